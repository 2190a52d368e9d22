"""Held-out evaluations in flight: each runs on a rollout worker with one published version,
next to the training (run.eval_every), and one that failed is retried once, unless its error
would only repeat (the task's data, its reward function, a prompt too long)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Evaluations"]

logger = logging.getLogger(__name__)


@dataclass
class Evaluations:
    """Evaluations of `prompts` held-out prompts running on `pool` (cluster.placement).
    `on_lost(slot)` is told of a worker that died in one (or was killed as hung), before its
    retry is placed: the driver replaces it there (Driver._worker_lost_in_evaluation)."""

    pool: Any
    prompts: int
    running: list[tuple[Any, int, Any]] = field(default_factory=list)  # (ref, step, slot)
    on_lost: Callable[[Any], None] = lambda slot: None
    _hung: set[Any] = field(default_factory=set)  # refs whose worker was killed as hung
    _retried: set[int] = field(default_factory=set)

    def start(self, step: int, weights: Any, avoid: Any = None) -> None:
        """Evaluate `weights` (the version of `step`) on a live worker with the fewest calls
        in flight, the first such (other than `avoid`, the one a failed attempt ran on, if
        there is another): an idle one if any, so no rollout part waits behind it."""
        others = [s for s in self.pool.active if s is not avoid] or self.pool.active
        slot = min(others, key=lambda s: len(s.queue))
        self.running.append((self.pool.evaluate(slot, weights, self.prompts), step, slot))

    def check_hung(self, limit: float, now: float) -> None:
        """Kill the worker of an evaluation that has run longer than `limit` s (from when
        the calls before it on its worker ended), as a hung batch's (Rollouts.check_hung):
        its call then fails, the worker is replaced (`on_lost`) and the evaluation retried
        once, on another worker if there is one."""
        import ray

        for ref, step, slot in self.running:
            ran = None if ref in self._hung else slot.overdue(ref, limit, now)
            if ran is None:
                continue
            logger.warning(
                "rollout worker %d: the evaluation of step %d has run %.0f s "
                "(rollout.batch_timeout_s=%g): killing it as hung", slot.index, step, ran, limit,
            )  # fmt: skip
            self._hung.add(ref)
            ray.kill(slot.handle)  # (again, if the worker was dropped already: no matter)

    @property
    def refs(self) -> list[Any]:
        return [ref for ref, _, _ in self.running]

    @property
    def versions(self) -> set[int]:
        """The versions evaluations in flight use (their weights must stay published)."""
        return {step for _, step, _ in self.running}

    def finished(self, ref: Any, published: dict[int, Any]) -> tuple[int, Any | None]:
        """An evaluation's call returned: (its step, its report), or (step, None) if it
        failed; then it runs once more on a live worker, if its version is still in
        `published` and it was not retried before."""
        import ray

        step, slot = next((s, w) for r, s, w in self.running if r == ref)
        self.running = [entry for entry in self.running if entry[0] != ref]
        killed = ref in self._hung  # (it may have ended just before the kill: still lost)
        self._hung.discard(ref)
        self.pool.ended(slot, ref)  # (a retiring worker with nothing left is removed)
        from staleflow.actors.tasks import TaskError
        from staleflow.actors.worker import PromptTooLongError, RewardError
        from staleflow.cluster.failures import remote_cause

        try:
            report = ray.get(ref)
            if report.policy_version != step:  # (a worker refuses this; never record it)
                raise RuntimeError(
                    f"the evaluation of step {step} ran on weights v{report.policy_version}"
                )
            if killed:
                self.on_lost(slot)
            return step, report
        except Exception as exc:  # its worker died, or the evaluation itself failed
            # The weights it holds are unknown (a load may have failed partway): whatever
            # runs on it next loads its version first.
            self.pool.version_unknown(slot)
            died = isinstance(exc, ray.exceptions.RayActorError) and not isinstance(
                exc,
                ray.exceptions.ActorUnavailableError,  # (transient: it may come back)
            )
            if killed or died:
                self.on_lost(slot)  # replaced before the retry is placed
            shown = remote_cause(exc)
            repeats = isinstance(shown, TaskError | RewardError | PromptTooLongError)
            weights = published.get(step)
            retry = (
                not repeats and step not in self._retried and weights is not None
                and bool(self.pool.active)
            )  # fmt: skip
            first = (str(shown).strip().splitlines() or [""])[0]
            logger.warning("evaluation at step %d failed: %s: %s%s", step, type(shown).__name__,
                           first, "; retrying" if retry else "; skipped")  # fmt: skip
            self._retried.add(step)
            if retry:
                self.start(step, weights, avoid=slot)
            return step, None
