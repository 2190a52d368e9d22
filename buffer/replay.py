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
"""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import redis

from staleflow.buffer import scripts
from staleflow.buffer.codec import RecordError, decode_fields
from staleflow.buffer.connection import (
    BufferConnectionError,
    Pinned,
    connect,
    translate_errors,
    without_retries,
)
from staleflow.buffer.entries import (
    GROUP_NAME,
    BufferFullError,
    BufferStats,
    Receipt,
    Taken,
    id_key,
    int_map,
    now_ms,
    parse_fields,
    text,
)
from staleflow.buffer.inflight import InFlight
from staleflow.buffer.producer import Producer
from staleflow.buffer.records import Group
from staleflow.buffer.staleness import trainable
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

Sampling = Literal["fifo", "freshest", "replay"]
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


# ----------------------------------------------------------------------------- the buffer


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
        if not _RUN_NAME.match(run):
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
        self._lane = Pinned(self.client)  # take's read-ahead (InFlight)
        self.run = run
        self.capacity = capacity
        self.sampling: Sampling = sampling
        self.max_reuse = max_reuse
        self.max_staleness = max_staleness
        self.claim_idle_s = claim_idle_s
        self.read_ahead = read_ahead
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"

        prefix = f"staleflow:{run}:"
        self.prefix = prefix
        self.stream_key = prefix + "stream"
        self.stats_key = prefix + "stats"
        self.uses_key = prefix + "uses"
        self.replay_key = prefix + "replay"
        self.replay_pending_key = prefix + "replay:pending"
        self.invalid_key = prefix + "invalid"
        self.pushed_by_version_key = prefix + "versions:pushed"
        self.trained_by_version_key = prefix + "versions:trained"
        # The first KEYS of the ack and drop scripts (scripts._RELEASE relies on the order).
        self._entry_keys = [
            self.stream_key,
            self.stats_key,
            self.uses_key,
            self.replay_key,
            self.replay_pending_key,
        ]
        self._ack_keys = [*self._entry_keys, self.trained_by_version_key]

        self._producer = Producer(
            self.client,
            self._tx_client,
            run,
            prefix,
            stream_key=self.stream_key,
            stats_key=self.stats_key,
            pushed_by_version_key=self.pushed_by_version_key,
            capacity=capacity,
            push_timeout_s=push_timeout_s,
            dedup_ttl_s=dedup_ttl_s,
            url_for_display=self.url_for_display,
        )
        self._ack = self.client.register_script(scripts.ACK)
        self._drop = self.client.register_script(scripts.DROP)
        self._replay_take = self.client.register_script(scripts.REPLAY_TAKE)
        self._replay_reclaim = self.client.register_script(scripts.REPLAY_RECLAIM)
        # Entries delivered to this consumer but not yet handed out: entry id -> (version,
        # payload). They stay pending in Redis, so they are reclaimed if this process dies.
        self._pool: dict[str, tuple[int, dict[bytes, bytes]]] = {}
        # Entries this consumer handed out and has not acked: still pending under its name in
        # Redis, so XAUTOCLAIM would return them to it; they must not be handed out twice.
        self._held: set[str] = set()
        self._last_claim = 0.0
        self._group_ready = False
        # A read-ahead whose reply was lost: its entries are pending under this consumer.
        self._lost_read = False

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
        return self._producer.push_many([group])[0]

    def push_many(self, groups: Sequence[Group]) -> list[bool]:
        """See staleflow.buffer.producer.Producer.push_many."""
        return self._producer.push_many(groups)

    # ------------------------------------------------------------------------- learner

    @translate_errors
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
        trip); `Taken.acked` says how many of them were pending (fewer if the connection
        dropped and the ack was sent again after it had landed: acking is idempotent, the
        count is not)."""
        if n < 1:
            raise ValueError(f"take needs n >= 1, got {n}")
        self._ensure_group()
        deadline = time.monotonic() + timeout_s
        stale = invalid = 0
        taken: list[tuple[str, int, dict[bytes, bytes], bool]] = []
        ack_args, acked = self._ack_args(ack, held=False), 0
        while True:
            self._reclaim_if_due()
            stale += self._drop_stale_pooled(learner_version)  # read ahead, stale by now
            read, ack_result = self._refill(n - len(taken), deadline, ack_args)
            if ack_result is not None:
                acked, ack_args = self._acked(ack_args or [], ack_result), None
            stale += self._drop_stale_pooled(learner_version)
            for entry_id in self._select(n - len(taken)):
                version, fields = self._pool.pop(entry_id)
                taken.append((entry_id, version, fields, False))
            if len(taken) < n and self.sampling == "replay":
                replays, dropped = self._take_replays(n - len(taken), learner_version)
                taken.extend(replays)
                stale += dropped
            # Keep going while short and either time remains or the last read found entries
            # (stale drops can eat a read; the next one may have fresh groups).
            if len(taken) >= n or (read == 0 and time.monotonic() >= deadline):
                break
        # The ack not sent yet and the read of the next take's entries go out now; their
        # replies are read after decoding, so the server works while this process decodes.
        ahead = self._send_ahead(n, ack_args)
        try:
            try:
                groups, receipts, bad = self._decode(taken)
            finally:
                late = self._finish_ahead(ahead, ack_args)
        except BaseException:  # nothing is handed out: the next take offers these again
            for entry_id, version, fields, replay in taken:
                if not replay:
                    self._held.discard(entry_id)
                    self._pool.setdefault(entry_id, (version, fields))
            raise
        if ack_args:
            acked = self._acked(ack_args, late)
        if bad:
            invalid = self._drop_entries(bad, "invalid")
        return Taken(groups, receipts, dropped_stale=stale, dropped_invalid=invalid, acked=acked)

    def _decode(
        self, taken: list[tuple[str, int, dict[bytes, bytes], bool]]
    ) -> tuple[list[Group], list[Receipt], list[tuple[str, bool, str]]]:
        """Decode taken entries: (groups, their receipts, (entry, replay, error) of the bad)."""
        groups, receipts = [], []
        bad: list[tuple[str, bool, str]] = []
        for entry_id, version, fields, replay in taken:
            try:
                group = decode_fields(fields)
                if group.policy_version != version:
                    raise RecordError(
                        "policy_version", f"{group.policy_version} but the entry says {version}"
                    )
            except RecordError as exc:
                bad.append((entry_id, replay, str(exc)))
                continue
            groups.append(group)
            receipts.append(Receipt(entry_id, version, replay))
            if not replay:
                self._held.add(entry_id)
        return groups, receipts, bad

    @translate_errors
    def ack(self, receipts: Iterable[Receipt], held: bool = False) -> int:
        """Acknowledge groups whose training step is committed; returns how many were pending.

        In `replay` mode a group stays for reuse until it has been acked `max_reuse` times.
        `held`: the groups were counted by `hold` (the count drops by the number acked).
        """
        args = self._ack_args(receipts, held)
        if not args:
            return 0
        return self._acked(args, self._ack(keys=self._ack_keys, args=args))

    @translate_errors
    def hold(self, n: int) -> None:
        """`n` taken groups are trained but stay pending until a checkpoint makes the step
        durable (then `ack(..., held=True)`): they stop counting against the capacity, and a
        learner restarted from the checkpoint gets them again (`recover`)."""
        if n > 0:
            self.client.hincrby(self.stats_key, "held", n)

    @translate_errors
    def recover(self) -> int:
        """After a learner restart: every entry delivered and not acked (to any consumer,
        this one included) is handed out again, oldest first, before anything new; replays
        in flight become replayable. Returns how many entries were recovered."""
        self._ensure_group()
        self._pool.clear()
        self._held.clear()
        self._lost_read = False  # everything pending is claimed below, this consumer's too
        start, count = "0-0", 0
        while True:
            start, claimed, *_ = self.client.xautoclaim(
                self.stream_key, GROUP_NAME, self.consumer, 0, start_id=start, count=256
            )
            for entry_id, fields in claimed:
                if fields:  # deleted entries come back empty
                    self._pool[text(entry_id)] = parse_fields(fields)
                    count += 1
            if text(start) == "0-0":
                break
        if self.sampling == "replay":
            self._replay_reclaim(
                keys=[self.replay_key, self.replay_pending_key, self.uses_key], args=[now_ms(), 0]
            )
        self.client.hset(self.stats_key, "held", 0)
        self._last_claim = time.monotonic()
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
    def stats(self) -> BufferStats:
        """Counts for this run (cheap: a handful of O(1) commands and one memory estimate)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(self.stream_key)
        pipe.hgetall(self.stats_key)
        pipe.zcard(self.replay_key)
        pipe.hlen(self.replay_pending_key)
        pipe.hgetall(self.pushed_by_version_key)
        pipe.hgetall(self.trained_by_version_key)
        pipe.memory_usage(self.stream_key)
        length, counters, replayable, replay_pending, pushed_v, trained_v, mem = pipe.execute()
        group_pending = 0
        try:
            for info in self.client.xinfo_groups(self.stream_key):
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
            bytes_pushed=c.get("bytes_pushed", 0),
            stream_bytes=int(mem or 0),
            pushed_by_version=int_map(pushed_v),
            trained_by_version=int_map(trained_v),
        )

    @translate_errors
    def clear(self) -> int:
        """Delete every key of this run; returns how many were deleted."""
        keys = list(self.client.scan_iter(match=self.prefix + "*", count=1000))
        self._pool.clear()
        self._held.clear()
        self._lost_read = False
        self._group_ready = False
        return int(self.client.delete(*keys)) if keys else 0

    def close(self) -> None:
        self._tx_client.close()
        self.client.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------- internals

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self.client.xgroup_create(self.stream_key, GROUP_NAME, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def _regroup(self, error: redis.ResponseError) -> bool:
        """True if `error` says the server lost the consumer group (a restart without AOF);
        the group is then made again."""
        if "NOGROUP" not in str(error):
            return False
        self._group_ready = False
        self._ensure_group()
        return True

    def _ack_args(self, receipts: Iterable[Receipt], held: bool) -> list[Any] | None:
        """scripts.ACK's ARGV for these receipts, or None if there are none."""
        args: list[Any] = [GROUP_NAME, self.max_reuse, "1" if held else "0"]
        for r in receipts:
            args += [r.entry_id, r.policy_version, "1" if r.replay else "0"]
        return args if len(args) > 3 else None

    def _acked(self, args: list[Any], result: Any) -> int:
        """After scripts.ACK ran: its receipts are no longer held here; how many it acked."""
        for i in range(3, len(args), 3):
            self._held.discard(args[i])
        return int(result)

    def _reclaim_if_due(self) -> None:
        """Take over entries a dead consumer left pending, at most every claim_idle_s / 4."""
        now = time.monotonic()
        if now - self._last_claim < self.claim_idle_s / 4:
            return
        self._last_claim = now
        idle_ms = int(self.claim_idle_s * 1000)
        start = "0-0"
        for _ in range(1000):  # bounded: each round claims up to 256
            start, claimed, *_ = self.client.xautoclaim(
                self.stream_key, GROUP_NAME, self.consumer, idle_ms, start_id=start, count=256
            )
            for entry_id, fields in claimed:
                entry = text(entry_id)
                # deleted entries come back empty; held ones are in a step or staged already
                if fields and entry not in self._held:
                    self._pool.setdefault(entry, parse_fields(fields))
            if text(start) == "0-0":
                break
        if self.sampling == "replay":
            self._replay_reclaim(
                keys=[self.replay_key, self.replay_pending_key, self.uses_key],
                args=[now_ms(), idle_ms],
            )

    def _refill(
        self, need: int, deadline: float, ack_args: list[Any] | None = None
    ) -> tuple[int, Any]:
        """Read new entries into the pool: what fifo needs, or everything for freshest.
        Blocks (until the deadline, 5 s at most per call) only if the pool cannot cover
        `need`. With `ack_args`, scripts.ACK runs first, in the same round trip. Returns
        (entries read, the ack's result, or None if nothing was sent: the pool covers
        `need`, and the ack waits for the next send)."""
        if self._lost_read:
            self._reread_own()
        want = self.capacity if self.sampling == "freshest" else need - len(self._pool)
        if want <= 0:
            return 0, None
        remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
        block = min(remaining_ms, 5000) if len(self._pool) < need else None
        pipe = self.client.pipeline(transaction=False)
        if ack_args:  # EVAL, not the registered script: a pipeline would check it exists
            pipe.eval(scripts.ACK, len(self._ack_keys), *self._ack_keys, *ack_args)
        pipe.xreadgroup(
            GROUP_NAME, self.consumer, {self.stream_key: ">"}, count=want, block=block or None
        )
        *ack_result, reply = pipe.execute(raise_on_error=False)
        if ack_result and isinstance(ack_result[0], Exception):
            raise ack_result[0]
        return self._pool_read(reply), ack_result[0] if ack_result else None

    def _pool_read(self, reply: Any) -> int:
        """Put the entries of an XREADGROUP reply into the pool; how many there were."""
        if isinstance(reply, redis.ResponseError) and self._regroup(reply):
            return 0
        if isinstance(reply, Exception):
            raise reply
        count = 0
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self._pool[text(entry_id)] = parse_fields(fields)
                count += 1
        return count

    def _send_ahead(self, n: int, ack_args: list[Any] | None) -> InFlight | None:
        """Send the ack still due, and a read of what the next take of `n` will want (fifo
        and replay: `n` more than the pool holds), without waiting for the replies."""
        commands: list[tuple[Any, ...]] = []
        if ack_args:
            commands.append(("EVAL", scripts.ACK, len(self._ack_keys), *self._ack_keys,
                             *ack_args))  # fmt: skip
        want = n - len(self._pool) if self.read_ahead and self.sampling != "freshest" else 0
        if want > 0:
            commands.append(("XREADGROUP", "GROUP", GROUP_NAME, self.consumer, "COUNT", want,
                             "STREAMS", self.stream_key, ">"))  # fmt: skip
        return InFlight.send(self._lane, commands) if commands else None

    def _finish_ahead(self, ahead: InFlight | None, ack_args: list[Any] | None) -> Any:
        """Read what `_send_ahead` sent; returns the ack's result (None if none was sent).
        A lost connection loses nothing: the ack is redone (it is idempotent), and entries
        the read may have delivered are read again from this consumer's pending list by
        the next take (`_reread_own`)."""
        if ahead is None:
            return None
        read_sent = len(ahead.commands) > bool(ack_args)
        try:
            replies = ahead.replies()
        except BaseException:  # unparseable: whatever the read delivered is found again
            self._lost_read = self._lost_read or read_sent
            raise
        if replies is None:
            self._lost_read = self._lost_read or read_sent
            return self._ack(keys=self._ack_keys, args=ack_args) if ack_args else None
        ack_result = replies.pop(0) if ack_args else None
        if replies:
            self._pool_read(replies[0])  # before raising an ack error: nothing read is lost
        if isinstance(ack_result, Exception):
            raise ack_result
        return ack_result

    def _reread_own(self) -> None:
        """Entries delivered to this consumer whose reply never arrived are still pending
        under its name: read them again (XREADGROUP from id 0 reads only its own pending
        list), all but those it handed out and holds."""
        # Held as of before the read: a group acked meanwhile (by another thread) has left
        # `_held` but may be in the reply, and must not be handed out again.
        held = set(self._held)
        start = "0"
        while True:
            try:
                reply: Any = self.client.xreadgroup(
                    GROUP_NAME, self.consumer, {self.stream_key: start}, count=256
                )
            except redis.ResponseError as exc:
                if not self._regroup(exc):
                    raise
                break  # this consumer's pending list went with the group
            entries = reply[0][1] if reply else []
            if not entries:
                break
            for entry_id, fields in entries:
                key = text(entry_id)
                if fields and key not in held:  # deleted entries come back empty
                    self._pool.setdefault(key, parse_fields(fields))
            start = text(entries[-1][0])
        self._lost_read = False

    def _select(self, k: int) -> list[str]:
        if k <= 0 or not self._pool:
            return []
        if self.sampling == "freshest":
            order = sorted(self._pool, key=lambda i: (self._pool[i][0], id_key(i)), reverse=True)
        else:
            order = sorted(self._pool, key=id_key)
        return order[:k]

    def _stale(self, version: int, learner_version: int) -> bool:
        # version -1 marks a malformed entry: leave it to the decoder, which moves it to the
        # invalid stream, rather than miscounting it as stale.
        return version >= 0 and not trainable(version, learner_version, self.max_staleness)

    def _drop_stale_pooled(self, learner_version: int) -> int:
        if self.max_staleness is None:
            return 0
        stale = [i for i, (v, _) in self._pool.items() if self._stale(v, learner_version)]
        for i in stale:
            del self._pool[i]
        return self._drop_entries([(i, False, "") for i in stale], "stale")

    def _take_replays(
        self, k: int, learner_version: int
    ) -> tuple[list[tuple[str, int, dict[bytes, bytes], bool]], int]:
        ids = [
            text(i)
            for i in self._replay_take(
                keys=[self.replay_key, self.replay_pending_key], args=[k, now_ms()]
            )
        ]
        if not ids:
            return [], 0
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(self.stream_key, entry_id, entry_id)
        out, stale = [], []
        for entry_id, rows in zip(ids, pipe.execute(), strict=True):
            if not rows:  # deleted meanwhile; forget it
                self.client.hdel(self.replay_pending_key, entry_id)
                continue
            version, fields = parse_fields(rows[0][1])
            if self._stale(version, learner_version):
                stale.append((entry_id, True, ""))
            else:
                out.append((entry_id, version, fields, True))
        return out, self._drop_entries(stale, "stale")

    def _drop_entries(self, entries: Sequence[tuple[str, bool, str]], reason: str) -> int:
        if not entries:
            return 0
        args: list[Any] = [GROUP_NAME, reason]
        for entry_id, replay, error in entries:
            args += [entry_id, "1" if replay else "0", error]
        return int(self._drop(keys=[*self._entry_keys, self.invalid_key], args=args))
