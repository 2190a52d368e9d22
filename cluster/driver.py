"""The driver: steers rollout workers and the learner with small messages only.

It never touches group data (docs/architecture.md, "The data path"): workers push groups to
the buffer, learner rank 0 takes them itself, trains and acks. The driver says which policy
version each rollout batch uses (cluster.schedule), when the learner steps and publishes, and
when to evaluate and checkpoint; it hears back counts and timings. Every pushed group ends up
trained, dropped (stale or invalid) or left in the buffer at the stop; `summary.json`
reconciles the driver's counts with the buffer's (cluster.ledger).

The rollout batches in flight and their faults are cluster.rollouts, the evaluations
cluster.evaluations, the checkpoint (written with the driver's state) and the restore from it
cluster.resume.

Faults (docs/architecture.md, "Faults and resume"): a rollout worker that dies, hangs
(rollout.batch_timeout_s) or whose engine fails is replaced and its part of the batch redone
(group ids are fixed per batch and prompt, so nothing is pushed twice); an embedded Redis that
dies is restarted from its append-only file (with buffer.persistence off the run stops); a
learner rank that dies, or hangs past learner.step_timeout_s, stops the run with the
command that resumes it from its last checkpoint (`train --resume`, which `Resume` restores).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn

from staleflow.buffer.connection import BufferConnectionError
from staleflow.buffer.server import RedisServerError
from staleflow.cluster.evaluations import Evaluations
from staleflow.cluster.failures import BatchStalled, LearnerFailed, rank_error, remote_cause
from staleflow.cluster.ledger import Counts, Timeline, accuracy_fields, reconcile
from staleflow.cluster.resources import ipc_scale_refusal, scale_placement_refusal
from staleflow.cluster.resume import CheckpointMixin, Resume, load_resume, versions_in_use
from staleflow.cluster.rollouts import Rollouts
from staleflow.cluster.rundir import MetricsWriter, write_json, write_text
from staleflow.cluster.schedule import (
    Flow,
    Schedule,
    ScheduleError,
    check_schedule,
    idle_workers_warning,
)
from staleflow.cluster.services import Services
from staleflow.configs.loader import dump_redacted, redact

__all__ = ["Driver", "LearnerFailed", "ScheduleError", "check_schedule"]

logger = logging.getLogger(__name__)

# Seconds one learner call waits for its batch before it returns short and is made again.
# A lock-step call made after its batch was complete that comes back short is an error.
LEARNER_WAIT_S, COMPLETE_BATCH_WAIT_S = 2.0, 30.0
# Broadcast methods: how long a publish waits for its members' pings (`_drop_dead_members`).
MEMBER_PING_S = 10.0
# At a stop, the most the driver waits for the parts of a lock-step batch the learner has
# trained: they pushed every group and are returning (`_handle_returned_calls`)
RETURNING_PARTS_S = 5.0


class BroadcastCancelled(Exception):
    """A stop was asked for while a broadcast waited for its members' calls (batch parts,
    evaluations: up to rollout.batch_timeout_s): it is not made, so the stop's checkpoint
    comes first; the resume publishes the checkpoint's weights."""


@dataclass
class Driver(CheckpointMixin):
    """Runs one training run (see the module docstring). `run()` returns the summary.
    Its checkpoint and its restore from one are CheckpointMixin's (cluster.resume)."""

    cfg: Any
    rundir: Any  # RunDir
    address: str | None = None
    progress: Any = None  # cluster.progress.Progress or None
    counts: Counts = field(default_factory=Counts)
    resume: bool = False  # continue the run in `rundir` from its last checkpoint
    # in _drain: a worker lost is forgotten (broadcast methods) but not replaced (not a field)
    _draining = False

    def __post_init__(self) -> None:
        self.schedule = Schedule(self.cfg)
        self.flow = Flow()
        self.run_id = self.rundir.key  # (RunDir.key: the name plus a suffix)
        self.P = self.cfg.rollout.prompts_per_batch
        self.published: dict[int, Any] = {}  # version -> handle workers load
        self.rollouts: Any = None  # Rollouts: the batches on the workers, once started
        self.evaluations: Any = None  # Evaluations in flight, once started
        self.learning: list[Any] | None = None  # refs of the learner call in flight
        self._learning_since = 0.0  # when it was made (time.monotonic), plus its batch wait
        self.buffer_lost = False  # the embedded Redis died with no append-only file
        self._ranks_returned: set[Any] = set()  # of those, other ranks' already returned
        self.batch_was_complete = False  # ... made once its lock-step batch was all pushed
        self._publish_when_idle = False  # async broadcast: engines were added
        self.timeline = Timeline()
        self.accuracy: dict[int, float] = {}
        self.stop_requested = False
        self.stop_signal: str | None = None  # the signal that asked for the stop, by name
        self._finishing = False  # in _finish: a stop signal no longer interrupts
        # in a periodic checkpoint: a second stop signal waits for its end (cut short after
        # LATEST named it, the stop would have written the same step over it)
        self._checkpointing = False
        self._interrupt_after_checkpoint = False
        self.started = time.time()
        self._pool_since, self._pool_size = self.started, 0  # (see clock)
        self.services = Services(self.cfg, self.rundir, self.address)
        self.metrics: Any = None  # MetricsWriter, once started
        self._deferred_workers: int | None = None
        self.redo: list[int] = []  # batches running at the checkpoint a resume started from
        self._waited_for_returning = False  # at a stop (`_handle_returned_calls`): done once
        self.resumed: Resume | None = None
        self.faults: list[dict[str, Any]] = []  # what failed, when, how long recovery took
        self.learner_failed: str | None = None
        self.error: str | None = None  # what stopped a failed run (also in summary.json)
        self._checkpointed = -1  # the step of the newest checkpoint
        # a resume that fails before its learner is restored leaves the run directory as it
        # was (config.json and status.json are put back; summary, report and metrics are
        # not rewritten)
        self._restored = not self.resume
        self._files_before: dict[Any, str | None] = {
            path: path.read_text() if path.is_file() else None
            for path in (self.rundir.config, self.rundir.status)
            if self.resume
        }

    # the run's parts (cluster.services); None until started
    buffer = property(lambda self: self.services.buffer)
    learner = property(lambda self: self.services.learner)
    pool = property(lambda self: self.services.pool)
    sync = property(lambda self: self.services.sync)

    @property
    def step(self) -> int:
        return self.flow.steps

    @property
    def latest(self) -> Any:
        return self.published.get(self.flow.latest)

    # ------------------------------------------------------------------------ the schedule

    def _tick(self) -> None:
        """Start whatever the schedule allows now: rollout batches, then a learner call."""
        if self.redo:
            self._redo_batches()
        elif self.schedule.lockstep:
            version = self.schedule.next_batch(self.flow)
            if version is not None and not self.pool.active:
                version = self._rejoin(version)
            if version is not None:
                self._dispatch(self.pool.active, version)
        else:
            for slot in self.pool.idle():
                version = self.schedule.next_batch(self.flow)
                if version is None:
                    break
                self._dispatch([slot], version)
            version = self.schedule.unstall(self.flow)
            if version is not None and (idle := self.pool.idle()):
                logger.warning(
                    "async schedule: only %d of the %d groups a step needs are stored or "
                    "coming (some were dropped), and every batch would now train groups past "
                    "buffer.max_staleness=%s: starting one at v%d anyway; its groups past the "
                    "bound are dropped stale",
                    self.flow.untrained(), self.schedule.G, self.cfg.buffer.max_staleness,
                    version,
                )  # fmt: skip
                self._dispatch(idle[:1], version)
            # stalled only if a worker was free and refused a batch: not while each is in an
            # evaluation, or every one was lost and new ones join at the next publish
            refused = bool(self.pool.idle())
            if not self.flow.running and refused and self.flow.untrained() < self.schedule.G:
                raise BatchStalled(
                    f"async schedule stalled at step {self.step}: no batch may start "
                    f"(buffer.max_staleness={self.cfg.buffer.max_staleness}) and the buffer "
                    f"holds {self.flow.untrained()} of the {self.schedule.G} groups a step "
                    "needs; raise buffer.max_staleness, or buffer.capacity to at least "
                    f"{self.schedule.G + self.P - 1} (one step's groups plus a batch's, less "
                    "one: the least that holds once groups were dropped, as here)"
                )
        if self.learning is None and self._publish_when_idle:
            self._publish_when_idle = False
            self._publish()  # broadcast to newly added engines, between learner calls
        if self.learning is None and self.schedule.may_step(self.flow):
            publish = not self.sync.broadcasts and self.schedule.publishes_after(self.step + 1)
            done = self.flow.batches_done > self.step
            self.batch_was_complete = self.schedule.lockstep and done
            wait = COMPLETE_BATCH_WAIT_S if self.batch_was_complete else LEARNER_WAIT_S
            self.learning = self.learner.train(wait, publish)
            self._learning_since = time.monotonic() + wait  # its take may wait this long
            self._ranks_returned = set()

    def _rejoin(self, version: int) -> int | None:
        """Lock-step with a broadcast method, every worker lost (in evaluations: a part is
        redone on a member, Rollouts): new workers join at a publish, and the schedule's
        next one waits for this batch. They join now, once the learner is between calls, if
        its current weights are the version the batch needs (returned, to dispatch it; None
        to wait); otherwise no engine can load that version in this run."""
        if self.learning is not None:
            return None
        # (only broadcast methods lose a worker without replacing it: the new ones are due)
        assert self.sync.broadcasts, "no rollout worker"
        assert self._deferred_workers, "no rollout worker, and none due"
        if version == self.step:
            logger.warning("every rollout worker was lost: publishing v%d now, for the new "
                           "ones to join", version)  # fmt: skip
            self._publish()
            return version
        raise RuntimeError(
            f"every rollout worker was lost, and the next batch needs weights v{version}: "
            f"with sync.method {self.cfg.sync.method} a new engine gets weights only from a "
            f"broadcast of the learner's current ones (v{self.step}, newer), so it cannot be "
            f"run in this run; resume it: {self.rollouts.resume_hint}"
        )

    def _dispatch(self, slots: list[Any], version: int, batch: int | None = None) -> None:
        """Start a new rollout batch (or, given `batch`, one a resume redoes) at `version`,
        split over `slots`."""
        flow = self.flow
        if batch is None:
            flow.batches += 1
            batch = flow.batches
            prompts = self.prompts.take(self.P)
        else:
            assert self.resumed is not None
            prompts = self.resumed.prompts_of(batch)
            # its parts that finished before the stop are redone and report their groups again
            flow.pushed -= flow.partial.pop(batch, 0)
        weights = self.published[version]
        self.timeline.gap_s += self.rollouts.start(
            slots, batch, weights, prompts, since=self.timeline.last
        )
        flow.running[batch] = (version, len(prompts))

    def _redo_batches(self) -> None:
        """After a resume: the batches that were running at the checkpoint, first (their
        groups that were pushed before the stop are not pushed again). Lock-step keeps each
        batch's version (the checkpoint kept the weights); async takes the newest."""
        assert self.resumed is not None
        if self.schedule.lockstep:
            if not self.flow.running:
                version: int | None = self.resumed.versions[self.redo[0]]
                if not self.pool.active:
                    version = self._rejoin(version)
                if version is not None:
                    self._dispatch(self.pool.active, version, self.redo.pop(0))
            return
        for slot in self.pool.idle():
            if not self.redo:
                break
            self._dispatch([slot], self.flow.latest, self.redo.pop(0))

    # ------------------------------------------------------------------------ events

    def _account(self, report: Any) -> None:
        """Count what a learner call did (also for a call the run is not waiting for)."""
        c, flow = self.counts, self.flow
        self._count_drops(report.dropped_stale, report.dropped_invalid, report.replays_dropped)
        if not report.trained:
            return
        if self.cfg.run.checkpoint_every == 0 and report.acked != report.metrics["groups"]:
            logger.error(
                "step %d: the buffer acked %d of the %d groups trained (acked before, or lost "
                "by the server): the summary will not reconcile", flow.steps + 1,
                report.acked, int(report.metrics["groups"]),
            )  # fmt: skip
        flow.count_step(int(report.metrics["groups"]), report.replays)
        c.trained += report.acked
        c.learner_s += report.timeline["step_s"]

    def _count_drops(self, stale: int, invalid: int, replays: int) -> None:
        """What the buffer dropped while the learner took (replays among them), in the
        run's counts and the schedule's."""
        self.counts.dropped_stale += stale
        self.counts.dropped_invalid += invalid
        self.flow.count_drops(stale + invalid, replays)

    def _on_learner_done(self) -> None:
        import ray

        assert self.learning is not None
        # every rank's, so a rank's error surfaces; a rank still out when rank 0 is done is
        # waited for up to the call's limit, not for ever
        left = self._learning_since + self.cfg.learner.step_timeout_s - time.monotonic()
        try:
            report = ray.get(self.learning, timeout=max(1.0, left))[0]
        except ray.exceptions.GetTimeoutError:
            self._learner_hung()  # raises, unless every rank returned since the get gave up:
            return self._on_learner_done()  # then their results are there (or their errors)
        except Exception as exc:
            self._learner_failed(exc)
        self.learning = None
        self._account(report)
        if not report.trained:
            if self.schedule.lockstep and self.batch_was_complete:
                st = self.buffer.stats()
                raise BatchStalled(
                    f"lockstep: batch {self.step + 1} was pushed whole but the learner took "
                    f"fewer than its {self.schedule.G} groups in {COMPLETE_BATCH_WAIT_S:g} s. "
                    f"The buffer of run {self.run_id} has refused {st.duplicates} pushes as "
                    f"duplicates (group ids it already holds or trained: another run with "
                    f"this name on the same Redis?), dropped {st.dropped_stale} stale and "
                    f"{st.dropped_invalid} invalid groups, and holds {st.undelivered} "
                    f"undelivered and {st.pending - st.held} pending (taken by a consumer, "
                    "not trained) groups"
                )
            return
        try:
            record = self._checked_step(report)
        except Exception as exc:  # counted, but not a state to checkpoint (as at the stop)
            self.learner_failed = self.learner_failed or f"step {self.step}: {exc}"
            raise
        try:
            try:  # (a broadcast waits for its members first: a second Ctrl-C may land there)
                if (
                    report.weights is None
                    and self.sync.broadcasts
                    and self.schedule.publishes_after(self.step)
                ):
                    self._publish()
            finally:  # the step is counted (and will be checkpointed): its record, always
                self._record_step(report, record)
            if self._eval_due(self.step):
                self._evaluate(self.step)  # (publishes, if off the sync schedule)
        except BroadcastCancelled:  # a stop: its checkpoint next (also when drained)
            logger.info("stopping: step %d's weights are not broadcast; its evaluation, if "
                        "due, is made at the resume", self.step)  # fmt: skip
            return
        ckpt = self.cfg.run.checkpoint_every
        if ckpt and self.step % ckpt == 0:
            self._checkpoint()
        self._write_status("running")

    def _checked_step(self, report: Any) -> dict[str, Any]:
        """A trained step's record, once its version (and in lock-step its lag) agree with
        the schedule, and its published weights (non-broadcast methods) are registered."""
        if report.version != self.step:
            raise RuntimeError(
                f"the learner is at policy version {report.version} after the driver's step "
                f"{self.step}: one of them counted a step twice"
            )
        record = dict(report.metrics, reward_mean=report.reward_mean, lag_counts=report.lag_counts)
        if self.schedule.lockstep:
            m = report.metrics
            record["lag_expected"] = self.schedule.check_lag(self.step, m["lag_min"], m["lag_max"])
        if report.weights is not None:
            self._published(report.weights)
        return record

    def _record_step(self, report: Any, record: dict[str, Any]) -> None:
        """The step's record in metrics.jsonl (and TensorBoard), the log and the progress bar."""
        c = self.counts
        clock = self.clock()
        elapsed = max(clock["wall_s"], 1e-9)
        self.timeline.gap_s += self.rollouts.idle_seconds(since=self.timeline.last)
        record.update(
            learner_busy=c.learner_s / elapsed,
            rollout_busy=c.rollout_s / max(clock["worker_s"], 1e-9),
            workers=len(self.pool.active),
            wall_s=elapsed,
            **self.timeline.close_step(report.timeline),
        )
        self.metrics.write("step", self.step, **record)
        logger.info(
            "step %d: reward %.3f, loss %.4f, lag %.0f..%.0f, clip %.3f, %.0f tok/s",
            self.step, record["reward_mean"], record["loss"], record["lag_min"],
            record["lag_max"], record.get("clip_frac", 0.0), record["tokens_per_s"],
        )  # fmt: skip
        if self.progress is not None:
            self.progress.step(self.step, record)

    def _on_batch_done(self, ref: Any) -> None:
        done = self.rollouts.finished(ref)
        if done is None:  # its worker failed: the part runs again (cluster.rollouts)
            return
        shard, report, complete = done
        if shard.failed_at is not None:
            self._recovered("rollout worker", shard.failed_at, batch=shard.batch)
        self.counts.rollout_s += report.generate_s
        self.flow.pushed += report.groups  # in the buffer now (pushed by this try or before)
        self.timeline.load_s += report.load_s
        if complete:
            del self.flow.running[shard.batch]
            self.flow.partial.pop(shard.batch, None)
            self.flow.batches_done += 1
        else:
            self.flow.partial[shard.batch] = self.flow.partial.get(shard.batch, 0) + report.groups
        self.metrics.write(
            "rollout", self.step, worker=shard.slot.index, batch=shard.batch,
            policy_version=report.policy_version, groups=report.groups, pushed=report.pushed,
            reward_mean=report.reward_mean, tokens_per_s=report.tokens_per_s,
            generate_s=report.generate_s, load_s=report.load_s,
            parse_failures=report.parse_failures, reward_errors=report.reward_errors,
            node=report.node,
        )  # fmt: skip

    def _on_fault(self, error: str, batch: int) -> None:
        self.metrics.write("fault", self.step, what="rollout worker", error=error, batch=batch,
                           wall_s=time.time() - self.started)  # fmt: skip

    def _recovered(self, what: str, failed_at: float, **detail: Any) -> None:
        seconds = time.monotonic() - failed_at
        self.faults.append({"what": what, "step": self.step, "recovery_s": seconds, **detail})
        logger.info("%s recovered in %.1f s", what, seconds)
        self.metrics.write("recovery", self.step, what=what, recovery_s=seconds, **detail)

    def _check_redis(self) -> None:
        """Restart the embedded Redis if it died (from its append-only file; clients retry
        meanwhile, so the workers and the learner carry on). Without one (buffer.persistence
        off), or if it cannot be started again, the run's groups are out of reach: it stops
        (RedisServerError)."""
        if self.buffer_lost:
            return  # said once: the stop neither checkpoints nor counts in it
        started = time.monotonic()
        try:
            revived = self.services.revive_redis()
        except RedisServerError:  # no AOF to restart from, or it would not start again
            self.buffer_lost = True
            raise
        if revived:
            self._recovered("redis", started)

    def _publish(self) -> None:
        """Publish the learner's current weights outside a learner call (the first version,
        broadcast methods, evaluations off the sync schedule).

        A broadcast first lets every member finish the calls it has in flight (rollout parts,
        evaluations), handling their ends here as at any other time: a member lost meanwhile
        is one lost mid-batch (its part is redone on another member, which still holds the
        part's version, and a new worker joins at this publish), not a failed broadcast. The
        broadcast would otherwise wait for those calls inside the collective, where a
        member's death also fails learner rank 0's call, and the run stopped."""
        if self.sync.broadcasts:
            self._wait_for_members()
            self._drop_dead_members()
            if self.stop_requested and self._deferred_workers is not None:
                # new workers would join first: their start (up to run.start_timeout_s)
                # must not hold up the stop's checkpoint either
                raise BroadcastCancelled
        if self._deferred_workers is not None:  # broadcast: new workers join at a publish
            self._scale(self._deferred_workers)
            self._deferred_workers = None
            self._publish_when_idle = False  # this publish is the one they wait for
        start = time.monotonic()
        self._published(self.sync.publish(self.step))
        self.timeline.publish_s += time.monotonic() - start

    def _wait_for_members(self) -> None:
        """Broadcast methods, before a publish: handle events until no member has a call in
        flight. Each call is bounded by rollout.batch_timeout_s from when it began running,
        batch parts and evaluations alike (`_wait`): a hung one has its worker killed and
        replaced, and nothing else would end it (the broadcast would wait for it).

        A stop asked for meanwhile, or before, while a member is still busy once the calls
        that have returned are handled cancels the broadcast (BroadcastCancelled): the
        stop's checkpoint must not wait for a batch or an evaluation (a grace period,
        Kubernetes' 30 s, may end first)."""
        while self.learning is None and self._members_busy():
            if self.stop_requested:
                self._handle_returned_calls()
                if self._members_busy():
                    raise BroadcastCancelled
                break
            self._wait()

    def _handle_returned_calls(self) -> None:
        """At a stop: handle the batch parts and evaluations that have returned but were not
        handled yet (`_wait` handles one call at a time, and `_drain` waits for the learner
        first). In lock-step, when step t's learner call returns, batch t's parts have pushed
        every group and are returning: they are waited for, once a stop, up to
        RETURNING_PARTS_S. Until they are handled the batch counts as running, so a member
        looks busy (the broadcast was cancelled) and the batch's older version looks needed
        (the stop's checkpoint was skipped under a broadcast method, then written after the
        evaluations). Not a part redone (after its worker failed, or by a resume): it may
        have had nothing new to push and still be queued or generating. A call that failed
        is left to `_drain` (its part is redone at the resume)."""
        import ray

        if self.schedule.lockstep and not self._waited_for_returning:
            self._waited_for_returning = True
            redone = self.resumed.versions if self.resumed is not None else {}
            returning = [
                ref for ref, s in self.rollouts.shards.items()
                if s.batch <= self.step and s.attempts == 1 and s.batch not in redone
            ]  # fmt: skip
            if returning:
                ray.wait(returning, num_returns=len(returning), timeout=RETURNING_PARTS_S)
        self._handle_returned([*self.rollouts.shards, *self.evaluations.refs])

    def _handle_returned(self, refs: list[Any]) -> None:
        """Handle those of `refs` (batch parts, evaluations) that have returned, without
        waiting; one that failed is left as it is (`_drain`: its part is redone at the
        resume)."""
        import ray

        shards = set(self.rollouts.shards)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except Exception:
                continue
            if ref in shards:
                self._on_batch_done(ref)
            else:
                self._on_eval_done(ref)

    def _drop_dead_members(self) -> None:
        """Broadcast methods, before a publish: a member that died while idle (between two
        calls, which is how a lock-step worker spends each learner step) had no call in
        flight to report it, and the broadcast would include it: the collective fails, and
        learner rank 0's call with it, which stopped the run as a learner failure. Each
        member is pinged (an empty actor call); one whose ping fails is dead and lost like a
        worker lost mid-batch (replaced at this publish). One that has not answered within
        MEMBER_PING_S (busy) is left to the broadcast's own limits."""
        import ray

        # (one still starting is left to the publish's own wait for it, which reports a
        # constructor's error as it is)
        members = [s for s in self.pool.slots if not s.retiring and s.ready is None]
        pings = {s.handle.__ray_ready__.remote(): s for s in members}
        done, _ = ray.wait(list(pings), num_returns=len(pings), timeout=MEMBER_PING_S)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:
                slot = pings[ref]
                cause = remote_cause(exc)
                error = f"rollout worker {slot.index} died while idle: {type(cause).__name__}"
                logger.warning("%s; replacing it at this publish", error)
                self.metrics.write("fault", self.step, what="rollout worker", error=error,
                                   wall_s=time.time() - self.started)  # fmt: skip
                self._lose_worker(slot)

    def _lose_worker(self, slot: Any) -> None:
        """Broadcast methods: a member's evaluation hung or its worker died: forget the worker
        (killed) and replace it at the next publish. A shard of its own fails in turn and is
        redone on a member (Rollouts), which keeps the replacement count."""
        self.pool.drop(slot)
        self._replace_lost_worker()

    def _members_busy(self) -> bool:
        """Whether a batch shard is in flight (on any worker: a retiring one's, or a lost
        one's not handled yet, is redone on a member if it fails, which must then still hold
        its version), or an evaluation on a member of the next broadcast, or on a worker
        lost or killed whose failure is not handled yet: it is retried on a member, which
        holds its version only until this broadcast (after it, the retry could not load it
        and the step's accuracy would be skipped), or on a retiring worker a scale due at
        this publish may make a member again."""
        if self.rollouts is None:
            return False
        if self.rollouts.shards:
            return True
        slots, scaling = self.pool.slots, self._deferred_workers is not None
        # (a scale due at this publish may make a retiring worker a member again: WorkerPool
        # .scale; it must not be in an evaluation, or dead with its failure not handled yet)
        return any(
            s in self.pool.active or s not in slots or (scaling and s.retiring)
            for _, _, s in self.evaluations.running
        )

    def _published(self, weights: Any) -> None:
        self.published[weights.version] = weights
        self.flow.latest = max(self.flow.latest, weights.version)
        # keep what the schedule, a pending eval or a batch that may be redone may still load
        keep = self.schedule.versions_needed(self.flow) | self.evaluations.versions
        keep |= versions_in_use(self.schedule, self.flow)  # running, coming (for a checkpoint)
        if self.resumed is not None and self.schedule.lockstep:  # batches still to redo
            keep |= {self.resumed.versions[b] for b in self.redo}
        # every version nothing needs, also those between needed ones: an evaluation of an
        # old step must not keep every later version (under ipc each is a model's copy)
        for v in [v for v in self.published if v not in keep]:
            self.sync.discard(self.published.pop(v))  # checkpoint: its file; ipc: its copy
        self.flow.published = set(self.published)

    def _evaluate(self, step: int) -> None:
        if not self.cfg.task.eval_prompts:
            return
        if step not in self.published:  # not on the sync schedule: publish for evaluation
            self._publish()
        self.evaluations.start(step, self.published[step])

    def _on_eval_done(self, ref: Any) -> None:
        step, report = self.evaluations.finished(ref, self.published)
        if report is None:
            return
        self.accuracy[step] = report.accuracy
        logger.info("held-out accuracy at step %d: %.3f", step, report.accuracy)
        self.metrics.write(
            "eval", step, accuracy=report.accuracy, reward_mean=report.reward_mean,
            prompts=report.prompts, problems=report.problems, temperature=report.temperature,
            parse_failures=report.parse_failures, reward_errors=report.reward_errors,
            wall_s=time.time() - self.started, examples=[list(e) for e in report.examples],
        )  # fmt: skip
        if self.progress is not None:
            self.progress.eval(step, report.accuracy)

    # ------------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        """Start everything, train `run.steps` steps, stop everything; returns the summary.

        The first SIGINT (Ctrl-C) or SIGTERM (what `kill`, Slurm, Kubernetes and `ray job
        stop` send) asks for a clean stop at the next event: the step in flight finishes and
        is acked, then checkpoint, summary, report (run.report), Ray and Redis go down. A
        second one interrupts at once; cleanup (checkpoint, summary, shutdown) then runs to its
        end, and signals during it are only logged."""
        previous = {
            sig: signal.signal(sig, self._on_stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        status = "failed"
        try:
            try:
                self._start()  # (start_ray keeps this SIGTERM handler through ray.init)
                while self.step < self.cfg.run.steps and not self.stop_requested:
                    self._tick()
                    self._wait()
                    self._poll_control()
                if self.stop_requested:
                    status = "interrupted"
                else:
                    status = "completed"
                    if self.step not in self.accuracy:  # a resume after the final evaluation
                        self._evaluate(self.step)
            except BroadcastCancelled:  # (_tick's publish for new workers, or _rejoin's)
                status = "interrupted"
            self._drain(checkpoint_first=status == "interrupted")
        except KeyboardInterrupt:
            status = "interrupted"
        except LearnerFailed as exc:
            self.learner_failed = self.learner_failed or str(exc)  # no final checkpoint
            logger.error("%s; the run stops (the ranks share one process group). Its last "
                         "checkpoint and the groups trained since are kept: resume with "
                         "`staleflow train --resume %s`", exc, self.rundir.path)  # fmt: skip
        except Exception as exc:  # the caller reports it too; driver.log keeps the reason
            self.error = redact(f"{type(exc).__name__}: {exc}")
            logger.error("the run failed: %s", self.error)
            raise
        finally:
            self._finishing = True
            try:
                summary = self._finish(status)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        return summary

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        if self._finishing:  # checkpoint, summary and shutdown must not be cut short
            logger.warning(
                "%s: already stopping (checkpoint, summary, shutdown of Ray and Redis); "
                "kill -9 would skip that",
                signal.Signals(signum).name,
            )
            return
        if self.stop_requested:
            if self._checkpointing:
                self._interrupt_after_checkpoint = True
                logger.warning("%s: stopping once the checkpoint being written is complete",
                               signal.Signals(signum).name)  # fmt: skip
                return
            raise KeyboardInterrupt
        self.stop_requested = True
        self.stop_signal = signal.Signals(signum).name
        again = "Ctrl-C" if signum == signal.SIGINT else self.stop_signal
        logger.warning("stopping (%s): finishing the step in flight (%s again to stop now)",
                       self.stop_signal, again)  # fmt: skip

    def _learner_failed(self, exc: BaseException) -> NoReturn:
        self.learning = None
        self.learner_failed = rank_error(exc)
        raise LearnerFailed(
            f"a learner rank failed at step {self.step + 1}: {self.learner_failed}"
        ) from exc

    def _rank_returned(self, ref: Any) -> None:
        """A learner rank other than 0 returned from its step: if it raised (or died), the
        run stops now. Rank 0 may be waiting for it in a collective, which only the process
        group's timeout (10-30 min) would end."""
        import ray

        try:
            ray.get(ref)
        except Exception as exc:
            self._learner_failed(exc)
        self._ranks_returned.add(ref)

    def _learning_refs(self) -> list[Any]:
        """The step's calls still to watch: rank 0's (its report), and the other ranks'
        that have not returned (`_rank_returned`)."""
        if self.learning is None:
            return []
        return [self.learning[0], *(r for r in self.learning[1:] if r not in self._ranks_returned)]

    def _wait(self) -> None:
        """Block until something in flight finishes (or briefly, to poll buffer and control)."""
        import ray

        refs = list(self.rollouts.shards) + self.evaluations.refs + self._learning_refs()
        timeout = 0.2 if self.cfg.sync.mode == "async" or not refs else 1.0
        done, _ = ray.wait(refs, num_returns=1, timeout=timeout) if refs else ([], [])
        if not refs:
            time.sleep(timeout)
        for ref in done:
            if self.learning is not None and ref == self.learning[0]:
                self._on_learner_done()
            elif self.learning is not None and ref in self.learning:
                self._rank_returned(ref)
            elif ref in self.rollouts.shards:
                self._on_batch_done(ref)
            else:
                self._on_eval_done(ref)
        self._check_learner_hung()
        self.rollouts.check_hung()
        self.evaluations.check_hung(self.cfg.rollout.batch_timeout_s, time.monotonic())
        self.rollouts.check_started()
        self._check_redis()

    def _worker_lost_in_evaluation(self, slot: Any) -> None:
        """Its worker died in an evaluation (or was killed as hung): told before the
        evaluation's retry is placed. Its next call would fail too. Broadcast methods forget
        it at once and replace it at the next publish (a broadcast would include the dead
        member and stop the run); other methods replace it now, and a batch part queued on
        it fails and is redone on a live worker (Rollouts._failed). One retiring, or dropped
        or replaced already, is not replaced (again)."""
        if slot not in self.pool.active:
            return
        if self.sync.broadcasts:
            logger.warning("rollout worker %d died in an evaluation: replacing it at the next "
                           "publish", slot.index)  # fmt: skip
            self._lose_worker(slot)
            return
        if self._draining:  # (every worker is stopped next: no new engine for nothing)
            return
        logger.warning("rollout worker %d died in an evaluation: replacing it", slot.index)
        self.pool.replace(slot)

    def _check_learner_hung(self) -> None:
        """A learner call out longer than learner.step_timeout_s (on top of the wait for its
        batch it was given: a lock-step batch that never lands is BatchStalled's, not a
        hang) stops the run, naming the ranks that have not returned: Ray reports a rank
        that dies, not one that hangs (a GPU fault, a stalled filesystem, a collective
        waiting for a peer). The call is not waited for again: no checkpoint or count
        queues behind it, the ranks are killed at the stop, and the run resumes from its
        last checkpoint."""
        limit = self.cfg.learner.step_timeout_s
        if self.learning is None or time.monotonic() - self._learning_since <= limit:
            return
        self._learner_hung()

    def _learner_hung(self) -> None:
        """Past its limit: stop the run naming the ranks whose part of the learner call has
        not returned (none: it finished just now, and the next wait takes it)."""
        import ray

        assert self.learning is not None
        limit = self.cfg.learner.step_timeout_s
        every = len(self.learning)
        ready, _ = ray.wait(self.learning, num_returns=every, timeout=0)
        ranks = [i for i, ref in enumerate(self.learning) if ref not in ready]
        if not ranks:
            return
        self.learning = None
        self.learner_failed = (
            f"learner rank(s) {', '.join(map(str, ranks))} did not return from step "
            f"{self.step + 1} within learner.step_timeout_s={limit:g} s (a hung GPU, a stalled "
            "filesystem or a collective waiting for a peer; raise learner.step_timeout_s if "
            "steps take this long)"
        )
        raise LearnerFailed(self.learner_failed)

    def _drain(self, checkpoint_first: bool = False) -> None:
        """Finish the step and evaluations in flight; let no rollout batch push afterwards.
        With `checkpoint_first` (a stop asked for) the checkpoint is written before the
        evaluations are waited for (up to rollout.batch_timeout_s): a grace period (Slurm's,
        Kubernetes' 30 s) may end meanwhile; an evaluation of the checkpoint's step that the
        stop cuts short is made again at the resume."""
        import ray

        self._draining = True

        while self.learning is not None:  # a rank failing first stops it (`_rank_returned`)
            done, _ = ray.wait(self._learning_refs(), num_returns=1, timeout=1.0)
            if not done:
                self._check_learner_hung()
                self._check_redis()
            elif done[0] == self.learning[0]:
                self._on_learner_done()
            else:
                self._rank_returned(done[0])
        if checkpoint_first:  # a batch the learner trained is not running (its version)
            self._handle_returned_calls()
        refs = self.evaluations.refs
        if checkpoint_first and refs and 0 < self.step != self._checkpointed:
            logger.info("checkpointing before waiting for %d evaluation(s) in flight", len(refs))
            self._checkpoint()
        if refs:  # bounded like a batch: a hung evaluation must not hold up the shutdown
            limit = self.cfg.rollout.batch_timeout_s
            done, late = ray.wait(refs, num_returns=len(refs), timeout=limit)
            for ref in done:
                self._on_eval_done(ref)
            if late:
                logger.warning(
                    "%d evaluation(s) still running after rollout.batch_timeout_s=%g s: not "
                    "waited for, their accuracy is missing", len(late), limit,
                )  # fmt: skip
        self.evaluations.running = []  # a retry started just now is not waited for
        self._handle_returned(list(self.rollouts.shards))  # what finished already counts
        self.rollouts.abandon()  # the rest (see Rollouts.abandon)

    def _poll_control(self) -> None:
        n = self.rundir.take_worker_request()
        if n is None:
            return
        cfg = self.cfg  # `staleflow scale` refuses the same
        refusal = ipc_scale_refusal(cfg.sync.method, cfg.rollout.num_workers, n)
        if refusal is None and n > len(self.pool.active):
            try:
                refusal = scale_placement_refusal(cfg, n)
            except Exception as exc:  # the cluster's state could not be read (GCS busy)
                refusal = f"could not read the cluster's nodes ({exc!r}); ask again"
        if refusal:
            logger.error("not scaling to %d rollout workers: %s", n, refusal)
            self.rundir.refuse_workers(n, refusal)
            return
        added = n > len(self.pool.active)
        idle = idle_workers_warning(cfg, n)
        if idle and added:
            logger.warning("%s", idle)
        if self.sync.broadcasts and (added or self.schedule.lockstep):
            # A new engine can only get weights from a broadcast: it joins at the next
            # publish (`_publish` scales first), and must not be handed a batch before it.
            # Lock-step publishes on its schedule; async publishes the newest weights (any
            # version runs) as soon as the learner is between calls, so the weights
            # published are exactly version `step`.
            logger.info("scaling rollout workers to %d at the next publish", n)
            self._scale_at_next_publish(n)
            return
        self._deferred_workers = None  # the count asked for now stands (no replacement due)
        self._scale(n)

    def _replace_lost_worker(self) -> None:
        """Broadcast methods: a worker was lost (its part is redone on another, Rollouts); a
        new one joins at the next publish, as one `staleflow scale` adds, unless a scale is
        pending already (its count stands)."""
        if self._draining:  # the run stops: the lost worker is forgotten, none joins
            return
        pending = self._deferred_workers
        self._scale_at_next_publish(len(self.pool.active) + 1 if pending is None else pending)

    def _scale_at_next_publish(self, n: int) -> None:
        """Broadcast methods: `n` workers from the next publish (`_publish` scales first);
        async publishes as soon as the learner is between calls, lock-step on its schedule."""
        self._deferred_workers = n
        self._publish_when_idle = not self.schedule.lockstep

    def clock(self) -> dict[str, float]:
        """The run's time from its first step's start (`wall_s`, resumes included) and the
        worker-seconds its pool has had (`worker_s`: each stretch at the worker count seen at
        its start, counted on at every step and scale): the busy fractions' denominators."""
        now = time.time()
        self.counts.worker_s += (now - self._pool_since) * self._pool_size
        self._pool_since, self._pool_size = now, len(self.pool.active)
        self.counts.wall_s = now - self.started
        return {"wall_s": self.counts.wall_s, "worker_s": self.counts.worker_s}

    def _scale(self, n: int) -> None:
        logger.info("scaling rollout workers %d -> %d", len(self.pool.active), n)
        self.clock()  # the stretch before at the old count
        self.pool.scale(n)
        self._pool_size = len(self.pool.active)
        self.metrics.write("scale", self.step, workers=n, wall_s=time.time() - self.started)
        self._write_status("running")

    def _start(self) -> None:
        from staleflow.actors.models import prepare_model
        from staleflow.actors.tasks import PromptStream, make_task
        from staleflow.cluster.resources import check_sync_method

        check_sync_method(self.cfg)
        # atomically and durably: an empty config.json after a power cut, and the run could
        # not be resumed ("not a staleflow run directory")
        write_text(self.rundir.config, dump_redacted(self.cfg) + "\n", durable=True)
        # bad input fails here, before any server or process starts
        self.prompts = PromptStream(make_task(self.cfg.task).train_prompts())
        prepare_model(self.cfg.model)
        if self.resume:
            self.resumed = load_resume(self.rundir, self.cfg)  # _restore cuts metrics back
            self.prompts = self.resumed.continue_prompts(self.prompts)
            left = self.rundir.drop_worker_request()  # (an old count must not override ours)
            if left is not None:
                logger.warning(
                    "dropped a request for %d rollout workers the stopped run never took: this "
                    "run starts with rollout.num_workers=%d (staleflow scale asks again)",
                    left, self.cfg.rollout.num_workers,
                )  # fmt: skip
        # a resume mirrors to TensorBoard once restored (CheckpointMixin._restore): its purge
        # of the steps trained again must not happen if the resume stops before
        self.metrics = MetricsWriter(self.rundir, self.cfg.run.tensorboard and not self.resume)
        self._write_status("starting")
        logger.info("run %s in %s (%s schedule)", self.run_id, self.rundir.path, self.cfg.sync.mode)
        idle = idle_workers_warning(self.cfg, self.cfg.rollout.num_workers)
        if idle:
            logger.warning("%s", idle)
        self.services.start(
            resume=self.resume,
            check_buffer=self._check_buffer_as_left if self.resumed is not None else None,
        )
        self.learner.while_waiting = self._check_redis  # also during checkpoints and publishes
        self.rollouts = Rollouts(
            self.cfg,
            self.pool,
            self.sync.broadcasts,
            f"staleflow train --resume {self.rundir.path}",
            self._on_fault,
            self._replace_lost_worker,
        )
        self.evaluations = Evaluations(
            self.pool, self.cfg.task.eval_prompts, on_lost=self._worker_lost_in_evaluation
        )
        if self.resumed is not None:
            self._restore(self.resumed)
        self._publish()
        if self.resumed is None or (self.resumed.step == 0 and 0 not in self.accuracy):
            self._evaluate(0)  # (a run stopped before its first evaluation had finished)
        elif self._eval_due(self.step) and self.step not in self.accuracy:
            self._evaluate(self.step)  # the checkpoint's evaluation did not finish before
        # busy fractions and wall time count from here, a resumed run's from its first start
        self.started = time.time() - self.counts.wall_s
        self._pool_since, self._pool_size = time.time(), len(self.pool.active)
        self.timeline = Timeline()  # so does the first step's interval (not the first publish)
        self._write_status("running")
        if self.progress is not None:
            self.progress.start(self.cfg.run.steps)

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.run.eval_every
        return bool(every) and step % every == 0 and 0 < step < self.cfg.run.steps

    def _finish(self, status: str) -> dict[str, Any]:
        """Checkpoint, reconcile, report and stop everything; safe after a partial start."""
        if not self._restored:
            return self._abandon_resume(status)
        self._absorb_learner_call()
        summary: dict[str, Any] = {"status": status, "steps": self.step, "run_id": self.run_id}
        learner_ok = False
        try:
            learner_ok = self.learner is not None and self.learner_failed is None
            learner_ok = learner_ok and not self.buffer_lost  # its acks would go nowhere
            if learner_ok:  # not queued behind a constructor or a call that never returned
                busy = self.learner.idle(COMPLETE_BATCH_WAIT_S + 60)
                if busy is not None:
                    logger.error("no final checkpoint or settle: %s", busy)
                    learner_ok = False
                    if self.learner.started:  # (a start that failed says so in `error`)
                        self.learner_failed = busy
            if learner_ok and self.step > 0 and self.step != self._checkpointed:
                self._checkpoint(final=status == "completed")
        except Exception as exc:  # the groups are still counted below, without the settle
            summary["status"] = status = "failed"
            learner_ok = False
            self._failed_at_finish("could not write the final checkpoint", exc)
        try:
            if self.buffer is not None and not self.buffer_lost:
                if learner_ok:
                    self._count_drops(*self.learner.settle())  # no take races the counts
                elapsed = time.time() - self.started
                summary.update(reconcile(self.buffer.stats(), self.counts, self.flow, elapsed))
        except Exception as exc:
            summary["status"] = status = "failed"
            self._failed_at_finish("could not reconcile the run", exc)
        if self.services.placement is not None:
            summary["placement"] = self.services.placement
        summary["faults"] = self.faults
        if status != "completed" and self.rundir.latest_checkpoint() is not None:
            summary["resume"] = f"staleflow train --resume {self.rundir.path}"
        if status == "interrupted" and self.stop_signal is not None:
            summary["stopped_by"] = self.stop_signal
        if self.learner_failed is not None:
            summary["learner_error"] = self.learner_failed
        if self.error is not None:
            summary["error"] = self.error
        summary.update(wall_s=time.time() - self.started, **accuracy_fields(self.accuracy))
        if self.progress is not None:
            self.progress.stop()
        self._write_status(status)
        groups = summary.get("groups", "groups not reconciled (no buffer to count them in)")
        logger.info("stopping (%s after %d steps): %s", status, self.step, groups)
        self._teardown()
        write_json(self.rundir.summary, summary)
        if not self.cfg.run.report:
            logger.info("no report (run.report: false): `staleflow report %s` builds it",
                        self.rundir.path)  # fmt: skip
            return summary
        try:
            from staleflow.cluster.report import write_report

            write_report(self.rundir)
        except Exception:
            logger.exception(
                "could not write the report; rerun `staleflow report %s`", self.rundir.path
            )
        return summary

    def _failed_at_finish(self, what: str, exc: Exception) -> None:
        """The final checkpoint or count failed: logged, and its reason in the summary (a
        learner rank's failure as `learner_error`, anything else as `error`)."""
        if isinstance(exc, BufferConnectionError):  # says all there is to say: no traceback
            logger.error("%s: %s", what, exc)
        else:
            logger.exception("%s", what)
        reason = redact(f"{what}: {type(exc).__name__}: {exc}")
        if isinstance(exc, LearnerFailed):
            self.learner_failed = self.learner_failed or reason
        else:
            self.error = self.error or reason

    def _abandon_resume(self, status: str) -> dict[str, Any]:
        """A resume stopped before its learner was restored: nothing of the run changed, so
        its summary, report and metrics stay the earlier run's; config.json and status.json
        (rewritten at the start) go back."""
        step = self.resumed.step if self.resumed is not None else 0
        logger.error("the resume stopped (%s) before the run changed: %s keeps its summary, "
                     "report and metrics", self.error or status, self.rundir.path)  # fmt: skip
        if self.progress is not None:
            self.progress.stop()
        self._teardown()
        for path, text in self._files_before.items():
            if text is None:
                path.unlink(missing_ok=True)
            else:
                write_text(path, text, durable=path == self.rundir.config)
        summary = {"status": status, "steps": step, "run_id": self.run_id,
                   "resume_abandoned": self.error or self.learner_failed or status}  # fmt: skip
        if status == "interrupted" and self.stop_signal is not None:
            summary["stopped_by"] = self.stop_signal
        return summary

    def _absorb_learner_call(self) -> None:
        """A learner call still running when the run stops (an error elsewhere, a second
        Ctrl-C) may finish its step and ack it: wait for it and count it, so the checkpoint
        and the summary agree with the buffer."""
        import ray

        if self.learning is None:
            return
        refs, self.learning = self.learning, None
        try:
            report = ray.get(refs[0], timeout=COMPLETE_BATCH_WAIT_S + 60)
        except Exception as exc:
            # The ranks may still be in that step, or stopped part way: a checkpoint queued
            # behind it would hold a learner one step ahead of the driver's count
            logger.exception("the learner call in flight at the stop did not finish")
            self.learner_failed = self.learner_failed or (
                f"the learner call in flight at the stop did not finish: {rank_error(exc)}"
            )
            return
        self._account(report)
        if not report.trained:
            return
        # its record too, as any step's (a resume keeps metrics up to the checkpoint, which
        # holds this step: without it the curves had a gap there for good); no evaluation,
        # checkpoint (the stop's own follows) or broadcast publish
        try:
            self._record_step(report, self._checked_step(report))
        except Exception as exc:  # (the version or lag check): not a state to checkpoint
            logger.exception("the step finished at the stop does not agree with the schedule")
            self.learner_failed = self.learner_failed or f"step {self.step}: {exc}"

    def _teardown(self) -> None:
        self.services.stop()
        if self.metrics is not None:
            self.metrics.close()

    def _write_status(self, state: str) -> None:
        pool = self.pool
        write_json(
            self.rundir.status,
            {
                "state": state,
                "step": self.step,
                "steps": self.cfg.run.steps,
                "workers": len(pool.active) if pool is not None else 0,
                "published_version": self.latest.version if self.latest is not None else None,
                "updated_at": time.time(),
                "driver": {"host": socket.gethostname(), "pid": os.getpid()},  # `scale` checks it
            },
        )
