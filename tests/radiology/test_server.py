"""The reward server: EditGRPO's /predict shape, the composite, format failures, bad requests, auth, /analyze,
and `serve rewards --workers 2`'s pool of scoring processes.

EditGRPO-specific behaviours beyond the shape (embeddings, /extract, long reports, slow bodies) are in
test_server_editgrpo.py; RadVLM-GRPO's worker routes in test_server_radvlm.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from live_server import two_free_ports  # noqa: E402  (tests/radiology/live_server.py)
from grouprl.domains.radiology.server import app as server  # noqa: E402
from grouprl.domains.radiology.rewards.components import COMPONENTS, Component  # noqa: E402


def exact(hyps, refs):
    return [1.0 if h.strip().lower() == r.strip().lower() else 0.0 for h, r in zip(hyps, refs)]


def overlap(hyps, refs):
    out = []
    for h, r in zip(hyps, refs):
        a, b = set(re.findall(r"\w+", h.lower())), set(re.findall(r"\w+", r.lower()))
        out.append(len(a & b) / len(a | b) if a | b else 0.0)
    return out


def boxed_extract(text, type):
    """Test double of answers.extract_report: EditGRPO's short / cot / free_form format rules."""
    if type == "free_form":
        return text
    if type == "cot" and not re.search(r"<think>.*?</think>.*\\boxed\{", text, re.S):
        return None
    m = re.search(r"\\boxed\{(.*)\}", text, re.S)
    return m.group(1).strip() if m else None


CALLS: list[int] = []


def counted_exact(hyps, refs):
    CALLS.append(len(hyps))
    return exact(hyps, refs)


def broken(hyps, refs):
    raise RuntimeError("labeler exploded")


@pytest.fixture
def components(monkeypatch):
    server.load_report_components()  # the real modules register first; ours are added on top
    for name, fn, backend in (("t_exact", exact, "test=exact"), ("t_overlap", overlap, "test=overlap"),
                              ("t_counted", counted_exact, "test=exact"), ("t_broken", broken, "test=broken")):
        monkeypatch.setitem(COMPONENTS, name, Component(name, fn, backend))
    CALLS.clear()
    return COMPONENTS


def make_client(**kwargs):
    options = dict(default_components=["t_exact", "t_overlap"], extract_report=boxed_extract, entity_embeddings="ngram")
    options.update(kwargs)
    return TestClient(server.create_app(**options))


@pytest.fixture
def client(components):
    return make_client()


def post(client, payload, headers=None):
    return client.post("/predict", content=json.dumps(payload),
                       headers={"Content-Type": "application/json", **(headers or {})})


HYPS = ["No pleural effusion.", "Small left pleural effusion.", "Heart size is normal."]
REFS = ["No pleural effusion.", "No pleural effusion.", "Cardiomegaly."]


def test_predict_success_shape_and_composite(client):
    r = post(client, {"hyps": HYPS, "refs": REFS, "type": "free_form",
                      "requested_reward_components": ["t_exact", "t_overlap"], "editgrpo_keys": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"result", "data"} and body["result"] == "success"
    assert set(body["data"]) == {"predictions", "backends", "type", "components", "weights", "truncated"}
    predictions = body["data"]["predictions"]
    assert set(predictions) == {"t_exact", "t_overlap", "final_scores", "format_ok", "format_scores"}
    assert predictions["t_exact"] == [1.0, 0.0, 0.0]
    assert predictions["t_overlap"] == pytest.approx([1.0, 2 / 5, 0.0])
    assert predictions["final_scores"] == pytest.approx([2.0, 0.4, 0.0])
    assert predictions["format_ok"] == [True, True, True]
    assert body["data"]["backends"] == {"t_exact": "test=exact", "t_overlap": "test=overlap"}


def test_default_components_and_one_call_per_batch(components):
    client = make_client(default_components=["t_counted"])
    r = post(client, {"hyps": HYPS, "refs": REFS, "type": "free_form", "editgrpo_keys": False})
    assert r.status_code == 200, r.text
    assert set(r.json()["data"]["predictions"]) == {"t_counted", "final_scores", "format_ok", "format_scores"}
    assert CALLS == [3]  # batched: one component call for the whole request


def test_all_components_of_a_request_share_one_parse_scope(components, monkeypatch):
    """Each distinct text is parsed once per request: every component runs inside the same batch scope."""
    from grouprl.domains.radiology.rewards.batch_parses import active_scope

    seen = []

    def scoped(hyps, refs):
        seen.append(active_scope())
        return exact(hyps, refs)

    monkeypatch.setitem(COMPONENTS, "t_scoped_a", Component("t_scoped_a", scoped, "test=a"))
    monkeypatch.setitem(COMPONENTS, "t_scoped_b", Component("t_scoped_b", scoped, "test=b"))
    client = make_client(default_components=["t_scoped_a", "t_scoped_b"])
    r = post(client, {"hyps": HYPS, "refs": REFS, "type": "free_form", "editgrpo_keys": False})
    assert r.status_code == 200, r.text
    assert len(seen) == 2 and seen[0] is not None and seen[0] is seen[1]


def test_listening_sockets_are_tcp_so_connections_get_nodelay():
    """asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP; with proto 0 a keep-alive
    client's next request waited out the 40 ms delayed-ACK timer."""
    import socket

    sockets = server.bind_sockets("127.0.0.1", 0)
    try:
        assert sockets[0].proto == socket.IPPROTO_TCP
    finally:
        for sock in sockets:
            sock.close()


def test_format_failures_lose_only_the_format_term(client):
    """EditGRPO's server still scores the content of a response that fails its format."""
    hyps = ["\\boxed{No pleural effusion.}", "No pleural effusion.",
            "<think>effusion?</think> \\boxed{No pleural effusion.}", "\\boxed{No pleural effusion.}"]
    refs = ["No pleural effusion."] * 4
    short = post(client, {"hyps": hyps, "refs": refs, "type": "short", "editgrpo_keys": False}).json()
    p = short["data"]["predictions"]
    assert p["format_ok"] == [True, False, True, True]
    assert p["t_exact"] == [1.0, 0.0, 1.0, 1.0]  # no box at all: the content is the empty report
    assert p["final_scores"] == [2.0, 0.0, 2.0, 2.0]
    cot = post(client, {"hyps": hyps, "refs": refs, "type": "cot", "editgrpo_keys": False}).json()
    p = cot["data"]["predictions"]
    assert p["format_ok"] == [False, False, True, False]
    # the boxed report of a response without its <think> block is still scored
    assert p["t_exact"] == [1.0, 0.0, 1.0, 1.0] and p["t_overlap"] == [1.0, 0.0, 1.0, 1.0]
    assert p["final_scores"] == [2.0, 0.0, 2.0, 2.0]
    assert p["format_scores"] == [0.0, 0.0, 1.0, 0.0]
    with_format = post(client, {"hyps": hyps, "refs": refs, "type": "cot", "editgrpo_keys": False,
                                "requested_reward_components": ["t_exact", "t_overlap", "format"]}).json()
    assert with_format["data"]["predictions"]["final_scores"] == [2.0, 0.0, 3.0, 2.0]  # only the format term drops


def test_format_pseudo_component_follows_editgrpo(client):
    hyps, refs = ["\\boxed{No pleural effusion.}", "nothing boxed"], ["No pleural effusion."] * 2
    p = post(client, {"hyps": hyps, "refs": refs, "type": "short", "editgrpo_keys": False,
                      "requested_reward_components": ["t_exact", "format"]}).json()["data"]["predictions"]
    assert p["format"] == [1.0, 0.0] and p["final_scores"] == [2.0, 0.0]
    p = post(client, {"hyps": refs, "refs": refs, "type": "free_form", "editgrpo_keys": False,
                      "requested_reward_components": ["t_exact", "format"]}).json()["data"]["predictions"]
    assert p["final_scores"] == [1.0, 1.0]  # EditGRPO adds no format score under free_form
    data = post(client, {"hyps": refs, "refs": refs, "type": "free_form", "editgrpo_keys": False,
                         "requested_reward_components": ["format"]}).json()["data"]
    assert data["predictions"]["final_scores"] == [0.0, 0.0]  # a composite left with no term is 0, not unscored
    assert data["weights"] == {"format": 1.0}


def test_editgrpo_key_names_carry_mapped_components(client, monkeypatch):
    monkeypatch.setattr(server, "EDITGRPO_KEYS", {"f1_test_scores": "t_exact", "micro_test": "t_overlap"})
    r = post(client, {"hyps": HYPS, "refs": REFS, "type": "free_form", "requested_reward_components": ["t_exact"]})
    p = r.json()["data"]["predictions"]
    assert p["f1_test_scores"] == p["t_exact"] == [1.0, 0.0, 0.0]
    assert p["micro_test"] == pytest.approx([1.0, 0.4, 0.0])  # computed for EditGRPO's client...
    assert "t_overlap" not in p and p["final_scores"] == [1.0, 0.0, 0.0]  # ...but not part of the composite


BAD_REQUESTS = [
    ("malformed JSON", b'{"hyps": ["a"], "refs": ', "malformed JSON"),
    ("not an object", b'["a", "b"]', "expected a JSON object"),
    ("empty body", b"", "empty request body"),
    ("invalid UTF-8", b'{"hyps": ["\xff\xfe"], "refs": ["x"]}', "not valid UTF-8"),
    ("NaN constant", b'{"hyps": ["a"], "refs": ["b"], "x": NaN}', "NaN"),
    ("missing hyps", {"refs": ["a"]}, "missing 'hyps'"),
    ("missing refs", {"hyps": ["a"]}, "missing 'refs'"),
    ("hyps not a list", {"hyps": "a", "refs": ["a"]}, "'hyps' must be a list"),
    ("unequal lengths", {"hyps": ["a", "b"], "refs": ["a"]}, "must pair up"),
    ("non-string item", {"hyps": ["a", 3], "refs": ["a", "b"]}, "hyps[1] must be a string"),
    ("null item", {"hyps": ["a"], "refs": [None]}, "refs[0] must be a string"),
    ("empty lists", {"hyps": [], "refs": []}, "'hyps' is empty"),
    ("blank reference", {"hyps": ["a"], "refs": ["   "]}, "refs[0] is empty"),
    ("bad type", {"hyps": ["a"], "refs": ["a"], "type": "essay"}, "'type' must be one of"),
    ("components not a list", {"hyps": ["a"], "refs": ["a"], "requested_reward_components": "t_exact"},
     "must be a list"),
    ("duplicate components", {"hyps": ["a"], "refs": ["a"], "requested_reward_components": ["t_exact", "t_exact"]},
     "more than once"),
    ("too many items", {"hyps": ["a"] * 5, "refs": ["a"] * 5}, "at most 4"),
]


@pytest.mark.parametrize("name,payload,message", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_400_and_the_server_keeps_serving(components, name, payload, message):
    client = make_client(max_batch=4, max_chars=100)
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    r = client.post("/predict", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["result"] == "error"
    assert message in r.json()["data"]["message"]
    assert client.get("/health").json()["status"] == "ok"
    ok = post(client, {"hyps": ["a"], "refs": ["a"], "type": "free_form"})
    assert ok.status_code == 200


def test_unknown_component_lists_the_known_ones(client):
    r = post(client, {"hyps": ["a"], "refs": ["a"], "requested_reward_components": ["radgraph_f1_typo"]})
    assert r.status_code == 400
    message = r.json()["data"]["message"]
    assert "radgraph_f1_typo" in message and "t_exact" in message and "t_overlap" in message


def test_oversized_body_gets_413(components):
    client = make_client(max_body_bytes=200)
    big = json.dumps({"hyps": ["x" * 300], "refs": ["y"]}).encode()
    r = client.post("/predict", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "limit of 200 bytes" in r.json()["data"]["message"]

    def chunks():  # no Content-Length: the limit must hold while the body streams in
        for _ in range(10):
            yield b" " * 50

    r = client.post("/predict", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert client.get("/health").status_code == 200


def test_component_failure_is_500_and_the_server_keeps_serving(client):
    r = post(client, {"hyps": ["a"], "refs": ["a"], "type": "free_form", "requested_reward_components": ["t_broken"]})
    assert r.status_code == 500
    message = r.json()["data"]["message"]
    assert "t_broken" in message and "labeler exploded" in message and r.json()["result"] == "error"
    assert client.get("/health").status_code == 200
    assert post(client, {"hyps": ["a"], "refs": ["a"], "type": "free_form"}).status_code == 200


def test_token_auth(components):
    client = make_client(token="s3cret")
    payload = {"hyps": ["a"], "refs": ["a"], "type": "free_form"}
    assert post(client, payload).status_code == 401
    assert post(client, payload, headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = client.post("/predict", json=payload, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200, r.text
    assert "bearer token" in post(client, payload).json()["data"]["message"]
    assert client.get("/health").status_code == 200  # health stays open
    assert client.post("/analyze", json={"generations": ["a"], "ground_truth": ["a"]}).status_code == 401
    assert client.post("/extract", json={"generations": ["a"], "ground_truth": ["a"]}).status_code == 401
    assert client.post("/score_radcliq", json={"pred_text": "a" * 9, "true_text": "a" * 9}).status_code == 401


def test_health_and_unknown_route(client):
    health = client.get("/health").json()
    assert health["status"] == "ok" and {"t_exact", "t_overlap"} <= set(health["components"])
    assert health["default_components"] == ["t_exact", "t_overlap"]
    r = client.get("/nothing")
    assert r.status_code == 404 and r.json()["result"] == "error"
    assert client.get("/predict").status_code == 405


def test_bad_startup_settings(components):
    with pytest.raises(ValueError, match="unknown reward component"):
        server.create_app(default_components=["no_such_component"])
    with pytest.raises(ValueError, match="max_batch"):
        server.create_app(default_components=["t_exact"], max_batch=0)
    # scoring processes build everything from plain settings: test doubles and threads cannot go there
    with pytest.raises(ValueError, match="extract_report / analyze"):
        server.create_app(default_components=["t_exact"], scoring_processes=2, extract_report=boxed_extract)
    with pytest.raises(ValueError, match="scoring_threads"):
        server.create_app(default_components=["t_exact"], scoring_processes=2, scoring_threads=2)


def test_in_process_answers_name_this_process_as_the_scorer(client):
    r = post(client, {"hyps": HYPS, "refs": REFS, "type": "free_form"})
    assert r.status_code == 200 and r.headers[server.SCORING_PID_HEADER] == str(os.getpid())
    assert client.get("/health").json()["scoring"] == {"threads": 1, "pids": [os.getpid()]}


# ----------------------------------------------------------------------------- /analyze


class FakeMatching:
    """Test double of ratescore.match_entities' result: words as entities, 'no X' vs 'X' a contradiction."""

    def __init__(self, hyp, ref):
        self.hyp, self.ref = hyp, ref

    @staticmethod
    def entities(text):
        out = []
        for s, sentence in enumerate(re.split(r"(?<=[.!?])\s+", text.strip())):
            for word in re.findall(r"[a-z]+", sentence.lower()):
                if word not in ("no", "is", "the"):
                    negated = re.search(rf"\bno\s+{word}\b", sentence.lower()) is not None
                    out.append({"text": word, "head": word, "type": "NON-ABNORMALITY" if negated else "ABNORMALITY",
                                "sentence": s, "start": 0, "end": 0})
        return out

    def to_dict(self):
        g, r = self.entities(self.hyp), self.entities(self.ref)
        rtexts, gtexts = {e["text"]: e for e in r}, {e["text"]: e for e in g}
        contradictions = [{"hyp": e, "ref": rtexts[e["text"]], "similarity": 0.9, "relation": "contradiction"}
                          for e in g if e["text"] in rtexts and e["type"] != rtexts[e["text"]]["type"]]
        return {"hyp_entities": g, "ref_entities": r, "pairs": [],
                "false_positives": [e for e in g if e["text"] not in rtexts],
                "false_negatives": [e for e in r if e["text"] not in gtexts],
                "contradictions": contradictions}


@pytest.fixture
def fake_matcher(monkeypatch):
    import grouprl.domains.radiology.rewards.ratescore as ratescore

    monkeypatch.setattr(ratescore, "match_entities", FakeMatching)


def test_analyze_shape(client, fake_matcher):
    r = client.post("/analyze", json={"generations": ["Effusion. Nodule.", ""],
                                      "ground_truth": ["No effusion. Edema.", "Edema."]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["result"] == "success"
    results = body["data"]["predictions"]["analysis_results"]
    assert len(results) == 2
    first = results[0]
    assert set(first) == {"generation_entities", "reference_entities", "false_positives", "false_negatives",
                          "contradictions", "ref_entities_grouped_by_sentence"}
    assert [e["text"] for e in first["false_positives"]] == ["nodule"]
    assert [e["text"] for e in first["false_negatives"]] == ["edema"]
    (c,) = first["contradictions"]
    assert c["gen_entity"]["text"] == c["ref_entity"]["text"] == "effusion" and c["similarity"] == 0.9
    assert c["gen_entity"]["sentence"] == "Effusion." and c["ref_entity"]["sentence"] == "No effusion."
    assert first["reference_entities"][1] == {"text": "edema", "text_span": "edema", "head": "edema",
                                              "type": "ABNORMALITY", "sentence_index": 1, "sentence": "Edema.",
                                              "start": 0, "end": 0}
    assert set(first["ref_entities_grouped_by_sentence"]) == {"No effusion.", "Edema."}
    assert results[1]["generation_entities"] == [] and [e["text"] for e in results[1]["false_negatives"]] == ["edema"]


def test_analyze_bad_requests(client, fake_matcher):
    r = client.post("/analyze", json={"generations": ["a", "b"], "ground_truth": ["a"]})
    assert r.status_code == 400 and "pair up" in r.json()["data"]["message"]
    r = client.post("/analyze", json={"generations": ["a"]})
    assert r.status_code == 400 and "ground_truth" in r.json()["data"]["message"]
    r = client.post("/analyze", json={"generations": ["a"], "ground_truth": "Edema."})  # EditGRPO allows one string
    assert r.status_code == 200


# ----------------------------------------------------------------------------- the real components

EDITGRPO = ["radgraphf1", "cxb14micro", "ratescore"]


def _missing_real(names):
    registry = server.load_report_components()
    return [n for n in names if n not in registry]


@pytest.mark.skipif(bool(_missing_real(EDITGRPO)), reason="the real radgraphf1/cxb14micro/ratescore components "
                    "are not registered yet")
def test_real_editgrpo_composite():
    pytest.importorskip("grouprl.domains.radiology.rewards.answers")
    client = TestClient(server.create_app())
    ref = "Mild cardiomegaly. No pleural effusion or pneumothorax."
    hyps = [ref, "\\boxed{" + ref + "}", "Large right pleural effusion. Pneumothorax."]
    r = client.post("/predict", json={"hyps": hyps, "refs": [ref] * 3, "type": "free_form"})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    p = data["predictions"]
    assert set(EDITGRPO) <= set(p) and set(EDITGRPO) <= set(data["backends"])
    # EditGRPO's default sum: the three [0, 1] scores, its cxb_bal_acc / 14, and no format term under free_form
    assert p["final_scores"][0] == pytest.approx(sum(p[c][0] for c in EDITGRPO) + p["cxb_bal_acc_editgrpo"][0] / 14)
    assert p["cxb_bal_acc_editgrpo"][0] == 7.0  # all 14 labels agree, frequencies per pair: 14 / 2
    assert p["final_scores"][0] == pytest.approx(3.5, abs=1e-6)
    assert p["final_scores"][2] < p["final_scores"][0]
    # EditGRPO's own client reads these names
    assert p["f1_radgraph_scores"] == p["radgraphf1"] and p["rate_scores"] == p["ratescore"]
    short = client.post("/predict", json={"hyps": hyps, "refs": [ref] * 3, "type": "short"}).json()
    assert short["data"]["predictions"]["format_ok"] == [False, True, False]
    assert short["data"]["predictions"]["final_scores"][1] == pytest.approx(4.5, abs=1e-6)  # + the format term


def _has_real_matcher():
    try:
        from grouprl.domains.radiology.rewards.ratescore import match_entities  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_real_matcher(), reason="ratescore.match_entities is not available")
def test_real_analyze(components):
    client = make_client()  # the real matcher: no analyze= given
    r = client.post("/analyze", json={"generations": ["Large left pleural effusion. Heart size is normal."],
                                      "ground_truth": ["No pleural effusion. Mild cardiomegaly."]})
    assert r.status_code == 200, r.text
    (result,) = r.json()["data"]["predictions"]["analysis_results"]
    assert result["generation_entities"] and result["reference_entities"]
    for e in result["generation_entities"] + result["reference_entities"]:
        assert e["text"] and e["type"] and isinstance(e["sentence_index"], int) and e["sentence"]
    (c,) = result["contradictions"]  # effusion present vs absent
    assert "effusion" in c["gen_entity"]["text"] and "effusion" in c["ref_entity"]["text"]
    assert c["gen_entity"]["sentence"] == "Large left pleural effusion."
    assert any("cardiomegaly" in e["text"] for e in result["false_negatives"])
    assert "No pleural effusion." in result["ref_entities_grouped_by_sentence"]


def test_every_key_editgrpos_own_client_reads_is_filled_by_real_components():
    """EditGRPO's client reads 11 prediction keys unconditionally; a missing one becomes reward 0 there."""
    app_client = TestClient(server.create_app())
    assert app_client.get("/health").json()["missing_editgrpo_keys"] == []
    body = {"hyps": ["\\boxed{Small left effusion.}", "no box"], "refs": ["Small left effusion.", "Clear lungs."],
            "type": "short"}
    predictions = app_client.post("/predict", json=body).json()["data"]["predictions"]
    for key in server.EDITGRPO_KEYS:
        assert len(predictions[key]) == 2, key
    assert predictions["format_ok"] == [True, False]
    assert predictions["f1_radgraph_scores"][0] == 1.0
    assert predictions["balanced_accuracy_chexbert"] == predictions["cxb_bal_acc_editgrpo"]  # EditGRPO's scale


# ----------------------------------------------------------------------------- --workers 2: the scoring pool

# Components the server's processes register at interpreter start (a sitecustomize on their
# PYTHONPATH): the spawned scoring processes import grouprl afresh, so a test's registry does
# not reach them. Their scores are the pid of the process that computed them.
POOL_COMPONENTS = textwrap.dedent("""
    import os, time
    from grouprl.domains.radiology.rewards.components import COMPONENTS, Component

    def t_pid(hyps, refs):
        return [float(os.getpid())] * len(hyps)

    def t_gate(hyps, refs):
        # each hyp names a gate file: announce this process at GATE.started, score once GATE exists
        for gate in hyps:
            with open(gate + ".tmp", "w") as fh:
                fh.write(str(os.getpid()))
            os.replace(gate + ".tmp", gate + ".started")  # whole, or not there yet
            deadline = time.monotonic() + 120
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.01)
        return [float(os.getpid())] * len(hyps)

    def t_boom(hyps, refs):
        raise RuntimeError("labeler exploded")

    def t_gc(hyps, refs):
        import gc
        # the process's first collector threshold when its startup objects are frozen, else -1
        return [float(gc.get_threshold()[0]) if gc.get_freeze_count() > 0 else -1.0] * len(hyps)

    for fn in (t_pid, t_gate, t_boom, t_gc):
        COMPONENTS[fn.__name__] = Component(fn.__name__, fn, "test=" + fn.__name__)
""")


@pytest.fixture(scope="module")
def pool_server(tmp_path_factory):
    """`grouprl serve rewards --workers 2 --ports 2 --class-frequencies F`, with the test components above."""
    pytest.importorskip("httpx")
    root = tmp_path_factory.mktemp("pool")
    (root / "sitecustomize.py").write_text(POOL_COMPONENTS)
    frequencies = root / "class_frequencies.json"
    frequencies.write_text(json.dumps({"Cardiomegaly": 0.2, "Pleural Effusion": 0.4}))
    base = two_free_ports()
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "grouprl", "serve", "rewards", "--port", str(base), "--ports", "2",
                             "--workers", "2", "--entity-embeddings", "ngram", "--class-frequencies", str(frequencies),
                             "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        for port in (base, base + 1):
            while True:  # the ports accept once the pool has started (a startup guard, not a timed assertion)
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "reward server did not start"
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    time.sleep(0.1)
        yield {"urls": [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"], "root": root,
               "class_frequencies": str(frequencies), "proc": proc}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # shutdown hung: fail after cleaning up
            proc.kill()
            proc.wait()
            raise AssertionError("the reward server did not stop within 60 s of SIGINT")


def pool_post(http, url, component, hyps):
    return http.post(url + "/predict", json={"hyps": hyps, "refs": ["Clear lungs."] * len(hyps), "type": "free_form",
                                             "requested_reward_components": [component], "editgrpo_keys": False})


def scorer(response) -> int:
    """The pid the test components scored in."""
    assert response.status_code == 200, response.text
    return int(response.json()["data"]["predictions"]["final_scores"][0])


def wait_for_file(path, thread=None) -> str:
    deadline = time.monotonic() + 60  # a guard against hanging, not a timed assertion
    while not path.exists():
        assert thread is None or thread.is_alive(), "the request ended before it reached its gate"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)
    return path.read_text()


def test_a_pool_that_cannot_start_says_so():
    """Settings a scoring process cannot build from (here: a component only the test process has) fail the
    pool's start with an error instead of leaving it waiting for its processes."""
    server.load_report_components()
    pool = server.ScoringPool({"default_components": ["only_in_this_process"]}, 1)
    with pytest.raises(RuntimeError, match="the scoring processes did not start"):
        pool.start()
    assert pool.describe()["pids"] == []


def test_pool_scores_as_in_process_on_every_port(pool_server):
    """Each port answers /predict, /analyze and /extract with in-process scoring's numbers, under the same
    settings (the class-frequency variant of cxb_bal_acc_editgrpo included)."""
    import httpx

    ref = "Mild cardiomegaly. Small left pleural effusion. No pneumothorax."
    predict = {"hyps": ["\\boxed{" + ref + "}", "\\boxed{Cardiomegaly. No effusion.}", "Large effusion.",
                        "<think>x</think>\\boxed{Normal chest.}"],
               "refs": [ref, ref, ref, "Cardiomegaly. Small right effusion."]}
    pairs = {"generations": predict["hyps"][:2], "ground_truth": predict["refs"][:2]}
    local = TestClient(server.create_app(entity_embeddings="ngram", class_frequencies=pool_server["class_frequencies"]))
    expected = {route: local.post(route, json=body).json() for route, body in
                (("/predict", predict), ("/analyze", pairs), ("/extract", pairs))}
    assert pool_server["class_frequencies"] in expected["/predict"]["data"]["backends"]["cxb_bal_acc_editgrpo"]
    for url in pool_server["urls"]:
        health = httpx.get(url + "/health", timeout=30).json()
        assert len(health["scoring"]["pids"]) == 2 and health["pid"] not in health["scoring"]["pids"]
        for route, body in (("/predict", predict), ("/analyze", pairs), ("/extract", pairs)):
            r = httpx.post(url + route, json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json() == expected[route], (url, route)
            assert int(r.headers[server.SCORING_PID_HEADER]) in health["scoring"]["pids"]


def test_one_connection_is_scored_by_whichever_process_is_idle(pool_server):
    """Requests on one keep-alive connection go to whichever scoring process is idle: while one process
    is held by another request, the other one serves them; each process in turn."""
    import httpx

    url, root = pool_server["urls"][0], pool_server["root"]
    held: dict = {}

    def hold(name):
        with httpx.Client(timeout=120) as other:
            held[name] = pool_post(other, url, "t_gate", [str(root / name)])

    with httpx.Client(timeout=30) as conn:  # one connection (one process per connection would fail here)
        first = threading.Thread(target=hold, args=("g1",))
        first.start()
        x = int(wait_for_file(root / "g1.started", first))  # process x is held
        r1 = pool_post(conn, url, "t_pid", ["a"])
        y = scorer(r1)
        assert y != x and first.is_alive()  # the other process scored it while x was busy
        second = threading.Thread(target=hold, args=("g2",))
        second.start()
        assert int(wait_for_file(root / "g2.started", second)) == y  # now y is held too
        (root / "g1").touch()  # x is free again
        first.join()
        assert scorer(held["g1"]) == x
        r2 = pool_post(conn, url, "t_pid", ["b"])
        assert scorer(r2) == x and second.is_alive()  # the same connection, the other process
        (root / "g2").touch()
        second.join()
        assert scorer(held["g2"]) == y
        addresses = {r.extensions["network_stream"].get_extra_info("client_addr") for r in (r1, r2)}
        assert len(addresses) == 1  # both answers came over the one connection
    assert {x, y} == set(httpx.get(url + "/health", timeout=30).json()["scoring"]["pids"])


def test_scoring_processes_collect_garbage_rarely_and_skip_startup_objects(pool_server):
    """Full collections walking startup objects stalled requests: each scoring process freezes them
    and uses the serving thresholds."""
    import httpx

    with httpx.Client(timeout=60) as http:
        r = pool_post(http, pool_server["urls"][0], "t_gc", ["a", "b"])
    assert r.status_code == 200, r.text
    assert r.json()["data"]["predictions"]["t_gc"] == [float(server.SERVING_GC_THRESHOLDS[0])] * 2


def test_serve_tunes_the_collector_of_its_own_process(monkeypatch):
    """With --workers 1 the serving process scores: serve() freezes its startup objects and sets the
    serving thresholds before it serves."""
    import gc

    import uvicorn

    seen = {}

    def fake_run(self, sockets=None):
        seen.update(threshold=gc.get_threshold(), frozen=gc.get_freeze_count())

    old = gc.get_threshold()
    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    try:
        server.serve(port=0, entity_embeddings="ngram", log_level="warning")
    finally:  # this is the test process: undo
        gc.set_threshold(*old)
        gc.unfreeze()
    assert seen["threshold"] == server.SERVING_GC_THRESHOLDS and seen["frozen"] > 0


def test_pool_component_failure_is_500_and_the_server_keeps_serving(pool_server):
    import httpx

    url = pool_server["urls"][1]
    with httpx.Client(timeout=60) as http:
        before = http.get(url + "/health").json()["scoring"]
        r = pool_post(http, url, "t_boom", ["a", "b"])
        assert r.status_code == 500
        assert r.json() == {"result": "error", "data": {"message": "component 't_boom' (test=t_boom) raised "
                                                                  "RuntimeError: labeler exploded"}}
        assert scorer(pool_post(http, url, "t_pid", ["a"])) in before["pids"]
        assert http.get(url + "/health").json()["scoring"] == before  # an exception is not a dead process


def test_a_killed_scoring_process_is_replaced(pool_server):
    """A scoring process killed mid-request: that request gets a 503 saying so, the pool is started
    afresh, and the next requests are scored by the new processes."""
    import httpx

    url, root = pool_server["urls"][0], pool_server["root"]
    answer: dict = {}

    def doomed():
        with httpx.Client(timeout=120) as other:
            answer["r"] = pool_post(other, url, "t_gate", [str(root / "never")])

    with httpx.Client(timeout=120) as http:
        before = http.get(url + "/health").json()["scoring"]
        thread = threading.Thread(target=doomed)
        thread.start()
        victim = int(wait_for_file(root / "never.started", thread))
        os.kill(victim, signal.SIGKILL)
        thread.join()
        r = answer["r"]
        assert r.status_code == 503, r.text
        assert "a scoring process died" in r.json()["data"]["message"]
        for _ in range(3):  # the new processes answer
            pid = scorer(pool_post(http, url, "t_pid", ["a"]))
            assert pid not in before["pids"]
        after = http.get(url + "/health").json()["scoring"]
        assert after["restarts"] == before["restarts"] + 1 and pid in after["pids"]
        assert not set(after["pids"]) & set(before["pids"]) and len(after["pids"]) == 2


def test_stopping_does_not_wait_for_a_stuck_request(pool_server):
    """SIGINT with a request stuck in a component: the server stops (after its grace period) and takes
    its scoring processes with it. Runs last: it stops the module's server."""
    import httpx

    url, root, proc = pool_server["urls"][0], pool_server["root"], pool_server["proc"]
    pids = httpx.get(url + "/health", timeout=30).json()["scoring"]["pids"]

    def stuck():
        with contextlib.suppress(httpx.HTTPError), httpx.Client(timeout=120) as other:
            pool_post(other, url, "t_gate", [str(root / "stuck")])

    thread = threading.Thread(target=stuck, daemon=True)
    thread.start()
    wait_for_file(root / "stuck.started", thread)
    proc.send_signal(signal.SIGINT)
    # the gate never opens and the component would wait 120 s: stopping sooner is the server's doing
    assert proc.wait(timeout=60) == 0
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


def test_every_hypothesis_failing_its_format_is_warned_in_the_response_and_the_log(caplog):
    """A request without "type" is "short" (EditGRPO's default): plain reports then score as empty
    reports. The server keeps the seed's rule but says so, in the response and in one log line."""
    length = Component("c_len", lambda hyps, refs: [float(len(h)) for h in hyps], "test=len")
    plain = ["No pleural effusion.", "Heart size is normal."]
    boxed = ["Report: \\boxed{No pleural effusion.}", "Heart size is normal."]

    def score(hyps, type_):
        request = server.PredictRequest(hyps, ["x", "y"], type_, ["c_len"], False)
        return server.score_predict(request, components={"c_len": length},
                                    extract=server._default_extract)

    with caplog.at_level("WARNING", logger=server.logger.name):
        data = score(plain, "short")
    assert data["predictions"]["c_len"] == [0.0, 0.0]  # scored as empty reports: the seed's rule, kept
    assert len(data["warnings"]) == 1 and "free_form" in data["warnings"][0] and "'short'" in data["warnings"][0]
    assert sum("has the 'short' format" in r.getMessage() for r in caplog.records) == 1
    assert "warnings" not in score(plain, "free_form")
    assert "warnings" not in score(boxed, "short")  # one report has the format: nothing to warn of
