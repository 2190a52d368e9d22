"""The replay buffer: trajectory groups in a Redis Stream, consumed through a consumer group.

Producers (rollout workers) `push` one entry per group; the learner `take`s a batch, trains,
and `ack`s the receipts once the step is committed. Invariants:

- Nothing is lost: an entry leaves the stream only when acked (and out of reuses), dropped as
  stale (counted), or moved to the `invalid` stream because it does not decode (counted).
  Entries delivered to a consumer that dies stay pending and are reclaimed (XAUTOCLAIM) by the
  next consumer after `claim_idle_s`. Capacity is back-pressure on producers, never trimming.
- Nothing is duplicated: a push is idempotent by group id (a retried push returns the first
  entry's id); an acked group is never delivered again, except through `replay` up to
  `max_reuse` trainings in all.
- A group the staleness rule (buffer.staleness.trainable) says may not be trained at
  `learner_version` is never returned by `take`; it is dropped and counted. The driver's
  async admission applies the same rule beforehand, so in FIFO order nothing reaches it.

Every key lives under `staleflow:<run>:`, so runs can share a server. Each multi-key change is
one Lua script, so a crash between two commands cannot leave counters and data disagreeing.
The push side is staleflow.buffer.producer, the learner side staleflow.buffer.consumer; this
module holds them together with the run's statistics and its administration.
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import redis

from staleflow.buffer.connection import (
    BufferConnectionError,
    connect,
    translate_errors,
    without_retries,
)
from staleflow.buffer.consumer import Consumer, Sampling
from staleflow.buffer.entries import (
    GROUP_NAME,
    RUN_NAME,
    BufferFullError,
    BufferStats,
    Receipt,
    RunKeys,
    Taken,
    int_map,
    text,
)
from staleflow.buffer.producer import Producer
from staleflow.buffer.records import Group
from staleflow.configs.loader import redact

__all__ = [
    "BufferConnectionError",
    "BufferFullError",
    "BufferStats",
    "Receipt",
    "ReplayBuffer",
    "Taken",
    "connect",
]


# ----------------------------------------------------------------------------- the buffer


def _consumer_option(name: str) -> Any:
    """A ReplayBuffer attribute read and set on its Consumer's `name`."""
    return property(
        lambda self: getattr(self._consumer, name),
        lambda self, value: setattr(self._consumer, name, value),
    )


class ReplayBuffer:
    """One run's replay buffer on a Redis server (see the module docstring).

    A producer needs only `push`; a learner uses `take` and `ack`. Each learner process should
    have its own `consumer` name (default: host, pid and a random suffix).
    Groups a consumer holds (taken, not yet acked) are never handed out to it again; another
    consumer reclaims them after `claim_idle_s`, so with several learner processes it must
    exceed the longest time one holds a group: a step, plus the prefetch before it, plus
    (with `read_ahead`, see `take`) the step before that, since entries read ahead wait in
    the consumer's pool for a take.
    """

    def __init__(
        self,
        url: str | redis.Redis,
        run: str,
        *,
        capacity: int = 1024,
        sampling: Sampling = "fifo",
        max_reuse: int = 1,
        max_staleness: int | None = None,
        push_timeout_s: float = 300.0,
        claim_idle_s: float = 60.0,
        consumer: str | None = None,
        dedup_ttl_s: int = 24 * 3600,
        read_ahead: bool = True,
    ) -> None:
        if not RUN_NAME.fullmatch(run):
            raise ValueError(
                f"run name {run!r} must be 1-128 letters, digits, '_', '.' or '-', starting "
                "with a letter or digit"
            )
        if sampling not in ("fifo", "freshest", "replay"):
            raise ValueError(f"sampling must be fifo, freshest or replay, got {sampling!r}")
        if max_reuse < 1 or (max_reuse > 1 and sampling != "replay"):
            raise ValueError("max_reuse must be >= 1, and > 1 only with sampling='replay'")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if dedup_ttl_s < 1:
            raise ValueError(f"dedup_ttl_s must be >= 1 second, got {dedup_ttl_s}")
        if max_staleness is not None and not (type(max_staleness) is int and max_staleness >= 0):
            raise ValueError(  # -1 dropped every group as stale
                f"max_staleness must be a whole number >= 0 (or None), got {max_staleness!r}"
            )
        for name, seconds in (("push_timeout_s", push_timeout_s), ("claim_idle_s", claim_idle_s)):
            if not (math.isfinite(seconds) and seconds >= 0):  # nan: a full push spun for ever
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {seconds}")
        if not isinstance(url, str | redis.Redis):
            raise TypeError(f"url must be a redis:// URL or a redis.Redis client, got {url!r}")
        if isinstance(url, str):
            self.client = connect(url)
            self.url_for_display = redact(url)
        else:
            self.client = url
            kw = url.connection_pool.connection_kwargs
            self.url_for_display = f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}"
        # Transactions must never be resent blindly (a resent EXEC could add twice), so they
        # go through a client whose connections do not retry; push_many recovers instead.
        self._tx_client = without_retries(self.client)
        self.run = run
        name = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.keys = keys = RunKeys(run)
        self._producer = Producer(
            self.client,
            self._tx_client,
            run,
            keys,
            capacity=capacity,
            push_timeout_s=push_timeout_s,
            dedup_ttl_s=dedup_ttl_s,
            url_for_display=self.url_for_display,
        )
        self._consumer = Consumer(
            self.client,
            keys,
            name,
            capacity=capacity,
            sampling=sampling,
            max_reuse=max_reuse,
            max_staleness=max_staleness,
            claim_idle_s=claim_idle_s,
            read_ahead=read_ahead,
            url_for_display=self.url_for_display,
        )

    # The options the learner side acts on live in the Consumer only (one copy).
    sampling = _consumer_option("sampling")
    max_reuse = _consumer_option("max_reuse")
    max_staleness = _consumer_option("max_staleness")
    claim_idle_s = _consumer_option("claim_idle_s")
    read_ahead = _consumer_option("read_ahead")
    consumer = _consumer_option("name")  # this learner process's consumer name

    @property
    def capacity(self) -> int:
        """Groups the buffer holds at most (trained ones held for a checkpoint not counted):
        the producer waits at it, and a freshest-first consumer reads up to it."""
        return self._producer.capacity

    @capacity.setter
    def capacity(self, value: int) -> None:  # both sides act on it: one value for both
        if value < 1:
            raise ValueError(f"capacity must be >= 1, got {value}")
        self._producer.capacity = self._consumer.capacity = value

    @classmethod
    def from_config(cls, cfg: Any, url: str | redis.Redis, run: str, **kwargs: Any) -> ReplayBuffer:
        """From a `BufferConfig` (staleflow.configs.schema)."""
        return cls(
            url,
            run,
            capacity=cfg.capacity,
            sampling=cfg.sampling,
            max_reuse=cfg.max_reuse,
            max_staleness=cfg.max_staleness,
            push_timeout_s=cfg.push_timeout_s,
            claim_idle_s=cfg.claim_idle_s,
            **kwargs,
        )

    # ------------------------------------------------------------------------- producer

    def push(self, group: Group) -> bool:
        """Append one group; True if added, False if this group id was already pushed.
        Blocks while the buffer is full, then raises BufferFullError (see `push_many`)."""
        return self._producer.push(group)

    def push_many(self, groups: Sequence[Group]) -> list[bool]:
        """See staleflow.buffer.producer.Producer.push_many."""
        return self._producer.push_many(groups)

    # ------------------------------------------------------------------------- learner

    def take(
        self, n: int, learner_version: int, timeout_s: float = 0.0, ack: Sequence[Receipt] = ()
    ) -> Taken:
        """Up to `n` groups trainable at `learner_version`, waiting up to `timeout_s` for
        `n` to be available. Stale groups met on the way are dropped and counted.

        Read-ahead (on unless the buffer was made with `read_ahead=False`; not with
        `freshest`, which reads everything anyway): while this take decodes, the server is
        already delivering up to `n` more entries to this consumer for the next take. They
        wait in the local pool, pending in Redis under this consumer's name (so a crash
        loses none: `recover` or another consumer's reclaim gets them back), and the
        staleness rule is applied to them when a take hands them out.

        `ack`: receipts of groups whose step is committed, acked exactly as `ack` would, in
        the same round trip as this take's read (with read-ahead, the read of the next
        take's entries: a consumer that takes right after acking saves the ack's round
        trip); `Taken.acked` says how many of them were pending when the ack ran (an ack
        sent again after a dropped connection returns the first one's count: each ack
        records it under its own key for 10 minutes)."""
        return self._consumer.take(n, learner_version, timeout_s, ack)

    def ack(self, receipts: Iterable[Receipt], held: bool = False) -> int:
        """Acknowledge groups whose training step is committed; returns how many were pending.

        In `replay` mode a group stays for reuse until it has been acked `max_reuse` times.
        `held`: the groups were counted by `hold` (the count drops by the number acked).
        """
        return self._consumer.ack(receipts, held)

    def hold(self, receipts: Sequence[Receipt]) -> None:
        """These taken groups are trained but stay pending until a checkpoint makes the step
        durable (then `ack(receipts, held=True)`): those the ack will delete (with replay
        sampling, only those at their last use: the others stay in the stream as replays)
        stop counting against the capacity, and a learner restarted from the checkpoint gets
        them all again (`recover`)."""
        self._consumer.hold(receipts)

    def recover(self) -> int:
        """After a learner restart: every entry delivered and not acked (to any consumer,
        this one included) is handed out again, oldest first, before anything new; replays
        in flight become replayable; the dedup keys of every group in the stream are set
        again (a resume after `dedup_ttl_s` redoes batches whose groups are still here).
        Returns how many entries were recovered."""
        count = self._consumer.recover()
        self._producer.refresh_dedup()
        return count

    def check_reachable(self, who: str) -> None:
        """Ping the server now, so that a process that cannot reach it fails at start with a
        message naming itself and the address, rather than at its first push or take."""
        try:
            self._ping()
        except BufferConnectionError as exc:
            raise BufferConnectionError(
                f"{who} cannot reach the replay buffer: {exc}. On a multi-node cluster the "
                "server must listen on an address every node reaches: the embedded one does "
                "when the run joins the cluster with --address; or set buffer.redis_url"
            ) from None

    @translate_errors
    def _ping(self) -> None:
        self.client.ping()

    @translate_errors
    def runs(self) -> list[str]:
        """The runs with a buffer on this server (a stream or counters under their prefix)."""
        names = set()
        for pattern in ("staleflow:*:stream", "staleflow:*:stats"):
            for key in self.client.scan_iter(match=pattern, count=1000):
                names.add(text(key).split(":")[1])  # run names hold no ":" (see __init__)
        return sorted(names)

    @translate_errors
    def stats(self) -> BufferStats:
        """Counts for this run (cheap: a handful of O(1) commands and one memory estimate)."""
        keys = self.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(keys.stream)
        pipe.hgetall(keys.stats)
        pipe.zcard(keys.replay)
        pipe.hlen(keys.replay_pending)
        pipe.hgetall(keys.pushed_by_version)
        pipe.hgetall(keys.trained_by_version)
        pipe.memory_usage(keys.stream)
        length, counters, replayable, replay_pending, pushed_v, trained_v, mem = pipe.execute()
        group_pending = 0
        try:
            for info in self.client.xinfo_groups(keys.stream):
                if text(info["name"]) == GROUP_NAME:
                    group_pending = int(info["pending"])
        except redis.ResponseError:  # no stream yet
            pass
        # Every stored entry is exactly one of: undelivered, pending in the consumer group,
        # replayable, or a replay in flight; so undelivered is the remainder.
        undelivered = int(length) - group_pending - int(replayable) - int(replay_pending)
        c = {text(k): int(v) for k, v in counters.items()}
        return BufferStats(
            run=self.run,
            capacity=self.capacity,
            length=int(length),
            undelivered=undelivered,
            pending=group_pending + int(replay_pending),
            replayable=int(replayable),
            pushed=c.get("pushed", 0),
            duplicates=c.get("duplicates", 0),
            acked=c.get("acked", 0),
            reused=c.get("reused", 0),
            dropped_stale=c.get("dropped_stale", 0),
            dropped_invalid=c.get("dropped_invalid", 0),
            held=c.get("held", 0),
            replays_pending=int(replay_pending),
            replays_dropped_stale=c.get("replays_dropped_stale", 0),
            replays_dropped_invalid=c.get("replays_dropped_invalid", 0),
            bytes_pushed=c.get("bytes_pushed", 0),
            stream_bytes=int(mem or 0),
            pushed_by_version=int_map(pushed_v),
            trained_by_version=int_map(trained_v),
        )

    @translate_errors
    def clear(self) -> int:
        """Delete every key of this run; returns how many were deleted."""
        keys = list(self.client.scan_iter(match=self.keys.prefix + "*", count=1000))
        self._consumer.forget()
        return int(self.client.delete(*keys)) if keys else 0

    def close(self) -> None:
        self._tx_client.close()
        self.client.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
