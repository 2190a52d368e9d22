"""Group-relative advantages and RED-Drop, with expected values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from staleflow.learner.advantages import STD_EPS, balance_keep_mask, group_advantages


def close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def test_mean_only_baseline():
    # group 0: mean 0.25 -> (0.75, -0.25, -0.25, -0.25); group 1: mean 2 -> (1, -1, 1, -1)
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [3.0, 1.0, 3.0, 1.0]]))
    close(adv, [[0.75, -0.25, -0.25, -0.25], [1.0, -1.0, 1.0, -1.0]])


def test_std_normalize_uses_population_std():
    # deviations (0.75, -0.25 x3): variance (0.5625 + 3 * 0.0625) / 4 = 0.1875,
    # std = 0.4330127; A = dev / (std + 1e-6)
    std = math.sqrt(0.1875)
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), std_normalize=True)
    close(adv, [[0.75 / (std + STD_EPS)] + [-0.25 / (std + STD_EPS)] * 3])


def test_equal_rewards_give_zero_even_normalised():
    adv = group_advantages(torch.tensor([[2.0, 2.0, 2.0]]), std_normalize=True)
    assert torch.equal(adv, torch.zeros(1, 3))


@pytest.mark.parametrize("std_normalize", [False, True])
@pytest.mark.parametrize("drop", [None, "balance"])
def test_singleton_groups_have_zero_advantage(std_normalize, drop):
    adv = group_advantages(torch.tensor([[5.0], [-3.0]]), std_normalize=std_normalize, drop=drop)
    assert torch.equal(adv, torch.zeros(2, 1))


def test_integer_rewards_are_accepted():
    close(group_advantages(torch.tensor([[1, 0]])), [[0.5, -0.5]])


def test_red_drop_balances_and_keeps_dropped_at_zero():
    # mean 0.25: one positive (r=1), three negatives -> drop 3 - 1 = 2 negatives at random.
    # Kept set {1, 0}: mean 0.5 -> A = +0.5 for the 1, -0.5 for the kept 0, 0 for dropped.
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    adv = group_advantages(rewards, drop="balance", seed=0)
    assert adv[0, 0] == 0.5
    assert sorted(adv[0, 1:].tolist()) == [-0.5, 0.0, 0.0]


def test_red_drop_with_std_normalize():
    # kept {1, 0}: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6)
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), std_normalize=True, drop="balance")
    assert float(adv[0, 0]) == pytest.approx(0.5 / (0.5 + STD_EPS))
    assert sorted(adv[0, 1:].tolist()) == pytest.approx([-0.5 / (0.5 + STD_EPS), 0.0, 0.0])


def test_red_drop_leaves_balanced_or_positive_heavy_groups_alone():
    # (1, 1, 0, 0): 2 positives, 2 negatives -> nothing dropped -> (0.5, 0.5, -0.5, -0.5)
    # (1, 1, 1, 0): mean 0.75, 3 positives, 1 negative -> only negatives are ever dropped
    rewards = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    close(
        group_advantages(rewards, drop="balance", seed=1),
        [[0.5, 0.5, -0.5, -0.5], [0.25, 0.25, 0.25, -0.75]],
    )


def test_red_drop_is_reproducible_with_a_seed_and_random_across_seeds():
    rewards = torch.tensor([[1.0] + [0.0] * 7] * 3)
    first = group_advantages(rewards, drop="balance", seed=7)
    again = group_advantages(rewards, drop="balance", seed=7)
    assert torch.equal(first, again)
    patterns = {
        tuple(group_advantages(rewards, drop="balance", seed=s)[0].tolist()) for s in range(20)
    }
    assert len(patterns) > 1  # which negative survives depends on the seed
    # every group keeps exactly 1 positive and 1 negative: 6 of the 8 entries dropped
    assert ((first == 0).sum(dim=1) == 6).all()


def test_balance_keep_mask_counts():
    # (3, 0, 0, 0, 0, 1): mean 0.667 -> positives {3, 1}; 4 negatives -> drop 2
    keep = balance_keep_mask(torch.tensor([[3.0, 0.0, 0.0, 0.0, 0.0, 1.0]]))
    assert keep[0, 0]
    assert keep[0, 5]
    assert int(keep.sum()) == 4


def test_bad_input():
    with pytest.raises(ValueError, match=r"\[groups, K\]"):
        group_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="balance"):
        group_advantages(torch.zeros(1, 4), drop="random")
