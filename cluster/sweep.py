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
run again; a cell left incomplete (Ctrl-C, a crash, a failure) continues from its last
checkpoint as `staleflow train --resume` would, and one that cannot (no checkpoint yet, other
settings, a damaged checkpoint) is moved to <sweep dir>/incomplete/, with the reason logged,
and run again from step 0. A cell that fails does not stop the others. A sweep holds its
directory (.lock) while it runs, and each cell's run directory as `staleflow train` does; it
refuses to start beside another sweep of the directory, or when a completed cell was made
with other settings than the file's now. One after another, cells share one Ray instance
in this process; with `--parallel K` (and `--address` for a cluster) K cells run at once as
`staleflow train` processes joining the same Ray cluster.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import logging
import math
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
from staleflow.configs.loader import ConfigError, read_yaml

__all__ = [
    "Cell", "Sweep", "SweepError", "cell_status", "load_sweep", "read_summary",
    "resume_refusal", "run_status", "run_sweep",
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


def _placement(sweep: Sweep, cell: Cell) -> tuple[str, str]:
    """The overrides that put a cell's run where the sweep looks for it. The name is quoted:
    an override's value is read as YAML, where a label like 0.001 or on is no string."""
    return f"run.name={json.dumps(cell.name)}", f"run.output_dir={json.dumps(str(sweep.runs))}"


def _cell_config(sweep: Sweep, cell: Cell) -> Any:
    """The cell's resolved config (SweepError if invalid, or its schedule cannot run). What
    needs this machine's files (task data, model) is checked by `run_sweep`, for the cells it
    runs: --dry-run and --report-only work where those are missing."""
    from staleflow.cluster.schedule import check_schedule
    from staleflow.configs import load_config

    try:
        cfg = load_config(sweep.base, (*sweep.overrides, *cell.overrides, *_placement(sweep, cell)))
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
        try:
            out.append(f"{key}={json.dumps(value, default=_date_as_written)}")
        except (TypeError, ValueError) as exc:  # (a NaN passes: the config's bounds refuse it)
            raise SweepError(f"{where}: {key}: {exc}") from None
    return tuple(out)


def _date_as_written(value: Any) -> str:
    """YAML reads an unquoted 2026-05-01 as a date: passed on as the text written (JSON
    has no dates); any other value JSON cannot hold stays an error."""
    if type(value) is datetime.date:
        return value.isoformat()
    raise TypeError(f"{value!r} is not a config value (a number, string, list or mapping)")


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
    """Read and check a sweep file: every cell's config is resolved and validated (the
    checks that need this machine's files come in `run_sweep`, before any cell runs)."""
    path = Path(path)
    try:
        data = read_yaml(path.read_text(encoding="utf-8"), str(path))
    except FileNotFoundError:
        raise SweepError(f"sweep file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise SweepError(f"cannot read sweep file {path}: {exc}; save it as UTF-8") from None
    except (OSError, yaml.YAMLError) as exc:
        raise SweepError(f"cannot read sweep file {path}: {exc}") from None
    except ConfigError as exc:  # a key given twice (YAML would keep the last silently)
        raise SweepError(str(exc)) from None
    except ValueError as exc:  # an integer past Python's 4300 digits
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
    base = (path.parent / Path(str(data["base"])).expanduser()).resolve()
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
    _check_axes_apart(path, axes)
    columns = str(data.get("columns", names[0]))
    lines = str(data.get("lines", names[1] if len(names) > 1 else names[0]))
    for role, axis in (("columns", columns), ("lines", lines)):
        if axis not in axes:
            raise SweepError(f"{path}: {role}: {axis!r} is not an axis; axes: {names}")
    threshold = data.get("threshold", 0.5)
    if (
        not isinstance(threshold, int | float)
        or isinstance(threshold, bool)  # YAML's yes / on / true
        or not math.isfinite(threshold)
        or not 0 <= threshold <= 1  # 50 (a percentage) could never be reached
    ):
        raise SweepError(
            f"{path}: threshold: must be a held-out accuracy between 0 and 1, got {threshold!r}"
        )
    out = output_dir or data.get("output_dir", "runs/sweeps")
    if not isinstance(out, str | Path) or not str(out):
        raise SweepError(f"{path}: output_dir: must be a directory path, got {out!r}")
    directory = Path(out).expanduser() / name
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
        if len(cell_name) > 128 and _NAME.match(cell_name[:128]):
            raise SweepError(
                f"{path}: cell name {cell_name!r} is {len(cell_name)} characters, more than "
                "a run name's 128 (cell names join the labels with __): shorten the labels"
            )
        if not _NAME.match(cell_name):
            raise SweepError(f"{path}: cell name {cell_name!r} is not a valid run name")
        if cell_name in sweep.configs:  # labels holding the separator: a__b + c = a + b__c
            raise SweepError(
                f"{path}: two cells are both named {cell_name!r} (cell names join the labels "
                "with __); use labels without __"
            )
        overrides = tuple(o for _, os_ in combo for o in os_)
        _check_nothing_replaced(path, (*sweep.overrides, *overrides))
        cell = Cell(cell_name, labels, overrides)
        sweep.cells.append(cell)
        sweep.configs[cell_name] = _cell_config(sweep, cell)
    _check_cells_differ(path, sweep)
    return sweep


def _check_nothing_replaced(path: Path, overrides: tuple[str, ...]) -> None:
    """Refuse a key that a later override replaces with its whole section (overrides: then
    an axis, or two keys of one label: they apply in that order), e.g. learner.loss.epsilon_low
    before learner.loss: {name: ...}: its value was lost without a word."""
    from staleflow.configs.loader import key_dropped_by_section

    dropped = key_dropped_by_section(overrides)
    if dropped is not None:
        key, later = dropped
        raise SweepError(
            f"{path}: {key} is set, then {later} is set whole (overrides: apply first, "
            f"then the axes in order): {key}'s value would be lost; put it inside "
            f"{later}'s value, or set {later} key by key"
        )


def _check_cells_differ(path: Path, sweep: Sweep) -> None:
    """Refuse two cells whose configs are the same but for their run's name and place
    (run.seed: [1, 1.0], lr: [1000, 1e3], two labels with one setting): the same run twice,
    counted as two in the report."""
    seen: dict[str, str] = {}
    for name, cfg in sweep.configs.items():
        data = cfg.model_dump(mode="json")
        data["run"] = {k: v for k, v in data["run"].items() if k not in ("name", "output_dir")}
        key = json.dumps(data, sort_keys=True)
        if key in seen:
            raise SweepError(
                f"{path}: cells {seen[key]} and {name} have the same config: the same run "
                "twice; give each value once (to repeat a setting, add an axis over run.seed)"
            )
        seen[key] = name


def _check_axes_apart(path: Path, axes: dict[str, dict[str, tuple[str, ...]]]) -> None:
    """Refuse a later axis that sets a key an earlier one sets, or a section holding it: the
    later axis's value wins, so cells labelled apart would be the same run. (A later axis may
    set a key inside an earlier one's section, e.g. learner.loss.epsilon_high after
    learner.loss: {name: grpo}: the cells' overrides apply in axis order.)"""
    keys = {
        axis: {o.partition("=")[0] for overrides in values.values() for o in overrides}
        for axis, values in axes.items()
    }
    for (a, a_keys), (b, b_keys) in itertools.combinations(keys.items(), 2):
        for x, y in itertools.product(sorted(a_keys), sorted(b_keys)):
            if x == y or x.startswith(f"{y}."):
                what = y if x == y else f"{x} (inside {y}, which {b} sets whole)"
                raise SweepError(
                    f"{path}: grid axes {a} and {b} both set {what}: the later axis's value "
                    "would win in each cell, so cells labelled apart would be the same run; "
                    "set each key on one axis (or in overrides:, which every cell starts from)"
                )


def read_summary(run: Path) -> dict[str, Any] | None:
    """A run directory's summary.json, or None while it has none (or a torn one)."""
    return read_json_object(run / "summary.json")


def run_status(run: Path) -> str:
    """ "completed", "incomplete" (a directory without a completed summary) or "new"."""
    summary = read_summary(run)
    if summary is not None and summary.get("status") == "completed":
        return "completed"
    return "incomplete" if run.exists() else "new"


def config_changes(sweep: Sweep, cell: Cell) -> list[str]:
    """How the config a cell's run was made with (its config.json) differs from the cell's
    config now (an edited sweep or base file): one "key: then -> now" per key. Keys only one
    of the two has (a newer staleflow), the run's name and place, the Redis server's URL and
    which outputs it writes (TensorBoard files, the report) are not compared."""
    from staleflow.cluster.resume import flatten
    from staleflow.configs.loader import redacted_dict

    saved = read_json_object(sweep.runs / cell.name / "config.json")
    if saved is None:
        return []
    now = flatten(redacted_dict(sweep.config(cell)))
    then = flatten(saved)
    where = ("run.name", "run.output_dir", "buffer.redis_url")  # (--parallel: in the env)
    where += ("run.tensorboard", "run.report")  # outputs, not the experiment
    return [
        f"{key}: {json.dumps(then[key])} -> {json.dumps(now[key])}"
        for key in sorted(then.keys() & now.keys())
        if key not in where and then[key] != now[key]
    ]


def cell_status(sweep: Sweep, cell: Cell) -> str:
    """ "running" (another process runs it now), "completed", "changed" (completed with
    other settings than the sweep's now), "resumable" (incomplete, continues from its last
    checkpoint), "incomplete" (to run again from step 0: `resume_refusal` says why) or
    "new"."""
    from staleflow.cluster.rundir import RunDir

    if RunDir(sweep.runs / cell.name).in_use():
        return "running"
    status = run_status(sweep.runs / cell.name)
    if status == "completed" and config_changes(sweep, cell):
        return "changed"
    if status == "incomplete" and resume_refusal(sweep, cell) is None:
        return "resumable"
    return status


def resume_refusal(sweep: Sweep, cell: Cell) -> str | None:
    """Why an incomplete cell cannot continue from its last checkpoint, or None if it can:
    what `staleflow train --resume` checks (cluster.resume.check_resumable), and, stricter,
    the cell's settings the same as the sweep's now (run.steps included)."""
    from staleflow.cluster.resume import ResumeError, check_resumable, resumable_checkpoint
    from staleflow.cluster.rundir import RunDir

    run = RunDir(sweep.runs / cell.name)
    try:
        if not run.config.is_file() or resumable_checkpoint(run) is None:
            return "it made no checkpoint"
        changes = config_changes(sweep, cell)
        if changes:
            more = "; ..." if len(changes) > 3 else ""
            return f"its settings are not the sweep's now ({'; '.join(changes[:3])}{more})"
        check_resumable(run, sweep.config(cell))
    except (ResumeError, OSError) as exc:
        return str(exc)
    return None


def _set_aside(sweep: Sweep, cell: Cell) -> None:
    """Move an incomplete attempt that cannot resume out of the way (kept, never deleted)."""
    why = resume_refusal(sweep, cell)
    target = sweep.directory / "incomplete" / f"{cell.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    target.parent.mkdir(parents=True, exist_ok=True)
    (sweep.runs / cell.name).rename(target)
    logger.warning("cell %s was incomplete and cannot resume (%s): moved to %s and run again "
                   "from step 0", cell.name, why, target)  # fmt: skip


@contextlib.contextmanager
def _holding(sweep: Sweep) -> Iterator[None]:
    """Hold the sweep directory while this process runs its cells: a second `staleflow
    sweep` of it is refused, instead of setting aside (or running again) cells in progress."""
    import os
    import socket

    from staleflow.cluster.rundir import lock_file

    sweep.directory.mkdir(parents=True, exist_ok=True)
    path = sweep.directory / ".lock"
    try:
        fd = lock_file(path, "staleflow sweep", "sweep directory")
    except BlockingIOError:
        holder = path.read_text(errors="replace").strip() or "pid unknown"
        raise SweepError(
            f"{sweep.directory} is in use by another staleflow sweep ({holder}); wait for it "
            "to finish, or stop it (Ctrl-C), then run this again"
        ) from None
    if fd is not None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _check_cells(
    sweep: Sweep, statuses: dict[str, str], todo: list[Cell], address: str | None
) -> None:
    """SweepError for what would spoil the sweep once cells run (`statuses`: each cell's
    `cell_status`): a cell another process is running, a completed cell whose settings are
    not the sweep's any more (its results would be reported under the new settings), a cell
    to run that `staleflow train` would refuse."""
    from staleflow.actors.models import ModelError
    from staleflow.cluster.commands import check_before_start, check_engine_installed
    from staleflow.cluster.rundir import RunDir

    for cell in sweep.cells:
        status = statuses[cell.name]
        if status == "running":
            raise SweepError(
                f"cell {cell.name} is being run by another process"
                f"{RunDir(sweep.runs / cell.name).driver_label()}; wait for it or stop it, then "
                "run the sweep again"
            )
        if status == "changed":
            changes = config_changes(sweep, cell)
            raise SweepError(
                f"cell {cell.name} in {sweep.directory} completed with other settings than the "
                f"sweep's now ({'; '.join(changes[:3])}{'; ...' if len(changes) > 3 else ''}): "
                "give the sweep another name: (or --out DIR) to keep both, or move "
                f"{sweep.runs / cell.name} away to run the cell again"
            )
    for cell in todo:  # what `staleflow train` refuses before it starts
        try:
            check_before_start(sweep.config(cell))
            check_engine_installed(sweep.config(cell), address)
        except (ConfigError, ValueError, ModelError) as exc:  # (a TaskError is a ValueError)
            raise SweepError(f"{sweep.source}: cell {cell.name}: {exc}") from None


def update_figures(sweep: Sweep) -> None:
    """Set sweep.json's figure settings (columns, lines, threshold) to the file's now, for
    `--report-only`; the cells, labels and overrides stay those that ran."""
    path = sweep.directory / "sweep.json"
    spec = read_json_object(path)
    if spec is None:
        return
    cells = spec.get("cells")
    first = cells[0] if isinstance(cells, list) and cells and isinstance(cells[0], dict) else {}
    labels = first.get("labels")
    ran = set(labels) if isinstance(labels, dict) else set()  # (damaged: the report says so)
    for role, axis in (("columns", sweep.columns), ("lines", sweep.lines)):
        if ran and axis not in ran:  # an axis added to the file since the cells ran
            raise SweepError(
                f"{sweep.source}: {role}: {axis!r} is not an axis the sweep's cells ran with "
                f"({', '.join(sorted(ran))}); run the sweep (without --report-only) to run "
                "the new cells, or set columns:/lines: to one of those"
            )
    spec.update(columns=sweep.columns, lines=sweep.lines, threshold=sweep.threshold)
    write_text(path, json.dumps(spec, indent=2) + "\n")


def write_sweep_json(sweep: Sweep) -> None:
    """<sweep dir>/sweep.json: what the report reads (cells, labels, figures' axes), with
    any password in an override masked."""
    from staleflow.configs.loader import redact_override

    write_text(  # atomically: --report-only reads it
        sweep.directory / "sweep.json",
        json.dumps(
            {
                "source": str(sweep.source),
                "base": str(sweep.base),
                "overrides": [redact_override(o) for o in sweep.overrides],
                "columns": sweep.columns,
                "lines": sweep.lines,
                "threshold": sweep.threshold,
                "cells": [
                    {
                        "name": c.name,
                        "labels": c.labels,
                        "overrides": [redact_override(o) for o in c.overrides],
                    }
                    for c in sweep.cells
                ],
            },
            indent=2,
        )
        + "\n",
    )


def run_sweep(
    sweep: Sweep,
    *,
    address: str | None = None,
    parallel: int = 1,
    on_cell: Callable[[Cell, str, dict[str, Any] | None], None] | None = None,
) -> dict[str, str]:
    """Run every cell not yet completed; returns cell -> final status ("completed",
    "failed": the other cells still run, "interrupted", "skipped (completed)"). Stops after
    a cell that was interrupted (Ctrl-C): run the same command again to go on; an interrupted
    cell then continues from its last checkpoint (or, if it cannot, `resume_refusal`, starts
    again from step 0, its attempt kept under incomplete/). Refuses
    (SweepError) before running anything when another sweep holds the directory, or a cell
    is running or completed with other settings (`_check_cells`)."""
    with _holding(sweep):
        statuses = {cell.name: cell_status(sweep, cell) for cell in sweep.cells}
        todo = [cell for cell in sweep.cells if statuses[cell.name] != "completed"]
        _check_cells(sweep, statuses, todo, address)
        sweep.runs.mkdir(parents=True, exist_ok=True)
        write_sweep_json(sweep)
        results: dict[str, str] = {}
        for cell in sweep.cells:
            if statuses[cell.name] == "completed":
                results[cell.name] = "skipped (completed)"
                if on_cell is not None:
                    on_cell(cell, "skipped", None)
            elif statuses[cell.name] == "incomplete":
                _set_aside(sweep, cell)
        if not todo:
            return results
        resume = {name for name, status in statuses.items() if status == "resumable"}
        if parallel > 1:
            results.update(_run_processes(sweep, todo, address, parallel, on_cell, resume))
        else:
            results.update(_run_in_process(sweep, todo, address, on_cell, resume))
        return results


@contextlib.contextmanager
def _ray_for(
    sweep: Sweep, todo: list[Cell], address: str | None, parallel: int = 1
) -> Iterator[None]:
    """Join `address`, or start a local Ray sized for `parallel` of the largest cell, in CPUs
    and object store each (sized for one, the cells of a --parallel sweep queued for CPUs
    until run.start_timeout_s failed them, and shared one store), and stop it after."""
    import ray

    from staleflow.cluster.placement import start_ray

    started = not ray.is_initialized() and not address
    # each cell's driver.log is in its run directory; actors' output stays in Ray's session
    # directory (README, "Every run writes ...")
    cells = [sweep.config(c) for c in todo]
    start_ray(address, cells, log_to_driver=False, runs=min(parallel, len(todo)))
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def _run_in_process(
    sweep: Sweep, todo: list[Cell], address: str | None, on_cell: Any, resume: set[str]
) -> dict[str, str]:
    """Cells one after another, sharing one Ray instance (started once, stopped at the end);
    those named in `resume` continue from their last checkpoint. A cell that fails is
    reported "failed" (its one-line error to `on_cell`, the traceback in its
    logs/driver.log only) and the next one runs, as with --parallel; a lost Ray cluster
    stops the sweep."""
    import os

    from staleflow.cluster.driver import Driver
    from staleflow.cluster.failures import ClusterUnreachable
    from staleflow.cluster.progress import Progress
    from staleflow.cluster.rundir import RunDir

    results: dict[str, str] = {}
    with _ray_for(sweep, todo, address):
        for cell in todo:
            resuming = cell.name in resume
            if on_cell is not None:
                on_cell(cell, "resuming" if resuming else "started", None)
            cfg = sweep.config(cell)
            fd, handler = None, None
            try:
                path = sweep.runs / cell.name
                run = RunDir(path) if resuming else RunDir.create(str(sweep.runs), cell.name)
                fd = run.lock()  # as `staleflow train` does: a `train --resume` of it is refused
                handler = run.attach_log()
                progress = Progress(cell.name, cfg.run.log_every)
                driver = Driver(cfg, run, address=address, progress=progress, resume=resuming)
                summary = driver.run()
            except ClusterUnreachable:
                raise
            except Exception as exc:  # the cell's own failure: the other cells still run
                if handler is not None:  # the traceback to the cell's log, not the console
                    handler.handle(logger.makeRecord(
                        logger.name, logging.ERROR, __file__, 0, "cell %s failed", (cell.name,),
                        sys.exc_info(),
                    ))  # fmt: skip
                summary = {"status": "failed", "error": _one_line(exc)}
            finally:
                if handler is not None:
                    logging.getLogger().removeHandler(handler)
                    handler.close()
                if fd is not None:
                    os.close(fd)
            results[cell.name] = summary["status"]
            if on_cell is not None:
                on_cell(cell, summary["status"], summary)
            if summary["status"] == "interrupted":
                break
    return results


def _one_line(exc: BaseException) -> str:
    """An exception as one line: staleflow's own errors by their message, others by type."""
    text = str(exc).strip().splitlines()
    if type(exc).__module__.startswith("staleflow") and text:
        return text[0]
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _ended(
    sweep: Sweep,
    cell: Cell,
    proc: subprocess.Popen[bytes],
    logs: Path,
    start: int,
    on_cell: Any,
    stopped: bool = False,
) -> str:
    """A --parallel cell's process ended: its status by its exit status (a failure's one-line
    error from its output after byte `start`), told to `on_cell`. `stopped`: the sweep
    stopped it, so one killed by a signal (the third stop) is interrupted, not failed."""
    killed = stopped and proc.returncode < 0
    status = (
        "completed" if proc.returncode == 0
        else "interrupted" if proc.returncode in _STOPPED_CLEANLY or killed
        else "failed"
    )  # fmt: skip
    summary = read_summary(sweep.runs / cell.name)
    if status == "failed":
        error = _last_error(logs / f"{cell.name}.out", start) or f"exit status {proc.returncode}"
        summary = {**(summary or {}), "status": status, "error": error}
    if on_cell is not None:
        on_cell(cell, status, summary)
    return status


def _stop_cells(
    procs: dict[str, subprocess.Popen[bytes]], received: list[int], poll_s: float = 0.1
) -> None:
    """Stop the cells' `staleflow train` processes after the stop signal `received[0]`, and
    wait for them; signals received meanwhile (appended to `received` by the caller's
    handler) escalate. The first is passed on to each cell: it finishes its step in flight,
    checkpoints and writes its summary. The second is passed on again, which makes each
    train stop at once (its cleanup, the checkpoint included, still runs). The third kills
    each cell's process group (SIGKILL: no checkpoint, no summary; the next `staleflow
    sweep` continues each from its last checkpoint). SIGHUP reaches the cells as SIGTERM (a
    train in a session of its own has no terminal to lose). The handler only records:
    everything happens here and in the caller's loop, between polls, so no signal lands
    halfway through starting or reaping a cell."""
    import os

    def live() -> list[tuple[str, subprocess.Popen[bytes]]]:
        return [(cell, proc) for cell, proc in procs.items() if proc.poll() is None]

    def names(cells: list[tuple[str, Any]]) -> str:
        return ", ".join(cell for cell, _ in cells)

    handled = 0
    while cells := live():
        if len(received) > handled:
            handled += 1  # one stage per signal
            signum = received[handled - 1]
            name = signal.Signals(signum).name
            again = "Ctrl-C" if signum == signal.SIGINT else name
            sig = signal.SIGTERM if signum == signal.SIGHUP else signum
            if handled == 1:
                logger.warning(
                    "%s: stopping %d cell(s) (%s): each finishes its step in flight, "
                    "checkpoints and writes its summary. %s again stops them at once",
                    name, len(cells), names(cells), again,
                )  # fmt: skip
            elif handled == 2:
                logger.warning(
                    "%s again: stopping the cells at once (%s); each still checkpoints and "
                    "writes its summary. %s once more kills them without that",
                    name, names(cells), again,
                )  # fmt: skip
            else:
                logger.warning(
                    "%s a third time: killing the cells still running (%s) with SIGKILL; "
                    "run the sweep again to continue each from its last checkpoint",
                    name, names(cells),
                )  # fmt: skip
            for _, proc in cells:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if handled < 3:
                        proc.send_signal(sig)
                    else:  # its session: the train and its embedded Redis
                        os.killpg(proc.pid, signal.SIGKILL)
            continue
        time.sleep(poll_s)


def _child_command(
    sweep: Sweep, cell: Cell, join: str, resume: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The `staleflow train` of one cell (`resume`: `train --resume` of its run directory,
    which has its config), and its environment: a Redis URL given as an override goes in
    $STALEFLOW_REDIS_URL, never on a command line that `ps` shows."""
    import os

    env = dict(os.environ)
    overrides = []
    url = None
    for override in (*sweep.overrides, *cell.overrides):
        key, _, value = override.partition("=")
        if key == "buffer.redis_url":
            url = json.loads(value)
            continue
        if key == "buffer":  # a whole section: its URL, if any, goes the same way
            section = json.loads(value)
            if isinstance(section, dict) and "redis_url" in section:
                url = section.pop("redis_url")
                override = f"buffer={json.dumps(section)}"
        overrides.append(override)
    if isinstance(url, str):  # the train then takes it from $STALEFLOW_REDIS_URL
        env["STALEFLOW_REDIS_URL"] = url
        overrides.append("buffer.redis_url=null")  # (over a URL in the base config)
    train = [sys.executable, "-m", "staleflow.cluster.cli", "train"]
    if resume:  # the URL (from the overrides or the base file) again in the environment:
        url = sweep.config(cell).buffer.redis_url  # config.json masks its password
        if url is not None:
            env["STALEFLOW_REDIS_URL"] = url
        return [*train, "--resume", str(sweep.runs / cell.name), "--address", join], env
    # A key given twice (in overrides: and on an axis, or run.name in overrides:) is refused
    # on a command line; in-process the last one wins: only the last goes.
    given = [*overrides, *_placement(sweep, cell)]
    last = {o.partition("=")[0]: i for i, o in enumerate(given)}
    given = [o for i, o in enumerate(given) if last[o.partition("=")[0]] == i]
    return [*train, str(sweep.base), *given, "--address", join], env


def _last_error(log: Path, start: int) -> str | None:
    """The last "error: ..." line a cell's `staleflow train` wrote (its one-line failure)
    after byte `start` of its log (where this attempt's output begins)."""
    try:
        with open(log, "rb") as f:
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    return next((ln[7:] for ln in reversed(lines) if ln.startswith("error: ")), None)


def _run_processes(
    sweep: Sweep,
    todo: list[Cell],
    address: str | None,
    parallel: int,
    on_cell: Any,
    resume: set[str],
) -> dict[str, str]:
    """Up to `parallel` cells at once, each a `staleflow train` process on one Ray cluster
    (the given address, or a local one this process starts and the cells join); those named
    in `resume` a `staleflow train --resume` of their run directory. Each runs
    in a session of its own: Ctrl-C, SIGTERM or SIGHUP reaches this process, which passes it
    on to each cell and waits for them before it stops the Ray they use; a second signal
    stops them at once, a third kills them (`_stop_cells`). Each cell's output is
    appended to logs/<cell>.out (an earlier attempt's is kept above it)."""
    import threading

    import ray

    results: dict[str, str] = {}
    running: dict[str, tuple[Cell, subprocess.Popen[bytes], Any, int]] = {}
    queue = list(todo)
    logs = sweep.directory / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    received: list[int] = []  # the stop signals, in order; only recorded by the handler

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)

    main = threading.current_thread() is threading.main_thread()  # where handlers can be set
    previous = {sig: signal.getsignal(sig) for sig in signals} if main else {}
    for sig in signals if main else ():
        signal.signal(sig, on_signal)
    try:
        with _ray_for(sweep, todo, address, parallel):
            join = address or ray.get_runtime_context().gcs_address
            while (queue or running) and not received:
                while queue and len(running) < parallel and not received:
                    cell = queue.pop(0)
                    resuming = cell.name in resume
                    argv, env = _child_command(sweep, cell, join, resuming)
                    out = open(logs / f"{cell.name}.out", "ab")  # noqa: SIM115
                    started = time.strftime("%Y-%m-%d %H:%M:%S")
                    out.write(f"--- {started} {cell.name}\n".encode())
                    out.flush()
                    proc = subprocess.Popen(
                        argv, stdout=out, stderr=out, env=env, start_new_session=True
                    )
                    running[cell.name] = (cell, proc, out, out.tell())
                    if on_cell is not None:
                        on_cell(cell, "resuming" if resuming else "started", None)
                time.sleep(0.5)
                for name, (cell, proc, out, start) in list(running.items()):
                    if proc.poll() is None:
                        continue
                    out.close()
                    del running[name]
                    results[name] = _ended(sweep, cell, proc, logs, start, on_cell)
            if received:  # the cells not started yet are stopped too (run again to go on),
                # also when the running ones all ended in the poll that saw the signal
                results.update({cell.name: "interrupted" for cell in queue})
                _stop_cells({name: proc for name, (_, proc, _, _) in running.items()}, received)
                for name, (cell, proc, out, start) in running.items():  # each as it ended (a
                    out.close()  # cell may have completed, or failed, during the stop)
                    results[name] = _ended(sweep, cell, proc, logs, start, on_cell, True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return results
