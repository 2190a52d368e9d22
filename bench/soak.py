"""Soak: a long run under random kills; reports memory over time and what was lost.

    python bench/soak.py [--minutes 10] [--every 30] [--seed 0] [--out /tmp/staleflow-soak]

Runs `staleflow train` on the tiny model (lock-step, lag 1, a checkpoint every 3 steps, an
endless step count) and, every `--every` seconds (+-50%, seeded), SIGKILLs one part chosen at
random: a rollout worker, the Redis server, a learner rank, or the driver itself. A run the
kill stopped (learner rank, driver) is resumed with `staleflow train --resume`. Every 10 s it
samples the resident memory of the driver's process tree (Ray's workers, the learner, Redis)
and the stream's length. At the end the run is stopped with Ctrl-C and checked:
pushed = trained + dropped + left in the buffer (the summary's reconciliation), each learner
step recorded once, no group trained twice (the trajectory record).

Targets: nothing lost, nothing trained twice, memory flat (last sample vs the first after
warm-up). Not in CI (10 minutes); the closing note of the resilience issue quotes a run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIG = """
model: {preset: tiny}
task: {name: digits, chat_template: false, eval_prompts: 0}
rollout: {num_workers: 2, prompts_per_batch: 2, group_size: 2, max_new_tokens: 4}
learner: {optimizer: {lr: 1.0e-3}, loss: {name: rec-oneside-nois}}
sync: {mode: lockstep, interval: 1, offset: 1}
run: {name: soak, steps: 10000000, checkpoint_every: 3, tensorboard: false}
"""

PARTS = ("rollout worker", "redis", "learner rank", "driver")


def tree(root: int) -> list[int]:
    """`root` and every live process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def named(root: int, name: bytes) -> list[int]:
    out = []
    for pid in tree(root):
        try:
            if name in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return out


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def status(run: Path) -> dict:
    try:
        return json.loads((run / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    log = open(cwd / "soak.log", "a")  # noqa: SIM115 (kept open for the child)
    return subprocess.Popen(
        [sys.executable, "-m", "staleflow.cluster.cli", "train", *args],
        cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def wait_running(proc: subprocess.Popen, run: Path, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the run exited with {proc.returncode}; see soak.log")
        if status(run).get("state") == "running" and named(proc.pid, b"ray::LearnerRank"):
            return
        time.sleep(0.2)
    raise SystemExit("the run did not start within 5 minutes; see soak.log")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long to soak [10]")
    p.add_argument("--every", type=float, default=30.0, help="seconds between kills [30]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/staleflow-soak", help="working directory")
    args = p.parse_args()
    rng = random.Random(args.seed)
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    (work / "soak.yaml").write_text(CONFIG)
    run = work / "runs" / "soak"
    if run.exists():
        raise SystemExit(f"{run} exists: remove it or pass another --out")

    proc = start(["soak.yaml"], work)
    wait_running(proc, run)
    began = time.time()
    end = began + args.minutes * 60
    next_kill = began + args.every * rng.uniform(0.5, 1.5)
    samples: list[tuple[float, int, float]] = []  # (seconds, step, MB)
    kills: list[dict] = []
    next_sample = began
    while time.time() < end:
        now = time.time()
        if now >= next_sample:
            samples.append((now - began, int(status(run).get("step", 0)), rss_mb(tree(proc.pid))))
            print(f"{now - began:6.0f} s  step {samples[-1][1]:5d}  {samples[-1][2]:7.0f} MB",
                  flush=True)  # fmt: skip
            next_sample += 10
        if now >= next_kill:
            part = rng.choice(PARTS)
            step = int(status(run).get("step", 0))
            if part == "rollout worker":
                pids = named(proc.pid, b"ray::RolloutWorker")
            elif part == "learner rank":
                pids = named(proc.pid, b"ray::LearnerRank")
            elif part == "redis":
                pids = [json.loads((run / "redis/server.json").read_text())["pid"]]
            else:
                pids = [proc.pid]
            if pids:
                os.kill(rng.choice(pids), signal.SIGKILL)
                kills.append({"part": part, "step": step, "at_s": round(now - began, 1)})
                print(f"{now - began:6.0f} s  killed the {part} at step {step}", flush=True)
            if part in ("learner rank", "driver"):
                proc.wait(timeout=300)
                time.sleep(2)  # let the actors of the dead driver go
                restarted = time.time()
                proc = start(["--resume", str(run)], work)
                wait_running(proc, run)
                kills[-1]["resumed_in_s"] = round(time.time() - restarted, 1)
            next_kill = time.time() + args.every * rng.uniform(0.5, 1.5)
        if proc.poll() is not None:
            raise SystemExit(f"the run exited with {proc.returncode} unasked; see soak.log")
        time.sleep(0.2)

    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=600)
    summary = json.loads((run / "summary.json").read_text())
    lines = [json.loads(x) for x in (run / "trajectories/steps.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in lines]
    ids = [g for x in lines for g, _ in x["groups"]]
    groups = summary["groups"]
    warm = [mb for s, _, mb in samples if s >= 60] or [mb for _, _, mb in samples]
    report = {
        "minutes": args.minutes,
        "steps": summary["steps"],
        "kills": kills,
        "groups": groups,
        "steps_recorded_once": steps == list(range(1, len(steps) + 1)),
        "groups_trained_twice": len(ids) - len(set(ids)),
        "lost": groups["pushed"]
        - groups["trained"]
        - groups["dropped_stale"]
        - groups["dropped_invalid"]
        - groups["left_in_buffer"],
        "memory_mb": {
            "first_after_warmup": warm[0],
            "last": warm[-1],
            "median": statistics.median(warm),
            "last_over_first": warm[-1] / warm[0],
        },
        "recovery_s": summary.get("faults", []),
    }
    (work / "soak.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    ok = (
        groups["reconciled"]
        and report["lost"] == 0
        and report["groups_trained_twice"] == 0
        and report["steps_recorded_once"]
    )
    print("soak:", "nothing lost, nothing trained twice" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
