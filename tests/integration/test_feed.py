"""The learner's feed (learner/feed.py) against a real redis-server."""

from __future__ import annotations

from staleflow.buffer.replay import ReplayBuffer
from staleflow.learner.feed import BatchFeed
from tests.integration.test_buffer import group


def test_a_batch_take_time_counts_the_waits_of_the_calls_that_came_back_short(redis_url):
    # In lock-step the driver asks for the batch again and again (a wait of a few seconds
    # each) while the rollout runs. Only the last call's time was reported as time_take_s,
    # so the seconds the learner waited for data went to time_other_s.
    buffer = ReplayBuffer(redis_url, "run")
    feed = BatchFeed(buffer, size=2)
    try:
        buffer.push(group(prompt="a"))
        assert feed.next(0, wait_s=0.3) is None  # 1 of 2: waited its 0.3 s, in vain
        assert feed.next(0, wait_s=0.2) is None
        buffer.push(group(prompt="b"))
        batch = feed.next(0, wait_s=0.0)
        assert batch is not None
        assert len(batch.groups) == 2
        assert batch.take_s >= 0.5  # both waits (a take waits its full timeout when short)
        assert feed._waited == 0.0  # spent on this batch: the next one starts from nothing
    finally:
        feed.close()
