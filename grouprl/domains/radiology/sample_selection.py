"""Choosing the training items of a run: CheXPO's hard-sample mining and stratified sampling.

CheXPO-v2 trains on the questions its SFT model gets wrong. ``hard`` keeps the
items whose prediction (from ``grouprl generate``) scores an answer-set F1 below
``threshold`` against the item's reference (see
``grouprl.domains.radiology.rewards.answers.answer_set_f1``; the default 1.0 keeps every
item that is not exactly right); ``uniform`` keeps every item. Then ``n`` items
are drawn, stratified by question type: each type gets a share of ``n``
proportional to its share of the kept items (largest remainders), at least one
item per type when ``n`` is at least the number of types, and its items are
drawn at random with ``seed``. The chosen records come back unchanged, in their
input order, so the same seed gives the same file.

    grouprl sample --data vqa.jsonl --predictions sft_preds.jsonl --strategy hard --n 1000 --out hard.jsonl
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from grouprl.files import RecordsError, json_layout, read_json_records, write_text_atomic

STRATEGIES = ("hard", "uniform")
_SHOWN = 10  # ids named in an error message before "and N more"


class SamplingError(ValueError):
    """Inputs that cannot be sampled from; the message says which items or option."""


# ---------------------------------------------------------------------------- the library


def select_samples(
    records: Sequence[dict[str, Any]],
    *,
    strategy: str,
    predictions: Mapping[str, str] | Iterable[dict[str, Any]] | None = None,
    n: int | None = None,
    seed: int = 0,
    type_key: str | None = "question_type",
    threshold: float = 1.0,
    answer_key: str = "answer",
    id_key: str = "id",
) -> list[dict[str, Any]]:
    """The records a run trains on, chosen by ``strategy`` (``hard`` or ``uniform``).

    ``predictions`` (``hard`` only) maps each record's id (``record[id_key]``) to
    the model's response, as a mapping or as ``{"id", "response"}`` records (what
    ``grouprl generate`` writes). ``n``: how many to return (default: every kept
    item). ``type_key`` names the question-type field; several fields joined by
    commas (``"semantic_type,question_type"``) stratify by their combination, and
    None draws without strata. Returns the chosen records themselves, in input order.
    """
    pool = candidate_indices(records, strategy=strategy, predictions=predictions, threshold=threshold,
                             answer_key=answer_key, id_key=id_key)
    chosen = stratified_sample([records[i] for i in pool], n=n, seed=seed, type_key=type_key)
    return [records[pool[i]] for i in chosen]


def candidate_indices(
    records: Sequence[dict[str, Any]],
    *,
    strategy: str,
    predictions: Mapping[str, str] | Iterable[dict[str, Any]] | None = None,
    threshold: float = 1.0,
    answer_key: str = "answer",
    id_key: str = "id",
) -> list[int]:
    """Indices of the records ``strategy`` keeps before sampling: all (``uniform``) or the
    ones the predictions get wrong (``hard``: answer-set F1 < ``threshold``)."""
    if strategy not in STRATEGIES:
        raise SamplingError(f"unknown sampling strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    _check_records(records)
    if strategy == "uniform":
        if predictions is not None:
            raise SamplingError("predictions were given but strategy 'uniform' does not use them; "
                                "use strategy 'hard' to keep the items the model gets wrong")
        return list(range(len(records)))
    if predictions is None:
        raise SamplingError("strategy 'hard' needs the model's predictions ({id, response} per item, "
                            "as grouprl generate writes them)")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise SamplingError(f"threshold must be a number in (0, 1], got {threshold!r}")
    from grouprl.domains.radiology.rewards.answers import answer_set_f1

    responses = prediction_map(predictions)
    ids = record_ids(records, id_key)
    missing = [rid for rid in ids if rid not in responses]
    if missing:
        raise SamplingError(f"the predictions have no response for {len(missing)} of {len(ids)} items: "
                            f"{_name_some(missing)}")
    return [i for i, (record, rid) in enumerate(zip(records, ids))
            if answer_set_f1(responses[rid], reference_answer(record, i, answer_key)) < threshold]


def stratified_sample(
    records: Sequence[dict[str, Any]],
    *,
    n: int | None = None,
    seed: int = 0,
    type_key: str | None = "question_type",
) -> list[int]:
    """Indices (ascending) of ``n`` records drawn at random within question types, each type
    getting the share :func:`allocate` gives it. ``n`` None takes every record."""
    _check_records(records)
    strata = group_by_type(records, type_key)  # first, so that a wrong field name fails whatever n is
    available = len(records)
    if n is None:
        return list(range(available))
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SamplingError(f"n must be a positive integer, got {n!r}")
    if n > available:
        raise SamplingError(f"asked for {n} items but only {available} are available")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SamplingError(f"seed must be an integer, got {seed!r}")
    quotas = allocate({t: len(idx) for t, idx in strata.items()}, n)
    rng = random.Random(seed)
    chosen: list[int] = []
    for t in sorted(strata, key=_type_order):  # a fixed order, so the seed alone decides the draw
        chosen.extend(rng.sample(strata[t], quotas[t]))
    return sorted(chosen)


def allocate(counts: Mapping[Any, int], n: int) -> dict[Any, int]:
    """Split ``n`` over types in proportion to ``counts`` (Hamilton's largest remainders).

    Every type gets at least one when ``n`` is at least the number of types, and
    never more than it has. Ties go to the larger type, then to the type that
    sorts first, so the split does not depend on the seed.
    """
    total = sum(counts.values())
    if n > total:
        raise SamplingError(f"asked for {n} items but only {total} are available")
    ideal = {t: n * c / total for t, c in counts.items()} if total else {}
    quota = {t: math.floor(ideal[t]) for t in counts}
    if n >= len(counts):
        for t in counts:
            quota[t] = max(quota[t], 1)

    def order(t):  # larger remainder first, then larger type, then the type's sort order
        return (-(ideal[t] - quota[t]), -counts[t], _type_order(t))

    while sum(quota.values()) < n:
        t = min((t for t in counts if quota[t] < counts[t]), key=order)
        quota[t] += 1
    while sum(quota.values()) > n:  # only after the at-least-one rule: take from the most over-served
        t = max((t for t in counts if quota[t] > 1), key=order)
        quota[t] -= 1
    return quota


def group_by_type(records: Sequence[dict[str, Any]], type_key: str | None) -> dict[str | None, list[int]]:
    """Record indices per question type; one stratum (None) when ``type_key`` is None."""
    if type_key is None or not str(type_key).strip():
        return {None: list(range(len(records)))}
    keys = [k.strip() for k in str(type_key).split(",") if k.strip()]
    absent = [k for k in keys if not any(k in r for r in records)]
    if absent:
        seen = sorted({k for r in records for k in r})
        raise SamplingError(f"no item has the question-type field {', '.join(map(repr, absent))}; fields present: "
                            f"{', '.join(seen)}. Name the field (--question-type-key), or sample without strata "
                            "(an empty key: --question-type-key '')")
    strata: dict[str | None, list[int]] = {}
    for i, record in enumerate(records):
        parts = [record.get(k) for k in keys]
        label = None if all(p is None for p in parts) else "_".join(_type_text(p) for p in parts)
        strata.setdefault(label, []).append(i)
    return strata


def record_ids(records: Sequence[dict[str, Any]], id_key: str = "id") -> list[str]:
    """Each record's id as a string; an error naming the records without one or with a repeated one."""
    ids, missing, seen, repeats = [], [], {}, []
    for i, record in enumerate(records):
        value = record.get(id_key)
        if value is None or isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
            missing.append(str(i))
            ids.append("")
            continue
        rid = str(value)
        if rid in seen:
            repeats.append(rid)
        seen[rid] = i
        ids.append(rid)
    if missing:
        raise SamplingError(f"{len(missing)} item(s) have no usable {id_key!r} to match predictions by "
                            f"(record indices {_name_some(missing)}); give every item a unique id")
    if repeats:
        raise SamplingError(f"item ids repeat ({_name_some(sorted(set(repeats)))}); predictions are matched by id, "
                            "so every item needs a unique one")
    return ids


def prediction_map(predictions: Mapping[str, str] | Iterable[dict[str, Any]]) -> dict[str, str]:
    """``{id: response}`` from a mapping or from ``{"id", "response"}`` records (ids as strings)."""
    if isinstance(predictions, Mapping):
        out = {}
        for key, value in predictions.items():
            if not isinstance(value, str):
                raise SamplingError(f"prediction {key!r}: the response must be a string, got {type(value).__name__}")
            out[str(key)] = value
        return out
    out, where = {}, {}
    for i, record in enumerate(predictions):
        if not isinstance(record, dict):
            raise SamplingError(f"prediction {i}: expected an object with 'id' and 'response', "
                                f"got {type(record).__name__}")
        rid = record.get("id")
        if rid is None or isinstance(rid, bool) or not isinstance(rid, (str, int)):
            raise SamplingError(f"prediction {i}: field 'id' is missing or not a string/integer "
                                f"(keys: {sorted(record)})")
        response = record.get("response")
        if not isinstance(response, str):
            raise SamplingError(f"prediction {i} (id {rid!r}): field 'response' is missing or not a string")
        rid = str(rid)
        if rid in out:
            raise SamplingError(f"prediction {i}: id {rid!r} repeats prediction {where[rid]}")
        out[rid], where[rid] = response, i
    return out


def reference_answer(record: dict[str, Any], index: int, answer_key: str = "answer") -> str:
    """The item's reference answer: ``record[answer_key]`` (a label list is joined with commas),
    else the answer of the record read in its format (LLaVA's last ``gpt`` turn, ms-swift's last
    assistant message or ``solution``)."""
    value = record.get(answer_key)
    if isinstance(value, (list, tuple)):
        value = ", ".join(str(v) for v in value)
    if isinstance(value, str):
        return value
    if value is not None:
        raise SamplingError(f"item {index}: field {answer_key!r} must be a string or a list of labels, "
                            f"got {type(value).__name__}")
    from grouprl.data.formats import DataError, RecordError, RecordKeys, detect_format, parse_record

    keys = RecordKeys(answer=answer_key)
    try:
        parsed = parse_record(record, detect_format(record, keys, f"item {index}"), keys=keys)
    except (DataError, RecordError) as exc:
        raise SamplingError(f"item {index}: no reference answer: field {answer_key!r} is missing and the record "
                            f"is not one whose answer can be read ({exc})") from exc
    return parsed.answer or ""


def _check_records(records: Sequence[dict[str, Any]]) -> None:
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise SamplingError(f"item {i}: expected an object, got {type(record).__name__}")


def _type_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "_".join(map(str, value))
    return "" if value is None else str(value)


def _type_order(t: str | None) -> tuple[bool, str]:
    return (t is None, "" if t is None else t)


def _name_some(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


# ---------------------------------------------------------------------------- files


def read_records(path: str | os.PathLike) -> tuple[list[dict[str, Any]], str]:
    """The records of a JSON-list or JSON-lines file, and which of the two it is (``json`` / ``jsonl``)."""
    path = Path(path)
    if not path.is_file():
        raise SamplingError(f"{path}: file not found")
    try:
        records = read_json_records(path)
    except RecordsError as exc:
        raise SamplingError(str(exc)) from exc
    if not records:
        raise SamplingError(f"{path}: no records")
    return records, json_layout(path)


def write_records(path: str | os.PathLike, records: Sequence[dict[str, Any]], layout: str) -> None:
    """Write records as a JSON list (``json``) or JSON lines (``jsonl``), atomically."""
    if layout == "json":
        text = json.dumps(list(records), ensure_ascii=False, indent=1) + "\n"
    elif layout == "jsonl":
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    else:
        raise SamplingError(f"unknown record layout {layout!r}; expected json or jsonl")
    write_text_atomic(path, text)
