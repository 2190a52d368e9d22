"""Checkpointing a run and resuming it from its last checkpoint (`staleflow train --resume
RUN_DIR`): the driver's `_checkpoint` and `_restore` (CheckpointMixin) and what they use.

What a checkpoint holds besides the learner (learner.checkpoint): the driver's state at that
step (`driver_state`: the schedule's counts, which rollout batches were running and with which
version, the groups counted so far) and, when the schedule still needs them, the weights of
older published versions (`weights/` in the checkpoint: lock-step with sync.offset > 0 hands
out versions older than the step).

The contract (docs/architecture.md, "Faults and resume"): a step's groups are acked only once
a checkpoint holds the step, so the groups trained after the checkpoint are still pending and
come back to the resumed learner, in the order they were taken; rollout batches redone after
the resume have the same group ids, so what was pushed before the stop is not pushed twice.
Every group pushed is then trained exactly once or dropped with a counted reason, no step is
counted twice (metrics.jsonl, TensorBoard and the trajectory record are cut back to the
checkpoint's step), and a lock-step lag continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from staleflow.cluster.ledger import Counts
from staleflow.cluster.rundir import RunDir, read_json_object, read_metrics
from staleflow.cluster.schedule import Flow
from staleflow.configs.schema import SyncConfig

__all__ = [
    "CheckpointMixin",
    "Resume",
    "ResumeError",
    "check_resumable",
    "driver_state",
    "load_resume",
    "republish",
    "resume_overrides_allowed",
    "save_old_weights",
    "versions_in_use",
    "versions_to_keep",
]

logger = logging.getLogger(__name__)

STATE_FORMAT = 1

# What a resume may change (a longer run, more workers, where the buffer is); anything else
# would make the resumed half a different experiment from the first.
RESUMABLE = (
    "run.steps", "run.eval_every", "run.checkpoint_every", "run.keep_checkpoints",
    "run.tensorboard", "run.report", "run.start_timeout_s", "rollout.num_workers",
    "rollout.max_restarts", "rollout.batch_timeout_s", "rollout.vllm.gpu_memory_utilization",
    "buffer.redis_url", "buffer.push_timeout_s",
)  # fmt: skip


class ResumeError(RuntimeError):
    """The run directory cannot be resumed (what is missing or changed, and what to do)."""


def resume_overrides_allowed(overrides: list[str]) -> None:
    """Refuse overrides a resume may not change (see `RESUMABLE`)."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key not in RESUMABLE:
            raise ResumeError(
                f"{key} cannot change when a run resumes (it would train the rest of the run "
                f"differently); a resume may set: {', '.join(RESUMABLE)}"
            )


def driver_state(driver: Any, trained: int) -> dict[str, Any]:
    """The driver's state at a checkpoint; `trained` counts the trainings acked once the
    checkpoint is written (it acks the held ones)."""
    flow, c = driver.flow, driver.counts
    return {
        "format": STATE_FORMAT,
        "flow": {
            "steps": flow.steps,
            "batches": flow.batches,
            "batches_done": flow.batches_done,
            "running": {str(b): [v, g] for b, (v, g) in flow.running.items()},
            "pushed": flow.pushed,
            "partial": {str(b): n for b, n in flow.partial.items()},
            "trained": flow.trained,
            "dropped": flow.dropped,
            "replayed": flow.replayed,
            "replays_dropped": flow.replays_dropped,
        },
        "counts": {**dataclasses.asdict(c), "trained": trained, **driver.clock()},
        "prompts_per_batch": driver.P,
        "prompts": {"taken": driver.prompts.taken, "sha256": driver.prompts.digest},
        "faults": driver.faults,
    }


def save_old_weights(driver: Any, checkpoint: Path) -> None:
    """The published versions older than the step that a batch may still need, into the
    checkpoint (a resumed learner can only publish its own step's weights). Durable before it
    returns, directory entries included: the caller then moves LATEST and acks the groups."""
    from staleflow.learner import durable
    from staleflow.learner.publish import CheckpointPublisher

    old = sorted(versions_to_keep(driver.schedule, driver.flow))
    if not old:
        return
    if driver.sync.broadcasts:
        logger.warning(
            "checkpoint at step %d: the schedule still needs weights v%s, which sync.method %s "
            "does not keep; a resume from this checkpoint will be refused",
            driver.step, old, driver.cfg.sync.method,
        )  # fmt: skip
        return
    # Those held: a resumed run was checked for the versions its own steps need; one that
    # lengthened the run may not hold every version a further lengthening would need.
    old = [v for v in old if v in driver.published]
    from staleflow.learner.ipc import SharedWeights

    # ipc: learner rank 0 writes the versions it shares; a resumed run's older ones came
    # through the object store (republish) and are written from here, like ray's
    shared = [v for v in old if isinstance(driver.published[v], SharedWeights)]
    publisher = CheckpointPublisher(checkpoint / "weights")
    for version in old:
        if version not in shared:
            publisher.publish(dict(driver.published[version].arrays()), version)
    if shared:
        driver.learner.save_shared(shared, str(checkpoint / "weights"))
    # Each file is fsynced, not its new name nor `weights/` in the checkpoint: on power loss
    # after LATEST and the acks, the checkpoint could come back without them, and the run
    # could not be resumed from it nor, its groups acked, from an older one.
    durable.fsync_dir(checkpoint / "weights")
    durable.fsync_dir(checkpoint)


class CheckpointMixin:
    """The driver's checkpoint and its restore from one: methods of cluster.driver.Driver,
    whose state (the schedule's Flow, the Counts, the published versions) they write and
    read back, kept here with the rest of what a checkpoint holds."""

    def _checkpoint(self: Any, final: bool = False) -> None:
        """`_write_checkpoint`, which a second stop signal does not cut short: it stops the
        run once the checkpoint is complete."""
        self._checkpointing = True
        try:
            self._write_checkpoint(final)
        finally:  # a failed checkpoint stops the run with its own error, not this signal
            self._checkpointing = False
            interrupt, self._interrupt_after_checkpoint = self._interrupt_after_checkpoint, False
        if interrupt and not self._finishing:  # (the stop's own checkpoint: stopping anyway)
            raise KeyboardInterrupt

    def _write_checkpoint(self: Any, final: bool = False) -> None:
        """Checkpoint the learner with the driver's state (`driver_state`), name it in LATEST,
        then ack and count the groups it holds: every step up to this one is durable now.

        With a broadcast sync (nccl, gloo) no copy of older weights is kept, so a checkpoint
        between a lock-step schedule's syncs, where coming batches still need older weights,
        could never be resumed; made, it would ack its groups and leave the run nothing to
        resume from. It is skipped (with a warning; the groups stay held for the next one),
        except the completed run's `final` one, kept for its weights."""
        if self.sync.broadcasts and not final:
            needed = sorted(versions_to_keep(self.schedule, self.flow))
            if needed:
                logger.warning(
                    "no checkpoint at step %d: batches still to run need weights v%s, which "
                    "sync.method %s does not keep, so it could not be resumed; a resume "
                    "continues from the last checkpoint (set run.checkpoint_every to a "
                    "multiple of sync.interval to checkpoint at syncs)",
                    self.step, needed, self.cfg.sync.method,
                )  # fmt: skip
                return
        path = self.rundir.checkpoints / f"step-{self.step:06d}"
        held = self.flow.trained - self.counts.trained  # trainings acked by this checkpoint
        state = driver_state(self, trained=self.flow.trained)
        self.learner.save(str(path), {"step": self.step, "run_id": self.run_id,
                                      "driver": state})  # fmt: skip
        save_old_weights(self, path)
        self._sync_buffer_log()
        # Only a checkpoint LATEST names is resumed from: its groups are acked after that.
        self.rundir.mark_latest_checkpoint(path)
        acked = self.learner.commit()
        if acked != held:  # 0 == 0 when every step acks its own groups (checkpoint_every 0)
            logger.error("checkpoint at step %d acked %d groups, %d were held: the summary "
                         "will not reconcile", self.step, acked, held)  # fmt: skip
        self.counts.trained += acked
        self._checkpointed = self.step
        self.rundir.prune_checkpoints(self.cfg.run.keep_checkpoints)
        self.metrics.write("checkpoint", self.step, path=str(path), acked=acked)

    def _sync_buffer_log(self: Any) -> None:
        """The embedded Redis's append-only file fsynced before LATEST names the checkpoint:
        it fsyncs once a second, so a machine going down right after could lose pushes the
        checkpoint counts (their batches done, never redone: a resume refuses such a
        buffer). An external Redis keeps its own policy (its appendfsync)."""
        import redis

        server = self.services.redis
        if server is None:
            return
        risk = ("if this machine goes down within a second, a resume may find pushes "
                "missing and refuse")  # fmt: skip
        try:
            synced = server.sync_log(self.buffer.keys.prefix + "checkpointed")
        except redis.RedisError as exc:
            logger.warning(
                "checkpoint at step %d: the buffer's log could not be made durable now (%s), "
                "and Redis may go on fsyncing every write (appendfsync always) until a later "
                "checkpoint sets it back; %s", self.step, exc, risk,
            )  # fmt: skip
            return
        if not synced and self.cfg.buffer.persistence:  # (without, there is no log to sync)
            logger.warning("checkpoint at step %d: the embedded Redis is not running, so its "
                           "log was not made durable now; %s", self.step, risk)  # fmt: skip

    def _check_buffer_as_left(self: Any, stats: Any) -> None:
        """A resume's checks of the buffer's `stats` as the stopped run left it, made as soon
        as the buffer is reached, before any learner rank or rollout worker starts
        (Services.start): a resume refused here costs a Redis and a Ray, not the start of
        every actor. The counts that only the checkpoint's load settles are checked again in
        _restore."""
        r = self.resumed
        assert r is not None
        acked = stats.acked
        if acked and r.checkpoint is None:
            raise ResumeError(
                f"{self.rundir.path} has no checkpoint, but the buffer has acknowledged "
                f"{acked} trainings: its groups were acked as they were trained "
                "(run.checkpoint_every=0) or its checkpoints were removed, so it cannot be "
                "resumed exactly; start a new run"
            )
        if acked > r.counts.trained:  # what check_resumable cannot see without metrics.jsonl
            raise ResumeError(
                f"the buffer has acknowledged {acked} trainings, but "
                f"{r.checkpoint or 'the start of the run'} counts {r.counts.trained}: a later "
                "checkpoint was made (its groups are gone from the buffer), so this run cannot "
                "be resumed exactly from here; restore the run's newest checkpoint and its "
                "LATEST, or start a new run"
            )
        if stats.pushed < r.flow.pushed:
            raise _lost_its_data(stats, r)

    def _restore(self: Any, r: Resume) -> None:
        """Continue from the checkpoint `r`: the learner loads it and gets back the groups
        held since; the schedule's counts, the batches to redo and older weights return."""
        from staleflow.cluster.failures import LearnerFailed

        started = time.monotonic()
        old = r.check_old_weights(self.schedule, self.cfg.sync.method)
        try:
            recovered = self.learner.load(str(r.checkpoint) if r.checkpoint else None, r.step)
        except LearnerFailed as exc:
            raise ResumeError(f"the learner could not load {r.checkpoint}: {exc}") from None
        stats = self.buffer.stats()  # (the load acked the checkpoint's groups if not yet)
        if (stats.acked == 0 < r.counts.trained) or (stats.pushed < r.flow.pushed):
            raise _lost_its_data(stats, r)
        if stats.acked < r.counts.trained:
            logger.warning(
                "the buffer counts %d acknowledged trainings, %s counts %d: the summary will "
                "not reconcile (acks lost with the last second of a Redis that died, or a "
                "checkpoint whose commit acked fewer than it held)",
                stats.acked, r.checkpoint, r.counts.trained,
            )  # fmt: skip
        r.cut_metrics(self.rundir)  # the records of what is trained again
        # TensorBoard hides the earlier run's steps from the first one trained again
        self.metrics.reopen(self.cfg.run.tensorboard, purge_step=r.step + 1)
        self._restored = True
        self._checkpointed = r.step  # never rewrite it (a failure now would damage it)
        self.flow, self.counts, self.faults = r.flow, r.counts, r.faults
        self.accuracy = r.accuracy
        stats = self.buffer.stats()
        self.flow.dropped += self.counts.catch_up_drops(stats)
        # the buffer's counts are final (drops since the checkpoint included), as above
        replays_dropped = stats.replays_dropped_stale + stats.replays_dropped_invalid
        self.flow.replays_dropped = max(self.flow.replays_dropped, replays_dropped)
        # replays trained up to the checkpoint, all acked by now (the load acked them if the
        # checkpoint had not): what a checkpoint written before Flow kept them left at 0
        self.flow.replayed = max(self.flow.replayed, stats.reused)
        self.redo = r.redo  # before publishing: their versions are kept
        for version, directory in old.items():
            self._published(republish(self.cfg, version, directory, self.services.publish_dir))
        seconds = time.monotonic() - started
        logger.info(
            "resumed at step %d from %s: %d group(s) held or staged come back, batches %s "
            "redone, %.1f s", r.step, r.checkpoint or "the start (no checkpoint yet)",
            recovered, self.redo or "none", seconds,
        )  # fmt: skip
        checkpoint = None if r.checkpoint is None else str(r.checkpoint)  # (null, not "None")
        self.metrics.write("resume", r.step, checkpoint=checkpoint, recovered=recovered,
                           redo=self.redo, restore_s=seconds)  # fmt: skip


def _lost_its_data(stats: Any, r: Resume) -> ResumeError:
    """Why a resume cannot use a buffer with fewer groups pushed (or no trainings
    acknowledged) than its checkpoint counts: an empty or another buffer, or one that lost its
    last writes (_sync_buffer_log). Groups the checkpoint counts as pushed are gone, and a run
    that waited for them would wait for ever (a batch it counts as done is not redone)."""
    return ResumeError(
        f"the replay buffer has {stats.pushed} groups pushed and {stats.acked} "
        f"trainings acknowledged, but {r.checkpoint or 'the run'} counts "
        f"{r.flow.pushed} pushed and {r.counts.trained} trained: this is not the "
        "run's buffer, or it lost its data (an embedded Redis whose files were "
        "removed or a run with buffer.persistence: false; an external Redis restarted "
        "without persistence, flushed, or another buffer.redis_url; fewer pushed "
        "than counted, a Redis whose machine went down before its log reached the "
        "disk: an external one fsyncs by its own appendfsync policy, the embedded "
        "one at each checkpoint, unless the run's log warns it could not). Resume "
        "against the run's own buffer, or start a new run"
    )


def versions_to_keep(schedule: Any, flow: Flow) -> set[int]:
    """The older versions a checkpoint must hold for a resume: in lock-step `versions_in_use`
    (a resume redoes a running batch with its own version, and the coming ones need theirs);
    in async none, as a resume redoes running batches with the newest version. Async runs
    nearly always have a batch running that started at an older version: counted, every
    periodic and stop checkpoint of a broadcast method (nccl, gloo) was skipped, and the
    others copied versions the resume discarded at once."""
    return versions_in_use(schedule, flow) if schedule.lockstep else set()


def versions_in_use(schedule: Any, flow: Flow, *, through: int | None = None) -> set[int]:
    """Versions older than `flow.steps` that batches running or still to start are generated
    with: in lock-step each coming batch's up to batch `through`. By default that is twice
    run.steps: a resume may lengthen the run, and what its next batches use is kept, e.g.
    with I=1, O=3 at step 8 of 8 the next three batches use v5, v6 and v7. Not further: with
    an offset past the run's length (the offline preset, sync.offset=1000000) every batch of
    the run uses v0, and looking on to the batches after the offset kept every version the
    run published, in memory and in each checkpoint. A resume needs them `through` its own
    run.steps (Resume.check_old_weights): the batches it makes."""
    from staleflow.cluster.schedule import rollout_version

    needed = {v for v, _ in flow.running.values()}
    if schedule.lockstep:
        last = 2 * schedule.cfg.run.steps if through is None else through
        batch = flow.batches + 1
        if batch <= min(schedule.O + 1, last):  # batches up to O + 1 all use v0: not one by one
            needed.add(0)
            batch = schedule.O + 2
        while batch <= last:
            version = rollout_version(batch, schedule.I, schedule.O)
            if version >= flow.steps:
                break
            needed.add(version)
            batch += 1
    return {v for v in needed if 0 <= v < flow.steps}


@dataclass
class Resume:
    """A run directory's last checkpoint, read back for the driver."""

    checkpoint: Path | None  # None: stopped before its first checkpoint (resume from step 0)
    step: int
    flow: Flow
    counts: Counts
    versions: dict[int, int] = field(default_factory=dict)  # batch to redo -> its version
    faults: list[dict[str, Any]] = field(default_factory=list)
    accuracy: dict[int, float] = field(default_factory=dict)
    _prompts: list[Any] = field(default_factory=list)
    P: int = 0
    prompts_taken: dict[str, Any] | None = None  # PromptStream's count and digest (or none kept)

    @property
    def redo(self) -> list[int]:
        return sorted(self.versions)

    def prompts_of(self, batch: int) -> list[Any]:
        return self._prompts[(batch - 1) * self.P : batch * self.P]

    def continue_prompts(self, stream: Any) -> Any:
        """The prompt stream (actors.tasks.PromptStream) where the checkpoint left it, the
        redone batches' prompts kept; ResumeError if the prompts it took up to there are not
        the ones the checkpoint's run took (the task's data changed)."""
        self._prompts = stream.take(self.flow.batches * self.P)
        saved = self.prompts_taken
        if saved is not None and (stream.taken, stream.digest) != (saved["taken"], saved["sha256"]):
            raise ResumeError(
                f"the task's training prompts changed since {self.checkpoint}: the "
                f"{saved['taken']} prompts its batches took are not the {stream.taken} the "
                "task gives now (an edited task.path file, another version of the task's "
                "data or code); the rest of the run would train on other prompts, and redo "
                "batches with other prompts under the same group ids. Put the task's data "
                "back as it was, or start a new run"
            )
        return stream

    def cut_metrics(self, run: RunDir) -> None:
        """Drop the metrics.jsonl records the resumed run makes again: every record after
        the checkpoint's step, and the rollout records of batches it redoes or had not
        started (a batch that finished after the checkpoint was written is generated again)."""

        def kept(r: dict[str, Any]) -> bool:
            if int(r.get("step", 0)) > self.step:
                return False
            batch = r.get("batch")
            if r.get("kind") != "rollout" or not isinstance(batch, int):
                return True
            return batch <= self.flow.batches and batch not in self.versions

        records = [r for r in read_metrics(run.metrics) if kept(r)]
        tmp = run.metrics.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        tmp.replace(run.metrics)

    def check_old_weights(self, schedule: Any, method: str) -> dict[int, Path]:
        """The older versions the checkpoint kept (`old_weights`); raises ResumeError if the
        schedule still needs one it did not keep: a coming lock-step batch's or a redone
        one's (async redoes batches with the newest version)."""
        needed = versions_in_use(schedule, self.flow, through=schedule.cfg.run.steps)
        if schedule.lockstep:
            needed |= {v for v in self.versions.values() if v < self.step}
        old = self.old_weights()
        missing = sorted(needed - set(old))
        if missing:
            why = (
                f"sync.method {method} keeps no copy"
                if method in SyncConfig.PUSH_METHODS
                else "a checkpoint keeps the versions of the batches up to twice the "
                "run.steps of the run that wrote it, and this resume's run.steps goes past "
                "them; or it was written before staleflow kept every version a lock-step "
                "sync.offset above the interval needs"
            )
            raise ResumeError(
                f"{self.checkpoint}: the schedule still needs weights v{missing}, which the "
                f"checkpoint does not hold ({why}); resume with fewer run.steps, or from a "
                "checkpoint without older versions in use"
            )
        return old

    def old_weights(self) -> dict[int, Path]:
        """Older versions the checkpoint kept: version -> directory to read them from."""
        if self.checkpoint is None:
            return {}
        out = {}
        for path in sorted((self.checkpoint / "weights").glob("weights-v*.safetensors")):
            out[int(path.stem.split("-v")[1])] = path.parent
        return out


def _driver_state(checkpoint: Path) -> dict[str, Any]:
    """The driver's state saved in `checkpoint` (see `driver_state`); ResumeError if none."""
    try:
        state = json.loads((checkpoint / "trainer.json").read_text())["extra"]["driver"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ResumeError(
            f"{checkpoint} holds no driver state ({type(exc).__name__}: {exc}); it was written "
            "by an older staleflow or is damaged: start a new run from it with "
            "model.path pointing at an exported model"
        ) from None
    if state.get("format") != STATE_FORMAT:
        raise ResumeError(f"{checkpoint}: driver state format {state.get('format')!r} unknown")
    return dict(state)


def _prompts_taken(checkpoint: Path, state: dict[str, Any]) -> dict[str, Any] | None:
    """The driver state's record of the prompts taken (None: a checkpoint written before
    staleflow kept one, so the prompts are not checked)."""
    taken = state.get("prompts")
    if taken is None:
        return None
    if not (isinstance(taken, dict) and type(taken.get("taken")) is int
            and isinstance(taken.get("sha256"), str)):  # fmt: skip
        raise ResumeError(
            f"{checkpoint / 'trainer.json'}: damaged driver state (prompts: {taken!r}); "
            "restore the file, or start a new run"
        )
    return taken


def resumable_checkpoint(run: RunDir) -> Path | None:
    """The checkpoint LATEST names (None: the run made none yet); ResumeError if LATEST names
    a directory that is gone (LATEST is written after its directory is complete)."""
    path = run.latest_checkpoint()
    latest = run.checkpoints / "LATEST"
    if path is None and latest.is_file():
        name = latest.read_text().strip()
        raise ResumeError(
            f"{latest} names {name}, which is missing: the groups trained up to it were "
            "acknowledged (removed from the buffer) when it was made, so no older checkpoint "
            f"can redo them; restore {run.checkpoints / name}, or start a new run"
        )
    return path


def check_resumable(run: RunDir, cfg: Any) -> None:
    """Everything a resume refuses, checked before it changes anything in the run directory:
    a checkpoint missing, damaged or older than the last one the run acked its groups at
    (metrics.jsonl's `checkpoint` records, written after the ack); a config.json that differs
    from the checkpoint's config beyond what a resume may change; nothing left to do (the
    last checkpoint holds more than run.steps steps, or exactly as many and the run completed;
    a run stopped during its last step still needs its final evaluation and summary); a
    damaged run-key (RunDir.key)."""
    from staleflow.learner.checkpoint import CheckpointError, check_files

    try:
        run.key  # noqa: B018 (read only to check it)
    except ValueError as exc:
        raise ResumeError(str(exc)) from None
    path = resumable_checkpoint(run)
    done = 0
    if path is not None:
        try:
            trainer = check_files(path)
        except CheckpointError as exc:
            raise ResumeError(
                f"{exc}; this checkpoint cannot be resumed (the groups trained up to it were "
                "acknowledged when it was made, so an older one cannot redo them): restore "
                "the file, or start a new run"
            ) from None
        state = _driver_state(path)
        try:
            done, P = int(state["flow"]["steps"]), int(state["prompts_per_batch"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ResumeError(
                f"{path / 'trainer.json'}: damaged driver state ({type(exc).__name__}: {exc}); "
                "restore the file, or start a new run"
            ) from None
        _check_prompts_per_batch(P, cfg)
        _check_same_config(run, path, trainer.get("config"), cfg)
        moved = lr_horizon_warning(trainer.get("config"), cfg, done)
        if moved:
            logger.warning("%s", moved)
    acked_at = [int(r.get("step", 0)) for r in read_metrics(run.metrics)
                if r.get("kind") == "checkpoint" and r.get("acked", 1)]  # fmt: skip
    if acked_at and max(acked_at) > done:
        where = f"{path.name} holds step {done}" if path else "it has no checkpoint (LATEST)"
        raise ResumeError(
            f"{run.path} acknowledged the groups of its checkpoint at step {max(acked_at)} "
            f"(metrics.jsonl), but {where}: the groups trained after step {done} are gone from "
            f"the buffer, so it cannot be resumed exactly; restore "
            f"{run.checkpoints / f'step-{max(acked_at):06d}'} and LATEST, or start a new run"
        )
    completed = (read_json_object(run.summary) or {}).get("status") == "completed"
    if done > cfg.run.steps or (done == cfg.run.steps and completed):
        raise ResumeError(
            f"{run.path} has already trained {done} steps, and run.steps is {cfg.run.steps}: "
            f"nothing to resume; to train it further, give run.steps=N with N > {done}"
        )


def _check_prompts_per_batch(saved: int, cfg: Any) -> None:
    if cfg.rollout.prompts_per_batch != saved:
        raise ResumeError(
            f"rollout.prompts_per_batch changed from {saved} to "
            f"{cfg.rollout.prompts_per_batch}; a resume must keep it"
        )


def _check_same_config(run: RunDir, checkpoint: Path, saved: Any, cfg: Any) -> None:
    """ResumeError if `cfg` (config.json with the resume's overrides) differs from the config
    the checkpoint was trained with (`saved`, from trainer.json) in a key a resume may not
    change: an edited config.json would train the rest of the run differently."""
    from staleflow.configs.loader import redacted_dict

    if not isinstance(saved, dict):
        return  # an older checkpoint without its config: nothing to compare
    now = flatten(redacted_dict(cfg))
    free = {*RESUMABLE, "run.name", "run.output_dir"}
    for key, old in flatten(saved).items():
        new = now.get(key, old)  # a key this build added or dropped: not a change
        if key not in free and new != old:
            raise ResumeError(
                f"{key} is {json.dumps(new)} in {run.config} but {json.dumps(old)} in the "
                f"checkpoint {checkpoint.name}: a resume continues the run as it was trained; "
                f"put it back in config.json, or start a new run (a resume may set: "
                f"{', '.join(RESUMABLE)})"
            )


def lr_horizon_warning(saved: Any, cfg: Any, done: int) -> str | None:
    """What a resume that changes run.steps does to a warmup_cosine learning rate (its decay
    spans run.steps, so the rest of the run follows the new length), or None if the next
    step's rate stays as it was. `saved` is the checkpoint's config, `done` its steps."""
    from types import SimpleNamespace

    from staleflow.learner.lr import lr_factor

    try:
        old_steps = int(saved["run"]["steps"])
    except (KeyError, TypeError, ValueError):
        return None  # an older checkpoint without its config
    step = done * cfg.learner.mini_batches * cfg.learner.epochs  # the next optimizer step
    old = SimpleNamespace(run=SimpleNamespace(steps=old_steps), learner=cfg.learner)
    before, after = lr_factor(old)(step), lr_factor(cfg)(step)
    if math.isclose(before, after, rel_tol=1e-9, abs_tol=1e-12):
        return None
    lr = cfg.learner.optimizer.lr
    return (
        f"run.steps is {cfg.run.steps}, the checkpoint's run had {old_steps}: "
        f"learner.optimizer.schedule=warmup_cosine decays over run.steps, so step {done + 1} "
        f"trains at lr {lr * after:.3g}, not {lr * before:.3g}, and the decay now ends at "
        f"step {cfg.run.steps}"
    )


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: a config as its dotted keys."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:  # (an empty one is a value: {} -> {..} shows)
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load_resume(run: RunDir, cfg: Any) -> Resume:
    """Read the last checkpoint of `run` (or start from step 0 if it has none, which only
    works if no group was acked yet: `_check_buffer_as_left` asks the buffer). `check_resumable` has
    passed; metrics.jsonl is cut back to the checkpoint's step by `Resume.cut_metrics`, once
    the learner has loaded it."""
    path = resumable_checkpoint(run)
    if path is None:
        # Not judged by cfg.run.checkpoint_every: that is the resume's (a resume may change
        # it), not what the stopped run acked by. A run of checkpoint_every=10 stopped at
        # step 5 was refused when resumed with 0; one of 0 resumed with 10 was let through
        # and refused later for "a later checkpoint".
        res = Resume(None, 0, Flow(), Counts(), P=cfg.rollout.prompts_per_batch)
    else:
        state = _driver_state(path)
        f = state["flow"]
        flow = Flow(
            steps=f["steps"], batches=f["batches"], batches_done=f["batches_done"],
            pushed=f["pushed"], trained=f["trained"], dropped=f["dropped"],
            replayed=f.get("replayed", 0), replays_dropped=f.get("replays_dropped", 0),  # (newer)
            partial={int(b): int(n) for b, n in f.get("partial", {}).items()},  # (newer)
        )  # fmt: skip
        res = Resume(
            path,
            int(f["steps"]),
            flow,
            Counts(**state["counts"]),
            versions={int(b): int(v) for b, (v, _) in f["running"].items()},
            faults=list(state.get("faults", [])),
            P=int(state["prompts_per_batch"]),
            prompts_taken=_prompts_taken(path, state),
        )
        _check_prompts_per_batch(res.P, cfg)  # also for a Driver made without the CLI
    res.accuracy = {
        int(r["step"]): float(r["accuracy"])
        for r in read_metrics(run.metrics)
        if r.get("kind") == "eval" and int(r.get("step", 0)) <= res.step
    }
    return res


def republish(cfg: Any, version: int, directory: Path, publish_dir: str) -> Any:
    """Publish weights a checkpoint kept (`save_old_weights`) the way the run publishes."""
    import shutil

    from staleflow.learner.publish import (
        CheckpointWeights,
        PublishStats,
        RayPublisher,
        read_published,
    )

    if cfg.sync.method in ("ray", "ipc"):  # ipc: rank 0 shares only versions it trained
        _, arrays = read_published(directory, version)
        return RayPublisher(cfg.sync.bucket_mb).publish(arrays, version)
    name = f"weights-v{version:08d}.safetensors"
    target = Path(publish_dir) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(directory / name, target)
    stats = PublishStats(version, 0.0, target.stat().st_size, 1)
    return CheckpointWeights(version, str(target), stats)
