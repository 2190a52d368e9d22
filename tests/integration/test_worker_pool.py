"""The rollout worker pool on a real local Ray: scaling back up keeps workers that are still
finishing their last batch before retiring, instead of starting new engines next to them
(under sync.method ipc they still hold their room in learner rank 0's bundle)."""

from __future__ import annotations

import pytest
import ray

from staleflow.cluster.placement import WorkerPool, wait_started
from staleflow.configs import parse_config

from .tiny import TINY

pytestmark = pytest.mark.integration


def test_scaling_back_up_keeps_retiring_workers_before_starting_new_ones(ray_local, redis_url):
    pool = WorkerPool(parse_config(TINY), "pool", redis_url)
    try:
        for _ in range(2):
            pool.add()
        wait_started({"rollout workers": [s.handle for s in pool.slots]}, 300)
        first, second = pool.slots
        second.busy = ray.put("a batch in flight")  # (what run_batch sets; not awaited here)

        pool.scale(1)  # the busy worker retires when its batch ends, the idle one stays
        assert pool.slots == [first, second]
        assert second.retiring
        assert pool.active == [first]

        pool.scale(2)  # back up: the retiring worker stays, no new engine starts
        assert pool.slots == [first, second]
        assert not second.retiring
        assert pool._next_index == 2

        pool.scale(1)
        pool.scale(3)  # one kept, one new
        assert [s.index for s in pool.active] == [0, 1, 2]
        assert pool._next_index == 3

        second.busy = None
        pool.scale(1)  # idle workers go at once
        assert [s.index for s in pool.slots] == [0]
    finally:
        for slot in list(pool.slots):
            pool.remove(slot)
