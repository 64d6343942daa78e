"""Statistics over seeds: a metric's mean with a Student-t interval, and paired comparisons.

A run repeated over K seeds gives K values of each metric per model. For one model the
interval is the classical one for a mean from K independent draws; to compare two models
trained and evaluated from the same seed (same data, SFT start and prompts), the per-seed
differences are used (a paired comparison), which cancels what the two share. Verdicts:
a difference "holds beyond the noise" when its whole interval lies above 0, is "reversed
beyond the noise" when it lies below 0, and is "within the noise" otherwise. One seed gives
a mean but no interval (K - 1 = 0 degrees of freedom), and says so instead of a NaN.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import scipy.stats

CONFIDENCE = 0.95

HOLDS = "holds beyond the noise"
REVERSED = "reversed beyond the noise"
WITHIN = "within the noise"
NO_INTERVAL = "no interval from one seed"


def t_quantile(p: float, df: float) -> float:
    """The quantile t_p of Student's t distribution with ``df`` degrees of freedom: F(t_p) = p.

    F(t) = 1/2 + sign(t) I_y(1/2, df/2) / 2 with y = t^2 / (df + t^2), where I is the
    regularized incomplete beta function; t_{1-p} = -t_p. Computed by scipy.stats.t.ppf.
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p!r}")
    if not 0 < df < math.inf:  # also rejects NaN
        raise ValueError(f"t_quantile: degrees of freedom must be positive and finite, got {df!r}")
    return float(scipy.stats.t.ppf(p, df))


@dataclass(frozen=True)
class MeanInterval:
    """A mean over ``n`` values with its two-sided ``confidence`` interval (None for n = 1)."""

    n: int
    mean: float
    sd: float | None  # sample standard deviation (n - 1 in the denominator)
    low: float | None
    high: float | None
    confidence: float

    @property
    def half_width(self) -> float | None:
        return None if self.low is None else (self.high - self.low) / 2

    def as_dict(self) -> dict:
        return {"n": self.n, "mean": self.mean, "sd": self.sd, "low": self.low, "high": self.high,
                "half_width": self.half_width, "confidence": self.confidence}


def _values(values: Sequence[float], who: str) -> list[float]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{who}: expected a sequence of numbers (one per seed), got {type(values).__name__}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{who}: every value must be a finite number, got {v!r}")
        out.append(float(v))
    if not out:
        raise ValueError(f"{who}: needs at least one value (one per seed), got none")
    return out


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> MeanInterval:
    """Mean of ``values`` (one per seed) and its Student-t interval.

    mean = sum(v) / n, sd = sqrt(sum((v - mean)^2) / (n - 1)), and the interval is
    mean -/+ t_{(1 + confidence)/2, n - 1} * sd / sqrt(n). It assumes the values are
    independent draws of a roughly normal quantity. With n = 1 there are no degrees of
    freedom: the mean is returned with sd, low and high None.
    """
    vals = _values(values, "t_interval")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"t_interval: confidence must be in (0, 1), got {confidence!r}")
    n = len(vals)
    mean = math.fsum(vals) / n
    if n == 1:
        return MeanInterval(n=1, mean=mean, sd=None, low=None, high=None, confidence=confidence)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (n - 1))
    half = t_quantile((1 + confidence) / 2, n - 1) * sd / math.sqrt(n)
    return MeanInterval(n=n, mean=mean, sd=sd, low=mean - half, high=mean + half, confidence=confidence)


def paired_differences(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """d_i = a_i - b_i for values paired by position (the same seed)."""
    av, bv = _values(a, "paired_differences"), _values(b, "paired_differences")
    if len(av) != len(bv):
        raise ValueError(f"paired_differences: {len(av)} values against {len(bv)}; each seed needs both")
    return [x - y for x, y in zip(av, bv)]


def paired_interval(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> MeanInterval:
    """The paired t-interval of mean(a - b): `t_interval` of the per-seed differences a_i - b_i."""
    return t_interval(paired_differences(a, b), confidence)


def verdict(interval: MeanInterval) -> str:
    """HOLDS when low > 0, REVERSED when high < 0, WITHIN otherwise; NO_INTERVAL for one seed."""
    if interval.low is None:
        return NO_INTERVAL
    if interval.low > 0:
        return HOLDS
    if interval.high < 0:
        return REVERSED
    return WITHIN


def chain_verdict(verdicts: Sequence[str]) -> str:
    """A chain a > b > c from its links' verdicts: HOLDS if every link holds, REVERSED if any is
    reversed, NO_INTERVAL if there are none to judge, WITHIN otherwise."""
    if not verdicts:
        raise ValueError("chain_verdict: no links to judge")
    if NO_INTERVAL in verdicts:
        return NO_INTERVAL
    if REVERSED in verdicts:
        return REVERSED
    return HOLDS if all(v == HOLDS for v in verdicts) else WITHIN


def summarize_seeds(results: Mapping[int, Mapping[str, Mapping[str, float]]], *, metrics: Sequence[str],
                    order: Sequence[str], ordered_metrics: Sequence[str] | None = None,
                    also: Sequence[tuple[str, str]] = (), confidence: float = CONFIDENCE) -> dict:
    """Per-model intervals and the paired ordering test, from ``results[seed][model][metric]``.

    ``order`` names models best first (the expected ordering order[0] > order[1] > ...);
    each adjacent pair is compared with `paired_interval` over the seeds on every metric of
    ``ordered_metrics`` (default all of ``metrics``; leave out ones where larger is not
    better), and `chain_verdict` judges the whole chain per metric. ``also``: more (better,
    worse) pairs compared the same way, after the chain's in ``paired``, outside the chain's
    verdict (a variant that is no link of the ordering, tested against one). Every seed must hold
    every model and metric (paired by seed). Returns plain JSON-able dicts.
    """
    seeds = sorted(results)
    if not seeds:
        raise ValueError("summarize_seeds: no seeds")
    models = list(results[seeds[0]])
    for s in seeds:
        if list(results[s]) != models:
            raise ValueError(f"summarize_seeds: seed {s} has models {list(results[s])}, seed {seeds[0]} {models}")
        for m in models:
            missing = [k for k in metrics if k not in results[s][m]]
            if missing:
                raise ValueError(f"summarize_seeds: seed {s}, model {m!r} lacks {missing}")
    unknown = [m for m in [*order, *(m for pair in also for m in pair)] if m not in models]
    if unknown or len(order) < 2:
        raise ValueError(f"summarize_seeds: order must name at least two of {models} and also only those; "
                         f"got order {list(order)}, also {list(also)}")
    ordered_metrics = list(metrics if ordered_metrics is None else ordered_metrics)

    def column(model: str, metric: str) -> list[float]:
        return [results[s][model][metric] for s in seeds]

    per_model = {m: {k: {**t_interval(column(m, k), confidence).as_dict(), "values": column(m, k)}
                     for k in metrics} for m in models}
    pairs = {}
    chain_pairs = list(zip(order, order[1:]))
    for better, worse in [*chain_pairs, *also]:
        rows = {}
        for k in ordered_metrics:
            iv = paired_interval(column(better, k), column(worse, k), confidence)
            rows[k] = {**iv.as_dict(), "values": paired_differences(column(better, k), column(worse, k)),
                       "verdict": verdict(iv)}
        pairs[f"{better} - {worse}"] = rows
    chain = {k: chain_verdict([pairs[f"{b} - {w}"][k]["verdict"] for b, w in chain_pairs]) for k in ordered_metrics}
    return {"seeds": seeds, "k": len(seeds), "confidence": confidence, "models": per_model,
            "paired": pairs, "ordering": " > ".join(order), "ordering_verdict": chain}


def format_mean(iv: Mapping, digits: int = 3) -> str:
    """``mean ± half-width`` of an interval's dict (``MeanInterval.as_dict``), or the mean alone for one seed."""
    if iv["low"] is None:
        return f"{iv['mean']:.{digits}f}"
    return f"{iv['mean']:.{digits}f} ± {iv['half_width']:.{digits}f}"


def format_difference(iv: Mapping) -> str:
    """A paired difference: ``+mean [low, high]``, or the signed mean alone for one seed."""
    if iv["low"] is None:
        return f"{iv['mean']:+.3f}"
    return f"{iv['mean']:+.3f} [{iv['low']:+.3f}, {iv['high']:+.3f}]"


# ---------------------------------------------------------------------------- a seed's run directory


def seed_dir_status(seed_dir: Path, *, wanted: Mapping, describe: Callable[[dict], dict], entries: set[str]) -> str:
    """What a seed's run directory holds: "new" (nothing), "complete" (a finished run whose
    summary.json, written last and atomically, ``describe``s as ``wanted``: this seed, sizes and
    model) or "incomplete" (only ``entries``, what the demo writes, and no summary.json: an
    interrupted run). Anything else, another run's results or foreign files, is a ValueError, so
    nothing is mixed or deleted. Dot files are temporaries of atomic writes."""
    if not seed_dir.exists():
        return "new"
    if not seed_dir.is_dir():
        raise ValueError(f"{seed_dir} is a file, not a seed's run directory; choose another --out")
    summary_file = seed_dir / "summary.json"
    if summary_file.exists():
        try:
            summary = json.loads(summary_file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{summary_file} is not valid JSON ({exc.msg}); remove {seed_dir} to run it again") from exc
        found = describe(summary)
        if found != dict(wanted):
            differ = {k: found.get(k) for k in wanted if found.get(k) != wanted[k]}
            raise ValueError(f"{seed_dir} holds another run's results ({differ}; this run needs {dict(wanted)}); "
                             "choose another --out, or remove that directory")
        return "complete"
    foreign = sorted(p.name for p in seed_dir.iterdir() if p.name not in entries and not p.name.startswith("."))
    if foreign:
        raise ValueError(f"{seed_dir} has no summary.json and holds files the demo does not write ({foreign}); "
                         "choose another --out")
    return "incomplete"
