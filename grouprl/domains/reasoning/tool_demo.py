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
import time
from pathlib import Path

import torch

from grouprl.config import config_from_dict, merge_values
from grouprl.domains.reasoning.demo import model_config, seed_range, seed_summaries, training_summary
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


# ---------------------------------------------------------------------------- the runs
#
# Both runs of a seed: one tiny model (its tokenizer trained on the arithmetic and the tool's text,
# so both runs read the same ids), the same problems, SFT epochs, RL steps, prompts and samples
# per step, the same reward on the final turn. The calculator run's dialogues have at most
# TOOL_MAX_TURNS policy turns (a call, the answer, one more call allowed).

# The full demo's SFT sees 2,000 problems four times in batches of 8 (1,000 steps). With 1,000 problems
# four times the tiny model wrote nearly one call for every problem (its first call right for 0.05 of
# held-out problems in batches of 32, 0.16 in batches of 8); with 2,000 twice (500 steps) it copied the
# problem's numbers into its call for one seed of three (right for 0.98) and not for the other two.
# Both runs get the same sizes.
TOOL_FULL = dict(train=2000, val=300, max_value=10, sft_epochs=4, sft_batch_size=8, grpo_steps=20, n=8,
                 prompts_per_step=16)
# --quick: every stage in seconds; the SFT models write calls and answers in the right format
TOOL_QUICK = dict(train=192, val=32, max_value=10, sft_epochs=6, sft_batch_size=32, grpo_steps=3, n=4,
                  prompts_per_step=4)
TOOL_MODEL = dict(hidden_size=128, layers=4, heads=4, kv_heads=2, vocab_size=768)  # 768: the tool text in few tokens
TOOL_REWARD = "accuracy"  # 1 when the final turn's boxed answer is right
TOOL_MAX_TURNS = 3
TOOL_TURN_TOKENS = 48  # a call is ~28 tokens, an answer ~10, a worked solution ~30
TOOL_RUNS = {"tools": "calculator", "plain": "no tool"}  # run directory -> label
TOOL_SFT_ROWS = {key: f"SFT ({label})" for key, label in TOOL_RUNS.items()}
TOOL_GRPO_ROWS = {key: f"SFT+GRPO ({label})" for key, label in TOOL_RUNS.items()}
TOOL_LIMITS = dict(max_tool_calls_per_turn=1, max_tool_calls=2, tool_timeout=5.0)
TOOL_CAVEATS = (
    "What this can show: whether a policy that hands its arithmetic to a tool answers more held-out problems "
    "than one that does it in its own tokens, for this tiny model (4 layers, 128 wide), these synthetic two-step "
    "problems with numbers up to {max_value}, this budget and these seeds. What it cannot show: that the same holds "
    "for real models or real tasks (a large model does this arithmetic itself), that the gap comes from the tool "
    "rather than from the shorter answer it trains, or a difference smaller than the seeds' noise (few seeds; one "
    "seed gives no interval). The calculator run learns the call format from its SFT traces; GRPO only reinforces "
    "or wears it. Whether its SFT model copies the problem's numbers into the call (right call) decides its "
    "accuracy, and at this budget that varies with the seed.")


def tool_demo_configs(out: Path, data: dict[str, Path], sizes: dict, seed: int) -> dict[str, tuple[dict, dict]]:
    """``{run: (SFT config, GRPO config)}`` for the runs ``tools`` and ``plain`` of one seed, as plain
    dicts; the two differ only in their data and ``worker.rollout.multi_turn``."""
    common_data = {"val_files": [], "format": "auto", "max_prompt_length": 256,
                   "max_response_length": TOOL_TURN_TOKENS, "seed": seed}
    trainer = {"logger": ["console", "jsonl"], "seed": seed, "device": "cpu"}
    configs = {}
    for key in TOOL_RUNS:
        sft = {
            "data": {**common_data, "train_files": [str(data[f"sft_{key}"])],
                     # a tool trace: call, result, answer
                     "max_response_length": 3 * TOOL_TURN_TOKENS},
            "worker": {"actor": {"model": model_config(str(out / "init_model")),
                                 "optim": {"lr": 3e-3, "weight_decay": 0.0, "lr_scheduler_type": "cosine",
                                           "lr_warmup_ratio": 0.05}}},
            "sft": {"epochs": sizes["sft_epochs"], "batch_size": sizes["sft_batch_size"],
                    "micro_batch_size": sizes["sft_batch_size"]},
            "trainer": {**trainer, "output_dir": str(out / key / "sft"), "experiment_name": f"demo-tools-{key}-sft"},
        }
        grpo = {
            "data": {**common_data, "train_files": [str(data["train"])],
                     "rollout_batch_size": sizes["prompts_per_step"]},
            "algorithm": {"adv_estimator": "grpo", "loss_agg_mode": "token-mean", "kl_coef": 0.0},
            "worker": {
                "actor": {"model": model_config(str(out / key / "sft_model")),
                          "optim": {"lr": 3e-5, "weight_decay": 0.0},  # the guided demo's: higher forgets
                          "global_batch_size": sizes["prompts_per_step"],
                          "micro_batch_size_per_device_for_update": 64,
                          "micro_batch_size_per_device_for_experience": 128},
                "rollout": {"n": sizes["n"], "temperature": 1.0},
                "reward": {"functions": [{"name": TOOL_REWARD, "weight": 1.0}]},
            },
            "trainer": {**trainer, "output_dir": str(out / key / "grpo"), "experiment_name": f"demo-tools-{key}-grpo",
                        "max_steps": sizes["grpo_steps"], "save_freq": -1, "save_limit": 1, "val_freq": -1},
        }
        if key == "tools":
            grpo = merge_values(grpo, {"worker": {"rollout": {"multi_turn": {
                "tools": [TOOL_NAME], "max_turns": TOOL_MAX_TURNS, "max_tokens_per_turn": TOOL_TURN_TOKENS,
                "train_scope": "full_turn", **TOOL_LIMITS}}}})
        configs[key] = (sft, grpo)
    return configs


@torch.no_grad()
def evaluate_tool_use(model, processor, samples, *, tools: bool, max_new_tokens: int = TOOL_TURN_TOKENS,
                      batch_size: int = 100) -> dict:
    """Greedy answers to held-out problems: with ``tools``, dialogues of at most ``TOOL_MAX_TURNS`` turns
    with the calculator (the multi-turn rollout the GRPO run samples from); without, one turn.

    ``accuracy`` = right final answers / problems; ``format_rate`` = final answers in the boxed format /
    problems; ``tool_calls`` = calls per problem; ``called`` = problems with a call / problems;
    ``tool_errors`` = calls answered with an error (malformed, wrong arguments, raised) / problems;
    ``right_expression`` = problems whose first call's result is the right answer / problems.
    """
    from grouprl.config import MultiTurnConfig
    from grouprl.domains.reasoning.exact_match import answer_right, exact_match
    from grouprl.rollout.engine import SamplingParams
    from grouprl.rollout.hf_engine import HFGenerationEngine
    from grouprl.rollout.multiturn import MultiTurnRollout
    from grouprl.rollout.tools import ToolLimits, load_tool

    engine = HFGenerationEngine(model, processor)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, seed=0)
    dialogues = None
    if tools:
        config = MultiTurnConfig(tools=[TOOL_NAME], max_turns=TOOL_MAX_TURNS, max_tokens_per_turn=max_new_tokens,
                                 **TOOL_LIMITS)
        dialogues = MultiTurnRollout(None, processor, config, end_of_turn_ids=list(engine.eos_token_ids),
                                     tools=[load_tool(TOOL_NAME)],
                                     tool_limits=ToolLimits(per_turn=config.max_tool_calls_per_turn,
                                                            per_dialogue=config.max_tool_calls,
                                                            timeout=config.tool_timeout))
    responses, calls, errors, called, right_call, examples = [], 0.0, 0.0, 0, 0, []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        if dialogues is None:
            responses.extend(engine.generate(chunk, greedy).responses)
            continue
        batch = dialogues.generate(engine, chunk, greedy)
        responses.extend(batch.responses)
        calls += dialogues.last_metrics.get("tools/calls", 0.0)
        errors += dialogues.last_metrics.get("tools/errors", 0.0)
        for sample, dialogue in zip(chunk, batch.extras["dialogue"]):
            results = [m for m in dialogue if m["role"] == "tool"]
            called += any(m.get("tool_calls") for m in dialogue if m["role"] == "assistant")
            right_call += bool(results) and results[0]["text"].strip() == str(sample.columns["result"])
            if len(examples) < 3:
                examples.append({"problem": sample.prompt_text(), "dialogue": dialogue})
    correct = [answer_right(r, s.answer) for s, r in zip(samples, responses)]
    n = len(samples)
    out = {**exact_match(responses, [s.answer for s in samples]), "correct": correct,
           "sample_ids": [s.id for s in samples]}
    if dialogues is not None:
        out.update(tool_calls=calls / n, tool_errors=errors / n, called=called / n, right_expression=right_call / n,
                   examples=examples)
    else:
        out["examples"] = [{"problem": s.prompt_text(), "generated": r} for s, r in list(zip(samples, responses))[:3]]
    return out


def tool_demo_data(out: Path, sizes: dict, seed: int) -> dict[str, Path]:
    """The seed's problems as files under ``out/data``: ``train`` (EasyR1, the worked solutions: the plain
    run's SFT data and both GRPO runs' prompts), ``sft_tools`` (the same problems as tool traces),
    ``val`` (held-out problems, no arithmetic shared); and the tiny model in ``out/init_model``."""
    from grouprl.domains.reasoning import synthetic_math as sm
    from grouprl.models.tiny import build_tiny_text_lm
    from grouprl.rollout.tools import load_tool

    schema = load_tool(TOOL_NAME).schema
    train = sm.generate_problems(sizes["train"], seed=seed, max_value=sizes["max_value"])
    held_out = sm.generate_problems(sizes["val"], seed=seed + 10_000, max_value=sizes["max_value"],
                                    exclude=[p.key for p in train])
    data = {"train": sm.write_dataset(out / "data" / "train.jsonl", train),
            "sft_tools": sm.write_records(out / "data" / "sft_tools.jsonl", tool_records(train, schema)),
            "val": sm.write_dataset(out / "data" / "val.jsonl", held_out)}
    data["sft_plain"] = data["train"]
    corpus_problems = sm.generate_problems(400, seed=-1, max_value=sizes["max_value"])
    build_tiny_text_lm(out / "init_model", sm.corpus(sizes["max_value"]) + tool_corpus(corpus_problems, schema),
                       seed=seed, chat_template=TOOL_CHAT_TEMPLATE, **TOOL_MODEL)
    return data


def run_tool_demo(out: str | Path | None = None, *, quick: bool = False, seed: int = 0,
                  seeds: int | None = None) -> dict:
    """Both runs (calculator, no tool) for one seed: one table, summary.json. With ``seeds`` K: for seeds
    seed .. seed+K-1 in <out>/seed_<s>/ and the statistics over them (:func:`run_tool_seeds`).
    Default ``out``: runs/demo-tools (runs/demo-tools-quick with ``quick``)."""
    from grouprl.cli import UsageError, demo_dir

    out = Path(demo_dir(out, "runs/demo-tools", quick))
    if seeds is None:
        return _run_tool_demo(out, quick=quick, seed=seed)
    try:  # K >= 1, and no seed directory holds another run's results or foreign files
        statuses = {s: tool_seed_status(out / f"seed_{s}", s, TOOL_QUICK if quick else TOOL_FULL)
                    for s in seed_range(seed, seeds)}
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return run_tool_seeds(out, statuses, quick=quick)


def _run_tool_demo(out: Path, *, quick: bool, seed: int) -> dict:
    """One seed: data and model, then per run SFT, its evaluation, GRPO, its evaluation; summary.json."""
    from rich.console import Console
    from rich.table import Table

    from grouprl.cli import DEMO_RESUME_HINT, demo_resumes
    from grouprl.data import load_samples
    from grouprl.models.loading import load_model_and_processor
    from grouprl.trainer.grpo import GRPOTrainer
    from grouprl.trainer.sft import answer_batch, dialogue_batch, run_sft

    console = Console()
    sizes = TOOL_QUICK if quick else TOOL_FULL
    out.mkdir(parents=True, exist_ok=True)
    resuming = demo_resumes(out, {"demo": "tools", "seed": seed, "sizes": sizes, "model": TOOL_MODEL},
                            stages=[p for key in TOOL_RUNS for p in (out / key / "sft_model", out / key / "grpo")])
    torch.manual_seed(seed)
    t_start = time.perf_counter()
    console.rule("[bold]grouprl demo --tools: arithmetic word problems, GRPO with a calculator vs without")
    data = tool_demo_data(out, sizes, seed)
    val = load_samples([str(data["val"])], format="easyr1")
    samples = [val[i] for i in range(len(val))]
    console.print(f"{sizes['train']} training and {len(samples)} held-out problems and a tiny Qwen2 (its chat "
                  f"template renders tools) under {out}")
    results, training, seconds, curves = {}, {}, {}, {}
    rows_per_step = sizes["prompts_per_step"] * sizes["n"]
    for i, (key, (sft_cfg, grpo_cfg)) in enumerate(tool_demo_configs(out, data, sizes, seed).items()):
        tools = key == "tools"
        console.rule(f"[bold]{2 * i + 1}/4 SFT on {'tool-using traces' if tools else 'worked solutions'}")
        t0 = time.perf_counter()
        if resuming and (out / key / "sft_model" / "config.json").exists():  # written whole or not at all
            console.print(f"the SFT model of the earlier run is reused: {out / key / 'sft_model'}")
        else:
            run_sft(config_from_dict(sft_cfg), output_dir=out / key / "sft_model",
                    batch_fn=dialogue_batch if tools else answer_batch)
        seconds[TOOL_SFT_ROWS[key]] = time.perf_counter() - t0
        model, processor, _ = load_model_and_processor(str(out / key / "sft_model"))
        results[TOOL_SFT_ROWS[key]] = evaluate_tool_use(model, processor, samples, tools=tools)
        del model
        console.rule(f"[bold]{2 * i + 2}/4 GRPO {'with the calculator' if tools else 'without a tool'}")
        t0 = time.perf_counter()
        if resuming:
            grpo_cfg = merge_values(grpo_cfg, {"trainer": {"resume": "auto"}})
        trainer = GRPOTrainer(config_from_dict(grpo_cfg))
        trainer.resume_hint = DEMO_RESUME_HINT
        trainer.train()
        label = TOOL_GRPO_ROWS[key]
        seconds[label] = time.perf_counter() - t0
        results[label] = evaluate_tool_use(trainer.policy, trainer.processor, samples, tools=tools)
        curves[label] = out / key / "grpo" / "metrics.jsonl"
        training[label] = training_summary(curves[label], rows_per_step)
        del trainer

    table = Table(title=f"held-out arithmetic problems (n={len(samples)}), greedy",
                  caption="accuracy = right final answers; called = problems with a calculator call; right call = "
                          "problems whose first call returned the right answer; calls, errors = per problem")
    for title in ("model", "accuracy", "format", "called", "right call", "calls", "errors"):
        table.add_column(title, justify="left" if title == "model" else "right", no_wrap=True)
    for name, r in results.items():
        table.add_row(name, f"{r['accuracy']:.3f}", f"{r['format_rate']:.3f}",
                      *(f"{r[k]:.3f}" if k in r else "" for k in ("called", "right_expression", "tool_calls",
                                                                 "tool_errors")))
    console.print(table)
    runs = Table(title="the GRPO runs", caption=f"reward = {TOOL_REWARD} of the final turn, mean of the first 5 -> "
                                               f"last 5 steps; same SFT budget, seed, {sizes['grpo_steps']} steps of "
                                               f"{sizes['prompts_per_step']} prompts x {sizes['n']} samples")
    for title in ("run", "reward", "turns", "tool calls/step", "tokens", "seconds"):
        runs.add_column(title, justify="left" if title == "run" else "right", no_wrap=True)
    for label, t in training.items():
        runs.add_row(label, f"{t['reward_first_5']:.3f} -> {t['reward_last_5']:.3f}",
                     f"{t['turns_mean']:.2f}" if "turns_mean" in t else "1",
                     f"{t['tool_calls_per_step']:.1f}" if "tool_calls_per_step" in t else "0",
                     f"{t['policy_tokens']:,}", f"{seconds[label]:.0f}")
    console.print(runs)
    console.print(TOOL_CAVEATS.format(max_value=sizes["max_value"]))
    summary = {
        "task": "synthetic arithmetic word problems (grouprl.domains.reasoning.synthetic_math)",
        "tool": TOOL_NAME, "reward": TOOL_REWARD, "max_turns": TOOL_MAX_TURNS, "tool_limits": TOOL_LIMITS,
        "held_out_problems": len(samples), "sizes": sizes, "model": TOOL_MODEL, "seed": seed,
        "models": results, "training": training, "seconds": seconds,
        "calculator_minus_no_tool_accuracy": (results[TOOL_GRPO_ROWS["tools"]]["accuracy"]
                                              - results[TOOL_GRPO_ROWS["plain"]]["accuracy"]),
        "caveats": TOOL_CAVEATS.format(max_value=sizes["max_value"]),
        "wall_seconds": time.perf_counter() - t_start,
    }
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2))
    console.print(f"summary: {(out / 'summary.json').resolve()}")
    return summary


# ---------------------------------------------------------------------------- `--tools --seeds K`

TOOL_METRICS = ["accuracy", "format_rate"]
TOOL_ORDER = [TOOL_GRPO_ROWS["tools"], TOOL_GRPO_ROWS["plain"]]  # the claim: the calculator helps
TOOL_ALSO = [(TOOL_SFT_ROWS["tools"], TOOL_SFT_ROWS["plain"]), (TOOL_GRPO_ROWS["tools"], TOOL_SFT_ROWS["tools"]),
             (TOOL_GRPO_ROWS["plain"], TOOL_SFT_ROWS["plain"])]
_TOOL_ENTRIES = {"data", "init_model", *TOOL_RUNS, "summary.json"}  # what one seed's run writes


def tool_seed_status(seed_dir: Path, seed: int, sizes: dict) -> str:
    """``seed_dir_status`` for this demo: "new", "complete" or "incomplete"; a ValueError for another run's
    results or files the demo does not write."""
    from grouprl.domains.demos.seed_stats import seed_dir_status

    return seed_dir_status(seed_dir, wanted={"seed": seed, "sizes": sizes, "model": TOOL_MODEL},
                           describe=lambda summary: {key: summary.get(key) for key in ("seed", "sizes", "model")},
                           entries=_TOOL_ENTRIES)


def run_tool_seeds(out: Path, statuses: dict[int, str], *, quick: bool = False) -> dict:
    """Each seed's run (a complete one reused, an interrupted one run again from the start), then each
    model's mean accuracy with its 95% t-interval and the paired differences (calculator - no tool after
    GRPO, the same after SFT, GRPO - SFT in each), with verdicts; tools_seeds.json in ``out``."""
    from rich.console import Console
    from rich.table import Table

    from grouprl.domains.demos.seed_stats import format_difference, format_mean, summarize_seeds

    console = Console()
    t_start = time.perf_counter()
    summaries, reused = seed_summaries(out, statuses, lambda d, s: _run_tool_demo(d, quick=quick, seed=s),
                                       _TOOL_ENTRIES, console)
    per_seed = {s: {name: {k: row[k] for k in TOOL_METRICS} for name, row in summary["models"].items()}
                for s, summary in summaries.items()}
    sizes = TOOL_QUICK if quick else TOOL_FULL
    stats = summarize_seeds(per_seed, metrics=TOOL_METRICS, order=TOOL_ORDER, also=TOOL_ALSO)
    k = stats["k"]
    console.rule(f"[bold]{k} seed(s): {', '.join(map(str, stats['seeds']))}")
    if k == 1:
        console.print("one seed: means only; an interval needs at least 2 seeds (--seeds 2 or more)")
    table = Table(title="held-out accuracy (greedy), mean over seeds ± the 95% t-interval's half-width")
    for title in ("model", "accuracy", "format"):
        table.add_column(title, justify="left" if title == "model" else "right")
    for name in stats["models"]:
        table.add_row(name, *(format_mean(stats["models"][name][key]) for key in TOOL_METRICS))
    console.print(table)
    pairs = Table(title="paired by seed: the mean difference in accuracy [95% interval] and its verdict")
    for title in ("difference", "mean, 95% interval", "verdict"):
        pairs.add_column(title, justify="right" if title.startswith("mean") else "left", no_wrap=title != "verdict")
    for pair, rows in stats["paired"].items():
        pairs.add_row(pair, format_difference(rows["accuracy"]), rows["accuracy"]["verdict"])
    console.print(pairs)
    caveats = TOOL_CAVEATS.format(max_value=sizes["max_value"])
    console.print(caveats)
    result = {**stats, "metrics": TOOL_METRICS, "seed_dirs": {s: str(out / f"seed_{s}") for s in statuses},
              "reused_seeds": reused, "caveats": caveats, "wall_seconds": time.perf_counter() - t_start}
    write_text_atomic(out / "tools_seeds.json", json.dumps(result, indent=2))
    console.print(f"summary: {(out / 'tools_seeds.json').resolve()}")
    return result
