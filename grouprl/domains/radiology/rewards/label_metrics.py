"""CheXpert-label agreement between generated and reference reports: corpus F1 and per-sample rewards.

Both reports of a pair are labelled by the rule-based labeler
(:func:`grouprl.domains.radiology.rewards.chexpert.label_report`), and each label becomes
binary (:func:`to_binary`): positive is 1; uncertain is 1 by default (the
"uncertain as positive" convention of CheXbert-F1 papers, since a hedged mention
of a real finding is a detection) or 0 with ``uncertain_as_positive=False``;
negative and not mentioned are 0. "No Finding" is one of the 14 classes, so a
normal report described as normal agrees on a positive.

Corpus scores (:func:`chexpert_f1`), on the positive class over the whole test set:
micro F1 (pooled counts) and macro F1 (mean of per-class F1) over the 14 classes
and over the five (``FIVE``). A class with no positive in either hypotheses or
references has an undefined F1, counted as ``zero_division`` (0.0 by default,
as scikit-learn's ``f1_score`` does in the published evaluations).

Per-sample reward components (registered in
:mod:`grouprl.domains.radiology.rewards.components`, backend ``labeler=rules``):

- ``cxb14micro``: F1 of the hypothesis's positive classes against the
  reference's, over the 14 classes, ``2 TP / (2 TP + FP + FN)``; 1.0 when
  neither has a positive (nothing to find, nothing claimed).
- ``cxb5micro``: the same over the five classes.
- ``cxb_bal_acc``: balanced accuracy of the hypothesis's 14 binary labels against
  the reference's, taken as truth: the mean of the recall of the reference's
  positives (TP / (TP + FN)) and of its negatives (TN / (TN + FP)). When the
  reference has no positive (or no negative) that recall is undefined and the
  score is the other one alone, as scikit-learn's ``balanced_accuracy_score``
  averages over the classes present in the truth.

Batch functions label each distinct text once, and inside a
:func:`~grouprl.domains.radiology.rewards.batch_parses.batch_scope` once for every
component of the batch: the references of a group of rollouts are usually one
text repeated, and EditGRPO's request reads six label-based scores.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from grouprl.domains.radiology.rewards.batch_parses import batch_cached, batch_scope
from grouprl.domains.radiology.rewards.chexpert import BACKEND, FIVE, OBSERVATIONS, label_report
from grouprl.domains.radiology.rewards.components import register_component

# Positions of the classes in a binary vector (``to_binary`` order).
INDEX_14: tuple[int, ...] = tuple(range(len(OBSERVATIONS)))
INDEX_5: tuple[int, ...] = tuple(OBSERVATIONS.index(name) for name in FIVE)

Labels = Mapping[str, "int | None"]


def to_binary(labels: Labels, *, uncertain_as_positive: bool = True) -> list[int]:
    """The 14 labels as 0/1 in ``OBSERVATIONS`` order: 1 positive, uncertain as chosen, else 0."""
    uncertain = 1 if uncertain_as_positive else 0
    out = []
    for name in OBSERVATIONS:
        value = labels.get(name)
        out.append(1 if value == 1 else uncertain if value == -1 else 0)
    return out


def _f1(tp: int, fp: int, fn: int, undefined: float) -> float:
    denominator = 2 * tp + fp + fn
    return 2 * tp / denominator if denominator else undefined


def label_f1(hyp: Sequence[int], ref: Sequence[int], classes: Sequence[int] = INDEX_14) -> float:
    """Per-sample micro F1 of two binary vectors over ``classes``; 1.0 when neither has a positive."""
    tp = fp = fn = 0
    for i in classes:
        h, r = hyp[i], ref[i]
        tp += h and r
        fp += h and not r
        fn += r and not h
    return _f1(tp, fp, fn, 1.0)


def label_balanced_accuracy(hyp: Sequence[int], ref: Sequence[int], classes: Sequence[int] = INDEX_14) -> float:
    """Per-sample balanced accuracy of ``hyp`` against ``ref`` (the truth) over ``classes``.

    ``(TP / (TP + FN) + TN / (TN + FP)) / 2``; when the reference has only negatives
    (or only positives) the undefined recall is left out and the other is the score.
    """
    tp = fn = tn = fp = 0
    for i in classes:
        if ref[i]:
            tp += bool(hyp[i])
            fn += not hyp[i]
        else:
            tn += not hyp[i]
            fp += bool(hyp[i])
    recalls = [hits / (hits + misses) for hits, misses in ((tp, fn), (tn, fp)) if hits + misses]
    return sum(recalls) / len(recalls)


def chexpert_f1(
    hyps_labels: Sequence[Labels],
    refs_labels: Sequence[Labels],
    *,
    uncertain_as_positive: bool = True,
    zero_division: float = 0.0,
) -> dict[str, Any]:
    """Corpus CheXpert-label F1 of hypotheses against references (label dicts, one per report).

    Returns ``micro_f1_14``, ``macro_f1_14``, ``micro_f1_5``, ``macro_f1_5``,
    ``per_class_f1`` (all 14), ``support`` (reference positives per class), ``n``,
    ``uncertain_as_positive`` and ``backend``. A class with no positive anywhere
    has F1 ``zero_division``; so has a micro F1 with no positive at all.
    """
    if len(hyps_labels) != len(refs_labels):
        raise ValueError(f"got {len(hyps_labels)} hypotheses for {len(refs_labels)} references")
    k = len(OBSERVATIONS)
    tp, fp, fn = [0] * k, [0] * k, [0] * k
    for hyp_labels, ref_labels in zip(hyps_labels, refs_labels):
        hyp = to_binary(hyp_labels, uncertain_as_positive=uncertain_as_positive)
        ref = to_binary(ref_labels, uncertain_as_positive=uncertain_as_positive)
        for i in range(k):
            tp[i] += hyp[i] and ref[i]
            fp[i] += hyp[i] and not ref[i]
            fn[i] += ref[i] and not hyp[i]
    per_class = [_f1(tp[i], fp[i], fn[i], zero_division) for i in range(k)]

    def micro(classes: Sequence[int]) -> float:
        return _f1(sum(tp[i] for i in classes), sum(fp[i] for i in classes), sum(fn[i] for i in classes),
                   zero_division)

    def macro(classes: Sequence[int]) -> float:
        return sum(per_class[i] for i in classes) / len(classes)

    return {
        "micro_f1_14": micro(INDEX_14),
        "macro_f1_14": macro(INDEX_14),
        "micro_f1_5": micro(INDEX_5),
        "macro_f1_5": macro(INDEX_5),
        "per_class_f1": dict(zip(OBSERVATIONS, per_class)),
        "support": {name: tp[i] + fn[i] for i, name in enumerate(OBSERVATIONS)},
        "n": len(hyps_labels),
        "uncertain_as_positive": uncertain_as_positive,
        "backend": BACKEND,
    }


@batch_cached
def report_labels(text: str) -> dict[str, int | None]:
    """:func:`label_report` of a text, once per distinct text of a batch (shared: do not mutate)."""
    return label_report(text)


@batch_cached
def _binary_uncertain_positive(text: str) -> bytes:
    return bytes(to_binary(report_labels(text), uncertain_as_positive=True))


@batch_cached
def _binary_uncertain_negative(text: str) -> bytes:
    return bytes(to_binary(report_labels(text), uncertain_as_positive=False))


def binary_labels(text: str, uncertain_as_positive: bool) -> bytes:
    """:func:`to_binary` of a text's labels as 14 bytes of 0 or 1, once per distinct text of a batch.

    Bytes and one cache per convention (not a tuple keyed by text and flag): a batch keeps
    one per text, and neither bytes nor a text key is an object the garbage collector counts.
    """
    return (_binary_uncertain_positive if uncertain_as_positive else _binary_uncertain_negative)(text)


def _check_texts(hyps: Sequence[Any], refs: Sequence[Any]) -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"got {len(hyps)} hypotheses for {len(refs)} references")
    for role, texts in (("hypothesis", hyps), ("reference", refs)):
        for row, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"{role} {row} must be a string, got {type(text).__name__}")


def label_pairs(hyps: Sequence[str], refs: Sequence[str]) -> tuple[list[dict], list[dict]]:
    """Labels of every hypothesis and reference, each distinct text labelled once (the dicts are shared)."""
    _check_texts(hyps, refs)
    with batch_scope():
        return [report_labels(h) for h in hyps], [report_labels(r) for r in refs]


def chexpert_f1_reports(
    hyps: Sequence[str],
    refs: Sequence[str],
    *,
    uncertain_as_positive: bool = True,
    zero_division: float = 0.0,
) -> dict[str, Any]:
    """:func:`chexpert_f1` of report texts, labelled by the rule-based labeler."""
    hyps_labels, refs_labels = label_pairs(hyps, refs)
    return chexpert_f1(hyps_labels, refs_labels, uncertain_as_positive=uncertain_as_positive,
                       zero_division=zero_division)


def _per_sample(score, hyps, refs, classes, uncertain_as_positive) -> list[float]:
    _check_texts(hyps, refs)
    with batch_scope():
        return [score(binary_labels(h, uncertain_as_positive), binary_labels(r, uncertain_as_positive), classes)
                for h, r in zip(hyps, refs)]


@register_component("cxb14micro", backend=BACKEND)
def cxb14micro(hyps: list[str], refs: list[str], *, uncertain_as_positive: bool = True) -> list[float]:
    """Per-sample CheXpert-label micro F1 over the 14 classes (1.0 when neither report has a positive)."""
    return _per_sample(label_f1, hyps, refs, INDEX_14, uncertain_as_positive)


@register_component("cxb5micro", backend=BACKEND)
def cxb5micro(hyps: list[str], refs: list[str], *, uncertain_as_positive: bool = True) -> list[float]:
    """Per-sample CheXpert-label micro F1 over the five classes (1.0 when neither report has a positive)."""
    return _per_sample(label_f1, hyps, refs, INDEX_5, uncertain_as_positive)


@register_component("cxb_bal_acc", backend=BACKEND)
def cxb_bal_acc(hyps: list[str], refs: list[str], *, uncertain_as_positive: bool = True) -> list[float]:
    """Per-sample balanced accuracy of the 14 CheXpert labels against the reference's."""
    return _per_sample(label_balanced_accuracy, hyps, refs, INDEX_14, uncertain_as_positive)


def label_macro_f1(hyp: Sequence[int], ref: Sequence[int], classes: Sequence[int] = INDEX_14) -> float:
    """Per-sample macro F1: the mean per-class F1 over the classes positive in either report.

    For one pair each such class scores 1 (both positive) or 0 (one positive);
    classes negative in both have no defined F1 and are left out. 1.0 when no
    class is positive in either report (nothing to get wrong).
    """
    scored = [1.0 if hyp[i] and ref[i] else 0.0 for i in classes if hyp[i] or ref[i]]
    return sum(scored) / len(scored) if scored else 1.0


def label_accuracy(hyp: Sequence[int], ref: Sequence[int], classes: Sequence[int] = INDEX_14) -> float:
    """Per-sample accuracy: the fraction of ``classes`` whose binary labels agree."""
    return sum(hyp[i] == ref[i] for i in classes) / len(classes)


@register_component("cxb14macro", backend=BACKEND)
def cxb14macro(hyps: list[str], refs: list[str], *, uncertain_as_positive: bool = True) -> list[float]:
    """Per-sample macro F1 over the 14 CheXpert-style labels (see :func:`label_macro_f1`)."""
    return _per_sample(label_macro_f1, hyps, refs, INDEX_14, uncertain_as_positive)


@register_component("cxb5macro", backend=BACKEND)
def cxb5macro(hyps: list[str], refs: list[str], *, uncertain_as_positive: bool = True) -> list[float]:
    """Per-sample macro F1 over the 5 CheXpert competition labels."""
    return _per_sample(label_macro_f1, hyps, refs, INDEX_5, uncertain_as_positive)


@register_component("cxb_accuracy", backend=BACKEND)
def cxb_accuracy(hyps: list[str], refs: list[str], *, uncertain_as_positive: bool = True) -> list[float]:
    """Per-sample accuracy over the 14 CheXpert-style labels."""
    return _per_sample(label_accuracy, hyps, refs, INDEX_14, uncertain_as_positive)
