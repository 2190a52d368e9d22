"""Replay-buffer throughput: staleflow vs raw redis-py on the same server and the same bytes.

    python bench/buffer.py [--redis-url URL] [--groups 300] [--rounds 15] [--batch 8]

Realistic groups: K = 8 responses x 1024 tokens (int32 ids + float32 log-probs, ~66 KB). Each
round measures, on one Redis server:
  push:     ReplayBuffer.push(group) (encode, then one MULTI/EXEC: XADD + the admit script's
            dedup, capacity and counters) vs raw XADD of the already-encoded bytes, and,
            for context, vs raw XADD of each group encoded as it comes by the same codec
            (what a push costs beyond encoding: dedup, exact capacity, counters);
  take+ack: ReplayBuffer.take(batch) + ack (reclaim, XREADGROUP, decode, Lua ack + XDEL),
            and take(batch, ack=previous receipts) (the ack rides on the next read), both
            with read-ahead (the next batch is read while this one decodes), and the latter
            without it (read_ahead=False), vs raw XREADGROUP + XACK of the same entries
            (take+ack), and vs raw redis-py piggybacking too, the previous XACK pipelined
            with the next XREADGROUP in one round trip (the two take(ack=previous) rows);
            and, for context, raw XREADGROUP + XACK + XDEL: the buffer deletes what it
            trained on, raw XACK alone leaves it in memory.
Both sides are connected (and their consumer groups made) before anything is timed: a long
run's steady state is compared, not connection setup. Rounds alternate which side goes
first; medians over rounds are reported, ratios last
(targets: >= 0.8x raw throughput, encode+decode of one group < 1 ms). Also side by side:
push on its pinned connection vs through the pool (the pinned one held, as by another
thread). Then where a push's time goes, per call, side by side: raw XADD; the same XADD in
a MULTI/EXEC with an empty EVAL; with the admit script instead (the push's transaction on
encoded groups, Producer._add); encoding alone; encoding, then that transaction; the whole
push; and the transaction alone against raw XADD, the bound on the push's ratio before any
encoding. Also the take-then-ack loops' time per batch, split into the take (or XREADGROUP)
and the ack (or XACK). Last, the server's own time per call (INFO commandstats): the admit
script per push, the ack script per ack of `batch`, an empty EVAL, and XREADGROUP of `batch`
(both sides; raw's XACK too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import redis

from staleflow.buffer.codec import decode_fields, encode_fields
from staleflow.buffer.connection import Pinned, connect
from staleflow.buffer.inflight import InFlight
from staleflow.buffer.producer import Producer
from staleflow.buffer.records import Group, synthetic_groups
from staleflow.buffer.replay import ReplayBuffer
from staleflow.buffer.server import RedisServer


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    count = fn()
    return time.perf_counter() - start, count


def raw_entries(groups: list[Group]) -> list[dict]:
    """Exactly the fields staleflow writes, as plain bytes, for the raw side."""
    return [
        {**{k: bytes(v) for k, v in encode_fields(g).items()}, "v": g.policy_version,
         "gid": g.group_id}
        for g in groups
    ]  # fmt: skip


def raw_push(client: redis.Redis, key: str, entries: list[dict], batch: int) -> int:
    for i in range(0, len(entries), batch):
        if batch == 1:
            client.xadd(key, entries[i])
            continue
        pipe = client.pipeline(transaction=False)
        for entry in entries[i : i + batch]:
            pipe.xadd(key, entry)
        pipe.execute()
    return len(entries)


def raw_push_encoding(client: redis.Redis, key: str, groups: list[Group]) -> int:
    """Raw XADD of each group as it comes, encoded by staleflow's codec first (its header and
    array views, as `push` sends them): what a push costs on top of encoding the group."""
    for g in groups:
        client.xadd(key, {**encode_fields(g), "v": g.policy_version, "gid": g.group_id})
    return len(groups)


def raw_take_ack(
    client: redis.Redis, key: str, batch: int, delete: bool = False, split: dict | None = None
) -> int:
    """XREADGROUP + XACK; with `delete`, XACK + XDEL pipelined (one round trip), as a
    bounded buffer must free what it trained on. With `split`, the seconds spent reading
    and acking are added to its "take" and "ack"."""
    done, split = 0, split if split is not None else {}
    while True:
        start = time.perf_counter()
        reply = client.xreadgroup("learner", "raw", {key: ">"}, count=batch)
        read = time.perf_counter()
        split["take"] = split.get("take", 0.0) + read - start
        if not reply:
            return done
        ids = [entry_id for entry_id, _ in reply[0][1]]
        if delete:
            pipe = client.pipeline(transaction=False)
            pipe.xack(key, "learner", *ids)
            pipe.xdel(key, *ids)
            pipe.execute()
        else:
            client.xack(key, "learner", *ids)
        split["ack"] = split.get("ack", 0.0) + time.perf_counter() - read
        done += len(ids)


def raw_take_ack_piggyback(client: redis.Redis, key: str, batch: int) -> int:
    """XACK of the previous batch pipelined with the next XREADGROUP: one round trip per
    batch, as staleflow's take(ack=previous) makes (the last batch's XACK on its own)."""
    done, previous = 0, []
    while True:
        pipe = client.pipeline(transaction=False)
        if previous:
            pipe.xack(key, "learner", *previous)
        pipe.xreadgroup("learner", "raw", {key: ">"}, count=batch)
        reply = pipe.execute()[-1]
        if not reply:
            return done
        previous = [entry_id for entry_id, _ in reply[0][1]]
        done += len(previous)


def warmed(buffer: ReplayBuffer) -> ReplayBuffer:
    """Connect `buffer` and create its consumer group before anything is timed, as the raw
    side's client is connected and its group made: what is compared is the steady state of
    a long run, not connection setup (a new connection with a password costs a few round
    trips)."""
    buffer.take(1, learner_version=0)  # empty: makes the group, connects the consumer
    # Each pinned lane keeps a connection of its own (the push's, the read-ahead's, the
    # ack's), taken from the pool at first use: connect them all, then the pool's connection
    # for the other calls. Without this, the first take and the first ack of a round each made
    # a new connection inside the timed loop (1.5-2 ms each with a password, timed once in a
    # throwaway script: 0.03-0.05 ms per batch of a 300-group round).
    for lane in (buffer._producer._lane, buffer._consumer._lane, buffer._consumer._ack_lane):
        lane.release(lane.acquire())
    buffer.client.ping()
    return buffer


def buffer_push(buffer: ReplayBuffer, groups: list[Group], batch: int) -> int:
    for i in range(0, len(groups), batch):
        if batch == 1:
            buffer.push(groups[i])
        else:
            buffer.push_many(groups[i : i + batch])
    return len(groups)


def buffer_take_ack(buffer: ReplayBuffer, batch: int, split: dict | None = None) -> int:
    """take + ack; with `split`, as raw_take_ack."""
    done, split = 0, split if split is not None else {}
    while True:
        start = time.perf_counter()
        taken = buffer.take(batch, learner_version=10)
        took = time.perf_counter()
        split["take"] = split.get("take", 0.0) + took - start
        if not taken.groups:
            return done
        buffer.ack(taken.receipts)
        split["ack"] = split.get("ack", 0.0) + time.perf_counter() - took
        done += len(taken.groups)


def buffer_take_ack_pipelined(buffer: ReplayBuffer, batch: int) -> int:
    """The learner's loop with the ack riding on the next take (one round trip each)."""
    done, receipts = 0, []
    while True:
        taken = buffer.take(batch, learner_version=10, ack=receipts)
        receipts = taken.receipts
        if not taken.groups:
            return done
        done += len(taken.groups)


def run(url: str, n_groups: int, rounds: int, batch: int) -> None:
    groups = synthetic_groups(n_groups)
    entries = raw_entries(groups)
    mb_per_group = sum(len(v) for e in entries for v in e.values() if isinstance(v, bytes)) / 1e6
    mb_per_group /= n_groups
    print(
        f"{n_groups} groups of 8 x 1024 tokens ({mb_per_group * 1e3:.1f} KB each), "
        f"{rounds} rounds, batches of {batch}"
    )

    codec = []
    for g in groups[:100]:
        start = time.perf_counter()
        decode_fields({k.encode(): bytes(v) for k, v in encode_fields(g).items()})
        codec.append(time.perf_counter() - start)
    codec_ms = statistics.median(codec) * 1e3
    # Decoding alone, the take's share of the client's work, in a tight loop: the per-call
    # line above is too coarse (timer granularity, cold caches) to show a few microseconds.
    as_read = [{k.encode(): bytes(v) for k, v in encode_fields(g).items()} for g in groups[:100]]
    decode_runs = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(20):
            for fields in as_read:
                decode_fields(fields)
        decode_runs.append((time.perf_counter() - start) / (20 * len(as_read)))
    decode_us = statistics.median(decode_runs) * 1e6

    client = connect(url)
    rates: dict[str, list[float]] = {}

    per_batch: dict[str, list[float]] = {}  # the take-then-ack loops' parts, us per batch

    def measure(name: str, fn: Callable[[], int]) -> None:
        seconds, count = timed(fn)
        assert count == n_groups, f"{name}: {count} of {n_groups}"
        rates.setdefault(name, []).append(count / seconds)

    def measure_split(name: str, fn: Callable[[dict], int]) -> None:
        split: dict[str, float] = {}
        measure(name, lambda: fn(split))
        for part, seconds in split.items():
            per_batch.setdefault(f"{name} {part}", []).append(seconds / n_groups * batch * 1e6)

    def raw_side(r: int) -> None:
        measure("raw_push_1", lambda: raw_push(client, f"raw1:{r}", entries, 1))
        measure("raw_push_enc", lambda: raw_push_encoding(client, f"rawe:{r}", groups))
        measure("raw_push_b", lambda: raw_push(client, f"rawb:{r}", entries, batch))
        client.xgroup_create(f"rawb:{r}", "learner", id="0")
        measure_split(
            "raw_take", lambda split: raw_take_ack(client, f"rawb:{r}", batch, split=split)
        )
        raw_push(client, f"rawd:{r}", entries, batch)
        client.xgroup_create(f"rawd:{r}", "learner", id="0")
        measure("raw_take_del", lambda: raw_take_ack(client, f"rawd:{r}", batch, delete=True))
        raw_push(client, f"rawp:{r}", entries, batch)
        client.xgroup_create(f"rawp:{r}", "learner", id="0")
        measure("raw_take_piped", lambda: raw_take_ack_piggyback(client, f"rawp:{r}", batch))

    def staleflow_side(r: int) -> None:
        with (
            ReplayBuffer(url, f"one-{r}", capacity=n_groups + 1) as one,
            ReplayBuffer(url, f"many-{r}", capacity=n_groups + 1) as many,
            ReplayBuffer(url, f"piped-{r}", capacity=n_groups + 1) as piped,
            ReplayBuffer(url, f"serial-{r}", capacity=n_groups + 1, read_ahead=False) as serial,
            ReplayBuffer(url, f"pooled-{r}", capacity=n_groups + 1) as pooled,
        ):
            for b in (one, many, piped, serial, pooled):
                warmed(b)
            measure("sf_push_1", lambda: buffer_push(one, groups, 1))
            lane = pooled._producer._lane  # held here, so each push takes a pooled connection
            pinned = lane.acquire()
            lane.release(lane.acquire())  # that pooled one, connected before timing
            measure("sf_push_pooled", lambda: buffer_push(pooled, groups, 1))
            lane.release(pinned)
            measure("sf_push_b", lambda: buffer_push(many, groups, batch))
            measure_split("sf_take", lambda split: buffer_take_ack(many, batch, split))
            buffer_push(piped, groups, batch)
            measure("sf_take_piped", lambda: buffer_take_ack_pipelined(piped, batch))
            buffer_push(serial, groups, batch)
            measure("sf_take_serial", lambda: buffer_take_ack_pipelined(serial, batch))

    for r in range(rounds):  # alternate which side runs first
        client.flushall()
        first, second = (raw_side, staleflow_side) if r % 2 == 0 else (staleflow_side, raw_side)
        first(r)
        second(r)
    client.flushall()
    server = server_costs(url, client, groups, batch)

    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{'':34}{'groups/s':>10}{'MB/s':>10}")
    for label, key in [
        ("raw XADD, one per call", "raw_push_1"),
        ("  the same, encoding included", "raw_push_enc"),
        ("staleflow push, one per call", "sf_push_1"),
        (f"raw XADD, pipelined by {batch}", "raw_push_b"),
        (f"staleflow push_many({batch})", "sf_push_b"),
        (f"raw XREADGROUP+XACK by {batch}", "raw_take"),
        ("  the same, XDEL pipelined", "raw_take_del"),
        ("  XACK pipelined with the next read", "raw_take_piped"),
        (f"staleflow take({batch})+ack", "sf_take"),
        (f"staleflow take({batch}, ack=previous)", "sf_take_piped"),
        ("  the same without read-ahead", "sf_take_serial"),
    ]:
        print(f"{label:34}{med[key]:10.0f}{med[key] * mb_per_group:10.1f}")
    print(f"encode+decode one group: {codec_ms:.3f} ms (median of 100; target < 1 ms)")
    print(f"decode one group as read from Redis: {decode_us:.1f} us (median of 7 loops)")
    for label, ours, raw in [
        ("push, one per call ", "sf_push_1", "raw_push_1"),
        (f"push, batches of {batch}", "sf_push_b", "raw_push_b"),
        ("take+ack          ", "sf_take", "raw_take"),
        # against raw redis-py doing the same: the previous XACK pipelined with the read
        ("take, ack piggyback", "sf_take_piped", "raw_take_piped"),
        ("  no read-ahead    ", "sf_take_serial", "raw_take_piped"),
    ]:
        print(f"ratio {label} staleflow/raw: {med[ours] / med[raw]:.2f}x (target >= 0.8x)")
    print(f"  (context: push vs raw XADD that also encodes each group, same codec: "
          f"{med['sf_push_1'] / med['raw_push_enc']:.2f}x: what the guarantees cost)")  # fmt: skip
    print(f"  (context: take+ack vs raw that also deletes what it acked, XDEL pipelined: "
          f"{med['sf_take'] / med['raw_take_del']:.2f}x)")  # fmt: skip
    b = {k: statistics.median(v) for k, v in per_batch.items()}
    print(f"take-then-ack loop, us per batch of {batch}: staleflow take {b['sf_take take']:.0f}, "
          f"ack {b['sf_take ack']:.0f}; raw XREADGROUP {b['raw_take take']:.0f}, "
          f"XACK {b['raw_take ack']:.0f}")  # fmt: skip
    print(f"push on its pinned connection / through the pool: "
          f"{med['sf_push_1'] / med['sf_push_pooled']:.2f}x")  # fmt: skip
    push_breakdown(url, client, groups, rounds)
    print(
        "server time per call (us): admit script {admit:.1f} per push, ack script {ack:.1f} "
        "per {batch} acked, an empty EVAL {empty:.1f}; XREADGROUP of {batch} {read:.1f} "
        "(raw: {raw_read:.1f}, and XACK of {batch} {raw_ack:.1f})".format(batch=batch, **server)
    )


def push_breakdown(url: str, client: redis.Redis, groups: list[Group], rounds: int) -> None:
    """Microseconds per call of a push's parts, each step adding one thing, rounds
    alternating the order; prints the medians over rounds."""
    entries = [encode_fields(g) for g in groups]
    raw = raw_entries(groups)
    lane = Pinned(client)
    per_call: dict[str, list[float]] = {}

    def in_tx(stream: str) -> int:
        for g, fields in zip(groups, entries, strict=True):
            flat = [x for kv in fields.items() for x in kv]
            commands = [("MULTI",), ("XADD", stream, "*", *flat, "v", g.policy_version,
                        "gid", g.group_id), ("EVAL", "return {0}", 0), ("EXEC",)]  # fmt: skip
            InFlight.send(lane, commands).replies()
        return len(groups)

    def transactions(producer: Producer, r: int, encode: bool = False) -> int:
        for g, fields in zip(groups, entries, strict=True):
            if encode:
                fields = encode_fields(g)
            producer._add([g], [fields], [producer.keys.dedup(g.group_id)], f"t:{r}:{g.group_id}")
        return len(groups)

    for r in range(rounds):
        client.flushall()
        with (
            ReplayBuffer(url, f"add-{r}", capacity=len(groups) + 1) as adder,
            ReplayBuffer(url, f"push-{r}", capacity=len(groups) + 1) as pusher,
            ReplayBuffer(url, f"encode-{r}", capacity=len(groups) + 1) as encoder,
        ):
            for buffer in (adder, pusher, encoder):
                warmed(buffer)
            steps: list[tuple[str, Callable[[], int]]] = [
                ("raw XADD", lambda: raw_push(client, "raw", raw, 1)),
                ("+ MULTI/EXEC, empty EVAL", lambda: in_tx("tx")),
                (
                    "admit script instead (Producer._add)",
                    lambda a=adder, r=r: transactions(a._producer, r),
                ),
                ("encode_fields alone", lambda: len([encode_fields(g) for g in groups])),
                (
                    "encode_fields, then Producer._add",
                    lambda a=encoder, r=r: transactions(a._producer, r, encode=True),
                ),
                ("ReplayBuffer.push", lambda b=pusher: buffer_push(b, groups, 1)),
            ]
            for name, fn in steps if r % 2 == 0 else steps[::-1]:
                seconds, _ = timed(fn)
                per_call.setdefault(name, []).append(seconds / len(groups) * 1e6)
    print("where a push's time goes, us per call (medians over rounds):")
    med = {name: statistics.median(values) for name, values in per_call.items()}
    for name, value in med.items():
        print(f"  {name:32}{value:8.1f}")
    print(  # what the guarantees cost before any encoding: the bound on a push's ratio
        f"the push's transaction alone, on groups encoded beforehand / raw XADD: "
        f"{med['raw XADD'] / med['admit script instead (Producer._add)']:.2f}x"
    )


def server_costs(url: str, client: redis.Redis, groups: list[Group], batch: int) -> dict:
    """Microseconds the server spends per call (INFO commandstats): the admit script (push
    uses EVAL), the ack script (ack uses EVALSHA) and `return 1` by EVAL."""
    with ReplayBuffer(url, "server-warm-up", capacity=batch, read_ahead=False) as b:
        buffer_push(b, groups[:batch], 1)  # the ack script is loaded: no NOSCRIPT below
        buffer_take_ack(b, batch)
    client.config_resetstat()
    with ReplayBuffer(url, "server-costs", capacity=len(groups) + 1, read_ahead=False) as b:
        buffer_push(b, groups, 1)
        buffer_take_ack(b, batch)
    stats = client.info("commandstats")
    admit = stats["cmdstat_eval"]["usec_per_call"]
    ack = stats["cmdstat_evalsha"]["usec_per_call"]
    read = stats["cmdstat_xreadgroup"]["usec_per_call"]
    raw_push(client, "server-costs-raw", raw_entries(groups), batch)
    client.xgroup_create("server-costs-raw", "learner", id="0")
    client.config_resetstat()
    raw_take_ack(client, "server-costs-raw", batch)
    stats = client.info("commandstats")
    raw_read = stats["cmdstat_xreadgroup"]["usec_per_call"]
    raw_ack = stats["cmdstat_xack"]["usec_per_call"]
    client.config_resetstat()
    for _ in range(len(groups)):
        client.eval("return 1", 0)
    empty = client.info("commandstats")["cmdstat_eval"]["usec_per_call"]
    client.flushall()
    return {"admit": admit, "ack": ack, "empty": empty, "read": read, "raw_read": raw_read,
            "raw_ack": raw_ack}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", help="benchmark against this server (default: embedded)")
    parser.add_argument("--groups", type=int, default=300, help="groups per round")
    parser.add_argument("--rounds", type=int, default=15, help="rounds (medians are reported)")
    parser.add_argument("--batch", type=int, default=8, help="groups per take")
    args = parser.parse_args()
    for flag in ("groups", "rounds", "batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.redis_url:  # it empties the server (FLUSHALL) every round: only an empty one
        keys = redis.Redis.from_url(args.redis_url).dbsize()
        if keys:
            parser.error(
                f"the server at --redis-url holds {keys} keys in its database, and the benchmark "
                "empties the whole server every round: give an empty server, or no --redis-url "
                "(an embedded one)"
            )
        run(args.redis_url, args.groups, args.rounds, args.batch)
        return 0
    with tempfile.TemporaryDirectory() as tmp, RedisServer(tmp) as server:
        run(server.url, args.groups, args.rounds, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
