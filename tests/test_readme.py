"""Every `staleflow` command README.md shows: it parses as written (placeholders filled in),
the configs and overrides it names load and pass the schedule checks, and the cheap ones run.
The expensive ones (training the quickstart, the tiny sweep) run in the system and study
tests; those needing a cluster are parsed only."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from staleflow.cluster.cli import parse
from staleflow.configs import load_config

REPO = Path(__file__).resolve().parents[1]

# README placeholders -> something that exists here
PLACES = {
    "CONFIG": "configs/tiny.yaml",
    "runs/NAME": "runs/NAME",
    "path/to/hf-model": "path/to/hf-model",
    "PASSWORD": "pw",
    "PW": "pw",
    "HOST": "localhost",
}


def readme_commands() -> list[str]:
    """Lines of README's code blocks that run the staleflow CLI (comments stripped)."""
    commands, fenced = [], False
    for raw in (REPO / "README.md").read_text().splitlines():
        if raw.startswith("```"):
            fenced = not fenced
            continue
        line = raw.split("  #", 1)[0].strip()
        if fenced and line.startswith(("staleflow ", ".venv/bin/staleflow ")):
            commands.append(line.removeprefix(".venv/bin/"))
    return commands


COMMANDS = readme_commands()


def test_readme_shows_the_commands_this_test_knows():
    assert len(COMMANDS) >= 15, COMMANDS
    assert {c.split()[1] for c in COMMANDS} >= {
        "train", "eval", "scale", "report", "buffer", "sweep", "replay", "config",
    }  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS)
def test_every_readme_command_parses_and_its_config_loads(command):
    argv = shlex.split(command)[1:]
    for key, value in PLACES.items():
        argv = [a.replace(key, value) for a in argv]
    if "--help" in argv:
        with pytest.raises(SystemExit) as done:
            parse(argv)
        assert done.value.code == 0
        return
    args = parse(argv)  # SystemExit(2) on anything argparse would refuse
    if getattr(args, "resume", None):
        from staleflow.cluster.resume import resume_overrides_allowed

        assert args.config is None
        resume_overrides_allowed(args.overrides)  # what a resume may change
        return
    config = getattr(args, "config", None)
    if config is not None and args.command == "train":
        from staleflow.cluster.schedule import check_schedule

        check_schedule(load_config(REPO / config, args.overrides))
    elif config is not None:
        assert (REPO / config).is_file(), config


def test_readme_config_command_runs(capsys):
    from staleflow.cluster.cli import main

    (command,) = [c for c in COMMANDS if c.split()[1] == "config"]
    assert main(shlex.split(command)[1:]) == 0
    assert '"name": "grpo"' in capsys.readouterr().out


def test_readme_sweep_dry_run_lists_the_paper_grid(capsys):
    from staleflow.cluster.cli import main

    (command,) = [c for c in COMMANDS if "--dry-run" in c]
    assert main(shlex.split(command)[1:]) == 0
    assert "cells" in capsys.readouterr().out.lower()
