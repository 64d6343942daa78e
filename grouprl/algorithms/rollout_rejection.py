"""Rollout rejection sampling: a hard trust region between the sampler and the trainer (verl's ``rollout_rs``).

Where importance weights (:mod:`grouprl.algorithms.rollout_correction`) reweight tokens that a
mismatched sampler produced, rejection sampling drops the tokens or whole responses whose
divergence between trainer and sampler exceeds a bound. The options and their thresholds are
verl's (0.9.1, ``trainer/ppo/rollout_corr_helper.py``), so a verl config means the same here.

Notation (all [B, T]): m = response mask, d_t = clamp(log pi_train(y_t) - log pi_rollout(y_t), -20, 20)
where m_t != 0 (log-probs at m = 0 are never read, so nan or inf there is harmless). Per token:

    k1_t = -d_t                  (log pi_rollout / pi_train; bounded below and above)
    k2_t = d_t^2 / 2
    k3_t = exp(d_t) - 1 - d_t    (>= 0, 0 when both agree)

Options, each a statistic compared with its threshold:

- ``token_k{1,2,3}``: k_t per token; a rejected token alone leaves the loss;
- ``seq_sum_k{1,2,3}``: S_i = sum_t m_t k_t; a rejected row leaves it whole;
- ``seq_mean_k{1,2,3}``: S_i = sum_t m_t k_t / sum_t m_t (``seq_mean_k1`` is the log of the
  inverse geometric-mean ratio: verl's geometric-mean rejection, "Geo-RS");
- ``seq_max_k{2,3}``: S_i = max_{t: m_t != 0} k_t.

Keep rule: a k1 option keeps log(lower) <= S <= log(upper); a k2 / k3 option keeps S <= upper.
A comma list (``"token_k1,seq_mean_k3"``) keeps what every option keeps.

Thresholds (``rollout_rs_threshold``): one spec shared by all options, or one per option, comma
separated. A k1 spec is ``"lower_upper"`` (ratio bounds, e.g. ``"0.999_1.001"``) or one number u,
which means ``1/u _ u``; a k2 / k3 spec is one positive upper bound.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grouprl.algorithms.rollout_correction import mean_and_count

ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
# exp(+-20) bounds each token's log-ratio as verl does (SAFETY_BOUND): exp stays finite in float32.
RS_LOG_RATIO_BOUND = 20.0


def parse_rs_options(rollout_rs: str) -> list[str]:
    """``"a, b, a"`` -> ``["a", "b"]``: the comma list in order, duplicates dropped, each a known option.

    ValueError for an empty list or an unknown option (naming it and the valid ones).
    """
    if not isinstance(rollout_rs, str):
        raise ValueError(f"rollout_rs must be a string of comma separated options; got {rollout_rs!r}")
    options: list[str] = []
    for option in (part.strip() for part in rollout_rs.split(",")):
        if not option:
            continue
        if option not in ROLLOUT_RS_OPTIONS:
            raise ValueError(f"unknown rollout_rs option {option!r}; valid options: {', '.join(ROLLOUT_RS_OPTIONS)}")
        if option not in options:
            options.append(option)
    if not options:
        raise ValueError("rollout_rs names no option")
    return options


def _number(text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"rollout_rs_threshold for {option}: {text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"rollout_rs_threshold for {option} must be positive and finite; got {text}")
    return value


def parse_rs_thresholds(options: list[str], spec: str | float | None) -> dict[str, tuple[float | None, float]]:
    """Each option's (lower, upper) bound from ``rollout_rs_threshold`` (verl's rules, module docstring).

    One spec serves every option; otherwise there must be exactly one per option. For a k1
    option a single number u gives (1/u, u); a k2 / k3 option has lower None and refuses a
    ``lower_upper`` spec. ValueError for a missing, malformed, non-positive or inverted bound.
    """
    if spec is None:
        raise ValueError("rollout_rs_threshold must be given with rollout_rs")
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        raise ValueError(f"rollout_rs_threshold must be a number or a string; got {spec!r}")
    specs = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold has {len(specs)} entries; give one for all options or one for "
                         f"each of the {len(options)} ({', '.join(options)})")
    if len(specs) == 1:
        specs = specs * len(options)
    bounds: dict[str, tuple[float | None, float]] = {}
    for option, text in zip(options, specs):
        if option.endswith("k1"):
            if "_" in text:
                lower_text, upper_text = text.split("_", 1)
                lower, upper = _number(lower_text, option), _number(upper_text, option)
            else:
                upper = _number(text, option)
                lower = 1.0 / upper
            if lower > upper:
                raise ValueError(f"rollout_rs_threshold for {option}: lower bound {lower} exceeds upper {upper}")
            bounds[option] = (lower, upper)
        else:
            if "_" in text:
                raise ValueError(f"rollout_rs_threshold for {option} is one upper bound (no 'lower_upper'); got {text!r}")
            bounds[option] = (None, _number(text, option))
    return bounds


def rollout_rejection_mask(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    rollout_rs: str,
    rollout_rs_threshold: str | float,
) -> tuple[Tensor, dict[str, tuple[float, float]]]:
    """The rejection mask keep [B, T] (1 kept, 0 rejected or padding; ``response_mask``'s dtype) and its metrics.

    keep_t = m_t * prod_{options o} [lower_o <= S_o <= upper_o] with the statistics and bounds of
    the module docstring (lower in log space for k1, none for k2 / k3); sequence options
    broadcast S_i over row i. Computed in float64, without gradient.

    Metrics, each (value, weight) for a weighted mean across processes (``rollout_corr/`` prefix, verl's names):

    - ``rollout_rs_masked_fraction``: rejected share of valid tokens (weight: valid tokens);
    - ``rollout_rs_seq_masked_fraction``: share of rows with a rejected token (weight: rows);
    - per option o: ``rollout_rs_<o>_masked_fraction`` (tokens), ``rollout_rs_<o>_seq_masked_fraction``
      (over rows with a valid token) and ``rollout_rs_<o>_mean``, the mean over valid tokens of
      the statistic (for a sequence option, S_i counted once per valid token of row i).

    ValueError (from ``parse_rs_options`` / ``parse_rs_thresholds``) for a bad option or threshold.
    """
    options = parse_rs_options(rollout_rs)
    bounds = parse_rs_thresholds(options, rollout_rs_threshold)
    valid = response_mask != 0
    mask = valid.to(torch.float64)
    old = torch.where(valid, old_log_prob.detach().to(torch.float64), 0.0)
    rollout = torch.where(valid, rollout_log_prob.detach().to(torch.float64), 0.0)
    d = (old - rollout).clamp(-RS_LOG_RATIO_BOUND, RS_LOG_RATIO_BOUND)
    token_stats = {"k1": -d, "k2": 0.5 * d.square(), "k3": torch.expm1(d) - d}
    counts = mask.sum(-1)
    rows = counts > 0
    n_tokens, n_rows = mask.sum(), rows.sum()

    keep = valid.clone()
    metrics: dict[str, tuple[float, float]] = {}
    for option in options:
        lower, upper = bounds[option]
        stat = token_stats[option[-2:]]
        if option.startswith("seq_sum"):
            stat = (stat * mask).sum(-1, keepdim=True).expand_as(d)
        elif option.startswith("seq_mean"):
            stat = ((stat * mask).sum(-1) / counts.clamp(min=1)).unsqueeze(-1).expand_as(d)
        elif option.startswith("seq_max"):
            stat = torch.where(valid, stat, -math.inf).amax(-1, keepdim=True)
            stat = torch.where(rows.unsqueeze(-1), stat, 0.0).expand_as(d)
        if lower is None:
            passed = stat <= upper
        else:
            passed = (stat >= math.log(lower)) & (stat <= math.log(upper))
        rejected = valid & ~passed
        keep &= passed
        prefix = f"rollout_rs_{option}"
        metrics[f"{prefix}_masked_fraction"] = mean_and_count(rejected.to(torch.float64), n_tokens)
        metrics[f"{prefix}_seq_masked_fraction"] = mean_and_count(rejected.any(-1).to(torch.float64), n_rows)
        metrics[f"{prefix}_mean"] = mean_and_count(torch.where(valid, stat, 0.0), n_tokens)
    rejected = valid & ~keep
    metrics["rollout_rs_masked_fraction"] = mean_and_count(rejected.to(torch.float64), n_tokens)
    metrics["rollout_rs_seq_masked_fraction"] = mean_and_count(rejected.any(-1).to(torch.float64), valid.shape[0])
    return keep.to(response_mask.dtype), metrics
