"""Rollout correction: importance weights for the mismatch between the sampler and the trainer.

The rollout engine (vLLM, or a stale policy copy in one-step-off training) samples y_t from
pi_rollout and reports rollout_log_prob = log pi_rollout(y_t); the trainer recomputes
old_log_prob = log pi_old(y_t) with its own weights and kernels at sampling time. The policy
loss assumes the tokens came from pi_old, so each token's loss is reweighted by the
importance weight pi_old / pi_rollout, truncated or masked to bound its variance
(truncated / masked importance sampling, as TRL's ``vllm_importance_sampling_correction``).

Notation (all [B, T]): m = response mask, d_t = old_log_prob_t - rollout_log_prob_t where
m_t != 0 and 0 elsewhere (padding log-probs are never read, so nan or inf there is harmless).

- level ``token``:    w_t = exp(d_t)
- level ``sequence``: w_i = exp(sum_t m_t d_t), the same for every token of row i
- mode ``truncate``:  w = clamp(w, clip_min, clip_max)
- mode ``mask``:      w = 0 where w < clip_min or w > clip_max, w elsewhere

A bound that is None is off. The weight is a constant (no gradient) and exactly 0 where m = 0;
pass it to ``compute_policy_loss(..., token_weights=w)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grouprl.algorithms.kl import kl_penalty

ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")
ROLLOUT_CORRECTION_MODES = ("truncate", "mask")
# exp(700) ~ 1e304 is finite in float64 (exp overflows past ~709.78): a sequence of large
# log-ratios gives a huge finite ratio, which the bounds then clip or mask, never inf or nan.
MAX_LOG_WEIGHT = 700.0


def _check_log_probs(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> None:
    tensors = (old_log_prob, rollout_log_prob, response_mask)
    if len({t.shape for t in tensors}) != 1 or old_log_prob.dim() != 2:
        raise ValueError(
            "old_log_prob, rollout_log_prob and response_mask must share one [B, T] shape; got "
            + ", ".join(str(tuple(t.shape)) for t in tensors)
        )
    for name, t in (("old_log_prob", old_log_prob), ("rollout_log_prob", rollout_log_prob)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor; got {t.dtype}")


def _check_level(level: str) -> None:
    if level not in ROLLOUT_CORRECTION_LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r}; valid levels: {', '.join(ROLLOUT_CORRECTION_LEVELS)}")


def _log_ratio(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, level: str) -> Tensor:
    """float64 [B, T], detached: d_t (token) or sum_t m_t d_t broadcast over the row (sequence).

    The log-probs are selected to 0 where m = 0 before d is formed, so nan or inf there
    never enters a row's sum.
    """
    valid = response_mask != 0
    old = torch.where(valid, old_log_prob.detach().to(torch.float64), 0.0)
    rollout = torch.where(valid, rollout_log_prob.detach().to(torch.float64), 0.0)
    log_ratio = old - rollout
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    return log_ratio


def _uncapped_ratio(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, level: str) -> Tensor:
    """float64 [B, T]: exp(min(log ratio, 700)), the importance ratio before any bound."""
    return torch.exp(_log_ratio(old_log_prob, rollout_log_prob, response_mask, level).clamp(max=MAX_LOG_WEIGHT))


def _to_dtype(weights: Tensor, dtype: torch.dtype) -> Tensor:
    # A ratio beyond the dtype's range (no upper bound, huge log-ratio) saturates instead of becoming inf.
    return weights.clamp(max=torch.finfo(dtype).max).to(dtype)


def rollout_importance_weights(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    level: str = "sequence",
    mode: str = "mask",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> Tensor:
    """Truncated or masked importance weights pi_old / pi_rollout, [B, T], without gradient.

    d_t = old_log_prob_t - rollout_log_prob_t where m_t != 0, 0 elsewhere;
    ``level="token"``:    w_t = exp(d_t);
    ``level="sequence"``: w_i = exp(sum_t m_t d_t), broadcast to row i's tokens;
    ``mode="truncate"``:  w = clamp(w, clip_min, clip_max);
    ``mode="mask"``:      w = 0 where w < clip_min or w > clip_max (that token, or the whole
    row at sequence level, drops out of the loss), w elsewhere.
    A bound that is None is off on that side; w = 0 where m_t = 0.

    The log-ratio is formed and summed in float64 and its exponent is capped at 700, so an
    enormous (even inf) log-ratio gives a finite ratio that the bounds clip or mask, never
    inf or nan; with no upper bound it saturates at exp(700) (float64) or the output dtype's
    largest value (float32: about 3.4e38). The result has the log-probs' dtype promoted to
    at least float32 (bf16 -> float32, float64 stays float64). A nan log-prob on a valid
    token gives a nan weight (for that token, or its whole row at sequence level).

    ValueError for an unknown level or mode, mismatched or non-2-D shapes, clip_max <= 0,
    clip_min < 0 or clip_min > clip_max.
    """
    _check_log_probs(old_log_prob, rollout_log_prob, response_mask)
    _check_level(level)
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(f"unknown rollout correction mode {mode!r}; valid modes: {', '.join(ROLLOUT_CORRECTION_MODES)}")
    if clip_max is not None and not clip_max > 0:
        raise ValueError(f"clip_max must be > 0 (or None for no upper bound); got {clip_max}")
    if clip_min is not None and not clip_min >= 0:
        raise ValueError(f"clip_min must be >= 0 (or None for no lower bound); got {clip_min}")
    if clip_min is not None and clip_max is not None and clip_min > clip_max:
        raise ValueError(f"clip_min must not exceed clip_max; got clip_min={clip_min} > clip_max={clip_max}")

    dtype = torch.promote_types(torch.promote_types(old_log_prob.dtype, rollout_log_prob.dtype), torch.float32)
    ratio = _uncapped_ratio(old_log_prob, rollout_log_prob, response_mask, level)
    if mode == "truncate":
        weights = ratio if clip_min is None and clip_max is None else ratio.clamp(min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        weights = torch.where((ratio < low) | (ratio > high), 0.0, ratio)
    weights = torch.where(response_mask != 0, weights, 0.0)
    return _to_dtype(weights, dtype)


def mean_and_count(values: Tensor, count: Tensor | int) -> tuple[float, float]:
    """(sum(values) / count, count), (0.0, 0.0) for no count: a metric as (value, weight), reduced over
    processes as sum(value * weight) / sum(weight)."""
    n = float(count)
    return (float(values.sum()) / n if n > 0 else 0.0, n)


def rollout_mismatch_metrics(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    weights: Tensor,
    *,
    level: str = "sequence",
) -> dict[str, tuple[float, float]]:
    """Statistics of the sampler / trainer mismatch, each as (value, weight).

    ``weights`` is ``rollout_importance_weights(...)`` computed at the same ``level``. Each
    value is a mean and its weight the number of items averaged, so the cross-process value
    is sum(value * weight) / sum(weight); with nothing to average the pair is (0.0, 0.0).
    Over valid tokens (weight = number of tokens with m != 0), with d_t = old - rollout:

    - ``mismatch/k3_kl``: mean of k3 = exp(d_t) - d_t - 1, an estimate of
      KL(pi_rollout || pi_old) = E_{y ~ pi_rollout}[log pi_rollout(y) - log pi_old(y)]: the
      tokens were sampled from the rollout policy, and under that sampling exp(d) - d - 1
      with d = log(pi_old / pi_rollout) is unbiased for this direction. It is
      ``kl_penalty(rollout_log_prob, old_log_prob, "k3")`` (d clamped to [-20, 20], each
      token's k3 to 10, as there). 0 when both agree.
    - ``mismatch/abs_log_prob_diff``: mean |d_t|.

    Over valid tokens (``level="token"``) or rows with at least one valid token
    (``level="sequence"``; weight = number of such rows; a row with no valid token counts
    as neither):

    - ``mismatch/weight_mean``: mean importance weight after truncation or masking;
    - ``mismatch/capped_frac``: share whose weight was clipped or masked, i.e. differs from
      the uncapped ratio exp(d_t) (token) or exp(sum_t m_t d_t) (sequence), compared in
      ``weights``' dtype.
    """
    _check_log_probs(old_log_prob, rollout_log_prob, response_mask)
    _check_level(level)
    if weights.shape != old_log_prob.shape:
        raise ValueError(f"weights must have shape {tuple(old_log_prob.shape)}; got {tuple(weights.shape)}")

    valid = response_mask != 0
    n_tokens = valid.sum()
    old = old_log_prob.detach().to(torch.float64)
    rollout = rollout_log_prob.detach().to(torch.float64)
    k3 = kl_penalty(rollout, old, "k3", response_mask=response_mask)
    abs_diff = torch.where(valid, old - rollout, 0.0).abs()

    weights = weights.detach()
    uncapped = _to_dtype(_uncapped_ratio(old_log_prob, rollout_log_prob, response_mask, level), weights.dtype)
    capped = valid & (weights != uncapped)
    weights = weights.to(torch.float64)
    if level == "token":
        weight_values = torch.where(valid, weights, 0.0)
        capped_values = capped.to(torch.float64)
        count = n_tokens
    else:
        # A row's weight is the same on all its valid tokens: read it off with a max over them.
        rows = valid.any(-1)
        weight_values = torch.where(rows, torch.where(valid, weights, -math.inf).amax(-1), 0.0)
        capped_values = capped.any(-1).to(torch.float64)
        count = rows.sum()
    return {
        "mismatch/k3_kl": mean_and_count(k3, n_tokens),
        "mismatch/abs_log_prob_diff": mean_and_count(abs_diff, n_tokens),
        "mismatch/weight_mean": mean_and_count(weight_values, count),
        "mismatch/capped_frac": mean_and_count(capped_values, count),
    }


# ---------------------------------------------------------------- verl's spelling (rollout_is, rollout_is_threshold)


def parse_is_threshold(spec: str | float) -> tuple[float | None, float]:
    """verl's ``rollout_is_threshold`` as (lower, upper): a number (or a number's string) u is TIS,
    (None, u); ``"lower_upper"`` is IcePop, (lower, upper).

    ValueError for a boolean, an empty or malformed string, a bound <= 0 or not finite, or lower > upper.
    """
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        raise ValueError(f"rollout_is_threshold must be a number or a 'lower_upper' string; got {spec!r}")
    text = str(spec).strip()
    parts = text.split("_", 1) if "_" in text else [text]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"rollout_is_threshold {spec!r} is neither a number nor 'lower_upper'") from None
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"rollout_is_threshold bounds must be positive and finite; got {spec!r}")
    if len(values) == 1:
        return None, values[0]
    if values[0] > values[1]:
        raise ValueError(f"rollout_is_threshold lower bound exceeds the upper one: {spec!r}")
    return values[0], values[1]


def threshold_importance_weights(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str,
    rollout_is_threshold: str | float,
) -> Tensor:
    """verl's IS weights, [B, T], without gradient: ``rollout_importance_weights`` at level ``rollout_is``
    with the bounds of ``parse_is_threshold(rollout_is_threshold)``:

    - TIS, a single bound u: w = min(r, u)                (mode ``truncate``, clip_max = u);
    - IcePop, ``"l_u"``:     w = r if l <= r <= u else 0  (mode ``mask``, clip_min = l, clip_max = u);

    r = exp(d_t) (token) or exp(sum_t m_t d_t) (sequence). Where this differs from verl: verl
    clamps the log-ratio to [-20, 20] before exp, so a ratio below exp(-20) ~ 2e-9 is raised to
    it (here it stays as small as it is); above, both give the same clipped or zeroed weight.
    """
    lower, upper = parse_is_threshold(rollout_is_threshold)
    if lower is None:
        return rollout_importance_weights(old_log_prob, rollout_log_prob, response_mask, level=rollout_is,
                                          mode="truncate", clip_max=upper, clip_min=None)
    return rollout_importance_weights(old_log_prob, rollout_log_prob, response_mask, level=rollout_is,
                                      mode="mask", clip_max=upper, clip_min=lower)


def is_weight_totals(weights: Tensor, response_mask: Tensor, *, level: str) -> Tensor:
    """float64 [2]: (sum, count) whose ratio is the batch mean of the IS weights, for ``batch_normalized_weights``.

    ``level="token"``: (sum_{t: m != 0} w_t, number of valid tokens);
    ``level="sequence"``: (sum_i w_i, number of rows with a valid token), w_i a row's weight
    (the mean over its valid tokens, all equal). Sums, so processes add theirs (an all-reduce
    of this vector) to get the global mean, as verl's ``distributed_masked_mean`` does.
    """
    _check_level(level)
    valid = response_mask != 0
    w = torch.where(valid, weights.detach().to(torch.float64), 0.0)
    if level == "token":
        return torch.stack([w.sum(), valid.sum().to(torch.float64)])
    counts = valid.sum(-1)
    rows = counts > 0
    row_weight = w.sum(-1) / counts.clamp(min=1)
    return torch.stack([row_weight[rows].sum(), rows.sum().to(torch.float64)])


def batch_normalized_weights(weights: Tensor, totals: Tensor) -> tuple[Tensor, float]:
    """(w / mu, mu) with mu = totals[0] / totals[1] (``is_weight_totals``, summed over processes);
    w unchanged and mu reported as 1 when mu <= 1e-8 (verl's rollout_is_batch_normalize)."""
    mean = float(totals[0] / totals[1]) if float(totals[1]) > 0 else 0.0
    if mean > 1e-8:
        return weights / mean, mean
    return weights, 1.0


def importance_weight_metrics(
    weights: Tensor,
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str,
    rollout_is_threshold: str | float,
) -> dict[str, tuple[float, float]]:
    """verl's means of the IS weights (``threshold_importance_weights``, before batch normalisation), each
    (value, weight) for a weighted mean across processes (``rollout_corr/`` prefix, verl's names).

    With r the uncapped ratio (token, or the row's at sequence level) and (l, u) the bounds
    (l = 1/u for TIS, as verl's metrics take it):

    - ``rollout_is_mean``: mean of w over valid tokens (weight: valid tokens);
    - ``rollout_is_ratio_fraction_high`` / ``_low``: share with r > u / r < l, over valid tokens
      (token) or over all rows (sequence; weight: rows, verl's mean over the batch);
    - ``rollout_is_oob_ratio`` (IcePop only): share of valid tokens with r outside [l, u].
    """
    _check_log_probs(old_log_prob, rollout_log_prob, response_mask)
    _check_level(rollout_is)
    lower, upper = parse_is_threshold(rollout_is_threshold)
    icepop = lower is not None
    lower = 1.0 / upper if lower is None else lower
    valid = response_mask != 0
    n_tokens = valid.sum()
    w = torch.where(valid, weights.detach().to(torch.float64), 0.0)
    log_ratio = _log_ratio(old_log_prob, rollout_log_prob, response_mask, rollout_is)
    high, low = log_ratio > math.log(upper), log_ratio < math.log(lower)
    if rollout_is == "token":
        high_frac = mean_and_count((high & valid).to(torch.float64), n_tokens)
        low_frac = mean_and_count((low & valid).to(torch.float64), n_tokens)
    else:  # one value per row (the row's log-ratio sum, 0 for an empty row)
        high_frac = mean_and_count(high[:, 0].to(torch.float64), high.shape[0]) if high.shape[1] else (0.0, 0.0)
        low_frac = mean_and_count(low[:, 0].to(torch.float64), low.shape[0]) if low.shape[1] else (0.0, 0.0)
    metrics = {"rollout_is_mean": mean_and_count(w, n_tokens), "rollout_is_ratio_fraction_high": high_frac,
               "rollout_is_ratio_fraction_low": low_frac}
    if icepop:
        metrics["rollout_is_oob_ratio"] = mean_and_count(((high | low) & valid).to(torch.float64), n_tokens)
    return metrics


def off_policy_metrics(
    old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor
) -> dict[str, tuple[float, float]]:
    """verl's off-policy diagnostics between trainer (old) and sampler (rollout) log-probs, each (value, weight).

    Over valid tokens (weight: valid tokens), d_t = old_t - rollout_t:
    ``kl`` = mean(-d) (KL(pi_rollout || pi_train), direct estimate), ``k3_kl`` = mean(exp(d) - d - 1),
    ``chi2_token`` = mean(exp(2 clamp(d, -20, 20))) - 1.
    Over rows with a valid token (weight: those rows), with lbar_i = mean_t of a row's log-probs:
    ``training_ppl`` = mean_i exp(-lbar_old_i), ``rollout_ppl`` = mean_i exp(-lbar_rollout_i),
    ``log_ppl_diff`` = mean_i (lbar_rollout_i - lbar_old_i), ``chi2_seq`` = mean_i exp(2 clamp(sum_t d_t, -20, 20)) - 1.
    Where this differs from verl: its row means run over every row, an empty one counted as 0
    (and ``chi2_seq`` as 1); here empty rows are left out. Its ``k3_kl`` has no clamp; neither has this one.
    """
    _check_log_probs(old_log_prob, rollout_log_prob, response_mask)
    valid = response_mask != 0
    n_tokens = valid.sum()
    old = torch.where(valid, old_log_prob.detach().to(torch.float64), 0.0)
    rollout = torch.where(valid, rollout_log_prob.detach().to(torch.float64), 0.0)
    d = old - rollout
    counts = valid.sum(-1)
    rows = counts > 0
    n_rows = rows.sum()
    mean_old, mean_rollout = old.sum(-1) / counts.clamp(min=1), rollout.sum(-1) / counts.clamp(min=1)

    def over_rows(values: Tensor) -> tuple[float, float]:
        return mean_and_count(torch.where(rows, values, 0.0), n_rows)

    chi2_token = mean_and_count(torch.where(valid, torch.exp(2 * d.clamp(-20.0, 20.0)), 0.0), n_tokens)
    chi2_seq = over_rows(torch.exp(2 * d.sum(-1).clamp(-20.0, 20.0)))
    return {
        "kl": mean_and_count(-d, n_tokens),
        "k3_kl": mean_and_count(torch.where(valid, torch.expm1(d) - d, 0.0), n_tokens),
        "chi2_token": (chi2_token[0] - 1.0 if chi2_token[1] else 0.0, chi2_token[1]),
        "training_ppl": over_rows(torch.exp(-mean_old)),
        "rollout_ppl": over_rows(torch.exp(-mean_rollout)),
        "log_ppl_diff": over_rows(mean_rollout - mean_old),
        "chi2_seq": (chi2_seq[0] - 1.0 if chi2_seq[1] else 0.0, chi2_seq[1]),
    }
