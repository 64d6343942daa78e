"""The one OpenAI-compatible chat client (grouprl.rewards.chat_endpoint, on the openai SDK), through
httpx.MockTransport: headers, the body as sent, replies, attempts, refusals, and the missing extra."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")

from grouprl.config import VerifierConfig
from grouprl.rewards.chat_endpoint import ChatCallError, ChatEndpoint, UnusableReply, chat_completions_url
from grouprl.rewards.judge import ChatJudge, JudgeError
from grouprl.rollout.verifier import build_verifier


def answer(content="fine", *, usage=True, as_text=False):
    choice = {"index": 0, "text": content} if as_text else {"index": 0, "message": {"role": "assistant",
                                                                                     "content": content}}
    body = {"id": "x", "object": "chat.completion", "choices": [choice]}
    if usage:
        body["usage"] = {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
    return httpx.Response(200, json=body)


class Server:
    """Answers from ``script`` (responses or exceptions, one per request), then ``answer()``; records requests."""

    def __init__(self, *script):
        self.script, self.seen = list(script), []

    def __call__(self, request):
        self.seen.append(request)
        item = self.script.pop(0) if self.script else answer()
        if isinstance(item, Exception):
            raise item
        return item

    def body(self, i=0):
        return json.loads(self.seen[i].content)


def failing(status):
    return httpx.Response(status, json={"error": {"message": f"told to answer {status}"}},
                          headers={"retry-after-ms": "1"})


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0.0}


def test_url_and_the_body_as_given():
    assert chat_completions_url("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h:8000/v1/chat/completions") == "http://h:8000/v1/chat/completions"
    server = Server()
    # the endpoint itself as base_url: requests still go to it, not to .../chat/completions/chat/completions
    endpoint = ChatEndpoint("http://h:8000/v1/chat/completions", transport=httpx.MockTransport(server))
    reply = endpoint.complete({**BODY, "top_k": 5, "repetition_penalty": 1.1})
    assert (reply.text, reply.tokens, reply.attempts) == ("fine", 7, 1)
    assert str(server.seen[0].url) == "http://h:8000/v1/chat/completions"
    assert server.body() == {**BODY, "top_k": 5, "repetition_penalty": 1.1}  # server-specific fields sent as given


def test_no_key_sends_no_authorization_and_nothing_from_the_openai_environment(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-users-openai-key")
    monkeypatch.setenv("OPENAI_ORG_ID", "org-user")
    monkeypatch.setenv("OPENAI_PROJECT_ID", "proj-user")
    monkeypatch.setenv("OPENAI_CUSTOM_HEADERS", "Authorization: Bearer sk-from-env")
    server = Server()
    ChatEndpoint("http://h/v1", transport=httpx.MockTransport(server)).complete(BODY)
    ChatEndpoint("http://h/v1", api_key="sk-judge", transport=httpx.MockTransport(server)).complete(BODY)
    without, with_key = (server.seen[0].headers, server.seen[1].headers)
    assert "authorization" not in without
    assert with_key["authorization"] == "Bearer sk-judge"
    for headers in (without, with_key):
        assert "openai-organization" not in headers and "openai-project" not in headers


def test_completions_style_text_no_usage_and_no_text():
    server = Server(answer("from text", usage=False, as_text=True),
                    httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": None}}]}),
                    httpx.Response(200, text="not json"))
    endpoint = ChatEndpoint("http://h/v1", transport=httpx.MockTransport(server))
    reply = endpoint.complete(BODY)
    assert reply.text == "from text" and reply.tokens is None
    with pytest.raises(UnusableReply, match="neither choices.0..message.content nor choices.0..text") as info:
        endpoint.complete(BODY)
    assert info.value.status == 200 and not info.value.refused
    with pytest.raises(UnusableReply, match="without choices.0.*'not json'"):
        endpoint.complete(BODY)
    assert len(server.seen) == 3  # an HTTP 200 is never repeated by the endpoint itself


def test_retries_count_attempts_and_refusals_are_not_retried():
    server = Server(failing(503), failing(429), answer())
    endpoint = ChatEndpoint("http://h/v1", max_retries=3, transport=httpx.MockTransport(server))
    assert endpoint.complete(BODY).attempts == 3
    server.script = [failing(503), failing(401)]
    with pytest.raises(ChatCallError, match="HTTP 401: .*told to answer 401") as info:
        endpoint.complete(BODY)
    assert (info.value.status, info.value.attempts, info.value.refused) == (401, 2, True)
    server.script = [failing(500)] * 5
    with pytest.raises(ChatCallError, match="HTTP 500") as info:
        endpoint.complete(BODY, max_retries=1)  # this call's own budget
    assert (info.value.status, info.value.attempts, info.value.refused) == (500, 2, False)
    assert len(server.seen) == 3 + 2 + 2


def test_connection_errors_and_timeouts_name_what_failed():
    request = httpx.Request("POST", "http://h/v1/chat/completions")
    server = Server(httpx.ConnectError("connection refused", request=request),
                    httpx.ReadTimeout("slow", request=request))
    endpoint = ChatEndpoint("http://h/v1", timeout=0.5, max_retries=0, transport=httpx.MockTransport(server))
    with pytest.raises(ChatCallError, match="ConnectError: connection refused") as info:
        endpoint.complete(BODY)
    assert info.value.status is None and info.value.attempts == 1 and not info.value.refused
    with pytest.raises(ChatCallError, match=r"timed out after 0.5 s \(ReadTimeout\)"):
        endpoint.complete(BODY)


def test_async_calls_share_the_policy():
    server = Server(failing(502), answer("async", as_text=True))

    async def main():
        endpoint = ChatEndpoint("http://h/v1", api_key="k", transport=httpx.MockTransport(server))
        try:
            reply = await endpoint.acomplete(BODY)
            server.script = [failing(400)]
            with pytest.raises(ChatCallError, match="HTTP 400") as info:
                await endpoint.acomplete(BODY)
            return reply, info.value
        finally:
            await endpoint.aclose()

    reply, error = asyncio.run(main())
    assert (reply.text, reply.attempts) == ("async", 2) and error.refused and error.attempts == 1
    assert all(r.headers["authorization"] == "Bearer k" for r in server.seen)


def test_chat_judge_retries_unusable_replies_within_one_budget():
    server = Server(failing(503), answer("no verdict"), answer("still none"), answer("verdict: 4"))

    def parse(text):
        if not text.startswith("verdict: "):
            raise ValueError(f"no verdict in {text!r}")
        return int(text.split(": ")[1])

    judge = ChatJudge("http://h/v1", "m", api_key_env="NO_SUCH_VARIABLE", max_retries=3, backoff=0.0,
                      transport=httpx.MockTransport(server))
    assert judge.judge(BODY["messages"], parse) == (4, "verdict: 4")
    assert len(server.seen) == 4 and "authorization" not in server.seen[0].headers
    judge.close()
    server.script, server.seen = [answer("no verdict")] + [failing(503)] * 3, []
    with ChatJudge("http://h/v1", "m", max_retries=2, backoff=0.0, transport=httpx.MockTransport(server)) as judge:
        with pytest.raises(JudgeError, match=r"failed for row 3 after 3 attempt\(s\) \(last status 503\): "
                                             r"HTTP 503") as info:
            judge.judge(BODY["messages"], parse, item="row 3")
    # the re-asked reply and the SDK's retries of the 503s share max_retries: 3 requests, not more
    assert info.value.attempts == 3 and len(server.seen) == 3 and not info.value.refused


@pytest.mark.parametrize("build, extra", [
    (lambda: ChatJudge("http://h/v1", "m"), "judge"),
    (lambda: build_verifier(VerifierConfig(backend="http", base_url="http://h/v1", model="m")), "guided"),
])
def test_a_missing_openai_names_the_extra(monkeypatch, build, extra):
    # the domains' judges: tests/radiology/test_green_chat_endpoint.py, tests/diffusion/test_vlm_judge_chat_endpoint.py
    monkeypatch.setitem(sys.modules, "openai", None)  # import openai now raises ImportError
    with pytest.raises(ImportError, match=rf"needs the openai client: pip install 'grouprl\[{extra}\]'"):
        build()
