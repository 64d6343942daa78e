"""The training side of the reward server: a reward function that scores over HTTP.

``RewardServerClient`` follows the reward contract (``client(prompts, completions,
answer=[...]) -> list[float]``, the server's ``final_scores``) and also gives the
per-component values (:meth:`RewardServerClient.score`) so that the trainer can log
them. A batch is split into requests of ``batch_size`` reports sent concurrently
(at most ``max_concurrency`` in flight). Connection errors, timeouts and 5xx
answers are retried with exponential backoff; a 4xx is the request's fault and is
raised at once with the server's message. When the server stays down or answers
with an error, :class:`RewardServerError` is raised: a failure is never turned
into a reward of 0 (EditGRPO's client did that, silently).

A row with no reference report (``answer`` None, empty or only whitespace) is not
sent, since the server refuses empty references with a 400 that would end
training; its reward is None ("not applicable"). Empty ones are counted in
:attr:`RewardServerClient.skipped_empty_references` and logged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

logger = logging.getLogger(__name__)

REPORT_TYPES = ("short", "cot", "free_form")


class RewardServerError(RuntimeError):
    """The reward server could not score a batch (down, timing out, or answering with an error).

    ``url`` is the endpoint, ``attempts`` how many requests were made, ``status``
    the last HTTP status (None when no answer came back).
    """

    def __init__(self, message: str, *, url: str, attempts: int, status: int | None = None):
        super().__init__(message)
        self.url = url
        self.attempts = attempts
        self.status = status


class _Retryable(Exception):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def server_base_url(url: str) -> str:
    """``http://host:5000/predict`` (EditGRPO's setting) or ``http://host:5000`` -> ``http://host:5000``."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"reward server URL must be a non-empty string, got {url!r}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"reward server URL must look like http://host:port[/predict], got {url!r}")
    path = parts.path.rstrip("/")
    for endpoint in ("/predict", "/analyze", "/health"):
        if path.endswith(endpoint):
            path = path[: -len(endpoint)]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class RewardServerClient:
    """Score reports on a grouprl (or EditGRPO) reward server.

    ``components``: the components to request (None: the server's default, EditGRPO's
    composite radgraphf1 + cxb14micro + ratescore + cxb_bal_acc_editgrpo / 14 + format,
    where the format term counts only under ``short`` and ``cot``). ``type``: ``short`` / ``cot`` / ``free_form`` (the server's format
    check). ``timeout`` is per request in seconds; ``retries`` is how many times a
    failed request is repeated (so at most ``retries + 1`` attempts), waiting
    ``backoff * 2**k`` seconds before repeat ``k + 1``.
    """

    __name__ = "reward_server"  # the reward's key when it is used in a RewardSet

    def __init__(
        self,
        url: str,
        *,
        components: Sequence[str] | None = None,
        type: str = "free_form",
        batch_size: int = 64,
        max_concurrency: int = 4,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
        token: str | None = None,
    ):
        self.base_url = server_base_url(url)
        self.url = self.base_url + "/predict"
        if type not in REPORT_TYPES:
            raise ValueError(f"type must be one of {', '.join(REPORT_TYPES)}, got {type!r}")
        if components is not None:
            if isinstance(components, str) or not all(isinstance(c, str) and c for c in components):
                raise ValueError(f"components must be a list of component names, got {components!r}")
            components = list(components)
        for name, value in (("batch_size", batch_size), ("max_concurrency", max_concurrency)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a non-negative integer, got {retries!r}")
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not (backoff >= 0 and math.isfinite(backoff)):
            raise ValueError(f"backoff must be a non-negative number of seconds, got {backoff!r}")
        self.components = components
        self.type = type
        self.batch_size = batch_size
        self.max_concurrency = max_concurrency
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = float(backoff)
        self.token = token
        self.backends: dict[str, str] = {}  # component -> backend, from the last answer
        self.last_scores: dict[str, list[float]] = {}  # score()'s result for the last batch
        # Rows whose reference was empty or whitespace, over every call: not sent, reward None.
        self.skipped_empty_references = 0

    # ------------------------------------------------------------------ the reward contract

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], *, answer: Sequence[Any],
                 **columns: Any) -> list[float | None]:
        """The reward: the server's ``final_scores`` of each completion against its ``answer``.

        A row whose ``answer`` is None, empty or only whitespace has no reference report:
        it is not sent and its reward is None ("not applicable", the contract's meaning).
        Empty ones are added to :attr:`skipped_empty_references` and logged once per call.
        """
        hyps = [_completion_text(c, i) for i, c in enumerate(completions)]
        if len(answer) != len(hyps):
            raise ValueError(f"got {len(answer)} answers for {len(hyps)} completions")
        rows = _rows_with_reference(answer)
        self._note_empty_references(answer, rows)
        final = self.score([hyps[i] for i in rows], [answer[i] for i in rows])["final_scores"]
        out: list[float | None] = [None] * len(hyps)
        for i, value in zip(rows, final):
            out[i] = value
        return out

    def _note_empty_references(self, answer: Sequence[Any], rows: list[int]) -> None:
        empty = sum(1 for a in answer if a is not None) - len(rows)
        if not empty:
            return
        self.skipped_empty_references += empty
        # One line per batch: a data set with many empty references must not flood the log.
        logger.warning("%d of %d rows have an empty reference report; not sent to the reward server %s, "
                       "their reward is None (%d skipped so far)", empty, len(answer), self.url,
                       self.skipped_empty_references)

    def score(self, hyps: Sequence[str], refs: Sequence[str]) -> dict[str, list[float]]:
        """Every requested component's per-sample values, ``final_scores`` and ``format_ok`` (1.0 / 0.0).

        Safe to call from inside a running event loop (it then runs on its own loop in
        a worker thread); from async code prefer :meth:`ascore`.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.ascore(hyps, refs))
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grouprl-reward-client") as pool:
            return pool.submit(asyncio.run, self.ascore(hyps, refs)).result()

    async def ascore(self, hyps: Sequence[str], refs: Sequence[str]) -> dict[str, list[float]]:
        """:meth:`score` for async callers."""
        import httpx

        hyps, refs = list(hyps), list(refs)
        if len(hyps) != len(refs):
            raise ValueError(f"got {len(hyps)} hypotheses for {len(refs)} references")
        if not hyps:
            return {name: [] for name in [*(self.components or []), "final_scores", "format_ok"]}
        starts = range(0, len(hyps), self.batch_size)
        limit = asyncio.Semaphore(self.max_concurrency)
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as http:

            async def one(start: int) -> dict[str, Any]:
                async with limit:
                    return await self._post(http, hyps[start:start + self.batch_size],
                                            refs[start:start + self.batch_size])

            tasks = [asyncio.ensure_future(one(s)) for s in starts]
            try:
                answers = await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        out: dict[str, list[float]] = {}
        for data in answers:
            for key, values in data["scores"].items():
                out.setdefault(key, []).extend(values)
            self.backends.update(data["backends"])
        self.last_scores = out
        return out

    # ------------------------------------------------------------------ one request

    def _payload(self, hyps: list[str], refs: list[str]) -> dict[str, Any]:
        payload: dict[str, Any] = {"hyps": hyps, "refs": refs, "type": self.type, "editgrpo_keys": False}
        if self.components is not None:
            payload["requested_reward_components"] = self.components
        return payload

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json; charset=utf-8"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    async def _post(self, http, hyps: list[str], refs: list[str]) -> dict[str, Any]:
        import httpx

        payload, headers = self._payload(hyps, refs), self._headers()
        attempts, last_error, last_status = 0, "", None
        started = time.monotonic()
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            attempts += 1
            try:
                response = await http.post(self.url, json=payload, headers=headers)
                return self._parse(response, len(hyps))
            except RewardServerError as exc:  # the server answered and refused: repeating cannot help
                exc.attempts = attempts
                raise
            except _Retryable as exc:
                last_error, last_status = str(exc), exc.status
            except httpx.TimeoutException as exc:
                last_error, last_status = f"timed out after {self.timeout:g} s ({type(exc).__name__})", None
            except httpx.TransportError as exc:
                last_error, last_status = f"{type(exc).__name__}: {exc or 'connection failed'}", None
        elapsed = time.monotonic() - started
        raise RewardServerError(
            f"reward server {self.url} failed after {attempts} attempt(s) over {elapsed:.1f} s; "
            f"last error: {last_error}",
            url=self.url, attempts=attempts, status=last_status,
        )

    def _parse(self, response, n: int) -> dict[str, Any]:
        status = response.status_code
        message = _server_message(response)
        if status >= 500:
            raise _Retryable(f"HTTP {status}: {message}", status)
        if status != 200:
            raise RewardServerError(f"reward server {self.url} refused the request (HTTP {status}): {message}",
                                    url=self.url, attempts=1, status=status)
        try:
            body = response.json()
        except ValueError:
            raise RewardServerError(f"reward server {self.url} answered HTTP 200 with non-JSON: {message}",
                                    url=self.url, attempts=1, status=status) from None
        if not isinstance(body, dict) or body.get("result") != "success":
            raise RewardServerError(f"reward server {self.url} answered with an error: {message}",
                                    url=self.url, attempts=1, status=status)
        data = body.get("data") or {}
        predictions = data.get("predictions")
        if not isinstance(predictions, dict):
            raise RewardServerError(f"reward server {self.url} answered without data.predictions",
                                    url=self.url, attempts=1, status=status)
        wanted = [*(self.components or data.get("components") or []), "final_scores"]
        scores: dict[str, list[float]] = {}
        for key in wanted:
            scores[key] = self._values(predictions, key, n)
        if "format_ok" in predictions:
            scores["format_ok"] = [1.0 if v else 0.0 for v in self._values(predictions, "format_ok", n, flags=True)]
        backends = data.get("backends") if isinstance(data.get("backends"), dict) else {}
        return {"scores": scores, "backends": {str(k): str(v) for k, v in backends.items()}}

    def _values(self, predictions: dict[str, Any], key: str, n: int, *, flags: bool = False) -> list[Any]:
        values = predictions.get(key)
        if not isinstance(values, list) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, list) else "nothing"
            raise RewardServerError(f"reward server {self.url} answered {got} for {key!r}; expected {n}",
                                    url=self.url, attempts=1)
        if flags:
            return values
        out = []
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RewardServerError(f"reward server {self.url} answered {v!r} in {key!r}; expected finite numbers",
                                        url=self.url, attempts=1)
            out.append(float(v))
        return out

    def health(self) -> dict[str, Any]:
        """The server's ``GET /health`` answer (raises RewardServerError when it does not answer)."""
        import httpx

        try:
            response = httpx.get(self.base_url + "/health", timeout=self.timeout, headers=self._headers())
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise RewardServerError(f"reward server {self.base_url}/health: {type(exc).__name__}: {exc}",
                                    url=self.base_url + "/health", attempts=1) from exc

    def __repr__(self) -> str:
        return (f"RewardServerClient({self.url!r}, components={self.components}, type={self.type!r}, "
                f"batch_size={self.batch_size}, max_concurrency={self.max_concurrency})")


def _rows_with_reference(answer: Sequence[Any]) -> list[int]:
    """Indices of the rows whose reference report has text (None, "" and whitespace have none)."""
    rows = []
    for i, a in enumerate(answer):
        if a is None:
            continue
        if not isinstance(a, str):
            raise ValueError(f"answer[{i}] must be the reference report text, got {type(a).__name__}")
        if a.strip():
            rows.append(i)
    return rows


def _completion_text(completion: Any, i: int) -> str:
    if isinstance(completion, str):
        return completion
    # TRL's conversational completions: a list of messages, the reply last.
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise ValueError(f"completions[{i}] must be text (or a list of chat messages), got {type(completion).__name__}")


def _server_message(response) -> str:
    try:
        body = response.json()
        message = body["data"]["message"]
        if isinstance(message, str):
            return message
    except (ValueError, KeyError, TypeError):
        pass
    text = response.text.strip()
    return text[:500] if text else f"(empty HTTP {response.status_code} answer)"


# EditGRPO's trainer requests these when its config names none
TRAINER_DEFAULT_COMPONENTS = ("radgraphf1", "cxb14micro", "ratescore")


def client_from_config(reward) -> RewardServerClient:
    """The client for ``worker.reward.reward_server`` and its keys (``reward`` is that config section).

    The bearer token comes from ``$GROUPRL_REWARD_TOKEN``, never from a config file.
    """
    components = list(reward.reward_components) if reward.reward_components is not None \
        else list(TRAINER_DEFAULT_COMPONENTS)
    return RewardServerClient(
        reward.reward_server, components=components, type=reward.type, batch_size=reward.server_batch_size,
        max_concurrency=reward.server_max_concurrency, timeout=reward.server_timeout, retries=reward.server_retries,
        token=os.environ.get("GROUPRL_REWARD_TOKEN"))
