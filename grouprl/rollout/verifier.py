"""Guided-GRPO's verifier: the teacher that answers each policy turn of a multi-turn rollout.

    verifier = build_verifier(config.worker.rollout.verifier, tokenizer=tokenizer)
    replies = verifier.reply_many([VerifierRequest(problem, reference, turns), ...])

After each policy turn the rollout sends the verifier what the seed's verifier sees:
the problem text (images as ``[IMAGE]``: it never sees pixels), the reference answer
(``N/A`` in validation) and the policy's turns so far (its own earlier replies are
left out). The reply either guides the next turn or ends the dialogue with the stop
token; a ``[SCORE] hallucination_detect=0|1`` line judges the last turn.

Backends (``worker.rollout.verifier.backend``):

- ``http``: an OpenAI-compatible ``POST {base_url}/chat/completions`` server (vLLM,
  SGLang, a hosted API), called through the ``openai`` SDK
  (:class:`grouprl.rewards.chat_endpoint.ChatEndpoint`). Requests run concurrently (at
  most ``http_concurrency``); the SDK retries connection errors, timeouts, 408, 409,
  429 and 5xx (after the server's Retry-After, else 0.5 s doubling up to 8 s). A call
  that still fails is never hidden: with ``on_failure: stop`` it ends its dialogue as
  the seed does, but the reply says ``failed=True``, the failure is counted
  (:attr:`Verifier.failures`) and logged; with ``on_failure: fail`` it raises
  :class:`VerifierError`.
- ``local``: a transformers checkpoint loaded with its real weights (the seed built
  its local verifier on random weights), prompted through its own chat template and
  sampled with the verifier's settings by grouprl's ``hf`` engine.
- more by name from :data:`VERIFIER_BACKENDS`: the reasoning domain registers ``rule``,
  a deterministic stand-in with the same inputs for demos and tests
  (``grouprl.domains.reasoning``'s plugin; see :func:`register_verifier_backend`).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from grouprl.config import DEFAULT_VERIFIER_TEMPLATE, ConfigError, VerifierConfig
from grouprl.config.verifier_backends import VERIFIER_BACKENDS  # noqa: F401 - registered into here, and re-exported
from grouprl.errors import FEATURE_EXTRAS
from grouprl.rewards.chat_endpoint import ChatCallError, ChatEndpoint, chat_completions_url
from grouprl.rollout.environments import Environment, Step
# The final-answer rules live with the rewards (the format reward uses them too); re-exported here
# because a dialogue's STOP depends on them.
from grouprl.rewards.rule_based import (  # noqa: F401
    answers_match,
    extract_answer,
    extract_boxed,
    final_answer,
    has_final_answer,
    math_equal,
    normalize_answer,
    parse_number,
)

logger = logging.getLogger(__name__)

API_KEY_ENV = "GROUPRL_VERIFIER_API_KEY"
_HTTP_EXTRA = FEATURE_EXTRAS["worker.rollout.verifier.enable: True, worker.rollout.verifier.resolved_backend: http"]
IMAGE_PLACEHOLDER = "[IMAGE]"
NO_REFERENCE = "N/A"
# The seed's closing sentence ("the rules above" are the system message's)
GUIDANCE_INSTRUCTION = "Provide the next piece of guidance following the rules above."
# The published verifier, fine-tuned on the seed's teacher prompt: a model name with this in it is
# warned about when grouprl's default template is in use.
PUBLISHED_VERIFIER = "Guided-Verifier"

# The seed's pattern. A reply is meant to end with its score line, so the last match is the
# verdict: an earlier one can only be the model quoting the instruction, and the quoted
# "hallucination_detect=0|1" would otherwise read as a detection (the seed takes the first).
_SCORE = re.compile(r"\[SCORE\]\s*hallucination_detect\s*=\s*([01])")
# as the seed: any case ("user:", "USER:")
_LEADING_USER = re.compile(r"\Auser:\s*", re.IGNORECASE)
# The seed's test for a reply with something to say: an ASCII letter or digit. A reply in another
# script only (e.g. Chinese) is a STOP there, and here.
_ASCII_ALNUM = re.compile(r"[A-Za-z0-9]")


class VerifierError(RuntimeError):
    """A verifier call failed (``on_failure: fail``).

    ``url`` is the endpoint, ``attempts`` how many requests were made, ``status`` the
    last HTTP status (None when no answer came back).
    """

    def __init__(self, message: str, *, url: str | None = None, attempts: int = 0, status: int | None = None):
        super().__init__(message)
        self.url = url
        self.attempts = attempts
        self.status = status


@dataclass
class VerifierRequest:
    """What the verifier sees of one dialogue.

    ``problem``: the first user message's text, images shown as ``[IMAGE]``.
    ``reference``: the reference answer in training; None in validation (``N/A`` in the prompt).
    ``turns``: the policy's turns so far, oldest first; the verifier's replies are not included.
    """

    problem: str
    reference: str | None
    turns: list[str]


@dataclass
class VerifierReply:
    """The verifier's answer to one request.

    ``text`` is what the policy reads next (stripped, a leading ``User:`` removed).
    ``stop`` ends the dialogue (see :func:`is_stop`); ``score`` is the parsed
    hallucination score (1 = none found, 0 = found; None when absent or disabled).
    ``failed`` marks a backend failure after its retries (then ``stop`` is True and
    ``error`` says why). ``latency_s`` is the wall time of the request, retries
    included (for the local backend, of the batched call it was part of). ``tokens``
    is the reply's length in tokens when known.
    """

    text: str
    stop: bool
    score: float | None
    failed: bool = False
    error: str | None = None
    latency_s: float = 0.0
    tokens: int | None = None


# ---------------------------------------------------------------------------- parsing


def parse_hallucination_score(text: str) -> float | None:
    """The ``[SCORE] hallucination_detect=0|1`` value of a reply (0.0 or 1.0), or None without one.

    With several score lines the last one wins (see ``_SCORE``).
    """
    matches = _SCORE.findall(text or "")
    return float(matches[-1]) if matches else None


def is_stop(text: str, stop_token: str) -> bool:
    """Whether a verifier reply ends the dialogue.

    After stripping: empty, without any ASCII letter or digit (the seed's test: a model
    that has nothing to say often emits only punctuation; a reply in another script
    only, e.g. Chinese, counts as STOP too), or starting with ``stop_token``.
    """
    text = (text or "").strip()
    return not text or _ASCII_ALNUM.search(text) is None or text.startswith(stop_token)


def clean_reply(text: str) -> str:
    """The reply as the policy reads it: stripped, with a leading ``User:`` role label (any case) removed.

    Chat models trained on transcripts sometimes open with the role of the message
    they write; the policy's chat template already marks the turn as the user's.
    """
    text = (text or "").strip()
    return _LEADING_USER.sub("", text, count=1).strip()


def verifier_messages(template: str, request: VerifierRequest) -> list[dict]:
    """The chat messages of a verifier call: the template as system message, then one user message.

    The user message is the seed's, character for character: three sections
    (``### Problem Statement``, the problem as given; ``### Reference Answer``, ``N/A``
    when there is none or it is empty; ``### Conversation History``, one
    ``Assistant: <turn>`` line per policy turn, each turn stripped, joined by single
    newlines), a blank line between sections, then :data:`GUIDANCE_INSTRUCTION`.
    """
    reference = str(request.reference) if request.reference is not None else ""
    history = "\n".join(f"Assistant: {turn.strip()}" for turn in request.turns)
    user = (
        f"### Problem Statement\n{request.problem}\n\n"
        f"### Reference Answer\n{reference or NO_REFERENCE}\n\n"
        f"### Conversation History\n{history}\n\n"
        f"{GUIDANCE_INSTRUCTION}"
    )
    return [{"role": "system", "content": template}, {"role": "user", "content": user}]


def read_prompt_template(config: VerifierConfig, key: str = "worker.rollout.verifier") -> str:
    """The verifier's system message: ``prompt_template_file``'s contents when set, else ``prompt_template``.

    Raises ConfigError naming ``{key}.prompt_template_file`` when the file cannot be
    read, is empty, or never mentions the stop token.
    """
    path = config.prompt_template_file
    if path is None:
        return config.prompt_template
    try:
        with open(os.path.expanduser(str(path)), encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"config key '{key}.prompt_template_file': cannot read {str(path)!r}: {reason}") from None
    if not text.strip():
        raise ConfigError(f"config key '{key}.prompt_template_file': {str(path)!r} is empty")
    if config.stop_token not in text:
        raise ConfigError(f"config key '{key}.prompt_template_file': {str(path)!r} never mentions the stop token "
                          f"{config.stop_token!r} ('{key}.stop_token'): the verifier could not end a dialogue")
    return text


# ---------------------------------------------------------------------------- the interface


class Verifier(abc.ABC):
    """Answers a batch of dialogues' latest turns; one reply per request, in order.

    ``reply_many`` is synchronous and runs the backend's own concurrency inside it.
    ``requests`` and ``failures`` count calls over the verifier's life, for logs.
    """

    backend: str = ""

    def __init__(self, config: VerifierConfig, *, tokenizer=None) -> None:
        self.config = config
        self.tokenizer = tokenizer  # counts reply tokens where the backend gives no count
        # the system message, read once (prompt_template_file when set)
        self.prompt_template = read_prompt_template(config)
        self.requests = 0
        self.failures = 0

    def reply_many(self, requests: list[VerifierRequest]) -> list[VerifierReply]:
        requests = list(requests)
        for i, request in enumerate(requests):
            if not isinstance(request, VerifierRequest):
                raise TypeError(f"requests[{i}] must be a VerifierRequest, got {type(request).__name__}")
        if not requests:
            return []
        replies = self._reply_many(requests)
        self.requests += len(requests)
        return replies

    @abc.abstractmethod
    def _reply_many(self, requests: list[VerifierRequest]) -> list[VerifierReply]:
        """One reply per request, in order."""

    def close(self) -> None:
        """Release what the backend holds (connections, threads, a model)."""

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _reply(self, raw: str, *, latency_s: float = 0.0, tokens: int | None = None) -> VerifierReply:
        text = clean_reply(raw)
        score = parse_hallucination_score(text) if self.config.enable_hallucination_score else None
        if tokens is None:
            tokens = self._count_tokens(text)
        return VerifierReply(text=text, stop=is_stop(text, self.config.stop_token), score=score,
                             latency_s=latency_s, tokens=tokens)

    def _failed(self, error: str, *, latency_s: float) -> VerifierReply:
        self.failures += 1
        logger.warning("verifier call failed, ending its dialogue as a STOP (on_failure=stop; %d failure(s) so "
                       "far): %s", self.failures, error)
        return VerifierReply(text="", stop=True, score=None, failed=True, error=error, latency_s=latency_s)

    def _count_tokens(self, text: str) -> int | None:
        if self.tokenizer is None:
            return None
        tokenizer = getattr(self.tokenizer, "tokenizer", self.tokenizer)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend!r})"




def register_verifier_backend(name: str):
    """Class decorator: ``@register_verifier_backend("mine")`` makes ``worker.rollout.verifier.backend: mine`` build it."""
    return VERIFIER_BACKENDS.register(name)


def verifier_backend(name: str) -> type:
    try:
        return VERIFIER_BACKENDS.get(name)
    except ConfigError as exc:
        raise ConfigError(f"config key 'worker.rollout.verifier.backend': {exc}") from None


def build_verifier(config: VerifierConfig, *, tokenizer=None) -> Verifier:
    """The verifier ``config`` describes (``backend``, with ``auto`` read through ``use_http``).

    ``tokenizer`` counts reply tokens where the backend has no count of its own (the
    rule backend, a server that sends no ``usage``); pass the policy's, so that the
    count is what a reply adds to the policy's context. The HTTP key is ``api_key``
    or, when that is None, ``$GROUPRL_VERIFIER_API_KEY`` read now.
    """
    config.check("worker.rollout.verifier", building=True)
    backend = config.resolved_backend
    if backend == "http":
        return HTTPVerifier(config, tokenizer=tokenizer)
    if backend == "local":
        return LocalVerifier(config, tokenizer=tokenizer)
    return verifier_backend(backend)(config, tokenizer=tokenizer)


# ---------------------------------------------------------------------------- http


@register_verifier_backend("http")
class HTTPVerifier(Verifier):
    """A verifier behind an OpenAI-compatible ``/chat/completions`` endpoint.

    Requests run on a private event loop in a daemon thread, so ``reply_many`` works
    from plain code and from inside a running event loop alike, and one async client
    keeps its connections across the turns of a rollout.
    """

    backend = "http"

    def __init__(self, config: VerifierConfig, *, tokenizer=None) -> None:
        super().__init__(config, tokenizer=tokenizer)
        if not config.base_url:
            raise ConfigError("config key 'worker.rollout.verifier.base_url' is required by the http verifier")
        self.url = chat_completions_url(config.base_url)
        self.api_key = config.api_key if config.api_key is not None else os.environ.get(API_KEY_ENV) or None
        # made now: a missing openai fails the build, not the first rollout
        self.endpoint = ChatEndpoint(config.base_url, api_key=self.api_key, timeout=config.timeout,
                                     max_retries=config.max_retries, connections=config.http_concurrency,
                                     extra=_HTTP_EXTRA.extra, user=_HTTP_EXTRA.needed_by)
        if PUBLISHED_VERIFIER.lower() in (config.model or "").lower() and \
                self.prompt_template == DEFAULT_VERIFIER_TEMPLATE:
            logger.warning("verifier model %r was fine-tuned on the seed's teacher prompt, but grouprl's default "
                           "template is in use: point worker.rollout.verifier.prompt_template_file at the seed's "
                           "teacher prompt (Guided-GRPO's verl/workers/rollout/config.py, DEFAULT_VERIFIER_PROMPT)",
                           config.model)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the private loop

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="grouprl-verifier-http", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def _reply_many(self, requests: list[VerifierRequest]) -> list[VerifierReply]:
        # The caller may be plain code or a coroutine on its own loop: either way it waits here
        # while the private loop runs the requests.
        return asyncio.run_coroutine_threadsafe(self._areply_many(requests), self._ensure_loop()).result()

    def close(self) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None:
            return
        # the async client's connections belong to the private loop: closed there
        asyncio.run_coroutine_threadsafe(self.endpoint.aclose(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()

    # ------------------------------------------------------------------ requests

    async def _areply_many(self, requests: list[VerifierRequest]) -> list[VerifierReply]:
        limit = asyncio.Semaphore(self.config.http_concurrency)

        async def one(request: VerifierRequest) -> VerifierReply:
            async with limit:
                return await self._request(request)

        tasks = [asyncio.ensure_future(one(r)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            # on_failure=fail: the first error ends the batch; stop the others' retries too
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def payload(self, request: VerifierRequest) -> dict[str, Any]:
        """The JSON body of one request."""
        c = self.config
        body: dict[str, Any] = {"model": c.model, "messages": verifier_messages(self.prompt_template, request),
                                "max_tokens": c.max_tokens, "temperature": c.temperature, "top_p": c.top_p}
        if c.top_k >= 0:  # OpenAI's own API has no top_k; send it only when asked for
            body["top_k"] = c.top_k
        return body

    async def _request(self, request: VerifierRequest) -> VerifierReply:
        started = time.monotonic()
        try:
            # An HTTP 200 without a reply text is refused like a 400: repeating the request cannot help.
            reply = await self.endpoint.acomplete(self.payload(request))
        except ChatCallError as exc:
            elapsed = time.monotonic() - started
            message = (f"verifier {self.url} failed after {exc.attempts} attempt(s) over {elapsed:.1f} s "
                       f"(last status {exc.status if exc.status is not None else 'none'}): {exc}")
            if self.config.on_failure == "fail":
                self.failures += 1
                raise VerifierError(message, url=self.url, attempts=exc.attempts, status=exc.status) from None
            return self._failed(message, latency_s=elapsed)
        return self._reply(reply.text, latency_s=time.monotonic() - started, tokens=reply.tokens)

    def __repr__(self) -> str:
        return (f"HTTPVerifier({self.url!r}, model={self.config.model!r}, "
                f"http_concurrency={self.config.http_concurrency}, key={'set' if self.api_key else 'none'})")


# ---------------------------------------------------------------------------- local


@register_verifier_backend("local")
class LocalVerifier(Verifier):
    """A transformers checkpoint answering in-process.

    Loaded with its real weights through ``load_model_and_processor`` (dtype as the
    checkpoint stores it), onto the current CUDA device when there is one. Requests
    are rendered with the checkpoint's own chat template and generated in one batch by
    grouprl's ``hf`` engine with the verifier's temperature, top-p, top-k and
    ``max_tokens``. An exception in generation propagates: unlike a remote server's
    hiccup it is no transient state that a retry or a STOP could paper over.
    """

    backend = "local"

    def __init__(self, config: VerifierConfig, *, tokenizer=None, device=None) -> None:
        super().__init__(config, tokenizer=tokenizer)
        import torch

        from grouprl.models.loading import load_model_and_processor
        from grouprl.rollout.engine import SamplingParams
        from grouprl.rollout.hf_engine import HFGenerationEngine

        model, processor, _ = load_model_and_processor(config.model_path, dtype="auto",
                                                       trust_remote_code=config.trust_remote_code)
        if config.tokenizer_path and config.tokenizer_path != config.model_path:
            processor = _load_tokenizer(config.tokenizer_path, like=processor,
                                        trust_remote_code=config.trust_remote_code)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.model = model.to(device).eval()
        self.processor = processor
        # holds_weights: the engine owns this model (frozen; nothing ever updates it)
        self.engine = HFGenerationEngine(self.model, processor, holds_weights=True)
        self.sampling = SamplingParams(n=1, temperature=config.temperature, top_p=config.top_p,
                                       top_k=config.top_k if config.top_k > 0 else None,
                                       max_new_tokens=config.max_tokens)

    def samples(self, requests: list[VerifierRequest]) -> list:
        """The requests as text-only Samples (the verifier never sees images)."""
        from grouprl.data.sample import Sample

        return [Sample(messages=verifier_messages(self.prompt_template, r), index=i)
                for i, r in enumerate(requests)]

    def render(self, request: VerifierRequest) -> str:
        """The prompt text a request becomes through the checkpoint's chat template."""
        from grouprl.models.inputs import render_prompt

        return render_prompt(self.processor, self.samples([request])[0])

    def _reply_many(self, requests: list[VerifierRequest]) -> list[VerifierReply]:
        started = time.monotonic()
        batch = self.engine.generate(self.samples(requests), self.sampling)
        latency = time.monotonic() - started
        lengths = batch.response_mask.sum(dim=1).tolist()
        return [self._reply(text, latency_s=latency, tokens=int(n)) for text, n in zip(batch.responses, lengths)]

    def close(self) -> None:
        # Drop the references; the memory goes back once nothing else holds the model.
        self.engine = self.model = self.processor = None


def _load_tokenizer(path: str, *, like, trust_remote_code: bool):
    """The tokenizer (or processor, when ``like`` is one) at ``path``, set up for batched generation."""
    from transformers import AutoProcessor, AutoTokenizer

    from grouprl.models.inputs import tokenizer_of

    loader = AutoProcessor if hasattr(like, "tokenizer") else AutoTokenizer
    processor = loader.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer = tokenizer_of(processor)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # as load_model_and_processor sets it: prompts are left-padded
    return processor


# ---------------------------------------------------------------------------- the environment


class VerifierEnvironment(Environment):
    """Guided-GRPO's verifier as a multi-turn environment (the environment ``verifier``).

    Each policy turn goes to the verifier with the problem, the reference (none in validation)
    and the policy's turns so far; the dialogue's turns are asked together (:meth:`step_many`:
    one ``reply_many`` call, the backend's own concurrency). A STOP ends the dialogue when the
    last turn holds a final answer (exactly one ``<answer>`` with one ``\\boxed{}``); a STOP
    without one sends ``continue_message``; anything else sends the reply as a user message. A
    failed call (after its retries) is a STOP with ``failed`` set: counted, and under the
    rollout's failure count (``max_consecutive_failures``). ``columns()`` gives the dialogue's
    hallucination score (``verifier_hallucination_score``, what the ``guided`` reward reads).
    """

    failure_reason = "verifier_failure"

    def __init__(self, verifier: Verifier, validation: Callable[[], bool] = lambda: False) -> None:
        self.verifier = verifier
        self.validation = validation
        self.sample = None
        self.turns: list[str] = []
        self.replies: list[VerifierReply] = []

    def reset(self, sample) -> None:
        self.sample, self.turns, self.replies = sample, [], []
        return None

    def step(self, message: str) -> Step:
        return self.step_many([self], [message])[0]

    def tools(self) -> list:
        return []  # the verifier talks, it offers the policy no tools

    @staticmethod
    def step_many(environments: list[VerifierEnvironment], messages: list[str]) -> list[Step]:
        from grouprl.rollout.multiturn import problem_text

        verifier = environments[0].verifier
        for env, message in zip(environments, messages):
            env.turns.append(message)
        requests = [VerifierRequest(problem=problem_text(env.sample),
                                    reference=None if env.validation() else env.sample.answer,
                                    turns=list(env.turns)) for env in environments]
        steps = []
        for env, reply in zip(environments, verifier.reply_many(requests)):
            env.replies.append(reply)
            if reply.stop and has_final_answer(env.turns[-1]):
                steps.append(Step(done=True, failed=reply.failed, error=reply.error))
                continue
            # STOP without a final answer (or a failed verifier, taken as STOP) asks for the answer
            text = verifier.config.continue_message if reply.stop else reply.text
            steps.append(Step([{"role": "user", "content": text}], failed=reply.failed, error=reply.error))
        return steps

    def hallucination_score(self) -> float:
        """Mean of the [SCORE] values the verifier gave (0.5 when it gave none), as the seed computes it."""
        scores = [r.score for r in self.replies if r.score is not None and not r.stop]
        return sum(scores) / len(scores) if scores else 0.5

    def columns(self) -> dict[str, float]:
        return {"verifier_hallucination_score": self.hallucination_score()}

    @staticmethod
    def metrics(environments: list[VerifierEnvironment]) -> tuple[dict[str, float], dict[str, str]]:
        """The verifier's figures over a call's dialogues, and how each adds up across calls."""
        replies = [r for env in environments for r in env.replies]
        n = max(len(environments), 1)
        metrics = {
            "multiturn/hallucination_score": sum(env.hallucination_score() for env in environments) / n,
            "verifier/failures": float(sum(r.failed for r in replies)),
            "verifier/tokens": float(sum(r.tokens or 0 for r in replies)),
            "verifier/latency_s": sum(r.latency_s for r in replies) / len(replies) if replies else 0.0,
        }
        return metrics, {"verifier/failures": "sum", "verifier/tokens": "sum"}

    def __repr__(self) -> str:
        return f"VerifierEnvironment({self.verifier!r})"
