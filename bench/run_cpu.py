"""Where a tiny `staleflow train` spends its CPU, per role: median of several runs.

    python bench/run_cpu.py [--rounds 3] [--steps 5]

Each round runs the tests' TINY config (tests/integration/tiny.py: 2 rollout workers, 1
learner rank, 2 x 2 samples x 4 tokens per batch) for `--steps` steps, as a CLI process
starting its own Ray, as most of the test suite's runs do. While it runs, every process on
the machine is sampled from /proc every 0.2 s; each one's CPU time since the run began is
attributed by its command line to a role: the driver (the CLI process), the learner rank,
the rollout workers, idle Ray workers (`ray::IDLE`, started for nothing a run uses), Ray's
own processes (GCS, raylet, agents, monitors), Redis, and the rest of the machine. A process
that lives less than one sample, and the last 0.2 s of each, are missed: the figures are a
little low. Run it on an otherwise idle machine.

Printed: per role, the median CPU-s over the rounds; the run's wall time; and the steps'
share, from the run's own summary (its steps take a fraction of a second: a test run's cost is
starting and stopping the actors, which is what the suite's CI time is made of).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
ROLES = ("driver", "learner rank", "rollout workers", "idle ray workers", "ray itself",
         "redis", "other")  # fmt: skip


def cpu_times() -> dict[int, tuple[float, str]]:
    """Every process's user+system CPU seconds and command line."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        out[int(name)] = ((int(fields[11]) + int(fields[12])) / TICK, cmd)
    return out


def role(pid: int, cmd: str, driver: int) -> str:
    if pid == driver:
        return "driver"
    if cmd.startswith("ray::LearnerRank"):
        return "learner rank"
    if cmd.startswith("ray::RolloutWorker"):
        return "rollout workers"
    if cmd.startswith("ray::IDLE"):
        return "idle ray workers"
    if "redis-server" in cmd:
        return "redis"
    if cmd.startswith("ray::") or "/site-packages/ray/" in cmd:
        return "ray itself"
    return "other"


def one_round(directory: Path, steps: int) -> tuple[dict[str, float], float, float]:
    before = cpu_times()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "staleflow.cluster.cli", "train", "c.yaml", "run.name=r",
         f"run.steps={steps}", f"run.output_dir={directory}"],
        cwd=directory, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    last: dict[int, tuple[float, str]] = {}
    while proc.poll() is None:
        for pid, (cpu, cmd) in cpu_times().items():
            if pid != os.getpid():
                # the latest title: an actor's process is ray::IDLE until it becomes one
                last[pid] = (cpu, cmd or last.get(pid, (0.0, ""))[1])
        time.sleep(0.2)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"the run failed (exit {proc.returncode}):\n{proc.stderr.read()[-3000:]}")
    per_role = dict.fromkeys(ROLES, 0.0)
    for pid, (cpu, cmd) in last.items():
        per_role[role(pid, cmd, proc.pid)] += cpu - before.get(pid, (0.0, ""))[0]
    summary = json.loads((directory / "r" / "summary.json").read_text())
    return per_role, wall, float(summary["wall_s"])  # from the first step's start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    sys.path.insert(0, str(REPO))
    from tests.integration.tiny import TINY

    rows, walls, trains = [], [], []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="staleflow-run-cpu-") as tmp:
            (Path(tmp) / "c.yaml").write_text(TINY)
            per_role, wall, train = one_round(Path(tmp), args.steps)
        rows.append(per_role)
        walls.append(wall)
        trains.append(train)
        total = sum(per_role.values())
        print(f"round {i + 1}/{args.rounds}: {total:.1f} CPU-s, {wall:.1f} s", flush=True)
    print(f"\ntiny staleflow train, {args.steps} steps, on {os.cpu_count()} cores, "
          f"median of {args.rounds} rounds")  # fmt: skip
    for name in ROLES:
        print(f"{name:<18}{statistics.median(r[name] for r in rows):>8.2f} CPU-s")
    print(f"{'all':<18}{statistics.median(sum(r.values()) for r in rows):>8.2f} CPU-s")
    wall, train = statistics.median(walls), statistics.median(trains)
    print(f"wall {wall:.1f} s, of which steps {train:.2f} s ({train / wall:.1%})")


if __name__ == "__main__":
    main()
