"""Policy losses against hand-computed values, gradients and clip metrics."""

import math

import pytest
import torch

from grouprl.algorithms import POLICY_LOSS_OPTIONS, POLICY_LOSSES, PolicyLossTerms, compute_policy_loss, register_policy_loss

LN = math.log


def make_log_probs(ratios, log_prob):
    """log_prob as a leaf requiring grad, and old_log_prob such that exp(log_prob - old) = ratios."""
    log_prob = torch.tensor(log_prob, dtype=torch.float64, requires_grad=True)
    old = log_prob.detach() - torch.log(torch.tensor(ratios, dtype=torch.float64))
    return log_prob, old


def close(actual, expected, atol=1e-9):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert torch.allclose(actual.detach().to(torch.float64), expected, atol=atol, rtol=0), f"\n{actual}\n!=\n{expected}"


# Vanilla PPO fixture: eps_low 0.2, eps_high 0.28, mask with one padded token.
V_RATIOS = [[1.5, 0.5, 1.1], [0.5, 4.0, 2.0]]
V_ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
V_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# Per-token losses max(-A r, -A clip(r, 0.8, 1.28)):
#   row 0: max(-1.5, -1.28) = -1.28 (upper clip), max(-0.5, -0.8) = -0.5, -1.1
#   row 1: max(1.0, 1.6) = 1.6 (lower clip), max(8, 2.56) = 8 -> dual min(8, 2 * 3) = 6, padding.


def test_vanilla_dual_clip_value_gradient_metrics():
    log_prob, old = make_log_probs(V_RATIOS, [[-1.0, -2.0, -0.5], [-0.3, -1.0, -4.0]])
    loss, metrics = compute_policy_loss(
        "vanilla", log_prob, old, V_ADV, V_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=3.0
    )
    close(loss, (-1.28 - 0.5 - 1.1 + 1.6 + 6.0) / 5)
    loss.backward()
    # dl/dlog_prob = -A r where the unclipped branch is active, 0 where any clip binds.
    close(log_prob.grad, [[0.0, -0.5 / 5, -1.1 / 5], [0.0, 0.0, 0.0]])
    assert metrics["clipfrac"] == pytest.approx(3 / 5)
    assert metrics["clipfrac_high"] == pytest.approx(1 / 5)
    assert metrics["clipfrac_low"] == pytest.approx(1 / 5)
    assert metrics["dual_clipfrac"] == pytest.approx(1 / 5)
    assert metrics["ppo_kl"] == pytest.approx(-LN(1.5 * 0.5 * 1.1 * 0.5 * 4.0) / 5)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.5 + 4.0) / 5)
    assert all(isinstance(v, float) for v in metrics.values())


def test_vanilla_without_dual_clip():
    log_prob, old = make_log_probs(V_RATIOS, [[-1.0, -2.0, -0.5], [-0.3, -1.0, -4.0]])
    loss, metrics = compute_policy_loss("vanilla", log_prob, old, V_ADV, V_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28)
    close(loss, (-1.28 - 0.5 - 1.1 + 1.6 + 8.0) / 5)
    loss.backward()
    close(log_prob.grad, [[0.0, -0.5 / 5, -1.1 / 5], [0.0, 2.0 * 4.0 / 5, 0.0]])
    assert metrics["clipfrac"] == pytest.approx(2 / 5)
    assert metrics["dual_clipfrac"] == 0.0


def test_vanilla_symmetric_clip_at_ratio_one_is_policy_gradient():
    log_prob, old = make_log_probs([[1.0, 1.0]], [[-1.0, -2.0]])
    adv = torch.tensor([[0.5, -1.5]], dtype=torch.float64)
    loss, metrics = compute_policy_loss("vanilla", log_prob, old, adv, torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.2)
    close(loss, (-0.5 + 1.5) / 2)
    loss.backward()
    close(log_prob.grad, [[-0.5 / 2, 1.5 / 2]])
    assert metrics["clipfrac"] == 0.0 and metrics["ppo_kl"] == 0.0 and metrics["ratio_mean"] == 1.0


def test_dual_clip_must_exceed_one():
    log_prob, old = make_log_probs([[1.0]], [[-1.0]])
    with pytest.raises(ValueError, match="clip_ratio_dual"):
        compute_policy_loss("vanilla", log_prob, old, torch.ones(1, 1), torch.ones(1, 1), clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_dual=0.9)


def test_log_ratio_is_clamped():
    # d = 50 is clamped to 20: the ratio stays finite.
    log_prob = torch.tensor([[0.0]], dtype=torch.float64)
    old = torch.tensor([[-50.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0]], dtype=torch.float64)
    loss, metrics = compute_policy_loss("vanilla", log_prob, old, adv, torch.ones(1, 1), clip_ratio_low=0.2, clip_ratio_high=0.2)
    close(loss, math.exp(20.0), atol=1e-3)
    assert metrics["ppo_kl"] == pytest.approx(-20.0)


# GSPO fixture: B = 2 rows, R = 3 columns (B != R), ragged mask.
# Row 0: d = [ln 2, ln 4, 0], all valid -> log s0 = ln(8) / 3 = ln 2, s0 = 2.
# Row 1: d = [ln 1/4, 0, ln 100 (padding)], 2 valid -> log s1 = ln(1/4) / 2 = ln 1/2, s1 = 1/2.
G_RATIOS = [[2.0, 4.0, 1.0], [0.25, 1.0, 100.0]]
G_LOGP = [[-1.0, -0.7, -2.0], [-0.2, -1.5, -9.0]]
G_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
G_ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_clipped_values_and_metrics(name):
    log_prob, old = make_log_probs(G_RATIOS, G_LOGP)
    loss, metrics = compute_policy_loss(
        name, log_prob, old, G_ADV, G_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-mean"
    )
    # s0 = 2 > 1.28 with A > 0: -1.28 per token; s1 = 0.5 < 0.8 with A < 0: 0.8 per token.
    close(loss, (-1.28 + 0.8) / 2)
    assert metrics["clipfrac"] == pytest.approx(1.0)
    assert metrics["clipfrac_high"] == pytest.approx(3 / 5)
    assert metrics["clipfrac_low"] == pytest.approx(2 / 5)
    assert metrics["ratio_mean"] == pytest.approx((3 * 2.0 + 2 * 0.5) / 5)
    loss.backward()
    close(log_prob.grad, torch.zeros(2, 3))


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_unclipped_gradient_spreads_over_the_sequence(name):
    log_prob, old = make_log_probs(G_RATIOS, G_LOGP)
    loss, metrics = compute_policy_loss(
        name, log_prob, old, G_ADV, G_MASK, clip_ratio_low=0.6, clip_ratio_high=1.5, loss_agg_mode="seq-mean-token-mean"
    )
    # Sequence terms -A s: -2 and +0.5; mean over 2 sequences.
    close(loss, (-2.0 + 0.5) / 2)
    assert metrics["clipfrac"] == 0.0
    loss.backward()
    # d/dlog_prob_t of (1/2) (-A_i s_i) = (1/2) (-A_i) s_i / |y_i| for every valid token of row i.
    close(log_prob.grad, [[-1 / 3, -1 / 3, -1 / 3], [0.125, 0.125, 0.0]])


def test_gspo_token_level_advantages_differ_between_forms():
    adv = torch.tensor([[1.0, 2.0, 3.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    grads = {}
    for name in ("gspo", "gspo_token"):
        log_prob, old = make_log_probs(G_RATIOS, G_LOGP)
        loss, _ = compute_policy_loss(
            name, log_prob, old, adv, G_MASK, clip_ratio_low=0.6, clip_ratio_high=1.5, loss_agg_mode="seq-mean-token-sum"
        )
        # Both values: (sum_t -A_t s_i) / 2 = (-(1 + 2 + 3) * 2 + 2 * 0.5) / 2.
        close(loss, (-12.0 + 1.0) / 2)
        loss.backward()
        grads[name] = log_prob.grad
    # gspo_token: token t gets -A_t s_i / 2; gspo: every token gets -(sum_t A_t) s_i / |y_i| / 2.
    close(grads["gspo_token"], [[-1.0, -2.0, -3.0], [0.25, 0.25, 0.0]])
    close(grads["gspo"], [[-2.0, -2.0, -2.0], [0.25, 0.25, 0.0]])


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gspo_shapes_batch_larger_than_one(name, mode):
    # EasyR1 #595: a [B] sequence ratio multiplied with a [B, R] mask fails when B != R.
    torch.manual_seed(0)
    B, R = 4, 7
    log_prob = (-torch.rand(B, R)).requires_grad_()
    old = log_prob.detach() + 0.01 * torch.randn(B, R)
    mask = (torch.arange(R) < torch.tensor([[7], [3], [1], [5]])).long()
    adv = torch.randn(B, 1).expand(B, R).contiguous()
    loss, metrics = compute_policy_loss(name, log_prob, old, adv, mask, clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode=mode)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert torch.all(log_prob.grad[mask == 0] == 0)
    assert 0.0 <= metrics["clipfrac"] <= 1.0


def test_gspo_ignores_padding_log_probs():
    log_prob, old = make_log_probs(G_RATIOS, G_LOGP)
    base, _ = compute_policy_loss("gspo", log_prob, old, G_ADV, G_MASK, clip_ratio_low=0.6, clip_ratio_high=1.5)
    garbage = log_prob.detach().clone()
    garbage[1, 2] = 1e4
    changed, _ = compute_policy_loss("gspo", garbage, old, G_ADV, G_MASK, clip_ratio_low=0.6, clip_ratio_high=1.5)
    close(changed, base.detach())


def test_cispo():
    log_prob, old = make_log_probs([[2.0, 1.1], [0.5, 3.0]], [[-1.0, -2.0], [-0.5, -3.0]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = compute_policy_loss("cispo", log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # Weights clip(r, 0.8, 1.28) = [1.28, 1.1], [0.8, -]; l = -w A log_prob = 1.28, 2.2, -0.8.
    close(loss, (1.28 + 2.2 - 0.8) / 3)
    loss.backward()
    # The weight is detached: dl/dlog_prob = -w A, also on clipped tokens.
    close(log_prob.grad, [[-1.28 / 3, -1.1 / 3], [1.6 / 3, 0.0]])
    assert metrics["clipfrac_high"] == pytest.approx(1 / 3)
    assert metrics["clipfrac_low"] == pytest.approx(1 / 3)
    assert metrics["clipfrac"] == pytest.approx(2 / 3)


def test_sapo():
    log_prob, old = make_log_probs([[1.0, 2.0]], [[-1.0, -2.0]])
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, metrics = compute_policy_loss("sapo", log_prob, old, adv, torch.ones(1, 2))
    # Token 0: A > 0, tau 1, r = 1: -1 * 4 * sigmoid(0) = -2.
    # Token 1: A < 0, tau 1.05, r = 2: (4 / 1.05) * sigmoid(1.05), sigmoid(1.05) = 0.7407748991...
    sig = 0.740774899182154
    close(loss, (-2.0 + (4 / 1.05) * sig) / 2)
    loss.backward()
    # Token 0: -A * 4 * sigmoid'(0) * r = -1 (PPO's gradient at r = 1). Token 1: 4 sig (1 - sig) * 2.
    close(log_prob.grad, [[-1.0 / 2, 4 * sig * (1 - sig) * 2.0 / 2]])
    assert metrics["clipfrac"] == 0.0


def test_sapo_taus_are_options():
    log_prob, old = make_log_probs([[1.0, 1.0]], [[-1.0, -2.0]])
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, _ = compute_policy_loss(
        "sapo", log_prob, old, adv, torch.ones(1, 2), sapo_tau_pos=2.0, sapo_tau_neg=4.0
    )
    # -1 * (4 / 2) * 0.5 = -1 and +1 * (4 / 4) * 0.5 = 0.5.
    close(loss, (-1.0 + 0.5) / 2)


def test_aggregation_options_pass_through():
    log_prob, old = make_log_probs(V_RATIOS, [[-1.0, -2.0, -0.5], [-0.3, -1.0, -4.0]])
    loss, _ = compute_policy_loss(
        "vanilla", log_prob, old, V_ADV, V_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28,
        loss_agg_mode="seq-mean-token-sum-norm", num_seqs=4, norm_len=10,
    )
    close(loss, (-1.28 - 0.5 - 1.1 + 1.6 + 8.0) / 40)


def test_unknown_policy_loss_and_option():
    log_prob, old = make_log_probs([[1.0]], [[-1.0]])
    ones = torch.ones(1, 1)
    with pytest.raises(ValueError, match="valid names") as info:
        compute_policy_loss("ppo2", log_prob, old, ones, ones, clip_ratio_low=0.2, clip_ratio_high=0.2)
    for name in ("vanilla", "gspo", "gspo_token", "cispo", "sapo"):
        assert name in str(info.value)
    with pytest.raises(TypeError, match="sapo_tau_pos"):
        compute_policy_loss("vanilla", log_prob, old, ones, ones, sapo_tau_pos=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_policy_loss("vanilla", log_prob, old, ones, ones, clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="mean")


def test_shape_mismatch_is_reported():
    log_prob, old = make_log_probs([[1.0, 1.0]], [[-1.0, -1.0]])
    with pytest.raises(ValueError, match="shape"):
        compute_policy_loss("vanilla", log_prob, old, torch.ones(1), torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.2)


def test_register_custom_policy_loss():
    @register_policy_loss("test_pg")
    def plain_pg(log_prob, old_log_prob, advantages, response_mask):
        never = torch.zeros_like(log_prob, dtype=torch.bool)
        return PolicyLossTerms(-advantages * log_prob, torch.ones_like(log_prob), never, never)

    try:
        log_prob, old = make_log_probs([[1.0, 1.0]], [[-1.0, -3.0]])
        adv = torch.tensor([[2.0, 1.0]], dtype=torch.float64)
        loss, metrics = compute_policy_loss("test_pg", log_prob, old, adv, torch.ones(1, 2))
        close(loss, (2.0 + 3.0) / 2)
        assert metrics["clipfrac"] == 0.0
        # it declares no options: a clip range given to it is refused, naming it
        with pytest.raises(TypeError, match="'test_pg' takes no option 'clip_ratio_low'.*takes no options"):
            compute_policy_loss("test_pg", log_prob, old, adv, torch.ones(1, 2), clip_ratio_low=0.2)
    finally:
        del POLICY_LOSSES["test_pg"]
        POLICY_LOSS_OPTIONS.pop("test_pg", None)


def test_a_new_loss_is_one_function_and_one_registration_with_its_options():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class ScaledOptions:
        scale: float = 2.0

    @register_policy_loss("test_scaled", options=ScaledOptions)
    def scaled_pg(log_prob, old_log_prob, advantages, response_mask, *, scale=2.0):
        never = torch.zeros_like(log_prob, dtype=torch.bool)
        return PolicyLossTerms(-scale * advantages * log_prob, torch.ones_like(log_prob), never, never)

    try:
        assert POLICY_LOSS_OPTIONS["test_scaled"] is ScaledOptions
        log_prob, old = make_log_probs([[1.0, 1.0]], [[-1.0, -3.0]])
        adv = torch.tensor([[2.0, 1.0]], dtype=torch.float64)
        close(compute_policy_loss("test_scaled", log_prob, old, adv, torch.ones(1, 2))[0], 2 * (2.0 + 3.0) / 2)
        close(compute_policy_loss("test_scaled", log_prob, old, adv, torch.ones(1, 2), scale=1.0)[0], (2.0 + 3.0) / 2)
        with pytest.raises(TypeError, match="'test_scaled' takes no option 'scal'.*did you mean 'scale'"):
            compute_policy_loss("test_scaled", log_prob, old, adv, torch.ones(1, 2), scal=1.0)
        # an options class with a field the function does not take is refused when registered
        @dataclass(frozen=True)
        class Wrong:
            temperature: float = 1.0

        with pytest.raises(TypeError, match="test_wrong.*temperature"):
            register_policy_loss("test_wrong", options=Wrong)(scaled_pg)
    finally:
        del POLICY_LOSSES["test_scaled"]
        POLICY_LOSS_OPTIONS.pop("test_scaled", None)


def test_cispo_without_lower_cap():
    # CISPO caps the weight only above: clip_ratio_low=None, ratio cap 1 + 4 = 5.
    log_prob, old = make_log_probs([[0.01, 10.0], [0.5, 3.0]], [[-1.0, -2.0], [-0.5, -3.0]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 1]])
    loss, metrics = compute_policy_loss("cispo", log_prob, old, adv, mask, clip_ratio_low=None, clip_ratio_high=4.0)
    # Weights [0.01 (no floor), 5 (capped)], [0.5, 3]; l = -w A log_prob = 0.01, 10, -0.5, -18.
    close(loss, (0.01 + 10.0 - 0.5 - 18.0) / 4)
    loss.backward()
    close(log_prob.grad, [[-0.01 / 4, -5.0 / 4], [1.0 / 4, 6.0 / 4]])
    assert metrics["clipfrac_low"] == 0.0
    assert metrics["clipfrac_high"] == pytest.approx(1 / 4)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gspo_token"])
def test_clip_ratio_low_none_is_rejected_by_losses_that_need_it(name):
    log_prob, old = make_log_probs([[1.0]], [[-1.0]])
    ones = torch.ones(1, 1)
    with pytest.raises(ValueError, match=f"{name!r}.*clip_ratio_low.*cispo"):
        compute_policy_loss(name, log_prob, old, ones, ones, clip_ratio_low=None, clip_ratio_high=0.2)


def test_an_option_the_loss_does_not_take_names_the_option_and_the_loss():
    log_prob, old = make_log_probs([[1.0]], [[-1.0]])
    ones = torch.ones(1, 1)
    # sapo has no clip: a clip range given to it is a mistake, not silently dropped
    with pytest.raises(TypeError, match="policy loss 'sapo' takes no option 'clip_ratio_low'.*sapo_tau_pos"):
        compute_policy_loss("sapo", log_prob, old, ones, ones, clip_ratio_low=None, clip_ratio_high=None)
    loss, _ = compute_policy_loss("sapo", log_prob, old, ones, ones)
    close(loss, -2.0)


def test_options_not_given_take_the_options_class_defaults():
    from grouprl.algorithms import POLICY_LOSS_OPTIONS, POLICY_LOSSES
    from grouprl.algorithms.options import option_defaults

    log_prob, old = make_log_probs([[1.3, 0.8], [0.9, 1.1]], [[-1.0, -0.4], [-0.2, -0.5]])
    adv = torch.tensor([[1.0, -2.0], [-0.5, 0.7]], dtype=torch.float64)
    mask = torch.ones(2, 2)
    for name in POLICY_LOSSES.names():
        defaults = option_defaults(POLICY_LOSS_OPTIONS[name])
        implicit, _ = compute_policy_loss(name, log_prob, old, adv, mask)
        explicit, _ = compute_policy_loss(name, log_prob, old, adv, mask, **defaults)
        close(implicit, explicit)
        # the function's own defaults are the class's: a direct call behaves as the registered loss
        import inspect
        params = inspect.signature(POLICY_LOSSES.get(name)).parameters
        assert {k: params[k].default for k in defaults} == defaults, name
