"""build_batch: groups -> the learner's tensors, every value written out by hand.

The learner tests build their reference inputs with build_batch too, so a mistake here (an
advantage setting not passed on, a log-prob one position off) would pass there unseen.

The two groups used throughout (pad id 99):

    group 0, prompt [11, 12] (P = 2), policy version 3, rewards 1, 0, 0, 0
      responses [21, 22, 23] logp [-.1, -.2, -.3];  [24] [-.4];  [25, 26] [-.5, -.6];  [27] [-.7]
    group 1, prompt [13, 14, 15] (P = 3), policy version 5, rewards 3, 1, 3, 1
      responses [31] [-1];  [32, 33] [-2, -3];  [34] [-4];  [35, 36, 37] [-5, -6, -7]

Longest sequence: 3 + 3 = 6 tokens, so L = 6 and the targets are L - 1 = 5 wide. Target t
predicts token t + 1: response token j of a prompt of length P is target P - 1 + j.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from staleflow.buffer.records import Group, Response
from staleflow.configs import LOSS_PRESETS
from staleflow.configs.losses import AdvantageConfig
from staleflow.learner.batch import build_batch

PAD = 99


def _group(prompt: list[int], responses: list[tuple[list[int], list[float]]],
           rewards: list[float], version: int) -> Group:  # fmt: skip
    return Group.new(
        run_id="r", prompt_id=f"p{version}", task="t", prompt_token_ids=prompt,
        responses=[Response(np.array(t, np.int32), np.array(lp, np.float32), r, "stop", {})
                   for (t, lp), r in zip(responses, rewards, strict=True)],
        policy_version=version, worker_id="w",
    )  # fmt: skip


GROUPS = [
    _group([11, 12], [([21, 22, 23], [-0.1, -0.2, -0.3]), ([24], [-0.4]),
                      ([25, 26], [-0.5, -0.6]), ([27], [-0.7])], [1, 0, 0, 0], 3),
    _group([13, 14, 15], [([31], [-1.0]), ([32, 33], [-2.0, -3.0]), ([34], [-4.0]),
                          ([35, 36, 37], [-5.0, -6.0, -7.0])], [3, 1, 3, 1], 5),
]  # fmt: skip


def test_tokens_masks_and_log_probs_sit_where_the_targets_are():
    batch = build_batch(GROUPS, AdvantageConfig(), pad_id=PAD)
    assert batch.input_ids.tolist() == [
        [11, 12, 21, 22, 23, PAD],
        [11, 12, 24, PAD, PAD, PAD],
        [11, 12, 25, 26, PAD, PAD],
        [11, 12, 27, PAD, PAD, PAD],
        [13, 14, 15, 31, PAD, PAD],
        [13, 14, 15, 32, 33, PAD],
        [13, 14, 15, 34, PAD, PAD],
        [13, 14, 15, 35, 36, 37],
    ]
    # prompt + response lengths: 5 3 4 3 | 4 5 4 6
    assert batch.attention_mask.sum(dim=1).tolist() == [5, 3, 4, 3, 4, 5, 4, 6]
    assert batch.attention_mask[0].tolist() == [1, 1, 1, 1, 1, 0]
    # group 0 (P = 2): responses start at target 1; group 1 (P = 3): at target 2
    F, T = False, True
    assert batch.response_mask.tolist() == [
        [F, T, T, T, F],
        [F, T, F, F, F],
        [F, T, T, F, F],
        [F, T, F, F, F],
        [F, F, T, F, F],
        [F, F, T, T, F],
        [F, F, T, F, F],
        [F, F, T, T, T],
    ]
    torch.testing.assert_close(batch.behavior_logp, torch.tensor([
        [0, -0.1, -0.2, -0.3, 0],
        [0, -0.4, 0, 0, 0],
        [0, -0.5, -0.6, 0, 0],
        [0, -0.7, 0, 0, 0],
        [0, 0, -1.0, 0, 0],
        [0, 0, -2.0, -3.0, 0],
        [0, 0, -4.0, 0, 0],
        [0, 0, -5.0, -6.0, -7.0],
    ]))  # fmt: skip
    assert batch.behavior_logp.dtype == torch.float32
    assert batch.group_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert batch.policy_versions == [3, 5]


def test_mean_baseline_advantages():
    # group 0: mean 0.25 -> 0.75, -0.25, -0.25, -0.25; group 1: mean 2 -> 1, -1, 1, -1
    batch = build_batch(GROUPS, LOSS_PRESETS["rec-oneside-nois"]().advantage, pad_id=PAD)
    torch.testing.assert_close(
        batch.advantages, torch.tensor([0.75, -0.25, -0.25, -0.25, 1, -1, 1, -1])
    )


def test_grpo_divides_by_the_population_std():
    # group 0: deviations 0.75, -0.25 x3; variance (0.5625 + 3 * 0.0625) / 4 = 0.1875,
    #   std = sqrt(0.1875) = 0.4330127; 0.75 / 0.4330137 = 1.7320468, -0.25 / it = -0.5773489
    # group 1: deviations +-1, std 1: +-1 / (1 + 1e-6)
    batch = build_batch(GROUPS, LOSS_PRESETS["grpo"]().advantage, pad_id=PAD)
    s = 1 / (1 + 1e-6)
    torch.testing.assert_close(
        batch.advantages,
        torch.tensor([1.7320468, -0.5773489, -0.5773489, -0.5773489, s, -s, s, -s]),
    )


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_red_drop_keeps_as_many_negatives_as_positives(seed):
    # group 0: one positive (1 >= mean 0.25), three negatives: two are dropped (A = 0), the
    # kept rewards 1 and 0 have mean 0.5 -> +0.5 and -0.5. Group 1: two of each, none dropped.
    batch = build_batch(GROUPS, LOSS_PRESETS["red-drop"]().advantage, pad_id=PAD, seed=seed)
    first = batch.advantages[:4].tolist()
    assert first[0] == 0.5
    assert sorted(first[1:]) == [-0.5, 0.0, 0.0]
    assert batch.advantages[4:].tolist() == [1, -1, 1, -1]
    again = build_batch(GROUPS, LOSS_PRESETS["red-drop"]().advantage, pad_id=PAD, seed=seed)
    assert again.advantages.tolist() == batch.advantages.tolist()  # the seed fixes the choice


def test_red_drop_draws_differently_for_different_seeds():
    # three choices of the kept negative: over 8 seeds, more than one must come up
    kept = {
        build_batch(GROUPS, AdvantageConfig(drop="balance"), pad_id=PAD, seed=s)
        .advantages[1:4]
        .argmin()
        .item()
        for s in range(8)
    }
    assert len(kept) > 1
