"""The sync schedule: which rollout batch may start now, with which policy version, and when the
learner steps and publishes (docs/algorithms.md section 6, docs/architecture.md "The schedule").

One version counter: the policy version is the number of learner steps (batches) done.
With sync interval I and offset O, lock-step rollout batch e (1-based) is generated with

    v(e) = I * max(0, floor((e - O - 1) / I))

and learner step t trains on batch t, at lag(t) = (t - 1) - v(t), whatever the relative speeds
and whatever `mini_batches` / `epochs` do inside a step. In async mode a batch starts with the
newest published version on any idle worker, if the staleness rule (buffer.staleness) holds
for it and for every batch already running in the worst order they can finish in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from staleflow.buffer.staleness import trainable
from staleflow.configs.loader import ConfigError

__all__ = [
    "Flow",
    "Schedule",
    "ScheduleError",
    "async_least_lag",
    "check_schedule",
    "groups_per_step",
    "lag",
    "rollout_version",
]


class ScheduleError(ConfigError):
    """A config whose schedule cannot run (e.g. a staleness bound the schedule must exceed)."""


def rollout_version(batch: int, interval: int, offset: int) -> int:
    """v(e): the policy version rollout batch `batch` (1-based) must be generated with."""
    if batch < 1:
        raise ValueError(f"batches are numbered from 1, got {batch}")
    if interval < 1 or offset < 0:
        raise ValueError(f"need sync interval >= 1 and offset >= 0, got I={interval}, O={offset}")
    return interval * max(0, (batch - offset - 1) // interval)


def lag(step: int, interval: int, offset: int) -> int:
    """lag(t) = (t - 1) - v(t): how many versions behind the data of learner step `step` is."""
    return (step - 1) - rollout_version(step, interval, offset)


def groups_per_step(cfg: Any) -> int:
    return int(cfg.learner.groups_per_step or cfg.rollout.prompts_per_batch)


@dataclass
class Flow:
    """The driver's view of the groups, in counts only (it never sees group data)."""

    steps: int = 0  # learner steps done = the learner's policy version
    published: set[int] = field(default_factory=set)  # versions workers can load now
    latest: int = -1  # newest published version
    batches: int = 0  # rollout batches started
    batches_done: int = 0  # ... and finished (every shard pushed)
    running: dict[int, tuple[int, int]] = field(default_factory=dict)  # batch -> (version, groups)
    pushed: int = 0  # groups pushed by finished batches (and finished parts of running ones)
    # running batch -> groups its finished parts added to `pushed`: a resume redoes the whole
    # batch, whose parts report those groups again
    partial: dict[int, int] = field(default_factory=dict)
    trained: int = 0  # trainings (with sampling: replay, a group trained again counts again)
    dropped: int = 0  # drops, replays among them
    replayed: int = 0  # of the trainings, those of groups trained before (sampling: replay)
    replays_dropped: int = 0  # of the drops, those of groups trained before

    def untrained(self) -> int:
        """Groups pushed or being generated that no step has trained or dropped yet."""
        return self.left() + sum(g for _, g in self.running.values())

    def left(self) -> int:
        """Groups pushed that no step has trained or dropped yet (a replay trained or dropped
        is not one of them: it was trained when first taken)."""
        first = (self.trained - self.replayed) + (self.dropped - self.replays_dropped)
        return self.pushed - first

    def count_step(self, groups: int, replays: int) -> None:
        """A learner step trained `groups`, `replays` of them trained before."""
        self.steps += 1
        self.trained += groups
        self.replayed += replays

    def count_drops(self, dropped: int, replays: int) -> None:
        """The buffer dropped `dropped` groups (stale or invalid), `replays` of them trained
        before."""
        self.dropped += dropped
        self.replays_dropped += replays


@dataclass
class Schedule:
    """The rules, as questions the driver asks whenever something finished."""

    cfg: Any

    def __post_init__(self) -> None:
        check_schedule(self.cfg)
        self.P, self.G = self.cfg.rollout.prompts_per_batch, groups_per_step(self.cfg)
        self.I, self.O = self.cfg.sync.interval, self.cfg.sync.offset
        self.lockstep = self.cfg.sync.mode == "lockstep"

    def next_batch(self, flow: Flow) -> int | None:
        """The version the next rollout batch must use, or None if none may start now.
        Lock-step batches run one at a time (split over every worker); async ones one per
        idle worker."""
        if self.lockstep:
            e = flow.batches + 1
            v = rollout_version(e, self.I, self.O) if e <= self.cfg.run.steps else None
            ahead = (flow.batches - flow.steps + 1) * self.P  # unconsumed batches, new one too
            ok = not flow.running and ahead <= self.cfg.buffer.capacity
            return v if ok and v in flow.published else None
        return flow.latest if self.admits(flow, flow.latest) else None

    def admits(self, flow: Flow, version: int) -> bool:
        """async: may a batch of P groups start at `version` now? Batches can finish in any
        order, so the worst case puts every group pushed or running, and this batch, before
        the last group of any running batch: that group is trained at version
        steps + ceil(total / G) - 1 (the step in flight, if any, is `steps`'s). The rule must
        hold for the oldest version running, or that batch would be dropped as stale."""
        if flow.trained + flow.untrained() >= self.cfg.run.steps * self.G:
            return False  # the remaining steps are covered: this batch would not be trained
        total = flow.untrained() + self.P
        if total > self.cfg.buffer.capacity:
            return False
        trained_at = flow.steps + -(-total // self.G) - 1
        oldest = min([version, *(v for v, _ in flow.running.values())])
        return trainable(oldest, trained_at, self.cfg.buffer.max_staleness)

    def unstall(self, flow: Flow) -> int | None:
        """async, when nothing runs and fewer than G groups are stored (some were dropped, e.g.
        invalid), so no step can run, and `admits` refuses every batch because some of its
        groups would be trained too late: the version to start one at anyway, or None if
        that cannot help (no room in the buffer, or no step left short). Its groups past the
        staleness rule are dropped stale when the learner takes them, and the steps line up
        with the batches again; without it the run could never finish."""
        if self.lockstep or flow.running or flow.untrained() >= self.G:
            return None
        if flow.trained + flow.untrained() >= self.cfg.run.steps * self.G:
            return None
        if flow.untrained() + self.P > self.cfg.buffer.capacity:
            return None
        return flow.latest

    def may_step(self, flow: Flow) -> bool:
        """Whether to call the learner now: lock-step once batch t (its data) has started, so
        the learner takes the groups the moment they land; async whenever it is idle."""
        return flow.batches > flow.steps if self.lockstep else True

    def publishes_after(self, step: int) -> bool:
        return step % self.I == 0 or step == self.cfg.run.steps

    def check_lag(self, step: int, lag_min: float, lag_max: float) -> int:
        """Lock-step: the lag every group of learner step `step` has by the formula above;
        raises if the step's groups (their lag from lag_min to lag_max) had another."""
        expected = lag(step, self.I, self.O)
        if not lag_min == lag_max == expected:
            raise RuntimeError(
                f"lockstep step {step}: lag {lag_min}..{lag_max} but the schedule says {expected}"
            )
        return expected

    def versions_needed(self, flow: Flow) -> set[int]:
        """Published versions a rollout batch may still ask for."""
        keep = {flow.latest}
        if self.lockstep and flow.batches < self.cfg.run.steps:
            keep.add(rollout_version(flow.batches + 1, self.I, self.O))
        return keep


def async_least_lag(interval: int, batch: int, per_step: int) -> int:
    """The largest lag async FIFO training forces even when every batch starts with the
    newest weights: up to I - 1 from publishing every I steps, plus the steps a batch of P
    groups spans when it starts r groups into a step of G (r is a multiple of gcd(P, G),
    at most G - gcd(P, G))."""
    r = per_step - math.gcd(batch, per_step)
    return interval - 1 + (r + batch - 1) // per_step


def idle_workers_warning(cfg: Any, workers: int) -> str | None:
    """Lock-step splits each rollout batch over the workers, one batch at a time: workers
    beyond rollout.prompts_per_batch never get a prompt. Said, not refused."""
    per_batch = cfg.rollout.prompts_per_batch
    if cfg.sync.mode != "lockstep" or workers <= per_batch:
        return None
    return (
        f"{workers} rollout workers, but lock-step splits each batch of {per_batch} prompts "
        f"over them: {workers - per_batch} will stay idle (raise rollout.prompts_per_batch, "
        "or use sync.mode: async, where each worker runs batches of its own)"
    )


def check_schedule(cfg: Any) -> None:
    """Reject schedules that would starve the learner or drop data by construction."""
    sync, buf, steps = cfg.sync, cfg.buffer, cfg.run.steps
    per_step = groups_per_step(cfg)
    if sync.mode == "lockstep":
        if per_step != cfg.rollout.prompts_per_batch:
            raise ScheduleError(
                f"lockstep trains one rollout batch per step: learner.groups_per_step "
                f"({per_step}) must equal rollout.prompts_per_batch "
                f"({cfg.rollout.prompts_per_batch}) or be left null"
            )
        if buf.sampling != "fifo":
            raise ScheduleError(
                f"lockstep needs buffer.sampling: fifo (got {buf.sampling}); the other "
                "orders would break the exact lag schedule, use sync.mode: async for them"
            )
        # lag(t) = t - 1 up to step O, then cycles O .. O + I - 1: the largest is reached
        # by step O + I, so a run of millions of steps is checked in O + I evaluations.
        last = min(steps, sync.offset + sync.interval)
        worst = max(lag(t, sync.interval, sync.offset) for t in range(1, last + 1))
        if buf.max_staleness is not None and buf.max_staleness < worst:
            raise ScheduleError(
                f"buffer.max_staleness={buf.max_staleness} is below the schedule's largest "
                f"lag ({worst}, sync.interval={sync.interval}, sync.offset={sync.offset}); "
                f"raise it to {worst} or set it to null"
            )
    else:
        if sync.offset:
            raise ScheduleError(
                f"sync.offset={sync.offset} only applies to sync.mode: lockstep; in async "
                "mode bound the lag with buffer.max_staleness instead"
            )
        P = cfg.rollout.prompts_per_batch
        least = async_least_lag(sync.interval, P, per_step)
        room = per_step + P - math.gcd(P, per_step)
        if buf.capacity < room:
            raise ScheduleError(
                f"buffer.capacity ({buf.capacity}) is below {room}: async admission could "
                f"stall with fewer than one step's {per_step} groups stored and no room for "
                f"another batch of {P}; raise it to at least {room}"
            )
        if buf.max_staleness is not None and buf.max_staleness < least:
            raise ScheduleError(
                f"buffer.max_staleness={buf.max_staleness} is below {least}, the lag that "
                f"publishing every {sync.interval} step(s) implies; raise it to at least {least}"
            )
    sequences = per_step * cfg.rollout.group_size
    if cfg.learner.mini_batches > sequences:
        # _split would make only `sequences` optimizer steps, while the learning-rate schedule
        # and a resume count mini_batches x epochs of them per learner step
        raise ScheduleError(
            f"learner.mini_batches={cfg.learner.mini_batches} is more than the {sequences} "
            f"sequences of a step ({per_step} groups x rollout.group_size "
            f"{cfg.rollout.group_size}); set it to at most {sequences}"
        )
    if cfg.rollout.prompts_per_batch > buf.capacity:
        raise ScheduleError(
            f"buffer.capacity ({buf.capacity}) must hold one rollout batch "
            f"({cfg.rollout.prompts_per_batch} groups)"
        )
