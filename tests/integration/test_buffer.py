"""The replay buffer against a real redis-server: delivery, crashes, staleness, reuse."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
import redis

from staleflow.buffer.connection import BufferConnectionError
from staleflow.buffer.consumer import Consumer
from staleflow.buffer.inflight import InFlight
from staleflow.buffer.records import Group, Response
from staleflow.buffer.replay import BufferFullError, ReplayBuffer
from staleflow.cluster.ledger import Counts, reconcile
from staleflow.cluster.schedule import Flow

pytestmark = pytest.mark.integration


def group(version: int = 0, prompt: str = "p", k: int = 2, worker: str = "w") -> Group:
    return Group.new(
        run_id="run",
        prompt_id=prompt,
        task="arithmetic",
        prompt_token_ids=[1, 2, 3],
        responses=[Response([4, 5], [-0.1, -0.2], float(i)) for i in range(k)],
        policy_version=version,
        worker_id=worker,
    )


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """Every back-off a test's calls slept, in seconds: redis-py's retries and the buffer's own
    waits (both still sleep). Whether an error was retried is read here, not off a clock.
    Only the test's own thread is recorded: another thread's sleep (a sampling plugin's,
    a proxy's) is not a retry of the test's calls."""
    import redis.retry

    slept: list[float] = []
    real = time.sleep
    test_thread = threading.current_thread()

    def sleep(seconds: float) -> None:
        if threading.current_thread() is test_thread:
            slept.append(seconds)
        real(seconds)

    monkeypatch.setattr(redis.retry, "sleep", sleep)
    monkeypatch.setattr(time, "sleep", sleep)
    return slept


def take_all(buffer: ReplayBuffer, n: int, version: int = 0, timeout_s: float = 0.0):
    taken = buffer.take(n, version, timeout_s=timeout_s)
    return taken, [g.prompt_id for g in taken.groups]


# ----------------------------------------------------------------------------- delivery


def _produce(url: str, worker: int, count: int) -> None:
    buffer = ReplayBuffer(url, "run")
    for i in range(count):
        g = group(prompt=f"{worker}-{i}", worker=str(worker))
        buffer.push(g)
        if i % 5 == 0:
            buffer.push(g)  # a retried push must not duplicate


def test_many_producer_processes_one_consumer_exactly_once(redis_url):
    producers, per = 4, 50
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_produce, args=(redis_url, w, per)) for w in range(producers)]
    for p in procs:
        p.start()
    consumer = ReplayBuffer(redis_url, "run")
    seen: Counter[str] = Counter()
    deadline = time.monotonic() + 120
    while sum(seen.values()) < producers * per and time.monotonic() < deadline:
        taken = consumer.take(16, learner_version=0, timeout_s=1.0)
        seen.update(g.prompt_id for g in taken.groups)
        assert consumer.ack(taken.receipts) == len(taken.receipts)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert seen == Counter({f"{w}-{i}": 1 for w in range(producers) for i in range(per)})
    assert consumer.take(16, 0).groups == []  # nothing left, nothing re-delivered
    stats = consumer.stats()
    assert (stats.pushed, stats.duplicates, stats.acked) == (200, 40, 200)
    assert (stats.length, stats.pending, stats.undelivered) == (0, 0, 0)


@pytest.mark.parametrize("read_ahead", [True, False])
def test_fifo_order_and_receipts(redis_url, read_ahead):
    buffer = ReplayBuffer(redis_url, "run", read_ahead=read_ahead)
    for i in range(5):
        buffer.push(group(prompt=str(i)))
    taken, ids = take_all(buffer, 3)
    assert ids == ["0", "1", "2"]
    assert [r.policy_version for r in taken.receipts] == [0, 0, 0]
    # read-ahead: the other 2 were delivered to this consumer while it decoded the first 3
    assert (buffer.stats().pending, buffer.stats().undelivered) == (
        (5, 0) if read_ahead else (3, 2)
    )
    assert buffer.ack(taken.receipts) == 3
    assert buffer.ack(taken.receipts) == 0  # acking twice changes nothing
    assert take_all(buffer, 3)[1] == ["3", "4"]
    assert buffer.stats().acked == 3


def test_freshest_first(redis_url):
    buffer = ReplayBuffer(redis_url, "run", sampling="freshest")
    for v in [3, 1, 4, 1, 5, 9, 2, 6]:
        buffer.push(group(version=v, prompt=f"v{v}"))
    assert take_all(buffer, 3, version=9)[1] == ["v9", "v6", "v5"]
    assert take_all(buffer, 2, version=9)[1] == ["v4", "v3"]


@pytest.mark.timeout(60)  # the first take returns when the group comes, not at its 300 s
def test_take_waits_for_groups_up_to_the_timeout(redis_url):
    buffer = ReplayBuffer(redis_url, "run")
    pusher = threading.Timer(0.3, lambda: ReplayBuffer(redis_url, "run").push(group()))
    pusher.start()
    taken, _ = take_all(buffer, 1, timeout_s=300)
    pusher.join()
    assert len(taken.groups) == 1
    start = time.monotonic()
    assert take_all(buffer, 1, timeout_s=0.5)[0].groups == []
    assert time.monotonic() - start >= 0.45


def test_runs_sharing_a_server_are_isolated(redis_url):
    a, b = ReplayBuffer(redis_url, "run-a"), ReplayBuffer(redis_url, "run-b")
    a.push(group(prompt="a"))
    b.push(group(prompt="b"))
    assert take_all(a, 5)[1] == ["a"]
    assert take_all(b, 5)[1] == ["b"]
    keys = redis.Redis.from_url(redis_url).keys("*")
    assert all(k.startswith((b"staleflow:run-a:", b"staleflow:run-b:")) for k in keys)


# ----------------------------------------------------------------------------- crashes

_CONSUMER = """
import sys
from staleflow.buffer.replay import ReplayBuffer
buffer = ReplayBuffer(sys.argv[1], "run", consumer="doomed")
taken = buffer.take(3, 0)
print(",".join(g.prompt_id for g in taken.groups), flush=True)
sys.stdin.read()  # 'training' until killed; never acks
"""


def test_consumer_killed_before_ack_is_redelivered_once(redis_url):
    producer = ReplayBuffer(redis_url, "run")
    for i in range(5):
        producer.push(group(prompt=str(i)))
    doomed = subprocess.Popen(
        [sys.executable, "-c", _CONSUMER, redis_url],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert doomed.stdout.readline().strip() == "0,1,2"
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()

    survivor = ReplayBuffer(redis_url, "run", claim_idle_s=0.2)
    time.sleep(0.3)
    taken, ids = take_all(survivor, 10)
    assert sorted(ids) == ["0", "1", "2", "3", "4"]  # the dead consumer's three come back
    survivor.ack(taken.receipts)
    time.sleep(0.3)
    assert take_all(survivor, 10)[1] == []  # and nothing is delivered again after the ack
    assert survivor.stats().acked == 5


def test_a_hold_sent_again_after_a_lost_reply_counts_once(redis_url, monkeypatch):
    # Held groups leave the capacity until their ack. A hold counted twice (redis-py resends
    # a command whose reply was lost) would let producers overfill the buffer for good.
    buffer = ReplayBuffer(redis_url, "run", capacity=4, push_timeout_s=0.2)
    buffer.push_many([group(prompt=str(i)) for i in range(4)])
    taken = buffer.take(2, 0)
    real = buffer.client.execute_command

    def sent_twice(*args, **kwargs):  # the server ran it, the reply was lost, it was resent
        real(*args, **kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(buffer.client, "execute_command", sent_twice)
    buffer.hold(taken.receipts)
    monkeypatch.undo()
    assert buffer.stats().held == 2
    for bad in (2, "ab", [1], None):  # (a count, as hold once took, is refused)
        with pytest.raises(ValueError, match=r"hold\(receipts\): the receipts of taken groups"):
            buffer.hold(bad)
    assert buffer.stats().held == 2
    buffer.push_many([group(prompt="a"), group(prompt="b")])  # 6 stored - 2 held = 4: full
    with pytest.raises(BufferFullError):
        buffer.push(group(prompt="c"))
    buffer.ack(taken.receipts, held=True)
    assert buffer.stats().held == 0


def test_groups_a_consumer_holds_are_never_handed_to_it_again(redis_url):
    # The learner holds groups past claim_idle_s (staged for a batch that is not complete,
    # prefetched during a step). Its own reclaim must not hand them out a second time.
    buffer = ReplayBuffer(redis_url, "run", claim_idle_s=0.2)
    buffer.push(group(prompt="p0"))
    first, ids = take_all(buffer, 2)  # short: p0 is held, the batch waits for more
    assert ids == ["p0"]
    time.sleep(0.4)  # p0 is now idle longer than claim_idle_s
    buffer.push(group(prompt="p1"))
    second, ids = take_all(buffer, 2)
    assert ids == ["p1"]  # not p0 again
    assert buffer.ack(first.receipts + second.receipts) == 2
    _after, ids = take_all(buffer, 1)
    assert ids == []
    assert buffer.stats().acked == 2


def test_a_take_waiting_for_more_never_hands_out_what_it_has_taken_twice(redis_url):
    # A take that waits for its groups (the learner's prefetch waits up to a step) had moved
    # p0 out of the pool but not yet into the held set: its own reclaim, once p0 was idle
    # past claim_idle_s, put p0 back and the same take handed it out twice.
    import threading

    buffer = ReplayBuffer(redis_url, "run", claim_idle_s=0.2)
    buffer.push(group(prompt="p0"))
    late = threading.Timer(0.8, lambda: [buffer.push(group(prompt=p)) for p in ("p1", "p2")])
    late.start()
    taken = buffer.take(3, learner_version=0, timeout_s=3.0)  # reclaims every 0.05 s
    late.join()
    assert sorted(g.prompt_id for g in taken.groups) == ["p0", "p1", "p2"]
    assert buffer.ack(taken.receipts) == 3


def test_a_waiting_replay_take_never_hands_out_the_same_replay_twice(redis_url):
    # The same for replays: one taken in a waiting take's first round was held only once
    # decoded, after the wait. Its own reclaim, with the replay out past claim_idle_s, made it
    # replayable again, and a later round took it again: X twice in one step, X's first
    # receipt then acked nothing, and the hold left one group counted as held for good.
    import threading

    buffer = ReplayBuffer(redis_url, "run", sampling="replay", max_reuse=5, claim_idle_s=0.2)
    buffer.push(group(prompt="X"))
    assert buffer.ack(buffer.take(1, learner_version=0).receipts) == 1  # X replayable
    buffer.push(group(prompt="Z"))
    late = threading.Timer(0.8, lambda: buffer.push(group(prompt="Y")))  # wakes the wait
    late.start()
    # round 1 (t = 0): Z, read at once, then X as a replay; round 2 waits for Y (0.8 s);
    # round 3 reclaims (X out for 0.8 s > claim_idle_s), waits till the deadline, and takes
    # replays again: X came back here
    taken = buffer.take(4, learner_version=0, timeout_s=2.0)
    late.join()
    assert sorted(g.prompt_id for g in taken.groups) == ["X", "Y", "Z"]
    buffer.hold(taken.receipts)
    assert buffer.ack(taken.receipts, held=True) == 3
    stats = buffer.stats()
    assert (stats.held, stats.acked, stats.reused, stats.replays_pending) == (0, 4, 1, 0)


def test_held_replays_keep_their_room_until_their_last_use(redis_url):
    # With replay sampling an ack deletes a group only at its last use (max_reuse); before
    # that it stays in the stream as a replay. Every held group was counted out of the
    # capacity, so producers filled its room and the checkpoint's ack left the stream over
    # capacity (review: capacity 4, length 8). Only groups the ack will delete are held now.
    buffer = ReplayBuffer(redis_url, "run", capacity=2, sampling="replay", max_reuse=2,
                          push_timeout_s=0.2)  # fmt: skip
    buffer.push_many([group(prompt="a"), group(prompt="b")])
    first = buffer.take(2, 0)
    buffer.hold(first.receipts)  # first uses of 2: both stay as replays after their ack
    assert buffer.stats().held == 0
    with pytest.raises(BufferFullError):
        buffer.push(group(prompt="c"))
    assert buffer.ack(first.receipts, held=True) == 2
    again = buffer.take(2, 1)
    assert [r.replay for r in again.receipts] == [True, True]
    buffer.hold(again.receipts)  # their last uses: the ack deletes them, their room is free
    assert buffer.stats().held == 2
    buffer.push_many([group(prompt="c"), group(prompt="d")])
    with pytest.raises(BufferFullError):
        buffer.push(group(prompt="e"))
    assert buffer.ack(again.receipts, held=True) == 2
    stats = buffer.stats()
    assert (stats.held, stats.length, stats.capacity) == (0, 2, 2)


def test_an_ack_racing_a_reclaim_does_not_hand_the_acked_group_out_again(redis_url):
    # The learner's commit acks on one thread while the prefetch reclaims on another: an
    # entry XAUTOCLAIM returned just before the ack deleted it had left the held set by the
    # time the reply was read, and went back into the pool with its payload.
    from staleflow.buffer.consumer import Consumer

    buffer = ReplayBuffer(redis_url, "run", claim_idle_s=0.2)
    for p in ("p0", "p1"):
        buffer.push(group(prompt=p))
    first = buffer.take(2, learner_version=0)
    time.sleep(0.3)  # held past claim_idle_s: a reclaim's XAUTOCLAIM returns them
    consumer = buffer._consumer
    assert isinstance(consumer, Consumer)
    xautoclaim = consumer.client.xautoclaim

    def claim_then_ack(*args, **kwargs):  # the commit lands between the reply and its use
        reply = xautoclaim(*args, **kwargs)
        if reply[1]:
            assert buffer.ack(first.receipts) == 2
        return reply

    consumer.client.xautoclaim = claim_then_ack
    consumer._claim(200)
    consumer.client.xautoclaim = xautoclaim
    assert take_all(buffer, 2)[1] == []  # neither comes back
    assert buffer.stats().acked == 2


def test_slow_step_is_not_stolen_before_claim_idle(redis_url):
    ReplayBuffer(redis_url, "run").push(group())
    first = ReplayBuffer(redis_url, "run", consumer="first", claim_idle_s=30)
    second = ReplayBuffer(redis_url, "run", consumer="second", claim_idle_s=30)
    assert len(first.take(1, 0).groups) == 1
    assert second.take(1, 0).groups == []


def wait_aof_written(url: str, timeout_s: float = 30.0) -> None:
    """Until everything the server acknowledged is in its append-only file (in the kernel's
    hands, which a SIGKILL of the server does not lose). With appendfsync everysec, Redis
    may hold its AOF buffer back for up to 2 s while a background fsync is slow, and a
    fixed sleep raced that on a busy disk."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            info = client.info("persistence")
            if info["aof_enabled"] and info["aof_buffer_length"] == 0:
                return
            time.sleep(0.05)
    finally:
        client.close()
    raise AssertionError(f"the AOF buffer was not written within {timeout_s} s: {info}")


def test_redis_killed_and_restarted_with_aof_keeps_unacked_groups(fresh_server):
    buffer = ReplayBuffer(fresh_server.url, "run")
    for i in range(6):
        buffer.push(group(prompt=str(i)))
    taken, _ = take_all(buffer, 2)
    buffer.ack(taken.receipts)  # 0, 1 trained and acked
    take_all(buffer, 2)  # 2, 3 taken, not acked
    wait_aof_written(fresh_server.url)
    fresh_server.kill()
    fresh_server.start()  # same port, password and data directory

    after = ReplayBuffer(fresh_server.url, "run", claim_idle_s=0.1)
    time.sleep(0.2)
    taken, ids = take_all(after, 10)
    assert sorted(ids) == ["2", "3", "4", "5"]
    after.ack(taken.receipts)
    stats = after.stats()
    assert (stats.pushed, stats.acked, stats.length) == (6, 6, 0)


def test_held_groups_leave_the_capacity_and_come_back_to_a_restarted_learner(redis_url):
    # The learner trains on 0, 1 and holds them until a checkpoint; it dies before one.
    producer = ReplayBuffer(redis_url, "run", capacity=4, push_timeout_s=0.2)
    for i in range(4):
        producer.push(group(prompt=str(i)))
    learner = ReplayBuffer(redis_url, "run", consumer="learner", capacity=4)
    trained, ids = take_all(learner, 2)
    assert ids == ["0", "1"]
    with pytest.raises(BufferFullError):
        producer.push(group(prompt="4"))  # 4 stored of 4: trained but unacked still count
    learner.hold(trained.receipts)
    assert learner.stats().held == 2
    producer.push(group(prompt="4"))  # 4 stored, 2 of them held: room for 2
    producer.push(group(prompt="5"))
    with pytest.raises(BufferFullError):
        producer.push(group(prompt="6"))
    take_all(learner, 1)  # "2" staged for the next step when the learner dies

    # the learner restarts from a checkpoint before those steps: everything delivered and
    # not acked comes back, oldest first, ahead of anything new; nothing else
    restarted = ReplayBuffer(redis_url, "run", consumer="learner", capacity=4)
    assert restarted.recover() == 4  # 0, 1 held, 2 staged, 3 read ahead by the first take
    assert restarted.stats().held == 0
    taken, ids = take_all(restarted, 10)
    assert ids == ["0", "1", "2", "3", "4", "5"]
    assert restarted.ack(taken.receipts, held=True) == 6
    stats = restarted.stats()
    assert (stats.pushed, stats.acked, stats.length, stats.pending, stats.held) == (6, 6, 0, 0, 0)


@pytest.mark.parametrize("max_reuse", [1, 2])
def test_an_ack_of_thousands_at_a_checkpoint_counts_each_group_once(redis_url, max_reuse):
    # A checkpoint acks every group held since the last one in one call: thousands of
    # receipts, over two versions, each counted once; acking them again changes nothing.
    n = 2500
    sampling = "fifo" if max_reuse == 1 else "replay"
    buffer = ReplayBuffer(redis_url, "run", capacity=n, max_reuse=max_reuse, sampling=sampling)
    for start in range(0, n, 250):
        buffer.push_many([group(version=i % 2, prompt=str(i)) for i in range(start, start + 250)])
    taken = buffer.take(n, learner_version=1)
    assert len(taken.groups) == n
    buffer.hold(taken.receipts)
    assert buffer.ack(taken.receipts, held=True) == n
    assert buffer.ack(taken.receipts, held=True) == 0  # again: nothing was pending
    stats = buffer.stats()
    # versions alternate 0, 1, 0, ...: 1250 groups of each
    assert stats.trained_by_version == {0: 1250, 1: 1250}
    assert (stats.acked, stats.held, stats.pending) == (n, 0, 0)
    if max_reuse == 1:  # every group used up: deleted from the stream
        assert (stats.length, stats.replayable) == (0, 0)
    else:  # every group used once of twice: all of them replayable, still stored
        assert (stats.length, stats.replayable) == (n, n)


def test_recover_takes_over_another_consumers_pending_at_once(redis_url):
    ReplayBuffer(redis_url, "run").push(group(prompt="a"))
    old = ReplayBuffer(redis_url, "run", consumer="old", claim_idle_s=3600)
    assert take_all(old, 1)[1] == ["a"]
    new = ReplayBuffer(redis_url, "run", consumer="new", claim_idle_s=3600)
    assert take_all(new, 1)[1] == []  # not idle long enough for a plain reclaim
    assert new.recover() == 1
    assert take_all(new, 1)[1] == ["a"]


def test_a_redone_batch_with_the_same_group_ids_pushes_nothing_twice(redis_url):
    from staleflow.buffer.records import batch_group_id

    buffer = ReplayBuffer(redis_url, "run")
    ids = [batch_group_id("run", 7, i) for i in range(3)]
    assert len(set(ids)) == 3
    assert ids[0] == batch_group_id("run", 7, 0) != batch_group_id("run", 8, 0)
    assert ids[0] != batch_group_id("other", 7, 0)
    first = [dataclasses.replace(group(prompt=str(i)), group_id=g) for i, g in enumerate(ids)]
    assert buffer.push_many(first[:2]) == [True, True]  # the worker died after two
    redone = [dataclasses.replace(group(prompt=str(i)), group_id=g) for i, g in enumerate(ids)]
    assert buffer.push_many(redone) == [False, False, True]
    stats = buffer.stats()
    assert (stats.pushed, stats.duplicates, stats.length) == (3, 2, 3)


def test_a_resume_after_the_dedup_keys_expired_still_pushes_nothing_twice(redis_url):
    # A resume redoes the batches running at its checkpoint, with the same group ids; what
    # they pushed before the stop is still in the stream. Resumed after dedup_ttl_s (24 h:
    # a crash on Friday night), the keys were gone and those groups were added again.
    from staleflow.buffer.records import batch_group_id

    ids = [batch_group_id("run", 7, i) for i in range(3)]
    first = [dataclasses.replace(group(prompt=str(i)), group_id=g) for i, g in enumerate(ids)]
    before = ReplayBuffer(redis_url, "run", dedup_ttl_s=1, read_ahead=False)
    assert before.push_many(first[:2]) == [True, True]
    assert [g.group_id for g in before.take(1, learner_version=0).groups] == ids[:1]  # pending
    time.sleep(1.5)  # both dedup keys expire (the second group was never read)
    resumed = ReplayBuffer(redis_url, "run")
    assert resumed.recover() == 1
    redone = [dataclasses.replace(group(prompt=str(i)), group_id=g) for i, g in enumerate(ids)]
    assert resumed.push_many(redone) == [False, False, True]
    stats = resumed.stats()
    assert (stats.pushed, stats.duplicates, stats.length) == (3, 2, 3)


def test_a_push_whose_reply_was_lost_is_sent_again_and_added_once(redis_url, monkeypatch):
    # The transaction runs on the server, then the connection drops before its reply (a
    # failure injected after the real call): the retry finds its own token and keeps nothing.
    from staleflow.buffer.producer import Producer

    real, lost = Producer._add, []

    def reply_lost_once(self, *args):
        status = real(self, *args)
        if not lost:
            lost.append(status)
            return None
        return status

    buffer = ReplayBuffer(redis_url, "run")
    old = group(prompt="old")
    assert buffer.push(old) is True
    monkeypatch.setattr(Producer, "_add", reply_lost_once)
    assert buffer.push_many([group(prompt="a"), old, group(prompt="b")]) == [True, False, True]
    assert lost == [[0, 1, 0]]  # the first transaction did add both new ones
    stats = buffer.stats()
    # the retry counts nothing again: "old" is one duplicate, not two
    assert (stats.length, stats.pushed, stats.duplicates) == (3, 3, 1)
    assert take_all(buffer, 5)[1] == ["old", "a", "b"]
    lost.clear()  # a push of duplicates only, its reply lost too
    assert buffer.push_many([old]) == [False]
    assert buffer.stats().duplicates == 2
    # A push of new groups only writes no status key (its dedup keys hold its token); its
    # retry after a lost reply finds its own groups by their token, keeps one copy of each
    # and counts them once.
    statuses = set(buffer.client.keys(buffer.keys.prefix + "push:*"))
    lost.clear()
    assert buffer.push_many([group(prompt="c"), group(prompt="d")]) == [True, True]
    assert lost == [[0, 0]]
    assert set(buffer.client.keys(buffer.keys.prefix + "push:*")) == statuses
    stats = buffer.stats()
    assert (stats.length, stats.pushed, stats.duplicates) == (5, 5, 2)
    assert take_all(buffer, 5)[1] == ["c", "d"]


def test_a_push_whose_dedup_keys_expire_before_its_statuses_keeps_them(redis_url):
    # A retry of an all-new push finds its groups by their dedup keys: with buffer
    # dedup_ttl_s below the status TTL they could be gone by then, so the statuses are kept
    short = ReplayBuffer(redis_url, "short", dedup_ttl_s=1)
    assert short.push(group(prompt="a")) is True
    assert len(short.client.keys(short.keys.prefix + "push:*")) == 1
    usual = ReplayBuffer(redis_url, "usual")
    assert usual.push(group(prompt="a")) is True
    assert usual.client.keys(usual.keys.prefix + "push:*") == []


def test_a_push_whose_connection_always_drops_fails_instead_of_retrying_forever(
    redis_url, monkeypatch
):
    from staleflow.buffer.producer import Producer

    calls = []
    monkeypatch.setattr(Producer, "_add", lambda self, *args: calls.append(1))  # always lost
    buffer = ReplayBuffer(redis_url, "run")
    with pytest.raises(BufferConnectionError, match="dropped during each of 6 attempts"):
        buffer.push(group())
    assert len(calls) == 6


def test_a_duplicate_push_is_never_visible_to_a_reader(redis_url):
    # A duplicate's XADD runs inside the push's transaction and is deleted by it before EXEC
    # ends: a reader polling the stream the whole time sees each group exactly once.
    pusher = ReplayBuffer(redis_url, "run")
    first = [group(prompt=str(i)) for i in range(20)]
    assert pusher.push_many(first) == [True] * 20
    reader = redis.Redis.from_url(redis_url)
    key = pusher.keys.stream
    reader.xgroup_create(key, "spy", id="$")  # only entries added from now on
    seen: list[bytes] = []
    stop = threading.Event()

    def spy() -> None:
        while not stop.is_set():
            for _, entries in reader.xreadgroup("spy", "s", {key: ">"}, block=50) or []:
                seen.extend(fields[b"gid"] for _, fields in entries)

    thread = threading.Thread(target=spy)
    thread.start()
    try:
        for _ in range(10):  # every group again, one at a time and in batches
            assert all(pusher.push(g) is False for g in first[:10])
            assert pusher.push_many(first[10:]) == [False] * 10
        fresh = group(prompt="new")
        assert pusher.push_many([first[0], fresh, first[1]]) == [False, True, False]
        deadline = time.monotonic() + 10  # the spy reads in order: all before it are read
        while fresh.group_id.encode() not in seen and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        thread.join()
    assert seen == [fresh.group_id.encode()]
    stats = pusher.stats()
    assert (stats.length, stats.pushed, stats.duplicates) == (21, 21, 10 * 20 + 2)


def test_capacity_is_exact_under_concurrent_producers(redis_url):
    # Four threads push batches of 3 into room for 7: the check runs inside each push's
    # transaction, so the stream never holds more than 7 and a refused push adds nothing.
    capacity = 7
    results: list[str] = []

    def produce(worker: int) -> None:
        buffer = ReplayBuffer(redis_url, "run", capacity=capacity, push_timeout_s=0.5)
        for batch in range(3):
            groups = [group(prompt=f"{worker}-{batch}-{i}") for i in range(3)]
            try:
                buffer.push_many(groups)
                results.append("added")
            except BufferFullError:
                results.append("full")

    threads = [threading.Thread(target=produce, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = ReplayBuffer(redis_url, "run").stats()
    assert results.count("added") == 2
    assert results.count("full") == 10
    assert stats.length == stats.pushed == 6
    assert stats.duplicates == 0


def test_threads_pushing_through_one_buffer_never_share_a_connection(redis_url):
    # push keeps one connection pinned; a thread finding it busy takes a pooled one. Were
    # two transactions interleaved on one connection, their replies would cross: a push
    # would fail or return the other's statuses.
    buffer = ReplayBuffer(redis_url, "run", capacity=1000)
    results: list[list[bool]] = []
    errors: list[BaseException] = []

    def produce(worker: int) -> None:
        try:
            for i in range(40):
                batch = [group(prompt=f"{worker}-{i}-{j}") for j in range(1 + i % 3)]
                results.append(buffer.push_many(batch + batch[:1]))  # one duplicate each
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 160
    assert all(r == [True] * (len(r) - 1) + [False] for r in results)
    # 4 workers x (14 x 1 + 13 x 2 + 13 x 3 = 79) groups, and one duplicate per push
    stats = buffer.stats()
    assert (stats.pushed, stats.duplicates, stats.length) == (4 * 79, 160, 4 * 79)


def test_a_closed_buffer_leaves_no_connection_open(redis_url):
    from tests.integration.test_system import wait_for

    admin = redis.Redis.from_url(redis_url)
    before = len(admin.client_list())
    buffer = ReplayBuffer(redis_url, "run")
    buffer.push_many([group(prompt=str(i)) for i in range(3)])  # the pinned connection
    take_all(buffer, 2)  # pooled ones, and the read-ahead's
    assert len(admin.client_list()) > before
    buffer.close()
    # the server drops a closed connection when its event loop reads the EOF, which may come
    # after a command already waiting on another connection (CLIENT LIST): poll for it
    wait_for(lambda: len(admin.client_list()) <= before, 10, "the connections to close", 0.05)
    assert len(admin.client_list()) == before


def test_a_push_the_server_refuses_raises_its_reason_and_adds_nothing(redis_url):
    buffer = ReplayBuffer(redis_url, "run")
    admin = redis.Redis.from_url(redis_url)
    assert buffer.push(group(prompt="before")) is True
    admin.config_set("maxmemory", 1)  # noeviction: each XADD is refused as it is queued
    try:
        with pytest.raises(redis.ResponseError, match="maxmemory"):  # the refusal, no EXECABORT
            buffer.push(group(prompt="refused"))
    finally:
        admin.config_set("maxmemory", 0)
    assert buffer.push(group(prompt="after")) is True  # the pinned connection still works
    assert take_all(buffer, 5)[1] == ["before", "after"]
    assert buffer.stats().pushed == 2


def test_the_same_group_twice_in_one_push_is_added_once(redis_url):
    buffer = ReplayBuffer(redis_url, "run")
    g = group(prompt="twice")
    assert buffer.push_many([g, group(prompt="other"), g]) == [True, True, False]
    stats = buffer.stats()
    assert (stats.length, stats.pushed, stats.duplicates) == (2, 2, 1)
    assert take_all(buffer, 5)[1] == ["twice", "other"]


def test_a_push_while_the_server_restarts_waits_for_it(fresh_server):
    buffer = ReplayBuffer(fresh_server.url, "run")
    assert buffer.push(group(prompt="before")) is True
    wait_aof_written(fresh_server.url)
    fresh_server.kill()
    result: list[object] = []
    pusher = threading.Thread(target=lambda: result.append(buffer.push(group(prompt="during"))))
    pusher.start()  # it finds the server gone and waits with the client's retries (~9 s)
    time.sleep(1.0)
    # restarted from this thread: the server dies with the thread that started it
    fresh_server.start()  # same port, password, data
    pusher.join(30)
    assert result == [True]
    assert take_all(buffer, 5)[1] == ["before", "during"]
    assert buffer.stats().pushed == 2


def test_a_producer_killed_mid_push_leaves_nothing_behind(redis_url, waits):
    # A producer dies after sending MULTI and an XADD but before EXEC: Redis discards the
    # transaction with the connection, so nothing was added and the same group id can be
    # pushed at once.
    buffer = ReplayBuffer(redis_url, "run")
    g = group(prompt="redone")
    dying = redis.Redis.from_url(redis_url)
    conn = dying.connection_pool.get_connection()
    conn.send_packed_command(conn.pack_commands(
        [("MULTI",), ("XADD", buffer.keys.stream, "*", "gid", g.group_id, "h", b"x")]
    ))  # fmt: skip
    assert conn.read_response() == b"OK"
    conn.disconnect()  # killed: EXEC never comes
    assert buffer.push(g) is True
    assert waits == []  # at once: no wait for the dead one, no retry
    assert buffer.stats().length == 1
    assert take_all(buffer, 5)[1] == ["redone"]


def test_take_with_an_ack_when_nothing_needs_reading(redis_url):
    # Consumer B reclaims both groups a dead consumer held and hands out one; its next take
    # needs no read (the other is pooled), so the ack goes alone and still counts.
    buffer = ReplayBuffer(redis_url, "run")
    buffer.push_many([group(prompt="a"), group(prompt="b")])
    ReplayBuffer(redis_url, "run", consumer="dead").take(2, 0)
    time.sleep(0.3)
    b = ReplayBuffer(redis_url, "run", consumer="b", claim_idle_s=0.2)
    first = b.take(1, 0)
    second = b.take(1, 0, ack=first.receipts)
    assert [g.prompt_id for g in first.groups + second.groups] == ["a", "b"]
    assert second.acked == 1
    assert b.stats().acked == 1


def test_take_acks_the_previous_batch_in_the_same_call(redis_url):
    buffer = ReplayBuffer(redis_url, "run")
    buffer.push_many([group(prompt=str(i)) for i in range(5)])
    first = buffer.take(2, 0)
    second = buffer.take(2, 0, ack=first.receipts)
    assert [g.prompt_id for g in second.groups] == ["2", "3"]
    assert second.acked == 2
    assert buffer.stats().acked == 2
    # acking again is harmless and counted as nothing; an ack with nothing left to read works
    third = buffer.take(2, 0, ack=[*first.receipts, *second.receipts])
    assert third.acked == 2
    assert [g.prompt_id for g in third.groups] == ["4"]
    last = buffer.take(2, 0, ack=third.receipts)
    assert (last.groups, last.acked) == ([], 1)
    stats = buffer.stats()
    assert (stats.acked, stats.length, stats.pending) == (5, 0, 0)


def _drop_replies(monkeypatch, times: int = 1) -> list[int]:
    """The next `times` calls sent ahead (InFlight: a push, an ack, a take's read) reach the
    server, which runs them (the sleep), and then their connection closes before the
    replies are read: the process never sees them. Returns the dropped calls' sizes."""
    real_send = InFlight.send.__func__
    dropped: list[int] = []

    def send_then_drop(cls, lane, commands):
        call = real_send(cls, lane, commands)
        if len(dropped) < times and call._conn is not None:
            time.sleep(0.2)
            call._conn.disconnect()
            dropped.append(len(commands))
        return call

    monkeypatch.setattr(InFlight, "send", classmethod(send_then_drop))
    return dropped


def _drop_the_read_ahead_reply(monkeypatch, times: int = 1) -> list[int]:
    """As `_drop_replies`, for the read-ahead (the read a take sends for the next one) only."""
    real_send_ahead = Consumer._send_ahead
    dropped: list[int] = []

    def send_then_drop(self, n, ack_args):
        call = real_send_ahead(self, n, ack_args)
        if call is not None and len(dropped) < times and call._conn is not None:
            time.sleep(0.2)
            call._conn.disconnect()
            dropped.append(len(call.commands))
        return call

    monkeypatch.setattr(Consumer, "_send_ahead", send_then_drop)
    return dropped


def test_a_lost_reply_to_a_plain_read_is_read_again_at_once_and_its_ack_counted_once(
    redis_url, monkeypatch
):
    # Without read-ahead every take reads (and acks) in one round trip; a reply lost with its
    # connection used to leave what it delivered pending under this consumer, in no pool,
    # until claim_idle_s (here 600 s) had passed.
    buffer = ReplayBuffer(redis_url, "run", claim_idle_s=600, read_ahead=False)
    buffer.push_many([group(prompt=str(i)) for i in range(6)])
    dropped = _drop_replies(monkeypatch)
    first = buffer.take(2, 0)  # the read of 0, 1 ran; its reply is lost
    assert dropped == [1]
    assert [g.prompt_id for g in first.groups] == ["0", "1"]
    dropped = _drop_replies(monkeypatch)
    second = buffer.take(2, 0, ack=first.receipts)  # the ack of 0, 1 and the read of 2, 3
    assert dropped == [2]
    assert [g.prompt_id for g in second.groups] == ["2", "3"]
    assert second.acked == 2  # the ack ran, and sent again it changes nothing
    assert buffer.stats().acked == 2
    third = buffer.take(2, 0, ack=second.receipts)
    assert [g.prompt_id for g in third.groups] == ["4", "5"]
    assert buffer.take(2, 0, ack=third.receipts).groups == []
    stats = buffer.stats()
    assert (stats.acked, stats.length, stats.pending, stats.undelivered) == (6, 0, 0, 0)


def test_a_lost_read_ahead_is_read_again_at_once_not_after_claim_idle(redis_url, monkeypatch):
    buffer = ReplayBuffer(redis_url, "run", claim_idle_s=600)
    buffer.push_many([group(prompt=str(i)) for i in range(6)])
    dropped = _drop_the_read_ahead_reply(monkeypatch)
    first = buffer.take(2, 0)  # its read-ahead delivers 2 and 3, but the reply is lost
    assert dropped == [1]
    assert [g.prompt_id for g in first.groups] == ["0", "1"]
    # 2 and 3 are pending under this consumer, in no pool: the next take reads its own
    # pending list first, so they come now and in order, not after 600 s of claim_idle_s
    second = buffer.take(2, 0, ack=first.receipts)
    assert [g.prompt_id for g in second.groups] == ["2", "3"]
    third = buffer.take(2, 0, ack=second.receipts)
    assert [g.prompt_id for g in third.groups] == ["4", "5"]
    assert buffer.take(2, 0, ack=third.receipts).groups == []
    stats = buffer.stats()
    assert (stats.acked, stats.length, stats.pending, stats.undelivered) == (6, 0, 0, 0)


def test_an_ack_whose_reply_was_lost_with_the_read_ahead_is_applied_once(redis_url, monkeypatch):
    buffer = ReplayBuffer(redis_url, "run", claim_idle_s=600)
    buffer.push_many([group(prompt=str(i)) for i in range(6)])
    first = buffer.take(2, 0)  # 2, 3 read ahead into the pool
    dropped = _drop_the_read_ahead_reply(monkeypatch)
    second = buffer.take(2, 0, ack=first.receipts)  # the ack and the read of 4, 5: lost
    assert dropped == [2]
    assert [g.prompt_id for g in second.groups] == ["2", "3"]
    # the ack had run on the server; sent again, it returns what it did then (its status
    # key) and changes nothing: the server's count is not doubled
    assert second.acked == 2
    assert buffer.stats().acked == 2
    third = buffer.take(2, 0, ack=second.receipts)
    assert [g.prompt_id for g in third.groups] == ["4", "5"]
    buffer.ack(third.receipts)
    stats = buffer.stats()
    assert (stats.acked, stats.length, stats.pending) == (6, 0, 0)


def test_a_lost_read_ahead_then_a_server_that_lost_everything_recovers(redis_url, monkeypatch):
    # As after a restart without persistence: the stream, its group and this consumer's
    # pending list are gone when the next take wants to read the lost entries again.
    buffer = ReplayBuffer(redis_url, "run", claim_idle_s=600)
    buffer.push_many([group(prompt=str(i)) for i in range(4)])
    _drop_the_read_ahead_reply(monkeypatch)
    assert [g.prompt_id for g in buffer.take(2, 0).groups] == ["0", "1"]
    buffer.client.delete(buffer.keys.stream)
    buffer.push_many([group(prompt="new")])
    assert [g.prompt_id for g in buffer.take(2, 0).groups] == ["new"]  # not NOGROUP, forever


def test_a_group_acked_while_a_lost_read_is_read_again_is_not_handed_out_twice(
    redis_url, monkeypatch
):
    buffer = ReplayBuffer(redis_url, "run", claim_idle_s=600)
    buffer.push_many([group(prompt=str(i)) for i in range(4)])
    _drop_the_read_ahead_reply(monkeypatch)
    first = buffer.take(2, 0)  # 0, 1 held; the read of 2, 3 lost
    real = buffer.client.xreadgroup

    def ack_lands_right_after_the_read(*args, **kwargs):
        reply = real(*args, **kwargs)
        if "0" in args[2].values() and first.receipts:  # the re-read of the pending list
            buffer.ack(first.receipts)  # the learner's thread acks 0, 1 meanwhile
            first.receipts.clear()
        return reply

    monkeypatch.setattr(buffer.client, "xreadgroup", ack_lands_right_after_the_read)
    assert [g.prompt_id for g in buffer.take(2, 0).groups] == ["2", "3"]
    assert buffer.take(2, 0).groups == []  # 0 and 1 were trained and acked: never again
    assert buffer.stats().acked == 2


def test_a_take_that_fails_after_decoding_hands_nothing_out_and_loses_nothing(
    redis_url, monkeypatch
):
    buffer = ReplayBuffer(redis_url, "run", claim_idle_s=600)
    buffer.push_many([group(prompt=str(i)) for i in range(4)])
    real, calls = InFlight.replies, []

    def unreadable(self):
        calls.append(self.commands)
        replies = real(self)  # the replies arrive; the read-ahead's cannot be understood
        if len(calls) == 2:  # (the first is the take's own read)
            raise redis.InvalidResponse("injected: garbled reply")
        return replies

    monkeypatch.setattr(InFlight, "replies", unreadable)
    with pytest.raises(BufferConnectionError, match="not in the Redis protocol"):
        buffer.take(2, 0)  # (the buffer's own error for it, naming the server)
    monkeypatch.setattr(InFlight, "replies", real)
    # 0, 1 were decoded but never returned: offered again, then the read-ahead's 2, 3
    second = buffer.take(2, 0)
    assert [g.prompt_id for g in second.groups] == ["0", "1"]
    third = buffer.take(2, 0, ack=second.receipts)
    assert [g.prompt_id for g in third.groups] == ["2", "3"]
    buffer.ack(third.receipts)
    stats = buffer.stats()
    assert (stats.acked, stats.length, stats.pending) == (4, 0, 0)


def test_a_replay_in_a_take_that_fails_after_decoding_is_offered_again(redis_url, monkeypatch):
    # The same failure with a replay: the take's fifo entries went back to the pool, but the
    # replay stayed held by this consumer, so every reclaim skipped it and no take offered it
    # again (until a restart's recover).
    buffer = ReplayBuffer(redis_url, "run", sampling="replay", max_reuse=3, claim_idle_s=0.2)
    buffer.push(group(prompt="X"))
    assert buffer.ack(buffer.take(1, 0).receipts) == 1  # X replayable
    real, calls = InFlight.replies, []

    def unreadable(self):
        calls.append(self.commands)
        replies = real(self)
        if len(calls) == 2:  # the read-ahead's, after X was taken as a replay and decoded
            raise redis.InvalidResponse("injected: garbled reply")
        return replies

    monkeypatch.setattr(InFlight, "replies", unreadable)
    with pytest.raises(BufferConnectionError, match="not in the Redis protocol"):
        buffer.take(1, 0)
    monkeypatch.setattr(InFlight, "replies", real)
    time.sleep(0.3)  # out past claim_idle_s: the next take's reclaim makes it replayable
    again = buffer.take(1, 0)
    assert [g.prompt_id for g in again.groups] == ["X"]
    assert buffer.ack(again.receipts) == 1
    stats = buffer.stats()
    assert (stats.acked, stats.reused, stats.replays_pending) == (2, 1, 0)


def test_read_ahead_entries_meet_the_staleness_rule_when_handed_out(redis_url):
    # Read ahead at learner version 0, handed out at 1: with max_staleness 0 they are stale
    # then, so they are dropped and counted, never returned.
    buffer = ReplayBuffer(redis_url, "run", max_staleness=0)
    buffer.push_many([group(version=0, prompt=str(i)) for i in range(4)])
    buffer.push(group(version=1, prompt="fresh"))
    first = buffer.take(2, learner_version=0)
    assert [g.prompt_id for g in first.groups] == ["0", "1"]
    assert buffer.stats().undelivered == 1  # 2 and 3 were read ahead; "fresh" was not
    later = buffer.take(2, learner_version=1)
    assert [g.prompt_id for g in later.groups] == ["fresh"]
    assert later.dropped_stale == 2
    assert buffer.stats().dropped_stale == 2


# ----------------------------------------------------------------------------- staleness, reuse


def test_stale_groups_are_dropped_and_counted(redis_url):
    buffer = ReplayBuffer(redis_url, "run", max_staleness=2)
    for v in range(6):
        buffer.push(group(version=v, prompt=f"v{v}"))
    # learner at version 5: oldest allowed is 5 - 2 = 3
    taken, ids = take_all(buffer, 10, version=5)
    assert ids == ["v3", "v4", "v5"]
    assert taken.dropped_stale == 3
    stats = buffer.stats()
    assert stats.dropped_stale == 3
    assert stats.length == 3  # the dropped ones are gone, the taken ones pending
    assert stats.pushed_by_version == {v: 1 for v in range(6)}


def test_groups_becoming_stale_while_pooled_are_dropped(redis_url):
    buffer = ReplayBuffer(redis_url, "run", sampling="freshest", max_staleness=1)
    for v in (0, 1):
        buffer.push(group(version=v, prompt=f"v{v}"))
    # learner at 1 (floor 0): freshest hands out v1; v0 stays pooled (pending in Redis)
    assert take_all(buffer, 1, version=1)[1] == ["v1"]
    # learner at 2 (floor 1): the pooled v0 is now stale
    taken, ids = take_all(buffer, 1, version=2)
    assert ids == []
    assert taken.dropped_stale == 1


def test_replay_reuses_each_group_up_to_max_reuse(redis_url):
    buffer = ReplayBuffer(redis_url, "run", sampling="replay", max_reuse=3)
    buffer.push(group(prompt="a"))
    buffer.push(group(prompt="b"))
    uses: Counter[str] = Counter()
    for _ in range(6):
        taken = buffer.take(2, 0)
        uses.update(g.prompt_id for g in taken.groups)
        buffer.ack(taken.receipts)
    assert uses == {"a": 3, "b": 3}
    stats = buffer.stats()
    assert (stats.acked, stats.reused, stats.length, stats.replayable) == (6, 4, 0, 0)
    assert stats.trained_by_version == {0: 6}


def test_replay_prefers_fresh_groups_and_recovers_unacked_replays(redis_url):
    buffer = ReplayBuffer(redis_url, "run", sampling="replay", max_reuse=2, claim_idle_s=0.2)
    buffer.push(group(prompt="old"))
    buffer.ack(buffer.take(1, 0).receipts)
    buffer.push(group(prompt="new"))
    taken = buffer.take(1, 0)
    assert [g.prompt_id for g in taken.groups] == ["new"]
    assert taken.receipts[0].replay is False
    buffer.ack(taken.receipts)
    replay = buffer.take(1, 0)  # the least-used replayable group: "old"
    assert [g.prompt_id for g in replay.groups] == ["old"]
    assert replay.receipts[0].replay is True
    # never acked (the consumer died): after claim_idle it is replayable again
    other = ReplayBuffer(redis_url, "run", sampling="replay", max_reuse=2, claim_idle_s=0.2)
    time.sleep(0.3)
    assert sorted(g.prompt_id for g in other.take(2, 0).groups) == ["new", "old"]


def test_replay_respects_staleness(redis_url):
    buffer = ReplayBuffer(redis_url, "run", sampling="replay", max_reuse=5, max_staleness=1)
    buffer.push(group(version=0))
    buffer.ack(buffer.take(1, 0).receipts)
    taken = buffer.take(1, learner_version=2)
    assert taken.groups == []
    assert taken.dropped_stale == 1
    assert buffer.stats().length == 0


def test_replays_dropped_or_in_flight_count_once_when_a_run_reconciles(redis_url):
    # A replay is a group trained before: dropping it stale, or holding it out unacked, must
    # not count it a second time in the summary's pushed = trained + dropped + left, nor in
    # the schedule's count of groups not trained yet (async admission's: it drifted down by
    # one per replay, trained or dropped, so admission let more batches start than fit).
    buffer = ReplayBuffer(redis_url, "run", sampling="replay", max_reuse=3, max_staleness=1)
    counts, flow = Counts(), Flow()

    def take(n: int, version: int):  # counted as the driver counts the learner's reports
        taken = buffer.take(n, version)
        counts.dropped_stale += taken.dropped_stale
        counts.dropped_invalid += taken.dropped_invalid
        flow.count_drops(taken.dropped_stale + taken.dropped_invalid, taken.replays_dropped)
        pairs = zip(taken.groups, taken.receipts, strict=True)
        names = [g.prompt_id + "*" * r.replay for g, r in pairs]
        return names, taken.receipts

    def train(receipts):  # a step on them, acked (LearnerRank.train's report: its replays)
        counts.trained += buffer.ack(receipts)
        flow.count_step(len(receipts), sum(r.replay for r in receipts))

    buffer.push_many([group(version=0, prompt="a"), group(version=0, prompt="b")])
    flow.pushed += 2
    names, receipts = take(2, 0)
    assert names == ["a", "b"]
    train(receipts)
    buffer.push(group(version=1, prompt="c"))
    flow.pushed += 1
    names, receipts = take(2, 1)  # fresh first, then the least-used replay (a tie: a)
    assert names == ["c", "a*"]
    train(receipts)
    assert flow.untrained() == 0  # a, b, c trained; a again
    names, _ = take(1, 2)  # the replay b (version 0) is stale at 2 with max_staleness 1
    assert (names, counts.dropped_stale, flow.untrained()) == ([], 1, 0)
    buffer.push(group(version=2, prompt="d"))
    flow.pushed += 1
    names, _ = take(2, 2)  # d, and the replay c (used once; a twice): neither acked
    assert names == ["d", "c*"]
    # d: 4 pushed - (4 trainings - 1 a replay) - (1 dropped - 1 a replay)
    assert flow.untrained() == 1

    stats = buffer.stats()
    assert (stats.replays_pending, stats.replays_dropped_stale, stats.pending) == (1, 1, 2)
    summary = reconcile(stats, counts, flow, 1.0)
    groups = summary["groups"]
    # 4 pushed = trained once: a, b, c (3) + never trained and still here: d (1)
    assert (groups["pushed"], groups["trained"], groups["left_in_buffer"]) == (4, 3, 1)
    assert (groups["dropped_stale"], groups["replays_dropped"]) == (0, 1)
    assert groups["trainings"] == counts.trained == 4  # a twice, b, c
    assert groups["reconciled"] is True
    assert summary["driver_counts"]["left_in_buffer"] == 1


# ----------------------------------------------------------------------------- capacity


def test_full_buffer_blocks_producers_then_raises(redis_url):
    buffer = ReplayBuffer(redis_url, "run", capacity=3, push_timeout_s=0.5)
    for i in range(3):
        buffer.push(group(prompt=str(i)))
    start = time.monotonic()
    with pytest.raises(BufferFullError, match=r"full \(3 groups\).*buffer.capacity"):
        buffer.push(group(prompt="late"))
    assert time.monotonic() - start >= 0.45
    assert buffer.stats().length == 3  # nothing was trimmed to make room


def test_capacity_changed_on_a_live_buffer_applies_to_both_sides(redis_url):
    buffer = ReplayBuffer(redis_url, "run", capacity=2, push_timeout_s=0.2, sampling="freshest")
    buffer.push(group(prompt="0"))
    buffer.push(group(prompt="1"))
    with pytest.raises(BufferFullError):
        buffer.push(group(prompt="2"))
    buffer.capacity = 3  # the producer takes one more, and freshest-first reads all three
    buffer.push(group(prompt="2"))
    assert buffer.stats().capacity == 3
    assert sorted(g.prompt_id for g in buffer.take(3, 0).groups) == ["0", "1", "2"]
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        buffer.capacity = 0
    assert buffer.capacity == 3


def test_blocked_producer_resumes_when_the_learner_acks(redis_url):
    producer = ReplayBuffer(redis_url, "run", capacity=2, push_timeout_s=30)
    producer.push(group(prompt="0"))
    producer.push(group(prompt="1"))
    done = threading.Event()

    def push_third() -> None:
        producer.push(group(prompt="2"))
        done.set()

    threading.Thread(target=push_third, daemon=True).start()
    time.sleep(0.3)
    assert not done.is_set()  # blocked: the buffer is full
    learner = ReplayBuffer(redis_url, "run")
    learner.ack(learner.take(2, 0).receipts)
    assert done.wait(10)
    assert take_all(learner, 5)[1] == ["2"]


# ----------------------------------------------------------------------------- bad data, bad URLs


def test_undecodable_entries_are_quarantined_not_lost(redis_url):
    buffer = ReplayBuffer(redis_url, "run")
    buffer.push(group(prompt="good"))
    client = redis.Redis.from_url(redis_url)
    client.xadd(buffer.keys.stream, {"g": b"\x93garbage", "v": b"0", "gid": b"x"})
    taken, ids = take_all(buffer, 5)
    assert ids == ["good"]
    assert taken.dropped_invalid == 1
    (entry,) = client.xrange(buffer.keys.invalid)
    assert entry[1][b"g"] == b"\x93garbage"
    assert b"invalid group record" in entry[1][b"error"]
    assert buffer.stats().dropped_invalid == 1


def test_a_host_name_that_does_not_resolve_fails_at_once(waits):
    # retrying a name that does not exist only delayed the error (~9 s of backoff)
    host = "nosuchhost.invalid"  # RFC 2606: never resolves
    try:
        socket.getaddrinfo(host, 6379)
    except socket.gaierror as exc:
        if exc.errno != socket.EAI_NONAME:
            pytest.skip(f"this machine's resolver answers {exc} (not 'no such name')")
    buffer = ReplayBuffer(f"redis://:hunter2@{host}:6379/0", "run")
    with pytest.raises(BufferConnectionError, match="its host name does not resolve") as err:
        buffer.push(group())
    assert waits == []  # not retried
    assert "hunter2" not in str(err.value)


def test_unreachable_redis_gives_a_clear_error_with_the_password_masked(waits):
    url = "redis://:hunter2@127.0.0.1:1/0"  # nothing listens on port 1
    buffer = ReplayBuffer(url, "run")
    with pytest.raises(BufferConnectionError) as err:
        buffer.push(group())
    message = str(err.value)
    assert "redis://:***@127.0.0.1:1/0" in message
    assert "hunter2" not in message
    assert "without buffer.redis_url" in message
    # retried with exponential back-off (a server restarting comes back), then gave up
    assert len(waits) >= 3
    assert waits[-1] > waits[0]


class Blackhole:
    """A TCP proxy to a real server that can go dark as a lost host does: after `go_dark()`
    nothing reaches the server or comes back, and new connections are never accepted (the
    listening socket's queue is full, so the SYNs are dropped and connects time out)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.dark = threading.Event()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.dark.is_set():
            try:
                client = self.listener.accept()[0]
            except TimeoutError:
                continue
            server = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if not self.dark.is_set():
                    sink.sendall(data)

    def go_dark(self) -> None:
        self.dark.set()
        threading.Event().wait(0.2)  # the accept loop has stopped (not time.sleep: `waits`)
        self.sockets.append(socket.create_connection(("127.0.0.1", self.port)))  # queue full

    def close(self) -> None:
        for sock in (*self.sockets, self.listener):
            with contextlib.suppress(OSError):  # ends a pump's recv (close alone would not,
                sock.shutdown(socket.SHUT_RDWR)  # and its connection to Redis stayed open)
            sock.close()


def test_a_host_that_stops_answering_mid_run_is_given_up_on_after_give_up_s(redis_server, waits):
    # A host that stops answering (a lost node): the command in flight waits out its socket
    # timeout, then each connection attempt its 5 s connect timeout, and redis-py retries the
    # connection inside each retry of the command, 9 x 9 attempts: minutes. `give_up_s`
    # bounds them all.
    from staleflow.buffer.connection import connect

    hole = Blackhole(redis_server.port)
    try:
        url = redis_server.url.replace(f":{redis_server.port}/", f":{hole.port}/")
        client = connect(url, socket_timeout_s=0.5, give_up_s=3.0)  # < one 5 s connect
        assert client.ping()
        hole.go_dark()
        with pytest.raises(redis.TimeoutError, match="Timeout connecting"):
            client.ping()  # no reply; then one attempt to connect again times out
    finally:
        hole.close()
    assert len(waits) == 1, waits  # one back-off, then the deadline ended the retries


def test_a_url_without_the_password_the_server_needs_says_where_it_goes(redis_server):
    url = redis_server.url.replace(f":{redis_server.password}@", "")
    with pytest.raises(BufferConnectionError, match=r"needs a password .*redis://:PASSWORD@"):
        ReplayBuffer(url, "run").stats()


def test_a_database_the_server_lacks_is_named(redis_server):
    url = redis_server.url.rsplit("/", 1)[0] + "/99"
    with pytest.raises(BufferConnectionError, match=r"has no such database .*DB index") as err:
        ReplayBuffer(url, "run").stats()
    assert redis_server.password not in str(err.value)  # the URL is shown masked


def test_rediss_to_a_server_without_tls_says_so_after_one_handshake(redis_server):
    # The TLS handshake's bytes never end a Redis command, so the server waits and every
    # attempt ran to the socket timeout: with redis-py's connect retries nested in the
    # command's, a rediss:// URL to this server went on for minutes. After the first timeout
    # one plain-text PING finds a Redis server (-NOAUTH here) and ends it with the fix.
    from staleflow.buffer.connection import connect

    url = redis_server.url.replace("redis://", "rediss://", 1)
    client = connect(url, socket_timeout_s=1.0)
    with pytest.raises(BufferConnectionError, match="has no TLS: it answers plain-text") as err:
        client.ping()
    assert "use redis://" in str(err.value)
    assert redis_server.password not in str(err.value)


def test_a_server_that_is_not_redis_is_named_as_such():
    # an HTTP server where Redis was expected: redis-py's protocol error used to escape
    import socket as sk

    listener = sk.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer_http() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"<html>not redis</html>\r\n")

    threading.Thread(target=answer_http, daemon=True).start()
    url = f"redis://:pw@127.0.0.1:{listener.getsockname()[1]}/0"
    try:
        with pytest.raises(BufferConnectionError) as err:
            ReplayBuffer(url, "run").stats()
    finally:
        listener.close()
    message = str(err.value)
    assert "sent a reply that is not in the Redis protocol" in message
    assert "check the host and port" in message
    assert ":pw@" not in message


def test_wrong_password_is_reported_without_retrying(redis_server, waits):
    url = redis_server.url.replace(redis_server.password, "wrong")
    with pytest.raises(BufferConnectionError, match="refused the password"):
        ReplayBuffer(url, "run").stats()
    assert waits == []  # retrying cannot fix a password


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"run": "bad name"}, "run name"),
        ({"run": "ok", "sampling": "lifo"}, "sampling"),
        ({"run": "ok", "max_reuse": 2}, "replay"),
        ({"run": "ok", "capacity": 0}, "capacity"),
        ({"run": "ok", "dedup_ttl_s": 0}, "dedup_ttl_s must be >= 1"),
    ],
)
def test_bad_arguments(redis_url, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReplayBuffer(redis_url, **kwargs)


def test_push_survives_a_connection_drop(redis_url):
    buffer = ReplayBuffer(redis_url, "run")
    buffer.push(group(prompt="before"))
    client = redis.Redis.from_url(redis_url)
    client.client_kill_filter(_type="normal", skipme=True)  # drop every other connection
    buffer.push(group(prompt="after"))  # reconnects transparently
    assert take_all(buffer, 5)[1] == ["before", "after"]


def test_large_realistic_group_round_trips_through_redis(redis_url):
    rng = np.random.default_rng(0)
    big = Group.new(
        run_id="run", prompt_id="big", task="t", prompt_token_ids=rng.integers(0, 1000, 200),
        responses=[Response(rng.integers(0, 50_000, 1024), -rng.random(1024), 1.0)
                   for _ in range(8)],
        policy_version=4, worker_id=str(os.getpid()),
    )  # fmt: skip
    buffer = ReplayBuffer(redis_url, "run")
    buffer.push(big)
    assert take_all(buffer, 1, version=4)[0].groups == [big]


def test_a_process_that_cannot_reach_the_server_fails_naming_itself_and_the_address():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    buffer = ReplayBuffer(f"redis://:hunter2@127.0.0.1:{port}/0", "run")
    with pytest.raises(BufferConnectionError) as failed:
        buffer.check_reachable("rollout worker 3 on 10.0.0.7")
    message = str(failed.value)
    assert "rollout worker 3 on 10.0.0.7 cannot reach" in message
    assert f"127.0.0.1:{port}" in message
    assert "buffer.redis_url" in message  # the fix
    assert "hunter2" not in message


def test_a_take_interrupted_while_it_waits_offers_its_groups_to_the_next(redis_url, monkeypatch):
    # Ctrl-C during take(4, timeout_s=10) with 2 groups there: the 2 it had chosen stayed
    # held (pending, counting against capacity) until recover(); the next take got none.
    buffer = ReplayBuffer(redis_url, "run", capacity=4)
    buffer.push_many([group(prompt="a"), group(prompt="b")])
    refill, calls = Consumer._refill, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the wait for the other 2, after the first read chose 2
            raise KeyboardInterrupt
        return refill(self, *args, **kwargs)

    monkeypatch.setattr(Consumer, "_refill", interrupted)
    with pytest.raises(KeyboardInterrupt):
        buffer.take(4, 0, timeout_s=10)
    monkeypatch.undo()
    taken, prompts = take_all(buffer, 4)
    assert sorted(prompts) == ["a", "b"]
    buffer.ack(taken.receipts)
    buffer.push_many([group(prompt=p) for p in "cdef"])  # the capacity is all free again


def test_buffer_arguments_no_take_could_honour_are_refused(redis_url):
    # max_staleness=-1 dropped every group as stale; timeout_s=nan spun for ever (25k
    # commands a second), inf was an OverflowError; take(2.5) a raw ResponseError
    for kwargs, message in (
        ({"max_staleness": -1}, "max_staleness must be a whole number >= 0"),
        ({"push_timeout_s": float("nan")}, "push_timeout_s must be a finite number"),
        ({"claim_idle_s": -1.0}, "claim_idle_s must be a finite number"),
    ):
        with pytest.raises(ValueError, match=message):
            ReplayBuffer(redis_url, "run", **kwargs)
    with pytest.raises(TypeError, match=r"url must be a redis:// URL or a redis\.Redis client"):
        ReplayBuffer(None, "run")  # type: ignore[arg-type]
    buffer = ReplayBuffer(redis_url, "run")
    with pytest.raises(ValueError, match="timeout_s >= 0"):
        buffer.take(1, 0, timeout_s=float("nan"))
    with pytest.raises(ValueError, match=r"a whole n >= 1, got 2\.5"):
        buffer.take(2.5, 0)  # type: ignore[arg-type]
    buffer.push(group())
    assert len(buffer.take(1, 0, timeout_s=float("inf")).groups) == 1  # no limit: it waits


def test_a_held_replay_is_not_reclaimed_while_it_waits_for_its_checkpoint(redis_url):
    # A replay trained and held (acked at the next checkpoint) went back to the replayable
    # set once claim_idle_s passed, was handed out again, and the checkpoint's ack then
    # released the second take: trained 3 times with 2 counted, the summary unreconciled.
    buffer = ReplayBuffer(redis_url, "run", sampling="replay", max_reuse=3, claim_idle_s=0.4)
    buffer.push(group(prompt="a"))
    first = buffer.take(1, 0)
    buffer.hold(first.receipts)
    assert buffer.ack(first.receipts, held=True) == 1  # checkpoint 1
    replay = buffer.take(1, 1)  # step 2 trains it as a replay, held until checkpoint 2
    assert [r.replay for r in replay.receipts] == [True]
    buffer.hold(replay.receipts)
    time.sleep(0.6)  # past claim_idle_s: the next take's reclaim runs
    buffer.push(group(prompt="b"))
    later = buffer.take(2, 2, timeout_s=0.3)  # only "b": "a" is still out with step 2
    assert [g.prompt_id for g in later.groups] == ["b"]
    assert buffer.ack(replay.receipts, held=True) == 1  # checkpoint 2 releases step 2's take
    stats = buffer.stats()
    assert stats.acked == 2  # a's two trainings; b is not acked yet
    assert int(buffer.client.hget(buffer.keys.uses, replay.receipts[0].entry_id)) == 2


def test_a_resume_acking_a_checkpoints_replay_again_does_not_release_a_later_take(redis_url):
    # A resume acks the groups its checkpoint named again (the checkpoint's commit may not
    # have run). A replay named there and taken again after the checkpoint was released by
    # it: a training the resume rolled back counted as done (acked above the checkpoint's
    # count, and at max_reuse the group was deleted).
    buffer = ReplayBuffer(redis_url, "run", sampling="replay", max_reuse=3)
    buffer.push(group(prompt="a"))
    assert buffer.ack(buffer.take(1, 0).receipts) == 1  # step 1
    step_2 = buffer.take(1, 1).receipts  # a replay; the checkpoint at step 2 names it
    assert buffer.ack(step_2) == 1  # the checkpoint's commit
    step_3 = buffer.take(1, 2).receipts  # taken again; the learner dies before step 3 ends
    assert step_3[0].entry_id == step_2[0].entry_id
    assert step_3[0].token != step_2[0].token
    resumed = ReplayBuffer(redis_url, "run", sampling="replay", max_reuse=3)
    assert resumed.ack(step_2) == 0  # step 3's take is not step 2's
    assert resumed.stats().acked == 2  # what the checkpoint counts
    assert resumed.recover() == 0  # (no stream entry was pending)
    again = resumed.take(1, 2, timeout_s=0.5)  # step 3 is redone with the group
    assert [g.prompt_id for g in again.groups] == ["a"]
    assert resumed.ack(again.receipts) == 1


def test_a_drop_sent_again_after_a_lost_reply_counts_once(redis_url, monkeypatch):
    # redis-py resends a command whose reply was lost; the resent drop found nothing pending
    # and said 0, so the learner reported fewer drops than the buffer counted (unreconciled)
    buffer = ReplayBuffer(redis_url, "run", max_staleness=0)
    buffer.push_many([group(version=0, prompt="a"), group(version=0, prompt="b")])
    real, sha = buffer.client.execute_command, buffer._consumer._drop.sha

    def drop_sent_twice(*args, **kwargs):  # the server ran it, the reply was lost, resent
        if args[:2] == ("EVALSHA", sha):
            real(*args, **kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(buffer.client, "execute_command", drop_sent_twice)
    taken = buffer.take(2, learner_version=1, timeout_s=0.2)  # both are stale at version 1
    monkeypatch.undo()
    assert taken.groups == []
    assert taken.dropped_stale == 2
    assert buffer.stats().dropped_stale == 2


def test_an_ack_ends_only_its_own_takes_hold_of_a_replay(redis_url):
    # The checkpoint's ack runs while the prefetch thread takes: between the server's ack
    # and the reply being read, the replay it released can be taken again. Reading the reply
    # then forgot the id, and the new take lost its protection from the reclaim.
    buffer = ReplayBuffer(redis_url, "run", sampling="replay", max_reuse=5)
    consumer = buffer._consumer
    buffer.push(group(prompt="a"))
    assert buffer.ack(buffer.take(1, 0).receipts) == 1
    first = buffer.take(1, 1).receipts  # a replay, held for the checkpoint
    args = consumer._ack_args(first, held=False)
    result = consumer._run_ack(args)  # the server acked it ...
    second = buffer.take(1, 2).receipts  # ... the prefetch takes it again ...
    consumer._acked(args, result)  # ... and then the ack's reply is read
    assert consumer._held_replays == {second[0].entry_id: second[0].token}
    assert buffer.ack(second) == 1
    assert consumer._held_replays == {}
