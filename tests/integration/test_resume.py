"""Resume and the faults a run survives in place: real Ray (the session's), Redis, DeepSpeed.

The chaos test (test_chaos.py) kills everything in one run through the command line; these
check one thing each, in process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from staleflow.actors.tasks import PromptStream, make_task
from staleflow.cluster.driver import Driver
from staleflow.cluster.resume import (
    STATE_FORMAT,
    ResumeError,
    check_resumable,
    load_resume,
    resume_overrides_allowed,
)
from staleflow.cluster.rundir import RunDir, read_metrics
from staleflow.cluster.schedule import lag, rollout_version
from staleflow.configs import parse_config
from tests.integration.rewards import slow_once_marked_task
from tests.integration.test_system import assert_reconciled, ctrl_c, staleflow, status_of, wait_for
from tests.integration.tiny import ONE_WORKER, TINY, run_driver, steps_of

pytestmark = pytest.mark.integration


def test_resume_lengthens_a_finished_run_with_exact_lags_and_one_record_per_step(
    tmp_path, ray_local
):
    base = [
        "run.name=r", "run.checkpoint_every=2", "sync.offset=1", "run.keep_checkpoints=2",
        ONE_WORKER,
    ]  # fmt: skip
    _cfg, run, first, _ = run_driver(tmp_path, *base, "run.steps=5")
    assert first["status"] == "completed"
    # checkpoints at 2, 4 and the end (5); the oldest is pruned
    assert sorted(p.name for p in run.checkpoints.glob("step-*")) == [
        "step-000004",
        "step-000005",
    ]
    trainer = json.loads((run.checkpoints / "step-000005/trainer.json").read_text())
    state = trainer["extra"]["driver"]
    assert state["flow"]["steps"] == 5
    assert state["counts"]["trained"] == 10  # every training is acked by then
    # with offset 1, batch 6 needs version 4: the checkpoint kept it
    assert (run.checkpoints / "step-000005/weights/weights-v00000004.safetensors").is_file()

    # a resume with no steps left is refused before it touches the run's files (it used to
    # evaluate again, append to metrics.jsonl, and store run.steps=3 in config.json)
    files = {p: p.read_bytes() for p in (run.metrics, run.config, run.path / "summary.json")}
    for more in ([], ["run.steps=3"]):
        proc = staleflow("train", "--resume", str(run.path), *more, cwd=tmp_path)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 2, out
        assert "has already trained 5 steps" in out
        assert "run.steps=N with N > 5" in out
    assert {p: p.read_bytes() for p in files} == files

    cfg = parse_config(TINY, [f"run.output_dir={tmp_path}", *base, "run.steps=8"])
    summary = Driver(cfg, RunDir(run.path), resume=True).run()
    assert summary["status"] == "completed"
    assert summary["steps"] == 8
    assert_reconciled(summary)
    assert summary["groups"]["pushed"] == summary["groups"]["trained"] == 16
    records = list(read_metrics(run.metrics))
    steps = steps_of(records)
    assert [r["step"] for r in steps] == list(range(1, 9))
    for r in steps:
        assert r["lag_min"] == r["lag_max"] == lag(r["step"], 1, 1)
    assert [r["step"] for r in records if r["kind"] == "resume"] == [5]
    # the resumed run's clock goes on from the checkpoint's: it restarted at 0, so its busy
    # fractions divided the whole run's busy seconds by the time since the resume (over 1)
    # (the final checkpoint was made after step 5's record, and step 6 follows it)
    assert steps[4]["wall_s"] <= state["counts"]["wall_s"] <= steps[5]["wall_s"]
    walls = [r["wall_s"] for r in steps]
    assert walls == sorted(walls)
    assert walls[5] > walls[4]
    assert all(0 < r["learner_busy"] <= 1 and 0 < r["rollout_busy"] <= 1 for r in steps)
    assert 0 < summary["learner_busy"] <= 1


def test_a_step_finished_during_a_hard_stop_keeps_its_record(tmp_path, ray_local):
    # A second Ctrl-C (or an error elsewhere) while the learner call for step 3 runs: that
    # call finishes, is counted and checkpointed at the stop, but its `step` record was never
    # written, and a resume from that checkpoint went on at step 4: a gap in the curves for
    # good.
    import signal

    class CtrlCTwice(Driver):
        fired = False

        def _poll_control(self):
            super()._poll_control()
            if not self.fired and self.learning is not None and self.step == 2:
                self.fired = True
                self._on_stop_signal(signal.SIGINT, None)  # a clean stop asked ...
                self._on_stop_signal(signal.SIGINT, None)  # ... and then at once

    base = ["run.name=r", "run.steps=4", "run.checkpoint_every=100", ONE_WORKER]
    cfg = parse_config(TINY, [f"run.output_dir={tmp_path}", *base])
    run = RunDir.create(str(tmp_path), "r")
    driver = CtrlCTwice(cfg, run)
    summary = driver.run()
    assert driver.fired
    assert (summary["status"], summary["steps"]) == ("interrupted", 3)
    assert_reconciled(summary)
    assert (run.checkpoints / "LATEST").read_text().strip() == "step-000003"
    records = list(read_metrics(run.metrics))
    assert [r["step"] for r in steps_of(records)] == [1, 2, 3]
    # checked against the schedule like any step's
    assert steps_of(records)[2]["lag_min"] == steps_of(records)[2]["lag_expected"]

    cfg = parse_config(TINY, [f"run.output_dir={tmp_path}", *base])
    assert Driver(cfg, RunDir(run.path), resume=True).run()["status"] == "completed"
    assert [r["step"] for r in steps_of(list(read_metrics(run.metrics)))] == [1, 2, 3, 4]


def test_resuming_a_replay_run_from_a_checkpoint_older_than_its_replay_counts(tmp_path, ray_local):
    # Checkpoints written before the schedule counted replays apart (Flow.replayed) hold
    # trainings that include replays: resumed as 0 replays, the count of groups not trained
    # yet came out negative and async admission went on drifting. The buffer's own count of
    # replay trainings (acked by the checkpoint) restores it.
    # Steps of 8 groups from batches of 1 prompt of 64 generated tokens (64 forward passes in
    # turn): a step's data takes the worker about ten times the learner's step, so the steps
    # after the first are filled with replays (acked, so replayable, at each step's
    # checkpoint), whatever else the machine runs. (With 4 tokens the worker kept up under
    # CI's load, and no replay was trained.)
    base = ["run.name=r", "sync.mode=async", "buffer.sampling=replay", "buffer.max_reuse=3",
            "learner.groups_per_step=8", "rollout.prompts_per_batch=1",
            "rollout.max_new_tokens=64", "run.checkpoint_every=1", ONE_WORKER]  # fmt: skip
    _cfg, run, first, _ = run_driver(tmp_path, *base, "run.steps=6")
    assert first["status"] == "completed"
    assert first["groups"]["trainings"] > first["groups"]["trained"]  # replays were trained
    latest = run.checkpoints / "step-000006/trainer.json"
    trainer = json.loads(latest.read_text())
    flow = trainer["extra"]["driver"]["flow"]
    replayed = flow.pop("replayed")
    assert replayed == first["groups"]["trainings"] - first["groups"]["trained"] > 0
    flow.pop("replays_dropped")
    latest.write_text(json.dumps(trainer))  # as an older staleflow wrote it

    cfg = parse_config(TINY, [f"run.output_dir={tmp_path}", *base, "run.steps=10"])
    driver = Driver(cfg, RunDir(run.path), resume=True)
    summary = driver.run()
    assert summary["status"] == "completed"
    assert_reconciled(summary)
    assert driver.flow.replayed >= replayed
    assert 0 <= summary["driver_counts"]["left_in_buffer"] <= summary["groups"]["left_in_buffer"]


def test_resume_after_a_crash_retrains_the_held_groups_in_the_same_order(
    tmp_path, ray_local, monkeypatch
):
    # The driver dies just before its checkpoint at step 4 (injected): steps 3 and 4 were
    # trained but only the checkpoint at step 2 exists, and their groups were never acked.
    base = ["run.name=c", "run.checkpoint_every=2", "run.steps=4", ONE_WORKER]
    original = Driver._checkpoint

    def dies_at_step_4(self):
        if self.step >= 4:
            raise RuntimeError("injected: the driver died before its checkpoint")
        original(self)

    monkeypatch.setattr(Driver, "_checkpoint", dies_at_step_4)
    with pytest.raises(RuntimeError, match="injected"):
        run_driver(tmp_path, *base)
    monkeypatch.undo()
    run = RunDir(tmp_path / "c")
    lines = (run.trajectories / "steps.jsonl").read_text().splitlines()
    before = {x["step"]: x["groups"] for x in map(json.loads, lines)}
    assert sorted(before) == [1, 2, 3, 4]
    assert run.latest_checkpoint().name == "step-000002"

    cfg = parse_config(TINY, [f"run.output_dir={tmp_path}", *base])
    summary = Driver(cfg, run, resume=True).run()
    assert summary["status"] == "completed"
    assert_reconciled(summary)
    groups = summary["groups"]
    assert groups["pushed"] == groups["trained"] == 8  # no batch pushed twice
    assert groups["duplicates"] >= 2  # batch 4 or more was redone and deduplicated
    lines = (run.trajectories / "steps.jsonl").read_text().splitlines()
    after = {x["step"]: x["groups"] for x in map(json.loads, lines)}
    assert [x["step"] for x in map(json.loads, lines)] == [1, 2, 3, 4]
    assert after == before  # steps 3 and 4 trained again on exactly their groups
    resumed = [r for r in read_metrics(run.metrics) if r["kind"] == "resume"]
    assert resumed[0]["recovered"] >= 4  # the 2 x 2 held groups (and any staged)
    assert [r["step"] for r in steps_of(read_metrics(run.metrics))] == [1, 2, 3, 4]


def test_a_stop_checkpoints_before_it_waits_for_an_evaluation(tmp_path, ray_local):
    # A clean stop waited up to rollout.batch_timeout_s for the evaluations in flight and only
    # then checkpointed: a grace period (Kubernetes' 30 s) could end with no checkpoint.
    # Here step 2's evaluation is slow (its rewards sleep 0.2 s a response, from the marker
    # made as it starts), and the stop is asked for as it starts.
    import signal

    marker, task = slow_once_marked_task(tmp_path, sleep_s=0.2)

    class StopsAsStep2IsEvaluated(Driver):
        def _evaluate(self, step):
            if step == 2:
                marker.touch()
            super()._evaluate(step)
            if step == 2:
                self._on_stop_signal(signal.SIGINT, None)

    cfg = parse_config(TINY, [
        f"run.output_dir={tmp_path}", "run.name=e", "run.steps=6", "run.eval_every=2",
        "run.checkpoint_every=100", *task, "task.eval_prompts=4",
    ])  # fmt: skip
    run = RunDir.create(str(tmp_path), "e")
    summary = StopsAsStep2IsEvaluated(cfg, run).run()
    assert (summary["status"], summary["steps"]) == ("interrupted", 2)
    assert_reconciled(summary)
    order = [(r["kind"], r["step"]) for r in read_metrics(run.metrics)
             if r["kind"] in ("checkpoint", "eval")]  # fmt: skip
    # the stop's checkpoint first; the evaluation still waited for, and recorded, after it
    assert order == [("eval", 0), ("checkpoint", 2), ("eval", 2)]


def test_a_final_checkpoint_that_fails_is_named_in_the_summary(tmp_path, ray_local, monkeypatch):
    # The run's only checkpoint is its last (injected failure): the summary said "failed"
    # with no reason (the traceback only in driver.log) and counted no group.
    def fails(self, final=False):
        raise RuntimeError("injected: no space left on device")

    monkeypatch.setattr(Driver, "_checkpoint", fails)
    _cfg, run, summary, _ = run_driver(
        tmp_path, "run.name=f", "run.steps=2", "run.checkpoint_every=100", ONE_WORKER
    )
    assert summary["status"] == "failed"
    assert summary["error"] == (
        "could not write the final checkpoint: RuntimeError: injected: no space left on device"
    )
    # still counted: the groups trained were never acked (that happens at a checkpoint), so
    # they are left in the buffer (2 steps x 2 groups)
    groups = summary["groups"]
    assert groups["reconciled"]
    assert (groups["pushed"], groups["trained"], groups["left_in_buffer"]) == (4, 0, 4)
    assert "resume" not in summary  # no checkpoint to resume from
    assert json.loads((run.path / "summary.json").read_text())["error"] == summary["error"]


def test_a_crash_after_the_learner_checkpoint_before_latest_loses_no_group(
    tmp_path, ray_local, monkeypatch
):
    # The driver dies after the learner wrote its checkpoint at step 4 but before LATEST named
    # it (injected; the chaos test's driver SIGKILL once landed there). The groups of steps 3
    # and 4 must still be in the buffer: acking them before LATEST moved lost them, and the
    # resume from step 2 then trained later batches' groups at step 3 (a negative lag).
    base = ["run.name=l", "run.checkpoint_every=2", "run.steps=4", "sync.offset=1", ONE_WORKER]
    original = RunDir.mark_latest_checkpoint

    def dies_before_latest_at_step_4(self, path):
        if path.name == "step-000004":
            raise RuntimeError("injected: the driver died before LATEST")
        original(self, path)

    monkeypatch.setattr(RunDir, "mark_latest_checkpoint", dies_before_latest_at_step_4)
    with pytest.raises(RuntimeError, match="injected"):
        run_driver(tmp_path, *base)
    monkeypatch.undo()
    run = RunDir(tmp_path / "l")
    assert (run.checkpoints / "step-000004").is_dir()
    assert run.latest_checkpoint().name == "step-000002"
    lines = (run.trajectories / "steps.jsonl").read_text().splitlines()
    before = {x["step"]: x["groups"] for x in map(json.loads, lines)}

    cfg = parse_config(TINY, [f"run.output_dir={tmp_path}", *base])
    summary = Driver(cfg, run, resume=True).run()
    assert summary["status"] == "completed"
    assert_reconciled(summary)
    assert summary["groups"]["pushed"] == summary["groups"]["trained"] == 8
    lines = (run.trajectories / "steps.jsonl").read_text().splitlines()
    assert {x["step"]: x["groups"] for x in map(json.loads, lines)} == before
    steps = steps_of(read_metrics(run.metrics))
    assert [(r["step"], r["lag_min"], r["lag_max"]) for r in steps] == [
        (t, lag(t, 1, 1), lag(t, 1, 1)) for t in range(1, 5)
    ]


def _redis_dies_at_the_first(call: str, run_dir, monkeypatch) -> list[int]:
    """SIGKILL the run's embedded Redis as the first checkpoint makes LearnerGroup `call`
    ("save": the ranks write files; "commit": they ack in Redis); the pid killed is
    appended to the list returned."""
    import os
    import signal

    from staleflow.cluster.placement import LearnerGroup

    original = getattr(LearnerGroup, call)
    killed: list[int] = []

    def redis_dies_first(self, *args):
        if not killed:
            pid = json.loads((run_dir / "redis/server.json").read_text())["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return original(self, *args)

    monkeypatch.setattr(LearnerGroup, call, redis_dies_first)
    return killed


def test_redis_killed_during_a_checkpoint_is_restarted_and_the_run_goes_on(
    tmp_path, ray_local, monkeypatch
):
    # A make test run of the chaos test killed Redis while rank 0 acked a checkpoint's
    # groups: the driver, blocked on that call, restarted Redis only after the rank's
    # client had given up, and the run stopped. Injected here: Redis is SIGKILLed as the
    # checkpoint at step 2 commits; the driver restarts it while it waits, and the commit
    # goes through.
    killed = _redis_dies_at_the_first("commit", tmp_path / "r", monkeypatch)
    _cfg, _run, summary, _ = run_driver(
        tmp_path, "run.name=r", "run.checkpoint_every=2", "run.steps=4", "sync.offset=1", ONE_WORKER
    )
    assert killed
    assert summary["status"] == "completed", summary
    assert [f["what"] for f in summary["faults"]] == ["redis"]
    assert_reconciled(summary)
    assert summary["groups"]["trained"] == 4 * 2


def test_redis_dying_without_persistence_stops_the_run_with_the_reason(
    tmp_path, ray_local, monkeypatch, caplog
):
    # Restarted empty, the server had lost the groups and counts the run's tally stands on,
    # and the run went on as if it held them (this one completed, its summary counting groups
    # that no longer existed; a lock-step run stalls on a lost batch). Injected: Redis is
    # SIGKILLed as the checkpoint at step 2 is saved.
    from staleflow.buffer.server import RedisServerError

    # (as the ranks write it: none of them is then inside a Redis call that retries)
    killed = _redis_dies_at_the_first("save", tmp_path / "r", monkeypatch)
    with pytest.raises(RedisServerError, match=r"\(exit code -9\) and buffer\.persistence is off"):
        run_driver(
            tmp_path, "run.name=r", "run.checkpoint_every=2", "run.steps=4", "sync.mode=async",
            "buffer.persistence=false", ONE_WORKER,
        )  # fmt: skip
    assert killed
    status = json.loads((tmp_path / "r/status.json").read_text())
    assert status["state"] == "failed"
    summary = json.loads((tmp_path / "r/summary.json").read_text())
    assert "buffer.persistence is off" in summary["error"]
    # the stop made no checkpoint and no count against the empty server (each failed, with
    # a traceback in the log, before)
    assert "could not checkpoint or reconcile" not in caplog.text


def test_a_learner_rank_killed_during_a_checkpoint_stops_the_run_resumably(
    tmp_path, ray_local, monkeypatch, caplog
):
    # The chaos test once killed learner rank 0 while a periodic checkpoint was being
    # written: the actor's death escaped the driver as a raw ActorDiedError (a traceback, no
    # "resume:" line) and the stop tried to checkpoint the dead rank again. Injected here:
    # rank 0 is killed (for real) as the checkpoint at step 4 starts.
    import ray

    from staleflow.cluster.placement import LearnerGroup

    base = ["run.name=k", "run.checkpoint_every=2", "run.steps=6", "sync.offset=1", ONE_WORKER]
    original = LearnerGroup.save

    def rank_0_dies_at_step_4(self, path, extra):
        if extra["step"] == 4:
            ray.kill(self.ranks[0])
        original(self, path, extra)

    monkeypatch.setattr(LearnerGroup, "save", rank_0_dies_at_step_4)
    _cfg, run, summary, _ = run_driver(tmp_path, *base)  # returns: the run stopped cleanly
    monkeypatch.undo()
    assert summary["status"] == "failed"
    assert summary["steps"] == 4
    assert summary["resume"] == f"staleflow train --resume {run.path}"
    assert run.latest_checkpoint().name == "step-000002"
    # one line, the error's type first (Ray's own text, with its traceback, goes to the log)
    assert "a learner rank failed during a checkpoint: ActorDiedError: The actor died" in (
        caplog.text
    )

    cfg = parse_config(TINY, [f"run.output_dir={tmp_path}", *base])
    resumed = Driver(cfg, run, resume=True).run()
    assert resumed["status"] == "completed"
    assert_reconciled(resumed)


# the stop waits at most the 30 s given to a blocked rank's close, never the collective's
@pytest.mark.timeout(300)
def test_a_learner_rank_failing_mid_step_stops_the_run_at_once(tmp_path, ray_local, monkeypatch):
    # The driver watched only rank 0's call: rank 1 raising (out of memory, say) left rank 0
    # waiting for it in the step's first collective, and the run hung until the process
    # group's timeout (10-30 min). Injected here: at the third learner call rank 1 raises
    # instead of stepping, while rank 0 steps for real.

    import ray

    from staleflow.cluster.placement import LearnerGroup

    @ray.remote(num_cpus=0)
    def out_of_memory():
        raise MemoryError("rank 1 ran out of memory")

    original, calls = LearnerGroup.train, []

    def rank_1_fails(self, wait_s, publish):
        calls.append(wait_s)
        if len(calls) == 3:
            return [self.ranks[0].train.remote(wait_s, publish), out_of_memory.remote()]
        return original(self, wait_s, publish)

    monkeypatch.setattr(LearnerGroup, "train", rank_1_fails)
    _cfg, run, summary, _ = run_driver(
        tmp_path,
        "run.name=m",
        "learner.num_ranks=2",
        "run.steps=6",
        "run.checkpoint_every=2",
        ONE_WORKER,
    )
    assert summary["status"] == "failed"
    assert summary["steps"] == 2
    assert "MemoryError: rank 1 ran out of memory" in summary["learner_error"]
    assert summary["resume"] == f"staleflow train --resume {run.path}"


def _run_with_a_call_that_never_returns(tmp_path, name, inject, *overrides):
    """run_driver with learner.step_timeout_s=10, after `inject(never)` has patched in a call
    that never returns: `never()` starts a Ray task that sleeps for an hour (cancelled when
    the run is over) and returns its ref. Returns (run, summary, the refs made); a run that
    waited for the hour instead of the limit fails by the test's 600 s timeout."""
    import time

    import ray

    @ray.remote(num_cpus=0)
    def hung() -> None:
        time.sleep(3600)

    refs: list = []

    def never():
        refs.append(hung.remote())
        return refs[-1]

    inject(never)
    try:
        _cfg, run, summary, _ = run_driver(
            tmp_path, f"run.name={name}", "run.checkpoint_every=2", "learner.step_timeout_s=10",
            ONE_WORKER, *overrides,
        )  # fmt: skip
    finally:
        for ref in refs:
            ray.cancel(ref, force=True)
    return run, summary, refs


def test_a_learner_call_that_never_returns_stops_the_run_after_step_timeout_s(
    tmp_path, ray_local, monkeypatch
):
    # Ray reports a rank that dies, not one that hangs (a GPU fault, a stalled filesystem):
    # the driver waited for the learner's call forever. Injected here: the first learner
    # call after the checkpoint at step 2 (so step 3's, whatever calls came back short
    # before) is a task that sleeps for an hour in place of rank 0's.
    from staleflow.cluster.placement import LearnerGroup

    original = LearnerGroup.train

    def inject(never):
        def rank_0_hangs(self, wait_s, publish):
            if RunDir(tmp_path / "h").latest_checkpoint() is not None:
                return [never()]
            return original(self, wait_s, publish)

        monkeypatch.setattr(LearnerGroup, "train", rank_0_hangs)

    run, summary, _ = _run_with_a_call_that_never_returns(tmp_path, "h", inject, "run.steps=6")
    assert summary["status"] == "failed"
    assert summary["steps"] == 2
    assert summary["learner_error"].startswith(
        "learner rank(s) 0 did not return from step 3 within learner.step_timeout_s=10 s"
    )
    assert summary["resume"] == f"staleflow train --resume {run.path}"
    assert run.latest_checkpoint().name == "step-000002"  # none made behind the hung call


def test_a_checkpoint_that_never_returns_stops_the_run_after_step_timeout_s(
    tmp_path, ray_local, monkeypatch
):
    # The driver waited on the ranks outside a step (a checkpoint, a publish) with no limit:
    # a rank stalled on its filesystem held the run for ever. Injected: the checkpoint at
    # step 2 waits on a task that sleeps for an hour in place of the ranks' save.
    from staleflow.cluster.placement import LearnerGroup

    def inject(never):
        monkeypatch.setattr(
            LearnerGroup, "save", lambda self, path, extra: self.on_ranks([never()], "a checkpoint")
        )

    run, summary, refs = _run_with_a_call_that_never_returns(tmp_path, "c", inject, "run.steps=4")
    assert len(refs) == 1  # the stop made no second checkpoint behind it
    assert summary["status"] == "failed"
    assert summary["learner_error"].startswith(
        "learner rank 0 did not return from a checkpoint within 10 s (learner.step_timeout_s"
    )
    assert run.latest_checkpoint() is None


def test_four_learner_ranks_at_zero_2_checkpoint_and_resume(tmp_path, ray_local):
    # The shipped paper configs run 4 ranks at ZeRO 2: their checkpoint used to fail.
    base = [
        "run.name=z", "run.checkpoint_every=2", "learner.num_ranks=4", "learner.zero_stage=2",
        ONE_WORKER,
    ]  # fmt: skip
    _cfg, run, first, _ = run_driver(tmp_path, *base, "run.steps=2")
    assert first["status"] == "completed", first
    ckpt = run.checkpoints / "step-000002"
    assert sorted(p.name for p in ckpt.glob("optimizer-rank*.safetensors")) == [
        f"optimizer-rank{r}.safetensors" for r in range(4)
    ]
    cfg = parse_config(TINY, [f"run.output_dir={tmp_path}", *base, "run.steps=3"])
    summary = Driver(cfg, RunDir(run.path), resume=True).run()
    assert summary["status"] == "completed"
    assert summary["steps"] == 3
    assert_reconciled(summary)


def _once(tmp_path, monkeypatch, module: str, first_call: str) -> list[str]:
    """A custom task whose reward function (in `module`) runs `first_call` the first time it
    is called in any worker, then scores normally: a real fault in a real worker process."""
    marker = tmp_path / f"{module}-once"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            f"""
            import os, signal, time
            def fn(meta, text):
                try:  # atomic: only the first call of all workers misbehaves
                    os.close(os.open({str(marker)!r}, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    return float(len(text))
                {first_call}
                return float(len(text))
            """
        )
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the workers import it
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": f"Say something #{i}"} for i in range(40)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        "task.name=custom", f"task.path={tmp_path / 'p.jsonl'}", f"task.reward_fn={module}:fn",
    ]  # fmt: skip


def _hang_once(tmp_path, monkeypatch) -> list[str]:
    """The first reward call of the run hangs (for 600 s)."""
    return _once(tmp_path, monkeypatch, "hangrewards", "time.sleep(600)")


def _crash_once(tmp_path, monkeypatch, after_s: float = 0.0) -> list[str]:
    """The first reward call of the run kills its own worker process (SIGKILL, as the OOM
    killer would), `after_s` seconds into the call."""
    return _once(
        tmp_path, monkeypatch, "crashrewards",
        f"time.sleep({after_s}); os.kill(os.getpid(), signal.SIGKILL)",
    )  # fmt: skip


def _train(tmp_path, *args: str) -> tuple[int, str]:
    """`staleflow train` in a process of its own: its own Ray, whose workers see PYTHONPATH
    (the session's Ray would not import the test's reward module)."""
    (tmp_path / "c.yaml").write_text(TINY)
    proc = staleflow("train", "c.yaml", *args, cwd=tmp_path)
    out, _ = proc.communicate(timeout=500)
    return proc.returncode, out


@pytest.mark.slow
def test_a_hung_worker_is_killed_and_its_batch_redone(tmp_path, monkeypatch):
    task = _hang_once(tmp_path, monkeypatch)
    # the timeout covers a replacement's start too (a Ray worker process, torch's import,
    # the model: 5-15 s on a loaded 2-core machine), so keep it well above
    code, out = _train(
        tmp_path, *task, "run.name=h", "run.steps=3", "rollout.batch_timeout_s=40", ONE_WORKER
    )
    assert code == 0, out[-3000:]
    run = tmp_path / "runs/h"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert_reconciled(summary)
    faults = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "fault"]
    assert [f["error"] for f in faults] == ["hung"]
    assert [f["what"] for f in summary["faults"]] == ["rollout worker"]
    assert summary["groups"]["pushed"] == summary["groups"]["trained"] == 6


def _completed(run, code: int, out: str, groups: int) -> tuple:
    """A `staleflow train` that exited 0 and completed, every one of its `groups` pushed
    trained and the summary reconciled: (run directory, summary, metrics records)."""
    assert code == 0, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed", summary.get("error")
    assert_reconciled(summary)
    assert summary["groups"]["pushed"] == summary["groups"]["trained"] == groups
    return run, summary, list(read_metrics(run / "metrics.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lockstep", "async"])
def test_a_worker_lost_mid_batch_under_a_broadcast_method_is_replaced_and_the_run_goes_on(
    tmp_path, monkeypatch, mode
):
    # With sync.method gloo/nccl a new engine gets weights only at a publish: a worker lost
    # mid-batch stopped the run ("the batch cannot be redone in this run; resume it"). Its
    # part is now redone on a live worker of the broadcast group, which holds the part's
    # version, and a new worker joins the group at the next publish.
    # Async: the crash comes 12 s into the batch, so the other worker's batch has been
    # trained and the broadcast of v1 is due while the crashing batch still runs. The
    # broadcast waited for it inside the collective, where the death also failed learner
    # rank 0's call (gloo: "Connection reset by peer") and the run stopped; it now waits
    # for the members' calls first, and the loss is one mid-batch like any other.
    schedule = ["sync.interval=2", "sync.offset=0"] if mode == "lockstep" else [
        "sync.offset=0", "buffer.max_staleness=1"]  # fmt: skip
    crash = _crash_once(tmp_path, monkeypatch, after_s=0 if mode == "lockstep" else 12)
    code, out = _train(
        tmp_path, *crash, "run.name=b", "run.steps=6",
        "sync.method=gloo", f"sync.mode={mode}", *schedule,
    )  # fmt: skip
    _, summary, records = _completed(tmp_path / "runs/b", code, out, groups=6 * 2)
    [fault] = [r for r in records if r["kind"] == "fault"]
    assert fault["error"].startswith("failed: ActorDiedError"), fault
    if mode == "async":  # the case meant: lost while the broadcast of v1 waited for it
        assert fault["step"] == 1, fault
    assert [f["what"] for f in summary["faults"]] == ["rollout worker"]
    redone = [r for r in records if r["kind"] == "rollout" and r["batch"] == fault["batch"]]
    assert {r["worker"] for r in redone} <= {0, 1}  # on the survivor, at the part's version
    assert len({r["policy_version"] for r in redone}) == 1
    # the new worker (index 2) joined at a publish and generated with the weights broadcast
    new = [r for r in records if r["kind"] == "rollout" and r["worker"] == 2]
    assert new, "the replacement worker ran no batch"
    assert [r["workers"] for r in records if r["kind"] == "scale"] == [2]
    steps = steps_of(records)
    assert [s["step"] for s in steps] == list(range(1, 7))
    if mode == "lockstep":  # every lag the formula's, the redone batch's included
        assert [(s["lag_min"], s["lag_max"]) for s in steps] == [
            (lag(t, 2, 0), lag(t, 2, 0)) for t in range(1, 7)
        ]
    else:
        assert max(s["lag_max"] for s in steps) <= 1


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gloo-async", "ray-lockstep", "ray-async"])
def test_a_hung_evaluation_has_its_worker_killed_and_the_run_goes_on(
    tmp_path, monkeypatch, schedule
):
    # The evaluation before training hangs (its first reward call of a held-out prompt
    # sleeps 600 s). Every call on a worker, batch part or evaluation, is bounded by
    # rollout.batch_timeout_s from when it began running: the hung worker is killed, the
    # evaluation retried once on the other worker, and the worker replaced.
    # gloo-async: a broadcast waits for its members' calls. It used to wait for the hung
    # evaluation inside the collective, and rank 0 gave up after sync.broadcast_timeout_s
    # (30 s here), stopping the run as the learner's failure; the replacement joins at the
    # publish. No batch waits behind the evaluation (an async batch goes to a worker with
    # nothing in flight).
    # ray-lockstep: batch 1 is split over both workers, and worker 0's part waits behind the
    # evaluation without its clock running; the evaluation's own bound must end the hang (a
    # version of this change bounded evaluations only inside a broadcast's wait, and this run
    # hung with no error). The part fails with its worker and is redone on a new one.
    # ray-async, one worker: no batch starts while it evaluates (not a stalled schedule);
    # killed, it is replaced at once, and the retry and the batches run on the new one (that
    # version of the change never ended the evaluation, and the run spun without a word).
    from staleflow.actors.tasks import _in_eval_split

    marker = tmp_path / "hung-once"
    (tmp_path / "evalhang.py").write_text(
        textwrap.dedent(
            f"""
            import os, time
            def fn(meta, text):
                if meta.get("held"):
                    try:  # only the first held-out call of all workers hangs
                        os.close(os.open({str(marker)!r}, os.O_CREAT | os.O_EXCL))
                        time.sleep(600)
                    except FileExistsError:
                        pass
                return float(len(text))
            """
        )
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    texts = [f"Say something #{i}" for i in range(60)]
    rows = [{"prompt": t, "held": _in_eval_split(t, 0.1)} for t in texts]
    assert sum(r["held"] for r in rows) >= 2
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sync = {
        "gloo-async": ["sync.method=gloo", "sync.mode=async", "buffer.max_staleness=1",
                       "sync.broadcast_timeout_s=30"],
        "ray-lockstep": ["sync.method=ray", "sync.mode=lockstep", "sync.interval=1"],
        "ray-async": ["sync.method=ray", "sync.mode=async", "buffer.max_staleness=1", ONE_WORKER],
    }[schedule]  # fmt: skip
    code, out = _train(
        tmp_path, "task.name=custom", f"task.path={tmp_path / 'p.jsonl'}",
        "task.reward_fn=evalhang:fn", "task.eval_prompts=2", "run.name=e", "run.steps=4",
        "sync.offset=0", "rollout.batch_timeout_s=40", *sync,
    )  # fmt: skip
    run, summary, records = _completed(tmp_path / "runs/e", code, out, groups=4 * 2)
    assert marker.exists()  # the hang happened
    log = (run / "logs/driver.log").read_text()
    assert re.search(r"the evaluation of step 0 has run \d+ s \(rollout.batch_timeout_s=40\): "
                     "killing it as hung", log)  # fmt: skip
    assert not re.search(r"batch \d+ has run", log)  # (no batch's bound fired)
    assert [s["step"] for s in steps_of(records)] == [1, 2, 3, 4]
    evals = sorted(r["step"] for r in records if r["kind"] == "eval")
    assert evals == [0, 4]  # the hung one retried on another worker
    replacement = 1 if schedule == "ray-async" else 2  # (worker indices count up from 0)
    new = [r for r in records if r["kind"] == "rollout" and r["worker"] == replacement]
    assert new, "the replacement worker ran no batch"
    if schedule == "gloo-async":
        assert [r["workers"] for r in records if r["kind"] == "scale"] == [2]
    elif schedule == "ray-async":  # no part waited behind the evaluation: none was redone
        assert summary["faults"] == []
    else:  # the part queued behind the evaluation died with its worker, and was redone
        assert [f["what"] for f in summary["faults"]] == ["rollout worker"]
        [fault] = [r for r in records if r["kind"] == "fault"]
        assert fault["error"].startswith("failed: ActorDiedError"), fault
        assert fault["batch"] == 1


@pytest.mark.slow
def test_a_failing_reward_function_stops_the_run_with_its_traceback(tmp_path, monkeypatch):
    (tmp_path / "badrewards.py").write_text("def fn(meta, text):\n    return meta['nope']\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the driver and the workers import it
    rows = [{"prompt": f"Say something #{i}"} for i in range(40)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out = _train(
        tmp_path, "task.name=custom", f"task.path={tmp_path / 'p.jsonl'}",
        "task.reward_fn=badrewards:fn", "run.name=bad", "run.steps=2", ONE_WORKER,
    )  # fmt: skip
    assert code == 2, out[-3000:]
    # one worker: 2 prompts x 2 samples, the first traceback quoted
    assert "the reward function failed for 4 of 4 responses" in out
    assert "KeyError: 'nope'" in out
    summary = json.loads((tmp_path / "runs/bad/summary.json").read_text())
    assert summary["status"] == "failed"
    # the reason stays with the run, not only on the terminal
    # the worker's id (the run key, then w and its index), then why
    key = (tmp_path / "runs/bad/run-key").read_text().strip()
    assert summary["error"].startswith(f"RewardError: {key}-w")
    assert "the reward function failed for 4 of 4 responses" in summary["error"]
    assert "KeyError: 'nope'" in summary["error"]
    log = (tmp_path / "runs/bad/logs/driver.log").read_text()
    assert f"the run failed: RewardError: {key}-w" in log


@pytest.mark.slow
def test_ctrl_c_mid_batch_then_resume_redoes_it_with_its_older_weights(tmp_path, monkeypatch):
    # Generation much slower than a step (the reward sleeps: 5 s a batch), offset 1: Ctrl-C
    # right after step s finds batch s+1 being generated with version s-1 for seconds more
    # than the learner's 2 s wait, so the stop abandons it. The checkpoint keeps those
    # weights and the resume redoes that batch with them: every lag stays the formula's.
    (tmp_path / "slowrewards.py").write_text(
        "import time\ndef fn(meta, text):\n    time.sleep(2.5)\n    return float(len(text))\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    rows = [{"prompt": f"Say something #{i}"} for i in range(40)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = [
        "task.name=custom", f"task.path={tmp_path / 'p.jsonl'}", "task.reward_fn=slowrewards:fn",
        "sync.offset=1", "run.checkpoint_every=100", "run.name=s",
    ]  # fmt: skip
    (tmp_path / "c.yaml").write_text(TINY)
    proc = staleflow("train", "c.yaml", *task, "run.steps=5", cwd=tmp_path)
    run = tmp_path / "runs/s"
    try:
        wait_for(lambda: status_of(run).get("step", 0) >= 2, 300, "step 2")
    finally:
        out = ctrl_c(proc)
    assert proc.returncode == 130, out[-3000:]
    latest = run / "checkpoints" / (run / "checkpoints/LATEST").read_text().strip()
    state = json.loads((latest / "trainer.json").read_text())["extra"]["driver"]
    step, running = state["flow"]["steps"], state["flow"]["running"]
    assert running  # batch -> [version, groups]: at least the next one was being generated
    for batch, (version, groups) in running.items():
        assert version == rollout_version(int(batch), 1, 1) < step
        assert groups == 2
        assert (latest / f"weights/weights-v{version:08d}.safetensors").is_file()

    code, out = _train_resume(tmp_path, run)
    assert code == 0, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert_reconciled(summary)
    assert summary["groups"]["pushed"] == summary["groups"]["trained"] == 10
    # the redone batch's parts that finished before the stop were counted twice
    assert summary["driver_counts"]["pushed_by_finished_batches"] == 10
    records = list(read_metrics(run / "metrics.jsonl"))
    assert [r["redo"] for r in records if r["kind"] == "resume"] == [sorted(map(int, running))]
    steps = steps_of(records)
    assert [r["step"] for r in steps] == list(range(1, 6))
    for r in steps:
        assert r["lag_min"] == r["lag_max"] == lag(r["step"], 1, 1)


def _checkpoint_files(path, driver: dict) -> None:
    """A checkpoint's files as check_resumable reads them (headers only): trainer.json with
    the driver's state, and tiny safetensors files."""
    import numpy as np
    from safetensors.numpy import save_file

    from staleflow.learner.checkpoint import FORMAT

    path.mkdir(parents=True)
    (path / "trainer.json").write_text(json.dumps({"format": FORMAT, "extra": {"driver": driver}}))
    for name in ("model", "rng", "optimizer"):
        save_file({"x": np.zeros(2, np.float32)}, str(path / f"{name}.safetensors"))


def test_a_run_stopped_during_its_last_step_may_still_resume(tmp_path):
    # Ctrl-C or SIGTERM during the last step: the step finishes and is checkpointed, but the
    # final evaluation never ran; a resume does it. Only a completed run has nothing left.
    run = RunDir.create(str(tmp_path), "last")
    last = run.checkpoints / "step-000005"
    state = {"format": STATE_FORMAT, "flow": {"steps": 5}, "prompts_per_batch": 2}
    _checkpoint_files(last, state)
    run.mark_latest_checkpoint(last)
    run.summary.write_text(json.dumps({"status": "interrupted", "steps": 5}))

    def cfg(steps: int):
        return parse_config(TINY, [f"run.steps={steps}"])

    check_resumable(run, cfg(5))  # allowed
    with pytest.raises(ResumeError, match=r"already trained 5 steps, and run\.steps is 4"):
        check_resumable(run, cfg(4))
    run.summary.write_text(json.dumps({"status": "completed", "steps": 5}))
    with pytest.raises(ResumeError, match="already trained 5 steps"):
        check_resumable(run, cfg(5))
    check_resumable(run, cfg(6))
    (run.path / "run-key").write_text("last 2\n")  # damaged: its buffer cannot be found
    with pytest.raises(ResumeError, match=r"holds 'last 2', not a run key"):
        check_resumable(run, cfg(6))


def _train_resume(tmp_path, run) -> tuple[int, str]:
    proc = staleflow("train", "--resume", str(run), cwd=tmp_path)
    out, _ = proc.communicate(timeout=500)
    return proc.returncode, out


def test_resume_refuses_what_it_cannot_do(tmp_path):
    resume_overrides_allowed(["run.steps=20", "rollout.num_workers=4"])
    with pytest.raises(ResumeError, match=r"learner.optimizer.lr cannot change when a run"):
        resume_overrides_allowed(["learner.optimizer.lr=0.1"])
    # A run with no checkpoint resumed with run.checkpoint_every=0 starts from step 0: the
    # resume's value says nothing of how the stopped run acked (a run of 10 stopped at step 5
    # was refused here); the buffer's count of acked trainings decides, once it is up (below,
    # in test_a_resume_refuses_a_missing_damaged_or_older_checkpoint_and_changes_nothing)
    cfg = parse_config(TINY, ["run.checkpoint_every=0"])
    run = RunDir.create(str(tmp_path), "none")
    resumed = load_resume(run, cfg)
    assert (resumed.checkpoint, resumed.step, resumed.flow.steps) == (None, 0, 0)
    cli = [sys.executable, "-m", "staleflow.cluster.cli", "train"]
    out = subprocess.run(
        [*cli, "--resume", str(tmp_path / "nowhere")], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "is not a staleflow run directory (no config.json)" in out.stderr
    out = subprocess.run(cli, capture_output=True, text=True)
    assert out.returncode == 2
    assert "give a run config" in out.stderr


def test_a_resume_refuses_a_missing_damaged_or_older_checkpoint_and_changes_nothing(
    tmp_path, ray_local
):
    # Each of these used to go ahead: a missing LATEST target or an older checkpoint resumed
    # from there (or from step 0), cut metrics.jsonl back, then waited 30 s for groups the
    # buffer had already acked and failed; a damaged file failed after Ray started and
    # rewrote summary.json as "failed after 0 steps, MISMATCH"; an edited config.json
    # trained the rest of the run with another loss.
    _cfg, run, first, _ = run_driver(
        tmp_path,
        "run.name=d",
        "run.checkpoint_every=2",
        "run.steps=4",
        "run.tensorboard=true",
        "run.report=true",  # (the refusals leave it as it was)
        ONE_WORKER,
    )
    assert first["status"] == "completed"
    ckpt = run.checkpoints / "step-000004"

    def files() -> dict[str, bytes]:
        """Every file of the run directory but the log, Redis' own files, the lock and the
        shared-storage token every start writes (cluster.storage)."""
        return {
            str(p.relative_to(run.path)): p.read_bytes()
            for p in run.path.rglob("*")
            if p.is_file() and p.name not in (".lock", ".staleflow-shared")
            and p.parts[len(run.path.parts)] not in ("logs", "redis")
        }  # fmt: skip

    log = run.path / "logs/driver.log"

    def refused(*messages: str, by_the_buffer: bool = False) -> None:
        before = files()
        logged = log.stat().st_size if log.exists() else 0  # (the CLI writes it)
        proc = staleflow("train", "--resume", str(run.path), "run.steps=6", cwd=tmp_path)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 2, out[-3000:]
        for message in messages:
            assert message in out, out[-3000:]
        assert "Traceback" not in out
        assert files() == before  # nothing in the run directory changed
        if by_the_buffer:  # refused once the buffer was reached, before any actor started
            with log.open() as f:
                f.seek(logged)
                this = f.read()
            assert "resuming with the buffer as left" in this, this[-3000:]
            assert "services: placement: " not in this, this[-3000:]  # (once every actor is up)

    config = run.config.read_text()
    run.config.write_text(config.replace('"name": "rec-oneside-nois"', '"name": "rec-oneside-is"'))
    refused('learner.loss.name is "rec-oneside-is" in', 'but "rec-oneside-nois" in the checkpoint')
    run.config.write_text(config)

    run.mark_latest_checkpoint(run.checkpoints / "step-000002")
    refused("acknowledged the groups of its checkpoint at step 4 (metrics.jsonl), but "
            "step-000002 holds step 2", "restore")  # fmt: skip
    run.mark_latest_checkpoint(ckpt)

    optimizer = (ckpt / "optimizer.safetensors").read_bytes()
    (ckpt / "optimizer.safetensors").write_bytes(optimizer[:1000])
    refused(f"{ckpt / 'optimizer.safetensors'}: corrupt")
    (ckpt / "optimizer.safetensors").write_bytes(optimizer)

    ckpt.rename(tmp_path / "aside")
    refused(f"{run.checkpoints / 'LATEST'} names step-000004, which is missing")
    (tmp_path / "aside").rename(ckpt)

    # without metrics.jsonl's record of the later checkpoint, the buffer's own count of acked
    # trainings still refuses the older one, once Ray and Redis are up and before any actor
    # starts (Driver._check_buffer_as_left): status.json is put back, summary, report and
    # metrics are left alone
    kept = [r for r in read_metrics(run.metrics) if r["kind"] != "checkpoint"]
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
    run.mark_latest_checkpoint(run.checkpoints / "step-000002")
    refused(
        "the buffer has acknowledged 8 trainings, but", "step-000002 counts 4", by_the_buffer=True
    )
    # and with no checkpoint at all (removed here; or a run of run.checkpoint_every=0, whose
    # groups were acked as trained, stopped before its final one): it named "a later
    # checkpoint", and with checkpoint_every=0 in the resume's overrides it was refused
    # before looking, even for a run that had acked nothing
    (run.checkpoints / "LATEST").unlink()
    run.checkpoints.rename(tmp_path / "checkpoints-aside")
    run.checkpoints.mkdir()
    refused("has no checkpoint, but the buffer has acknowledged 8 trainings: its groups were "
            "acked as they were trained", by_the_buffer=True)  # fmt: skip
    run.checkpoints.rmdir()
    (tmp_path / "checkpoints-aside").rename(run.checkpoints)

    # a buffer that lost its data (here the embedded server's files are gone; a Redis
    # restarted empty alike): the groups pushed and not trained were gone, and the resumed
    # run went on with counts that no buffer held
    import shutil

    import redis

    from staleflow.buffer.entries import RunKeys
    from staleflow.buffer.server import RedisServer, redis_dir

    run.mark_latest_checkpoint(ckpt)
    # a buffer that lost its last writes with its machine (Redis fsyncs its log once a
    # second; since 2026-11-28 the embedded one also at each checkpoint, whose marker is
    # checked here, but an external one need not): fewer groups pushed than the checkpoint
    # counts, here its pushed counter set back by 2 as the lost pushes would leave it. Only
    # an empty buffer was refused: this resume waited for groups that were gone, then
    # failed as stalled, blaming duplicates or another run
    with RedisServer(redis_dir(run.path), persistence=True) as server:
        client = redis.Redis.from_url(server.url)
        assert client.exists(RunKeys(run.key).prefix + "checkpointed") == 1  # sync_log ran
        client.hincrby(RunKeys(run.key).stats, "pushed", -2)
        client.close()
    refused(
        "the replay buffer has 6 groups pushed and 8 trainings acknowledged, but",
        "counts 8 pushed and 8 trained: this is not the run's buffer, or it lost its data",
        "fewer pushed than counted, a Redis whose machine went down before its log",
        by_the_buffer=True,
    )
    shutil.rmtree(redis_dir(run.path))
    refused(
        "the replay buffer has 0 groups pushed and 0 trainings acknowledged, but",
        "counts 8 pushed and 8 trained: this is not the run's buffer, or it lost its data",
        by_the_buffer=True,
    )


def test_a_resume_refuses_a_task_file_edited_since_its_checkpoint(tmp_path, ray_local):
    # An edited task file used to be read as it was now: the resumed run redid its batches
    # with other prompts under the same group ids and trained on a different stream, silently.
    rows = [{"prompt": f"Say something #{i}", "target": i} for i in range(40)]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = [
        "task.name=custom",
        f"task.path={data}",
        "task.reward_fn=tests.integration.rewards:length",
    ]
    args = [*task, "run.name=t", "run.checkpoint_every=1", ONE_WORKER]
    cfg, run, first, _ = run_driver(tmp_path, *args, "run.steps=2")
    assert first["status"] == "completed"
    state = json.loads((run.checkpoints / "step-000002/trainer.json").read_text())["extra"]
    n = state["driver"]["flow"]["batches"] * 2  # prompts taken: 2 per batch started
    assert state["driver"]["prompts"]["taken"] == n >= 4
    before = {p: p.read_bytes() for p in (run.metrics, run.config, run.summary)}

    def resume():
        cfg = parse_config(TINY, [f"run.output_dir={tmp_path}", *args, "run.steps=3"])
        return Driver(cfg, RunDir(run.path), resume=True).run()

    # one field (metadata: the reward may read it) of one row the run trained on
    taken = PromptStream(make_task(cfg.task).train_prompts()).take(n)
    line = int(taken[0].prompt_id.split(":")[1])  # custom:<line number>
    edited = [dict(r, target=-1) if j == line - 1 else r for j, r in enumerate(rows)]
    data.write_text("".join(json.dumps(r) + "\n" for r in edited))
    with pytest.raises(ResumeError, match="the task's training prompts changed since") as exc:
        resume()
    assert f"the {n} prompts its batches took are not the {n} the task gives now" in str(exc.value)
    assert {p: p.read_bytes() for p in before} == before  # nothing of the run changed

    data.write_text("".join(json.dumps(r) + "\n" for r in rows))  # put back: it resumes
    assert resume()["status"] == "completed"


def test_a_resumed_run_trains_as_the_uninterrupted_run(tmp_path, ray_local):
    # A batch redone after the resume, or first run by a new worker process, used to sample
    # other responses (its seed counted the worker's own batches, from 0 in every new
    # process): from the first step after the checkpoint, the runs diverged.
    args = ["run.checkpoint_every=2", "sync.offset=1", ONE_WORKER]
    _cfg, _whole, _, whole = run_driver(tmp_path, "run.name=whole", *args, "run.steps=5")
    _cfg, part, _, records = run_driver(tmp_path, "run.name=part", *args, "run.steps=3")
    # as a batch that finished after the checkpoint at step 3 (before a kill -9) records it
    rollouts = [r for r in records if r["kind"] == "rollout"]
    late = {**rollouts[-1], "batch": max(r["batch"] for r in rollouts) + 1, "late": True}
    with part.metrics.open("a") as f:
        f.write(json.dumps(late) + "\n")
    cfg = parse_config(TINY, [f"run.output_dir={tmp_path}", "run.name=part", *args, "run.steps=5"])
    assert Driver(cfg, RunDir(part.path), resume=True).run()["status"] == "completed"
    resumed = list(read_metrics(part.metrics))
    for key in ("reward_mean", "loss", "grad_norm"):
        a, b = [r[key] for r in steps_of(whole)], [r[key] for r in steps_of(resumed)]
        assert b == pytest.approx(a, rel=1e-4, abs=1e-7), key
    # one record per batch and per evaluation: the batch finished after the checkpoint at
    # step 3 and the final evaluation of step 3 are not counted twice
    batches = [(r["batch"], r["worker"]) for r in resumed if r["kind"] == "rollout"]
    assert len(batches) == len(set(batches))
    assert not [r for r in resumed if r.get("late")]  # the resume made that batch again
    evals = [r["step"] for r in resumed if r["kind"] == "eval"]
    assert len(evals) == len(set(evals))
