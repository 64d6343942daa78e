"""RadVLM-GRPO's tasks beyond report generation: the plugin registering their rewards, and their scoring.

Importing this module (the ``radvlm_tasks`` entry point of ``grouprl.plugins``)
registers the task rewards by name, for GRPO training and the reward registry:

- ``classification_set_f1``: abnormality classification (:mod:`.classification`);
- ``grounding_iou``: anatomical, abnormality and phrase grounding (:mod:`.grounding`);
- ``conversation_judge``: multi-turn conversation, scored by an LLM judge (:mod:`.conversation`).

:func:`score_task` scores a predictions file's records (``{id, response, answer}``,
plus ``history`` for conversations) for ``grouprl eval --task``: per-sample metrics,
and corpus metrics recomputable on any subset of the records (for bootstrap intervals).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from grouprl.rewards.judge import ChatJudge
from grouprl.domains.radiology.rewards import classification, conversation, grounding
from grouprl.domains.radiology.rewards.classification import (
    classification_corpus_scores,
    parse_findings_list,
    set_f1,
)
from grouprl.domains.radiology.rewards.conversation import history_turns, judge_conversations
from grouprl.domains.radiology.rewards.grounding import grounding_score, parse_boxes

EVAL_TASKS = ("classification", "grounding", "conversation")

# What each evaluation task needs in a predictions record besides id, response and answer.
TASK_FIELDS: dict[str, tuple[str, ...]] = {"classification": (), "grounding": (), "conversation": ("history",)}


@dataclass
class TaskScores:
    """A task's scores of a predictions file.

    ``per_sample``: metric -> one value per record (None: unscored, e.g. the judge failed
    under ``on_failure="skip"``); ``backends``: metric -> where its values come from;
    ``corpus(indices)``: the corpus metrics on those records (repeated indices allowed);
    ``unscored``: ``{"id", "error"}`` of the records left unscored.
    """

    per_sample: dict[str, list[float | None]]
    backends: dict[str, str]
    corpus: Callable[[Sequence[int]], dict[str, float | None]] | None = None
    corpus_backend: str = ""
    unscored: list[dict[str, str]] = field(default_factory=list)


def _where(source: str, index: int, record: dict[str, Any]) -> str:
    return f"{source}: record {index} (id {record['id']!r})"


def score_classification(records: Sequence[dict[str, Any]], *, source: str = "predictions") -> TaskScores:
    """Per sample: ``set_f1`` and ``exact_match`` of the response's findings list against the answer's;
    corpus: micro precision/recall/F1 and macro F1 (:func:`classification_corpus_scores`)."""
    preds = [parse_findings_list(r["response"]) for r in records]
    refs = [parse_findings_list(r["answer"]) for r in records]
    backend = classification.BACKEND

    def corpus(indices: Sequence[int]) -> dict[str, float | None]:
        scores = classification_corpus_scores([preds[i] for i in indices], [refs[i] for i in indices])
        # exact match is also the per-sample mean; reported once, there
        return {k: v for k, v in scores.items() if k not in ("backend", "exact_match")}

    return TaskScores(
        per_sample={"set_f1": [set_f1(p, r) for p, r in zip(preds, refs)],
                    "exact_match": [float(p == r) for p, r in zip(preds, refs)]},
        backends={"set_f1": backend, "exact_match": backend},
        corpus=corpus,
        corpus_backend=backend,
    )


def score_grounding(records: Sequence[dict[str, Any]], *, iou_threshold: float = 0.5, labels: str = "auto",
                    source: str = "predictions") -> TaskScores:
    """Per sample: matched ``iou`` and ``precision/recall/f1@<threshold>`` (:func:`grounding_score`);
    corpus: the same three pooled over all boxes (hits summed over samples, divided by all
    predicted / reference boxes). A reference answer whose boxes cannot be read is an error
    naming the record."""
    scores = []
    for i, record in enumerate(records):
        ref = parse_boxes(record["answer"], strict=True, where=f"{_where(source, i, record)}: field 'answer'")
        scores.append(grounding_score(parse_boxes(record["response"]), ref, iou_threshold=iou_threshold,
                                      labels=labels))
    t = f"{iou_threshold:g}"
    backend = grounding.BACKEND

    def corpus(indices: Sequence[int]) -> dict[str, float | None]:
        hits = sum(sum(1 for *_, v in scores[i].pairs if v >= iou_threshold) for i in indices)
        n_pred = sum(scores[i].n_pred for i in indices)
        n_ref = sum(scores[i].n_ref for i in indices)
        return {f"micro_precision@{t}": hits / n_pred if n_pred else None,
                f"micro_recall@{t}": hits / n_ref if n_ref else None,
                f"micro_f1@{t}": 2 * hits / (n_pred + n_ref) if n_pred + n_ref else None}

    per_sample = {"iou": [s.iou for s in scores], f"precision@{t}": [s.precision for s in scores],
                  f"recall@{t}": [s.recall for s in scores], f"f1@{t}": [s.f1 for s in scores]}
    return TaskScores(per_sample, {name: backend for name in per_sample}, corpus, backend)


def score_conversation(records: Sequence[dict[str, Any]], *, judge: ChatJudge, on_failure: str = "raise",
                       source: str = "predictions") -> TaskScores:
    """Per sample: ``judge_score``, the judge's overall score / 10 for the final answer given the
    record's ``history`` (the turns before it). A failed judgement raises, or with
    ``on_failure="skip"`` leaves the record unscored (None) and lists it in ``unscored``."""
    histories = []
    for i, record in enumerate(records):
        if record.get("history") is None:
            raise ValueError(f"{_where(source, i, record)}: field 'history' is missing; the conversation task "
                             f"needs the turns before the answer (grouprl generate --task conversation writes them)")
        histories.append(history_turns(record["history"], where=f"{_where(source, i, record)}: field 'history'"))
    items = [f"record {i} (id {r['id']!r})" for i, r in enumerate(records)]
    outcomes = judge_conversations(judge, histories, [r["answer"] for r in records], [r["response"] for r in records],
                                   items=items, on_failure=on_failure)
    unscored = [{"id": r["id"], "error": o.error} for r, o in zip(records, outcomes) if o.value is None]
    return TaskScores({"judge_score": [o.value for o in outcomes]}, {"judge_score": judge.backend},
                      unscored=unscored)


def score_task(task: str, records: Sequence[dict[str, Any]], *, source: str = "predictions",
               iou_threshold: float = 0.5, labels: str = "auto", judge: ChatJudge | None = None,
               on_failure: str = "raise") -> TaskScores:
    """Score ``records`` for ``task`` (one of :data:`EVAL_TASKS`)."""
    if task == "classification":
        return score_classification(records, source=source)
    if task == "grounding":
        return score_grounding(records, iou_threshold=iou_threshold, labels=labels, source=source)
    if task == "conversation":
        if judge is None:
            raise ValueError("the conversation task needs a judge: give its base URL and model "
                             "(--judge-base-url/--judge-model, or $GROUPRL_JUDGE_BASE_URL/$GROUPRL_JUDGE_MODEL)")
        return score_conversation(records, judge=judge, on_failure=on_failure, source=source)
    raise ValueError(f"unknown task {task!r}; tasks: {', '.join(EVAL_TASKS)}")


__all__ = ["EVAL_TASKS", "TASK_FIELDS", "TaskScores", "classification", "conversation", "grounding", "score_task"]
