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
                 "configs", "tests", "docker"):  # fmt: skip
        assert (REPO / name).exists(), name


def _admitted_by_dockerignore() -> set[str]:
    """The paths .dockerignore lets into the build context (its `!` lines)."""
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return {line[1:].strip() for line in lines if line.startswith("!")}


def test_images_copy_every_package_folder():
    # A package folder added to pyproject.toml but not to the Dockerfiles (or let through
    # .dockerignore) would build an image that fails at its first import.
    import tomllib

    folders = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].values())  # fmt: skip
    admitted = _admitted_by_dockerignore()
    assert folders <= admitted, folders - admitted
    for dockerfile in ("docker/Dockerfile.cpu", "docker/Dockerfile.gpu"):
        copied = set(re.findall(r"^COPY (\w+) \1$", (REPO / dockerfile).read_text(), re.M))
        assert folders <= copied, (dockerfile, folders - copied)


def test_images_copy_the_files_the_build_reads():
    # setuptools fails to build the wheel when the readme or a license file is missing, so
    # both must pass .dockerignore and be copied next to pyproject.toml.
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = {"pyproject.toml", project["readme"], *project["license-files"]}
    assert all((REPO / name).is_file() for name in needed), needed
    admitted = _admitted_by_dockerignore()
    assert needed <= admitted, needed - admitted
    for dockerfile in ("docker/Dockerfile.cpu", "docker/Dockerfile.gpu"):
        copied = re.search(r"^COPY ((?:\S+ )+)\./$", (REPO / dockerfile).read_text(), re.M)
        assert copied, dockerfile
        assert needed <= set(copied.group(1).split()), dockerfile


def test_images_run_staleflow_under_tini():
    # staleflow as PID 1 never reaps the processes Ray orphans, and `docker stop`'s clean
    # stop was checked for the CPU image only (docker/build.sh): both images install tini
    # and start staleflow through it.
    for dockerfile in ("docker/Dockerfile.cpu", "docker/Dockerfile.gpu"):
        text = (REPO / dockerfile).read_text()
        stages = text.split("\nFROM ")
        final = stages[-1]
        assert re.search(r"apt-get install[^&]*\btini\b", final), dockerfile
        entry = re.findall(r"^ENTRYPOINT (.+)$", final, re.M)
        assert entry == ['["/usr/bin/tini", "--", "staleflow"]'], (dockerfile, entry)


def test_every_cited_doc_ships_with_the_repository():
    # Code, configs and docs cite docs/algorithms.md and docs/architecture.md by name; a
    # citation of a file outside the repository could not be followed by anyone who clones it.
    cited: set[str] = set()
    parts_cited: list[tuple[Path, str, str]] = []
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if path.suffix not in {".py", ".md", ".yaml", ".toml"} or any(
            p.startswith(".") or p in {"build", "runs"} or p.endswith(".egg-info") for p in parts
        ):
            continue
        text = path.read_text(errors="replace")
        assert "../" + "shared" not in text, f"{path} points outside the repository"
        cited.update(re.findall(r"\bdocs/[\w/.-]+\.md\b", text))
        # a part cited by name (`docs/architecture.md, "Contracts"`, possibly across a line
        # break and a comment's `#`) must be a heading or a bold paragraph label there
        for doc, name in re.findall(r'\b(docs/[\w/.-]+\.md),?[\s#]*"([A-Z][\w ]+)"', text):
            parts_cited.append((path, doc, " ".join(name.split())))
    assert {"docs/algorithms.md", "docs/architecture.md"} <= cited
    for doc in cited:
        assert (REPO / doc).is_file(), f"{doc} is cited but missing"
    assert len(parts_cited) >= 10  # the pattern finds the citations
    for path, doc, name in parts_cited:
        text = (REPO / doc).read_text()
        headings = {line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")}
        named = any(h == name or h.split(". ", 1)[-1] == name for h in headings)
        labelled = f"**{name}**" in text or f"**{name}.**" in text
        assert named or labelled, f"{path} cites {doc}, {name!r}: no such part"


def test_configuration_reference_is_generated_from_the_current_schema():
    from staleflow.cluster.commands import config_reference

    current = (REPO / "docs/configuration.md").read_text()
    assert current == config_reference(), "docs/configuration.md is stale: run `make docs`"
    # every key of the schema is in it, e.g. one of each section and a preset's own parameter
    for key in ("model.dtype", "task.eval_fraction", "rollout.vllm.max_model_len",
                "buffer.claim_idle_s", "learner.optimizer.warmup_steps", "sync.bucket_mb",
                "run.record_trajectories", "learner.loss.regularizer_coef"):  # fmt: skip
        assert f"| `{key}` |" in current
