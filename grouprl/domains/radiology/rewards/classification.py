"""Abnormality classification: the findings list in RadVLM's answers, set F1, and its reward.

RadVLM's classification answers (MIMIC-CXR and CheXpert labels) name the findings as
a list after a colon, joined with ", " and " and ", or say there are none::

    The following abnormalities are present: cardiomegaly, pleural effusion and edema.
    Yes, there is one abnormality identified: pneumothorax.
    No abnormalities or lesions are detected on this Chest X-ray.

:func:`parse_findings_list` reads that shape back into a set of normalised label
names; :func:`set_f1` compares two such sets and is the per-sample score and the
``classification_set_f1`` reward; :func:`classification_corpus_scores` gives the
micro and macro scores over a corpus.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

from grouprl.rewards.contract import completion_text
from grouprl.domains.radiology.rewards.task_rows import applies, row_name
from grouprl.rewards.registry import register_reward

BACKEND = "findings=list after the colon, set F1"

CLASSIFICATION_TASKS = frozenset({"classification", "abnormality_classification"})

# Items that mean "nothing found" rather than a finding (CheXpert's and VinDr's "No Finding").
NO_FINDING_ITEMS = frozenset({"no finding", "no findings", "none", "nothing", "normal"})
# Without a colon, an answer with one of these words says there is nothing to list.
_NEGATION = re.compile(r"\b(?:no|none|not|without|clear|normal|nothing)\b")
_SEPARATORS = re.compile(r"\s*(?:,|;|\band\b)\s*")
_LEADING_ARTICLE = re.compile(r"^(?:a|an|the)\s+")


def normalize_finding(item: str) -> str:
    """Lower case, no leading article, single spaces, no surrounding punctuation."""
    text = " ".join(item.lower().split()).strip(" .!?\"'()")
    return _LEADING_ARTICLE.sub("", text).strip()


def parse_findings_list(text: str) -> frozenset[str]:
    """The set of findings an answer lists (normalised with :func:`normalize_finding`).

    The list is what follows the first ":"; it is split at commas, semicolons and
    the word "and". An answer without a colon lists nothing when it holds a negation
    ("no", "not", "none", "clear", "normal", "without", "nothing"); otherwise the
    whole answer is the list. "No finding" and the like are not findings.
    """
    if not isinstance(text, str):
        raise TypeError(f"expected an answer string, got {type(text).__name__}")
    body = text.strip()
    if ":" in body:
        body = body.split(":", 1)[1]
    elif _NEGATION.search(body.lower()):
        return frozenset()
    items = (normalize_finding(piece) for piece in _SEPARATORS.split(body))
    return frozenset(item for item in items if item and item not in NO_FINDING_ITEMS)


def format_findings_list(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``: the list shape :func:`parse_findings_list` reads."""
    if not items:
        raise ValueError("format_findings_list needs at least one item")
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def set_f1(pred: Iterable[str], ref: Iterable[str]) -> float:
    """F1 of two sets: ``2 |P ∩ R| / (|P| + |R|)``; 1 when both are empty (correctly nothing)."""
    p, r = set(pred), set(ref)
    if not p and not r:
        return 1.0
    return 2 * len(p & r) / (len(p) + len(r))


def classification_corpus_scores(preds: Sequence[Iterable[str]], refs: Sequence[Iterable[str]]) -> dict[str, Any]:
    """Corpus scores over the label occurrences of all samples.

    With ``TP``, ``FP``, ``FN`` summed over samples and labels::

        micro_precision = TP / (TP + FP),  micro_recall = TP / (TP + FN),
        micro_f1 = 2 TP / (2 TP + FP + FN)
        macro_f1 = mean over labels l of 2 TP_l / (2 TP_l + FP_l + FN_l)
        exact_match = fraction of samples with P = R

    over the labels seen in the references or the predictions. A ratio with a zero
    denominator is None (undefined: e.g. no label anywhere).
    """
    if len(preds) != len(refs):
        raise ValueError(f"got {len(preds)} predictions for {len(refs)} references")
    counts: dict[str, list[int]] = {}  # label -> [tp, fp, fn]
    exact = 0
    for pred, ref in zip(preds, refs):
        p, r = set(pred), set(ref)
        exact += p == r
        for label in p | r:
            c = counts.setdefault(label, [0, 0, 0])
            c[0] += label in p and label in r
            c[1] += label in p and label not in r
            c[2] += label in r and label not in p
    tp, fp, fn = (sum(c[k] for c in counts.values()) for k in range(3))

    def ratio(num: int, den: int) -> float | None:
        return num / den if den else None

    per_label = [2 * c[0] / (2 * c[0] + c[1] + c[2]) for c in counts.values()]
    return {
        "micro_precision": ratio(tp, tp + fp),
        "micro_recall": ratio(tp, tp + fn),
        "micro_f1": ratio(2 * tp, 2 * tp + fp + fn),
        "macro_f1": sum(per_label) / len(per_label) if per_label else None,
        "exact_match": exact / len(refs) if refs else None,
        "backend": BACKEND,
    }


@register_reward("classification_set_f1")
def classification_set_f1_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[str | None] | None = None,
    task: Sequence[Any] | None = None,
    **columns: Any,
) -> list[float | None]:
    """RadVLM abnormality-classification reward: :func:`set_f1` of the completion's findings
    list against the reference answer's. Rows whose ``task`` column names another task get
    None (not applicable)."""
    if answer is None:
        raise ValueError("classification_set_f1 needs the 'answer' column (the reference findings list)")
    named = {"id": columns.get("id")}
    out: list[float | None] = []
    for row, completion in enumerate(completions):
        if not applies(task, row, CLASSIFICATION_TASKS):
            out.append(None)
            continue
        if not isinstance(answer[row], str):
            raise ValueError(f"classification_set_f1: {row_name(named, row)} has no reference answer")
        out.append(set_f1(parse_findings_list(completion_text(completion)), parse_findings_list(answer[row])))
    return out
