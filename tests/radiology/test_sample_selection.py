"""CheXPO hard-sample mining and stratified sampling: `grouprl.domains.radiology.sample_selection` and `grouprl sample`."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from grouprl.cli import main
from grouprl.domains.radiology.sample_selection import (
    SamplingError,
    allocate,
    candidate_indices,
    read_records,
    select_samples,
    stratified_sample,
    write_records,
)

# 40 items over three question types (20 / 12 / 8). The "model" answers every item whose
# index is divisible by 4 wrong, and item 1 half right (F1 0.5).
TYPES = ["presence"] * 20 + ["location"] * 12 + ["severity"] * 8


def make_items() -> list[dict]:
    return [{"id": f"q{i}", "question_type": t, "answer": "effusion, edema", "extra": {"i": i}}
            for i, t in enumerate(TYPES)]


def make_predictions() -> list[dict]:
    preds = []
    for i in range(len(TYPES)):
        if i % 4 == 0:
            response = "<think>...</think><answer>pneumothorax</answer>"  # F1 0
        elif i == 1:
            response = "<answer>effusion</answer>"  # F1 2/3
        else:
            response = "<think>x</think><answer>Edema, effusion.</answer>"  # F1 1 (case, order, punctuation)
        preds.append({"id": f"q{i}", "response": response, "answer": "effusion, edema"})
    return preds


WRONG = sorted({i for i in range(40) if i % 4 == 0} | {1})


def test_hard_keeps_exactly_the_wrong_items():
    items = make_items()
    assert candidate_indices(items, strategy="hard", predictions=make_predictions()) == WRONG
    # every kept item, in input order, when n is not given
    kept = select_samples(items, strategy="hard", predictions=make_predictions())
    assert [r["id"] for r in kept] == [f"q{i}" for i in WRONG]
    assert all(r is items[i] for r, i in zip(kept, WRONG))  # the records themselves, unchanged


def test_threshold_sets_what_counts_as_wrong():
    items, preds = make_items(), make_predictions()
    # F1 2/3 of item 1 is not below 0.5: only the F1-0 items are wrong
    assert candidate_indices(items, strategy="hard", predictions=preds, threshold=0.5) == [i for i in range(40)
                                                                                            if i % 4 == 0]
    # a mapping id -> response works as well as records
    as_map = {p["id"]: p["response"] for p in preds}
    assert candidate_indices(items, strategy="hard", predictions=as_map) == WRONG


def test_uniform_keeps_everything():
    items = make_items()
    assert candidate_indices(items, strategy="uniform") == list(range(40))
    assert select_samples(items, strategy="uniform") == items


def test_stratified_counts_are_proportional():
    items = make_items()
    chosen = select_samples(items, strategy="uniform", n=10, seed=3)
    assert len(chosen) == 10
    assert Counter(r["question_type"] for r in chosen) == {"presence": 5, "location": 3, "severity": 2}
    # input order is kept
    assert [int(r["id"][1:]) for r in chosen] == sorted(int(r["id"][1:]) for r in chosen)


def test_hard_then_stratified():
    items = make_items()
    # the kept items: 11 wrong, types presence 6 (0,1,4,8,12,16), location 3 (20,24,28), severity 2 (32,36)
    chosen = select_samples(items, strategy="hard", predictions=make_predictions(), n=6, seed=0)
    assert Counter(r["question_type"] for r in chosen) == {"presence": 3, "location": 2, "severity": 1}
    assert {r["id"] for r in chosen} <= {f"q{i}" for i in WRONG}


def test_allocate_largest_remainders_and_at_least_one():
    assert allocate({"a": 20, "b": 12, "c": 8}, 10) == {"a": 5, "b": 3, "c": 2}
    # a rare type still gets one when n allows it, taken from the most over-served type
    assert allocate({"a": 97, "b": 2, "c": 1}, 3) == {"a": 1, "b": 1, "c": 1}
    assert allocate({"a": 97, "b": 2, "c": 1}, 10) == {"a": 8, "b": 1, "c": 1}
    # fewer items than types: the largest types, by share
    assert allocate({"a": 5, "b": 3, "c": 2}, 2) == {"a": 1, "b": 1, "c": 0}
    # never more than a type has; every item when n is the total
    assert allocate({"a": 1, "b": 9}, 10) == {"a": 1, "b": 9}
    # ties go to the larger type, then to the name that sorts first
    assert allocate({"x": 3, "y": 3}, 1) == {"x": 1, "y": 0}
    for n in range(1, 41):
        quotas = allocate({"p": 20, "l": 12, "s": 8}, n)
        assert sum(quotas.values()) == n
        assert all(0 <= q <= c for q, c in zip(quotas.values(), (20, 12, 8)))
        if n >= 3:
            assert min(quotas.values()) >= 1


def test_same_seed_same_sample_other_seed_other_sample():
    items = make_items()
    first = select_samples(items, strategy="uniform", n=12, seed=7)
    again = select_samples(make_items(), strategy="uniform", n=12, seed=7)
    assert [r["id"] for r in first] == [r["id"] for r in again]
    others = {tuple(r["id"] for r in select_samples(items, strategy="uniform", n=12, seed=s)) for s in range(8)}
    assert len(others) > 1


def test_combined_type_keys_and_no_strata():
    items = [{"id": str(i), "a": "x" if i < 6 else "y", "b": "1" if i % 2 else "2"} for i in range(12)]
    strata = Counter((r["a"], r["b"]) for r in
                     select_samples(items, strategy="uniform", n=4, seed=0, type_key="a,b"))
    assert strata == {("x", "1"): 1, ("x", "2"): 1, ("y", "1"): 1, ("y", "2"): 1}
    # without strata: any n items
    assert len(stratified_sample(items, n=5, seed=0, type_key=None)) == 5


def test_reference_from_llava_and_swift_records():
    llava = {"id": "a", "question_type": "t", "image": "x.png",
             "conversations": [{"from": "human", "value": "<image>Q?"},
                               {"from": "gpt", "value": "<answer>edema</answer>"}]}
    swift = {"id": "b", "question_type": "t", "images": ["x.png"], "messages": [{"role": "user", "content": "Q?"}],
             "solution": "<think>r</think><answer>effusion</answer>"}
    preds = {"a": "<answer>edema</answer>", "b": "<answer>edema</answer>"}
    assert candidate_indices([llava, swift], strategy="hard", predictions=preds) == [1]


def test_errors_are_clear():
    items, preds = make_items(), make_predictions()
    with pytest.raises(SamplingError, match="unknown sampling strategy 'random'; choose one of hard, uniform"):
        select_samples(items, strategy="random")
    with pytest.raises(SamplingError, match="needs the model's predictions"):
        select_samples(items, strategy="hard")
    with pytest.raises(SamplingError, match="no response for 3 of 40 items: q0, q1, q2"):
        select_samples(items, strategy="hard", predictions=preds[3:])
    with pytest.raises(SamplingError, match="asked for 12 items but only 11 are available"):
        select_samples(items, strategy="hard", predictions=preds, n=12)
    with pytest.raises(SamplingError, match="asked for 41 items but only 40"):
        select_samples(items, strategy="uniform", n=41)
    with pytest.raises(SamplingError, match="does not use them"):
        select_samples(items, strategy="uniform", predictions=preds)
    with pytest.raises(SamplingError, match="no item has the question-type field 'qtype'"):
        select_samples(items, strategy="uniform", n=3, type_key="qtype")
    with pytest.raises(SamplingError, match=r"threshold must be a number in \(0, 1\]"):
        select_samples(items, strategy="hard", predictions=preds, threshold=1.5)
    with pytest.raises(SamplingError, match="n must be a positive integer"):
        select_samples(items, strategy="uniform", n=0)
    no_id = [dict(r) for r in items]
    del no_id[5]["id"]
    with pytest.raises(SamplingError, match=r"no usable 'id'.*record indices 5"):
        select_samples(no_id, strategy="hard", predictions=preds)
    twice = items + [dict(items[0])]
    with pytest.raises(SamplingError, match="item ids repeat"):
        select_samples(twice, strategy="hard", predictions=preds)
    with pytest.raises(SamplingError, match="id 'q0' repeats prediction 0"):
        select_samples(items, strategy="hard", predictions=preds + [preds[0]])


@pytest.mark.parametrize("layout", ["json", "jsonl"])
def test_files_round_trip_in_the_input_layout(tmp_path, layout):
    items = make_items()
    path = tmp_path / f"items.{layout}"
    write_records(path, items, layout)
    assert read_records(path) == (items, layout)
    # a JSON-lines file named .json stays JSON lines
    odd = tmp_path / "lines.json"
    odd.write_text("".join(json.dumps(r) + "\n" for r in items))
    assert read_records(odd)[1] == "jsonl"


def test_cli_hard(tmp_path, capsys):
    data, preds, out = tmp_path / "items.json", tmp_path / "preds.jsonl", tmp_path / "hard.json"
    write_records(data, make_items(), "json")
    write_records(preds, make_predictions(), "jsonl")
    assert main(["sample", "--data", str(data), "--predictions", str(preds), "--strategy", "hard",
                 "--n", "6", "--seed", "0", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "get 11 of 40 items wrong" in text and "location 2, presence 3, severity 1" in text
    records, layout = read_records(out)
    assert layout == "json" and len(records) == 6
    assert records == select_samples(make_items(), strategy="hard", predictions=make_predictions(), n=6, seed=0)
    first = out.read_bytes()
    assert main(["sample", "--data", str(data), "--predictions", str(preds), "--strategy", "hard",
                 "--n", "6", "--seed", "0", "--out", str(out)]) == 0
    assert out.read_bytes() == first  # same seed, same file


def test_cli_uniform_jsonl_and_threshold(tmp_path, capsys):
    data, preds, out = tmp_path / "items.jsonl", tmp_path / "preds.jsonl", tmp_path / "u.jsonl"
    write_records(data, make_items(), "jsonl")
    write_records(preds, make_predictions(), "jsonl")
    assert main(["sample", "--data", str(data), "--strategy", "uniform", "--n", "10", "--out", str(out)]) == 0
    records, layout = read_records(out)
    assert layout == "jsonl" and Counter(r["question_type"] for r in records) == {"presence": 5, "location": 3,
                                                                                    "severity": 2}
    assert main(["sample", "--data", str(data), "--predictions", str(preds), "--strategy", "hard",
                 "--threshold", "0.5", "--out", str(out)]) == 0
    assert len(read_records(out)[0]) == 10


def test_cli_errors(tmp_path, capsys):
    data, preds, out = tmp_path / "items.json", tmp_path / "preds.jsonl", tmp_path / "o.json"
    write_records(data, make_items(), "json")
    write_records(preds, make_predictions()[:38], "jsonl")
    assert main(["sample", "--data", str(data), "--predictions", str(preds), "--strategy", "hard",
                 "--out", str(out)]) == 2
    assert "no response for 2 of 40 items: q38, q39" in capsys.readouterr().err
    write_records(preds, make_predictions(), "jsonl")
    assert main(["sample", "--data", str(data), "--predictions", str(preds), "--strategy", "hard",
                 "--n", "20", "--out", str(out)]) == 2
    assert "asked for --n 20 but only 11 items the model gets wrong are available (of 40)" in capsys.readouterr().err
    assert main(["sample", "--data", str(data), "--strategy", "uniform", "--n", "50", "--out", str(out)]) == 2
    assert "only 40 items are available" in capsys.readouterr().err
    assert main(["sample", "--data", str(data), "--strategy", "uniform", "--out", str(data)]) == 2
    assert "is the input file" in capsys.readouterr().err
    right = [dict(p, response="<answer>edema, effusion</answer>") for p in make_predictions()]
    write_records(preds, right, "jsonl")
    assert main(["sample", "--data", str(data), "--predictions", str(preds), "--strategy", "hard",
                 "--out", str(out)]) == 2
    assert "no hard items" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit):
        main(["sample", "--data", str(data), "--strategy", "random", "--out", str(out)])
    assert "invalid choice: 'random'" in capsys.readouterr().err
