"""Loss presets: one pydantic model per named algorithm (docs/algorithms.md section 5).

These models are the single source of truth for each preset's parameters and defaults.
`staleflow.learner.losses.get_loss(name, **params)` validates its arguments through them, and a
run config selects one under `learner.loss` by `name` (a discriminated union).

A preset also fixes how advantages are computed (`advantage`): grpo normalises by the group
std, red-drop balances positives and negatives. Every value is overridable.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLEstimator = Literal["k1", "k2", "k3"]


class Frozen(BaseModel):
    """Base of every config model: unknown keys are errors, values cannot change after load,
    and a number is never given as true/false (pydantic would read `run.steps=true` as 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        """Also inside lists and mappings of numbers (betas: [no, no] was (0.0, 0.0)), and no
        NUL character in any text (no path or name can hold one: it failed in os.mkdir)."""
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key)
                if field is None:
                    continue
                if not _is_model(field.annotation) and _has_nul(value):  # (a section: its own)
                    raise ValueError(
                        f"{key}: holds a NUL character (\\0): remove it (no path, name or "
                        "text of a config may hold one)"
                    )
                kinds = _kinds(field.annotation)
                if isinstance(value, bool) and bool not in kinds and kinds & {int, float}:
                    raise ValueError(f"{key}: expected a number, got {str(value).lower()}")
                items = value.values() if isinstance(value, dict) else value
                if isinstance(value, list | tuple | dict) and any(
                    isinstance(v, bool) for v in items
                ):
                    inner = _element_kinds(field.annotation)
                    if bool not in inner and inner & {int, float}:
                        raise ValueError(f"{key}: expected numbers, got {value!r}")
        return data


def _is_model(annotation: Any) -> bool:
    return any(isinstance(k, type) and issubclass(k, BaseModel) for k in _kinds(annotation))


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(v) for v in value)
    return False


def _kinds(annotation: Any) -> set[Any]:
    """The plain types an annotation admits (through Optional / unions / Annotated)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, Annotated):
        return set().union(*(_kinds(a) for a in typing.get_args(annotation)))
    return {annotation}


def _element_kinds(annotation: Any) -> set[Any]:
    """The plain types the elements of a list, tuple or mapping annotation admit (a
    mapping's values), through Optional / unions / Annotated; empty for anything else."""
    out: set[Any] = set()
    for kind in _kinds(annotation):
        origin, args = typing.get_origin(kind), typing.get_args(kind)
        if origin is dict and len(args) == 2:
            out |= _kinds(args[1])
        elif origin in (list, tuple, set, frozenset):
            for arg in args:
                if arg is not Ellipsis:
                    out |= _kinds(arg)
    return out


class AdvantageConfig(Frozen):
    """How group-relative advantages are computed (docs/algorithms.md section 3)."""

    std_normalize: bool = Field(
        False, description="Divide A = r - mean(r) by the group's population std + 1e-6."
    )
    drop: Literal["balance"] | None = Field(
        None,
        description="RED-Drop: 'balance' drops surplus negatives at random; null keeps all.",
    )


# Field types shared by the presets; each preset lists the ones it takes with its own default.
EpsilonLow = Annotated[float, Field(ge=0.0, le=1.0, description="Lower clip bound: 1 - eps_low.")]
EpsilonHigh = Annotated[
    float, Field(ge=0.0, le=100.0, description="Upper clip bound: 1 + eps_high.")
]
EpsilonLowPrime = Annotated[
    float, Field(ge=0.0, le=1.0, description="Ring's outer lower bound: 1 - eps_low_prime.")
]
EpsilonHighPrime = Annotated[
    float, Field(ge=0.0, le=100.0, description="Ring's outer upper bound: 1 + eps_high_prime.")
]
ISTruncation = Annotated[
    float | None,
    Field(gt=0.0, le=1000.0, description="Truncated IS: cap rho in the weight (null: no cap)."),
]
RegularizerCoef = Annotated[
    float, Field(ge=0.0, le=100.0, description="c, the regulariser's coefficient.")
]
AggMode = Annotated[
    LossAggMode,
    Field(description="token-mean over the batch, or per-sequence mean/sum then mean."),
]


def _advantage(**settings: object) -> Any:
    return Field(
        default_factory=lambda: AdvantageConfig.model_validate(settings),
        description="Advantage settings this preset uses.",
    )


class LossPreset(Frozen):
    """Parameters every preset accepts (all off or neutral by default)."""

    loss_agg_mode: AggMode = "token-mean"
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description="Weight of a KL penalty to a frozen reference model (needs "
        "learner.reference_model: true).",
    )
    kl_estimator: KLEstimator = Field(
        "k3", description="Estimator of that KL: k1, k2 or k3 (Schulman's approximations)."
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, le=100.0, description="Weight of an entropy bonus (0 disables it)."
    )
    advantage: AdvantageConfig = _advantage()


def check_ring(cfg: Any) -> Any:
    """The ring's outer band must contain its inner band."""
    if cfg.epsilon_low_prime < cfg.epsilon_low or cfg.epsilon_high_prime < cfg.epsilon_high:
        raise ValueError(
            "ring needs epsilon_low_prime >= epsilon_low and epsilon_high_prime >= epsilon_high "
            f"(got outer ({cfg.epsilon_low_prime}, {cfg.epsilon_high_prime}), "
            f"inner ({cfg.epsilon_low}, {cfg.epsilon_high}))"
        )
    return cfg


class ReinforceLoss(LossPreset):
    """Group-relative REINFORCE with a mean-only baseline; no clipping, no IS."""

    name: Literal["reinforce"] = "reinforce"


class GRPOLoss(LossPreset):
    """GRPO as run in the paper: one-side clip, IS weight, std-normalised advantages."""

    name: Literal["grpo"] = "grpo"
    epsilon_low: EpsilonLow = 0.2
    epsilon_high: EpsilonHigh = 0.2
    is_truncation: ISTruncation = None
    advantage: AdvantageConfig = _advantage(std_normalize=True)


class RecOneSideISLoss(LossPreset):
    """REC-OneSide-IS: exactly PPO's clipped-surrogate gradient (without dual clip)."""

    name: Literal["rec-oneside-is"] = "rec-oneside-is"
    epsilon_low: EpsilonLow = 0.2
    epsilon_high: EpsilonHigh = 0.2
    is_truncation: ISTruncation = None


class RecOneSideNoISLoss(LossPreset):
    """REC-OneSide-NoIS: one-side clip mask, weight A (no importance ratio)."""

    name: Literal["rec-oneside-nois"] = "rec-oneside-nois"
    epsilon_low: EpsilonLow = 0.2
    epsilon_high: EpsilonHigh = 0.2


class RecTwoSideISLoss(LossPreset):
    """REC-TwoSide-IS: tokens with rho outside [1-eps_low, 1+eps_high] are masked; IS weight."""

    name: Literal["rec-twoside-is"] = "rec-twoside-is"
    epsilon_low: EpsilonLow = 0.2
    epsilon_high: EpsilonHigh = 0.2
    is_truncation: ISTruncation = None


class RecTwoSideNoISLoss(LossPreset):
    """REC-TwoSide-NoIS: two-side clip mask, weight A."""

    name: Literal["rec-twoside-nois"] = "rec-twoside-nois"
    epsilon_low: EpsilonLow = 0.2
    epsilon_high: EpsilonHigh = 0.2


class RecRingISLoss(LossPreset):
    """REC-Ring-IS: the inner band plus outer one-sided regions; IS weight."""

    name: Literal["rec-ring-is"] = "rec-ring-is"
    epsilon_low: EpsilonLow = 0.2
    epsilon_high: EpsilonHigh = 0.2
    epsilon_low_prime: EpsilonLowPrime = 0.6
    epsilon_high_prime: EpsilonHighPrime = 2.0
    is_truncation: ISTruncation = None
    check_ring = model_validator(mode="after")(check_ring)


class RecRingNoISLoss(LossPreset):
    """REC-Ring-NoIS: the inner band plus outer one-sided regions; weight A."""

    name: Literal["rec-ring-nois"] = "rec-ring-nois"
    epsilon_low: EpsilonLow = 0.2
    epsilon_high: EpsilonHigh = 0.2
    epsilon_low_prime: EpsilonLowPrime = 0.6
    epsilon_high_prime: EpsilonHighPrime = 2.0
    check_ring = model_validator(mode="after")(check_ring)


class OPMDLoss(LossPreset):
    """OPMD: REINFORCE plus the k2 regulariser c * (logp - blogp)^2, c = tau / 2."""

    name: Literal["opmd"] = "opmd"
    regularizer_coef: RegularizerCoef = 0.1


class AsymRELoss(LossPreset):
    """AsymRE: REINFORCE plus the forward-KL regulariser -c * logp (baseline shifted by -c)."""

    name: Literal["asymre"] = "asymre"
    regularizer_coef: RegularizerCoef = 0.1


class REDDropLoss(LossPreset):
    """RED-Drop: REINFORCE on groups balanced by dropping surplus negatives."""

    name: Literal["red-drop"] = "red-drop"
    advantage: AdvantageConfig = _advantage(drop="balance")


class REDWeightLoss(LossPreset):
    """RED-Weight: REINFORCE with weight A * exp(A / T)."""

    name: Literal["red-weight"] = "red-weight"
    weight_temperature: float = Field(
        1.0, gt=0.0, le=1000.0, description="T in the weight A * exp(A / T)."
    )


class PPOLoss(LossPreset):
    """PPO's clipped surrogate on the ratio to the behaviour policy, with dual clip."""

    name: Literal["ppo"] = "ppo"
    epsilon_low: EpsilonLow = 0.2
    epsilon_high: EpsilonHigh = 0.2
    dual_clip: float | None = Field(
        3.0,
        gt=1.0,
        le=100.0,
        description="Dual clip c: for A < 0 the loss is at most c * |A| (null disables).",
    )


class GSPOLoss(LossPreset):
    """GSPO: clipped surrogate on the sequence-level geometric-mean ratio."""

    name: Literal["gspo"] = "gspo"
    epsilon_low: EpsilonLow = 3e-4
    epsilon_high: EpsilonHigh = 4e-4
    loss_agg_mode: AggMode = "seq-mean-token-mean"


class CISPOLoss(LossPreset):
    """CISPO: -A * sg(clip(rho, 1-eps_low, 1+eps_high)) * logp; every token keeps its gradient.

    Defaults follow MiniMax-M1: no lower truncation (epsilon_low = 1), upper bound 1 + 0.28.
    """

    name: Literal["cispo"] = "cispo"
    epsilon_low: EpsilonLow = 1.0
    epsilon_high: EpsilonHigh = 0.28


LOSS_PRESETS: dict[str, type[LossPreset]] = {
    cls.model_fields["name"].default: cls
    for cls in (
        ReinforceLoss,
        GRPOLoss,
        RecOneSideISLoss,
        RecOneSideNoISLoss,
        RecTwoSideISLoss,
        RecTwoSideNoISLoss,
        RecRingISLoss,
        RecRingNoISLoss,
        OPMDLoss,
        AsymRELoss,
        REDDropLoss,
        REDWeightLoss,
        PPOLoss,
        GSPOLoss,
        CISPOLoss,
    )
}

LossConfig = Annotated[
    ReinforceLoss
    | GRPOLoss
    | RecOneSideISLoss
    | RecOneSideNoISLoss
    | RecTwoSideISLoss
    | RecTwoSideNoISLoss
    | RecRingISLoss
    | RecRingNoISLoss
    | OPMDLoss
    | AsymRELoss
    | REDDropLoss
    | REDWeightLoss
    | PPOLoss
    | GSPOLoss
    | CISPOLoss,
    Field(discriminator="name"),
]
"""A loss preset, selected by its `name`."""
