"""The run directory: everything a run leaves behind, in one place.

<output_dir>/<run name>/
    config.json          the resolved config (secrets masked)
    run-key              the run's id in shared places: Redis keys, /dev/shm files, Ray names
    metrics.jsonl        one JSON object per line, {"kind": ..., "step": ..., "time": ...}:
                         step, rollout, eval, checkpoint, scale, fault, recovery, resume
                         (docs/architecture.md, "metrics.jsonl", lists every field)
    tensorboard/         the same scalars as TensorBoard event files (run.tensorboard)
    checkpoints/step-N/  learner checkpoints (safetensors + JSON); LATEST names the newest
    weights/             published weights when sync.method is checkpoint
    trajectories/        each learner step's groups in order (steps.jsonl, groups.bin)
    redis/               the embedded Redis server's data, log and address
    logs/driver.log      the driver's log (Ray's worker logs stay in Ray's session dir)
    summary.json         totals, reconciliation of the groups, before/after accuracy
    status.json          live state for `staleflow scale` and monitoring
    control/             requests to the running driver (`staleflow scale` writes here)
    report.html, plots/  the report (`staleflow report RUN_DIR` rebuilds it)
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from staleflow.buffer.entries import RUN_NAME

__all__ = [
    "MetricsWriter",
    "RunDir",
    "RunDirBusy",
    "keys_named",
    "read_json_object",
    "read_metrics",
    "write_json",
    "write_text",
]

logger = logging.getLogger(__name__)
_WARNED: set[tuple[Path, int, str]] = set()  # metrics.jsonl lines read_metrics skipped


def write_json(path: Path, data: Any) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True, default=_jsonable) + "\n")


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A JSON object file (status.json, summary.json, ...); None if it is missing, torn or
    not an object. The driver writes them atomically, so only a damaged one is unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_text(path: Path, text: str, durable: bool = False) -> None:
    """Write atomically (a temporary file renamed over `path`); `durable`: fsynced, file and
    rename, so that a machine going down right after cannot leave it empty (what a run
    cannot do without, config.json; not status.json, rewritten every few seconds)."""
    from staleflow.learner.durable import replace_durably

    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    if durable:
        replace_durably(tmp, path)
    else:
        os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def lock_file(path: Path, who: str, what: str) -> int | None:
    """An exclusive flock on `path` (made if missing), held until the returned descriptor is
    closed or the process exits (kill -9 included). BlockingIOError while another process
    holds it. None, with a warning, where the file system has no locks (NFS without lockd,
    Lustre without -o flock): nothing then stops a second `who` from using the `what`."""
    import errno
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if isinstance(exc, BlockingIOError) or exc.errno not in (
            errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL,
        ):  # fmt: skip
            raise
        logging.getLogger(__name__).warning(
            "%s: the file system has no locks (%s): nothing stops a second %s from using "
            "this %s at the same time",
            path.parent, exc.strerror, who, what,
        )  # fmt: skip
        return None
    return fd


def _key_base(name: str) -> str:
    """The part of a run key before its random suffix: the run's name, cut to 119 characters
    and with what a key cannot hold (a name made from a config file's name may have spaces)
    turned into '-'."""
    base = re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:119]
    return base if base[:1].isalnum() else f"r{base[:118]}"


def keys_named(name: str, keys: Iterable[str]) -> list[str]:
    """The run keys among `keys` that `RunDir.create` makes for runs named `name`."""
    mine = re.compile(re.escape(_key_base(name)) + "-[0-9a-f]{8}")
    return [key for key in keys if mine.fullmatch(key)]


class RunDirBusy(RuntimeError):
    """Another process holds the run directory (a driver still running there)."""


# The sections of the resolved config every run directory's config.json holds.
RUN_SECTIONS = frozenset({"model", "task", "rollout", "buffer", "learner", "sync", "run"})


class RunDir:
    """Paths of one run directory (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, output_dir: str, name: str) -> RunDir:
        """The directory of a new run named `name`, with a new run key (see `key`)."""
        run = cls(Path(output_dir) / name)
        for sub in ("checkpoints", "logs", "control", "plots"):
            (run.path / sub).mkdir(parents=True, exist_ok=True)
        try:  # made once: a second train given this name (refused at the lock, after this)
            with (run.path / "run-key").open("x") as f:  # must not change the first's key
                f.write(f"{_key_base(name)}-{uuid.uuid4().hex[:8]}\n")  # (keys_named)
        except FileExistsError:
            pass
        return run

    @property
    def key(self) -> str:
        """The run's id wherever runs share a namespace: its Redis keys, its /dev/shm weight
        files, its Ray actor names. It is the run's name plus a random suffix, made with the
        directory and kept across resumes, so two runs given the same run.name (in two
        output directories, on one Redis server or one node) never touch each other's
        data. Run directories made before the key existed use their name, as they did."""
        try:
            key = (self.path / "run-key").read_text().strip()
        except FileNotFoundError:
            return self.path.name
        if not RUN_NAME.fullmatch(key):  # what the buffer takes as a run
            raise ValueError(
                f"{self.path / 'run-key'} holds {key[:80]!r}, not a run key (letters, digits, "
                "'_', '.', '-'; at most 128): it was edited or damaged. Put back the key the "
                "run started with: logs/driver.log and summary.json name it (run_id)"
            )
        return key

    def check_exists(self) -> RunDir:
        if not self.config.is_file():
            raise FileNotFoundError(
                f"{self.path} is not a staleflow run directory (no config.json); pass the "
                "directory `staleflow train` printed, e.g. runs/<name>"
            )
        if (self.path / "tokenizer_config.json").is_file() or any(
            self.path.glob("*.safetensors")
        ):  # its config.json is a model's: nothing here may be written to or read as a run's
            raise FileNotFoundError(
                f"{self.path} is a Hugging Face model directory, not a staleflow run "
                "directory; pass the directory `staleflow train` printed, e.g. runs/<name>"
            )
        # Any other config.json (a model's with .bin weights, some tool's): a report or a
        # resume would write over files there. A run's is the resolved config, every section.
        try:
            config = json.loads(self.config.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # (UnicodeDecodeError is a ValueError)
            config = None
        missing = RUN_SECTIONS - set(config) if isinstance(config, dict) else RUN_SECTIONS
        if missing:
            raise FileNotFoundError(
                f"{self.path} is not a staleflow run directory: its config.json is not a "
                f"run's resolved config (no {', '.join(sorted(missing))} section); pass the "
                "directory `staleflow train` printed, e.g. runs/<name>"
            )
        return self

    config = property(lambda self: self.path / "config.json")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    summary = property(lambda self: self.path / "summary.json")
    status = property(lambda self: self.path / "status.json")
    checkpoints = property(lambda self: self.path / "checkpoints")
    tensorboard = property(lambda self: self.path / "tensorboard")
    control = property(lambda self: self.path / "control")
    plots = property(lambda self: self.path / "plots")
    report = property(lambda self: self.path / "report.html")
    log = property(lambda self: self.path / "logs" / "driver.log")
    trajectories = property(lambda self: self.path / "trajectories")

    def lock(self) -> int | None:
        """Hold this run directory for the calling process until it closes the returned file
        descriptor or exits (kill -9 included: the kernel drops the lock). A second driver
        that would write into a live run (`train --resume` of a run still going) is refused
        with RunDirBusy, naming the driver that holds it. None, with a warning, where the
        file system has no locks (NFS without lockd, Lustre without -o flock)."""
        try:
            return lock_file(self.path / ".lock", "staleflow train", "run directory")
        except BlockingIOError:
            raise RunDirBusy(
                f"{self.path} is in use by a staleflow train still running{self.driver_label()}; "
                "stop it first (Ctrl-C, or kill -TERM its pid: it checkpoints), then resume"
            ) from None

    def in_use(self) -> bool | None:
        """True while a `staleflow train` holds this run directory (see `lock`), False if
        none does; None if that cannot be told (no .lock, written before staleflow locked
        run directories; a file system without locks). Creates nothing."""
        import fcntl

        try:
            fd = os.open(self.path / ".lock", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return None
        finally:
            os.close(fd)  # (also releases the shared lock just taken)
        return False

    def driver_label(self) -> str:
        """' (driver pid P on HOST)' from status.json, or '' if it names none."""
        driver = (read_json_object(self.status) or {}).get("driver")
        if isinstance(driver, dict) and driver.get("pid"):
            return f" (driver pid {driver['pid']} on {driver.get('host', '?')})"
        return ""

    def latest_checkpoint(self) -> Path | None:
        latest = self.checkpoints / "LATEST"
        if not latest.is_file():
            return None
        path = self.checkpoints / latest.read_text().strip()
        return path if path.is_dir() else None

    def mark_latest_checkpoint(self, path: Path) -> None:
        from staleflow.learner.durable import replace_durably

        # durable before the step's groups are acked (the caller acks after this returns)
        tmp = self.checkpoints / f".LATEST.{uuid.uuid4().hex[:8]}"
        tmp.write_text(path.name)
        replace_durably(tmp, self.checkpoints / "LATEST")

    def prune_checkpoints(self, keep: int) -> None:
        """Delete all but the newest `keep` checkpoints (never the one LATEST names)."""
        import shutil

        latest = self.latest_checkpoint()
        steps = sorted(self.checkpoints.glob("step-*"))
        for old in steps[:-keep] if keep > 0 else []:
            if old != latest:
                shutil.rmtree(old, ignore_errors=True)

    def request_workers(self, n: int) -> Path:
        """Ask the running driver to scale to `n` rollout workers (see Driver._poll_control);
        the driver's answer to an earlier request, if any, no longer applies."""
        (self.control / "scale-refused.json").unlink(missing_ok=True)
        path = self.control / "scale.json"
        write_json(path, {"workers": n, "requested_at": time.time()})
        return path

    def refuse_workers(self, n: int | None, reason: str) -> None:
        """The driver's answer to a request it will not apply (`staleflow scale` prints it)."""
        write_json(self.control / "scale-refused.json", {"workers": n, "reason": reason})

    def worker_refusal(self, n: int) -> str | None:
        """Why the driver refused to scale to `n` workers, if it did."""
        data = read_json_object(self.control / "scale-refused.json") or {}
        return str(data.get("reason")) if data.get("workers") == n else None

    def take_worker_request(self) -> int | None:
        """The worker count a `staleflow scale` asks for, taken once (the request is removed),
        or None. A request that is not one (a hand edit, another tool: not a JSON object
        with an integer `workers` from 1 to MAX_WORKERS) is removed too, and refused
        (`refuse_workers`) with what is wrong: it must neither stop the driver nor stay to be
        read at every poll."""
        from staleflow.configs.schema import MAX_WORKERS

        path = self.control / "scale.json"
        taking = self.control / f".scale.taking.{uuid.uuid4().hex[:8]}"
        try:  # renamed first: a request written meanwhile stays for the next poll
            os.rename(path, taking)
            raw = taking.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:  # unreadable, or a directory: said once, left for its owner
            if not getattr(self, "_said_unreadable", False):
                logger.warning("cannot read the scale request %s: %s", path, exc)
                self._said_unreadable = True
            if taking.exists():
                with contextlib.suppress(OSError):
                    os.rename(taking, path)
            return None
        taking.unlink(missing_ok=True)
        try:
            data = json.loads(raw)
        except ValueError:  # JSON or UTF-8 errors
            data = None
        n = data.get("workers") if isinstance(data, dict) else None
        if type(n) is int and 1 <= n <= MAX_WORKERS:
            return n
        reason = (
            f"workers must be an integer from 1 to {MAX_WORKERS}, got {n!r}"
            if isinstance(data, dict)
            else f'{path.name} is not a JSON object like {{"workers": 4}}'
        )
        logger.error("scale request ignored: %s", reason)
        self.refuse_workers(n if type(n) is int else None, reason)
        return None

    def drop_worker_request(self) -> int | None:
        """Remove a scale request no driver took (its run stopped first); the count it asked
        for, if it can be read. A resume starts with the workers it is given, not those."""
        path = self.control / "scale.json"
        data = read_json_object(path) or {}
        path.unlink(missing_ok=True)
        n = data.get("workers")
        return n if type(n) is int else None

    def attach_log(self) -> logging.Handler:
        handler = logging.FileHandler(self.log)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        return handler


class MetricsWriter:
    """Appends records to metrics.jsonl (flushed per line, so a crash keeps all but the last)
    and mirrors numeric fields to TensorBoard as `<kind>/<key>`."""

    def __init__(self, run: RunDir, tensorboard: bool) -> None:
        self._path, self._tensorboard = run.metrics, run.tensorboard
        self._file = run.metrics.open("a", buffering=1)
        self._tb: Any = None
        if tensorboard:
            self._start_tensorboard(None)

    def reopen(self, tensorboard: bool, purge_step: int | None = None) -> None:
        """Append to metrics.jsonl anew (it was replaced: cut back by a resume), and start
        mirroring to TensorBoard now if asked. `purge_step`: a resumed run's first step;
        TensorBoard hides what the earlier run logged from there on (it is trained again).
        A resume opens it only once it is sure to go on: the purge is written at once."""
        self._file.close()
        self._file = self._path.open("a", buffering=1)
        if tensorboard and self._tb is None:
            self._start_tensorboard(purge_step)

    def _start_tensorboard(self, purge_step: int | None) -> None:
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(str(self._tensorboard), flush_secs=10, purge_step=purge_step)

    def write(self, kind: str, step: int, **fields: Any) -> dict[str, Any]:
        record = {"kind": kind, "step": step, "time": time.time(), **fields}
        self._file.write(json.dumps(record, default=_jsonable) + "\n")
        if self._tb is not None:
            for key, value in fields.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
        return record

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a metrics.jsonl: objects with a string `kind` and an integer `step`, as
    `MetricsWriter.write` makes them. A torn last line (a crash mid-write) is skipped; any other
    line that is no such record (a hand edit, a damaged disk) is skipped with a warning
    naming it, so a report or resume reads the rest."""
    if not path.is_file():
        return
    with path.open(encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if (
            isinstance(record, dict)
            and isinstance(record.get("kind"), str)
            and type(record.get("step")) is int
        ):
            yield record
        elif (number < len(lines) or line.endswith("\n")) and (path, number, line) not in _WARNED:
            _WARNED.add((path, number, line))  # once: a resume reads the file three times
            logger.warning(
                "%s:%d is not a metrics record (an object with kind and step): skipped: %.80r",
                path, number, line.rstrip("\n"),
            )  # fmt: skip
