"""Guided-GRPO's rule verifier: a deterministic stand-in for the seed's LLM verifier, for demos and tests.

It has the seed's inputs (problem text, reference, the policy's turns): it stops on a
correct boxed answer, asks for the format when there is none, otherwise says what is
wrong and gives one cue. It has no fluency, and its hallucination check only knows
numbers. Registered as the verifier backend ``rule`` (``worker.rollout.verifier.backend``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from grouprl.rewards.rule_based import answers_match, extract_answer, final_answer, normalize_answer, parse_number
from grouprl.rollout.verifier import Verifier, VerifierReply, VerifierRequest, register_verifier_backend

# A number as written in text: digits with thousands commas and decimals. The sign is left
# out ("-3" where the problem says 3 is an operation on a given value, not a new one), and
# so is "a/b", whose parts are checked one by one.
_NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?![\w])")
# Enumeration markers are layout, not claims: "Step 2", "2." or "2)" at a line start, "(2)".
_ENUMERATION = re.compile(r"(?:\bstep\s+\d+\b)|(?:^\s*\d+[.)](?=\s))|(?:\(\d+\))", re.IGNORECASE | re.MULTILINE)
_SET_BRACES = re.compile(r"^\\?[{(\[]|\\?[})\]]$")


def _numbers_in(text: str) -> set[Fraction]:
    text = _ENUMERATION.sub(" ", text)
    found = set()
    for m in _NUMBER.finditer(text):
        value = parse_number(m.group())
        if value is not None:
            found.add(value)
    return found


def _items(answer: str) -> list[str] | None:
    """The items of a comma-separated answer (``1, 2, 3`` or ``\\{a, b\\}``), or None for a single item."""
    s = answer.strip()
    while _SET_BRACES.search(s) and len(s) > 1:
        s = _SET_BRACES.sub("", s).strip()
    if "," not in s or parse_number(s) is not None:  # "1,200" is one number
        return None
    return [normalize_answer(x) for x in s.split(",") if x.strip()]


@register_verifier_backend("rule")
class RuleVerifier(Verifier):
    """A deterministic verifier with the seed's inputs: problem text, reference, the policy's turns.

    On the last turn:

    - a final answer (:func:`has_final_answer`) equal to the reference's answer
      (:func:`answers_match`): the stop token alone; with no reference (validation)
      any final answer stops, since there is nothing to check it against;
    - no final answer: a request to write it as ``<answer>\\boxed{...}</answer>``;
    - a wrong one: what is wrong (a number "too high"/"too low", a list "k of your n
      items are right") and one small cue, never the answer.

    Every reply but STOP ends with a checkpoint question and, when scores are on,
    ``[SCORE] hallucination_detect=0`` if the last turn states a number found neither
    in the problem nor in the reference (enumerations like "Step 2" aside), else ``=1``.
    The check is blunt by design: a value the student derived correctly also counts,
    and numbers shown only in an image are unknown to it, as to the seed's verifier.
    """

    backend = "rule"

    def _reply_many(self, requests: list[VerifierRequest]) -> list[VerifierReply]:
        return [self._reply(self.respond(r)) for r in requests]

    def respond(self, request: VerifierRequest) -> str:
        """The raw reply text for one request."""
        last = request.turns[-1] if request.turns else ""
        predicted = final_answer(last)
        gold = extract_answer(request.reference) if request.reference is not None else None
        if predicted is not None and (gold is None or answers_match(gold, predicted)):
            return self.config.stop_token
        if predicted is None:
            guidance = ("Your final answer is missing or not in the required format. Write it once, as "
                        "<answer>\\boxed{...}</answer>, with exactly one \\boxed{} inside.")
            question = "What is your final answer, in that format?"
        else:
            # step-level feedback, as the seed's teacher prompt asks, when the reference is a worked
            # solution the student's steps can be held against; else what is wrong with the answer
            steps = step_feedback(last, request.reference) if request.reference is not None else None
            guidance, question = steps if steps is not None else _correction(gold, predicted)
        lines = [guidance, question]
        if self.config.enable_hallucination_score:
            lines.append(f"[SCORE] hallucination_detect={self.hallucination_score(request)}")
        return "\n".join(lines)

    @staticmethod
    def hallucination_score(request: VerifierRequest) -> int:
        """0 when the last turn states a number found neither in the problem nor in the reference, else 1."""
        last = request.turns[-1] if request.turns else ""
        known = _numbers_in(request.problem) | _numbers_in(request.reference or "")
        return 0 if _numbers_in(last) - known else 1


# "a op b = c": one step of a worked solution. Signs are not part of the operands: the synthetic
# problems never go negative, and "-" between two numbers is the operation.
_STEP = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s*([-+*/\u00d7\u00f7])\s*(\d+(?:\.\d+)?)\s*=\s*(-?\d+(?:\.\d+)?)(?![\w])")
_OPERATIONS = {"+": ("addition", lambda a, b: a + b), "-": ("subtraction", lambda a, b: a - b),
               "*": ("multiplication", lambda a, b: a * b), "\u00d7": ("multiplication", lambda a, b: a * b),
               "/": ("division", lambda a, b: a / b if b else None), "\u00f7": ("division", lambda a, b: a / b if b else None)}


@dataclass(frozen=True)
class Step:
    """One ``a op b = c`` step of a worked solution, as written (``result`` may be wrong)."""

    a: Fraction
    op: str
    b: Fraction
    result: Fraction
    text: str

    @property
    def expression(self) -> str:
        """The step as written, up to its ``=`` (``12 - 3``): what it computes, not what it got."""
        return self.text.split("=")[0].strip()

    @property
    def operation(self) -> str:
        return _OPERATIONS[self.op][0]

    @property
    def sound(self) -> bool:
        """Whether the step's own arithmetic is right."""
        return _OPERATIONS[self.op][1](self.a, self.b) == self.result


def worked_steps(text: str) -> list[Step]:
    """The ``a op b = c`` steps of ``text``, in order (``x`` and ``\u00f7`` read as their operations)."""
    steps = []
    for m in _STEP.finditer(text):
        a, b, result = (parse_number(g) for g in (m.group(1), m.group(3), m.group(4)))
        if None not in (a, b, result):
            steps.append(Step(a, m.group(2), b, result, " ".join(m.group(0).split())))
    return steps


def step_feedback(turn: str, reference: str) -> tuple[str, str] | None:
    """(guidance, question) naming the student's first wrong step against the reference's worked
    solution, without its result; None when either has no steps to compare.

    A step is wrong when its own arithmetic is wrong (it is named, with its operands, and the
    student is asked to redo it), or when it combines other numbers or another operation than the
    reference's step at that place (named by its position and the operation it should be). A
    student who stops early is told how many of the needed steps are done; one whose steps are all
    right but whose boxed answer is not their result is told that."""
    expected, written = worked_steps(reference), worked_steps(turn)
    if not expected or not written:
        return None
    for k, want in enumerate(expected, start=1):
        done = "Your first step is right" if k == 2 else f"Your first {k - 1} steps are right"
        if k > len(written):
            return f"{done}, but the problem needs {len(expected)} steps.", "What is the next step?"
        got = written[k - 1]
        if (got.a, got.op, got.b) != (want.a, want.op, want.b):
            return (f"Step {k} ({got.expression}) does not follow the problem: it should be the {want.operation} "
                    "the problem describes next.", f"Which numbers does step {k} combine, and how?")
        if not got.sound:
            before = "" if k == 1 else f" {done}."
            return f"Step {k}, the {got.operation} {got.expression}, is computed wrong.{before}", f"What is {got.expression}?"
    return ("Your steps are right, but your boxed answer is not the result of your last step.",
            "What does your last step give?")


def _correction(gold: str, predicted: str) -> tuple[str, str]:
    """What is wrong with a final answer and one cue, without giving the answer away."""
    a, b = parse_number(gold), parse_number(predicted)
    if a is not None and b is not None:
        if b == -a:
            return (f"Your answer {predicted} has the wrong sign.",
                    "Which step flips the sign, and should it?")
        direction = "too high" if b > a else "too low"
        cue = "Re-check the last computation that produced it."
        if a != 0 and b != 0 and _power_of_ten(b / a):
            cue = "Check your units and the position of the decimal point."
        return f"Your answer {predicted} is {direction}. {cue}", "What do you get when you redo that step?"
    gold_items, predicted_items = _items(gold), _items(predicted)
    if gold_items is not None and predicted_items is not None:
        right = len(set(predicted_items) & set(gold_items))
        cue = ("The answer has a different number of items than yours."
               if len(set(predicted_items)) != len(set(gold_items)) else "Test each item against the conditions.")
        return (f"{right} of your {len(predicted_items)} items are right. {cue}",
                "Which of your items fails a condition of the problem?")
    return ("Your final answer does not match the expected result.",
            "Which condition of the problem does your answer not satisfy yet?")


def _power_of_ten(ratio: Fraction) -> bool:
    ratio = abs(ratio)
    if ratio < 1:
        ratio = 1 / ratio
    return ratio.denominator == 1 and ratio > 1 and str(ratio.numerator).strip("0") == "1"
