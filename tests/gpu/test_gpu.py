"""On one CUDA GPU (`pytest -m gpu`; skipped without one): learner and engines on CUDA, and
tiny runs end to end with each engine. Not part of `make test` (CI has no GPU)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.need_vllm import need_vllm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _learner_step(gpus: float, queue) -> None:
    """In a fresh process (DeepSpeed's backend and accelerator are per process): one step on
    the same off-policy groups (sampled on the CPU), then the metrics and the new weights."""
    from tests.integration.test_learner import config, new_learner, sampled_groups

    learner = new_learner(config(gpus_per_rank=gpus))
    metrics = learner.step(sampled_groups(behaviour_seed=1))
    queue.put((str(learner.device), metrics, learner.state_dict_for_sync()))


def step_on(gpus: float):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_learner_step, args=(gpus, queue))
    proc.start()
    result = queue.get(timeout=300)
    proc.join(timeout=60)
    return result


def test_learner_step_on_cuda_equals_the_cpu_step():
    cpu_device, cpu_metrics, cpu_weights = step_on(0.0)
    gpu_device, gpu_metrics, gpu_weights = step_on(1.0)
    assert (cpu_device, gpu_device) == ("cpu", "cuda:0")
    for key in ("loss", "grad_norm", "ratio_mean", "clip_frac", "entropy"):
        assert gpu_metrics[key] == pytest.approx(cpu_metrics[key], rel=1e-3, abs=1e-5), key
    # Adam's first step moves each weight by lr * g / (|g| + eps), lr = 1e-3, eps = 1e-8:
    # +-lr wherever |g| >> eps, the same on both devices. Only where g is within rounding of 0
    # can the two differ (by up to 2 lr if the rounding flipped g's sign at |g| ~ eps). On an
    # H100 (2026-11-24) 2 of 16384 entries of one matrix differed, by 8.8e-5. So: nearly every
    # entry equal to 1e-5, none apart by over lr.
    for name, array in cpu_weights.items():
        apart = np.abs(gpu_weights[name].astype(np.float64) - array)
        assert (apart > 1e-5 + 1e-4 * np.abs(array)).mean() <= 1e-3, name
        assert apart.max() <= 1e-3, name


def test_hf_engine_on_cuda_records_the_models_logprobs():
    from staleflow.actors.engine import SamplingParams
    from staleflow.actors.hf_engine import HFEngine
    from staleflow.actors.models import tiny_model

    model, tokenizer = tiny_model(seed=0)
    engine = HFEngine(model.to("cuda"), tokenizer)
    prompts = [tokenizer("12 + 7 =").input_ids, tokenizer("hello").input_ids]
    out = engine.generate(prompts, 4, SamplingParams(0.8, max_new_tokens=10, seed=1))
    for prompt, row in zip(prompts, out, strict=True):
        for c in row:
            ids = torch.tensor([list(prompt) + c.token_ids.tolist()], device="cuda")
            with torch.no_grad():
                logits = engine.model(ids).logits[0, len(prompt) - 1 : -1].float() / 0.8
            expected = torch.log_softmax(logits, -1).gather(
                1, ids[0, len(prompt) :, None]).squeeze(1).cpu().numpy()  # fmt: skip
            np.testing.assert_allclose(c.logprobs, expected, atol=1e-4)


def _tiny_run(tmp_path: Path, *overrides: str):
    from tests.integration.tiny import run_driver, steps_of

    _cfg, _run, summary, records = run_driver(
        tmp_path, "run.steps=20", "rollout.num_workers=1", "rollout.prompts_per_batch=4",
        "rollout.group_size=8", "rollout.max_new_tokens=8", "learner.optimizer.lr=3.0e-3",
        "sync.offset=0", "learner.gpus_per_rank=0.5", "rollout.gpus_per_worker=0.5",
        *overrides,
    )  # fmt: skip
    assert summary["status"] == "completed"
    assert summary["groups"]["reconciled"]
    rewards = [r["reward_mean"] for r in steps_of(records)]
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]), rewards  # the digits reward rises
    return summary, records


def test_tiny_run_on_one_gpu_with_the_hf_engine(tmp_path, ray_gpu):
    _tiny_run(tmp_path)


def test_tiny_run_on_one_gpu_with_vllm_in_its_default_mode(tmp_path, ray_gpu):
    need_vllm()
    _tiny_run(tmp_path, "rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=0.3",
              "rollout.vllm.max_model_len=256", "rollout.vllm.enforce_eager=true")  # fmt: skip


@pytest.mark.parametrize("engine", ["hf", "vllm", "vllm-cuda-graphs"])
def test_tiny_run_on_one_gpu_with_ipc_sync(tmp_path, ray_gpu, engine):
    # learner and worker share the GPU; every publish reaches the engine through CUDA IPC.
    # Lag 0 with pi / mu = 1 on every token shows each one arrived (an engine a version
    # behind samples from weights one Adam step at lr 3e-3 away); the 1e-2 allows for the
    # GPU's generation kernels against the learner's forward pass, not for a missed update.
    # vllm-cuda-graphs: vLLM's default mode (CUDA graphs, torch.compile), where a reload must
    # write into the tensors the captured graphs read, or they sample from the old weights.
    eager = "false" if engine == "vllm-cuda-graphs" else "true"
    vllm = ("rollout.vllm.gpu_memory_utilization=0.3", "rollout.vllm.max_model_len=256",
            f"rollout.vllm.enforce_eager={eager}")  # fmt: skip
    if engine != "hf":
        need_vllm()
    from tests.integration.tiny import steps_of

    _summary, records = _tiny_run(tmp_path, "sync.method=ipc",
                                  f"rollout.engine={engine.split('-')[0]}",
                                  *(vllm if engine != "hf" else ()))  # fmt: skip
    rows = steps_of(records)
    assert [r["lag_max"] for r in rows] == [0.0] * 20
    for r in rows:
        assert r["ratio_min"] == pytest.approx(1.0, abs=1e-2), r["step"]
        assert r["ratio_max"] == pytest.approx(1.0, abs=1e-2), r["step"]


class Holder:
    """Learner rank 0's side of sync.method ipc in a process of its own, on the shared GPU."""

    def __init__(self) -> None:
        from staleflow.actors.models import tiny_model

        model, _ = tiny_model(seed=0)
        self.tensors = {k: v.detach().cuda() for k, v in model.state_dict().items()}
        g = torch.Generator(device="cuda").manual_seed(0)
        self.tensors["bf16"] = torch.randn(1000, generator=g, device="cuda").bfloat16()
        self.sharer = None

    def share(self, bucket_bytes: int, model_only: bool = False):
        from staleflow.learner.ipc import WeightSharer

        tensors = {k: v for k, v in self.tensors.items() if not (model_only and k == "bf16")}
        self.sharer = WeightSharer(bucket_bytes)
        return self.sharer.share(tensors, version=1).buckets

    def host(self) -> dict:
        return {k: v.cpu() for k, v in self.tensors.items()}

    def release(self) -> None:
        self.sharer.close()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated()


class Opener:
    """An engine's side in a process of its own: opens a version's buckets and drops them."""

    def open(self, buckets) -> int:
        from staleflow.learner.ipc import open_bucket

        n = sum(len(open_bucket(b)) for b in buckets)
        torch.cuda.synchronize()
        return n


def test_ipc_buckets_open_on_the_same_gpu_bit_exactly_after_a_serialiser(ray_gpu):
    import msgpack
    import ray

    from staleflow.actors.hf_engine import HFEngine
    from staleflow.actors.models import tiny_model
    from staleflow.learner.ipc import open_bucket

    holder = ray.remote(num_gpus=0.5)(Holder).remote()
    expected = ray.get(holder.host.remote())
    buckets = ray.get(holder.share.remote(64 << 10))  # 64 KiB: several buckets
    assert len(buckets) > 1
    assert {b.kind for b in buckets} == {"cuda"}
    # what vLLM's IPC does to arguments: plain msgpack, then opened in another process
    wire = msgpack.unpackb(msgpack.packb([[b.kind, b.layout, b.where] for b in buckets]))
    opened = {k: v for b in wire for k, v in open_bucket(b).items()}
    assert sorted(opened) == sorted(expected)
    for name, tensor in opened.items():
        assert tensor.device.type == "cuda"
        assert torch.equal(tensor.cpu(), expected[name]), name
    del opened, tensor
    ray.get(holder.release.remote())
    # an hf engine on the GPU loads the model's weights into its own parameters, bit for bit
    model, tokenizer = tiny_model(seed=1)
    engine = HFEngine(model.cuda(), tokenizer)
    engine.receive_shared(ray.get(holder.share.remote(64 << 10, model_only=True)), 1)
    ray.get(holder.release.remote())
    assert engine.version == 1
    for name, value in model.state_dict().items():
        assert torch.equal(value.cpu(), expected[name]), name
    ray.kill(holder)


def test_a_discarded_version_frees_its_gpu_memory_however_often_it_was_opened(ray_gpu):
    # torch pairs one CUDA IPC export with one opener; a version here is opened by any
    # number of engines (or by none), so rank 0 releases it itself at discard
    import ray

    from staleflow.learner.ipc import open_bucket

    holder = ray.remote(num_gpus=0.3)(Holder).remote()
    opener = ray.remote(num_gpus=0.3)(Opener).remote()
    baseline = ray.get(holder.allocated.remote())
    for opens in (0, 1, 3):
        buckets = ray.get(holder.share.remote(64 << 10, model_only=True))
        assert ray.get(holder.allocated.remote()) > baseline
        for _ in range(opens):  # opened here and in another process, `opens` times each
            views = [open_bucket(b) for b in buckets]
            del views
            ray.get(opener.open.remote(buckets))
        torch.cuda.synchronize()
        ray.get(holder.release.remote())
        assert ray.get(holder.allocated.remote()) == baseline, opens
    ray.kill(holder)
    ray.kill(opener)


@pytest.fixture(scope="module")
def ray_gpu():
    import os

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=True, configure_logging=False)  # fmt: skip
    yield
    ray.shutdown()
