"""The reward server: report score components over HTTP, compatible with EditGRPO's reward server.

``grouprl serve rewards`` runs it (FastAPI under uvicorn, 127.0.0.1 by default)::

    POST /predict  {"hyps": [...], "refs": [...], "type": "short"|"cot"|"free_form",
                    "requested_reward_components": ["radgraphf1", "cxb14micro", "ratescore"]}
      200 {"result": "success",
           "data": {"predictions": {"radgraphf1": [...], "cxb14micro": [...], "ratescore": [...],
                                    "final_scores": [...], "format_ok": [...], "format_scores": [...],
                                    <EditGRPO's own key names, see EDITGRPO_KEYS>},
                    "backends": {"radgraphf1": "...", ...}, "type": "...", "components": [...]}}
      400/401/413 {"result": "error", "data": {"message": "..."}}   (the request's fault)
      500         {"result": "error", "data": {"message": "..."}}   (a component raised)
    POST /analyze  {"generations": [...], "ground_truth": [...]}   (EditGRPO's extractor request)
    GET  /health   {"status": "ok", "components": [...], ...}

``final_scores[i]`` is the sum of the requested components at sample ``i``
(EditGRPO's composite radgraphf1 + cxb14micro + ratescore by default). Under
``short`` and ``cot`` a response must hold ``\\boxed{...}`` (``cot``: after
``<think>...</think>``) and only the boxed report is scored; a response failing
its type's format scores 0 in every component and in ``final_scores`` and is
flagged ``format_ok: false``. Two pseudo-components keep EditGRPO's request
vocabulary: ``format`` (1 when the format holds; added to ``final_scores`` only
when the type is not ``free_form``, as EditGRPO does) and ``all`` (radgraphf1,
cxb14micro, ratescore, cxb_bal_acc, format). Unlike EditGRPO, ``cxb_bal_acc``
enters the sum as it is (it is already in [0, 1]; EditGRPO divides its 14-class
sum by 14).

EditGRPO's client reads its own key names (``f1_radgraph_scores``,
``micro_chexbert_14``, ...); the server also writes those for every registered
component they map to (:data:`EDITGRPO_KEYS`), computing such a component even
when it was not requested (it is then not part of ``final_scores``). A request
with ``"editgrpo_keys": false`` (grouprl's own client sends it) skips that.

Scoring runs in a worker thread, one component call per request batch, so that
the event loop keeps answering (``/health`` stays responsive during a long batch).
A component that raises gives a 500 naming it; the server keeps serving.
"""

# No "from __future__ import annotations": FastAPI must see the route parameters' real types
# (Request is imported inside create_app, so string annotations could not be resolved).

import asyncio
import concurrent.futures
import hmac
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

REPORT_TYPES = ("short", "cot", "free_form")
DEFAULT_COMPONENTS = ("radgraphf1", "cxb14micro", "ratescore")
FORMAT = "format"  # pseudo-component: 1.0 when the response has its type's format
ALL = "all"  # pseudo-component: EditGRPO's "every reward" request
ALL_COMPONENTS = ("radgraphf1", "cxb14micro", "ratescore", "cxb_bal_acc", FORMAT)

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
    "balanced_accuracy_chexbert": "cxb_bal_acc",
    "rate_scores": "ratescore",
}

DEFAULT_MAX_BATCH = 1024
DEFAULT_MAX_CHARS = 20_000
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024

ENV_CONFIG = "GROUPRL_REWARD_SERVER_CONFIG"  # settings handed to uvicorn worker processes

ExtractFn = Callable[[str, str], "str | None"]
AnalyzeFn = Callable[[list[str], list[str]], list[dict[str, Any]]]


class RequestError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status (4xx) to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class ComponentFailure(RuntimeError):
    """A score component raised or returned something unusable (HTTP 500)."""


# ----------------------------------------------------------------------------- components


def load_report_components() -> dict[str, Any]:
    """The registry of report score components; importing the radiology package registers them all.

    Their optional libraries (sentence encoders, pycocoevalcap, httpx) load only when
    a component is computed, so a missing one fails that request with its install hint.
    """
    import grouprl.rewards.radiology  # noqa: F401
    from grouprl.rewards.radiology.components import COMPONENTS

    return COMPONENTS


def _default_extract(text: str, type: str) -> str | None:
    from grouprl.rewards.radiology.answers import extract_report

    return extract_report(text, type)


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

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_chars", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"reward server {name} must be a positive integer, got {value!r}")


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
        if len(value) > limits.max_chars:
            raise RequestError(f"{key}[{i}] has {len(value)} characters; the limit is {limits.max_chars}")
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
    editgrpo_keys = payload.get("editgrpo_keys", True)
    if not isinstance(editgrpo_keys, bool):
        raise RequestError(f"'editgrpo_keys' must be true or false, got {editgrpo_keys!r}")
    return PredictRequest(hyps, refs, type_, components, editgrpo_keys)


# ----------------------------------------------------------------------------- scoring


def score_predict(request: PredictRequest, *, components: Mapping[str, Any], extract: ExtractFn) -> dict[str, Any]:
    """The ``data`` of a /predict success: per-sample predictions and each component's backend."""
    n = len(request.hyps)
    reports: list[str | None] = []
    for i, hyp in enumerate(request.hyps):
        try:
            reports.append(extract(hyp, request.type))
        except Exception as exc:
            raise ComponentFailure(f"extracting the report of hyps[{i}] ({request.type}) failed: "
                                   f"{type(exc).__name__}: {exc}") from exc
    ok = [r is not None for r in reports]
    keep = [i for i in range(n) if ok[i]]
    hyps = [reports[i] for i in keep]
    refs = [request.refs[i] for i in keep]

    scored = [c for c in request.components if c != FORMAT]
    extra: list[str] = []
    if request.editgrpo_keys:
        extra = [c for c in EDITGRPO_KEYS.values() if c in components and c not in scored]
    values: dict[str, list[float]] = {}
    for name in [*scored, *extra]:
        component = components[name]
        got = _call_component(component, hyps, refs) if hyps else []
        full = [0.0] * n  # a sample failing its format scores 0 in every component
        for i, v in zip(keep, got):
            full[i] = v
        values[name] = full

    format_scores = [1.0 if o else 0.0 for o in ok]
    predictions: dict[str, Any] = {}
    for name in request.components:
        predictions[name] = format_scores if name == FORMAT else values[name]
    final = []
    for i in range(n):
        total = 0.0
        if ok[i]:
            for name in request.components:
                if name == FORMAT:
                    if request.type != "free_form":
                        total += format_scores[i]
                else:
                    total += values[name][i]
        final.append(total)
    predictions["final_scores"] = final
    predictions["format_ok"] = ok
    predictions["format_scores"] = format_scores
    if request.editgrpo_keys:
        for key, name in EDITGRPO_KEYS.items():
            if name in values:
                predictions[key] = values[name]
    backends = {name: components[name].backend for name in values}
    if FORMAT in request.components:
        backends[FORMAT] = f"rules(type={request.type})"
    return {"predictions": predictions, "backends": backends, "type": request.type,
            "components": list(request.components)}


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


def analyze_pairs(generations: list[str], ground_truth: list[str]) -> list[dict[str, Any]]:
    """EditGRPO's extractor analysis of each (generation, reference) pair, with grouprl's entity matcher.

    Per pair: the entities of both texts (text, type, sentence index and sentence),
    the false positives (generated entities with no counterpart), the false negatives
    (reference entities with none) and the contradictions (same observation, opposite
    polarity), plus EditGRPO's ``ref_entities_grouped_by_sentence``.
    """
    from grouprl.rewards.radiology.entities import split_sentences
    from grouprl.rewards.radiology.ratescore import match_entities

    return [analysis_dict(match_entities(gen, ref).to_dict(), split_sentences(gen), split_sentences(ref))
            for gen, ref in zip(generations, ground_truth)]


def analysis_dict(match: Mapping[str, Any], gen_sentences: Sequence[str],
                  ref_sentences: Sequence[str]) -> dict[str, Any]:
    """``EntityMatching.to_dict()`` in the /analyze response's shape, EditGRPO's key names kept.

    Entities get ``sentence_index`` (the matcher's ``sentence``), the ``sentence``
    text itself and EditGRPO's ``text_span``; a contradiction is
    ``{"gen_entity", "ref_entity", "similarity"}``.
    """
    def gen(e):
        return entity_dict(e, gen_sentences)

    def ref(e):
        return entity_dict(e, ref_sentences)

    references = [ref(e) for e in match["ref_entities"]]
    grouped: dict[str, list[dict[str, Any]]] = {}
    for e in references:
        grouped.setdefault(e["sentence"], []).append(e)
    return {
        "generation_entities": [gen(e) for e in match["hyp_entities"]],
        "reference_entities": references,
        "false_positives": [gen(e) for e in match["false_positives"]],
        "false_negatives": [ref(e) for e in match["false_negatives"]],
        "contradictions": [{"gen_entity": gen(c["hyp"]), "ref_entity": ref(c["ref"]),
                            "similarity": float(c["similarity"])} for c in match["contradictions"]],
        "ref_entities_grouped_by_sentence": grouped,
    }


def entity_dict(entity: Mapping[str, Any], sentences: Sequence[str]) -> dict[str, Any]:
    index = int(entity["sentence"])
    out = {k: v for k, v in entity.items() if k != "sentence"}
    out.update(text_span=entity["text"], sentence_index=index,
               sentence=sentences[index].strip() if 0 <= index < len(sentences) else "")
    return out


# ----------------------------------------------------------------------------- the app


def create_app(
    *,
    default_components: Sequence[str] = DEFAULT_COMPONENTS,
    token: str | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_chars: int = DEFAULT_MAX_CHARS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    default_type: str = "short",
    scoring_threads: int = 1,
    extract_report: ExtractFn | None = None,
    analyze: AnalyzeFn | None = None,
):
    """The FastAPI app of the reward server.

    ``default_components`` are scored when a request names none (EditGRPO's
    composite). ``token``: when set, /predict and /analyze need
    ``Authorization: Bearer <token>`` (401 otherwise); /health stays open.
    ``default_type`` is the report type of a request without ``type`` ("short",
    as EditGRPO's server). ``scoring_threads`` worker threads run the scoring (1:
    requests are scored one at a time, off the event loop; model backends need not
    be thread-safe). ``extract_report`` / ``analyze`` replace the format check
    (``answers.extract_report``) and the entity analysis (``ratescore.match_entities``).
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    limits = Limits(max_batch, max_chars, max_body_bytes)
    if default_type not in REPORT_TYPES:
        raise ValueError(f"default_type must be one of {REPORT_TYPES}, got {default_type!r}")
    if isinstance(scoring_threads, bool) or not isinstance(scoring_threads, int) or scoring_threads < 1:
        raise ValueError(f"scoring_threads must be a positive integer, got {scoring_threads!r}")
    if token is not None and not token:
        raise ValueError("token must be a non-empty string or None")
    components = load_report_components()
    default = expand_components(list(default_components), DEFAULT_COMPONENTS)
    try:
        check_component_names(default, components)
    except RequestError as exc:
        raise ValueError(f"default components: {exc}") from None
    extract = extract_report or _default_extract
    analyzer = analyze or analyze_pairs
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=scoring_threads, thread_name_prefix="grouprl-score")

    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="grouprl reward server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.limits = limits
    app.state.executor = executor

    def error(message: str, status: int) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
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

    async def read_json(request: Request) -> dict[str, Any]:
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
        return decode_json_body(b"".join(chunks))

    async def run(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    async def guarded(request: Request, handle) -> JSONResponse:
        try:
            authorize(request)
            payload = await read_json(request)
            return JSONResponse({"result": "success", "data": await handle(payload)})
        except RequestError as exc:
            return error(str(exc), exc.status)
        except ComponentFailure as exc:
            logger.error("%s %s failed: %s", request.method, request.url.path, exc)
            return error(str(exc), 500)
        except Exception as exc:  # never let one request take the server down or hide why it failed
            logger.exception("%s %s failed", request.method, request.url.path)
            return error(f"internal error: {type(exc).__name__}: {exc}", 500)

    @app.post("/predict")
    async def predict(request: Request):
        async def handle(payload):
            parsed = parse_predict(payload, known=components, default_components=default,
                                   default_type=default_type, limits=limits)
            return await run(lambda: score_predict(parsed, components=components, extract=extract))

        return await guarded(request, handle)

    @app.post("/analyze")
    async def analyze_route(request: Request):
        async def handle(payload):
            if isinstance(payload.get("ground_truth"), str):  # EditGRPO's extractor accepts one bare reference
                payload = {**payload, "ground_truth": [payload["ground_truth"]]}
            gens, refs = paired_lists(payload, "generations", "ground_truth", limits)

            def work():
                try:
                    results = analyzer(gens, refs)
                except ComponentFailure:
                    raise
                except Exception as exc:
                    raise ComponentFailure(f"entity analysis raised {type(exc).__name__}: {exc}") from exc
                if len(results) != len(gens):
                    raise ComponentFailure(f"entity analysis returned {len(results)} results for {len(gens)} pairs")
                return {"predictions": {"analysis_results": results}}

            return await run(work)

        return await guarded(request, handle)

    @app.get("/health")
    async def health():
        known = sorted(components)
        return {
            "status": "ok",
            "components": known,
            "backends": {name: components[name].backend for name in known},
            "default_components": default,
            "types": list(REPORT_TYPES),
            "limits": {"max_batch": limits.max_batch, "max_chars": limits.max_chars,
                       "max_body_bytes": limits.max_body_bytes},
            "missing_editgrpo_keys": sorted(k for k, c in EDITGRPO_KEYS.items() if c not in components),
        }

    return app


def app_from_env():
    """App factory for uvicorn worker processes: settings from ``$GROUPRL_REWARD_SERVER_CONFIG``."""
    raw = os.environ.get(ENV_CONFIG)
    if not raw:
        raise RuntimeError(f"{ENV_CONFIG} is not set; start the server with grouprl serve rewards")
    return create_app(**json.loads(raw))


def serve(
    host: str = "127.0.0.1",
    port: int = 5000,
    workers: int = 1,
    token: str | None = None,
    *,
    default_components: Sequence[str] = DEFAULT_COMPONENTS,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_chars: int = DEFAULT_MAX_CHARS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    default_type: str = "short",
    scoring_threads: int = 1,
    log_level: str = "info",
) -> None:
    """Run the reward server under uvicorn until interrupted.

    ``workers > 1`` starts that many processes (each loads the components); their
    settings travel in an environment variable, the token included.
    """
    import uvicorn

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    settings = dict(default_components=list(default_components), token=token, max_batch=max_batch,
                    max_chars=max_chars, max_body_bytes=max_body_bytes, default_type=default_type,
                    scoring_threads=scoring_threads)
    if host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("reward server listening on %s: reachable from other machines%s", host,
                       "" if token else " without a token (pass --token)")
    if workers == 1:
        uvicorn.run(create_app(**settings), host=host, port=port, log_level=log_level)
        return
    create_app(**settings)  # fail here, once, on bad settings rather than in every worker
    os.environ[ENV_CONFIG] = json.dumps(settings)
    uvicorn.run("grouprl.rewards.server:app_from_env", factory=True, host=host, port=port, workers=workers,
                log_level=log_level)
