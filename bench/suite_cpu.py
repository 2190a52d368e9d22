"""Where the test suite's CPU goes: a pytest plugin that records each test's CPU seconds, and
the report of what it recorded, per file and per test.

    PYTHONPATH=bench .venv/bin/pytest -p suite_cpu -n 2 --dist loadgroup [TESTS]
    .venv/bin/python bench/suite_cpu.py [--top 40] [DIR]

CI's time is the suite's CPU: on 2 cores its runs keep both busy (93% over a whole `make
test`), so a test costs what its processes burn, not its wall time (a test that waits leaves
the cores to the other pytest process). A test's CPU is that of every process whose
environment carries the mark its pytest process sets (SUITE_CPU_OWNER: the process itself, a
Ray it started, Ray's daemons, which leave the process tree, the actors of its runs, a
`staleflow train` it ran and all of that one's processes; not a process started with an
environment of its own). A thread samples them every 0.25 s, and its own CPU counts too; a
process's last-seen user+system time counts after it exits, so the figures are a little low.
Each test's share is the growth of that sum from its setup to its teardown. Records go to
DIR (default .cache/suite-cpu), one JSON line per test, cleared at the session's start.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

TICK = os.sysconf("SC_CLK_TCK")
DIR = Path(os.environ.get("SUITE_CPU_DIR", ".cache/suite-cpu")).resolve()
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
_TAG = f"SUITE_CPU_OWNER={os.getpid()}".encode()  # inherited by what this process starts
_ours: dict[tuple[int, str], bool] = {}  # (pid, start time) -> whether it is this worker's
_cpu: dict[tuple[int, str], float] = {}  # (pid, start time) -> last-seen CPU seconds
_lock = threading.Lock()


def _sample() -> None:
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        key = (int(name), fields[19])  # a pid reused later is another process
        if key not in _ours:
            try:
                env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            _ours[key] = int(name) == me or _TAG in env
        if _ours[key]:
            seconds = (int(fields[11]) + int(fields[12])) / TICK
            with _lock:
                _cpu[key] = max(_cpu.get(key, 0.0), seconds)


def _total() -> float:
    with contextlib.suppress(Exception):  # (the sampler's last round stands)
        _sample()
    with _lock:
        return sum(_cpu.values())


def _sampler() -> None:
    pause = threading.Event()  # never set: its wait is the pause, not time.sleep, which tests
    while True:  # patch to record their own back-offs (test_buffer.py's `waits`)
        with contextlib.suppress(Exception):  # a process gone mid-read: the next round
            _sample()
        pause.wait(0.25)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        shutil.rmtree(DIR, ignore_errors=True)
    DIR.mkdir(parents=True, exist_ok=True)
    os.environ["SUITE_CPU_OWNER"] = str(os.getpid())


_sampling: list[threading.Thread] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not _sampling:  # (in a process that runs tests: not xdist's controller)
        _sampling.append(threading.Thread(target=_sampler, name="suite-cpu", daemon=True))
        _sampling[0].start()
    cpu, wall = _total(), time.monotonic()
    yield
    record = {"test": item.nodeid, "cpu_s": round(_total() - cpu, 2),
              "wall_s": round(time.monotonic() - wall, 2)}  # fmt: skip
    with (DIR / f"{WORKER}.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", nargs="?", type=Path, default=DIR)
    parser.add_argument("--top", type=int, default=40, help="tests listed (most CPU first)")
    args = parser.parse_args()
    records = [json.loads(line) for path in sorted(args.dir.glob("*.jsonl"))
               for line in path.read_text().splitlines()]  # fmt: skip
    if not records:
        raise SystemExit(f"no records in {args.dir}: run pytest with -p suite_cpu first")
    total = sum(r["cpu_s"] for r in records)
    print(f"{len(records)} tests, {total:.0f} CPU-s, {sum(r['wall_s'] for r in records):.0f} "
          "s of test wall time (summed over the pytest processes)\n")  # fmt: skip
    by_file: collections.Counter[str] = collections.Counter()
    for r in records:
        by_file[r["test"].split("::")[0]] += r["cpu_s"]
    print(f"{'CPU-s':>8} {'share':>6}  file")
    for name, cpu in by_file.most_common():
        if cpu >= 1:
            print(f"{cpu:8.1f} {cpu / total:6.1%}  {name}")
    print(f"\n{'CPU-s':>8} {'wall-s':>7}  test (the {args.top} costliest)")
    for r in sorted(records, key=lambda r: -r["cpu_s"])[: args.top]:
        print(f"{r['cpu_s']:8.1f} {r['wall_s']:7.1f}  {r['test']}")


if __name__ == "__main__":
    main()
