"""Shared storage on a multi-node cluster: checked at start, not discovered at a checkpoint.

Learner ranks write checkpoints and the trajectory record into the run directory, and with
`sync.method: checkpoint` rank 0 writes the published weights that rollout workers read; the
driver reads all of it. Those paths are the driver's, so a rank or worker on another node
writes (or looks) on that node's own disk unless the directory is on storage every node mounts
at the same path. The driver leaves a fresh token in each such directory; every actor that
uses one reads it back in its constructor, and one that cannot fails the start, naming itself,
its node and the fix:

    shared = SharedDir.mark(run_dir, "the run directory")   # driver
    shared.check("learner rank 1 on 10.0.0.2")              # actor, before anything else
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MARK", "SharedDir", "SharedStorageError"]

MARK = ".staleflow-shared"


class SharedStorageError(RuntimeError):
    """An actor does not see a directory the driver wrote (it is not on shared storage)."""


@dataclass(frozen=True)
class SharedDir:
    path: str
    token: str
    what: str  # e.g. "the run directory", "sync.checkpoint_dir"
    writer: str  # the driver's node address, for the message

    @classmethod
    def mark(cls, path: str | os.PathLike[str], what: str, writer: str) -> SharedDir:
        """Leave a new token in `path` (created if missing) for actors to find."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex
        tmp = directory / f"{MARK}.{token[:8]}"
        tmp.write_text(token)
        os.replace(tmp, directory / MARK)
        # the same string the actors are given (absolute, symlinks kept): resolving a link
        # here would check another path than the one they write to
        return cls(os.path.abspath(directory), token, what, writer)

    def check(self, who: str, wait_s: float = 5.0) -> None:
        """Raise SharedStorageError unless this process sees the token the driver left.

        Retried for `wait_s`: a network file system may show a new file to other nodes a
        moment late (listing the directory makes NFS revalidate it)."""
        deadline = time.monotonic() + wait_s
        while True:
            seen, error = self._read()
            if seen == self.token or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if seen == self.token:
            return
        if error is not None:
            found = f"cannot be read there: {error}"
        elif seen is None:
            found = "is missing there"
        else:
            found = "holds another run's token there"
        raise SharedStorageError(
            f"{who} does not see {self.what} {self.path} as the driver on {self.writer} wrote "
            f"it (its marker file {MARK} {found}): the learner writes checkpoints, the "
            "trajectory record and published weights there, and the driver and workers read "
            "them, so on a multi-node cluster it must be on storage every node mounts at the "
            "same path (NFS, a shared volume). Set run.output_dir (and sync.checkpoint_dir) to "
            "such a path, or keep the learner on the driver's node (learner.resources) and "
            "use a sync.method other than checkpoint."
        )

    def _read(self) -> tuple[str | None, str | None]:
        """(the token seen, or None; why it could not be read, if not for being absent)."""
        try:
            os.listdir(self.path)
            return (Path(self.path) / MARK).read_text().strip(), None
        except FileNotFoundError:
            return None, None
        except OSError as exc:  # permissions (NFS root_squash), a stale handle...
            return None, f"{type(exc).__name__}: {exc}"
