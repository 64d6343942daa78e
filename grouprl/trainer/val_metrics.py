"""Validation metrics over k samples per prompt: mean@k, best@k, worst@k, pass@k and their standard errors.

With ``worker.rollout.val_n = k`` each validation prompt gets k responses. For one reward (or the
weighted total) let ``x_1..x_m`` be the values of a prompt's responses that the reward applies to
(m = k unless it returned None for some; a prompt with m = 0 has no value; with m < k, best@k still
draws k of the m). Per prompt, as verl's ``process_validation_metrics``
(verl/trainer/ppo/metric_utils.py) defines them:

- ``mean@k``  = (1/m) * sum_i x_i
- ``best@k``  = (1/B) * sum_b max_{j<k} x_{I[b,j]}, the mean over B = 1000 bootstrap draws of the best
  of k responses drawn with replacement from the m; ``I`` is numpy's ``RandomState(42).choice(m,
  (B, k))``, the same indices verl draws (it reseeds numpy's global generator with 42 per call),
  so the values equal verl's. It estimates E[max of k draws] = sum_i x_(i) * ((i/m)^k - ((i-1)/m)^k)
  over the sorted values x_(1) <= ... <= x_(m) (:func:`expected_best`), which is below max_i x_i.
- ``worst@k`` = the same with min.
- ``pass@k``  = 1 if max_i x_i >= threshold else 0: whether any of the k responses passes (for a
  0/1 reward with threshold 1, Chen et al.'s unbiased pass@k estimator with n = k). Not in verl.

A metric's value is the mean of its per-prompt values over the prompts (each prompt weighs the
same, as in verl) and its standard error ``<metric>_se`` is the bootstrap over prompts in closed
form: resampling P prompts with replacement, the mean's variance is exactly
sigma^2 / P, sigma^2 = (1/P) sum_p (v_p - mean)^2 (:func:`bootstrap_se`). That is the limit of
infinitely many resamples, so it needs no seed and reduces exactly over processes from the sums
of v and v^2 (``StepMetrics.mean_se``): each process computes the per-prompt values of its own
prompts, whose k responses it sampled.

Names (``StepMetrics.mean_se``, logged under ``val/``): ``val/rewards/{key}/{metric}`` for each reward
(beside the per-response ``val/rewards/{key}/mean``), ``val/reward/{metric}`` for the weighted total
(no pass@k: the total has no threshold), each with ``{metric}_se``; and the same under
``val/{data_source}/`` when the validation records have a ``data_source`` field. ``{metric}`` is
``mean@k``, ``best@k``, ``worst@k`` (k > 1, as verl) and ``pass@k``; a sample passes when the reward is
at least its ``threshold`` (``worker.reward.functions[i].threshold``, default 1).

Which n: verl bootstraps best@n and worst@n for n = 2, 4, 8, ... and n = k, and logs n = k as its
headline (``val-core``); we report n = k only. verl's ``best@n/std`` (the bootstrap spread of one
prompt's best-of-n, averaged over prompts) and ``std@n`` (the spread of a prompt's responses,
averaged) are not logged: ``_se`` is the uncertainty of the logged value itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import lru_cache

import numpy as np

N_BOOTSTRAP = 1000  # verl's process_validation_metrics
SEED = 42  # verl's default seed


@lru_cache(maxsize=64)
def _bootstrap_indices(m: int, n: int, n_bootstrap: int, seed: int) -> np.ndarray:
    # verl: np.random.seed(seed); np.random.choice(m, size=(n_bootstrap, n), replace=True)
    return np.random.RandomState(seed).choice(m, size=(n_bootstrap, n), replace=True)


def bootstrap_best_worst(values: Sequence[float], n: int, *, n_bootstrap: int = N_BOOTSTRAP,
                         seed: int = SEED) -> tuple[float, float, float, float]:
    """verl's ``bootstrap_metric(values, n, [np.max, np.min])``: (best mean, best std, worst mean, worst std).

    best = (1/B) sum_b max_j x_{I[b,j]}, its std the population std over the B draws; worst with min.
    """
    x = np.asarray(values, dtype=np.float64)
    draws = x[_bootstrap_indices(len(x), n, n_bootstrap, seed)]
    best, worst = draws.max(axis=1), draws.min(axis=1)
    return float(best.mean()), float(best.std()), float(worst.mean()), float(worst.std())


def expected_best(values: Sequence[float], n: int) -> float:
    """E[max of n draws with replacement] = sum_i x_(i) ((i/m)^n - ((i-1)/m)^n): what best@n estimates."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    i = np.arange(1, len(x) + 1) / len(x)
    return float((x * (i ** n - (i - 1 / len(x)) ** n)).sum())


def prompt_metrics(values: Sequence[float], k: int, threshold: float | None = None) -> dict[str, float]:
    """One prompt's ``mean@k``, ``best@k``, ``worst@k`` (k > 1) and ``pass@k`` (threshold not None).

    ``values``: the prompt's applicable response values (at least one); ``k``: responses sampled.
    """
    if not len(values):
        raise ValueError("a prompt's metrics need at least one value")
    out = {f"mean@{k}": float(np.mean(values))}
    if k > 1:  # verl: best/worst only with more than one response
        best, _, worst, _ = bootstrap_best_worst(values, k)
        out[f"best@{k}"], out[f"worst@{k}"] = best, worst
    if threshold is not None:
        out[f"pass@{k}"] = float(max(values) >= threshold)
    return out


def metric_names(k: int, with_pass: bool) -> list[str]:
    """The names :func:`prompt_metrics` returns for k responses: declared even where no prompt has a value."""
    return [f"mean@{k}"] + ([f"best@{k}", f"worst@{k}"] if k > 1 else []) + ([f"pass@{k}"] if with_pass else [])


def bootstrap_se(per_prompt: Sequence[float]) -> float:
    """Standard error of the mean of ``per_prompt`` by the bootstrap over prompts, in closed form:
    sqrt(sigma^2 / P), sigma^2 = (1/P) sum_p (v_p - mean)^2 (NaN for no prompt)."""
    v = np.asarray(per_prompt, dtype=np.float64)
    return float(math.sqrt(v.var() / len(v))) if len(v) else math.nan


def group_rows(group_ids: Sequence) -> list[list[int]]:
    """The rows of each prompt (rows sharing a group id), prompts in order of first appearance."""
    groups: dict = {}
    for row, g in enumerate(group_ids):
        groups.setdefault(g, []).append(row)
    return list(groups.values())


def per_prompt_values(groups: Sequence[Sequence[int]], columns: Mapping[str, Sequence[float | None]], k: int,
                      thresholds: Mapping[str, float | None]) -> dict[str, dict[str, list[float]]]:
    """``{column: {metric: [value of each prompt the column applies to]}}`` for every column
    (a reward's key, or the total); a prompt where a column is None on every row has no value."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, column in columns.items():
        threshold = thresholds.get(name)
        acc = out.setdefault(name, {m: [] for m in metric_names(k, threshold is not None)})
        for rows in groups:
            values = [column[r] for r in rows if column[r] is not None]
            if values:
                for metric, value in prompt_metrics(values, k, threshold).items():
                    acc[metric].append(value)
    return out


def record_val_metrics(metrics, groups: Sequence[Sequence[int]], components: Mapping[str, Sequence[float | None]],
                       total: Sequence[float | None], k: int, thresholds: Mapping[str, float | None],
                       prompt_sources: Sequence[str | None] = (), sources: Sequence[str] = ()) -> None:
    """Add this process's prompts to ``metrics`` (a ``StepMetrics``; every key a ``mean_se``).

    ``rewards/{key}/{metric}`` for each reward component, ``reward/{metric}`` for the weighted
    total (no pass@k: it has no threshold), and the same under ``{source}/`` for each of
    ``sources`` (every data source of the whole validation set, so that each process declares
    the same keys); ``prompt_sources``: each group's data source (None: in no source's metrics).
    """
    def record(prefix: str, chosen: Sequence[Sequence[int]]) -> None:
        columns = {f"rewards/{key}": values for key, values in components.items()}
        columns["reward"] = total
        found = per_prompt_values(chosen, columns, k, {f"rewards/{key}": t for key, t in thresholds.items()})
        for name, by_metric in found.items():
            for metric, values in by_metric.items():
                metrics.mean_se(f"{prefix}{name}/{metric}", values)

    record("", groups)
    for source in sources:
        record(f"{source}/", [rows for rows, s in zip(groups, prompt_sources) if s == source])
