"""Synthetic multi-step arithmetic word problems, for the Guided-GRPO demo and tiny runs.

Each problem is a short story with two operations on three numbers ("a + b - c",
"a - b + c", "a + b + c" or "a - b - c"):

    Ann has 7 shells. Ann finds 5 more, then loses 3. How many shells does Ann have now?
    Give the result as <answer>\\boxed{N}</answer>.

The reference is a worked solution, one line per step, then the final answer in the
format Guided-GRPO's verifier and reward expect:

    7 + 5 = 12. 12 - 3 = 9. <answer>\\boxed{9}</answer>

so the same record serves SFT (the solution is the target), the reward and the
verifier (both read the boxed result; the verifier also sees the intermediate value
in the reference, so a correct step is not taken for a hallucination). No
intermediate or final value is negative.

Everything is deterministic under ``seed``: problem ``i`` of a seed is the same
whatever ``n`` is. ``exclude`` keeps held-out problems apart from training ones by
their arithmetic (the numbers and operations), not only by their wording.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from grouprl.files import write_text_atomic

NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun")
ITEMS = ("apples", "coins", "books", "stamps", "marbles", "shells", "cards", "pens")
GAINS = ("finds", "buys", "gets", "wins")  # verbs of "+": "<name> <verb> <b> more"
LOSSES = ("loses", "sells", "gives away", "uses")  # verbs of "-"
OPS = ("+", "-")
INSTRUCTION = "Give the result as <answer>\\boxed{N}</answer>."


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    c: int
    ops: tuple[str, str]  # the first and second operation, each "+" or "-"
    name: str
    item: str
    verbs: tuple[str, str]

    @property
    def key(self) -> tuple:
        """The arithmetic alone: what ``exclude`` compares."""
        return (self.a, self.ops[0], self.b, self.ops[1], self.c)

    @property
    def intermediate(self) -> int:
        return _apply(self.a, self.ops[0], self.b)

    @property
    def result(self) -> int:
        return _apply(self.intermediate, self.ops[1], self.c)

    @property
    def text(self) -> str:
        first = f"{self.verbs[0]} {self.b} more" if self.ops[0] == "+" else f"{self.verbs[0]} {self.b}"
        second = f"{self.verbs[1]} {self.c} more" if self.ops[1] == "+" else f"{self.verbs[1]} {self.c}"
        return (f"{self.name} has {self.a} {self.item}. {self.name} {first}, then {second}. "
                f"How many {self.item} does {self.name} have now? {INSTRUCTION}")

    @property
    def solution(self) -> str:
        s = self.intermediate
        return (f"{self.a} {self.ops[0]} {self.b} = {s}. {s} {self.ops[1]} {self.c} = {self.result}. "
                f"<answer>\\boxed{{{self.result}}}</answer>")

    def record(self, index: int) -> dict:
        """An EasyR1 record: ``problem``, ``answer`` (the worked solution) and the parts it was made from."""
        return {"id": f"math-{index:06d}", "problem": self.text, "answer": self.solution, "result": self.result,
                "numbers": [self.a, self.b, self.c], "ops": list(self.ops)}


def slip_solution(problem: Problem, rng: random.Random) -> str:
    """A worked solution with one arithmetic slip (off by 1 to 3 in one step, carried through), for
    correction dialogues: its final answer is wrong, its numbers are never negative."""
    a, (op1, op2), b, c = problem.a, problem.ops, problem.b, problem.c
    while True:
        step = rng.choice((1, 2))
        delta = rng.choice((-3, -2, -1, 1, 2, 3))
        s = problem.intermediate + (delta if step == 1 else 0)
        r = _apply(s, op2, c) + (delta if step == 2 else 0)
        if s >= 0 and r >= 0 and r != problem.result:
            return f"{a} {op1} {b} = {s}. {s} {op2} {c} = {r}. <answer>\\boxed{{{r}}}</answer>"


def correction_record(problem: Problem, index: int, wrong: str, reply: str) -> dict:
    """An ms-swift record of a two-turn dialogue: the problem, a wrong attempt, the verifier's ``reply``;
    the worked solution is the answer (what SFT trains on, after the dialogue so far)."""
    return {"id": f"math-correction-{index:06d}",
            "messages": [{"role": "user", "content": problem.text}, {"role": "assistant", "content": wrong},
                         {"role": "user", "content": reply}],
            "solution": problem.solution, "result": problem.result}


def verifier_replies(problems: list[Problem]) -> list[str]:
    """The rule verifier's replies to slipped, mis-set-up and unfinished solutions of ``problems``:
    the phrases a tokenizer for this task should know."""
    from grouprl.domains.reasoning.verifier import step_feedback

    replies = []
    for i, p in enumerate(problems):
        first_step = p.solution.split(". ")[0] + "."
        swapped = f"{p.a} {'-' if p.ops[0] == '+' else '+'} {p.b} = {abs(_apply(p.a, '-' if p.ops[0] == '+' else '+', p.b))}."
        for attempt in (slip_solution(p, random.Random(f"corpus:{i}")), first_step, swapped):
            feedback = step_feedback(attempt, p.solution)
            if feedback is not None:
                replies.append(" ".join(feedback))
    return replies


def _apply(x: int, op: str, y: int) -> int:
    return x + y if op == "+" else x - y


def make_problem(rng: random.Random, *, max_value: int = 20) -> Problem:
    """One problem with a in [2, max_value], b and c in [1, max_value] and no negative value along the way."""
    if max_value < 2:
        raise ValueError(f"max_value must be >= 2, got {max_value}")
    while True:
        a, b, c = rng.randint(2, max_value), rng.randint(1, max_value), rng.randint(1, max_value)
        ops = (rng.choice(OPS), rng.choice(OPS))
        s = _apply(a, ops[0], b)
        if s < 0 or _apply(s, ops[1], c) < 0:
            continue
        verbs = tuple(rng.choice(GAINS if op == "+" else LOSSES) for op in ops)
        return Problem(a, b, c, ops, rng.choice(NAMES), rng.choice(ITEMS), verbs)


def generate_problems(n: int, *, seed: int, max_value: int = 20, exclude: Iterable[tuple] = ()) -> list[Problem]:
    """``n`` problems; problem ``i`` depends only on ``seed`` and ``i`` (and on ``exclude``, which it avoids)."""
    banned = set(exclude)
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}:{i}")
        for _ in range(10_000):
            p = make_problem(rng, max_value=max_value)
            if p.key not in banned:
                break
        else:
            raise ValueError(f"no problem with max_value={max_value} outside the {len(banned)} excluded ones")
        out.append(p)
    return out


def write_dataset(path: str | Path, problems: list[Problem]) -> Path:
    """The problems as EasyR1 JSON lines at ``path`` (written atomically)."""
    return write_records(path, [p.record(i) for i, p in enumerate(problems)])


def write_records(path: str | Path, records: list[dict]) -> Path:
    """Records as JSON lines at ``path`` (written atomically)."""
    path = Path(path)
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
    return path


def corpus(max_value: int = 20) -> list[str]:
    """Text a tokenizer for this task should know: problems, solutions and the rule verifier's replies."""
    problems = generate_problems(400, seed=-1, max_value=max_value)
    text = [p.text for p in problems] + [p.solution for p in problems]
    text += [str(i) for i in range(0, 3 * max_value + 1)]
    text += verifier_replies(problems[:100])
    text += [  # what the rule verifier and the dialogue runner write between turns
        "Your answer is too high. Re-check the last computation that produced it.",
        "Your answer is too low. Re-check the last computation that produced it.",
        "What do you get when you redo that step?",
        "Your final answer is missing or not in the required format. Write it once, as "
        "<answer>\\boxed{...}</answer>, with exactly one \\boxed{} inside.",
        "What is your final answer, in that format?",
        "[SCORE] hallucination_detect=0", "[SCORE] hallucination_detect=1",
        "Please continue and provide the final answer in the required format.",
        "That is not right. Try again.",  # the demo's content-free feedback (demo.TRY_AGAIN)
    ]
    return text
