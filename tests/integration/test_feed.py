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
