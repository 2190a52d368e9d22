"""The installed `staleflow` console script, run as a user would run it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from staleflow.configs import LOSS_PRESETS

REPO = Path(__file__).resolve().parents[1]
EXE = shutil.which("staleflow", path=str(Path(sys.executable).parent))


def staleflow(*args: str) -> subprocess.CompletedProcess[str]:
    assert EXE, "the staleflow console script is not installed next to this Python"
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_version():
    out = staleflow("--version")
    assert out.returncode == 0
    assert out.stdout.strip().startswith("staleflow 0.")


def test_help_lists_the_commands():
    out = staleflow("--help")
    assert out.returncode == 0
    assert "config" in out.stdout
    assert "losses" in out.stdout


def test_config_prints_the_resolved_config_as_json():
    out = staleflow("config", "configs/tiny.yaml", "learner.loss.epsilon_high=3.0")
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    assert resolved["learner"]["loss"]["epsilon_high"] == 3.0
    assert resolved["model"]["preset"] == "tiny"


def test_config_error_exits_2_with_the_location():
    out = staleflow("config", "configs/tiny.yaml", "sync.offset=-1")
    assert out.returncode == 2
    assert "override 'sync.offset=-1': sync.offset" in out.stderr


@pytest.mark.parametrize("args", [(), ("--json",)])
def test_losses_lists_every_preset(args):
    out = staleflow("losses", *args)
    assert out.returncode == 0
    for name in LOSS_PRESETS:
        assert name in out.stdout


def test_losses_unknown_preset():
    out = staleflow("losses", "nope")
    assert out.returncode == 2
    assert "valid: reinforce" in out.stderr
