"""The repository's promises: CI runs the README's test command, the layout is as requested."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_test_command() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("pass the tests", 1)[1]
    match = re.search(r"```bash\n(.+?)\n```", section, re.S)
    assert match, "README.md lost its test command block"
    return match.group(1).strip()


def test_ci_runs_exactly_the_readme_test_command():
    lines = [
        line.strip()
        for line in (REPO / ".ci/run").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert lines[-1] == readme_test_command()


def test_top_level_layout():
    for name in ("pyproject.toml", "README.md", "actors", "buffer", "learner", "cluster",
                 "configs", "tests"):  # fmt: skip
        assert (REPO / name).exists(), name
