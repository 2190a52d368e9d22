"""Ray placement: starting or joining a cluster, the rollout worker pool and the learner ranks.

The roles stay plain classes (actors/, learner/); this module is the only place that wraps
them in `ray.remote` and decides how many CPUs / GPUs each gets. Remote calls go through the
typed handles returned here (`pool.run_batch(...)`, `learner.step(...)`), never by method-name
strings.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from staleflow.actors.tasks import Prompt
from staleflow.actors.worker import RolloutWorker
from staleflow.buffer.records import Group
from staleflow.learner.learner import Learner
from staleflow.learner.publish import CheckpointPublisher, RayPublisher

__all__ = ["LearnerGroup", "LearnerRank", "WorkerPool", "learner_threads", "start_ray"]

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
    ray.init(num_cpus=cpus, _node_ip_address="127.0.0.1", **kwargs)


SCALE_HEADROOM = 4


def _thread_env(cpus: float) -> dict[str, Any]:
    """Ray sets OMP_NUM_THREADS=1 in actors; give torch the CPUs the actor reserved."""
    threads = str(max(1, int(cpus)))
    return {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}}


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
    slots: list[WorkerSlot] = field(default_factory=list)
    _next_index: int = 0

    def __post_init__(self) -> None:
        rollout = self.cfg.rollout
        self._actor = ray.remote(RolloutWorker).options(  # type: ignore[attr-defined]
            num_cpus=rollout.cpus_per_worker,
            num_gpus=rollout.gpus_per_worker,
            runtime_env=_thread_env(rollout.cpus_per_worker),
            max_concurrency=1,
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

    def add(self, weights: Any | None) -> WorkerSlot:
        """Start a worker; it loads `weights` (a published handle) before anything else."""
        index, self._next_index = self._next_index, self._next_index + 1
        handle = self._actor.remote(
            self.cfg, run_id=self.run_id, worker_index=index, redis_url=self.redis_url
        )
        slot = WorkerSlot(index, handle)
        if weights is not None and weights.version != 0:
            self.ensure_version(slot, weights)
        self.slots.append(slot)
        return slot

    def ensure_version(self, slot: WorkerSlot, weights: Any) -> None:
        """Queue a weight load unless the worker will already have `weights.version`. An actor
        runs one call at a time, so the load happens at the next batch boundary."""
        if slot.version != weights.version:
            slot.handle.load_published.remote(weights)
            slot.version = weights.version

    def run_batch(self, slot: WorkerSlot, prompts: Sequence[Prompt]) -> Any:
        slot.busy = slot.handle.run_batch.remote(slot.version, list(prompts))
        return slot.busy

    def evaluate(self, slot: WorkerSlot, weights: Any, n_prompts: int) -> Any:
        self.ensure_version(slot, weights)
        return slot.handle.evaluate.remote(n_prompts)

    def remove(self, slot: WorkerSlot) -> None:
        ray.kill(slot.handle)
        self.slots.remove(slot)


# --------------------------------------------------------------------------- learner ranks


class LearnerRank:
    """One data-parallel rank of the learner (a Ray actor); rank 0 also publishes weights."""

    def __init__(self, cfg: Any, rank: int, world_size: int, master: tuple[str, int]) -> None:
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        self.learner = Learner(cfg, rank=rank, world_size=world_size)
        self.rank = rank
        if cfg.sync.method == "checkpoint":
            self.publisher: Any = CheckpointPublisher(cfg.sync.checkpoint_dir)
        else:  # nccl needs engines in the learner's process group: GPU workers only
            self.publisher = RayPublisher(cfg.sync.bucket_mb)

    def step(self, groups: list[Group], learner_version: int) -> dict[str, float]:
        return self.learner.step(groups, learner_version)

    def publish(self) -> Any:
        """Every rank gathers (ZeRO-3 needs all); rank 0 returns the published handle."""
        arrays = self.learner.state_dict_for_sync()
        if self.rank != 0:
            return None
        return self.publisher.publish(arrays, self.learner.version)

    def save(self, path: str, extra: dict[str, Any]) -> None:
        self.learner.save(path, extra)


@dataclass
class LearnerGroup:
    """M learner ranks as actors; every call goes to all ranks (they step in lock step)."""

    cfg: Any
    ranks: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        learner = self.cfg.learner
        gpu = self.cfg.rollout.gpus_per_worker > 0
        # One CPU reserved per rank; its torch threads use this machine's cores (the learner is
        # the bottleneck of a CPU run, and the OS shares the cores with the workers).
        threads = learner_threads(learner.num_ranks)
        actor = ray.remote(LearnerRank).options(  # type: ignore[attr-defined]
            num_cpus=1, num_gpus=1.0 if gpu else 0.0, runtime_env=_thread_env(threads)
        )
        master = ("127.0.0.1", _free_port())
        self.ranks = [
            actor.remote(self.cfg, rank, learner.num_ranks, master)
            for rank in range(learner.num_ranks)
        ]

    def step(self, groups: list[Group], learner_version: int) -> list[Any]:
        """Start a step on every rank; returns the metrics refs, rank 0's first."""
        ref = ray.put(groups)
        return [r.step.remote(ref, learner_version) for r in self.ranks]

    def publish(self) -> Any:
        return ray.get([r.publish.remote() for r in self.ranks])[0]

    def save(self, path: str, extra: dict[str, Any]) -> None:
        ray.get(self.ranks[0].save.remote(path, extra))

    def ready(self) -> None:
        """Block until every rank has built its engine (raises the rank's error if not)."""
        ray.get([r.__ray_ready__.remote() for r in self.ranks])

    def kill(self) -> None:
        for r in self.ranks:
            ray.kill(r)


def learner_threads(num_ranks: int) -> int:
    """Torch threads of each learner rank: this machine's cores shared over the ranks."""
    return max(1, min(8, (os.cpu_count() or 1) // num_ranks))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
