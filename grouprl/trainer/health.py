"""Health alarms: the run watches its own metrics and says, once per alarm, when it stops working.

Pure detectors over the history of reduced metrics (one value per training step, one per
validation), each with its rule in its docstring, and :class:`HealthWatch`, the small stateful
part the run loop calls after each step's metrics are reduced and after each validation
(``trainer.health``; docs/health.md). A detector returns None (quiet) or its evidence: a dict
with a ``message`` and the values, steps and thresholds it judged.

Alarms and the metrics they read (a metric a run does not log leaves its alarm quiet):

- ``reward_gaming``: the reward (``trainer.health.reward_key``, default ``reward/mean``) rising
  while a held-out metric of ``trainer.health.watch`` falls, both beyond their noise over the last
  ``gaming_window`` steps (:func:`trend`, :func:`reward_gaming`); judged after each validation.
- ``length_growth``: ``response_length/mean`` doubled within ``window`` steps (:func:`length_growth`).
- ``truncation``: ``response/truncation_rate`` above ``max_truncation`` over ``recent`` steps.
- ``entropy_collapse``: ``actor/entropy`` below ``entropy_collapse`` times its first steps' mean.
- ``no_reward_spread``: ``frac_reward_zero_std`` above ``max_zero_std`` over ``recent`` steps.
- ``ratio_blowup``: ``actor/ratio_mean`` (GRPO) or ``actor/ratio/mean`` (flow) outside
  [1/ratio_max, ratio_max], or ``actor/clipfrac`` above ``max_clipfrac``.
- ``kl_blowup``: ``actor/kl``, ``reward/kl_penalty`` or ``actor/kl_loss`` spiking (:func:`spike`).
- ``grad_norm_blowup``: ``actor/grad_norm`` spiking (:func:`spike`).
- ``nan``: a loss (``actor/*loss``, ``sft/loss``) or ``actor/grad_norm`` NaN or infinite, or
  ``actor/nonfinite_grad_steps`` above 0.

What the run records: ``health/<alarm>`` in every training step's metrics, 1 while the alarm's
condition holds as judged with that step's metrics (for ``reward_gaming``: as judged at the last
validation, from the validation's step on), else 0. A validation that changes an alarm's value
logs one more metrics row for its step with the ``health/`` keys it changed (the later row of a
step wins). The first time an alarm's condition holds it fires: one warning line on the main
process naming the alarm and its evidence, and one JSON line appended to ``RUN_DIR/alarms.jsonl``
(``{"step", "alarm", "message", ...evidence}``); it does not fire again in the run, resumed or not.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from grouprl.trainer.logging import truncate_jsonl

logger = logging.getLogger(__name__)

ALARMS = ("reward_gaming", "length_growth", "truncation", "entropy_collapse", "no_reward_spread",
          "ratio_blowup", "kl_blowup", "grad_norm_blowup", "nan")
LENGTH = "response_length/mean"
TRUNCATION = "response/truncation_rate"
ENTROPY = "actor/entropy"
ZERO_STD = "frac_reward_zero_std"
RATIO = ("actor/ratio_mean", "actor/ratio/mean")  # GRPO's policy losses, the flow trainer's
CLIPFRAC = "actor/clipfrac"
KL = ("actor/kl", "reward/kl_penalty", "actor/kl_loss")  # KL loss, KL in the reward, the flow trainer's
GRAD_NORM = "actor/grad_norm"
NONFINITE_STEPS = "actor/nonfinite_grad_steps"
ALARMS_FILE = "alarms.jsonl"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _g(value: float) -> str:
    return f"{value:.4g}"


# ---------------------------------------------------------------------------- the detectors


@dataclass(frozen=True)
class Trend:
    """A series' change over a window: ``change`` = b (x_last - x_first) from the least-squares slope
    b, ``se`` its standard error, ``z`` = change / se (inf for a change with no noise)."""

    change: float
    se: float
    first: float  # the fitted line at the window's ends
    last: float

    @property
    def z(self) -> float:
        if self.se > 0:
            return self.change / self.se
        return 0.0 if self.change == 0 else math.copysign(math.inf, self.change)


def trend(xs: Sequence[float], ys: Sequence[float], ses: Sequence[float] | None = None) -> Trend | None:
    """The least-squares trend of ``ys`` over ``xs`` and its noise; None when it cannot be judged.

    b = sum_i c_i y_i with c_i = (x_i - mean x) / S, S = sum_i (x_i - mean x)^2; change = b (x_m - x_1).
    Its variance: with the points' own standard errors ``ses`` (a validation metric's ``_se``),
    Var(b) = sum_i c_i^2 se_i^2 (for two points: se_1^2 + se_2^2 for the change); without them,
    from the spread about the line, Var(b) = s^2 / S, s^2 = sum_i r_i^2 / (m - 2), which needs
    m >= 3 points. None for fewer than 2 points, 2 points without ``ses``, or all x equal.
    """
    m = len(xs)
    if m < 2 or (ses is None and m < 3):
        return None
    mx, my = sum(xs) / m, sum(ys) / m
    s = sum((x - mx) ** 2 for x in xs)
    if s == 0:
        return None
    c = [(x - mx) / s for x in xs]
    b = sum(ci * y for ci, y in zip(c, ys))
    if ses is not None:
        var_b = sum(ci * ci * se * se for ci, se in zip(c, ses))
    else:
        residuals = [y - (my + b * (x - mx)) for x, y in zip(xs, ys)]
        var_b = sum(r * r for r in residuals) / (m - 2) / s
    span = xs[-1] - xs[0]
    return Trend(change=b * span, se=math.sqrt(var_b) * abs(span),
                 first=my + b * (xs[0] - mx), last=my + b * (xs[-1] - mx))


def reward_gaming(reward_steps: Sequence[int], reward: Sequence[float], held_steps: Sequence[int],
                  held: Sequence[float], held_se: Sequence[float] | None, *, key: str, reward_key: str,
                  mode: str, z: float) -> dict | None:
    """Reward gaming: the reward rises while the held-out metric ``key`` gets worse, both beyond noise.

    Both series are taken over the same window of steps. Fires when trend(reward).z >= ``z`` and
    d * trend(held).z <= -``z``, d = +1 for a metric where higher is better (``mode`` max), -1 for
    min: each change at least ``z`` of its own standard errors (:func:`trend`: the held-out metric's
    ``_se`` where logged at every point, else its spread about the line; the reward's spread about
    its line, which holds the steps' sampling noise).
    """
    up = trend(reward_steps, reward)
    sign = 1.0 if mode == "max" else -1.0
    down = trend(held_steps, held, held_se)
    if up is None or down is None or not (up.z >= z and sign * down.z <= -z):
        return None
    worse = "fell" if mode == "max" else "rose"
    noise = "its standard errors" if held_se is not None else "its spread"
    return {
        "message": (f"{reward_key} rose {_g(up.first)} -> {_g(up.last)} over steps {reward_steps[0]}-{reward_steps[-1]} "
                    f"({_g(up.z)} standard errors) while held-out {key} {worse} {_g(held[0])} -> {_g(held[-1])} "
                    f"over validations at steps {held_steps[0]}-{held_steps[-1]} ({_g(abs(down.z))} standard errors, "
                    f"from {noise}; threshold {_g(z)}): the reward is being gamed"),
        "reward_key": reward_key, "reward_change": up.change, "reward_z": up.z,
        "reward_steps": [reward_steps[0], reward_steps[-1]],
        "metric": key, "mode": mode, "metric_values": list(held), "metric_steps": list(held_steps),
        "metric_change": down.change, "metric_z": down.z, "z_threshold": z,
    }


def length_growth(steps: Sequence[int], lengths: Sequence[float], *, factor: float, window: int,
                  recent: int) -> dict | None:
    """Response length growth: over the last ``window`` steps (all present), the mean of its last
    ``recent`` steps >= ``factor`` x the mean of its first ``recent`` steps (r = min(recent, window // 2),
    so that the two do not overlap)."""
    r = min(recent, window // 2)
    if len(lengths) < window or r < 1:
        return None
    steps, lengths = steps[-window:], lengths[-window:]
    before, after = sum(lengths[:r]) / r, sum(lengths[-r:]) / r
    if not (before > 0 and after >= factor * before):
        return None
    return {"message": (f"mean response length grew {_g(before)} -> {_g(after)} tokens (x{_g(after / before)}, "
                        f"threshold x{_g(factor)}) from steps {steps[0]}-{steps[r - 1]} to {steps[-r]}-{steps[-1]}"),
            "key": LENGTH, "before": before, "after": after, "factor": factor, "steps": [steps[0], steps[-1]]}


def recent_level(steps: Sequence[int], values: Sequence[float], *, recent: int, above: float, key: str,
                 what: str) -> dict | None:
    """A level held too long: the mean of the last ``recent`` values (all present) > ``above``."""
    if len(values) < recent:
        return None
    mean = sum(values[-recent:]) / recent
    if not mean > above:
        return None
    return {"message": f"{what}: {key} averaged {_g(mean)} over steps {steps[-recent]}-{steps[-1]} (threshold {_g(above)})",
            "key": key, "value": mean, "threshold": above, "steps": [steps[-recent], steps[-1]]}


def truncation(steps: Sequence[int], rates: Sequence[float], *, max_rate: float, recent: int) -> dict | None:
    """Truncation: the mean ``response/truncation_rate`` of the last ``recent`` steps > ``max_rate``
    (that share of responses hit ``data.max_response_length``)."""
    return recent_level(steps, rates, recent=recent, above=max_rate, key=TRUNCATION,
                        what="responses cut at data.max_response_length")


def no_reward_spread(steps: Sequence[int], fracs: Sequence[float], *, max_frac: float, recent: int) -> dict | None:
    """No reward spread: the mean ``frac_reward_zero_std`` (share of responses in groups whose rewards
    are all equal: zero advantage, no learning signal) of the last ``recent`` steps > ``max_frac``."""
    return recent_level(steps, fracs, recent=recent, above=max_frac, key=ZERO_STD,
                        what="groups with no reward spread give no learning signal")


def entropy_collapse(steps: Sequence[int], entropies: Sequence[float], *, ratio: float, recent: int) -> dict | None:
    """Entropy collapse: the mean ``actor/entropy`` of the last ``recent`` steps <= ``ratio`` x the mean
    of the run's first ``recent`` steps (``entropies`` starts at the run's first step); needs 2 x
    ``recent`` steps, so that the two means do not overlap."""
    if len(entropies) < 2 * recent:
        return None
    start, now = sum(entropies[:recent]) / recent, sum(entropies[-recent:]) / recent
    if not (start > 0 and now <= ratio * start):
        return None
    return {"message": (f"policy entropy collapsed {_g(start)} -> {_g(now)} (steps {steps[0]}-{steps[recent - 1]} vs "
                        f"{steps[-recent]}-{steps[-1]}; threshold {_g(ratio)} x the start): the policy stopped exploring"),
            "key": ENTROPY, "start": start, "now": now, "ratio": ratio}


def ratio_blowup(ratio_key: str | None, ratio: float | None, clipfrac: float | None, *, ratio_max: float,
                 max_clipfrac: float) -> dict | None:
    """Importance-ratio blow-up at one step: the mean ratio pi/pi_old outside [1/ratio_max, ratio_max],
    or the clipped share of tokens (rows, flow) ``actor/clipfrac`` > ``max_clipfrac``."""
    if _finite(ratio) and not (1 / ratio_max <= ratio <= ratio_max):
        return {"message": f"{ratio_key} is {_g(ratio)}, outside [{_g(1 / ratio_max)}, {_g(ratio_max)}]",
                "key": ratio_key, "value": ratio, "ratio_max": ratio_max}
    if _finite(clipfrac) and clipfrac > max_clipfrac:
        return {"message": f"{CLIPFRAC} is {_g(clipfrac)} (threshold {_g(max_clipfrac)}): the update left the clip range",
                "key": CLIPFRAC, "value": clipfrac, "max_clipfrac": max_clipfrac}
    return None


def spike(value: float, previous: Sequence[float], *, factor: float, floor: float, min_history: int = 3) -> dict | None:
    """A blow-up at one step: ``value`` > ``factor`` x median(previous) and ``value`` > ``floor``, the median
    over the earlier steps' positive finite values (a step without gradient says nothing of its
    scale), of which at least ``min_history``."""
    base = [v for v in previous if _finite(v) and v > 0]
    if not _finite(value) or len(base) < min_history:
        return None
    median = statistics.median(base)
    if not (value > factor * median and value > floor):
        return None
    return {"value": value, "median": median, "factor": factor, "floor": floor, "history": len(base)}


def nonfinite(values: Mapping[str, float]) -> dict | None:
    """NaN or infinity: a loss (``actor/*loss``, ``sft/loss``) or ``actor/grad_norm`` not finite, or
    ``actor/nonfinite_grad_steps`` > 0 (optimizer steps skipped for a non-finite gradient)."""
    bad = sorted(k for k, v in values.items()
                 if (k == GRAD_NORM or k == "sft/loss" or (k.startswith("actor/") and k.endswith("loss")))
                 and isinstance(v, (int, float)) and not math.isfinite(v))
    skipped = values.get(NONFINITE_STEPS)
    if not bad and not (_finite(skipped) and skipped > 0):
        return None
    parts = [f"{k}={values[k]}" for k in bad] + ([f"{NONFINITE_STEPS}={_g(skipped)}"] if skipped else [])
    return {"message": f"not finite: {', '.join(parts)}", "keys": bad, "nonfinite_grad_steps": skipped}


# ---------------------------------------------------------------------------- the watcher


def _first_key(values: Mapping[str, float], keys: Sequence[str]) -> str | None:
    return next((k for k in keys if k in values), None)


class HealthWatch:
    """Keeps the history the detectors read and fires each alarm once (see the module docstring).

    Every process judges the same reduced values, so every process holds the same state; only the
    main one (``main``) prints and writes ``alarms.jsonl``. :meth:`state` goes into checkpoints and
    :meth:`load` takes it back at resume, so that an alarm fired before the checkpoint stays fired.
    """

    def __init__(self, config, run_dir: Path, *, main: bool):
        self.config, self.main = config, main
        self.path = Path(run_dir) / ALARMS_FILE
        # per key: [[step, value], ...], the steps' (or, for val/ keys, the validations') values
        self.series: dict[str, list[list[float]]] = {}
        self.fired: dict[str, int] = {}  # alarm -> the step it fired at
        self.gaming = 0.0  # health/reward_gaming as judged at the last validation
        self.unlogged: set[str] = set()  # watched keys a validation did not log (said once)

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def _keep(self) -> int:
        c = self.config
        return max(c.window, 2 * c.recent, c.gaming_window + 1) + 1

    # ------------------------------------------------------------------ state

    def state(self) -> dict:
        return {"series": self.series, "fired": self.fired, "gaming": self.gaming}

    def load(self, state: Mapping | None) -> None:
        if not state:
            return
        self.series = {k: [list(p) for p in v] for k, v in state.get("series", {}).items()}
        self.fired = {k: int(v) for k, v in state.get("fired", {}).items()}
        self.gaming = float(state.get("gaming", 0.0))

    def open(self, resume_step: int | None) -> None:
        """Cut ``alarms.jsonl`` back to the resumed step (-1, a fresh start: empty), as the metrics are."""
        if self.enabled and self.main and resume_step is not None:
            truncate_jsonl(self.path, resume_step)

    # ------------------------------------------------------------------ history

    def _add(self, key: str, step: int, value) -> None:
        if not _finite(value):  # judged by the nan alarm; the checkpoint's JSON keeps finite numbers only
            return
        points = self.series.setdefault(key, [])
        points.append([step, float(value)])
        keep = None if key == ENTROPY else self._keep()  # entropy keeps its first steps: its baseline
        if keep is not None and len(points) > keep:
            del points[:len(points) - keep]
        elif key == ENTROPY and len(points) > 2 * self.config.recent:
            del points[self.config.recent:len(points) - self.config.recent]

    def _points(self, key: str, since: int | None = None) -> tuple[list[int], list[float]]:
        points = [p for p in self.series.get(key, []) if since is None or p[0] >= since]
        return [int(p[0]) for p in points], [p[1] for p in points]

    def _tracked(self) -> list[str]:
        c = self.config
        keys = [LENGTH, TRUNCATION, ENTROPY, ZERO_STD, *KL, GRAD_NORM]
        return keys + ([] if c.reward_key.startswith("val/") else [c.reward_key]) + \
            [k for k in c.watch if not k.startswith("val/")]

    # ------------------------------------------------------------------ the calls from the run loop

    def after_step(self, step: int, values: Mapping[str, float]) -> dict[str, float]:
        """Judge step ``step`` (``values``: its reduced metrics); returns its ``health/`` metrics."""
        if not self.enabled:
            return {}
        c = self.config
        previous = {k: self._points(k)[1][-c.window:] for k in (*KL, GRAD_NORM)}
        for key in self._tracked():
            if key in values:
                self._add(key, step, values[key])
        found: dict[str, dict | None] = {name: None for name in ALARMS}
        steps, lengths = self._points(LENGTH)
        found["length_growth"] = length_growth(steps, lengths, factor=c.length_growth, window=c.window,
                                                recent=c.recent)
        found["truncation"] = truncation(*self._points(TRUNCATION), max_rate=c.max_truncation, recent=c.recent)
        found["entropy_collapse"] = entropy_collapse(*self._points(ENTROPY), ratio=c.entropy_collapse, recent=c.recent)
        found["no_reward_spread"] = no_reward_spread(*self._points(ZERO_STD), max_frac=c.max_zero_std, recent=c.recent)
        ratio_key = _first_key(values, RATIO)
        found["ratio_blowup"] = ratio_blowup(ratio_key, values.get(ratio_key) if ratio_key else None,
                                             values.get(CLIPFRAC), ratio_max=c.ratio_max, max_clipfrac=c.max_clipfrac)
        for key in KL:
            if key in values and found["kl_blowup"] is None:
                hit = spike(values[key], previous[key], factor=c.blowup_factor, floor=c.kl_floor)
                if hit:
                    found["kl_blowup"] = {"message": self._spike_message(key, hit, step), "key": key, **hit}
        if GRAD_NORM in values:
            hit = spike(values[GRAD_NORM], previous[GRAD_NORM], factor=c.blowup_factor, floor=c.grad_norm_floor)
            if hit:
                found["grad_norm_blowup"] = {"message": self._spike_message(GRAD_NORM, hit, step), "key": GRAD_NORM, **hit}
        found["nan"] = nonfinite(values)
        if not c.reward_key.startswith("val/") and not any(k.startswith("val/") for k in c.watch):
            found["reward_gaming"] = self._judge_gaming(step)  # every series is a training one
            self.gaming = float(found["reward_gaming"] is not None)
        out = {}
        for name in ALARMS:
            if name == "reward_gaming":
                out[f"health/{name}"] = self.gaming
                continue
            out[f"health/{name}"] = float(found[name] is not None)
            if found[name] is not None:
                self._fire(name, step, found[name])
        return out

    def after_validation(self, step: int, values: Mapping[str, float]) -> dict[str, float]:
        """Judge the validation at step ``step`` (``values``: its reduced metrics, keys under ``val/``);
        returns the ``health/`` metrics it changed for that step (empty: none changed)."""
        if not self.enabled:
            return {}
        c = self.config
        for key in [c.reward_key, *c.watch]:
            if not key.startswith("val/"):
                continue
            if key not in values:
                self._say_unlogged(key, values)
                continue
            self._add(key, step, values[key])
            if key in c.watch:
                self._add(f"{key}_se", step, values.get(f"{key}_se"))
        before = self.gaming
        self.gaming = float(self._judge_gaming(step) is not None)
        return {"health/reward_gaming": self.gaming} if self.gaming != before else {}

    # ------------------------------------------------------------------ helpers

    def _judge_gaming(self, step: int) -> dict | None:
        """Gaming over the steps (step - gaming_window, step]: the first watched metric that fires, fired."""
        c = self.config
        since = step - c.gaming_window
        r_steps, r_values = self._points(c.reward_key, since)
        for key, mode in c.watch.items():
            h_steps, h_values = self._points(key, since)
            se_points = {int(s): v for s, v in self.series.get(f"{key}_se", [])}
            ses = [se_points.get(s, math.nan) for s in h_steps]
            held_se = ses if ses and all(math.isfinite(v) and v >= 0 for v in ses) else None
            found = reward_gaming(r_steps, r_values, h_steps, h_values, held_se, key=key, reward_key=c.reward_key,
                                  mode=mode, z=c.noise_z)
            if found is not None:
                self._fire("reward_gaming", step, found)
                return found
        return None

    def _spike_message(self, key: str, hit: dict, step: int) -> str:
        return (f"{key} is {_g(hit['value'])} at step {step}, {_g(hit['value'] / hit['median'])} x the median "
                f"{_g(hit['median'])} of the {hit['history']} steps before (thresholds: x{_g(hit['factor'])}, "
                f"above {_g(hit['floor'])})")

    def _say_unlogged(self, key: str, values: Mapping[str, float]) -> None:
        if key in self.unlogged:
            return
        self.unlogged.add(key)
        if self.main:
            import difflib

            near = difflib.get_close_matches(key, list(values), n=3, cutoff=0.5)
            logger.warning("grouprl: config key 'trainer.health.watch' names %s, which validation does not log, so "
                           "reward_gaming cannot judge it%s", key, f" (did you mean {', '.join(near)}?)" if near else "")

    def _fire(self, name: str, step: int, evidence: dict) -> None:
        if name in self.fired:
            return
        self.fired[name] = step
        if not self.main:
            return
        logger.warning("grouprl: health alarm %s at step %d: %s", name, step, evidence["message"])
        record = {"step": step, "alarm": name, **evidence}
        append_line(self.path, json.dumps(_nulls(record), default=str))


def _nulls(obj):
    """``obj`` with every non-finite float as None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _nulls(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nulls(v) for v in obj]
    return obj


def append_line(path: Path, line: str) -> None:
    """Append one line to ``path`` in one write to a file opened for appending, then fsync: a kill leaves
    the line whole or absent (a torn last line is what ``truncate_jsonl`` drops at resume)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
