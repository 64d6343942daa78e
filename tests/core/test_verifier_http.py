"""The HTTP verifier against a real OpenAI-compatible server on loopback.

The server is a small FastAPI app run by uvicorn in a thread; it records every
request and can be told to fail, answer slowly, or refuse, and counts the requests
it is serving at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from grouprl.config import VerifierConfig
from grouprl.rollout.verifier import HTTPVerifier, VerifierError, VerifierRequest, build_verifier

DEFAULT_REPLY = "Correct. What is the cost of one group?\n[SCORE] hallucination_detect=1"


class FakeLLM:
    """What the server does; the test sets it, the server reads it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seen: list[dict] = []  # {"t", "headers", "body"} per request, in arrival order
        self.fail: list[int] = []  # statuses to answer with first, one per request
        self.status: int | None = None  # answer every request with this status
        self.retry_after: dict[str, str] = {"retry-after-ms": "1"}  # sent with failures: retries follow at once
        self.delay = 0.0
        self.required_key: str | None = None
        self.reply: Callable[[dict], str] = lambda body: DEFAULT_REPLY
        self.as_text = False  # answer in the completions style, choices[0].text
        self.usage = True
        self.in_flight = 0
        self.max_in_flight = 0


def create_app(llm: FakeLLM) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        llm.seen.append({"t": time.monotonic(), "headers": dict(request.headers), "body": body})
        llm.in_flight += 1
        llm.max_in_flight = max(llm.max_in_flight, llm.in_flight)
        try:
            await asyncio.sleep(llm.delay)
        finally:
            llm.in_flight -= 1
        if llm.required_key and request.headers.get("authorization") != f"Bearer {llm.required_key}":
            return JSONResponse({"error": {"message": "invalid api key"}}, status_code=401)
        status = llm.fail.pop(0) if llm.fail else llm.status
        if status is not None:
            return JSONResponse({"error": {"message": f"told to answer {status}"}}, status_code=status,
                                headers=llm.retry_after)
        text = llm.reply(body)
        choice = {"index": 0, "text": text} if llm.as_text else {"index": 0, "message": {"role": "assistant",
                                                                                         "content": text}}
        answer = {"id": "x", "object": "chat.completion", "choices": [choice]}
        if llm.usage:
            answer["usage"] = {"prompt_tokens": 10, "completion_tokens": len(text.split()), "total_tokens": 0}
        return answer

    return app


@pytest.fixture(scope="module")
def server(serve_app):
    llm = FakeLLM()
    with serve_app(create_app(llm), timeout_graceful_shutdown=1) as port:
        yield llm, f"http://127.0.0.1:{port}/v1"


@pytest.fixture
def llm(server, monkeypatch):
    monkeypatch.delenv("GROUPRL_VERIFIER_API_KEY", raising=False)
    server[0].reset()
    return server[0]


@pytest.fixture
def make(server):
    built = []

    def make(**values) -> HTTPVerifier:
        values = {"backend": "http", "base_url": server[1], "model": "teacher", "timeout": 5.0, **values}
        verifier = build_verifier(VerifierConfig(**values))
        built.append(verifier)
        return verifier

    yield make
    for verifier in built:
        verifier.close()


def request(*turns: str, reference: str | None = "16") -> VerifierRequest:
    return VerifierRequest(problem="[IMAGE]\nHow much do 12 apples cost at 3 for 4 dollars?", reference=reference,
                           turns=list(turns))


# ---------------------------------------------------------------------------- the request


def test_request_shape_and_bearer_key(llm, make):
    verifier = make(api_key="sk-test", max_tokens=77, temperature=0.3, top_p=0.8)
    (out,) = verifier.reply_many([request("Step 1: 12/3 = 4.", "Step 2: 4*4 = 16?", reference=None)])
    assert not out.failed and out.text == DEFAULT_REPLY and not out.stop and out.score == 1.0
    assert out.tokens == len(DEFAULT_REPLY.split())  # usage.completion_tokens
    (seen,) = llm.seen
    body = seen["body"]
    assert seen["headers"]["authorization"] == "Bearer sk-test"
    assert body["model"] == "teacher" and body["max_tokens"] == 77
    assert body["temperature"] == 0.3 and body["top_p"] == 0.8 and "top_k" not in body  # top_k -1: not sent
    system, user = body["messages"]
    assert system == {"role": "system", "content": verifier.config.prompt_template}
    assert user["role"] == "user"
    text = user["content"]
    problem, rest = text.split("### Reference Answer")
    reference, history = rest.split("### Conversation History")
    assert problem.startswith("### Problem Statement\n[IMAGE]\nHow much")
    assert reference.strip() == "N/A"
    # only the policy's turns, one Assistant line each (the seed's layout); no verifier reply among them
    assert history.count("Assistant:") == 2
    assert "Assistant: Step 1: 12/3 = 4.\nAssistant: Step 2: 4*4 = 16?" in history
    assert "Provide the next piece of guidance" in history


def test_top_k_is_sent_when_set_and_no_key_means_no_header(llm, make):
    make(top_k=5).reply_many([request("a")])
    body, headers = llm.seen[0]["body"], llm.seen[0]["headers"]
    assert body["top_k"] == 5 and "authorization" not in headers
    assert "### Reference Answer\n16\n" in body["messages"][1]["content"]


def test_the_key_comes_from_the_environment(llm, make, monkeypatch):
    monkeypatch.setenv("GROUPRL_VERIFIER_API_KEY", "sk-env")
    llm.required_key = "sk-env"
    (out,) = make().reply_many([request("a")])
    assert not out.failed and llm.seen[0]["headers"]["authorization"] == "Bearer sk-env"


# ---------------------------------------------------------------------------- retries and failures


@pytest.mark.parametrize("status, header, value", [(500, "retry-after-ms", "600"), (503, "retry-after", "0.6"),
                                                   (429, "retry-after-ms", "600")])
def test_retries_after_the_servers_retry_after_then_success(llm, make, status, header, value):
    llm.fail, llm.retry_after = [status, status], {header: value}
    verifier = make(max_retries=3)
    (out,) = verifier.reply_many([request("a")])
    assert not out.failed and out.text == DEFAULT_REPLY
    times = [s["t"] for s in llm.seen]
    assert len(times) == 3
    # Retry-After honoured: 0.6 s is longer than the client's own first waits (at most 0.5 s, then 1 s)
    assert times[1] - times[0] >= 0.6 and times[2] - times[1] >= 0.6
    assert out.latency_s >= 1.2 and verifier.failures == 0


def test_retry_backoff_is_refused_naming_the_key(llm):
    from grouprl.config import ConfigError

    config = VerifierConfig(backend="http", base_url="http://127.0.0.1:9/v1", model="m", retry_backoff=1.0)
    with pytest.raises(ConfigError, match=r"'worker.rollout.verifier.retry_backoff' is no longer supported.*"
                                          r"Retry-After.*'worker.rollout.verifier.max_retries'"):
        build_verifier(config)


def test_a_400_is_not_retried(llm, make):
    llm.status = 400
    verifier = make(max_retries=3)
    (out,) = verifier.reply_many([request("a")])
    assert len(llm.seen) == 1
    assert out.failed and out.stop and out.text == "" and out.score is None
    assert "HTTP 400" in out.error and "1 attempt(s)" in out.error
    assert verifier.failures == 1


def test_a_wrong_key_is_refused_without_retries(llm, make):
    llm.required_key = "right"
    verifier = make(api_key="wrong", on_failure="fail")
    with pytest.raises(VerifierError, match="HTTP 401") as exc:
        verifier.reply_many([request("a")])
    assert exc.value.status == 401 and exc.value.attempts == 1 and len(llm.seen) == 1


def test_timeout_per_request(llm, make):
    llm.delay = 2.0
    verifier = make(timeout=0.2, max_retries=1)
    started = time.monotonic()
    (out,) = verifier.reply_many([request("a")])
    assert time.monotonic() - started < 1.5  # two attempts of 0.2 s, not the server's 2 s
    assert out.failed and out.stop and "timed out after 0.2 s" in out.error and "2 attempt(s)" in out.error


def test_on_failure_fail_raises_naming_url_attempts_and_status(llm, make, server):
    llm.status = 500
    verifier = make(on_failure="fail", max_retries=2)
    with pytest.raises(VerifierError) as exc:
        verifier.reply_many([request("a"), request("b")])
    err = exc.value
    assert err.url == server[1] + "/chat/completions" and err.attempts == 3 and err.status == 500
    assert server[1] in str(err) and "3 attempt(s)" in str(err) and "last status 500" in str(err)
    assert verifier.failures >= 1


def test_on_failure_stop_ends_the_dialogue_but_counts_and_logs(llm, make, caplog):
    llm.status = 500
    verifier = make(max_retries=1)
    with caplog.at_level(logging.WARNING, logger="grouprl.rollout.verifier"):
        replies = verifier.reply_many([request("a"), request("b"), request("c")])
    assert all(r.failed and r.stop and "HTTP 500" in r.error for r in replies)
    assert verifier.failures == 3 and verifier.requests == 3
    assert len(llm.seen) == 6  # 1 retry each
    assert sum("verifier call failed" in r.getMessage() for r in caplog.records) == 3


def test_a_dead_server_fails_after_its_retries(llm, make):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    (out,) = make(base_url=dead, max_retries=2).reply_many([request("a")])
    assert out.failed and out.stop and "3 attempt(s)" in out.error and "ConnectError" in out.error


# ---------------------------------------------------------------------------- concurrency


def test_concurrency_is_bounded_and_order_kept(llm, make):
    llm.delay = 0.15
    llm.reply = lambda body: "Echo " + body["messages"][1]["content"].split("Assistant: ")[-1].split("\n")[0]
    verifier = make(http_concurrency=3)
    replies = verifier.reply_many([request(f"turn {i}") for i in range(10)])
    assert [r.text for r in replies] == [f"Echo turn {i}" for i in range(10)]
    assert llm.max_in_flight == 3
    # the same client serves the next call (the rollout's next turn)
    assert len(verifier.reply_many([request("again")])) == 1 and llm.max_in_flight == 3


def test_reply_many_works_inside_a_running_event_loop(llm, make):
    verifier = make()

    async def caller():
        return verifier.reply_many([request("a")])

    (out,) = asyncio.run(caller())
    assert out.text == DEFAULT_REPLY


# ---------------------------------------------------------------------------- replies


@pytest.mark.parametrize("text, stop, score, cleaned", [
    ("###STOP###", True, None, "###STOP###"),
    ("  ###STOP###\n", True, None, "###STOP###"),
    ("", True, None, ""),
    ("  ...!\n", True, None, "...!"),
    ("User: Check step 2. Why 7?\n[SCORE] hallucination_detect=0", False, 0.0,
     "Check step 2. Why 7?\n[SCORE] hallucination_detect=0"),
    ("User: ###STOP###", True, None, "###STOP###"),
    ("Close. What is 12/3?\n[SCORE] hallucination_detect=1", False, 1.0, None),
])
def test_stop_and_score_of_the_replies(llm, make, text, stop, score, cleaned):
    llm.reply = lambda body: text
    (out,) = make().reply_many([request("a")])
    assert (out.stop, out.score, out.failed) == (stop, score, False)
    assert out.text == (cleaned if cleaned is not None else text.strip())


def test_scores_off_are_not_parsed(llm, make):
    (out,) = make(enable_hallucination_score=False).reply_many([request("a")])
    assert out.score is None and "[SCORE]" in out.text


def test_completions_style_text_and_no_usage(llm, make):
    llm.as_text, llm.usage = True, False
    (out,) = make().reply_many([request("a")])
    assert out.text == DEFAULT_REPLY and out.tokens is None
