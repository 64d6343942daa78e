"""Rollout correction weights and mismatch metrics against hand-computed values; token_weights in the policy loss."""

import math

import pytest
import torch

from grouprl.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    compute_policy_loss,
    rollout_importance_weights,
    rollout_mismatch_metrics,
)

NAN = math.nan
LN = math.log

# Importance ratios pi_old / pi_rollout per token; nan marks a masked position (its log-probs are nan).
#   row 0: 2, 4 (above clip_max 3), 0.25 (below clip_min 0.5)   sequence ratio 2     (inside)
#   row 1: 1.5, 2.5                                             sequence ratio 3.75  (above 3)
#   row 2: 0.8, 0.6                                             sequence ratio 0.48  (below 0.5)
#   row 3: no valid token
RATIOS = [[2.0, 4.0, 0.25, NAN], [1.5, 2.5, NAN, NAN], [0.8, 0.6, NAN, NAN], [NAN, NAN, NAN, NAN]]
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
BOUNDS = {"clip_min": 0.5, "clip_max": 3.0}


def make_log_probs(ratios=RATIOS, dtype=torch.float64):
    """(old, rollout) with exp(old - rollout) = ratio where valid and nan in both where masked."""
    ratios = torch.tensor(ratios, dtype=torch.float64)
    rollout = -1.0 - 0.25 * torch.arange(ratios.numel(), dtype=torch.float64).reshape(ratios.shape)
    old = rollout + torch.log(ratios)
    rollout = torch.where(MASK != 0, rollout, NAN)
    return old.to(dtype), rollout.to(dtype)


def close(actual, expected, atol=1e-12):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert torch.allclose(actual.detach().to(torch.float64), expected, atol=atol, rtol=0), f"\n{actual}\n!=\n{expected}"


EXPECTED_WEIGHTS = {
    ("token", "truncate"): [[2.0, 3.0, 0.5, 0.0], [1.5, 2.5, 0.0, 0.0], [0.8, 0.6, 0.0, 0.0], [0.0] * 4],
    ("token", "mask"): [[2.0, 0.0, 0.0, 0.0], [1.5, 2.5, 0.0, 0.0], [0.8, 0.6, 0.0, 0.0], [0.0] * 4],
    ("sequence", "truncate"): [[2.0, 2.0, 2.0, 0.0], [3.0, 3.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.0] * 4],
    ("sequence", "mask"): [[2.0, 2.0, 2.0, 0.0], [0.0] * 4, [0.0] * 4, [0.0] * 4],
}
# (weight_mean, capped_frac, count): over the 7 valid tokens, or the 3 rows with a valid token.
EXPECTED_STATS = {
    ("token", "truncate"): ((2 + 3 + 0.5 + 1.5 + 2.5 + 0.8 + 0.6) / 7, 2 / 7, 7.0),
    ("token", "mask"): ((2 + 1.5 + 2.5 + 0.8 + 0.6) / 7, 2 / 7, 7.0),
    ("sequence", "truncate"): ((2 + 3 + 0.5) / 3, 2 / 3, 3.0),
    ("sequence", "mask"): (2 / 3, 2 / 3, 3.0),
}
VALID_RATIOS = [2.0, 4.0, 0.25, 1.5, 2.5, 0.8, 0.6]
COMBOS = sorted(EXPECTED_WEIGHTS)


@pytest.mark.parametrize("level,mode", COMBOS)
def test_weights_per_level_and_mode(level, mode):
    old, rollout = make_log_probs()
    weights = rollout_importance_weights(old, rollout, MASK, level=level, mode=mode, **BOUNDS)
    assert weights.dtype == torch.float64 and weights.shape == MASK.shape
    assert torch.isfinite(weights).all()
    close(weights, EXPECTED_WEIGHTS[level, mode])


def test_defaults_are_sequence_mask_with_upper_bound_only():
    old, rollout = make_log_probs()
    # Row 2's ratio 0.48 is kept without clip_min; row 1's 3.75 is still masked.
    close(rollout_importance_weights(old, rollout, MASK), [[2.0, 2.0, 2.0, 0.0], [0.0] * 4, [0.48, 0.48, 0.0, 0.0], [0.0] * 4])


def test_no_bounds_gives_the_plain_ratio():
    old, rollout = make_log_probs()
    expected = torch.nan_to_num(torch.tensor(RATIOS, dtype=torch.float64), nan=0.0)
    for mode in ("truncate", "mask"):
        close(rollout_importance_weights(old, rollout, MASK, level="token", mode=mode, clip_max=None), expected)


@pytest.mark.parametrize("level,mode", COMBOS)
def test_metrics_per_level_and_mode(level, mode):
    old, rollout = make_log_probs()
    weights = rollout_importance_weights(old, rollout, MASK, level=level, mode=mode, **BOUNDS)
    metrics = rollout_mismatch_metrics(old, rollout, MASK, weights, level=level)
    assert set(metrics) == {"mismatch/k3_kl", "mismatch/abs_log_prob_diff", "mismatch/weight_mean", "mismatch/capped_frac"}
    # k3 of KL(rollout || trainer) with r = pi_old / pi_rollout: r - log r - 1.
    k3 = sum(r - LN(r) - 1 for r in VALID_RATIOS) / 7
    assert metrics["mismatch/k3_kl"] == (pytest.approx(k3, abs=1e-12), 7.0)
    assert metrics["mismatch/abs_log_prob_diff"] == (pytest.approx(sum(abs(LN(r)) for r in VALID_RATIOS) / 7, abs=1e-12), 7.0)
    weight_mean, capped_frac, count = EXPECTED_STATS[level, mode]
    assert metrics["mismatch/weight_mean"] == (pytest.approx(weight_mean, abs=1e-12), count)
    assert metrics["mismatch/capped_frac"] == (pytest.approx(capped_frac, abs=1e-12), count)
    assert all(isinstance(v, float) and isinstance(w, float) for v, w in metrics.values())


def test_k3_kl_direction_is_rollout_to_trainer():
    # One token: pi_rollout = 0.5 sampled it, pi_old gives it 0.25. k3 with r = pi_old / pi_rollout = 0.5
    # is 0.5 - log 0.5 - 1; the other direction (r = 2) would give 2 - log 2 - 1.
    old = torch.tensor([[LN(0.25)]], dtype=torch.float64)
    rollout = torch.tensor([[LN(0.5)]], dtype=torch.float64)
    mask = torch.ones(1, 1)
    weights = rollout_importance_weights(old, rollout, mask)
    value, weight = rollout_mismatch_metrics(old, rollout, mask, weights)["mismatch/k3_kl"]
    assert value == pytest.approx(0.5 - LN(0.5) - 1, abs=1e-12) and weight == 1.0


@pytest.mark.parametrize("level,mode", COMBOS)
def test_equal_log_probs_give_weight_one_and_zero_mismatch(level, mode):
    _, rollout = make_log_probs()
    old = rollout.clone()
    weights = rollout_importance_weights(old, rollout, MASK, level=level, mode=mode, **BOUNDS)
    assert torch.equal(weights, (MASK != 0).to(torch.float64))
    metrics = rollout_mismatch_metrics(old, rollout, MASK, weights, level=level)
    count = 7.0 if level == "token" else 3.0
    assert metrics["mismatch/k3_kl"] == (0.0, 7.0)
    assert metrics["mismatch/abs_log_prob_diff"] == (0.0, 7.0)
    assert metrics["mismatch/weight_mean"] == (1.0, count)
    assert metrics["mismatch/capped_frac"] == (0.0, count)


def test_no_valid_token_gives_zero_weight_pairs():
    old, rollout = make_log_probs()
    mask = torch.zeros_like(MASK)
    for level in ("token", "sequence"):
        weights = rollout_importance_weights(old, rollout, mask, level=level)
        assert torch.equal(weights, torch.zeros_like(weights))
        metrics = rollout_mismatch_metrics(old, rollout, mask, weights, level=level)
        assert all(pair == (0.0, 0.0) for pair in metrics.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_enormous_sequence_log_ratio_is_masked_or_clipped_never_nan(dtype, sign):
    # Row 0: four tokens with d = +-500, so exp(sum d) = exp(+-2000) overflows even float64.
    # Row 1: an infinite log-ratio on a valid token (a log-prob of -inf on one side).
    mask = torch.ones(2, 4)
    gap = torch.tensor([[500.0] * 4, [0.0, 0.0, math.inf, 0.0]], dtype=dtype)
    base = torch.full((2, 4), -1.0, dtype=dtype)
    old, rollout = (base, base - gap) if sign > 0 else (base - gap, base)
    cases = {
        # (mode, bounds): expected row weight for d -> +inf, d -> -inf
        ("mask", (None, 3.0)): (0.0, 0.0),
        ("mask", (0.5, 3.0)): (0.0, 0.0),
        ("truncate", (None, 3.0)): (3.0, 0.0),
        ("truncate", (0.5, 3.0)): (3.0, 0.5),
    }
    for (mode, (clip_min, clip_max)), (high, low) in cases.items():
        weights = rollout_importance_weights(old, rollout, mask, mode=mode, clip_min=clip_min, clip_max=clip_max)
        assert weights.dtype == dtype and torch.isfinite(weights).all(), (mode, clip_min, weights)
        assert torch.equal(weights, torch.full_like(weights, high if sign > 0 else low)), (mode, clip_min, weights)
    # Without an upper bound the ratio saturates at exp(700), or the dtype's largest value below that, not inf.
    weights = rollout_importance_weights(old, rollout, mask, mode="truncate", clip_max=None)
    assert torch.isfinite(weights).all()
    if sign > 0:
        saturated = torch.exp(torch.tensor(700.0, dtype=torch.float64)).clamp(max=torch.finfo(dtype).max).to(dtype)
        assert torch.equal(weights, torch.full_like(weights, float(saturated)))
    metrics = rollout_mismatch_metrics(old[:1], rollout[:1], mask[:1], weights[:1])
    assert all(math.isfinite(v) for v, _ in metrics.values())


def test_half_precision_inputs_give_float32_weights():
    old, rollout = make_log_probs(dtype=torch.bfloat16)
    weights = rollout_importance_weights(old, rollout, MASK, level="token", mode="truncate", **BOUNDS)
    assert weights.dtype == torch.float32
    assert torch.equal(weights[MASK == 0], torch.zeros(int((MASK == 0).sum())))


@pytest.mark.parametrize("level,mode", COMBOS)
def test_weights_carry_no_gradient(level, mode):
    old, rollout = make_log_probs()
    old.requires_grad_()
    rollout.requires_grad_()
    weights = rollout_importance_weights(old, rollout, MASK, level=level, mode=mode, **BOUNDS)
    assert not weights.requires_grad and weights.grad_fn is None


# compute_policy_loss with token_weights. Ratios inside the clip range (0.28) so l = -A r on every token.
PL_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
PL_LOG_PROB = [[-1.0, -2.0, -0.5, NAN], [-0.3, -1.2, NAN, NAN]]
PL_RATIOS = [[1.1, 0.9, 1.0, 1.0], [1.2, 0.95, 1.0, 1.0]]
PL_ADV = torch.tensor([[1.0, -2.0, 0.5, NAN], [2.0, -1.0, NAN, NAN]], dtype=torch.float64)
PL_WEIGHTS = torch.tensor([[2.0, 0.5, 0.0, NAN], [3.0, 1.0, NAN, math.inf]], dtype=torch.float64)
# -A r w on valid tokens: [[-2.2, 0.9, 0], [-7.2, 0.95]]


def pl_inputs():
    log_prob = torch.tensor(PL_LOG_PROB, dtype=torch.float64, requires_grad=True)
    old = log_prob.detach() - torch.log(torch.tensor(PL_RATIOS, dtype=torch.float64))
    return log_prob, old


@pytest.mark.parametrize(
    "mode,expected",
    [("token-mean", (-2.2 + 0.9 + 0.0 - 7.2 + 0.95) / 5), ("seq-mean-token-mean", ((-2.2 + 0.9 + 0.0) / 3 + (-7.2 + 0.95) / 2) / 2)],
)
def test_policy_loss_with_token_weights_is_the_weighted_aggregate(mode, expected):
    log_prob, old = pl_inputs()
    weights = PL_WEIGHTS.clone().requires_grad_()
    options = {"clip_ratio_low": 0.28, "clip_ratio_high": 0.28, "loss_agg_mode": mode}
    loss, metrics = compute_policy_loss("vanilla", log_prob, old, PL_ADV, PL_MASK, token_weights=weights, **options)
    close(loss, expected)
    loss.backward()
    # dl/dlog_prob_t = -A_t r_t w_t / (aggregation's denominator for t); 0 at masked positions.
    scale = [[1 / 5] * 4, [1 / 5] * 4] if mode == "token-mean" else [[1 / 6] * 4, [1 / 4] * 4]
    grad = torch.tensor([[-2.2, 0.9, 0.0, 0.0], [-7.2, 0.95, 0.0, 0.0]], dtype=torch.float64) * torch.tensor(scale, dtype=torch.float64)
    close(log_prob.grad, grad)
    assert weights.grad is None  # the weights are a constant
    # The metrics ignore the weights.
    _, unweighted_metrics = compute_policy_loss("vanilla", *pl_inputs(), PL_ADV, PL_MASK, **options)
    assert metrics == unweighted_metrics


def _clip_options(name):
    """A clip range for the losses whose options class declares one (sapo's gate and reinforce have none)."""
    from grouprl.algorithms import POLICY_LOSS_OPTIONS
    from grouprl.algorithms.options import option_names

    options = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_dual": 3.0}
    return {k: v for k, v in options.items() if k in option_names(POLICY_LOSS_OPTIONS[name])}


@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES))
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_loss_with_unit_weights_equals_unweighted_exactly(name, mode):
    ones = torch.where(PL_MASK != 0, 1.0, NAN).to(torch.float64)
    results = []
    for token_weights in (None, ones):
        log_prob, old = pl_inputs()
        loss, metrics = compute_policy_loss(
            name, log_prob, old, PL_ADV, PL_MASK, **_clip_options(name), loss_agg_mode=mode, token_weights=token_weights
        )
        loss.backward()
        results.append((loss.detach(), log_prob.grad, metrics))
    (loss0, grad0, metrics0), (loss1, grad1, metrics1) = results
    assert torch.isfinite(loss0) and torch.isfinite(grad0).all()
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1) and metrics0 == metrics1


def test_bad_arguments_raise_clear_errors():
    old, rollout = make_log_probs()
    with pytest.raises(ValueError, match="unknown rollout correction level 'tok'.*token, sequence"):
        rollout_importance_weights(old, rollout, MASK, level="tok")
    with pytest.raises(ValueError, match="unknown rollout correction mode 'clip'.*truncate, mask"):
        rollout_importance_weights(old, rollout, MASK, mode="clip")
    with pytest.raises(ValueError, match=r"share one \[B, T\] shape; got \(4, 4\), \(4, 3\), \(4, 4\)"):
        rollout_importance_weights(old, rollout[:, :3], MASK)
    with pytest.raises(ValueError, match=r"share one \[B, T\] shape"):
        rollout_importance_weights(old[0], rollout[0], MASK[0])
    with pytest.raises(ValueError, match="clip_min must not exceed clip_max; got clip_min=4.0 > clip_max=3.0"):
        rollout_importance_weights(old, rollout, MASK, clip_min=4.0)
    with pytest.raises(ValueError, match="clip_max must be > 0"):
        rollout_importance_weights(old, rollout, MASK, clip_max=0.0)
    with pytest.raises(ValueError, match="clip_min must be >= 0"):
        rollout_importance_weights(old, rollout, MASK, clip_min=-1.0)
    with pytest.raises(ValueError, match="rollout_log_prob must be a floating-point tensor"):
        rollout_importance_weights(old, torch.zeros(4, 4, dtype=torch.long), MASK)
    weights = rollout_importance_weights(old, rollout, MASK)
    with pytest.raises(ValueError, match="unknown rollout correction level 'seq'"):
        rollout_mismatch_metrics(old, rollout, MASK, weights, level="seq")
    with pytest.raises(ValueError, match=r"weights must have shape \(4, 4\); got \(4,\)"):
        rollout_mismatch_metrics(old, rollout, MASK, weights[:, 0])
    log_prob, old_pl = pl_inputs()
    with pytest.raises(ValueError, match=r"token_weights must have shape \(2, 4\); got \(2, 3\)"):
        compute_policy_loss(
            "vanilla", log_prob, old_pl, PL_ADV, PL_MASK, clip_ratio_low=0.2, clip_ratio_high=0.2, token_weights=torch.ones(2, 3)
        )
