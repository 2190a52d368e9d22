"""The off-policyness study: deterministic replay of an async run, and `staleflow sweep`.

Real Ray (the session's `ray_local`), real Redis, real DeepSpeed, the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from staleflow.cluster.rundir import RunDir, read_metrics
from staleflow.cluster.sweep import load_sweep, run_sweep
from staleflow.cluster.sweep_report import write_sweep_report
from staleflow.cluster.trajectories import read_trajectories, replay
from staleflow.configs import dump_config, load_config
from tests.integration.tiny import TINY, run_driver

# one xdist worker runs the whole module: the sweep it checks is a module fixture (run once)
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("study")]

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "staleflow.cluster.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ----------------------------------------------------------------------------- replay


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, ray_local):
    """An async run with real lag: one free-running worker, max_staleness 1, 8 steps (lag 1
    from step 2 on, see test_system)."""
    _, run, summary, _ = run_driver(
        tmp_path_factory.mktemp("async"),
        "sync.mode=async",
        "buffer.max_staleness=1",
        "rollout.num_workers=1",
        "rollout.group_size=4",  # a group of 2 often has equal rewards: no gradient at all
        "run.steps=8",
    )
    assert summary["status"] == "completed"
    return run


def test_every_step_records_its_groups_in_order(async_run):
    steps, groups = read_trajectories(async_run.trajectories)
    logged = [r for r in read_metrics(async_run.metrics) if r["kind"] == "step"]
    assert [s["step"] for s in steps] == list(range(1, 9))
    for entry, record in zip(steps, logged, strict=True):
        assert entry["learner_version"] == entry["step"] - 1
        assert len(entry["groups"]) == record["groups"] == 2
        lags = [entry["learner_version"] - version for _, version in entry["groups"]]
        assert (min(lags), max(lags)) == (record["lag_min"], record["lag_max"])
        for gid, version in entry["groups"]:  # the stored group is the one recorded
            assert groups[gid].policy_version == version
    # the run was really off-policy, so replay has stale data to get right
    assert [s["learner_version"] - s["groups"][0][1] for s in steps] == [0] + [1] * 7


def test_replay_reproduces_the_learners_metrics(async_run):
    result = replay(async_run.path)
    assert result.steps == 8
    assert result.ok, result.mismatches
    assert result.worst["loss"] <= 1e-5
    assert result.worst["grad_norm"] <= 1e-5
    # the comparison bites: the run trained, so its losses and norms are not all zero
    logged = [r for r in read_metrics(async_run.metrics) if r["kind"] == "step"]
    assert any(abs(r["loss"]) > 0 for r in logged)
    assert all(r["grad_norm"] > 0 for r in logged)


def test_replay_detects_a_changed_sequence(async_run, tmp_path):
    # the same groups, steps 3 and 4 consumed in the other order: from step 3 on the
    # weights differ from the run's, and replay must say so
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(async_run.path, copy)
    path = copy / "trajectories" / "steps.jsonl"
    lines = path.read_text().splitlines()
    a, b = json.loads(lines[2]), json.loads(lines[3])
    a["groups"], b["groups"] = b["groups"], a["groups"]
    lines[2], lines[3] = json.dumps(a), json.dumps(b)
    path.write_text("\n".join(lines) + "\n")
    result = replay(copy)
    assert not result.ok
    assert result.mismatches[0].startswith("step 3:")
    # the CLI says the same with its exit status
    proc = cli("replay", str(copy), "--steps", "3", timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "MISMATCH" in proc.stdout
    assert "step 3:" in proc.stdout


def test_replay_says_what_it_compared_and_names_a_damaged_step(async_run, tmp_path, capsys):
    # An empty metrics.jsonl replayed every step, compared none, and said "every step
    # reproduced the run's metrics"; a step record without its groups was a KeyError after
    # the learner was built.
    import argparse
    import shutil

    from staleflow.cluster.commands import cmd_replay
    from staleflow.cluster.trajectories import ReplayError

    copy = tmp_path / "copy"
    shutil.copytree(async_run.path, copy)
    metrics = copy / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("")
    with pytest.raises(ReplayError, match=r"metrics\.jsonl has no record of step 1"):
        replay(copy)
    # a run that stopped after logging step 2: step 3 is replayed, not compared
    kept = [r for r in records if r["kind"] != "step" or r["step"] <= 2]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
    args = argparse.Namespace(run_dir=str(copy), steps=None, rtol=1e-5, atol=1e-7)
    assert cmd_replay(args) == 0
    out = capsys.readouterr().out
    assert "replayed 3 steps" in out
    assert "the last step replayed has no metrics in the run" in out
    assert "every step compared (2) reproduced the run's metrics" in out
    steps = copy / "trajectories" / "steps.jsonl"
    lines = steps.read_text().splitlines()
    lines[1] = '{"step": 2, "learner_version": 1}'  # damaged: no groups
    steps.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReplayError, match=r"steps\.jsonl:2 is damaged .*\(--steps 1 replays"):
        replay(copy)
    assert replay(copy, steps=1).compared == 1  # the steps before it still replay


def test_replay_refuses_a_run_without_trajectories(tmp_path):
    run = RunDir.create(str(tmp_path), "bare")
    run.config.write_text(dump_config(load_config(REPO / "configs/tiny.yaml")))
    proc = cli("replay", str(run.path))
    assert proc.returncode == 2
    assert "no recorded trajectories" in proc.stderr


# ----------------------------------------------------------------------------- sweep


def write_sweep(tmp_path: Path) -> Path:
    base = tmp_path / "base.yaml"
    base.write_text(TINY.replace("num_workers: 2", "num_workers: 1"))
    sweep = tmp_path / "grid.yaml"
    sweep.write_text(
        f"""
name: grid
base: base.yaml
output_dir: {tmp_path / "out"}
overrides:
  {{rollout.group_size: 4, run.steps: 4, run.eval_every: 2, task.eval_prompts: 4,
    sync.mode: lockstep}}
threshold: 0.3
grid:
  sync:
    onpolicy: {{sync.interval: 1, sync.offset: 0}}
    offline: {{sync.interval: 1, sync.offset: 1000}}
  algorithm:
    reinforce: {{learner.loss: {{name: reinforce}}}}
    grpo: {{learner.loss: {{name: grpo}}}}
"""
    )
    return sweep


def test_sweep_runs_every_cell_reports_and_resumes(tmp_path, ray_local):
    sweep = load_sweep(write_sweep(tmp_path))
    names = [c.name for c in sweep.cells]
    assert names == [
        "onpolicy__reinforce", "onpolicy__grpo", "offline__reinforce", "offline__grpo",
    ]  # fmt: skip
    results = run_sweep(sweep)
    assert results == dict.fromkeys(names, "completed")
    for cell in sweep.cells:  # each cell ran its own settings
        cfg = json.loads((sweep.runs / cell.name / "config.json").read_text())
        assert cfg["learner"]["loss"]["name"] == cell.labels["algorithm"]
        assert cfg["sync"]["offset"] == (1000 if cell.labels["sync"] == "offline" else 0)
        records = list(read_metrics(sweep.runs / cell.name / "metrics.jsonl"))
        steps = [r for r in records if r["kind"] == "step"]
        assert len(steps) == 4
        # offline trains only on the initial policy's data: lag t-1 at step t (the offline
        # setting's check; test_system.py's lag-formula runs cover the others)
        offline = cell.labels["sync"] == "offline"
        expected = [t - 1 for t in range(1, 5)] if offline else [0] * 4
        assert [(r["lag_min"], r["lag_max"]) for r in steps] == [(e, e) for e in expected]
        if offline:  # every batch generated, and every group trained, on v0
            assert {r["policy_version"] for r in records if r["kind"] == "rollout"} == {0}
            summary = json.loads((sweep.runs / cell.name / "summary.json").read_text())
            assert set(summary["trained_by_version"]) == {"0"}
            assert summary["groups"]["reconciled"], summary["groups"]
    report = write_sweep_report(sweep.directory)
    assert report.is_file()
    for name in ("reward", "accuracy", "eval_reward", "clip_frac", "kl"):
        assert (sweep.directory / "plots" / f"{name}.png").stat().st_size > 1000
    rows = json.loads((sweep.directory / "summary.json").read_text())
    assert {(r["sync"], r["algorithm"]) for r in rows} == {
        (s, a) for s in ("onpolicy", "offline") for a in ("reinforce", "grpo")
    }
    for row in rows:  # evaluations at steps 0, 2, 4 of one seed each
        records = list(
            read_metrics(sweep.runs / f"{row['sync']}__{row['algorithm']}" / "metrics.jsonl")
        )
        evals = [r["accuracy"] for r in records if r["kind"] == "eval"]
        kls = [r["approx_kl"] for r in records if r["kind"] == "step"]
        assert row["kl_last"] == pytest.approx(sum(kls) / len(kls))  # 4 steps, all in the tail
        assert row["runs"] == 1
        assert len(evals) == 3
        assert row["final"] == evals[-1]
        assert row["peak"] == max(evals)
    assert "| sync | algorithm |" in (sweep.directory / "summary.md").read_text()

    # resumable: completed cells are skipped; an incomplete one continues from its last
    # checkpoint (as one stopped during its last step: its final evaluation and summary are
    # left to do); one that cannot (no checkpoint in LATEST) is set aside and rerun
    (sweep.runs / "offline__grpo" / "summary.json").unlink()
    (sweep.runs / "offline__reinforce" / "summary.json").unlink()
    (sweep.runs / "offline__reinforce" / "checkpoints" / "LATEST").unlink()
    write_sweep_report(sweep.directory)  # a cell that did not complete is left out
    rows = json.loads((sweep.directory / "summary.json").read_text())
    assert [r["runs"] for r in rows if r["algorithm"] == "grpo" and r["sync"] == "offline"] == [0]
    evals_before = [r for r in read_metrics(sweep.runs / "offline__grpo" / "metrics.jsonl")
                    if r["kind"] == "eval"]  # fmt: skip
    seen = []
    results = run_sweep(
        load_sweep(write_sweep(tmp_path)), on_cell=lambda c, st, s: seen.append((c.name, st))
    )
    assert results["offline__grpo"] == results["offline__reinforce"] == "completed"
    assert ("offline__grpo", "resuming") in seen
    assert ("offline__reinforce", "started") in seen
    assert all(results[n] == "skipped (completed)" for n in names[:2])
    records = list(read_metrics(sweep.runs / "offline__grpo" / "metrics.jsonl"))
    assert [r["step"] for r in records if r["kind"] == "resume"] == [4]
    assert [r["step"] for r in records if r["kind"] == "step"] == [1, 2, 3, 4]  # once each
    assert [r for r in records if r["kind"] == "eval"] == evals_before  # none made twice
    aside = list((sweep.directory / "incomplete").iterdir())
    assert len(aside) == 1
    assert aside[0].name.startswith("offline__reinforce-")
    assert (aside[0] / "metrics.jsonl").is_file()  # kept, not deleted


def test_sweep_cells_in_parallel_join_one_ray_cluster(tmp_path, ray_local):
    # two cells at once, each a `staleflow train` process joining the session's Ray
    sweep = load_sweep(write_sweep(tmp_path))
    sweep.cells = sweep.cells[:2]
    results = run_sweep(sweep, parallel=2)
    assert results == {"onpolicy__reinforce": "completed", "onpolicy__grpo": "completed"}
    for cell in sweep.cells:
        summary = json.loads((sweep.runs / cell.name / "summary.json").read_text())
        assert summary["steps"] == 4
        assert summary["groups"]["reconciled"]
        assert (sweep.directory / "logs" / f"{cell.name}.out").is_file()
    # an incomplete cell goes on as `staleflow train --resume` of its run directory
    (sweep.runs / "onpolicy__grpo" / "summary.json").unlink()
    results = run_sweep(sweep, parallel=2)
    assert results == {"onpolicy__grpo": "completed", "onpolicy__reinforce": "skipped (completed)"}
    records = list(read_metrics(sweep.runs / "onpolicy__grpo" / "metrics.jsonl"))
    assert [r["step"] for r in records if r["kind"] == "resume"] == [4]
    assert [r["step"] for r in records if r["kind"] == "step"] == [1, 2, 3, 4]
    assert not (sweep.directory / "incomplete").exists()


def test_sweep_cli_lists_cells_and_refuses_a_bad_cell(tmp_path):
    sweep = write_sweep(tmp_path)
    proc = cli("sweep", str(sweep), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "4 cells" in proc.stdout
    assert "new        offline__grpo" in proc.stdout
    sweep.write_text(sweep.read_text().replace("name: grpo", "name: grop"))
    proc = cli("sweep", str(sweep))
    assert proc.returncode == 2
    assert "cell onpolicy__grpo" in proc.stderr
    assert "grop" in proc.stderr
    assert not (tmp_path / "out" / "grid" / "runs").exists()  # nothing ran


def test_shipped_sweeps_load(tmp_path):
    from staleflow.cluster.schedule import check_schedule
    from staleflow.configs import load_config

    paper_grids = ("paper.yaml", "tiny.yaml")
    for name in paper_grids:
        sweep = load_sweep(REPO / "configs" / "sweeps" / name, output_dir=tmp_path)
        assert len(sweep.cells) == 30, name  # 3 sync settings x 10 algorithms
        assert set(sweep.axes["sync"]) == {"sync_interval-20", "sync_offset-10", "offline"}
    # the quickstart study: 2 schedules x 3 seeds, every cell a valid run
    sweep = load_sweep(REPO / "configs/sweeps/quickstart-schedule.yaml", output_dir=tmp_path)
    assert len(sweep.cells) == 6
    assert set(sweep.axes["sync"]) == {"lockstep-on-policy", "async-lag-1"}
    for cell in sweep.cells:
        check_schedule(load_config(sweep.base, list(cell.overrides)))
    shipped = {p.name for p in (REPO / "configs" / "sweeps").glob("*.yaml")}
    assert shipped == {*paper_grids, "quickstart-schedule.yaml"}  # a new one gets a check here
