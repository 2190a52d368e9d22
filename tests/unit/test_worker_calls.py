"""A rollout worker runs one call at a time, rollout parts and evaluations alike: what the
driver gives it, and when a call's hung clock (rollout.batch_timeout_s) starts, follow from
the order of its calls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from staleflow.cluster.placement import WorkerPool, WorkerSlot
from staleflow.configs import parse_config

ASYNC = (
    "model: {preset: tiny}\ntask: {name: digits, chat_template: false}\n"
    "rollout: {num_workers: 2, prompts_per_batch: 2, batch_timeout_s: 5}\n"
    "sync: {mode: async}\nbuffer: {max_staleness: 4}\nrun: {steps: 10}\n"
)


class _Pool(WorkerPool):
    """The real pool's bookkeeping without actors: `run_batch` and `evaluate` only queue a
    named call on the slot, as the real ones queue a call on its actor."""

    def __init__(self, n: int):
        super().__init__(parse_config(ASYNC), "run", "redis://localhost:6379/0")
        self.slots = [WorkerSlot(i, f"worker {i}") for i in range(n)]
        self.removed, self.names = [], iter(f"call {i}" for i in range(100))

    def run_batch(self, slot, weights, prompts, ids=None):
        return slot.call(next(self.names))

    def evaluate(self, slot, weights, n_prompts):
        return self.run_batch(slot, weights, [])

    def remove(self, slot):
        self.removed.append(slot.index)
        self.slots.remove(slot)

    def replace(self, slot):  # (the real one kills it and starts an actor)
        self.slots.remove(slot)
        new = WorkerSlot(len(self.slots) + len(self.removed) + 10, f"new worker for {slot.index}")
        self.slots.append(new)
        return new


def _async_driver(pool, overrides=()):
    """A Driver with what `_tick` reads in async mode; `rollouts.start` records which workers
    each batch went to."""
    from staleflow.cluster.driver import Driver
    from staleflow.cluster.schedule import Flow, Schedule

    cfg = parse_config(ASYNC, list(overrides))
    driver = Driver.__new__(Driver)
    driver.cfg, driver.redo, driver._publish_when_idle = cfg, [], False
    driver.learning = ("a learner step in flight",)  # (what it does is not these tests')
    driver.P = cfg.rollout.prompts_per_batch
    driver.schedule = Schedule(cfg)
    driver.flow = Flow(published={0}, latest=0)
    driver.services = SimpleNamespace(pool=pool, sync=SimpleNamespace(broadcasts=False))
    driver.published = {0: SimpleNamespace(version=0)}
    driver.prompts = SimpleNamespace(take=lambda n: ["p"] * n)
    driver.timeline = SimpleNamespace(gap_s=0.0, last=0.0)
    given = []

    def start(slots, batch, weights, prompts, since):
        given.append((batch, [s.index for s in slots]))
        for slot in slots:
            slot.queue.append(f"batch {batch}")
        return 0.0

    driver.rollouts = SimpleNamespace(start=start)
    return driver, given


def test_an_async_batch_waits_for_a_worker_with_no_evaluation_in_flight():
    # A worker running an evaluation counted as idle: a batch given to it waited behind the
    # evaluation (and its version got older meanwhile) while the run went on without it.
    pool = _Pool(2)
    a = pool.slots[0]
    a.queue.append("an evaluation")
    driver, given = _async_driver(pool)
    driver._tick()
    assert given == [(1, [1])]  # b only; a's evaluation is still running
    assert pool.idle() == []
    pool.ended(a, "an evaluation")
    assert pool.idle() == [a]
    driver._tick()
    assert given == [(1, [1]), (2, [0])]  # a, once its evaluation ended


def test_an_async_run_whose_workers_all_evaluate_waits_instead_of_stalling():
    # Nothing running and fewer groups than a step needs, and no batch started, read as a
    # stalled schedule; with every worker in an evaluation, no batch was refused: the run
    # waits for one to end. A real stall: 3 groups stored (one was dropped), a step needs
    # 4, and a batch of 2 more does not fit in the buffer's 4.
    from staleflow.cluster.driver import BatchStalled

    overrides = ["learner.groups_per_step=4", "buffer.capacity=4"]
    pool = _Pool(2)
    for slot in pool.slots:
        slot.queue.append("an evaluation")
    driver, given = _async_driver(pool, overrides)
    driver.flow.pushed = 3
    driver._tick()  # waits
    pool.ended(pool.slots[1], "an evaluation")
    with pytest.raises(BatchStalled, match=r"holds 3 of the 4 groups a step needs"):
        driver._tick()  # a worker is free and the schedule refuses its batch
    assert given == []


@pytest.fixture
def clock(monkeypatch):
    """A fake monotonic clock for the pool's and the rollouts' bookkeeping; `ray.kill` records
    the handles it is given, and no call is done (`ray.wait`) unless the test says so."""
    import ray

    import staleflow.cluster.placement as placement_module
    import staleflow.cluster.rollouts as rollouts_module

    now = SimpleNamespace(t=0.0, killed=[], done=set())
    fake = SimpleNamespace(monotonic=lambda: now.t)
    monkeypatch.setattr(rollouts_module, "time", fake)
    monkeypatch.setattr(placement_module, "time", fake)
    monkeypatch.setattr(ray, "kill", lambda handle: now.killed.append(handle))
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: ([r for r in refs if r in now.done], []))
    monkeypatch.setattr(ray, "get", lambda ref: SimpleNamespace(policy_version=0, accuracy=1.0))
    return now


def test_a_part_queued_behind_an_evaluation_starts_its_hung_clock_when_that_ends(clock):
    # Its rollout.batch_timeout_s counted from its dispatch, so a long evaluation ahead of
    # it on the same worker got a healthy worker killed as hung.
    from staleflow.cluster.evaluations import Evaluations
    from staleflow.cluster.rollouts import Rollouts

    pool = _Pool(1)
    [worker] = pool.slots
    rollouts = Rollouts(parse_config(ASYNC), pool, False, "resume", lambda error, batch: None)
    evaluations = Evaluations(pool, 2)
    evaluations.start(0, SimpleNamespace(version=0))
    rollouts.start([worker], 1, SimpleNamespace(version=0), ["p1", "p2"])
    [part] = rollouts.shards
    clock.t = 4.0  # the evaluation takes a minute, the batch timeout is 5 s
    assert evaluations.check_hung(5, clock.t) == []
    clock.t = 60.0
    [ref] = evaluations.refs
    clock.done.add(ref)  # done, not yet handled: neither it nor the part behind is hung
    assert evaluations.check_hung(5, clock.t) == []
    rollouts.check_hung()
    assert clock.killed == []
    assert evaluations.finished(ref, {0: "weights"})[0] == 0  # (its report: accuracy 1.0)
    assert worker.queue == [part]
    clock.t = 64.0
    rollouts.check_hung()
    assert clock.killed == []
    clock.t = 66.0  # 6 s since the evaluation ended: now the part is hung
    rollouts.check_hung()
    assert clock.killed == ["worker 0"]
    assert rollouts.shards[part].hung


@pytest.mark.parametrize("behind", [False, True])
def test_an_evaluation_that_never_ends_has_its_worker_killed(clock, monkeypatch, behind):
    # Evaluations were bounded only inside a broadcast's wait, and before that only by a
    # part queued behind one on its worker. An async batch never queues behind one, and a
    # lock-step part behind one does not run its clock: the worker was lost without a word
    # (async), or the run hung (lock-step). The evaluation's own clock now bounds it; a
    # part queued behind it is not the one blamed.
    from staleflow.cluster.evaluations import Evaluations
    from staleflow.cluster.rollouts import Rollouts

    pool = _Pool(2)
    a, b = pool.slots
    rollouts = Rollouts(parse_config(ASYNC), pool, False, "resume", lambda error, batch: None)
    evaluations = Evaluations(pool, 2)
    evaluations.start(0, SimpleNamespace(version=0))
    [ref] = evaluations.refs
    if behind:  # a lock-step batch over both workers: a's part waits behind the evaluation
        rollouts.start([a, b], 1, SimpleNamespace(version=0), ["p1", "p2"])
        [(mine, _)] = [(r, s) for r, s in rollouts.shards.items() if s.slot is b]
        clock.done.add(mine)
        rollouts.finished(mine)
    clock.t = 5.0  # not past the 5 s bound yet
    assert evaluations.check_hung(5, clock.t) == []
    clock.t = 5.5
    assert evaluations.check_hung(5, clock.t) == [a]
    assert clock.killed == ["worker 0"]
    assert evaluations.check_hung(5, 9.0) == []  # killed once
    rollouts.check_hung()
    assert clock.killed == ["worker 0"]  # the part behind it was not running: not its bound
    # its call fails (the worker was killed): retried on the other worker
    import ray
    import ray.exceptions

    def died(ref):
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(ray, "get", died)
    assert evaluations.finished(ref, {0: SimpleNamespace(version=0)}) == (0, None)
    assert [slot for _, _, slot in evaluations.running] == [b]


def test_the_driver_replaces_a_broadcast_member_whose_evaluation_hung(clock, monkeypatch):
    # With a broadcast sync a killed member is forgotten at once and replaced at the next
    # publish (the broadcast would include it otherwise); the evaluation's retry goes to a
    # live member.
    import staleflow.cluster.driver as driver_module
    from staleflow.cluster.driver import Driver
    from staleflow.cluster.evaluations import Evaluations

    monkeypatch.setattr(driver_module, "time", SimpleNamespace(monotonic=lambda: clock.t))
    pool = _Pool(2)
    a, b = pool.slots
    pool.drop = lambda slot: pool.slots.remove(slot)
    driver = Driver.__new__(Driver)
    driver.cfg = parse_config(ASYNC)
    driver.schedule = SimpleNamespace(lockstep=False)
    driver._deferred_workers = None
    driver.services = SimpleNamespace(pool=pool, sync=SimpleNamespace(broadcasts=True))
    driver.evaluations = Evaluations(pool, 2)
    driver.evaluations.start(0, SimpleNamespace(version=0))
    clock.t = 4.0
    driver._check_evaluations_hung()
    assert pool.slots == [a, b]
    clock.t = 6.0
    driver._check_evaluations_hung()
    assert clock.killed == ["worker 0"]
    assert pool.slots == [b]
    assert driver._deferred_workers == 2  # b and a new worker from the next publish


def test_an_evaluation_goes_to_a_worker_with_nothing_in_flight():
    # It went to the first live worker, busy or not, and a batch waited behind it.
    from staleflow.cluster.evaluations import Evaluations

    pool = _Pool(3)
    a, b, c = pool.slots
    a.queue.append("a batch")
    evaluations = Evaluations(pool, 2)
    evaluations.start(0, "v0")
    assert [slot for _, _, slot in evaluations.running] == [b]
    evaluations.start(1, "v1", avoid=c)  # a retry avoids the worker that failed it
    assert [slot for _, _, slot in evaluations.running] == [b, a]  # a and b: one call each
    evaluations.start(2, "v2")
    assert evaluations.running[-1][2] is c


def test_a_retiring_worker_goes_when_its_last_call_ends_an_evaluation_too():
    # It was removed (killed) at once if it had no batch in flight, its evaluation with it
    # (retried elsewhere), or stayed forever if its evaluation was queued behind its batch.
    pool = _Pool(2)
    a, b = pool.slots
    b.queue += ["a batch", "an evaluation"]
    b.retiring = True
    pool.ended(b, "a batch")
    assert pool.slots == [a, b]  # its evaluation still runs
    pool.ended(b, "an evaluation")
    assert pool.slots == [a]
    assert pool.removed == [1]


@pytest.mark.parametrize("behind", [False, True])
def test_the_driver_replaces_a_worker_whose_evaluation_hung_at_once_unless_a_part_waits(
    clock, monkeypatch, behind
):
    # Without a broadcast sync, a worker killed in an evaluation stayed in the pool, dead:
    # with one worker, the evaluation's retry went to it and was skipped, and the next batch
    # failed there before it was replaced. It is replaced at once, and the retry runs on the
    # new worker. A part queued behind the evaluation fails with the worker and its redo
    # replaces it (Rollouts._failed): replacing it here too would start two workers.
    import ray
    import ray.exceptions

    import staleflow.cluster.driver as driver_module
    from staleflow.cluster.driver import Driver
    from staleflow.cluster.evaluations import Evaluations

    monkeypatch.setattr(driver_module, "time", SimpleNamespace(monotonic=lambda: clock.t))
    pool = _Pool(1)
    [a] = pool.slots
    driver = Driver.__new__(Driver)
    driver.cfg = parse_config(ASYNC)
    driver.services = SimpleNamespace(pool=pool, sync=SimpleNamespace(broadcasts=False))
    driver.evaluations = Evaluations(pool, 2)
    driver.evaluations.start(0, SimpleNamespace(version=0))
    [ref] = driver.evaluations.refs
    if behind:
        a.call("a lock-step part")
    clock.t = 6.0
    driver._check_evaluations_hung()
    assert clock.killed == ["worker 0"]
    if behind:
        assert pool.slots == [a]  # replaced when its part fails
        return
    [new] = pool.slots
    assert new is not a

    def died(ref):
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(ray, "get", died)
    assert driver.evaluations.finished(ref, {0: SimpleNamespace(version=0)}) == (0, None)
    assert [slot for _, _, slot in driver.evaluations.running] == [new]  # the retry
