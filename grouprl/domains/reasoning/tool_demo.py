"""`grouprl demo --tools`: a tiny policy learns to call a calculator for its arithmetic, against the
same budget without the tool, on a laptop CPU.

Per seed, one tiny Qwen2 (its tokenizer's chat template renders tools the Qwen2.5 way:
:data:`TOOL_CHAT_TEMPLATE`) is trained twice from the same initial weights, problems, seed and
budget (SFT epochs, RL steps, prompts and samples per step):

- **calculator**: SFT on tool-using traces in token space (the problem, the assistant's
  ``<tool_call>`` with the problem's arithmetic, the ``calculator``'s result as the template renders
  a ``tool`` message, then the final answer; only the assistant's turns trained:
  :func:`grouprl.trainer.sft.dialogue_batch`), then GRPO whose samples are dialogues with the
  ``calculator`` tool (``worker.rollout.multi_turn.tools``);
- **no tool**: SFT on the plain worked solutions (the guided demo's), then GRPO on single turns.

Both are scored by the same reward on the final turn and evaluated on the same held-out problems
with greedy decoding (the calculator policy in dialogues with its tool, the other in one turn).
"""

from __future__ import annotations

import ast
import json
import operator
import shutil
import time
from pathlib import Path

import torch

from grouprl.config import config_from_dict, merge_values
from grouprl.files import write_text_atomic

# ---------------------------------------------------------------------------- the tool


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression: numbers, + - * /, unary minus and parentheses.

    Args:
        expression: the expression, for example "7 + 5 - 3"
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:  # bounds the work: no power operator, so no huge numbers
        raise ValueError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


MAX_EXPRESSION_CHARS = 200
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> int | float:
    """The value of a parsed expression made of numbers and the operators in ``_BINARY`` / ``_UNARY`` only;
    anything else (names, calls, powers, strings) is a ValueError naming it. Nothing is executed."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))  # x / 0 raises ZeroDivisionError
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {ast.unparse(node)!r}")


# ---------------------------------------------------------------------------- the chat template
#
# The tiny model's ChatML (grouprl.models.tiny.CHAT_TEMPLATE) with tools the Qwen2.5 way, so that
# the `hermes` parser reads its calls: with ``tools=``, a system block lists their JSON schemas
# and the call format; an assistant message's ``tool_calls`` are written as
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>; consecutive ``tool`` messages
# share one user block, each in <tool_response> tags. The system block is short (the tiny model
# reads it in every prompt); without tools the template writes exactly what CHAT_TEMPLATE does.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n' }}{%- endif %}"
    "{{- 'Tools:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>\\n{\"name\": <name>, \"arguments\": {...}}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set call = call['function'] if call['function'] is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- call['arguments'] if call['arguments'] is string else (call['arguments'] | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOL_NAME = "calculator"  # the name the reasoning plugin registers calculator() under


def tool_call_text(expression: str) -> str:
    """The assistant turn that calls the calculator on ``expression``, as :data:`TOOL_CHAT_TEMPLATE` renders
    ``tool_calls=[{"type": "function", "function": {"name": "calculator", "arguments": {"expression": ...}}}]``."""
    return "<tool_call>\n" + json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}}) + "\n</tool_call>"


def final_answer_text(result: int) -> str:
    """The turn after the tool's result: the answer alone, in the format the reward reads."""
    return f"<answer>\\boxed{{{result}}}</answer>"


def problem_expression(problem) -> str:
    """The problem's arithmetic as the calculator takes it: ``"a + b - c"``."""
    return f"{problem.a} {problem.ops[0]} {problem.b} {problem.ops[1]} {problem.c}"


def tool_records(problems, schema: dict) -> list[dict]:
    """EasyR1 records of tool-using traces: ``answer`` is the final turn, ``turns`` (what
    :func:`grouprl.trainer.sft.dialogue_batch` reads) the call and the tool's result before it, and
    ``chat_template_kwargs`` gives the template the tool's ``schema`` (as the rollout does)."""
    records = []
    for i, p in enumerate(problems):
        expression = problem_expression(p)
        records.append({
            "id": f"math-tool-{i:06d}", "problem": p.text, "answer": final_answer_text(p.result),
            "result": p.result, "chat_template_kwargs": {"tools": [schema]},
            "turns": [{"role": "assistant", "content": tool_call_text(expression)},
                      {"role": "tool", "name": TOOL_NAME, "content": calculator(expression)}]})
    return records


def tool_corpus(problems, schema: dict) -> list[str]:
    """Text the tokenizer should know besides the arithmetic's: the tool's system block and its
    calls, results and answers (each many times: BPE merges what is frequent)."""
    system = (f"Tools:\n<tools>\n{json.dumps(schema)}\n</tools>\nCall one as <tool_call>\n"
              '{"name": <name>, "arguments": {...}}\n</tool_call>')
    text = [system] * 8
    for p in problems:
        text += [tool_call_text(problem_expression(p)), f"\n<tool_response>\n{p.result}\n</tool_response>",
                 final_answer_text(p.result)]
    return text
