"""The reward server: report score components over HTTP, for grouprl's client and the seeds' own clients.

``grouprl serve rewards`` runs it (FastAPI under uvicorn, 127.0.0.1 by default). Routes::

    POST /predict  {"hyps": [...], "refs": [...], "type": "short"|"cot"|"free_form",
                    "requested_reward_components": ["radgraphf1", "cxb14micro", "ratescore"]}
      200 {"result": "success",
           "data": {"predictions": {"radgraphf1": [...], ..., "final_scores": [...], "format_ok": [...],
                                    "format_scores": [...], <EditGRPO's own key names, see EDITGRPO_KEYS>},
                    "backends": {"radgraphf1": "...", ...}, "type": "...", "components": [...],
                    "weights": {...}, "truncated": {"max_chars": N, "hyps": [...], "refs": [...]}}}
      400/401/408/413 {"result": "error", "data": {"message": "..."}}   (the request's fault)
      500             {"result": "error", "data": {"message": "..."}}   (a component raised)
    POST /analyze  {"generations": [...], "ground_truth": [...]}   EditGRPO's extractor (ratescore dialect)
    POST /extract  {"generations": [...], "ground_truth": [...]}   EditGRPO's extractor (radgraph dialect)
    POST /score_radcliq | /score_bertscore | /score_radgraph  {"pred_text", "true_text"} -> {"score"}
                                                                   RadVLM-GRPO's reward workers
    GET  /health   {"status": "ok", "components": [...], "radvlm": {"fallbacks": ...}, ...}

/predict follows EditGRPO's reward server:

- ``final_scores[i]`` is the weighted sum of the requested components at sample ``i``.
  Every weight is 1 except ``cxb_bal_acc_editgrpo``'s, 1/14 (:data:`COMPOSITE_WEIGHTS`):
  EditGRPO adds its 14-class "balanced accuracy" sum divided by 14.
- A request naming no component gets EditGRPO's default composite
  (:data:`DEFAULT_COMPONENTS`): radgraphf1 + cxb14micro + ratescore +
  cxb_bal_acc_editgrpo / 14 + format. ``all`` names the same set.
- Format: under ``short`` a response must hold ``\\boxed{...}``, under ``cot`` a
  ``<think>...</think>`` block and then ``\\boxed{...}``; ``format_ok`` says whether it
  does and the ``format`` term (1 or 0) enters ``final_scores`` only under ``short``
  and ``cot``. A response failing its format loses only that term: its content is
  still scored, as on EditGRPO's server. The content is the report when the format
  holds, else the last complete ``\\boxed{...}`` anywhere in the response, else the
  empty report (EditGRPO scores the placeholder text "None" there).
- ``cxb_bal_acc_editgrpo`` is EditGRPO's ``cxb_bal_acc`` with its definition and scale
  (a class-frequency-weighted count of agreeing CheXpert labels, 0..7; see
  ``radiology/weighted_accuracy.py``, ``class_frequencies`` for its frequency file).
  grouprl's ``cxb_bal_acc`` is a true balanced accuracy in [0, 1] and enters a sum with
  weight 1 when requested by name.
- Reports of any length are scored: each generated report (after its format is read)
  and each reference is cut to its first ``max_chars`` characters (20,000 by default)
  and ``truncated`` lists the cut ones. Only a request body over ``max_body_bytes``
  is refused (413). EditGRPO's client turns any refusal into reward 0 for the whole
  request.
- EditGRPO's client reads its own key names (``f1_radgraph_scores``,
  ``micro_chexbert_14``, ...); the server also writes those for every registered
  component they map to (:data:`EDITGRPO_KEYS`), computing such a component even when
  it was not requested (it is then not part of ``final_scores``). A request with
  ``"editgrpo_keys": false`` (grouprl's own client sends it) skips that.

/analyze answers EditGRPO's ``ratescore`` extractor client; every entity in the lists
that client reads carries an ``embedding`` so that its similarity choice and
threshold tau work (``data.embedding_backend`` names the encoder; a request may send
``"embeddings": false``). /extract answers its ``radgraph`` client with RadGraph-shaped
annotations. See ``radiology/extractor_api.py``. The RadVLM routes keep RadVLM's
worker behaviour, fallback scores included (``radvlm_workers.py``).

One process serves HTTP (every port, JSON, auth, limits) and hands each request's
scoring, one component call per request batch, to a scorer off its event loop, so that
it keeps answering (``/health`` stays responsive during a long batch): worker threads
of its own (``scoring_threads``), or a pool of scoring processes
(``scoring_processes``, ``grouprl serve rewards --workers N``) whose idle members take
the next request from one shared queue, whichever connection or port it came on. Every
scored answer names the process that scored it (header ``X-Scoring-Pid``). A component
that raises gives a 500 naming it (a RadVLM route answers its fallback score instead,
logged and counted); a scoring process that dies gives a 503 to the requests it took
down and the pool is started afresh. A request body must arrive within
``body_timeout`` seconds (else 408 and the connection is closed), and a request's line and
headers within ``header_timeout`` seconds of the connection opening or of the request's first
byte (else 408 and closed, see ``header_timeout_protocol``); a client that disconnects mid-body
is logged in one line. A body nested too deeply to parse is a 400, like any malformed JSON.
"""

# No "from __future__ import annotations": FastAPI must see the route parameters' real types
# (Request is imported inside create_app, so string annotations could not be resolved).

import asyncio
import collections
import concurrent.futures
import gc
import hmac
import json
import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grouprl.domains.radiology.server import radvlm as radvlm_workers
from grouprl.rewards.contract import weighted_total

logger = logging.getLogger(__name__)

REPORT_TYPES = ("short", "cot", "free_form")
FORMAT = "format"  # pseudo-component: 1.0 when the response has its type's format
ALL = "all"  # pseudo-component: EditGRPO's "every reward" request
EDITGRPO_BAL_ACC = "cxb_bal_acc_editgrpo"
# EditGRPO's server sums these when a request names none, and for "all".
DEFAULT_COMPONENTS = ("radgraphf1", "cxb14micro", "ratescore", EDITGRPO_BAL_ACC, FORMAT)
ALL_COMPONENTS = DEFAULT_COMPONENTS
# Weight of a component in final_scores when not 1: EditGRPO divides its 14-class sum by 14.
COMPOSITE_WEIGHTS: dict[str, float] = {EDITGRPO_BAL_ACC: 1.0 / 14.0}

# EditGRPO's response keys -> the component whose per-sample values they carry.
# Its client (rad_scores.py) reads all of them; a key whose component is not
# registered is left out (and /health lists it under missing_editgrpo_keys).
EDITGRPO_KEYS: dict[str, str] = {
    "f1_radgraph_scores": "radgraphf1",
    "precision_radgraph_scores": "radgraph_precision",
    "recall_radgraph_scores": "radgraph_recall",
    "micro_chexbert_14": "cxb14micro",
    "macro_chexbert_14": "cxb14macro",
    "micro_chexbert_5": "cxb5micro",
    "macro_chexbert_5": "cxb5macro",
    "accuracy_chexbert": "cxb_accuracy",
    "balanced_accuracy_chexbert": EDITGRPO_BAL_ACC,
    "rate_scores": "ratescore",
}

DEFAULT_MAX_BATCH = 1024
DEFAULT_MAX_CHARS = 20_000
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_BODY_TIMEOUT = 60.0
DEFAULT_HEADER_TIMEOUT = 30.0

SCORING_PID_HEADER = "X-Scoring-Pid"  # which process scored an answer
POOL_START_TIMEOUT = 300.0  # seconds the scoring processes may take to import and build their components
# The cyclic collector's thresholds in the server's processes (CPython's defaults: 700, 10, 10).
# With the defaults, the full collections, which walk every object the process holds (the
# imported libraries, the sentence encoder, the text-keyed parse caches), stalled one GRPO-shaped
# request in ~30 by 70-80 ms: in-process p99 97-110 ms against a 25 ms median. With these (and
# the startup objects frozen), p99 27-38 ms, and collection time per request 2.5 -> 0.3 ms.
SERVING_GC_THRESHOLDS = (20_000, 20, 20)
# Seconds a stopping server lets requests in progress finish before cancelling them: a stuck
# component must not keep it from stopping.
SHUTDOWN_GRACE = 10.0

ExtractFn = Callable[[str, str], "str | None"]
AnalyzeFn = Callable[[list[str], list[str]], list[dict[str, Any]]]


class RequestError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status (4xx) to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class ComponentFailure(RuntimeError):
    """A score component raised or returned something unusable (HTTP 500)."""


class ScoringProcessDied(RuntimeError):
    """A scoring process died with this request queued or in hand (HTTP 503: send it again)."""


# ----------------------------------------------------------------------------- components


def load_report_components() -> Mapping[str, Any]:
    """The registry of report score components; importing the radiology package registers them all.

    Their optional libraries (sentence encoders, pycocoevalcap, httpx) load only when
    a component is computed, so a missing one fails that request with its install hint.
    """
    import grouprl.domains.radiology.rewards  # noqa: F401
    # EditGRPO's cxb_bal_acc lives in its own module, which the package does not import.
    import grouprl.domains.radiology.rewards.weighted_accuracy  # noqa: F401
    from grouprl.domains.radiology.rewards.components import COMPONENTS

    return COMPONENTS


def _default_extract(text: str, type: str) -> str | None:
    from grouprl.domains.radiology.rewards.answers import extract_report

    return extract_report(text, type)


def content_without_format(text: str) -> str:
    """What EditGRPO scores for a response failing its format: the last complete box's content, else ""."""
    from grouprl.rewards.rule_based import extract_boxed

    return extract_boxed(text) or ""


def expand_components(names: Sequence[str] | None, default: Sequence[str]) -> list[str]:
    """Requested names -> the components to score, ``all`` expanded, order kept."""
    if not names:
        return list(default)
    out: list[str] = []
    for name in names:
        for n in (ALL_COMPONENTS if name == ALL else (name,)):
            if n not in out:
                out.append(n)
    return out


def check_component_names(names: Sequence[str], known: Mapping[str, Any]) -> None:
    unknown = [n for n in names if n != FORMAT and n not in known]
    if unknown:
        raise RequestError(
            f"unknown reward component(s) {unknown}; known: {', '.join(sorted([*known, FORMAT, ALL]))}"
        )


# ----------------------------------------------------------------------------- requests


@dataclass
class PredictRequest:
    hyps: list[str]
    refs: list[str]
    type: str
    components: list[str]
    editgrpo_keys: bool = True


@dataclass
class Limits:
    max_batch: int = DEFAULT_MAX_BATCH
    max_chars: int = DEFAULT_MAX_CHARS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout: float = DEFAULT_BODY_TIMEOUT

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_chars", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"reward server {name} must be a positive integer, got {value!r}")
        timeout = self.body_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < math.inf):
            raise ValueError(f"reward server body_timeout must be a positive number of seconds, got {timeout!r}")


def decode_json_body(body: bytes) -> dict[str, Any]:
    """Raw request bytes -> a JSON object, or a RequestError saying what is wrong with them."""
    if not body.strip():
        raise RequestError("empty request body; expected a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"request body is not valid UTF-8 (byte {exc.start}: {exc.reason})") from exc
    try:
        payload = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise RequestError(f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from exc
    except RecursionError:
        # json's parser recurses once per array or object level; a body of nested brackets runs
        # out of stack (the interpreter unwinds cleanly), which is the client's error, not ours
        raise RequestError("malformed JSON: arrays or objects nested too deeply to parse") from None
    if not isinstance(payload, dict):
        raise RequestError(f"expected a JSON object, got a JSON {_json_type(payload)}")
    return payload


def _reject_constant(name: str):
    raise RequestError(f"malformed JSON: {name} is not valid JSON")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def string_list(payload: Mapping[str, Any], key: str, limits: Limits, *, allow_blank: bool) -> list[str]:
    if key not in payload:
        raise RequestError(f"missing {key!r} in request")
    values = payload[key]
    if not isinstance(values, list):
        raise RequestError(f"{key!r} must be a list of strings, got a JSON {_json_type(values)}")
    if not values:
        raise RequestError(f"{key!r} is empty; send at least one item")
    if len(values) > limits.max_batch:
        raise RequestError(f"{key!r} has {len(values)} items; this server takes at most {limits.max_batch} "
                           "per request (split the batch)")
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise RequestError(f"{key}[{i}] must be a string, got a JSON {_json_type(value)}")
        if not allow_blank and not value.strip():
            raise RequestError(f"{key}[{i}] is empty; every reference needs text")
    return values


def paired_lists(payload: Mapping[str, Any], hyp_key: str, ref_key: str, limits: Limits) -> tuple[list[str], list[str]]:
    # A generated report may be empty (it then scores what it deserves); a reference may not.
    hyps = string_list(payload, hyp_key, limits, allow_blank=True)
    refs = string_list(payload, ref_key, limits, allow_blank=False)
    if len(hyps) != len(refs):
        raise RequestError(f"{hyp_key!r} has {len(hyps)} items but {ref_key!r} has {len(refs)}; they must pair up")
    return hyps, refs


def optional_flag(payload: Mapping[str, Any], key: str, default: bool) -> bool:
    value = payload.get(key, default)
    if not isinstance(value, bool):
        raise RequestError(f"{key!r} must be true or false, got {value!r}")
    return value


def parse_predict(payload: Mapping[str, Any], *, known: Mapping[str, Any], default_components: Sequence[str],
                  default_type: str, limits: Limits) -> PredictRequest:
    hyps, refs = paired_lists(payload, "hyps", "refs", limits)
    type_ = payload.get("type", default_type)
    if type_ is None:
        type_ = default_type
    if not isinstance(type_, str) or type_ not in REPORT_TYPES:
        raise RequestError(f"'type' must be one of {', '.join(REPORT_TYPES)}; got {type_!r}")
    requested = payload.get("requested_reward_components")
    if requested is not None:
        if not isinstance(requested, list) or not all(isinstance(n, str) for n in requested):
            raise RequestError("'requested_reward_components' must be a list of component names (strings)")
        duplicates = sorted({n for n in requested if requested.count(n) > 1})
        if duplicates:
            raise RequestError(f"'requested_reward_components' names {duplicates} more than once")
    components = expand_components(requested, default_components)
    check_component_names(components, known)
    return PredictRequest(hyps, refs, type_, components, optional_flag(payload, "editgrpo_keys", True))


def cut_texts(texts: Sequence[str], max_chars: int) -> tuple[list[str], list[int]]:
    """Each text cut to its first ``max_chars`` characters, and the indices of those that were cut."""
    return [t[:max_chars] for t in texts], [i for i, t in enumerate(texts) if len(t) > max_chars]


# ----------------------------------------------------------------------------- scoring


def score_predict(request: PredictRequest, *, components: Mapping[str, Any], extract: ExtractFn,
                  max_chars: int = DEFAULT_MAX_CHARS,
                  weights: Mapping[str, float] = COMPOSITE_WEIGHTS) -> dict[str, Any]:
    """The ``data`` of a /predict success: per-sample predictions and each component's backend.

    Every sample's content is scored, whether its format holds or not (see the module doc).
    """
    n = len(request.hyps)
    reports: list[str] = []
    ok: list[bool] = []
    for i, hyp in enumerate(request.hyps):
        try:
            report = extract(hyp, request.type)
            ok.append(report is not None)
            reports.append(report if report is not None else content_without_format(hyp))
        except Exception as exc:
            raise ComponentFailure(f"extracting the report of hyps[{i}] ({request.type}) failed: "
                                   f"{type(exc).__name__}: {exc}") from exc
    hyps, cut_hyps = cut_texts(reports, max_chars)
    refs, cut_refs = cut_texts(request.refs, max_chars)
    if cut_hyps or cut_refs:
        logger.info("/predict: cut %d report(s) and %d reference(s) to %d characters", len(cut_hyps), len(cut_refs),
                    max_chars)

    scored = [c for c in request.components if c != FORMAT]
    extra: list[str] = []
    if request.editgrpo_keys:
        extra = [c for c in EDITGRPO_KEYS.values() if c in components and c not in scored]
    from grouprl.domains.radiology.rewards.batch_parses import batch_scope

    # One scope for all components: each distinct text is parsed once per request, not once per component.
    with batch_scope():
        values = {name: _call_component(components[name], hyps, refs) for name in [*scored, *extra]}

    format_scores = [1.0 if o else 0.0 for o in ok]
    predictions: dict[str, Any] = {}
    for name in request.components:
        predictions[name] = format_scores if name == FORMAT else values[name]
    used = {name: float(weights.get(name, 1.0)) for name in request.components}
    # The core's weighted sum (every value here is a number, so no row is unscored). EditGRPO
    # adds no format term to free-form reports; a composite left with no term is 0.
    summed = {name: predictions[name] for name in request.components
              if not (name == FORMAT and request.type == "free_form")}
    predictions["final_scores"] = weighted_total(summed, used) if summed else [0.0] * n
    predictions["format_ok"] = ok
    predictions["format_scores"] = format_scores
    if request.editgrpo_keys:
        for key, name in EDITGRPO_KEYS.items():
            if name in values:
                predictions[key] = values[name]
    backends = {name: components[name].backend for name in values}
    if FORMAT in request.components:
        backends[FORMAT] = f"rules(type={request.type})"
    data = {"predictions": predictions, "backends": backends, "type": request.type,
            "components": list(request.components), "weights": used,
            "truncated": {"max_chars": max_chars, "hyps": cut_hyps, "refs": cut_refs}}
    if n and request.type != "free_form" and not any(ok):
        # The seed's trap: a request without "type" is "short", and a plain report then has no
        # boxed report to score, so every content score is that of an empty report.
        warning = (f"none of the {n} hypotheses has the '{request.type}' format, so each was scored as an empty "
                   "report (EditGRPO's rule); for plain reports send \"type\": \"free_form\"")
        logger.warning("/predict: %s", warning)
        data["warnings"] = [warning]
    return data


def _call_component(component, hyps: list[str], refs: list[str]) -> list[float]:
    try:
        raw = component.fn(list(hyps), list(refs))
    except Exception as exc:
        raise ComponentFailure(f"component {component.name!r} ({component.backend}) raised "
                               f"{type(exc).__name__}: {exc}") from exc
    try:
        out = [float(v) for v in raw]
    except (TypeError, ValueError) as exc:
        raise ComponentFailure(f"component {component.name!r} returned non-numbers: {exc}") from exc
    if len(out) != len(hyps):
        raise ComponentFailure(f"component {component.name!r} returned {len(out)} scores for {len(hyps)} reports")
    bad = [i for i, v in enumerate(out) if not math.isfinite(v)]
    if bad:
        raise ComponentFailure(f"component {component.name!r} returned a non-finite score ({out[bad[0]]}) "
                               f"for {len(bad)} report(s)")
    return out


def _default_analyze(generations: list[str], ground_truth: list[str]) -> list[dict[str, Any]]:
    from grouprl.domains.radiology.rewards.extractor_api import analyze_pairs

    return analyze_pairs(generations, ground_truth)


def _attach_embeddings(results: list[dict[str, Any]], embedder) -> list[dict[str, Any]]:
    from grouprl.domains.radiology.rewards.extractor_api import attach_embeddings

    return attach_embeddings(results, embedder)


def _radgraph_annotations(texts: list[str]) -> dict[str, Any]:
    from grouprl.domains.radiology.rewards.extractor_api import radgraph_annotations

    return radgraph_annotations(texts)


def _entity_embedder(kind: str, model: str | None):
    from grouprl.domains.radiology.rewards.entity_embeddings import entity_embedder

    return entity_embedder(kind, model)


def _frequency_component(path: str):
    from grouprl.domains.radiology.rewards.weighted_accuracy import weighted_accuracy_component

    return weighted_accuracy_component(path)


def extractor_lists(payload: Mapping[str, Any], limits: Limits) -> tuple[list[str], list[str], dict[str, Any]]:
    """``generations`` and ``ground_truth`` of an extractor request, cut to ``max_chars``, and what was cut."""
    if isinstance(payload.get("ground_truth"), str):  # EditGRPO's extractors accept one bare reference
        payload = {**payload, "ground_truth": [payload["ground_truth"]]}
    gens, refs = paired_lists(payload, "generations", "ground_truth", limits)
    gens, cut_gens = cut_texts(gens, limits.max_chars)
    refs, cut_refs = cut_texts(refs, limits.max_chars)
    return gens, refs, {"max_chars": limits.max_chars, "generations": cut_gens, "ground_truth": cut_refs}


# ----------------------------------------------------------------------------- scoring work


@dataclass
class Scoring:
    """What scoring needs, built once per process from the server's settings (:func:`scoring_context`)."""

    components: Mapping[str, Any]
    default: list[str]
    extract: ExtractFn
    analyzer: AnalyzeFn
    embedder: Any


def scoring_context(*, default_components: Sequence[str] = DEFAULT_COMPONENTS, class_frequencies: str | None = None,
                    entity_embeddings: str = "auto", entity_encoder: str | None = None,
                    extract_report: ExtractFn | None = None, analyze: AnalyzeFn | None = None) -> Scoring:
    """The components (the class-frequency variant bound), extractor, analyzer and embedder of a server.

    ValueError (or the loader's FileNotFoundError / ImportError) on settings that cannot
    serve. The scoring processes of a pool each call it with the same plain settings.
    """
    registry = load_report_components()
    # A frequency file binds a per-server variant of EditGRPO's cxb_bal_acc; the registry keeps the file-less one.
    overrides = {EDITGRPO_BAL_ACC: _frequency_component(class_frequencies)} if class_frequencies else {}
    components: Mapping[str, Any] = collections.ChainMap(overrides, registry)
    default = expand_components(list(default_components), DEFAULT_COMPONENTS)
    try:
        check_component_names(default, components)
    except RequestError as exc:
        raise ValueError(f"default components: {exc}") from None
    missing = sorted({e.component for e in radvlm_workers.ENDPOINTS.values()} - set(components))
    if missing:
        raise ValueError(f"RadVLM routes need the report score components {missing}, which are not registered")
    return Scoring(components=components, default=default, extract=extract_report or _default_extract,
                   analyzer=analyze or _default_analyze, embedder=_entity_embedder(entity_embeddings, entity_encoder))


# Each route's scoring, a module-level function of (Scoring, plain arguments): what a pool
# process can be sent by name, and what a scoring thread runs the same way.


def predict_work(scoring: Scoring, request: PredictRequest, max_chars: int) -> dict[str, Any]:
    """The ``data`` of a /predict success (:func:`score_predict` with this server's components)."""
    return score_predict(request, components=scoring.components, extract=scoring.extract, max_chars=max_chars)


def analyze_work(scoring: Scoring, gens: list[str], refs: list[str], with_embeddings: bool,
                 truncated: dict[str, Any]) -> dict[str, Any]:
    """The ``data`` of an /analyze success: the entity analysis of each pair, embeddings attached."""
    try:
        results = scoring.analyzer(gens, refs)
    except ComponentFailure:
        raise
    except Exception as exc:
        raise ComponentFailure(f"entity analysis raised {type(exc).__name__}: {exc}") from exc
    if len(results) != len(gens):
        raise ComponentFailure(f"entity analysis returned {len(results)} results for {len(gens)} pairs")
    embedder = scoring.embedder
    if with_embeddings:
        try:
            results = _attach_embeddings(results, embedder)
        except Exception as exc:
            raise ComponentFailure(f"entity embeddings ({embedder.backend}) raised "
                                   f"{type(exc).__name__}: {exc}") from exc
    return {"predictions": {"analysis_results": results},
            "embedding_backend": embedder.backend if with_embeddings else None,
            "truncated": truncated}


def extract_work(scoring: Scoring, gens: list[str], refs: list[str], truncated: dict[str, Any]) -> dict[str, Any]:
    """The ``data`` of an /extract success: RadGraph-shaped annotations of both lists."""
    try:
        predictions = {"gen_annotations": _radgraph_annotations(gens), "gt_annotations": _radgraph_annotations(refs)}
    except Exception as exc:
        raise ComponentFailure(f"RadGraph-style extraction raised {type(exc).__name__}: {exc}") from exc
    return {"predictions": predictions, "backend": "radgraph=rules", "truncated": truncated}


def radvlm_work(scoring: Scoring, endpoint: radvlm_workers.Endpoint, pred: str, true: str) -> dict[str, Any]:
    """A RadVLM route's answer to one pair; its ``fallback`` is counted by the serving process, not here."""
    return radvlm_workers.score_pair(endpoint, scoring.components[endpoint.component], pred, true)


# ----------------------------------------------------------------------------- the scoring pool

# The Scoring of this pool process and the barrier its pool's warm-up meets at (set by _pool_init).
_POOL_SCORING: Scoring | None = None
_POOL_STARTED: Any = None


def _pool_init(settings: dict[str, Any], started) -> None:
    """Initializer of a scoring process: its Scoring from the server's plain settings."""
    global _POOL_SCORING, _POOL_STARTED
    # Ctrl-C reaches the whole process group; the serving process stops the pool itself, and a
    # scoring process interrupted mid-task would only print a traceback and break the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _POOL_SCORING = scoring_context(**settings)
    _POOL_STARTED = started
    tune_gc_for_serving()


def _pool_warm() -> int:
    """One per process at pool start: waits until every process has started, scores a pair; its pid."""
    # Tasks submitted before any finishes each spawn a process; meeting at the barrier keeps any
    # process from taking a second warm-up task, so each of them builds its Scoring now, not on a request.
    _POOL_STARTED.wait(POOL_START_TIMEOUT)
    scoring = _POOL_SCORING
    request = PredictRequest(["No pleural effusion."], ["No pleural effusion."], "free_form", scoring.default, False)
    try:  # first-call imports; a component that cannot score fails its requests, not the server's start
        predict_work(scoring, request, DEFAULT_MAX_CHARS)
    except Exception as exc:
        logger.debug("scoring process %d: warm-up scoring failed: %s", os.getpid(), exc)
    return os.getpid()


def tune_gc_for_serving() -> None:
    """Set the collector up for a process that only serves: what startup built (modules, models,
    the components' tables) is moved out of its walks (``gc.freeze``), and it collects less often
    (:data:`SERVING_GC_THRESHOLDS`). Called once a process has built its components."""
    gc.collect()  # freeze only what survives: garbage frozen now would never be freed
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)


def _pool_call(work: Callable[..., Any], *args: Any) -> tuple[int, Any]:
    """Runs in a scoring process: ``work(its Scoring, *args)`` and the pid that ran it."""
    return os.getpid(), work(_POOL_SCORING, *args)


class ScoringPool:
    """``processes`` spawned scoring processes taking requests from one queue: any idle one takes the next.

    Each builds its own :class:`Scoring` from ``settings`` (plain data; only those and
    module-level functions cross the process boundary). A process that dies breaks the
    executor for good: the requests it took down get :class:`ScoringProcessDied`, and
    the next request finds a new pool (``restarts`` counts them).
    """

    def __init__(self, settings: Mapping[str, Any], processes: int):
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise ValueError(f"scoring processes must be a positive integer, got {processes!r}")
        self.settings = dict(settings)
        self.processes = processes
        self.restarts = 0
        self.pids: list[int] = []
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None

    def _new_executor(self) -> tuple[concurrent.futures.ProcessPoolExecutor, list[concurrent.futures.Future]]:
        # spawn, not fork: the serving process has threads (and an event loop) a fork would copy mid-state
        context = multiprocessing.get_context("spawn")
        started = context.Barrier(self.processes)
        executor = concurrent.futures.ProcessPoolExecutor(self.processes, mp_context=context, initializer=_pool_init,
                                                          initargs=(self.settings, started))
        self._executor = executor
        self.pids = []

        def record_pid(future: concurrent.futures.Future) -> None:  # in the executor's thread
            if self._executor is executor and not future.cancelled() and future.exception() is None:
                self.pids = sorted({*self.pids, future.result()})

        warm = [executor.submit(_pool_warm) for _ in range(self.processes)]
        for future in warm:
            future.add_done_callback(record_pid)
        return executor, warm

    def start(self) -> None:
        """Spawn every process and wait until each has built its components (blocking)."""
        _, warm = self._new_executor()
        try:
            for future in warm:
                future.result()
        except Exception as exc:
            self.shutdown()
            raise RuntimeError(f"the scoring processes did not start: {type(exc).__name__}: {exc}") from exc

    def _replace(self, broken: concurrent.futures.ProcessPoolExecutor) -> concurrent.futures.ProcessPoolExecutor:
        """The pool to use instead of ``broken``: a new one, unless another request already started it."""
        if self._executor is broken:  # requests that fail together replace the pool once
            logger.error("a scoring process died; starting %d new scoring process(es)", self.processes)
            broken.shutdown(wait=False, cancel_futures=True)
            self.restarts += 1
            self._new_executor()  # its processes start now; requests queue behind their warm-up
        return self._executor

    async def run(self, work: Callable[..., Any], *args: Any) -> tuple[int, Any]:
        """``work(Scoring, *args)`` in an idle scoring process: (its pid, the result)."""
        executor = self._executor
        if executor is None:
            raise RuntimeError("the scoring pool was not started")
        try:
            future = executor.submit(_pool_call, work, *args)
        except concurrent.futures.process.BrokenProcessPool:
            # found broken before this request reached it: nothing of it ran, so the new pool takes it
            executor = self._replace(executor)
            future = executor.submit(_pool_call, work, *args)
        try:
            return await asyncio.wrap_future(future)
        except concurrent.futures.process.BrokenProcessPool as exc:
            self._replace(executor)
            raise ScoringProcessDied(f"a scoring process died while this request was queued or being scored "
                                     f"({exc}); {self.processes} new scoring process(es) were started: "
                                     "send it again") from None

    def shutdown(self) -> None:
        """Stop the processes: queued work is cancelled, a process still scoring after a grace period is ended."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        # ProcessPoolExecutor has no public handle on its processes; a stuck component must not hang the exit.
        processes = list((getattr(executor, "_processes", None) or {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + 2.0  # idle processes leave at once; a busy one gets this long
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        executor.shutdown(wait=True)

    def describe(self) -> dict[str, Any]:
        """For /health: how many processes, the current ones' pids, how many times the pool was replaced."""
        return {"processes": self.processes, "pids": list(self.pids), "restarts": self.restarts}


# ----------------------------------------------------------------------------- the app


def create_app(
    *,
    default_components: Sequence[str] = DEFAULT_COMPONENTS,
    token: str | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_chars: int = DEFAULT_MAX_CHARS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    default_type: str = "short",
    scoring_threads: int = 1,
    scoring_processes: int | None = None,
    class_frequencies: str | None = None,
    entity_embeddings: str = "auto",
    entity_encoder: str | None = None,
    extract_report: ExtractFn | None = None,
    analyze: AnalyzeFn | None = None,
):
    """The FastAPI app of the reward server.

    ``default_components`` are scored when a request names none (EditGRPO's
    composite). ``token``: when set, every POST route needs ``Authorization: Bearer
    <token>`` (401 otherwise); /health stays open. ``max_chars``: reports are scored up
    to this many characters (the rest is cut, and the answer says so);
    ``max_body_bytes``: larger request bodies get 413; ``body_timeout``: seconds a
    request body may take to arrive (408 after). ``default_type`` is the report type of
    a request without ``type`` ("short", as EditGRPO's server). ``scoring_threads``
    worker threads of this process run the scoring (1: requests are scored one at a
    time, off the event loop; model backends need not be thread-safe).
    ``scoring_processes``: a :class:`ScoringPool` of that many processes scores instead
    (each one request at a time; started with the app's lifespan, so only under a server
    or ``with TestClient(app)``); it builds its components from these settings, so it
    takes no ``extract_report`` / ``analyze``. ``class_frequencies``: EditGRPO's
    class-frequency JSON for ``cxb_bal_acc_editgrpo``. ``entity_embeddings`` (``auto``,
    ``encoder``, ``ngram``) and ``entity_encoder`` (a local encoder directory) choose the
    /analyze embeddings. ``extract_report`` / ``analyze`` replace the format check
    (``answers.extract_report``) and the entity analysis
    (``extractor_api.analyze_pairs``).
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect

    limits = Limits(max_batch, max_chars, max_body_bytes, body_timeout)
    if default_type not in REPORT_TYPES:
        raise ValueError(f"default_type must be one of {REPORT_TYPES}, got {default_type!r}")
    if isinstance(scoring_threads, bool) or not isinstance(scoring_threads, int) or scoring_threads < 1:
        raise ValueError(f"scoring_threads must be a positive integer, got {scoring_threads!r}")
    if token is not None and not token:
        raise ValueError("token must be a non-empty string or None")
    settings = dict(default_components=list(default_components), class_frequencies=class_frequencies,
                    entity_embeddings=entity_embeddings, entity_encoder=entity_encoder)
    pool = None
    if scoring_processes is not None:
        if extract_report is not None or analyze is not None:
            raise ValueError("scoring processes build their components from the settings: "
                             "extract_report / analyze need scoring in this process (no scoring_processes)")
        if scoring_threads != 1:
            raise ValueError("scoring_threads (--scoring-threads) applies to scoring in the server process "
                             "(--workers 1); each of the scoring_processes (--workers N) scores one request at a time")
        pool = ScoringPool(settings, scoring_processes)
    # Built here in every case: bad settings fail now, once, before any scoring process starts.
    scoring = scoring_context(**settings, extract_report=extract_report, analyze=analyze)
    components, default, embedder = scoring.components, scoring.default, scoring.embedder
    fallbacks = radvlm_workers.FallbackCounter(radvlm_workers.ENDPOINTS)
    executor = None
    if pool is None:
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=scoring_threads,
                                                         thread_name_prefix="grouprl-score")

    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if pool is not None:
            await asyncio.to_thread(pool.start)
        try:
            yield
        finally:
            if pool is not None:
                await asyncio.to_thread(pool.shutdown)
            else:
                executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="grouprl reward server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.limits = limits
    app.state.executor = executor
    app.state.pool = pool
    app.state.radvlm_fallbacks = fallbacks

    def error(message: str, status: int) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        if status == 408:  # the rest of the body may still be on its way: this connection cannot be reused
            headers = {"Connection": "close"}
        return JSONResponse({"result": "error", "data": {"message": message}}, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):  # 404, 405: the same envelope as every other error
        return error(f"{exc.detail} ({request.method} {request.url.path})", exc.status_code)

    def authorize(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise RequestError("missing or wrong bearer token (send 'Authorization: Bearer <token>')", 401)

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
            raise RequestError(f"request body of {int(length)} bytes is over the limit of "
                               f"{limits.max_body_bytes} bytes (split the batch)", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise RequestError(f"request body is over the limit of {limits.max_body_bytes} bytes "
                                   "(split the batch)", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_json(request: Request) -> dict[str, Any]:
        # uvicorn bounds the wait for headers and between requests, not for a body: a client
        # trickling one would hold its connection (and this coroutine) forever.
        try:
            async with asyncio.timeout(limits.body_timeout):
                body = await read_body(request)
        except TimeoutError:
            raise RequestError(f"request body not received within {limits.body_timeout:g} s", 408) from None
        return decode_json_body(body)

    async def run(work, *args) -> tuple[int, Any]:
        """``work(scoring, *args)`` off the event loop: (the pid that scored, its result)."""
        if pool is not None:
            return await pool.run(work, *args)
        result = await asyncio.get_running_loop().run_in_executor(executor, work, scoring, *args)
        return os.getpid(), result

    async def answered(request: Request, handle, envelope: bool = True) -> JSONResponse:
        try:
            authorize(request)
            payload = await read_json(request)
            pid, data = await handle(payload)
            return JSONResponse({"result": "success", "data": data} if envelope else data,
                                headers={SCORING_PID_HEADER: str(pid)})
        except RequestError as exc:
            if exc.status == 408:
                logger.info("%s %s from %s: %s", request.method, request.url.path, _peer(request), exc)
            return error(str(exc), exc.status)
        except ClientDisconnect:  # nobody is left to answer; one line, not a traceback
            logger.info("%s %s: client %s disconnected before sending the whole request body", request.method,
                        request.url.path, _peer(request))
            return error("client disconnected", 400)
        except ComponentFailure as exc:
            logger.error("%s %s failed: %s", request.method, request.url.path, exc)
            return error(str(exc), 500)
        except ScoringProcessDied as exc:
            logger.error("%s %s: %s", request.method, request.url.path, exc)
            return error(str(exc), 503)
        except Exception as exc:  # never let one request take the server down or hide why it failed
            logger.exception("%s %s failed", request.method, request.url.path)
            return error(f"internal error: {type(exc).__name__}: {exc}", 500)

    @app.post("/predict")
    async def predict(request: Request):
        async def handle(payload):
            parsed = parse_predict(payload, known=components, default_components=default,
                                   default_type=default_type, limits=limits)
            return await run(predict_work, parsed, limits.max_chars)

        return await answered(request, handle)

    @app.post("/analyze")
    async def analyze_route(request: Request):
        async def handle(payload):
            gens, refs, truncated = extractor_lists(payload, limits)
            return await run(analyze_work, gens, refs, optional_flag(payload, "embeddings", True), truncated)

        return await answered(request, handle)

    @app.post("/extract")
    async def extract_route(request: Request):
        async def handle(payload):
            gens, refs, truncated = extractor_lists(payload, limits)
            return await run(extract_work, gens, refs, truncated)

        return await answered(request, handle)

    def radvlm_route(endpoint: radvlm_workers.Endpoint):
        async def score(request: Request):
            async def handle(payload):
                try:
                    pred, true = radvlm_workers.parse_score_request(payload)
                except ValueError as exc:
                    raise RequestError(str(exc)) from None
                pid, answer = await run(radvlm_work, endpoint, pred, true)
                # counted here, where every scoring process's answers arrive: /health shows the server's totals
                if answer.get("fallback"):
                    fallbacks.add(endpoint.path, answer["fallback"])
                return pid, answer

            return await answered(request, handle, envelope=False)

        return score

    for endpoint in radvlm_workers.ENDPOINTS.values():
        app.add_api_route(endpoint.path, radvlm_route(endpoint), methods=["POST"])

    @app.get("/health")
    async def health():
        known = sorted(components)
        return {
            "status": "ok",
            "pid": os.getpid(),  # the serving process (HTTP, every port)
            # who scores: this process's threads, or the pool's processes (pids of the current pool)
            "scoring": pool.describe() if pool is not None else {"threads": scoring_threads, "pids": [os.getpid()]},
            "components": known,
            "backends": {name: components[name].backend for name in known},
            "default_components": default,
            "composite_weights": {name: COMPOSITE_WEIGHTS.get(name, 1.0) for name in default if name != FORMAT},
            "types": list(REPORT_TYPES),
            "limits": {"max_batch": limits.max_batch, "max_chars": limits.max_chars,
                       "max_body_bytes": limits.max_body_bytes, "body_timeout": limits.body_timeout},
            "missing_editgrpo_keys": sorted(k for k, c in EDITGRPO_KEYS.items() if c not in components),
            "entity_embedding_backend": embedder.backend,
            "radvlm": {"routes": {e.path: {"component": e.component, "fallback": e.fallback,
                                           "backend": components[e.component].backend}
                                  for e in radvlm_workers.ENDPOINTS.values()},
                       "fallbacks": fallbacks.snapshot()},  # every scoring process's, counted here
        }

    return app


def _peer(request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else "(unknown)"


# ----------------------------------------------------------------------------- serving


def header_timeout_protocol(timeout: float = DEFAULT_HEADER_TIMEOUT) -> type:
    """uvicorn's HTTP protocol class (``uvicorn.Config(http=...)``) with a deadline on a request's
    line and headers: ``timeout`` seconds, else a 408 and the connection is closed.

    uvicorn bounds only an idle keep-alive connection (``timeout_keep_alive``, armed when a
    response is complete and disarmed by the next byte): a connection that sends nothing, or
    trickles a request line or headers a byte at a time, has no deadline and holds its socket
    (and memory) for as long as the client likes. The deadline starts when the connection opens,
    and again at the first byte of each later request, and ends when the headers are parsed (the
    protocol then starts a new request cycle); more bytes do not extend it. The body has its own
    deadline in the app (``Limits.body_timeout``), where the route can answer in JSON.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < math.inf):
        raise ValueError(f"reward server header_timeout must be a positive number of seconds, got {timeout!r}")
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    # h11, or httptools where installed: both keep ``cycle`` (the current request, set once its
    # headers are parsed), ``transport``, ``client`` and ``loop``
    base = import_from_string(HTTP_PROTOCOLS["auto"])
    message = f"request line and headers not received within {timeout:g} s"
    body = json.dumps({"result": "error", "data": {"message": message}}).encode()
    answer = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))

    class HeaderTimeoutProtocol(base):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # these bytes start a request, or continue its headers
                self._arm_header_deadline()
            super().data_received(data)
            if self.cycle is not cycle:  # its headers are parsed
                self._disarm_header_deadline()

        def connection_lost(self, exc) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            if self._header_deadline is None:
                self._header_deadline = self.loop.call_later(timeout, self._headers_too_slow)

        def _disarm_header_deadline(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_too_slow(self) -> None:
            self._header_deadline = None
            if self.transport.is_closing() or self.transport.get_protocol() is not self:  # closed, or upgraded
                return
            peer = "%s:%d" % self.client if self.client else "(unknown)"
            logger.info("client %s: %s; connection closed", peer, message)
            # written raw: no request was parsed, so there is no request cycle to answer through
            self.transport.write(answer)
            self.transport.close()

    return HeaderTimeoutProtocol


def bind_sockets(host: str, port: int, count: int = 1) -> list[socket.socket]:
    """Listening-ready sockets on ``port, port + 1, ..., port + count - 1`` (closed again if one fails).

    Bound here rather than by uvicorn so that one server can serve several ports:
    RadVLM's clients spread requests over consecutive ports, one per worker.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"ports must be a positive integer, got {count!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not (0 <= port and port + count - 1 <= 65535):
        raise ValueError(f"ports {port}..{port + count - 1} are not all valid port numbers")
    if port == 0 and count > 1:
        raise ValueError("--ports needs a fixed --port (the first of the consecutive ports)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for p in range(port, port + count):
            # IPPROTO_TCP explicitly: asyncio then sets TCP_NODELAY on accepted connections, without
            # which a keep-alive client's next request waits out the 40 ms delayed-ACK timer.
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, p))
            except OSError as exc:
                raise OSError(f"cannot listen on {host}:{p}: {exc.strerror or exc}") from exc
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def serve(
    host: str = "127.0.0.1",
    port: int = 5000,
    workers: int = 1,
    token: str | None = None,
    *,
    ports: int = 1,
    default_components: Sequence[str] = DEFAULT_COMPONENTS,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_chars: int = DEFAULT_MAX_CHARS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    default_type: str = "short",
    scoring_threads: int = 1,
    class_frequencies: str | None = None,
    entity_embeddings: str = "auto",
    entity_encoder: str | None = None,
    log_level: str = "info",
) -> None:
    """Run the reward server under uvicorn until interrupted.

    One process (one event loop: HTTP, JSON, auth, limits) listens on ``ports``
    consecutive ports from ``port`` (RadVLM's layout: one port per worker,
    ``WORKER_BASE_PORT + i``). ``workers`` is how many requests are scored at once:
    with 1, this process scores in ``scoring_threads`` threads; with more, a pool of
    ``workers`` spawned scoring processes (each building the components from these
    settings at startup) takes requests from one queue, whichever connection and port
    they came on, so no process idles while another has requests waiting (clients keep
    their connections open, which with one process per connection left work unevenly
    spread). So ``--ports`` matches the clients' port list and ``--workers`` the
    machine's cores. Bad settings fail here, once, before any process starts; the
    pool's processes are started and warmed before the ports accept connections (if they
    cannot start, uvicorn logs why and exits with status 3). ``body_timeout`` and
    ``header_timeout`` bound how long a request may take to arrive (``header_timeout_protocol``).
    """
    from grouprl.errors import require

    require("fastapi", extra="server", needed_by="the reward server (grouprl serve rewards)")
    uvicorn = require("uvicorn", extra="server", needed_by="the reward server (grouprl serve rewards)")

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    settings = dict(default_components=list(default_components), token=token, max_batch=max_batch,
                    max_chars=max_chars, max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                    default_type=default_type, scoring_threads=scoring_threads, class_frequencies=class_frequencies,
                    entity_embeddings=entity_embeddings, entity_encoder=entity_encoder)
    if workers > 1:
        settings["scoring_processes"] = workers
    if host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("reward server listening on %s: reachable from other machines%s", host,
                       "" if token else " without a token (pass --token)")
    http = header_timeout_protocol(header_timeout)  # a bad value fails here, before any process starts
    app = create_app(**settings)
    tune_gc_for_serving()  # this process scores too with --workers 1
    sockets = bind_sockets(host, port, ports)
    listening = ", ".join(f"{host}:{s.getsockname()[1]}" for s in sockets)
    scorers = f"{workers} scoring processes" if workers > 1 else f"{scoring_threads} scoring thread(s)"
    # uvicorn announces only the first port; say where every one is
    print(f"grouprl reward server: listening on {listening}, {scorers}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, http=http,
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE))
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:
        pass
    finally:
        for sock in sockets:
            sock.close()
