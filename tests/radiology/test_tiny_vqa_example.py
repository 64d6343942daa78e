"""The CheXPO-style VQA data examples/tiny_setup.py writes for the recipes' tiny runs
(the recipes themselves: tests/core/test_examples.py)."""

from __future__ import annotations

import json

from grouprl.data import load_samples
from grouprl.domains.radiology.rewards.answers import answer_labels


def test_tiny_vqa_data(tiny_examples):
    tiny_root = tiny_examples.built()
    records = [json.loads(line) for line in (tiny_root / "vqa" / "data.jsonl").read_text().splitlines()]
    studies = json.loads((tiny_root / "vqa" / "studies.json").read_text())
    for record, study in zip(records, studies):
        present = {k.replace("_", " ") for k, v in study["findings"].items() if v == 1}
        assert answer_labels(record["answer"]) == (present or {"no finding"})
        assert record["question_type"] == "findings"
        assert record["reasoning"] == study["conversations"][-1]["value"]
    samples = load_samples(tiny_root / "vqa" / "data.jsonl")
    assert len(samples) == len(records) and len(samples[0].images) == 1
    assert samples[0].answer == records[0]["solution"]  # answer_set_f1 reads its <answer>, kg its <think>
