"""Failures that stop a run cleanly, in a module of their own so the driver and the CLI can
name them without importing Ray (cluster/placement.py raises them)."""

from __future__ import annotations

import logging
import re

__all__ = [
    "BatchStalled",
    "ClusterUnreachable",
    "LearnerFailed",
    "RayStartError",
    "rank_error",
    "remote_cause",
]

logger = logging.getLogger(__name__)
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


class ClusterUnreachable(RuntimeError):
    """`--address` names no Ray cluster this process can join (nothing has started yet)."""


class RayStartError(RuntimeError):
    """The run's own Ray refused to start (e.g. an object store larger than the machine's
    memory); the message says which setting to change."""


class BatchStalled(RuntimeError):
    """The schedule cannot go on: a lock-step batch was pushed whole, yet the learner could
    not take it (its groups were refused or dropped by the buffer, or taken by another
    consumer), or no async batch may start and the buffer holds less than a step (the message
    says which)."""


class LearnerFailed(RuntimeError):
    """A learner rank died or raised (in a step, a publish, a checkpoint, ...): the ranks
    share one process group, so the run stops; its last checkpoint and the groups held since
    are what `train --resume` continues from."""


def remote_cause(exc: BaseException) -> BaseException:
    """What an actor raised, out of the RayTaskError that Ray's `get` raises for it (its
    `cause`); `exc` itself for anything else (an actor that died, a timeout)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def rank_error(exc: BaseException) -> str:
    """A learner rank's failure in one line: the exception the rank raised (Ray wraps it in
    the remote traceback, with terminal colours), or how the rank died. The whole of Ray's
    text goes to the driver's log."""
    logger.info("a learner rank failed; as Ray reports it:\n%s", _COLOUR.sub("", str(exc)))
    shown = remote_cause(exc)
    return _COLOUR.sub("", f"{type(shown).__name__}: {shown}")
