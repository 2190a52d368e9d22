"""The combined report of a sweep, laid out like the paper's figures.

One column per value of the `columns` axis (the sync setting), one line per value of the
`lines` axis (the algorithm), the mean over every other axis (seeds) with a min-max band.
Panels: training reward, held-out accuracy, clip fraction and KL(behaviour || policy) against
the learner step. The summary table gives, per (column, line):

- final: held-out accuracy at each run's last evaluation (mean over seeds); eval_steps_differ
  marks rows whose runs were evaluated at different steps (the curve and the other columns
  use the steps they share);
- auc: the area under the accuracy-vs-step curve divided by its step range (the mean
  accuracy over training, trapezoid rule);
- steps_to_threshold: the first evaluated step whose mean accuracy reaches `threshold`;
- peak: the best mean accuracy, and collapse: True when the final accuracy is more than
  COLLAPSE_DROP below the peak (the policy got worse and stayed worse);
- reward_initial / reward_final / reward_auc: the same for the held-out mean reward, which
  also moves when accuracy is a hard threshold (the tiny model's all-digit answers);
- final_low / final_high: the lowest and highest final accuracy over the seeds;
- minutes: the runs' mean wall-clock time (start to end, evaluations included);
- kl_last / entropy_last: KL(behaviour || policy) and the policy's entropy, averaged over the
  last TAIL_STEPS learner steps (how far each method moved from the data it trained on).

The training-reward panel shows the reward of the groups each step trained on, that is of
the policy that sampled them: in the offline column it stays the initial policy's by design,
and only the held-out panels show what the learner learned.

Written to <sweep dir>/: report.html, plots/*.png, summary.md, summary.csv, summary.json.
`staleflow sweep SWEEP.yaml --report-only` rebuilds it from the cells completed so far
(runs counts a cell's completed runs with evaluations: 0 for a cell not completed yet,
or one that evaluated nothing).
"""

from __future__ import annotations

import csv
import html
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from staleflow.cluster.rundir import read_metrics
from staleflow.cluster.sweep import SweepError, run_status

__all__ = ["COLLAPSE_DROP", "TAIL_STEPS", "Curve", "summarize", "write_sweep_report"]

COLLAPSE_DROP = 0.2
TAIL_STEPS = 5

PANELS = (
    ("reward", "step", "reward_mean", "training reward"),
    ("accuracy", "eval", "accuracy", "held-out accuracy"),
    ("eval_reward", "eval", "reward_mean", "held-out reward"),
    ("clip_frac", "step", "clip_frac", "clip fraction"),
    ("kl", "step", "approx_kl", "KL(behaviour || policy)"),
)


class Curve:
    """Mean and min-max band of one (column, line) over the runs it averages, at the steps
    every one of them recorded; `last` is each run's own last value, and `differ` says
    whether the runs recorded different steps (a failed evaluation, another eval_every)."""

    def __init__(self, runs: list[list[dict[str, Any]]], kind: str, key: str) -> None:
        per_run = []
        for records in runs:
            points = {
                int(r["step"]): float(r[key])
                for r in records
                if r.get("kind") == kind and isinstance(r.get(key), (int, float))
            }
            if points:
                per_run.append(points)
        common = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
        values = np.array([[p[s] for s in common] for p in per_run], dtype=float)
        values = values.reshape(len(per_run), len(common))
        self.steps = np.array(common, dtype=float)
        self.runs = len(per_run)
        self.last = [p[max(p)] for p in per_run]
        self.differ = len({frozenset(p) for p in per_run}) > 1
        self.mean = values.mean(axis=0) if self.runs else np.zeros(0)
        self.low = values.min(axis=0) if self.runs else np.zeros(0)
        self.high = values.max(axis=0) if self.runs else np.zeros(0)


def summarize(curve: Curve, threshold: float) -> dict[str, Any]:
    """The table row of one accuracy curve (see the module docstring). `final` is the mean
    of each run's own last value: at the last common step it was an earlier step's where a
    run lacked its final evaluation, silently. The rest is read from the common steps;
    `eval_steps_differ` flags rows whose runs recorded different steps."""
    if curve.runs == 0:
        return {"runs": 0}
    final = float(np.mean(curve.last))
    row: dict[str, Any] = {
        "runs": curve.runs,
        "final": final,
        "final_low": float(min(curve.last)),
        "final_high": float(max(curve.last)),
        "eval_steps_differ": curve.differ,
    }
    if len(curve.steps) == 0:  # no step in common: no curve to read the rest from
        return row
    s, m = curve.steps, curve.mean
    span = s[-1] - s[0]
    auc = float(np.sum((m[1:] + m[:-1]) / 2 * np.diff(s)) / span) if span > 0 else float(m[0])
    reached = [int(step) for step, v in zip(s, m, strict=True) if v >= threshold]
    peak = max(float(m.max()), final)
    row.update(
        initial=float(m[0]),
        peak=peak,
        auc=auc,
        steps_to_threshold=reached[0] if reached else None,
        collapse=bool(peak - final > COLLAPSE_DROP),
    )
    return row


def _load(directory: Path) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    path = directory / "sweep.json"
    try:
        spec = json.loads(path.read_text())
        if not isinstance(spec, dict) or not {"cells", "threshold", "columns", "lines"} <= set(
            spec
        ):
            raise ValueError("no cells, threshold, columns or lines in it")
        for cell in spec["cells"]:  # each named, labelled on both figure axes
            if not (isinstance(cell["name"], str) and spec["columns"] in cell["labels"]
                    and spec["lines"] in cell["labels"]):  # fmt: skip
                raise ValueError(f"a cell without its name or labels: {cell!r:.100}")
    except FileNotFoundError:
        raise SweepError(f"{path} not found: run the sweep first (without --report-only)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SweepError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}); run the sweep again "
            "without --report-only: it rewrites the file and skips the completed cells"
        ) from None
    records = {}
    for cell in spec["cells"]:  # completed cells only: a half-run cell would skew the means
        run = directory / "runs" / cell["name"]
        if run_status(run) == "completed":
            records[cell["name"]] = list(read_metrics(run / "metrics.jsonl"))
    return spec, records


def write_sweep_report(directory: str | Path) -> Path:
    """Build the sweep's plots, tables and report.html from its cells' metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    spec, records = _load(directory)
    col_axis, line_axis = spec["columns"], spec["lines"]
    columns = list(dict.fromkeys(c["labels"][col_axis] for c in spec["cells"]))
    lines = list(dict.fromkeys(c["labels"][line_axis] for c in spec["cells"]))

    def cells_of(column: str, line: str) -> list[str]:
        """The completed cells of one (column, line)."""
        return [
            c["name"]
            for c in spec["cells"]
            if c["labels"][col_axis] == column
            and c["labels"][line_axis] == line
            and c["name"] in records
        ]

    def runs_of(column: str, line: str) -> list[list[dict[str, Any]]]:
        return [records[name] for name in cells_of(column, line)]

    plots = directory / "plots"
    plots.mkdir(exist_ok=True)
    colors = plt.get_cmap("tab10")
    for name, kind, key, ylabel in PANELS:
        fig, axes = plt.subplots(
            1, len(columns), figsize=(4.2 * len(columns), 3.6), sharey=True, squeeze=False
        )
        for ax, column in zip(axes[0], columns, strict=True):
            for i, line in enumerate(lines):
                curve = Curve(runs_of(column, line), kind, key)
                if curve.runs == 0:
                    continue
                # tab10 repeats after 10 lines: each further ten get another dash pattern
                color, dashes = colors(i % 10), ("-", "--", ":", "-.")[i // 10 % 4]
                ax.plot(curve.steps, curve.mean, label=line, color=color, ls=dashes, lw=1.4)
                if curve.runs > 1:
                    ax.fill_between(curve.steps, curve.low, curve.high, color=color, alpha=0.15)
            ax.set_title(column)
            ax.set_xlabel("learner step")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(ylabel)
        # every panel's lines (a line with no completed cell in the first column was drawn
        # elsewhere but never named), in the lines' order
        named = {}
        for ax in axes[0]:
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                named.setdefault(label, handle)
        labels = [line for line in lines if line in named]
        if labels:
            fig.legend([named[x] for x in labels], labels, loc="lower center",
                       ncol=min(len(labels), 5), fontsize=8)  # fmt: skip
            fig.subplots_adjust(bottom=min(0.6, 0.17 + 0.07 * math.ceil(len(labels) / 5)))
        fig.savefig(plots / f"{name}.png", dpi=100, bbox_inches="tight")
        plt.close(fig)

    rows = []
    for column in columns:
        for line in lines:
            if col_axis == line_axis and column != line:
                continue  # one axis for both: its values are the rows
            runs = runs_of(column, line)
            accuracy = Curve(runs, "eval", "accuracy")
            row = summarize(accuracy, spec["threshold"])
            reward = summarize(Curve(runs, "eval", "reward_mean"), math.inf)
            row.update({f"reward_{k}": reward.get(k) for k in ("initial", "final", "auc")})
            for name, key in (("kl_last", "approx_kl"), ("entropy_last", "entropy")):
                tail = Curve(runs, "step", key).mean[-TAIL_STEPS:]
                tail = tail[np.isfinite(tail)]  # one NaN step would make the whole mean NaN
                row[name] = float(tail.mean()) if len(tail) else None
            walls = [_wall_s(directory / "runs" / name) for name in cells_of(column, line)]
            known = [w for w in walls if w is not None]
            row["minutes"] = sum(known) / len(known) / 60 if known else None
            rows.append({col_axis: column, line_axis: line, **row})
    (directory / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    fields = [col_axis] + ([line_axis] if line_axis != col_axis else [])
    fields += ["runs", "initial", "final", "final_low", "final_high", "peak", "auc", "minutes"]
    fields += ["steps_to_threshold", "collapse", "reward_initial", "reward_final", "reward_auc"]
    fields += ["kl_last", "entropy_last", "eval_steps_differ"]
    with open(directory / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (directory / "summary.md").write_text(_markdown(rows, fields, spec["threshold"]))
    report = directory / "report.html"
    report.write_text(_html(spec, rows, fields, directory.name))
    return report


def _wall_s(run: Path) -> float | None:
    """A completed run's wall-clock seconds from its summary.json, if it recorded them."""
    try:
        wall = json.loads((run / "summary.json").read_text()).get("wall_s")
    except (OSError, ValueError):
        return None
    return float(wall) if isinstance(wall, (int, float)) else None


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.3f}"
    return str(value)


def _markdown(rows: list[dict[str, Any]], fields: list[str], threshold: float) -> str:
    head = [f if f != "steps_to_threshold" else f"steps to {threshold:g}" for f in fields]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(fields)]
    out += ["| " + " | ".join(_fmt(r.get(f)) for f in fields) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _html(spec: dict[str, Any], rows: list[dict[str, Any]], fields: list[str], name: str) -> str:
    table = "<tr>" + "".join(f"<th>{html.escape(f)}</th>" for f in fields) + "</tr>"
    for r in rows:
        table += "<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(f)))}</td>" for f in fields)
        table += "</tr>"
    figures = "".join(
        f"<h2>{html.escape(label)}</h2><img src='plots/{n}.png' alt='{html.escape(label)}'>"
        for n, _, _, label in PANELS
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>staleflow sweep {html.escape(name)}</title>
<style>body{{font-family:sans-serif;margin:2em}}img{{max-width:100%}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:3px 8px}}</style>
</head><body>
<h1>Sweep {html.escape(name)}</h1>
<p>Base config {html.escape(str(spec.get("base", "?")))};
columns: {html.escape(spec["columns"])}, lines: {html.escape(spec["lines"])};
mean over the other axes with a min-max band.
Collapse: final accuracy more than {COLLAPSE_DROP} below the peak.</p>
<table>{table}</table>
{figures}
</body></html>
"""
