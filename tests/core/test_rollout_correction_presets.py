"""verl's rollout correction (rejection sampling, TIS / IcePop, batch normalisation, bypass mode, presets)
against a transcription of verl's code on the same tensors, its config rules, and two tiny runs.

The ``verl_*`` functions below transcribe verl 0.9.1 (``verl/trainer/ppo/rollout_corr_helper.py``:
``_parse_rollout_rs_thresholds``, ``compute_rollout_rejection_mask``, ``compute_rollout_correction_weights``,
``compute_is_metrics``, ``compute_offpolicy_metrics``; ``verl/trainer/ppo/core_algos.py``:
``compute_policy_loss_bypass_mode``, ``compute_policy_loss_reinforce``, ``compute_policy_loss_vanilla``,
``agg_loss``; ``verl/trainer/config/algorithm.py``: ``RolloutCorrectionConfig``'s classmethods), with
``verl_F.masked_mean`` / ``masked_sum`` as in ``verl/utils/torch_functional.py``. verl cannot be imported
here (it needs ray). Only the metric keys grouprl logs are transcribed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from grouprl import algorithms
from grouprl.config import ConfigError, config_from_dict
from grouprl.config.rollout_correction import VERL_PRESET_NAMES, resolve_verl_correction

SAFETY_BOUND = 20.0
KEY = "algorithm.rollout_correction"


# ------------------------------------------------------------------------------------------ verl, transcribed


def masked_sum(values, mask, axis=None):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def verl_parse_rs_thresholds(options, spec):
    raw = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(raw) == 1 and len(options) > 1:
        raw = raw * len(options)
    out = {}
    for option, s in zip(options, raw):
        if option.endswith("k1"):
            if "_" in s:
                lo, hi = s.split("_", 1)
            else:
                hi, lo = s, str(1.0 / float(s))
            out[option] = {"lower": float(lo), "upper": float(hi)}
        else:
            out[option] = {"lower": None, "upper": float(s)}
    return out


def verl_rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold):
    options = []
    for opt in (o.strip() for o in rollout_rs.split(",") if o.strip()):
        if opt not in options:
            options.append(opt)
    specs = verl_parse_rs_thresholds(options, rollout_rs_threshold)
    lr = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    token = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1.0 - lr}
    mask_bool = response_mask.bool()
    seq_valid = response_mask.sum(dim=-1) > 0
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics = {}
    for name in options:
        is_k1 = name.endswith("k1")
        upper, lower = specs[name]["upper"], specs[name]["lower"]
        lower_log = math.log(lower) if is_k1 else None
        upper_log = math.log(upper) if is_k1 else None
        stat = token[name[-2:]]
        if name.startswith("token"):
            per_token = stat
            keep = (stat >= lower_log) & (stat <= upper_log) if is_k1 else stat <= upper
        else:
            if name.startswith("seq_sum"):
                seq = masked_sum(stat, response_mask, axis=-1)
            elif name.startswith("seq_mean"):
                seq = masked_mean(stat, response_mask, axis=-1)
            else:
                neg_inf = torch.tensor(float("-inf"), dtype=stat.dtype)
                mx = stat.masked_fill(~mask_bool, neg_inf).max(dim=-1).values
                seq = torch.where(mx == neg_inf, torch.zeros_like(mx), mx)
            direct = (seq >= lower_log) & (seq <= upper_log) if is_k1 else seq <= upper
            keep = direct.unsqueeze(-1).expand_as(mask_bool)
            per_token = seq.unsqueeze(-1).expand_as(response_mask)
        metrics[f"rollout_rs_{name}_mean"] = masked_mean(per_token, response_mask).item()
        keep_f = keep.to(log_ratio.dtype)
        combined = combined * keep_f
        seq_keep = (~((~keep) & mask_bool)).all(dim=-1)
        metrics[f"rollout_rs_{name}_masked_fraction"] = masked_mean(1 - keep_f, response_mask).item()
        sv = seq_valid.float()
        metrics[f"rollout_rs_{name}_seq_masked_fraction"] = (((1.0 - seq_keep.to(log_ratio.dtype)) * sv).sum()
                                                             / sv.sum()).item()
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - combined, response_mask).item()
    final_keep = (combined > 0.5) & mask_bool
    metrics["rollout_rs_seq_masked_fraction"] = (~final_keep & mask_bool).any(dim=-1).float().mean().item()
    return (response_mask * combined).to(dtype=response_mask.dtype), metrics


def verl_correction_weights(log_ratio, response_mask, rollout_is, threshold, batch_normalize=False):
    if "_" in str(threshold):
        lower, upper = (float(x) for x in str(threshold).split("_", 1))
    else:
        lower, upper = None, float(threshold)
    if rollout_is == "token":
        for_metrics = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        for_metrics = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        raw = torch.exp(torch.clamp(for_metrics, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * response_mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    # compute_is_metrics (the keys grouprl logs)
    metric_lower = 1.0 / upper if lower is None else lower
    metrics = {"rollout_is_mean": masked_mean(weights, response_mask).item()}
    if rollout_is == "sequence":
        metrics["rollout_is_ratio_fraction_high"] = (for_metrics > math.log(upper)).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (for_metrics < math.log(metric_lower)).float().mean().item()
    else:
        metrics["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), response_mask).item()
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((raw < metric_lower).float(), response_mask).item()
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), response_mask).item()
    weights = weights.detach()
    if batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, response_mask)
        else:
            seq_w = masked_mean(weights, response_mask, axis=-1)
            seq_mask = (response_mask.sum(dim=-1) > 0).to(weights.dtype)
            mean = (seq_w * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def verl_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
    mean_train = masked_mean(old_log_prob, response_mask, axis=-1)
    mean_rollout = masked_mean(rollout_log_prob, response_mask, axis=-1)
    log_ratio = old_log_prob - rollout_log_prob
    log_ppl_diff = mean_rollout - mean_train
    rho = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    seq_sum = torch.clamp(masked_sum(log_ratio, response_mask, axis=-1), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    return {
        "training_ppl": torch.exp(-mean_train).mean().item(),
        "kl": masked_mean(rollout_log_prob - old_log_prob, response_mask).item(),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item(),
        "rollout_ppl": torch.exp(-mean_rollout).mean().item(),
        "log_ppl_diff": log_ppl_diff.mean().item(),
        "chi2_token": (masked_mean(rho.square(), response_mask) - 1.0).item(),
        "chi2_seq": (torch.exp(2.0 * seq_sum).mean() - 1.0).item(),
    }


def verl_agg_token_mean(loss_mat, loss_mask, batch_num_tokens):
    return masked_sum(loss_mat, loss_mask) / batch_num_tokens


def verl_bypass_loss(log_prob, rollout_log_prob, advantages, response_mask, cfg, *, clip_low=0.2, clip_high=0.28,
                     clip_ratio_c=3.0):
    """compute_policy_loss_bypass_mode with loss_agg_mode token-mean and global_batch_info's token count."""
    batch_num_tokens = response_mask.sum()
    with torch.no_grad():
        log_ratio = log_prob.detach() - rollout_log_prob
        weights, metrics = (None, {}) if cfg.get("rollout_is") is None else verl_correction_weights(
            log_ratio, response_mask, cfg["rollout_is"], cfg.get("rollout_is_threshold", 2.0),
            cfg.get("rollout_is_batch_normalize", False))
        mask = response_mask
        if cfg.get("rollout_rs") is not None:
            mask, rs_metrics = verl_rejection_mask(log_ratio, response_mask, cfg["rollout_rs"],
                                                   cfg["rollout_rs_threshold"])
            metrics.update(rs_metrics)
    if cfg["loss_type"] == "reinforce":  # compute_policy_loss_reinforce
        pg_losses = -advantages * log_prob * weights if weights is not None else -advantages * log_prob
        return verl_agg_token_mean(pg_losses, mask, batch_num_tokens), metrics
    # compute_policy_loss_vanilla(old_log_prob=rollout_log_prob, rollout_is_weights=None)
    ratio = torch.exp(torch.clamp(log_prob - rollout_log_prob, min=-20.0, max=20.0))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clip_pg_losses2 = torch.min(-advantages * clip_ratio_c, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return verl_agg_token_mean(pg_losses, mask, batch_num_tokens), metrics


# verl's RolloutCorrectionConfig fields and defaults, and each classmethod with its default arguments
VERL_FIELDS = {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
               "rollout_rs": None, "rollout_rs_threshold": None, "bypass_mode": False, "loss_type": "ppo_clip"}


def verl_preset(name: str) -> dict:
    geo, k3 = "0.999_1.001", 0.01
    calls = {
        "decoupled_token_is": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs=None),
        "decoupled_seq_is": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs=None),
        "decoupled_token_icepop": dict(rollout_is="token", rollout_is_threshold=f"{0.5}_{5.0}", rollout_rs=None),
        "decoupled_seq_is_rs": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1",
                                    rollout_rs_threshold="0.5_2.0"),
        "decoupled_geo_rs": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=geo),
        "bypass_ppo_clip": dict(rollout_is=None, rollout_rs=None, bypass_mode=True, loss_type="ppo_clip"),
        "bypass_ppo_clip_geo_rs": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=geo,
                                       bypass_mode=True, loss_type="ppo_clip"),
        "bypass_ppo_clip_k3_rs": dict(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=k3,
                                      bypass_mode=True, loss_type="ppo_clip"),
        "bypass_pg_is": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs=None, bypass_mode=True,
                             loss_type="reinforce"),
        "bypass_pg_token_icepop": dict(rollout_is="token", rollout_is_threshold=f"{0.5}_{5.0}", rollout_rs=None,
                                       bypass_mode=True, loss_type="reinforce"),
        "bypass_pg_geo_rs": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=geo,
                                 bypass_mode=True, loss_type="reinforce"),
        "decoupled_geo_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                         rollout_rs_threshold=geo),
        "decoupled_geo_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                           rollout_rs_threshold=geo),
        "bypass_pg_geo_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                         rollout_rs_threshold=geo, bypass_mode=True, loss_type="reinforce"),
        "bypass_pg_geo_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                           rollout_rs_threshold=geo, bypass_mode=True, loss_type="reinforce"),
        "decoupled_k3_rs": dict(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=k3),
        "decoupled_k3_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3",
                                        rollout_rs_threshold=k3),
        "decoupled_k3_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3",
                                          rollout_rs_threshold=k3),
        "disabled": dict(rollout_is=None, rollout_rs=None),
    }
    return {**VERL_FIELDS, **calls[name]}


# ------------------------------------------------------------------------------------------ tensors


def log_probs(seed: int = 0, rows: int = 8, width: int = 7, spread: float = 0.3):
    """float64 trainer / sampler log-probs that differ by N(0, spread) per token, a mask with rows of 1..width
    valid tokens, nan in the padding (never read by grouprl; verl's masked sums select it away too)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    rollout = old + torch.randn(rows, width, generator=g, dtype=torch.float64) * spread
    lengths = torch.arange(rows) % width + 1
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(-1)).to(torch.float64)
    return old, rollout, mask


def padded_nan(t, mask):
    return torch.where(mask != 0, t, math.nan)


def close_metrics(ours: dict, theirs: dict, tol: float = 1e-6) -> None:
    for key, value in theirs.items():
        assert key in ours, key
        assert abs(ours[key][0] - value) <= tol, (key, ours[key][0], value)


RS_CASES = [
    ("token_k1", "0.8_1.25"), ("token_k1", 1.3), ("token_k2", 0.02), ("token_k3", 0.02),
    ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", 0.1), ("seq_sum_k3", 0.1),
    ("seq_mean_k1", "0.9_1.1"), ("seq_mean_k2", 0.03), ("seq_mean_k3", 0.03),
    ("seq_max_k2", 0.1), ("seq_max_k3", 0.1),
    ("token_k1,seq_mean_k3", "0.8_1.25,0.03"), ("seq_mean_k3,seq_max_k2,seq_mean_k3", 0.05),
]


def with_empty_row(old, rollout, mask):
    """A last row with no valid token (a response rejected before, or empty): counted apart by some metrics."""
    mask = mask.clone()
    mask[-1] = 0
    return old, rollout, mask


@pytest.mark.parametrize("rollout_rs,threshold", RS_CASES)
def test_rejection_mask_and_metrics_equal_verls(rollout_rs, threshold):
    old, rollout, mask = with_empty_row(*log_probs())
    keep, metrics = algorithms.rollout_rejection_mask(padded_nan(old, mask), padded_nan(rollout, mask), mask,
                                                      rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
    theirs, their_metrics = verl_rejection_mask(old - rollout, mask, rollout_rs, threshold)
    assert torch.equal(keep, theirs)
    assert 0 < keep.sum() < mask.sum(), "each case keeps some tokens and rejects others"
    close_metrics(metrics, their_metrics)


@pytest.mark.parametrize("rollout_rs,threshold", [("token_k1", "0.5_2.0"), ("token_k2", 0.5 * math.log(2) ** 2),
                                                   ("seq_sum_k1", "0.5_2.0")])
def test_a_statistic_on_its_bound_is_kept(rollout_rs, threshold):
    """verl keeps S == bound (>= lower, <= upper): ratios of exactly 2 and 1/2 stay."""
    old = torch.tensor([[math.log(2.0), 0.0], [-math.log(2.0), 0.0], [math.log(2.0) + 1e-9, 0.0]],
                       dtype=torch.float64)
    rollout, mask = torch.zeros_like(old), torch.tensor([[1.0, 0.0]] * 3, dtype=torch.float64)
    keep, _ = algorithms.rollout_rejection_mask(old, rollout, mask, rollout_rs=rollout_rs,
                                                rollout_rs_threshold=threshold)
    theirs, _ = verl_rejection_mask(old - rollout, mask, rollout_rs, threshold)
    assert torch.equal(keep, theirs) and keep[:2, 0].tolist() == [1.0, 1.0] and keep[2, 0] == 0


def test_seq_mean_k1_is_the_geometric_mean_ratio_bound():
    old, rollout, mask = log_probs(seed=1)
    keep, _ = algorithms.rollout_rejection_mask(old, rollout, mask, rollout_rs="seq_mean_k1",
                                                rollout_rs_threshold="0.9_1.1")
    n = mask.sum(-1)
    geometric = torch.exp(((rollout - old) * mask).sum(-1) / n)  # geometric mean of pi_rollout / pi_train
    expected = ((geometric >= 0.9) & (geometric <= 1.1)).unsqueeze(-1) * mask
    assert torch.equal(keep, expected.to(keep.dtype))


@pytest.mark.parametrize("spec,bounds", [
    ("0.5_2.0", {"token_k1": (0.5, 2.0)}), (2.0, {"token_k1": (0.5, 2.0)}), ("4", {"token_k1": (0.25, 4.0)}),
])
def test_k1_threshold_parsing(spec, bounds):
    assert algorithms.parse_rs_thresholds(["token_k1"], spec) == bounds
    assert algorithms.parse_rs_thresholds(["token_k1", "seq_max_k3"], "0.5_2,0.1") == {
        "token_k1": (0.5, 2.0), "seq_max_k3": (None, 0.1)}


@pytest.mark.parametrize("options,spec,match", [
    (["seq_mean_k3"], "0.1_0.2", "one upper bound"), (["token_k1"], "2_1", "exceeds"),
    (["token_k1"], "-1", "positive"), (["token_k1", "token_k2"], "1,2,3", "one for all"),
    (["token_k2"], None, "must be given"), (["token_k2"], "x", "not a number"),
])
def test_bad_rs_thresholds_are_refused(options, spec, match):
    with pytest.raises(ValueError, match=match):
        algorithms.parse_rs_thresholds(options, spec)


def test_rs_options_parse_like_verls():
    assert algorithms.parse_rs_options(" token_k1, seq_mean_k3,token_k1 ") == ["token_k1", "seq_mean_k3"]
    with pytest.raises(ValueError, match="seq_max_k1"):
        algorithms.parse_rs_options("seq_max_k1")


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 1.2, "0.5_5.0", "0.8_1.3"])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_and_metrics_equal_verls(level, threshold, normalize):
    old, rollout, mask = with_empty_row(*log_probs(seed=2, rows=16, spread=0.4))
    weights = algorithms.threshold_importance_weights(old, padded_nan(rollout, mask), mask, rollout_is=level,
                                                      rollout_is_threshold=threshold)
    metrics = algorithms.importance_weight_metrics(weights, old, rollout, mask, rollout_is=level,
                                                   rollout_is_threshold=threshold)
    if normalize:
        weights, factor = algorithms.batch_normalized_weights(weights, algorithms.is_weight_totals(weights, mask,
                                                                                                   level=level))
        metrics["rollout_is_batch_norm_factor"] = (factor, 1.0)
    theirs, their_metrics = verl_correction_weights(old - rollout, mask, level, threshold, normalize)
    # rtol 1e-7: verl's sequence-level mean reads each row's weight as a masked mean (count + 1e-8)
    torch.testing.assert_close(weights, theirs, rtol=1e-7, atol=1e-9)
    close_metrics(metrics, their_metrics)
    assert 0 < their_metrics["rollout_is_ratio_fraction_high"] + their_metrics["rollout_is_ratio_fraction_low"] < 1


def test_icepop_zeroes_outside_and_tis_truncates():
    old, rollout, mask = log_probs(seed=3)
    ratio = torch.exp(old - rollout) * mask
    tis = algorithms.threshold_importance_weights(old, rollout, mask, rollout_is="token", rollout_is_threshold=1.5)
    icepop = algorithms.threshold_importance_weights(old, rollout, mask, rollout_is="token",
                                                     rollout_is_threshold="0.8_1.5")
    torch.testing.assert_close(tis, ratio.clamp(max=1.5))
    inside = (ratio >= 0.8) & (ratio <= 1.5)
    torch.testing.assert_close(icepop, torch.where(inside, ratio, 0.0))
    assert (~inside & (mask != 0)).any()


def test_is_weight_totals_add_up_across_processes():
    """Two processes' totals summed give the mean over their union (what the trainer's all-reduce does)."""
    old, rollout, mask = log_probs(seed=4)
    for level in ("token", "sequence"):
        w = algorithms.threshold_importance_weights(old, rollout, mask, rollout_is=level, rollout_is_threshold=3.0)
        whole = algorithms.is_weight_totals(w, mask, level=level)
        parts = algorithms.is_weight_totals(w[:3], mask[:3], level=level) + algorithms.is_weight_totals(
            w[3:], mask[3:], level=level)
        torch.testing.assert_close(whole, parts)
        normalized, _ = algorithms.batch_normalized_weights(w, whole)
        mean = algorithms.is_weight_totals(normalized, mask, level=level)
        assert abs(float(mean[0] / mean[1]) - 1.0) < 1e-12


def test_off_policy_metrics_equal_verls():
    old, rollout, mask = log_probs(seed=5)
    close_metrics(algorithms.off_policy_metrics(old, padded_nan(rollout, mask), mask),
                  verl_offpolicy_metrics(old, rollout, mask))


BYPASS_CASES = [
    {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 2.0},
    {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "0.8_1.3", "rollout_rs": "seq_mean_k1",
     "rollout_rs_threshold": "0.9_1.1"},
    {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_is_batch_normalize": True},
    {"loss_type": "reinforce", "rollout_rs": "token_k3", "rollout_rs_threshold": 0.02},
    {"loss_type": "ppo_clip", "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.03},
    {"loss_type": "ppo_clip", "rollout_is": "sequence", "rollout_is_threshold": 2.0},
]


@pytest.mark.parametrize("cfg", BYPASS_CASES)
def test_bypass_loss_and_gradient_equal_verls(cfg):
    old, rollout, mask = log_probs(seed=6, spread=0.2)
    advantages = torch.randn(old.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ours_lp = old.clone().requires_grad_(True)
    # the options of the loss used: PPO's clip for ppo_clip, none for reinforce
    clip = {} if cfg["loss_type"] == "reinforce" else {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                                                       "clip_ratio_dual": 3.0}
    loss, _, metrics = algorithms.compute_bypass_policy_loss(
        ours_lp, padded_nan(rollout, mask), advantages, mask, num_tokens=float(mask.sum()), **clip, **cfg)
    loss.backward()
    theirs_lp = old.clone().requires_grad_(True)
    their_loss, their_metrics = verl_bypass_loss(theirs_lp, rollout, advantages, mask, cfg)
    their_loss.backward()
    assert abs(float(loss.detach()) - float(their_loss.detach())) < 1e-9
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-9, atol=1e-12)
    close_metrics(metrics, their_metrics)


def test_reinforce_gradient_is_the_weighted_score_function():
    """d/d log_prob of bypass REINFORCE = -sg(w) A keep / N, written out by hand."""
    old, rollout, mask = log_probs(seed=8, spread=0.2)
    advantages = torch.randn(old.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    lp = old.clone().requires_grad_(True)
    loss, _, _ = algorithms.compute_bypass_policy_loss(lp, rollout, advantages, mask, loss_type="reinforce",
                                                       rollout_is="token", rollout_is_threshold=1.4,
                                                       rollout_rs="token_k2", rollout_rs_threshold=0.02)
    loss.backward()
    d = old - rollout
    keep = (0.5 * d.square() <= 0.02) & (mask != 0)
    w = torch.exp(d).clamp(max=1.4)
    expected = torch.where(keep, -w * advantages, 0.0) / keep.sum()
    torch.testing.assert_close(lp.grad, expected)
    # the REINFORCE loss alone: l = -A log_prob, its gradient -A
    lp2 = old.clone().requires_grad_(True)
    plain, _ = algorithms.compute_policy_loss("reinforce", lp2, rollout, advantages, mask,
                                              loss_agg_mode="seq-mean-token-sum")
    plain.backward()
    torch.testing.assert_close(lp2.grad, -advantages * mask / mask.shape[0])


# ------------------------------------------------------------------------------------------ config


def base(tmp_path, **correction) -> dict:
    return {"data": {"train_files": [str(tmp_path / "x.jsonl")]},
            "worker": {"actor": {"model": {"model_path": "m"}}, "reward": {"functions": [{"name": "accuracy"}]}},
            "trainer": {"output_dir": str(tmp_path / "out")}, "algorithm": {"rollout_correction": correction}}


@pytest.mark.parametrize("name", VERL_PRESET_NAMES)
def test_every_preset_resolves_to_verls_fields(tmp_path, name):
    config = config_from_dict(base(tmp_path, preset=name))
    resolved = vars(resolve_verl_correction(config.algorithm.rollout_correction))
    expected = verl_preset(name)
    if expected["rollout_is"] is None:  # verl keeps its default threshold, unused without IS weights
        assert resolved["rollout_is_threshold"] == expected["rollout_is_threshold"]
    assert resolved == expected


def test_the_preset_list_is_verls():
    assert set(VERL_PRESET_NAMES) == {
        "decoupled_token_is", "decoupled_seq_is", "decoupled_token_icepop", "decoupled_seq_is_rs", "decoupled_geo_rs",
        "decoupled_geo_rs_seq_tis", "decoupled_geo_rs_token_tis", "decoupled_k3_rs", "decoupled_k3_rs_seq_tis",
        "decoupled_k3_rs_token_tis", "bypass_ppo_clip", "bypass_ppo_clip_geo_rs", "bypass_ppo_clip_k3_rs",
        "bypass_pg_is", "bypass_pg_token_icepop", "bypass_pg_geo_rs", "bypass_pg_geo_rs_seq_tis",
        "bypass_pg_geo_rs_token_tis", "disabled"}


def test_explicit_keys_beside_a_preset(tmp_path):
    config = config_from_dict(base(tmp_path, preset="decoupled_geo_rs", rollout_rs_threshold="0.999_1.001",
                                   rollout_is_batch_normalize=False))
    assert resolve_verl_correction(config.algorithm.rollout_correction).rollout_rs == "seq_mean_k1"
    # a key the preset does not set is added to it
    config = config_from_dict(base(tmp_path, preset="decoupled_token_is", rollout_is_batch_normalize=True))
    assert resolve_verl_correction(config.algorithm.rollout_correction).rollout_is_batch_normalize
    # verl's keys without a preset, thresholds as numbers or strings
    config = config_from_dict(base(tmp_path, rollout_is="token", rollout_is_threshold="0.5_5.0",
                                   rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="2,0.1"))
    verl = resolve_verl_correction(config.algorithm.rollout_correction)
    assert (verl.rollout_is_threshold, verl.rollout_rs_threshold, verl.bypass_mode) == ("0.5_5.0", "2,0.1", False)
    # "1_5" is IcePop's bounds (float() alone would read 15), "3" the number 3
    config = config_from_dict(base(tmp_path, rollout_is="token", rollout_is_threshold="1_5",
                                   rollout_rs="seq_max_k3", rollout_rs_threshold="3"))
    verl = resolve_verl_correction(config.algorithm.rollout_correction)
    assert (verl.rollout_is_threshold, verl.rollout_rs_threshold) == ("1_5", 3.0)
    # no verl key: TRL's spelling, as before
    assert resolve_verl_correction(config_from_dict(base(tmp_path, level="token")).algorithm.rollout_correction) \
        is None


@pytest.mark.parametrize("correction,match", [
    ({"preset": "decoupled_geo_rs", "rollout_rs_threshold": "0.9_1.1"},
     "'algorithm.rollout_correction.rollout_rs_threshold' is '0.9_1.1', but 'algorithm.rollout_correction.preset' "
     "decoupled_geo_rs sets it"),
    ({"preset": "decoupled_geo_rs", "rollout_is": "token"}, "rollout_is' is 'token'.*preset"),
    ({"preset": "decoupled_seq_is", "bypass_mode": True}, "bypass_mode.*decoupled_seq_is"),
    ({"preset": "bypass_pg_is", "loss_type": "ppo_clip"}, "loss_type.*bypass_pg_is"),
    ({"preset": "bypass_pg_is", "clip_max": 5.0}, "'algorithm.rollout_correction.clip_max' \\(TRL's spelling\\).*"
     "'algorithm.rollout_correction.preset'"),
    ({"rollout_is": "token", "mode": "truncate"}, "mode' \\(TRL's spelling\\).*rollout_is' \\(verl's\\)"),
    ({"preset": "decoupled_token_is", "enable": False}, "enable' is false.*preset"),
    ({"rollout_is": "token", "rollout_is_threshold": "2_1"}, "rollout_is_threshold': .*lower bound exceeds"),
    ({"rollout_is": "token", "rollout_is_threshold": "a_b"}, "rollout_is_threshold"),
    ({"rollout_rs": "token_k3"}, "rollout_rs': rollout_rs_threshold must be given"),
    ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 1.0}, "rollout_rs': unknown rollout_rs option 'seq_max_k1'"),
    ({"rollout_is_batch_normalize": True}, "rollout_is_batch_normalize' .*rollout_is' is null"),
    ({"loss_type": "reinforce"}, "loss_type' reinforce is bypass mode's loss"),
    ({"preset": "nope"}, "preset' accepts one of"),
])
def test_rollout_correction_config_errors(tmp_path, correction, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(base(tmp_path, **correction))


def test_reinforce_refuses_another_policy_loss(tmp_path):
    values = base(tmp_path, preset="bypass_pg_geo_rs")
    values["algorithm"]["policy_loss"] = "gspo"
    with pytest.raises(ConfigError, match="loss_type' reinforce replaces the policy loss.*'algorithm.policy_loss' "
                                          "is 'gspo'"):
        config_from_dict(values)
    values["algorithm"]["rollout_correction"] = {"preset": "bypass_ppo_clip_k3_rs"}  # ppo_clip: the configured loss
    config_from_dict(values)


# ------------------------------------------------------------------------------------------ tiny runs


@pytest.fixture(scope="module")
def setup(say_task):
    return say_task(6)


def run_config(task, out, **overrides) -> dict:
    return task.config(out, [{"name": "accuracy"}, {"name": "length", "weight": 0.5, "kwargs": {"target": 1}}], **{
        "worker.actor.global_batch_size": 4, "worker.actor.micro_batch_size_per_device_for_update": 4,
        "trainer.seed": 3, "trainer.max_steps": 1, **overrides})


def test_bypass_preset_trains_on_the_samplers_log_probs(setup, tmp_path):
    from grouprl.trainer.grpo import GRPOTrainer

    cfg = run_config(setup, tmp_path / "run", **{"algorithm.rollout_correction.preset": "bypass_pg_geo_rs_token_tis",
                                                 "worker.actor.ppo_epochs": 2})
    trainer = GRPOTrainer(config_from_dict(cfg))
    assert trainer.correct_rollout and trainer.bypass is not None
    recomputed = []
    log_probs_of = trainer._log_probs
    trainer._log_probs = lambda model, batch: recomputed.append(1) or log_probs_of(model, batch)
    before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    trainer.train()
    assert not recomputed, "bypass mode recomputed the old log-probs"
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.named_parameters())
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction",
                "rollout_corr/rollout_rs_seq_mean_k1_mean", "rollout_corr/k3_kl", "actor/pg_loss"):
        assert key in metrics, key
    assert metrics["actor/clipfrac"] == 0  # REINFORCE: nothing is clipped


def test_decoupled_preset_weights_and_rejects_before_the_update(setup, tmp_path):
    from grouprl.trainer.grpo import GRPOTrainer

    cfg = run_config(setup, tmp_path / "run", **{"algorithm.rollout_correction.preset": "decoupled_k3_rs_token_tis",
                                                 "algorithm.rollout_correction.rollout_rs_threshold": 1e-30})
    with pytest.raises(ConfigError, match="rollout_rs_threshold.*decoupled_k3_rs_token_tis"):
        GRPOTrainer(config_from_dict(cfg))
    cfg = run_config(setup, tmp_path / "run", **{"algorithm.rollout_correction.rollout_is": "token",
                                                 "algorithm.rollout_correction.rollout_is_batch_normalize": True,
                                                 "algorithm.rollout_correction.rollout_rs": "token_k1",
                                                 "algorithm.rollout_correction.rollout_rs_threshold": "0.8_1.25"})
    trainer = GRPOTrainer(config_from_dict(cfg))
    assert trainer.correct_rollout and trainer.bypass is None
    # a sampler that disagrees with the trainer (as vLLM in bf16 would), by N(0, 0.3) per token
    generate, noise = trainer.engine.generate, torch.Generator().manual_seed(0)

    def mismatched(samples, params, **kwargs):
        batch = generate(samples, params, **kwargs)
        shift = torch.randn(batch.rollout_log_probs.shape, generator=noise) * 0.3
        batch.rollout_log_probs = batch.rollout_log_probs + shift * batch.response_mask
        return batch

    trainer.engine.generate = mismatched
    seen = {}
    from grouprl.trainer import grpo

    run_update = grpo.run_update

    def watched(model, optimizer, batch, **kwargs):
        seen["loss_mask"], seen["weights"] = batch.loss_mask.clone(), batch.token_weights.clone()
        seen["response_mask"] = batch.response_mask.clone()
        return run_update(model, optimizer, batch, **kwargs)

    grpo.run_update = watched
    try:
        trainer.train()
    finally:
        grpo.run_update = run_update
    rejected = (seen["response_mask"] != 0) & (seen["loss_mask"] == 0)
    assert 0 < rejected.sum() < (seen["response_mask"] != 0).sum()
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(metrics["rollout_corr/rollout_rs_masked_fraction"]
               - float(rejected.sum() / (seen["response_mask"] != 0).sum())) < 1e-6
    assert "rollout_corr/rollout_is_batch_norm_factor" in metrics and "rollout_corr/chi2_token" in metrics
    valid = seen["response_mask"] != 0
    assert abs(float(seen["weights"][valid].mean()) - 1.0) < 1e-5  # batch-normalised to mean 1
    assert abs(metrics["rollout_corr/rollout_is_batch_norm_factor"] - 1.0) > 1e-3  # which took a division
