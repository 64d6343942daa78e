"""nan / inf at masked positions (padding, template or edited tokens) reach neither a loss nor its gradient.

Masking by multiplication lets them through (nan * 0 = nan, inf * 0 = nan), and a select on the
output alone still lets them into the gradient through upstream ops (exp's backward is
grad * exp(x) = 0 * nan). These tests put garbage at masked positions and compare with clean values.
"""

import math

import pytest
import torch

from grouprl.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    compute_advantages,
    compute_policy_loss,
    kl_penalty,
    masked_whiten,
)
from grouprl.algorithms.policy_losses import sequence_log_ratio

BAD = [math.nan, math.inf, -math.inf]
# Trailing padding, a hole in the middle (template tokens of a multi-turn response) and an empty row.
MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 0, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
MASKED = MASK == 0


def _clean_batch():
    generator = torch.Generator().manual_seed(3)
    B, R = MASK.shape
    log_prob = -torch.rand(B, R, generator=generator, dtype=torch.float64) - 0.1
    old = log_prob + 0.2 * torch.randn(B, R, generator=generator, dtype=torch.float64)
    adv = torch.randn(B, R, generator=generator, dtype=torch.float64)
    return log_prob, old, adv


def _spoil(tensor, value):
    spoilt = tensor.clone()
    spoilt[MASKED] = value
    return spoilt


def _clip_options(name):
    """A clip range for the losses whose options class declares one (sapo's gate and reinforce have none)."""
    from grouprl.algorithms import POLICY_LOSS_OPTIONS
    from grouprl.algorithms.options import option_names

    options = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_dual": 3.0}
    return {k: v for k, v in options.items() if k in option_names(POLICY_LOSS_OPTIONS[name])}


def _loss_and_grad(name, mode, log_prob, old, adv):
    leaf = log_prob.clone().requires_grad_()
    loss, metrics = compute_policy_loss(name, leaf, old, adv, MASK, **_clip_options(name), loss_agg_mode=mode)
    loss.backward()
    return loss.detach(), leaf.grad, metrics


@pytest.mark.parametrize("bad", BAD, ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("where", ["log_prob", "old_log_prob", "advantages", "all"])
@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES))
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_loss_ignores_nonfinite_values_at_masked_positions(name, mode, where, bad):
    log_prob, old, adv = _clean_batch()
    clean_loss, clean_grad, _ = _loss_and_grad(name, mode, log_prob, old, adv)
    spoilt = {
        "log_prob": _spoil(log_prob, bad) if where in ("log_prob", "all") else log_prob,
        "old": _spoil(old, bad) if where in ("old_log_prob", "all") else old,
        "adv": _spoil(adv, bad) if where in ("advantages", "all") else adv,
    }
    loss, grad, metrics = _loss_and_grad(name, mode, spoilt["log_prob"], spoilt["old"], spoilt["adv"])
    assert torch.isfinite(loss)
    assert torch.allclose(loss, clean_loss, atol=1e-12, rtol=0)
    assert torch.isfinite(grad).all()
    assert torch.all(grad[MASKED] == 0)
    assert torch.allclose(grad, clean_grad, atol=1e-12, rtol=0)
    assert all(math.isfinite(value) for value in metrics.values()), metrics


@pytest.mark.parametrize("bad", BAD, ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES))
def test_aggregate_loss_ignores_nonfinite_values_at_masked_positions(mode, bad):
    _, _, values = _clean_batch()
    clean = aggregate_loss(values, MASK, mode)
    leaf = _spoil(values, bad).requires_grad_()
    value = aggregate_loss(leaf, MASK, mode)
    assert torch.isfinite(value) and torch.allclose(value, clean, atol=1e-12, rtol=0)
    value.backward()
    assert torch.isfinite(leaf.grad).all() and torch.all(leaf.grad[MASKED] == 0)


@pytest.mark.parametrize("bad", BAD, ids=["nan", "+inf", "-inf"])
def test_sequence_log_ratio_ignores_nonfinite_values_at_masked_positions(bad):
    log_prob, old, _ = _clean_batch()
    clean = sequence_log_ratio(log_prob, old, MASK)
    leaf = _spoil(log_prob, bad).requires_grad_()
    value = sequence_log_ratio(leaf, _spoil(old, bad), MASK)
    assert torch.allclose(value, clean, atol=1e-12, rtol=0)
    value.sum().backward()
    assert torch.isfinite(leaf.grad).all() and torch.all(leaf.grad[MASKED] == 0)


@pytest.mark.parametrize("bad", BAD, ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
def test_kl_penalty_with_mask_ignores_nonfinite_ref_log_probs(kind, bad):
    log_prob, ref, _ = _clean_batch()
    clean = kl_penalty(log_prob, ref, kind, response_mask=MASK)
    assert torch.all(clean[MASKED] == 0)
    assert torch.equal(clean[~MASKED], kl_penalty(log_prob, ref, kind)[~MASKED])
    leaf = _spoil(log_prob, bad).requires_grad_()
    kl = kl_penalty(leaf, _spoil(ref, bad), kind, response_mask=MASK)
    assert torch.equal(kl, clean)
    aggregate_loss(kl, MASK, "token-mean").backward()
    assert torch.isfinite(leaf.grad).all() and torch.all(leaf.grad[MASKED] == 0)


@pytest.mark.parametrize("bad", BAD, ids=["nan", "+inf", "-inf"])
def test_masked_whiten_ignores_nonfinite_values_at_masked_positions(bad):
    _, _, values = _clean_batch()
    out = masked_whiten(_spoil(values, bad), MASK, 1e-6)
    assert torch.allclose(out, masked_whiten(values, MASK, 1e-6), atol=1e-12, rtol=0)
    assert torch.all(out[MASKED] == 0)


@pytest.mark.parametrize("bad", BAD, ids=["nan", "+inf", "-inf"])
def test_reinforce_plus_plus_ignores_nonfinite_token_rewards_at_masked_positions(bad):
    _, _, token_rewards = _clean_batch()
    scores = torch.tensor([1.0, 0.0, -1.0, 2.0], dtype=torch.float64)
    groups = torch.arange(4)
    options = {"response_mask": MASK, "gamma": 0.9}
    clean = compute_advantages("reinforce_plus_plus", scores, groups, token_rewards=token_rewards, **options)
    spoilt = compute_advantages("reinforce_plus_plus", scores, groups, token_rewards=_spoil(token_rewards, bad), **options)
    assert torch.isfinite(spoilt).all()
    assert torch.allclose(spoilt, clean, atol=1e-12, rtol=0)
