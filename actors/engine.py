"""The rollout engine interface (docs/architecture.md, "Contracts") and the types it speaks.

    engine.generate(prompts, n, sampling) -> completions with token ids and behaviour log-probs
    engine.load_weights(named arrays, version)
    engine.version

Implementations: `HFEngine` (transformers `generate`, CPU or GPU) and `VLLMEngine` (vLLM).

Behaviour log-probs. For every generated token an engine records log mu(token), where mu is the
distribution the token was actually drawn from: softmax(logits / temperature), restricted to
the top-k / top-p set and renormalised when those are enabled. The learner's target policy is
the untruncated softmax(logits / temperature) at the same temperature, so with the defaults
(top_p = 1, top_k = 0) the ratio rho = pi / mu is exactly 1 on fresh data; with truncation,
rho <= 1 on fresh data and the truncation shows up as off-policyness, which the losses' clipping
handles like any other. Greedy decoding (temperature 0) records log softmax(logits).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = [
    "Completion",
    "RolloutEngine",
    "SamplingParams",
    "WeightsUpdate",
    "as_named_arrays",
    "check_parameter",
    "prompt_seed",
    "token_stops",
]

WeightsUpdate = Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]
"""Named arrays: parameter name -> numpy array (bfloat16 may arrive as an int16 view)."""


def token_stops(tokenizer: Any, stop: Sequence[str]) -> tuple[tuple[str, ...], list[int]]:
    """(the stop strings to look for in the text, the token ids to stop at): a stop string
    that is a special or added token ("<|im_end|>") can never appear in the text, which is
    decoded without special tokens, so it stops at that token instead (kept, as an eos)."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    ids = [int(added[s]) for s in stop if s in added]
    return tuple(s for s in stop if s not in added), ids


def prompt_seed(seed: int, j: int, n: int) -> int:
    """The seed of prompt `j` of a call seeded `seed` that samples `n` responses per prompt,
    for an engine that seeds each prompt on its own and its i-th response with seed + i
    (vLLM): prompts' seeds are at least `n` apart, so no two responses share one."""
    return ((seed * 1_000_003 + j) * max(n, 1)) % (1 << 62)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy; top_k 0 and top_p 1 disable truncation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @classmethod
    def from_config(cls, rollout: Any, seed: int | None = None) -> SamplingParams:
        """From a `RolloutConfig` (staleflow.configs.schema)."""
        return cls(
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=rollout.max_new_tokens,
            stop=tuple(rollout.stop),
            seed=seed,
        )


@dataclass(frozen=True, eq=False)
class Completion:
    """One generated response.

    token_ids:     int32 [L], generated tokens, the final eos included when there was one.
    logprobs:      float32 [L], behaviour log-prob of each token (see the module docstring).
    finish_reason: "stop" (eos or a stop string) or "length" (max_new_tokens reached).
    text:          the decoded tokens (special tokens skipped).
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    text: str


class RolloutEngine(Protocol):
    """What a rollout worker needs from an inference engine."""

    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded; -1 after a load that failed once
        it had changed some weights (they are then a mix of two versions)."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> list[list[Completion]]:
        """`n` completions for each prompt (token ids), in prompt order."""
        ...

    def load_weights(self, weights: WeightsUpdate, version: int) -> None:
        """Copy named arrays into the model in place and set the policy version."""
        ...


def as_named_arrays(weights: WeightsUpdate) -> Iterable[tuple[str, np.ndarray]]:
    return weights.items() if isinstance(weights, Mapping) else weights


def check_parameter(
    name: str, shape: Sequence[int], expected: Sequence[int] | None, known: Iterable[str]
) -> None:
    """Raise on a weight the model lacks: KeyError for an unknown `name` (`expected` None),
    naming a few of the `known` ones; ValueError for a `shape` other than `expected`."""
    if expected is None:
        names = ", ".join(sorted(known)[:5])
        raise KeyError(f"unknown parameter {name!r} (the model has e.g. {names}, ...)")
    if tuple(shape) != tuple(expected):
        raise ValueError(
            f"parameter {name!r}: got shape {tuple(shape)}, the model has {tuple(expected)}"
        )
