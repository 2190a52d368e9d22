"""Weight publishing: learner rank 0 -> rollout engines, versioned (design.md section 3).

    handle = publisher.publish(learner.state_dict_for_sync(), version)   # on learner rank 0
    worker.load_published(handle)                                         # on each worker

- `RayPublisher`: buckets of numpy arrays (bfloat16 as int16 views) in the Ray object store;
  numpy crosses zero-copy, and the worker fetches one bucket at a time, so neither side holds
  a second full copy. `handle` is a small `RayWeights` of object refs.
- `CheckpointPublisher`: safetensors plus a version file in a shared directory, written under
  temporary names and renamed, for separately launched jobs; `read_published(dir)` loads the
  newest complete version.
- `BroadcastPublisher` (`nccl` on GPUs): a dedicated process group between learner rank 0 and
  the engines; each bucket is flattened into one tensor and broadcast in one collective, one
  remote call per bucket on the receiving side. The same code runs over gloo on CPU (tests).

Every publish reports its wall time and bytes.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BroadcastPublisher",
    "CheckpointPublisher",
    "CheckpointWeights",
    "PublishStats",
    "RayPublisher",
    "RayWeights",
    "bucketize",
    "flatten_bucket",
    "read_published",
    "unflatten_bucket",
]

Arrays = Mapping[str, np.ndarray]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishStats:
    version: int
    seconds: float
    bytes: int
    buckets: int

    @classmethod
    def measure(
        cls, version: int, start: float, arrays: Arrays, buckets: int, method: str
    ) -> PublishStats:
        """The stats of a publish that began at `start` (perf_counter), logged."""
        nbytes = sum(a.nbytes for a in arrays.values())
        return cls(version, time.perf_counter() - start, nbytes, buckets).log(method)

    def log(self, method: str) -> PublishStats:
        logger.info(
            "published weights v%d via %s: %.1f MB in %d bucket(s), %.3f s (%.2f GB/s)",
            self.version, method, self.bytes / 1e6, self.buckets, self.seconds,
            self.bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf"),
        )  # fmt: skip
        return self


@dataclass(frozen=True)
class RayWeights:
    """Object refs to the buckets of one version (each a dict name -> numpy array)."""

    version: int
    buckets: list[Any]
    stats: PublishStats

    def arrays(self) -> Iterator[tuple[str, np.ndarray]]:
        """Fetch and yield one bucket at a time (call where Ray is initialised)."""
        import ray

        for ref in self.buckets:
            yield from ray.get(ref).items()


@dataclass(frozen=True)
class CheckpointWeights:
    version: int
    path: str
    stats: PublishStats = field(compare=False)

    def arrays(self) -> Iterator[tuple[str, np.ndarray]]:
        _, arrays = read_published(Path(self.path).parent, self.version)
        yield from arrays.items()


def bucketize(arrays: Arrays, bucket_bytes: int) -> list[dict[str, np.ndarray]]:
    """Consecutive parameters grouped into buckets of about `bucket_bytes` (a large one alone)."""
    buckets: list[dict[str, np.ndarray]] = []
    current: dict[str, np.ndarray] = {}
    size = 0
    for name, array in arrays.items():
        if current and size + array.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    if current:
        buckets.append(current)
    return buckets


class RayPublisher:
    def __init__(self, bucket_mb: int = 256) -> None:
        self.bucket_bytes = bucket_mb << 20

    def publish(self, arrays: Arrays, version: int) -> RayWeights:
        import ray

        start = time.perf_counter()
        buckets = bucketize(arrays, self.bucket_bytes)
        refs = [ray.put(bucket) for bucket in buckets]
        return RayWeights(
            version, refs, PublishStats.measure(version, start, arrays, len(refs), "ray")
        )


class CheckpointPublisher:
    """Versioned safetensors files in `directory`; `LATEST` names the newest complete one."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 2) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def publish(self, arrays: Arrays, version: int) -> CheckpointWeights:
        from safetensors.numpy import save_file

        start = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"weights-v{version:08d}.safetensors"
        tmp = self.directory / f".{final.name}.{uuid.uuid4().hex[:8]}"
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp),
                  metadata={"version": str(version)})  # fmt: skip
        _fsync_rename(tmp, final)
        latest_tmp = self.directory / f".LATEST.{uuid.uuid4().hex[:8]}"
        latest_tmp.write_text(json.dumps({"version": version, "file": final.name}))
        _fsync_rename(latest_tmp, self.directory / "LATEST")
        for old in sorted(self.directory.glob("weights-v*.safetensors"))[: -self.keep]:
            old.unlink(missing_ok=True)
        stats = PublishStats.measure(version, start, arrays, 1, "checkpoint")
        return CheckpointWeights(version, str(final), stats)


def read_published(
    directory: str | os.PathLike[str], version: int | None = None
) -> tuple[int, dict[str, np.ndarray]]:
    """(version, arrays) of the newest published weights, or of `version`."""
    from safetensors.numpy import load_file

    directory = Path(directory)
    if version is None:
        try:
            latest = json.loads((directory / "LATEST").read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no weights published in {directory} yet") from None
        version, name = int(latest["version"]), latest["file"]
    else:
        name = f"weights-v{version:08d}.safetensors"
    return version, dict(load_file(str(directory / name)))


def _fsync_rename(tmp: Path, final: Path) -> None:
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, final)


# ----------------------------------------------------------------------------- broadcast


def flatten_bucket(bucket: Mapping[str, Any]) -> tuple[Any, list[tuple[str, tuple[int, ...], str]]]:
    """One contiguous uint8 tensor holding every array of the bucket, plus the layout."""
    import torch

    layout, parts = [], []
    for name, array in bucket.items():
        a = np.ascontiguousarray(array)
        layout.append((name, tuple(a.shape), a.dtype.str))
        parts.append(torch.from_numpy(a.reshape(-1).view(np.uint8)))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8), layout


def unflatten_bucket(
    flat: Any, layout: list[tuple[str, tuple[int, ...], str]]
) -> dict[str, np.ndarray]:
    raw = flat.cpu().numpy()
    out, offset = {}, 0
    for name, shape, dtype in layout:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        out[name] = raw[offset : offset + size].view(dtype).reshape(shape).copy()
        offset += size
    return out


class BroadcastPublisher:
    """Bucketed broadcast over a process group of learner rank 0 (src) and the engines.

    `group` is a torch.distributed group containing the sender and every receiver (NCCL on
    GPUs; gloo works the same on CPU). The layout of each bucket travels with the handle (or a
    remote call per bucket); the bytes go through one collective per bucket."""

    def __init__(self, group: Any, src: int = 0, bucket_mb: int = 256, device: str = "cpu") -> None:
        self.group, self.src, self.device = group, src, device
        self.bucket_bytes = bucket_mb << 20

    def layouts(self, arrays: Arrays) -> list[list[tuple[str, tuple[int, ...], str]]]:
        """The layout of every bucket (cheap metadata for the receivers)."""
        return [flatten_bucket(bucket)[1] for bucket in bucketize(arrays, self.bucket_bytes)]

    def send(self, arrays: Arrays, version: int) -> PublishStats:
        import torch.distributed as dist

        start = time.perf_counter()
        buckets = bucketize(arrays, self.bucket_bytes)
        for bucket in buckets:
            flat, _ = flatten_bucket(bucket)
            dist.broadcast(flat.to(self.device), src=self.src, group=self.group)
        return PublishStats.measure(version, start, arrays, len(buckets), "broadcast")

    def receive_bucket(
        self, layout: list[tuple[str, tuple[int, ...], str]]
    ) -> dict[str, np.ndarray]:
        """On a receiver: the bucket with this layout (call once per bucket, in order)."""
        import torch
        import torch.distributed as dist

        size = sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for _, s, d in layout)
        flat = torch.empty(size, dtype=torch.uint8, device=self.device)
        dist.broadcast(flat, src=self.src, group=self.group)
        return unflatten_bucket(flat, layout)
