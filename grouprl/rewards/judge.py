"""An LLM judge behind an OpenAI-compatible chat endpoint, for rewards and evaluations that need one.

:class:`ChatJudge` sends ``POST {base_url}/chat/completions`` (vLLM, SGLang, a hosted
API) through :class:`grouprl.rewards.chat_endpoint.ChatEndpoint` (the ``openai`` SDK)
with ``Authorization: Bearer <key>``, the key read from an environment variable
(``GROUPRL_JUDGE_API_KEY`` unless told otherwise) so that it never sits in a config
file. Each request has a timeout; connection errors, timeouts and HTTP 408/409/429/5xx
are retried by the SDK (after the server's ``Retry-After`` when it sends one, else
0.5 s doubling up to 8 s), and replies the caller's ``parse`` rejects are asked again
after ``backoff * 2 ** (k - 1)`` seconds; both share the ``max_retries`` budget. Any
other HTTP error (a bad key, a bad model name) fails at once: repeating cannot help.

A judge that does not judge never becomes a score: :meth:`ChatJudge.judge` raises
:class:`JudgeError` naming the endpoint, the item and the last error, and
:meth:`ChatJudge.judge_many` either raises it or, with ``on_failure="skip"``, returns
the item as unscored with its error.

Needs ``openai`` and ``httpx`` (``pip install 'grouprl[judge]'``).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Sequence, TypeVar

from grouprl.rewards.chat_endpoint import (  # noqa: F401  (chat_completions_url: re-exported, public here before)
    ChatCallError,
    ChatEndpoint,
    UnusableReply,
    chat_completions_url,
)

JUDGE_API_KEY_ENV = "GROUPRL_JUDGE_API_KEY"
JUDGE_BASE_URL_ENV = "GROUPRL_JUDGE_BASE_URL"
JUDGE_MODEL_ENV = "GROUPRL_JUDGE_MODEL"
ON_FAILURE = ("raise", "skip")

T = TypeVar("T")


class JudgeError(RuntimeError):
    """A judge request that failed after its retries, or was refused; names the endpoint and item.

    ``error`` is the last error alone (``HTTP 503: ...``, ``unusable reply: ...``);
    ``refused`` says the server refused the request, so no retry was made.
    """

    def __init__(self, message: str, *, url: str, item: str | None = None, attempts: int = 0,
                 status: int | None = None, error: str | None = None, refused: bool = False):
        super().__init__(message)
        self.url = url
        self.item = item
        self.attempts = attempts
        self.status = status
        self.error = error
        self.refused = refused


@dataclass
class Judged(Generic[T]):
    """One item's outcome: ``value`` (None when unscored), the judge's ``reply``, the ``error`` if any."""

    value: T | None
    reply: str | None = None
    error: str | None = None


@dataclass
class ChatJudge:
    """A chat model used as a judge.

    ``api_key`` wins over the ``api_key_env`` variable; with neither, requests go
    without an Authorization header (a local server). ``max_retries`` further attempts
    follow the first, shared by transient failures (retried by the ``openai`` SDK: the
    server's Retry-After, else 0.5 s doubling up to 8 s) and replies ``parse`` rejects
    (asked again after ``backoff * 2 ** (k - 1)`` seconds, k = 1, 2, ...). At most
    ``concurrency`` requests are in flight. ``extra_body`` fields go into every request
    body. ``transport`` is an httpx transport to use instead of the network (tests pass
    ``httpx.MockTransport``).
    """

    base_url: str
    model: str
    api_key: str | None = None
    api_key_env: str = JUDGE_API_KEY_ENV
    timeout: float = 60.0
    max_retries: int = 3
    backoff: float = 1.0
    concurrency: int = 4
    temperature: float = 0.0
    max_tokens: int = 512
    transport: Any = field(default=None, repr=False)
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.base_url, str) or not self.base_url.strip().startswith(("http://", "https://")):
            raise ValueError(f"judge base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, "
                             f"got {self.base_url!r}")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("the judge model name is empty")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"judge max_retries must be a non-negative integer, got {self.max_retries!r}")
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(f"judge concurrency must be a positive integer, got {self.concurrency!r}")
        if not (self.timeout > 0 and self.backoff >= 0):
            raise ValueError(f"judge timeout must be > 0 and backoff >= 0, got {self.timeout!r}, {self.backoff!r}")
        self.endpoint = ChatEndpoint(self.base_url, api_key=self.key, timeout=self.timeout,
                                     max_retries=self.max_retries, connections=self.concurrency,
                                     transport=self.transport, extra="judge", user="the chat judge")
        self.url = self.endpoint.url

    @property
    def backend(self) -> str:
        return f"judge={self.model} at {self.url}"

    @property
    def key(self) -> str | None:
        return self.api_key if self.api_key is not None else (os.environ.get(self.api_key_env) or None)

    def close(self) -> None:
        self.endpoint.close()

    def __enter__(self) -> "ChatJudge":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def judge(self, messages: list[dict[str, Any]], parse: Callable[[str], T], *,
              item: str = "the request") -> tuple[T, str]:
        """Ask (with retries) and return ``(parse(reply), reply)``.

        ``parse`` raises ValueError for a reply it cannot use; such a reply is asked
        again within the same ``max_retries`` budget. Raises :class:`JudgeError` when no
        usable reply comes.
        """
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens, **self.extra_body}
        attempts, rejected = 0, 0
        while True:
            try:
                reply = self.endpoint.complete(body, max_retries=self.max_retries - attempts)
                attempts += reply.attempts
                value = parse(reply.text)
            except UnusableReply as exc:  # HTTP 200 without a text: as unusable as one parse rejects
                attempts += exc.attempts
                last_error, last_status = f"unusable reply: {exc}", exc.status
            except ChatCallError as exc:
                attempts += exc.attempts
                if exc.refused:
                    raise JudgeError(f"judge {self.url} refused {item}: {exc}", url=self.url, item=item,
                                     attempts=attempts, status=exc.status, error=str(exc), refused=True) from None
                last_error, last_status = str(exc), exc.status
                break  # the SDK has spent the retries that were left
            except ValueError as exc:
                last_error, last_status = f"unusable reply: {exc}", 200
            else:
                return value, reply.text
            if attempts > self.max_retries:
                break
            rejected += 1
            time.sleep(self.backoff * 2 ** (rejected - 1))
        raise JudgeError(f"judge {self.url} (model {self.model}) failed for {item} after {attempts} attempt(s) "
                         f"(last status {last_status if last_status is not None else 'none'}): {last_error}",
                         url=self.url, item=item, attempts=attempts, status=last_status, error=last_error)

    def judge_many(self, requests: Sequence[list[dict[str, Any]]], parse: Callable[[str], T], *,
                   items: Sequence[str] | None = None, on_failure: str = "raise") -> list[Judged[T]]:
        """:meth:`judge` every request, ``concurrency`` at a time, in order.

        ``on_failure="raise"``: the first failure raises its :class:`JudgeError` (the
        others are cancelled); ``"skip"``: a failed item comes back with ``value`` None
        and its ``error``, never as a score.
        """
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure must be one of {ON_FAILURE}, got {on_failure!r}")
        names = list(items) if items is not None else [f"item {i}" for i in range(len(requests))]
        if len(names) != len(requests):
            raise ValueError(f"got {len(names)} item names for {len(requests)} requests")
        if not requests:
            return []

        def one(index: int) -> Judged[T]:
            try:
                value, reply = self.judge(requests[index], parse, item=names[index])
            except JudgeError as exc:
                if on_failure == "raise":
                    raise
                return Judged(None, None, str(exc))
            return Judged(value, reply, None)

        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as pool:
            futures = [pool.submit(one, i) for i in range(len(requests))]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise


def judge_from_options(base_url: str | None = None, model: str | None = None, **options: Any) -> ChatJudge:
    """A :class:`ChatJudge` from options, ``base_url`` and ``model`` defaulting to
    ``$GROUPRL_JUDGE_BASE_URL`` and ``$GROUPRL_JUDGE_MODEL``; a clear error when neither is set."""
    base_url = base_url or os.environ.get(JUDGE_BASE_URL_ENV, "").strip()
    model = model or os.environ.get(JUDGE_MODEL_ENV, "").strip()
    if not base_url or not model:
        missing = " and ".join(n for n, v in (("base_url", base_url), ("model", model)) if not v)
        raise ValueError(f"the judge needs {missing}: pass it as an option or set {JUDGE_BASE_URL_ENV} "
                         f"(an OpenAI-compatible API root such as http://127.0.0.1:8000/v1) and {JUDGE_MODEL_ENV}")
    return ChatJudge(base_url, model, **options)
