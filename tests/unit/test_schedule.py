"""The lock-step schedule against the cases worked out in docs/algorithms.md section 6."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from staleflow.cluster.schedule import idle_workers_warning, lag, rollout_version
from staleflow.configs import parse_config


def lags(interval: int, offset: int, steps: int) -> list[int]:
    return [lag(t, interval, offset) for t in range(1, steps + 1)]


def test_strictly_on_policy():
    # I=1, O=0: every batch uses the weights of the step before it -> lag 0
    assert lags(1, 0, 6) == [0, 0, 0, 0, 0, 0]


def test_one_step_off_policy():
    # I=1, O=1: batch 1 from v0 (lag 0), then batch t from v(t-2) -> lag 1
    assert lags(1, 1, 6) == [0, 1, 1, 1, 1, 1]


def test_sync_interval_20_cycles_0_to_19():
    # I=20, O=0: v = 20 * floor((t-1)/20): steps 1..20 use v0 (lags 0..19), 21..40 use v20
    assert lags(20, 0, 45) == list(range(20)) + list(range(20)) + [0, 1, 2, 3, 4]


def test_sync_offset_10_is_a_constant_lag_of_10():
    # I=1, O=10: v = max(0, t - 11): lags 0..9 while rollout runs ahead, then 10 for good
    assert lags(1, 10, 15) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 10, 10, 10]


def test_interval_4_offset_1():
    # v(t) = 4 * max(0, floor((t - 2) / 4)): t=1..5 -> 0, t=6..9 -> 4, t=10.. -> 8
    assert [rollout_version(t, 4, 1) for t in range(1, 11)] == [0, 0, 0, 0, 0, 4, 4, 4, 4, 8]
    assert lags(4, 1, 10) == [0, 1, 2, 3, 4, 1, 2, 3, 4, 1]


def test_offline_when_the_offset_covers_the_run():
    # O >= total steps: every batch comes from the initial policy
    assert [rollout_version(t, 1, 100) for t in range(1, 51)] == [0] * 50
    assert lags(1, 100, 5) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("interval", [1, 4, 20])
@pytest.mark.parametrize("offset", [0, 1, 10])
def test_versions_only_grow_and_are_multiples_of_the_interval(interval, offset):
    versions = [rollout_version(t, interval, offset) for t in range(1, 100)]
    assert versions == sorted(versions)
    assert all(v % interval == 0 for v in versions)
    assert all(
        0 <= lag(t, interval, offset) <= max(interval - 1, 0) + offset for t in range(1, 100)
    )


@pytest.mark.parametrize("interval", [1, 4, 20])
@pytest.mark.parametrize("offset", [0, 1, 10, 100])
@pytest.mark.parametrize("capacity", [None, 2])
def test_the_lockstep_schedule_trains_every_step_at_the_formulas_lag(interval, offset, capacity):
    # The driver's lock-step loop on the real Schedule, without Ray: a batch starts as soon
    # as `next_batch` allows; then, in a seeded random order, the running batch finishes or
    # the learner trains batch t (once it is done) and publishes after each step that
    # `publishes_after` names, keeping only the versions Driver._published keeps. A step's
    # lag is the number of steps done before it less its batch's version. What can fail:
    # a batch handed another version than the formula's (the newest, say), a version
    # discarded while a batch still needs it, or a schedule that stalls. 45 steps wrap I=20
    # twice; O=100 is offline (every batch from v0). buffer.capacity=2 (one batch of 2
    # prompts) holds each batch back until the step before it is done, by when newer weights
    # than it needs may be published. The system test runs a subset of this grid through
    # Ray, the workers and the learner (and a resume's redone batches are its tests').
    import random

    from staleflow.cluster.resume import versions_in_use
    from staleflow.cluster.schedule import Flow, Schedule

    steps = 45
    cfg = parse_config(
        "model: {preset: tiny}\ntask: {name: digits, chat_template: false}\n"
        "rollout: {prompts_per_batch: 2}\n",
        ["sync.mode=lockstep", f"sync.interval={interval}", f"sync.offset={offset}",
         f"run.steps={steps}", *([f"buffer.capacity={capacity}"] if capacity else [])],
    )  # fmt: skip
    schedule, flow, rng = Schedule(cfg), Flow(published={0}, latest=0), random.Random(0)
    versions, got = {}, []
    while flow.steps < steps:
        if (v := schedule.next_batch(flow)) is not None:
            flow.batches += 1
            versions[flow.batches] = v
            flow.running[flow.batches] = (v, schedule.P)
        t = flow.steps + 1
        can_step = schedule.may_step(flow) and t not in flow.running
        assert flow.running or can_step, f"stalled at step {flow.steps}"
        if flow.running and not (can_step and rng.random() < 0.5):
            flow.running.clear()  # the batch finishes
            flow.batches_done += 1
            continue
        got.append(flow.steps - versions[t])
        flow.count_step(schedule.G, 0)
        if schedule.publishes_after(t):
            flow.published.add(t)
            flow.latest = t
            flow.published &= schedule.versions_needed(flow) | versions_in_use(schedule, flow)
    assert got == lags(interval, offset, steps)
    if offset >= steps:
        assert got == list(range(steps))  # offline: step t trains on v0, t - 1 behind


def test_bad_arguments():
    with pytest.raises(ValueError, match="numbered from 1"):
        rollout_version(0, 1, 0)
    with pytest.raises(ValueError, match="interval >= 1"):
        rollout_version(3, 0, 0)


@pytest.mark.parametrize("interval", [1, 3, 20])
@pytest.mark.parametrize("offset", [0, 2, 10, 60])
@pytest.mark.parametrize("steps", [1, 5, 25, 50])
def test_the_start_check_refuses_exactly_the_bounds_below_the_largest_lag(interval, offset, steps):
    # check_schedule looks at steps 1 .. O + I only: the largest lag over the whole run,
    # counted here step by step, must be the least max_staleness it accepts.
    from staleflow.cluster.schedule import ScheduleError, check_schedule

    worst = max(lags(interval, offset, steps))
    base = "model: {preset: tiny}\n"
    sync = [f"run.steps={steps}", f"sync.interval={interval}", f"sync.offset={offset}"]
    check_schedule(parse_config(base, [*sync, f"buffer.max_staleness={worst}"]))
    if worst:
        with pytest.raises(ScheduleError, match=f"largest lag \\({worst},"):
            check_schedule(parse_config(base, [*sync, f"buffer.max_staleness={worst - 1}"]))


def test_a_run_of_ten_million_steps_is_checked_without_walking_them(monkeypatch):
    # I=20, O=10: the largest lag is O + I - 1 = 29, reached at step 30. The check used to
    # evaluate lag() at every one of the 10M steps (seconds before `staleflow train` started
    # anything); it needs the first O + I = 30.
    from staleflow.cluster import schedule

    calls = []
    monkeypatch.setattr(schedule, "lag", lambda t, i, o: calls.append(t) or lag(t, i, o))
    cfg = parse_config(
        "model: {preset: tiny}\n",
        ["run.steps=10000000", "sync.interval=20", "sync.offset=10", "buffer.max_staleness=28"],
    )
    with pytest.raises(schedule.ScheduleError, match="largest lag \\(29,"):
        schedule.check_schedule(cfg)
    assert calls == list(range(1, 31))


def test_lockstep_workers_beyond_a_batch_are_said_to_stay_idle():
    lockstep = parse_config("model: {preset: tiny}\nrollout: {prompts_per_batch: 4}\n")
    # each lock-step batch of 4 prompts is split over the workers: 10 - 4 = 6 get none
    assert "6 will stay idle" in idle_workers_warning(lockstep, 10)
    assert idle_workers_warning(lockstep, 4) is None
    # async gives each idle worker a batch of its own
    async_cfg = parse_config(
        "model: {preset: tiny}\nrollout: {prompts_per_batch: 4}\nsync: {mode: async}\n"
    )
    assert idle_workers_warning(async_cfg, 10) is None


def checkpointing_driver(cfg, flow, saved: list[int]):
    """What CheckpointMixin._write_checkpoint reads of a driver; its learner records the step
    it is asked to save and stops there (the rest of a checkpoint is not these tests')."""
    from types import SimpleNamespace

    from staleflow.cluster.ledger import Counts
    from staleflow.cluster.schedule import Schedule

    class Learner:
        def save(self, path, extra):
            saved.append(extra["step"])
            raise StopIteration

    return SimpleNamespace(
        cfg=cfg, schedule=Schedule(cfg), flow=flow, step=flow.steps, learner=Learner(),
        sync=SimpleNamespace(broadcasts=cfg.sync.method in ("gloo", "nccl")), counts=Counts(),
        P=cfg.rollout.prompts_per_batch, faults=[], run_id="r", clock=lambda: {},
        prompts=SimpleNamespace(taken=flow.batches * cfg.rollout.prompts_per_batch, digest=""),
        rundir=SimpleNamespace(checkpoints=Path("/nonexistent")),
    )  # fmt: skip


def test_a_checkpoint_no_resume_could_use_is_not_made_with_a_broadcast_sync(caplog):
    # gloo/nccl keep no copy of older weights: at step 3 of I = 2, batch 4 still needs v2.
    # Such a checkpoint was made, acked its groups, and then every resume was refused.
    from staleflow.cluster.resume import CheckpointMixin
    from staleflow.cluster.schedule import Flow

    saved: list[int] = []

    def driver(method: str, batches: int):
        cfg = parse_config(
            "model: {preset: tiny}\nrollout: {prompts_per_batch: 2}\nsync: {mode: lockstep}",
            [f"sync.method={method}", "sync.interval=2", "sync.offset=0"],
        )
        return checkpointing_driver(
            cfg, Flow(steps=3, batches=batches, published={0, 2}, latest=2), saved
        )

    CheckpointMixin._write_checkpoint(driver("gloo", batches=3))  # batch 4 (v2) not made yet
    assert saved == []
    assert "no checkpoint at step 3: batches still to run need weights v[2]" in caplog.text
    for method, batches, final in (("gloo", 4, False), ("gloo", 3, True), ("ray", 3, False)):
        with pytest.raises(StopIteration):  # made: batch 4 done, the run's last, or kept
            CheckpointMixin._write_checkpoint(driver(method, batches), final=final)
    assert saved == [3, 3, 3]


def test_the_learning_rate_schedule_and_what_lengthening_a_run_does_to_it():
    from staleflow.cluster.resume import lr_horizon_warning
    from staleflow.learner.lr import lr_factor

    cfg = parse_config(
        "model: {preset: tiny}\nrun: {steps: 20}\n"
        "learner: {optimizer: {lr: 1.0e-6, schedule: warmup_cosine, warmup_steps: 2}}\n"
    )
    f = lr_factor(cfg)
    # warmup: (step + 1) / 2 -> 0.5, 1.0; then 0.5 (1 + cos(pi (step - 2) / 18))
    assert [f(0), f(1), f(2)] == [0.5, 1.0, 1.0]
    assert f(11) == pytest.approx(0.5)  # halfway: cos(pi / 2) = 0
    assert f(20) == pytest.approx(0.0)  # the end (min_lr_ratio 0), and after it
    # The checkpoint's run had 11 steps and trained them all; resumed with run.steps 20, the
    # next optimizer step is 11: at 11 steps it was at the end (0.5 (1 + cos(pi 9/9)) = 0),
    # over 20 it is halfway (0.5): step 12 trains at 0.5 x 1e-6, not 0.
    saved = {"run": {"steps": 11}}
    message = lr_horizon_warning(saved, cfg, done=11)
    assert message is not None
    assert "step 12 trains at lr 5e-07, not 0," in message
    assert "decay now ends at step 20" in message
    assert lr_horizon_warning({"run": {"steps": 20}}, cfg, done=11) is None  # unchanged
    constant = parse_config("model: {preset: tiny}\nrun: {steps: 20}\n")
    assert lr_horizon_warning(saved, constant, done=11) is None  # nothing decays
    assert lr_horizon_warning({}, cfg, done=11) is None  # an older checkpoint: no config


def test_published_versions_nothing_needs_are_freed_also_between_needed_ones():
    # An evaluation of step 1 still running kept every later version published (only those
    # below the oldest needed one were freed): under ipc each is a whole model's copy.
    from types import SimpleNamespace

    from staleflow.cluster.driver import Driver
    from staleflow.cluster.schedule import Flow, Schedule

    cfg = parse_config(
        "model: {preset: tiny}\ntask: {name: digits, chat_template: false}\n"
        "sync: {mode: async}\nrun: {steps: 10}\n"
    )
    driver = Driver.__new__(Driver)  # only the bookkeeping of published versions
    driver.schedule, driver.resumed = Schedule(cfg), None
    driver.flow = Flow(steps=5, running={7: (4, 2)})  # a batch still generating at v4
    driver.evaluations = SimpleNamespace(versions={1})  # step 1's evaluation in flight
    freed: list[int] = []
    sync = SimpleNamespace(discard=lambda handle: freed.append(handle.version))
    driver.services = SimpleNamespace(sync=sync)
    driver.published = {v: SimpleNamespace(version=v) for v in range(1, 5)}
    driver._published(SimpleNamespace(version=5))
    assert sorted(driver.published) == [1, 4, 5]  # the evaluation's, the batch's, the newest
    assert sorted(freed) == [2, 3]
    assert driver.flow.published == {1, 4, 5}


def test_a_second_stop_signal_during_a_checkpoint_stops_the_run_once_it_is_written():
    # Raised inside a periodic checkpoint (after LATEST named it, say), the interrupt left
    # the step unmarked as checkpointed, and the stop wrote the same step over the directory
    # LATEST named, its acks lost (the commit had run).
    import signal
    from types import SimpleNamespace

    from staleflow.cluster.driver import Driver
    from staleflow.cluster.resume import CheckpointMixin

    written = []

    def write(final):
        Driver._on_stop_signal(driver, signal.SIGINT, None)  # the second Ctrl-C, mid-write
        written.append(final)

    driver = SimpleNamespace(
        _finishing=False, stop_requested=True, _checkpointing=False,
        _interrupt_after_checkpoint=False, _write_checkpoint=write,
    )  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        CheckpointMixin._checkpoint(driver)
    assert written == [False]  # the checkpoint was complete before the stop
    assert not driver._checkpointing
    with pytest.raises(KeyboardInterrupt):  # outside a checkpoint it stops at once
        Driver._on_stop_signal(driver, signal.SIGINT, None)

    # a checkpoint that fails after the signal stops the run with its own error, and the
    # stop's own checkpoint later (which would succeed) raises no leftover interrupt
    def disk_full(final):
        Driver._on_stop_signal(driver, signal.SIGINT, None)
        raise OSError(28, "No space left on device")

    driver._write_checkpoint = disk_full
    with pytest.raises(OSError, match="No space left"):
        CheckpointMixin._checkpoint(driver)
    assert not driver._interrupt_after_checkpoint
    driver._write_checkpoint, driver._finishing = write, True
    CheckpointMixin._checkpoint(driver, final=True)  # in _finish: no KeyboardInterrupt
    assert written == [False, True]


def test_a_redone_batch_counts_the_groups_of_its_parts_once():
    # A lock-step batch split over two workers: one part finished before the stop (its
    # group counted in flow.pushed), the other did not. The resume redoes the whole batch,
    # both parts report their groups, and the finished part's was counted twice
    # (summary.json's pushed_by_finished_batches).
    from types import SimpleNamespace

    from staleflow.cluster.driver import Driver
    from staleflow.cluster.ledger import Counts
    from staleflow.cluster.resume import driver_state
    from staleflow.cluster.schedule import Flow

    def part_done(complete: bool):
        shard = SimpleNamespace(batch=3, failed_at=None, slot=SimpleNamespace(index=0))
        report = SimpleNamespace(groups=1, pushed=1, generate_s=0.0, load_s=0.0,
                                 policy_version=1, reward_mean=0.0, tokens_per_s=0.0,
                                 parse_failures=0, reward_errors=0, node="n")  # fmt: skip
        driver.rollouts.finished = lambda ref: (shard, report, complete)
        Driver._on_batch_done(driver, "ref")

    driver = SimpleNamespace(
        flow=Flow(batches=3, running={3: (1, 2)}), counts=Counts(), step=2, P=2,
        timeline=SimpleNamespace(load_s=0.0, gap_s=0.0, last=0.0),
        metrics=SimpleNamespace(write=lambda *a, **k: None), rollouts=SimpleNamespace(),
        clock=lambda: {}, prompts=SimpleNamespace(taken=6, digest=""), faults=[],
    )  # fmt: skip
    part_done(complete=False)  # then the stop: batch 3 is still running at the checkpoint
    assert (driver.flow.pushed, driver.flow.partial) == (1, {3: 1})
    assert driver_state(driver, trained=0)["flow"]["partial"] == {"3": 1}

    driver.resumed = SimpleNamespace(prompts_of=lambda batch: ["p1", "p2"])
    driver.published = {1: "weights v1"}
    driver.rollouts.start = lambda slots, batch, weights, prompts, since: 0.0
    Driver._dispatch(driver, ["w0", "w1"], 1, batch=3)  # the resume redoes all of batch 3
    part_done(complete=False)
    part_done(complete=True)
    assert (driver.flow.pushed, driver.flow.partial) == (2, {})  # 3 before: one counted twice
    assert driver.flow.batches_done == 1


def test_an_async_checkpoint_keeps_no_older_weights_and_is_not_skipped(caplog):
    # Async: step 5 is done while batches 6 and 7, started at v4, still run (the steady
    # state). Counted as needed, v4 made every periodic and stop checkpoint of gloo / nccl
    # be skipped ("batches still to run need weights v[4]"), though a resume redoes running
    # async batches with the newest version and needs no older one.
    from staleflow.cluster.resume import CheckpointMixin, versions_in_use, versions_to_keep
    from staleflow.cluster.schedule import Flow

    saved: list[int] = []
    cfg = parse_config("model: {preset: tiny}\nrollout: {prompts_per_batch: 2}\n"
                       "sync: {mode: async, method: gloo}\n")  # fmt: skip
    flow = Flow(steps=5, batches=7, batches_done=5, published={4, 5}, latest=5,
                running={6: (4, 2), 7: (4, 2)}, pushed=10, trained=10)  # fmt: skip
    driver = checkpointing_driver(cfg, flow, saved)
    assert versions_in_use(driver.schedule, flow) == {4}  # kept while the batches run
    assert versions_to_keep(driver.schedule, flow) == set()  # but not for a resume
    with pytest.raises(StopIteration):  # made
        CheckpointMixin._write_checkpoint(driver)
    assert saved == [5]
    assert "no checkpoint at step 5" not in caplog.text


def test_the_older_weights_a_checkpoint_keeps_are_durable_names_included(tmp_path, monkeypatch):
    # Lock-step I = 1, O = 2 at step 3: batches 4 and 5 still use v1 and v2, so the checkpoint
    # keeps both. Each file was fsynced, but not checkpoint/weights/ (their names) nor the
    # checkpoint directory (the entry of weights/): on power loss after LATEST moved and the
    # groups were acked, the checkpoint could come back without them, and no resume was left.
    from types import SimpleNamespace

    import numpy as np

    from staleflow.cluster.resume import save_old_weights
    from staleflow.cluster.schedule import Flow, Schedule
    from staleflow.learner import durable

    synced: list[Path] = []
    real = durable.fsync_dir

    def fsync_dir(path):
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(durable, "fsync_dir", fsync_dir)
    cfg = parse_config("model: {preset: tiny}\nrollout: {prompts_per_batch: 2}\n"
                       "sync: {mode: lockstep, interval: 1, offset: 2, method: ray}\n")  # fmt: skip
    flow = Flow(steps=3, batches=3, batches_done=3, published={1, 2, 3}, latest=3)
    weights = {v: SimpleNamespace(arrays=lambda v=v: {"w": np.full(2, v, np.float32)})
               for v in (1, 2, 3)}  # fmt: skip
    driver = SimpleNamespace(schedule=Schedule(cfg), flow=flow, published=weights,
                             sync=SimpleNamespace(broadcasts=False))  # fmt: skip
    checkpoint = tmp_path / "step-000003"
    checkpoint.mkdir()
    save_old_weights(driver, checkpoint)
    assert sorted(p.name for p in (checkpoint / "weights").glob("weights-v*")) == [
        "weights-v00000001.safetensors", "weights-v00000002.safetensors"]  # fmt: skip
    assert synced == [checkpoint / "weights", checkpoint]  # names first, then weights/ itself


@pytest.mark.parametrize("outcome", ["synced", "not running", "failed"])
def test_a_checkpoint_says_when_the_buffers_log_was_not_made_durable(caplog, outcome):
    # The embedded Redis's log is fsynced before LATEST names a checkpoint (sync_log). When
    # it could not be (the server just died, or a CONFIG SET timed out, which may also leave
    # it fsyncing every write), the run went on without a word, while the docs and a resume's
    # refusal point at the log's warning.
    from types import SimpleNamespace

    import redis

    from staleflow.cluster.resume import CheckpointMixin

    def sync_log(marker):
        assert marker == "staleflow:r:checkpointed"
        if outcome == "failed":
            raise redis.TimeoutError("Timeout reading from socket")
        return outcome == "synced"

    driver = SimpleNamespace(
        step=7, services=SimpleNamespace(redis=SimpleNamespace(sync_log=sync_log)),
        buffer=SimpleNamespace(keys=SimpleNamespace(prefix="staleflow:r:")),
        cfg=SimpleNamespace(buffer=SimpleNamespace(persistence=True)),
    )  # fmt: skip
    with caplog.at_level("WARNING"):
        CheckpointMixin._sync_buffer_log(driver)
    said = {
        "synced": "",
        "not running": "checkpoint at step 7: the embedded Redis is not running",
        "failed": "could not be made durable now (Timeout reading from socket), and Redis may "
        "go on fsyncing every write (appendfsync always)",
    }[outcome]
    assert said in caplog.text
    assert ("may find pushes missing" in caplog.text) == (outcome != "synced")


class _Pool:
    """The part of placement.WorkerPool the driver's publish wait uses."""

    def __init__(self, slots):
        self.slots = list(slots)
        self.dropped = []

    @property
    def active(self):
        return [s for s in self.slots if not s.retiring]

    def drop(self, slot):
        self.dropped.append(slot.index)
        self.slots.remove(slot)

    def version_unknown(self, slot):
        slot.version = -1

    def evaluate(self, slot, weights, n_prompts):  # a retry: queued on the slot
        return slot.call(f"retry of {weights}")

    def ended(self, slot, ref):
        if ref in slot.queue:
            slot.queue.remove(ref)


def _waiting_driver(monkeypatch, shards, running, slots):
    """A Driver with only what `_wait_for_members` uses; `_wait` advances a fake clock by a
    second, handles the end of an evaluation whose worker was killed or dropped (its call
    fails) and of a retry two seconds after it started (it succeeds), then checks for hung
    evaluations as the real one does. Each evaluation in `running` is its slot's only call,
    running since t = 0. `ray.kill` records the handles it kills (in `killed`)."""
    from types import SimpleNamespace

    import ray
    import ray.exceptions

    import staleflow.cluster.driver as driver_module
    import staleflow.cluster.placement as placement_module
    from staleflow.cluster.driver import Driver
    from staleflow.cluster.evaluations import Evaluations

    cfg = parse_config(
        "model: {preset: tiny}\ntask: {name: digits, chat_template: false}\n"
        "sync: {mode: async, method: gloo}\nrollout: {batch_timeout_s: 5}\n"
    )
    clock = [0.0]
    fake_time = SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0])
    monkeypatch.setattr(driver_module, "time", fake_time)
    monkeypatch.setattr(placement_module, "time", fake_time)
    for ref, _, slot in running:
        slot.call(ref)
    killed = []
    monkeypatch.setattr(ray, "kill", lambda handle: killed.append(handle))
    monkeypatch.setattr(ray, "wait", lambda refs, timeout, num_returns=1: ([], refs))
    driver = Driver.__new__(Driver)
    driver.cfg, driver.learning, driver._deferred_workers = cfg, None, None
    driver.stop_requested = False
    driver.schedule = SimpleNamespace(lockstep=False)
    pool = _Pool(slots)
    driver.services = SimpleNamespace(pool=pool, sync=SimpleNamespace(broadcasts=True))
    driver.rollouts = SimpleNamespace(shards=shards)
    driver.evaluations = Evaluations(
        pool, 2, running=running, on_lost=driver._worker_lost_in_evaluation
    )
    driver.published, driver.accuracy, driver.started, driver.progress = {}, {}, 0.0, None
    driver.metrics = SimpleNamespace(write=lambda *args, **kwargs: None)
    waits, retries = [], {}  # retry ref -> when it ends

    def get(ref):
        if ref not in retries:
            raise ray.exceptions.ActorDiedError()
        return SimpleNamespace(policy_version=int(ref.split("v")[-1]), accuracy=0.5,
                               reward_mean=0.0, prompts=2, problems=2, temperature=0.0,
                               parse_failures=0, reward_errors=0, examples=[])  # fmt: skip

    monkeypatch.setattr(ray, "get", get)

    def wait():
        assert len(waits) < 50, "the publish's wait never ends"
        waits.append(clock[0])
        clock[0] += 1.0
        for ref, _, slot in list(driver.evaluations.running):
            killed_or_dropped = slot.handle in killed or slot not in pool.slots
            if killed_or_dropped or retries.get(ref, math.inf) <= clock[0]:
                driver._on_eval_done(ref)
        for ref in driver.evaluations.refs:
            retries.setdefault(ref, clock[0] + 2) if ref.startswith("retry") else None
        for ref in [r for r, left in shards.items() if left <= clock[0]]:
            del shards[ref]
        driver.evaluations.check_hung(cfg.rollout.batch_timeout_s, clock[0])

    driver._wait = wait
    driver.killed = killed
    return driver, pool, waits


def test_a_broadcast_waits_for_the_batches_in_flight_then_publishes(monkeypatch):
    # A shard in flight (a retiring worker's too: redone on a member if it fails) is waited
    # for until it ends: the broadcast waited for it inside the collective, where a worker
    # dying in its batch failed learner rank 0's call too
    from staleflow.cluster.placement import WorkerSlot

    a, b = WorkerSlot(0, "a"), WorkerSlot(1, "b", retiring=True)
    running = [("e5", 5, b)]  # on the retiring worker: no scale is due, it stays retiring
    driver, pool, waits = _waiting_driver(monkeypatch, {"s1": 3.0}, running, [a, b])
    driver._wait_for_members()
    assert waits == [0.0, 1.0, 2.0]  # until the shard ended at t = 3
    assert pool.dropped == []
    assert driver._deferred_workers is None
    assert [step for _, step, _ in driver.evaluations.running] == [5]  # not waited for


def test_a_stop_cancels_a_broadcast_that_waits_for_its_members(monkeypatch):
    # A stop asked for while a broadcast waits for a batch in flight: the broadcast is not
    # made (it would hold up the stop's checkpoint until the batch ends, up to
    # rollout.batch_timeout_s). The stop lands during the second wait (t = 1).
    from staleflow.cluster.driver import BroadcastCancelled
    from staleflow.cluster.placement import WorkerSlot

    a = WorkerSlot(0, "a")
    driver, _pool, waits = _waiting_driver(monkeypatch, {"s1": 3.0}, [], [a])
    wait = driver._wait

    def stop_at_t1():
        if waits == [0.0]:
            driver.stop_requested = True
        wait()

    driver._wait = stop_at_t1
    with pytest.raises(BroadcastCancelled):
        driver._wait_for_members()
    assert waits == [0.0, 1.0]  # not to t = 3, when the batch ends


def test_a_stop_handles_the_calls_that_have_returned_before_it_cancels_a_broadcast(
    monkeypatch,
):
    # Lock-step, a stop asked for during step 3: when its learner call returns, batch 3's
    # part has returned too (it pushed every group the step trained), but the driver has
    # not handled it. It was taken for a busy member: the broadcast was cancelled, and the
    # batch still counted as running at v2 (under gloo the stop's checkpoint was skipped as
    # unresumable). Returned calls are handled first (the trained batch's parts waited for,
    # once a stop, up to RETURNING_PARTS_S; not a part redone, which may have had nothing
    # new to push); the broadcast is cancelled only if a member is still busy.
    from types import SimpleNamespace

    import ray

    from staleflow.cluster.driver import RETURNING_PARTS_S, BroadcastCancelled
    from staleflow.cluster.placement import WorkerSlot

    a = WorkerSlot(0, "a")
    driver, _pool, waits = _waiting_driver(monkeypatch, {}, [], [a])
    driver.schedule, driver.stop_requested = SimpleNamespace(lockstep=True), True
    driver.flow = SimpleNamespace(steps=3)
    driver._waited_for_returning = False
    driver.resumed = SimpleNamespace(versions={2: 1})  # batch 2 redone by the resume, at v1
    returned = {"batch 3": True, "batch 4": False, "redone 2": False, "again 3": False}
    handled, timeouts = [], []
    shards = {
        "batch 3": SimpleNamespace(batch=3, attempts=1),
        "batch 4": SimpleNamespace(batch=4, attempts=1),
        "redone 2": SimpleNamespace(batch=2, attempts=1),  # by the resume
        "again 3": SimpleNamespace(batch=3, attempts=2),  # after its worker failed
    }
    driver.rollouts = SimpleNamespace(shards=shards)

    def wait(refs, timeout, num_returns=1):
        timeouts.append((sorted(refs), timeout))
        return [r for r in refs if returned[r]], [r for r in refs if not returned[r]]

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", lambda ref: None)
    driver._on_batch_done = lambda ref: handled.append(shards.pop(ref).batch)
    with pytest.raises(BroadcastCancelled):  # batch 4 (a fake: lock-step has one) is out
        driver._wait_for_members()
    assert handled == [3]
    assert waits == []  # (no wait for a call to end)
    # only the trained batch's first parts are waited for; the rest is only looked at
    assert timeouts[0] == (["batch 3"], RETURNING_PARTS_S)
    assert timeouts[1:] == [(["again 3", "batch 3", "batch 4", "redone 2"], 0)]
    # every call has returned: the broadcast is made, and nothing is waited for again
    returned.update(dict.fromkeys(returned, True))
    timeouts.clear()
    driver._wait_for_members()
    assert sorted(handled) == [2, 3, 3, 4]
    assert timeouts == [(["again 3", "batch 4", "redone 2"], 0)]
    assert waits == []


def test_a_stop_cancels_a_broadcast_new_workers_would_join_first(monkeypatch):
    # A scale (or a lost worker's replacement) waits for the next publish under a broadcast
    # method: at a stop, that publish would start the new workers and wait for them (up to
    # run.start_timeout_s) before the stop's checkpoint. It is cancelled instead.
    from staleflow.cluster.driver import BroadcastCancelled
    from staleflow.cluster.placement import WorkerSlot

    driver, _pool, waits = _waiting_driver(monkeypatch, {}, [], [WorkerSlot(0, "a")])
    driver.stop_requested, driver._deferred_workers = True, 3
    driver._drop_dead_members = lambda: None
    driver._scale = lambda n: pytest.fail(f"scaled to {n} at a stop")
    with pytest.raises(BroadcastCancelled):
        driver._publish()
    assert driver._deferred_workers == 3  # (a resume starts them)
    assert waits == []


def test_a_broadcast_kills_an_evaluation_hung_on_a_member_and_retries_it_before_publishing(
    monkeypatch,
):
    # An evaluation on a member with nothing queued behind it was waited for forever (only
    # batches were bounded by rollout.batch_timeout_s): past that limit (5 s) its worker is
    # killed and replaced at this publish. Its failure is handled before the publish, so its
    # retry runs on a member that still holds v0 (after the broadcast of v1 no engine could
    # load v0 again, and the step's accuracy was skipped), and is waited for in turn. One
    # on a retiring worker is waited for too once a's replacement is due at this publish:
    # scaling up makes a retiring worker a member again first (WorkerPool.scale), and the
    # broadcast would wait for its evaluation inside the collective. It hangs as well.
    from staleflow.cluster.placement import WorkerSlot

    a, b, c = WorkerSlot(0, "a"), WorkerSlot(1, "b"), WorkerSlot(2, "c", retiring=True)
    running = [("e0", 0, a), ("e9", 9, c)]
    driver, pool, waits = _waiting_driver(monkeypatch, {}, running, [a, b, c])
    c.head_since = 4.5  # (its evaluation began later)
    driver.published = {0: "v0"}
    driver._wait_for_members()
    # a killed after the wait at t = 5 (> 5 s): its failure at t = 7, the retry on b until 9;
    # c's killed after the wait at t = 9 (10 - 4.5 > 5), its failure at t = 11
    assert waits == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert pool.dropped == [0]
    assert driver.killed == ["a", "c"]
    assert driver._deferred_workers == 2  # b and a replacement join at this publish
    assert driver.accuracy == {0: 0.5}  # the retry's, on b
    assert b.queue == []
    assert driver.evaluations.running == []  # (step 9's was not published: not retried)


def test_a_worker_that_died_in_an_evaluation_is_replaced_at_the_next_broadcast(monkeypatch):
    # Its slot stayed in the pool: the next broadcast included the dead member and the run
    # stopped. Now the driver forgets it and a new worker joins at the next publish. An
    # evaluation that only failed (its worker alive) keeps its worker.
    import ray
    import ray.exceptions

    from staleflow.cluster.placement import WorkerSlot

    a, b = WorkerSlot(0, "a"), WorkerSlot(1, "b")
    driver, pool, _ = _waiting_driver(monkeypatch, {}, [("dead", 0, a), ("raised", 2, b)], [a, b])
    errors = {"dead": ray.exceptions.ActorDiedError(), "raised": ValueError("a bad reward")}

    def get(ref):
        raise errors[ref]

    monkeypatch.setattr(ray, "get", get)
    retried = []
    driver.evaluations.start = lambda step, weights, avoid=None: retried.append(step)
    driver.published = {}  # (nothing to retry with: each is skipped)
    driver._on_eval_done("raised")
    assert pool.dropped == []
    assert driver._deferred_workers is None
    driver._on_eval_done("dead")
    assert pool.dropped == [0]
    assert driver._deferred_workers == 2  # b and a replacement
    driver._worker_lost_in_evaluation(a)  # told again (another call on it failing)
    assert pool.dropped == [0]
    assert driver._deferred_workers == 2  # still one replacement


def test_a_checkpoint_writes_the_older_versions_it_holds(tmp_path):
    # A run resumed to more steps was checked for the versions its own batches use, not for
    # those a further lengthening would (I=1, O=10 at step 8 of 8: batches 12-16 would use
    # v1-v5). It holds v0 alone; its checkpoint failed with a KeyError on v1.
    from types import SimpleNamespace

    import numpy as np

    from staleflow.cluster.resume import save_old_weights, versions_to_keep
    from staleflow.cluster.schedule import Flow, Schedule

    sync = "sync: {mode: lockstep, interval: 1, offset: 10}"
    cfg = parse_config(f"model: {{preset: tiny}}\nrollout: {{prompts_per_batch: 2}}\n"
                       f"run: {{steps: 8}}\n{sync}\n")  # fmt: skip
    flow = Flow(steps=8, batches=8, batches_done=8, published={0, 8}, latest=8)
    weights = {v: SimpleNamespace(arrays=lambda v=v: {"w": np.full(2, v, np.float32)})
               for v in (0, 8)}  # fmt: skip
    driver = SimpleNamespace(schedule=Schedule(cfg), flow=flow, published=weights,
                             sync=SimpleNamespace(broadcasts=False))  # fmt: skip
    assert versions_to_keep(driver.schedule, flow) == {0, 1, 2, 3, 4, 5}
    checkpoint = tmp_path / "step-000008"
    checkpoint.mkdir()
    save_old_weights(driver, checkpoint)
    assert [p.name for p in (checkpoint / "weights").glob("weights-v*")] == [
        "weights-v00000000.safetensors"]  # fmt: skip
