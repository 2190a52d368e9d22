"""What each learner step consumed, and retraining on exactly that (`staleflow replay`).

Learner rank 0 records, for every learner step, the groups it took from the buffer: their ids,
policy versions and order (`trajectories/steps.jsonl`, one line per step), and the groups
themselves, each once, in the buffer's wire format (`trajectories/groups.bin`: an 8-byte
little-endian length, then `codec.encode(group)`). Both are appended and flushed before the
step starts, so a crash loses at most the step in flight.

`replay(run_dir)` rebuilds the learner from the run's resolved config (the same initial
weights, seed and thread count), feeds it that sequence, and compares its per-step metrics
with the ones the run logged.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from staleflow.buffer.codec import RecordError, decode, encode
from staleflow.buffer.records import Group

__all__ = [
    "COMPARED",
    "ReplayError",
    "ReplayResult",
    "TrajectoryLog",
    "read_trajectories",
    "replay",
]

_LEN = struct.Struct("<Q")

# The learner metrics a replay must reproduce (timings and throughput are not reproducible).
COMPARED = (
    "loss", "grad_norm", "entropy", "clip_frac", "ratio_mean", "ratio_min", "ratio_max",
    "approx_kl", "adv_mean", "regularizer", "lag_min", "lag_max", "tokens", "groups",
)  # fmt: skip


class ReplayError(RuntimeError):
    """The run directory cannot be replayed (what is missing and how to get it)."""


class TrajectoryLog:
    """Appends the consumed groups and the per-step sequence under `directory`."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._groups: IO[bytes] = open(self.dir / "groups.bin", "ab")  # noqa: SIM115
        self._steps: IO[str] = open(self.dir / "steps.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self._stored: set[str] = set()

    def record(self, step: int, learner_version: int, groups: Sequence[Group]) -> None:
        """Step `step` (1-based) trains at `learner_version` on `groups`, in this order."""
        for g in groups:
            if g.group_id not in self._stored:  # a reused group is stored once
                data = encode(g)
                self._groups.write(_LEN.pack(len(data)) + data)
                self._stored.add(g.group_id)
        self._groups.flush()
        line = {
            "step": step,
            "learner_version": learner_version,
            "groups": [[g.group_id, g.policy_version] for g in groups],
        }
        self._steps.write(json.dumps(line) + "\n")
        self._steps.flush()

    def truncate(self, step: int) -> None:
        """Forget the steps after `step` (a run resumed from its checkpoint at `step` trains
        them again); groups already stored are not stored twice."""
        self._steps.close()
        path = self.dir / "steps.jsonl"
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if int(json.loads(line)["step"]) <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line from a crash
        tmp = path.with_name(".steps.jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
        self._steps = open(path, "a", encoding="utf-8")  # noqa: SIM115
        # a record torn by the crash is cut off: appended after, the next would be misread
        self._groups.close()
        groups, whole, self._stored = self.dir / "groups.bin", 0, set()
        for end, data in _records(groups):
            whole = end
            self._stored.add(decode(data).group_id)
        os.truncate(groups, whole)
        self._groups = open(groups, "ab")  # noqa: SIM115

    def close(self) -> None:
        self._groups.close()
        self._steps.close()


def read_trajectories(
    directory: str | os.PathLike[str], limit: int | None = None
) -> tuple[list[dict[str, Any]], dict[str, Group]]:
    """(steps, groups by id) as recorded, the first `limit` steps if given; a torn last record
    (a crash mid-write) is ignored, a damaged one before it is a ReplayError naming it."""
    directory = Path(directory)
    steps_path, groups_path = directory / "steps.jsonl", directory / "groups.bin"
    if not steps_path.exists() or not groups_path.exists():
        raise ReplayError(
            f"{directory} holds no recorded trajectories (steps.jsonl, groups.bin); "
            "runs record them unless run.record_trajectories=false"
        )
    groups = {g.group_id: g for g in _read_groups(groups_path)}
    steps = []
    lines = steps_path.read_bytes().decode("utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines[:limit], 1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # torn by a crash: everything before it is whole
            entry = None
        if not _is_step_entry(entry):
            before = f" (--steps {number - 1} replays the steps before it)" if number > 1 else ""
            raise ReplayError(
                f"{steps_path}:{number} is damaged (not a step record: step, learner_version, "
                f"groups of [id, version]): {line[:80]!r}; the run cannot be replayed past "
                f"it{before}"
            )
        steps.append(entry)
    return steps, groups


def _is_step_entry(entry: Any) -> bool:
    """A steps.jsonl record as `TrajectoryLog` writes it."""
    return (
        isinstance(entry, dict)
        and type(entry.get("step")) is int
        and type(entry.get("learner_version")) is int
        and isinstance(entry.get("groups"), list)
        and all(
            isinstance(g, list) and len(g) == 2 and isinstance(g[0], str) and type(g[1]) is int
            for g in entry["groups"]
        )
    )


def _records(path: Path) -> Iterator[tuple[int, bytes]]:
    """Each whole record of groups.bin, with the offset where it ends; stops at a record
    torn by a crash mid-write."""
    end = 0
    size = path.stat().st_size
    with open(path, "rb") as f:
        while len(header := f.read(_LEN.size)) == _LEN.size:
            (n,) = _LEN.unpack(header)
            if n > size - f.tell():  # (a damaged length would ask read() for exabytes)
                return
            data = f.read(n)
            if len(data) < n:
                return
            end += _LEN.size + n
            yield end, data


def _read_groups(path: Path) -> Iterator[Group]:
    for end, data in _records(path):
        try:
            yield decode(data)
        except RecordError as exc:
            raise ReplayError(
                f"{path}: the record ending at byte {end} is damaged ({exc}); the run cannot "
                "be replayed from it"
            ) from None


def _single_rank_environment() -> None:
    """Replay is one rank of its own: never the rank variables or port a caller inherited
    from (or shares with) another process group. Without MASTER_PORT, `ensure_distributed`
    picks a free one."""
    import deepspeed

    if deepspeed.comm.is_initialized():
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.pop("MASTER_PORT", None)


@dataclass
class ReplayResult:
    steps: int  # steps replayed
    worst: dict[str, float]  # metric -> largest relative difference over the steps
    mismatches: list[str]  # "step 3: loss 0.12 (run) vs 0.13 (replay)"
    records: list[dict[str, float]]  # the replay's per-step metrics
    compared: int = 0  # steps compared with the run's metrics (the last one replayed may
    # have none: a run that crashed before logging it)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def replay(
    run_dir: str | os.PathLike[str],
    *,
    steps: int | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-7,
    on_step: Any = None,
) -> ReplayResult:
    """Retrain from the run's initial weights on exactly the recorded sequence of groups and
    compare each step's metrics with the run's (`COMPARED`, within rtol/atol)."""
    import torch

    from staleflow.cluster.placement import learner_threads
    from staleflow.cluster.rundir import RunDir, read_metrics
    from staleflow.configs import ConfigError, parse_config
    from staleflow.learner.learner import Learner

    if steps is not None and steps < 1:
        raise ReplayError(f"--steps must be at least 1, got {steps}")
    for flag, value in (("--rtol", rtol), ("--atol", atol)):
        if not (math.isfinite(value) and value >= 0):  # nan or < 0: every step a mismatch
            raise ReplayError(f"{flag} must be a finite number >= 0, got {value}")
    run = RunDir(Path(run_dir)).check_exists()
    recorded, groups = read_trajectories(run.trajectories, steps)
    try:
        cfg = parse_config(run.config.read_text(encoding="utf-8"), source=str(run.config))
    except ConfigError as exc:  # edited by hand, or from another staleflow version
        raise ReplayError(f"cannot replay {run.path}: its config does not load: {exc}") from None
    logged = {r["step"]: r for r in read_metrics(run.metrics) if r["kind"] == "step"}
    if not recorded:
        raise ReplayError(f"{run.trajectories} records no learner step to replay")
    if recorded[0]["step"] not in logged:  # replaying would compare nothing
        why = (
            "the run stopped during that step (a step is recorded before it trains, logged "
            "after), or the file was cut"
            if logged or run.metrics.is_file()
            else "the file is missing: restore it from the run"
        )
        raise ReplayError(
            f"{run.metrics} has no record of step {recorded[0]['step']} ({why}): replay "
            "compares each step with the run's own metrics, so there is nothing to compare"
        )
    if cfg.learner.num_ranks != 1:
        raise ReplayError(
            f"the run used {cfg.learner.num_ranks} learner ranks; replay rebuilds one rank, "
            "whose float sums differ from a sharded step's (replay runs of num_ranks=1)"
        )
    # the run's learner actor had this many torch threads; the same count sums the same way
    torch.set_num_threads(learner_threads(1))
    _single_rank_environment()
    learner = Learner(cfg)
    worst: dict[str, float] = {}
    mismatches: list[str] = []
    records = []
    compared = 0
    for entry in recorded:
        missing = [gid for gid, _ in entry["groups"] if gid not in groups]
        if missing:
            raise ReplayError(f"step {entry['step']}: group {missing[0]} is not in groups.bin")
        batch = [groups[gid] for gid, _ in entry["groups"]]
        metrics = learner.step(batch, entry["learner_version"])
        records.append(metrics)
        run_metrics = logged.get(entry["step"])
        if run_metrics is None:  # the run stopped before logging it (e.g. a crash)
            break
        compared += 1
        for key in COMPARED:
            if key not in metrics or key not in run_metrics:
                continue
            a, b = float(run_metrics[key]), float(metrics[key])
            if math.isnan(a) and math.isnan(b):
                continue
            diff = abs(a - b) / max(abs(a), 1e-12)
            worst[key] = max(worst.get(key, 0.0), diff if math.isfinite(diff) else math.inf)
            if not abs(a - b) <= atol + rtol * abs(a):
                mismatches.append(f"step {entry['step']}: {key} {a:.9g} (run) vs {b:.9g} (replay)")
        if on_step is not None:
            on_step(int(entry["step"]), metrics)
    return ReplayResult(len(records), worst, mismatches, records, compared)
