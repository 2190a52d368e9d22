"""The learner's side of the replay buffer: it takes its own batches (the driver never carries
group data) and acks them once the step that used them is committed.

    feed = BatchFeed(buffer, size=G)
    batch = feed.next(version, wait_s)   # G groups trainable at `version`, or None if short
    feed.prefetch(version + 1, wait_s)   # the next batch is read and decoded while this step runs
    ... train on batch.groups ...
    feed.ack(batch)                      # after the optimizer step: the groups are trained
    # or, with checkpoints: feed.hold(batch) after the step, feed.commit() once a
    # checkpoint holds the step (a learner restarted from an older one gets them again)

Only learner rank 0 has a feed; the other ranks receive the same groups from it
(docs/architecture.md, "The data path"). Groups taken but not yet acked stay pending in Redis
under this feed's consumer name, so if the process dies they are reclaimed, never lost. What
`take` dropped on the way (stale, undecodable) is counted and handed to the driver with the
next batch.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from staleflow.buffer.entries import Receipt, Taken
from staleflow.buffer.records import Group
from staleflow.buffer.replay import ReplayBuffer

logger = logging.getLogger(__name__)

__all__ = ["Batch", "BatchFeed"]

_clock = time.perf_counter  # what take_s is measured with


@dataclass
class Batch:
    """G groups for one learner step, with their receipts."""

    groups: list[Group]
    receipts: list[Receipt]
    # what getting them cost the step: waiting for data (in the calls that came back short
    # too), decoding not prefetched
    take_s: float


@dataclass
class BatchFeed:
    buffer: ReplayBuffer
    size: int
    staged: list[Taken] = field(default_factory=list)
    held: list[Receipt] = field(default_factory=list)  # trained, acked at the next commit
    dropped_stale: int = 0  # since the last `drops()`
    dropped_invalid: int = 0
    replays_dropped: int = 0  # of those drops, replays (groups trained before)
    _waited: float = 0.0  # seconds of `next` calls that came back short since the last batch
    _next: Future[float] | None = None
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="staleflow-prefetch")
    )

    def _have(self) -> int:
        return sum(len(t.groups) for t in self.staged)

    def _take(self, version: int, wait_s: float) -> float:
        """Take what is missing of the next batch (waiting up to `wait_s`); seconds spent."""
        start = _clock()
        need = self.size - self._have()
        if need > 0:
            taken = self.buffer.take(need, learner_version=version, timeout_s=wait_s)
            self.dropped_stale += taken.dropped_stale
            self.dropped_invalid += taken.dropped_invalid
            self.replays_dropped += taken.replays_dropped
            if taken.groups:
                self.staged.append(taken)
        return _clock() - start

    def prefetch(self, version: int, wait_s: float) -> None:
        """Start taking the batch for `version` in the background (one at a time)."""
        self._join()
        self._next = self._executor.submit(self._take, version, wait_s)

    def _join(self) -> float:
        if self._next is None:
            return 0.0
        future, self._next = self._next, None
        start = _clock()
        future.result()  # a failed prefetch raises here, in the step that needed it
        return _clock() - start

    def next(self, version: int, wait_s: float) -> Batch | None:
        """The batch for a step at `version`: G groups, or None if fewer arrived within
        `wait_s` (they stay staged for the next call)."""
        spent = self._join() + self._take(version, wait_s)
        if self._have() < self.size:
            self._waited += spent  # the step that gets the data waited this long for it too
            return None
        groups = [g for t in self.staged for g in t.groups]
        receipts = [r for t in self.staged for r in t.receipts]
        self.staged = []
        spent, self._waited = self._waited + spent, 0.0
        return Batch(groups, receipts, take_s=spent)

    def settle(self) -> tuple[int, int, int]:
        """Wait for a prefetch in progress; what was dropped since the last report, as
        `drops`. The run is over: a prefetch that failed (for a step that will not run; what
        it read stays pending in the buffer) is logged, not raised, which turned a completed
        run into a failed one after its final checkpoint."""
        try:
            self._join()
        except Exception as exc:
            logger.warning("the last prefetch (for a step not run) failed: %r", exc)
        return self.drops()

    def ack(self, batch: Batch) -> int:
        """Ack a trained batch; returns how many of its groups were pending (all of them)."""
        return self.buffer.ack(batch.receipts)

    def hold(self, batch: Batch) -> None:
        """The batch is trained: ack it with the next `commit` (a checkpoint made it durable)."""
        self.buffer.hold(batch.receipts)
        self.held.extend(batch.receipts)

    def commit(self) -> int:
        """Ack every held group (their steps are in a checkpoint now); returns how many."""
        held, self.held = self.held, []
        return self.buffer.ack(held, held=True)

    def drops(self) -> tuple[int, int, int]:
        """(stale, invalid, of those the replays) dropped since the last call."""
        out = (self.dropped_stale, self.dropped_invalid, self.replays_dropped)
        self.dropped_stale = self.dropped_invalid = self.replays_dropped = 0
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.buffer.close()
