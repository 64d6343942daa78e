"""Getting the report or the answer out of a response: EditGRPO's response types, CheXPO's
answer-set F1 and the text cleaning of EditGRPO's lightweight evaluation.

Response types (the ``type`` field of EditGRPO's reward server):

- ``short``: the report is the content of the last complete ``\\boxed{...}``;
- ``cot``: the response starts with one ``<think>...</think>`` block and the report is
  the last complete ``\\boxed{...}`` after it;
- ``free_form``: the whole response (stripped) is the report.

:func:`extract_report` gives None when the required layout is missing (or the box is
blank). A scorer then gives that sample 0 on every component and counts it as a
format failure (:func:`extract_reports` returns the reports with "" in its place and
the per-sample flags), rather than scoring text the model did not mark as its report.

CheXPO's answer accuracy compares comma-separated label lists inside
``<answer>...</answer>``. Its public code gives full credit when any label overlaps,
which a policy games by listing every label; :func:`answer_set_f1` is the set F1
instead: with P the predicted and R the reference label sets (case-folded, trimmed,
deduplicated), F1 = 2 |P & R| / (|P| + |R|) (1.0 when both are empty).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from grouprl.rewards.contract import completion_text
from grouprl.rewards.registry import register_reward
from grouprl.rewards.rule_based import extract_boxed as _last_boxed

REPORT_TYPES = ("short", "cot", "free_form")

_THINK_THEN_REST = re.compile(r"\s*<think>(.*?)</think>(.*)", re.S)
_ANSWER_SPAN = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_LABEL_SPLIT = re.compile(r"[,;\n]+")
_LABEL_TRIM = " \t\r\n.:;!?'\"`()[]{}*"
_WHITESPACE = re.compile(r"\s+")
_SPECIAL_TOKENS = re.compile(
    r"<\|[^<>|\s]{1,40}\|>"  # Qwen / GPT style: <|im_end|>, <|endoftext|>, <|vision_start|>
    r"|</?s>|<pad>|<unk>|<eos>|<bos>|<mask>|</?start_of_turn>|<end_of_turn>"
    r"|\[(?:PAD|CLS|SEP|UNK|MASK)\]",
    re.I,
)
_INDICATION = re.compile(r"\bindications?\s*:", re.I)


def _check_type(type: str) -> None:
    if type not in REPORT_TYPES:
        raise ValueError(f"unknown response type {type!r}; choose one of {', '.join(REPORT_TYPES)}")


def extract_report(text: str, type: str = "free_form") -> str | None:
    """The report in a response of the given type, or None when its required layout is missing."""
    _check_type(type)
    if not isinstance(text, str):
        raise TypeError(f"a response must be a string, got {text.__class__.__name__}")
    if type == "free_form":
        return text.strip()
    if type == "cot":
        m = _THINK_THEN_REST.fullmatch(text)
        if m is None or "<think>" in m.group(1) or "<think>" in m.group(2) or "</think>" in m.group(2):
            return None
        text = m.group(2)
    boxed = _last_boxed(text)
    return boxed if boxed else None


def format_ok(text: str, type: str = "free_form") -> bool:
    """True when ``text`` has the layout its response type requires."""
    return extract_report(text, type) is not None


def extract_reports(texts: Sequence[str], type: str = "free_form") -> tuple[list[str], list[bool]]:
    """The report of each response ("" where the layout is missing) and whether its layout was right."""
    reports, ok = [], []
    for text in texts:
        report = extract_report(text, type)
        reports.append("" if report is None else report)
        ok.append(report is not None)
    return reports, ok


# ---------------------------------------------------------------- CheXPO answer set F1


def answer_labels(text: str) -> set[str]:
    """The normalised label set of an answer: the last ``<answer>`` span (else the whole text),
    split on commas, semicolons and newlines, each label case-folded, trimmed of
    surrounding punctuation, underscores read as spaces and whitespace collapsed."""
    spans = _ANSWER_SPAN.findall(text)
    body = spans[-1] if spans else text
    labels = set()
    for raw in _LABEL_SPLIT.split(body):
        label = _WHITESPACE.sub(" ", raw.replace("_", " ").strip(_LABEL_TRIM)).casefold()
        if label.startswith("and "):
            label = label[4:]
        if label:
            labels.add(label)
    return labels


def set_f1(pred: set[str], ref: set[str]) -> float:
    """2 |pred & ref| / (|pred| + |ref|); 1.0 when both sets are empty."""
    if not pred and not ref:
        return 1.0
    return 2 * len(pred & ref) / (len(pred) + len(ref))


def answer_set_f1(pred: str, ref: str) -> float:
    """Set F1 between the labels of ``pred`` and ``ref`` (see :func:`answer_labels`).

    ``answer_set_f1("a, b", "a, c") == 0.5``; listing many labels lowers precision, so it
    is not full credit.
    """
    return set_f1(answer_labels(pred), answer_labels(ref))


def _reference_labels(gold: Any) -> set[str]:
    if isinstance(gold, (list, tuple, set)):
        labels: set[str] = set()
        for item in gold:
            labels |= answer_labels(str(item))
        return labels
    return answer_labels(str(gold))


@register_reward("answer_set_f1")
def answer_set_f1_reward(
    prompts: Sequence[Any], completions: Sequence[str], *, answer: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """CheXPO answer accuracy as a set F1 of the completion's ``<answer>`` labels against ``answer``.

    A completion without an ``<answer>...</answer>`` span scores 0. The reference may be
    a label string (with or without ``<answer>`` tags) or a list of labels; a None
    reference gives None (not applicable).
    """
    if answer is None:
        raise ValueError(
            f"needs an 'answer' column (the reference labels per row); the batch has columns: "
            f"{', '.join(sorted(kwargs)) or '(none)'}"
        )
    if len(answer) != len(completions):
        raise ValueError(f"got {len(answer)} answers for {len(completions)} completions")
    out: list[float | None] = []
    for gold, completion in zip(answer, map(completion_text, completions)):
        if gold is None:
            out.append(None)
        elif not _ANSWER_SPAN.search(completion):
            out.append(0.0)
        else:
            out.append(set_f1(answer_labels(completion), _reference_labels(gold)))
    return out


# ---------------------------------------------------------------- evaluation text cleaning


def clean_report(
    text: str,
    *,
    cut_at_indication: bool = True,
    drop_special_tokens: bool = True,
    extract_boxed: bool = False,
) -> str:
    """A generated report made ready for scoring, as in EditGRPO's lightweight evaluation.

    In this order: ``drop_special_tokens`` removes tokenizer markers left in decoded
    text (``<|im_end|>``, ``<|endoftext|>``, ``</s>``, ``<pad>``, ``[SEP]``, ...);
    ``extract_boxed`` keeps the content of the last ``\\boxed{...}`` when there is one
    (the text is kept as it is when there is none); ``cut_at_indication`` drops
    everything from the first ``Indication:`` on, which models append after the
    findings, unless nothing would remain before it (a report that starts with its
    indication keeps it). Whitespace is collapsed to single spaces.
    """
    if not isinstance(text, str):
        raise TypeError(f"a report must be a string, got {type(text).__name__}")
    if drop_special_tokens:
        text = _SPECIAL_TOKENS.sub(" ", text)
    if extract_boxed:
        boxed = _last_boxed(text)
        if boxed is not None:
            text = boxed
    if cut_at_indication:
        m = _INDICATION.search(text)
        if m is not None and text[: m.start()].strip():
            text = text[: m.start()]
    return _WHITESPACE.sub(" ", text).strip()
