"""What a terminal shows of a run: the live progress line, and the summary at its end."""

from __future__ import annotations

import io

from rich.console import Console

from staleflow.cluster.progress import Progress

STATS = {"reward_mean": 0.146, "lag_mean": 1.0, "lag_max": 1, "tokens_per_s": 6951,
         "learner_busy": 0.46, "rollout_busy": 0.34}  # fmt: skip


def drawn(width: int, steps_at: list[float], total: int = 10) -> str:
    """The bar's last drawing after a step at each time of `steps_at` (a fake clock)."""
    now = [0.0]
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, color_system=None)
    progress = Progress("tiny-20261127-212801-cc449e8f", console=console, clock=lambda: now[0])
    progress.start(total)
    for step, at in enumerate(steps_at, start=1):
        now[0] = at
        progress.step(step, STATS)
        progress.bar.refresh()
    progress.stop()
    return out.getvalue().split("\r")[-1]


def test_an_80_column_terminal_shows_the_step_the_times_and_the_eta_first():
    # the run name and the stats came first, and pushed "3/10", the elapsed time and the
    # ETA off an 80-column line
    line = drawn(80, [20.0, 40.0, 60.0])
    assert "3/10" in line
    assert "0:01:00" in line  # elapsed
    assert "ETA 0:02:20" in line  # 7 steps left at 20 s each
    assert "reward 0.146" in line  # the stats get the rest, cut at the line's end


def test_the_eta_is_shown_when_steps_are_minutes_apart():
    # rich estimates speed over its last 30 s by default: with the CPU demo's ~50 s steps it
    # never had an estimate, and the ETA stayed -:--:-- for the whole run
    line = drawn(120, [50.0, 100.0, 150.0])
    assert "ETA 0:05:50" in line  # 7 steps left at 50 s each


def test_the_end_summary_names_the_run_directory_and_both_times(capsys, tmp_path):
    # "run tiny-...-cc449e8f: completed after 6 steps in 0 s": the run's key, not the
    # directory a user types next, and the time of the steps alone (the run took 13 s)
    from types import SimpleNamespace

    from staleflow.cluster.commands import _print_summary

    run = SimpleNamespace(path=tmp_path / "tiny-20261127", report=tmp_path / "report.html")
    summary = {"run_id": "tiny-20261127-cc449e8f", "status": "completed", "steps": 6,
               "wall_s": 0.488}  # fmt: skip
    _print_summary(run, summary, total_s=13.2)
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (
        "run tiny-20261127: completed after 6 steps in 0.5 s (13.2 s in all, with start-up "
        "and shutdown)"
    )


def test_the_end_summary_names_the_report_or_how_to_build_it(capsys, tmp_path):
    # run.report: false skips report.html and its plots (2-3 s of CPU): the summary says
    # so and gives the command that builds them, instead of naming a file not written
    from types import SimpleNamespace

    from staleflow.cluster.commands import _print_summary

    run = SimpleNamespace(path=tmp_path / "r", report=tmp_path / "r" / "report.html")
    summary = {"status": "completed", "steps": 2, "wall_s": 1.0}
    _print_summary(run, summary, report=True)
    assert f"report: {run.report}" in capsys.readouterr().out.splitlines()
    _print_summary(run, summary, report=False)
    lines = capsys.readouterr().out.splitlines()
    assert f"report: not written (run.report: false); staleflow report {run.path}" in lines
