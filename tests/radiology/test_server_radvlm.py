"""RadVLM-GRPO's reward workers served by grouprl: its own client's protocol, port layout and fallback scores.

`radvlm_client` below repeats what RadVLM-GRPO's reward functions (verl/custom_rewards/*_reward.py) do
on the wire: endpoints http://{REWARD_NODE_IP}:{WORKER_BASE_PORT + i} for i < WORKER_NUM_GPUS *
WORKER_INSTANCES_PER_GPU, taken round-robin per call; POST {endpoint}/score_<metric> with
json={"pred_text", "true_text"}; a 200 answer's r.json()["score"] is the reward; 429/500/502/503/504 and
connection errors are retried with doubling backoff; any other status raises (raise_for_status).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from live_server import two_free_ports  # noqa: E402  (tests/radiology/live_server.py)
from grouprl.domains.radiology.server import app as server  # noqa: E402
from grouprl.domains.radiology.rewards.components import COMPONENTS, Component  # noqa: E402

MARK = "</think>"


def radvlm_client(node_ip: str, base_port: int, num_gpus: int, instances_per_gpu: int):
    """RadVLM-GRPO's client functions for one metric family, as its reward modules build them from the env."""
    requests = pytest.importorskip("requests")
    endpoints = [f"http://{node_ip}:{base_port + i}" for i in range(num_gpus * instances_per_gpu)]
    lock = threading.Lock()
    counter = [0]

    def next_endpoint():
        with lock:
            i = counter[0]
            counter[0] = i + 1
        return endpoints[i % len(endpoints)]

    def score(metric, pred_text, true_text, retries=3, timeout=5):
        backoff = 0.1
        for attempt in range(retries + 1):
            url = f"{next_endpoint()}/score_{metric}"
            try:
                r = requests.post(url, json={"pred_text": pred_text, "true_text": true_text}, timeout=timeout)
                if r.status_code == 200:
                    return r.json()["score"]
                if r.status_code in (429, 500, 502, 503, 504):
                    if attempt < retries:
                        time.sleep(backoff + random.random() * backoff)
                        backoff *= 2
                        continue
                r.raise_for_status()
            except (requests.ConnectionError, requests.Timeout):
                if attempt < retries:
                    time.sleep(backoff + random.random() * backoff)
                    backoff *= 2
                    continue
                raise
        raise RuntimeError("All retries failed")

    def compute_score(metric, data_source, solution_str, ground_truth):
        """RadVLM's reward entry point: a reasoning response is scored after its last </think>."""
        if data_source == "mimic_grpo":
            return score(metric, solution_str, ground_truth)
        if data_source == "mimic_grpo_reasoning":
            i = solution_str.rfind(MARK)
            if i == -1:
                return -3 if metric == "radcliq" else -0.0
            return score(metric, solution_str[i + len(MARK):].strip(), ground_truth)
        raise AssertionError("incorrect data source.")

    return score, compute_score, endpoints


# ----------------------------------------------------------------------------- the real server, two ports


@pytest.fixture(scope="module")
def radvlm_layout():
    """`grouprl serve rewards --port B --ports 2 --workers 2`: RadVLM's layout, 2 scoring processes."""
    base = two_free_ports()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "grouprl", "serve", "rewards", "--port", str(base), "--ports", "2",
                             "--workers", "2", "--entity-embeddings", "ngram", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        for port in (base, base + 1):
            while True:  # wait until the port answers (a startup guard, not a timed assertion)
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "reward server did not start"
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    time.sleep(0.1)
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


REF = ("Mild cardiomegaly. Small LEFT pleural effusion with adjacent atelectasis. "
       "No pneumothorax. Sternal wires are intact.")
PRED = "Cardiomegaly, mild. Effusion in the left pleura, small. Atelectasis. No pneumothorax."


def test_radvlm_port_layout_with_several_workers(radvlm_layout):
    """RadVLM's client spreads calls over WORKER_BASE_PORT + i; one server with two scoring processes serves
    both ports."""
    httpx = pytest.importorskip("httpx")
    score, compute_score, endpoints = radvlm_client("127.0.0.1", radvlm_layout, num_gpus=1, instances_per_gpu=2)
    pred, true = PRED[:2048].lower(), REF[:2048].lower()
    expected = server.load_report_components()["radgraph_complete"].fn([pred], [true])[0]
    assert 0.0 < expected < 1.0
    for _ in range(2 * len(endpoints)):  # every port, twice
        assert score("radgraph", PRED, REF) == pytest.approx(expected)
    for _ in range(4):  # too short: RadVLM's fallback, not scored; the calls go to both ports in turn
        assert compute_score("radcliq", "mimic_grpo", "ok", REF) == -3
    answered = {endpoint: httpx.get(endpoint + "/health", timeout=10).json() for endpoint in endpoints}
    assert all(h["status"] == "ok" for h in answered.values())
    # every port counts every scoring process's fallbacks: the server's totals, not one process's share
    for health in answered.values():
        assert len(health["scoring"]["pids"]) == 2
        assert health["radvlm"]["fallbacks"]["/score_radcliq"] == {"too_short": 4, "error": 0}


@pytest.fixture(scope="module")
def live_server(serve_app):
    """The real app (real components) under uvicorn on one port."""
    with serve_app(server.create_app(entity_embeddings="ngram")) as port:
        yield port

def test_radvlm_client_gets_radvlms_scores(live_server):
    score, compute_score, _ = radvlm_client("127.0.0.1", live_server, num_gpus=1, instances_per_gpu=1)
    registry = server.load_report_components()
    pred, true = PRED[:2048].lower(), REF[:2048].lower()
    expected = {"radcliq": registry["neg_radcliq"].fn([pred], [true])[0],
                "radgraph": registry["radgraph_complete"].fn([pred], [true])[0],
                "bertscore": registry["bertscore"].fn([pred], [true])[0]}
    assert expected["radcliq"] == pytest.approx(-registry["radcliq"].fn([pred], [true])[0])  # negated RadCliQ-v1
    assert expected["radgraph"] != registry["radgraphf1"].fn([pred], [true])[0]  # complete level, not partial
    for metric, value in expected.items():
        assert score(metric, PRED, REF) == pytest.approx(value, abs=1e-6)
    # the reasoning data source scores what follows the last </think>
    assert compute_score("radcliq", "mimic_grpo_reasoning", "<think>effusion?</think>" + PRED, REF) == \
        pytest.approx(expected["radcliq"], abs=1e-6)
    assert score("radcliq", "ok", REF) == -3.0 and score("bertscore", "ok", REF) == 0.0


# ----------------------------------------------------------------------------- RadVLM's worker rules, in process


class Recorder:
    """A component double that records what it was asked to score."""

    def __init__(self, value=0.5, error=None):
        self.value, self.error, self.calls = value, error, []

    def __call__(self, hyps, refs):
        self.calls.append((hyps, refs))
        if self.error is not None:
            raise self.error
        return [self.value] * len(hyps)


@pytest.fixture
def doubles(monkeypatch):
    server.load_report_components()
    out = {"radcliq": Recorder(-0.9), "bertscore": Recorder(0.4), "radgraph": Recorder(0.3)}
    for metric, name in (("radcliq", "neg_radcliq"), ("bertscore", "bertscore"), ("radgraph", "radgraph_complete")):
        monkeypatch.setitem(COMPONENTS, name, Component(name, out[metric], f"test={metric}"))
    return out


@pytest.fixture
def client(doubles):
    return TestClient(server.create_app(entity_embeddings="ngram"))


def test_texts_are_cut_then_lowercased(client, doubles):
    pred = "İ" * 2100  # "İ".lower() is two characters: lowercasing first would leave 2048 after the cut
    r = client.post("/score_radcliq", json={"pred_text": pred, "true_text": "Pleural EFFUSION. " * 200})
    assert r.status_code == 200 and r.json()["score"] == -0.9 and r.json()["fallback"] is None
    ((hyps, refs),) = doubles["radcliq"].calls
    assert hyps == [("İ" * 2048).lower()] and len(hyps[0]) == 4096
    assert refs == [("Pleural EFFUSION. " * 200)[:2048].lower()]


@pytest.mark.parametrize("metric,fallback", [("radcliq", -3.0), ("bertscore", 0.0), ("radgraph", 0.0)])
def test_five_characters_or_fewer_score_the_fallback(client, doubles, metric, fallback):
    for pred, true in (("abcde", "a long enough reference"), ("a long enough report", "    x")):
        r = client.post(f"/score_{metric}", json={"pred_text": pred, "true_text": true})
        assert r.status_code == 200 and r.json() == {"score": fallback, "fallback": "too_short",
                                                     "backend": f"test={metric}"}
    assert doubles[metric].calls == []
    r = client.post(f"/score_{metric}", json={"pred_text": "abcdef", "true_text": "     x"})  # 6 raw characters
    assert r.json()["fallback"] is None and len(doubles[metric].calls) == 1
    counts = client.get("/health").json()["radvlm"]["fallbacks"][f"/score_{metric}"]
    assert counts == {"too_short": 2, "error": 0}


@pytest.mark.parametrize("metric,fallback", [("radcliq", -3.0), ("bertscore", 0.0), ("radgraph", 0.0)])
def test_scoring_errors_fall_back_logged_and_counted(client, doubles, metric, fallback, caplog):
    doubles[metric].error = RuntimeError("CUDA out of memory")
    with caplog.at_level(logging.WARNING, logger="grouprl.domains.radiology.server.radvlm"):
        r = client.post(f"/score_{metric}", json={"pred_text": "Mild cardiomegaly.", "true_text": "No effusion."})
    assert r.status_code == 200
    assert r.json()["score"] == fallback and r.json()["fallback"] == "error"
    assert "RuntimeError: CUDA out of memory" in r.json()["error"]
    (record,) = [rec for rec in caplog.records if rec.name == "grouprl.domains.radiology.server.radvlm"]
    assert record.levelno == logging.WARNING and "CUDA out of memory" in record.getMessage()
    assert "\n" not in record.getMessage() and record.exc_info is None  # one line, no traceback
    assert client.get("/health").json()["radvlm"]["fallbacks"][f"/score_{metric}"] == {"too_short": 0, "error": 1}
    doubles[metric].error = None
    doubles[metric].value = float("nan")  # a non-finite score is an error too, never a reward
    assert client.post(f"/score_{metric}", json={"pred_text": "Mild cardiomegaly.",
                                                 "true_text": "No effusion."}).json()["fallback"] == "error"
    assert client.get("/health").json()["radvlm"]["fallbacks"][f"/score_{metric}"]["error"] == 2


BAD = [
    ({"true_text": "No effusion."}, "'pred_text'"),
    ({"pred_text": "No effusion."}, "'true_text'"),
    ({"pred_text": "No effusion.", "true_text": 3}, "'true_text' must be a string"),
    ({"pred_text": None, "true_text": "No effusion."}, "'pred_text' must be a string"),
]


@pytest.mark.parametrize("payload,message", BAD)
def test_bad_requests_name_the_key_and_the_server_keeps_serving(client, doubles, payload, message):
    r = client.post("/score_radcliq", json=payload)
    assert r.status_code == 400 and message in r.json()["data"]["message"]
    assert client.post("/score_radcliq", content=b"{not json").status_code == 400
    ok = client.post("/score_radcliq", json={"pred_text": "Mild cardiomegaly.", "true_text": "No effusion."})
    assert ok.status_code == 200 and ok.json()["score"] == -0.9
    assert doubles["radcliq"].calls and all(c == (["mild cardiomegaly."], ["no effusion."])
                                            for c in doubles["radcliq"].calls)
