"""Starting a run's actors (cluster.placement.wait_started): an actor no node can hold ends
the start after run.start_timeout_s with what the cluster has, and a constructor that raises
ends it at once with its error, whatever else is still loading."""

from __future__ import annotations

import time

import pytest

from staleflow.cluster.placement import ActorStartError, wait_started

pytestmark = pytest.mark.integration


class Role:
    def __init__(self, seconds: float = 0.0, error: str | None = None) -> None:
        time.sleep(seconds)
        if error:
            raise ValueError(error)


def test_actors_that_start_are_waited_for(ray_actors):
    import ray

    actor = ray_actors(ray.remote(Role).options(num_cpus=0).remote(0.5))
    wait_started({"rollout workers": [actor]}, timeout_s=60)
    assert ray.get(actor.__ray_ready__.remote(), timeout=1)


def test_an_actor_no_node_can_hold_times_out_naming_what_the_cluster_has(ray_actors):
    import ray

    placed = ray_actors(ray.remote(Role).options(num_cpus=0).remote())
    # started before the wait (a worker process can take seconds to start on a busy machine)
    ray.get(placed.__ray_ready__.remote(), timeout=120)
    unplaceable = ray_actors(
        ray.remote(Role).options(num_cpus=0, resources={"no_such_node": 1}).remote()
    )
    started = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        wait_started({"learner ranks": [placed], "rollout workers": [unplaceable]}, timeout_s=2)
    assert time.monotonic() - started >= 2  # it waited the limit (a hang: the test's timeout)
    message = str(raised.value)
    assert message.startswith("1 of 1 rollout workers did not start within 2 s "
                              "(run.start_timeout_s); the cluster has {")  # fmt: skip
    assert "'CPU'" in message  # the cluster's resources, free and in all
    assert "learner ranks" not in message  # the one that started is not blamed


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_learner_group_no_node_can_place_times_out_and_is_removed(ray_local, ranks):
    # One rank waits for its group itself (no task runs; a Ctrl-C still interrupts the wait),
    # several ranks for the task that finds where they meet: either way the limit ends it,
    # naming the setting and what the cluster has, and the group is not left holding room.
    from ray.util.placement_group import placement_group_table

    from staleflow.cluster.placement import LearnerGroup, StartTimeout
    from staleflow.configs import parse_config
    from tests.integration.tiny import TINY

    cfg = parse_config(TINY, ["run.start_timeout_s=1.5", f"learner.num_ranks={ranks}",
                              'learner.resources={"no_such_node": 1}'])  # fmt: skip
    started = time.monotonic()
    with pytest.raises(StartTimeout) as raised:
        LearnerGroup(cfg, run_id=f"unplaced-{ranks}")
    assert time.monotonic() - started >= 1.5  # the whole limit, not its whole seconds
    message = str(raised.value)
    assert message.startswith(f"the learner's {ranks} rank(s) (bundles ")
    assert "were not placed within 1.5 s (run.start_timeout_s); the cluster has {" in message
    groups = [g for g in placement_group_table().values()
              if g["name"] == f"staleflow-learner-unplaced-{ranks}"]  # fmt: skip
    assert groups
    assert all(g["state"] == "REMOVED" for g in groups), groups


def test_a_constructor_that_raises_ends_the_start_at_once(ray_actors):
    import ray

    slow = ray_actors(*(ray.remote(Role).options(num_cpus=0).remote(3600.0) for _ in range(2)))
    failing = ray_actors(ray.remote(Role).options(num_cpus=0).remote(0.2, "no model at /models/x"))
    with pytest.raises(ActorStartError, match=r"^one of the learner ranks failed to start: "
                       r"ValueError: no model at /models/x$"):  # fmt: skip
        wait_started({"rollout workers": slow, "learner ranks": [failing]}, timeout_s=300)
    # at once: waiting on the slow ones would have ended in a TimeoutError after 300 s


def ranks_only(cfg, ranks):
    """A LearnerGroup of these actors as its ranks: no placement group, no model."""
    import dataclasses

    from staleflow.cluster.placement import LearnerGroup

    fields = {f.name: f.default for f in dataclasses.fields(LearnerGroup) if f.init}
    group = object.__new__(LearnerGroup)
    group.__dict__.update(fields, cfg=cfg, ranks=ranks, while_waiting=lambda: None)
    return group


class Rank:
    """Stands in for a learner rank: a call that fails at once, or one that takes a while
    (a peer still in a collective with the one that failed)."""

    def fail(self) -> None:
        raise RuntimeError("rank 1 failed")

    def busy(self, seconds: float) -> None:
        time.sleep(seconds)


def test_ranks_still_in_a_call_the_driver_gave_up_on_are_not_called_again(ray_actors):
    # A rank failing during a checkpoint or broadcast stops the wait at once, and a rank
    # that had not finished starting left its constructor running: the stop's checkpoint
    # and settle then queued behind the other ranks' calls (up to DeepSpeed's 10-minute
    # rendezvous, or the broadcast timeout), with every further Ctrl-C only logged.
    import ray

    from staleflow.cluster.failures import LearnerFailed
    from staleflow.configs import parse_config

    cfg = parse_config("model: {preset: tiny}\n")
    ranks = list(ray_actors(*(ray.remote(Rank).options(num_cpus=0).remote() for _ in range(2))))
    group = ranks_only(cfg, ranks)
    assert group.idle(0.1) == "the learner ranks had not all started"
    group.started = True
    assert group.idle(0.1) is None
    with pytest.raises(LearnerFailed, match="failed during a checkpoint: RuntimeError: rank 1"):
        group.on_ranks([ranks[0].busy.remote(3.0), ranks[1].fail.remote()], "a checkpoint")
    assert group.idle(0.1) == "the learner ranks were still in a checkpoint at the stop"
    assert group.idle(30) is None  # it returned: the ranks take calls again
    group.on_ranks([r.busy.remote(0) for r in ranks], "a publish")
    assert group.idle(0) is None


def test_a_broadcast_group_is_not_formed_with_a_worker_that_cannot_start(ray_actors):
    # A lost worker's replacement (or a scale-up) that no node can hold joined the group at
    # the next publish: learner rank 0 then waited sync.broadcast_timeout_s (900 s) for it
    # in its rendezvous, the run frozen, and the stop blamed the learner.
    import types

    import ray

    from staleflow.cluster.placement import StartTimeout, WorkerSlot
    from staleflow.cluster.weights import WeightSync
    from staleflow.configs import parse_config

    cfg = parse_config("model: {preset: tiny}\nsync: {method: gloo}\nrun: {start_timeout_s: 3}\n")
    started = ray_actors(ray.remote(Role).options(num_cpus=0).remote())
    ray.get(started.__ray_ready__.remote(), timeout=120)
    unplaceable = ray_actors(
        ray.remote(Role).options(num_cpus=0, resources={"no_such_node": 1}).remote()
    )
    slots = [WorkerSlot(0, started), WorkerSlot(1, unplaceable)]
    for slot in slots:
        slot.ready = slot.handle.__ray_ready__.remote()
    waited = []
    learner = types.SimpleNamespace(while_waiting=lambda: waited.append(1))  # no ranks: the
    sync = WeightSync(cfg, learner, types.SimpleNamespace(slots=slots))  # group never forms
    begun = time.monotonic()
    with pytest.raises(StartTimeout, match=r"rollout worker 1, added during the run, did not "
                       r"start within 3 s \(run.start_timeout_s\)"):  # fmt: skip
        sync.publish(1)
    assert time.monotonic() - begun >= 2  # counted from when it was added
    assert slots[0].ready is None  # the started one seen
    assert waited  # and the driver's checks (a dead Redis) ran meanwhile


class Member:
    """A broadcast group's member on gloo: learner rank 0 (sends) or an engine that fails
    its part of the broadcast while its process lives on (a CUDA OOM, an engine error)."""

    def open(self, port: int, rank: int, timeout_s: float) -> None:
        from staleflow.learner.sync_group import SyncGroup

        self.group = SyncGroup.open("gloo", "127.0.0.1", port, rank, 2, timeout_s)

    def send(self) -> None:
        import torch

        self.group.broadcast(torch.zeros(1024))

    def fail(self) -> None:
        raise RuntimeError("out of memory receiving the bucket")


def test_a_worker_failing_its_part_of_a_broadcast_does_not_hold_the_learner(ray_actors):
    # The worker's call failed at once, but learner rank 0 stayed in the collective until
    # sync.broadcast_timeout_s (900 s by default), and the stop's checkpoint waited behind
    # it. The failed worker is now killed: its connection closes and rank 0's call returns.
    import types

    import ray

    from staleflow.buffer.ports import free_port
    from staleflow.configs import parse_config

    timeout = 120.0
    rank0, engine = ray_actors(*(ray.remote(Member).options(num_cpus=0).remote() for _ in range(2)))
    port = free_port()
    ray.get([rank0.open.remote(port, 0, timeout), engine.open.remote(port, 1, timeout)])
    cfg = parse_config("model: {preset: tiny}\nsync: {method: gloo}\n")
    group = ranks_only(cfg, [rank0])
    group.started = True
    slot = types.SimpleNamespace(index=0, handle=engine)
    with pytest.raises(RuntimeError, match="rollout worker 0 failed during the weight broad"):
        group.on_ranks([rank0.send.remote()], "the weight broadcast of v1",
                       [(slot, engine.fail.remote())])  # fmt: skip
    assert group.idle(30) is None  # rank 0's call returned (with its error) long before 120 s
