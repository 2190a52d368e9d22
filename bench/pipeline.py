"""The whole pipeline, lock-step against async, in one run: real Ray, Redis, learner, workers.

    python bench/pipeline.py [--model tiny|smollm2] [--steps 30] [--workers 2] [--engine hf]

Both runs use the same settings except the schedule: lockstep on-policy (sync.interval 1,
offset 0) and async with buffer.max_staleness 1. From each run's metrics.jsonl, over the
steps after the first (start-up excluded), it prints medians of:
  interval   between two learner steps, as the driver sees them finish;
  learner    the learner's step itself (forward, backward, optimizer);
  rollout    one rollout batch (the slowest shard of a split lock-step batch; generation plus
             weight loading);
  overhead   the step period / max(learner, rollout per step): 1.0 means nothing but the
             slower side counts. The period is the mean over the window (the span that
             groups/s uses; the median interval's form is printed beside it), and rollout per
             step is a batch's time, divided by the workers in async (each makes whole
             batches; lock-step splits one batch over them);
and, over the same steps, the busy fractions (learner step time / wall time; rollout batch
time / (wall time x workers)), trained groups per second, and async / lockstep throughput
(plus the ratio of the two median intervals, which outliers do not move). No run checkpoints
before its end (run.checkpoint_every 0): a checkpoint is not the pipeline, and one in the
middle of a short run moved the throughput ratio towards 1. The step
timeline (take, ack, publish, load, other) shows where any overhead went. Targets
(issue [Dataflow]): overhead <= 1.1 in async on a GPU; async >= 1.8x lockstep on-policy
throughput where learner and rollout can overlap.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from typing import Any

from staleflow.cluster.driver import Driver
from staleflow.cluster.placement import start_ray
from staleflow.cluster.rundir import RunDir, read_metrics
from staleflow.configs import parse_config

MODELS = {
    "tiny": """
model: {preset: tiny}
task: {name: digits, chat_template: false, eval_prompts: 0}
rollout: {prompts_per_batch: 4, group_size: 8, max_new_tokens: 8}
learner: {optimizer: {lr: 1.0e-3}, loss: {name: rec-oneside-nois}}
run: {tensorboard: false, eval_every: 0, record_trajectories: false, checkpoint_every: 0}
""",
    "smollm2": """
model: {preset: smollm2-135m}
task: {name: arithmetic, difficulty: 1, operations: ["+"], eval_prompts: 0}
rollout: {prompts_per_batch: 8, group_size: 8, max_new_tokens: 32}
learner: {micro_batch_size: 32, optimizer: {lr: 5.0e-5}, loss: {name: rec-oneside-nois}}
run: {tensorboard: false, eval_every: 0, record_trajectories: false, checkpoint_every: 0}
""",
}

SCHEDULES = {
    "lockstep": ["sync.mode=lockstep", "sync.interval=1", "sync.offset=0"],
    "async": ["sync.mode=async", "sync.interval=1", "buffer.max_staleness=1"],
}


def run_once(text: str, overrides: list[str], directory: str, workers: int) -> dict[str, Any]:
    cfg = parse_config(text, [f"run.output_dir={directory}", *overrides])
    run = RunDir.create(directory, cfg.run.name or "bench")
    summary = Driver(cfg, run).run()
    if summary["status"] != "completed":
        raise RuntimeError(f"the {overrides[0]} run ended {summary['status']}: see {run.path}")
    records = list(read_metrics(run.metrics))
    every = [r for r in records if r["kind"] == "step"]
    steps = every[1:]  # the first step includes start-up
    shards: dict[int, float] = defaultdict(float)
    for r in records:  # the batches finished after the first step, as the medians leave it out
        if r["kind"] == "rollout" and r["time"] > every[0]["time"]:
            # a lock-step batch is done when its slowest shard is
            shards[r["batch"]] = max(shards[r["batch"]], r["generate_s"] + r.get("load_s", 0.0))
    if "time_interval_s" not in steps[0]:  # a commit before the step timeline: derive
        for prev, r in zip([None, *steps], steps, strict=False):
            r["time_interval_s"] = r["wall_s"] - prev["wall_s"] if prev else float("nan")
            r["time_step_s"] = r["step_time_s"]
        steps = steps[1:]
    keys = ("interval", "take", "step", "ack", "publish", "load", "other")
    med = {
        k: statistics.median(r[f"time_{k}_s"] for r in steps)
        for k in keys
        if f"time_{k}_s" in steps[0]
    }
    rollout = statistics.median(shards.values())
    # throughput and busy fractions over the same window as the medians: from the end of the
    # first counted step to the end of the last (the driver's own fractions count start-up)
    window = steps[1:]
    span = steps[-1]["wall_s"] - steps[0]["wall_s"]
    groups = sum(r["groups"] for r in window)
    start, end = steps[0]["time"], steps[-1]["time"]  # (a rollout record's step is the
    # driver's count when its batch finished: one less than the step it is trained in)
    rollout_s = sum(
        r["generate_s"] + r.get("load_s", 0.0)
        for r in records
        if r["kind"] == "rollout" and start < r["time"] <= end
    )
    # What the rollout side supplies per learner step: a lock-step batch is split over the
    # workers (the slowest shard above), while in async each worker makes whole batches, so
    # W of them supply one every rollout / W seconds.
    supply = rollout if cfg.sync.mode == "lockstep" else rollout / workers
    # The sustained step period over the window (the same span as groups/s): a median
    # interval sits below it when intervals are skewed (an H100 run printed 0.92x, below
    # the 1.0 that one worker allows).
    period = span / len(window)
    return {
        "interval": med["interval"],
        "period": period,
        "learner": med["step"],
        "rollout": rollout,
        "supply": supply,
        "overhead": period / max(med["step"], supply),
        "overhead_median": med["interval"] / max(med["step"], supply),
        "learner_busy": sum(r["time_step_s"] for r in window) / span,
        "rollout_busy": rollout_s / (span * window[-1]["workers"]),
        "groups_per_s": groups / span if span > 0 else float("nan"),
        "timeline": med,
        "lag_max": max(r["lag_max"] for r in steps),
        "dropped_stale": summary["groups"]["dropped_stale"],
        "reconciled": summary["groups"]["reconciled"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    p.add_argument("--gpus-per-worker", type=float, default=0.0)
    p.add_argument("--gpus-per-rank", type=float, default=0.0)
    p.add_argument(
        "--sync-method",
        choices=["ray", "ipc", "nccl", "gloo"],
        default="ray",
        help="sync.method of both runs (ipc: colocated roles, one GPU or CPU)",
    )
    args = p.parse_args()
    if args.steps < 3:  # the medians skip step 1, the throughput window starts after step 2
        p.error(f"--steps must be at least 3, got {args.steps}")
    common = [
        f"run.steps={args.steps}",
        f"rollout.num_workers={args.workers}",
        f"rollout.engine={args.engine}",
        f"rollout.gpus_per_worker={args.gpus_per_worker}",
        f"learner.gpus_per_rank={args.gpus_per_rank}",
        f"sync.method={args.sync_method}",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        probe = parse_config(MODELS[args.model], common)
        start_ray(None, probe, log_to_driver=False)  # one Ray for both runs
        results = {
            name: run_once(
                MODELS[args.model], [*schedule, *common, f"run.name={name}"], tmp, args.workers
            )
            for name, schedule in SCHEDULES.items()
        }
    print(
        f"[{args.model}, {args.engine} engine, {args.workers} worker(s), {args.steps} steps, "
        f"sync.method {args.sync_method}; "
        "medians over steps 2..N, seconds]"
    )
    head = ("interval", "period", "learner", "rollout", "overhead", "L busy", "R busy", "groups/s")
    print(f"{'':10s}" + "".join(f"{h:>10s}" for h in (*head, "max lag", "stale")))
    for name, r in results.items():
        print(
            f"{name:10s}{r['interval']:10.3f}{r['period']:10.3f}{r['learner']:10.3f}"
            f"{r['rollout']:10.3f}{r['overhead']:9.3f}x{r['learner_busy']:10.1%}"
            f"{r['rollout_busy']:10.1%}{r['groups_per_s']:10.2f}{r['lag_max']:10.0f}"
            f"{r['dropped_stale']:10d}"
        )
    print(
        "  (period: the window's mean step period; overhead: period / max(learner, rollout "
        f"per step), rollout per step being a batch's time / {args.workers} in async)"
    )
    print("step timeline (medians, s):")
    for name, r in results.items():
        print(f"  {name:9s} " + "  ".join(f"{k} {v:.3f}" for k, v in r["timeline"].items()))
    lock = results["lockstep"]
    print(
        f"lockstep interval / (learner + rollout): "
        f"{lock['interval'] / (lock['learner'] + lock['rollout']):.2f}x "
        "(on-policy lock-step cannot overlap the two)"
    )
    ratio = results["async"]["groups_per_s"] / results["lockstep"]["groups_per_s"]
    print(
        f"async / lockstep throughput: {ratio:.3f}x: {'meets' if ratio >= 1.8 else 'misses'} "
        "the target >= 1.8x (where the sides overlap)"
    )
    rate = results["lockstep"]["interval"] / results["async"]["interval"]
    print(f"async / lockstep step rate (median intervals): {rate:.2f}x")
    a = results["async"]
    print(
        f"async overhead: {a['overhead']:.3f}x from the mean step period "
        f"({a['overhead_median']:.3f}x from the median interval): "
        f"{'meets' if a['overhead'] <= 1.1 else 'misses'} the target <= 1.1x (on a GPU)"
    )
    print(
        f"async learner busy: {a['learner_busy']:.1%}: "
        f"{'meets' if a['learner_busy'] >= 0.9 else 'misses'} the target >= 90% (on a GPU)"
    )
    ok = all(r["reconciled"] for r in results.values())
    print(f"reconciled: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
