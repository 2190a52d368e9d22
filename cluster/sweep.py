"""`staleflow sweep SWEEP.yaml`: a grid of runs over any config keys, resumable.

A sweep file names a base run config, overrides for every cell, and the grid's axes:

    name: tiny                        # the sweep directory's name (default: the file's stem)
    base: ../tiny.yaml                # relative to this file
    output_dir: runs/sweeps           # the sweep directory is <output_dir>/<name>
    overrides: {run.steps: 40}        # every cell
    columns: sync                     # the figures' columns (default: the first axis)
    lines: algorithm                  # one line per value (default: the second axis)
    threshold: 0.5                    # held-out accuracy for "steps to threshold"
    grid:
      sync:                           # a named axis: label -> overrides
        sync_interval-20: {sync.interval: 20, sync.offset: 0}
        offline: {sync.interval: 1, sync.offset: 1000000}
      algorithm:
        grpo: {learner.loss: {name: grpo}}       # a mapping value replaces the whole section
      run.seed: [0, 1]                # a key axis: one cell per value

Cells are the cartesian product of the axes; axes other than `columns` and `lines` (seeds)
are averaged over in the report. Each cell is a normal run directory under
<sweep dir>/runs/<cell>; a cell whose summary says "completed" is skipped when the sweep is
run again, and a cell left incomplete (Ctrl-C, a crash) is moved to <sweep dir>/incomplete/
and run again. One after another, cells share one Ray instance in this process; with
`--parallel K` (and `--address` for a cluster) K cells run at once as `staleflow train`
processes joining the same Ray cluster.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from staleflow.cluster.rundir import read_json_object, write_text
from staleflow.configs.loader import ConfigError, named_text

__all__ = [
    "Cell", "Sweep", "SweepError", "cell_status", "load_sweep", "read_summary", "run_status",
    "run_sweep",
]  # fmt: skip

logger = logging.getLogger(__name__)

_KEYS = {"name", "base", "output_dir", "overrides", "columns", "lines", "threshold", "grid"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class SweepError(ConfigError):
    """A sweep file that cannot be run: what is wrong and how to fix it."""


@dataclass(frozen=True)
class Cell:
    """One run of the grid: its directory name, its label on each axis, its overrides."""

    name: str
    labels: dict[str, str]
    overrides: tuple[str, ...]


@dataclass
class Sweep:
    name: str
    source: Path
    base: Path
    directory: Path
    overrides: tuple[str, ...]
    axes: dict[str, dict[str, tuple[str, ...]]]  # axis -> label -> overrides
    columns: str
    lines: str
    threshold: float = 0.5
    cells: list[Cell] = field(default_factory=list)
    configs: dict[str, Any] = field(default_factory=dict)  # cell name -> resolved config

    @property
    def runs(self) -> Path:
        return self.directory / "runs"

    def config(self, cell: Cell) -> Any:
        """The cell's resolved run config (its run name and directory set by the sweep),
        loaded and checked once by `load_sweep`."""
        return self.configs[cell.name]


def _cell_config(sweep: Sweep, cell: Cell) -> Any:
    from staleflow.cluster.schedule import check_schedule
    from staleflow.configs import load_config

    placement = (f"run.name={cell.name}", f"run.output_dir={sweep.runs}")
    try:
        cfg = load_config(sweep.base, (*sweep.overrides, *cell.overrides, *placement))
        check_schedule(cfg)
    except ConfigError as exc:
        raise SweepError(f"{sweep.source}: cell {cell.name}: {exc}") from None
    return cfg


def _as_overrides(values: Any, where: str) -> tuple[str, ...]:
    """{dotted.key: value} -> ("dotted.key=<value as JSON>", ...); a mapping value replaces
    the section (e.g. learner.loss: {name: grpo})."""
    if not isinstance(values, dict):
        raise SweepError(
            f"{where}: expected a mapping of dotted config keys to values, e.g. "
            f"{{sync.interval: 20}}; got {values!r}"
        )
    out = []
    for key, value in values.items():
        if not isinstance(key, str) or not all(key.split(".")):
            raise SweepError(f"{where}: {key!r} is not a dotted config key like sync.interval")
        out.append(f"{key}={json.dumps(value)}")
    return tuple(out)


# The exit statuses of a `staleflow train` stopped cleanly by a signal: 128 + the signal.
_STOPPED_CLEANLY = frozenset({128 + signal.SIGINT, 128 + signal.SIGTERM})


def _label(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(value))


def _unique_labels(
    where: str, entries: list[tuple[Any, str, tuple[str, ...]]]
) -> dict[str, tuple[str, ...]]:
    """label -> overrides of one axis, refusing two values that make the same label (the same
    value twice, 0.001 and 1.0e-3, 'a b' and 'a_b'): one cell would silently replace the
    other, as cells and their run directories are named by these labels."""
    out: dict[str, tuple[str, ...]] = {}
    first: dict[str, Any] = {}
    for value, label, overrides in entries:
        if label in out:
            raise SweepError(
                f"{where}: {first[label]!r} and {value!r} both make the cell label {label!r}; "
                "give each value once, with labels that differ in letters, digits or _.-"
            )
        out[label], first[label] = overrides, value
    return out


def load_sweep(path: str | Path, output_dir: str | Path | None = None) -> Sweep:
    """Read and check a sweep file; every cell's config is validated before anything runs."""
    path = Path(path)
    try:
        data = yaml.safe_load(named_text(path.read_text(encoding="utf-8"), str(path)))
    except FileNotFoundError:
        raise SweepError(f"sweep file not found: {path}") from None
    except (OSError, yaml.YAMLError) as exc:
        raise SweepError(f"cannot read sweep file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SweepError(f"{path}: a sweep file is a mapping with base: and grid: keys")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {unknown}; valid: {sorted(_KEYS)}")
    if "base" not in data or "grid" not in data:
        raise SweepError(f"{path}: needs base: (a run config) and grid: (the axes)")
    name = str(data.get("name") or path.stem)
    if not _NAME.match(name):
        raise SweepError(f"{path}: name {name!r} must be letters, digits and _.- only")
    base = (path.parent / str(data["base"])).resolve()
    if not base.is_file():
        raise SweepError(f"{path}: base config {base} not found (base: is relative to the file)")
    grid = data["grid"]
    if not isinstance(grid, dict) or not grid:
        raise SweepError(f"{path}: grid: must map each axis to its values")
    axes: dict[str, dict[str, tuple[str, ...]]] = {}
    for axis, values in grid.items():
        where = f"{path}: grid.{axis}"
        if isinstance(values, list):  # a key axis: the axis is a config key
            if not values:
                raise SweepError(f"{where}: the list of values is empty")
            axes[str(axis)] = _unique_labels(
                where,
                [(v, f"{str(axis).split('.')[-1]}-{_label(v)}", _as_overrides({axis: v}, where))
                 for v in values],
            )  # fmt: skip
        elif isinstance(values, dict) and values:
            for label in values:
                if not isinstance(label, (str, int, float)) or isinstance(label, bool):
                    raise SweepError(
                        f"{where}: label {label!r} is not a string; quote it (YAML reads "
                        "on / off / yes / no as booleans)"
                    )
            axes[str(axis)] = _unique_labels(
                where,
                [(label, _label(label), _as_overrides(o, f"{where}.{label}"))
                 for label, o in values.items()],
            )  # fmt: skip
        else:
            raise SweepError(
                f"{where}: give a list of values for a config key (run.seed: [0, 1]) or a "
                "mapping of labels to overrides ({grpo: {learner.loss: {name: grpo}}})"
            )
    names = list(axes)
    columns = str(data.get("columns", names[0]))
    lines = str(data.get("lines", names[1] if len(names) > 1 else names[0]))
    for role, axis in (("columns", columns), ("lines", lines)):
        if axis not in axes:
            raise SweepError(f"{path}: {role}: {axis!r} is not an axis; axes: {names}")
    threshold = data.get("threshold", 0.5)
    if not isinstance(threshold, (int, float)):
        raise SweepError(
            f"{path}: threshold: must be a number (held-out accuracy), got {threshold!r}"
        )
    directory = Path(output_dir or data.get("output_dir", "runs/sweeps")) / name
    sweep = Sweep(
        name=name,
        source=path,
        base=base,
        directory=directory,
        overrides=_as_overrides(data.get("overrides") or {}, f"{path}: overrides"),
        axes=axes,
        columns=columns,
        lines=lines,
        threshold=float(threshold),
    )
    for combo in itertools.product(*(axes[a].items() for a in names)):
        labels = {a: label for a, (label, _) in zip(names, combo, strict=True)}
        cell_name = "__".join(labels[a] for a in names)
        if not _NAME.match(cell_name):
            raise SweepError(f"{path}: cell name {cell_name!r} is not a valid run name")
        overrides = tuple(o for _, os_ in combo for o in os_)
        cell = Cell(cell_name, labels, overrides)
        sweep.cells.append(cell)
        sweep.configs[cell_name] = _cell_config(sweep, cell)
    return sweep


def read_summary(run: Path) -> dict[str, Any] | None:
    """A run directory's summary.json, or None while it has none (or a torn one)."""
    return read_json_object(run / "summary.json")


def run_status(run: Path) -> str:
    """ "completed", "incomplete" (a directory without a completed summary) or "new"."""
    summary = read_summary(run)
    if summary is not None and summary.get("status") == "completed":
        return "completed"
    return "incomplete" if run.exists() else "new"


def cell_status(sweep: Sweep, cell: Cell) -> str:
    return run_status(sweep.runs / cell.name)


def _set_aside(sweep: Sweep, cell: Cell) -> None:
    """Move an incomplete attempt out of the way (kept, never deleted)."""
    target = sweep.directory / "incomplete" / f"{cell.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    target.parent.mkdir(parents=True, exist_ok=True)
    (sweep.runs / cell.name).rename(target)
    logger.warning("cell %s was incomplete; moved to %s and run again", cell.name, target)


def run_sweep(
    sweep: Sweep,
    *,
    address: str | None = None,
    parallel: int = 1,
    on_cell: Callable[[Cell, str, dict[str, Any] | None], None] | None = None,
) -> dict[str, str]:
    """Run every cell not yet completed; returns cell -> final status. Stops after a cell
    that was interrupted (Ctrl-C): run the same command again to resume."""
    sweep.runs.mkdir(parents=True, exist_ok=True)
    write_text(  # atomically: --report-only reads it
        sweep.directory / "sweep.json",
        json.dumps(
            {
                "source": str(sweep.source),
                "base": str(sweep.base),
                "overrides": list(sweep.overrides),
                "columns": sweep.columns,
                "lines": sweep.lines,
                "threshold": sweep.threshold,
                "cells": [
                    {"name": c.name, "labels": c.labels, "overrides": list(c.overrides)}
                    for c in sweep.cells
                ],
            },
            indent=2,
        )
        + "\n",
    )
    results: dict[str, str] = {}
    todo = []
    for cell in sweep.cells:
        status = cell_status(sweep, cell)
        if status == "completed":
            results[cell.name] = "skipped (completed)"
            if on_cell is not None:
                on_cell(cell, "skipped", None)
            continue
        if status == "incomplete":
            _set_aside(sweep, cell)
        todo.append(cell)
    if not todo:
        return results
    if parallel > 1:
        results.update(_run_processes(sweep, todo, address, parallel, on_cell))
    else:
        results.update(_run_in_process(sweep, todo, address, on_cell))
    return results


@contextlib.contextmanager
def _ray_for(sweep: Sweep, todo: list[Cell], address: str | None) -> Iterator[None]:
    """Join `address`, or start a local Ray sized for the widest cell and stop it after."""
    import ray

    from staleflow.cluster.placement import start_ray

    started = not ray.is_initialized() and not address
    widest = max(
        (sweep.config(c) for c in todo),
        key=lambda c: c.rollout.num_workers * c.rollout.cpus_per_worker,
    )
    start_ray(address, widest, log_to_driver=False)  # each cell's log is in its run directory
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def _run_in_process(
    sweep: Sweep, todo: list[Cell], address: str | None, on_cell: Any
) -> dict[str, str]:
    """Cells one after another, sharing one Ray instance (started once, stopped at the end)."""
    from staleflow.cluster.driver import Driver
    from staleflow.cluster.rundir import RunDir

    results: dict[str, str] = {}
    with _ray_for(sweep, todo, address):
        for cell in todo:
            if on_cell is not None:
                on_cell(cell, "started", None)
            run = RunDir.create(str(sweep.runs), cell.name)
            handler = run.attach_log()
            try:
                summary = Driver(sweep.config(cell), run, address=address).run()
            finally:
                logging.getLogger().removeHandler(handler)
            results[cell.name] = summary["status"]
            if on_cell is not None:
                on_cell(cell, summary["status"], summary)
            if summary["status"] == "interrupted":
                break
    return results


def _run_processes(
    sweep: Sweep, todo: list[Cell], address: str | None, parallel: int, on_cell: Any
) -> dict[str, str]:
    """Up to `parallel` cells at once, each a `staleflow train` process on one Ray cluster
    (the given address, or a local one this process starts and the cells join)."""
    import ray

    results: dict[str, str] = {}
    running: dict[str, tuple[Cell, subprocess.Popen[bytes], Any]] = {}
    queue = list(todo)
    logs = sweep.directory / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with _ray_for(sweep, todo, address):
        join = address or ray.get_runtime_context().gcs_address
        try:
            while queue or running:
                while queue and len(running) < parallel:
                    cell = queue.pop(0)
                    argv = [
                        sys.executable, "-m", "staleflow.cluster.cli", "train", str(sweep.base),
                        *sweep.overrides, *cell.overrides, f"run.name={cell.name}",
                        f"run.output_dir={sweep.runs}", "--address", join,
                    ]  # fmt: skip
                    out = open(logs / f"{cell.name}.out", "wb")  # noqa: SIM115
                    proc = subprocess.Popen(argv, stdout=out, stderr=out)
                    running[cell.name] = (cell, proc, out)
                    if on_cell is not None:
                        on_cell(cell, "started", None)
                time.sleep(0.5)
                for name, (cell, proc, out) in list(running.items()):
                    if proc.poll() is None:
                        continue
                    out.close()
                    del running[name]
                    status = (
                        "completed" if proc.returncode == 0
                        else "interrupted" if proc.returncode in _STOPPED_CLEANLY else "failed"
                    )  # fmt: skip
                    results[name] = status
                    if on_cell is not None:
                        on_cell(cell, status, read_summary(sweep.runs / cell.name))
        except KeyboardInterrupt:
            for _, proc, _ in running.values():
                proc.send_signal(signal.SIGINT)  # each run stops cleanly, as on a terminal
            for name, (_, proc, out) in running.items():
                proc.wait()
                out.close()
                results[name] = "interrupted"
    return results
