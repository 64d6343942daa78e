"""The synthetic arithmetic problems of the Guided-GRPO demo and tiny runs."""

from __future__ import annotations

import json
import random

import pytest

from grouprl.domains.reasoning import synthetic_math as sm
from grouprl.rewards.rule_based import answers_match, extract_answer, final_answer


def test_problems_are_deterministic_per_index():
    a = sm.generate_problems(20, seed=3)
    b = sm.generate_problems(5, seed=3)
    assert a[:5] == b  # problem i depends on (seed, i), not on n
    assert sm.generate_problems(20, seed=4) != a


def test_solution_is_the_arithmetic_of_the_story():
    for p in sm.generate_problems(200, seed=0, max_value=10):
        values = [p.a, p.b, p.c]
        assert all(str(v) in p.text for v in values)
        s = p.a + p.b if p.ops[0] == "+" else p.a - p.b
        r = s + p.c if p.ops[1] == "+" else s - p.c
        assert (p.intermediate, p.result) == (s, r) and s >= 0 and r >= 0
        assert final_answer(p.solution) == str(r)
        assert f"{p.a} {p.ops[0]} {p.b} = {s}. {s} {p.ops[1]} {p.c} = {r}." in p.solution
        # the story's verbs say which operation it is
        first = p.text.split(". ")[1]
        assert ("more" in first.split(",")[0]) == (p.ops[0] == "+")


def test_exclude_keeps_held_out_arithmetic_apart():
    train = sm.generate_problems(300, seed=0, max_value=10)
    held = sm.generate_problems(100, seed=1, max_value=10, exclude=[p.key for p in train])
    assert not {p.key for p in held} & {p.key for p in train}
    with pytest.raises(ValueError, match="max_value"):
        sm.generate_problems(1, seed=0, max_value=1)


def test_slip_solution_is_wrong_by_one_step():
    rng = random.Random(0)
    for p in sm.generate_problems(100, seed=0, max_value=10):
        wrong = sm.slip_solution(p, rng)
        answer = final_answer(wrong)
        assert answer is not None and not answers_match(str(p.result), answer)
        assert int(answer) >= 0


def test_records_round_trip_through_the_loader(tmp_path):
    from grouprl.data import load_samples

    problems = sm.generate_problems(4, seed=0)
    path = sm.write_dataset(tmp_path / "d.jsonl", problems)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["result"] for r in records] == [p.result for p in problems]
    samples = load_samples([str(path)], format="easyr1")
    assert samples[0].answer == problems[0].solution
    assert extract_answer(samples[0].answer) == str(problems[0].result)
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, nothing left behind

    correction = sm.correction_record(problems[1], 0, "1 + 1 = 3. <answer>\\boxed{3}</answer>", "Too high.")
    path = sm.write_records(tmp_path / "c.jsonl", [correction])
    dialogue = load_samples([str(path)], format="swift")[0]
    assert dialogue.answer == problems[1].solution
    assert [m["role"] for m in dialogue.messages] == ["user", "assistant", "user"]
