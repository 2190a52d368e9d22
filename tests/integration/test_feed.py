"""The learner's feed (learner/feed.py) against a real redis-server."""

from __future__ import annotations

import itertools

import pytest

from staleflow.buffer.replay import ReplayBuffer
from staleflow.learner import feed as feed_module
from staleflow.learner.feed import BatchFeed
from tests.integration.test_buffer import group

pytestmark = pytest.mark.integration


def test_a_batch_take_time_counts_the_waits_of_the_calls_that_came_back_short(
    redis_url, monkeypatch
):
    # In lock-step the driver asks for the batch again and again (a wait of a few seconds
    # each) while the rollout runs. Only the last call's time was reported as time_take_s,
    # so the seconds the learner waited for data went to time_other_s.
    ticks = itertools.count(step=1.0)  # a clock that moves 1 s between two readings
    monkeypatch.setattr(feed_module, "_clock", lambda: next(ticks))
    buffer = ReplayBuffer(redis_url, "run")
    feed = BatchFeed(buffer, size=2)
    try:
        buffer.push(group(prompt="a"))
        assert feed.next(0, wait_s=0.05) is None  # 1 of 2: 1 s (on this clock), in vain
        assert feed.next(0, wait_s=0.05) is None  # 1 s more
        buffer.push(group(prompt="b"))
        batch = feed.next(0, wait_s=0.0)
        assert batch is not None
        assert len(batch.groups) == 2
        assert batch.take_s == 3.0  # its own take and the two that came back short
        buffer.push_many([group(prompt="c"), group(prompt="d")])
        second = feed.next(1, wait_s=0.0)
        assert second is not None
        assert second.take_s == 1.0  # the waits were the first batch's, not carried on
    finally:
        feed.close()


def test_a_failed_last_prefetch_does_not_fail_the_runs_settle(redis_url, monkeypatch, caplog):
    # The last step starts a prefetch for a step that never runs; its take failing (the
    # buffer unreachable) was raised by settle() after the final checkpoint, and the driver
    # marked the completed run failed. Injected: every take from the second on fails.
    from staleflow.buffer.connection import BufferConnectionError

    buffer = ReplayBuffer(redis_url, "run")
    feed = BatchFeed(buffer, size=1)
    try:
        buffer.push(group(prompt="a"))
        real, calls = buffer.take, itertools.count()

        def fails_after_the_first(*args, **kwargs):
            if next(calls):
                raise BufferConnectionError("injected: Redis unreachable after retrying")
            return real(*args, **kwargs)

        monkeypatch.setattr(buffer, "take", fails_after_the_first)
        assert feed.next(0, wait_s=0.0) is not None  # the last step's batch
        feed.prefetch(1, wait_s=0.0)  # for a step that will not run, and it fails
        assert feed.settle() == (0, 0, 0)
        assert "the last prefetch (for a step not run) failed" in caplog.text
        assert "injected: Redis unreachable" in caplog.text
    finally:
        feed.close()
