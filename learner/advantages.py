"""Group-relative advantages (docs/algorithms.md section 3). Pure tensor functions, no I/O.

    adv = group_advantages(rewards, std_normalize=False, drop=None, seed=None)  # [G, K] -> [G, K]

A_i = r_i - mean(r) over the group (a mean-only baseline), optionally divided by the group's
population std + 1e-6. RED-Drop (`drop="balance"`) first drops surplus negatives at random so
that a group has no more negatives than positives; dropped responses get A = 0 and stay in the
batch (they still count in the loss's token-mean denominator).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["STD_EPS", "balance_keep_mask", "group_advantages"]

STD_EPS = 1e-6
"""Added to the group std before dividing (docs/algorithms.md section 3)."""


def group_advantages(
    rewards: Tensor,
    std_normalize: bool = False,
    drop: str | None = None,
    seed: int | None = None,
) -> Tensor:
    """Advantages for `rewards` of shape [G, K] (G groups of K responses); returns [G, K].

    A group of one response has advantage 0. `drop` is None or "balance" (RED-Drop); `seed`
    makes the drop reproducible (None draws from torch's global generator).
    """
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, K], got shape {tuple(rewards.shape)}")
    if drop not in (None, "balance"):
        raise ValueError(f"drop must be None or 'balance', got {drop!r}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    if drop == "balance":
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        keep = balance_keep_mask(rewards, generator)
    else:
        keep = torch.ones_like(rewards, dtype=torch.bool)
    return _masked_group_advantages(rewards, keep, std_normalize)


def balance_keep_mask(rewards: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """RED-Drop's choice: True for responses kept, shape [G, K].

    A response is positive when r_i >= mean(r) of the full group. Where a group has more
    negatives than positives, (#neg - #pos) negatives chosen uniformly at random are dropped.
    """
    positive = rewards >= rewards.mean(dim=1, keepdim=True)
    keep = torch.ones_like(rewards, dtype=torch.bool)
    for g in range(rewards.shape[0]):
        negatives = torch.nonzero(~positive[g]).flatten()
        surplus = len(negatives) - int(positive[g].sum())
        if surplus > 0:
            order = torch.randperm(len(negatives), generator=generator)
            keep[g, negatives[order[:surplus]]] = False
    return keep


def _masked_group_advantages(rewards: Tensor, keep: Tensor, std_normalize: bool) -> Tensor:
    """r - mean over the kept responses of each group (optionally / (std + eps)); 0 elsewhere."""
    weight = keep.to(rewards.dtype)
    count = weight.sum(dim=1, keepdim=True)
    safe_count = torch.where(count > 0, count, torch.ones_like(count))
    mean = (rewards * weight).sum(dim=1, keepdim=True) / safe_count
    centred = torch.where(keep, rewards - mean, torch.zeros_like(rewards))
    if std_normalize:
        std = ((centred**2).sum(dim=1, keepdim=True) / safe_count).sqrt()
        centred = centred / (std + STD_EPS)
    # A group with a single (kept) response has no baseline to compare against.
    return torch.where(keep & (count > 1), centred, torch.zeros_like(centred))
