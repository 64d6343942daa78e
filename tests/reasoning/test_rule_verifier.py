"""Guided-GRPO's rule verifier (the ``rule`` backend) on worked dialogues: when it stops, what it asks,
how it scores.

The verifier protocol, its parsing and the other backends: tests/core/test_verifier.py.
"""

from __future__ import annotations

from grouprl.config import VerifierConfig
from grouprl.domains.reasoning.verifier import RuleVerifier
from grouprl.rollout.verifier import VerifierReply, VerifierRequest, build_verifier

PROBLEM = "[IMAGE]\nA shop sells 3 apples for 4 dollars. How much do 12 apples cost, in dollars?"


def rule(**overrides) -> RuleVerifier:
    return build_verifier(VerifierConfig(backend="rule", **overrides))


def reply(verifier, turns: list[str], reference: str | None = "16", problem: str = PROBLEM) -> VerifierReply:
    (out,) = verifier.reply_many([VerifierRequest(problem=problem, reference=reference, turns=turns)])
    return out


def test_rule_stops_on_a_correct_boxed_answer():
    v = rule()
    out = reply(v, ["12/3 = 4 groups of 3; 4*4 = 16 dollars. <answer>\\boxed{16}</answer>"])
    assert out.stop and out.text == "###STOP###" and not out.failed
    assert v.backend == "rule" and v.requests == 1
    # equal by value, not only by text
    assert reply(v, ["<answer>\\boxed{16.0}</answer>"]).stop
    assert reply(v, ["<answer>\\boxed{\\frac{1}{2}}</answer>"], reference="\\boxed{0.5}", problem="Half of 1?").stop


def test_rule_asks_for_the_format_when_there_is_no_final_answer():
    out = reply(rule(), ["12/3 = 4 groups, so 4*4 = 16 dollars."])
    assert not out.stop
    assert "<answer>\\boxed{...}</answer>" in out.text and "format" in out.text
    assert out.score == 1.0  # every number is in the problem or the reference
    # a right value outside the required format is not a final answer either
    assert not reply(rule(), ["\\boxed{16}"]).stop


def test_rule_says_a_wrong_number_is_too_high_or_too_low_without_giving_the_answer():
    v = rule()
    high = reply(v, ["So <answer>\\boxed{20}</answer>"])
    low = reply(v, ["So <answer>\\boxed{12}</answer>"])
    assert "20 is too high" in high.text and "12 is too low" in low.text
    for out in (high, low):
        assert not out.stop and "16" not in out.text
        lines = out.text.splitlines()
        assert lines[-2].endswith("?")  # a checkpoint question, then the score line
        assert lines[-1].startswith("[SCORE] hallucination_detect=")


def test_rule_counts_the_right_items_of_a_list():
    out = reply(rule(), ["<answer>\\boxed{2, 3, 9}</answer>"], reference="2, 3, 5, 7",
                problem="List the primes below 10.")
    assert "2 of your 3 items are right" in out.text and not out.stop


def test_rule_scores_a_number_from_nowhere_as_a_hallucination():
    v = rule()
    grounded = reply(v, ["Step 1: 12 apples make 12/3 = 4 groups of 3 apples. Step 2: what next?"])
    invented = reply(v, ["Step 1: the shop gives a 7 dollar discount. Step 2: what next?"])
    assert grounded.score == 1.0 and "hallucination_detect=1" in grounded.text
    assert invented.score == 0.0 and "hallucination_detect=0" in invented.text


def test_rule_without_a_reference_stops_on_any_final_answer():
    assert reply(rule(), ["<answer>\\boxed{17}</answer>"], reference=None).stop


def test_scores_off_means_no_score_line_and_no_score():
    out = reply(rule(enable_hallucination_score=False), ["Step 1: 7 dollars."])
    assert out.score is None and "[SCORE]" not in out.text


def test_rule_counts_tokens_with_the_given_tokenizer():
    class Words:  # a tokenizer-shaped counter: one token per word
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": text.split()}

    out = build_verifier(VerifierConfig(backend="rule"), tokenizer=Words()).reply_many(
        [VerifierRequest(PROBLEM, "16", ["no answer yet"])])[0]
    assert out.tokens == len(out.text.split())
    assert reply(rule(), ["no answer yet"]).tokens is None


# ---------------------------------------------------------------- step-level feedback

STORY = ("Ann has 7 shells. Ann finds 5 more, then loses 3. How many shells does Ann have now? "
         "Give the result as <answer>\\boxed{N}</answer>.")
WORKED = "7 + 5 = 12. 12 - 3 = 9. <answer>\\boxed{9}</answer>"


def test_rule_names_the_first_wrong_step_and_never_its_result():
    cases = {  # the student's turn -> what the reply must say
        "7 + 5 = 13. 13 - 3 = 10. <answer>\\boxed{10}</answer>": "Step 1, the addition 7 + 5, is computed wrong.",
        "7 + 5 = 12. 12 - 3 = 8. <answer>\\boxed{8}</answer>":
            "Step 2, the subtraction 12 - 3, is computed wrong. Your first step is right.",
        "7 - 5 = 2. 2 - 3 = 1. <answer>\\boxed{1}</answer>":
            "Step 1 (7 - 5) does not follow the problem: it should be the addition",
        "7 + 5 = 12. <answer>\\boxed{12}</answer>": "Your first step is right, but the problem needs 2 steps.",
        "7 + 5 = 12. 12 - 3 = 9. <answer>\\boxed{8}</answer>": "not the result of your last step",
    }
    for turn, said in cases.items():
        out = reply(rule(), [turn], reference=WORKED, problem=STORY)
        assert not out.stop and said in out.text, (turn, out.text)
        assert "9" not in out.text.replace("hallucination_detect", "")  # the result is never given
    # a bare answer has no steps to hold against the reference: what is wrong with the answer
    assert "is too low" in reply(rule(), ["<answer>\\boxed{8}</answer>"], reference=WORKED, problem=STORY).text


def test_every_correction_record_of_the_demo_points_at_the_slipped_step():
    import random

    from grouprl.domains.reasoning.synthetic_math import generate_problems, slip_solution

    for i, p in enumerate(generate_problems(300, seed=7, max_value=10)):
        wrong = slip_solution(p, random.Random(f"7:slip:{i}"))
        # where the slip is, read off the numbers: step 1 got another intermediate value, or step 2
        # another result from the right intermediate value
        slipped = 1 if f"= {p.intermediate}." not in wrong.split(". ")[0] + "." else 2
        out = reply(rule(), [wrong], reference=p.solution, problem=p.text)
        assert out.text.startswith(f"Step {slipped}, the "), (wrong, out.text)
