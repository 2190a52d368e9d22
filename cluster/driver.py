"""The driver: runs the sync schedule between rollout workers, the buffer and the learner.

One loop, two admission rules (`Driver._tick`):

- lockstep: rollout batches are made one after another, each split over all workers, and batch
  e starts only once version v(e) = I * max(0, (e - O - 1) // I) is published. The buffer holds
  batches in order, so learner step t trains on exactly batch t: its lag is lag(t) of
  algorithms.md section 6 whatever the relative speeds (checked at every step).
- async: every idle worker starts a batch with the newest published weights, unless the batch
  would be trained more than `max_staleness` versions later (its groups are trained at version
  (groups_started + P - 1) // G under FIFO); the learner takes G groups whenever they are there
  and publishes every I steps. The buffer's staleness bound drops what slips through anyway.

Everything else (weights to workers at batch boundaries, evaluation, checkpoints, scaling,
shutdown) is the same in both modes. Every pushed group ends up trained, dropped (stale or
invalid) or left in the buffer at the stop; `summary.json` reconciles the counts.
"""

from __future__ import annotations

import itertools
import logging
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from staleflow.cluster.rundir import MetricsWriter, write_json
from staleflow.cluster.schedule import lag, rollout_version
from staleflow.cluster.trajectories import TrajectoryLog
from staleflow.configs.loader import ConfigError, dump_config, redact

__all__ = ["Driver", "ScheduleError", "check_schedule"]

logger = logging.getLogger(__name__)


class ScheduleError(ConfigError):
    """A config whose schedule cannot run (e.g. a staleness bound the schedule must exceed)."""


def check_schedule(cfg: Any) -> None:
    """Reject schedules that would starve the learner or drop data by construction."""
    sync, buf, steps = cfg.sync, cfg.buffer, cfg.run.steps
    per_step = groups_per_step(cfg)
    if sync.mode == "lockstep":
        if per_step != cfg.rollout.prompts_per_batch:
            raise ScheduleError(
                f"lockstep trains one rollout batch per step: learner.groups_per_step "
                f"({per_step}) must equal rollout.prompts_per_batch "
                f"({cfg.rollout.prompts_per_batch}) or be left null"
            )
        if buf.sampling != "fifo":
            raise ScheduleError(
                f"lockstep needs buffer.sampling: fifo (got {buf.sampling}); the other "
                "orders would break the exact lag schedule, use sync.mode: async for them"
            )
        worst = max(lag(t, sync.interval, sync.offset) for t in range(1, steps + 1))
        if buf.max_staleness is not None and buf.max_staleness < worst:
            raise ScheduleError(
                f"buffer.max_staleness={buf.max_staleness} is below the schedule's largest "
                f"lag ({worst}, sync.interval={sync.interval}, sync.offset={sync.offset}); "
                f"raise it to {worst} or set it to null"
            )
    else:
        if sync.offset:
            raise ScheduleError(
                f"sync.offset={sync.offset} only applies to sync.mode: lockstep; in async "
                "mode bound the lag with buffer.max_staleness instead"
            )
        least = sync.interval - 1 + (cfg.rollout.prompts_per_batch - 1) // per_step
        if buf.max_staleness is not None and buf.max_staleness < least:
            raise ScheduleError(
                f"buffer.max_staleness={buf.max_staleness} is below {least}, the lag that "
                f"publishing every {sync.interval} step(s) implies; raise it to at least {least}"
            )
    if cfg.rollout.prompts_per_batch > buf.capacity:
        raise ScheduleError(
            f"buffer.capacity ({buf.capacity}) must hold one rollout batch "
            f"({cfg.rollout.prompts_per_batch} groups)"
        )


def groups_per_step(cfg: Any) -> int:
    return int(cfg.learner.groups_per_step or cfg.rollout.prompts_per_batch)


@dataclass
class Counts:
    """Groups seen by the driver; reconciled against the buffer's own counters at the end."""

    trained: int = 0
    dropped_stale: int = 0
    dropped_invalid: int = 0
    rollout_batches: int = 0
    rollout_s: float = 0.0  # summed over workers: generation time
    learner_s: float = 0.0
    pushed_by_reports: int = 0


@dataclass
class StepInFlight:
    refs: list[Any]
    taken: Any
    started: float
    reward_mean: float
    lag_counts: dict[str, int]  # lag -> groups, for the report's histogram


@dataclass
class Driver:
    """Runs one training run (see the module docstring). `run()` returns the summary."""

    cfg: Any
    rundir: Any  # RunDir
    address: str | None = None
    progress: Any = None  # cluster.progress.Progress or None
    counts: Counts = field(default_factory=Counts)

    def __post_init__(self) -> None:
        check_schedule(self.cfg)
        self.run_id = self.rundir.path.name
        self.P, self.G = self.cfg.rollout.prompts_per_batch, groups_per_step(self.cfg)
        self.I, self.O = self.cfg.sync.interval, self.cfg.sync.offset
        self.step = 0
        self.published: dict[int, Any] = {}
        self.latest: Any = None  # the version workers should run in async mode
        self.batches = 0  # rollout batches dispatched
        self.batches_done = 0
        self.groups_started = 0
        self.shards: dict[Any, tuple[Any, int]] = {}  # batch ref -> (slot, batch number)
        self.open_shards: dict[int, int] = {}
        self.learning: StepInFlight | None = None
        self.staged: list[Any] = []  # Taken pieces gathered for the next async step
        self.evals: list[tuple[Any, int]] = []
        self.accuracy: dict[int, float] = {}
        self.stop_requested = False
        self.started = time.time()
        self._redis: Any = None
        self._started_ray = False
        self._deferred_workers: int | None = None
        self.trajectories: TrajectoryLog | None = None

    # ------------------------------------------------------------------------ the schedule

    def _tick(self) -> None:
        """Start whatever the schedule allows now: rollout batches, then a learner step."""
        if self.cfg.sync.mode == "lockstep":
            e = self.batches + 1
            ahead_ok = (self.batches - self.step + 1) * self.P <= self.cfg.buffer.capacity
            v = rollout_version(e, self.I, self.O) if e <= self.cfg.run.steps else None
            if not self.shards and ahead_ok and v is not None and v in self.published:
                self._dispatch(self.pool.active, self.published[v], split=True)
            if self.learning is None and self.batches_done > self.step:
                self._start_step(timeout_s=30.0)
            return
        for slot in self.pool.idle():
            if not self._admit():
                break
            self._dispatch([slot], self.latest, split=False)
        if self.learning is None:
            self._start_step(timeout_s=0.0)

    def _admit(self) -> bool:
        """async: would a new batch stay within max_staleness and the buffer's capacity?"""
        dropped = self.counts.dropped_stale + self.counts.dropped_invalid
        if self.groups_started - dropped >= self.cfg.run.steps * self.G:
            return False  # enough for the remaining steps: no batch would be trained
        if self.groups_started - self.counts.trained - dropped + self.P > self.cfg.buffer.capacity:
            return False
        bound = self.cfg.buffer.max_staleness
        trained_at = (self.groups_started + self.P - 1) // self.G
        return bound is None or trained_at - self.latest.version <= bound

    def _dispatch(self, slots: list[Any], weights: Any, split: bool) -> None:
        self.batches += 1
        prompts = list(itertools.islice(self.prompts, self.P))
        parts = np.array_split(np.arange(self.P), len(slots)) if split else [np.arange(self.P)]
        for slot, part in zip(slots, parts, strict=False):
            if len(part) == 0:
                continue
            ref = self.pool.run_batch(slot, weights, [prompts[i] for i in part])
            self.shards[ref] = (slot, self.batches)
            self.open_shards[self.batches] = self.open_shards.get(self.batches, 0) + 1
        self.groups_started += self.P

    def _start_step(self, timeout_s: float) -> None:
        need = self.G - sum(len(t.groups) for t in self.staged)
        taken = self.buffer.take(need, learner_version=self.step, timeout_s=timeout_s)
        self.counts.dropped_stale += taken.dropped_stale
        self.counts.dropped_invalid += taken.dropped_invalid
        if taken.groups:
            self.staged.append(taken)
        groups = [g for t in self.staged for g in t.groups]
        if len(groups) < self.G:
            if self.cfg.sync.mode == "lockstep":
                raise RuntimeError(
                    f"lockstep: batch {self.step + 1} was complete but the buffer gave "
                    f"{len(groups)} of its {self.G} groups; see `staleflow buffer stats`"
                )
            return
        if self.trajectories is not None:
            self.trajectories.record(self.step + 1, self.step, groups)
        refs = self.learner.step(groups, self.step)
        reward = float(np.mean([g.rewards.mean() for g in groups]))
        lags = Counter(str(self.step - g.policy_version) for g in groups)
        self.learning = StepInFlight(refs, self.staged, time.time(), reward, dict(lags))
        self.staged = []

    # ------------------------------------------------------------------------ events

    def _on_step_done(self) -> None:
        import ray

        assert self.learning is not None
        metrics = ray.get(self.learning.refs)[0]
        receipts = [r for t in self.learning.taken for r in t.receipts]
        self.buffer.ack(receipts)
        self.counts.trained += len(receipts)
        self.counts.learner_s += time.time() - self.learning.started
        self.step += 1
        record = dict(
            metrics, reward_mean=self.learning.reward_mean, lag_counts=self.learning.lag_counts
        )
        self.learning = None
        if self.cfg.sync.mode == "lockstep":
            expected = lag(self.step, self.I, self.O)
            record["lag_expected"] = expected
            if not metrics["lag_min"] == metrics["lag_max"] == expected:
                raise RuntimeError(
                    f"lockstep step {self.step}: lag {metrics['lag_min']}..{metrics['lag_max']} "
                    f"but the schedule says {expected}"
                )
        elapsed = max(time.time() - self.started, 1e-9)
        workers = max(len(self.pool.active), 1)
        record.update(
            learner_busy=self.counts.learner_s / elapsed,
            rollout_busy=self.counts.rollout_s / (elapsed * workers),
            workers=len(self.pool.active),
            wall_s=elapsed,
        )
        self.metrics.write("step", self.step, **record)
        logger.info(
            "step %d: reward %.3f, loss %.4f, lag %.0f..%.0f, clip %.3f, %.0f tok/s",
            self.step, record["reward_mean"], record["loss"], record["lag_min"],
            record["lag_max"], record.get("clip_frac", 0.0), record["tokens_per_s"],
        )  # fmt: skip
        if self.progress is not None:
            self.progress.step(self.step, record)
        if self.step % self.I == 0 or self.step == self.cfg.run.steps:
            self._publish()
        every = self.cfg.run.eval_every
        if every and self.step % every == 0 and self.step < self.cfg.run.steps:
            self._evaluate(self.step)
        ckpt = self.cfg.run.checkpoint_every
        if ckpt and self.step % ckpt == 0:
            self._checkpoint()
        self._write_status("running")

    def _on_batch_done(self, ref: Any) -> None:
        import ray

        slot, batch = self.shards.pop(ref)
        self.pool.finished(slot)
        report = ray.get(ref)
        self.counts.rollout_s += report.generate_s
        self.counts.pushed_by_reports += report.pushed
        self.open_shards[batch] -= 1
        if self.open_shards[batch] == 0:
            del self.open_shards[batch]
            self.batches_done += 1
            self.counts.rollout_batches += 1
        self.metrics.write(
            "rollout", self.step, worker=slot.index, batch=batch,
            policy_version=report.policy_version, groups=report.groups, pushed=report.pushed,
            reward_mean=report.reward_mean, tokens_per_s=report.tokens_per_s,
            generate_s=report.generate_s,
        )  # fmt: skip
        if slot.retiring:
            self.pool.remove(slot)

    def _publish(self) -> None:
        if self._deferred_workers is not None:  # broadcast: new workers join at a publish
            self._scale(self._deferred_workers)
            self._deferred_workers = None
        weights = self.sync.publish(self.step)
        self.published[weights.version] = weights
        self.latest = weights  # what async workers and newly added workers load
        # keep what the schedule, a pending eval or the workers may still load
        keep = {self.latest.version, *(v for _, v in self.evals)}
        if self.cfg.sync.mode == "lockstep" and self.batches < self.cfg.run.steps:
            keep.add(rollout_version(self.batches + 1, self.I, self.O))
        low = min(keep)
        for v in [v for v in self.published if v < low]:
            del self.published[v]

    def _evaluate(self, step: int) -> None:
        if not self.cfg.task.eval_prompts:
            return
        weights = self.published.get(step)
        if weights is None:  # not on the sync schedule: publish for evaluation only
            weights = self.sync.publish(step)
            self.published[step] = weights
            if self.sync.broadcasts:  # every worker holds it now (async only: see resources)
                self.latest = weights
        slot = self.pool.active[0]
        self.evals.append((self.pool.evaluate(slot, weights, self.cfg.task.eval_prompts), step))

    def _on_eval_done(self, ref: Any, step: int) -> None:
        import ray

        report = ray.get(ref)
        self.accuracy[step] = report.accuracy
        logger.info("held-out accuracy at step %d: %.3f", step, report.accuracy)
        self.metrics.write(
            "eval", step, accuracy=report.accuracy, reward_mean=report.reward_mean,
            prompts=report.prompts, temperature=report.temperature,
            parse_failures=report.parse_failures, wall_s=time.time() - self.started,
            examples=[list(e) for e in report.examples],
        )  # fmt: skip
        if self.progress is not None:
            self.progress.eval(step, report.accuracy)

    def _checkpoint(self) -> None:
        path = self.rundir.checkpoints / f"step-{self.step:06d}"
        self.learner.save(str(path), {"step": self.step, "run_id": self.run_id})
        self.rundir.mark_latest_checkpoint(path)

    # ------------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        """Start everything, train `run.steps` steps, stop everything; returns the summary.

        The first SIGINT (Ctrl-C) asks for a clean stop at the next event: the step in flight
        finishes and is acked, then checkpoint, summary, report, Ray and Redis go down. A
        second SIGINT interrupts at once (cleanup still runs)."""
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        status = "failed"
        try:
            self._start()
            while self.step < self.cfg.run.steps and not self.stop_requested:
                self._tick()
                self._wait()
                self._poll_control()
            if self.stop_requested:
                status = "interrupted"
            else:
                status = "completed"
                self._evaluate(self.step)
            self._drain()
        except KeyboardInterrupt:
            status = "interrupted"
        finally:
            signal.signal(signal.SIGINT, previous)
            summary = self._finish(status)
        return summary

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.stop_requested:
            raise KeyboardInterrupt
        self.stop_requested = True
        logger.warning("stopping: finishing the step in flight (Ctrl-C again to stop now)")

    def _wait(self) -> None:
        """Block until something in flight finishes (or briefly, to poll buffer and control)."""
        import ray

        refs = list(self.shards) + [r for r, _ in self.evals]
        if self.learning is not None:
            refs.append(self.learning.refs[0])
        timeout = 0.2 if self.cfg.sync.mode == "async" or not refs else 1.0
        done, _ = ray.wait(refs, num_returns=1, timeout=timeout) if refs else ([], [])
        if not refs:
            time.sleep(timeout)
        for ref in done:
            if self.learning is not None and ref == self.learning.refs[0]:
                self._on_step_done()
            elif ref in self.shards:
                self._on_batch_done(ref)
            else:
                step = next(s for r, s in self.evals if r == ref)
                self.evals = [(r, s) for r, s in self.evals if r != ref]
                self._on_eval_done(ref, step)

    def _drain(self) -> None:
        """Finish the step and evaluations in flight; let no rollout batch push afterwards."""
        import ray

        if self.learning is not None:
            ray.wait(self.learning.refs, num_returns=len(self.learning.refs))
            self._on_step_done()
        for ref, step in self.evals:
            self._on_eval_done(ref, step)
        self.evals = []
        for slot in list(self.pool.slots):  # batches in flight are abandoned, never half-pushed
            self.pool.remove(slot)
        self.shards.clear()

    def _poll_control(self) -> None:
        n = self.rundir.take_worker_request()
        if n is None:
            return
        if self.sync.broadcasts and self.cfg.sync.mode == "lockstep":
            # a new engine can only get the weights of a broadcast: wait for the next publish
            logger.info("scaling rollout workers to %d at the next publish", n)
            self._deferred_workers = n
            return
        added = n > len(self.pool.active)
        self._scale(n)
        if self.sync.broadcasts and added:
            self._publish()  # new engines get the newest weights now (async: any version runs)

    def _scale(self, n: int) -> None:
        active = self.pool.active
        logger.info("scaling rollout workers %d -> %d", len(active), n)
        for _ in range(n - len(active)):
            self.pool.add()
        for slot in active[n:]:
            slot.retiring = True
            if slot.busy is None:
                self.pool.remove(slot)
        self.metrics.write("scale", self.step, workers=n, wall_s=time.time() - self.started)
        self._write_status("running")

    def _start(self) -> None:
        from staleflow.actors.models import prepare_model
        from staleflow.actors.tasks import make_task
        from staleflow.buffer.replay import ReplayBuffer
        from staleflow.buffer.server import RedisServer, redis_dir
        from staleflow.cluster.placement import LearnerGroup, WorkerPool, start_ray
        from staleflow.cluster.resources import check_sync_method, cluster_nodes, fit, run_requests
        from staleflow.cluster.weights import WeightSync

        check_sync_method(self.cfg)
        self.rundir.config.write_text(redact(dump_config(self.cfg)) + "\n")
        # bad input fails here, before any server or process starts
        self.prompts = iter(make_task(self.cfg.task).train_prompts())
        prepare_model(self.cfg.model)
        self.metrics = MetricsWriter(self.rundir, self.cfg.run.tensorboard)
        if self.cfg.run.record_trajectories:
            self.trajectories = TrajectoryLog(self.rundir.trajectories)
        self._write_status("starting")
        logger.info("run %s in %s (%s schedule)", self.run_id, self.rundir.path, self.cfg.sync.mode)
        url = self.cfg.buffer.redis_url
        if url is None:
            self._redis = RedisServer(
                redis_dir(self.rundir.path), persistence=self.cfg.buffer.persistence
            ).start()
            url = self._redis.url
        self.buffer = ReplayBuffer.from_config(self.cfg.buffer, url, self.run_id)
        logger.info("buffer: %s", redact(url))
        self.buffer.clear()  # a run name reused on a shared server starts from an empty buffer
        import ray

        self._started_ray = not ray.is_initialized() and not self.address
        start_ray(self.address, self.cfg)
        fit(run_requests(self.cfg), cluster_nodes())  # refuse now rather than wait forever
        publish_dir = self.cfg.sync.checkpoint_dir or str(self.rundir.path / "weights")
        self.learner = LearnerGroup(self.cfg, publish_dir=publish_dir)
        self.pool = WorkerPool(self.cfg, self.run_id, url)
        for _ in range(self.cfg.rollout.num_workers):
            self.pool.add()
        self.sync = WeightSync(self.cfg, self.learner, self.pool)
        self.learner.ready(self.cfg.run.start_timeout_s)
        self.pool.ready(self.cfg.run.start_timeout_s)
        logger.info(
            "ray: %d rollout worker(s), %d learner rank(s)",
            len(self.pool.slots), self.cfg.learner.num_ranks,
        )  # fmt: skip
        self._publish()
        self._evaluate(0)
        self.started = time.time()  # busy fractions and wall time count from here
        self._write_status("running")
        if self.progress is not None:
            self.progress.start(self.cfg.run.steps)

    def _finish(self, status: str) -> dict[str, Any]:
        """Checkpoint, reconcile, report and stop everything; safe after a partial start."""
        summary: dict[str, Any] = {"status": status, "steps": self.step, "run_id": self.run_id}
        try:
            if getattr(self, "learner", None) is not None and self.step > 0:
                self._checkpoint()
            if getattr(self, "buffer", None) is not None:
                summary.update(self._reconcile())
        except Exception:
            logger.exception("could not checkpoint or reconcile the run")
            summary["status"] = status = "failed"
        last = max(self.accuracy, default=None)
        summary.update(
            wall_s=time.time() - self.started,
            accuracy_before=self.accuracy.get(0),
            accuracy_after=self.accuracy.get(last) if last else None,
            accuracy_by_step={str(k): v for k, v in sorted(self.accuracy.items())},
        )
        if self.progress is not None:
            self.progress.stop()
        self._write_status(status)
        logger.info("stopping (%s after %d steps): %s", status, self.step, summary.get("groups"))
        self._teardown()
        write_json(self.rundir.summary, summary)
        try:
            from staleflow.cluster.report import write_report

            write_report(self.rundir)
        except Exception:
            logger.exception(
                "could not write the report; rerun `staleflow report %s`", self.rundir.path
            )
        return summary

    def _reconcile(self) -> dict[str, Any]:
        """pushed = trained + dropped (stale, invalid) + left in the buffer, by both counts."""
        stats = self.buffer.stats()
        left = stats.undelivered + stats.pending
        first_trainings = stats.acked - stats.reused
        c = self.counts
        return {
            "groups": {
                "pushed": stats.pushed,
                "trained": first_trainings,
                "trainings": stats.acked,
                "dropped_stale": stats.dropped_stale,
                "dropped_invalid": stats.dropped_invalid,
                "left_in_buffer": left,
                "duplicates": stats.duplicates,
                "reconciled": stats.pushed
                == first_trainings + stats.dropped_stale + stats.dropped_invalid + left
                and c.trained == stats.acked
                and c.dropped_stale == stats.dropped_stale
                and c.dropped_invalid == stats.dropped_invalid,
            },
            "driver_counts": {
                "trained": c.trained,
                "dropped_stale": c.dropped_stale,
                "dropped_invalid": c.dropped_invalid,
                "pushed_by_finished_batches": c.pushed_by_reports,
            },
            "pushed_by_version": stats.pushed_by_version,
            "trained_by_version": stats.trained_by_version,
            "rollout_batches": c.rollout_batches,
            "learner_busy": c.learner_s / max(time.time() - self.started, 1e-9),
            "rollout_busy_s": c.rollout_s,
        }

    def _teardown(self) -> None:
        import ray

        for what, stop in (
            ("workers", lambda: [self.pool.remove(s) for s in list(self.pool.slots)]),
            ("learner", lambda: self.learner.kill()),
            ("buffer", lambda: self.buffer.close()),
            ("metrics", lambda: self.metrics.close()),
            ("trajectories", lambda: self.trajectories and self.trajectories.close()),
            ("ray", lambda: ray.shutdown() if self._started_ray else None),
            ("redis", lambda: self._redis.stop() if self._redis is not None else None),
        ):
            try:
                stop()
            except AttributeError:  # never started
                pass
            except Exception:
                logger.exception("could not stop the %s", what)

    def _write_status(self, state: str) -> None:
        pool = getattr(self, "pool", None)
        write_json(
            self.rundir.status,
            {
                "state": state,
                "step": self.step,
                "steps": self.cfg.run.steps,
                "workers": len(pool.active) if pool is not None else 0,
                "published_version": self.latest.version if self.latest is not None else None,
                "updated_at": time.time(),
            },
        )
