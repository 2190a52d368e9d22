"""Learner checkpoints: exact resume, atomic writes, refusal of damaged or foreign ones."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from staleflow.actors.models import tiny_model
from staleflow.configs import parse_config
from staleflow.learner.checkpoint import CheckpointError, export_hf
from staleflow.learner.learner import Learner

from .test_learner import new_learner, sampled_groups

pytestmark = pytest.mark.integration

CFG = (
    "model: {preset: tiny}\nrollout: {temperature: 0.9}\nrun: {steps: 8}\n"
    "learner: {optimizer: {lr: 1.0e-2, schedule: warmup_cosine, warmup_steps: 2}, "
    "loss: {name: red-drop}}\n"  # red-drop: the seeded random drop must resume exactly too
)


def batches() -> list:
    return [sampled_groups(behaviour_seed=s, n=2) for s in (1, 2, 3, 4)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_gives_exactly_the_uninterrupted_run(tmp_path, stage):
    cfg = CFG.replace("learner: {", f"learner: {{zero_stage: {stage}, ")
    data = batches()
    straight = new_learner(parse_config(cfg))
    expected = [straight.step(groups) for groups in data]

    first = new_learner(parse_config(cfg))
    for groups in data[:2]:
        first.step(groups)
    torch.rand(5)  # RNG use after the checkpoint must not leak into the resumed run
    first.save(tmp_path / "ckpt", extra={"acked": ["1-0", "1-1"]})
    del first

    resumed = new_learner(parse_config(cfg), seed=9)  # different initial weights on purpose
    assert resumed.load(tmp_path / "ckpt") == {"acked": ["1-0", "1-1"]}
    assert resumed.version == 2
    got = [resumed.step(groups) for groups in data[2:]]
    for want, have in zip(expected[2:], got, strict=True):
        for key in ("loss", "grad_norm", "lr", "clip_frac", "entropy"):
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    for p, q in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


def test_saving_over_an_existing_checkpoint_is_atomic(tmp_path, monkeypatch):
    import safetensors.torch

    learner = new_learner(parse_config(CFG))
    learner.save(tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    learner.step(sampled_groups(n=1))
    # a save that fails half-way (the optimizer's file written, the model's not) leaves the
    # checkpoint that was there whole and loadable, and no partial directory
    real = safetensors.torch.save_file

    def disk_full(tensors, filename, *args, **kwargs):
        if str(filename).endswith("model.safetensors"):
            raise OSError(28, "No space left on device")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        learner.save(tmp_path / "ckpt")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    loaded = new_learner(parse_config(CFG))
    loaded.load(tmp_path / "ckpt")
    assert loaded.version == 0  # the checkpoint from before the step
    learner.save(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "trainer.json").read_text())["steps"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp or old dirs left


def test_corrupted_checkpoint_is_refused(tmp_path):
    learner = new_learner(parse_config(CFG))
    learner.save(tmp_path / "ckpt")
    target = tmp_path / "ckpt" / "model.safetensors"
    target.write_bytes(target.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt"):
        new_learner(parse_config(CFG)).load(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "trainer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"trainer\.json: corrupt"):
        new_learner(parse_config(CFG)).load(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"missing; is .* a staleflow checkpoint"):
        new_learner(parse_config(CFG)).load(tmp_path / "nothing")


def test_checkpoint_of_another_model_is_refused(tmp_path):
    learner = new_learner(parse_config(CFG))
    learner.save(tmp_path / "ckpt")
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tokenizer = tiny_model(0)
    wider = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2))
    other = Learner(parse_config(CFG), model=wider, tokenizer=tokenizer)
    with pytest.raises(
        CheckpointError, match=r"incompatible: parameter 'transformer\.wte\.weight'"
    ):
        other.load(tmp_path / "ckpt")


def test_checkpoint_from_other_zero_settings_is_refused(tmp_path):
    new_learner(parse_config(CFG)).save(tmp_path / "ckpt")  # ZeRO 0
    zero2 = new_learner(parse_config(CFG.replace("learner: {", "learner: {zero_stage: 2, ")))
    with pytest.raises(
        CheckpointError, match=r"written at ZeRO stage 0, this learner runs stage 2"
    ):
        zero2.load(tmp_path / "ckpt")


def test_export_is_a_plain_hugging_face_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    learner = new_learner(parse_config(CFG))
    learner.step(sampled_groups(n=1))
    _, tokenizer = tiny_model(0)
    export_hf(learner, tokenizer, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([tokenizer("What is 2 + 2?").input_ids])
    with torch.no_grad():
        np.testing.assert_allclose(
            loaded(ids).logits.numpy(), learner.model(ids).logits.numpy(), atol=1e-6
        )
