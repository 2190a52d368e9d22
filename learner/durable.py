"""Renames that survive a crash of the machine, not only of the process.

A file is durable once its bytes are fsynced; a rename (or a new directory entry) only once the
directory holding it is fsynced too. Without that, on power loss a checkpoint's directory or
its LATEST pointer can be lost while the buffer's acks of its groups (in Redis's AOF, fsynced
every second) are not: the resume then finds more groups trained than the checkpoint holds.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["fsync_dir", "fsync_file", "replace_durably"]

# file systems that cannot fsync a directory (some network ones) say so with these
_NO_DIR_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EBADF}


def fsync_file(path: str | os.PathLike[str]) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory `path` (files added, renamed or removed) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIR_SYNC:
            raise
    finally:
        os.close(fd)


def replace_durably(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """os.replace(tmp, final), with tmp's bytes durable first and the rename after."""
    fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)
