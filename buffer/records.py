"""The trajectory group: one prompt, K responses, the policy version that produced them.

This is the unit that crosses every process boundary (rollout worker -> Redis -> learner), so
every field's type, shape and dtype is fixed here and checked by the codec (buffer/codec.py).
A group stores its responses as a struct of arrays (all tokens concatenated, plus per-response
lengths), which is what the learner pads into batches and what the codec moves without
per-response work; `Group.responses` gives per-response views when you want them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "FINISH_REASONS",
    "LOGP_DTYPE",
    "SCHEMA_VERSION",
    "TOKEN_DTYPE",
    "Group",
    "MetaValue",
    "Response",
    "batch_group_id",
    "synthetic_groups",
]

SCHEMA_VERSION = 1
"""Bumped whenever the encoded layout changes; decoders refuse versions they do not know."""

TOKEN_DTYPE = np.dtype("<i4")
"""Token ids: little-endian int32."""
LOGP_DTYPE = np.dtype("<f4")
"""Behaviour log-probs: little-endian float32."""
LENGTH_DTYPE = np.dtype("<i4")
REWARD_DTYPE = np.dtype("<f8")

FINISH_REASONS = ("stop", "length", "abort")
"""Why generation ended: eos or a stop string, max_new_tokens, or cut short."""

MetaValue = str | int | float | bool | None
"""Per-response metadata values are scalars (no nesting), so records stay cheap to check."""


@dataclass(frozen=True, eq=False)
class Response:
    """One sampled response (an input to `Group.new`, or a view from `Group.responses`).

    token_ids:      int32 [L], the generated tokens (prompt excluded).
    behavior_logp:  float32 [L], log-prob the engine sampled each token with.
    reward:         float, finite.
    finish_reason:  one of FINISH_REASONS.
    metadata:       str -> scalar mapping (e.g. the extracted answer, a parse failure).
    """

    token_ids: np.ndarray | Sequence[int]
    behavior_logp: np.ndarray | Sequence[float]
    reward: float
    finish_reason: str = "stop"
    metadata: Mapping[str, MetaValue] = field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Response):
            return NotImplemented
        return (
            np.array_equal(self.token_ids, other.token_ids)
            and np.array_equal(self.behavior_logp, other.behavior_logp)
            and self.reward == other.reward
            and self.finish_reason == other.finish_reason
            and dict(self.metadata) == dict(other.metadata)
        )

    __hash__ = None  # type: ignore[assignment]  # arrays are not hashable


@dataclass(frozen=True, eq=False)
class Group:
    """K >= 1 responses to one prompt, produced by one policy version (never mixed).

    run_id:           the run this group belongs to.
    group_id:         32 hex digits (uuid4, or `batch_group_id` for a driver's batch); the
                      buffer deduplicates pushes by it.
    prompt_id:        stable id of the prompt within its task (held-out splits, replay).
    task:             task name, e.g. "arithmetic".
    prompt_token_ids: int32 [P], the prompt as the model saw it (chat template applied).
    token_ids:        int32 [N], every response's tokens concatenated, N = sum(lengths).
    behavior_logp:    float32 [N], the behaviour log-prob of each of those tokens.
    lengths:          int32 [K], tokens of each response.
    rewards:          float64 [K].
    finish_reasons:   K strings from FINISH_REASONS.
    metadata:         K mappings of str -> scalar.
    policy_version:   version of the weights that sampled every response (>= 0).
    worker_id:        the rollout worker that produced it.
    created_at:       unix time in seconds when the group was completed.
    schema_version:   SCHEMA_VERSION at encoding time.
    """

    run_id: str
    group_id: str
    prompt_id: str
    task: str
    prompt_token_ids: np.ndarray
    token_ids: np.ndarray
    behavior_logp: np.ndarray
    lengths: np.ndarray
    rewards: np.ndarray
    finish_reasons: tuple[str, ...]
    metadata: tuple[Mapping[str, MetaValue], ...]
    policy_version: int
    worker_id: str
    created_at: float
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def new(
        cls,
        *,
        run_id: str,
        prompt_id: str,
        task: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        responses: Sequence[Response],
        policy_version: int,
        worker_id: str,
        group_id: str | None = None,
    ) -> Group:
        """A fresh group (a new id unless given, current time) from per-response parts, dtypes
        coerced."""
        tokens = [_token_ids(r.token_ids, f"response {i}") for i, r in enumerate(responses)]
        logps = [np.asarray(r.behavior_logp, dtype=LOGP_DTYPE) for r in responses]
        for i, (t, lp) in enumerate(zip(tokens, logps, strict=True)):
            if t.shape != lp.shape or t.ndim != 1:
                raise ValueError(
                    f"response {i}: token_ids {t.shape} and behavior_logp {lp.shape} must be "
                    "one-dimensional and of equal length"
                )
        return cls(
            run_id=run_id,
            group_id=group_id or uuid.uuid4().hex,
            prompt_id=prompt_id,
            task=task,
            prompt_token_ids=_token_ids(prompt_token_ids, "prompt_token_ids"),
            token_ids=np.concatenate(tokens) if tokens else np.zeros(0, TOKEN_DTYPE),
            behavior_logp=np.concatenate(logps) if logps else np.zeros(0, LOGP_DTYPE),
            lengths=np.array([len(t) for t in tokens], dtype=LENGTH_DTYPE),
            rewards=np.array([float(r.reward) for r in responses], dtype=REWARD_DTYPE),
            finish_reasons=tuple(r.finish_reason for r in responses),
            metadata=tuple(dict(r.metadata) for r in responses),
            policy_version=_version(policy_version),
            worker_id=worker_id,
            created_at=time.time(),
        )

    @property
    def k(self) -> int:
        """Responses in the group."""
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        """Generated tokens over all responses."""
        return len(self.token_ids)

    @property
    def offsets(self) -> np.ndarray:
        """int64 [K + 1]: response i is token_ids[offsets[i]:offsets[i + 1]]."""
        return np.concatenate(([0], np.cumsum(self.lengths, dtype=np.int64)))

    @property
    def responses(self) -> tuple[Response, ...]:
        """Per-response views (no copies) of the arrays."""
        bounds = self.offsets.tolist()
        return tuple(
            Response(
                token_ids=self.token_ids[bounds[i] : bounds[i + 1]],
                behavior_logp=self.behavior_logp[bounds[i] : bounds[i + 1]],
                reward=float(self.rewards[i]),
                finish_reason=self.finish_reasons[i],
                metadata=self.metadata[i],
            )
            for i in range(self.k)
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Group):
            return NotImplemented
        return (
            self.run_id == other.run_id
            and self.group_id == other.group_id
            and self.prompt_id == other.prompt_id
            and self.task == other.task
            and np.array_equal(self.prompt_token_ids, other.prompt_token_ids)
            and np.array_equal(self.token_ids, other.token_ids)
            and np.array_equal(self.behavior_logp, other.behavior_logp)
            and np.array_equal(self.lengths, other.lengths)
            and np.array_equal(self.rewards, other.rewards)
            and self.finish_reasons == other.finish_reasons
            and [dict(m) for m in self.metadata] == [dict(m) for m in other.metadata]
            and self.policy_version == other.policy_version
            and self.worker_id == other.worker_id
            and self.created_at == other.created_at
            and self.schema_version == other.schema_version
        )

    __hash__ = None  # type: ignore[assignment]


def synthetic_groups(
    n: int,
    k: int = 8,
    tokens: int = 1024,
    vocab: int = 50_000,
    prompt_tokens: int = 128,
    seed: int = 0,
) -> list[Group]:
    """`n` groups of random tokens with plausible log-probs and rewards 0/1 alternating
    (for benchmarks and tests, where only shapes and sizes matter)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n):
        responses = [
            Response(rng.integers(0, vocab, tokens), -rng.random(tokens) - 0.5, float(i % 2))
            for i in range(k)
        ]
        groups.append(
            Group.new(
                run_id="synthetic",
                prompt_id=f"p{g}",
                task="synthetic",
                prompt_token_ids=rng.integers(0, vocab, prompt_tokens),
                responses=responses,
                policy_version=g % 4,
                worker_id="synthetic",
            )
        )
    return groups


def batch_group_id(run_id: str, batch: int, index: int) -> str:
    """The id of the group for prompt `index` of rollout batch `batch` of a run: the same
    every time that batch is generated, so a batch redone after a worker died or a run resumed
    pushes no group twice (the buffer drops a repeated id as a duplicate)."""
    import hashlib

    return hashlib.blake2b(f"{run_id}/{batch}/{index}".encode(), digest_size=16).hexdigest()


def _version(value: int) -> int:
    """A policy version as int, refusing what int() would change (1.9 became 1) or a bool."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(
            f"policy_version must be an integer (the learner steps done), got {value!r}"
        )
    return int(value)


def _token_ids(values: Sequence[int] | np.ndarray, where: str) -> np.ndarray:
    """Token ids as int32, refusing what the cast would change: 1.7 became 1, and an int64
    id of 2**32 + 7 became 7, silently."""
    given = np.asarray(values)
    out = given.astype(TOKEN_DTYPE)
    if given.size and (given.dtype.kind not in "iub" or not np.array_equal(out, given)):
        raise ValueError(
            f"{where}: token ids must be integers in int32's range, got {given.dtype} "
            f"values {given.ravel()[:5].tolist()}"
        )
    return out
