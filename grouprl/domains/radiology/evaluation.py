"""Evaluating generated reports: ``grouprl generate`` writes them, ``grouprl eval`` scores them.

The file between the two is EditGRPO's: a JSON list or JSON lines of
``{"id": ..., "response": <generated report>, "answer": <reference report>}``.

:func:`evaluate_file` scores every pair with the report score components (one
batched call per component), adds the corpus-level metrics the radiology modules
offer (CheXpert-label F1 micro/macro over 14 and 5 observations, RadGraph corpus
F1, BLEU/ROUGE/METEOR/CIDEr corpus scores), and writes into the output directory:

- ``per_sample.csv``: ``id`` and one column per component, named with its backend
  (``cxb14micro[labeler=rules]``);
- ``summary.json`` and ``summary.csv`` (``metric, value, ci_low, ci_high, backend``):
  each component's mean with a percentile-bootstrap 95% confidence interval
  (samples resampled with replacement, seeded), and the corpus metrics (their
  intervals are bootstrapped too when ``corpus_bootstrap`` > 0).

``task`` picks what the predictions answer (RadVLM-GRPO's tasks): ``report`` (the
default, above), or ``classification``, ``grounding`` and ``conversation``, scored by
:mod:`grouprl.domains.radiology.rewards.radvlm_tasks` (findings-list set F1, box IoU with an
optimal matching, an LLM judge) into the same three files, with the same intervals.
A conversation record also carries ``history``, the turns before the answer, which
``grouprl generate --task conversation`` writes.

Every file is written atomically (:mod:`grouprl.files`), so an interrupted run
never leaves a half-written result that looks complete.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib
import io
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from grouprl.files import AtomicFile, RecordsError, read_json_records, write_text_atomic

CONFIDENCE = 0.95

# Corpus-level metrics: name -> (function, modules to look for it in; the first that has it
# wins). A function is ``fn(hyps, refs) -> mapping of metric -> value``; absent ones are skipped.
CORPUS_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "chexpert_f1": ("chexpert_f1_reports", ("grouprl.domains.radiology.rewards.label_metrics",)),
    "radgraph_corpus_f1": ("radgraph_corpus_f1", ("grouprl.domains.radiology.rewards.radgraph_f1",)),
    "nlg_corpus_scores": ("nlg_corpus_scores", ("grouprl.domains.radiology.rewards.nlg",)),
}

# Keys of a corpus result that are counts, not metrics.
_NOT_METRICS = frozenset({"n", "support"})

# The per-sample components ``grouprl eval`` scores when none are named (those registered):
# EditGRPO's evaluation columns that have a per-sample form.
DEFAULT_EVAL_COMPONENTS = ("radgraphf1", "cxb14micro", "cxb_bal_acc", "ratescore", "kg_consistency", "bleu1",
                           "bleu2", "bleu3", "bleu4", "rougeL", "cider", "bertscore", "radcliq")


# What the predictions answer: RadVLM-GRPO's tasks. `report` is EditGRPO's report evaluation.
TASKS = ("report", "classification", "grounding", "conversation")


class EvalDataError(ValueError):
    """A predictions file that cannot be evaluated; the message names the file, record and field."""


# ----------------------------------------------------------------------------- reading


class EvaluationWarning(UserWarning):
    """An evaluation that ran but whose numbers say little (every response empty)."""


def read_predictions(path: str | os.PathLike, *, keep: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Read ``{id, response, answer}`` records from a JSON list or a JSON-lines file.

    ``dicom_id`` stands in for a missing ``id`` (as EditGRPO's evaluation allows);
    ids are kept as strings and must be unique. ``response`` may be empty (a model
    can generate nothing), ``answer`` may not. The fields named in ``keep`` are
    carried along when a record has them (a task's own fields, e.g. ``history``).
    """
    path = Path(path)
    if not path.is_file():
        raise EvalDataError(f"predictions file {path} not found")
    try:
        records = read_json_records(path)
    except RecordsError as exc:
        raise EvalDataError(str(exc)) from exc
    out: list[dict[str, str]] = []
    seen: dict[str, int] = {}
    for i, record in enumerate(records):
        where = f"{path}: record {i}"
        key = "id" if "id" in record else "dicom_id" if "dicom_id" in record else None
        if key is None:
            raise EvalDataError(f"{where}: field 'id' is missing")
        rid = record[key]
        if isinstance(rid, bool) or not isinstance(rid, (str, int)) or (isinstance(rid, str) and not rid.strip()):
            raise EvalDataError(f"{where}: field {key!r} must be a non-empty string or an integer, got {rid!r}")
        rid = str(rid)
        if rid in seen:
            raise EvalDataError(f"{where}: field {key!r} repeats id {rid!r} of record {seen[rid]}")
        seen[rid] = i
        for field in ("response", "answer"):
            if field not in record:
                raise EvalDataError(f"{where} (id {rid!r}): field {field!r} is missing")
            if not isinstance(record[field], str):
                raise EvalDataError(f"{where} (id {rid!r}): field {field!r} must be a string, "
                                    f"got {type(record[field]).__name__}")
        if not record["answer"].strip():
            raise EvalDataError(f"{where} (id {rid!r}): field 'answer' is empty; a reference report is needed")
        out.append({"id": rid, "response": record["response"], "answer": record["answer"],
                    **{k: record[k] for k in keep if k in record}})
    if not out:
        raise EvalDataError(f"{path}: no records")
    return out


# ----------------------------------------------------------------------------- statistics


def bootstrap_ci(values: Sequence[float], n: int, seed: int | None = 0, *,
                 confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of the mean of ``values``.

    Draws ``n`` resamples of ``len(values)`` values with replacement (seeded, so the
    same seed gives the same interval) and returns the ``(1 - confidence) / 2`` and
    ``(1 + confidence) / 2`` quantiles of their means. The interval is clipped to
    ``[min(values), max(values)]``, where every resample mean lies, so that
    rounding never puts it outside (the interval of constant values is ``[c, c]``).
    """
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("bootstrap_ci needs a non-empty list of numbers")
    if not np.all(np.isfinite(arr)):
        raise ValueError("bootstrap_ci: values must be finite")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"bootstrap_ci: n must be a positive number of resamples, got {n!r}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"bootstrap_ci: confidence must be in (0, 1), got {confidence!r}")
    means = _resample_means(arr, n, np.random.default_rng(seed))
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    lo, hi = float(arr.min()), float(arr.max())
    return min(max(float(low), lo), hi), min(max(float(high), lo), hi)


def _resample_means(arr: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    m = arr.size
    means = np.empty(n)
    chunk = max(1, 4_000_000 // m)  # bounds the index matrix at ~32 MB
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        means[start:start + k] = arr[rng.integers(0, m, size=(k, m))].mean(axis=1)
    return means


def resample_indices(m: int, n: int, seed: int | None) -> list[np.ndarray]:
    """``n`` index vectors of resamples with replacement of ``m`` samples (for corpus-metric intervals)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, m, size=m) for _ in range(n)]


# ----------------------------------------------------------------------------- scoring


@dataclasses.dataclass
class Metric:
    metric: str
    value: float | None  # None: undefined on this corpus (the backend says why)
    ci_low: float | None
    ci_high: float | None
    backend: str
    kind: str  # "sample_mean" or "corpus"

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def clean_texts(texts: Sequence[str]) -> list[str]:
    """EditGRPO's evaluation cleaning (cut at "Indication:", drop special tokens, take ``\\boxed{}``)."""
    from grouprl.domains.radiology.rewards.answers import clean_report

    return [clean_report(t, extract_boxed=True) for t in texts]


def corpus_metric_functions() -> dict[str, Callable[[list[str], list[str]], Any]]:
    """The corpus-level metric functions that exist in this installation, by name."""
    found = {}
    for name, (attr, modules) in CORPUS_METRICS.items():
        for module_name in modules:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            fn = getattr(module, attr, None)
            if callable(fn):
                found[name] = fn
                break
    return found


def flatten_corpus_result(name: str, result: Any, default_backend: str) -> dict[str, tuple[float | None, str]]:
    """A corpus metric's result -> ``{metric name: (value, backend)}``.

    The result is a mapping (or a dataclass) of numbers, possibly nested; a string
    under ``backend`` (or a mapping under ``backends``) says where the numbers came
    from. Metric names are ``<function>/<key>[/<subkey>]``.
    """
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        result = dataclasses.asdict(result)
    if not isinstance(result, Mapping):
        raise TypeError(f"corpus metric {name} returned {type(result).__name__}; expected a mapping of numbers")
    out: dict[str, tuple[float | None, str]] = {}

    def walk(prefix: str, mapping: Mapping, backend: str, backends: Mapping) -> None:
        backend = mapping.get("backend", backend) if isinstance(mapping.get("backend"), str) else backend
        if isinstance(mapping.get("backends"), Mapping):
            backends = {**backends, **mapping["backends"]}
        for key, value in mapping.items():
            if key in ("backend", "backends") or key in _NOT_METRICS:
                continue
            metric = f"{prefix}/{key}"
            if isinstance(value, Mapping):
                walk(metric, value, str(backends.get(key, backend)), backends)
            elif value is None:  # undefined here (e.g. CIDEr over identical references)
                out[metric] = (None, str(backends.get(key, backend)))
            elif isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
                out[metric] = (float(value), str(backends.get(key, backend)))
            # lists (per-sample values, per-class reports) are not summary numbers

    walk(name, result, default_backend, {})
    return out


def _module_backend(fn: Callable) -> str:
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    backend = getattr(module, "BACKEND", None)
    return str(backend) if backend else "unknown"


def score_samples(hyps: list[str], refs: list[str], names: Sequence[str]) -> tuple[dict[str, list[float]],
                                                                                   dict[str, str]]:
    """Per-sample values of each named component (one batched call each) and each one's backend."""
    from grouprl.domains.radiology.rewards.components import get_component, score_components

    scores: dict[str, list[float]] = {}
    for name in names:
        backend = get_component(name).backend
        try:
            values = score_components(hyps, refs, [name])[name]
        except Exception as exc:
            raise RuntimeError(f"component {name!r} ({backend}) failed: {type(exc).__name__}: {exc}") from exc
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"component {name!r} returned a non-finite score ({values[bad[0]]}) at sample {bad[0]}")
        scores[name] = values
    return scores, {name: get_component(name).backend for name in names}


def evaluate_file(
    data: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    task: str = "report",
    components: Sequence[str] | None = None,
    clean: bool = False,
    bootstrap: int = 1000,
    seed: int = 0,
    corpus: bool = True,
    corpus_bootstrap: int = 0,
    progress: Callable[[str], None] | None = None,
    iou_threshold: float = 0.5,
    box_labels: str = "auto",
    judge: Any = None,
    judge_on_failure: str = "raise",
) -> dict[str, Any]:
    """Score a predictions file and write ``per_sample.csv``, ``summary.json`` and ``summary.csv``.

    ``task``: one of :data:`TASKS` (default ``report``; the others: see
    :func:`evaluate_task_records`).
    ``components``: the per-sample components (default: those of
    :data:`DEFAULT_EVAL_COMPONENTS` that are registered); the report task only.
    ``clean``: apply EditGRPO's evaluation cleaning to responses and answers.
    ``bootstrap``: resamples for the confidence intervals (0: no intervals).
    ``corpus``: also compute the corpus-level metrics that are available;
    ``corpus_bootstrap``: resamples for their intervals (each resample recomputes
    the metric, so this costs ``corpus_bootstrap`` times the metric).
    ``iou_threshold`` and ``box_labels`` (``auto`` / ``ignore``): the grounding task's
    hit threshold and label matching; ``judge`` (a :class:`grouprl.rewards.judge.ChatJudge`)
    and ``judge_on_failure`` (``raise`` / ``skip``): the conversation task's. Returns the
    summary (what ``summary.json`` holds).
    """
    from grouprl.domains.radiology.server.app import load_report_components

    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 0:
        raise ValueError(f"bootstrap must be a non-negative number of resamples, got {bootstrap!r}")
    if isinstance(corpus_bootstrap, bool) or not isinstance(corpus_bootstrap, int) or corpus_bootstrap < 0:
        raise ValueError(f"corpus_bootstrap must be a non-negative number of resamples, got {corpus_bootstrap!r}")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    if task != "report":
        if components:
            raise ValueError(f"components name report score components; the {task} task has its own metrics")
        return evaluate_task_records(data, out_dir, task, clean=clean, bootstrap=bootstrap, seed=seed, corpus=corpus,
                                     corpus_bootstrap=corpus_bootstrap, progress=progress,
                                     iou_threshold=iou_threshold, box_labels=box_labels, judge=judge,
                                     judge_on_failure=judge_on_failure)
    say = progress or (lambda message: None)
    records = read_predictions(data)
    registry = load_report_components()
    names = list(components) if components else [n for n in DEFAULT_EVAL_COMPONENTS if n in registry]
    if not names:
        raise ValueError(f"none of the default report score components ({', '.join(DEFAULT_EVAL_COMPONENTS)}) "
                         f"is registered; name some with components= (registered: {', '.join(sorted(registry))})")
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(f"unknown report score component(s) {unknown}; known: {', '.join(sorted(registry))}")

    ids = [r["id"] for r in records]
    hyps = [r["response"] for r in records]
    refs = [r["answer"] for r in records]
    if clean:
        hyps, refs = clean_texts(hyps), clean_texts(refs)

    empty = sum(1 for h in hyps if not str(h).strip())
    if records and empty == len(records):
        # every metric of an empty report is 0 (or undefined): a table of zeros that looks like a result
        warnings.warn(f"every response in {data} is empty ({empty} of {len(records)}): the scores below are those "
                      "of empty reports; check the predictions file's 'response' field", EvaluationWarning,
                      stacklevel=2)
    say(f"scoring {len(records)} reports with {', '.join(names)}")
    scores, backends = score_samples(hyps, refs, names)
    metrics: list[Metric] = []
    for name in names:
        values = scores[name]
        low, high = bootstrap_ci(values, bootstrap, seed) if bootstrap else (None, None)
        metrics.append(Metric(name, float(np.mean(values)), low, high, backends[name], "sample_mean"))

    if corpus:
        for fn_name, fn in corpus_metric_functions().items():
            say(f"corpus metric {fn_name}")
            default_backend = _module_backend(fn)
            try:
                values = flatten_corpus_result(fn_name, fn(list(hyps), list(refs)), default_backend)
            except Exception as exc:
                raise RuntimeError(f"corpus metric {fn_name} failed: {type(exc).__name__}: {exc}") from exc
            intervals = _corpus_intervals(fn_name, fn, hyps, refs, corpus_bootstrap, seed, default_backend)
            for metric, (value, backend) in values.items():
                low, high = intervals.get(metric, (None, None))
                metrics.append(Metric(metric, value, low, high, backend, "corpus"))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    columns = ["id", *(f"{name}[{backends[name]}]" for name in names)]
    rows = [[rid, *(_number(scores[name][i]) for name in names)] for i, rid in enumerate(ids)]
    write_text_atomic(out / "per_sample.csv", _csv_text(columns, rows))
    summary = {
        "data": str(Path(data)),
        "task": "report",
        "n_samples": len(records),
        "cleaned": bool(clean),
        "components": names,
        "backends": backends,
        "bootstrap": {"resamples": bootstrap, "corpus_resamples": corpus_bootstrap if corpus else 0,
                      "seed": seed, "confidence": CONFIDENCE, "method": "percentile"},
        "metrics": [m.row() for m in metrics],
    }
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    summary_rows = [[m.metric, _number(m.value), _number(m.ci_low), _number(m.ci_high), m.backend] for m in metrics]
    write_text_atomic(out / "summary.csv", _csv_text(["metric", "value", "ci_low", "ci_high", "backend"], summary_rows))
    return summary


def evaluate_task_records(
    data: str | os.PathLike,
    out_dir: str | os.PathLike,
    task: str,
    *,
    clean: bool = False,
    bootstrap: int = 1000,
    seed: int = 0,
    corpus: bool = True,
    corpus_bootstrap: int = 0,
    progress: Callable[[str], None] | None = None,
    iou_threshold: float = 0.5,
    box_labels: str = "auto",
    judge: Any = None,
    judge_on_failure: str = "raise",
) -> dict[str, Any]:
    """Score a predictions file for one of RadVLM-GRPO's other tasks; the same three files as the report task.

    ``classification``: per-sample findings-list set F1 and exact match, corpus micro
    and macro scores. ``grounding``: per-sample matched IoU and precision / recall /
    F1 at ``iou_threshold``, corpus (pooled) precision / recall / F1. ``conversation``:
    the judge's score per sample; records the judge could not score (only with
    ``judge_on_failure="skip"``) are empty in ``per_sample.csv``, left out of the means
    and listed under ``unscored`` in the summary. Means get percentile-bootstrap
    intervals over the scored samples; corpus metrics get them with ``corpus_bootstrap``.
    """
    from grouprl.domains.radiology.rewards.radvlm_tasks import TASK_FIELDS, score_task

    say = progress or (lambda message: None)
    records = read_predictions(data, keep=TASK_FIELDS[task])
    if clean:
        for record, hyp, ref in zip(records, clean_texts([r["response"] for r in records]),
                                    clean_texts([r["answer"] for r in records])):
            record["response"], record["answer"] = hyp, ref
    say(f"scoring {len(records)} {task} predictions")
    scores = score_task(task, records, source=str(Path(data)), iou_threshold=iou_threshold, labels=box_labels,
                        judge=judge, on_failure=judge_on_failure)
    metrics: list[Metric] = []
    for name, values in scores.per_sample.items():
        scored = [v for v in values if v is not None]
        bad = [v for v in scored if not math.isfinite(v)]
        if bad:
            raise ValueError(f"{task} metric {name!r} has a non-finite value ({bad[0]})")
        if not scored:  # every record unscored: the mean is undefined, not 0
            metrics.append(Metric(name, None, None, None, scores.backends[name], "sample_mean"))
            continue
        low, high = bootstrap_ci(scored, bootstrap, seed) if bootstrap else (None, None)
        metrics.append(Metric(name, float(np.mean(scored)), low, high, scores.backends[name], "sample_mean"))
    if corpus and scores.corpus is not None:
        # The records' indices stand in for hypotheses, so the corpus-metric machinery
        # (flattening, resampled intervals) applies unchanged.
        def fn(indices, _refs):
            return scores.corpus(indices)

        indices = list(range(len(records)))
        values = flatten_corpus_result(task, fn(indices, indices), scores.corpus_backend)
        intervals = _corpus_intervals(task, fn, indices, indices, corpus_bootstrap, seed, scores.corpus_backend)
        for metric, (value, backend) in values.items():
            low, high = intervals.get(metric, (None, None))
            metrics.append(Metric(metric, value, low, high, backend, "corpus"))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(scores.per_sample)
    columns = ["id", *(f"{name}[{scores.backends[name]}]" for name in names)]
    rows = [[r["id"], *(_number(scores.per_sample[name][i]) for name in names)] for i, r in enumerate(records)]
    write_text_atomic(out / "per_sample.csv", _csv_text(columns, rows))
    options: dict[str, Any] = {}
    if task == "grounding":
        options = {"iou_threshold": iou_threshold, "box_labels": box_labels}
    elif task == "conversation":
        options = {"judge": scores.backends["judge_score"], "judge_on_failure": judge_on_failure}
    summary = {
        "data": str(Path(data)),
        "task": task,
        "n_samples": len(records),
        "n_unscored": len(scores.unscored),
        "unscored": scores.unscored,
        "cleaned": bool(clean),
        "components": names,
        "backends": scores.backends,
        "options": options,
        "bootstrap": {"resamples": bootstrap, "corpus_resamples": corpus_bootstrap if corpus else 0,
                      "seed": seed, "confidence": CONFIDENCE, "method": "percentile"},
        "metrics": [m.row() for m in metrics],
    }
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    summary_rows = [[m.metric, _number(m.value), _number(m.ci_low), _number(m.ci_high), m.backend] for m in metrics]
    write_text_atomic(out / "summary.csv", _csv_text(["metric", "value", "ci_low", "ci_high", "backend"], summary_rows))
    return summary


def _corpus_intervals(fn_name, fn, hyps, refs, n, seed, default_backend) -> dict[str, tuple[float, float]]:
    if not n:
        return {}
    draws: dict[str, list[float]] = {}
    for idx in resample_indices(len(hyps), n, seed):
        result = flatten_corpus_result(fn_name, fn([hyps[i] for i in idx], [refs[i] for i in idx]), default_backend)
        for metric, (value, _) in result.items():
            if value is not None:
                draws.setdefault(metric, []).append(value)
    alpha = 1.0 - CONFIDENCE
    out = {}
    for metric, values in draws.items():
        if len(values) == n and all(math.isfinite(v) for v in values):
            low, high = np.quantile(values, [alpha / 2, 1 - alpha / 2])
            out[metric] = (float(low), float(high))
    return out


def _number(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def _csv_text(header: list[str], rows: list[list[Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue()


# ----------------------------------------------------------------------------- generating


def generate_file(
    model: str | os.PathLike,
    data: str | os.PathLike,
    out: str | os.PathLike,
    *,
    batch_size: int = 8,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = 0,
    dtype: str = "float32",
    device: str = "auto",
    max_samples: int | None = None,
    max_prompt_length: int | None = None,
    load_kwargs: Mapping[str, Any] | None = None,
    show_progress: bool = True,
    task: str = "report",
) -> int:
    """Generate a report for every sample of ``data`` and write ``{id, response, answer}`` JSON lines to ``out``.

    Greedy decoding by default (``temperature`` 0). ``data`` is any dataset
    ``grouprl.data.load_samples`` reads; ``load_kwargs`` go to it (``format``,
    ``image_dir``, ``system_prompt``, ...). ``device``: ``auto`` (CUDA when
    available), ``cpu`` or ``cuda[:i]``. The output file appears only when every
    sample is done. Returns the number of records written.

    ``task`` (one of :data:`TASKS`) says what ``grouprl eval --task`` will score: the
    reference is the record's final answer in every task, and ``conversation`` records
    also get ``history``, the turns the answer was generated from (LLaVA
    ``{"from", "value"}`` turns, ``<image>`` where an image was).
    """
    import torch

    from grouprl.data import load_samples
    from grouprl.models.loading import load_model_and_processor
    from grouprl.rollout.engine import SamplingParams
    from grouprl.rollout.hf_engine import HFGenerationEngine

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    samples = load_samples(data, max_samples=max_samples, **dict(load_kwargs or {}))
    if len(samples) == 0:
        raise EvalDataError(f"{data}: no samples to generate for")
    ids = [s.id for s in samples]
    dupes = sorted({i for i in ids if ids.count(i) > 1}) if len(set(ids)) != len(ids) else []
    if dupes:
        raise EvalDataError(f"{data}: sample ids repeat ({dupes[:5]}); give each record a unique 'id'")
    params = SamplingParams(n=1, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
                            do_sample=temperature > 0)
    policy, processor, _ = load_model_and_processor(model, dtype=dtype)
    target = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    policy.to(target)
    engine = HFGenerationEngine(policy, processor, max_prompt_length=max_prompt_length)

    written = 0
    with AtomicFile(out, "w") as f, _progress(len(samples), show_progress) as advance:
        for start in range(0, len(samples), batch_size):
            batch = [samples[i] for i in range(start, min(start + batch_size, len(samples)))]
            call = dataclasses.replace(params, seed=None if seed is None else seed + start)
            rollout = engine.generate(batch, call)
            for sample, response in zip(batch, rollout.responses):
                record = {"id": sample.id, "response": response, "answer": sample.answer}
                if task == "conversation":
                    record["history"] = llava_turns(sample.messages)
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                written += 1
            advance(len(batch))
    return written


_LLAVA_SPEAKERS = {"user": "human", "assistant": "gpt", "system": "system"}


def llava_turns(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Chat messages (a Sample's prompt) as LLaVA turns ``{"from", "value"}``, images as ``<image>``."""
    turns = []
    for message in messages:
        content = message["content"]
        text = content if isinstance(content, str) else "".join(
            "<image>" if item["type"] == "image" else item.get("text", "") for item in content)
        turns.append({"from": _LLAVA_SPEAKERS.get(message["role"], message["role"]), "value": text})
    return turns


class _progress:
    """A rich progress bar on stderr (or nothing), as a context manager giving ``advance(k)``."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.bar = total, enabled, None

    def __enter__(self):
        if not self.enabled:
            return lambda k: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            console=Console(stderr=True))
        self.bar.start()
        task = self.bar.add_task("generate", total=self.total)
        return lambda k: self.bar.advance(task, k)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False
