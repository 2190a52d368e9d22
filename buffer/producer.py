"""The push side of the replay buffer: what rollout workers use (design: docs/architecture.md,
"The replay buffer"). Idempotent by group id, capacity as back-pressure, never trimming."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import redis

from staleflow.buffer import scripts
from staleflow.buffer.codec import encode_fields
from staleflow.buffer.connection import translate_errors
from staleflow.buffer.entries import BufferFullError, Fields, nbytes
from staleflow.buffer.records import Group

__all__ = ["Producer"]

_RESERVE_TTL_S = 30  # a producer that dies between reserving and adding blocks its ids this long


class Producer:
    """Appends groups to one run's stream (the ReplayBuffer names its keys; the dedup keys
    go under `prefix`); see `push_many`."""

    def __init__(
        self,
        client: redis.Redis,
        tx_client: redis.Redis,
        run: str,
        prefix: str,
        *,
        stream_key: str,
        stats_key: str,
        pushed_by_version_key: str,
        capacity: int,
        push_timeout_s: float,
        dedup_ttl_s: int,
        url_for_display: str = "?",
    ) -> None:
        self.client, self._tx_client = client, tx_client
        self.url_for_display = url_for_display  # errors name the server, password masked
        self.run, self.prefix = run, prefix
        self.stream_key, self.stats_key = stream_key, stats_key
        self.pushed_by_version_key = pushed_by_version_key
        self.capacity = capacity
        self.push_timeout_s = push_timeout_s
        self.dedup_ttl_s = dedup_ttl_s
        self._reserve = client.register_script(scripts.RESERVE)

    def push(self, group: Group) -> bool:
        """Append one group; True if added, False if this group id was already pushed.

        Blocks while the buffer is full, then raises BufferFullError. See `push_many`.
        """
        return self.push_many([group])[0]

    @translate_errors
    def push_many(self, groups: Sequence[Group]) -> list[bool]:
        """Append groups in two round trips; per group, True if added, False if a duplicate.

        Idempotent by group id: retrying a push, even after a lost reply, adds nothing twice.
        Blocks while the groups do not fit under `capacity`, then raises BufferFullError.
        Capacity is checked at reservation, so concurrent producers can overshoot it by the
        batches they have in flight; it is never enforced by trimming.
        """
        if not groups:
            return []
        if len(groups) > self.capacity:
            raise ValueError(
                f"cannot push {len(groups)} groups into a buffer of capacity {self.capacity}"
            )
        entries = [encode_fields(g) for g in groups]
        dedup_keys = [self.prefix + "gid:" + g.group_id for g in groups]
        token = "r:" + uuid.uuid4().hex
        deadline = time.monotonic() + self.push_timeout_s
        delay = 0.005
        while True:
            status = [int(x) for x in self._reserve(
                keys=[self.stream_key, self.stats_key, *dedup_keys],
                args=[self.capacity, _RESERVE_TTL_S, token],
            )]  # fmt: skip
            if status[0] >= 0:
                new = [i for i, st in enumerate(status) if st == 0]
                if not new or self._add_reserved(groups, entries, dedup_keys, new):
                    return [st == 0 for st in status]
                continue  # the transaction's reply was lost: the markers tell what happened
            if time.monotonic() >= deadline:
                if status[0] == -1:
                    raise BufferFullError(
                        f"another push of the same group id has been in flight for "
                        f"{self.push_timeout_s:g} s; nothing was pushed"
                    )
                raise BufferFullError(
                    f"replay buffer of run {self.run!r} has been full ({self.capacity} groups) "
                    f"for {self.push_timeout_s:g} s: the learner is not consuming (stopped or "
                    "too slow). Raise buffer.capacity or buffer.push_timeout_s, or add learner "
                    "throughput; nothing was pushed"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def _add_reserved(
        self, groups: Sequence[Group], entries: list[Fields], keys: list[str], new: list[int]
    ) -> bool:
        """XADD the reserved groups and mark them added, atomically. False if the connection
        dropped before the reply: the caller re-reserves, and the markers say whether the
        transaction ran ("added": duplicate from now on) or not (our token: add again)."""
        pipe = self._tx_client.pipeline(transaction=True)
        versions: dict[int, int] = {}
        for i in new:
            g = groups[i]
            entry: dict[Any, Any] = {**entries[i], "v": g.policy_version, "gid": g.group_id}
            pipe.xadd(self.stream_key, entry)
            pipe.set(keys[i], "added", ex=self.dedup_ttl_s)
            versions[g.policy_version] = versions.get(g.policy_version, 0) + 1
        pipe.hincrby(self.stats_key, "pushed", len(new))
        pipe.hincrby(self.stats_key, "bytes_pushed", sum(nbytes(entries[i]) for i in new))
        for version, count in versions.items():
            pipe.hincrby(self.pushed_by_version_key, str(version), count)
        try:
            pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError):
            return False
        return True
