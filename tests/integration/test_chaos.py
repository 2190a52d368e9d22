"""The chaos run: during one `staleflow train`, SIGKILL a rollout worker, the Redis server, a
learner rank and finally the driver (resuming after each stop), then check that nothing was
lost or trained twice, the lock-step lags never left the formula, and the losses are those of
an undisturbed learner on the same groups (`staleflow replay`).

Everything is real: the processes are found under the driver's process tree and killed with
SIGKILL, as the OOM killer or a lost node would.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from staleflow.cluster.rundir import read_metrics
from staleflow.cluster.schedule import lag
from tests.integration.test_system import (
    alive,
    assert_reconciled,
    descendants,
    staleflow,
    status_of,
    wait_for,
)
from tests.integration.tiny import TINY

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 30


def _config() -> str:
    # TINY ends with its own run section: replace it rather than add a second one
    base = TINY.replace("run: {tensorboard: false, report: false}\n", "")
    return base + (
        "sync: {mode: lockstep, interval: 1, offset: 1}\n"
        f"run: {{steps: {STEPS}, checkpoint_every: 3, tensorboard: false, report: false, "
        "name: chaos}\n"
    )


def _named(root: int, name: bytes) -> list[int]:
    """Processes under `root` whose command line (Ray sets it to ray::Class.method) has
    `name`."""
    out = []
    for pid in descendants(root):
        try:
            if name in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return sorted(out)


def _step(run: Path) -> int:
    return int(status_of(run).get("step", 0) or 0)


def _until(predicate, timeout_s: float, what: str):
    """`wait_for`, polling often: the tiny run makes several steps a second."""
    return wait_for(predicate, timeout_s, what, poll_s=0.05)


@pytest.mark.timeout(1500)  # several runs one after another: each wait is a hang guard
def test_chaos_run_loses_nothing_and_trains_nothing_twice(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(_config())
    run = tmp_path / "runs" / "chaos"
    killed: list[tuple[str, int, float]] = []  # (what, step when killed, time)

    def kill(pid: int, what: str) -> None:
        killed.append((what, _step(run), time.time()))
        os.kill(pid, signal.SIGKILL)

    proc = staleflow("train", "c.yaml", cwd=tmp_path)
    try:
        # 1. a rollout worker, in the middle of a batch
        _until(lambda: _step(run) >= 2, 300, "step 2")
        workers = _until(lambda: _named(proc.pid, b"ray::RolloutWorker"), 30, "a worker")
        kill(workers[0], "rollout worker")
        # 2. the Redis server
        at = _step(run)
        _until(lambda: _step(run) >= at + 2, 300, "two more steps")
        kill(json.loads((run / "redis/server.json").read_text())["pid"], "redis")
        # 3. the learner rank: the run stops, resumable
        at = _step(run)
        _until(lambda: _step(run) >= at + 2, 300, "two more steps after Redis died")
        kill(_named(proc.pid, b"ray::LearnerRank")[0], "learner rank")
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    stopped = json.loads((run / "summary.json").read_text())
    assert stopped["status"] == "failed"
    assert stopped["resume"] == "staleflow train --resume runs/chaos"  # relative to cwd
    assert "resume: staleflow train --resume" in out
    faults = {f["what"]: f for f in stopped["faults"]}
    assert {"rollout worker", "redis"} <= set(faults), stopped["faults"]

    # 4. resume, then SIGKILL the driver itself
    resumed_in = []  # seconds from `train --resume` to the first step after the checkpoint
    launched = time.time()
    proc = staleflow("train", "--resume", str(run), cwd=tmp_path)
    try:
        at = _until(lambda: status_of(run).get("state") == "running" and _step(run), 300, "resume")
        _until(lambda: _step(run) > at, 300, "a step after the resume")
        resumed_in.append(time.time() - launched)
        _until(lambda: _step(run) >= at + 2, 300, "two steps after the resume")
        ours = [
            *_named(proc.pid, b"ray::RolloutWorker"),
            *_named(proc.pid, b"ray::LearnerRank"),
            *_named(proc.pid, b"redis-server"),
        ]
        kill(proc.pid, "driver")
        proc.wait(timeout=60)
        # the actors fate-share with their driver, Redis has a parent-death signal (Ray's
        # own agents notice their raylet is gone later, by themselves)
        _until(lambda: not any(alive(p) for p in ours), 60, "the actors and Redis to exit")
    finally:
        if proc.poll() is None:
            proc.kill()

    # 5. resume once more: the run completes
    started = time.time()
    proc = staleflow("train", "--resume", str(run), cwd=tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["steps"] == STEPS

    # pushed = trained + dropped + left, by the buffer's counters and the driver's
    assert_reconciled(summary)
    groups = summary["groups"]
    assert groups["pushed"] == groups["trained"] == STEPS * 2  # 2 prompts per batch
    assert groups["dropped_stale"] == groups["dropped_invalid"] == groups["left_in_buffer"] == 0

    # no step counted twice, every lag the formula's
    records = list(read_metrics(run / "metrics.jsonl"))
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert r["lag_min"] == r["lag_max"] == r["lag_expected"] == lag(r["step"], 1, 1)

    # no group trained twice: the trajectory record, one line per step
    lines = [json.loads(x) for x in (run / "trajectories/steps.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
    ids = [gid for x in lines for gid, _ in x["groups"]]
    assert len(ids) == len(set(ids)) == STEPS * 2

    # the losses are an undisturbed learner's on the same groups
    replay = staleflow("replay", str(run), cwd=tmp_path)
    out_replay, _ = replay.communicate(timeout=600)
    assert replay.returncode == 0, out_replay[-3000:]

    resumes = [r for r in records if r["kind"] == "resume"]
    assert len(resumes) == 2
    faults = summary["faults"]
    with capsys.disabled():
        print("\nchaos run: recovery per fault")
        for f in faults:
            print(f"  {f['what']:<15} at step {f['step']:>2}: recovered in {f['recovery_s']:.1f} s")
        for what, step, _ in killed:
            if what in ("learner rank", "driver"):
                print(f"  {what:<15} at step {step:>2}: stopped; resumed with train --resume")
        # the last resume: its first step's record (the earlier one's was cut back)
        first = next(r for r in steps if r["step"] == resumes[-1]["step"] + 1)
        resumed_in.append(first["time"] - started)
        for r, seconds in zip(resumes, resumed_in, strict=True):
            print(
                f"  resume at step {r['step']:>2}: first step {seconds:.1f} s after `train "
                f"--resume` started (checkpoint load and buffer recovery {r['restore_s']:.2f} "
                f"s), {r['recovered']} group(s) recovered, batches redone {r['redo']}"
            )
        print(f"  last resume to completion: {time.time() - started:.0f} s; groups {groups}")
