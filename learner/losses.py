"""The REC / OPMD family of policy losses (docs/algorithms.md sections 2-5).

    from staleflow.learner.losses import LossInputs, get_loss
    fn = get_loss("rec-oneside-nois", epsilon_low=0.6, epsilon_high=2.0)
    out = fn(LossInputs(logp=..., behavior_logp=..., advantages=..., mask=...))
    out.loss.backward(); out.metrics["clip_frac"]

Every loss is a pure function of tensors plus a frozen preset config (staleflow.configs.losses,
the single source of truth for parameters and defaults): no `.item()`, no host sync, no I/O.

The REC presets share one per-token formula, l = -W(A, rho) * logp * M(A, rho) + R(logp, blogp),
where rho = exp(logp - blogp) and both W and M are detached; ppo, gspo and cispo have their own.
Tokens outside the mask never contribute, not even NaN or inf values sitting in padding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import ValidationError
from torch import Tensor

from staleflow.configs.losses import LOSS_PRESETS, LossAggMode, LossPreset

__all__ = [
    "PRESETS",
    "Loss",
    "LossInputs",
    "LossOutputs",
    "aggregate",
    "get_loss",
    "loss_denominator",
    "loss_from_config",
]

PRESETS: tuple[str, ...] = tuple(LOSS_PRESETS)
"""Every preset name get_loss accepts."""

ClipMode = Literal["none", "one-side", "two-side", "ring"]
WeightMode = Literal["none", "importance_sampling", "advantage"]
RegMode = Literal["none", "k2", "forward-kl"]

# The REC presets as (clip mask M, weight W, regulariser R); docs/algorithms.md section 5.
REC_PRESETS: dict[str, tuple[ClipMode, WeightMode, RegMode]] = {
    "reinforce": ("none", "none", "none"),
    "grpo": ("one-side", "importance_sampling", "none"),
    "rec-oneside-is": ("one-side", "importance_sampling", "none"),
    "rec-oneside-nois": ("one-side", "none", "none"),
    "rec-twoside-is": ("two-side", "importance_sampling", "none"),
    "rec-twoside-nois": ("two-side", "none", "none"),
    "rec-ring-is": ("ring", "importance_sampling", "none"),
    "rec-ring-nois": ("ring", "none", "none"),
    "opmd": ("none", "none", "k2"),
    "asymre": ("none", "none", "forward-kl"),
    "red-drop": ("none", "none", "none"),
    "red-weight": ("none", "advantage", "none"),
}


@dataclass(frozen=True)
class LossInputs:
    """Tensors of one (micro-)batch of B sequences padded to T tokens.

    logp:          [B, T] float, log pi_theta of each taken token at the sampling temperature;
                   the only input that carries gradient (with `entropy`).
    behavior_logp: [B, T] float, the log-prob the rollout engine sampled the token with.
    advantages:    [B] per sequence (broadcast over its tokens) or [B, T] per token.
    mask:          [B, T] bool or float; nonzero on generated response tokens (float = weight).
    ref_logp:      [B, T] float, optional; a frozen reference model's log-probs (kl_coef > 0).
    entropy:       [B, T] float, optional; per-token policy entropy (entropy_coef > 0).
    denominator:   optional; the aggregation's denominator over the *whole* batch when this call
                   sees one micro-batch (see `loss_denominator`), so that the losses of the
                   micro-batches add up to the whole batch's loss. None: this call's own.
    """

    logp: Tensor
    behavior_logp: Tensor
    advantages: Tensor
    mask: Tensor
    ref_logp: Tensor | None = None
    entropy: Tensor | None = None
    denominator: Tensor | float | None = None


@dataclass(frozen=True)
class LossOutputs:
    """The scalar loss (differentiable w.r.t. logp) and detached scalar tensor metrics."""

    loss: Tensor
    metrics: dict[str, Tensor]


@dataclass(frozen=True)
class _Tokens:
    """Inputs after checking and sanitising: padding holds zeros, so nothing leaks from it."""

    logp: Tensor  # [B, T], grad
    blogp: Tensor  # [B, T]
    adv: Tensor  # [B, T], detached
    weight: Tensor  # [B, T] float mask
    valid: Tensor  # [B, T] bool
    rho: Tensor  # [B, T], detached exp(logp - blogp)


# A policy term returns the per-token loss and a bool tensor marking tokens whose gradient
# was clipped away (1 - M), plus any metrics of its own.
PolicyTerm = tuple[Tensor, Tensor, dict[str, Tensor]]


@dataclass(frozen=True)
class Loss:
    """A loss preset bound to its frozen config; call it on `LossInputs`."""

    config: LossPreset

    @property
    def name(self) -> str:
        return str(getattr(self.config, "name"))  # noqa: B009 (every preset has it)

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        cfg = self.config
        x = _prepare(inputs)
        if self.name in REC_PRESETS:
            token_loss, clipped, metrics = _rec_term(x, cfg, *REC_PRESETS[self.name])
        else:
            token_loss, clipped, metrics = _OTHER_TERMS[self.name](x, cfg)
        if cfg.kl_coef > 0:
            if inputs.ref_logp is None:
                raise ValueError(f"{self.name}: kl_coef={cfg.kl_coef} needs LossInputs.ref_logp")
            ref = torch.where(x.valid, inputs.ref_logp.detach(), x.logp.detach())
            kl = _kl(x.logp, ref, cfg.kl_estimator)
            token_loss = token_loss + cfg.kl_coef * kl
            metrics["kl_ref"] = _masked_mean(kl.detach(), x.valid)
        if cfg.entropy_coef > 0:
            if inputs.entropy is None:
                raise ValueError(
                    f"{self.name}: entropy_coef={cfg.entropy_coef} needs LossInputs.entropy"
                )
            entropy = torch.where(x.valid, inputs.entropy, torch.zeros_like(inputs.entropy))
            token_loss = token_loss - cfg.entropy_coef * entropy
            metrics["entropy"] = _masked_mean(entropy.detach(), x.valid)
        loss = aggregate(token_loss, x.weight, cfg.loss_agg_mode, inputs.denominator)
        metrics.update(_common_metrics(x, clipped))
        return LossOutputs(loss=loss, metrics=metrics)


def get_loss(name: str, **params: Any) -> Loss:
    """The preset `name` with `params` overriding its defaults (docs/algorithms.md section 5).

    Raises ValueError naming the valid presets, or the valid parameters of this preset.
    Advantage settings are not loss parameters: pass them to `group_advantages`.
    """
    preset = LOSS_PRESETS.get(name)
    if preset is None:
        raise ValueError(f"unknown loss preset {name!r}; valid presets: {', '.join(PRESETS)}")
    valid = sorted(set(preset.model_fields) - {"name", "advantage"})
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(
            f"{name} has no parameter {', '.join(map(repr, unknown))}; "
            f"valid parameters: {', '.join(valid)}"
        )
    try:
        config = preset.model_validate({"name": name, **params})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or name}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise ValueError(f"invalid parameters for loss preset {name}: {problems}") from None
    return Loss(config)


def loss_from_config(config: LossPreset) -> Loss:
    """The loss for a preset config taken from a run config (`cfg.learner.loss`)."""
    if getattr(config, "name", None) not in LOSS_PRESETS:
        raise ValueError(f"not a loss preset config: {config!r}")
    return Loss(config)


def loss_denominator(mask: Tensor, mode: LossAggMode) -> Tensor:
    """What `aggregate` divides by for this mask: the (weighted) token count for token-mean,
    the number of sequences with at least one valid token for the seq-mean modes.

    Sum it over micro-batches (and ranks) and pass it as `LossInputs.denominator` to make
    micro-batch losses add up to the whole-batch loss.
    """
    weight = mask.to(torch.float32) if not mask.is_floating_point() else mask
    if mode == "token-mean":
        return weight.sum()
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return (weight.sum(dim=-1) != 0).sum().to(weight.dtype)
    raise ValueError(
        f"unknown loss_agg_mode {mode!r}; valid: token-mean, seq-mean-token-mean, "
        "seq-mean-token-sum"
    )


def aggregate(
    token_loss: Tensor,
    mask: Tensor,
    mode: LossAggMode,
    denominator: Tensor | float | None = None,
) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar over the mask's tokens.

    token-mean:          sum_{i,t} m l / sum_{i,t} m
    seq-mean-token-mean: mean over non-empty sequences of (sum_t m l / sum_t m)
    seq-mean-token-sum:  mean over non-empty sequences of sum_t m l
    An empty mask gives 0 (never NaN), still connected to the graph.
    """
    weight = mask.to(token_loss.dtype)
    weighted = torch.where(weight != 0, token_loss, torch.zeros_like(token_loss)) * weight
    if mode == "seq-mean-token-mean":
        per_seq = weight.sum(dim=-1)
        total = (weighted.sum(dim=-1) / _nonzero(per_seq)).sum()
    else:
        total = weighted.sum()
    den = loss_denominator(weight, mode) if denominator is None else denominator
    den = torch.as_tensor(den, dtype=token_loss.dtype, device=token_loss.device)
    return total / _nonzero(den)


# --------------------------------------------------------------------------- policy terms


def _rec_term(x: _Tokens, cfg: Any, clip: ClipMode, weight: WeightMode, reg: RegMode) -> PolicyTerm:
    """l = -W * M * logp + R: W and M detached, R not multiplied by M."""
    a, rho = x.adv, x.rho
    keep = _clip_mask(clip, a, rho, cfg)
    if weight == "none":
        w = a
    elif weight == "importance_sampling":
        cap = getattr(cfg, "is_truncation", None)
        w = a * (rho if cap is None else rho.clamp(max=cap))
    else:  # "advantage": RED-Weight
        w = a * torch.exp(a / cfg.weight_temperature)
    # M as a selection, not a product: a weight that overflowed (RED-Weight's exp(A / T))
    # on a token M drops would make inf * 0 = NaN in the loss and every gradient
    token_loss = -torch.where(keep, w, torch.zeros_like(w)) * x.logp
    metrics: dict[str, Tensor] = {}
    if reg != "none":
        if reg == "k2":
            r = cfg.regularizer_coef * (x.logp - x.blogp) ** 2
        else:  # "forward-kl"
            r = -cfg.regularizer_coef * x.logp
        token_loss = token_loss + r
        metrics["regularizer"] = _masked_mean(r.detach(), x.valid)
    return token_loss, ~keep, metrics


def _clip_mask(mode: ClipMode, a: Tensor, rho: Tensor, cfg: Any) -> Tensor:
    """M as a bool tensor (docs/algorithms.md section 4's table)."""
    if mode == "none":
        return torch.ones_like(rho, dtype=torch.bool)
    low, high = 1.0 - float(cfg.epsilon_low), 1.0 + float(cfg.epsilon_high)
    if mode == "one-side":
        return ((a >= 0) & (rho <= high)) | ((a <= 0) & (rho >= low))
    inner = (rho >= low) & (rho <= high)
    if mode == "two-side":
        return inner
    low_outer = 1.0 - float(cfg.epsilon_low_prime)
    high_outer = 1.0 + float(cfg.epsilon_high_prime)
    return inner | ((a >= 0) & (rho <= low_outer)) | ((a <= 0) & (rho >= high_outer))


def _ppo_term(x: _Tokens, cfg: Any) -> PolicyTerm:
    """max(-A rho, -A clip(rho)) with rho = exp(logp - blogp) carrying gradient; dual clip
    caps the loss of negative-advantage tokens at -c * A."""
    a = x.adv
    ratio = _ratio(x.logp - x.blogp)  # with gradient (0 beyond the clamp)
    low, high = 1.0 - float(cfg.epsilon_low), 1.0 + float(cfg.epsilon_high)
    token_loss = torch.maximum(-a * ratio, -a * ratio.clamp(low, high))
    clipped = ((a > 0) & (x.rho > high)) | ((a < 0) & (x.rho < low))
    metrics: dict[str, Tensor] = {}
    if cfg.dual_clip is not None:
        dual = (a < 0) & (x.rho > cfg.dual_clip)
        token_loss = torch.where(a < 0, torch.minimum(token_loss, -cfg.dual_clip * a), token_loss)
        clipped = clipped | dual
        metrics["dual_clip_frac"] = _masked_mean(dual.to(x.logp.dtype), x.valid)
    return token_loss, clipped, metrics


def _gspo_term(x: _Tokens, cfg: Any) -> PolicyTerm:
    """Clipped surrogate on s_i = exp(mean_t (logp - blogp)), token form: each token's ratio
    has the value s_i and the gradient s_i * grad logp_t (GSPO-token)."""
    a = x.adv
    lengths = _nonzero(x.weight.sum(dim=-1, keepdim=True))
    log_s = ((x.logp - x.blogp) * x.weight).sum(dim=-1, keepdim=True) / lengths
    log_s = log_s.clamp(-_LOG_RATIO_MAX, _LOG_RATIO_MAX)
    s = torch.exp(log_s.detach() + x.logp - x.logp.detach())
    low, high = 1.0 - float(cfg.epsilon_low), 1.0 + float(cfg.epsilon_high)
    token_loss = torch.maximum(-a * s, -a * s.clamp(low, high))
    s_value = s.detach()
    clipped = ((a > 0) & (s_value > high)) | ((a < 0) & (s_value < low))
    seq_valid = x.valid.any(dim=-1)
    seq_ratio = _masked_mean(torch.exp(log_s.detach()).squeeze(-1), seq_valid)
    return token_loss, clipped, {"seq_ratio_mean": seq_ratio}


def _cispo_term(x: _Tokens, cfg: Any) -> PolicyTerm:
    """-A * sg(clip(rho, 1-eps_low, 1+eps_high)) * logp: truncate the IS weight, keep every
    token's gradient."""
    low, high = 1.0 - float(cfg.epsilon_low), 1.0 + float(cfg.epsilon_high)
    token_loss = -x.adv * x.rho.clamp(low, high) * x.logp
    truncated = (x.rho < low) | (x.rho > high)
    return token_loss, truncated, {}


_OTHER_TERMS: dict[str, Callable[[_Tokens, Any], PolicyTerm]] = {
    "ppo": _ppo_term,
    "gspo": _gspo_term,
    "cispo": _cispo_term,
}
assert set(REC_PRESETS) | set(_OTHER_TERMS) == set(LOSS_PRESETS), "a preset lacks a formula"


# --------------------------------------------------------------------------- helpers


def _prepare(inputs: LossInputs) -> _Tokens:
    logp, blogp, adv, mask = inputs.logp, inputs.behavior_logp, inputs.advantages, inputs.mask
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    if not logp.is_floating_point():
        raise ValueError(f"logp must be a float tensor, got {logp.dtype}")
    for field, tensor in (
        ("behavior_logp", blogp),
        ("mask", mask),
        ("ref_logp", inputs.ref_logp),
        ("entropy", inputs.entropy),
    ):
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(
                f"{field} has shape {tuple(tensor.shape)} but logp has {tuple(logp.shape)}; "
                "both must be [B, T]"
            )
    if adv.shape == logp.shape[:1]:
        adv = adv.unsqueeze(-1).expand_as(logp)
    elif adv.shape != logp.shape:
        raise ValueError(
            f"advantages has shape {tuple(adv.shape)}; expected [B]={tuple(logp.shape[:1])} "
            f"or [B, T]={tuple(logp.shape)} to match logp"
        )
    weight = mask.to(logp.dtype)
    valid = weight != 0
    zeros = torch.zeros_like(logp)
    logp = torch.where(valid, logp, zeros)
    blogp = torch.where(valid, blogp.detach().to(logp.dtype), zeros)
    adv = torch.where(valid, adv.to(logp.dtype).detach(), zeros)
    rho = _ratio(logp.detach() - blogp)
    return _Tokens(logp=logp, blogp=blogp, adv=adv, weight=weight, valid=valid, rho=rho)


def _common_metrics(x: _Tokens, clipped: Tensor) -> dict[str, Tensor]:
    """Token-level statistics over valid tokens, all detached."""
    dt = x.logp.dtype
    any_valid = x.valid.any()
    one = torch.ones((), dtype=dt, device=x.logp.device)
    inf = torch.full((), float("inf"), dtype=dt, device=x.logp.device)
    ratio_min = torch.where(x.valid, x.rho, inf).amin()
    ratio_max = torch.where(x.valid, x.rho, -inf).amax()
    adv_mean = _masked_mean(x.adv, x.valid)
    adv_var = _masked_mean((x.adv - adv_mean) ** 2, x.valid)
    return {
        "clip_frac": _masked_mean((clipped & x.valid).to(dt), x.valid),
        "ratio_mean": _masked_mean(x.rho, x.valid),
        "ratio_min": torch.where(any_valid, ratio_min, one),
        "ratio_max": torch.where(any_valid, ratio_max, one),
        "approx_kl": _masked_mean((x.blogp - x.logp).detach(), x.valid),
        "adv_mean": adv_mean,
        "adv_std": adv_var.sqrt(),
        "adv_min": torch.where(any_valid, torch.where(x.valid, x.adv, inf).amin(), 0 * one),
        "adv_max": torch.where(any_valid, torch.where(x.valid, x.adv, -inf).amax(), 0 * one),
        "num_tokens": x.valid.sum().to(dt),
    }


# A log-ratio logp - blogp beyond this counts as this before exp (e^20 ~ 4.9e8): a behaviour
# log-prob far below the policy's (an engine's -9999 for "impossible", a float underflow)
# made rho inf in float32, and inf times a zero mask or advantage NaN, in the loss and in
# every gradient. No clip bound comes near it, so masks and clipped terms are unchanged.
_LOG_RATIO_MAX = 20.0


def _ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-_LOG_RATIO_MAX, _LOG_RATIO_MAX))


def _kl(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio: Tensor = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    k3: Tensor = torch.exp(log_ratio) - log_ratio - 1.0
    return k3


def _masked_mean(values: Tensor, valid: Tensor) -> Tensor:
    count = valid.sum().to(values.dtype)
    total = torch.where(valid, values, torch.zeros_like(values)).sum()
    return total / _nonzero(count)


def _nonzero(den: Tensor) -> Tensor:
    """den with zeros replaced by ones (a sum over nothing stays 0 instead of 0/0 = NaN)."""
    return torch.where(den != 0, den, torch.ones_like(den))
