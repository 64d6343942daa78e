"""EditGRPO's ``cxb_bal_acc``: a class-frequency-weighted count of agreeing CheXpert labels.

EditGRPO's reward server calls it "balanced accuracy" (``balanced_accuracy_chexbert``)
but computes something else, which this module reproduces under the component name
``cxb_bal_acc_editgrpo`` (grouprl's ``cxb_bal_acc`` is a real balanced accuracy in
[0, 1], see ``label_metrics``). For one (hypothesis, reference) pair with binary labels
``h_c``, ``r_c`` over the 14 CheXpert classes (uncertain counted as positive) and ``f_c``
the fraction of training references positive for class ``c``::

    value = 1/2 * sum_c ( [h_c = r_c = 1] * w_pos(f_c) + [h_c = r_c = 0] * w_neg(f_c) )

    w_pos(f) = 1 - f,  w_neg(f) = f      for 0 < f < 1   (inverse frequencies, normalised)
    w_pos(0) = 0,      w_neg(0) = 1      (the seed zeroes the weight of an absent side)
    w_pos(1) = 1,      w_neg(1) = 0

so ``value`` lies in [0, 7] and EditGRPO's composite adds ``value / 14`` (the reward server's
``COMPOSITE_WEIGHTS``). The seed reads
``f_c`` from a JSON file (``{"Cardiomegaly": 0.12, ...}``, its ``--class-frequencies-path``);
a class the file leaves out, or every class when there is no file, takes its frequency
from the pair itself, as the seed does for a batch of one pair (its client sends one
response per request): ``f_c = r_c``, which makes ``value`` half the number of agreeing
labels. The labels come from grouprl's rule-based CheXpert labeler, not CheXbert, and
the backend says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from grouprl.domains.radiology.rewards.batch_parses import batch_scope
from grouprl.domains.radiology.rewards.chexpert import BACKEND as LABELER_BACKEND
from grouprl.domains.radiology.rewards.chexpert import OBSERVATIONS
from grouprl.domains.radiology.rewards.components import Component, register_component
from grouprl.domains.radiology.rewards.label_metrics import _check_texts, binary_labels

NAME = "cxb_bal_acc_editgrpo"


def class_weights(frequency: float) -> tuple[float, float]:
    """``(w_pos, w_neg)`` of a class whose positive frequency is ``frequency`` (see the module doc)."""
    pos = 1.0 / frequency if frequency > 0 else 0.0
    neg = 1.0 / (1.0 - frequency) if frequency < 1 else 0.0
    total = pos + neg
    return (pos / total, neg / total) if total > 0 else (0.0, 0.0)


def weighted_label_agreement(hyp: Sequence[int], ref: Sequence[int],
                             frequencies: Sequence[float | None]) -> float:
    """EditGRPO's per-pair value: half the frequency-weighted count of agreeing labels.

    ``hyp``, ``ref``: binary labels in ``OBSERVATIONS`` order; ``frequencies[c]`` the
    positive frequency of class ``c`` or None (then the reference's own label, 0 or 1).
    """
    total = 0.0
    for h, r, f in zip(hyp, ref, frequencies):
        w_pos, w_neg = class_weights(float(r) if f is None else f)
        if h and r:
            total += w_pos
        elif not h and not r:
            total += w_neg
    return total / 2.0


def read_class_frequencies(path: str | Path) -> dict[str, float]:
    """A class-frequency JSON file (EditGRPO's format) -> ``{class name: frequency}``, checked.

    Names must be CheXpert class names; values numbers in [0, 1]. Classes left out are
    allowed (they fall back to the pair's own label).
    """
    path = Path(path).expanduser()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"class frequency file {path} not found") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"class frequency file {path}: malformed JSON at line {exc.lineno}: {exc.msg}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"class frequency file {path}: expected a JSON object of class name -> frequency")
    out: dict[str, float] = {}
    for name, value in raw.items():
        if name not in OBSERVATIONS:
            raise ValueError(f"class frequency file {path}: unknown class {name!r}; known: {', '.join(OBSERVATIONS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value <= 1.0) \
                or not math.isfinite(value):
            raise ValueError(f"class frequency file {path}: {name!r} must be a number in [0, 1], got {value!r}")
        out[name] = float(value)
    return out


def backend(frequencies: Mapping[str, float] | None = None, source: str | None = None) -> str:
    """How a value of this component was produced: the labeler and where the frequencies came from."""
    if not frequencies:
        return f"editgrpo-weighted-accuracy: {LABELER_BACKEND}, frequencies=per pair (the reference's labels)"
    missing = [c for c in OBSERVATIONS if c not in frequencies]
    where = f"frequencies={source or 'given'}"
    if missing:
        where += f" (per pair for {', '.join(missing)})"
    return f"editgrpo-weighted-accuracy: {LABELER_BACKEND}, {where}"


def weighted_accuracy_scores(hyps: Sequence[str], refs: Sequence[str],
                             frequencies: Mapping[str, float] | None = None) -> list[float]:
    """EditGRPO's ``cxb_bal_acc`` value of each pair, in [0, 7]."""
    per_class = [None if frequencies is None else frequencies.get(c) for c in OBSERVATIONS]
    # Each class's (w_pos, w_neg) for a reference label of 0 and of 1, worked out once per call
    # rather than per pair: only a class without a frequency depends on the label (f_c = r_c).
    weights = [(class_weights(0.0), class_weights(1.0)) if f is None else (class_weights(f),) * 2
               for f in per_class]
    hyps, refs = list(hyps), list(refs)
    _check_texts(hyps, refs)
    with batch_scope():  # the binary labels are the ones cxb14micro reads: shared in a request's scope
        return [_agreement(binary_labels(h, True), binary_labels(r, True), weights) for h, r in zip(hyps, refs)]


def _agreement(hyp: bytes, ref: bytes, weights: list) -> float:
    """:func:`weighted_label_agreement` with the class weights looked up (the same sums, in the same order)."""
    total = 0.0
    for h, r, w in zip(hyp, ref, weights):
        if h and r:
            total += w[1][0]
        elif not h and not r:
            total += w[0][1]
    return total / 2.0


@register_component(NAME, backend=backend())
def cxb_bal_acc_editgrpo(hyps: list[str], refs: list[str]) -> list[float]:
    """EditGRPO's cxb_bal_acc (frequency-weighted label agreement, 0..7; its composite adds it / 14)."""
    return weighted_accuracy_scores(hyps, refs)


def weighted_accuracy_component(path: str | Path) -> Component:
    """The component with the class frequencies of the file at ``path`` (not registered: one per server)."""
    frequencies = read_class_frequencies(path)

    def score(hyps: list[str], refs: list[str]) -> list[float]:
        return weighted_accuracy_scores(hyps, refs, frequencies)

    return Component(NAME, score, backend(frequencies, str(path)),
                     "EditGRPO's cxb_bal_acc with class frequencies from a file")
