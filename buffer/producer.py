"""The push side of the replay buffer: what rollout workers use (design: docs/architecture.md,
"The replay buffer"). Idempotent by group id, capacity as back-pressure, never trimming."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis

from staleflow.buffer import scripts
from staleflow.buffer.codec import encode_fields
from staleflow.buffer.connection import Pinned, translate_errors
from staleflow.buffer.entries import BufferFullError, Fields, RunKeys, Tokens, nbytes, text
from staleflow.buffer.inflight import InFlight, after_lost_reply
from staleflow.buffer.records import Group

__all__ = ["Producer"]

_FULL = -2  # scripts.ADMIT: the new groups do not fit


class Producer:
    """Appends groups to one run's stream; see `push_many`."""

    def __init__(
        self,
        client: redis.Redis,
        tx_client: redis.Redis,
        run: str,
        keys: RunKeys,
        *,
        capacity: int,
        push_timeout_s: float,
        dedup_ttl_s: int,
        url_for_display: str = "?",
    ) -> None:
        self.client = client
        self.url_for_display = url_for_display  # errors name the server, password masked
        self.run, self.keys = run, keys
        self.capacity = capacity
        self.push_timeout_s = push_timeout_s
        self.dedup_ttl_s = dedup_ttl_s
        self._fits = client.register_script(scripts.FITS)
        self._lane = Pinned(tx_client)
        self._tokens = Tokens()  # a push's token names it: its status key, its dedup keys

    def push(self, group: Group) -> bool:
        """Append one group; True if added, False if this group id was already pushed.

        Blocks while the buffer is full, then raises BufferFullError. See `push_many`.
        """
        return self.push_many([group])[0]

    @translate_errors
    def push_many(self, groups: Sequence[Group]) -> list[bool]:
        """Append groups in one round trip; per group, True if added, False if a duplicate.

        Idempotent by group id: retrying a push, even after a lost reply, adds nothing twice.
        Blocks while the groups do not fit under `capacity`, then raises BufferFullError.
        Capacity is checked inside the push's transaction, so it is exact: concurrent
        producers never overshoot it, and it is never enforced by trimming.
        """
        if not groups:
            return []
        if len(groups) > self.capacity:
            raise ValueError(
                f"cannot push {len(groups)} groups into a buffer of capacity {self.capacity}"
            )
        entries = [encode_fields(g) for g in groups]
        dedup_keys = [self.keys.dedup(g.group_id) for g in groups]
        token = "t:" + next(self._tokens)
        deadline = time.monotonic() + self.push_timeout_s
        delay, lost = 0.005, 0
        while True:
            status = self._add(groups, entries, dedup_keys, token)
            if status is None:  # the reply was lost: its dedup keys (and status key) tell if it ran
                lost = after_lost_reply(
                    lost,
                    self.client,
                    f"a push of {len(groups)} groups ({sum(map(nbytes, entries)) >> 20} MB); a "
                    "push too large for the server's client-query-buffer-limit does this",
                )
                continue
            lost = 0
            if status[0] != _FULL:
                return [st == 0 for st in status]
            while not self._fits(  # wait for room without resending the payload
                keys=[self.keys.stream, self.keys.stats, *dedup_keys], args=[self.capacity]
            ):
                if time.monotonic() >= deadline:
                    raise BufferFullError(
                        f"replay buffer of run {self.run!r} has been full ({self.capacity} "
                        f"groups) for {self.push_timeout_s:g} s: the learner is not consuming "
                        "(stopped or too slow). Raise buffer.capacity or buffer.push_timeout_s, "
                        "or add learner throughput; nothing was pushed"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.25)

    @translate_errors
    def refresh_dedup(self) -> int:
        """Set the dedup key of every group still in the stream again, for a full TTL; how
        many. A run resumed more than the TTL after its pushes redoes batches whose groups
        are still here (pending, or never read): they must not be taken as new. Reads the
        stream in chunks, payloads too (XRANGE has no field filter): once, at a resume."""
        start, count = "-", 0
        while True:
            entries = self.client.xrange(self.keys.stream, start, "+", count=64) or []
            if not entries:
                return count
            pipe = self.client.pipeline(transaction=False)
            for _, fields in entries:
                gid = (fields or {}).get(b"gid")
                if gid:  # a key still there keeps its push's token, with a new TTL
                    key = self.keys.dedup(text(gid))
                    pipe.set(key, "resumed", ex=self.dedup_ttl_s, nx=True)
                    pipe.expire(key, self.dedup_ttl_s)
                    count += 1
            pipe.execute()
            start = "(" + text(entries[-1][0])

    def _add(
        self, groups: Sequence[Group], entries: list[Fields], keys: list[str], token: str
    ) -> list[int] | None:
        """One MULTI/EXEC: XADD every group, then ADMIT keeps the new ones if they fit
        (scripts.ADMIT). None if the connection failed before the reply: the caller sends
        the same transaction again, and ADMIT returns what the first one did, if it ran.

        Sent as one packed write on a pinned connection (InFlight) and read back reply by
        reply, without the Python work of redis-py's transaction pipeline or of taking a
        pooled connection per push (connection.Pinned)."""
        args: list[Any] = [self.capacity, self.dedup_ttl_s, token, scripts.STATUS_TTL_S]
        commands: list[tuple[Any, ...]] = [("MULTI",)]
        for g, fields in zip(groups, entries, strict=True):
            flat = [x for kv in fields.items() for x in kv]
            commands.append(("XADD", self.keys.stream, "*", *flat, "v", g.policy_version,
                             "gid", g.group_id))  # fmt: skip
            args += [g.policy_version, nbytes(fields)]
        k = self.keys
        keys = [k.stream, k.stats, k.pushed_by_version, k.push_status(token), *keys]
        commands += [("EVAL", scripts.ADMIT, len(keys), *keys, *args), ("EXEC",)]
        # (Re)connecting is part of the attempt: a server restarting is waited for.
        replies = InFlight.send(self._lane, commands).replies()
        if replies is None:
            return None
        for reply in replies:  # a refused transaction: its first refusal, then EXECABORT
            if isinstance(reply, Exception):
                raise reply
        *added, admitted = replies[-1]
        if isinstance(admitted, Exception):  # EXEC does not roll back: take the XADDs back
            ids = [i for i in added if not isinstance(i, Exception)]
            if ids:
                self.client.xdel(self.keys.stream, *ids)
            raise admitted
        for reply in added:
            if isinstance(reply, Exception):
                raise reply  # see scripts.ADMIT: a failing XADD fails every one and ADMIT
        return [int(x) for x in admitted]
