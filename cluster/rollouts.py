"""The rollout batches in flight on the worker pool, and their faults (docs/architecture.md,
"Faults and resume").

The driver decides which batch runs with which policy version (cluster.schedule); this module
splits a batch over worker slots, tells the driver when each part is back, and redoes a part
whose worker died, hung (rollout.batch_timeout_s) or whose engine failed on a fresh worker.
Group ids are fixed per batch and prompt, so redoing a part pushes nothing twice.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Rollouts", "Shard"]

logger = logging.getLogger(__name__)


@dataclass
class Shard:
    """One worker's part of a rollout batch: what redoing it on another worker needs."""

    slot: Any
    batch: int
    weights: Any  # the published handle the worker loads (it carries its version)
    prompts: list[Any]
    first: int  # index of its first prompt in the batch (fixes the groups' ids)
    attempts: int = 1
    failed_at: float | None = None  # when its last worker failed (recovery time)
    hung: bool = False


@dataclass
class Rollouts:
    """The parts of rollout batches running on `pool` (cluster.placement.WorkerPool).

    `on_fault(error, batch)` is told of each part redone. `resume_hint` is the command that
    resumes the run, for the error when a part cannot be redone (broadcast sync methods, with
    no live worker holding its version). With broadcast methods `on_lost()` is told of each
    worker lost, which a new one replaces at the next publish (the driver's job)."""

    cfg: Any
    pool: Any
    broadcasts: bool  # sync.method nccl/gloo: a new engine gets weights only at a publish
    resume_hint: str
    on_fault: Callable[[str, int], None]
    on_lost: Callable[[], None] = lambda: None
    shards: dict[Any, Shard] = field(default_factory=dict)  # ref of the call -> its part
    _open: dict[int, int] = field(default_factory=dict)  # batch -> parts still running
    # batch -> its finished parts' reward errors, responses and first error, added up
    _rewards: dict[int, tuple[int, int, str | None]] = field(default_factory=dict)

    def start(
        self,
        slots: list[Any],
        batch: int,
        weights: Any,
        prompts: list[Any],
        since: float = -math.inf,
    ) -> float:
        """Split `prompts` over `slots` and start each part with `weights` (a published
        version); returns the seconds the slots had been idle since `since` (the timeline's
        dispatch gap: the current interval's start; what came before was counted in the
        interval it fell in, `idle_seconds`)."""
        parts = np.array_split(np.arange(len(prompts)), len(slots))
        now, gap = time.monotonic(), 0.0
        for slot, part in zip(slots, parts, strict=False):
            if len(part) == 0:
                continue
            if not slot.busy:  # (a lock-step part may queue behind an evaluation)
                gap += max(0.0, now - max(slot.idle_since, since))
            self._run(Shard(slot, batch, weights, [prompts[i] for i in part], int(part[0])))
            self._open[batch] = self._open.get(batch, 0) + 1
        return gap

    def idle_seconds(self, since: float) -> float:
        """Seconds the pool's idle workers have waited since `since` (a step's close: their
        wait until then belongs to the interval that ends)."""
        now = time.monotonic()
        return sum(max(0.0, now - max(s.idle_since, since)) for s in self.pool.active if not s.busy)

    def _run(self, shard: Shard) -> None:
        ref = self.pool.run_batch(shard.slot, shard.weights, shard.prompts,
                                  (shard.batch, shard.first))  # fmt: skip
        self.shards[ref] = shard

    def finished(self, ref: Any) -> tuple[Shard, Any, bool] | None:
        """A part's call returned: (its shard, the worker's report, whether that completed
        the batch), or None if it failed and runs again on another worker (raises if it may
        not: see `_failed`)."""
        import ray

        shard = self.shards.pop(ref)
        try:
            report = ray.get(ref)
        except Exception as exc:
            self._failed(shard, exc)
            return None
        self.pool.ended(shard.slot, ref)  # a retiring worker with nothing left is removed
        if shard.hung:  # killed just as it ended: the part counts, the worker is gone
            self._killed_after_its_end(shard.slot)
        self._open[shard.batch] -= 1
        complete = self._open[shard.batch] == 0
        errors, responses, first = self._rewards.pop(shard.batch, (0, 0, None))
        errors, responses = errors + report.reward_errors, responses + report.responses
        first = first or report.first_reward_error
        if complete:
            del self._open[shard.batch]
            from staleflow.actors.worker import check_reward_errors

            # the batch's parts together (each worker checked its own against the batch)
            check_reward_errors(f"batch {shard.batch}", self.cfg.task.max_reward_errors,
                                errors, responses, first)  # fmt: skip
        else:
            self._rewards[shard.batch] = (errors, responses, first)
        return shard, report, complete

    def _killed_after_its_end(self, slot: Any) -> None:
        """`check_hung` killed `slot`'s worker while its part was ending: replace it as a
        dead one (broadcast methods: forget it, a new one joins at the next publish, which
        would otherwise include the dead member and fail). Calls queued on it fail and are
        redone as any other's (`_failed`)."""
        if slot not in self.pool.slots:
            return
        logger.warning("rollout worker %d was killed as hung as its batch part ended: "
                       "replacing it", slot.index)  # fmt: skip
        if self.broadcasts:
            self.pool.drop(slot)
            if not slot.retiring:
                self.on_lost()
            return
        self.pool.replace(slot)

    def _failed(self, shard: Shard, exc: BaseException) -> None:
        """A worker died, hung or raised: replace it (unless it was replaced already) and
        redo its part of the batch, unless the error would only repeat (a reward function, a
        full buffer, a prompt too long for the model) or the part failed
        rollout.max_restarts times already. Broadcast methods redo it on a member instead
        (`_redo_on_a_member`)."""
        from staleflow.actors.worker import PromptTooLongError, RewardError
        from staleflow.buffer.replay import BufferFullError
        from staleflow.cluster.failures import remote_cause

        cause = remote_cause(exc)
        what = "hung" if shard.hung else f"failed: {type(cause).__name__}: {cause}"
        where = f"rollout worker {shard.slot.index} (batch {shard.batch})"
        if isinstance(cause, RewardError | BufferFullError | PromptTooLongError):
            raise cause  # it would only fail again
        restarts = self.cfg.rollout.max_restarts
        if shard.attempts > restarts:
            raise RuntimeError(
                f"{where} {what}; it was redone {shard.attempts - 1} time(s) already "
                f"(rollout.max_restarts={restarts})"
            ) from exc
        if self.broadcasts:
            self._redo_on_a_member(shard, where, what, exc)
            return
        if shard.slot in self.pool.slots:
            logger.warning("%s %s; replacing it and redoing its %d prompt(s)", where, what,
                           len(shard.prompts))  # fmt: skip
            shard.slot = self.pool.replace(shard.slot)
        else:  # replaced already (it died in a call ahead of this part): not once more
            shard.slot = min(self.pool.active, key=lambda s: (len(s.queue), s.idle_since))
            logger.warning("%s %s; it was replaced already: redoing its %d prompt(s) on rollout "
                           "worker %d", where, what, len(shard.prompts),
                           shard.slot.index)  # fmt: skip
        shard.attempts += 1
        shard.hung = False
        shard.failed_at = shard.failed_at or time.monotonic()
        self._run(shard)
        self.on_fault(what, shard.batch)

    def _redo_on_a_member(self, shard: Shard, where: str, what: str, exc: BaseException) -> None:
        """Broadcast methods: a new engine gets weights only at a publish, so the part is
        redone on a live worker of the broadcast group, which holds the part's version (every
        member holds the last one broadcast, and a publish waits for every shard in flight,
        a retiring worker's too: Driver._wait_for_members). It is queued behind that
        worker's own part if it has one. The lost worker is replaced at the next publish
        (`on_lost`)."""
        lost = shard.slot
        self.pool.drop(lost)
        version = shard.weights.version
        members = [s for s in self.pool.active if s.version == version]
        if not members:
            raise RuntimeError(
                f"{where} {what}. With sync.method {self.cfg.sync.method} a new engine gets "
                f"weights only at a publish, and no other worker holds v{version}, so the "
                f"batch cannot be redone in this run; resume it: {self.resume_hint}"
            ) from exc
        slot = min(members, key=lambda s: (len(s.queue), s.idle_since))
        logger.warning(
            "%s %s; redoing its %d prompt(s) on rollout worker %d, which holds v%d (with "
            "sync.method %s a new engine gets weights only at a publish: one joins at the next)",
            where, what, len(shard.prompts), slot.index, version, self.cfg.sync.method,
        )  # fmt: skip
        shard.slot = slot
        shard.attempts += 1
        shard.hung = False
        shard.failed_at = shard.failed_at or time.monotonic()
        self._run(shard)
        if not lost.retiring:
            self.on_lost()
        self.on_fault(what, shard.batch)

    def check_hung(self) -> None:
        """Kill the worker of a part that has run longer than rollout.batch_timeout_s (from
        when the calls before it on its worker ended): its call then fails like a dead
        worker's, and the part is redone elsewhere."""
        import ray

        limit = self.cfg.rollout.batch_timeout_s
        now = time.monotonic()
        for ref, shard in self.shards.items():
            ran = None if shard.hung else shard.slot.overdue(ref, limit, now)
            if ran is None:
                continue
            logger.warning(
                "rollout worker %d: batch %d has run %.0f s (rollout.batch_timeout_s=%g): "
                "killing it as hung", shard.slot.index, shard.batch, ran, limit,
            )  # fmt: skip
            shard.hung = True
            shard.failed_at = now
            ray.kill(shard.slot.handle)

    def check_started(self) -> None:
        """StartTimeout when a worker given a part (one that replaced a lost worker, or was
        added by `staleflow scale`) has not started within run.start_timeout_s: no node has
        room for it (its node was lost), or its model load hangs. Its part would otherwise
        wait for rollout.batch_timeout_s and be redone on another new worker that cannot
        start either, rollout.max_restarts times: hours."""
        import ray

        from staleflow.cluster.placement import StartTimeout, cluster_room

        limit = self.cfg.run.start_timeout_s
        now = time.monotonic()
        for shard in list(self.shards.values()):
            slot = shard.slot
            if slot.ready is None:
                continue
            done, _ = ray.wait([slot.ready], timeout=0)
            if done:  # started (a constructor that failed fails the part's own call)
                slot.ready = None
            elif now - slot.added > limit:
                raise StartTimeout(
                    f"rollout worker {slot.index}, started during the run for batch "
                    f"{shard.batch}, did not start within {limit:g} s (run.start_timeout_s); "
                    f"{cluster_room()}: a worker that fits on no node (its node was lost) "
                    "waits for resources. Add a node or lower rollout.num_workers, "
                    f"then resume: {self.resume_hint}"
                )

    def abandon(self) -> None:
        """Forget the parts still running and stop every worker: a worker pushes its part
        whole or not at all, and a resume redoes the batches its checkpoint lists as
        running, pushing none of their groups twice."""
        for slot in list(self.pool.slots):
            self.pool.remove(slot)
        self.shards.clear()
        self._open.clear()
