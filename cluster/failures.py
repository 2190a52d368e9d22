"""Failures that stop a run cleanly, in a module of their own so the driver and the CLI can
name them without importing Ray (cluster/placement.py raises them)."""

from __future__ import annotations

__all__ = ["ClusterUnreachable", "LearnerFailed"]


class ClusterUnreachable(RuntimeError):
    """`--address` names no Ray cluster this process can join (nothing has started yet)."""


class LearnerFailed(RuntimeError):
    """A learner rank died or raised (in a step, a publish, a checkpoint, ...): the ranks
    share one process group, so the run stops; its last checkpoint and the groups held since
    are what `train --resume` continues from."""
