"""Starting a local Ray with and without prestarted idle workers, side by side in one run.

    python bench/ray_start.py [--rounds 5]

Every Ray that `ray.init` starts prestarts idle Python workers for its first driver (one per
CPU, up to the machine's cores). staleflow's actors carry a runtime_env (their thread
counts), so they cannot use those workers: each is started for nothing. staleflow turns
prestarting off for the Rays it starts (`placement.NO_PRESTART`); this measures what that
saves.

Each round starts, in a fresh process, a local Ray: "off" through `placement.start_ray`, as
`staleflow train` does (loopback, no dashboard, the machine's CPUs plus the scale headroom),
"on" with the same `ray.init` arguments but Ray's default prestarting; then one actor
with a runtime_env that imports torch (as every staleflow actor does), calls it once, waits
4 s (the idle workers finish starting), counts the idle workers and shuts down. Printed per
setting, median of the rounds (on and off alternate, so drift hits both): CPU seconds the
whole machine spent (from /proc/stat: run it on an otherwise idle machine), seconds until the
first actor call answered, wall seconds, and the idle workers seen; then the ratios off/on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROUND = r"""
import json, os, subprocess, sys, time
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
import ray
from staleflow.cluster.placement import SCALE_HEADROOM, start_ray

def busy():  # CPU seconds the machine spent (all processes), not idle or iowait
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")

c0, t0 = busy(), time.perf_counter()
if sys.argv[1] == "on":  # start_ray's arguments for a run without an object store size
    ray.init(address="local", num_cpus=(os.cpu_count() or 1) + SCALE_HEADROOM,
             include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
else:
    start_ray(None, log_to_driver=False)

@ray.remote(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
class Actor:
    def ready(self):
        import torch  # noqa: F401  (as every staleflow actor imports it)
        return os.getpid()

ray.get(Actor.remote().ready.remote())
first = time.perf_counter() - t0
time.sleep(4)
ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
idle = sum(1 for line in ps.splitlines() if line.startswith("ray::IDLE"))
ray.shutdown()
print(json.dumps({"cpu_s": busy() - c0, "first_call_s": first,
                  "wall_s": time.perf_counter() - t0, "idle_workers": idle}))
"""


def one_round(mode: str) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", ROUND, mode],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"a round failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    rows: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for i in range(args.rounds):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        for mode in order:
            rows[mode].append(one_round(mode))
            print(f"round {i + 1}/{args.rounds} prestart {mode}: {rows[mode][-1]}", flush=True)
            time.sleep(2)  # the last round's processes finish exiting
    keys = ("cpu_s", "first_call_s", "wall_s", "idle_workers")
    med = {m: {k: statistics.median(r[k] for r in rows[m]) for k in keys} for m in rows}
    print(f"\nlocal Ray on {os.cpu_count()} cores, median of {args.rounds} rounds")
    print(f"{'prestart':<9}" + "".join(f"{k:>14}" for k in keys))
    for mode in ("on", "off"):
        print(f"{mode:<9}" + "".join(f"{med[mode][k]:>14.2f}" for k in keys))
    for k in ("cpu_s", "first_call_s", "wall_s"):
        print(f"off/on {k}: {med['off'][k] / med['on'][k]:.2f}x")


if __name__ == "__main__":
    main()
