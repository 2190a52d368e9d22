"""The lock-step sync schedule (docs/algorithms.md section 6; design.md section 3).

With sync interval I and sync offset O, rollout batch e (1-based) is generated with policy
version

    v(e) = I * max(0, floor((e - O - 1) / I))

(rollout may run O batches ahead before its first sync; afterwards it syncs every I batches and
the learner publishes every I steps). With one rollout batch per learner step, learner step t
trains on data of lag(t) = (t - 1) - v(t). The driver enforces v(e) in lock-step mode, so the
measured lag of every step equals the formula whatever the relative speeds.
"""

from __future__ import annotations

__all__ = ["lag", "rollout_version"]


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
