"""Sweep files, the sweep summary's arithmetic, and the trajectory log (no Ray needed)."""

from __future__ import annotations

import json
import math
from typing import ClassVar

import numpy as np
import pytest

from staleflow.buffer.records import synthetic_groups
from staleflow.cluster.sweep import SweepError, load_sweep
from staleflow.cluster.sweep_report import Curve, summarize, write_sweep_report
from staleflow.cluster.trajectories import TrajectoryLog, read_trajectories

BASE = """
model: {preset: tiny}
task: {name: digits, chat_template: false}
rollout: {num_workers: 1, prompts_per_batch: 2, group_size: 2, max_new_tokens: 4}
learner: {loss: {name: rec-oneside-nois, epsilon_low: 0.6, epsilon_high: 2.0}}
"""


def sweep_file(tmp_path, body: str):
    (tmp_path / "base.yaml").write_text(BASE)
    path = tmp_path / "s.yaml"
    path.write_text("base: base.yaml\n" + body)
    return path


def test_grid_is_the_product_of_the_axes(tmp_path):
    path = sweep_file(
        tmp_path,
        """
overrides: {run.steps: 3}
grid:
  sync: {onpolicy: {sync.interval: 1}, lag4: {sync.interval: 4, sync.offset: 0}}
  algorithm: {grpo: {learner.loss: {name: grpo}}}
  run.seed: [0, 7]
""",
    )
    sweep = load_sweep(path, output_dir=tmp_path / "out")
    assert [c.name for c in sweep.cells] == [
        "onpolicy__grpo__seed-0",
        "onpolicy__grpo__seed-7",
        "lag4__grpo__seed-0",
        "lag4__grpo__seed-7",
    ]
    assert (sweep.columns, sweep.lines) == ("sync", "algorithm")  # the first two axes
    assert sweep.directory == tmp_path / "out" / "s"
    cfg = sweep.config(sweep.cells[3])
    assert (cfg.sync.interval, cfg.run.seed, cfg.run.steps) == (4, 7, 3)
    # a mapping value replaces the section: grpo does not inherit the base's (0.6, 2.0)
    assert (cfg.learner.loss.name, cfg.learner.loss.epsilon_high) == ("grpo", 0.2)
    assert cfg.run.name == "lag4__grpo__seed-7"
    assert cfg.run.output_dir == str(tmp_path / "out" / "s" / "runs")


def test_a_cell_name_over_a_run_names_length_says_so(tmp_path):
    # two long labels joined with __ were "not a valid run name", every character valid
    long = "a" * 70
    body = f"grid:\n  x: {{{long}: {{run.seed: 1}}}}\n  y: {{{long}: {{sync.offset: 1}}}}\n"
    with pytest.raises(SweepError, match=r"is 142 characters, more than a run name's 128 .*"
                       r"shorten the labels"):  # fmt: skip
        load_sweep(sweep_file(tmp_path, body))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("grid: {a: [1]}\ncolour: red\n", r"unknown key\(s\) \['colour'\]"),
        ("grid: {sync: 3}\n", "give a list of values"),
        ("grid: {run.seed: []}\n", "empty"),
        ("grid: {a: [\n", r'in ".*s\.yaml", line 3'),  # the file and line, not <unicode string>
        ("grid: {sync: {x: [1, 2]}}\n", "expected a mapping of dotted config keys"),
        ("grid: {run.seed: [0]}\ncolumns: sync\n", "columns: 'sync' is not an axis"),
        ("grid: {run.seed: [0]}\nthreshold: high\n", "threshold: must be a held-out accuracy"),
        ("grid: {run.seed: [0]}\nthreshold: .nan\n", "threshold: must be a held-out accuracy"),
        # was 1.0
        ("grid: {run.seed: [0]}\nthreshold: yes\n", "threshold: must be a held-out accuracy"),
        # a percentage: "steps to threshold" could never be reached
        ("grid: {run.seed: [0]}\nthreshold: 50\n", "between 0 and 1, got 50"),
        # YAML keeps the last of two equal keys without a word: the cell labelled grpo ran
        # REINFORCE, and seeds 0 and 1 were gone
        (
            "grid:\n  algo: {grpo: {learner.loss: {name: grpo}},\n"
            "         grpo: {learner.loss: {name: reinforce}}}\n",
            r"s\.yaml:\d+: grid\.algo\.grpo is given twice \(also line \d+\)",
        ),
        ("grid:\n  run.seed: [0, 1]\n  run.seed: [2]\n", r"grid\.run\.seed is given twice"),
        (
            "overrides:\n  run.steps: 40\n  run.steps: 4\ngrid: {run.seed: [0]}\n",
            r"overrides\.run\.steps is given twice",
        ),
        ("grid: {run.name: [!!set {a}]}\n", r"run\.name: \{'a'\} is not a config value"),
        ("grid: {sync: {bad: {sync.interval: 0}}}\n", r"(?s)cell bad: .*sync\.interval"),
        # YAML reads an unquoted on / off / yes / no as a boolean, which is no label
        ("grid: {sync: {on: {sync.interval: 1}}}\n", "label True is not a string"),
        # two values that name the same cell: one would silently replace the other
        ("grid: {run.seed: [0, 0]}\n", "0 and 0 both make the cell label 'seed-0'"),
        (
            "grid: {learner.optimizer.lr: [0.001, 1.0e-3]}\n",
            "0.001 and 0.001 both make the cell label 'lr-0.001'",
        ),
        (
            "grid: {algo: {'a b': {sync.interval: 1}, a_b: {sync.interval: 2}}}\n",
            "'a b' and 'a_b' both make the cell label 'a_b'",
        ),
        # labels holding the separator: a__b + c and a + b__c would share one run directory
        (
            "grid: {x: {a__b: {run.seed: 1}, a: {run.seed: 2}}, "
            "y: {c: {sync.interval: 1}, b__c: {sync.interval: 2}}}\n",
            "two cells are both named 'a__b__c'",
        ),
        # two axes setting one key: the later won, so cells labelled apart were one run
        (
            "grid: {steps: {s: {run.steps: 2}, l: {run.steps: 9}}, "
            "seed: {a: {run.seed: 0, run.steps: 3}}}\n",
            "grid axes steps and seed both set run.steps: the later axis's value would win",
        ),
        (  # a later axis's section replaces a key an earlier one set
            "grid: {learner.loss.epsilon_high: [0.3, 0.4], "
            "algo: {g: {learner.loss: {name: grpo}}}}\n",
            r"both set learner\.loss\.epsilon_high \(inside learner\.loss, which algo sets whole\)",
        ),
        ("grid: {run.seed: [0]}\noutput_dir: 5\n", "output_dir: must be a directory path, got 5"),
        # lockstep with a bound below the schedule's worst lag cannot run: refused up front
        (
            "grid: {sync: {i4: {sync.mode: lockstep, sync.interval: 4, "
            "buffer.max_staleness: 1}}}\n",
            r"(?s)cell i4: .*lag",
        ),
    ],
)
def test_bad_sweep_files_are_refused_with_the_reason(tmp_path, body, message):
    with pytest.raises(SweepError, match=message):
        load_sweep(sweep_file(tmp_path, body))


def test_a_damaged_sweep_json_is_named_with_the_fix(tmp_path):
    (tmp_path / "sweep.json").write_text('{"cells": [')  # torn
    with pytest.raises(SweepError, match=r"sweep\.json cannot be read .*run the sweep again"):
        write_sweep_report(tmp_path)
    (tmp_path / "sweep.json").write_text("[]")
    with pytest.raises(SweepError, match="no cells, threshold, columns or lines"):
        write_sweep_report(tmp_path)
    # these were a KeyError traceback
    for spec in ({"cells": [{"name": "a"}], "threshold": 0.5},
                 {"cells": [{"name": "a", "labels": {"sync": "x"}}], "threshold": 0.5,
                  "columns": "sync", "lines": "algo"}):  # fmt: skip
        (tmp_path / "sweep.json").write_text(json.dumps(spec))
        with pytest.raises(SweepError, match=r"sweep\.json cannot be read .*run the sweep again"):
            write_sweep_report(tmp_path)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(SweepError, match="sweep file not found"):
        load_sweep(tmp_path / "nope.yaml")
    path = tmp_path / "s.yaml"
    path.write_text("base: missing.yaml\ngrid: {run.seed: [0]}\n")
    with pytest.raises(SweepError, match=r"base config .*missing\.yaml not found"):
        load_sweep(path)


def runs(*curves):
    return [[{"kind": "eval", "step": s, "accuracy": a} for s, a in c] for c in curves]


def test_curve_is_the_mean_with_a_min_max_band_over_runs():
    # two seeds evaluated at steps 0, 10, 20 (the second also at 5: not common, left out)
    curve = Curve(
        runs([(0, 0.1), (10, 0.5), (20, 0.6)], [(0, 0.3), (5, 0.9), (10, 0.7), (20, 0.2)]),
        "eval",
        "accuracy",
    )
    assert curve.runs == 2
    assert curve.steps.tolist() == [0, 10, 20]
    assert np.allclose(curve.mean, [0.2, 0.6, 0.4])  # (0.1+0.3)/2, (0.5+0.7)/2, (0.6+0.2)/2
    assert np.allclose(curve.low, [0.1, 0.5, 0.2])
    assert np.allclose(curve.high, [0.3, 0.7, 0.6])


def test_summary_row_by_hand():
    # accuracy 0.2 @0, 0.6 @10, 0.4 @20 (one run)
    curve = Curve(runs([(0, 0.2), (10, 0.6), (20, 0.4)]), "eval", "accuracy")
    row = summarize(curve, threshold=0.5)
    # trapezoids: (0.2+0.6)/2*10 = 4.0, (0.6+0.4)/2*10 = 5.0; area 9.0 over 20 steps = 0.45
    assert row["auc"] == pytest.approx(0.45)
    assert row["steps_to_threshold"] == 10  # first step with accuracy >= 0.5
    assert (row["initial"], row["final"], row["peak"]) == (0.2, 0.4, 0.6)
    assert row["collapse"] is False  # 0.6 - 0.4 = 0.2, not more than COLLAPSE_DROP (0.2)
    collapsed = summarize(Curve(runs([(0, 0.2), (10, 0.7), (20, 0.4)]), "eval", "accuracy"), 0.9)
    assert collapsed["collapse"] is True  # 0.7 - 0.4 = 0.3 > 0.2
    assert collapsed["steps_to_threshold"] is None  # never reached 0.9
    assert summarize(Curve([], "eval", "accuracy"), 0.5) == {"runs": 0}


def test_a_run_missing_its_last_evaluation_does_not_move_the_final_to_an_earlier_step():
    # seed 0 evaluated at 0, 5, 10; seed 1's final evaluation failed (0 and 5 only). The
    # common steps end at 5, and "final" was the mean there: 0.3, where seed 0 ended at 0.9
    curve = Curve(runs([(0, 0.1), (5, 0.3), (10, 0.9)], [(0, 0.1), (5, 0.3)]), "eval",
                  "accuracy")  # fmt: skip
    row = summarize(curve, threshold=0.5)
    assert row["final"] == pytest.approx((0.9 + 0.3) / 2)  # each run's own last: 0.6
    assert (row["final_low"], row["final_high"]) == (0.3, 0.9)
    assert row["eval_steps_differ"] is True
    assert row["peak"] == pytest.approx(0.6)  # the final mean is above the common curve's 0.3
    # evaluated at no step in common (an averaged axis changed run.eval_every): both runs
    # completed, and the row said runs = 0, "not completed"
    apart = summarize(Curve(runs([(0, 0.2), (4, 0.4)], [(3, 0.2), (6, 0.8)]), "eval",
                            "accuracy"), 0.5)  # fmt: skip
    assert (apart["runs"], apart["final"]) == (2, pytest.approx(0.6))  # (0.4 + 0.8) / 2
    assert "steps_to_threshold" not in apart  # no curve to read it from
    even = summarize(Curve(runs([(0, 0.1), (5, 0.5)], [(0, 0.3), (5, 0.7)]), "eval",
                           "accuracy"), 0.5)  # fmt: skip
    assert even["eval_steps_differ"] is False
    assert even["final"] == pytest.approx(0.6)


def test_the_legend_names_every_line_drawn_in_any_column(tmp_path, monkeypatch):
    # legends were read from the first column only: a line whose first-column cell had not
    # completed was drawn in the others unnamed (and with one axis for columns and lines,
    # only the first setting was named)
    import matplotlib.figure

    cells = []
    for column, line, done in (("A", "g", True), ("A", "r", False), ("B", "g", True),
                               ("B", "r", True)):  # fmt: skip
        name = f"{column}__{line}"
        cells.append({"name": name, "labels": {"sync": column, "algo": line}})
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        run.joinpath("metrics.jsonl").write_text(
            json.dumps({"kind": "eval", "step": 0, "accuracy": 0.1, "reward_mean": 0.1})
            + "\n"
            + json.dumps({"kind": "step", "step": 1, "reward_mean": 0.2})
            + "\n"
        )
        status = "completed" if done else "failed"
        run.joinpath("summary.json").write_text(json.dumps({"status": status}))
    spec = {"cells": cells, "columns": "sync", "lines": "algo", "threshold": 0.5, "base": "b"}
    (tmp_path / "sweep.json").write_text(json.dumps(spec))
    legends = []
    real = matplotlib.figure.Figure.legend

    def legend(self, handles, labels, **kwargs):
        legends.append(list(labels))
        return real(self, handles, labels, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "legend", legend)
    write_sweep_report(tmp_path)
    assert legends
    assert all(labels == ["g", "r"] for labels in legends)


def test_trajectory_log_round_trip_stores_each_group_once(tmp_path):
    groups = synthetic_groups(3, k=2, seed=1)
    log = TrajectoryLog(tmp_path)
    log.record(1, 0, [groups[0], groups[1]])
    log.record(2, 1, [groups[1], groups[2]])  # groups[1] reused: stored once
    log.close()
    steps, stored = read_trajectories(tmp_path)
    assert [s["groups"] for s in steps] == [
        [
            [groups[0].group_id, groups[0].policy_version],
            [groups[1].group_id, groups[1].policy_version],
        ],
        [
            [groups[1].group_id, groups[1].policy_version],
            [groups[2].group_id, groups[2].policy_version],
        ],
    ]
    assert [s["learner_version"] for s in steps] == [0, 1]
    assert set(stored) == {g.group_id for g in groups}
    assert all(stored[g.group_id] == g for g in groups)
    # a crash mid-write tears the last records: everything before them still reads back
    with open(tmp_path / "groups.bin", "ab") as f:
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00partial")
    with open(tmp_path / "steps.jsonl", "a") as f:
        f.write('{"step": 3, "lear')
    steps, stored = read_trajectories(tmp_path)
    assert len(steps) == 2
    assert len(stored) == 3
    assert json.loads(json.dumps(steps[0]))["step"] == 1


def test_report_with_one_axis_for_columns_and_lines_gives_minutes_and_the_seed_range(tmp_path):
    # Two settings x two seeds, the setting axis both columns and lines (the quickstart study).
    cells, finals = [], {"a": (0.5, 0.7), "b": (0.9, 0.8)}
    for setting, (seed0, seed1) in finals.items():
        for seed, final, wall in (("s0", seed0, 600.0), ("s1", seed1, 660.0)):
            name = f"{setting}__{seed}"
            cells.append({"name": name, "labels": {"sync": setting, "seed": seed}})
            run = tmp_path / "runs" / name
            run.mkdir(parents=True)
            evals = [(0, 0.2), (10, final)]
            # setting a's approx_kl: s0 0.1, NaN, 0.3 and s1 0.3, 0.2, 0.5, means over the
            # seeds 0.2, NaN, 0.4: the NaN step is left out, kl_last = (0.2 + 0.4) / 2 = 0.3
            kls = {"a__s0": [0.1, math.nan, 0.3], "a__s1": [0.3, 0.2, 0.5]}.get(name, [])
            run.joinpath("metrics.jsonl").write_text(
                "".join(
                    json.dumps({"kind": "eval", "step": s, "accuracy": a, "reward_mean": a}) + "\n"
                    for s, a in evals
                )
                + "".join(
                    json.dumps({"kind": "step", "step": i + 1, "approx_kl": kl}) + "\n"
                    for i, kl in enumerate(kls)
                )
            )
            run.joinpath("summary.json").write_text(
                json.dumps({"status": "completed", "wall_s": wall})
            )
    spec = {"cells": cells, "columns": "sync", "lines": "sync", "threshold": 0.6, "base": "b"}
    (tmp_path / "sweep.json").write_text(json.dumps(spec))
    write_sweep_report(tmp_path)
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [r["sync"] for r in rows] == ["a", "b"]  # no (a, b) / (b, a) rows
    a, b = rows
    assert a["final"] == pytest.approx((0.5 + 0.7) / 2)
    assert (a["final_low"], a["final_high"]) == (0.5, 0.7)
    assert (b["final_low"], b["final_high"]) == (0.8, 0.9)
    assert a["minutes"] == pytest.approx((600 + 660) / 2 / 60)  # 10.5
    assert a["kl_last"] == pytest.approx(0.3)
    assert b["kl_last"] is None  # no step records
    assert "| a | 2 |" in (tmp_path / "summary.md").read_text()


# ------------------------------------------------------------------ running cells (no Ray)


class FakeDriver:
    """Stands in for the Driver (and Ray) to test the sweep's own bookkeeping: it writes a
    completed run's config.json and summary.json, or raises for the cells in `fail`."""

    fail: ClassVar[dict[str, Exception]] = {}
    seen_locked: ClassVar[list[bool]] = []

    resumed: ClassVar[list[str]] = []

    def __init__(self, cfg, run, address=None, progress=None, resume=False):
        self.cfg, self.rundir = cfg, run
        if resume:
            FakeDriver.resumed.append(cfg.run.name)

    def run(self):
        from staleflow.cluster.rundir import write_text
        from staleflow.configs.loader import dump_config, redact

        FakeDriver.seen_locked.append(self.rundir.in_use() is True)
        write_text(self.rundir.config, redact(dump_config(self.cfg)) + "\n")
        if self.cfg.run.name in self.fail:
            raise self.fail[self.cfg.run.name]
        summary = {"status": "completed", "steps": self.cfg.run.steps}
        write_text(self.rundir.summary, json.dumps(summary))
        return summary


@pytest.fixture
def fake_driver(monkeypatch):
    import contextlib

    from staleflow.cluster import driver, sweep

    monkeypatch.setattr(driver, "Driver", FakeDriver)
    monkeypatch.setattr(sweep, "_ray_for", lambda *a: contextlib.nullcontext())
    FakeDriver.fail, FakeDriver.seen_locked, FakeDriver.resumed = {}, [], []
    return FakeDriver


def test_a_failing_cell_is_reported_and_the_others_still_run(tmp_path, fake_driver):
    from staleflow.actors.models import ModelError
    from staleflow.cluster.sweep import run_sweep

    sweep = load_sweep(sweep_file(tmp_path, "grid: {run.seed: [0, 1, 2]}\n"), tmp_path / "o")
    fake_driver.fail = {"seed-1": ModelError("model directory /m is gone; give model.path")}
    seen = []
    results = run_sweep(sweep, on_cell=lambda c, st, s: seen.append((c.name, st, s)))
    assert results == {"seed-0": "completed", "seed-1": "failed", "seed-2": "completed"}
    assert ("seed-1", "failed", {"status": "failed",
            "error": "model directory /m is gone; give model.path"}) in seen  # fmt: skip
    log = (sweep.runs / "seed-1" / "logs" / "driver.log").read_text()
    assert "cell seed-1 failed" in log
    assert "Traceback" in log  # the whole error, in the cell's log
    assert fake_driver.seen_locked == [True] * 3  # each cell held its run directory
    # run again: the failed cell is set aside and run again, the others are kept
    fake_driver.fail = {}
    results = run_sweep(load_sweep(sweep.source, tmp_path / "o"))
    assert results["seed-1"] == "completed"
    assert results["seed-0"] == results["seed-2"] == "skipped (completed)"
    assert [p.name.rsplit("-", 2)[0] for p in (sweep.directory / "incomplete").iterdir()] == [
        "seed-1"
    ]


def _checkpoint(run, steps: int) -> None:
    """A checkpoint as `check_resumable` reads it (trainer.json and safetensors headers),
    named in LATEST."""
    import numpy as np
    from safetensors.numpy import save_file

    from staleflow.cluster.resume import STATE_FORMAT
    from staleflow.learner.checkpoint import FORMAT

    path = run.checkpoints / f"step-{steps:06d}"
    path.mkdir(parents=True)
    driver = {"format": STATE_FORMAT, "flow": {"steps": steps}, "prompts_per_batch": 2}
    (path / "trainer.json").write_text(json.dumps({"format": FORMAT, "extra": {"driver": driver}}))
    for name in ("model", "rng", "optimizer"):
        save_file({"x": np.zeros(2, np.float32)}, str(path / f"{name}.safetensors"))
    run.mark_latest_checkpoint(path)


def test_an_incomplete_cell_continues_from_its_checkpoint_or_says_why_not(
    tmp_path, fake_driver, caplog
):
    # an interrupted or crashed cell used to be set aside and run again from step 0, its
    # checkpoints unused: hours of a long cell lost to one Ctrl-C
    from staleflow.cluster.rundir import RunDir
    from staleflow.cluster.sweep import cell_status, resume_refusal, run_sweep

    path = sweep_file(tmp_path, "overrides: {run.steps: 40}\ngrid: {run.seed: [0, 1, 2]}\n")
    sweep = load_sweep(path, tmp_path / "o")
    fake_driver.fail = {c.name: RuntimeError("crash") for c in sweep.cells}
    assert set(run_sweep(sweep).values()) == {"failed"}  # each has config.json, no summary
    fake_driver.fail = {}
    runs = {c.name: RunDir(sweep.runs / c.name) for c in sweep.cells}
    # seed-0 stopped at step 20 with a checkpoint; seed-1 before its first; seed-2's
    # checkpoint is damaged
    for name in ("seed-0", "seed-2"):
        _checkpoint(runs[name], 20)
    (runs["seed-2"].checkpoints / "step-000020" / "optimizer.safetensors").write_bytes(b"x")
    sweep = load_sweep(path, tmp_path / "o")
    assert [cell_status(sweep, c) for c in sweep.cells] == ["resumable", "incomplete", "incomplete"]
    assert resume_refusal(sweep, sweep.cells[1]) == "it made no checkpoint"
    assert "optimizer.safetensors: corrupt" in resume_refusal(sweep, sweep.cells[2])
    seen = []
    with caplog.at_level("WARNING"):
        results = run_sweep(sweep, on_cell=lambda c, st, s: seen.append((c.name, st)))
    assert set(results.values()) == {"completed"}
    assert fake_driver.resumed == ["seed-0"]
    assert ("seed-0", "resuming") in seen
    assert ("seed-1", "started") in seen
    assert (sweep.runs / "seed-0" / "checkpoints" / "step-000020").is_dir()  # in place
    aside = sorted(p.name.rsplit("-", 2)[0] for p in (sweep.directory / "incomplete").iterdir())
    assert aside == ["seed-1", "seed-2"]
    assert "cell seed-1 was incomplete and cannot resume (it made no checkpoint)" in caplog.text
    assert "cell seed-2 was incomplete and cannot resume (" in caplog.text
    # other settings than the checkpoint's (the file's overrides changed): from step 0
    fake_driver.resumed.clear()
    (sweep.runs / "seed-0" / "summary.json").unlink()
    path.write_text(path.read_text().replace("run.steps: 40", "run.steps: 60"))
    sweep = load_sweep(path, tmp_path / "o")
    assert (
        resume_refusal(sweep, sweep.cells[0])
        == "its settings are not the sweep's now (run.steps: 40 -> 60)"
    )


def test_completed_cells_made_with_other_settings_are_not_reported_as_new_ones(
    tmp_path, fake_driver
):
    from staleflow.cluster.sweep import cell_status, run_sweep

    path = sweep_file(tmp_path, "overrides: {run.steps: 40}\ngrid: {run.seed: [0, 1]}\n")
    run_sweep(load_sweep(path, tmp_path / "o"))
    before = (tmp_path / "o" / "s" / "sweep.json").read_text()
    path.write_text(path.read_text().replace("run.steps: 40", "run.steps: 80"))
    sweep = load_sweep(path, tmp_path / "o")
    assert [cell_status(sweep, c) for c in sweep.cells] == ["changed", "changed"]
    with pytest.raises(SweepError, match=r"cell seed-0 .* other settings .*run\.steps: 40 -> 80"):
        run_sweep(sweep)
    assert (tmp_path / "o" / "s" / "sweep.json").read_text() == before  # not relabelled
    assert not (sweep.directory / "incomplete").exists()  # nothing moved
    # the same settings again: nothing to do, nothing refused
    path.write_text(path.read_text().replace("run.steps: 80", "run.steps: 40"))
    assert set(run_sweep(load_sweep(path, tmp_path / "o")).values()) == {"skipped (completed)"}


def test_turning_a_sweeps_reports_off_changes_no_cells_settings(tmp_path, fake_driver):
    # run.report (and run.tensorboard) say what a run writes, not what it trains: set in a
    # sweep already run, they made every completed cell "changed" and the sweep refused
    from staleflow.cluster.resume import resume_overrides_allowed
    from staleflow.cluster.sweep import cell_status, config_changes, run_sweep

    path = sweep_file(tmp_path, "overrides: {run.steps: 40}\ngrid: {run.seed: [0, 1]}\n")
    run_sweep(load_sweep(path, tmp_path / "o"))
    path.write_text(path.read_text().replace(
        "run.steps: 40", "run.steps: 40, run.report: false, run.tensorboard: false"
    ))  # fmt: skip
    sweep = load_sweep(path, tmp_path / "o")
    assert [config_changes(sweep, c) for c in sweep.cells] == [[], []]
    assert [cell_status(sweep, c) for c in sweep.cells] == ["completed", "completed"]
    resume_overrides_allowed(["run.report=false", "run.tensorboard=true"])  # nor a resume's


def test_a_sweep_leaves_cells_and_directories_in_use_alone(tmp_path, fake_driver):
    import fcntl
    import os

    from staleflow.cluster.rundir import RunDir
    from staleflow.cluster.sweep import cell_status, run_sweep

    sweep = load_sweep(sweep_file(tmp_path, "grid: {run.seed: [0, 1]}\n"), tmp_path / "o")
    busy = RunDir.create(str(sweep.runs), "seed-1")  # a `train --resume` of a cell, running
    fd = busy.lock()
    try:
        assert cell_status(sweep, sweep.cells[1]) == "running"
        with pytest.raises(SweepError, match="cell seed-1 is being run by another process"):
            run_sweep(sweep)
        assert busy.path.is_dir()  # not moved to incomplete/
        assert fake_driver.seen_locked == []  # and nothing ran
    finally:
        os.close(fd)
    # another sweep of the same directory, running (its lock on the sweep directory)
    other = os.open(sweep.directory / ".lock", os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        with pytest.raises(SweepError, match="in use by another staleflow sweep"):
            run_sweep(sweep)
    finally:
        os.close(other)
    assert run_sweep(sweep) == {"seed-0": "completed", "seed-1": "completed"}


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ("{sync.method: [ray, nccl]}", r"(?s)cell method-nccl: .*nccl"),
        ("{task: {t: {task.name: custom, task.path: /nonexistent.jsonl, "
          "task.reward_fn: 'math:fabs'}}}",
         r"cell t: /nonexistent\.jsonl: no such file"),
    ],
)  # fmt: skip
def test_what_train_would_refuse_stops_the_sweep_before_any_cell(
    tmp_path, fake_driver, grid, message
):
    from staleflow.cluster.sweep import cell_status, run_sweep

    sweep = load_sweep(sweep_file(tmp_path, f"grid: {grid}\n"), tmp_path / "o")
    assert {cell_status(sweep, c) for c in sweep.cells} == {"new"}  # --dry-run still lists
    with pytest.raises(SweepError, match=message):
        run_sweep(sweep)
    assert fake_driver.seen_locked == []  # no cell ran


def test_a_cells_traceback_goes_to_its_log_and_its_last_error_to_the_console(
    tmp_path, fake_driver, caplog
):
    from staleflow.cluster.sweep import _last_error, run_sweep

    sweep = load_sweep(sweep_file(tmp_path, "grid: {run.seed: [0]}\n"), tmp_path / "o")
    fake_driver.fail = {"seed-0": RuntimeError("first line\nsecond line")}
    with caplog.at_level("DEBUG"):
        assert run_sweep(sweep) == {"seed-0": "failed"}
    assert not [r for r in caplog.records if r.exc_info]  # no traceback on the console
    # --parallel reads a cell's one-line error from its appended log, this attempt's only
    log = tmp_path / "cell.out"
    log.write_text("--- 1\nerror: the first attempt's\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("--- 2\nTraceback ...\nKilled\n")
    assert _last_error(log, 0) == "the first attempt's"
    assert _last_error(log, start) is None  # not the earlier attempt's error


def test_report_only_takes_the_figures_settings_and_nothing_else(tmp_path, fake_driver):
    from staleflow.cluster.sweep import run_sweep, update_figures

    path = sweep_file(tmp_path, "threshold: 0.5\ngrid: {run.seed: [0, 1]}\n")
    run_sweep(load_sweep(path, tmp_path / "o"))
    path.write_text("base: base.yaml\nthreshold: 0.7\ngrid: {run.seed: [0, 1, 2]}\n")
    update_figures(load_sweep(path, tmp_path / "o"))
    spec = json.loads((tmp_path / "o" / "s" / "sweep.json").read_text())
    assert spec["threshold"] == 0.7
    assert [c["name"] for c in spec["cells"]] == ["seed-0", "seed-1"]  # the cells that ran


def test_a_sweep_file_not_in_utf8_is_refused_with_the_fix(tmp_path):
    path = sweep_file(tmp_path, "grid: {run.seed: [0]}\n")
    path.write_bytes(b"# r\xe9glages (Latin-1)\n" + path.read_bytes())  # was a traceback
    with pytest.raises(SweepError, match=r"cannot read sweep file .*s\.yaml: .*save it as UTF-8"):
        load_sweep(path)


def test_values_yaml_reads_as_dates_pass_on_as_the_text_written(tmp_path):
    # an unquoted 2026-05-01 is a date to YAML, which json.dumps refused (a traceback)
    sweep = load_sweep(sweep_file(tmp_path, (
        "overrides: {run.name: 2026-05-01}\n"
        "grid: {task: {t: {task.name: custom, task.path: 2026-01-01, task.reward_fn: 'm:f'}}}\n"
    )))  # fmt: skip
    (cell,) = sweep.cells
    assert 'task.path="2026-01-01"' in cell.overrides
    assert sweep.config(cell).task.path == "2026-01-01"


def test_labels_that_yaml_reads_as_numbers_still_name_their_run(tmp_path):
    sweep = load_sweep(
        sweep_file(tmp_path, "grid: {lr: {0.001: {run.seed: 1}, 'null': {run.seed: 2}}}\n")
    )
    assert [sweep.config(c).run.name for c in sweep.cells] == ["0.001", "null"]


def test_sweep_files_are_read_as_configs_are(tmp_path):
    # load_sweep read with yaml.safe_load: a JSON sweep indented with tabs was refused, and a
    # grid value 1:30 became 90 (base 60) where the same value in a config is refused
    (tmp_path / "base.yaml").write_text(BASE)
    path = tmp_path / "s.json"
    grid = {"run.seed": [0, 7]}
    path.write_text(json.dumps({"base": "base.yaml", "grid": grid}, indent="\t"))
    assert [c.name for c in load_sweep(path).cells] == ["seed-0", "seed-7"]
    with pytest.raises(SweepError, match=r"(?s)cell start_timeout_s-1_30: .*got '1:30'"):
        load_sweep(sweep_file(tmp_path, "grid: {run.start_timeout_s: [1:30]}\n"))


def test_a_later_axis_may_set_a_key_inside_an_earlier_axis_s_section(tmp_path):
    sweep = load_sweep(sweep_file(tmp_path, (
        "grid: {algo: {g: {learner.loss: {name: grpo}}}, learner.loss.epsilon_high: [0.3, 0.4]}\n"
    )))  # fmt: skip
    got = [(sweep.config(c).learner.loss.name, sweep.config(c).learner.loss.epsilon_high)
           for c in sweep.cells]  # fmt: skip
    assert got == [("grpo", 0.3), ("grpo", 0.4)]


def test_report_only_of_an_axis_the_cells_did_not_run_with_is_refused(tmp_path):
    # columns: set to an axis added to the file after the cells ran: --report-only wrote it
    # into sweep.json, then every report was a KeyError traceback
    from staleflow.cluster.sweep import update_figures, write_sweep_json

    path = sweep_file(tmp_path, "grid: {run.seed: [0, 1]}\n")
    sweep = load_sweep(path, output_dir=tmp_path / "out")
    sweep.directory.mkdir(parents=True)
    write_sweep_json(sweep)
    before = (sweep.directory / "sweep.json").read_text()
    path.write_text("base: base.yaml\ngrid: {sync.interval: [1, 2], run.seed: [0, 1]}\n")
    with pytest.raises(SweepError, match=r"columns: 'sync\.interval' is not an axis the sweep"):
        update_figures(load_sweep(path, output_dir=tmp_path / "out"))
    assert (sweep.directory / "sweep.json").read_text() == before  # left as the cells ran


def test_a_redis_password_stays_out_of_sweep_json_and_command_lines(tmp_path, fake_driver):
    from staleflow.cluster.sweep import _child_command, cell_status, run_sweep

    url = "redis://:hunter2@localhost:6379/0"
    path = sweep_file(
        tmp_path, f"overrides: {{buffer.redis_url: '{url}'}}\ngrid: {{run.seed: [0]}}\n"
    )
    sweep = load_sweep(path, tmp_path / "o")
    run_sweep(sweep)
    assert "hunter2" not in (sweep.directory / "sweep.json").read_text()
    argv, env = _child_command(sweep, sweep.cells[0], "127.0.0.1:6379")
    assert "hunter2" not in " ".join(argv)
    assert env["STALEFLOW_REDIS_URL"] == url  # what the cell's train uses instead
    assert argv.count("buffer.redis_url=null") == 1  # over a URL the base config may give
    # such a cell's config.json says null: the cell is still the sweep's, not "changed"
    saved = json.loads((sweep.runs / "seed-0" / "config.json").read_text())
    saved["buffer"]["redis_url"] = None
    (sweep.runs / "seed-0" / "config.json").write_text(json.dumps(saved))
    assert cell_status(sweep, sweep.cells[0]) == "completed"
    # the URL in a whole buffer section goes the same way
    path.write_text(path.read_text().replace(
        f"{{buffer.redis_url: '{url}'}}", f"{{buffer: {{redis_url: '{url}', capacity: 64}}}}"
    ))  # fmt: skip
    argv, env = _child_command(load_sweep(path, tmp_path / "o2"), sweep.cells[0], "x:1")
    assert "hunter2" not in " ".join(argv)
    assert 'buffer={"capacity": 64}' in argv
    assert env["STALEFLOW_REDIS_URL"] == url


# A cell's `staleflow train` that does not stop: it records each signal it gets and goes on
# (the failure injected: a cell stuck in its cleanup). Only SIGKILL ends it, or a minute
# (so that a sweep that fails to kill it leaves nothing behind).
STUCK_CELL = """
import os, pathlib, signal, sys, time
log = pathlib.Path(sys.argv[1])
def note(signum, frame):
    with log.open("a") as f:
        f.write(signal.Signals(signum).name + "\\n")
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, note)
pathlib.Path(sys.argv[2]).write_text(str(os.getpid()))
log.write_text("")
end = time.monotonic() + 60
while time.monotonic() < end:
    time.sleep(0.05)
"""


def test_signals_to_a_parallel_sweep_escalate_to_cells_that_do_not_stop(
    tmp_path, monkeypatch, caplog
):
    import contextlib
    import os
    import signal
    import sys
    import threading

    from staleflow.cluster import sweep as sweep_module
    from tests.integration.test_system import wait_for

    path = sweep_file(tmp_path, "grid: {run.seed: [0]}\n")
    sweep = load_sweep(path, output_dir=tmp_path / "out")
    log, pid = tmp_path / "signals.txt", tmp_path / "pid"
    (tmp_path / "cell.py").write_text(STUCK_CELL)
    monkeypatch.setattr(sweep_module, "_ray_for", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(
        sweep_module, "_child_command",
        lambda *a: ([sys.executable, str(tmp_path / "cell.py"), str(log), str(pid)],
                    dict(os.environ)),
    )  # fmt: skip

    def got() -> list[str]:
        return log.read_text().split() if log.exists() else []

    failures: list[BaseException] = []

    def signal_the_sweep() -> None:  # as a user would: SIGTERM, then again, then again
        try:
            wait_for(log.exists, 30, "the cell to start", poll_s=0.05)
            for n in (1, 2):
                os.kill(os.getpid(), signal.SIGTERM)
                wait_for(lambda n=n: len(got()) == n, 30, f"signal {n} at the cell", poll_s=0.05)
            os.kill(os.getpid(), signal.SIGTERM)
        except BaseException as exc:  # reported by the test's thread below
            failures.append(exc)

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=signal_the_sweep, daemon=True)
    thread.start()
    with caplog.at_level("WARNING", logger="staleflow.cluster.sweep"):
        results = sweep_module._run_processes(sweep, sweep.cells, "127.0.0.1:6379", 2, None, set())
    thread.join(10)
    assert not failures, failures
    # the first two passed on (the second makes a real train stop at once), the third killed
    assert got() == ["SIGTERM", "SIGTERM"]
    with pytest.raises(ProcessLookupError):  # killed, and reaped by the sweep
        os.kill(int(pid.read_text()), 0)
    assert results == {"seed-0": "interrupted"}
    said = caplog.text
    assert "SIGTERM: stopping 1 cell(s) (seed-0)" in said
    assert "SIGTERM again: stopping the cells at once (seed-0)" in said
    assert "SIGTERM a third time: killing the cells still running (seed-0)" in said
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back


def test_a_key_that_a_later_section_replaces_is_refused(tmp_path):
    # overrides: set learner.loss.epsilon_low, then an axis set learner.loss whole: every
    # cell ran with the section's default (0.2), not 0.3, without a word. The same inside
    # one label, whose keys apply in order.
    for body, lost in [
        ("overrides: {learner.loss.epsilon_low: 0.3}\n"
         "grid: {a: {x: {learner.loss: {name: rec-oneside-nois}}}}\n", "learner.loss.epsilon_low"),
        ("overrides: {sync.offset: 1}\ngrid: {fast: {f: {sync: {interval: 2}}}}\n", "sync.offset"),
        ("grid: {a: {x: {learner.loss.epsilon_low: 0.3, learner.loss: {name: grpo}}}}\n",
         "learner.loss.epsilon_low"),
    ]:  # fmt: skip
        with pytest.raises(SweepError, match=rf"{lost} is set, then .* is set whole"):
            load_sweep(sweep_file(tmp_path, body), output_dir=tmp_path / "out")
    # a key inside a section set before it applies on top of it, as before
    sweep = load_sweep(sweep_file(tmp_path, (
        "overrides: {learner.loss: {name: rec-oneside-nois}}\n"
        "grid: {learner.loss.epsilon_low: [0.3, 0.4]}\n"
    )), output_dir=tmp_path / "out")  # fmt: skip
    assert [sweep.config(c).learner.loss.epsilon_low for c in sweep.cells] == [0.3, 0.4]


def test_two_cells_with_one_config_are_refused(tmp_path):
    # 1 and 1.0 make the labels seed-1 and seed-1.0: the same run twice, counted as two
    # seeds in the report
    for grid, cells in [
        ("{run.seed: [1, 1.0]}", "seed-1 and seed-1.0"),
        ("{run.steps: [4, 4.0]}", "steps-4 and steps-4.0"),
        ("{k: {a: {sync.interval: 2}, b: {sync.interval: 2}}}", "a and b"),
    ]:
        with pytest.raises(SweepError, match=f"cells {cells} have the same config"):
            load_sweep(sweep_file(tmp_path, f"grid: {grid}\n"), output_dir=tmp_path / "out")


def test_a_parallel_cell_gets_each_key_once_on_its_command_line(tmp_path):
    # A key in overrides: and on an axis (allowed: the axis's value wins) went twice on a
    # --parallel cell's `staleflow train`, which refuses that: every cell failed. So did
    # run.name in overrides: (the sweep sets it too).
    from staleflow.cluster.sweep import _child_command

    path = sweep_file(tmp_path, "overrides: {run.seed: 5, run.name: x}\ngrid: {run.seed: [0, 1]}\n")
    sweep = load_sweep(path, output_dir=tmp_path / "out")
    argv, _ = _child_command(sweep, sweep.cells[1], "x:1")
    assert [a for a in argv if a.startswith("run.seed=")] == ["run.seed=1"]
    assert [a for a in argv if a.startswith("run.name=")] == ['run.name="seed-1"']
    assert sweep.config(sweep.cells[1]).run.seed == 1  # what the in-process run uses
    from staleflow.configs.loader import check_distinct_overrides

    check_distinct_overrides([a for a in argv if "=" in a and not a.startswith("-")])


def test_a_parallel_sweeps_own_ray_has_cpus_for_its_cells_side_by_side(tmp_path, monkeypatch):
    # Sized for one cell, the cells of `--parallel 3` without --address queued for CPUs,
    # and those that never got them failed after run.start_timeout_s
    import ray

    from staleflow.cluster import placement
    from staleflow.cluster.sweep import _ray_for

    asked: list[int] = []
    monkeypatch.setattr(placement, "start_ray", lambda *a, runs=1, **k: asked.append(runs))
    sweep = load_sweep(sweep_file(tmp_path, "grid: {run.seed: [0, 1]}\n"), tmp_path / "out")
    for parallel, runs in ((1, 1), (3, 2)):  # (never more than the cells to run)
        with _ray_for(sweep, sweep.cells, "127.0.0.1:1", parallel):
            pass
        assert asked.pop() == runs
    # ... and start_ray reserves what that many runs of the largest cell need, in CPUs and
    # in object store. The cells differ in learner ranks or store, not in rollout CPUs, by
    # which alone the cell was once chosen (the first of each grid: 4 CPUs), and the store
    # was one cell's (100 MiB)
    monkeypatch.undo()  # the real start_ray, with Ray itself replaced
    inits: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: inits.append(kwargs))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(placement.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(placement, "_shm_free", lambda: 0)  # (no pre-faulting)
    for n, (grid, cpus, store_mb) in enumerate(
        (
            # 2 runs x (1 worker x 1 CPU + 2 learner ranks) = 6 CPUs; Ray's default store
            ("{learner.num_ranks: [1, 2]}", 6, None),
            # 2 runs x (1 + 1) = 4 CPUs, and 2 x the larger store, 300 MiB
            ("{sync.object_store_mb: [100, 300]}", 4, 600),
        )
    ):
        (tmp_path / str(n)).mkdir()
        grid_sweep = load_sweep(sweep_file(tmp_path / str(n), f"grid: {grid}\n"), tmp_path / "o")
        with _ray_for(grid_sweep, grid_sweep.cells, None, parallel=2):
            pass
        assert inits[-1]["num_cpus"] == cpus + placement.SCALE_HEADROOM
        assert inits[-1].get("object_store_memory") == (store_mb and store_mb << 20)


# A cell's `staleflow train` that, at the sweep's stop signal, ends with the exit status it
# was given: 0 (its last step was its run's last: completed), or another (it failed).
ENDING_CELL = """
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(int(sys.argv[2])))
pathlib.Path(sys.argv[1]).write_text("up")
end = time.monotonic() + 60
while time.monotonic() < end:
    time.sleep(0.05)
"""


def test_cells_that_end_during_a_parallel_stop_are_reported_as_they_ended(tmp_path, monkeypatch):
    # Every cell still running at the stop was recorded "interrupted", whatever its exit
    # status, and no line was printed for it
    import contextlib
    import os
    import signal
    import sys
    import threading

    from staleflow.cluster import sweep as sweep_module
    from tests.integration.test_system import wait_for

    sweep = load_sweep(sweep_file(tmp_path, "grid: {run.seed: [0, 1]}\n"), tmp_path / "out")
    (tmp_path / "cell.py").write_text(ENDING_CELL)
    monkeypatch.setattr(sweep_module, "_ray_for", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(
        sweep_module, "_child_command",
        lambda sweep, cell, *a: ([sys.executable, str(tmp_path / "cell.py"),
                                  str(tmp_path / cell.name), "0" if cell.name == "seed-0" else "3"],
                                 dict(os.environ)),
    )  # fmt: skip

    def stop_once_both_run() -> None:
        both = lambda: all((tmp_path / c.name).exists() for c in sweep.cells)  # noqa: E731
        wait_for(both, 30, "both cells to start", poll_s=0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    told: list[tuple[str, str]] = []
    thread = threading.Thread(target=stop_once_both_run, daemon=True)
    thread.start()
    results = sweep_module._run_processes(
        sweep, sweep.cells, "127.0.0.1:6379", 2,
        lambda cell, status, summary: told.append((cell.name, status)), set(),
    )  # fmt: skip
    thread.join(10)
    assert results == {"seed-0": "completed", "seed-1": "failed"}
    assert ("seed-0", "completed") in told
    assert ("seed-1", "failed") in told
