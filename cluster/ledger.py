"""What a run did with its groups and its time: the driver's counts, the per-step timeline and
the reconciliation against the buffer's own counters (`summary.json`, "groups")."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Counts", "Timeline", "accuracy_fields", "reconcile"]


@dataclass
class Counts:
    """Groups as the driver heard of them from the learner's reports (acked, dropped by
    reason) and time spent; what the schedule needs (pushed, batches) is in cluster.schedule's
    Flow."""

    trained: int = 0  # acked by the buffer
    dropped_stale: int = 0
    dropped_invalid: int = 0
    rollout_s: float = 0.0  # summed over workers: generation time
    learner_s: float = 0.0  # the learner's steps (forward, backward, optimizer)
    # run time from the first step's start, and the worker-seconds the pool had in it (each
    # interval at the worker count it had), up to the last step or scale: the busy fractions'
    # denominators, kept across a resume as learner_s and rollout_s are
    wall_s: float = 0.0
    worker_s: float = 0.0

    def catch_up_drops(self, stats: Any) -> int:
        """Take the buffer's drop counts (`stats`, BufferStats), which are final: after a
        resume, those made since the checkpoint count too. Returns how many more there are."""
        extra = (stats.dropped_stale - self.dropped_stale) + (
            stats.dropped_invalid - self.dropped_invalid
        )
        self.dropped_stale, self.dropped_invalid = stats.dropped_stale, stats.dropped_invalid
        return extra


@dataclass
class Timeline:
    """Where the time between two learner steps went (seconds; metrics.jsonl `time_*`).

    take / step / ack / publish are measured inside the learner call; `load` and `gap` are
    summed over workers since the previous step (weights loading at batch boundaries, idle
    workers waiting to be dispatched); `other` is the rest of the interval: the driver's
    round trips and, when the learner waited, nothing to do."""

    last: float = field(default_factory=time.monotonic)
    load_s: float = 0.0
    gap_s: float = 0.0
    publish_s: float = 0.0  # a broadcast publish, made by the driver after the step

    def close_step(self, learner: dict[str, float]) -> dict[str, float]:
        now = time.monotonic()
        interval = now - self.last
        parts = {k: learner.get(k, 0.0) for k in ("take_s", "step_s", "ack_s", "publish_s")}
        parts["publish_s"] += self.publish_s
        out = {f"time_{k}": v for k, v in parts.items()}
        out.update(
            time_interval_s=interval,
            time_other_s=max(0.0, interval - sum(parts.values())),
            time_load_s=self.load_s,
            time_gap_s=self.gap_s,
        )
        self.last, self.load_s, self.gap_s, self.publish_s = now, 0.0, 0.0, 0.0
        return out


def reconcile(stats: Any, c: Counts, flow: Any, elapsed: float) -> dict[str, Any]:
    """pushed = trained + dropped (stale, invalid) + left in the buffer, by both counts.

    Each pushed group counts once: `trained` counts groups trained at least once (replays
    are in `trainings`), the drops count groups dropped before any training, and `left`
    groups not trained yet. With replay sampling a replay (trained before) that is dropped
    or handed out counts as trained, and in `replays_dropped`."""
    left = stats.undelivered + stats.pending - stats.replays_pending
    first_trainings = stats.acked - stats.reused
    stale = stats.dropped_stale - stats.replays_dropped_stale
    invalid = stats.dropped_invalid - stats.replays_dropped_invalid
    return {
        "groups": {
            "pushed": stats.pushed,
            "trained": first_trainings,
            "trainings": stats.acked,
            "dropped_stale": stale,
            "dropped_invalid": invalid,
            "left_in_buffer": left,
            "replays_dropped": stats.replays_dropped_stale + stats.replays_dropped_invalid,
            "duplicates": stats.duplicates,
            "reconciled": stats.pushed == first_trainings + stale + invalid + left
            # the learner's reports count every drop, replays too
            and c.trained == stats.acked
            and c.dropped_stale == stats.dropped_stale
            and c.dropped_invalid == stats.dropped_invalid,
        },
        "driver_counts": {
            "trained": c.trained,
            "dropped_stale": c.dropped_stale,
            "dropped_invalid": c.dropped_invalid,
            "pushed_by_finished_batches": flow.pushed,
            # as the schedule counts it: below the buffer's own count by any part of a batch
            # the run stopped before hearing of (pushed, its report not in yet)
            "left_in_buffer": flow.left(),
        },
        "pushed_by_version": stats.pushed_by_version,
        "trained_by_version": stats.trained_by_version,
        "rollout_batches": flow.batches_done,
        "learner_busy": c.learner_s / max(elapsed, 1e-9),
        "rollout_busy_s": c.rollout_s,
    }


def accuracy_fields(accuracy: dict[int, float]) -> dict[str, Any]:
    """The summary's held-out accuracy: at step 0, at the last evaluation, and by step."""
    last = max(accuracy, default=None)
    return {
        "accuracy_before": accuracy.get(0),
        "accuracy_after": accuracy.get(last) if last else None,
        "accuracy_by_step": {str(k): v for k, v in sorted(accuracy.items())},
    }
