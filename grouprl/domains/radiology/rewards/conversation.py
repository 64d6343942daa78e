"""Multi-turn conversation about a chest X-ray, scored by an LLM judge (RadVLM's conversation task).

In RadVLM's conversation data a LLaVA record holds several question/answer turns.
Here the turns before the last answer are the prompt and the last answer is the
reference; a judge model behind an OpenAI-compatible endpoint
(:class:`grouprl.rewards.judge.ChatJudge`) reads the conversation, the expected
answer and the model's answer and ends its reply with ``Overall score: <x>/10``
(RadVLM's evaluation asks GPT-4o for the same line). The score is ``x / 10``.

A reply without that line, or with x outside [0, 10], is unusable: it is retried
and then the row fails (an error, or unscored with ``on_failure="skip"``), never 0.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from grouprl.rewards.contract import completion_text
from grouprl.rewards.judge import (
    JUDGE_API_KEY_ENV,
    ChatJudge,
    Judged,
    judge_from_options,
)
from grouprl.domains.radiology.rewards.task_rows import applies, row_name
from grouprl.rewards.registry import register_reward

CONVERSATION_TASKS = frozenset({"conversation"})

JUDGE_INSTRUCTIONS = """\
You grade one answer of an AI assistant in a conversation about a chest X-ray. The \
assistant saw the image and the conversation so far. You see the conversation, the \
expected answer to the last question (written by someone who knew the image's findings) \
and the assistant's answer.

Judge the assistant's answer against the expected answer: is it correct, complete and \
relevant to the question? The same content in other words is fine; a wrong finding, side \
or location, a missed finding, or an unsupported claim is not. Explain your judgement in \
at most three sentences, then end with one line in exactly this form:
Overall score: <integer from 0 to 10>/10"""

_SCORE = re.compile(r"overall\s*score\s*[:=\-]?\s*\**\s*([-+]?\d+(?:\.\d+)?)\s*\**\s*/\s*10", re.I)
_ROLE_NAMES = {"human": "User", "user": "User", "gpt": "Assistant", "assistant": "Assistant",
               "system": "System"}


def parse_overall_score(reply: str) -> float:
    """The x of the reply's last ``Overall score: x/10`` line; ValueError if none or x is outside [0, 10]."""
    matches = _SCORE.findall(reply or "")
    if not matches:
        raise ValueError(f"no 'Overall score: x/10' line in the judge's reply: {(reply or '')[:200]!r}")
    value = float(matches[-1])
    if not 0.0 <= value <= 10.0:
        raise ValueError(f"overall score {value:g}/10 is outside 0-10")
    return value


def history_turns(history: Any, *, where: str = "history") -> list[tuple[str, str]]:
    """``(speaker, text)`` turns from LLaVA turns (``from``/``value``) or chat messages (``role``/``content``).

    Image placeholders are dropped: the judge sees text only.
    """
    if not isinstance(history, (list, tuple)) or not history:
        raise ValueError(f"{where}: expected a non-empty list of conversation turns, got {history!r:.80}")
    turns = []
    for i, turn in enumerate(history):
        if not isinstance(turn, dict):
            raise ValueError(f"{where}[{i}]: expected an object with 'from' and 'value', got {type(turn).__name__}")
        speaker = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if isinstance(text, list):  # chat content items
            text = "".join(part.get("text", "") for part in text if isinstance(part, dict))
        if speaker not in _ROLE_NAMES or not isinstance(text, str):
            raise ValueError(f"{where}[{i}]: expected 'from' in {sorted(_ROLE_NAMES)} and a text 'value', "
                             f"got {turn!r:.120}")
        turns.append((_ROLE_NAMES[speaker], text.replace("<image>", "").strip()))
    return turns


def judge_messages(turns: Sequence[tuple[str, str]], expected: str, generated: str) -> list[dict[str, Any]]:
    """The judge's one user message: instructions, the conversation so far, expected and generated answers."""
    conversation = "\n".join(f"{speaker}: {text}" for speaker, text in turns)
    content = (f"{JUDGE_INSTRUCTIONS}\n\nConversation so far:\n{conversation}\n\n"
               f"Expected answer: {expected.strip()}\n\nAssistant's answer: {generated.strip()}")
    return [{"role": "user", "content": content}]


def judge_conversations(judge: ChatJudge, histories: Sequence[Sequence[tuple[str, str]]], expected: Sequence[str],
                        generated: Sequence[str], *, items: Sequence[str] | None = None,
                        on_failure: str = "raise") -> list[Judged[float]]:
    """Each final answer's judge score in [0, 1] (``x / 10``); unscored (value None) only with ``on_failure="skip"``."""
    if not len(histories) == len(expected) == len(generated):
        raise ValueError(f"got {len(histories)} histories, {len(expected)} expected and {len(generated)} "
                         f"generated answers")
    requests = [judge_messages(h, e, g) for h, e, g in zip(histories, expected, generated)]
    outcomes = judge.judge_many(requests, parse_overall_score, items=items, on_failure=on_failure)
    return [Judged(None if o.value is None else o.value / 10.0, o.reply, o.error) for o in outcomes]


@register_reward("conversation_judge")
def conversation_judge_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[str | None] | None = None,
    task: Sequence[Any] | None = None,
    history: Sequence[Any] | None = None,
    *,
    base_url: str | None = None,
    model: str | None = None,
    api_key_env: str = JUDGE_API_KEY_ENV,
    timeout: float = 60.0,
    max_retries: int = 3,
    backoff: float = 1.0,
    concurrency: int = 4,
    on_failure: str = "raise",
    **columns: Any,
) -> list[float | None]:
    """RadVLM conversation reward: an LLM judge's ``Overall score`` / 10 for the final answer.

    The conversation so far comes from a ``history`` column (LLaVA turns) when the
    data has one, else from the prompt text. ``base_url`` / ``model`` default to
    ``$GROUPRL_JUDGE_BASE_URL`` / ``$GROUPRL_JUDGE_MODEL``; the bearer key is read from
    ``$<api_key_env>``. ``on_failure="raise"`` (default) fails the batch when the judge
    fails for a row after its retries; ``"skip"`` gives that row None (unscored,
    counted in the reward's applicable fraction), never 0.
    """
    if answer is None:
        raise ValueError("conversation_judge needs the 'answer' column (the expected last answer)")
    named = {"id": columns.get("id")}
    rows = [row for row in range(len(completions)) if applies(task, row, CONVERSATION_TASKS)]
    out: list[float | None] = [None] * len(completions)
    if not rows:
        return out
    histories, expected, generated, items = [], [], [], []
    for row in rows:
        where = row_name(named, row)
        if not isinstance(answer[row], str) or not answer[row].strip():
            raise ValueError(f"conversation_judge: {where} has no expected answer")
        if history is not None and history[row] is not None:
            histories.append(history_turns(history[row], where=f"conversation_judge: {where}, history"))
        else:
            histories.append([("Prompt", str(prompts[row]).replace("<image>", "").strip())])
        expected.append(answer[row])
        generated.append(completion_text(completions[row]))
        items.append(where)
    with judge_from_options(base_url, model, api_key_env=api_key_env, timeout=timeout, max_retries=max_retries,
                            backoff=backoff, concurrency=concurrency) as judge:
        outcomes = judge_conversations(judge, histories, expected, generated, items=items, on_failure=on_failure)
    for row, outcome in zip(rows, outcomes):
        out[row] = outcome.value
    return out
