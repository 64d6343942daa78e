"""An LLM judge behind an OpenAI-compatible chat endpoint, for rewards and evaluations that need one.

:class:`ChatJudge` sends ``POST {base_url}/chat/completions`` (vLLM, SGLang, a hosted
API) with ``Authorization: Bearer <key>``, the key read from an environment variable
(``GROUPRL_JUDGE_API_KEY`` unless told otherwise) so that it never sits in a config
file. Each request has a timeout; connection errors, timeouts, HTTP 408/409/425/429/5xx
and replies the caller's ``parse`` rejects are retried with exponential back-off
(the server's ``Retry-After`` when it sends one). Any other HTTP error (a bad key, a
bad model name) fails at once: repeating cannot help.

A judge that does not judge never becomes a score: :meth:`ChatJudge.judge` raises
:class:`JudgeError` naming the endpoint, the item and the last error, and
:meth:`ChatJudge.judge_many` either raises it or, with ``on_failure="skip"``, returns
the item as unscored with its error.

Needs ``httpx`` (``pip install 'grouprl[green]'`` or ``'grouprl[server]'``).
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Sequence, TypeVar

JUDGE_API_KEY_ENV = "GROUPRL_JUDGE_API_KEY"
JUDGE_BASE_URL_ENV = "GROUPRL_JUDGE_BASE_URL"
JUDGE_MODEL_ENV = "GROUPRL_JUDGE_MODEL"
ON_FAILURE = ("raise", "skip")

# Statuses that say "try again later" rather than "this request is wrong".
_RETRY_STATUS = frozenset({408, 409, 425, 429}) | frozenset(range(500, 600))

T = TypeVar("T")


class JudgeError(RuntimeError):
    """A judge request that failed after its retries, or was refused; names the endpoint and item."""

    def __init__(self, message: str, *, url: str, item: str | None = None, attempts: int = 0,
                 status: int | None = None):
        super().__init__(message)
        self.url = url
        self.item = item
        self.attempts = attempts
        self.status = status


@dataclass
class Judged(Generic[T]):
    """One item's outcome: ``value`` (None when unscored), the judge's ``reply``, the ``error`` if any."""

    value: T | None
    reply: str | None = None
    error: str | None = None


def chat_completions_url(base_url: str) -> str:
    """``http://host:8000/v1`` (or the endpoint itself) -> ``http://host:8000/v1/chat/completions``."""
    url = base_url.strip().rstrip("/")
    return url if url.endswith("/chat/completions") else url + "/chat/completions"


@dataclass
class ChatJudge:
    """A chat model used as a judge.

    ``api_key`` wins over the ``api_key_env`` variable; with neither, requests go
    without an Authorization header (a local server). ``max_retries`` further attempts
    follow the first; the wait before retry k (k = 1, 2, ...) is
    ``backoff * 2 ** (k - 1)`` seconds, or the server's Retry-After (capped at 60 s).
    At most ``concurrency`` requests are in flight. ``transport`` is an httpx
    transport to use instead of the network (tests pass ``httpx.MockTransport``).
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
        self.url = chat_completions_url(self.base_url)
        self._client = None
        self._lock = threading.Lock()

    @property
    def backend(self) -> str:
        return f"judge={self.model} at {self.url}"

    @property
    def key(self) -> str | None:
        return self.api_key if self.api_key is not None else (os.environ.get(self.api_key_env) or None)

    def _http(self):
        with self._lock:
            if self._client is None:
                try:
                    import httpx
                except ImportError as exc:
                    raise ImportError("the chat judge needs httpx: pip install 'grouprl[green]'") from exc
                headers = {"Content-Type": "application/json"}
                if self.key:
                    headers["Authorization"] = f"Bearer {self.key}"
                limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
                self._client = httpx.Client(timeout=self.timeout, headers=headers, limits=limits,
                                            transport=self.transport)
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def __enter__(self) -> "ChatJudge":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def judge(self, messages: list[dict[str, Any]], parse: Callable[[str], T], *,
              item: str = "the request") -> tuple[T, str]:
        """Ask once (with retries) and return ``(parse(reply), reply)``.

        ``parse`` raises ValueError for a reply it cannot use; such replies are retried
        like transient errors. Raises :class:`JudgeError` when no usable reply comes.
        """
        client = self._http()
        import httpx

        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens}
        last_error, last_status, attempts = "no attempt made", None, 0
        for attempt in range(self.max_retries + 1):
            wait = self.backoff * 2 ** attempt
            attempts += 1
            try:
                response = client.post(self.url, json=body)
            except httpx.TimeoutException as exc:
                last_error, last_status = f"timed out after {self.timeout:g} s ({type(exc).__name__})", None
            except httpx.HTTPError as exc:  # connection refused or reset: the server may be restarting
                last_error, last_status = f"{type(exc).__name__}: {exc or 'connection failed'}", None
            else:
                last_status = response.status_code
                if response.status_code in _RETRY_STATUS:
                    last_error = f"HTTP {response.status_code}: {_excerpt(response.text)}"
                    wait = _retry_after(response, default=wait)
                elif response.status_code != 200:
                    raise JudgeError(f"judge {self.url} refused {item}: HTTP {response.status_code}: "
                                     f"{_excerpt(response.text)}", url=self.url, item=item, attempts=attempts,
                                     status=response.status_code)
                else:
                    try:
                        reply = _reply_text(response)
                        return parse(reply), reply
                    except ValueError as exc:
                        last_error = f"unusable reply: {exc}"
            if attempt < self.max_retries:
                time.sleep(wait)
        raise JudgeError(f"judge {self.url} (model {self.model}) failed for {item} after {attempts} attempt(s) "
                         f"(last status {last_status if last_status is not None else 'none'}): {last_error}",
                         url=self.url, item=item, attempts=attempts, status=last_status)

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


def _reply_text(response: Any) -> str:
    try:
        content = response.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"no choices[0].message.content in {_excerpt(response.text)}") from None
    if not isinstance(content, str):
        raise ValueError(f"choices[0].message.content is {type(content).__name__}, not text")
    return content


def _retry_after(response: Any, *, default: float) -> float:
    try:
        seconds = float(response.headers.get("retry-after") or "nan")
    except ValueError:  # the HTTP-date form: rare from model servers; the back-off applies
        return default
    return min(max(seconds, 0.0), 60.0) if math.isfinite(seconds) else default


def _excerpt(text: str) -> str:
    text = (text or "").strip()
    return repr(text[:300]) if text else "(empty body)"
