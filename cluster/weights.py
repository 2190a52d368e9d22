"""Publishing weights to the rollout workers, per `sync.method` (docs/architecture.md, "Contracts").

- `ray`: learner rank 0 puts buckets of numpy arrays in the object store; each worker fetches
  them at its next batch boundary (inside the call that needs them).
- `checkpoint`: safetensors files in `sync.checkpoint_dir` (default: <run dir>/weights).
- `nccl` / `gloo`: learner rank 0 and every active worker's engine form a process group of
  their own (rendezvous on rank 0's node address); each update is one remote call per member
  and one collective per bucket, from the learner's device straight into the engines'
  weights. Every member takes part at once, so the driver starts a broadcast once the
  members' calls in flight have ended (Driver._publish); the group is formed again whenever
  the set of workers changed.
- `ipc`: learner rank 0 copies its weights once into memory the engines open in place (CUDA
  IPC handles to buffers on its GPU, or files in /dev/shm for CPU roles; staleflow.learner.ipc)
  and keeps each version until the driver discards it; like `ray`, each worker loads it at
  its next batch boundary. Every worker must be on rank 0's node and GPU: checked for all at
  the first publish, and by a worker started later when it loads a version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from staleflow.learner.ipc import SharedWeights

__all__ = ["WeightSync"]

logger = logging.getLogger(__name__)


@dataclass
class WeightSync:
    cfg: Any
    learner: Any  # placement.LearnerGroup
    pool: Any  # placement.WorkerPool
    _members: tuple[int, ...] | None = None
    _layouts: Any = None

    @property
    def broadcasts(self) -> bool:
        """Whether publishing loads the weights into the workers right away."""
        return self.cfg.sync.method in self.cfg.sync.PUSH_METHODS

    def publish(self, version: int) -> Any:
        """Publish the learner's current weights as `version`; returns the handle workers load
        (for broadcast methods: already loaded in every active worker)."""
        if not self.broadcasts:
            if self.cfg.sync.method == "ipc":
                self.check_colocated()
            return self.learner.publish()
        members = [s for s in self.pool.slots if not s.retiring]
        if tuple(s.index for s in members) != self._members:
            self._wait_started(members)
            self._form_group(members)
        handle = self.learner.on_ranks(
            [r.broadcast.remote(version) for r in self.learner.ranks],
            f"the weight broadcast of v{version}",
            [(s, s.handle.receive_broadcast.remote(self._layouts, version)) for s in members],
        )[0]
        for slot in members:
            slot.version = version
        return handle

    def discard(self, handle: Any) -> None:
        """A published version no batch, evaluation or checkpoint needs any more: free what
        holds it (checkpoint: its file; ipc: learner rank 0's copy)."""
        if hasattr(handle, "discard"):
            handle.discard()
        elif isinstance(handle, SharedWeights):
            self.learner.ranks[0].discard_shared.remote(handle.version)  # in call order

    def check_colocated(self) -> None:
        """ipc, at the first publish (the run's start, every worker idle): every worker on
        learner rank 0's node and GPU. A worker started later checks its own place when it
        loads a version (SharedWeights.check_place): asking a busy one here would wait for
        its batch."""
        from staleflow.cluster.resources import check_colocated

        if self._members is not None:
            return
        members = list(self.pool.slots)
        places = self.learner.on_ranks(
            [self.learner.ranks[0].place.remote()],
            "the check that every worker is on learner rank 0's node (sync.method ipc)",
            [(s, s.handle.place.remote()) for s in members],
        )
        names = [f"rollout worker {s.index}" for s in members]
        check_colocated(places[0], dict(zip(names, places[1:], strict=True)))
        self._members = tuple(s.index for s in members)

    def _wait_started(self, members: Sequence[Any]) -> None:
        """Members added during the run (a lost worker's replacement, a scale-up) must have
        started before the group forms, within run.start_timeout_s of being added: learner
        rank 0 would otherwise wait sync.broadcast_timeout_s (900 s) in its rendezvous for
        one no node has room for (its node was lost), the run frozen meanwhile, and the stop
        would blame the learner."""
        import ray

        from staleflow.cluster.placement import StartTimeout, cluster_room

        limit = self.cfg.run.start_timeout_s
        for slot in members:
            while slot.ready is not None:
                left = limit - (time.monotonic() - slot.added)
                done, _ = ray.wait([slot.ready], timeout=max(0.0, min(1.0, left)))
                if done:  # (a constructor that failed fails its join of the group)
                    slot.ready = None
                elif left <= 0:
                    raise StartTimeout(
                        f"rollout worker {slot.index}, added during the run, did not start "
                        f"within {limit:g} s (run.start_timeout_s), so the weight broadcast "
                        f"group ({self.cfg.sync.method}) cannot form; {cluster_room()}: a "
                        "worker that fits on no node (its node was lost) waits for "
                        "resources. Add a node or lower rollout.num_workers, then resume"
                    )
                else:
                    self.learner.while_waiting()

    def _form_group(self, members: Sequence[Any]) -> None:
        sync = self.cfg.sync
        rank0 = self.learner.ranks[0]
        during = f"the forming of the weight broadcast group ({sync.method})"
        if self._layouts is None:
            ranks = self.learner.ranks
            layouts = [r.sync_layouts.remote(sync.bucket_mb << 20) for r in ranks]
            self._layouts = self.learner.on_ranks(layouts, during)[0]
        host, port = self.learner.on_ranks([rank0.sync_address.remote()], during)[0]
        world = 1 + len(members)
        self.learner.on_ranks(
            [rank0.open_sync_group.remote(host, port, world)],
            during,
            [
                (s, s.handle.join_sync_group.remote(
                    host, port, i + 1, world, sync.method, sync.broadcast_timeout_s
                ))
                for i, s in enumerate(members)
            ],
        )  # fmt: skip
        self._members = tuple(s.index for s in members)
        logger.info(
            "weight broadcast group (%s) at %s:%d: learner rank 0 + %d engine(s)",
            sync.method, host, port, len(members),
        )  # fmt: skip
