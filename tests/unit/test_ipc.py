"""sync.method ipc on CPU: learner rank 0's weights shared through files in shared memory, the
buckets' plain form, an HF engine loading them, and the errors. (The CUDA IPC kind is
checked on a GPU: tests/gpu.)"""

from __future__ import annotations

import json
import os
import pickle

import msgpack
import numpy as np
import pytest
import torch

from staleflow.actors.hf_engine import HFEngine
from staleflow.actors.models import tiny_model
from staleflow.learner import ipc
from staleflow.learner.ipc import SharedBucket, WeightSharer, open_bucket


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 32, generator=g),  # 8192 bytes
        "b": torch.randn(300, generator=g).to(torch.bfloat16),  # 600 bytes
        "s": torch.tensor(3.5),  # 4 bytes
    }


def staleflow_files(directory) -> list[str]:
    return sorted(p for p in os.listdir(directory) if p.startswith("staleflow-ipc-"))


def test_cpu_weights_are_shared_through_files_and_read_back_bit_exactly(tmp_path):
    tensors = weights()
    # buckets of at most 4 KiB: "w" alone exceeds it (a bucket of its own), "b" and "s" share
    sharer = WeightSharer(4096, shm_dir=str(tmp_path))
    shared = sharer.share(tensors, version=3)
    assert shared.version == 3
    assert shared.stats.bytes == 8192 + 600 + 4
    assert [b.kind for b in shared.buckets] == ["file", "file"]
    assert len(staleflow_files(tmp_path)) == 2
    # what crosses Ray and vLLM's IPC is plain data: JSON, msgpack and pickle carry it
    plain = [[b.kind, b.layout, b.where] for b in shared.buckets]
    for wire in (json.loads(json.dumps(plain)),
                 msgpack.unpackb(msgpack.packb(plain), raw=False),
                 pickle.loads(pickle.dumps(shared)).buckets):  # fmt: skip
        opened = {}
        for bucket in wire:
            opened.update(open_bucket(bucket))
        assert list(opened) == ["w", "b", "s"]
        np.testing.assert_array_equal(opened["w"], tensors["w"].numpy())
        # bfloat16 is read back as its int16 bit pattern, bit for bit
        np.testing.assert_array_equal(opened["b"], tensors["b"].view(torch.int16).numpy())
        assert opened["s"].shape == ()
        assert opened["s"] == 3.5
    # the sharer's own copy, for a checkpoint: the same values
    saved = sharer.host_arrays(3)
    np.testing.assert_array_equal(saved["w"], tensors["w"].numpy())
    np.testing.assert_array_equal(saved["b"], tensors["b"].view(torch.int16).numpy())
    sharer.close()
    assert staleflow_files(tmp_path) == []
    sharer.close()  # twice is harmless


def test_versions_stay_until_discarded_and_their_files_are_reused_in_place(tmp_path):
    tensors = weights()
    sharer = WeightSharer(4096, shm_dir=str(tmp_path))
    v1 = sharer.share(tensors, version=1)
    tensors["w"] += 1.0
    w2 = tensors["w"].clone()
    v2 = sharer.share(tensors, version=2)
    # async with max_staleness 1: both versions are held, each in files of its own
    assert sharer.versions == [1, 2]
    assert len(staleflow_files(tmp_path)) == 4
    np.testing.assert_array_equal(open_bucket(v1.buckets[0])["w"], weights()["w"].numpy())
    np.testing.assert_array_equal(open_bucket(v2.buckets[0])["w"], tensors["w"].numpy())
    inodes = {b.where[0]: os.stat(b.where[0]).st_ino for b in v1.buckets}
    sharer.discard(1)
    assert sharer.versions == [2]
    assert len(staleflow_files(tmp_path)) == 4  # kept for the next version
    tensors["w"] += 1.0
    v3 = sharer.share(tensors, version=3)
    # version 3 took version 1's files and overwrote them in place (same inodes: same pages)
    assert {b.where[0]: os.stat(b.where[0]).st_ino for b in v3.buckets} == inodes
    np.testing.assert_array_equal(open_bucket(v3.buckets[0])["w"], tensors["w"].numpy())
    np.testing.assert_array_equal(open_bucket(v2.buckets[0])["w"], w2.numpy())
    sharer.discard(7)  # a version it does not hold: nothing to do
    sharer.close()
    assert staleflow_files(tmp_path) == []
    with pytest.raises(FileNotFoundError, match=r"weights file .* is not here: this process is"):
        open_bucket(v2.buckets[0])


def test_both_sides_keep_their_mappings_of_reused_files_and_let_go_of_removed_ones(tmp_path):
    # a version written into a reused file goes through rank 0's kept mapping and is read
    # through the engine's kept mapping of the same file (no page faults on either side);
    # what they read is still each version's own bytes, and removing the files frees them
    tensors = weights()
    sharer = WeightSharer(4096, shm_dir=str(tmp_path))
    v1 = sharer.share(tensors, version=1)
    first = open_bucket(v1.buckets[0])["w"].copy()
    written = dict(sharer.files._maps)  # path -> (inode, mapping)
    opened = {path: kept[1] for path, kept in ipc._opened.items() if path in written}
    assert list(opened) == [v1.buckets[0].where[0]]
    sharer.discard(1)
    tensors["w"] *= -1.0
    v3 = sharer.share(tensors, version=3)  # into version 1's files, through the same mappings
    assert v3.buckets[0].where == v1.buckets[0].where
    assert all(sharer.files._maps[p][1] is kept[1] for p, kept in written.items())
    third = open_bucket(v3.buckets[0])["w"]
    assert ipc._opened[v3.buckets[0].where[0]][1] is opened[v3.buckets[0].where[0]]
    np.testing.assert_array_equal(third, tensors["w"].numpy())
    np.testing.assert_array_equal(first, -third)
    del third
    sharer.close()
    assert sharer.files._maps == {}
    assert staleflow_files(tmp_path) == []
    # the next file any engine opens sweeps out the mappings of removed files
    fresh = WeightSharer(4096, shm_dir=str(tmp_path), tag="fresh")
    open_bucket(fresh.share(weights(), version=1).buckets[0])
    assert not set(opened) & set(ipc._opened)
    fresh.close()


def test_a_worker_elsewhere_is_told_where_the_weights_are(tmp_path):
    sharer = WeightSharer(4096, shm_dir=str(tmp_path))
    shared = sharer.share(weights(), version=1, place=("a" * 40, ["0"]))
    shared.check_place(("a" * 40, ["0"]), "worker-0")  # the same node and GPU: fine
    rank0 = r"rank 0's node and GPU \(node aaaaaaaaaaaa, GPU \['0'\]\), but Ray placed "
    with pytest.raises(RuntimeError, match=rank0 + r"worker-1 on node bbbbbbbbbbbb GPU \['0'\]"):
        shared.check_place(("b" * 40, ["0"]), "worker-1")
    with pytest.raises(RuntimeError, match=rank0 + r"worker-2 on node aaaaaaaaaaaa GPU \['1'\]"):
        shared.check_place(("a" * 40, ["1"]), "worker-2")
    sharer.close()


def test_an_allocator_cuda_ipc_cannot_share_from_is_refused(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    with pytest.raises(RuntimeError, match=r"unset expandable_segments .* or use sync.method: ray"):
        ipc._check_allocator()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    ipc._check_allocator()  # other settings share fine


def test_a_learner_sharing_its_gpu_is_told_to_start_mps_unless_a_daemon_serves_it(tmp_path):
    import socket

    pipe = tmp_path / "mps"
    pipe.mkdir()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    hint = ipc.mps_hint(env)
    assert hint is not None
    assert f"{pipe}/control is missing" in hint
    assert "nvidia-cuda-mps-control -d" in hint
    # the control daemon listens on a Unix socket named `control` in its pipe directory
    with socket.socket(socket.AF_UNIX) as daemon:
        daemon.bind(str(pipe / "control"))
        assert ipc.mps_hint(env) is None
    # no variable (or an empty one): MPS's default pipe directory
    default = ipc.mps_hint({"CUDA_MPS_PIPE_DIRECTORY": ""})
    assert (default is None) == os.path.exists("/tmp/nvidia-mps/control")
    assert default is None or "/tmp/nvidia-mps/control is missing" in default


def test_a_sharer_removes_what_a_killed_run_of_its_name_left(tmp_path):
    for name in ("staleflow-ipc-run-0", "staleflow-ipc-run-1", "staleflow-ipc-run-2-0"):
        (tmp_path / name).write_bytes(b"x")
    WeightSharer(4096, shm_dir=str(tmp_path), tag="run")
    assert staleflow_files(tmp_path) == ["staleflow-ipc-run-2-0"]  # run "run-2"'s is kept


def test_an_hf_engine_loads_shared_weights_into_its_parameters(tmp_path):
    source, _ = tiny_model(seed=0)
    model, tokenizer = tiny_model(seed=1)
    engine = HFEngine(model, tokenizer)
    state = {k: v.detach() for k, v in source.state_dict().items()}
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    sharer = WeightSharer(1 << 20, shm_dir=str(tmp_path))
    engine.receive_shared(sharer.share(state, version=5).buckets, 5)
    sharer.close()
    assert engine.version == 5
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_a_failed_share_leaves_no_file_behind(tmp_path, monkeypatch):
    # a full /dev/shm fails the write: the files this share made are removed again
    written = []

    def fail_on_the_second(self, bucket, path):
        if written:
            raise OSError("No space left on device")
        written.append(path)
        return real(self, bucket, path)

    real = ipc.MappedFiles.write
    monkeypatch.setattr(ipc.MappedFiles, "write", fail_on_the_second)
    with pytest.raises(OSError, match="No space left"):
        WeightSharer(4096, shm_dir=str(tmp_path)).share(weights(), version=1)
    assert written
    assert staleflow_files(tmp_path) == []


def test_share_and_open_errors_name_the_problem_and_the_fix(tmp_path):
    with pytest.raises(OSError, match=r"does not exist.*use sync.method: ray"):
        WeightSharer(4096, shm_dir=str(tmp_path / "missing")).share(weights(), version=1)
    with pytest.raises(ValueError, match="unknown shared bucket kind 'tcp'"):
        open_bucket(SharedBucket("tcp", [], []))
    if torch.cuda.device_count() == 0:  # a handle to a GPU this process cannot see
        cuda = SharedBucket("cuda", [["w", [2], "float32"]], ["GPU-1234", 8, 0] + [b""] * 7)
        unseen = r"on GPU GPU-1234, which this process cannot see \(it sees no GPU\).*nccl"
        with pytest.raises(RuntimeError, match=unseen):
            open_bucket(cuda)
