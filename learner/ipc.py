"""Weight sync through memory the learner and the engines share on one machine
(`sync.method: ipc`), for colocated roles (docs/architecture.md, "Contracts").

    sharer = WeightSharer(bucket_bytes)            # learner rank 0, for the run
    handle = sharer.share(tensors, version)        # rank 0, at each publish: a SharedWeights
    for bucket in handle.buckets:                  # each worker, at its next batch boundary
        tensors = open_bucket(bucket)              #   (views of the shared memory)
    sharer.discard(version)                        # rank 0, once the driver no longer needs it

- On a GPU every bucket is one flat uint8 tensor on the learner's device (one device-to-device
  copy of its weights), and the engines receive a CUDA IPC handle to it: they read the
  learner's memory in place and copy it into their weights, so the bytes never visit the host
  (the `ray` method copies them to the host, into the object store, and back). Both ends must
  be on the same GPU: the handle names it by UUID, and a process that cannot see it is told so.
- On CPU every bucket is a file in shared memory (/dev/shm) in the wire format of
  staleflow.learner.publish (`write_bucket`), which the engines map.

Like `ray`, a version is published once and each worker loads it at its own next batch
boundary, so the learner never waits for the workers. A `SharedBucket` is plain data
(strings, ints, bytes, lists): it crosses Ray and vLLM's IPC as it is. An engine synchronises
its device before its load returns, so no copy out of the shared memory is in flight when a
version is discarded.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from staleflow.learner.publish import (
    PublishStats,
    bucket_nbytes,
    bucket_offsets,
    bucketize,
    check_room,
    flatten_tensors,
    host_arrays,
    padded_views,
    read_bucket,
    unflatten_tensors,
    unpack_bucket,
    wire_views,
)

__all__ = [
    "MappedFiles",
    "Place",
    "SharedBucket",
    "SharedWeights",
    "WeightSharer",
    "colocation_problem",
    "cuda_uuid",
    "mps_hint",
    "open_bucket",
]

Place = tuple[str, list[str]]
"""Where Ray put an actor: its node id and the GPU ids it was given ([] for a CPU role)."""


@dataclass(frozen=True)
class SharedBucket:
    """One bucket's place in shared memory. kind "file": `where` is [path] and `layout` the
    wire layout ([name, shape, numpy dtype]); kind "cuda": `where` is the CUDA IPC handle's
    fields (see `_cuda_handle`) and `layout` [name, shape, torch dtype]."""

    kind: str
    layout: list[Any]
    where: list[Any]


@dataclass(frozen=True)
class SharedWeights:
    """A published version shared in place (sync.method ipc): what a worker needs to load it.
    The memory stays on learner rank 0 until the driver discards the version."""

    version: int
    buckets: list[SharedBucket]
    stats: PublishStats
    place: Place | None = None  # rank 0's

    def check_place(self, mine: Place, who: str) -> None:
        """Raise, naming both places, unless `who` (at `mine`) can open this version."""
        problem = colocation_problem(self.place, {who: mine}) if self.place else None
        if problem:
            raise RuntimeError(problem)


def colocation_problem(learner: Place, workers: Mapping[str, Place]) -> str | None:
    """What is wrong, and the fix, when some of `workers` are not on learner rank 0's node and
    GPU, where they could open its shared memory; None when all are."""
    away = {name: w for name, w in workers.items() if tuple(w) != tuple(learner)}
    if not away:
        return None
    listed = "; ".join(f"{n} on node {w[0][:12]} GPU {w[1] or 'none'}" for n, w in away.items())
    fix = (
        "Run on one node with one GPU (or hide the others: CUDA_VISIBLE_DEVICES), or use "
        "sync.method: nccl or ray"
        if learner[1]
        else "Run on one node (as many workers as fit beside the learner), or use "
        "sync.method: gloo or ray"
    )
    return (
        f"sync.method: ipc needs every rollout worker on learner rank 0's node and GPU "
        f"(node {learner[0][:12]}, GPU {learner[1] or 'none'}), but Ray placed {listed}. " + fix
    )


@dataclass
class _Held:
    buckets: list[SharedBucket]
    buffers: list[Any]  # GPU: the flat tensors
    files: list[str]  # CPU: the files, in bucket order
    counters: list[tuple[bytes, int]]  # GPU: torch's reference counter of each buffer


# torch pairs each CUDA IPC export with exactly one opener, which decrements a reference
# counter when its storage dies; the allocator frees the buffer only when that counter is
# exactly 0. A version here is opened by any number of engines, any number of times (none,
# if every worker moved on first), so the engines get a counter name that does not exist
# (torch ignores a counter it cannot open: the producer may be gone) and rank 0 releases its
# one count itself at `discard`, when the driver knows no engine can open the version again.
_NO_COUNTER = b"/staleflow-ipc-no-counter"


class WeightSharer:
    """Learner rank 0's side of sync.method ipc: every published version the driver still
    needs, in memory the engines open in place.

    `share` copies the weights once: on a GPU into one flat buffer per bucket (the engines
    get CUDA IPC handles to them), on CPU into files in `shm_dir`. A version stays until
    `discard`: after each publish the driver discards the versions older than the oldest one
    a batch, evaluation or checkpoint can still load, so async holds up to max_staleness + 1
    versions and lockstep with sync.offset O up to O/I + 1, plus the new one between its
    share and that discard. A discarded version's GPU buffers go back to the allocator; its
    files are kept for a later version and overwritten in place, because fresh tmpfs pages
    cost more than the copy into them: bench/sync.py's ipc row on SmolLM2 (651 MB, 2-core
    CPU machine, median of 5) fell from 416 ms with a new file per update to 166 ms once
    files were reused, and to 79-81 ms (from 155-161 ms, side by side) once both sides kept
    their mappings of them (`MappedFiles`, `_read_kept`). `close` removes every file."""

    def __init__(
        self, bucket_bytes: int, shm_dir: str = "/dev/shm", tag: str | None = None
    ) -> None:
        """`tag` (the run id) names the files, and files of that tag are removed first: what
        a run killed before `close` left behind, found again when it resumes."""
        self.bucket_bytes = bucket_bytes
        self.shm_dir = shm_dir
        self.files = MappedFiles()
        self.tag = tag or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._held: dict[int, _Held] = {}
        self._spare: list[list[str]] = []  # file sets of discarded versions
        self._made = 0  # files created (their names' numbers)
        if tag is not None and os.path.isdir(shm_dir):
            mine = re.compile(rf"staleflow-ipc-{re.escape(tag)}-\d+")  # not run "<tag>-2"'s
            for left in Path(shm_dir).iterdir():
                if mine.fullmatch(left.name):
                    with contextlib.suppress(FileNotFoundError):
                        left.unlink()

    @property
    def versions(self) -> list[int]:
        return sorted(self._held)

    def share(self, tensors: Mapping[str, Any], version: int, place: Any = None) -> SharedWeights:
        """Share `tensors` (the learner's weights, on one device) as `version`; `place`
        (this process's Ray node id and GPU ids) lets a worker check it can open them."""
        start = time.perf_counter()
        self.discard(version)  # the same version shared again (a resumed run) replaces it
        parts = bucketize(tensors, self.bucket_bytes)
        devices = {str(t.device) for t in tensors.values()}
        if len(devices) > 1:
            raise ValueError(
                f"sync.method ipc: the weights are on several devices {sorted(devices)}"
            )
        on_cpu = devices <= {"cpu"}
        held = self._share_files(parts) if on_cpu else self._share_cuda(parts)
        self._held[version] = held
        method = "ipc (files in shared memory)" if on_cpu else "ipc (CUDA IPC)"
        stats = PublishStats.measure(version, start, tensors, len(parts), method)
        return SharedWeights(version, held.buckets, stats, place)

    def discard(self, version: int) -> None:
        """No engine will load `version` any more: free it (its files are kept for reuse)."""
        held = self._held.pop(version, None)
        if held is not None:
            self._free(held)

    def _free(self, held: _Held) -> None:
        if held.files:
            self._spare.append(held.files)
        if held.buffers:
            import torch

            for counter, offset in held.counters:  # see _NO_COUNTER
                torch.UntypedStorage._release_ipc_counter_cuda(counter, offset)
            held.buffers.clear()
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]  # released blocks go back

    def host_arrays(self, version: int) -> dict[str, np.ndarray]:
        """A held version as host arrays (bfloat16 as int16 views), e.g. for a checkpoint;
        read from this process's own buffers (a process cannot open its own CUDA handles)."""
        held = self._held[version]
        out: dict[str, np.ndarray] = {}
        for i, bucket in enumerate(held.buckets):
            if held.buffers:
                layout = [(n, tuple(shape), d) for n, shape, d in bucket.layout]
                out.update(host_arrays(unflatten_tensors(held.buffers[i], layout), copy=True))
            else:
                arrays = read_bucket(bucket.layout, bucket.where[0])
                out.update((name, np.array(a)) for name, a in arrays.items())
        return out

    def close(self) -> None:
        """Discard every version and remove every file."""
        for version in list(self._held):
            self.discard(version)
        self.files.close()
        for files in self._spare:
            for path in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self._spare.clear()

    def _share_files(self, parts: list[dict[str, Any]]) -> _Held:
        if not os.path.isdir(self.shm_dir):
            raise OSError(
                f"sync.method ipc: {self.shm_dir} does not exist; CPU roles share weights "
                "through files in it (a Linux tmpfs); use sync.method: ray here"
            )
        files = self._spare.pop() if self._spare else []
        try:
            check_room(
                self.shm_dir,
                sum(bucket_nbytes(p) for p in parts),
                "a version of the weights (sync.method ipc)",
                "give the machine (or container: --shm-size) more shared memory, or use "
                "sync.method: ray",
                reusable=sum(os.path.getsize(f) for f in files if os.path.exists(f)),
            )
            while len(files) < len(parts):
                files.append(os.path.join(self.shm_dir, f"staleflow-ipc-{self.tag}-{self._made}"))
                self._made += 1
            buckets = []
            for path, part in zip(files, parts, strict=False):
                layout = self.files.write(host_arrays(part), path)
                buckets.append(SharedBucket("file", layout, [path]))
        except BaseException:
            for path in files:  # likely out of shared memory: give back what this share took
                self.files.drop(path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        return _Held(buckets, [], files, [])

    def _share_cuda(self, parts: list[dict[str, Any]]) -> _Held:
        import torch

        _check_allocator()
        held = _Held([], [], [], [])
        try:
            for part in parts:
                device = next(iter(part.values())).device
                flat, layout = flatten_tensors(part, device)
                held.buffers.append(flat)
                wire = [[name, list(shape), dtype] for name, shape, dtype in layout]
                where, counter = _cuda_handle(flat)
                if counter is not None:
                    held.counters.append(counter)
                held.buckets.append(SharedBucket("cuda", wire, where))
            # the copies are done before any engine reads: no CUDA event per export for the
            # engines to wait on (each open would leave one behind in the engine's process)
            torch.cuda.current_stream(device).synchronize()
        except BaseException:
            self._free(held)  # what was exported before the failure
            raise
        return held


FileKey = tuple[int, int, int]
"""A file as both sides of a mapping tell it apart: device, inode and size."""


def _key_of(st: os.stat_result) -> FileKey:
    return st.st_dev, st.st_ino, st.st_size


def _file_key(path: str) -> FileKey | None:
    try:
        return _key_of(os.stat(path))
    except FileNotFoundError:
        return None


class MappedFiles:
    """Learner rank 0's bucket files (CPU roles), each kept mapped from one version to the
    next. Writing a version into a reused file is then a memcpy into pages already mapped;
    through write() tmpfs looks up every page and it cost 3x a memcpy (2-core machine,
    651 MB in one file: memcpy 30 ms, write() 92 ms, a copy into the kept mapping 32 ms).
    A bucket's file holds exactly `write_bucket`'s bytes."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[FileKey, mmap.mmap]] = {}  # path -> (its file, mapping)

    def write(self, bucket: Mapping[str, np.ndarray], path: str) -> list[Any]:
        """Write `bucket` to the file `path` (made or resized as needed); its layout."""
        layout, views = wire_views(bucket)
        _, size = bucket_offsets(v.nbytes for v in views)
        target = self._mapping(path, size)
        if target is not None:  # (None: an empty bucket, an empty file)
            offset = 0
            for part in padded_views(views):  # write_bucket's bytes, padding included
                target[offset : offset + len(part)] = part
                offset += len(part)
        return layout

    def _mapping(self, path: str, size: int) -> mmap.mmap | None:
        kept = self._maps.get(path)
        if kept is not None:
            key, mapping = kept
            if key[2] == size and _file_key(path) == key:  # the same file, the same size
                return mapping
            self.drop(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            if size == 0:  # nothing to write, and an empty file cannot be mapped
                return None
            mapping = mmap.mmap(fd, size)
            self._maps[path] = (_key_of(os.fstat(fd)), mapping)
        finally:
            os.close(fd)
        return mapping

    def drop(self, path: str) -> None:
        kept = self._maps.pop(path, None)
        if kept is not None:
            kept[1].close()

    def close(self) -> None:
        for path in list(self._maps):
            self.drop(path)


# An engine's side: the files it opened, kept mapped (read-only) while they are the same
# files, for the same reason (a fresh mapping faults in every page on the first read: 90 ms
# for 651 MB where the copy out of a kept one took 31 ms). Keyed by path; an entry goes as
# soon as its file is removed or replaced, so no removed file's memory is held for long.
_opened: dict[str, tuple[FileKey, np.memmap]] = {}
_opened_lock = threading.Lock()


def _read_kept(layout: list[Any], path: str) -> dict[str, np.ndarray]:
    key = _file_key(path)
    if key is None or key[2] == 0:  # gone since the caller looked, or empty
        return read_bucket(layout, path)
    with _opened_lock:
        for other, (other_key, _) in list(_opened.items()):
            if other != path and _file_key(other) != other_key:
                del _opened[other]  # removed or replaced: let its memory go
        kept = _opened.get(path)
        if kept is None or kept[0] != key:
            kept = (key, np.memmap(path, dtype=np.uint8, mode="r"))
            _opened[path] = kept
    return unpack_bucket(layout, kept[1].data)


def _cuda_handle(flat: Any) -> tuple[list[Any], tuple[bytes, int] | None]:
    """A flat uint8 CUDA tensor as plain fields another process can open, and torch's
    reference counter for it (None for an empty tensor, which has no allocation). The fields:
    [GPU UUID, bytes, offset in its storage, then what torch's storage._share_cuda_ returns
    after the device index: the allocation's IPC handle, storage size and offset, a reference
    counter (here `_NO_COUNTER`) and its offset, and an event the opener need not wait on
    (the sharer synchronised its stream)]."""
    gpu = cuda_uuid(flat.device.index or 0)
    if flat.numel() == 0:
        return [gpu, 0, 0, None, 0, 0, _NO_COUNTER, 0, None, False], None
    storage = flat.untyped_storage()
    (
        _device,
        handle,
        size_bytes,
        offset_bytes,
        counter_handle,
        counter_offset,
        event_handle,
        _event_sync,
    ) = storage._share_cuda_()
    fields = [
        gpu,
        int(flat.numel()),
        int(flat.storage_offset()),
        bytes(handle),
        int(size_bytes),
        int(offset_bytes),
        _NO_COUNTER,
        int(counter_offset),
        bytes(event_handle) if event_handle is not None else None,
        False,  # no wait on the event: see WeightSharer._share_cuda
    ]
    return fields, (bytes(counter_handle), int(counter_offset))


def _check_allocator() -> None:
    """CUDA IPC cannot export memory from torch's expandable segments (it needs a file
    descriptor handed over, which containers often forbid) or from cudaMallocAsync."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = os.environ.get(name, "").replace(" ", "")
        if "expandable_segments:True" in conf or "backend:cudaMallocAsync" in conf:
            raise RuntimeError(
                f"sync.method ipc: the learner's {name}={conf!r} allocates memory CUDA IPC "
                f"cannot share; unset expandable_segments / cudaMallocAsync for the learner, "
                "or use sync.method: ray"
            )


def mps_hint(environ: Mapping[str, str] | None = None) -> str | None:
    """For a learner sharing its GPU with the engines (ipc on CUDA): None if an NVIDIA MPS
    control daemon serves this machine (its socket `control` in $CUDA_MPS_PIPE_DIRECTORY,
    /tmp/nvidia-mps by default), else what MPS would buy and how to start it. Without MPS the
    GPU runs one process's kernels at a time, so async's overlap slows both sides (on an H200,
    SmolLM2 with vLLM: async ran 1.56x lock-step's steps per second without MPS, 1.73x with)."""
    env = os.environ if environ is None else environ
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    if os.path.exists(os.path.join(pipe, "control")):
        return None
    return (
        "sync.method ipc: the learner and the rollout workers share this GPU, and no NVIDIA "
        f"MPS daemon serves it ({pipe}/control is missing), so the GPU runs one process's "
        "kernels at a time and generation beside a learner step slows both. For overlap, start "
        'MPS on the node before Ray (`nvidia-cuda-mps-control -d`; README, "GPUs")'
    )


def cuda_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def _local_device(gpu_uuid: str) -> int:
    """This process's index of the GPU with `gpu_uuid`; the error says what it sees instead."""
    import torch

    seen = [cuda_uuid(i) for i in range(torch.cuda.device_count())]
    if gpu_uuid not in seen:
        raise RuntimeError(
            f"sync.method ipc: the learner's weights are on GPU {gpu_uuid}, which this process "
            f"cannot see (it sees {seen or 'no GPU'}); ipc needs the learner and every worker "
            "on one GPU. Use sync.method: nccl (a GPU each) or ray"
        )
    return seen.index(gpu_uuid)


def open_bucket(bucket: SharedBucket | list[Any]) -> dict[str, Any]:
    """The named tensors (CUDA, on the shared GPU) or numpy arrays (file) of a shared bucket:
    views of the shared memory, valid while the learner has not released it. `bucket` may be
    a SharedBucket's fields as a list (after vLLM's IPC)."""
    kind, layout, where = (
        (bucket.kind, bucket.layout, bucket.where) if isinstance(bucket, SharedBucket) else bucket
    )
    if kind == "file":
        if not os.path.exists(where[0]):
            raise FileNotFoundError(
                f"sync.method ipc: learner rank 0's weights file {where[0]} is not here: this "
                "process is on another node than rank 0 (ipc needs every worker on its node), "
                "or the version was discarded before this load"
            )
        return _read_kept(layout, where[0])
    if kind != "cuda":
        raise ValueError(f"unknown shared bucket kind {kind!r}")
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    gpu_uuid, numel, tensor_offset, handle, size, offset, counter, counter_at, event, sync = where
    flat = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor,
        torch.Size([numel]),
        (1,),
        tensor_offset,
        torch.storage.TypedStorage,
        torch.uint8,
        _local_device(gpu_uuid),
        handle,
        size,
        offset,
        False,  # requires_grad
        counter,
        counter_at,
        event,
        sync,
    )
    return unflatten_tensors(flat, [(n, tuple(s), d) for n, s, d in layout])
