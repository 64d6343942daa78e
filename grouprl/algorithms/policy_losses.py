"""Policy-gradient losses of the GRPO family, per token, then aggregated to a scalar.

Notation (all [B, R]): log_prob = log pi_theta(y_t), old_log_prob = log pi_old(y_t) (the
policy that sampled), A = advantages, m = response mask, sg = stop-gradient,
d = clamp(log_prob - old_log_prob, -20, 20) (the clamp keeps exp finite), r = exp(d).

Every loss is a pure function registered by name in ``POLICY_LOSSES`` with its options class
(``grouprl.algorithms.options``): ``fn(log_prob, old_log_prob, advantages, response_mask, *,
<options>) -> PolicyLossTerms``. ``compute_policy_loss`` checks the options given against the
loss's class by name, fills the rest from its defaults, aggregates the per-token loss and
computes the metrics. An option may be None (e.g. that clip bound is off, CISPO's lower cap)
only where its default is None.

Masked positions (padding, template tokens of multi-turn responses) may hold nan or inf
log-probs or advantages. ``compute_policy_loss`` replaces them by 0 before calling the loss
and aggregation selects them away, so they reach neither the loss nor its gradient: a
select on the output alone would not do, as exp's backward turns the 0 gradient of a
masked position back into nan (0 * exp(nan)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from grouprl.algorithms.aggregation import aggregate_loss
from grouprl.algorithms.options import option_defaults, register_with_options, split_options
from grouprl.registry import Registry

LOG_RATIO_CLAMP = 20.0
AGGREGATION_OPTIONS = ("num_tokens", "num_seqs", "norm_len")


@dataclass
class PolicyLossTerms:
    """What a policy loss produces, per token ([B, R]); masking is left to the caller.

    ``ratio`` is the importance ratio the loss used (token or sequence level), for metrics.
    The ``clipped_*`` masks mark tokens where a clip bound is active; ``dual_clipped`` is
    None for losses without a dual clip.
    """

    loss: Tensor
    ratio: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    dual_clipped: Tensor | None = None


PolicyLoss = Callable[..., PolicyLossTerms]

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", error=ValueError)
# name -> the loss's options class (``grouprl.algorithms.options``)
POLICY_LOSS_OPTIONS: dict[str, type] = {}
# what a loss receives besides its options: computed by the trainer, never set by a user
POLICY_LOSS_INPUTS = ("log_prob", "old_log_prob", "advantages", "response_mask")


def register_policy_loss(name: str, *, options: type | None = None,
                         overwrite: bool = False) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator adding ``fn(log_prob, old_log_prob, advantages, response_mask, *, <options>) -> PolicyLossTerms``.

    ``options``: a dataclass of the options the loss takes (each a keyword parameter of ``fn``,
    with its default); None makes one from ``fn``'s keyword-only parameters with defaults.
    """
    return register_with_options(POLICY_LOSSES, POLICY_LOSS_OPTIONS, kind="policy loss", name=name,
                                 options=options, inputs=POLICY_LOSS_INPUTS, overwrite=overwrite)


def policy_loss_options_class(name: str) -> type:
    """The options class registered with policy loss ``name``; ValueError naming the valid losses."""
    if POLICY_LOSSES.get(name, None) is None:
        raise ValueError(f"unknown policy loss {name!r}; valid names: {', '.join(POLICY_LOSSES.names())}")
    return POLICY_LOSS_OPTIONS[name]


@dataclass(frozen=True)
class PPOClipOptions:
    """PPO's clip range [1 - clip_ratio_low, 1 + clip_ratio_high] on the token ratio (asymmetric: DAPO's
    clip-higher), and the dual clip c > 1 bounding the loss of negative-advantage tokens (None: off)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.3
    clip_ratio_dual: float | None = None


@dataclass(frozen=True)
class GSPOOptions:
    """GSPO's clip range on the sequence ratio; the paper's 3e-4 / 4e-4."""

    clip_ratio_low: float = 3e-4
    clip_ratio_high: float = 4e-4


@dataclass(frozen=True)
class CISPOOptions:
    """CISPO's cap on its detached importance weight, [1 - low, 1 + high]; low None = no lower cap."""

    clip_ratio_low: float | None = None
    clip_ratio_high: float = 4.0


@dataclass(frozen=True)
class GMPOOptions:
    """GMPO's clip range in log space: token log-ratios within [-clip_ratio_low, clip_ratio_high]; the paper's
    0.4 / 0.4 (ratios within [exp(-0.4), exp(0.4)])."""

    clip_ratio_low: float = 0.4
    clip_ratio_high: float = 0.4

    def __post_init__(self):
        for name in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be > 0 and finite (a log-space bound); got {value}")


@dataclass(frozen=True)
class SAPOOptions:
    """SAPO's gate temperatures for positive and negative advantages."""

    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05


def clamped_log_ratio(log_prob: Tensor, old_log_prob: Tensor) -> Tensor:
    """d = clamp(log_prob - old_log_prob, -20, 20)."""
    return (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_ratio_low: float, clip_ratio_high: float):
    """PPO clip: l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), with where each bound binds.

    The upper bound binds (and the gradient vanishes) when A > 0 and r > 1 + eps_high;
    the lower one when A < 0 and r < 1 - eps_low.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    clipped_high = (advantages > 0) & (ratio > 1 + clip_ratio_high)
    clipped_low = (advantages < 0) & (ratio < 1 - clip_ratio_low)
    return loss, clipped_low, clipped_high


@register_policy_loss("vanilla", options=PPOClipOptions)
def vanilla_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.3,
    clip_ratio_dual: float | None = None,
) -> PolicyLossTerms:
    """PPO clip with asymmetric range (DAPO clip-higher) and optional dual clip.

    l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high));
    with c = ``clip_ratio_dual`` (> 1): for A < 0, l = min(l, -A c), which bounds the loss of
    a negative-advantage token whose ratio has grown past c (its gradient is then 0).
    """
    ratio = torch.exp(clamped_log_ratio(log_prob, old_log_prob))
    loss, clipped_low, clipped_high = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    dual_clipped = None
    if clip_ratio_dual is not None:
        if clip_ratio_dual <= 1.0:
            raise ValueError(f"clip_ratio_dual must be > 1; got {clip_ratio_dual}")
        negative = advantages < 0
        loss = torch.where(negative, torch.minimum(loss, -advantages * clip_ratio_dual), loss)
        # For A < 0 the clipped loss is -A max(r, 1 - eps_low), which exceeds -A c exactly when r > c.
        dual_clipped = negative & (ratio > clip_ratio_dual)
    return PolicyLossTerms(loss, ratio.detach(), clipped_low, clipped_high, dual_clipped)


def _select_valid(values: Tensor, response_mask: Tensor) -> Tensor:
    """values where m != 0, exactly 0 elsewhere; the gradient at masked positions is 0, never nan."""
    return torch.where(response_mask != 0, values, torch.zeros_like(values))


def sequence_log_ratio(log_prob: Tensor, old_log_prob: Tensor, response_mask: Tensor) -> Tensor:
    """log s_i = sum_t m_t d_t / sum_t m_t, shape [B] (0 for a row with no valid token)."""
    mask = response_mask.to(log_prob.dtype)
    # Padding log-probs are arbitrary, even nan or inf: select them away before d is formed,
    # since multiplying d by m would give nan (and a nan gradient) for them.
    log_ratio = clamped_log_ratio(_select_valid(log_prob, response_mask), _select_valid(old_log_prob, response_mask))
    return (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)


@register_policy_loss("gspo", options=GSPOOptions)
def gspo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
) -> PolicyLossTerms:
    """GSPO, sequence form: one importance ratio per response, clipped as a whole.

    s_i = exp(sum_t m_t d_t / sum_t m_t)   (geometric mean of the token ratios)
    l_{i,t} = max(-A_{i,t} s_i, -A_{i,t} clip(s_i, 1 - eps_low, 1 + eps_high))
    s_i is broadcast over response i's tokens ([B] -> [B, 1] -> [B, R]), so the gradient of
    every token's loss reaches all tokens of the response. GSPO's clip range is tiny
    (3e-4 / 4e-4 in the paper). Aggregation is not forced: ``seq-mean-token-mean`` is the
    recommended ``loss_agg_mode``, the mean of per-sequence terms the objective is defined as.
    """
    seq_log = sequence_log_ratio(log_prob, old_log_prob, response_mask)
    ratio = torch.exp(seq_log).unsqueeze(-1).expand_as(log_prob)
    loss, clipped_low, clipped_high = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    return PolicyLossTerms(loss, ratio.detach(), clipped_low, clipped_high)


@register_policy_loss("gspo_token", options=GSPOOptions)
def gspo_token_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
) -> PolicyLossTerms:
    """GSPO-token: log s_{i,t} = sg(log s_i) + log_prob_t - sg(log_prob_t).

    s_{i,t} equals s_i in value but its gradient is s_i * grad log_prob_t, so per-token
    advantages weigh their own token. l_{i,t} = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - eps_low, 1 + eps_high)).
    With A constant over a response it has the same value and gradient as ``gspo``.
    """
    seq_log = sequence_log_ratio(log_prob, old_log_prob, response_mask).detach()
    ratio = torch.exp(seq_log.unsqueeze(-1) + log_prob - log_prob.detach())
    loss, clipped_low, clipped_high = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    return PolicyLossTerms(loss, ratio.detach(), clipped_low, clipped_high)


@register_policy_loss("cispo", options=CISPOOptions)
def cispo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float = 4.0,
) -> PolicyLossTerms:
    """CISPO: l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log_prob.

    The importance weight is clipped and detached instead of the update, so every token
    keeps a gradient (REINFORCE with a capped weight). ``clip_ratio_low=None`` (the default)
    means no lower cap, l = -sg(min(r, 1 + eps_high)) * A * log_prob: CISPO usually caps
    only above, e.g. at r = 5 (``clip_ratio_high=4.0``). ``clipped_*`` mark tokens whose
    weight hit a bound, whatever the sign of A (``clipped_low`` is all False without a lower cap).
    """
    ratio = torch.exp(clamped_log_ratio(log_prob, old_log_prob)).detach()
    low = None if clip_ratio_low is None else 1 - clip_ratio_low
    weight = ratio.clamp(min=low, max=1 + clip_ratio_high)
    loss = -weight * advantages * log_prob
    clipped_low = torch.zeros_like(ratio, dtype=torch.bool) if low is None else ratio < low
    return PolicyLossTerms(loss, ratio, clipped_low, ratio > 1 + clip_ratio_high)


@register_policy_loss("sapo", options=SAPOOptions)
def sapo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
) -> PolicyLossTerms:
    """SAPO: l = -A (4 / tau) sigmoid(tau (r - 1)), tau = ``sapo_tau_pos`` if A > 0 else ``sapo_tau_neg``.

    A smooth gate instead of a hard clip: the gradient is -A * 4 sigmoid'(tau (r - 1)) * r * grad log_prob,
    equal to PPO's at r = 1 and decaying as r leaves 1 (faster for negative advantages).
    No clip bound, so the clip masks are all False.
    """
    ratio = torch.exp(clamped_log_ratio(log_prob, old_log_prob))
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(sapo_tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(sapo_tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    loss = -advantages * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1))
    never = torch.zeros_like(ratio, dtype=torch.bool)
    return PolicyLossTerms(loss, ratio.detach(), never, never)


@register_policy_loss("reinforce")
def reinforce_policy_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                          response_mask: Tensor) -> PolicyLossTerms:
    """REINFORCE: l = -A * log_prob (no ratio, no clip; old_log_prob is read for the ratio metric only).

    The gradient is -A grad log_prob. With ``token_weights`` w (an IS weight pi_theta / pi_rollout,
    detached) it is verl's bypass-mode REINFORCE, l = -sg(w) A log_prob
    (``compute_policy_loss_reinforce``). ``ratio`` = r for metrics; nothing is ever clipped.
    """
    ratio = torch.exp(clamped_log_ratio(log_prob, old_log_prob)).detach()
    never = torch.zeros_like(ratio, dtype=torch.bool)
    return PolicyLossTerms(-advantages * log_prob, ratio, never, never)


@register_policy_loss("geo_mean", options=GMPOOptions)
def geo_mean_policy_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
                         clip_ratio_low: float = 0.4, clip_ratio_high: float = 0.4) -> PolicyLossTerms:
    """GMPO (geometric-mean policy optimisation, arXiv 2507.20673): one ratio per response, the
    geometric mean of its token ratios, each clipped in log space first.

    A_i = sum_t m_t A_{i,t} / sum_t m_t   (the response's advantage; per-token advantages are averaged)
    c_t = min(d_t, clamp(d_t, -eps_low, eps_high)) if A_i > 0, else max(d_t, clamp(d_t, -eps_low, eps_high))
    l_i = -A_i exp(sum_t m_t c_t / max(sum_t m_t, 1))
    The clip is sign-aware and one-sided (PPO's min written in log space): a positive response's
    token stops pulling once d_t > eps_high, a negative one's once d_t < -eps_low. The range is
    in log space (ratios within [exp(-eps_low), exp(eps_high)]; the paper's 0.4 / 0.4). l_i is
    broadcast over response i's tokens ([B] -> [B, R]), as ``gspo`` does, so
    ``loss_agg_mode: seq-mean-token-mean`` gives mean_i l_i, the paper's objective (token-mean
    weighs responses by length). ``clipped_high`` marks tokens with A_i > 0 and d_t > eps_high,
    ``clipped_low`` those with A_i < 0 and d_t < -eps_low (TRL's GMPO metrics).

    Differences from the peers, same tensors otherwise: d_t is clamped to [-20, 20] before the
    clip (neither peer clamps; it keeps exp finite); A_i = 0 takes the max branch, as TRL
    (verl multiplies by sign(A) = 0; the loss and its gradient are 0 either way); the token
    count is clamped to 1 where verl adds 1e-8 (the same for any response with a token); verl
    always takes the mean over rows, ignoring ``loss_agg_mode``; a response with no valid token
    has A_i = 0 here (verl's too), while TRL's mean still adds -A_i for it (no gradient either way).
    ``token_weights`` (rollout correction) scale each token's share of l_i, so seq-mean-token-mean
    gives l_i times the mean weight; verl multiplies l_i by the weights' geometric mean.
    """
    mask = response_mask.to(log_prob.dtype)
    count = mask.sum(-1).clamp(min=1)
    seq_advantages = (_select_valid(advantages, response_mask) * mask).sum(-1) / count
    log_ratio = clamped_log_ratio(_select_valid(log_prob, response_mask), _select_valid(old_log_prob, response_mask))
    bounded = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    positive = (seq_advantages > 0).unsqueeze(-1)
    clipped = torch.where(positive, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded))
    ratio = torch.exp((clipped * mask).sum(-1) / count)
    loss = (-seq_advantages * ratio).unsqueeze(-1).expand_as(log_prob)
    negative = (seq_advantages < 0).unsqueeze(-1)
    clipped_high = positive & (log_ratio > clip_ratio_high)
    clipped_low = negative & (log_ratio < -clip_ratio_low)
    return PolicyLossTerms(loss, ratio.detach().unsqueeze(-1).expand_as(log_prob), clipped_low, clipped_high)


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    # Selected, not multiplied: a custom loss may leave nan in its terms at masked positions.
    mask = mask.to(torch.float64)
    selected = torch.where(mask != 0, values.detach().to(torch.float64) * mask, 0.0)
    return float(selected.sum() / mask.sum().clamp(min=1))


def _resolve_options(name: str, options: dict) -> dict:
    """The loss's options: those given, checked against its options class by name, the rest its defaults.

    TypeError naming the loss for an option it does not take; ValueError for a None where the
    option's default is not None (a bound the loss needs), naming the losses that take None there.
    """
    cls = policy_loss_options_class(name)
    given = split_options("policy loss", name, cls, options)
    defaults = option_defaults(cls)
    for key, value in given.items():
        if value is None and defaults[key] is not None:
            optional = sorted(other for other, other_cls in POLICY_LOSS_OPTIONS.items()
                              if option_defaults(other_cls).get(key, 0) is None)
            raise ValueError(
                f"policy loss {name!r} needs a number for {key}, got None; None (no such bound) is accepted only by: "
                + (", ".join(optional) or "none")
            )
    return {**defaults, **given}


def compute_policy_loss(
    name: str,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    token_weights: Tensor | None = None,
    **options,
) -> tuple[Tensor, dict[str, float]]:
    """Scalar policy loss and metrics: aggregate_loss(POLICY_LOSSES[name](...).loss, m, loss_agg_mode).

    ``options`` holds the aggregation options ``num_tokens`` / ``num_seqs`` / ``norm_len`` (pass
    the mini-batch totals when accumulating gradients over micro-batches, see
    ``aggregation``) and the loss's own options, checked by name against the options class
    registered with it (``POLICY_LOSS_OPTIONS[name]``: the clip range for ``vanilla``, ``gspo``,
    ``cispo``, the temperatures for ``sapo``); options not given take the class's defaults, and
    one the loss does not take raises TypeError naming the loss and its options. An option may
    be None only where its default is None: ``clip_ratio_low=None`` works for ``cispo`` (no
    lower cap) and raises ValueError naming the loss for ``vanilla``, ``gspo``, ``gspo_token`` and
    ``geo_mean``.

    log_prob, old_log_prob and advantages are replaced by 0 where the mask is 0 before the
    loss sees them, so nan or inf there (padding, template tokens) leave the loss, its
    gradient (0 at those positions) and the metrics finite.

    ``token_weights`` ([B, R], e.g. ``rollout_importance_weights``) scales each token's loss
    before aggregation: aggregate_loss(w * l, m, loss_agg_mode). It is a constant (detached,
    no gradient flows into it) and is replaced by 0 where m = 0, so nan or inf there reach
    neither the loss nor its gradient. The metrics below ignore it. Without it (None) the
    loss is the unweighted one, bit for bit.

    Metrics (python floats, means over valid tokens of this call's batch):
    ``clipfrac`` fraction of tokens where any clip bound is active (for PPO-style losses,
    the tokens whose gradient clipping zeroes), ``clipfrac_low``, ``clipfrac_high``,
    ``dual_clipfrac`` (vanilla with ``clip_ratio_dual``; 0 otherwise), ``ppo_kl`` mean of -d, ``ratio_mean`` mean of the
    ratio the loss used (sequence ratio for GSPO).
    """
    fn = POLICY_LOSSES.get(name, None)
    if fn is None:
        raise ValueError(f"unknown policy loss {name!r}; valid names: {', '.join(POLICY_LOSSES.names())}")
    shapes = {t.shape for t in (log_prob, old_log_prob, advantages, response_mask)}
    if len(shapes) != 1 or log_prob.dim() != 2:
        raise ValueError(
            "log_prob, old_log_prob, advantages and response_mask must share one [B, R] shape; got "
            + ", ".join(str(tuple(t.shape)) for t in (log_prob, old_log_prob, advantages, response_mask))
        )
    if token_weights is not None and token_weights.shape != log_prob.shape:
        raise ValueError(f"token_weights must have shape {tuple(log_prob.shape)}; got {tuple(token_weights.shape)}")
    agg_options = {k: options.pop(k) for k in AGGREGATION_OPTIONS if k in options}
    kwargs = _resolve_options(name, options)
    # Sanitise the inputs, not just the output: a select on the loss still lets nan into the
    # gradient through the ops that produced it (exp's backward: 0 * exp(nan) = nan).
    log_prob = _select_valid(log_prob, response_mask)
    old_log_prob = _select_valid(old_log_prob, response_mask)
    advantages = _select_valid(advantages, response_mask)
    terms = fn(log_prob, old_log_prob, advantages, response_mask, **kwargs)

    per_token = terms.loss
    if token_weights is not None:
        # Selected before the product: nan * 0 would put nan into the loss's gradient at masked positions.
        per_token = per_token * _select_valid(token_weights.detach(), response_mask)
    loss = aggregate_loss(per_token, response_mask, loss_agg_mode, **agg_options)

    # Same keys for every loss so that logged series stay aligned when the loss changes.
    dual = terms.dual_clipped if terms.dual_clipped is not None else torch.zeros_like(terms.clipped_low)
    metrics = {
        "clipfrac": _masked_mean((terms.clipped_low | terms.clipped_high | dual).float(), response_mask),
        "clipfrac_low": _masked_mean(terms.clipped_low.float(), response_mask),
        "clipfrac_high": _masked_mean(terms.clipped_high.float(), response_mask),
        "dual_clipfrac": _masked_mean(dual.float(), response_mask),
        "ppo_kl": _masked_mean(-clamped_log_ratio(log_prob, old_log_prob), response_mask),
        "ratio_mean": _masked_mean(terms.ratio, response_mask),
    }
    return loss, metrics
