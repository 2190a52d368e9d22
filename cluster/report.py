"""The run report: report.html with PNG plots, built from metrics.jsonl and summary.json.

`staleflow report RUN_DIR` rebuilds it at any time, also for a run that is still going or
that crashed (metrics are flushed line by line).
"""

from __future__ import annotations

import html
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from staleflow.cluster.rundir import RunDir, read_metrics

logger = logging.getLogger(__name__)

__all__ = ["write_report"]

PLOTS = (
    ("reward", "Reward of the trained groups"),
    ("accuracy", "Held-out accuracy"),
    ("lag", "Policy lag of the trained groups"),
    ("clip_kl", "Clip fraction and KL(behaviour || policy)"),
    ("throughput", "Throughput"),
    ("busy", "Busy fractions"),
    ("timeline", "Where each step's time went"),
)


# The step timeline's parts (metrics.jsonl `time_<key>_s`, cluster.ledger.Timeline), stacked.
TIMELINE = (
    ("take", "take (waiting for rollout data, decoding)"),
    ("step", "learner step"),
    ("ack", "ack"),
    ("publish", "publish"),
    ("other", "other (driver round trips, learner not called yet)"),
)
# The rollout side of the same interval, in worker-seconds (summed over workers): it overlaps
# the learner's parts, so it is stacked in a panel of its own below them. Each worker's own
# load time is in its `rollout` records (`load_s`).
WORKER_TIMELINE = (
    ("load", "weights loading at batch boundaries"),
    ("gap", "idle, waiting to be dispatched"),
)


def write_report(run: RunDir) -> Path:
    """Write plots/*.png and report.html; returns the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(read_metrics(run.metrics))
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    rollouts = [r for r in records if r["kind"] == "rollout"]
    run.plots.mkdir(exist_ok=True)

    def series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
        # in step order: evaluations are recorded as they finish, and a retried one (on
        # another worker) can finish after a later step's (stable: a step's own order stays)
        rows = sorted((r for r in rows if isinstance(r.get(key), (int, float))),
                      key=lambda r: r["step"])  # fmt: skip
        return [r["step"] for r in rows], [r[key] for r in rows]

    def wall(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
        rows = sorted((r for r in rows if isinstance(r.get(key), int | float)
                       and isinstance(r.get("wall_s"), int | float)),
                      key=lambda r: r["wall_s"])  # fmt: skip
        return [r["wall_s"] / 60 for r in rows], [r[key] for r in rows]

    def pair(name: str, rows: list[dict[str, Any]], key: str, ylabel: str) -> None:
        fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 3.5))
        by_step.plot(*series(rows, key), marker="o" if len(rows) < 40 else None)
        by_time.plot(*wall(rows, key), marker="o" if len(rows) < 40 else None)
        by_step.set_xlabel("learner step")
        by_time.set_xlabel("wall time (min)")
        for ax in (by_step, by_time):
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        _save(fig, run.plots / f"{name}.png")

    pair("reward", steps, "reward_mean", "mean reward")
    pair("accuracy", evals, "accuracy", "accuracy (sampled)")

    fig, (hist, over) = plt.subplots(1, 2, figsize=(10, 3.5))
    lags: Counter[int] = Counter()
    for r in steps:
        counts = r.get("lag_counts")
        for value, count in counts.items() if isinstance(counts, dict) else ():
            if str(value).lstrip("-").isdigit() and isinstance(count, int):  # (a hand edit)
                lags[int(value)] += count
    if lags:
        hist.bar(list(lags), list(lags.values()))
    hist.set_xlabel("lag (versions)")
    hist.set_ylabel("groups")
    for key in ("lag_min", "lag_mean", "lag_max", "lag_expected"):
        x, y = series(steps, key)
        if x:
            over.plot(x, y, label=key, linestyle="--" if key == "lag_expected" else "-")
    over.set_xlabel("learner step")
    if over.lines:
        over.legend()
    _save(fig, run.plots / "lag.png")

    fig, (clip, kl) = plt.subplots(1, 2, figsize=(10, 3.5))
    clip.plot(*series(steps, "clip_frac"))
    clip.set_ylabel("clip fraction")
    kl.plot(*series(steps, "approx_kl"))
    kl.set_ylabel("approx KL(mu || pi)")
    for ax in (clip, kl):
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
    _save(fig, run.plots / "clip_kl.png")

    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.plot(*series(steps, "tokens_per_s"), label="learner (trained tokens/s)")
    x, y = series(rollouts, "tokens_per_s")
    ax.plot(x, y, ".", label="rollout batch (generated tokens/s, per worker)")
    ax.set_xlabel("learner step")
    ax.legend()
    _save(fig, run.plots / "throughput.png")

    fig, ax = plt.subplots(figsize=(10, 3.5))
    for key in ("learner_busy", "rollout_busy"):
        ax.plot(*series(steps, key), label=key)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("learner step")
    ax.legend()
    _save(fig, run.plots / "busy.png")

    fig, (learner_ax, workers_ax) = plt.subplots(
        2, 1, figsize=(12, 5.5), sharex=True, height_ratios=(2, 1)
    )
    x = [r["step"] for r in steps]
    for ax, parts in ((learner_ax, TIMELINE), (workers_ax, WORKER_TIMELINE)):
        bottom = [0.0] * len(steps)
        for key, label in parts:
            y = [_number(r.get(f"time_{key}_s")) for r in steps]
            if any(y):
                ax.bar(x, y, bottom=bottom, label=label, width=0.9)
                bottom = [b + v for b, v in zip(bottom, y, strict=True)]
        if ax.patches:  # beside the bars, never over them
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    learner_ax.set_ylabel("seconds since the\nprevious step")
    workers_ax.set_ylabel("worker-seconds\n(all workers)")
    workers_ax.set_xlabel("learner step")
    _save(fig, run.plots / "timeline.png")

    try:
        summary = json.loads(run.summary.read_text()) if run.summary.is_file() else {}
        if not isinstance(summary, dict):
            raise ValueError(f"a JSON {type(summary).__name__}, not an object")
    except (ValueError, OSError) as exc:  # damaged, unreadable: the plots still come
        logger.warning("%s cannot be read (%s): the report has no summary", run.summary, exc)
        summary = {}
    config = run.config.read_text() if run.config.is_file() else "{}"
    run.report.write_text(_html(run, summary, config, len(steps)))
    return run.report


def _number(value: Any) -> float:
    """A timeline part's seconds; 0 where the record has none (or not a number)."""
    return float(value) if isinstance(value, int | float) else 0.0


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _html(run: RunDir, summary: dict[str, Any], config: str, steps: int) -> str:
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>"
        for k, v in summary.items()
        if not isinstance(v, dict)
    )
    groups = summary.get("groups")
    groups = groups if isinstance(groups, dict) else {}
    group_rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>"
        for k, v in groups.items()
    )
    figures = "".join(
        f'<h2>{title}</h2><img src="plots/{name}.png" alt="{title}">' for name, title in PLOTS
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>staleflow run {html.escape(run.path.name)}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:auto}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px;text-align:left}}
img{{max-width:100%}}</style></head><body>
<h1>staleflow run {html.escape(run.path.name)}</h1>
<p>{steps} learner steps recorded.</p>
<h2>Summary</h2><table>{rows}</table>
<h2>Groups: pushed = trained + dropped + left in the buffer</h2><table>{group_rows}</table>
{figures}
<h2>Config</h2><pre>{html.escape(config)}</pre>
</body></html>
"""


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
