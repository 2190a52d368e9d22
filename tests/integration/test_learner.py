"""The DeepSpeed learner on the tiny model: the pure loss, micro-batching, presets, lag, sync."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from staleflow.actors.engine import SamplingParams
from staleflow.actors.hf_engine import HFEngine
from staleflow.actors.models import tiny_model
from staleflow.buffer.records import Group, Response
from staleflow.configs import parse_config
from staleflow.learner.batch import TrainBatch, build_batch
from staleflow.learner.learner import Learner, response_logprobs, response_logprobs_entropy
from staleflow.learner.losses import PRESETS, LossInputs, get_loss

pytestmark = pytest.mark.integration


def config(loss: str = "rec-oneside-is", **learner: object) -> object:
    extra = "".join(f", {k}: {v}" for k, v in learner.items())
    return parse_config(
        f"""
model: {{preset: tiny}}
rollout: {{temperature: 0.9}}
learner: {{optimizer: {{lr: 1.0e-3, grad_clip: null}}, loss: {{name: {loss}}}{extra}}}
"""
    )


def sampled_groups(
    behaviour_seed: int = 1, n: int = 4, k: int = 4, version: int = 0
) -> list[Group]:
    """Real completions from the tiny model of `behaviour_seed` (seed 0 is the learner's own,
    so other seeds give off-policy data), with rewards 1, 0, 1, 0, ... in every group."""
    model, tokenizer = tiny_model(behaviour_seed)
    engine = HFEngine(model, tokenizer)
    prompts = [tokenizer(f"What is {i} + {i + 1}?").input_ids for i in range(n)]
    out = engine.generate(prompts, k, SamplingParams(temperature=0.9, max_new_tokens=6, seed=3))
    return [
        Group.new(
            run_id="t",
            prompt_id=f"p{i}",
            task="t",
            prompt_token_ids=prompt,
            worker_id="w",
            policy_version=version,
            responses=[
                Response(c.token_ids, c.logprobs, float(j % 2 == 0), c.finish_reason)
                for j, c in enumerate(row)
            ],
        )
        for i, (prompt, row) in enumerate(zip(prompts, out, strict=True))
    ]


def new_learner(cfg, seed: int = 0) -> Learner:
    model, tokenizer = tiny_model(seed)
    return Learner(cfg, model=model, tokenizer=tokenizer)


def test_loss_and_update_match_the_pure_loss_function():
    cfg = config("rec-oneside-is")
    groups = sampled_groups(behaviour_seed=1)  # off-policy: rho != 1, clipping active
    reference, tokenizer = tiny_model(0)
    learner = new_learner(cfg)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}

    # the reference: the pure loss on the same tensors, by hand
    batch = build_batch(groups, cfg.learner.loss.advantage, tokenizer.pad_token_id, seed=0)
    logp = response_logprobs(reference, batch, 0.9)
    out = get_loss("rec-oneside-is")(
        LossInputs(logp, batch.behavior_logp, batch.advantages, batch.response_mask)
    )
    out.loss.backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))

    metrics = learner.step(groups)
    assert metrics["loss"] == pytest.approx(float(out.loss.detach()), rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(float(ref_norm), rel=1e-4)
    assert metrics["clip_frac"] == pytest.approx(float(out.metrics["clip_frac"]), abs=1e-6)
    assert 0 < metrics["clip_frac"] < 1
    # AdamW's first step moves each weight by -lr * g / (|g| + eps) (bias-corrected m, v)
    for name, p in learner.model.named_parameters():
        g = grads[name]
        expected = before[name] - 1e-3 * g / (g.abs() + 1e-8)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_give_the_same_update_as_the_whole_batch(mode):
    # AdamW with eps = 1 moves weights by ~ -lr * g, so equal updates mean equal gradients
    # (with eps = 1e-8, g / (|g| + eps) would blow float rounding of tiny gradients up).
    def cfg(micro: str) -> object:
        return parse_config(
            "model: {preset: tiny}\nrollout: {temperature: 0.9}\n"
            "learner: {optimizer: {lr: 1.0e-2, eps: 1.0, grad_clip: null}, "
            f"loss: {{name: rec-oneside-is, loss_agg_mode: {mode}}}, micro_batch_size: {micro}}}\n"
        )

    groups = sampled_groups(behaviour_seed=2)
    whole, split = new_learner(cfg("null")), new_learner(cfg("3"))  # 16 rows: 6 uneven parts
    a, b = whole.step(groups), split.step(groups)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    moved = 0.0
    for (name, p), q in zip(whole.model.named_parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9, msg=name)
        moved = max(moved, float((p.detach() - tiny_model(0)[0].state_dict()[name]).abs().max()))
    assert moved > 1e-5  # the step did change the weights


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_step_moves_the_policy_the_expected_way(preset):
    # Every preset is a policy-gradient step: it raises the log-likelihood of responses with
    # positive advantage and lowers it for negative ones, i.e. sum(A * log pi) goes up. (A loss
    # *value* need not fall: CISPO's detached weight clip(rho) itself moves with the step.)
    groups = sampled_groups(behaviour_seed=0)  # on-policy
    cfg = parse_config(
        "model: {preset: tiny}\nrollout: {temperature: 0.9}\n"
        f"learner: {{optimizer: {{lr: 1.0e-4, grad_clip: null}}, loss: {{name: {preset}}}}}\n"
    )
    learner = new_learner(cfg)
    batch = build_batch(groups, cfg.learner.loss.advantage, learner.pad_id, seed=0)

    def weighted_loglik() -> float:
        with torch.no_grad():
            logp = response_logprobs(learner.model, batch, 0.9)
        return float((batch.advantages[:, None] * logp * batch.response_mask).sum())

    before = weighted_loglik()
    learner.step(groups)
    after = weighted_loglik()
    assert after > before, f"{preset}: sum(A log pi) {before:.5f} -> {after:.5f}"


def test_lag_of_the_groups_trained_on():
    groups = [
        *sampled_groups(n=1, version=0),
        *sampled_groups(n=1, version=2),
        *sampled_groups(n=1, version=3),
    ]
    metrics = new_learner(config()).step(groups, learner_version=5)
    assert (metrics["lag_min"], metrics["lag_mean"], metrics["lag_max"]) == (2.0, 10 / 3, 5.0)


def test_on_policy_ratio_is_one_and_versions_count_steps():
    learner = new_learner(config("grpo"))
    metrics = learner.step(sampled_groups(behaviour_seed=0))
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # engine == learner log-probs
    assert (metrics["ratio_min"], metrics["ratio_max"]) == pytest.approx((1.0, 1.0), abs=1e-4)
    assert metrics["clip_frac"] == 0.0
    assert learner.version == 1


def test_synced_weights_reproduce_the_learner_in_an_engine():
    learner = new_learner(config())
    learner.step(sampled_groups(behaviour_seed=1))
    model, tokenizer = tiny_model(seed=5)
    engine = HFEngine(model, tokenizer)
    engine.load_weights(learner.state_dict_for_sync(), version=learner.version)
    for name, p in learner.model.state_dict().items():
        torch.testing.assert_close(engine.model.state_dict()[name], p, msg=name)
    assert engine.version == 1


def test_warmup_cosine_schedule():
    cfg = parse_config(
        "model: {preset: tiny}\nrun: {steps: 10}\nlearner: {optimizer: {lr: 1.0e-3, "
        "schedule: warmup_cosine, warmup_steps: 2, min_lr_ratio: 0.1}}\n"
    )
    learner = new_learner(cfg)
    groups = sampled_groups(n=1)
    lrs = [learner.step(groups)["lr"] for _ in range(10)]
    # the lr each step trained with: optimizer step s (0-based) uses lr * factor(s), with
    # factor (s + 1) / 2 during the 2 warmup steps, then 0.1 + 0.9 * (1 + cos(pi * p)) / 2 at
    # progress p = (s - 2) / (10 - 2); the last step (s = 9) is at p = 7/8, short of the floor
    # 0.1, which step 11 would reach
    warmup = [0.5e-3, 1e-3]
    cosine = [1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * (s - 2) / 8))) for s in range(2, 10)]
    assert lrs == pytest.approx(warmup + cosine, rel=1e-6)
    assert lrs[2] == pytest.approx(1e-3)  # p = 0: the peak, right after warmup


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stages_agree_with_stage_zero(stage):
    def cfg(zero: int) -> object:
        return parse_config(
            "model: {preset: tiny}\nrollout: {temperature: 0.9}\n"
            f"learner: {{zero_stage: {zero}, optimizer: {{lr: 1.0e-2, eps: 1.0, grad_clip: 1.0}}, "
            "loss: {name: rec-oneside-is}}\n"
        )

    groups = sampled_groups(behaviour_seed=2)
    base, other = new_learner(cfg(0)), new_learner(cfg(stage))
    a, b = base.step(groups), other.step(groups)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)  # partitioned: from step()
    synced_a, synced_b = base.state_dict_for_sync(), other.state_dict_for_sync()
    assert synced_a.keys() == synced_b.keys()
    for name in synced_a:
        np.testing.assert_allclose(synced_a[name], synced_b[name], rtol=1e-5, atol=1e-7)


def test_the_kl_penalty_s_reference_model_works_at_zero_3():
    # The reference used to be copied from the DeepSpeed-wrapped module; at ZeRO 3 that copy
    # holds parameter partitions and its forward pass failed ('Parameter' object has no
    # attribute 'ds_status'). It must give the same steps as at ZeRO 0.
    def cfg(zero: int) -> object:
        return parse_config(
            "model: {preset: tiny}\nrollout: {temperature: 0.9}\n"
            f"learner: {{zero_stage: {zero}, reference_model: true, "
            "optimizer: {lr: 1.0e-2, eps: 1.0, grad_clip: 1.0}, "
            "loss: {name: reinforce, kl_coef: 1.0, kl_estimator: k3}}\n"
        )

    groups = sampled_groups(behaviour_seed=2)
    base, sharded = new_learner(cfg(0)), new_learner(cfg(3))
    for _ in range(2):  # the second step's KL is away from 0: the policy has moved
        a, b = base.step(groups), sharded.step(groups)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["kl_ref"] == pytest.approx(a["kl_ref"], rel=1e-4, abs=1e-9)
    assert b["kl_ref"] > 0
    synced_a, synced_b = base.state_dict_for_sync(), sharded.state_dict_for_sync()
    for name in synced_a:
        np.testing.assert_allclose(synced_b[name], synced_a[name], rtol=1e-5, atol=1e-7)


def test_reference_model_kl_penalty_pulls_towards_the_initial_policy():
    def cfg(kl: float) -> object:
        return parse_config(
            "model: {preset: tiny}\nrollout: {temperature: 0.9}\n"
            f"learner: {{reference_model: true, optimizer: {{lr: 1.0e-2, grad_clip: null}}, "
            f"loss: {{name: reinforce, kl_coef: {kl}, kl_estimator: k3}}}}\n"
        )

    groups = sampled_groups(behaviour_seed=0)
    free, anchored = new_learner(cfg(0.0)), new_learner(cfg(10.0))
    for _ in range(3):
        m_free, m_anchored = free.step(groups), anchored.step(groups)
    assert m_anchored["kl_ref"] > 0
    # a strong KL penalty keeps the policy closer to where it started
    start, _ = tiny_model(0)

    def drift(learner: Learner) -> float:
        return sum(
            float((p.detach() - q.detach()).pow(2).sum())
            for p, q in zip(learner.model.parameters(), start.parameters(), strict=True)
        )

    assert drift(anchored) < drift(free)
    assert "kl_ref" not in m_free


def test_mini_batches_and_epochs_take_more_optimizer_steps_but_one_version():
    groups = sampled_groups(behaviour_seed=1)

    def run(extra: str) -> Learner:
        cfg = parse_config(
            "model: {preset: tiny}\nrollout: {temperature: 0.9}\n"
            f"learner: {{optimizer: {{lr: 1.0e-3}}, loss: {{name: rec-oneside-is}}{extra}}}\n"
        )
        learner = new_learner(cfg)
        learner.step(groups)
        return learner

    one, minis, epochs = run(""), run(", mini_batches: 2"), run(", epochs: 3")
    # one batch trained = one policy version, however many optimizer steps it took
    assert (one.version, minis.version, epochs.version) == (1, 1, 1)
    assert (one.optimizer_steps, minis.optimizer_steps, epochs.optimizer_steps) == (1, 2, 3)
    first = next(one.model.parameters())
    assert not torch.equal(first, next(minis.model.parameters()))
    assert not torch.equal(first, next(epochs.model.parameters()))


def test_bfloat16_learner_syncs_int16_views_that_engines_load_exactly():
    from staleflow.actors.models import load_model

    cfg = parse_config(
        "model: {preset: tiny, dtype: bfloat16}\nlearner: {optimizer: {lr: 1.0e-3}}\n"
    )
    model, tokenizer = load_model(cfg.model)
    learner = Learner(cfg, model=model, tokenizer=tokenizer)
    metrics = learner.step(sampled_groups(behaviour_seed=1))
    assert np.isfinite(metrics["loss"])
    arrays = learner.state_dict_for_sync()
    assert {a.dtype for a in arrays.values()} == {np.dtype(np.int16)}
    target, _ = load_model(cfg.model)
    engine = HFEngine(target, tokenizer)
    engine.load_weights(arrays, version=1)
    for name, p in learner.model.state_dict().items():
        assert p.dtype == torch.bfloat16
        assert torch.equal(engine.model.state_dict()[name], p), name


@pytest.mark.parametrize("stage", [0, 2])
def test_bfloat16_takes_a_first_adam_step_of_lr_at_every_zero_stage(stage):
    # At ZeRO 0, DeepSpeed's bf16 optimizer made its state by one step on zero gradients:
    # AdamW's step count began at 1, and weight decay shrank the fp32 master weights once.
    # By hand, Adam's first update of an element is lr * g / (|g| + eps) = lr for |g| >> eps
    # (m = 0.1 g, v = 0.001 g^2, both bias-corrected by 1 - beta^1); one step late it was
    # lr * (0.1 / 0.19) / sqrt(0.001 / 0.001999) = 0.744 lr. ZeRO 2 was right.
    from staleflow.actors.models import load_model

    cfg = parse_config(
        f"model: {{preset: tiny, dtype: bfloat16}}\nrollout: {{temperature: 0.9}}\n"
        f"learner: {{zero_stage: {stage}, optimizer: {{lr: 1.0e-3, weight_decay: 0.1}}, "
        "loss: {name: rec-oneside-is}}\n"  # (clipping scales g, and g / |g| not at all)
    )
    model, tokenizer = load_model(cfg.model)
    learner = Learner(cfg, model=model, tokenizer=tokenizer)
    wrapped = learner.engine.optimizer

    def masters() -> torch.Tensor:
        groups = getattr(wrapped, "fp32_groups", None) or [wrapped.single_partition_of_fp32_groups]
        return torch.cat([p.detach().flatten().clone() for g in groups for p in g])

    before = masters()
    weights = torch.cat([p.detach().float().flatten() for p in learner.model.parameters()])
    if stage == 0:  # the masters are the model's weights, not decayed once already
        assert torch.equal(before, weights)
    learner.step(sampled_groups(behaviour_seed=2))
    moved = (masters() - before).abs()
    # (weight decay adds lr * 0.1 * |w| <= 1e-4 * 0.2 to an element: under the tolerance)
    assert moved[moved > 0].median().item() == pytest.approx(1.0e-3, rel=0.01)


def test_evaluate_loss_includes_the_reference_kl_term():
    cfg = parse_config(
        "model: {preset: tiny}\nrollout: {temperature: 0.9}\n"
        "learner: {reference_model: true, optimizer: {lr: 1.0e-2}, "
        "loss: {name: reinforce, kl_coef: 5.0, kl_estimator: k2}}\n"
    )
    learner = new_learner(cfg)
    groups = sampled_groups(behaviour_seed=0)
    at_start = learner.evaluate_loss(groups)  # the policy is the reference: KL term 0
    learner.step(groups)
    learner.step(groups)
    moved = learner.evaluate_loss(groups)
    # two steps away from the reference, the loss is the policy loss plus 5 x the k2 KL to it
    batch = build_batch(groups, cfg.learner.loss.advantage, learner.pad_id, seed=0)
    with torch.no_grad():
        logp = response_logprobs(learner.model, batch, 0.9)
        ref = response_logprobs(learner.reference, batch, 0.9)
    pg = get_loss("reinforce")(
        LossInputs(logp, batch.behavior_logp, batch.advantages, batch.response_mask)
    )
    k2 = 0.5 * ((ref - logp) ** 2 * batch.response_mask).sum() / batch.response_mask.sum()
    assert moved == pytest.approx(float(pg.loss) + 5.0 * float(k2), rel=1e-5)
    assert float(k2) > 0
    assert np.isfinite(at_start)


def test_response_logprobs_skips_prompt_logits_without_changing_response_values():
    # The learner computes logits only from the first response target on; on every masked
    # position the values must equal a plain full-logit log-softmax.
    cfg = config("reinforce")
    groups = sampled_groups(behaviour_seed=0)
    model, tokenizer = tiny_model(0)
    batch = build_batch(groups, cfg.learner.loss.advantage, tokenizer.pad_token_id, seed=0)
    with torch.no_grad():
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        full = torch.log_softmax(full[:, :-1].float() / 0.9, dim=-1)
        expected = full.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        got = response_logprobs(model, batch, 0.9)
    mask = batch.response_mask.bool()
    assert got.shape == expected.shape
    assert bool(mask[:, 0].logical_not().all())  # prompts exist, so trimming really happens
    torch.testing.assert_close(got[mask], expected[mask], rtol=0, atol=1e-5)


class _FixedLogits(torch.nn.Module):
    """A stand-in for the model's forward only: every position gets the same logits, so the
    entropy below can be worked out by hand (the part under test is the entropy arithmetic)."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.logits = torch.tensor(logits)

    def forward(self, input_ids, attention_mask, logits_to_keep):
        n = input_ids.shape[0]
        return type("Out", (), {"logits": self.logits.expand(n, logits_to_keep, -1).clone()})


def test_response_entropy_by_hand():
    # logits (0, 0, 2 ln 2) at temperature 2 are (0, 0, ln 2): p = (1/4, 1/4, 1/2), so
    # H = 2 * (1/4) ln 4 + (1/2) ln 2 = (1/2)(2 ln 2) + (1/2) ln 2 = 1.5 ln 2 = 1.03972
    # and log p of token 2 = ln(1/2) = -0.69315.
    model = _FixedLogits([0.0, 0.0, 2 * math.log(2)])
    ids = torch.tensor([[1, 0, 2, 2]])  # a prompt of two tokens, a response of two
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=torch.tensor([[False, True, True]]),  # targets 1..3: response's 2, 2
        behavior_logp=torch.zeros(1, 3),
        advantages=torch.zeros(1),
        group_index=torch.zeros(1, dtype=torch.long),
        policy_versions=[0],
    )
    logp, entropy = response_logprobs_entropy(model, batch, 2.0)
    torch.testing.assert_close(entropy[0, 1:], torch.full((2,), 1.5 * math.log(2)))
    torch.testing.assert_close(logp[0, 1:], torch.full((2,), math.log(0.5)))
    assert float(entropy[0, 0]) == 0.0  # a prompt position: never computed
    torch.testing.assert_close(logp, response_logprobs(model, batch, 2.0))

    # a fourth token at -inf (masked out) has p = 0: the same H, and a finite gradient
    masked = _FixedLogits([0.0, 0.0, 2 * math.log(2), -math.inf])
    masked.logits.requires_grad_(True)
    _, h = response_logprobs_entropy(masked, batch, 2.0)
    torch.testing.assert_close(h[0, 1:], torch.full((2,), 1.5 * math.log(2)))
    h[0, 1:].sum().backward()
    assert bool(torch.isfinite(masked.logits.grad).all())


def test_entropy_bonus_is_the_exact_entropy_with_its_gradient():
    # learner.loss.entropy_coef > 0 used to be accepted and then fail the first step (the
    # learner never passed the entropy to the loss). The step's loss must be the policy loss
    # minus 0.5 x the token-mean entropy, with H computed here independently of the learner
    # (torch.distributions), and the update must follow that loss's gradient.
    cfg = parse_config(
        "model: {preset: tiny}\nrollout: {temperature: 0.9}\n"
        "learner: {optimizer: {lr: 1.0e-3, grad_clip: null}, "
        "loss: {name: rec-oneside-is, entropy_coef: 0.5}}\n"
    )
    groups = sampled_groups(behaviour_seed=1)
    reference, tokenizer = tiny_model(0)
    learner = new_learner(cfg)
    batch = build_batch(groups, cfg.learner.loss.advantage, tokenizer.pad_token_id, seed=0)
    logp = response_logprobs(reference, batch, 0.9)
    logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    h = torch.distributions.Categorical(logits=logits[:, :-1].float() / 0.9).entropy()
    mask = batch.response_mask.float()
    mean_h = (h * mask).sum() / mask.sum()
    pg = get_loss("rec-oneside-is")(
        LossInputs(logp, batch.behavior_logp, batch.advantages, batch.response_mask)
    )
    total = pg.loss - 0.5 * mean_h
    total.backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))

    metrics = learner.step(groups)
    assert float(mean_h.detach()) > 0.1  # the term is not negligible next to the policy loss
    assert metrics["loss"] == pytest.approx(float(total.detach()), rel=1e-5)
    assert metrics["entropy"] == pytest.approx(float(mean_h.detach()), rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(float(ref_norm), rel=1e-4)


def test_a_step_whose_gradient_is_not_finite_is_skipped_and_the_next_one_trains():
    # RED-Weight at T = 0.005: exp(A / T) = exp(200) overflows float32, the loss is inf and
    # the gradient NaN. Applied, it made the weights NaN, and Adam's moments with them for
    # good (a later normal step brought the NaN back).
    from staleflow.learner.losses import loss_from_config

    groups = sampled_groups(behaviour_seed=1, n=2)
    cfg = parse_config(
        "model: {preset: tiny}\nrollout: {temperature: 0.9}\nlearner: {optimizer: {lr: 1.0e-3}, "
        "loss: {name: red-weight, weight_temperature: 0.005}}\n"
    )
    learner = new_learner(cfg)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    metrics = learner.step(g for g in groups)  # a generator: read twice, it trained, then failed
    assert metrics["skipped_steps"] == 1
    assert not math.isfinite(metrics["grad_norm"])
    assert learner.version == 1  # the step happened; its update did not
    for n, p in learner.model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    learner.loss_fn = loss_from_config(config("red-weight").learner.loss)  # T = 1
    metrics = learner.step(groups)
    assert metrics["skipped_steps"] == 0
    assert math.isfinite(metrics["grad_norm"])
    moved = [
        (p.detach() - before[n]).abs().max().item() for n, p in learner.model.named_parameters()
    ]
    assert all(math.isfinite(m) for m in moved)
    assert max(moved) > 0


def test_huge_rewards_give_finite_normalised_advantages():
    # rewards were cast to float32 before the advantages: 1e39 was inf, its advantage NaN.
    # Normalised by the group's std (grpo), they are +-1: (1e39 - 5e38) / 5e38 and its
    # negative. (Unnormalised, 5e38 exceeds float32 itself: such a step is skipped, above.)
    cfg = config("grpo")
    groups = sampled_groups(n=1, k=2)
    g = groups[0]
    big = dataclasses_replace_rewards(g, [1e39, 0.0])
    batch = build_batch([big], cfg.learner.loss.advantage, 0, seed=0)
    torch.testing.assert_close(batch.advantages, torch.tensor([1.0, -1.0]))


def dataclasses_replace_rewards(group: Group, rewards: list[float]) -> Group:
    return Group.new(
        run_id=group.run_id, prompt_id=group.prompt_id, task=group.task,
        prompt_token_ids=list(group.prompt_token_ids), worker_id=group.worker_id,
        policy_version=group.policy_version,
        responses=[Response(list(r.token_ids), list(r.behavior_logp), reward, r.finish_reason)
                   for r, reward in zip(group.responses, rewards, strict=True)],
    )  # fmt: skip


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bfloat16_under_zero_sums_micro_batch_gradients_in_fp32(stage, tmp_path):
    # DeepSpeed sums micro-batches' gradients in the model's dtype unless told otherwise: in
    # bf16 (8 bits of mantissa) for the paper config (bf16, ZeRO 2, micro_batch_size 4).
    # ZeRO 1 then takes DeepSpeed's BF16_Optimizer (fp32 accumulation), ZeRO 2-3 keep their
    # optimizer with fp32 accumulation buffers; a checkpoint round trip trains on the same.
    cfg = parse_config(
        f"model: {{preset: tiny, dtype: bfloat16}}\nlearner: {{zero_stage: {stage}, "
        "micro_batch_size: 2, optimizer: {lr: 1.0e-3}}\n"
    )
    learner = Learner(cfg)
    optimizer = learner.engine.optimizer
    if stage == 1:
        assert type(optimizer).__name__ == "BF16_Optimizer"
    else:
        assert optimizer.gradient_accumulation_dtype == torch.float32
    learner.step(sampled_groups(behaviour_seed=1))
    learner.save(tmp_path / "ckpt", {"step": 1})
    resumed = Learner(cfg)
    resumed.load(tmp_path / "ckpt")
    a = learner.step(sampled_groups(behaviour_seed=2))
    b = resumed.step(sampled_groups(behaviour_seed=2))
    assert a["loss"] == b["loss"]
    for (name, p), q in zip(learner.model.state_dict().items(),
                            resumed.model.state_dict().values(), strict=True):  # fmt: skip
        assert torch.equal(p, q), name
