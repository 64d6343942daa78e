"""One client for OpenAI-compatible ``POST {base_url}/chat/completions`` endpoints, on the ``openai`` SDK.

The LLM judges (:mod:`grouprl.rewards.judge`, GREEN), Guided-GRPO's verifier and the
image VLM judge all call such a server (vLLM, SGLang, a hosted API) through
:class:`ChatEndpoint`, sync or async. The request policy is the SDK's: a timeout per
request, and up to ``max_retries`` further attempts after connection errors, timeouts
and HTTP 408, 409, 429 and 5xx, each after the wait the server asks for
(``Retry-After-ms`` or ``Retry-After``, up to two minutes) or else 0.5 s doubling up to
8 s, less up to a quarter at random. Any other status (a bad key, a bad request) fails
at once: repeating cannot help. Needs ``openai>=2.0``.

What this module adds to the SDK:

- the ``Authorization`` header is ``Bearer <api_key>`` or, with ``api_key`` None (a
  local server), absent; never a key, organisation or header the SDK would otherwise
  take from ``OPENAI_API_KEY``, ``OPENAI_ORG_ID``, ``OPENAI_PROJECT_ID`` or
  ``OPENAI_CUSTOM_HEADERS``: those belong to the user's OpenAI account, not to this
  endpoint;
- the body is sent as given (``top_k`` and other server-specific fields included), and
  the reply is read from the JSON as served: ``choices[0].message.content``, or the
  completions-style ``choices[0].text`` some servers answer with, and
  ``usage.completion_tokens`` when sent;
- a failure is one :class:`ChatCallError` with the attempts made and the last status,
  so that each caller can name its endpoint and row.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

_ENDPOINT = "/chat/completions"
# The SDK insists on a key at construction; with none, this stands in and is never sent
# (every request sets its own Authorization header, or omits it).
_NO_KEY = "no-key"


def chat_completions_url(base_url: str) -> str:
    """``http://host:8000/v1`` (or the endpoint itself) -> ``http://host:8000/v1/chat/completions``."""
    url = base_url.strip().rstrip("/")
    return url if url.endswith(_ENDPOINT) else url + _ENDPOINT


def excerpt(text: str | None) -> str:
    """The start of a response body for an error message."""
    text = (text or "").strip()
    return repr(text[:300]) if text else "(empty body)"


def is_retried(status: int) -> bool:
    """Whether the SDK retries a response with this status (its documented policy); others are refused."""
    return status in (408, 409, 429) or status >= 500


class ChatCallError(RuntimeError):
    """A chat call that gave no reply text: after its retries, refused, or answered without text.

    The message says what went wrong (``HTTP 503: ...``, ``timed out after 5 s (ReadTimeout)``,
    ``ConnectError: ...``); ``status`` is the last HTTP status (None when no answer came),
    ``attempts`` the requests made, ``refused`` whether the server refused the request
    (a status the SDK does not retry).
    """

    def __init__(self, message: str, *, status: int | None = None, attempts: int = 1, refused: bool = False):
        super().__init__(message)
        self.status = status
        self.attempts = attempts
        self.refused = refused


class UnusableReply(ChatCallError):
    """HTTP 200 without ``choices[0].message.content`` or ``choices[0].text``."""


@dataclass
class ChatReply:
    """The reply ``text``, its length in ``tokens`` (``usage.completion_tokens``; None when not sent),
    and the ``attempts`` it took."""

    text: str
    tokens: int | None
    attempts: int


class ChatEndpoint:
    """An OpenAI-compatible chat endpoint: ``complete(body)`` (threads) or ``await acomplete(body)``.

    ``timeout`` seconds per request; ``max_retries`` further attempts (see the module
    docstring); at most ``connections`` open at once. ``transport`` is an httpx transport
    to use instead of the network (tests pass ``httpx.MockTransport``; the async client
    needs an async one). ``extra`` is the grouprl extra named when ``openai`` is missing.
    The async client belongs to the event loop that first uses it.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 60.0, max_retries: int = 3,
                 connections: int = 4, transport: Any = None, extra: str = "judge", user: str = "the chat client"):
        self.openai = require_openai(user, extra)
        self.url = chat_completions_url(base_url)
        self.api_key = api_key or None
        self.timeout = timeout
        self.max_retries = max_retries
        self.connections = connections
        self.transport = transport
        self._sync = self._async = None
        self._lock = threading.Lock()  # judges call from a thread pool

    def __repr__(self) -> str:
        return f"ChatEndpoint({self.url!r}, key={'set' if self.api_key else 'none'})"

    # ------------------------------------------------------------------ clients

    def _client_options(self, http_client: Any) -> dict[str, Any]:
        return {"base_url": self.url[: -len(_ENDPOINT)], "api_key": self.api_key or _NO_KEY,
                "timeout": self.timeout, "max_retries": self.max_retries, "http_client": http_client}

    def _limits(self):
        import httpx

        return httpx.Limits(max_connections=self.connections, max_keepalive_connections=self.connections)

    def client(self):
        """The SDK's ``OpenAI`` client (made on first use) over an ``httpx.Client``."""
        with self._lock:
            if self._sync is None:
                import httpx

                http = httpx.Client(timeout=self.timeout, limits=self._limits(), transport=self.transport)
                self._sync = self.openai.OpenAI(**self._client_options(http))
            return self._sync

    def async_client(self):
        """The SDK's ``AsyncOpenAI`` client (made on first use) over an ``httpx.AsyncClient``."""
        if self._async is None:
            import httpx

            http = httpx.AsyncClient(timeout=self.timeout, limits=self._limits(), transport=self.transport)
            self._async = self.openai.AsyncOpenAI(**self._client_options(http))
        return self._async

    def close(self) -> None:
        with self._lock:
            client, self._sync = self._sync, None
        if client is not None:
            client.close()

    async def aclose(self) -> None:
        self.close()
        if self._async is not None:
            client, self._async = self._async, None
            await client.close()

    # ------------------------------------------------------------------ calls

    def _request(self, body: dict[str, Any]) -> dict[str, Any]:
        body = dict(body)
        model, messages = body.pop("model"), body.pop("messages")
        # Set on every request, so that nothing from the environment reaches this endpoint.
        headers = {"Authorization": f"Bearer {self.api_key}" if self.api_key else self.openai.omit,
                   "OpenAI-Organization": self.openai.omit, "OpenAI-Project": self.openai.omit}
        return {"model": model, "messages": messages, "extra_body": body or None, "extra_headers": headers}

    def complete(self, body: dict[str, Any], *, max_retries: int | None = None) -> ChatReply:
        """Send ``body`` (``model``, ``messages`` and any other fields, as they are) and return the reply.

        ``max_retries`` overrides the endpoint's for this call. Raises :class:`ChatCallError`.
        """
        client = self.client()
        if max_retries is not None and max_retries != self.max_retries:
            client = client.with_options(max_retries=max_retries)
        try:
            raw = client.chat.completions.with_raw_response.create(**self._request(body))
        except self.openai.APIError as exc:
            raise self._error(exc) from exc
        return _reply(raw.http_response, raw.retries_taken + 1)

    async def acomplete(self, body: dict[str, Any], *, max_retries: int | None = None) -> ChatReply:
        """:meth:`complete` on the event loop."""
        client = self.async_client()
        if max_retries is not None and max_retries != self.max_retries:
            client = client.with_options(max_retries=max_retries)
        try:
            raw = await client.chat.completions.with_raw_response.create(**self._request(body))
        except self.openai.APIError as exc:
            raise self._error(exc) from exc
        return _reply(raw.http_response, raw.retries_taken + 1)

    def _error(self, exc: Exception) -> ChatCallError:
        openai = self.openai
        request = getattr(exc, "request", None)
        response = getattr(exc, "response", None)
        if request is None and response is not None:
            request = response.request
        attempts = _attempts(request)
        if isinstance(exc, openai.APIStatusError):
            status = exc.status_code
            return ChatCallError(f"HTTP {status}: {excerpt(_text(exc.response))}", status=status, attempts=attempts,
                                 refused=not is_retried(status))
        cause = exc.__cause__
        if isinstance(exc, openai.APITimeoutError):
            name = type(cause).__name__ if cause is not None else type(exc).__name__
            return ChatCallError(f"timed out after {self.timeout:g} s ({name})", attempts=attempts)
        if isinstance(exc, openai.APIConnectionError):  # refused or reset: the server may be restarting
            return ChatCallError(f"{type(cause or exc).__name__}: {cause or exc or 'connection failed'}",
                                 attempts=attempts)
        return ChatCallError(f"{type(exc).__name__}: {exc}", attempts=attempts)


def require_openai(user: str, extra: str):
    """The ``openai`` module, or an ImportError naming ``user`` and the grouprl extra that installs it."""
    try:
        import openai
    except ImportError as exc:
        raise ImportError(f"{user} needs the openai client: pip install 'grouprl[{extra}]'") from exc
    return openai


def _attempts(request: Any) -> int:
    """The requests made so far: the SDK numbers each one in ``x-stainless-retry-count``."""
    try:
        return int(request.headers.get("x-stainless-retry-count", "0")) + 1
    except (AttributeError, TypeError, ValueError):
        return 1


def _text(response: Any) -> str:
    try:
        return response.text
    except Exception:  # a streamed body that was not read: the status says enough
        return ""


def _reply(response: Any, attempts: int) -> ChatReply:
    """The text and token count of an HTTP 200 answer, read from its JSON as served."""
    try:
        body = response.json()
        choice = body["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise UnusableReply(f"HTTP 200 without choices[0]: {excerpt(_text(response))}", status=200,
                            attempts=attempts) from None
    message = choice.get("message") if isinstance(choice, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        content = choice.get("text") if isinstance(choice, dict) else None  # the completions-style answer
    if not isinstance(content, str):
        raise UnusableReply(f"HTTP 200 with neither choices[0].message.content nor choices[0].text: "
                            f"{excerpt(_text(response))}", status=200, attempts=attempts)
    usage = body.get("usage") if isinstance(body, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        tokens = None
    return ChatReply(content, tokens, attempts)
