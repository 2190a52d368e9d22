"""The tiny in-process run the system and study tests share: real Ray (the session's
`ray_local`), real Redis, real DeepSpeed, the tiny model."""

from __future__ import annotations

from pathlib import Path

from staleflow.cluster.driver import Driver
from staleflow.cluster.rundir import RunDir, read_metrics
from staleflow.configs import parse_config

# Small and fast: 2 prompts x 2 samples x 4 tokens per batch, no evaluation unless asked.
TINY = """
model: {preset: tiny}
task: {name: digits, chat_template: false, eval_prompts: 0}
rollout: {num_workers: 2, prompts_per_batch: 2, group_size: 2, max_new_tokens: 4}
learner: {optimizer: {lr: 1.0e-3}, loss: {name: rec-oneside-nois}}
run: {tensorboard: false, report: false}
"""


# For a run whose test does not need a batch split over workers: one rollout actor fewer. On a
# 2-core machine a tiny run cost about 25 CPU-seconds (one run, measured per process), most of
# it each actor process importing torch and transformers; the second worker about 6 of them.
ONE_WORKER = "rollout.num_workers=1"


def run_driver(tmp_path: Path, *overrides: str, text: str = TINY):
    cfg = parse_config(text, [f"run.output_dir={tmp_path}", *overrides])
    run = RunDir.create(str(tmp_path), cfg.run.name or "run")
    summary = Driver(cfg, run).run()
    return cfg, run, summary, list(read_metrics(run.metrics))


def steps_of(records):
    return [r for r in records if r["kind"] == "step"]
