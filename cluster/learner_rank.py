"""A learner rank as a Ray actor: one data-parallel rank of the learner, wrapping the plain
`Learner` (learner/) with what a rank does in a run: rank 0 takes each batch from the buffer
and hands the same groups to the others, every rank steps, rank 0 acks the groups once a
checkpoint holds the step (holding them until then) and publishes. The driver hears back a
small `StepReport` per call. `placement.LearnerGroup` starts the ranks and calls them all
together."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from staleflow.buffer.entries import Receipt
from staleflow.buffer.ports import free_port, node_address
from staleflow.buffer.records import Group
from staleflow.buffer.replay import ReplayBuffer
from staleflow.cluster.schedule import groups_per_step
from staleflow.cluster.trajectories import TrajectoryLog
from staleflow.learner.feed import BatchFeed
from staleflow.learner.ipc import WeightSharer, mps_hint
from staleflow.learner.publish import (
    CheckpointPublisher,
    RayPublisher,
    broadcast_send,
    tensor_layouts,
)
from staleflow.learner.sync_group import SyncGroup, ray_place

if TYPE_CHECKING:  # imported in the rank's process: a driver starts ranks without torch
    from staleflow.learner.learner import Learner

__all__ = ["LearnerRank", "StepReport"]


@dataclass(frozen=True)
class StepReport:
    """What one `LearnerRank.train` call did: small, it is all the driver gets of a step."""

    trained: bool  # False: fewer than G groups came within the wait (they stay staged)
    version: int  # the learner's policy version after the call
    metrics: dict[str, float] = field(default_factory=dict)
    reward_mean: float = 0.0
    lag_counts: dict[str, int] = field(default_factory=dict)  # lag -> groups
    dropped_stale: int = 0  # by the buffer while taking, since the last report
    dropped_invalid: int = 0
    timeline: dict[str, float] = field(default_factory=dict)  # take_s, step_s, ack_s, ...
    weights: Any = None  # the published handle, when asked to publish (ray, checkpoint)
    acked: int = 0  # groups the buffer counted as acked (== trained, or something is wrong)
    # sampling: replay. Of the step's groups, how many were trained before; of the drops
    # since the last report, how many were such replays (the schedule counts each group once)
    replays: int = 0
    replays_dropped: int = 0


class LearnerRank:
    """One data-parallel rank of the learner (a Ray actor). Rank 0 takes each batch from the
    buffer, hands the same groups to the other ranks, acks them once a checkpoint holds the
    step (right after it with run.checkpoint_every 0) and publishes weights; the driver only
    says when (docs/architecture.md, "The data path")."""

    def __init__(
        self,
        cfg: Any,
        rank: int,
        world_size: int,
        master: tuple[str, int],
        publish_dir: str | None = None,
        redis_url: str | None = None,
        run_id: str | None = None,
        trajectories_dir: str | None = None,
        shared: Sequence[Any] = (),
    ) -> None:
        for directory in shared:  # before the rendezvous: a rank that fails here fails fast
            directory.check(f"learner rank {rank} on {node_address()}")
        if master[1] == 0:  # one rank (LearnerGroup): a port of its own, on loopback
            master = (master[0], free_port())
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        self.cfg = cfg
        from staleflow.learner.learner import Learner

        self.learner: Learner = Learner(cfg, rank=rank, world_size=world_size)
        self.rank, self.world_size = rank, world_size
        self.sync_group: Any = None
        self.sharer: WeightSharer | None = None  # sync.method ipc, rank 0
        self.publisher: Any = None
        if cfg.sync.method == "checkpoint":
            if publish_dir is None:
                raise ValueError("sync.method checkpoint needs a directory to publish into")
            self.publisher = CheckpointPublisher(publish_dir)
        elif cfg.sync.method == "ray":
            self.publisher = RayPublisher(cfg.sync.bucket_mb)
        elif cfg.sync.method == "ipc" and rank == 0:
            self.sharer = WeightSharer(cfg.sync.bucket_mb << 20, tag=run_id)
            if self.learner.device.type == "cuda" and (hint := mps_hint()) is not None:
                logging.getLogger(__name__).info(hint)
        self.feed: BatchFeed | None = None
        self.trajectories: TrajectoryLog | None = None
        if rank == 0 and redis_url is not None and run_id is not None:
            buffer = ReplayBuffer.from_config(cfg.buffer, redis_url, run_id)
            buffer.check_reachable(f"learner rank 0 on {node_address()}")
            self.feed = BatchFeed(buffer, groups_per_step(cfg))
            if trajectories_dir is not None:
                self.trajectories = TrajectoryLog(trajectories_dir)
        self._step_s = 1.0  # the last step's length: how long a prefetch may wait for data
        # With periodic checkpoints a step's groups are acked when a checkpoint holds the step
        # (`save`), so a learner restarted from it trains them again: none is lost or doubled.
        self.defer_acks = cfg.run.checkpoint_every > 0

    def train(self, wait_s: float, publish: bool) -> StepReport:
        """One learner step on the next G groups of the buffer, if they come within `wait_s`:
        take (prefetched while the previous step ran), record, train, ack, then publish if
        asked. Every rank is called at once; rank 0 returns the report."""
        version = self.learner.version
        t0 = time.perf_counter()
        batch, failure, doing = None, None, "take its batch"
        if self.rank == 0:
            try:
                batch = self.feed.next(version, wait_s) if self.feed is not None else None
                if batch is not None and self.trajectories is not None:
                    doing = "record the batch's trajectories"
                    self.trajectories.record(version + 1, version, batch.groups)
            except Exception as exc:  # every rank must leave the collective below together
                failure = exc
        groups = self._share(batch.groups if batch is not None else None, failure, doing)
        stale, invalid, replays_dropped = (0, 0, 0) if self.feed is None else self.feed.drops()
        if groups is None:
            return StepReport(False, version, dropped_stale=stale, dropped_invalid=invalid,
                              replays_dropped=replays_dropped)  # fmt: skip
        if self.feed is not None:  # read and decode the next batch while this one trains
            self.feed.prefetch(version + 1, wait_s=self._step_s)
        t1 = time.perf_counter()
        metrics = self.learner.step(groups)
        t2 = time.perf_counter()
        acked = 0
        if self.feed is not None and batch is not None:
            if self.defer_acks:
                self.feed.hold(batch)
            else:
                acked = self.feed.ack(batch)
        t3 = time.perf_counter()
        weights = self.publish() if publish else None
        t4 = time.perf_counter()
        self._step_s = t2 - t1
        lags = Counter(str(version - g.policy_version) for g in groups)
        timeline = {
            "take_s": batch.take_s if batch is not None else t1 - t0,
            "step_s": t2 - t1,
            "ack_s": t3 - t2,
            "publish_s": t4 - t3 if publish else 0.0,
        }
        reward = float(np.mean([g.rewards.mean() for g in groups]))
        replays = sum(r.replay for r in batch.receipts) if batch is not None else 0
        return StepReport(
            True, self.learner.version, metrics, reward, dict(lags), stale, invalid, timeline,
            weights, acked, replays, replays_dropped,
        )  # fmt: skip

    def _share(
        self,
        groups: list[Group] | None,
        failure: BaseException | None = None,
        doing: str = "take its batch",
    ) -> list[Group] | None:
        """Rank 0's groups (or None: not enough yet) on every rank, over the learner's own
        process group; the groups were validated by rank 0's decoder. A failure on rank 0
        (while it did `doing`) is raised on every rank, so none waits in a collective for it."""
        if self.world_size > 1:
            import torch.distributed as dist

            box: list[Any] = [("error", f"{doing}: {failure!r}") if failure else ("ok", groups)]
            dist.broadcast_object_list(box, src=0)
            kind, payload = box[0]
            if kind == "error" and failure is None:
                raise RuntimeError(f"learner rank 0 failed to {payload}")
            groups = payload
        if failure is not None:
            raise failure
        return groups

    def publish(self) -> Any:
        """ray / checkpoint / ipc: every rank gathers (ZeRO-3 needs all); rank 0 returns the
        published handle. The publisher takes the tensors: on a CPU learner host views of
        them (no copy), the object store or the file taking the one copy; from a GPU, ray
        copies them to the host a bucket at a time. ipc copies them once on their device."""
        with self.learner.gathered_weights() as tensors:
            if self.rank != 0:
                return None
            if self.sharer is not None:
                return self.sharer.share(tensors, self.learner.version, ray_place())
            return self.publisher.publish(tensors, self.learner.version)

    # broadcast methods (nccl, gloo): rank 0 sends to the engines in a group of their own

    def sync_address(self) -> tuple[str, int]:
        """Where the broadcast group meets: this rank's node address and a free port."""
        host = node_address()
        return host, free_port()

    def sync_layouts(self, bucket_bytes: int) -> Any:
        """Every rank gathers under ZeRO-3; rank 0 returns the broadcast buckets' layouts."""
        with self.learner.gathered_weights() as tensors:
            return tensor_layouts(tensors, bucket_bytes) if self.rank == 0 else None

    def open_sync_group(self, host: str, port: int, world_size: int) -> None:
        backend, timeout = self.cfg.sync.method, self.cfg.sync.broadcast_timeout_s
        self.sync_group = SyncGroup.reopen(
            self.sync_group, backend, host, port, 0, world_size, timeout
        )

    def broadcast(self, version: int) -> Any:
        """Every rank gathers under ZeRO-3; rank 0 sends, straight from the learner's device."""
        with self.learner.gathered_weights() as tensors:
            if self.rank != 0:
                return None
            bucket_bytes = self.cfg.sync.bucket_mb << 20
            return broadcast_send(self.sync_group, tensors, bucket_bytes, version)

    # ipc: rank 0 shares its weights in place with the engines on its device

    def place(self) -> tuple[str, list[str]]:
        """This rank's node id and GPU ids (ipc checks every worker shares rank 0's)."""
        return ray_place()

    def discard_shared(self, version: int) -> None:
        """Rank 0: free a shared version no batch, evaluation or checkpoint needs any more."""
        if self.sharer is not None:
            self.sharer.discard(version)

    def save_shared(self, versions: list[int], directory: str) -> None:
        """Rank 0: write shared versions into a checkpoint's `weights/` (a resumed run
        publishes them through the object store: its learner only has its own step's)."""
        if self.sharer is not None:
            publisher = CheckpointPublisher(directory)
            for version in versions:
                publisher.publish(self.sharer.host_arrays(version), version)

    def save(self, path: str, extra: dict[str, Any]) -> None:
        """Checkpoint (every rank takes part: sharded optimizer states, ZeRO-3 gathers). The
        groups held since the last one are named in it and acked by `commit`, which the
        driver calls once LATEST names this checkpoint: a crash before that resumes from the
        previous checkpoint with the groups still in the buffer, a crash after it acks them
        at resume instead of training them again. No step runs between the two calls."""
        held = self.feed.held if self.feed is not None else []
        acked = [[r.entry_id, r.policy_version, r.replay, r.token] for r in held]
        self.learner.save(path, {**extra, "acked": acked} if self.rank == 0 else extra)

    def commit(self) -> int:
        """Ack the held groups the last `save` named (rank 0); returns how many were acked."""
        return self.feed.commit() if self.feed is not None else 0

    def load(self, path: str | None, step: int) -> int:
        """Resume: restore the checkpoint at `path` (None: the initial weights, step 0); rank 0
        acks what the checkpoint committed, forgets the recorded steps after `step`, and gets
        back every group delivered but not acked (trained after the checkpoint, or staged).
        Returns how many groups it recovered."""
        extra = self.learner.load(path) if path is not None else {}
        if self.trajectories is not None:
            self.trajectories.truncate(step)
        if self.feed is None:
            return 0
        # [entry, version, replay, take token] ([entry, version, replay] before the token)
        receipts = [
            Receipt(str(e), int(v), bool(r), str(t[0]) if t else "")
            for e, v, r, *t in extra.get("acked", [])
        ]
        self.feed.buffer.ack(receipts)
        return self.feed.buffer.recover()

    def settle(self) -> tuple[int, int, int]:
        """Rank 0: wait for a prefetch in progress; (stale, invalid, of those the replays) it
        dropped unreported."""
        return self.feed.settle() if self.feed is not None else (0, 0, 0)

    def close(self) -> None:
        """Let a prefetch in progress finish, flush the trajectory record, remove shared
        weights."""
        if self.sharer is not None:
            self.sharer.close()
        if self.feed is not None:
            self.feed.close()
        if self.trajectories is not None:
            self.trajectories.close()
