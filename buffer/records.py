"""The trajectory group: one prompt, K responses, the policy version that produced them.

This is the unit that crosses every process boundary (rollout worker -> Redis -> learner), so
every field's type, shape and dtype is fixed here and checked by the codec (buffer/codec.py).
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
]

SCHEMA_VERSION = 1
"""Bumped whenever the encoded layout changes; decoders refuse versions they do not know."""

TOKEN_DTYPE = np.dtype("<i4")
"""Token ids: little-endian int32."""
LOGP_DTYPE = np.dtype("<f4")
"""Behaviour log-probs: little-endian float32."""

FINISH_REASONS = ("stop", "length", "abort")
"""Why generation ended: eos or a stop string, max_new_tokens, or cut short."""

MetaValue = str | int | float | bool | None
"""Per-response metadata values are scalars (no nesting), so records stay cheap to check."""


@dataclass(frozen=True, eq=False)
class Response:
    """One sampled response.

    token_ids:      int32 [L], the generated tokens (prompt excluded).
    behavior_logp:  float32 [L], log-prob the engine sampled each token with (temperature
                    applied, see the engine's docs for top-p/top-k).
    reward:         float, finite.
    finish_reason:  one of FINISH_REASONS.
    metadata:       optional str -> scalar mapping (e.g. parse failures, extracted answer).
    """

    token_ids: np.ndarray
    behavior_logp: np.ndarray
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
    """K responses to one prompt, produced by one policy version (never mixed).

    run_id:           the run this group belongs to.
    group_id:         uuid4 hex; the buffer deduplicates pushes by it.
    prompt_id:        stable id of the prompt within its task (for held-out splits, replay).
    task:             task name, e.g. "arithmetic".
    prompt_token_ids: int32 [P], the prompt as the model saw it (chat template applied).
    responses:        K >= 1 responses.
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
    responses: tuple[Response, ...]
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
    ) -> Group:
        """A fresh group with a new id and the current time, arrays coerced to their dtypes."""
        return cls(
            run_id=run_id,
            group_id=uuid.uuid4().hex,
            prompt_id=prompt_id,
            task=task,
            prompt_token_ids=np.asarray(prompt_token_ids, dtype=TOKEN_DTYPE),
            responses=tuple(
                Response(
                    token_ids=np.asarray(r.token_ids, dtype=TOKEN_DTYPE),
                    behavior_logp=np.asarray(r.behavior_logp, dtype=LOGP_DTYPE),
                    reward=float(r.reward),
                    finish_reason=r.finish_reason,
                    metadata=dict(r.metadata),
                )
                for r in responses
            ),
            policy_version=int(policy_version),
            worker_id=worker_id,
            created_at=time.time(),
        )

    @property
    def rewards(self) -> np.ndarray:
        """float32 [K]."""
        return np.array([r.reward for r in self.responses], dtype=np.float32)

    @property
    def num_tokens(self) -> int:
        """Generated tokens over all responses."""
        return sum(len(r.token_ids) for r in self.responses)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Group):
            return NotImplemented
        return (
            self.run_id == other.run_id
            and self.group_id == other.group_id
            and self.prompt_id == other.prompt_id
            and self.task == other.task
            and np.array_equal(self.prompt_token_ids, other.prompt_token_ids)
            and self.responses == other.responses
            and self.policy_version == other.policy_version
            and self.worker_id == other.worker_id
            and self.created_at == other.created_at
            and self.schema_version == other.schema_version
        )

    __hash__ = None  # type: ignore[assignment]
