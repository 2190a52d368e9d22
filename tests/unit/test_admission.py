"""Admission (cluster.schedule.Schedule) and the one staleness rule (buffer.staleness),
checked against an event simulation of workers that finish in any order."""

from __future__ import annotations

import heapq
import random
from collections import deque

import pytest

from staleflow.buffer.staleness import trainable
from staleflow.cluster.schedule import (
    Flow,
    Schedule,
    ScheduleError,
    async_least_lag,
    check_schedule,
)
from staleflow.configs import parse_config

BASE = """
model: {preset: tiny}
task: {name: digits, chat_template: false, eval_prompts: 0}
rollout: {num_workers: 3, prompts_per_batch: 2, group_size: 2}
sync: {mode: async}
"""


def config(*overrides: str):
    return parse_config(BASE, list(overrides))


def test_the_staleness_rule():
    # lag = trained_at - policy_version; trainable iff lag <= bound (None: no bound)
    assert trainable(3, 5, 2)  # lag 2 <= 2
    assert not trainable(3, 6, 2)  # lag 3 > 2
    assert trainable(0, 1000, None)
    assert trainable(4, 4, 0)  # on-policy


def test_async_least_lag():
    # I - 1 + (G - gcd(P, G) + P - 1) // G
    assert async_least_lag(1, 8, 8) == 0  # (8 - 8 + 7) // 8 = 0
    assert async_least_lag(1, 8, 4) == 1  # (4 - 4 + 7) // 4 = 1
    assert async_least_lag(1, 2, 3) == 1  # (3 - 1 + 1) // 3 = 1: a batch spans two steps
    assert async_least_lag(3, 4, 8) == 2  # 2 + (8 - 4 + 3) // 8 = 2
    with pytest.raises(ScheduleError, match="at least 1"):
        check_schedule(config("learner.groups_per_step=3", "buffer.max_staleness=0"))


def test_async_needs_room_for_a_step_and_a_batch():
    # P=2, G=3: up to G - gcd(2, 3) = 2 groups can wait while no batch fits; room 3 + 2 - 1
    with pytest.raises(ScheduleError, match="at least 4"):
        check_schedule(config("learner.groups_per_step=3", "buffer.capacity=3"))
    check_schedule(config("learner.groups_per_step=3", "buffer.capacity=4"))


def test_lockstep_runs_one_batch_at_a_time_once_its_version_is_published():
    s = Schedule(config("sync.mode=lockstep", "sync.interval=1", "sync.offset=1"))
    flow = Flow(published={0}, latest=0)
    assert s.next_batch(flow) == 0  # v(1) = 0
    flow.batches, flow.running = 1, {1: (0, 2)}
    assert s.next_batch(flow) is None  # batch 1 still running
    flow.running, flow.batches_done = {}, 1
    assert s.next_batch(flow) == 0  # v(2) = 0 with O = 1
    flow.batches = 2
    assert s.next_batch(flow) is None  # v(3) = 1 is not published yet
    flow.published, flow.latest = {0, 1}, 1
    assert s.next_batch(flow) == 1


class LatestOnly(Schedule):
    """The rule before out-of-order finishing was handled: only the new batch's version."""

    def admits(self, flow: Flow, version: int) -> bool:
        return super().admits(Flow(**{**flow.__dict__, "running": {}}), version) and (
            flow.trained + flow.untrained() < self.cfg.run.steps * self.G
        )


def simulate(
    schedule: Schedule, seed: int, workers: int, invalid: set[int] = frozenset()
) -> tuple[list[int], int, int]:
    """Workers take 1-6 time units per batch (so they finish in any order), the learner 1-2
    per step; FIFO buffer, publish every I steps. The first group of each batch numbered in
    `invalid` is dropped (as the buffer drops an invalid one); the learner's take drops
    groups past the staleness rule, as the buffer does, and a stall starts the batch
    `Schedule.unstall` allows, as the driver does. Returns every trained group's lag and
    the steps done and the groups dropped stale."""
    rng = random.Random(seed)
    bound = schedule.cfg.buffer.max_staleness
    steps, G, P = schedule.cfg.run.steps, schedule.G, schedule.P
    flow = Flow(published={0}, latest=0)
    fifo: deque[int] = deque()  # policy versions of pushed, untaken groups
    events: list[tuple[float, int, str, int]] = []  # (time, order, kind, batch)
    idle, now, order, lags, stale = workers, 0.0, 0, [], 0
    learning: list[int] | None = None
    while flow.steps < steps:
        while idle and (v := schedule.next_batch(flow)) is not None:
            flow.batches += 1
            flow.running[flow.batches] = (v, P)
            idle -= 1
            order += 1
            heapq.heappush(events, (now + rng.uniform(1, 6), order, "batch", flow.batches))
        if learning is None:
            while fifo and not trainable(fifo[0], flow.steps, bound):
                fifo.popleft()  # the buffer drops it stale as the learner takes
                flow.dropped += 1
                stale += 1
            if len(fifo) >= G:
                learning = [flow.steps - fifo.popleft() for _ in range(G)]
                order += 1
                heapq.heappush(events, (now + rng.uniform(1, 2), order, "step", 0))
        if not events and idle and (v := schedule.unstall(flow)) is not None:
            flow.batches += 1
            flow.running[flow.batches] = (v, P)
            idle -= 1
            order += 1
            heapq.heappush(events, (now + rng.uniform(1, 6), order, "batch", flow.batches))
        if not events:
            break  # stalled
        now, _, kind, batch = heapq.heappop(events)
        if kind == "batch":
            version, groups = flow.running.pop(batch)
            fifo.extend([version] * (groups - (batch in invalid)))
            flow.pushed += groups
            flow.dropped += batch in invalid
            flow.batches_done += 1
            idle += 1
        else:
            assert learning is not None
            lags.extend(learning)
            learning = None
            flow.steps += 1
            flow.trained += G
            if schedule.publishes_after(flow.steps):
                flow.published.add(flow.steps)
                flow.latest = flow.steps
    return lags, flow.steps, stale


@pytest.mark.parametrize(
    ("bound", "interval", "groups_per_step", "workers"),
    [(1, 1, 2, 3), (2, 1, 2, 3), (1, 1, 4, 4), (3, 2, 2, 5), (2, 1, 3, 3)],
)
def test_async_admission_never_starts_a_batch_that_would_be_dropped(
    bound, interval, groups_per_step, workers
):
    cfg = config(
        f"buffer.max_staleness={bound}",
        f"sync.interval={interval}",
        f"learner.groups_per_step={groups_per_step}",
        "run.steps=40",
    )
    for seed in range(30):
        lags, done, stale = simulate(Schedule(cfg), seed, workers)
        assert done == 40, f"seed {seed}: stalled after {done} steps"
        assert stale == 0, f"seed {seed}: {stale} groups generated only to be dropped stale"
        assert max(lags) <= bound


def test_the_simulation_catches_the_rule_that_ignored_running_batches():
    # Admitting on the new batch's version alone: a batch that started earlier and finishes
    # later is pushed back behind the new one and trained beyond the bound.
    cfg = config("buffer.max_staleness=1", "run.steps=40")
    assert sum(simulate(LatestOnly(cfg), seed, 3)[2] for seed in range(30)) > 0


@pytest.mark.parametrize(
    ("bound", "groups_per_step", "prompts"), [(0, 2, 2), (0, 4, 4), (1, 2, 4), (2, 2, 6)]
)
def test_an_async_run_short_of_groups_after_a_drop_finishes_instead_of_stalling(
    bound, groups_per_step, prompts
):
    # With batches that fill steps exactly, one dropped group leaves every later step a group
    # short: each batch would straddle two steps, and admission refuses any batch whose
    # groups would pass the bound, so nothing could start (the driver raised "stalled").
    # unstall starts one anyway; its late groups are dropped stale and the steps line up.
    cfg = config(
        f"buffer.max_staleness={bound}",
        f"learner.groups_per_step={groups_per_step}",
        f"rollout.prompts_per_batch={prompts}",
        "run.steps=30",
    )
    for seed in range(20):
        lags, done, stale = simulate(Schedule(cfg), seed, workers=3, invalid={3, 11})
        assert done == 30, f"seed {seed}: stalled after {done} steps"
        assert max(lags) <= bound
        # each drop costs at most one straddling batch's late groups
        assert stale <= 2 * prompts, f"seed {seed}: {stale} dropped stale"
    # without unstall the same runs stop short
    assert simulate(NoUnstall(cfg), 0, workers=3, invalid={3})[1] < 30


class NoUnstall(Schedule):
    def unstall(self, flow: Flow) -> int | None:
        return None
