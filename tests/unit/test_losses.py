"""Loss presets on small tensors, with expected values computed by hand.

The shared batch (see `batch()`): two sequences of three positions; the last position of the
second sequence is padding. logp is chosen to be round, and behaviour log-probs are set to
logp - ln(rho) so that the ratio rho = exp(logp - blogp) takes round values:

    token  seq  A    rho   logp
    a      0   +1   0.25   -1.0
    b      0   +1   1.0    -2.0
    c      0   +1   4.0    -0.5
    d      1   -1   0.5    -1.0
    e      1   -1   2.0    -2.0
    (pad)  1   -1   -      -      mask 0

Five valid tokens, so token-mean divides by 5. The REC loss per token is
l = -W * M * logp + R, with W = A (no IS) or A * rho (IS).
"""

from __future__ import annotations

import math

import pytest
import torch

from staleflow.learner.losses import (
    PRESETS,
    LossInputs,
    aggregate,
    get_loss,
    loss_denominator,
)

RHO = [[0.25, 1.0, 4.0], [0.5, 2.0, 1.0]]
LOGP = [[-1.0, -2.0, -0.5], [-1.0, -2.0, -3.0]]
MASK = [[True, True, True], [True, True, False]]
ADV = [1.0, -1.0]


def batch(**changes: object) -> LossInputs:
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    blogp = logp.detach() - torch.log(torch.tensor(RHO, dtype=torch.float64))
    fields: dict[str, object] = {
        "logp": logp,
        "behavior_logp": blogp,
        "advantages": torch.tensor(ADV, dtype=torch.float64),
        "mask": torch.tensor(MASK),
    }
    fields.update(changes)
    return LossInputs(**fields)  # type: ignore[arg-type]


def run(name: str, inputs: LossInputs | None = None, **params: object) -> tuple[float, dict]:
    out = get_loss(name, **params)(inputs or batch())
    return float(out.loss.detach()), {k: float(v) for k, v in out.metrics.items()}


def assert_values(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


# ----------------------------------------------------------------------------- values


def test_reinforce_value():
    # l = -A * logp: a 1, b 2, c 0.5, d -1, e -2; sum 0.5; / 5 tokens = 0.1
    loss, m = run("reinforce")
    assert loss == pytest.approx(0.1)
    assert m["clip_frac"] == 0.0


def test_rec_oneside_nois_value():
    # clip band [0.8, 1.2]. M = (A>=0 and rho<=1.2) or (A<=0 and rho>=0.8):
    # a 1 (0.25<=1.2), b 1, c 0 (4>1.2, A>0), d 0 (0.5<0.8, A<0), e 1 (2>=0.8, A<0)
    # l = -A*M*logp: a 1 + b 2 + e -2 = 1; / 5 = 0.2; clip_frac = 2/5
    loss, m = run("rec-oneside-nois")
    assert loss == pytest.approx(0.2)
    assert m["clip_frac"] == pytest.approx(0.4)


def test_rec_oneside_nois_wide_clip_value():
    # (0.6, 2.0): band [0.4, 3.0]. M: a 1, b 1, c 0 (4>3), d 1 (0.5>=0.4), e 1
    # l: a 1 + b 2 + d -1 + e -2 = 0; clip_frac = 1/5
    loss, m = run("rec-oneside-nois", epsilon_low=0.6, epsilon_high=2.0)
    assert loss == pytest.approx(0.0)
    assert m["clip_frac"] == pytest.approx(0.2)


@pytest.mark.parametrize("name", ["rec-oneside-is", "grpo"])
def test_rec_oneside_is_value(name):
    # same M as one-side NoIS (a, b, e kept); W = A*rho:
    # a -(1*0.25)(-1) = 0.25, b -(1*1)(-2) = 2, e -(-1*2)(-2) = -4; sum -1.75; / 5 = -0.35
    # (grpo's std-normalisation lives in the advantages, not the loss)
    loss, m = run(name)
    assert loss == pytest.approx(-0.35)
    assert m["clip_frac"] == pytest.approx(0.4)


def test_truncated_is_value():
    # is_truncation 1.5 caps e's weight: W_e = -1 * min(2, 1.5) = -1.5, l_e = -(-1.5)(-2) = -3
    # a 0.25 + b 2 + e -3 = -0.75; / 5 = -0.15
    loss, _ = run("rec-oneside-is", is_truncation=1.5)
    assert loss == pytest.approx(-0.15)


@pytest.mark.parametrize(("name", "expected"), [("rec-twoside-nois", 0.4), ("rec-twoside-is", 0.4)])
def test_rec_twoside_value(name, expected):
    # band [0.8, 1.2] whatever the sign of A: only b (rho 1) kept; l_b = -(1*1)(-2) = 2; / 5
    loss, m = run(name)
    assert loss == pytest.approx(expected)
    assert m["clip_frac"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("name", "expected"), [("rec-twoside-nois", -0.2), ("rec-twoside-is", -0.5)]
)
def test_rec_twoside_wide_clip_value(name, expected):
    # (0.6, 2.0): band [0.4, 3.0] whatever the sign of A: a no (0.25), b yes, c no (4), d yes
    # (0.5), e yes (2). The band above keeps only b, whose rho is 1: IS and NoIS agree there.
    # NoIS: b -(1)(-2) = 2, d -(-1)(-1) = -1, e -(-1)(-2) = -2; sum -1; / 5 = -0.2
    # IS (W = A*rho): b 2, d -(-1*0.5)(-1) = -0.5, e -(-1*2)(-2) = -4; sum -2.5; / 5 = -0.5
    loss, m = run(name, epsilon_low=0.6, epsilon_high=2.0)
    assert loss == pytest.approx(expected)
    assert m["clip_frac"] == pytest.approx(0.4)


@pytest.mark.parametrize(("name", "expected"), [("rec-ring-nois", 0.6), ("rec-ring-is", 0.45)])
def test_rec_ring_value(name, expected):
    # inner [0.8, 1.2], outer: (A>=0 and rho<=0.4) or (A<=0 and rho>=3.0)
    # a kept (A>0, 0.25<=0.4), b kept (inner), c no (A>0, 4), d no (A<0, 0.5), e no (A<0, 2<3)
    # NoIS: a 1 + b 2 = 3 -> 0.6;  IS: a 0.25 + b 2 = 2.25 -> 0.45;  clip_frac 3/5
    loss, m = run(name)
    assert loss == pytest.approx(expected)
    assert m["clip_frac"] == pytest.approx(0.6)


def test_rec_ring_outer_high_region():
    # epsilon_high_prime 0.9: outer high bound 1.9, so e (A<0, rho 2 >= 1.9) is kept too
    # a 1 + b 2 + e -2 = 1 -> 0.2
    loss, _ = run("rec-ring-nois", epsilon_high_prime=0.9)
    assert loss == pytest.approx(0.2)


def test_opmd_value():
    # REINFORCE part 0.5 (see reinforce). R = 0.1 * (logp - blogp)^2 = 0.1 * ln(rho)^2:
    # ln rho = -2ln2, 0, 2ln2, -ln2, ln2 -> squares sum (4+0+4+1+1)(ln2)^2 = 10 (ln2)^2
    # R total = (ln2)^2 = 0.480453; loss = (0.5 + 0.480453) / 5 = 0.196091
    loss, m = run("opmd")
    assert loss == pytest.approx((0.5 + math.log(2) ** 2) / 5)
    assert m["regularizer"] == pytest.approx(math.log(2) ** 2 / 5)


def test_asymre_value():
    # R = -0.1 * logp; sum logp = -1 -2 -0.5 -1 -2 = -6.5 -> R total 0.65
    # loss = (0.5 + 0.65) / 5 = 0.23
    loss, _ = run("asymre")
    assert loss == pytest.approx(0.23)


def test_red_drop_loss_is_reinforce():
    # RED-Drop changes the advantages (see test_advantages), not the per-token loss
    assert run("red-drop")[0] == pytest.approx(run("reinforce")[0])


def test_red_weight_value():
    # W = A * exp(A / 1): +e for A = +1, -1/e for A = -1; l = -W * logp
    # seq 0: e * (1 + 2 + 0.5) = 3.5e;  seq 1: -(1/e) * (1 + 2) = -3/e
    # (3.5 * 2.718282 - 3 * 0.367879) / 5 = (9.513986 - 1.103638) / 5 = 1.682070
    loss, _ = run("red-weight")
    assert loss == pytest.approx((3.5 * math.e - 3 / math.e) / 5)


def test_red_weight_temperature():
    # T = 2: W = A * exp(A/2); seq 0: 3.5 e^0.5, seq 1: -3 e^-0.5
    loss, _ = run("red-weight", weight_temperature=2.0)
    assert loss == pytest.approx((3.5 * math.exp(0.5) - 3 * math.exp(-0.5)) / 5)


def test_ppo_value():
    # l = max(-A rho, -A clip(rho, 0.8, 1.2)):
    # a max(-0.25, -0.8) = -0.25; b -1; c max(-4, -1.2) = -1.2
    # d max(0.5, 0.8) = 0.8; e max(2, 1.2) = 2, dual clip min(2, 3*1) = 2 (rho 2 < 3)
    # sum 0.35; / 5 = 0.07; clipped (no gradient): c (A>0, rho>1.2), d (A<0, rho<0.8) -> 0.4
    loss, m = run("ppo")
    assert loss == pytest.approx(0.07)
    assert m["clip_frac"] == pytest.approx(0.4)
    assert m["dual_clip_frac"] == 0.0


def test_ppo_dual_clip_value():
    # dual_clip 1.5: e's loss min(2, 1.5 * 1) = 1.5; sum 0.35 - 0.5 = -0.15; / 5 = -0.03
    loss, m = run("ppo", dual_clip=1.5)
    assert loss == pytest.approx(-0.03)
    assert m["dual_clip_frac"] == pytest.approx(0.2)
    assert m["clip_frac"] == pytest.approx(0.6)  # c, d and the dual-clipped e


def test_cispo_value():
    # defaults (1.0, 0.28): weight sg(clip(rho, 0, 1.28)): a 0.25, b 1, c 1.28, d 0.5, e 1.28
    # l = -A * w * logp: a 0.25, b 2, c 0.64, d -0.5, e -2.56; sum -0.17; / 5 = -0.034
    loss, m = run("cispo")
    assert loss == pytest.approx(-0.034)
    assert m["clip_frac"] == pytest.approx(0.4)  # c and e truncated


def test_gspo_uses_the_sequence_ratio():
    # On the shared batch every sequence's geometric-mean ratio is 1:
    # seq 0 exp((ln .25 + 0 + ln 4)/3) = 1, seq 1 exp((ln .5 + ln 2)/2) = 1, although token
    # ratios range 0.25..4. l = -A per token; seq-mean-token-mean: (-1 + 1) / 2 = 0, no clip.
    loss, m = run("gspo")
    assert loss == pytest.approx(0.0)
    assert m["clip_frac"] == 0.0
    assert m["seq_ratio_mean"] == pytest.approx(1.0)


def test_gspo_clips_whole_sequences():
    # seq 0: A +1, log-ratios (0.1, 0.3) -> s = e^0.2 = 1.2214 > 1 + 4e-4: clipped, loss -1.0004
    # seq 1: A -1, log-ratios (-0.1, 0.1) -> s = 1: loss +1; d s / d logp_t = s * (1/2)
    # seq-mean-token-mean: (-1.0004 + 1) / 2 = -0.0002
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    blogp = logp.detach() - torch.tensor([[0.1, 0.3], [-0.1, 0.1]], dtype=torch.float64)
    out = get_loss("gspo")(
        LossInputs(logp, blogp, torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 2))
    )
    assert float(out.loss.detach()) == pytest.approx(-0.0002)
    out.loss.backward()
    # seq 1 enters the mean with weight 1/2: d/dlogp_t [(1/2) * (-A) * s] = (1/2)(1)(1)(1/2)
    assert_values(logp.grad, [[0.0, 0.0], [0.25, 0.25]])
    assert float(out.metrics["clip_frac"]) == pytest.approx(0.5)


def test_ratio_and_kl_metrics():
    # ratios 0.25, 1, 4, 0.5, 2 -> mean 7.75 / 5 = 1.55, min 0.25, max 4
    _, m = run("reinforce")
    assert m["ratio_mean"] == pytest.approx(1.55)
    assert (m["ratio_min"], m["ratio_max"]) == pytest.approx((0.25, 4.0))
    # approx_kl = mean(blogp - logp); with blogp = logp + 0.5 everywhere it is 0.5
    logp = torch.full((2, 3), -1.0)
    _, m2 = run("reinforce", LossInputs(logp, logp + 0.5, torch.ones(2), torch.ones(2, 3)))
    assert m2["approx_kl"] == pytest.approx(0.5)
    # advantage stats over the 5 valid tokens: three +1, two -1 -> mean 0.2
    assert m["adv_mean"] == pytest.approx(0.2)
    assert m["adv_std"] == pytest.approx(math.sqrt(1 - 0.2**2))
    assert m["num_tokens"] == 5


# ----------------------------------------------------------------------------- KL, entropy


@pytest.mark.parametrize(
    ("estimator", "per_token"),
    [
        ("k1", 0.1),  # logp - ref = 0.1
        ("k2", 0.005),  # 0.5 * 0.1^2
        ("k3", math.exp(-0.1) + 0.1 - 1),  # exp(ref - logp) - (ref - logp) - 1 = 0.0048374
    ],
)
def test_reference_kl_penalty(estimator, per_token):
    # ref_logp = logp - 0.1 on every token; loss = 0.1 (reinforce) + 0.5 * per_token
    inputs = batch()
    inputs = batch(ref_logp=inputs.logp.detach() - 0.1)
    loss, m = run("reinforce", inputs, kl_coef=0.5, kl_estimator=estimator)
    assert loss == pytest.approx(0.1 + 0.5 * per_token)
    assert m["kl_ref"] == pytest.approx(per_token)


def test_kl_without_reference_is_an_error():
    with pytest.raises(ValueError, match="ref_logp"):
        run("reinforce", kl_coef=0.1)


def test_entropy_bonus():
    # entropy 2.0 on every token, coefficient 0.01: 0.1 - 0.01 * 2 = 0.08
    loss, m = run("reinforce", batch(entropy=torch.full((2, 3), 2.0)), entropy_coef=0.01)
    assert loss == pytest.approx(0.08)
    assert m["entropy"] == pytest.approx(2.0)


# ----------------------------------------------------------------------------- aggregation


def test_aggregation_modes():
    # reinforce per-token losses: seq 0 (1, 2, 0.5) sum 3.5 over 3 tokens; seq 1 (-1, -2)
    # sum -3 over 2 tokens.
    # seq-mean-token-mean: (3.5/3 + -3/2) / 2 = (1.166667 - 1.5) / 2 = -0.166667
    # seq-mean-token-sum:  (3.5 + -3) / 2 = 0.25
    assert run("reinforce", loss_agg_mode="seq-mean-token-mean")[0] == pytest.approx(
        (3.5 / 3 - 1.5) / 2
    )
    assert run("reinforce", loss_agg_mode="seq-mean-token-sum")[0] == pytest.approx(0.25)


def test_aggregate_skips_empty_sequences():
    # the second sequence has no valid token: it neither counts nor produces NaN
    token_loss = torch.tensor([[1.0, 3.0], [float("nan"), 5.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert float(aggregate(token_loss, mask, "seq-mean-token-mean")) == pytest.approx(2.0)
    assert float(aggregate(token_loss, mask, "seq-mean-token-sum")) == pytest.approx(4.0)
    assert float(aggregate(token_loss, mask, "token-mean")) == pytest.approx(2.0)


def _random_batch(seed: int, b: int = 6, t: int = 7) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 3).requires_grad_()
    blogp = logp.detach() + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return LossInputs(logp, blogp, adv, mask)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_add_up_to_the_whole_batch(name, mode):
    whole = _random_batch(seed=3)
    fn = get_loss(name, loss_agg_mode=mode)
    full = fn(whole)
    full.loss.backward()
    full_grad = whole.logp.grad.clone()

    logp = whole.logp.detach().clone().requires_grad_()
    den = loss_denominator(whole.mask, mode)
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 2), slice(2, 6)):
        part = LossInputs(
            logp[rows], whole.behavior_logp[rows], whole.advantages[rows], whole.mask[rows],
            denominator=den,
        )  # fmt: skip
        out = fn(part)
        out.loss.backward()
        total = total + out.loss.detach()
    assert float(total) == pytest.approx(float(full.loss.detach()), abs=1e-12)
    torch.testing.assert_close(logp.grad, full_grad)


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("name", PRESETS)
def test_gradient_reaches_only_logp(name):
    inputs = batch()
    blogp = inputs.behavior_logp.clone().requires_grad_()
    adv = inputs.advantages.clone().requires_grad_()
    out = get_loss(name)(batch(behavior_logp=blogp, advantages=adv))
    out.loss.backward()
    assert blogp.grad is None
    assert adv.grad is None
    assert all(not v.requires_grad for v in out.metrics.values())


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # d loss / d logp = -W * M / 5 (W, M detached); padding 0
        # rec-oneside-is: a -(0.25)/5, b -(1)/5, c 0, d 0, e -(-1*2)/5
        ("rec-oneside-is", [[-0.05, -0.2, 0.0], [0.0, 0.4, 0.0]]),
        # rec-oneside-nois: a -1/5, b -1/5, e +1/5
        ("rec-oneside-nois", [[-0.2, -0.2, 0.0], [0.0, 0.2, 0.0]]),
        # opmd: -A/5 + 0.1 * 2 * (logp - blogp)/5 = -A/5 + 0.04 ln(rho)
        (
            "opmd",
            [
                [-0.2 + 0.04 * math.log(0.25), -0.2, -0.2 + 0.04 * math.log(4)],
                [0.2 + 0.04 * math.log(0.5), 0.2 + 0.04 * math.log(2), 0.0],
            ],
        ),
        # cispo: -A * clip(rho, 0, 1.28) / 5: a -0.05, b -0.2, c -0.256, d 0.1, e 0.256
        ("cispo", [[-0.05, -0.2, -0.256], [0.1, 0.256, 0.0]]),
    ],
)
def test_gradient_values(name, expected):
    inputs = batch()
    get_loss(name)(inputs).loss.backward()
    assert_values(inputs.logp.grad, expected)


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.6, 2.0)])
def test_rec_oneside_is_has_the_gradient_of_ppo_without_dual_clip(eps):
    low, high = eps
    for seed in range(5):
        a, b = _random_batch(seed, b=16, t=9), _random_batch(seed, b=16, t=9)
        get_loss("rec-oneside-is", epsilon_low=low, epsilon_high=high)(a).loss.backward()
        get_loss("ppo", epsilon_low=low, epsilon_high=high, dual_clip=None)(b).loss.backward()
        torch.testing.assert_close(a.logp.grad, b.logp.grad)
        assert a.logp.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("name", PRESETS)
def test_all_zero_mask_gives_zero_loss_and_zero_gradient(name):
    inputs = batch(mask=torch.zeros(2, 3, dtype=torch.bool))
    out = get_loss(name)(inputs)
    assert float(out.loss.detach()) == 0.0
    out.loss.backward()
    assert torch.equal(inputs.logp.grad, torch.zeros(2, 3, dtype=torch.float64))
    assert all(math.isfinite(float(v)) for v in out.metrics.values())


@pytest.mark.parametrize("name", PRESETS)
def test_garbage_in_padding_does_not_leak(name):
    clean = get_loss(name)(batch())
    logp = torch.tensor(LOGP, dtype=torch.float64)
    logp[1, 2] = float("nan")
    logp.requires_grad_()
    blogp = batch().behavior_logp.clone()
    blogp[1, 2] = float("inf")
    dirty = batch(logp=logp, behavior_logp=blogp)
    out = get_loss(name)(dirty)
    assert float(out.loss.detach()) == pytest.approx(float(clean.loss.detach()))
    out.loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_float_mask_and_per_token_advantages_match_bool_and_per_sequence():
    expected = run("rec-oneside-is")[0]
    as_float = batch(mask=torch.tensor(MASK, dtype=torch.float64))
    per_token = batch(advantages=torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64))
    assert run("rec-oneside-is", as_float)[0] == pytest.approx(expected)
    assert run("rec-oneside-is", per_token)[0] == pytest.approx(expected)


@pytest.mark.parametrize("name", PRESETS)
def test_no_host_sync_inside_a_loss(name):
    # On the meta device a tensor has no data: .item(), bool(tensor) or any data-dependent
    # branch raises, so passing here shows the loss never waits on the device.
    b, t = 3, 4
    x = LossInputs(
        logp=torch.empty(b, t, device="meta", requires_grad=True),
        behavior_logp=torch.empty(b, t, device="meta"),
        advantages=torch.empty(b, device="meta"),
        mask=torch.empty(b, t, dtype=torch.bool, device="meta"),
    )
    out = get_loss(name)(x)
    assert out.loss.shape == ()
    assert out.loss.device.type == "meta"


# ----------------------------------------------------------------------------- bad input


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid presets: reinforce, grpo") as err:
        get_loss("rec-oneside")
    assert all(name in str(err.value) for name in PRESETS)


def test_unknown_parameter_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"no parameter 'epsilon_low_prime'.*epsilon_high"):
        get_loss("rec-oneside-nois", epsilon_low_prime=0.5)
    with pytest.raises(ValueError, match="dual_clip"):
        get_loss("grpo", dual_clip=3.0)  # dual_clip is ppo's only
    with pytest.raises(ValueError, match="valid parameters"):
        get_loss("grpo", advantage={"std_normalize": False})


def test_out_of_range_parameter_is_an_error():
    with pytest.raises(ValueError, match="epsilon_low"):
        get_loss("rec-oneside-is", epsilon_low=1.5)
    with pytest.raises(ValueError, match="epsilon_high_prime"):
        get_loss("rec-ring-nois", epsilon_high=3.0, epsilon_high_prime=2.0)


def test_shape_mismatches_name_the_shapes():
    with pytest.raises(ValueError, match=r"behavior_logp has shape \(2, 4\).*\(2, 3\)"):
        run("reinforce", batch(behavior_logp=torch.zeros(2, 4)))
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
        run("reinforce", batch(advantages=torch.zeros(3)))
    with pytest.raises(ValueError, match=r"logp must be \[B, T\]"):
        run("reinforce", batch(logp=torch.zeros(6)))


def test_defaults_follow_the_paper_table():
    ring = get_loss("rec-ring-is").config
    assert (ring.epsilon_low, ring.epsilon_high) == (0.2, 0.2)
    assert (ring.epsilon_low_prime, ring.epsilon_high_prime) == (0.6, 2.0)
    assert get_loss("opmd").config.regularizer_coef == 0.1
    assert get_loss("asymre").config.regularizer_coef == 0.1
    assert get_loss("red-weight").config.weight_temperature == 1.0
    assert get_loss("ppo").config.dual_clip == 3.0
    gspo = get_loss("gspo").config
    assert (gspo.epsilon_low, gspo.epsilon_high, gspo.loss_agg_mode) == (
        3e-4,
        4e-4,
        "seq-mean-token-mean",
    )
    assert get_loss("grpo").config.advantage.std_normalize is True
    assert get_loss("red-drop").config.advantage.drop == "balance"
    assert get_loss("rec-oneside-nois").config.advantage.std_normalize is False


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("advantage", [1.0, 0.0, -1.0])
def test_a_behaviour_log_prob_far_below_the_policys_gives_no_nan(name, advantage):
    # An engine's -9999 for a token it deems impossible: rho = exp(-0.5 + 9999) was inf in
    # float32, and inf times a zero mask or advantage NaN (loss and gradients): grpo, the IS
    # presets and ppo (whose loss stayed finite while its gradient was NaN) broke the weights.
    logp = torch.tensor([[-0.5, -0.5]], requires_grad=True)
    inputs = LossInputs(
        logp=logp,
        behavior_logp=torch.tensor([[-9999.0, -0.5]]),
        advantages=torch.tensor([advantage]),
        mask=torch.ones(1, 2, dtype=torch.bool),
    )
    out = get_loss(name)(inputs)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.isfinite(logp.grad).all(), logp.grad


def test_a_far_off_policy_token_is_clipped_as_any_other_ratio_above_the_bound():
    # the same two tokens at A = +1 (token-mean over 2). rec-oneside-is: token 1's ratio is
    # counted as e^20, above 1 + 0.2, so M = 0; token 2: rho 1, W = 1, l = -1 * -0.5 = 0.5.
    # loss = (0 + 0.5) / 2 = 0.25; d loss / d logp = (0, -W / 2) = (0, -0.5).
    # ppo: token 1 max(-e^20, -1.2) = -1.2 (the clipped branch, no gradient); token 2
    # max(-1, -1) = -1 with d/dlogp = -rho = -1. loss = (-1.2 - 1) / 2 = -1.1; grad (0, -0.5).
    for name, loss in (("rec-oneside-is", 0.25), ("ppo", -1.1)):
        logp = torch.tensor([[-0.5, -0.5]], dtype=torch.float64, requires_grad=True)
        out = get_loss(name)(LossInputs(
            logp=logp, behavior_logp=torch.tensor([[-9999.0, -0.5]], dtype=torch.float64),
            advantages=torch.tensor([1.0], dtype=torch.float64),
            mask=torch.ones(1, 2, dtype=torch.bool),
        ))  # fmt: skip
        out.loss.backward()
        assert float(out.loss.detach()) == pytest.approx(loss)
        assert_values(logp.grad, [[0.0, -0.5]])
