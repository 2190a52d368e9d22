"""The staleness rule, the one place it is written (docs/architecture.md, "Staleness").

A group made by policy version `policy_version` and trained when the learner is at version
`trained_at` (the number of batches it has trained) has lag `trained_at - policy_version`.
With a bound `max_staleness` (None: no bound), it may be trained iff that lag is at most the
bound. The driver's async admission asks this question for the worst case of a batch it is
about to start; the buffer asks it for every group it is about to hand out, and drops (and
counts) the ones that fail, a safety net that admission keeps empty in FIFO order.
"""

from __future__ import annotations

__all__ = ["lag", "trainable"]


def lag(policy_version: int, trained_at: int) -> int:
    """How many versions behind the learner a group trained at `trained_at` is."""
    return trained_at - policy_version


def trainable(policy_version: int, trained_at: int, max_staleness: int | None) -> bool:
    """The rule: a group may be trained at `trained_at` iff its lag is within the bound."""
    return max_staleness is None or lag(policy_version, trained_at) <= max_staleness
