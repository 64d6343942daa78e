"""`grouprl demo --tools`: the calculator tool, the tiny model's tools template, tool traces trained in
token space, and the quick demo end to end (the full demo's numbers are in docs/demos.md)."""

import json

import pytest
import torch
import yaml

from grouprl.cli import main
from grouprl.domains.reasoning import synthetic_math as sm
from grouprl.domains.reasoning import tool_demo as td


def test_calculator_evaluates_arithmetic_and_refuses_anything_else():
    assert td.calculator("7 + 5 - 3") == "9"
    assert td.calculator(" (2 + 4) * 3 / 4 ") == "4.5"
    assert td.calculator("-(6 / 3)") == "-2"  # an integral quotient reads as an integer
    for bad in ("2 ** 10", "__import__('os').getcwd()", "abs(-1)", "x + 1", "'a' + 'b'", "[1][0]"):
        with pytest.raises(ValueError, match="only numbers"):
            td.calculator(bad)
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        td.calculator("7 +")
    with pytest.raises(ZeroDivisionError):
        td.calculator("1 / (2 - 2)")
    with pytest.raises(ValueError, match="longer than"):
        td.calculator("1 + " * 100 + "1")


def test_calculator_is_a_registered_tool_whose_errors_reach_the_policy():
    from grouprl.rollout.tools import ToolCall, ToolRunner, load_tool

    tool = load_tool("calculator")
    assert tool.name == "calculator" and tool.parameters["required"] == ["expression"]
    runner = ToolRunner([tool])
    results = runner.run_turn([ToolCall("calculator", {"expression": "3 * 4"}),
                               ToolCall("calculator", {"expression": "1 / 0"})])
    assert results[0].message == {"role": "tool", "name": "calculator", "content": "12"}
    assert results[1].error and "ZeroDivisionError" in results[1].content and runner.errors == 1


@pytest.fixture(scope="module")
def tokenizer():
    from grouprl.models.tiny import build_tokenizer
    from grouprl.rollout.tools import load_tool

    problems = sm.generate_problems(40, seed=-1, max_value=10)
    tok = build_tokenizer(sm.corpus(10) + td.tool_corpus(problems, load_tool("calculator").schema), vocab_size=768)
    tok.chat_template = td.TOOL_CHAT_TEMPLATE
    return tok


def test_tools_template_writes_calls_the_hermes_parser_reads_and_plain_chatml_without_tools(tokenizer):
    from grouprl.models.tiny import CHAT_TEMPLATE
    from grouprl.rollout.tools import load_tool, parse_tool_calls, parser_for_template

    schema = load_tool("calculator").schema
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "7 + 5 - 3"}}}
    messages = [{"role": "user", "content": "Ann has 7 shells."}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": "9"}]
    text = tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False, add_generation_prompt=True)
    assert json.dumps(schema) in text  # the tool's schema in the system block
    # what the demo's traces make the policy write is what the template renders for the call
    assert "<|im_start|>assistant\n" + td.tool_call_text("7 + 5 - 3") + "<|im_end|>" in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n9\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert parser_for_template(tokenizer.chat_template) == "hermes"
    parsed = parse_tool_calls(td.tool_call_text("7 + 5 - 3"), "hermes")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "7 + 5 - 3"})]
    # without tools the template is the tiny model's ChatML: the no-tool run's prompts are unchanged
    plain = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        assert plain == tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    finally:
        tokenizer.chat_template = td.TOOL_CHAT_TEMPLATE
    # the vocabulary holds the tool's text: a call is about as long as a worked solution
    problem = sm.generate_problems(1, seed=3, max_value=10)[0]
    call_tokens = len(tokenizer(td.tool_call_text(td.problem_expression(problem)))["input_ids"])
    assert call_tokens <= 1.2 * len(tokenizer(problem.solution)["input_ids"])


def test_tool_traces_are_trained_in_token_space_with_only_the_assistant_turns_in_the_loss(tokenizer):
    from grouprl.data.sample import Sample
    from grouprl.rollout.tools import load_tool
    from grouprl.rollout.turn_tokens import between_turns
    from grouprl.trainer.sft import dialogue_batch

    problems = sm.generate_problems(2, seed=5, max_value=10)
    records = td.tool_records(problems, load_tool("calculator").schema)
    samples = [Sample(messages=[{"role": "user", "content": r["problem"]}], answer=r["answer"],
                      columns={"turns": r["turns"]}, chat_template_kwargs=r["chat_template_kwargs"]) for r in records]
    batch = dialogue_batch(tokenizer, samples, max_prompt_length=512, max_response_length=200)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row, (sample, record, p) in enumerate(zip(samples, records, problems)):
        call = tokenizer(td.tool_call_text(td.problem_expression(p)), add_special_tokens=False)["input_ids"] + [end]
        between = between_turns(tokenizer, record["turns"][1:], after_end_of_turn=True,
                                chat_template_kwargs=sample.chat_template_kwargs).ids
        answer = tokenizer(record["answer"], add_special_tokens=False)["input_ids"] + [end]
        length = int(batch.response_mask[row].sum())
        # the response is the ids a rollout holds: the sampled call, the tool's message as between_turns
        # renders it, the sampled answer
        assert batch.response_ids[row, :length].tolist() == call + between + answer
        assert batch.policy_mask[row, :length].tolist() == [1] * len(call) + [0] * len(between) + [1] * len(answer)
        assert torch.equal(batch.loss_mask[row], batch.policy_mask[row])
        # and the whole sequence is the template's rendering of the dialogue
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        conversation = [*sample.messages,
                        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                            "name": "calculator", "arguments": {"expression": td.problem_expression(p)}}}]},
                        record["turns"][1], {"role": "assistant", "content": record["answer"]}]
        rendered = tokenizer.apply_chat_template(conversation, tools=sample.chat_template_kwargs["tools"],
                                                 tokenize=False)
        assert tokenizer.decode(prompt + call + between + answer) + "\n" == rendered
        assert f"<tool_response>\n{p.result}\n</tool_response>" in rendered
    # a sample without turns is a single answer, as answer_batch makes it
    single = dialogue_batch(tokenizer, [Sample(messages=samples[0].messages, answer="<answer>\\boxed{3}</answer>")],
                            max_prompt_length=512, max_response_length=200)
    assert bool(single.policy_mask[0][single.response_mask[0].bool()].all())
    with pytest.raises(ValueError, match="two assistant turns"):
        dialogue_batch(tokenizer, [Sample(messages=samples[0].messages, answer="x",
                                          columns={"turns": [{"role": "assistant", "content": "y"}]})],
                       max_prompt_length=512, max_response_length=200)
    with pytest.raises(ValueError, match="max_response_length"):
        dialogue_batch(tokenizer, samples, max_prompt_length=512, max_response_length=20)


def _jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_quick_tool_demo_trains_with_and_without_the_calculator_from_one_model(tmp_path, capsys):
    out = tmp_path / "tools"
    assert main(["demo", "--tools", "--quick", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["models"]) == ["SFT (calculator)", "SFT+GRPO (calculator)", "SFT (no tool)",
                                       "SFT+GRPO (no tool)"]
    n_val = summary["held_out_problems"]
    for name, row in summary["models"].items():
        assert len(row["correct"]) == n_val and row["accuracy"] == sum(row["correct"]) / n_val
        assert ("tool_calls" in row) == ("calculator" in name)  # evaluated with the tool, or in one turn
    # the SFT model learnt to call: most held-out dialogues call the calculator
    assert summary["models"]["SFT (calculator)"]["called"] > 0.5

    # tool calls happened in the calculator's GRPO run, in every step, and in no step of the other
    metrics = {key: [m for m in _jsonl(out / key / "grpo" / "metrics.jsonl") if "reward/mean" in m]
               for key in td.TOOL_RUNS}
    assert len(metrics["tools"]) == summary["sizes"]["grpo_steps"]
    # calls written in every step (at --quick size, many malformed: answered with their error, counted)
    assert all(m["tools/calls"] > 0 and m["tools/calls"] >= m["tools/calculator/calls"] for m in metrics["tools"])
    assert not any(k.startswith("tools/") for m in metrics["plain"] for k in m)
    assert summary["training"]["SFT+GRPO (calculator)"]["tool_calls_per_step"] > 0
    rollouts = {key: _jsonl(out / key / "grpo" / "rollouts.jsonl") for key in td.TOOL_RUNS}
    assert all("dialogue" not in r for r in rollouts["plain"])
    tool_turns = [t for r in rollouts["tools"] for t in r["dialogue"] if t["role"] == "tool"]
    assert tool_turns and all(t["tools"] in (["calculator"], ["error"]) for t in tool_turns)  # error: malformed

    # one initial model, one budget: the runs differ only in their SFT data and the multi-turn tools
    configs = {key: yaml.safe_load((out / key / "grpo" / "config.yaml").read_text()) for key in td.TOOL_RUNS}
    assert configs["tools"]["worker"]["rollout"]["multi_turn"]["tools"] == ["calculator"]
    for key, cfg in configs.items():
        assert cfg["worker"]["actor"]["model"]["model_path"] == str(out / key / "sft_model")
        cfg["worker"]["actor"]["model"].pop("model_path")
        cfg["worker"]["rollout"].pop("multi_turn")
        cfg["trainer"].pop("output_dir"), cfg["trainer"].pop("experiment_name")
    assert configs["tools"] == configs["plain"]
    sft = {key: yaml.safe_load((out / key / "sft" / "config.yaml").read_text()) for key in td.TOOL_RUNS}
    assert {c["worker"]["actor"]["model"]["model_path"] for c in sft.values()} == {str(out / "init_model")}
    assert [c["sft"]["batch_size"] for c in sft.values()] == [summary["sizes"]["sft_batch_size"]] * 2
    traces = _jsonl(out / "data" / "sft_tools.jsonl")
    assert len(traces) == summary["sizes"]["train"] and all(t["turns"][1]["role"] == "tool" for t in traces)

    words = " ".join(capsys.readouterr().out.split())
    assert "What this can show" in words and "What it cannot show" in words and "summary: " in words


# the seeds' plumbing at the smallest sizes that run every stage
PLUMBING = dict(train=32, val=8, max_value=10, sft_epochs=1, sft_batch_size=32, grpo_steps=1, n=2,
                prompts_per_step=2)


def test_tool_seeds_report_intervals_and_paired_differences_from_each_seed(tmp_path, capsys, monkeypatch):
    from grouprl.domains.demos.seed_stats import paired_interval, verdict

    monkeypatch.setattr(td, "TOOL_QUICK", PLUMBING)
    out = tmp_path / "seeds"
    argv = ["demo", "--tools", "--quick", "--seeds", "2", "--seed", "1", "--out", str(out)]
    assert main(argv) == 0
    agg = json.loads((out / "tools_seeds.json").read_text())
    assert agg["seeds"] == [1, 2] and agg["reused_seeds"] == []
    seeds = {s: json.loads((out / f"seed_{s}" / "summary.json").read_text()) for s in (1, 2)}
    for better, worse in [tuple(td.TOOL_ORDER), *td.TOOL_ALSO]:
        a, b = ([seeds[s]["models"][m]["accuracy"] for s in (1, 2)] for m in (better, worse))
        row = agg["paired"][f"{better} - {worse}"]["accuracy"]
        assert row["values"] == pytest.approx([x - y for x, y in zip(a, b)])
        assert row["verdict"] == verdict(paired_interval(a, b))
    words = " ".join(capsys.readouterr().out.split())
    assert "paired by seed" in words and "What it cannot show" in words
    # run again: both seeds are complete and reused, nothing is trained
    monkeypatch.setattr(td, "_run_tool_demo", lambda *a, **k: pytest.fail("a complete seed must be reused"))
    assert main(argv) == 0
    assert json.loads((out / "tools_seeds.json").read_text())["reused_seeds"] == [1, 2]
