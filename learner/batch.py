"""Groups -> training tensors. Pure: no I/O, no model.

Each response becomes one sequence, prompt + response, right-padded to the batch's longest.
Right padding keeps positions as in generation (the prompt starts at position 0). Target
position t predicts input token t + 1, so response token j of a prompt of length P sits at
target index P - 1 + j; `response_mask` is 1 exactly there, and `behavior_logp` holds the
engine's log-prob of that token at the same index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from staleflow.buffer.records import Group
from staleflow.configs.losses import AdvantageConfig
from staleflow.learner.advantages import group_advantages

__all__ = ["TrainBatch", "build_batch"]


@dataclass(frozen=True)
class TrainBatch:
    """N sequences (all responses of the batch's groups), padded to length L.

    input_ids:       long [N, L], prompt then response, pad_id after.
    attention_mask:  long [N, L], 1 on real tokens.
    response_mask:   bool [N, L - 1], 1 on targets that are response tokens.
    behavior_logp:   float32 [N, L - 1], behaviour log-prob at those targets (0 elsewhere).
    advantages:      float32 [N], one per sequence.
    group_index:     long [N], the group each sequence came from.
    policy_versions: int [G], version of each group.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    behavior_logp: Tensor
    advantages: Tensor
    group_index: Tensor
    policy_versions: list[int]

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with every tensor on `device` (the learner's model's device)."""
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), Tensor)
            },
        )

    def rows(self, index: slice | Tensor) -> TrainBatch:
        """A micro-batch: the given sequences, trimmed to their own longest length."""
        mask = self.attention_mask[index]
        width = int(mask.sum(dim=1).max()) if len(mask) else 1
        return TrainBatch(
            input_ids=self.input_ids[index, :width],
            attention_mask=mask[:, :width],
            response_mask=self.response_mask[index, : width - 1],
            behavior_logp=self.behavior_logp[index, : width - 1],
            advantages=self.advantages[index],
            group_index=self.group_index[index],
            policy_versions=self.policy_versions,
        )


def build_batch(
    groups: Sequence[Group], advantage: AdvantageConfig, pad_id: int, seed: int | None = None
) -> TrainBatch:
    """Stack `groups` into a TrainBatch, with group-relative advantages per `advantage`.

    `seed` makes RED-Drop reproducible (group g uses seed + g)."""
    if not groups:
        raise ValueError("build_batch needs at least one group")
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    advantages: list[Tensor] = []
    group_index: list[int] = []
    for g, group in enumerate(groups):
        # a copy: the rewards array may be a read-only view of the received bytes. In float64
        # (the records' own precision): a reward of 1e39 was inf in float32, its advantage NaN
        rewards = torch.tensor(group.rewards, dtype=torch.float64)[None, :]
        advantages.append(
            group_advantages(
                rewards,
                std_normalize=advantage.std_normalize,
                drop=advantage.drop,
                seed=None if seed is None else seed + g,
            )[0].to(torch.float32)
        )
        bounds = group.offsets.tolist()
        for i in range(group.k):
            start, end = bounds[i], bounds[i + 1]
            rows.append(
                (group.prompt_token_ids, group.token_ids[start:end], group.behavior_logp[start:end])
            )
            group_index.append(g)
    width = max(len(p) + len(r) for p, r, _ in rows)
    if any(len(p) == 0 for p, _, _ in rows):
        raise ValueError("every group needs a non-empty prompt (the first response token is "
                         "predicted from the prompt's last)")  # fmt: skip
    n = len(rows)
    input_ids = np.full((n, width), pad_id, dtype=np.int64)
    attention = np.zeros((n, width), dtype=np.int64)
    response_mask = np.zeros((n, max(width - 1, 1)), dtype=bool)
    behavior = np.zeros((n, max(width - 1, 1)), dtype=np.float32)
    for i, (prompt, response, logp) in enumerate(rows):
        p, r = len(prompt), len(response)
        input_ids[i, :p] = prompt
        input_ids[i, p : p + r] = response
        attention[i, : p + r] = 1
        response_mask[i, p - 1 : p - 1 + r] = True
        behavior[i, p - 1 : p - 1 + r] = logp
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        response_mask=torch.from_numpy(response_mask),
        behavior_logp=torch.from_numpy(behavior),
        advantages=torch.cat(advantages).to(torch.float32),
        group_index=torch.tensor(group_index, dtype=torch.long),
        policy_versions=[int(g.policy_version) for g in groups],
    )
