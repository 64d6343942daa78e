"""KL estimators and group filtering / overlong shaping / truncation masks."""

import math

import pytest
import torch

from grouprl.algorithms import (
    KL_ESTIMATORS,
    filter_groups,
    kl_penalty,
    mask_truncated,
    overlong_penalty,
    reward_std_per_group,
)

# delta = log_prob - ref_log_prob = [0, 1, -1, 2, -3, -25, 30]
LOG_PROB = torch.tensor([-1.0, -1.0, -2.0, 0.0, -4.0, -30.0, 0.0], dtype=torch.float64)
REF_LOG_PROB = torch.tensor([-1.0, -2.0, -1.0, -2.0, -1.0, -5.0, -30.0], dtype=torch.float64)
E = math.e


def close(actual, expected, atol=1e-9):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert torch.allclose(actual, expected, atol=atol, rtol=0), f"\n{actual}\n!=\n{expected}"


@pytest.mark.parametrize("kind", ["k1", "kl"])
def test_k1(kind):
    close(kl_penalty(LOG_PROB, REF_LOG_PROB, kind), [0, 1, -1, 2, -3, -25, 30])


def test_abs():
    close(kl_penalty(LOG_PROB, REF_LOG_PROB, "abs"), [0, 1, 1, 2, 3, 25, 30])


@pytest.mark.parametrize("kind", ["k2", "mse"])
def test_k2(kind):
    close(kl_penalty(LOG_PROB, REF_LOG_PROB, kind), [0, 0.5, 0.5, 2.0, 4.5, 312.5, 450.0])


@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_k3_with_clamps(kind):
    # exp(-d) + d - 1: d=1 -> 1/e; d=-1 -> e - 2; d=2 -> e^-2 + 1; d=-3 -> e^3 - 4 = 16.09 -> clamped 10;
    # d=-25 -> -d clamped to 20, e^20 - 21 -> 10; d=30 -> -d clamped to -20, e^-20 + 19 -> 10.
    close(kl_penalty(LOG_PROB, REF_LOG_PROB, kind), [0, 1 / E, E - 2, E**-2 + 1, 10, 10, 10])


def test_k3_gradient_is_finite_for_extreme_ratios():
    log_prob = LOG_PROB.clone().requires_grad_()
    kl_penalty(log_prob, REF_LOG_PROB, "k3").sum().backward()
    assert torch.isfinite(log_prob.grad).all()


def test_kl_keeps_shape():
    assert kl_penalty(torch.zeros(2, 5), torch.zeros(2, 5), "low_var_kl").shape == (2, 5)


def test_unknown_kl_lists_kinds():
    with pytest.raises(ValueError, match="valid kinds") as info:
        kl_penalty(LOG_PROB, REF_LOG_PROB, "k4")
    for kind in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"):
        assert kind in str(info.value)
    assert set(KL_ESTIMATORS) == {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"}


# Groups: 5 -> [1, 1] (no spread); 9 -> [0, 1] (std sqrt(1/2));
# 2 -> [0.5, 0.55] (std 0.05 / sqrt(2) = 0.0354); 100 -> [3] alone (std 0).
F_SCORES = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.55, 3.0, 1.0], dtype=torch.float64)
F_GROUPS = torch.tensor([5, 9, 9, 2, 2, 100, 5])


def test_reward_std_per_group():
    s9, s2 = math.sqrt(0.5), 0.05 / math.sqrt(2)
    close(reward_std_per_group(F_SCORES, F_GROUPS), [0, s9, s9, s2, s2, 0, 0], atol=1e-12)


def test_filter_groups_dapo_drops_groups_without_spread_and_singletons():
    keep = filter_groups(F_SCORES, F_GROUPS)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, True, True, True, True, False, False]


def test_filter_groups_chexpo_threshold():
    keep = filter_groups(F_SCORES, F_GROUPS, min_std=0.06)
    assert keep.tolist() == [False, True, True, False, False, False, False]


def test_overlong_penalty():
    lengths = torch.tensor([3, 6, 7, 8, 10, 11, 20])
    # max 10, buffer 4: free up to 6, then (6 - L) / 4, then -1 beyond 10.
    close(overlong_penalty(lengths, max_length=10, buffer_length=4), [0, 0, -0.25, -0.5, -1, -1, -1])
    close(overlong_penalty(lengths, max_length=10, buffer_length=4, penalty_factor=0.5), [0, 0, -0.125, -0.25, -0.5, -0.5, -0.5])


def test_overlong_penalty_rejects_bad_buffer():
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([1]), max_length=10, buffer_length=0)
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([1]), max_length=10, buffer_length=11)


def test_mask_truncated_float_and_bool():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    truncated = torch.tensor([False, True, False])
    out = mask_truncated(mask, truncated)
    assert out.dtype == mask.dtype
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert mask_truncated(mask.bool(), truncated).tolist() == [[True, True, False], [False, False, False], [True, False, False]]
    assert mask.sum() == 6  # input left untouched
