"""The reward-server client against a real uvicorn server on 127.0.0.1: batching, concurrency, retries, failures."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
import httpx  # noqa: E402
import uvicorn  # noqa: E402

from grouprl.rewards import RewardSet  # noqa: E402
from grouprl.domains.radiology.server import app as server  # noqa: E402
from grouprl.domains.radiology.server.client import RewardServerClient, RewardServerError, server_base_url  # noqa: E402
from grouprl.domains.radiology.rewards.components import COMPONENTS, Component  # noqa: E402

TOKEN = "t0ken"


def exact(hyps, refs):
    return [1.0 if h.strip() == r.strip() else 0.0 for h, r in zip(hyps, refs)]


def length_ratio(hyps, refs):
    return [min(len(h), len(r)) / max(len(h), len(r), 1) for h, r in zip(hyps, refs)]


class Flaky:
    """Fails the first ``failures`` calls (the server answers 500), then scores; counts calls."""

    def __init__(self):
        self.failures, self.calls = 0, 0
        self.lock = threading.Lock()

    def __call__(self, hyps, refs):
        with self.lock:
            self.calls += 1
            fail = self.calls <= self.failures
        if fail:
            raise RuntimeError(f"transient failure {self.calls}")
        return exact(hyps, refs)


class Slow:
    """Records batch sizes and how many calls overlap; waits ``delay`` seconds (bounded) per call."""

    def __init__(self):
        self.delay, self.active, self.peak, self.sizes = 0.0, 0, 0, []
        self.lock = threading.Lock()
        self.release = threading.Event()

    def __call__(self, hyps, refs):
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
            self.sizes.append(len(hyps))
        try:
            if self.delay:
                self.release.wait(self.delay)
        finally:
            with self.lock:
                self.active -= 1
        return exact(hyps, refs)


FLAKY, SLOW = Flaky(), Slow()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live_server():
    server.load_report_components()
    added = {"c_exact": Component("c_exact", exact, "test=exact"),
             "c_length": Component("c_length", length_ratio, "test=length"),
             "c_flaky": Component("c_flaky", FLAKY, "test=flaky"),
             "c_slow": Component("c_slow", SLOW, "test=slow")}
    saved = {k: COMPONENTS.get(k, None) for k in added}
    COMPONENTS.update(added)
    app = server.create_app(default_components=["c_exact", "c_length"], token=TOKEN, scoring_threads=4,
                            extract_report=lambda text, type: text)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test reward server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        SLOW.release.set()
        uv.should_exit = True
        thread.join(timeout=10)
        sock.close()
        for k, v in saved.items():
            if v is None:
                COMPONENTS.pop(k, None)
            else:
                COMPONENTS[k] = v


def client(url, **kw):
    options = dict(token=TOKEN, timeout=10, retries=2, backoff=0.01)
    options.update(kw)
    return RewardServerClient(url, **options)


HYPS = [f"finding {i}." for i in range(7)]
REFS = [f"finding {i}." if i % 2 == 0 else f"other {i}." for i in range(7)]


def test_url_forms():
    assert server_base_url("http://h:5000/predict") == "http://h:5000"
    assert server_base_url("http://h:5000/") == "http://h:5000"
    assert server_base_url("https://h/api/predict") == "https://h/api"
    with pytest.raises(ValueError):
        server_base_url("h:5000")


def test_score_components_and_final(live_server):
    c = client(live_server + "/predict", components=["c_exact", "c_length"])
    out = c.score(HYPS, REFS)
    assert out["c_exact"] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert out["final_scores"] == pytest.approx([a + b for a, b in zip(out["c_exact"], out["c_length"])])
    assert out["format_ok"] == [1.0] * 7
    assert c.backends == {"c_exact": "test=exact", "c_length": "test=length"}


def test_reward_contract_and_reward_set(live_server):
    c = client(live_server)
    rewards = c(["p"] * 7, HYPS, answer=REFS, other_column=list(range(7)))
    assert rewards == pytest.approx(c.score(HYPS, REFS)["final_scores"])
    partial = c(["p"] * 3, HYPS[:3], answer=[REFS[0], None, REFS[2]])
    assert partial[1] is None and partial[0] == rewards[0] and partial[2] == rewards[2]
    result = RewardSet.from_specs([c]).score(["p"] * 7, HYPS, {"answer": REFS})
    assert result.components["reward_server"] == pytest.approx(rewards)


def test_empty_references_are_skipped_counted_and_logged(live_server, caplog):
    c = client(live_server)
    expected = c(["p"] * 4, HYPS[:4], answer=REFS[:4])
    assert c.skipped_empty_references == 0
    answers = [REFS[0], "", REFS[2], " \n\t"]
    with caplog.at_level("WARNING", logger="grouprl.domains.radiology.server.client"):
        rewards = c(["p"] * 4, HYPS[:4], answer=answers)  # the server would answer 400 to an empty ref
    assert rewards[1] is None and rewards[3] is None
    assert rewards[0] == pytest.approx(expected[0]) and rewards[2] == pytest.approx(expected[2])
    assert c.skipped_empty_references == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "2 of 4" in warnings[0]
    assert c(["p"], ["x"], answer=[""]) == [None]  # all rows empty: nothing sent at all
    assert c.skipped_empty_references == 3  # cumulative over calls


def test_batches_are_split_and_sent_concurrently(live_server):
    SLOW.sizes.clear()
    SLOW.peak, SLOW.delay = 0, 0.3
    try:
        c = client(live_server, components=["c_slow"], batch_size=2, max_concurrency=4)
        out = c.score(HYPS, REFS)
    finally:
        SLOW.delay = 0.0
    assert sorted(SLOW.sizes) == [1, 2, 2, 2]  # 7 reports in batches of 2
    assert SLOW.peak >= 2  # batches overlapped on the server
    assert out["c_slow"] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]  # and come back in order


def test_scoring_does_not_block_the_event_loop(live_server):
    SLOW.release.clear()
    SLOW.delay = 10.0
    c = client(live_server, components=["c_slow"])
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("out", c.score(["a"], ["a"])))
    worker.start()
    try:
        deadline = time.monotonic() + 5
        while SLOW.active == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert SLOW.active == 1
        assert httpx.get(live_server + "/health", timeout=5).json()["status"] == "ok"
        assert SLOW.active == 1  # answered while the batch was still being scored
    finally:
        SLOW.delay = 0.0
        SLOW.release.set()
        worker.join(timeout=10)
    assert box["out"]["c_slow"] == [1.0]


def test_retries_transient_server_errors(live_server):
    FLAKY.calls, FLAKY.failures = 0, 2
    c = client(live_server, components=["c_flaky"], retries=3)
    assert c.score(["a", "b"], ["a", "x"])["c_flaky"] == [1.0, 0.0]
    assert FLAKY.calls == 3  # failed twice, then succeeded


def test_gives_up_loudly_when_errors_persist(live_server):
    FLAKY.calls, FLAKY.failures = 0, 100
    c = client(live_server, components=["c_flaky"], retries=2)
    with pytest.raises(RewardServerError) as info:
        c(["p"], ["a"], answer=["a"])
    assert FLAKY.calls == 3 and info.value.attempts == 3 and info.value.status == 500
    assert "3 attempt(s)" in str(info.value) and "transient failure 3" in str(info.value)
    assert live_server in str(info.value)


def test_nothing_listening_fails_in_bounded_time():
    url = f"http://127.0.0.1:{free_port()}/predict"
    c = RewardServerClient(url, retries=2, backoff=0.05, timeout=2)
    with pytest.raises(RewardServerError) as info:
        c.score(["a"], ["a"])
    assert info.value.attempts == 3 and info.value.status is None
    message = str(info.value)
    assert url in message and "3 attempt(s)" in message and "Connect" in message


def test_client_errors_are_not_retried(live_server):
    c = client(live_server, components=["no_such_component"], retries=3, backoff=5.0)
    with pytest.raises(RewardServerError) as info:
        c.score(["a"], ["a"])
    assert info.value.status == 400 and info.value.attempts == 1
    assert "unknown reward component" in str(info.value) and "c_exact" in str(info.value)


def test_wrong_token_is_a_401(live_server):
    c = client(live_server, token="wrong", backoff=5.0)
    with pytest.raises(RewardServerError) as info:
        c.score(["a"], ["a"])
    assert info.value.status == 401 and "bearer token" in str(info.value)


def test_timeouts_are_retried_then_raised(live_server):
    SLOW.release.clear()
    SLOW.delay = 10.0
    try:
        c = client(live_server, components=["c_slow"], timeout=0.3, retries=1, backoff=0.01)
        with pytest.raises(RewardServerError) as info:
            c.score(["a"], ["a"])
    finally:
        SLOW.delay = 0.0
        SLOW.release.set()
    assert info.value.attempts == 2 and "timed out" in str(info.value)


def test_works_inside_a_running_event_loop(live_server):
    c = client(live_server, batch_size=3)

    async def main():
        from_sync = c(["p"] * 7, HYPS, answer=REFS)  # the trainer's sync call, made from async code
        from_async = await c.ascore(HYPS, REFS)
        return from_sync, from_async["final_scores"]

    from_sync, from_async = asyncio.run(main())
    assert from_sync == from_async and len(from_sync) == 7


def test_bad_inputs_fail_before_any_request():
    c = RewardServerClient("http://127.0.0.1:9/predict")
    with pytest.raises(ValueError, match="answers"):
        c(["p"], ["a", "b"], answer=["a"])
    with pytest.raises(ValueError, match="answer\\[0\\]"):
        c(["p"], ["a"], answer=[3])
    assert c(["p"], ["a"], answer=[None]) == [None]  # no reference: not applicable, nothing sent
    with pytest.raises(ValueError, match="type"):
        RewardServerClient("http://127.0.0.1:9", type="essay")
    assert c.score([], []) == {"final_scores": [], "format_ok": []}


@pytest.mark.skipif(not all(n in server.load_report_components() for n in ("radgraphf1", "cxb14micro", "ratescore")),
                    reason="the real radgraphf1/cxb14micro/ratescore components are not registered yet")
def test_real_composite_over_http():
    pytest.importorskip("grouprl.domains.radiology.rewards.answers")
    app = server.create_app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not uv.started and time.monotonic() < deadline:
            time.sleep(0.02)
        c = RewardServerClient(f"http://127.0.0.1:{sock.getsockname()[1]}/predict", batch_size=2)
        ref = "Mild cardiomegaly. No pleural effusion."
        out = c.score([ref, "Large pleural effusion.", re.sub("Mild", "Severe", ref)], [ref] * 3)
        # no components named: EditGRPO's default sum, whose cxb_bal_acc term adds 7/14 for 14 agreeing labels
        # (the unboxed reports fail the 'short' format: its term is 0 and the content is still scored)
        assert out["final_scores"][0] == pytest.approx(3.5, abs=1e-6)
        assert out["final_scores"][1] < out["final_scores"][0]
        assert set(c.backends) == {"radgraphf1", "cxb14micro", "ratescore", "cxb_bal_acc_editgrpo", "format"}
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        sock.close()
