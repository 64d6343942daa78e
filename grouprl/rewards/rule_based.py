"""Built-in rule-based rewards: response format, answer accuracy, response length.

Registered as ``format``, ``accuracy`` and ``length``; their options go in a
RewardSpec's ``kwargs`` (e.g. ``{"name": "format", "kwargs": {"style": "boxed"}}``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from fractions import Fraction
import threading
from typing import Any, Sequence

from grouprl.rewards.contract import completion_text
from grouprl.rewards.registry import register_reward

logger = logging.getLogger(__name__)

FORMAT_STYLES = ("think_answer", "boxed", "think_boxed")

_BOXED_OPEN = re.compile(r"\\boxed\s*\{")
_ANSWER_SPAN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
_THINK_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_THINK_THEN_REST = re.compile(r"\s*<think>.*?</think>(.*)", re.DOTALL)
_WHITESPACE = re.compile(r"\s+")
# The seed's normalisation before its final-answer rule and its grading: whitespace around every
# "<", ">" and "/" removed (the seed's fix for models that write "< answer >"), so
# "< answer >\boxed{2}</ answer >" is a final answer.
_TAG_SPACE = re.compile(r"\s*(<|>|/)\s*")


# ---------------------------------------------------------------- answer extraction


def _boxed_contents(text: str) -> list[str]:
    """Contents of the complete top-level ``\\boxed{...}`` groups of ``text``, in order.

    Braces are counted so that nested groups (``\\boxed{\\frac{1}{2}}``) are kept whole;
    a backslash escapes the next character, as in TeX, so ``\\{`` and ``\\}`` (set
    braces) do not count. A group left open (a truncated response) is skipped.
    """
    found: list[str] = []
    pos = 0
    while True:
        m = _BOXED_OPEN.search(text, pos)
        if m is None:
            return found
        end = _group_end(text, m.end())
        if end is not None:
            found.append(text[m.end() : end])
            pos = end + 1  # groups nested in this one are part of it, not separate answers
        else:
            pos = m.start() + 1


def _group_end(text: str, start: int) -> int | None:
    """Index of the ``}`` closing the group whose content starts at ``start``, or None if it stays open."""
    depth, i = 1, start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` in ``text`` (stripped), or None if there is none."""
    contents = _boxed_contents(text)
    return contents[-1].strip() if contents else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{`` in ``text`` (stripped), None when there is none or it is left open.

    What the seed grades: the last box anywhere in the response, and nothing when that
    box never closes (a truncated answer does not fall back to an earlier box).
    """
    opens = list(_BOXED_OPEN.finditer(text))
    if not opens:
        return None
    start = opens[-1].end()
    end = _group_end(text, start)
    return None if end is None else text[start:end].strip()


def normalize_tags(text: str) -> str:
    """``text`` with the whitespace around every ``<``, ``>`` and ``/`` removed, as the seed normalises responses."""
    return _TAG_SPACE.sub(r"\1", text)


def extract_answer(text: str) -> str:
    """The answer a response (or a reference) states.

    The last ``\\boxed{...}``, else the last ``<answer>...</answer>`` span, else the whole
    text; stripped.
    """
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    spans = _ANSWER_SPAN.findall(text)
    if spans:
        return spans[-1].strip()
    return text.strip()


def normalize_answer(text: str) -> str:
    """Canonical form for exact comparison.

    Strips whitespace, trailing periods and surrounding ``$`` (repeatedly, so ``"$5$."``
    and ``"$$5$$"`` both give ``"5"``), then casefolds and collapses inner whitespace.
    """
    s = text
    while True:
        before = s
        s = s.strip()
        if s.endswith("."):
            s = s[:-1]
        if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
            s = s[1:-1]
        if s == before:
            break
    return _WHITESPACE.sub(" ", s.casefold())


# ---------------------------------------------------------------- mathematical equivalence


@functools.lru_cache(maxsize=None)
def _math_verify() -> Any:
    """The math_verify module, or None when it is not installed (the `math` extra)."""
    try:
        import math_verify
    except ImportError:
        logger.info(
            "math-verify is not installed: 'accuracy' compares answers as normalised text only "
            "(pip install 'grouprl[math]' for mathematical equivalence)"
        )
        return None
    except Exception as exc:  # a broken install must not take the reward down; say why it is off
        logger.warning(
            "math-verify failed to import (%s: %s); 'accuracy' uses text match only", type(exc).__name__, exc
        )
        return None
    return math_verify


@functools.lru_cache(maxsize=None)
def _timeout_kwargs(threaded: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword arguments turning off math-verify's timeouts off the main thread.

    Its timeouts use signal.alarm, which only works in the main thread: elsewhere parse
    raises, which would make every comparison "not equal". Versions without the
    parameters get none.
    """
    mv = _math_verify()
    if not threaded:
        return {}, {}
    parse_params = inspect.signature(mv.parse).parameters
    verify_params = inspect.signature(mv.verify).parameters
    return (
        {"parsing_timeout": None} if "parsing_timeout" in parse_params else {},
        {"timeout_seconds": None} if "timeout_seconds" in verify_params else {},
    )


def _as_latex(answer: str) -> str:
    # math-verify extracts from LaTeX inside math delimiters; a bare "x+1" or "\sqrt{4}"
    # is otherwise not found at all.
    s = answer.strip()
    while len(s) >= 2 and s.startswith("$") and s.endswith("$"):
        s = s[1:-1].strip()
    return s if "$" in s else f"${s}$"


def math_equal(gold: str, pred: str) -> bool:
    """True when math-verify is installed and finds ``pred`` mathematically equal to ``gold``.

    Any exception inside math-verify counts as "not equal": a malformed answer is a
    wrong answer, not a crashed run.
    """
    mv = _math_verify()
    if mv is None:
        return False
    parse_kwargs, verify_kwargs = _timeout_kwargs(threading.current_thread() is not threading.main_thread())
    try:
        gold_parsed = mv.parse(_as_latex(gold), **parse_kwargs)
        pred_parsed = mv.parse(_as_latex(pred), **parse_kwargs)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(mv.verify(gold_parsed, pred_parsed, **verify_kwargs))
    except Exception:
        return False




# ---------------------------------------------------------------- final answers (<answer>\boxed{}</answer>)


def has_final_answer(turn: str) -> bool:
    """Whether a policy turn holds exactly one ``<answer>...</answer>`` with exactly one non-empty ``\\boxed{}``.

    This is the condition under which a STOP ends a dialogue (otherwise the policy is
    asked to give its answer in the required format), and the rewards' format rule.
    A ``\\boxed{`` left open counts as a second, broken box. The turn is first
    normalised as the seed does (:func:`normalize_tags`), so ``< answer >`` counts.
    """
    turn = normalize_tags(turn)
    if turn.count(_ANSWER_OPEN) != 1 or turn.count(_ANSWER_CLOSE) != 1:
        return False
    span = _ANSWER_SPAN.search(turn)
    if span is None:  # the closing tag comes first
        return False
    inside = span.group(1)
    if len(_BOXED_OPEN.findall(inside)) != 1:
        return False
    boxed = extract_boxed(inside)
    return boxed is not None and bool(boxed)


def final_answer(turn: str) -> str | None:
    """The boxed content of a turn's final answer (see :func:`has_final_answer`), or None."""
    if not has_final_answer(turn):
        return None
    return extract_boxed(_ANSWER_SPAN.search(normalize_tags(turn)).group(1))


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number (``12``, ``-3.5``, ``1,200``, ``3/4``), or None."""
    s = text.strip().replace(",", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(reference: str, predicted: str) -> bool:
    """Equal as normalised text, as exact numbers, or by math-verify's equivalence."""
    if normalize_answer(reference) == normalize_answer(predicted):
        return True
    a, b = parse_number(reference), parse_number(predicted)
    if a is not None and b is not None:
        return a == b
    return math_equal(reference, predicted)


# ---------------------------------------------------------------- rewards


@register_reward("format")
def format_reward(
    prompts: Sequence[str], completions: Sequence[str], *, style: str = "think_answer", **kwargs: Any
) -> list[float]:
    """1.0 when the completion has the required layout, else 0.0.

    ``style``:
      - ``think_answer`` (default): ``<think>...</think>`` then ``<answer>...</answer>``,
        whitespace allowed around them, nothing else outside, one of each tag, and a
        non-blank answer;
      - ``boxed``: a complete (balanced-brace), non-empty ``\\boxed{...}`` anywhere;
      - ``think_boxed``: starts with one ``<think>...</think>`` and has a complete,
        non-empty ``\\boxed{...}`` after it.
    """
    if style not in FORMAT_STYLES:
        raise ValueError(f"unknown format style {style!r}; choose one of {', '.join(FORMAT_STYLES)}")
    check = {"think_answer": _is_think_answer, "boxed": _has_boxed, "think_boxed": _is_think_boxed}[style]
    return [1.0 if check(completion_text(c)) else 0.0 for c in completions]


def _one_each(text: str, *tags: str) -> bool:
    # A lazy regex alone would accept "<answer>a</answer> junk <answer>b</answer>" as one span.
    return all(text.count(f"<{t}>") == 1 and text.count(f"</{t}>") == 1 for t in tags)


def _is_think_answer(text: str) -> bool:
    m = _THINK_ANSWER.fullmatch(text)
    return bool(m) and _one_each(text, "think", "answer") and bool(m.group(1).strip())


def _has_boxed(text: str) -> bool:
    return any(c.strip() for c in _boxed_contents(text))


def _is_think_boxed(text: str) -> bool:
    m = _THINK_THEN_REST.fullmatch(text)
    return bool(m) and _one_each(text, "think") and _has_boxed(m.group(1))


@register_reward("accuracy")
def accuracy_reward(
    prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's answer equals the reference in the ``answer`` column, else 0.0.

    Both sides go through :func:`extract_answer`; they are equal when their
    :func:`normalize_answer` forms match or, with math-verify installed, when it finds
    them mathematically equivalent (``\\frac{1}{2}`` and ``0.5``). A row whose reference
    is None gets None (not applicable). A reference that is a list accepts any of its items.
    """
    if answer is None:
        raise ValueError(
            f"needs an 'answer' column (the reference answer per row); the batch has columns: "
            f"{', '.join(sorted(kwargs)) or '(none)'}"
        )
    return [None if gold is None else _score_one(gold, completion_text(completion))
            for gold, completion in zip(answer, completions)]


def _score_one(gold: Any, completion: str) -> float:
    golds = gold if isinstance(gold, (list, tuple)) else [gold]
    pred = extract_answer(completion)
    for g in golds:
        if g is None:
            continue
        gold_answer = extract_answer(g if isinstance(g, str) else str(g))
        if normalize_answer(gold_answer) == normalize_answer(pred) or math_equal(gold_answer, pred):
            return 1.0
    return 0.0


@register_reward("length")
def length_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    target: int | None = None,
    max_length: int | None = None,
    **kwargs: Any,
) -> list[float]:
    """A penalty in [-1, 0] on the completion's length in whitespace-separated words ``n``.

    Give exactly one option:
      - ``target``: ``-|n - target| / target``, clipped to [-1, 0] (0 at the target);
      - ``max_length``: 0 while ``n <= max_length``, then ``-(n - max_length) / max_length``,
        clipped at -1 (so -1 from twice the limit on).
    Words, not tokens, so that the reward does not depend on the tokenizer.
    """
    if (target is None) == (max_length is None):
        raise ValueError("give exactly one of the options 'target' or 'max_length'")
    name, limit = ("target", target) if target is not None else ("max_length", max_length)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"option {name!r} must be a positive integer (words), got {limit!r}")
    out = []
    for completion in completions:
        n = len(completion_text(completion).split())
        if target is not None:
            penalty = abs(n - limit) / limit
        else:
            penalty = max(0, n - limit) / limit
        out.append(0.0 - min(1.0, penalty))  # 0.0 - x: no "-0.0" in logs at the target
    return out


@register_reward("guided")
def guided_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    answer: Sequence[Any] | None = None,
    verifier_hallucination_score: Sequence[float | None] | None = None,
    accuracy_weight: float = 0.8,
    format_weight: float = 0.1,
    hallucination_weight: float = 0.1,
    **kwargs: Any,
) -> list[float | None]:
    """Guided-GRPO's reward: accuracy_weight * accuracy + format_weight * format + hallucination_weight * h.

    accuracy: 1 when the last ``\\boxed{}`` anywhere in the completion (:func:`last_boxed`,
    after the seed's :func:`normalize_tags`) equals the reference (:func:`answers_match`),
    else 0, whether or not it sits in a valid ``<answer>``, as the seed grades; format: 1
    when it has a final answer (:func:`has_final_answer`); h: the verifier's mean
    hallucination score for the dialogue (column ``verifier_hallucination_score``), 0.5
    when the column is absent or None, as the seed scores a dialogue without scores.
    The seed's weights are 0.8 / 0.1 / 0.1. A row without a reference gets None.
    """
    if answer is None:
        raise ValueError("the guided reward needs an 'answer' column (the reference answer per row)")
    scores = verifier_hallucination_score or [None] * len(completions)
    out: list[float | None] = []
    for gold, completion, h in zip(answer, completions, scores):
        if gold is None:
            out.append(None)
            continue
        normalized = normalize_tags(completion_text(completion))
        predicted = last_boxed(normalized)
        accurate = predicted is not None and answers_match(extract_answer(str(gold)), predicted)
        out.append(accuracy_weight * float(accurate) + format_weight * float(has_final_answer(normalized))
                   + hallucination_weight * (0.5 if h is None else float(h)))
    return out
