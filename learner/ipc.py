"""Weight sync through memory the learner and the engines share on one machine
(`sync.method: ipc`), for colocated roles (docs/architecture.md, "Contracts").

    sharer = WeightSharer(bucket_bytes)                 # learner rank 0, for the run
    buckets, handle = sharer.share(tensors, version)    # rank 0, at each publish
    for bucket in buckets:                              # each engine, all at once
        tensors = open_bucket(bucket)                   #   (views of the shared memory)
    sharer.release()                                    # rank 0, once every engine loaded

- On a GPU every bucket is one flat uint8 tensor on the learner's device (one device-to-device
  copy of its weights), and the engines receive a CUDA IPC handle to it: they read the
  learner's memory in place and copy it into their weights, so the bytes never visit the host
  (the `ray` method copies them to the host, into the object store, and back). Both ends must
  be on the same GPU: the handle names it by UUID, and a process that cannot see it is told so.
- On CPU every bucket is a file in shared memory (/dev/shm) in the wire format of
  staleflow.learner.publish (`write_bucket`), which the engines map; the files are
  overwritten in place by the next update.

A `SharedBucket` is plain data (strings, ints, bytes, lists): it crosses Ray and vLLM's IPC as
it is. The learner keeps the memory until `release`, which the driver calls once every engine
has returned from its load (an engine synchronises its device before returning, so no copy
out of the shared memory is still in flight).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from staleflow.learner.publish import (
    PublishStats,
    PushedWeights,
    bucketize,
    flatten_tensors,
    host_arrays,
    read_bucket,
    unflatten_tensors,
    write_bucket,
)

__all__ = ["SharedBucket", "WeightSharer", "cuda_uuid", "open_bucket"]


@dataclass(frozen=True)
class SharedBucket:
    """One bucket's place in shared memory. kind "file": `where` is [path] and `layout` the
    wire layout ([name, shape, numpy dtype]); kind "cuda": `where` is the CUDA IPC handle's
    fields (see `_cuda_handle`) and `layout` [name, shape, torch dtype]."""

    kind: str
    layout: list[Any]
    where: list[Any]


class WeightSharer:
    """Learner rank 0's side of sync.method ipc, across updates.

    `share` puts the weights where the engines can read them and returns the buckets to send
    them; the memory stays until `release`. On a GPU that is one flat buffer per bucket
    (freed at release: the allocator takes it back once every engine has dropped its
    mapping). On CPU the files in `shm_dir` are kept from one update to the next and
    overwritten in place: fresh tmpfs pages cost more than the copy into them (651 MB on the
    2-core machine: 321-589 ms into a new file, 122 ms over an existing one), so /dev/shm
    holds one copy of the weights for the run, until `close`."""

    def __init__(
        self, bucket_bytes: int, shm_dir: str = "/dev/shm", tag: str | None = None
    ) -> None:
        """`tag` (the run id) names the files, and files of that tag are removed first: what
        a run killed before `close` left behind, found again when it resumes."""
        self.bucket_bytes = bucket_bytes
        self.shm_dir = shm_dir
        self.tag = tag or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._files: list[str] = []
        self._buffers: list[Any] = []
        if tag is not None and os.path.isdir(shm_dir):
            mine = re.compile(rf"staleflow-ipc-{re.escape(tag)}-\d+")  # not run "<tag>-2"'s
            for left in Path(shm_dir).iterdir():
                if mine.fullmatch(left.name):
                    with contextlib.suppress(FileNotFoundError):
                        left.unlink()

    def share(
        self, tensors: Mapping[str, Any], version: int
    ) -> tuple[list[SharedBucket], PushedWeights]:
        """(the buckets for the engines, the version's handle) of `tensors`, the learner's
        weights on one device; what the last share held is released first."""
        self.release()
        start = time.perf_counter()
        parts = bucketize(tensors, self.bucket_bytes)
        devices = {str(t.device) for t in tensors.values()}
        if len(devices) > 1:
            raise ValueError(
                f"sync.method ipc: the weights are on several devices {sorted(devices)}"
            )
        on_cpu = devices <= {"cpu"}
        try:
            buckets = self._share_files(parts) if on_cpu else self._share_cuda(parts)
        except BaseException:
            self.close()  # likely out of shared memory: give back what this share took
            raise
        method = "ipc (files in shared memory)" if on_cpu else "ipc (CUDA IPC)"
        stats = PublishStats.measure(version, start, tensors, len(parts), method)
        return buckets, PushedWeights(version, stats, "shared with the engines in place")

    def release(self) -> None:
        """The engines are done with the last share: free its GPU buffers (CPU files stay
        for the next update)."""
        if self._buffers:
            import torch

            self._buffers.clear()
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]  # blocks the engines have released go back now

    def close(self) -> None:
        """Release and remove the files."""
        self.release()
        for path in self._files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._files.clear()

    def _share_files(self, parts: list[dict[str, Any]]) -> list[SharedBucket]:
        if not os.path.isdir(self.shm_dir):
            raise OSError(
                f"sync.method ipc: {self.shm_dir} does not exist; CPU roles share weights "
                "through files in it (a Linux tmpfs); use sync.method: ray here"
            )
        sizes = [sum(int(t.nelement()) * t.element_size() for t in p.values()) for p in parts]
        held = sum(os.path.getsize(f) for f in self._files if os.path.exists(f))
        free = shutil.disk_usage(self.shm_dir).free + held
        if free < sum(sizes):
            raise OSError(
                f"sync.method ipc: {self.shm_dir} has {free >> 20} MiB free, the weights need "
                f"{sum(sizes) >> 20} MiB: give the machine (or container: --shm-size) more "
                "shared memory, or use sync.method: ray"
            )
        for i in range(len(self._files), len(parts)):
            self._files.append(os.path.join(self.shm_dir, f"staleflow-ipc-{self.tag}-{i}"))
        buckets = []
        for path, part in zip(self._files, parts, strict=False):
            layout = write_bucket(host_arrays(part), path)
            buckets.append(SharedBucket("file", layout, [path]))
        return buckets

    def _share_cuda(self, parts: list[dict[str, Any]]) -> list[SharedBucket]:
        buckets = []
        for part in parts:
            device = next(iter(part.values())).device
            flat, layout = flatten_tensors(part, device)
            self._buffers.append(flat)
            wire = [[name, list(shape), dtype] for name, shape, dtype in layout]
            buckets.append(SharedBucket("cuda", wire, _cuda_handle(flat)))
        return buckets


def _cuda_handle(flat: Any) -> list[Any]:
    """A flat uint8 CUDA tensor as plain fields another process can open: [GPU UUID, bytes,
    offset in its storage, then what torch's storage._share_cuda_ returns after the device
    index: the allocation's IPC handle, storage size and offset, the reference counter's
    handle and offset (the allocator keeps the memory until every opener released it), and
    an event the opener waits on (the copy that filled the buffer)]."""
    storage = flat.untyped_storage()
    (
        _device,
        handle,
        size_bytes,
        offset_bytes,
        counter_handle,
        counter_offset,
        event_handle,
        event_sync,
    ) = storage._share_cuda_()
    return [
        cuda_uuid(flat.device.index or 0),
        int(flat.numel()),
        int(flat.storage_offset()),
        bytes(handle),
        int(size_bytes),
        int(offset_bytes),
        bytes(counter_handle),
        int(counter_offset),
        bytes(event_handle) if event_handle is not None else None,
        bool(event_sync),
    ]


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
        return read_bucket(layout, where[0])
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
