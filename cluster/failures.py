"""Failures that stop a run cleanly, in a module of their own so the driver and the CLI can
name them without importing Ray (cluster/placement.py raises them)."""

from __future__ import annotations

__all__ = ["LearnerFailed"]


class LearnerFailed(RuntimeError):
    """A learner rank died or raised (in a step, a publish, a checkpoint, ...): the ranks
    share one process group, so the run stops; its last checkpoint and the groups held since
    are what `train --resume` continues from."""
