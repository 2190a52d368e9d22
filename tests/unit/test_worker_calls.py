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

    def drop(self, slot):  # (the real one also kills it; `replace` is the real one)
        if slot in self.slots:
            self.slots.remove(slot)

    def add(self):  # (the real one starts an actor)
        self.slots.append(WorkerSlot(len(self.slots) + len(self.removed) + 10, "a new worker"))
        return self.slots[-1]


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

    driver.rollouts = SimpleNamespace(start=start, resume_hint="staleflow train --resume R")
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
    # every worker lost (broadcast methods: in evaluations; new ones join at the next
    # publish): no batch was refused either
    pool.slots = []
    driver._tick()
    assert given == []


def test_lockstep_with_every_worker_lost_publishes_for_new_ones_or_says_it_cannot_go_on():
    # Broadcast methods: a worker lost in an evaluation is replaced at the next publish, and
    # a lock-step publish waits for the batch that needs workers: the batch was split over
    # no worker at all (numpy: "number sections must be larger than 0").
    pool = _Pool(0)
    driver, given = _async_driver(pool)
    driver.schedule = SimpleNamespace(lockstep=True, next_batch=lambda flow: 0,
                                      may_step=lambda flow: False)  # fmt: skip
    driver._deferred_workers = 2
    driver.services.sync.broadcasts = True
    published = []

    def publish():  # (the real one scales to the workers deferred, then broadcasts)
        published.append(driver.step)
        driver.published[driver.step] = SimpleNamespace(version=driver.step)
        pool.slots = [WorkerSlot(7, "new 7"), WorkerSlot(8, "new 8")]

    driver._publish = publish
    driver._tick()  # a learner call is in flight: waits for it
    assert (published, given) == ([], [])
    driver.learning = None
    driver._tick()  # the learner holds v0, the version batch 1 needs: they join now
    assert published == [0]
    assert given == [(1, [7, 8])]
    pool.slots, driver.flow.steps = [], 3
    driver.schedule.next_batch = lambda flow: 2  # (lock-step with a lag: older weights)
    with pytest.raises(
        RuntimeError,
        match=r"every rollout worker was lost, and the next batch "
        r"needs weights v2: .* \(v3, newer\).* resume it: staleflow train --resume R",
    ):
        driver._tick()  # fmt: skip
    assert published == [0]
    # the same for a batch a resume redoes (it keeps its checkpointed version, v3 here)
    pool.slots, driver.redo = [], [5]
    driver.flow.running.clear()  # (batch 1 above: done)
    driver.resumed = SimpleNamespace(versions={5: 3}, prompts_of=lambda batch: ["p"] * 2)
    driver._tick()
    assert published == [0, 3]
    assert given[-1] == (5, [7, 8])


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
    monkeypatch.setattr(ray, "get", lambda ref: now.reports.get(ref, _REPORT))
    now.reports = {}  # a call's report, if not _REPORT
    return now


# what a part or an evaluation reports, unless a test says otherwise (`clock.reports`)
_REPORT = SimpleNamespace(policy_version=0, accuracy=1.0, reward_errors=0, responses=8,
                          first_reward_error=None)  # fmt: skip


@pytest.mark.parametrize(("errors", "stops"), [((2, 2), False), ((3, 2), True), ((0, 5), True)])
def test_the_reward_error_limit_is_the_whole_batchs_whatever_its_parts(clock, errors, stops):
    # Each worker judged only its own part: with a limit of 0.25 and a batch of 16 responses
    # in two parts of 8, 5 failures split 3 + 2 went on (3/8, 2/8), split 0 + 5 stopped the
    # run (5/8), and in one part of 16 went on: whether a run stopped depended on how the
    # batch was split. Now the parts add up: 2 + 2 = 4 <= 0.25 * 16 goes on; 3 + 2 and
    # 0 + 5 stop, once the batch's last part is in.
    from staleflow.actors.worker import RewardError
    from staleflow.cluster.rollouts import Rollouts

    pool = _Pool(2)
    cfg = parse_config(ASYNC, ["task.max_reward_errors=0.25"])
    rollouts = Rollouts(cfg, pool, False, "resume", lambda error, batch: None)
    rollouts.start(pool.slots, 1, SimpleNamespace(version=0), ["p1", "p2"])
    first, last = rollouts.shards
    for ref, n in zip((first, last), errors, strict=True):
        clock.reports[ref] = SimpleNamespace(
            policy_version=0, reward_errors=n, responses=8,
            first_reward_error=f"prompt {ref}: KeyError" if n else None,
        )  # fmt: skip
    assert rollouts.finished(first)[2] is False  # the batch is not complete: no verdict yet
    if not stops:
        assert rollouts.finished(last)[2] is True
        return
    which = "call 0" if errors[0] else "call 1"
    with pytest.raises(RewardError, match=rf"(?s)batch 1: the reward function failed for "
                       rf"5 of 16 responses \(task.*prompt {which}: KeyError"):  # fmt: skip
        rollouts.finished(last)


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
    evaluations.check_hung(5, clock.t)
    clock.t = 60.0
    [ref] = evaluations.refs
    clock.done.add(ref)  # done, not yet handled: neither it nor the part behind is hung
    evaluations.check_hung(5, clock.t)
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
    evaluations.check_hung(5, clock.t)
    assert clock.killed == []
    clock.t = 5.5
    evaluations.check_hung(5, clock.t)
    assert clock.killed == ["worker 0"]
    evaluations.check_hung(5, 9.0)
    assert clock.killed == ["worker 0"]  # killed once
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


def _driver_with(pool, broadcasts):
    """A Driver with what a worker lost in an evaluation involves: `evaluations` tells it of
    the loss (on_lost), `rollouts` redoes a part that was queued on the worker."""
    from staleflow.cluster.driver import Driver
    from staleflow.cluster.evaluations import Evaluations
    from staleflow.cluster.rollouts import Rollouts

    driver = Driver.__new__(Driver)
    driver.cfg = parse_config(ASYNC)
    driver.schedule = SimpleNamespace(lockstep=False)
    driver._deferred_workers = None
    driver.services = SimpleNamespace(pool=pool, sync=SimpleNamespace(broadcasts=broadcasts))
    driver.rollouts = Rollouts(driver.cfg, pool, broadcasts, "resume", lambda error, b: None)
    driver.evaluations = Evaluations(pool, 2, on_lost=driver._worker_lost_in_evaluation)
    return driver


def _died(ref):
    import ray.exceptions

    raise ray.exceptions.ActorDiedError()


def test_a_broadcast_member_killed_in_an_evaluation_is_forgotten_and_replaced_at_a_publish(
    clock, monkeypatch
):
    # Its slot stayed in the pool: the next broadcast included the dead member and the run
    # stopped. It is forgotten before the evaluation's retry is placed (on the live member),
    # and a new worker joins at the next publish.
    import ray

    pool = _Pool(2)
    a, b = pool.slots
    driver = _driver_with(pool, broadcasts=True)
    driver.evaluations.start(0, SimpleNamespace(version=0))
    [ref] = driver.evaluations.refs
    driver.evaluations.check_hung(5, 6.0)
    assert clock.killed == ["worker 0"]
    monkeypatch.setattr(ray, "get", _died)
    assert driver.evaluations.finished(ref, {0: SimpleNamespace(version=0)}) == (0, None)
    assert pool.slots == [b]
    assert driver._deferred_workers == 2  # b and a new worker from the next publish
    assert [slot for _, _, slot in driver.evaluations.running] == [b]  # the retry
    driver._worker_lost_in_evaluation(a)  # told again (another call on it failing)
    assert driver._deferred_workers == 2  # still one replacement


@pytest.mark.parametrize("behind", [False, True])
def test_a_worker_killed_in_an_evaluation_is_replaced_before_its_retry_and_only_once(
    clock, monkeypatch, behind
):
    # Without a broadcast sync, a worker that died in an evaluation (or was killed as hung)
    # stayed in the pool, dead: with one worker, the evaluation's retry went to it and was
    # skipped, and the next batch failed there before it was replaced. It is replaced before
    # the retry is placed. A part queued behind the evaluation fails with the worker and is
    # redone on the new one: replacing it once more would start a second worker.
    import ray

    pool = _Pool(1)
    [a] = pool.slots
    driver = _driver_with(pool, broadcasts=False)
    driver.evaluations.start(0, SimpleNamespace(version=0))
    [ref] = driver.evaluations.refs
    if behind:  # a lock-step part
        driver.rollouts.start([a], 1, SimpleNamespace(version=0), ["p1", "p2"])
    driver.evaluations.check_hung(5, 6.0)
    assert clock.killed == ["worker 0"]
    monkeypatch.setattr(ray, "get", _died)
    assert driver.evaluations.finished(ref, {0: SimpleNamespace(version=0)}) == (0, None)
    [new] = pool.slots
    assert new is not a
    assert [slot for _, _, slot in driver.evaluations.running] == [new]  # the retry
    if behind:
        [part] = driver.rollouts.shards
        assert driver.rollouts.finished(part) is None  # failed with its worker: redone
        assert pool.slots == [new]
        [(_, redone)] = driver.rollouts.shards.items()
        assert redone.slot is new
        assert redone.attempts == 2


def test_a_worker_killed_as_hung_is_replaced_even_if_its_evaluation_ended_just_before(
    clock, monkeypatch
):
    # Between the hung check's look (not done) and the kill, the evaluation ended: its report
    # came back fine, and the killed worker stayed in the pool (a broadcast would then include
    # the dead member and stop the run).
    pool = _Pool(2)
    a, _ = pool.slots
    driver = _driver_with(pool, broadcasts=False)
    driver.evaluations.start(0, SimpleNamespace(version=0))
    [ref] = driver.evaluations.refs
    driver.evaluations.check_hung(5, 6.0)
    assert clock.killed == ["worker 0"]
    step, report = driver.evaluations.finished(ref, {0: SimpleNamespace(version=0)})
    assert (step, report.accuracy) == (0, 1.0)  # recorded
    assert a not in pool.slots
    assert len(pool.slots) == 2


def test_whichever_failure_comes_first_a_dead_worker_is_replaced_once(clock, monkeypatch):
    # Non-broadcast, one worker killed in an evaluation with two lock-step parts queued
    # behind it (batches 1 and 2): handled in the order part, evaluation, part. The first
    # part's redo replaces it; the evaluation's retry and the second part go to the new
    # worker; no second one starts (each part's redo used to start one).
    import ray

    pool = _Pool(1)
    [a] = pool.slots
    driver = _driver_with(pool, broadcasts=False)
    driver.evaluations.start(0, SimpleNamespace(version=0))
    [ref] = driver.evaluations.refs
    driver.rollouts.start([a], 1, SimpleNamespace(version=0), ["p1"])
    driver.rollouts.start([a], 2, SimpleNamespace(version=0), ["p2"])
    first, second = driver.rollouts.shards
    driver.evaluations.check_hung(5, 6.0)
    monkeypatch.setattr(ray, "get", _died)
    assert driver.rollouts.finished(first) is None
    [new] = pool.slots
    assert driver.evaluations.finished(ref, {0: SimpleNamespace(version=0)}) == (0, None)
    assert driver.rollouts.finished(second) is None
    assert pool.slots == [new]
    assert [s.slot for s in driver.rollouts.shards.values()] == [new, new]
    assert [slot for _, _, slot in driver.evaluations.running] == [new]


@pytest.mark.parametrize("broadcasts", [False, True])
def test_a_retiring_worker_lost_in_an_evaluation_is_not_replaced(clock, monkeypatch, broadcasts):
    # It was going anyway (here still holding a part queued behind the evaluation): a new
    # worker for it would grow the pool past the count asked for.
    import ray

    pool = _Pool(2)
    a, b = pool.slots
    b.retiring = True
    driver = _driver_with(pool, broadcasts=broadcasts)
    driver.evaluations.running.append((b.call("an evaluation"), 0, b))
    driver.rollouts.start([b], 1, SimpleNamespace(version=0), ["p1"])
    driver.evaluations.check_hung(5, 6.0)
    assert clock.killed == ["worker 1"]
    monkeypatch.setattr(ray, "get", _died)
    driver.evaluations.finished("an evaluation", {0: SimpleNamespace(version=0)})
    assert pool.slots == [a, b]  # not replaced (its part still to fail)
    assert [slot for _, _, slot in driver.evaluations.running] == [a]  # the retry
    [part] = driver.rollouts.shards
    assert driver.rollouts.finished(part) is None  # redone elsewhere
    assert [s.index for s in pool.active] == [0]  # still one active worker
    assert driver._deferred_workers is None


@pytest.mark.parametrize("broadcasts", [False, True])
def test_a_worker_killed_as_its_part_ended_is_replaced(clock, broadcasts):
    # The hung check saw the part running and killed the worker, which had just finished
    # it: the part came back fine and the dead worker stayed in the pool (its next call
    # failed; under a broadcast method the next publish included the dead member).
    from staleflow.cluster.rollouts import Rollouts

    pool = _Pool(2)
    a, b = pool.slots
    lost = []
    rollouts = Rollouts(parse_config(ASYNC), pool, broadcasts, "resume",
                        lambda error, batch: None, lambda: lost.append(True))  # fmt: skip
    rollouts.start([a], 1, SimpleNamespace(version=0), ["p1", "p2"])
    [part] = rollouts.shards
    clock.t = 6.0
    rollouts.check_hung()
    assert clock.killed == ["worker 0"]
    _shard, _report, complete = rollouts.finished(part)  # its report came back all the same
    assert complete
    assert a not in pool.slots
    if broadcasts:
        assert (pool.slots, lost) == ([b], [True])  # a new one joins at the next publish
    else:
        assert len(pool.slots) == 2
        assert lost == []


@pytest.mark.parametrize("broadcasts", [False, True])
def test_a_worker_lost_while_draining_is_not_replaced(clock, monkeypatch, broadcasts):
    # At the stop, a worker that died in an evaluation got a new worker (an engine started)
    # that the stop killed at once. A broadcast member must still leave the pool: a publish
    # in the drain (the step in flight) would otherwise broadcast to it and fail the stop.
    import ray

    pool = _Pool(2)
    a, b = pool.slots
    driver = _driver_with(pool, broadcasts=broadcasts)
    driver._draining = True
    driver.evaluations.start(0, SimpleNamespace(version=0))
    [ref] = driver.evaluations.refs
    monkeypatch.setattr(ray, "get", _died)
    driver.evaluations.finished(ref, {0: SimpleNamespace(version=0)})
    assert pool.slots == ([b] if broadcasts else [a, b])  # (the stop kills every worker)
    assert driver._deferred_workers is None  # no replacement due
