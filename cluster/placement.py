"""Ray placement: starting or joining a cluster, the rollout worker pool and the learner ranks.

The roles stay plain classes (actors/, learner/); this module is the only place that wraps
them in `ray.remote` and decides how many CPUs / GPUs each gets. Remote calls go through the
typed handles returned here (`pool.run_batch(...)`, `learner.train(...)`), never by method-name
strings.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from staleflow.actors.tasks import Prompt
from staleflow.actors.worker import RolloutWorker
from staleflow.buffer.entries import Receipt
from staleflow.buffer.records import Group
from staleflow.buffer.replay import ReplayBuffer
from staleflow.cluster.schedule import groups_per_step
from staleflow.cluster.trajectories import TrajectoryLog
from staleflow.learner.device import hidden_gpus_env
from staleflow.learner.feed import BatchFeed
from staleflow.learner.ipc import WeightSharer
from staleflow.learner.learner import Learner
from staleflow.learner.publish import (
    CheckpointPublisher,
    RayPublisher,
    broadcast_send,
    host_arrays,
    tensor_layouts,
)
from staleflow.learner.sync_group import SyncGroup, free_port, node_address, ray_place

__all__ = [
    "ActorStartError",
    "LearnerGroup",
    "LearnerRank",
    "WorkerPool",
    "learner_threads",
    "object_store_bytes",
    "start_ray",
    "wait_started",
]

logger = logging.getLogger(__name__)


def start_ray(address: str | None, cfg: Any = None, log_to_driver: bool = True) -> None:
    """Join the cluster at `address` ('auto', 'ray://host:port', 'host:port') or start a local
    one on the loopback interface (actors' logs are echoed here unless `log_to_driver` is
    False). A local one gets the machine's CPUs, or what the run
    reserves if that is more, plus `SCALE_HEADROOM` so `staleflow scale` can add workers (Ray
    CPUs are a scheduling count: the OS shares the cores)."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kwargs: dict[str, Any] = {"log_to_driver": log_to_driver, "include_dashboard": False}
    if address:
        ray.init(address=address, **kwargs)
        return
    needed = 1.0
    if cfg is not None:
        needed = cfg.rollout.num_workers * cfg.rollout.cpus_per_worker + cfg.learner.num_ranks
    cpus = max(os.cpu_count() or 1, math.ceil(needed)) + SCALE_HEADROOM
    store = object_store_bytes(cfg) if cfg is not None else None
    if store is None:
        ray.init(num_cpus=cpus, _node_ip_address="127.0.0.1", **kwargs)
        return
    # Pages of a fresh object store fault in on first write: pre-faulted, putting 651 MB of
    # weights takes less than half the time (bench/sync.py). Only in shared memory: where
    # /dev/shm is too small Ray puts the store on disk, and pre-faulting that would be slow.
    prefault = _shm_free() >= store
    if not prefault:
        logger.warning(
            "/dev/shm has less free space than the %d MiB object store: Ray will keep it on "
            "disk, and weight publishes will be slower (give the container a larger /dev/shm, "
            "e.g. docker --shm-size)", store >> 20,
        )  # fmt: skip
    system: dict[str, Any] = {"preallocate_plasma_memory": prefault}
    if prefault:
        # The raylet connects to its store once the store is pre-faulted, and gives up after
        # 10 one-second attempts: faulting 2.7 GB in took 9.4 s on a 2-core machine, so a
        # run failed to start now and then. Allow 1 s per 100 MB on top.
        system["raylet_client_num_connect_attempts"] = 10 + math.ceil(store / 100e6)
    ray.init(
        num_cpus=cpus,
        _node_ip_address="127.0.0.1",
        object_store_memory=store,
        _system_config=system,
        **kwargs,
    )


def _shm_free() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def object_store_bytes(cfg: Any) -> int | None:
    """The object store a local Ray gets for this run: `sync.object_store_mb`, or with
    `sync.method: ray` room for four published copies of the weights plus 512 MiB (None:
    Ray's default, e.g. for the tiny model)."""
    if cfg.sync.object_store_mb is not None:
        return int(cfg.sync.object_store_mb) << 20
    if cfg.sync.method != "ray":
        return None
    from staleflow.actors.models import weights_bytes

    size = weights_bytes(cfg.model)
    return None if size is None else 4 * size + (512 << 20)


SCALE_HEADROOM = 4


def _actor_env(cpus: float, gpus: float) -> dict[str, Any]:
    """Ray sets OMP_NUM_THREADS=1 in actors; give torch the CPUs the actor reserved. An actor
    with no GPU share sees no GPU (Ray would leave the machine's GPUs visible to it)."""
    threads = str(max(1, int(cpus)))
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **hidden_gpus_env(gpus)}
    return {"env_vars": env}


# --------------------------------------------------------------------------- rollout workers


@dataclass
class WorkerSlot:
    """One rollout worker actor and what the driver knows about it."""

    index: int
    handle: Any
    version: int = 0  # the version the actor will have loaded once its queued calls ran
    busy: Any = None  # ObjectRef of the batch in flight
    retiring: bool = False
    idle_since: float = field(default_factory=time.monotonic)


@dataclass
class WorkerPool:
    """Rollout worker actors; workers can be added and retired while a run goes on."""

    cfg: Any
    run_id: str
    redis_url: str
    shared: tuple[Any, ...] = ()  # storage.SharedDir each worker must see (checked at start)
    strategy: Any = None  # LearnerGroup.worker_strategy(): a placement group bundle, or None
    slots: list[WorkerSlot] = field(default_factory=list)
    _next_index: int = 0

    def __post_init__(self) -> None:
        rollout = self.cfg.rollout
        placed = {"scheduling_strategy": self.strategy} if self.strategy is not None else {}
        self._actor = ray.remote(RolloutWorker).options(  # type: ignore[attr-defined]
            num_cpus=rollout.cpus_per_worker,
            num_gpus=rollout.gpus_per_worker,
            resources=dict(rollout.resources) or None,
            runtime_env=_actor_env(rollout.cpus_per_worker, rollout.gpus_per_worker),
            max_concurrency=1,
            **placed,
        )

    @property
    def active(self) -> list[WorkerSlot]:
        return [s for s in self.slots if not s.retiring]

    def idle(self) -> list[WorkerSlot]:
        """Active workers without a batch in flight, longest idle first (so a newly added
        worker is not starved by a fast one that is always idle first)."""
        return sorted((s for s in self.active if s.busy is None), key=lambda s: s.idle_since)

    def finished(self, slot: WorkerSlot) -> None:
        slot.busy = None
        slot.idle_since = time.monotonic()

    def add(self) -> WorkerSlot:
        """Start a worker; its first batch loads the weights it must use (`run_batch`)."""
        index, self._next_index = self._next_index, self._next_index + 1
        handle = self._actor.remote(
            self.cfg,
            run_id=self.run_id,
            worker_index=index,
            redis_url=self.redis_url,
            shared=self.shared,
        )
        slot = WorkerSlot(index, handle)
        self.slots.append(slot)
        return slot

    def _weights_for(self, slot: WorkerSlot, weights: Any) -> Any:
        """`weights` if the worker must load them first (it loads them inside the call that
        needs them, so a failed load fails that call with its own error)."""
        if slot.version == weights.version:
            return None
        slot.version = weights.version
        return weights

    def run_batch(
        self,
        slot: WorkerSlot,
        weights: Any,
        prompts: Sequence[Prompt],
        ids: tuple[int, int] | None = None,
    ) -> Any:
        """Start a batch at `weights.version` (loaded first at this batch boundary if needed);
        `ids` = (batch number, first prompt's index in it) fixes the groups' ids."""
        load = self._weights_for(slot, weights)
        slot.busy = slot.handle.run_batch.remote(weights.version, list(prompts), load, ids)
        return slot.busy

    def evaluate(self, slot: WorkerSlot, weights: Any, n_prompts: int) -> Any:
        load = self._weights_for(slot, weights)
        return slot.handle.evaluate.remote(n_prompts, None, load)

    def scale(self, n: int) -> None:
        """Make `n` workers active. Going up, workers still finishing their last batch before
        retiring stay instead (no engine to start; under ipc they still hold their room in
        learner rank 0's bundle), then new ones start. Going down, the newest retire: an idle
        one at once, a busy one when its batch ends (Rollouts removes it)."""
        active = self.active
        if n > len(active):
            for slot in [s for s in self.slots if s.retiring][: n - len(active)]:
                slot.retiring = False
            for _ in range(n - len(self.active)):
                self.add()
        for slot in active[n:]:
            slot.retiring = True
            if slot.busy is None:
                self.remove(slot)

    def remove(self, slot: WorkerSlot) -> None:
        ray.kill(slot.handle)
        self.slots.remove(slot)

    def replace(self, slot: WorkerSlot) -> WorkerSlot:
        """A new worker in place of a dead (or hung) one, which is killed."""
        with contextlib.suppress(Exception):
            ray.kill(slot.handle)
        if slot in self.slots:
            self.slots.remove(slot)
        return self.add()


# --------------------------------------------------------------------------- learner ranks


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


class LearnerRank:
    """One data-parallel rank of the learner (a Ray actor). Rank 0 takes each batch from the
    buffer, hands the same groups to the other ranks, acks them after the step and publishes
    weights; the driver only says when (docs/architecture.md, "The data path")."""

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
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        self.cfg = cfg
        self.learner = Learner(cfg, rank=rank, world_size=world_size)
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
        batch, failure = None, None
        if self.rank == 0:
            try:
                batch = self.feed.next(version, wait_s) if self.feed is not None else None
                if batch is not None and self.trajectories is not None:
                    self.trajectories.record(version + 1, version, batch.groups)
            except Exception as exc:  # every rank must leave the collective below together
                failure = exc
        groups = self._share(batch.groups if batch is not None else None, failure)
        stale, invalid = self.feed.drops() if self.feed is not None else (0, 0)
        if groups is None:
            return StepReport(False, version, dropped_stale=stale, dropped_invalid=invalid)
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
        return StepReport(
            True, self.learner.version, metrics, reward, dict(lags), stale, invalid, timeline,
            weights, acked,
        )  # fmt: skip

    def _share(
        self, groups: list[Group] | None, failure: BaseException | None = None
    ) -> list[Group] | None:
        """Rank 0's groups (or None: not enough yet) on every rank, over the learner's own
        process group; the groups were validated by rank 0's decoder. A failure on rank 0
        is raised on every rank, so none waits in a collective for it."""
        if self.world_size > 1:
            import torch.distributed as dist

            box: list[Any] = [("error", repr(failure)) if failure else ("ok", groups)]
            dist.broadcast_object_list(box, src=0)
            kind, payload = box[0]
            if kind == "error" and failure is None:
                raise RuntimeError(f"learner rank 0 failed to take its batch: {payload}")
            groups = payload
        if failure is not None:
            raise failure
        return groups

    def publish(self) -> Any:
        """ray / checkpoint / ipc: every rank gathers (ZeRO-3 needs all); rank 0 returns the
        published handle. The arrays are host views of the weights (no copy on a CPU
        learner): the object store or the file takes the one copy; ipc copies the tensors
        once on their own device."""
        with self.learner.gathered_weights() as tensors:
            if self.rank != 0:
                return None
            if self.sharer is not None:
                return self.sharer.share(tensors, self.learner.version, ray_place())
            return self.publisher.publish(host_arrays(tensors), self.learner.version)

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
        acked = [[r.entry_id, r.policy_version, r.replay] for r in held]
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
        receipts = [Receipt(str(e), int(v), bool(r)) for e, v, r in extra.get("acked", [])]
        self.feed.buffer.ack(receipts)
        return self.feed.buffer.recover()

    def settle(self) -> tuple[int, int]:
        """Rank 0: wait for a prefetch in progress; (stale, invalid) it dropped unreported."""
        return self.feed.settle() if self.feed is not None else (0, 0)

    def close(self) -> None:
        """Let a prefetch in progress finish, flush the trajectory record, remove shared
        weights."""
        if self.sharer is not None:
            self.sharer.close()
        if self.feed is not None:
            self.feed.close()
        if self.trajectories is not None:
            self.trajectories.close()


@dataclass
class LearnerGroup:
    """M learner ranks as actors; every call goes to all ranks (they step in lock step)."""

    cfg: Any
    ranks: list[Any] = field(default_factory=list)
    group: Any = None  # the ranks' placement group
    master: tuple[str, int] = ("", 0)  # where they rendezvous: rank 0's node and a free port

    publish_dir: str | None = None
    redis_url: str | None = None
    run_id: str | None = None
    trajectories_dir: str | None = None
    shared: tuple[Any, ...] = ()  # storage.SharedDir every rank must see (checked at start)

    def __post_init__(self) -> None:
        learner = self.cfg.learner
        # One CPU reserved per rank; its torch threads use this machine's cores (the learner is
        # the bottleneck of a CPU run, and the OS shares the cores with the workers). Its GPU
        # share is its own setting (learner.gpus_per_rank), whatever the workers take.
        threads = learner_threads(learner.num_ranks)
        # One bundle per rank in a placement group: packed on as few nodes as possible, or
        # spread when asked; rank r lives in bundle r, and all meet on bundle 0's node.
        bundle = {"CPU": 1.0, **({"GPU": learner.gpus_per_rank} if learner.gpus_per_rank else {})}
        bundle.update(learner.resources)  # custom resources pin the ranks to labelled nodes
        bundles = [dict(bundle) for _ in range(learner.num_ranks)]
        if self.cfg.sync.method == "ipc":  # the workers open rank 0's memory: its bundle
            bundles[0] = _with_workers(bundles[0], self.cfg.rollout)
        self.group = placement_group(
            bundles,
            strategy="PACK" if learner.placement == "pack" else "SPREAD",
            name=f"staleflow-learner-{self.run_id or os.getpid()}",
        )
        timeout = self.cfg.run.start_timeout_s
        try:
            host, port = ray.get(
                _rendezvous.options(scheduling_strategy=self._in_bundle(0)).remote(),
                timeout=timeout,
            )
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            raise TimeoutError(
                f"the learner's {learner.num_ranks} rank(s) (bundles {bundles}) were not placed "
                f"within {timeout:g} s (run.start_timeout_s); the cluster has "
                f"{ray.available_resources()} free of {ray.cluster_resources()}"
                + (
                    " (sync.method ipc: bundle 0 holds rank 0 and every rollout worker, so it "
                    "needs one node with all of that)"
                    if self.cfg.sync.method == "ipc"
                    else ""
                )
            ) from None
        self.master = (str(host), int(port))
        actor = ray.remote(LearnerRank)  # type: ignore[attr-defined]
        self.ranks = [
            actor.options(
                num_cpus=1,
                num_gpus=learner.gpus_per_rank,
                runtime_env=_actor_env(threads, learner.gpus_per_rank),
                scheduling_strategy=self._in_bundle(rank),
            ).remote(
                self.cfg,
                rank,
                learner.num_ranks,
                self.master,
                self.publish_dir,
                self.redis_url,
                self.run_id,
                self.trajectories_dir,
                self.shared,
            )
            for rank in range(learner.num_ranks)
        ]

    def _in_bundle(self, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=index
        )

    def worker_strategy(self) -> PlacementGroupSchedulingStrategy | None:
        """Where rollout workers go: sync.method ipc, in rank 0's bundle (reserved for
        rollout.num_workers beside the rank); otherwise wherever Ray finds room (None)."""
        return self._in_bundle(0) if self.cfg.sync.method == "ipc" else None

    def train(self, wait_s: float, publish: bool) -> list[Any]:
        """Start `LearnerRank.train` on every rank; returns the refs, rank 0's (the report)
        first."""
        return [r.train.remote(wait_s, publish) for r in self.ranks]

    def publish(self) -> Any:
        return ray.get([r.publish.remote() for r in self.ranks])[0]

    def save_shared(self, versions: list[int], directory: str) -> None:
        ray.get(self.ranks[0].save_shared.remote(versions, os.path.abspath(directory)))

    def settle(self) -> tuple[int, int]:
        """No take in progress afterwards; what the last prefetch dropped (stale, invalid)."""
        return tuple(ray.get(self.ranks[0].settle.remote()))  # type: ignore[return-value]

    def save(self, path: str, extra: dict[str, Any]) -> None:
        """Every rank checkpoints its part (the held groups are acked by `commit`). Paths
        are made absolute here: a rank's working directory is not the driver's."""
        path = os.path.abspath(path)
        ray.get([r.save.remote(path, extra) for r in self.ranks])

    def commit(self) -> int:
        """Once LATEST names the checkpoint: rank 0 acks the groups it named; how many."""
        return int(ray.get(self.ranks[0].commit.remote()))

    def load(self, path: str | None, step: int) -> int:
        path = os.path.abspath(path) if path is not None else None
        return int(ray.get([r.load.remote(path, step) for r in self.ranks])[0])

    def kill(self) -> None:
        try:
            ray.get([r.close.remote() for r in self.ranks], timeout=30)
        finally:
            for r in self.ranks:
                ray.kill(r)
            if self.group is not None:
                remove_placement_group(self.group)


def _with_workers(bundle: dict[str, float], rollout: Any) -> dict[str, float]:
    """`bundle` grown by rollout.num_workers workers' resources: Ray keeps a bundle on one
    node, and a GPU share of at most 1 on one GPU, so every worker placed in it shares
    learner rank 0's node and GPU (sync.method ipc; resources.run_requests checks it fits)."""
    out = dict(bundle)
    n = rollout.num_workers
    worker = {"CPU": rollout.cpus_per_worker, "GPU": rollout.gpus_per_worker,
              **rollout.resources}  # fmt: skip
    for key, amount in worker.items():
        if amount:
            out[key] = out.get(key, 0.0) + n * amount
    return out


@ray.remote(num_cpus=0)
def _rendezvous() -> tuple[str, int]:
    """Where the learner ranks meet: the address of the node this runs on (bundle 0's, rank
    0's) and a port free there."""
    return node_address(), free_port()


class ActorStartError(RuntimeError):
    """A worker's or learner rank's constructor raised; the message is its error's last line
    (the whole traceback goes to the driver's log)."""


def _last_error(exc: Exception) -> str:
    """'SomeError: message' of the exception a remote constructor raised (Ray hands it on
    only as traceback text), else the text's last line."""
    lines = str(exc).strip().splitlines()
    for line in reversed(lines):
        name, sep, message = line.partition(": ")
        if sep and re.fullmatch(r"[A-Za-z_][\w.]*(Error|Exception)", name):
            return f"{name.rsplit('.', 1)[-1]}: {message}"
    return lines[-1] if lines else type(exc).__name__


def learner_threads(num_ranks: int) -> int:
    """Torch threads of each learner rank: this machine's cores shared over the ranks."""
    return max(1, min(8, (os.cpu_count() or 1) // num_ranks))


def wait_started(roles: dict[str, Sequence[Any]], timeout_s: float) -> None:
    """Wait for actors' constructors ({"learner ranks": handles, ...}); an actor Ray cannot
    place (or that hangs while starting) ends the wait after `timeout_s` with what the cluster
    has left, instead of a hang. The first constructor to fail, of any role, ends it at once
    with its error: its peers may be blocked on it (learner ranks wait in their rendezvous
    for a rank that died), and the other roles need not finish loading first."""
    role_of = {h.__ray_ready__.remote(): what for what, handles in roles.items() for h in handles}
    pending = list(role_of)
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        try:
            ray.get(done)
        except ray.exceptions.RayActorError as exc:
            if not exc.actor_init_failed:
                raise
            what = role_of[done[0]]
            logger.error("one of the %s failed to start: %s", what, exc)  # with its traceback
            message = f"one of the {what} failed to start: {_last_error(exc)}"
            raise ActorStartError(message) from None
    if pending:
        late = Counter(role_of[ref] for ref in pending)
        total = Counter(role_of.values())
        which = ", ".join(f"{n} of {total[what]} {what}" for what, n in late.items())
        raise TimeoutError(
            f"{which} did not start within {timeout_s:g} s "
            f"(run.start_timeout_s); the cluster has {ray.available_resources()} free of "
            f"{ray.cluster_resources()}: an actor that fits on no node waits for resources, "
            "and one still loading its model needs a longer run.start_timeout_s"
        )
