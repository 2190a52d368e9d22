"""The rollout worker pool on a real local Ray: scaling back up keeps workers that are still
finishing their last batch before retiring, instead of starting new engines next to them
(under sync.method ipc they still hold their room in learner rank 0's bundle)."""

from __future__ import annotations

import pytest
import ray

from staleflow.cluster.placement import WorkerPool, wait_started
from staleflow.configs import parse_config

from .tiny import TINY

pytestmark = pytest.mark.integration


def test_scaling_back_up_keeps_retiring_workers_before_starting_new_ones(ray_local, redis_url):
    pool = WorkerPool(parse_config(TINY), "pool", redis_url)
    try:
        for _ in range(2):
            pool.add()
        wait_started({"rollout workers": [s.handle for s in pool.slots]}, 300)
        first, second = pool.slots
        second.queue = ["a batch"]  # a call in flight (what run_batch queues; none is started)

        pool.scale(1)  # the busy worker retires when its batch ends, the idle one stays
        assert pool.slots == [first, second]
        assert second.retiring
        assert pool.active == [first]

        pool.scale(2)  # back up: the retiring worker stays, no new engine starts
        assert pool.slots == [first, second]
        assert not second.retiring
        assert pool._next_index == 2

        pool.scale(1)
        pool.scale(3)  # one kept, one new
        assert [s.index for s in pool.active] == [0, 1, 2]
        assert pool._next_index == 3

        second.queue = ["an evaluation"]
        pool.scale(1)  # idle workers go at once, a busy one when its last call ends
        assert [s.index for s in pool.slots] == [0, 1]
        pool.ended(second, "an evaluation")
        assert [s.index for s in pool.slots] == [0]
    finally:
        for slot in list(pool.slots):
            pool.remove(slot)


def test_a_part_lost_under_a_broadcast_method_is_queued_on_a_member_holding_its_version(
    ray_local, redis_url
):
    # sync.method gloo/nccl: a new engine gets weights only at a publish, so a lost worker's
    # part is redone on a live member of the broadcast group, queued behind that member's own
    # part. Its timeout clock starts when the part ahead of it ends, the member stays busy
    # until both are back, and the lost worker is reported for replacement (`on_lost`).
    import itertools
    import time
    from types import SimpleNamespace

    from staleflow.actors.tasks import make_task
    from staleflow.cluster.rollouts import Rollouts

    cfg = parse_config(TINY)
    pool = WorkerPool(cfg, "lost", redis_url)
    faults, lost = [], []
    rollouts = Rollouts(cfg, pool, True, "staleflow train --resume R",
                        lambda error, batch: faults.append((error, batch)),
                        lambda: lost.append(True))  # fmt: skip
    try:
        for _ in range(2):
            pool.add()
        wait_started({"rollout workers": [s.handle for s in pool.slots]}, 300)
        first, second = pool.slots
        weights = SimpleNamespace(version=0)  # the initial weights every engine starts with
        prompts = list(itertools.islice(make_task(cfg.task).train_prompts(), 4))
        rollouts.start([first, second], 1, weights, prompts)
        refs = {shard.slot.index: ref for ref, shard in rollouts.shards.items()}
        ray.kill(first.handle)
        ray.wait([refs[0]], timeout=60)
        assert rollouts.finished(refs[0]) is None  # redone, not raised
        assert first not in pool.slots
        assert lost == [True]
        assert faults
        assert faults[0][0].startswith("failed: ActorDiedError")
        assert faults[0][1] == 1
        [(redo_ref, redo)] = [(r, s) for r, s in rollouts.shards.items() if s.attempts == 2]
        assert redo.slot is second
        assert redo.prompts == prompts[:2]
        assert second.queue == [refs[1], redo_ref]  # behind the member's own part
        assert second.running_for(redo_ref, time.monotonic()) == 0  # its clock not running

        before = time.monotonic()
        shard, _report, complete = rollouts.finished(refs[1])  # the member's own part
        assert shard.slot is second
        assert not complete
        assert second.queue == [redo_ref]
        assert second.head_since >= before  # the redone part's clock runs from its end
        assert pool.idle() == []  # still busy with the redone part
        shard, report, complete = rollouts.finished(redo_ref)
        assert complete
        assert report.policy_version == 0
        assert report.groups == 2
        assert pool.idle() == [second]
        assert second.queue == []

        # the last member lost: nothing holds v0, so the run must stop with the resume command
        rollouts.start([second], 2, weights, prompts[:2])
        [ref] = list(rollouts.shards)
        ray.kill(second.handle)
        ray.wait([ref], timeout=60)
        with pytest.raises(RuntimeError, match=r"no other worker holds v0.*resume it: staleflow"):
            rollouts.finished(ref)
    finally:
        for slot in list(pool.slots):
            pool.drop(slot)


def test_a_replacement_worker_no_node_has_room_for_stops_the_run_after_start_timeout_s(
    ray_local, redis_url
):
    # A worker lost with its node: its replacement fits nowhere and waits for resources. Its
    # part waited for rollout.batch_timeout_s (30 min) and was redone on another replacement
    # that could not start either, rollout.max_restarts times: about 2 hours, then the error.
    # Now the run stops after run.start_timeout_s, saying what the cluster has free.
    import itertools
    import time
    from types import SimpleNamespace

    from staleflow.actors.tasks import make_task
    from staleflow.actors.worker import RolloutWorker
    from staleflow.cluster.placement import StartTimeout
    from staleflow.cluster.rollouts import Rollouts
    from tests.integration.test_system import wait_for

    cfg = parse_config(TINY, ["run.start_timeout_s=2", "rollout.num_workers=1"])
    pool = WorkerPool(cfg, "unplaced", redis_url)
    faults = []
    rollouts = Rollouts(cfg, pool, False, "staleflow train --resume R",
                        lambda error, batch: faults.append((error, batch)))  # fmt: skip
    try:
        first = pool.add()
        wait_started({"rollout workers": [first.handle]}, 300)
        weights = SimpleNamespace(version=0)  # the initial weights every engine starts with
        prompts = list(itertools.islice(make_task(cfg.task).train_prompts(), 2))
        ray.wait([first.ready], timeout=60)  # its constructor's reply is here
        rollouts.start([first], 1, weights, prompts)
        [ref] = list(rollouts.shards)
        ray.wait([ref], timeout=60)
        rollouts.check_started()  # a worker that started passes (and is not asked again)
        assert first.ready is None
        assert rollouts.finished(ref)[2]  # batch 1 done on it
        # the failures injected: the worker dies (as with its node), and from now on a new
        # worker asks for a resource no node has
        ray.kill(first.handle)

        def dead() -> bool:
            try:
                ray.get(first.handle.__ray_ready__.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                return True
            return False

        wait_for(dead, 60, "Ray to report the killed worker dead", poll_s=0.1)  # (asynchronous)
        pool._actor = ray.remote(RolloutWorker).options(
            num_cpus=cfg.rollout.cpus_per_worker, resources={"staleflow-test-lost-node": 1}
        )
        rollouts.start([first], 2, weights, prompts)  # a call to the dead worker fails
        [ref] = list(rollouts.shards)
        ray.wait([ref], timeout=60)
        assert rollouts.finished(ref) is None  # replaced, the part queued on the new worker
        [shard] = rollouts.shards.values()
        assert shard.slot is not first
        assert shard.slot.ready is not None
        rollouts.check_started()  # within the limit: still waiting
        time.sleep(2.5)
        with pytest.raises(StartTimeout) as stopped:
            rollouts.check_started()
        message = str(stopped.value)
        assert "rollout worker 1, started during the run for batch 2, did not start" in message
        assert "within 2 s (run.start_timeout_s)" in message
        assert "resume: staleflow train --resume R" in message
    finally:
        for slot in list(pool.slots):
            pool.drop(slot)
