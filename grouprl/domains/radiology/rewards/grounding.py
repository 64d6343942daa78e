"""Visual grounding: boxes in RadVLM's answer text, their overlap, and the grounding reward.

RadVLM-GRPO's grounding tasks (anatomical grounding on Chest ImaGenome, abnormality
grounding on VinDr-CXR, phrase grounding on MS-CXR) answer with boxes normalised to
[0, 1] of the image width and height, written as ``[x1, y1, x2, y2]`` (RadVLM rounds
each coordinate to two decimals), several boxes joined with ", " and " and "::

    The right lung is located at the coordinates [0.14, 0.17, 0.47, 0.79] on the image.
    This phrase can be observed at [0.61, 0.52, 0.83, 0.7] on the image.
    I can find a nodule located at the coordinates [0.6, 0.3, 0.67, 0.37]; an effusion
    located at the coordinates [0.12, 0.6, 0.4, 0.8] and [0.6, 0.62, 0.88, 0.81].

The last form (abnormality grounding) names a label for each group of boxes:
``<a|an> <label> located at the coordinates <boxes>``, groups separated by ";".
:func:`parse_boxes` reads every form and keeps those labels.

A prediction is scored against the reference by matching boxes one to one so that
the summed IoU is largest (:func:`max_weight_matching`, scipy's assignment solver), with
every unmatched box, predicted or reference, counting as IoU 0 (:func:`grounding_score`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from grouprl.rewards.contract import completion_text
from grouprl.domains.radiology.rewards.task_rows import applies, row_name
from grouprl.rewards.registry import register_reward

BACKEND = "boxes=IoU with optimal one-to-one matching"

# The tasks whose rows the grounding reward scores when a row says its task.
GROUNDING_TASKS = frozenset({"grounding", "anatomical_grounding", "abnormality_grounding", "phrase_grounding",
                             "region_grounding"})

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_FOUR = re.compile(rf"^\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*$")
# The abnormality-grounding cue; the label is the words between the article and it.
_LABEL_CUE = re.compile(r"\blocated\s+at\s+(?:the\s+)?coordinates\b", re.I)
_ARTICLE = re.compile(r"\b(?:a|an)\s+", re.I)
LABEL_MODES = ("auto", "ignore")


class BoxFormatError(ValueError):
    """A reference answer whose boxes cannot be read; the message names the record and the box."""


@dataclass(frozen=True)
class Box:
    """An axis-aligned box in image fractions: x to the right, y down; ``label`` when the text names one."""

    x1: float
    y1: float
    x2: float
    y2: float
    label: str | None = None

    @property
    def area(self) -> float:
        """``max(0, x2 - x1) * max(0, y2 - y1)``: a box written with its corners swapped has no area."""
        return max(0.0, self.x2 - self.x1) * max(0.0, self.y2 - self.y1)

    def coords(self) -> list[float]:
        return [self.x1, self.y1, self.x2, self.y2]


def normalize_label(text: str) -> str:
    """Lower case, single spaces, no surrounding punctuation: how box labels are compared."""
    return " ".join(re.sub(r"[.,;:!?\"']", " ", text.lower()).split())


def parse_boxes(text: str, *, strict: bool = False, where: str = "answer") -> list[Box]:
    """Every ``[x1, y1, x2, y2]`` box in ``text``, in order, with its label when the text gives one.

    A box is labelled when it follows ``<a|an> <label> located at the coordinates`` in
    the same ";"-separated part of the text (RadVLM's abnormality-grounding answers).

    ``strict=False`` (model outputs): brackets that do not hold four numbers are not
    boxes and are skipped; coordinates are kept as written. ``strict=True``
    (references): every bracket must be a box with ``0 <= x1 < x2 <= 1`` and
    ``0 <= y1 < y2 <= 1``, else :class:`BoxFormatError` naming ``where`` and the box.
    """
    if not isinstance(text, str):
        raise TypeError(f"{where}: expected text holding boxes, got {type(text).__name__}")
    boxes = []
    for match in _BRACKET.finditer(text):
        four = _FOUR.match(match.group(1))
        if four is None:
            if strict:
                raise BoxFormatError(f"{where}: malformed box {match.group(0)!r}; expected [x1, y1, x2, y2] "
                                     f"with four numbers in [0, 1]")
            continue
        x1, y1, x2, y2 = (float(v) for v in four.groups())
        if strict:
            if not all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in (x1, y1, x2, y2)):
                raise BoxFormatError(f"{where}: box {match.group(0)!r} has a coordinate outside [0, 1] "
                                     f"(boxes are fractions of the image width and height)")
            if not (x1 < x2 and y1 < y2):
                raise BoxFormatError(f"{where}: box {match.group(0)!r} is empty; expected x1 < x2 and y1 < y2")
        boxes.append(Box(x1, y1, x2, y2, _label_before(text, match.start())))
    return boxes


def _label_before(text: str, position: int) -> str | None:
    part_start = text.rfind(";", 0, position) + 1
    cues = [m for m in _LABEL_CUE.finditer(text, part_start, position)]
    if not cues:
        return None
    head = text[part_start:cues[-1].start()]
    articles = list(_ARTICLE.finditer(head))
    if not articles:
        return None  # "The right lung is located at ...": a sentence, not a labelled group
    label = normalize_label(head[articles[-1].end():])
    return label or None


def format_box(box: Sequence[float]) -> str:
    """``[x1, y1, x2, y2]`` with each coordinate rounded to two decimals, as RadVLM writes boxes."""
    if len(box) != 4:
        raise ValueError(f"a box has four coordinates, got {list(box)!r}")
    return "[" + ", ".join(str(round(float(v), 2)) for v in box) + "]"


def format_boxes(boxes: Sequence[Sequence[float]]) -> str:
    """Boxes joined as RadVLM joins them: ``[..], [..] and [..]``."""
    if not boxes:
        raise ValueError("format_boxes needs at least one box")
    texts = [format_box(b) for b in boxes]
    return texts[0] if len(texts) == 1 else ", ".join(texts[:-1]) + " and " + texts[-1]


# ----------------------------------------------------------------------------- overlap and matching


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union: ``|a ∩ b| / (|a| + |b| - |a ∩ b|)``; 0 when the union is empty."""
    w = min(a.x2, b.x2) - max(a.x1, b.x1)
    h = min(a.y2, b.y2) - max(a.y1, b.y1)
    inter = max(0.0, w) * max(0.0, h) if a.area > 0 and b.area > 0 else 0.0
    union = a.area + b.area - inter
    return inter / union if union > 0 else 0.0


def max_weight_matching(weights: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """A one-to-one matching of rows to columns with the largest total weight.

    For an ``n x m`` matrix ``W`` it returns ``min(n, m)`` pairs ``(i, j)``, no row or
    column twice, maximising ``sum W[i][j]`` over all such matchings: the rectangular
    assignment problem, solved by scipy's ``linear_sum_assignment`` (``maximize=True``).
    """
    import numpy as np
    from scipy.optimize import linear_sum_assignment

    n = len(weights)
    m = len(weights[0]) if n else 0
    if any(len(row) != m for row in weights):
        raise ValueError("max_weight_matching needs a rectangular matrix")
    if min(n, m) == 0:
        return []
    rows, cols = linear_sum_assignment(np.asarray(weights, dtype=np.float64), maximize=True)
    return sorted(zip(rows.tolist(), cols.tolist()))


@dataclass(frozen=True)
class GroundingScore:
    """A prediction's boxes against the reference's, after the optimal matching.

    ``iou``: the summed IoU of matched pairs over ``max(n_pred, n_ref)``.
    ``precision`` / ``recall`` / ``f1``: with a pair a hit when its IoU >= the threshold.
    ``pairs``: ``(predicted index, reference index, IoU)`` of the matched pairs.
    """

    iou: float
    precision: float
    recall: float
    f1: float
    n_pred: int
    n_ref: int
    pairs: tuple[tuple[int, int, float], ...]


def grounding_score(pred: Sequence[Box], ref: Sequence[Box], *, iou_threshold: float = 0.5,
                    labels: str = "auto") -> GroundingScore:
    """Score predicted boxes against reference boxes; every unmatched box counts against.

    With ``n`` predicted and ``m`` reference boxes and the matching ``M`` that
    maximises the summed IoU (:func:`max_weight_matching`)::

        iou       = sum_{(p, r) in M} IoU(p, r) / max(n, m)
        hits      = |{(p, r) in M : IoU(p, r) >= iou_threshold}|
        precision = hits / n,   recall = hits / m,   f1 = 2 hits / (n + m)

    so an extra predicted box or a missed reference box lowers every score. Both
    empty (nothing to find, nothing claimed) scores 1; exactly one empty scores 0.
    ``labels="auto"``: when every box on both sides carries a label, a pair with
    different labels has IoU 0 (a box around the right place named as the wrong
    finding earns nothing); ``"ignore"``: labels are not compared.
    """
    if labels not in LABEL_MODES:
        raise ValueError(f"labels must be one of {LABEL_MODES}, got {labels!r}")
    if not 0.0 < iou_threshold <= 1.0:
        raise ValueError(f"iou_threshold must be in (0, 1], got {iou_threshold!r}")
    n, m = len(pred), len(ref)
    if n == 0 and m == 0:
        return GroundingScore(1.0, 1.0, 1.0, 1.0, 0, 0, ())
    if n == 0 or m == 0:
        return GroundingScore(0.0, 0.0, 0.0, 0.0, n, m, ())
    use_labels = labels == "auto" and all(b.label for b in pred) and all(b.label for b in ref)
    weights = [[0.0 if use_labels and p.label != r.label else box_iou(p, r) for r in ref] for p in pred]
    pairs = tuple((i, j, weights[i][j]) for i, j in max_weight_matching(weights) if weights[i][j] > 0)
    hits = sum(1 for _, _, value in pairs if value >= iou_threshold)
    return GroundingScore(
        iou=sum(value for _, _, value in pairs) / max(n, m),
        precision=hits / n,
        recall=hits / m,
        f1=2 * hits / (n + m),
        n_pred=n,
        n_ref=m,
        pairs=pairs,
    )


# ----------------------------------------------------------------------------- the reward


@register_reward("grounding_iou")
def grounding_iou_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[str | None] | None = None,
    task: Sequence[Any] | None = None,
    *,
    score: str = "iou",
    iou_threshold: float = 0.5,
    labels: str = "auto",
    **columns: Any,
) -> list[float | None]:
    """RadVLM grounding reward: the completion's boxes against the reference answer's.

    ``score="iou"`` (default): :func:`grounding_score`'s matched IoU with unmatched
    boxes counting 0; ``score="f1"``: its F1 at ``iou_threshold``. The reference boxes
    are read strictly from the ``answer`` column (a malformed reference raises,
    naming the row and its id); rows whose ``task`` column names another task get
    None (not applicable), so one dataset can mix RadVLM's tasks.
    """
    if score not in ("iou", "f1"):
        raise ValueError(f"grounding_iou: score must be 'iou' or 'f1', got {score!r}")
    if answer is None:
        raise ValueError("grounding_iou needs the 'answer' column (the reference answer with its boxes)")
    named = {"id": columns.get("id")}
    out: list[float | None] = []
    for row, completion in enumerate(completions):
        if not applies(task, row, GROUNDING_TASKS):
            out.append(None)
            continue
        reference = answer[row]
        if not isinstance(reference, str):
            raise ValueError(f"grounding_iou: {row_name(named, row)} has no reference answer")
        ref = parse_boxes(reference, strict=True, where=f"{row_name(named, row)}, reference answer")
        result = grounding_score(parse_boxes(completion_text(completion)), ref, iou_threshold=iou_threshold,
                                 labels=labels)
        out.append(result.iou if score == "iou" else result.f1)
    return out
