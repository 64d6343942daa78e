"""Advantage estimators: from one scalar score per response to per-response (or per-token) advantages.

Notation: a group is the set of responses that answer the same prompt (rows sharing
a ``group_index`` id); R_i is response i's score; n_g, mean_g, std_g are its group's
size, mean and unbiased standard deviation; m is the response mask.

Every estimator is a pure function ``fn(scores, group_index, *, <options>)`` registered
by name in ``ADVANTAGE_ESTIMATORS``. Outcome estimators return one advantage per
response, shape [B]; ``compute_advantages`` broadcasts it to the tokens when a
``response_mask`` is given. Token-level estimators declare a ``response_mask``
parameter and return [B, R] themselves.

Group ids may be a torch tensor of any integer dtype, a list or tuple of ints, a numpy
array of ints, or strings (a list or numpy array of str, e.g. verl's uids); see
``dense_group_index``. ``compute_advantages`` hands estimators dense long group numbers.

Statistics are computed in float64 and results returned in the scores' floating dtype
(the default dtype for integer scores). In float32 the mean of a group of equal scores
such as 0.7 is off by a rounding error, and dividing that residue by an equally tiny std
gave a visible advantage to a group with no reward spread at all.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from grouprl.algorithms.options import NoOptions, register_with_options
from grouprl.registry import Registry

AdvantageEstimator = Callable[..., Tensor]

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", error=ValueError)


# Estimators whose baseline is the rest of the group: with one response per prompt every
# advantage is 0 and nothing trains, so a config with worker.rollout.n < 2 is refused for them.
GROUP_RELATIVE_ESTIMATORS: set[str] = set()


# name -> the estimator's options class (``grouprl.algorithms.options``)
ADVANTAGE_ESTIMATOR_OPTIONS: dict[str, type] = {}
# What an estimator may take besides its options, computed by the trainer at run time (never set
# by a user): the response mask, per-token rewards (KL in the reward), ReMax's greedy baseline
# scores, and the std of the whole batch across processes.
ADVANTAGE_ESTIMATOR_INPUTS = ("scores", "group_index", "response_mask", "token_rewards", "baseline_scores",
                              "batch_std")


def register_advantage_estimator(
    name: str, *, options: type | None = None, overwrite: bool = False, group_relative: bool = False
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator adding ``fn(scores, group_index, *, <inputs>, <options>) -> Tensor`` to ``ADVANTAGE_ESTIMATORS``.

    Declare a keyword parameter ``response_mask`` to receive the [B, R] mask and return
    per-token advantages; otherwise return one advantage per row ([B]). The other run-time
    inputs an estimator may declare are in ``ADVANTAGE_ESTIMATOR_INPUTS``. ``options``: a
    dataclass of the options it takes (each a keyword parameter of ``fn``, with its default);
    None makes one from its keyword-only parameters with defaults that are not inputs.
    ``group_relative``: the estimator needs at least two responses per prompt
    (``GROUP_RELATIVE_ESTIMATORS``).
    """
    if group_relative:
        GROUP_RELATIVE_ESTIMATORS.add(name)
    else:
        GROUP_RELATIVE_ESTIMATORS.discard(name)
    return register_with_options(ADVANTAGE_ESTIMATORS, ADVANTAGE_ESTIMATOR_OPTIONS, kind="advantage estimator",
                                 name=name, options=options, inputs=ADVANTAGE_ESTIMATOR_INPUTS, overwrite=overwrite)


def advantage_estimator_options_class(name: str) -> type:
    """The options class registered with estimator ``name``; ValueError naming the valid estimators."""
    if ADVANTAGE_ESTIMATORS.get(name, None) is None:
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {', '.join(ADVANTAGE_ESTIMATORS.names())}")
    return ADVANTAGE_ESTIMATOR_OPTIONS[name]


def estimator_inputs(name: str, options: dict | None = None) -> set[str]:
    """The run-time inputs (``ADVANTAGE_ESTIMATOR_INPUTS``) that estimator ``name`` declares as parameters,
    or with ``options`` those it needs under them: an options class may say so with a method
    ``needed_inputs(self) -> set[str]`` (GRPO needs the batch std, a collective, only at std_level batch)."""
    params = inspect.signature(ADVANTAGE_ESTIMATORS.get(name)).parameters
    declared = {p for p in ADVANTAGE_ESTIMATOR_INPUTS if p in params}
    needed = getattr(ADVANTAGE_ESTIMATOR_OPTIONS.get(name), "needed_inputs", None)
    if options is None or needed is None:
        return declared
    try:
        chosen = ADVANTAGE_ESTIMATOR_OPTIONS[name](**options)
    except TypeError:  # options outside the class (an older keyword such as grpo's norm_by_std): assume all
        return declared
    return declared & set(needed(chosen))


@dataclass(frozen=True)
class GRPOOptions:
    """What GRPO divides (R - group mean) by: ``group`` (its group's std), ``batch`` (the whole
    batch's std, TRL's scale_rewards batch), ``none`` (Dr. GRPO); eps keeps the division finite."""

    std_level: str = "group"
    eps: float = 1e-6

    def needed_inputs(self) -> set[str]:
        """The batch std is computed over every process (a collective): only when this std level divides by it."""
        return {"scores", "group_index", "response_mask"} | ({"batch_std"} if self.std_level == "batch" else set())


@dataclass(frozen=True)
class PassKOptions:
    """Pass@k GRPO: whether the best response's margin is divided by its group's std."""

    norm_by_std: bool = True
    eps: float = 1e-6


@dataclass(frozen=True)
class ReinforcePlusPlusOptions:
    """REINFORCE++: the discount of the token returns, and the whitening's eps."""

    gamma: float = 1.0
    eps: float = 1e-6


@dataclass(frozen=True)
class WhitenOptions:
    """The eps of a batch whitening."""

    eps: float = 1e-6


# ---------------------------------------------------------------------------
# Group ids
# ---------------------------------------------------------------------------

_GROUP_ID_KINDS = "a torch integer tensor, a list/tuple or numpy array of ints, or a list/numpy array of str"


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True/False as group ids is almost surely a mask passed by mistake.
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _ids_as_numpy(group_index: Any) -> np.ndarray:
    """Integer or string ids of a list, tuple or numpy array as a numpy array; TypeError otherwise."""
    if isinstance(group_index, np.ndarray):
        if group_index.dtype.kind in "iuU" or group_index.size == 0:
            return group_index
        if group_index.dtype.kind != "O":
            raise TypeError(f"group_index must be {_GROUP_ID_KINDS}; got a numpy array of dtype {group_index.dtype}")
        values = group_index.ravel().tolist()
    elif isinstance(group_index, (list, tuple)):
        values = list(group_index)
    else:
        raise TypeError(f"group_index must be {_GROUP_ID_KINDS}; got {type(group_index).__name__}")
    # Checked element by element: numpy would silently turn [1, "a"] into strings and [1, 2.5] into floats.
    if all(_is_int(v) for v in values):
        return np.asarray(values, dtype=np.int64).reshape(np.shape(group_index))
    if all(isinstance(v, str) for v in values):
        return np.asarray(values, dtype=object).reshape(np.shape(group_index))
    kinds = sorted({type(v).__name__ for v in values})
    raise TypeError(f"group_index must be {_GROUP_ID_KINDS}; got elements of type {', '.join(kinds)}")


def dense_group_index(
    group_index: Any, num_rows: int | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """Any accepted kind of group ids as dense group numbers: LongTensor [B], values 0 .. G-1.

    g_i = rank of row i's id among the distinct ids in sorted order, so two rows share a
    number exactly when they share an id. Accepted: a torch tensor of any integer dtype, a
    list or tuple of ints, a numpy array of ints, a list or numpy array (str or object
    dtype) of str. TypeError for anything else (floats, bools, mixed ints and strings);
    ValueError when the ids are not one-dimensional or their count is not ``num_rows``.
    The result is on ``device`` (default: the input tensor's device, else the CPU).
    """
    if isinstance(group_index, Tensor):
        if group_index.is_floating_point() or group_index.is_complex() or group_index.dtype == torch.bool:
            raise TypeError(f"group_index must be {_GROUP_ID_KINDS}; got a torch tensor of dtype {group_index.dtype}")
        ids: Tensor | np.ndarray = group_index
    else:
        ids = _ids_as_numpy(group_index)
    if ids.ndim != 1:
        raise ValueError(f"group_index must be one-dimensional ([B]); got shape {tuple(ids.shape)}")
    if num_rows is not None and ids.shape[0] != num_rows:
        raise ValueError(f"group_index has {ids.shape[0]} ids but scores has {num_rows} rows")
    if isinstance(ids, Tensor):
        dense = torch.unique(ids, return_inverse=True)[1] if ids.numel() else ids.new_zeros(0)
        return dense.to(device=device if device is not None else ids.device, dtype=torch.long)
    dense_np = np.unique(ids, return_inverse=True)[1] if ids.size else np.zeros(0, dtype=np.int64)
    return torch.as_tensor(dense_np.reshape(-1).astype(np.int64), device=device)


# ---------------------------------------------------------------------------
# Group statistics
# ---------------------------------------------------------------------------


def _result_dtype(scores: Tensor) -> torch.dtype:
    return scores.dtype if scores.is_floating_point() else torch.get_default_dtype()


def _prepare(scores: Tensor, group_index: Any) -> tuple[Tensor, Tensor, torch.dtype]:
    """(scores in float64, dense group numbers, dtype of the result) after checking shapes."""
    if scores.dim() != 1:
        raise ValueError(f"scores must have shape [B]; got {tuple(scores.shape)}")
    dense = dense_group_index(group_index, scores.shape[0], device=scores.device)
    return scores.to(torch.float64), dense, _result_dtype(scores)


def _group_moments(scores64: Tensor, dense: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float64 (mean_g, std_g, n_g) of each row's group, [B] each (formulas on ``group_statistics``)."""
    num_groups = int(dense.max()) + 1 if dense.numel() else 0

    def per_group_sum(values: Tensor) -> Tensor:
        return torch.zeros(num_groups, dtype=torch.float64, device=scores64.device).index_add_(0, dense, values)

    count = per_group_sum(torch.ones_like(scores64))
    # In float64 a sum of n equal float32 (or lower) values is exact for any realistic n, so
    # mean_g of a group of equal scores is the score itself and its std exactly 0.
    mean = per_group_sum(scores64) / count
    # Two-pass variance: subtracting the mean first avoids the cancellation of E[x^2] - E[x]^2.
    sum_squared = per_group_sum((scores64 - mean[dense]) ** 2)
    std = torch.where(count > 1, (sum_squared / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(count))
    return mean[dense], std[dense], count[dense]


def group_statistics(
    scores: Tensor, group_index: Any, *, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row statistics of the row's group: (mean_g, std_g, n_g), each shape [B].

    mean_g = sum_{j in g} R_j / n_g
    std_g  = sqrt(sum_{j in g} (R_j - mean_g)^2 / (n_g - 1))   (unbiased, like torch.std)
             and 0 for a group of size 1 (where the unbiased estimate is undefined).
    Group ids: any kind ``dense_group_index`` accepts; they need not be contiguous or sorted.
    Computed in float64, returned in ``dtype`` (default: the scores' floating dtype, or the
    default dtype for integer scores); a group of equal scores has std exactly 0.
    """
    scores64, dense, result_dtype = _prepare(scores, group_index)
    out = dtype if dtype is not None else result_dtype
    return tuple(stat.to(out) for stat in _group_moments(scores64, dense))


def _check_token_shape(name: str, tensor: Tensor, scores: Tensor) -> None:
    if tensor.dim() != 2 or tensor.shape[0] != scores.shape[0]:
        raise ValueError(f"{name} must have shape [B, R] with B={scores.shape[0]}; got {tuple(tensor.shape)}")


def masked_whiten(values: Tensor, mask: Tensor, eps: float) -> Tensor:
    """Whiten ``values`` over the positions where ``mask`` is nonzero, exactly 0 elsewhere.

    out = (x - mu) / (sigma + eps) * m,  mu = sum(x m)/sum(m),
    sigma = sqrt(sum((x - mu)^2 m) / (sum(m) - 1))   (unbiased; 0 when sum(m) < 2).
    Computed in float64, returned in the values' floating dtype. Masked positions are
    selected away, not multiplied by 0, so nan or inf there never reach the statistics.
    """
    valid = mask != 0
    x = torch.where(valid, values.to(torch.float64), 0.0)
    count = valid.sum().to(torch.float64)
    mean = x.sum() / count.clamp(min=1)
    centred = torch.where(valid, x - mean, 0.0)
    var = (centred**2).sum() / (count - 1).clamp(min=1)
    std = torch.where(count > 1, var.sqrt(), torch.zeros_like(var))
    return (centred / (std + eps)).to(_result_dtype(values))


# ---------------------------------------------------------------------------
# Outcome estimators: one advantage per response
# ---------------------------------------------------------------------------


STD_LEVELS = ("group", "batch", "none")


@register_advantage_estimator("grpo", options=GRPOOptions, group_relative=True)
def grpo_advantages(scores: Tensor, group_index: Any, *, norm_by_std: bool = True, std_level: str | None = None,
                    batch_std: float | None = None, eps: float = 1e-6) -> Tensor:
    """GRPO: A_i = (R_i - mean_g) / (s + eps), the scale s chosen by ``std_level``.

    - ``group`` (GRPO; TRL's ``scale_rewards="group"``): s = std_g, the unbiased std of the
      row's group (a group of size 1 gets A_i = 0: its std is taken as 1, so 0 stays 0);
    - ``batch`` (TRL's ``scale_rewards="batch"``): s = std_B, the unbiased std of the raw
      rewards over the whole batch, sqrt(sum_i (R_i - mean_B)^2 / (N - 1)), one number for
      every row (taken as 1 for N < 2); ``batch_std`` gives it when the batch spans more rows
      than these (the trainer's processes together), else it is computed from ``scores``;
    - ``none`` (Dr. GRPO; ``scale_rewards="none"``): A_i = R_i - mean_g.

    ``std_level`` None reads the older ``norm_by_std``: True is ``group``, False ``none``.
    A group of equal scores gets exactly 0 at every level.
    Dr. GRPO pairs ``none`` with loss_agg_mode ``seq-mean-token-sum-norm``.
    """
    level = std_level if std_level is not None else ("group" if norm_by_std else "none")
    if level not in STD_LEVELS:
        raise ValueError(f"std_level={level!r} is not one of {', '.join(STD_LEVELS)}")
    x, dense, dtype = _prepare(scores, group_index)
    mean, std, count = _group_moments(x, dense)
    centred = x - mean
    if level == "group":
        centred = centred / (torch.where(count > 1, std, torch.ones_like(std)) + eps)
    elif level == "batch":
        if batch_std is None:
            n = x.numel()
            batch_std = float(x.std()) if n > 1 else 1.0
        centred = centred / (batch_std + eps)
    return centred.to(dtype)


@register_advantage_estimator("rloo", options=NoOptions, group_relative=True)
def rloo_advantages(scores: Tensor, group_index: Any) -> Tensor:
    """RLOO: A_i = R_i - sum_{j in g, j != i} R_j / (n_g - 1) = n_g / (n_g - 1) * (R_i - mean_g).

    A group of size 1 has no other responses to compare with and gets A_i = 0.
    """
    x, dense, dtype = _prepare(scores, group_index)
    mean, _, count = _group_moments(x, dense)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return (scale * (x - mean)).to(dtype)


@register_advantage_estimator("remax", options=NoOptions)
def remax_advantages(scores: Tensor, group_index: Any, *, baseline_scores: Tensor) -> Tensor:
    """ReMax: A_i = R_i - b_i, b_i = reward of the greedy response to row i's prompt (``baseline_scores`` [B]).

    ``group_index`` is not needed by the formula; it is accepted to keep one estimator signature.
    """
    if baseline_scores.shape != scores.shape:
        raise ValueError(f"baseline_scores must have shape {tuple(scores.shape)}; got {tuple(baseline_scores.shape)}")
    return (scores.to(torch.float64) - baseline_scores.to(torch.float64)).to(_result_dtype(scores))


@register_advantage_estimator("grpo_passk", options=PassKOptions, group_relative=True)
def grpo_passk_advantages(
    scores: Tensor, group_index: Any, *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Pass@k GRPO: only the best response of each group is credited.

    A_best = (R_max - R_second) / (std_g + eps)  (or R_max - R_second with ``norm_by_std=False``),
    every other response A_i = 0. Ties for the best go to the lowest row index, and then
    R_max - R_second = 0. A group of size 1 has no second response and gets 0.
    """
    x, dense, dtype = _prepare(scores, group_index)
    _, std, _ = _group_moments(x, dense)
    # Sort by score descending, then (stably) by group: each group becomes a contiguous
    # run ordered best-first, with ties kept in row order.
    by_score = torch.argsort(x, descending=True, stable=True)
    order = by_score[torch.argsort(dense[by_score], stable=True)]
    sizes = torch.bincount(dense)
    starts = torch.cumsum(sizes, 0) - sizes
    has_second = sizes > 1
    best_rows = order[starts[has_second]]
    second_rows = order[starts[has_second] + 1]
    gap = x[best_rows] - x[second_rows]
    if norm_by_std:
        gap = gap / (std[best_rows] + eps)
    advantages = torch.zeros_like(x)
    advantages[best_rows] = gap
    return advantages.to(dtype)


# ---------------------------------------------------------------------------
# Token-level estimators: return [B, R]
# ---------------------------------------------------------------------------


@register_advantage_estimator("reinforce_plus_plus", options=ReinforcePlusPlusOptions)
def reinforce_plus_plus_advantages(
    scores: Tensor,
    group_index: Any,
    *,
    response_mask: Tensor,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """REINFORCE++: whitened discounted token returns, time counted in valid tokens only.

    r_t = token_rewards_t + [t = last valid token] * R_i      on valid tokens (m_t = 1)
    G_t = r_t + gamma * G_next(t),  next(t) = the next VALID position after t (G = 0 past the end)
        = sum over valid k >= t of gamma^(number of valid tokens in [t, k) ) r_k
    A_t = whiten(G) over all valid tokens of the batch (see ``masked_whiten``), 0 where m_t = 0.

    A masked position inside a response (a hole: template tokens between turns, edited
    spans) is not a time step: the running return passes through it unchanged, with no
    discount and no reward (a token reward placed there is dropped, like one on padding).
    With gamma = 1 holes make no difference.

    verl's ``compute_reinforce_plus_plus_outcome_advantage`` (core_algos.py, checked Jan 2026)
    instead runs G_t = r_t + gamma * G_{t+1} over every position and multiplies the running
    return by m_t after each step ("reset after EOS"), so a hole cuts the return: tokens
    before it get none of the reward after it. For responses whose mask is 1 up to EOS
    and 0 after (no holes) both give the same returns; this version carries the return
    across holes, as the REINFORCE++ return over the policy's own tokens intends.
    KL-in-reward enters as ``token_rewards = -beta * kl_penalty(...)``.
    ``group_index`` is not used: the baseline is the batch mean, not the group mean.
    """
    _check_token_shape("response_mask", response_mask, scores)
    x = scores.to(torch.float64)
    valid = response_mask != 0
    rewards = torch.zeros(valid.shape, dtype=torch.float64, device=x.device)
    if token_rewards is not None:
        _check_token_shape("token_rewards", token_rewards, scores)
        # Selected, not multiplied by the mask: a nan or inf reward on a masked token must not leak.
        rewards = torch.where(valid, token_rewards.to(torch.float64), 0.0)
    positions = torch.arange(valid.shape[-1], device=valid.device)
    # Last valid token by position, so masks with holes (e.g. edited spans) still work.
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(-1) if valid.shape[-1] else None
    rows = torch.nonzero(valid.any(-1), as_tuple=True)[0]
    if last is not None:
        rewards[rows, last[rows]] += x[rows]

    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(x)
    for t in range(rewards.shape[-1] - 1, -1, -1):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return masked_whiten(returns, valid, eps).to(_result_dtype(scores))


@register_advantage_estimator("reinforce_plus_plus_baseline", options=WhitenOptions, group_relative=True)
def reinforce_plus_plus_baseline_advantages(
    scores: Tensor, group_index: Any, *, response_mask: Tensor, eps: float = 1e-6
) -> Tensor:
    """REINFORCE++ with a group baseline.

    a_i = R_i - mean_g, broadcast to every valid token of response i,
    A_t = whiten(a) over all valid tokens of the batch (see ``masked_whiten``),
    so long responses weigh more in the batch statistics, as in token-level whitening.
    """
    x, dense, dtype = _prepare(scores, group_index)
    _check_token_shape("response_mask", response_mask, scores)
    mean, _, _ = _group_moments(x, dense)
    valid = response_mask != 0
    centred = torch.where(valid, (x - mean).unsqueeze(-1), 0.0)
    return masked_whiten(centred, valid, eps).to(dtype)


# ---------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------


def compute_advantages(name: str, scores: Tensor, group_index: Any, **options) -> Tensor:
    """Advantages by estimator name: ``ADVANTAGE_ESTIMATORS[name](scores, g, **options)``.

    g = ``dense_group_index(group_index)``: group ids of any accepted kind (integer tensor,
    list or numpy array of ints, list or numpy array of str) become dense long group numbers
    once, here, so every estimator (registered ones too) sees a LongTensor [B].
    Returns [B, R] (exactly zero on masked tokens) when ``response_mask`` [B, R] is given,
    else [B]. Outcome advantages are broadcast as A_{i,t} = A_i where m_{i,t} != 0, else 0.
    Token-level estimators (``reinforce_plus_plus*``) require ``response_mask``.
    Raises ValueError for an unknown name, a missing required option or a group_index of
    the wrong length, and TypeError for an option the estimator does not take or an
    unsupported kind of group_index.
    """
    fn = ADVANTAGE_ESTIMATORS.get(name, None)
    if fn is None:
        valid_names = ", ".join(ADVANTAGE_ESTIMATORS.names())
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {valid_names}")
    params = dict(inspect.signature(fn).parameters)
    accepted = {p for p, spec in params.items() if spec.kind is inspect.Parameter.KEYWORD_ONLY}
    # Token-level estimators take the mask themselves; for outcome ones it is only for broadcasting.
    token_level = "response_mask" in accepted
    response_mask = None if token_level else options.pop("response_mask", None)
    unknown = sorted(set(options) - accepted)
    if unknown:
        valid = ", ".join(sorted(accepted | {"response_mask"})) or "none"
        raise TypeError(
            f"advantage estimator {name!r} got unknown option(s) {', '.join(unknown)}; valid options: {valid}"
        )
    missing = sorted(p for p in accepted if params[p].default is inspect.Parameter.empty and options.get(p) is None)
    if missing:
        raise ValueError(f"advantage estimator {name!r} needs option(s): {', '.join(missing)}")
    num_rows = scores.shape[0] if scores.dim() == 1 else None
    group_index = dense_group_index(group_index, num_rows, device=scores.device)

    advantages = fn(scores, group_index, **options)
    if token_level:
        return torch.where(options["response_mask"] != 0, advantages, 0.0)
    if response_mask is None:
        return advantages
    _check_token_shape("response_mask", response_mask, advantages)
    return torch.where(response_mask != 0, advantages.unsqueeze(-1), 0.0)
