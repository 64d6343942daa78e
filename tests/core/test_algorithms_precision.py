"""Group statistics in float64: a float32 group of equal scores has exactly zero spread."""

import math

import pytest
import torch

from grouprl.algorithms import compute_advantages, filter_groups, group_statistics, masked_whiten, reward_std_per_group

# 0.7 is not representable: the float32 mean of seven copies differs from 0.7f by rounding,
# and dividing that residue by an equally tiny std gave advantages of about 0.056.
EQUAL = torch.tensor([0.7] * 7, dtype=torch.float32)
ONE_GROUP = torch.zeros(7, dtype=torch.long)


@pytest.mark.parametrize("name", ["grpo", "rloo", "grpo_passk"])
def test_equal_float32_scores_give_exactly_zero(name):
    adv = compute_advantages(name, EQUAL, ONE_GROUP)
    assert adv.dtype == torch.float32
    assert torch.equal(adv, torch.zeros(7))


def test_equal_float32_scores_give_exactly_zero_dr_grpo():
    assert torch.equal(compute_advantages("grpo", EQUAL, ONE_GROUP, norm_by_std=False), torch.zeros(7))


def test_equal_float32_group_is_exactly_zero_for_reinforce_plus_plus_baseline():
    # Next to a symmetric group [0, 1] the batch mean of the centred scores is exactly 0, so the
    # equal group's tokens must whiten to exactly 0 too (not to a rounding residue over sigma).
    scores = torch.cat([EQUAL, torch.tensor([0.0, 1.0])])
    groups = torch.tensor([0] * 7 + [1, 1])
    mask = torch.ones(9, 3)
    adv = compute_advantages("reinforce_plus_plus_baseline", scores, groups, response_mask=mask)
    assert adv.dtype == torch.float32
    assert torch.equal(adv[:7], torch.zeros(7, 3))
    # The other group: +-0.5 on 6 tokens out of 27, batch std sqrt(6 * 0.25 / 26).
    s = math.sqrt(1.5 / 26)
    assert torch.allclose(adv[7:], torch.tensor([[-0.5 / s] * 3, [0.5 / s] * 3]), atol=1e-5, rtol=0)


def test_equal_float32_group_has_exactly_zero_std_and_is_filtered():
    std = reward_std_per_group(EQUAL, ONE_GROUP)
    assert std.dtype == torch.float32
    assert torch.equal(std, torch.zeros(7))
    assert (reward_std_per_group(EQUAL, ONE_GROUP) == 0).float().mean() == 1.0  # frac_reward_zero_std
    assert not filter_groups(EQUAL, ONE_GROUP, min_std=0.0).any()


def test_group_statistics_of_equal_float32_group():
    mean, std, count = group_statistics(EQUAL, ONE_GROUP)
    assert mean.dtype == std.dtype == count.dtype == torch.float32
    assert torch.equal(mean, EQUAL) and torch.equal(std, torch.zeros(7)) and torch.equal(count, torch.full((7,), 7.0))


def test_masked_whiten_of_constant_float32_values_is_zero():
    values = torch.full((3, 4), 0.7, dtype=torch.float32)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    out = masked_whiten(values, mask, 1e-6)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.zeros(3, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_normal_case_matches_hand_values_in_input_dtype(dtype):
    # Group 0: [1, 0, 0.5], mean 0.5, std 0.5; group 1: [2, 4], mean 3, std sqrt(2).
    scores = torch.tensor([1.0, 0.0, 2.0, 0.5, 4.0], dtype=dtype)
    groups = torch.tensor([0, 0, 1, 0, 1])
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    grpo = compute_advantages("grpo", scores, groups, eps=0.0)
    assert grpo.dtype == dtype
    r2 = math.sqrt(2.0)
    expected = torch.tensor([1.0, -1.0, -1 / r2, 0.0, 1 / r2])
    assert torch.allclose(grpo.float(), expected, atol=atol, rtol=0)
    rloo = compute_advantages("rloo", scores, groups)
    assert rloo.dtype == dtype
    assert torch.allclose(rloo.float(), torch.tensor([0.75, -0.75, -2.0, 0.0, 2.0]), atol=atol, rtol=0)
    std = reward_std_per_group(scores, groups)
    assert std.dtype == dtype
    assert torch.allclose(std.float(), torch.tensor([0.5, 0.5, r2, 0.5, r2]), atol=atol, rtol=0)
    assert filter_groups(scores, groups).all()
