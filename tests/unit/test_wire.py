"""The wire format of weight buckets that cross a serialiser (vLLM's multiprocess IPC) or a
file in shared memory, and how the vLLM worker extension collects and applies them."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest
import torch

from staleflow.actors.engine import check_parameter
from staleflow.actors.vllm_engine import WeightLoaderExtension
from staleflow.learner.ipc import MappedFiles
from staleflow.learner.publish import (
    bucket_offsets,
    bucketize,
    flatten_tensors,
    layout_bytes,
    pack_bucket,
    read_bucket,
    remove_orphaned_files,
    unflatten_tensors,
    unpack_bucket,
    write_bucket,
)


def sample_bucket() -> dict[str, np.ndarray]:
    bf16 = torch.tensor([1.5, -2.25, 3.0e-3], dtype=torch.bfloat16)
    return {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": bf16.view(torch.int16).numpy(),  # bfloat16 travels as its int16 bit pattern
        "scalar": np.array(7.0, dtype=np.float32),
        "empty": np.zeros((0, 5), dtype=np.float32),
    }


@pytest.mark.parametrize(
    "serialise",
    [
        # plain msgpack, no numpy or extension hooks: what any IPC layer can at least do
        lambda x: msgpack.unpackb(msgpack.packb(x, use_bin_type=True), raw=False),
        lambda x: pickle.loads(pickle.dumps(x)),
    ],
    ids=["msgpack", "pickle"],
)
def test_a_bucket_survives_a_serialiser_bit_exactly(serialise):
    bucket = sample_bucket()
    layout, data = serialise(list(pack_bucket(bucket)))
    assert isinstance(data, bytes)
    # each array starts at a multiple of 16 bytes (ALIGN): "w" 12 floats * 4 = bytes 0-48,
    # "b" 3 int16 * 2 = 48-54, "scalar" 1 float * 4 = 64-68, "empty" 0 bytes at 80: 80 bytes
    assert len(data) == 80
    out = unpack_bucket(layout, data)
    assert list(out) == ["w", "b", "scalar", "empty"]
    for name, array in bucket.items():
        assert out[name].dtype == array.dtype
        assert out[name].shape == array.shape
        np.testing.assert_array_equal(out[name], array)
    restored = torch.from_numpy(out["b"].copy()).view(torch.bfloat16)
    assert restored.tolist() == torch.tensor([1.5, -2.25, 3.0e-3], dtype=torch.bfloat16).tolist()


def test_arrays_turned_into_lists_are_refused_with_the_reason():
    # what vLLM's multiprocess IPC did to numpy arrays: they arrived as nested lists
    layout, _ = pack_bucket(sample_bucket())
    with pytest.raises(TypeError, match="must arrive as bytes, got list"):
        unpack_bucket(layout, [[0.0, 1.0], [2.0, 3.0]])


def test_a_truncated_or_padded_bucket_is_refused():
    layout, data = pack_bucket(sample_bucket())
    with pytest.raises(ValueError, match="parameter 'b': the bucket ends at byte 50"):
        unpack_bucket(layout, data[:50])  # "w" takes bytes 0-48, "b" needs 48-54
    with pytest.raises(ValueError, match="2 bytes the layout does not name"):
        unpack_bucket(layout, data + b"xx")
    with pytest.raises(ValueError, match="bad layout"):
        unpack_bucket([["w", [3, 4], "<U8"]], data)


def test_unsupported_dtypes_are_refused_when_packing():
    with pytest.raises(TypeError, match="parameter 's': dtype <U1"):
        pack_bucket({"s": np.array(["a"])})


def test_write_bucket_writes_pack_buckets_bytes_and_read_bucket_reads_them(tmp_path):
    bucket = sample_bucket()
    layout = write_bucket(bucket, tmp_path / "bucket")
    assert (layout, (tmp_path / "bucket").read_bytes()) == pack_bucket(bucket)
    out = read_bucket(layout, tmp_path / "bucket")
    # views of the file mapped into memory, still whole after the file is removed (the engine
    # removes each bucket's file once its RPC returns; the worker applies them all at the end)
    (tmp_path / "bucket").unlink()
    for name, array in bucket.items():
        np.testing.assert_array_equal(out[name], array)
        assert not out[name].flags.writeable
        assert not out[name].flags.owndata
    empty = write_bucket({"e": np.zeros((0, 5), dtype=np.float32)}, tmp_path / "empty")
    assert read_bucket(empty, tmp_path / "empty")["e"].shape == (0, 5)  # an empty file
    write_bucket(bucket, tmp_path / "bucket")
    with pytest.raises(ValueError, match="the bucket ends at byte 80, the layout needs 84"):
        read_bucket([*layout, ["x", [2], "<i2"]], tmp_path / "bucket")


def test_mixed_dtypes_start_aligned_so_each_can_be_viewed_in_its_own(tmp_path):
    # An odd count of bfloat16 before float32 and int64: packed back to back, "f" would start
    # at byte 6 and torch refused to view it as float32 ("storage_offset() must be divisible
    # by 4"), which broke the broadcast and CUDA IPC paths for such a model.
    tensors = {
        "h": torch.tensor([1.5, -2.25, 3.0e-3], dtype=torch.bfloat16),  # 6 bytes at 0
        "f": torch.arange(5, dtype=torch.float32),  # 20 bytes at 16
        "flag": torch.tensor([True]),  # 1 byte at 48
        "i": torch.tensor([[7, -8]], dtype=torch.int64),  # 16 bytes at 64
    }
    assert bucket_offsets([6, 20, 1, 16]) == ([0, 16, 48, 64], 80)
    flat, layout = flatten_tensors(tensors, "cpu")  # the broadcast's and CUDA IPC's buffer
    assert flat.numel() == layout_bytes(layout) == 80
    assert flat[6:16].tolist() == [0] * 10  # padding is zeros, not stale memory
    for name, t in unflatten_tensors(flat, layout).items():
        assert t.dtype == tensors[name].dtype
        assert torch.equal(t, tensors[name])
    arrays = {n: (t.view(torch.int16) if n == "h" else t).numpy() for n, t in tensors.items()}
    layout, data = pack_bucket(arrays)  # the numpy paths (rpc, files): the same places
    assert len(data) == 80
    assert write_bucket(arrays, tmp_path / "mixed") == layout
    assert (tmp_path / "mixed").read_bytes() == data
    for name, array in read_bucket(layout, tmp_path / "mixed").items():
        assert array.flags.aligned
        np.testing.assert_array_equal(array, arrays[name])
    # learner rank 0's kept mappings (sync.method ipc on CPU) write the same bytes, also into
    # a file that held other bytes of that size (a version's file reused in place)
    kept = MappedFiles()
    (tmp_path / "kept").write_bytes(b"\xff" * 80)
    assert kept.write(arrays, str(tmp_path / "kept")) == layout
    kept.close()
    assert (tmp_path / "kept").read_bytes() == data


def test_flatten_writes_the_bytes_the_numpy_paths_write_for_any_tensor_and_no_tensor():
    # flatten_tensors copies each tensor into its slice: a transposed (non-contiguous)
    # tensor, a 0-d one and an empty one land where pack_bucket puts their bytes, and the
    # padding between them is zeros whatever memory torch.empty handed out
    tensors = {
        "t": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),  # 24 bytes at 0
        "s": torch.tensor(-1.5, dtype=torch.bfloat16),  # 2 bytes at 32
        "e": torch.zeros((0, 5), dtype=torch.float32),  # 0 bytes at 48
        "b": torch.tensor([True, False, True]),  # 3 bytes at 48
        "i": torch.tensor([9], dtype=torch.int32),  # 4 bytes at 64
    }
    flat, layout = flatten_tensors(tensors, "cpu")
    arrays = {n: (t.view(torch.int16) if n == "s" else t).numpy() for n, t in tensors.items()}
    _, data = pack_bucket(arrays)
    assert len(data) == 68
    assert bytes(flat.numpy()) == data
    for name, t in unflatten_tensors(flat, layout).items():
        assert torch.equal(t, tensors[name])
    empty, none = flatten_tensors({}, "cpu")
    assert empty.numel() == 0
    assert none == []


class Runner:
    """Records what vLLM's model runner would be asked to load (the extension's collecting of
    buckets is under test here; vLLM's own loading is in tests/vllm_cpu)."""

    def __init__(self) -> None:
        self.applied: list[list[tuple[str, torch.Tensor]]] = []

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
        assert is_checkpoint_format
        self.applied.append([(name, t.clone()) for name, t in weights_iterator])


class Worker(WeightLoaderExtension):
    def __init__(self) -> None:
        self.model_runner = Runner()


def test_an_update_in_buckets_is_applied_once_and_whole_through_either_transport(tmp_path):
    weights = {f"p{i}": np.full(n, i, dtype=np.float32) for i, n in enumerate([100, 100, 300, 50])}
    weights["b"] = sample_bucket()["b"]
    parts = bucketize(weights, bucket_bytes=1000)  # 1000 bytes = 250 floats
    assert [list(b) for b in parts] == [["p0", "p1"], ["p2"], ["p3", "b"]]
    through_file, through_rpc = Worker(), Worker()
    for i, bucket in enumerate(parts):
        first, last = i == 0, i == len(parts) - 1
        layout = write_bucket(bucket, tmp_path / f"b{i}")
        assert through_file.staleflow_load_file(layout, str(tmp_path / f"b{i}"), first, last) == (
            5 if last else 0
        )
        layout, data = msgpack.unpackb(msgpack.packb(list(pack_bucket(bucket))), raw=False)
        through_rpc.staleflow_load_bucket(layout, data, first, last)
    for worker in (through_file, through_rpc):
        [update] = worker.model_runner.applied
        assert [name for name, _ in update] == list(weights)
        assert dict(update)["p2"].tolist() == [2.0] * 300
        assert dict(update)["b"].dtype == torch.bfloat16
        assert (
            dict(update)["b"].tolist()
            == torch.tensor([1.5, -2.25, 3.0e-3], dtype=torch.bfloat16).tolist()
        )


def test_an_update_that_stopped_half_way_does_not_leak_into_the_next(tmp_path):
    worker = Worker()
    layout = write_bucket({"old": np.zeros(4, np.float32)}, tmp_path / "a")
    worker.staleflow_load_file(layout, str(tmp_path / "a"), True, False)  # its rest never came
    layout = write_bucket({"new": np.ones(2, np.float32)}, tmp_path / "b")
    worker.staleflow_load_file(layout, str(tmp_path / "b"), True, True)
    [update] = worker.model_runner.applied
    assert [name for name, _ in update] == ["new"]


def test_weights_are_checked_against_the_models_names_and_shapes():
    # check_parameter: what the vLLM engine runs on a whole update before sending any of it,
    # and the hf engine on each entry before copying it
    shapes = {"w": (3, 4), "b": (4,)}
    for name, array in {"w": np.zeros((3, 4)), "b": np.zeros(4)}.items():
        check_parameter(name, array.shape, shapes.get(name), shapes)
    with pytest.raises(ValueError, match=r"parameter 'b': got shape \(5,\), the model has \(4,\)"):
        check_parameter("b", (5,), shapes["b"], shapes)
    with pytest.raises(KeyError, match=r"unknown parameter 'c' \(the model has e.g. b, w, ...\)"):
        check_parameter("c", (1,), shapes.get("c"), shapes)


def test_files_of_a_process_killed_mid_load_are_removed_and_no_others(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = int(gone.stdout)  # a pid no process has now (reused within the test: unlikely)
    old = time.time() - 3600
    names = {
        f"staleflow-weights-{dead}-v3-0": old,  # its process died an hour ago: removed
        f"staleflow-weights-{dead}-v4-1": time.time(),  # just written: maybe another
        # container's live engine, whose pid this one cannot see: kept
        f"staleflow-weights-{os.getpid()}-v3-0": old,  # alive: kept
        f"staleflow-ipc-run-{dead}": old,  # not an engine's: kept
    }
    for name, mtime in names.items():
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (mtime, mtime))
    removed = remove_orphaned_files(str(tmp_path), "staleflow-weights-")
    assert removed == [str(tmp_path / f"staleflow-weights-{dead}-v3-0")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(list(names)[1:])
    assert remove_orphaned_files(str(tmp_path / "absent"), "staleflow-weights-") == []
