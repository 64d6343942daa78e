"""EditGRPO's own clients against grouprl's reward server: /analyze embeddings and tau, /extract, long
reports, the default composite and its cxb_bal_acc, slow and abandoned request bodies.

The client functions here repeat what EditGRPO's code reads from each answer (verl/utils/
RaTEscore_extractor.py, verl/utils/radgraph_extractor.py, verl/utils/reward_score/rad_scores.py).
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import socket
import threading

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from grouprl.domains.radiology.server import app as server  # noqa: E402
from grouprl.domains.radiology.rewards.components import COMPONENTS, Component  # noqa: E402
from grouprl.domains.radiology.rewards.entity_embeddings import encoder_available, hashed_ngram_vector  # noqa: E402
from grouprl.domains.radiology.rewards.ratescore import text_similarity  # noqa: E402
from grouprl.domains.radiology.rewards.weighted_accuracy import class_weights, weighted_label_agreement  # noqa: E402


def cosine(a, b):
    """EditGRPO's cosine_similarity: 0 unless both are non-empty vectors."""
    if not a or not b:
        return 0.0
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    return sum(x * y for x, y in zip(a, b)) / (na * nb) if na and nb else 0.0


def editgrpo_replacement(fp, grouped, tau, rng=random.Random(0)):
    """EditGRPO's replace-false-positive choice, as its client makes it from one /analyze result.

    The false positive's entities are its ``sentence_entities`` (else itself) that have an
    ``embedding``; with none, a random reference sentence. Otherwise each other reference
    sentence scores the mean over those entities of their best cosine (floored at 0) with
    its entities; the best is used only when it reaches ``tau * len(entities)``.
    """
    entities = [e for e in fp.get("sentence_entities", [fp]) if "embedding" in e]
    if not entities:
        return rng.choice(list(grouped)), "random (no embeddings)"
    best, best_sentence = -float("inf"), None
    for sentence, refs in grouped.items():
        if sentence == fp["sentence"]:
            continue
        refs = [e for e in refs if "embedding" in e]
        if refs:
            score = sum(max([0.0] + [cosine(e["embedding"], r["embedding"]) for r in refs]) for e in entities)
            score /= len(entities)
            if score > best:
                best, best_sentence = score, sentence
    if best_sentence and best >= tau * len(entities):
        return best_sentence, "maximum similarity"
    return None, None


GEN = "Moderate right pleural effusion. Heart size is normal."
REF = "Small left apical pneumothorax. Mild cardiomegaly. Trace left pleural effusion."

KINDS = ["ngram", pytest.param("encoder", marks=pytest.mark.skipif(not encoder_available(),
                                                                    reason="grouprl[metrics] not installed"))]


@pytest.mark.parametrize("kind", KINDS)
def test_analyze_embeddings_make_editgrpos_similarity_and_tau_work(kind):
    client = TestClient(server.create_app(entity_embeddings=kind))
    body = client.post("/analyze", json={"generations": [GEN], "ground_truth": [REF]}).json()
    assert body["result"] == "success"
    assert body["data"]["embedding_backend"].startswith("entity_embedding=")
    assert ("char-trigram" in body["data"]["embedding_backend"]) == (kind == "ngram")
    (result,) = body["data"]["predictions"]["analysis_results"]
    fps, grouped = result["false_positives"], result["ref_entities_grouped_by_sentence"]
    assert fps and all(len(e["embedding"]) > 0 for e in fps)
    assert all("embedding" in e for es in grouped.values() for e in es)
    assert all("sentence_entities" not in e for e in fps)  # would scale the client's threshold by their count
    effusion = next(e for e in fps if "effusion" in e["text"])
    # the pleural effusion sentence is chosen by similarity, not at random ...
    assert editgrpo_replacement(effusion, grouped, tau=0.3) == ("Trace left pleural effusion.", "maximum similarity")
    # ... and only when it reaches tau
    assert editgrpo_replacement(effusion, grouped, tau=0.99) == (None, None)
    for fp in fps:  # the heart sentence has no counterpart similar enough at the paper's tau
        if fp["sentence"] == "Heart size is normal.":
            assert editgrpo_replacement(fp, grouped, tau=0.6) == (None, None)
    bare = client.post("/analyze", json={"generations": [GEN], "ground_truth": [REF], "embeddings": False}).json()
    (plain,) = bare["data"]["predictions"]["analysis_results"]
    assert bare["data"]["embedding_backend"] is None
    assert editgrpo_replacement(plain["false_positives"][0], plain["ref_entities_grouped_by_sentence"],
                                tau=0.99)[1] == "random (no embeddings)"


def test_ngram_embeddings_track_the_matchers_similarity():
    pairs = [("small effusion", "effusion"), ("left pleura", "right pleura"), ("moderate effusion", "trace effusion"),
             ("cardiomegaly", "pneumothorax"), ("left lower lobe", "left lower lobe")]
    for a, b in pairs:
        assert cosine(hashed_ngram_vector(a), hashed_ngram_vector(b)) == pytest.approx(text_similarity(a, b), abs=0.08)
    assert hashed_ngram_vector("effusion") == hashed_ngram_vector("effusion")
    assert cosine(hashed_ngram_vector("effusion"), hashed_ngram_vector("effusion")) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- /extract (extractor_type="radgraph")


def sentence_with(text, token):
    """EditGRPO's radgraph-client sentence finder: split after . ! ?, then a whole-word search."""
    sentences, current = [], ""
    for i, ch in enumerate(text):
        current += ch
        if ch in ".!?" or i == len(text) - 1:
            if current.strip():
                sentences.append(current.strip())
            current = ""
    for s in sentences:
        if re.search(r"\b" + re.escape(token.lower()) + r"\b", s.lower()):
            return s
    return None


def compare(gen, gt):
    """EditGRPO's compare_annotations, reduced to what it decides: (fp tokens, fn sentences, contradictions)."""
    def decided(anno):
        return {e["tokens"].lower(): ("absent" if "definitely absent" in e["label"] else "present")
                for e in anno["entities"].values()
                if "definitely absent" in e["label"] or "definitely present" in e["label"]}

    g, r = decided(gen), decided(gt)
    fps = sorted(t for t in g if t not in r)
    contradictions = sorted(t for t in g if t in r and g[t] != r[t])
    fns = sorted({sentence_with(gt["text"], t) for t in r if t not in g})
    return fps, fns, contradictions


def test_extract_serves_editgrpos_radgraph_client():
    client = TestClient(server.create_app(entity_embeddings="ngram"))
    gens = ["Large right pleural effusion. Heart size is normal.", "No pneumothorax."]
    refs = ["No pleural effusion. Mild cardiomegaly.", "No pneumothorax."]
    r = client.post("/extract", json={"generations": gens, "ground_truth": refs})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["result"] == "success" and body["data"]["backend"] == "radgraph=rules"
    predictions = body["data"]["predictions"]
    gen_annotations, gt_annotations = predictions["gen_annotations"], predictions["gt_annotations"]
    assert sorted(gen_annotations, key=int) == ["0", "1"] and set(gt_annotations) == {"0", "1"}
    for key, text in (("0", gens[0]), ("1", gens[1])):  # the client refuses an annotation without its text
        assert gen_annotations[key]["text"] == text
    for anno in [*gen_annotations.values(), *gt_annotations.values()]:
        for entity in anno["entities"].values():  # every entity is found again in its own text by the client
            assert sentence_with(anno["text"], entity["tokens"]) is not None, entity
            assert entity["label"] in ("Anatomy::definitely present", "Observation::definitely present",
                                       "Observation::uncertain", "Observation::definitely absent")
            for relation, target in entity["relations"]:
                assert relation in ("located_at", "modify", "suggestive_of") and target in anno["entities"]
    fps, fns, contradictions = compare(gen_annotations["0"], gt_annotations["0"])
    assert contradictions == ["effusion"]  # present in the generation, absent in the reference
    assert "large" in fps and "Mild cardiomegaly." in fns
    assert compare(gen_annotations["1"], gt_annotations["1"]) == ([], [], [])
    r = client.post("/extract", json={"generations": ["a"], "ground_truth": ["b", "c"]})
    assert r.status_code == 400 and "pair up" in r.json()["data"]["message"]


# ----------------------------------------------------------------------------- /predict: long reports


def rad_compute_score(client, hyp, ref, type="free_form"):
    """EditGRPO's rad_compute_score: any non-200 or non-success answer is reward 0, else final_scores."""
    r = client.post("/predict", json={"hyps": [hyp], "refs": [ref], "type": type},
                    headers={"Content-Type": "application/json; charset=utf-8"})
    if r.status_code != 200:
        return {"overall": 0.0}
    response = json.loads(r.text)
    if response["result"] != "success":
        return {"overall": 0.0}
    predictions = response["data"]["predictions"]
    return {"overall": predictions["final_scores"][0], "f1": predictions["f1_radgraph_scores"][0],
            "cxb_balanced_accuracy": predictions["balanced_accuracy_chexbert"][0]}


def test_long_reports_are_scored_and_the_cut_is_reported(monkeypatch):
    server.load_report_components()
    seen = []

    def length_probe(hyps, refs):
        seen.append((len(hyps[0]), len(refs[0])))
        return [1.0] * len(hyps)

    monkeypatch.setitem(COMPONENTS, "t_probe", Component("t_probe", length_probe, "test=probe"))
    client = TestClient(server.create_app(default_components=["t_probe"], entity_embeddings="ngram",
                                          max_chars=20_000, max_body_bytes=200_000))
    ref = "Mild cardiomegaly. No pleural effusion. " * 600  # 24,000 characters
    hyp = "\\boxed{" + ref + "}"
    r = client.post("/predict", json={"hyps": [hyp, "\\boxed{Mild cardiomegaly.}"], "refs": [ref, ref],
                                      "type": "short", "editgrpo_keys": False})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert data["truncated"] == {"max_chars": 20_000, "hyps": [0], "refs": [0, 1]}
    assert seen == [(20_000, 20_000)]  # the report inside the box is cut, after its format was read
    assert data["predictions"]["format_ok"] == [True, True] and data["predictions"]["final_scores"] == [1.0, 1.0]

    real = TestClient(server.create_app(entity_embeddings="ngram"))  # the real composite, default limits
    long_ref = "Moderate cardiomegaly. Small left pleural effusion. " * 500
    assert rad_compute_score(real, long_ref, long_ref)["overall"] > 3.0
    analysis = real.post("/analyze", json={"generations": [long_ref], "ground_truth": [long_ref]}).json()["data"]
    assert analysis["truncated"] == {"max_chars": 20_000, "generations": [0], "ground_truth": [0]}

    huge = json.dumps({"hyps": ["x" * 300_000], "refs": ["y"]}).encode()
    r = client.post("/predict", content=huge, headers={"Content-Type": "application/json"})
    assert r.status_code == 413  # a body really too large is still refused


# ----------------------------------------------------------------------------- the default composite


def test_class_weights_follow_editgrpos_normalised_inverse_frequencies():
    assert class_weights(0.2) == pytest.approx((0.8, 0.2))
    assert class_weights(0.0) == (0.0, 1.0) and class_weights(1.0) == (1.0, 0.0)
    hyp, ref = [1, 0, 0, 1], [1, 0, 1, 0]
    # class 0 agrees positive (w_pos 0.9), class 1 agrees negative (w_neg 0.3), classes 2, 3 disagree
    assert weighted_label_agreement(hyp, ref, [0.1, 0.3, 0.5, 0.5]) == pytest.approx((0.9 + 0.3) / 2)
    assert weighted_label_agreement(hyp, ref, [None] * 4) == pytest.approx(2 / 2)  # per pair: half the agreements


def test_default_request_gets_editgrpos_composite(tmp_path):
    client = TestClient(server.create_app(entity_embeddings="ngram"))
    ref = "Mild cardiomegaly. No pleural effusion or pneumothorax."
    hyps = ["\\boxed{Mild cardiomegaly. Large left pleural effusion.}", "Mild cardiomegaly."]
    body = {"hyps": hyps, "refs": [ref, ref], "type": "short"}
    data = client.post("/predict", json=body).json()["data"]
    p = data["predictions"]
    assert data["components"] == ["radgraphf1", "cxb14micro", "ratescore", "cxb_bal_acc_editgrpo", "format"]
    assert data["weights"]["cxb_bal_acc_editgrpo"] == pytest.approx(1 / 14)
    for i in range(2):
        expected = (p["radgraphf1"][i] + p["cxb14micro"][i] + p["ratescore"][i] + p["cxb_bal_acc_editgrpo"][i] / 14
                    + p["format_scores"][i])
        assert p["final_scores"][i] == pytest.approx(expected)
    assert p["format_ok"] == [True, False] and p["final_scores"][1] > 0  # the content still counts
    assert 0 < p["balanced_accuracy_chexbert"][0] <= 7.0  # EditGRPO's scale, under its own key
    assert client.post("/predict", json={**body, "requested_reward_components": ["all"]}).json()["data"][
        "predictions"]["final_scores"] == pytest.approx(p["final_scores"])

    frequencies = tmp_path / "class_frequencies.json"
    frequencies.write_text(json.dumps({"Cardiomegaly": 0.2}))
    weighted = TestClient(server.create_app(entity_embeddings="ngram", class_frequencies=str(frequencies)))
    same = "Mild cardiomegaly."
    q = weighted.post("/predict", json={"hyps": [same], "refs": [same], "type": "free_form"}).json()["data"]
    # Cardiomegaly agrees positive at frequency 0.2 (w_pos 0.8); the other 13 agree negative, per pair (weight 1)
    assert q["predictions"]["cxb_bal_acc_editgrpo"] == [pytest.approx((0.8 + 13) / 2)]
    assert str(frequencies) in q["backends"]["cxb_bal_acc_editgrpo"]
    frequencies.write_text(json.dumps({"Cardiomegally": 0.2}))
    with pytest.raises(ValueError, match="Cardiomegally"):
        server.create_app(entity_embeddings="ngram", class_frequencies=str(frequencies))


# ----------------------------------------------------------------------------- slow and abandoned bodies


class Signal(logging.Handler):
    """Sets an event when a record containing ``text`` arrives."""

    def __init__(self, text):
        super().__init__(logging.INFO)
        self.text, self.event, self.records = text, threading.Event(), []

    def emit(self, record):
        self.records.append(record)
        if self.text in record.getMessage():
            self.event.set()


@pytest.fixture
def live(request, serve_app):
    options = getattr(request, "param", {})
    with serve_app(server.create_app(entity_embeddings="ngram", **options)) as port:
        yield port

def read_all(conn):
    chunks = []
    while True:
        chunk = conn.recv(65536)
        if not chunk:  # the server closed the connection
            return b"".join(chunks)
        chunks.append(chunk)


PARTIAL = (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
           b'{"hyps": ["No eff')


@pytest.mark.parametrize("live", [{"body_timeout": 0.2}], indirect=True)
def test_a_slow_body_gets_408_and_the_connection_is_closed(live):
    httpx = pytest.importorskip("httpx")
    with socket.create_connection(("127.0.0.1", live), timeout=30) as conn:
        conn.sendall(PARTIAL)  # and nothing more: the rest never comes
        answer = read_all(conn)  # returns because the server answers and closes, not because we gave up
    assert answer.startswith(b"HTTP/1.1 408")
    assert b"request body not received within 0.2 s" in answer
    assert httpx.get(f"http://127.0.0.1:{live}/health", timeout=10).json()["status"] == "ok"


def test_a_client_leaving_mid_body_is_one_log_line(live):
    httpx = pytest.importorskip("httpx")
    logger = logging.getLogger("grouprl.domains.radiology.server.app")
    signal, level = Signal("disconnected before sending the whole request body"), logger.level
    logger.addHandler(signal)
    logger.setLevel(logging.INFO)
    try:
        with socket.create_connection(("127.0.0.1", live), timeout=30) as conn:
            conn.sendall(PARTIAL)
        assert signal.event.wait(30), [r.getMessage() for r in signal.records]
    finally:
        logger.removeHandler(signal)
        logger.setLevel(level)
    (record,) = [r for r in signal.records if "disconnected" in r.getMessage()]
    assert record.exc_info is None and "\n" not in record.getMessage() and "POST /predict" in record.getMessage()
    assert not [r for r in signal.records if r.levelno >= logging.ERROR]
    assert httpx.get(f"http://127.0.0.1:{live}/health", timeout=10).json()["status"] == "ok"
