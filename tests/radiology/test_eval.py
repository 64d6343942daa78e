"""`grouprl eval` (per-sample CSV, summary with bootstrap CIs, bad records) and `grouprl generate`."""

from __future__ import annotations

import csv
import json
import re
import sys
import types
import warnings

import numpy as np
import pytest

from grouprl.domains.radiology import evaluation
from grouprl.cli import main
from grouprl.domains.radiology.evaluation import EvalDataError, bootstrap_ci, evaluate_file, read_predictions
from grouprl.domains.radiology.rewards.components import COMPONENTS, Component
from grouprl.domains.radiology.server.app import load_report_components


def exact(hyps, refs):
    return [1.0 if h.strip() == r.strip() else 0.0 for h, r in zip(hyps, refs)]


def overlap(hyps, refs):
    out = []
    for h, r in zip(hyps, refs):
        a, b = set(re.findall(r"\w+", h.lower())), set(re.findall(r"\w+", r.lower()))
        out.append(len(a & b) / len(a | b) if a | b else 0.0)
    return out


def constant(hyps, refs):
    return [0.7] * len(hyps)


@pytest.fixture
def components(monkeypatch):
    load_report_components()
    for name, fn, backend in (("e_exact", exact, "test=exact"), ("e_overlap", overlap, "test=overlap"),
                              ("e_const", constant, "test=const")):
        monkeypatch.setitem(COMPONENTS, name, Component(name, fn, backend))
    monkeypatch.setattr(evaluation, "CORPUS_METRICS", {})  # the real corpus metrics get their own test


RECORDS = [
    {"id": "a", "response": "No pleural effusion.", "answer": "No pleural effusion."},
    {"id": "b", "response": "Small left effusion.", "answer": "No pleural effusion."},
    {"id": 3, "response": "", "answer": "Cardiomegaly."},
    {"id": "d", "response": "Cardiomegaly.", "answer": "Cardiomegaly."},
]


def write_json(path, records):
    path.write_text(json.dumps(records))
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_bootstrap_ci_hand_examples():
    assert bootstrap_ci([0.7] * 50, 1000, 0) == (0.7, 0.7)  # constant values: [c, c] exactly
    low, high = bootstrap_ci([0.0, 1.0] * 50, 2000, seed=1)
    # the mean of 100 fair coin flips: sd 0.05, so the 95% interval is about 0.5 +- 0.098
    assert 0.38 < low < 0.44 and 0.56 < high < 0.62
    assert bootstrap_ci([0.0, 1.0] * 50, 2000, seed=1) == (low, high)  # seeded
    spread = list(np.linspace(0.0, 1.0, 101))
    assert bootstrap_ci(spread, 500, seed=1) == bootstrap_ci(spread, 500, seed=1)
    assert bootstrap_ci(spread, 500, seed=1) != bootstrap_ci(spread, 500, seed=2)
    assert bootstrap_ci([5.0], 10, 0) == (5.0, 5.0)
    for bad in ([], [float("nan")]):
        with pytest.raises(ValueError):
            bootstrap_ci(bad, 10, 0)
    with pytest.raises(ValueError):
        bootstrap_ci([1.0], 0, 0)


def test_bootstrap_ci_matches_a_direct_resampling():
    values = np.random.default_rng(0).random(37)
    low, high = bootstrap_ci(values, 500, seed=3)
    rng = np.random.default_rng(3)
    means = values[rng.integers(0, 37, size=(500, 37))].mean(axis=1)
    assert (low, high) == pytest.approx(tuple(np.quantile(means, [0.025, 0.975])))


@pytest.mark.parametrize("writer", [write_json, write_jsonl], ids=["json", "jsonl"])
def test_eval_writes_per_sample_and_summary(components, tmp_path, writer):
    data = writer(tmp_path / ("preds.json" if writer is write_json else "preds.jsonl"), RECORDS)
    out = tmp_path / "eval"
    summary = evaluate_file(data, out, components=["e_exact", "e_overlap", "e_const"], bootstrap=500, seed=0)

    rows = read_csv(out / "per_sample.csv")
    assert rows[0] == ["id", "e_exact[test=exact]", "e_overlap[test=overlap]", "e_const[test=const]"]
    assert [r[0] for r in rows[1:]] == ["a", "b", "3", "d"]
    assert [float(r[1]) for r in rows[1:]] == [1.0, 0.0, 0.0, 1.0]
    assert float(rows[2][2]) == pytest.approx(1 / 5)

    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["n_samples"] == 4 and summary["bootstrap"]["resamples"] == 500
    metrics = {m["metric"]: m for m in summary["metrics"]}
    assert metrics["e_exact"]["value"] == 0.5 and metrics["e_exact"]["backend"] == "test=exact"
    assert 0.0 <= metrics["e_exact"]["ci_low"] <= 0.5 <= metrics["e_exact"]["ci_high"] <= 1.0
    assert metrics["e_const"]["ci_low"] == metrics["e_const"]["ci_high"] == metrics["e_const"]["value"] == 0.7

    table = read_csv(out / "summary.csv")
    assert table[0] == ["metric", "value", "ci_low", "ci_high", "backend"]
    assert table[3] == ["e_const", "0.7", "0.7", "0.7", "test=const"]
    assert sorted(p.name for p in out.iterdir()) == ["per_sample.csv", "summary.csv", "summary.json"]  # no temp files


def test_eval_is_reproducible_and_seeded(components, tmp_path):
    data = write_json(tmp_path / "p.json", [dict(r, id=i) for i, r in enumerate(RECORDS * 5)])
    a = evaluate_file(data, tmp_path / "a", components=["e_overlap"], bootstrap=300, seed=7)
    b = evaluate_file(data, tmp_path / "b", components=["e_overlap"], bootstrap=300, seed=7)
    c = evaluate_file(data, tmp_path / "c", components=["e_overlap"], bootstrap=300, seed=8)
    assert a["metrics"] == b["metrics"] and a["metrics"] != c["metrics"]
    none = evaluate_file(data, tmp_path / "d", components=["e_overlap"], bootstrap=0)
    assert none["metrics"][0]["ci_low"] is None and read_csv(tmp_path / "d" / "summary.csv")[1][2] == ""


BAD = [
    ({"id": "x", "answer": "a"}, "record 1 (id 'x'): field 'response' is missing"),
    ({"id": "x", "response": "a"}, "record 1 (id 'x'): field 'answer' is missing"),
    ({"id": "x", "response": None, "answer": "a"}, "field 'response' must be a string"),
    ({"id": "x", "response": "a", "answer": 3}, "field 'answer' must be a string"),
    ({"id": "x", "response": "a", "answer": "  "}, "field 'answer' is empty"),
    ({"response": "a", "answer": "a"}, "record 1: field 'id' is missing"),
    ({"id": None, "response": "a", "answer": "a"}, "record 1: field 'id' must be"),
    ({"id": "ok", "response": "a", "answer": "a"}, "repeats id 'ok' of record 0"),
    ("not a record", "record 1: expected an object"),
]


@pytest.mark.parametrize("record,message", BAD, ids=[m for _, m in BAD])
def test_bad_records_are_named(tmp_path, record, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"id": "ok", "response": "a", "answer": "a"}, record])
    with pytest.raises(EvalDataError, match=re.escape(message)):
        read_predictions(path)


def test_bad_files(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"id": 1, "response": "a", "answer": "a"}\n{"id": 2,\n')
    with pytest.raises(EvalDataError, match="broken.jsonl: line 2 \\(record 1\\): invalid JSON"):
        read_predictions(tmp_path / "broken.jsonl")
    (tmp_path / "broken.json").write_text('[{"id": 1}')
    with pytest.raises(EvalDataError, match="broken.json: line 1: invalid JSON"):
        read_predictions(tmp_path / "broken.json")
    with pytest.raises(EvalDataError, match="not found"):
        read_predictions(tmp_path / "missing.json")
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(EvalDataError, match="no records"):
        read_predictions(tmp_path / "empty.json")
    ok = write_json(tmp_path / "dicom.json", [{"dicom_id": "s1", "response": "a", "answer": "b"}])
    assert read_predictions(ok) == [{"id": "s1", "response": "a", "answer": "b"}]  # EditGRPO's fallback id


def test_cli_eval(components, tmp_path, capsys):
    data = write_json(tmp_path / "preds.json", RECORDS)
    assert main(["eval", "--data", str(data), "--out", str(tmp_path / "o"), "--components", "e_exact,e_const",
                 "--bootstrap", "200", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "e_exact" in out and "0.5000" in out and (tmp_path / "o" / "summary.csv").exists()
    bad = write_json(tmp_path / "bad.json", [{"id": 1, "response": "a"}])
    assert main(["eval", "--data", str(bad), "--out", str(tmp_path / "o2")]) == 2
    assert "record 0 (id '1'): field 'answer' is missing" in capsys.readouterr().err
    assert main(["eval", "--data", str(data), "--out", str(tmp_path / "o3"), "--components", "nope"]) == 2
    assert "unknown report score component" in capsys.readouterr().err


def test_corpus_metrics_with_backend_and_intervals(components, tmp_path, monkeypatch):
    module = types.ModuleType("grouprl_test_corpus_metrics")

    def chexpert_f1(hyps, refs):
        hits = sum(h == r for h, r in zip(hyps, refs))
        return {"micro_f1_14": hits / len(hyps), "per_class": [1, 2], "five": {"macro": 0.25},
                "undefined": None, "n": len(hyps), "flag": True, "backend": "labeler=test"}

    module.chexpert_f1 = chexpert_f1
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(evaluation, "CORPUS_METRICS", {"chexpert_f1": ("chexpert_f1", (module.__name__,))})
    data = write_json(tmp_path / "p.json", RECORDS)
    summary = evaluate_file(data, tmp_path / "o", components=["e_exact"], bootstrap=100, corpus_bootstrap=50)
    metrics = {m["metric"]: m for m in summary["metrics"]}
    micro = metrics["chexpert_f1/micro_f1_14"]
    assert micro["value"] == 0.5 and micro["backend"] == "labeler=test" and micro["kind"] == "corpus"
    assert 0.0 <= micro["ci_low"] <= 0.5 <= micro["ci_high"] <= 1.0
    assert metrics["chexpert_f1/five/macro"]["value"] == 0.25
    assert metrics["chexpert_f1/undefined"]["value"] is None
    assert not {"chexpert_f1/per_class", "chexpert_f1/n", "chexpert_f1/flag"} & set(metrics)
    no_ci = evaluate_file(data, tmp_path / "o2", components=["e_exact"], bootstrap=100)
    assert {m["metric"]: m for m in no_ci["metrics"]}["chexpert_f1/micro_f1_14"]["ci_low"] is None


def _fake_answers(monkeypatch):
    try:
        import grouprl.domains.radiology.rewards.answers as answers  # noqa: F401
        return False
    except ImportError:
        fake = types.ModuleType("grouprl.domains.radiology.rewards.answers")

        def clean_report(text, **options):
            text = re.sub(r"Indication:.*", "", text, flags=re.S)
            text = re.sub(r"<\|[a-z_]+\|>", "", text)
            m = re.search(r"\\boxed\{(.*?)\}", text, re.S)
            return (m.group(1) if m else text).strip()

        fake.clean_report = clean_report
        monkeypatch.setitem(sys.modules, fake.__name__, fake)
        return True


def test_clean_option(components, tmp_path, monkeypatch):
    _fake_answers(monkeypatch)  # the real answers.clean_report when it exists
    records = [{"id": 1, "response": "\\boxed{No pleural effusion.}<|endoftext|>", "answer": "No pleural effusion."},
               {"id": 2, "response": "Cardiomegaly. Indication: chest pain.", "answer": "Cardiomegaly."}]
    data = write_json(tmp_path / "p.json", records)
    raw = evaluate_file(data, tmp_path / "raw", components=["e_exact"], bootstrap=0)
    cleaned = evaluate_file(data, tmp_path / "clean", components=["e_exact"], bootstrap=0, clean=True)
    assert raw["metrics"][0]["value"] == 0.0
    assert cleaned["metrics"][0]["value"] == 1.0 and cleaned["cleaned"] is True


@pytest.mark.skipif(not {"radgraphf1", "cxb14micro", "ratescore"} <= set(load_report_components()),
                    reason="the real radgraphf1/cxb14micro/ratescore components are not registered yet")
def test_real_components_and_corpus_metrics(tmp_path, monkeypatch):
    # the label and graph corpus metrics (nlg_corpus_scores starts Java for METEOR: tested with nlg)
    monkeypatch.setattr(evaluation, "CORPUS_METRICS", {k: v for k, v in evaluation.CORPUS_METRICS.items()
                                                      if k != "nlg_corpus_scores"})
    refs = ["Mild cardiomegaly. No pleural effusion.", "Small right pleural effusion.", "No acute findings.",
            "Left lower lobe consolidation.", "Pneumothorax on the right."]
    hyps = [refs[0], "No pleural effusion.", "No acute cardiopulmonary process.", refs[3], "No pneumothorax."]
    data = write_json(tmp_path / "p.json", [{"id": i, "response": h, "answer": r}
                                            for i, (h, r) in enumerate(zip(hyps, refs))])
    summary = evaluate_file(data, tmp_path / "o", components=["radgraphf1", "cxb14micro", "ratescore"],
                            bootstrap=200)
    metrics = {m["metric"]: m for m in summary["metrics"]}
    for name in ("radgraphf1", "cxb14micro", "ratescore"):
        assert 0.0 <= metrics[name]["ci_low"] <= metrics[name]["value"] <= metrics[name]["ci_high"] <= 1.0
        assert metrics[name]["backend"]
    header = read_csv(tmp_path / "o" / "per_sample.csv")[0]
    assert all("[" in column for column in header[1:])
    corpus = {m["metric"]: m for m in summary["metrics"] if m["kind"] == "corpus"}
    if "chexpert_f1" in evaluation.corpus_metric_functions():
        for key in ("micro_f1_14", "macro_f1_14", "micro_f1_5", "macro_f1_5"):
            assert 0.0 <= corpus[f"chexpert_f1/{key}"]["value"] <= 1.0
            assert corpus[f"chexpert_f1/{key}"]["backend"] == "labeler=rules"
    if "radgraph_corpus_f1" in evaluation.corpus_metric_functions():
        assert corpus["radgraph_corpus_f1/partial"]["value"] == pytest.approx(metrics["radgraphf1"]["value"])


def test_generate_round_trip(components, tmp_path):
    from grouprl.models.tiny import build_tiny_text_lm

    records = [{"id": f"s{i}", "problem": f"Describe study {i}.", "answer": w}
               for i, w in enumerate(["No effusion.", "Cardiomegaly.", "Normal heart.", "Edema."])]
    data = write_jsonl(tmp_path / "test.jsonl", records)
    model = build_tiny_text_lm(tmp_path / "model", [r["problem"] for r in records] + [r["answer"] for r in records],
                               seed=0)
    out = tmp_path / "preds" / "out.jsonl"
    assert main(["generate", "--model", str(model), "--data", str(data), "--out", str(out), "--batch-size", "3",
                 "--max-new-tokens", "4", "--no-progress", "--device", "cpu"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == ["s0", "s1", "s2", "s3"]
    assert [r["answer"] for r in lines] == [r["answer"] for r in records]
    assert all(isinstance(r["response"], str) and set(r) == {"id", "response", "answer"} for r in lines)
    again = tmp_path / "again.jsonl"
    assert main(["generate", "--model", str(model), "--data", str(data), "--out", str(again), "--batch-size", "4",
                 "--max-new-tokens", "4", "--no-progress", "--device", "cpu"]) == 0
    assert again.read_text() == out.read_text()  # greedy: the same responses whatever the batching
    assert [p.name for p in out.parent.iterdir()] == ["out.jsonl"]
    assert main(["eval", "--data", str(out), "--out", str(tmp_path / "eval"), "--components", "e_overlap",
                 "--bootstrap", "50"]) == 0
    assert len(read_csv(tmp_path / "eval" / "per_sample.csv")) == 5


def test_tasks_other_than_report(tmp_path):
    data = write_json(tmp_path / "p.json", [{"id": 1, "response": "a", "answer": "b", "history": [], "x": 1}])
    assert read_predictions(data) == [{"id": "1", "response": "a", "answer": "b"}]  # the report task: as before
    assert read_predictions(data, keep=("history", "missing")) == [{"id": "1", "response": "a", "answer": "b",
                                                                     "history": []}]
    with pytest.raises(ValueError, match="unknown task 'vqa'; tasks: report, classification, grounding"):
        evaluate_file(data, tmp_path / "o", task="vqa")
    with pytest.raises(ValueError, match="components name report score components; the grounding task"):
        evaluate_file(data, tmp_path / "o", task="grounding", components=["bleu1"])
    summary = evaluate_file(data, tmp_path / "o", task="classification", bootstrap=10)
    assert summary["task"] == "classification" and summary["components"] == ["set_f1", "exact_match"]


def test_all_empty_responses_are_warned(components, tmp_path):
    """A predictions file whose responses are all empty scores 0 everywhere: said, not only tabled."""
    records = [{"id": str(i), "response": " ", "answer": "No effusion."} for i in range(3)]
    data = write_json(tmp_path / "preds.json", records)
    with pytest.warns(evaluation.EvaluationWarning, match="every response .* is empty"):
        evaluate_file(data, tmp_path / "eval", components=["e_exact"], bootstrap=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", evaluation.EvaluationWarning)  # one real response: no warning
        evaluate_file(write_json(tmp_path / "p2.json", [*records, {"id": "x", "response": "a", "answer": "a"}]),
                      tmp_path / "eval2", components=["e_exact"], bootstrap=0)
