"""The distribution: folders install as staleflow.<folder>, in wheels as in editable installs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import staleflow.learner.losses

REPO = Path(__file__).resolve().parents[1]


def test_editable_install_maps_folders_to_staleflow_packages():
    assert Path(staleflow.learner.losses.__file__).resolve() == REPO / "learner" / "losses.py"


def test_bare_folder_names_are_not_importable_as_staleflow_code():
    # `learner` must not shadow or be shadowed by an unrelated PyPI package of that name
    out = subprocess.run(
        [sys.executable, "-c", "import learner.losses"], capture_output=True, cwd="/", text=True
    )
    assert out.returncode != 0


@pytest.mark.slow
def test_wheel_contains_the_mapped_packages_and_configs(tmp_path):
    # built from a copy: pip writes build/ and staleflow.egg-info/ next to the sources
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".*", "build", "*.egg-info", "__pycache__", "runs", "gpu-results",
    ))  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(source)],
        check=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("staleflow-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "staleflow/learner/losses.py",
        "staleflow/learner/advantages.py",
        "staleflow/configs/schema.py",
        "staleflow/configs/quickstart.yaml",
        "staleflow/configs/paper/rec-gsm8k.yaml",
        "staleflow/cluster/cli.py",
    ):
        assert expected in names
    assert not any(n.startswith(("learner/", "tests/", "configs/")) for n in names)


def test_vllm_is_a_declared_extra_pinned_to_the_verified_release():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["vllm"] == ["vllm==0.25.0"]
    assert "0.25.0" in (REPO / "README.md").read_text()  # README says which was verified
