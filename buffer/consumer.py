"""The learner side of the replay buffer: `take`, `ack`, `hold`, `recover` (design:
docs/architecture.md, "The replay buffer"). Hands every group out exactly once, drops what
the staleness rule forbids (counted), and moves what does not decode to the invalid stream.

Entries come from Redis into a local pool (they stay pending under this consumer's name, so
a crash loses none) and leave it when a take hands them out; handed-out entries are `held`
until acked. Three things fill the pool: a take's read (with read-ahead, the next take's read
goes out while this one decodes, see `InFlight`), reclaiming what a dead consumer left
pending, and re-reading this consumer's own pending list after a read's reply was lost.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import redis

from staleflow.buffer import scripts
from staleflow.buffer.codec import RecordError, decode_fields
from staleflow.buffer.connection import Pinned, translate_errors
from staleflow.buffer.entries import (
    GROUP_NAME,
    Receipt,
    RunKeys,
    Taken,
    Tokens,
    id_key,
    now_ms,
    parse_fields,
    text,
)
from staleflow.buffer.inflight import InFlight, after_lost_reply
from staleflow.buffer.records import Group
from staleflow.buffer.staleness import trainable

__all__ = ["Consumer", "Sampling"]

Sampling = Literal["fifo", "freshest", "replay"]
# A taken entry: (entry id, policy version, its fields, False, or the take token of a replay)
_Entry = tuple[str, int, dict[bytes, bytes], "bool | str"]


class Consumer:
    """One learner process's consumer of a run's stream (ReplayBuffer documents the
    options); see `take`."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        name: str,
        *,
        capacity: int,
        sampling: Sampling,
        max_reuse: int,
        max_staleness: int | None,
        claim_idle_s: float,
        read_ahead: bool,
        url_for_display: str = "?",
    ) -> None:
        self.client, self.keys, self.name = client, keys, name
        self.url_for_display = url_for_display  # errors name the server, password masked
        self.capacity, self.sampling = capacity, sampling
        self.max_reuse, self.max_staleness = max_reuse, max_staleness
        self.claim_idle_s, self.read_ahead = claim_idle_s, read_ahead
        self._lane = Pinned(client)  # the read-ahead's connection (InFlight)
        self._ack_lane = Pinned(client)  # the ack's: the read-ahead's may be in flight
        self._ack_keys = [*keys.entry, keys.trained_by_version]
        self._ack_tokens = Tokens()  # an ack's token names its status key (scripts.ACK)
        self._ack = client.register_script(scripts.ACK)
        self._drop = client.register_script(scripts.DROP)
        self._hold = client.register_script(scripts.HOLD)
        self._replay_take = client.register_script(scripts.REPLAY_TAKE)
        self._replay_reclaim = client.register_script(scripts.REPLAY_RECLAIM)
        # Entries delivered to this consumer but not yet handed out: entry id -> (version,
        # payload). They stay pending in Redis, so they are reclaimed if this process dies.
        self._pool: dict[str, tuple[int, dict[bytes, bytes]]] = {}
        # Entries this consumer handed out and has not acked: still pending under its name in
        # Redis, so XAUTOCLAIM would return them to it; they must not be handed out twice.
        self._held: set[str] = set()
        # replays handed out and not acked yet -> their take's token (only an ack of that
        # take ends it: the id may be acked and taken again meanwhile, by a prefetch)
        self._held_replays: dict[str, str] = {}
        self._last_claim = 0.0
        self._group_ready = False
        # A read (the take's own or a read-ahead) whose reply was lost: its entries are pending
        # under this consumer, in no pool; the next refill reads them again (`_reread_own`).
        self._lost_read = False

    # ------------------------------------------------------------------------- take

    @translate_errors
    def take(
        self, n: int, learner_version: int, timeout_s: float = 0.0, ack: Sequence[Receipt] = ()
    ) -> Taken:
        """See ReplayBuffer.take."""
        if type(n) is not int or n < 1:
            raise ValueError(f"take needs a whole n >= 1, got {n!r}")
        if math.isnan(timeout_s) or timeout_s < 0:  # nan spun forever; inf waits forever
            raise ValueError(f"take needs timeout_s >= 0 (seconds; inf: no limit), got {timeout_s}")
        self._ensure_group()
        deadline = time.monotonic() + timeout_s
        stale = invalid = replays_dropped = 0
        taken: list[_Entry] = []
        ack_args, acked = self._ack_args(ack, held=False), 0
        try:
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
                    self._held.add(entry_id)  # from now: a reclaim while this take waits skips
                if len(taken) < n and self.sampling == "replay":
                    replays, dropped = self._take_replays(n - len(taken), learner_version)
                    taken.extend(replays)
                    for entry_id, _, _, token in replays:  # held from now, as above: the
                        self._held_replays[entry_id] = str(token)  # reclaim skips them
                    stale += dropped
                    replays_dropped += dropped
                # Keep going while short and either time remains or the last read found
                # entries (stale drops can eat a read; the next one may have fresh groups).
                if len(taken) >= n or (read == 0 and time.monotonic() >= deadline):
                    break
        except BaseException:  # Ctrl-C while it waits, a lost connection: offered again
            self._put_back(taken)
            raise
        # The ack not sent yet and the read of the next take's entries go out now; their
        # replies are read after decoding, so the server works while this process decodes.
        ahead = self._send_ahead(n, ack_args)
        try:
            try:
                groups, receipts, bad = self._decode(taken)
            finally:
                late = self._finish(ahead, ack_args)
        except BaseException:  # nothing is handed out: the next take offers these again
            self._put_back(taken)
            raise
        if ack_args:
            acked = self._acked(ack_args, late)
        if bad:  # replays apart, counted exactly (in practice none: each decoded once before)
            invalid = self._drop_entries([b for b in bad if not b[1]], "invalid")
            bad_replays = self._drop_entries([b for b in bad if b[1]], "invalid")  # none: no call
            invalid += bad_replays
            replays_dropped += bad_replays
        return Taken(groups, receipts, stale, invalid, acked, replays_dropped)

    def _put_back(self, taken: list[_Entry]) -> None:
        """Entries a take chose but did not hand out, back in the pool for the next take;
        replays no longer held, so a reclaim makes them replayable again after claim_idle_s
        (held, every reclaim skipped them for the life of the process)."""
        for entry_id, version, fields, replay in taken:
            if replay:
                self._held_replays.pop(entry_id, None)
            else:
                self._held.discard(entry_id)
                self._pool.setdefault(entry_id, (version, fields))

    def _decode(
        self, taken: list[_Entry]
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
                bad.append((entry_id, bool(replay), str(exc)))
                self._held.discard(entry_id)  # dropped, not handed out
                if replay:
                    self._held_replays.pop(entry_id, None)
                continue
            groups.append(group)
            token = replay if isinstance(replay, str) else ""  # (held since it was taken)
            receipts.append(Receipt(entry_id, version, bool(replay), token))
        return groups, receipts, bad

    def _select(self, k: int) -> list[str]:
        if k <= 0 or not self._pool:
            return []
        if self.sampling == "freshest":
            order = sorted(self._pool, key=lambda i: (self._pool[i][0], id_key(i)), reverse=True)
        else:
            order = sorted(self._pool, key=id_key)
        return order[:k]

    # ------------------------------------------------------------------------- ack, hold, recover

    @translate_errors
    def ack(self, receipts: Iterable[Receipt], held: bool = False) -> int:
        """See ReplayBuffer.ack."""
        args = self._ack_args(receipts, held)
        if not args:
            return 0
        return self._acked(args, self._run_ack(args))

    def _run_ack(self, args: list[Any]) -> Any:
        """scripts.ACK by EVALSHA in one write on the ack's pinned connection (InFlight),
        without redis-py's per-call work or a pooled connection: 1.71-1.74x a raw XACK of 8,
        against 1.83-2.04x by the registered script's call (bench/buffer.py's take-then-ack
        split, three runs side by side on the 2-core machine). An ack whose reply is lost with its
        connection is sent again, once the client's retries reach the server, and returns
        what the first one did (its status key); a server that lost its scripts (NOSCRIPT:
        nothing ran) gets the body."""
        keys = self._ack_keys_for(args)
        command: tuple[Any, ...] = ("EVALSHA", self._ack.sha, len(keys), *keys, *args)
        lost = 0
        while True:
            replies = InFlight.send(self._ack_lane, [command]).replies()
            if replies is None:
                lost = after_lost_reply(
                    lost, self.client, f"an ack of {(len(args) - 4) // 3} groups"
                )
                continue
            (reply,) = replies
            if isinstance(reply, redis.exceptions.NoScriptError) and command[0] == "EVALSHA":
                command = ("EVAL", *self._ack_eval(args))
                continue
            if isinstance(reply, Exception):
                raise reply
            return reply

    @translate_errors
    def hold(self, receipts: Sequence[Receipt]) -> None:
        """See ReplayBuffer.hold."""
        if not isinstance(receipts, list | tuple) or not all(
            isinstance(r, Receipt) for r in receipts
        ):
            raise ValueError(
                f"hold(receipts): the receipts of taken groups, got {type(receipts).__name__}"
            )
        if receipts:  # one token per hold: a retry after a lost reply counts nothing twice
            status = self.keys.hold_status(next(self._ack_tokens))
            self._hold(
                keys=[self.keys.stats, status, self.keys.uses],
                args=[scripts.STATUS_TTL_S, self.max_reuse, *(r.entry_id for r in receipts)],
            )

    @translate_errors
    def recover(self) -> int:
        """See ReplayBuffer.recover."""
        self.forget()  # everything pending is claimed below, this consumer's too
        self._ensure_group()
        count = self._claim(idle_ms=0)
        self.client.hset(self.keys.stats, "held", 0)
        self._last_claim = time.monotonic()
        return count

    def forget(self) -> None:
        """Drop the local state (pool, held entries; Redis still has them pending), and check
        the consumer group again at the next take."""
        self._pool.clear()
        self._held.clear()
        self._held_replays.clear()
        self._lost_read = False
        self._group_ready = False

    def _ack_args(self, receipts: Iterable[Receipt], held: bool) -> list[Any] | None:
        """scripts.ACK's ARGV for these receipts (a new token each call), or None if there
        are none."""
        args: list[Any] = [GROUP_NAME, self.max_reuse, "1" if held else "0"]
        args.append(next(self._ack_tokens))
        for r in receipts:
            args += [r.entry_id, r.policy_version, (r.token or "1") if r.replay else "0"]
        return args if len(args) > 4 else None

    def _ack_keys_for(self, args: list[Any]) -> list[str]:
        """scripts.ACK's KEYS for `args` (from `_ack_args`): the status key is the token's."""
        return [*self._ack_keys, self.keys.ack_status(args[3])]

    def _ack_eval(self, args: list[Any]) -> tuple[Any, ...]:
        """EVAL's arguments for scripts.ACK, sent along with a read (by `_refill` or
        `_send_ahead`) or after a NOSCRIPT. EVAL, not EVALSHA: a NOSCRIPT reply to a
        command sent along with a read could not be answered by sending the body first."""
        keys = self._ack_keys_for(args)
        return (scripts.ACK, len(keys), *keys, *args)

    def _acked(self, args: list[Any], result: Any) -> int:
        """After scripts.ACK ran: its receipts are no longer held here; how many it acked."""
        for i in range(4, len(args), 3):
            self._held.discard(args[i])
            flag = args[i + 2]  # "0", "1" (a replay, any take) or a replay's take token
            if flag == "1" or (flag != "0" and self._held_replays.get(args[i]) == flag):
                self._held_replays.pop(args[i], None)
        return int(result)

    # ------------------------------------------------------------------------- the pool

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self.client.xgroup_create(self.keys.stream, GROUP_NAME, id="0", mkstream=True)
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

    def _claim(self, idle_ms: int) -> int:
        """Take over every entry pending (to any consumer, this one included) for at least
        `idle_ms` into the pool, except those this consumer holds, and make replays out that
        long replayable again; how many entries came."""
        start, count = "0-0", 0
        # Held as the claim is sent: an entry acked (another thread: the learner's commit)
        # after XAUTOCLAIM returned it has left `_held` but is in the reply with its payload,
        # and must not be handed out again (as in `_reread_own`).
        held = set(self._held)
        while True:  # XAUTOCLAIM's cursor only moves forward through the pending list
            start, claimed, *_ = self.client.xautoclaim(
                self.keys.stream, GROUP_NAME, self.name, idle_ms, start_id=start, count=256
            )
            for entry_id, fields in claimed:
                entry = text(entry_id)
                # deleted entries come back empty; held ones are in a step or staged already
                if fields and entry not in held and entry not in self._pool:
                    self._pool[entry] = parse_fields(fields)
                    count += 1
            if text(start) == "0-0":
                break
        if self.sampling == "replay":
            self._replay_reclaim(  # not the replays this consumer holds for its checkpoint
                keys=[self.keys.replay, self.keys.replay_pending, self.keys.uses],
                args=[now_ms(), idle_ms, *self._held_replays],
            )
        return count

    def _reclaim_if_due(self) -> None:
        """Take over entries a dead consumer left pending, at most every claim_idle_s / 4."""
        now = time.monotonic()
        if now - self._last_claim < self.claim_idle_s / 4:
            return
        self._last_claim = now
        self._claim(int(self.claim_idle_s * 1000))

    def _refill(
        self, need: int, deadline: float, ack_args: list[Any] | None = None
    ) -> tuple[int, Any]:
        """Read new entries into the pool: what fifo needs, or everything for freshest.
        Blocks (until the deadline, 5 s at most per call) only if the pool cannot cover
        `need`. With `ack_args`, scripts.ACK runs first, in the same round trip (see
        `_finish`). Returns (entries read, the ack's result, or None if nothing was sent:
        the pool covers `need`, and the ack waits for the next send)."""
        if self._lost_read:
            self._reread_own()
        want = self.capacity if self.sampling == "freshest" else need - len(self._pool)
        if want <= 0:
            return 0, None
        remaining_ms = int(min(max(0.0, deadline - time.monotonic()), 3600.0) * 1000)  # (inf)
        block = min(remaining_ms, 5000) if len(self._pool) < need else 0
        before = len(self._pool)
        commands = [*self._ack_command(ack_args), self._read_command(want, block)]
        ack_result = self._finish(InFlight.send(self._lane, commands), ack_args)
        if self._lost_read:  # its reply was lost: read what it delivered now, not after
            self._reread_own()  # claim_idle_s
        return len(self._pool) - before, ack_result

    def _pool_read(self, reply: Any) -> None:
        """Put the entries of an XREADGROUP reply into the pool."""
        if isinstance(reply, redis.ResponseError) and self._regroup(reply):
            return
        if isinstance(reply, Exception):
            raise reply
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self._pool[text(entry_id)] = parse_fields(fields)

    def _send_ahead(self, n: int, ack_args: list[Any] | None) -> InFlight | None:
        """Send the ack still due, and a read of what the next take of `n` will want (fifo
        and replay: `n` more than the pool holds), without waiting for the replies."""
        commands = self._ack_command(ack_args)
        want = n - len(self._pool) if self.read_ahead and self.sampling != "freshest" else 0
        if want > 0:
            commands.append(self._read_command(want))
        return InFlight.send(self._lane, commands) if commands else None

    def _ack_command(self, ack_args: list[Any] | None) -> list[tuple[Any, ...]]:
        """scripts.ACK as a command sent along with a read, if there is an ack to send."""
        return [("EVAL", *self._ack_eval(ack_args))] if ack_args else []

    def _read_command(self, want: int, block_ms: int = 0) -> tuple[Any, ...]:
        """XREADGROUP of up to `want` new entries (waiting up to `block_ms` if none)."""
        block = ("BLOCK", block_ms) if block_ms else ()
        return ("XREADGROUP", "GROUP", GROUP_NAME, self.name, "COUNT", want, *block,
                "STREAMS", self.keys.stream, ">")  # fmt: skip

    def _finish(self, call: InFlight | None, ack_args: list[Any] | None) -> Any:
        """Read the replies of a call sent on the read-ahead's connection (the take's read, or
        `_send_ahead`'s): InFlight, without redis-py's retries, which would send it again
        blind. Returns the ack's result (None if none was sent). A lost connection loses
        nothing: the ack is redone (it is idempotent), and entries the read may have delivered are
        read again from this consumer's pending list (`_reread_own`: by `_refill` at once,
        or by the next take)."""
        if call is None:
            return None
        read_sent = len(call.commands) > bool(ack_args)
        try:
            replies = call.replies()
        except BaseException:  # unparseable: whatever the read delivered is found again
            self._lost_read = self._lost_read or read_sent
            raise
        if replies is None:
            self._lost_read = self._lost_read or read_sent
            return self._run_ack(ack_args) if ack_args else None
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
                    GROUP_NAME, self.name, {self.keys.stream: start}, count=256
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

    # ------------------------------------------------------------------------- drops

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

    def _take_replays(self, k: int, learner_version: int) -> tuple[list[_Entry], int]:
        # what REPLAY_TAKE records for each (their receipts carry it): the time, which
        # REPLAY_RECLAIM reads as a number, and a random part that tells two takes apart
        token = f"{now_ms()}.{secrets.randbelow(10**6):06d}"
        ids = [
            text(i)
            for i in self._replay_take(
                keys=[self.keys.replay, self.keys.replay_pending], args=[k, token]
            )
        ]
        if not ids:
            return [], 0
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(self.keys.stream, entry_id, entry_id)
        out: list[_Entry] = []
        stale: list[tuple[str, bool, str]] = []
        for entry_id, rows in zip(ids, pipe.execute(), strict=True):
            if not rows:  # deleted meanwhile; forget it
                self.client.hdel(self.keys.replay_pending, entry_id)
                continue
            version, fields = parse_fields(rows[0][1])
            if self._stale(version, learner_version):
                stale.append((entry_id, True, ""))
            else:
                out.append((entry_id, version, fields, token))
        return out, self._drop_entries(stale, "stale")

    def _drop_entries(self, entries: Sequence[tuple[str, bool, str]], reason: str) -> int:
        if not entries:
            return 0
        args: list[Any] = [GROUP_NAME, reason]
        for entry_id, replay, error in entries:
            args += [entry_id, "1" if replay else "0", error]
        status = self.keys.drop_status(next(self._ack_tokens))  # a resend counts once
        return int(self._drop(keys=[*self.keys.entry, self.keys.invalid, status], args=args))
