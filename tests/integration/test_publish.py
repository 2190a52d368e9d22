"""Weight publishing from the learner to rollout engines: Ray object store, files, broadcast."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from staleflow.actors.hf_engine import HFEngine
from staleflow.actors.models import tiny_model
from staleflow.actors.worker import RolloutWorker
from staleflow.buffer.ports import free_port
from staleflow.configs import parse_config
from staleflow.learner.publish import (
    CheckpointPublisher,
    RayPublisher,
    broadcast_receive,
    broadcast_send,
    bucketize,
    read_published,
    tensor_layouts,
)

from .test_learner import config, new_learner, sampled_groups

pytestmark = pytest.mark.integration


def trained_learner():
    learner = new_learner(config())
    learner.step(sampled_groups(behaviour_seed=1))
    return learner


def assert_engine_has(engine: HFEngine, arrays: dict[str, np.ndarray]) -> None:
    state = engine.model.state_dict()
    for name, array in arrays.items():
        np.testing.assert_array_equal(state[name].numpy(), array, err_msg=name)


def test_a_tied_output_layer_is_sent_once_and_still_arrives():
    # The tiny model ties lm_head to the token embedding, as SmolLM2 and Qwen2.5 do: every
    # update sent the same tensor under both names (vLLM then skipped the second)
    learner = trained_learner()
    arrays = learner.state_dict_for_sync()
    model_names = list(learner.model.state_dict())
    assert "lm_head.weight" in model_names
    assert "lm_head.weight" not in arrays
    assert sorted(arrays) == sorted(n for n in model_names if n != "lm_head.weight")
    model, tokenizer = tiny_model(seed=4)
    engine = HFEngine(model, tokenizer)
    engine.load_weights(arrays, 1)
    assert_engine_has(engine, arrays)
    np.testing.assert_array_equal(  # loaded with the embedding it is tied to
        engine.model.lm_head.weight.detach().numpy(), arrays["transformer.wte.weight"]
    )


def test_bucketize_keeps_order_and_size():
    arrays = {f"p{i}": np.zeros(n, np.float32) for i, n in enumerate([10, 10, 30, 5])}
    assert [list(b) for b in bucketize(arrays, bucket_bytes=100)] == [["p0", "p1"], ["p2"], ["p3"]]


def test_ray_publish_in_buckets_reaches_an_engine(ray_local):
    learner = trained_learner()
    arrays = learner.state_dict_for_sync()
    handle = RayPublisher(bucket_mb=0).publish(arrays, version=learner.version)  # 1 param/bucket
    assert handle.stats.buckets == len(arrays)
    assert handle.stats.bytes == sum(a.nbytes for a in arrays.values())
    assert handle.stats.seconds > 0
    model, tokenizer = tiny_model(seed=4)
    engine = HFEngine(model, tokenizer)
    engine.load_weights(handle.arrays(), handle.version)
    assert engine.version == 1
    assert_engine_has(engine, arrays)


def test_ray_publish_takes_tensors_and_stores_them_as_host_arrays(ray_local):
    # what learner rank 0 now hands it (its gathered tensors; from a GPU each bucket is
    # copied to the host only when it is put): the store holds numpy, bfloat16 as int16
    import torch

    tensors = {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "h": torch.tensor([1.5, -2.25, 3.0e-3], dtype=torch.bfloat16),
    }
    handle = RayPublisher(bucket_mb=0).publish(tensors, version=2)  # one tensor a bucket
    assert handle.stats.buckets == 2
    assert handle.stats.bytes == 6 * 4 + 3 * 2
    got = dict(handle.arrays())
    assert got["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert got["h"].dtype == np.int16
    assert torch.equal(torch.from_numpy(got["h"].copy()).view(torch.bfloat16), tensors["h"])


def test_synced_worker_actor_samples_exactly_the_learners_policy(ray_actors, redis_url):
    # After a sync through the object store, the worker's behaviour log-probs are the
    # learner's own: a step on its fresh groups sees ratio 1 everywhere.
    import ray

    from staleflow.buffer.replay import ReplayBuffer

    cfg = parse_config(
        "model: {preset: tiny, seed: 3}\ntask: {name: arithmetic, chat_template: false}\n"
        "rollout: {prompts_per_batch: 3, group_size: 4, max_new_tokens: 6, temperature: 0.9}\n"
    )
    learner = trained_learner()
    handle = RayPublisher().publish(learner.state_dict_for_sync(), version=learner.version)
    actor = ray_actors(ray.remote(RolloutWorker).remote(cfg, run_id="sync", redis_url=redis_url))
    assert ray.get(actor.load_published.remote(handle), timeout=120) == 1
    assert ray.get(actor.run_batch.remote(1), timeout=120).pushed == 3
    groups = ReplayBuffer(redis_url, "sync").take(3, learner_version=1).groups
    metrics = learner.step(groups)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert (metrics["ratio_min"], metrics["ratio_max"]) == pytest.approx((1.0, 1.0), abs=1e-4)
    assert metrics["lag_max"] == 0.0


def test_publish_time_is_logged(tmp_path, caplog):
    import logging

    from staleflow.learner import publish

    arrays = {"w": np.ones((256, 256), np.float32)}
    publish._LOGGED.discard("checkpoint")  # as in a fresh learner process
    with caplog.at_level(logging.DEBUG, logger="staleflow.learner.publish"):
        handle = CheckpointPublisher(tmp_path).publish(arrays, version=4)
        CheckpointPublisher(tmp_path).publish(arrays, version=5)
    # the first publish at INFO (it reaches the terminal), the next at DEBUG: one line each
    # step interrupted the progress line (metrics.jsonl has every publish's time)
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.DEBUG]
    record = caplog.records[0]
    # 256 * 256 * 4 bytes = 0.26 MB; the seconds and the rate are the publish's own
    message = record.getMessage()
    match = re.fullmatch(
        r"published weights v4 via checkpoint: 0\.3 MB in 1 bucket\(s\), (\d+\.\d{3}) s "
        r"\((\d+\.\d{2}|inf) GB/s\)",
        message,
    )
    assert match, message
    assert float(match[1]) == pytest.approx(handle.stats.seconds, abs=5e-4)
    assert (tmp_path / "weights-v00000004.safetensors").is_file()


def test_checkpoint_publisher_is_versioned_and_atomic(tmp_path, monkeypatch):
    learner = trained_learner()
    publisher = CheckpointPublisher(tmp_path / "weights", keep=2)
    first = learner.state_dict_for_sync()
    publisher.publish(first, version=1)
    learner.step(sampled_groups(behaviour_seed=2))
    second = learner.state_dict_for_sync()
    handle = publisher.publish(second, version=2)
    publisher.publish(second, version=3)
    files = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert files == ["LATEST", "weights-v00000002.safetensors", "weights-v00000003.safetensors"]
    version, arrays = read_published(tmp_path / "weights")
    assert version == 3
    assert all(np.array_equal(arrays[k], second[k]) for k in second)
    model, tokenizer = tiny_model(seed=4)
    engine = HFEngine(model, tokenizer)
    engine.load_weights(handle.arrays(), handle.version)
    assert engine.version == 2
    assert_engine_has(engine, second)
    # keep=0 sliced [:-0], which is nothing: every file was kept
    with pytest.raises(ValueError, match="keep must be at least 1"):
        CheckpointPublisher(tmp_path / "weights", keep=0)

    # a publish that dies mid-write (the disk fills) leaves LATEST on the last whole version
    import safetensors.numpy

    def disk_full(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as half:
            half.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        publisher.publish(second, version=4)
    version, arrays = read_published(tmp_path / "weights")
    assert version == 3
    assert all(np.array_equal(arrays[k], second[k]) for k in second)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == files  # no partial
    monkeypatch.undo()

    # ... and one whose weights are whole but whose LATEST cannot be written leaves neither
    # the weights (no handle is returned: nothing would discard them) nor a half LATEST
    from pathlib import Path

    write_text = Path.write_text

    def latest_full(self, data, *args, **kwargs):
        if self.name.startswith(".LATEST."):
            write_text(self, data[:3])
            raise OSError(28, "No space left on device")
        return write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", latest_full)
    with pytest.raises(OSError, match="No space left"):
        publisher.publish(second, version=4)
    assert read_published(tmp_path / "weights")[0] == 3
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == files


def test_reading_before_anything_was_published(tmp_path):
    with pytest.raises(FileNotFoundError, match="no weights published"):
        read_published(tmp_path)


def _broadcast_rank(rank: int, port: int, arrays: dict, queue, backend: str = "gloo") -> None:
    from staleflow.learner.sync_group import SyncGroup

    if backend == "nccl":
        torch.cuda.set_device(rank)  # NCCL wants one device per rank
    # a group of its own, outside any default process group (as learner rank 0 + engines)
    group = SyncGroup.open(backend, "127.0.0.1", port, rank, 2, timeout_s=60)
    tensors = {k: torch.from_numpy(v).to(group.device) for k, v in arrays.items()}
    if rank == 0:
        handle = broadcast_send(group, tensors, bucket_bytes=1, version=7)  # 1 param/bucket
        queue.put(("sent", handle.version, handle.stats.buckets))
    else:
        layouts = tensor_layouts(tensors, bucket_bytes=1)  # the layouts travel as metadata
        received = dict(broadcast_receive(group, layouts))
        queue.put(("received", {k: v.cpu().numpy().tolist() for k, v in received.items()}))
    group.close()


def run_broadcast(backend: str) -> None:
    arrays = {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.array([1, -2, 3], dtype=np.int16),
        "c": np.random.default_rng(0).standard_normal(50).astype(np.float32),
    }
    port = free_port("127.0.0.1")  # below the ephemeral range (see free_port)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_broadcast_rank, args=(r, port, arrays, queue, backend)) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    results = dict((kind, rest) for kind, *rest in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results["sent"] == [7, 3]
    received = results["received"][0]
    for name, array in arrays.items():
        np.testing.assert_array_equal(np.array(received[name], dtype=array.dtype), array)


def test_bucketed_broadcast_delivers_every_parameter_bit_exactly():
    # The nccl method's code, run over gloo on CPU between two real processes.
    run_broadcast("gloo")


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: run with 2+ GPUs"
)
def test_bucketed_broadcast_over_nccl():
    run_broadcast("nccl")


def test_a_failed_weight_load_fails_the_batch_with_its_own_error(ray_actors):
    # The load happens inside the batch's call, so its error is the batch's error, not a later
    # VersionMismatchError. Failure injected by publishing a parameter of the wrong shape.
    import ray

    from staleflow.actors.worker import WeightLoadError

    cfg = parse_config(
        "model: {preset: tiny}\ntask: {name: digits, chat_template: false}\n"
        "rollout: {prompts_per_batch: 1, group_size: 2, max_new_tokens: 2}\n"
    )
    model, _ = tiny_model(seed=0)
    arrays = {n: t.detach().numpy() for n, t in model.state_dict().items()}
    name = next(iter(arrays))
    arrays[name] = np.zeros((3, 3), np.float32)
    handle = RayPublisher().publish(arrays, version=1)
    actor = ray_actors(ray.remote(RolloutWorker).remote(cfg, run_id="bad-load"))
    with pytest.raises(WeightLoadError, match=rf"loading weights v1 into the HFEngine failed: "
                       rf"ValueError: parameter '{name}': got shape \(3, 3\)"):  # fmt: skip
        ray.get(actor.run_batch.remote(1, None, handle), timeout=120)
    assert ray.get(actor.run_batch.remote(0), timeout=120).groups == 1  # still usable at v0
