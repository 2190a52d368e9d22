"""Weight publishing: learner rank 0 -> rollout engines, versioned (docs/architecture.md,
"Contracts").

    handle = publisher.publish(learner.state_dict_for_sync(), version)   # on learner rank 0
    worker.load_published(handle)                                         # on each worker

- `RayPublisher`: buckets of numpy arrays (bfloat16 as int16 views) in the Ray object store;
  numpy crosses zero-copy, and the worker fetches one bucket at a time, so neither side holds
  a second full copy. Given tensors on a GPU, it copies them to the host one bucket at a
  time, each freed once in the store: the learner's host memory holds the store's copy plus
  one bucket, not two copies. `handle` is a small `RayWeights` of object refs.
- `CheckpointPublisher`: safetensors plus a version file in a shared directory, written under
  temporary names and renamed, for separately launched jobs; `read_published(dir)` loads the
  newest complete version.
- `broadcast_send` / `broadcast_receive` (`nccl` on GPUs, `gloo` on CPUs): a dedicated
  process group (staleflow.learner.sync_group) of learner rank 0 and the engines; each bucket
  is flattened into one tensor on the sender's device and broadcast in one collective; the
  receivers get the layouts once per update (one remote call each), not per parameter.
- `pack_bucket` / `unpack_bucket`: the wire format of a bucket that crosses a serialiser (the
  vLLM engine's `collective_rpc`): plain bytes plus [name, shape, dtype] entries;
  `write_bucket` / `read_bucket`: the same bytes through a file in shared memory, for a
  process on the same node (vLLM's engine core), so only the layout crosses the serialiser.

Within a bucket (packed bytes, a file, a flattened tensor) every array starts at a multiple
of `ALIGN` bytes (`bucket_offsets`), so each can be viewed in its own dtype wherever the
dtypes mix. Every publish reports its wall time and bytes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from staleflow.learner.durable import fsync_file

__all__ = [
    "ALIGN",
    "BroadcastWeights",
    "CheckpointPublisher",
    "CheckpointWeights",
    "PublishStats",
    "RayPublisher",
    "RayWeights",
    "broadcast_receive",
    "broadcast_send",
    "bucket_nbytes",
    "bucket_offsets",
    "bucketize",
    "check_room",
    "flatten_tensors",
    "host_arrays",
    "pack_bucket",
    "padded_views",
    "read_bucket",
    "read_published",
    "remove_orphaned_files",
    "tensor_layouts",
    "unflatten_tensors",
    "unpack_bucket",
    "wire_views",
    "write_bucket",
]

Arrays = Mapping[str, np.ndarray]
logger = logging.getLogger(__name__)


_LOGGED: set[str] = set()  # the methods whose publish this process has logged at INFO


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
        # The first publish of each method in a process at INFO (it reaches the driver's
        # terminal); the others at DEBUG: one line per step interrupted the progress line,
        # and metrics.jsonl has every publish's time (time_publish_s)
        level = logging.DEBUG if method in _LOGGED else logging.INFO
        _LOGGED.add(method)
        logger.log(
            level,
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

    def discard(self) -> None:
        """Delete this version's file: the driver calls it once no batch, evaluation or
        checkpoint of the schedule can still need the version."""
        Path(self.path).unlink(missing_ok=True)


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


def host_arrays(tensors: Mapping[str, Any], copy: bool = False) -> dict[str, np.ndarray]:
    """numpy arrays of `tensors` (bfloat16 as int16 views, numpy has no bfloat16). A CPU
    tensor gives a view of its memory unless `copy`; a device tensor is copied to the host.
    numpy arrays pass as they are (copied if `copy`)."""
    import torch

    out = {}
    for name, tensor in tensors.items():
        if isinstance(tensor, np.ndarray):
            out[name] = tensor.copy() if copy else tensor
            continue
        t = tensor.detach()
        t = t.clone() if copy and t.device.type == "cpu" else t.cpu()
        out[name] = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return out


class RayPublisher:
    def __init__(self, bucket_mb: int = 256) -> None:
        self.bucket_bytes = bucket_mb << 20

    def publish(self, arrays: Mapping[str, Any], version: int) -> RayWeights:
        """`arrays`: numpy arrays, or torch tensors (on any device; see the module doc)."""
        import ray

        start = time.perf_counter()
        buckets = bucketize(arrays, self.bucket_bytes)
        refs = [ray.put(host_arrays(bucket)) for bucket in buckets]
        return RayWeights(
            version, refs, PublishStats.measure(version, start, arrays, len(refs), "ray")
        )


class CheckpointPublisher:
    """Versioned safetensors files in `directory`; `LATEST` names the newest complete one.

    With `keep` it deletes all but the newest `keep` files after each publish; without, it
    deletes nothing, and whoever knows which versions are still needed discards the others
    (`CheckpointWeights.discard`): in a run that is the driver, since a lock-step schedule with
    sync.offset > 1 generates batches with versions older than the newest two."""

    def __init__(self, directory: str | os.PathLike[str], keep: int | None = None) -> None:
        if keep is not None and keep < 1:  # ([:-0] would keep every file)
            raise ValueError(f"keep must be at least 1 (the version just written), got {keep}")
        self.directory = Path(directory)
        self.keep = keep

    def publish(self, arrays: Mapping[str, Any], version: int) -> CheckpointWeights:
        """`arrays`: numpy arrays, or torch tensors (copied to the host at once: the file is
        written whole)."""
        from safetensors.numpy import save_file

        arrays = host_arrays(arrays)
        start = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"weights-v{version:08d}.safetensors"
        tmp = self.directory / f".{final.name}.{uuid.uuid4().hex[:8]}"
        latest_tmp = self.directory / f".LATEST.{uuid.uuid4().hex[:8]}"
        existed = final.exists()  # (a version published again: its file is not ours to remove)
        try:
            save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp),
                      metadata={"version": str(version)})  # fmt: skip
            _fsync_rename(tmp, final)
            latest_tmp.write_text(json.dumps({"version": version, "file": final.name}))
            _fsync_rename(latest_tmp, self.directory / "LATEST")
        except BaseException:  # a full disk: no file left to fill it further, none unnamed
            tmp.unlink(missing_ok=True)
            latest_tmp.unlink(missing_ok=True)
            if not existed:  # no handle is returned: nothing would ever discard it
                final.unlink(missing_ok=True)
            raise
        if self.keep is not None:
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
    """(Not `replace_durably`: a resume publishes the weights again from its checkpoint, and a
    directory fsync per publish would cost every step.)"""
    fsync_file(tmp)
    os.replace(tmp, final)


# ----------------------------------------------------------------------------- wire format

WireLayout = list[list[Any]]
"""[[name, shape, numpy dtype str], ...]: lists and strings only, as any serialiser returns them."""

_WIRE_DTYPES = {"<f4", "<f2", "<f8", "<i2", "<i4", "<i8", "|u1", "|i1", "|b1"}

ALIGN = 16
"""Every array of a bucket starts at a multiple of this many bytes. Packed back to back, an
array after one of odd size in a narrower dtype (bfloat16 with an odd count, then float32)
would start off its dtype's alignment: torch refuses to view such bytes as the wider dtype
("storage_offset() must be divisible by 4"), which is how the broadcast and CUDA IPC paths
split their flat buffers, and unaligned numpy views copy slower."""


def bucket_offsets(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Where arrays of `sizes` bytes start in a bucket, in order, and the bucket's size: each
    start is the previous end rounded up to `ALIGN` (padding of at most ALIGN - 1 bytes; none
    after the last array)."""
    starts, end = [], 0
    for size in sizes:
        start = -(-end // ALIGN) * ALIGN
        starts.append(start)
        end = start + size
    return starts, end


def wire_views(bucket: Arrays) -> tuple[WireLayout, list[memoryview]]:
    """The layout of a bucket and each array's bytes (views, no copy), in layout order."""
    layout: WireLayout = []
    views = []
    for name, array in bucket.items():
        a = np.ascontiguousarray(array).reshape(np.shape(array))  # 0-d stays 0-d
        if a.dtype.str not in _WIRE_DTYPES:
            raise TypeError(f"parameter {name!r}: dtype {a.dtype} cannot travel as weights")
        layout.append([name, list(a.shape), a.dtype.str])
        views.append(a.reshape(-1).view(np.uint8).data)
    return layout, views


def pack_bucket(bucket: Arrays) -> tuple[WireLayout, bytes]:
    """One bucket as plain `bytes` plus its layout: serialisable by construction (msgpack,
    pickle, vLLM's IPC), where numpy arrays are not (vLLM's multiprocess mode turns them into
    nested lists). One copy of the bytes; bfloat16 travels as its int16 view."""
    layout, views = wire_views(bucket)
    return layout, b"".join(padded_views(views))


def padded_views(views: list[memoryview]) -> Iterator[memoryview | bytes]:
    """`views` with the zero bytes `bucket_offsets` puts between them: a bucket's bytes in
    order, for whatever writes them (bytes, a file, a kept mapping)."""
    starts, _ = bucket_offsets(v.nbytes for v in views)
    end = 0
    for start, view in zip(starts, views, strict=True):
        if start > end:
            yield bytes(start - end)
        yield view
        end = start + view.nbytes


def write_bucket(bucket: Arrays, path: str | Path) -> WireLayout:
    """`pack_bucket`'s bytes written to the file `path` (one copy, no joined buffer in
    between) for a process on the same node to read with `read_bucket`; returns the layout.
    In shared memory (/dev/shm) neither side touches a disk. A file of exactly that size is
    overwritten in place, keeping its pages (fresh tmpfs pages cost more than the copy)."""
    layout, views = wire_views(bucket)
    _, size = bucket_offsets(v.nbytes for v in views)
    same = os.path.exists(path) and os.path.getsize(path) == size
    with open(path, "r+b" if same else "wb") as handle:
        for view in padded_views(views):
            handle.write(view)
    return layout


def bucket_nbytes(bucket: Mapping[str, Any]) -> int:
    """The size of `bucket` packed (its arrays' bytes plus the padding between them)."""
    return bucket_offsets(int(a.nbytes) for a in bucket.values())[1]


def check_room(directory: str, nbytes: int, what: str, fix: str, reusable: int = 0) -> None:
    """Raise OSError naming the sizes and `fix` unless `directory` (shared memory, for
    `write_bucket`) has room for `nbytes` of `what`; `reusable` bytes of files that will be
    overwritten count as room."""
    free = shutil.disk_usage(directory).free + reusable
    if free < nbytes:
        raise OSError(
            f"{directory} has {free >> 20} MiB free, {what} needs {nbytes >> 20} MiB: {fix}"
        )


def remove_orphaned_files(directory: str, prefix: str, min_age_s: float = 600.0) -> list[str]:
    """Remove the files `<prefix><pid>-...` in `directory` (shared memory) whose process no
    longer runs on this machine and that nothing wrote for `min_age_s`: what a process
    killed while it held one left behind (kill -9 skips its cleanup, and /dev/shm lives
    until the machine restarts). The age spares a live process this one cannot see (another
    container's, sharing /dev/shm). Returns the paths removed."""
    import errno

    pattern = re.compile(rf"{re.escape(prefix)}(\d+)-.+")
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(directory, name)
        try:
            os.kill(int(match.group(1)), 0)
            continue  # alive (or alive and another user's: EPERM)
        except OverflowError:
            pass
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                continue
        try:
            if time.time() - os.stat(path).st_mtime < min_age_s:
                continue
            os.unlink(path)
        except OSError:  # gone meanwhile; another user's (/dev/shm is sticky): not ours
            continue
        removed.append(path)
    return removed


def read_bucket(layout: WireLayout, path: str | Path) -> dict[str, np.ndarray]:
    """The arrays `write_bucket` wrote to `path`: read-only views of the file mapped into
    this process (no copy; the mapping outlives the file's removal), checked against the
    layout as `unpack_bucket` checks bytes."""
    if os.path.getsize(path) == 0:  # an empty file cannot be mapped
        return unpack_bucket(layout, b"")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    return unpack_bucket(layout, data.data)


def unpack_bucket(layout: WireLayout, data: Any) -> dict[str, np.ndarray]:
    """The arrays of a packed bucket (read-only views of `data`), checked against the layout;
    a wrong type or size raises with what arrived, never a reshaped guess."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(
            f"a weight bucket must arrive as bytes, got {type(data).__name__}: something "
            "between the processes re-encoded it (send pack_bucket's output unchanged)"
        )
    out: dict[str, np.ndarray] = {}
    counts = []
    for entry in layout:
        if len(entry) != 3:
            raise ValueError(f"bad layout entry {entry!r}: expected [name, shape, dtype]")
        name, shape, dtype = entry
        if dtype not in _WIRE_DTYPES or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"parameter {name!r}: bad layout (shape {shape}, dtype {dtype})")
        counts.append(int(np.prod(shape, dtype=np.int64)))
    sizes = [n * np.dtype(dtype).itemsize for n, (_, _, dtype) in zip(counts, layout, strict=True)]
    starts, end = bucket_offsets(sizes)
    for (name, shape, dtype), count, start, size in zip(layout, counts, starts, sizes, strict=True):
        if start + size > len(data):
            raise ValueError(
                f"parameter {name!r}: the bucket ends at byte {len(data)}, the layout needs "
                f"{start + size}"
            )
        out[name] = np.frombuffer(data, dtype=dtype, count=count, offset=start).reshape(shape)
    if end != len(data):
        raise ValueError(f"the bucket has {len(data) - end} bytes the layout does not name")
    return out


# ----------------------------------------------------------------------------- broadcast

TensorLayout = list[tuple[str, tuple[int, ...], str]]
"""[(name, shape, torch dtype name)] of one broadcast bucket, in order."""


def flatten_tensors(bucket: Mapping[str, Any], device: Any) -> tuple[Any, TensorLayout]:
    """One contiguous uint8 tensor on `device` holding every tensor of the bucket (each at
    its `bucket_offsets` start), plus the layout. Each tensor is copied once, into place."""
    import torch

    layout: TensorLayout = [
        (name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket.items()
    ]
    starts, end = bucket_offsets(_entry_bytes(shape, dtype) for _, shape, dtype in layout)
    flat = torch.empty(end, dtype=torch.uint8, device=device)
    done = 0
    for tensor, start in zip(bucket.values(), starts, strict=True):
        t = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[done:start].zero_()  # the padding: no stale bytes of this process leave it
        flat[start : start + t.numel()].copy_(t)
        done = start + t.numel()
    return flat, layout


def tensor_layouts(tensors: Mapping[str, Any], bucket_bytes: int) -> list[TensorLayout]:
    """The layout of every broadcast bucket (what receivers need to allocate and split)."""
    return [
        [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in bucket.items()]
        for bucket in bucketize(tensors, bucket_bytes)
    ]


def unflatten_tensors(flat: Any, layout: TensorLayout) -> dict[str, Any]:
    """Views of `flat` with each named tensor's shape and dtype (no copy)."""
    import torch

    sizes = [_entry_bytes(shape, dtype) for _, shape, dtype in layout]
    starts, _ = bucket_offsets(sizes)
    return {
        name: flat[start : start + size].view(getattr(torch, dtype)).reshape(shape)
        for (name, shape, dtype), start, size in zip(layout, starts, sizes, strict=True)
    }


def layout_bytes(layout: TensorLayout) -> int:
    """The size of the flat tensor `flatten_tensors` makes for `layout`."""
    return bucket_offsets(_entry_bytes(shape, dtype) for _, shape, dtype in layout)[1]


def _entry_bytes(shape: tuple[int, ...], dtype: str) -> int:
    import torch

    return int(np.prod(shape, dtype=np.int64)) * int(getattr(torch, dtype).itemsize)


@dataclass(frozen=True)
class BroadcastWeights:
    """A version sent by broadcast: the engines loaded it when it was sent (no data here)."""

    version: int
    stats: PublishStats

    def arrays(self) -> Iterator[tuple[str, np.ndarray]]:
        raise RuntimeError(
            f"weights v{self.version} were broadcast to the engines that were in the sync "
            "group when they were published and cannot be fetched again"
        )


def broadcast_send(
    group: Any, tensors: Mapping[str, Any], bucket_bytes: int, version: int
) -> BroadcastWeights:
    """On the sender (rank 0): every bucket flattened on the group's device, one collective
    per bucket. With NCCL and the learner on a GPU the bytes never visit host memory."""
    start = time.perf_counter()
    buckets = bucketize(tensors, bucket_bytes)
    for bucket in buckets:
        flat, _ = flatten_tensors(bucket, group.device)
        group.broadcast(flat)
    if str(group.device).startswith("cuda"):
        import torch

        # NCCL's wait() only orders the current stream after the collective: without this
        # the time (and GB/s) logged would be the enqueueing, not the broadcast
        torch.cuda.current_stream(group.device).synchronize()
    method = f"{group.backend} broadcast"
    return BroadcastWeights(
        version, PublishStats.measure(version, start, tensors, len(buckets), method)
    )


def broadcast_receive(group: Any, layouts: list[TensorLayout]) -> Iterator[tuple[str, Any]]:
    """On a receiver: yields (name, tensor on the group's device), bucket by bucket, in the
    order the sender sends them."""
    import torch

    for layout in layouts:
        flat = torch.empty(layout_bytes(layout), dtype=torch.uint8, device=group.device)
        group.broadcast(flat)
        yield from unflatten_tensors(flat, layout).items()
