"""What the replay buffer hands out and reports, its keys, and how its stream entries are read
(staleflow.buffer.replay has the buffer itself, .producer the push side, .consumer the
learner side)."""

from __future__ import annotations

import itertools
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from staleflow.buffer.records import Group

__all__ = [
    "GROUP_NAME",
    "RUN_NAME",
    "BufferFullError",
    "BufferStats",
    "Fields",
    "Receipt",
    "RunKeys",
    "Taken",
    "Tokens",
    "id_key",
    "int_map",
    "nbytes",
    "now_ms",
    "parse_fields",
    "text",
]

GROUP_NAME = "learner"  # the stream's consumer group
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
"""What a run's name in the buffer may be (fullmatch): no ':' (runs() splits keys on it)
and no glob characters (clear() scans `staleflow:<run>:*`)."""
Fields = dict[str, bytes | memoryview]


class RunKeys:
    """The Redis keys of one run's buffer, all under `staleflow:<run>:` (runs can share a
    server)."""

    def __init__(self, run: str) -> None:
        self.prefix = p = f"staleflow:{run}:"
        self.stream = p + "stream"  # one entry per group
        self.stats = p + "stats"  # counters (a hash)
        self.uses = p + "uses"  # replay: entry -> trainings so far
        self.replay = p + "replay"  # replay: the replayable entries, scored by uses
        self.replay_pending = p + "replay:pending"  # replay: entries out for training
        self.invalid = p + "invalid"  # entries that did not decode, with the error
        self.pushed_by_version = p + "versions:pushed"
        self.trained_by_version = p + "versions:trained"
        # The first KEYS of the ack and drop scripts (scripts._RELEASE relies on the order).
        self.entry = [self.stream, self.stats, self.uses, self.replay, self.replay_pending]

    def dedup(self, group_id: str) -> str:
        return self.prefix + "gid:" + group_id

    def push_status(self, token: str) -> str:
        return self.prefix + "push:" + token

    def ack_status(self, token: str) -> str:
        return self.prefix + "ack:" + token

    def hold_status(self, token: str) -> str:
        return self.prefix + "hold:" + token

    def drop_status(self, token: str) -> str:
        return self.prefix + "drop:" + token


class Tokens:
    """Names for single calls (a push, an ack) that make a retried call recognisable: a
    random prefix per process, made again in a forked child (which would otherwise repeat
    its parent's names), and a counter. `next(tokens)`."""

    def __init__(self) -> None:
        self._renew()

    def _renew(self) -> None:
        self._prefix, self._count = uuid.uuid4().hex, itertools.count()
        self._pid = os.getpid()

    def __next__(self) -> str:
        if self._pid != os.getpid():
            self._renew()
        return f"{self._prefix}:{next(self._count)}"


class BufferFullError(TimeoutError):
    """A push waited `push_timeout_s` on a full buffer."""


@dataclass(frozen=True)
class Receipt:
    """Proof that a group was handed to the learner; pass it to `ack` after the step."""

    entry_id: str
    policy_version: int
    replay: bool = False
    # a replay's take, as the buffer recorded it: an ack of this receipt releases the entry
    # only while it is still out from that take (not once it was acked and taken again)
    token: str = ""


@dataclass(frozen=True)
class Taken:
    """What one `take` returned, plus what it dropped on the way."""

    groups: list[Group]
    receipts: list[Receipt]
    dropped_stale: int = 0
    dropped_invalid: int = 0
    acked: int = 0  # of the receipts passed to `take(..., ack=...)`, how many were pending
    replays_dropped: int = 0  # of the drops, replays (groups trained before)


@dataclass(frozen=True)
class BufferStats:
    """A snapshot of one run's buffer (see `ReplayBuffer.stats`)."""

    run: str
    capacity: int
    length: int  # entries stored: undelivered + pending + kept for replay
    undelivered: int  # never handed to a consumer
    pending: int  # delivered to a consumer (handed out or read ahead), not acked; replays too
    replayable: int  # acked, may be trained on again
    pushed: int
    duplicates: int  # pushes refused as already present
    acked: int  # trainings acknowledged (a replayed group counts each time)
    reused: int  # acks beyond a group's first
    dropped_stale: int
    dropped_invalid: int
    bytes_pushed: int
    stream_bytes: int  # Redis' estimate of the stream's memory
    pushed_by_version: dict[int, int] = field(default_factory=dict)
    trained_by_version: dict[int, int] = field(default_factory=dict)
    held: int = 0  # pending, trained, acked at the next checkpoint (not counted in capacity)
    # With replay sampling: replays (trained before) handed out and not acked (in `pending`),
    # and replays dropped (in `dropped_stale` / `dropped_invalid`).
    replays_pending: int = 0
    replays_dropped_stale: int = 0
    replays_dropped_invalid: int = 0


def parse_fields(fields: dict[bytes, bytes]) -> tuple[int, dict[bytes, bytes]]:
    """(policy version, fields) of a stream entry; a malformed version becomes -1, and the
    decoder then rejects the entry (it is moved to the invalid stream, not counted stale)."""
    try:
        version = int(fields.get(b"v", b"-1"))
    except ValueError:
        version = -1
    return version, fields


def nbytes(fields: Fields) -> int:
    return sum(len(v) if isinstance(v, bytes) else v.nbytes for v in fields.values())


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def int_map(raw: dict[Any, Any]) -> dict[int, int]:
    return dict(sorted((int(k), int(v)) for k, v in raw.items()))


def now_ms() -> int:
    return int(time.time() * 1000)
