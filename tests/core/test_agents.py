"""Tools and environments between policy turns: the loop in token space, in the trainer, and its errors."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest
import torch

from grouprl.config import ConfigError, MultiTurnConfig, config_from_dict
from grouprl.models.inputs import end_of_turn_id, tokenizer_of
from grouprl.rollout.engine import SamplingParams
from grouprl.rollout.logprobs import compute_log_probs
from grouprl.rollout.environments import Environment, EnvironmentFailure, EnvironmentPool, Step
from grouprl.rollout.multiturn import MultiTurnRollout, dialogue_parts
from grouprl.rollout.tools import load_tools
from grouprl.rollout.turn_tokens import between_turns

from scripted_turns import ScriptedFirstTurn  # tests/scripted_turns.py
from test_engine import text_samples  # helpers (`paths`: tests/conftest.py)
from test_multiturn import engine_for

QWEN25 = (Path(__file__).parent / "chat_templates" / "Qwen2.5-Instruct.jinja").read_text()

# A TRL environment, written for GRPOTrainer(environment_factory=...): reset(**row), tools as public
# methods, get_reward() owning a reward. grouprl takes it unchanged.
TRL_ENVIRONMENT = textwrap.dedent('''
    class Adder:
        def reset(self, **row):
            self.answer = row.get("answer")
            self.sums = 0
            return "You may call add."

        def add(self, a: int, b: int) -> int:
            """Add two whole numbers.

            Args:
                a: the first number
                b: the second number
            """
            self.sums += 1
            return a + b

        def get_reward(self) -> float:
            return float(self.sums)


    def multiply(a: int, b: int) -> int:
        """Multiply two whole numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a * b
''')

CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
         '<tool_call>\n{"name": "multiply", "arguments": {"a": 4, "b": 5}}\n</tool_call>')


def with_template(processor, template=QWEN25):
    tokenizer_of(processor).chat_template = template
    if hasattr(processor, "chat_template"):
        processor.chat_template = template
    return processor


class Guess(Environment):
    """Answers a turn without tool calls: right when it holds the sample's answer, else "try again"."""

    reward_parts = ("solved", "tries")

    def reset(self, sample):
        self.answer, self.tries = sample.answer, 0

    def step(self, message):
        self.tries += 1
        if self.answer and self.answer in message:
            return Step(done=True, reward={"solved": 1.0, "tries": 1.0})
        return Step([{"role": "user", "content": "Try again."}], reward={"tries": 1.0})


# ---------------------------------------------------------------------------- the loop


@pytest.fixture(scope="module")
def tiny(paths):
    model, processor, engine = engine_for(paths, "lm")
    engine.model_for_tests = model
    return with_template(processor), engine


def test_tool_results_enter_the_dialogue_in_token_space(tiny, tmp_path):
    processor, engine = tiny
    module = tmp_path / "agent_parts.py"
    module.write_text(TRL_ENVIRONMENT)
    from grouprl.rollout.environments import load_environment

    pool = EnvironmentPool({"adder": load_environment(f"{module}:Adder")})
    tools = load_tools([f"{module}:multiply"])
    scripted = ScriptedFirstTurn(engine, processor, CALLS, model=engine.model_for_tests)
    multi = MultiTurnRollout(pool, processor, MultiTurnConfig(max_turns=2), tools=tools,
                             end_of_turn_ids=[end_of_turn_id(processor)])
    batch = multi.generate(scripted, text_samples(), SamplingParams(n=2, max_new_tokens=4, seed=1,
                                                                    return_log_probs=True))
    # both calls ran, their results came back as tool messages rendered by the template, in order
    expected = between_turns(processor, [{"role": "tool", "name": "add", "content": "5"},
                                         {"role": "tool", "name": "multiply", "content": "20"}],
                             after_end_of_turn=True, chat_template_kwargs=batch.samples[0].chat_template_kwargs).ids
    first = len(scripted.ids)
    for row in range(len(batch)):
        between = batch.response_ids[row, first:first + len(expected)].tolist()
        assert between == expected
        # only the policy's turns are trained: the tool results and the template around them are not
        assert batch.policy_mask[row, :first].all() and not batch.policy_mask[row, first:first + len(expected)].any()
        # the second turn was generated from exactly the ids it is trained after
        context = scripted.calls[1][row].ids
        assert context.tolist() == torch.cat([batch.prompt_ids[row][batch.prompt_mask[row].bool()],
                                              batch.response_ids[row, :first + len(expected)]]).tolist()
    # the trainer's log-probs of the second turn, sampled after the tool results, are the sampler's
    with torch.no_grad():
        trained, _ = compute_log_probs(engine.model_for_tests, batch, micro_batch_size=len(batch))
    second = batch.policy_mask.bool().clone()
    second[:, :first] = False
    assert second.any()
    torch.testing.assert_close(trained[second], batch.rollout_log_probs[second], atol=1e-4, rtol=0)
    dialogue = batch.extras["dialogue"][0]
    assert [m["role"] for m in dialogue[:3]] == ["assistant", "tool", "assistant"]
    assert dialogue[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert dialogue[1]["tools"] == ["add", "multiply"] and "5" in dialogue[1]["text"] and "20" in dialogue[1]["text"]
    assert dialogue[1]["results"] == [{"name": "add", "text": "5"}, {"name": "multiply", "text": "20"}]
    # the TRL environment's reset text went into the first prompt, its tools into the template
    assert "You may call add." in batch.samples[0].messages[-1]["content"][-1]["text"]
    assert [t["function"]["name"] for t in batch.samples[0].chat_template_kwargs["tools"]] == ["multiply", "add"]
    # its get_reward() is the reward part named after its class: one add per dialogue
    assert batch.extras["environment_rewards"] == [{"Adder": 1.0}] * len(batch)
    m = multi.last_metrics
    assert m["tools/calls"] == 2 * len(batch) and m["tools/errors"] == 0
    assert m["tools/add/calls"] == len(batch) and m["tools/multiply/calls"] == len(batch)
    assert m["multiturn/turns"] == 2 and m["environment/adder/Adder"] == 1.0


class Notes:
    """A TRL environment with tools and no reward of its own."""

    def reset(self, **row):
        self.notes = []

    def note(self, text: str) -> str:
        """Keep a note.

        Args:
            text: the note
        """
        self.notes.append(text)
        return f"{len(self.notes)} note(s)"


def test_a_trl_environment_without_get_reward_gives_no_reward_part(tiny):
    processor, engine = tiny
    text = '<tool_call>\n{"name": "note", "arguments": {"text": "carry the one"}}\n</tool_call>'
    multi = MultiTurnRollout(EnvironmentPool({"notes": Notes}), processor, MultiTurnConfig(max_turns=2),
                             end_of_turn_ids=[end_of_turn_id(processor)])
    batch = multi.generate(ScriptedFirstTurn(engine, processor, text), text_samples()[:1],
                           SamplingParams(n=2, max_new_tokens=4, seed=1))
    assert "environment_rewards" not in batch.extras and multi.last_metrics["environment/errors"] == 0
    assert batch.extras["dialogue"][0][1]["text"] == "1 note(s)" and set(batch.extras["stop_reason"]) == {"stop"}


def test_a_tool_error_is_returned_to_the_policy_and_counted(tiny):
    processor, engine = tiny
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{oops}\n</tool_call>'
    tools = load_tools([add])
    multi = MultiTurnRollout(None, processor, MultiTurnConfig(max_turns=2), tools=tools,
                             end_of_turn_ids=[end_of_turn_id(processor)])
    batch = multi.generate(ScriptedFirstTurn(engine, processor, text), text_samples()[:1],
                           SamplingParams(n=1, max_new_tokens=4, seed=1))
    between = batch.extras["dialogue"][0][1]["text"]
    assert "missing required argument(s) b" in between and "not valid JSON" in between
    assert multi.last_metrics["tools/errors"] == 2 and multi.last_metrics["tools/calls"] == 2


def test_a_turn_without_tool_calls_goes_to_the_environment_and_rewards_add_up(tiny):
    processor, engine = tiny
    multi = MultiTurnRollout(EnvironmentPool({"guess": Guess}), processor, MultiTurnConfig(max_turns=3),
                             end_of_turn_ids=[end_of_turn_id(processor)])
    samples = text_samples()[:2]
    batch = multi.generate(engine, samples, SamplingParams(n=2, max_new_tokens=3, seed=4))
    for rewards, turns, reason, dialogue in zip(batch.extras["environment_rewards"], batch.extras["num_turns"],
                                               batch.extras["stop_reason"], batch.extras["dialogue"]):
        # each step gave one "try": the parts of a dialogue's steps are summed
        assert rewards["tries"] == turns and ("solved" in rewards) == (reason == "stop")
        assert all(m["text"] == "Try again." and m["environment"] == "guess" for m in dialogue if m["role"] == "user")
    assert multi.last_metrics["environment/guess/tries"] == pytest.approx(
        sum(batch.extras["num_turns"]) / len(batch))


class AsyncGuess(Guess):
    """Guess with an ``async def step``: the rollout runs it in its own loop."""

    async def step(self, message):
        import asyncio

        await asyncio.sleep(0)
        return Guess.step(self, message)


@pytest.mark.parametrize("credit", ["shared", "mask_fixed"])
def test_turn_credit_and_async_steps_apply_to_any_environment(tiny, credit, monkeypatch):
    processor, engine = tiny
    # every turn is right on the second try: the first is answered "Try again.", the second is done
    monkeypatch.setattr(Guess, "reset", lambda self, sample: setattr(self, "answer", None) or
                        setattr(self, "tries", 0))
    original = Guess.step

    def second_try(self, message):
        step = original(self, message)
        return Step(done=True, reward={"solved": 1.0, "tries": 1.0}) if self.tries == 2 else step

    monkeypatch.setattr(Guess, "step", second_try)
    multi = MultiTurnRollout(EnvironmentPool({"guess": AsyncGuess}), processor,
                             MultiTurnConfig(max_turns=3, turn_credit=credit),
                             end_of_turn_ids=[end_of_turn_id(processor)])
    batch = multi.generate(engine, text_samples()[:2], SamplingParams(n=2, max_new_tokens=3, seed=4))
    assert set(batch.extras["stop_reason"]) == {"stop"} and set(batch.extras["num_turns"]) == {2}
    for row, spans in enumerate(batch.extras["spans"]):
        first_turn = spans[0]
        trained = bool(batch.policy_mask[row, first_turn[0]:first_turn[1]].any())
        assert trained == (credit == "shared")
    assert multi.last_metrics["multiturn/masked_turns"] == (1.0 if credit == "mask_fixed" else 0.0)


class Flaky(Environment):
    mode = "raise"

    def step(self, message):
        if self.mode == "raise":
            raise RuntimeError("the game server is down")
        if self.mode == "sleep":
            time.sleep(2)
        if self.mode == "wrong":
            return "not a step"
        return Step([{"role": "user", "content": "go on"}], reward={"points": 1.0})


@pytest.mark.parametrize("mode, says", [("raise", "RuntimeError: the game server is down"),
                                        ("sleep", "no answer within 0.2 s"),
                                        ("wrong", "returned str, not a grouprl.rollout.environments.Step"),
                                        ("reward", "reward part 'points', which")])
def test_a_failing_environment_ends_its_dialogue_counted_or_fails_the_step(tiny, mode, says, monkeypatch):
    processor, engine = tiny
    monkeypatch.setattr(Flaky, "mode", mode)
    config = MultiTurnConfig(max_turns=3, step_timeout=0.2)
    multi = MultiTurnRollout(EnvironmentPool({"flaky": Flaky}), processor, config,
                             end_of_turn_ids=[end_of_turn_id(processor)])
    batch = multi.generate(engine, text_samples()[:2], SamplingParams(n=1, max_new_tokens=3, seed=4))
    assert set(batch.extras["stop_reason"]) == {"environment_failure"}
    assert multi.last_metrics["environment/errors"] == 2
    assert multi.last_metrics["multiturn/stop_reason/environment_failure"] == 1.0
    config.on_failure = "fail"
    with pytest.raises(EnvironmentFailure, match=says.replace("(", r"\(").replace(")", r"\)")):
        multi.generate(engine, text_samples()[:2], SamplingParams(n=1, max_new_tokens=3, seed=4))


def test_an_environment_down_for_several_calls_ends_every_dialogue(tiny, monkeypatch):
    processor, engine = tiny
    monkeypatch.setattr(Flaky, "mode", "raise")
    multi = MultiTurnRollout(EnvironmentPool({"flaky": Flaky}), processor,
                             MultiTurnConfig(max_turns=3, max_consecutive_failures=2),
                             end_of_turn_ids=[end_of_turn_id(processor)])
    multi.generate(engine, text_samples()[:3], SamplingParams(n=1, max_new_tokens=3, seed=4))
    assert multi.last_metrics["environment/down"] == 1.0


def test_each_record_picks_its_environment_by_field(tiny):
    from dataclasses import replace as copy

    processor, engine = tiny
    samples = [copy(s, columns={**s.columns, "game": name}) for s, name in zip(text_samples()[:2], ["a", "b"])]
    pool = EnvironmentPool({"a": Guess, "b": Flaky}, field_name="game")
    multi = MultiTurnRollout(pool, processor, MultiTurnConfig(max_turns=2), environment_field="game",
                             end_of_turn_ids=[end_of_turn_id(processor)])
    batch = multi.generate(engine, samples, SamplingParams(n=2, max_new_tokens=3, seed=4))
    assert [type(d) for d in pool.take(["a", "b"])] == [Guess, Flaky]
    assert batch.extras["stop_reason"][2:] == ["environment_failure"] * 2  # Flaky raises (its class default)
    bad = [copy(samples[0], columns={"game": "c"})]
    with pytest.raises(EnvironmentFailure, match="field 'game' is 'c', not one of the environments"):
        multi.generate(engine, bad, SamplingParams(n=1, max_new_tokens=3, seed=4))


def test_every_call_logs_the_same_metric_keys_whatever_environments_it_had(tiny):
    """Processes reduce the step's metrics key by key: a process whose records all picked one environment
    must log the keys of the others too (a mean with no dialogue at weight 0), or the reduction fails."""
    from dataclasses import replace as copy

    processor, engine = tiny
    pool = EnvironmentPool({"a": Guess, "notes": Notes}, field_name="game")
    multi = MultiTurnRollout(pool, processor, MultiTurnConfig(max_turns=2), environment_field="game",
                             end_of_turn_ids=[end_of_turn_id(processor)])
    seen = []
    for name in ("a", "notes"):
        samples = [copy(s, columns={**s.columns, "game": name}) for s in text_samples()[:2]]
        multi.generate(engine, samples, SamplingParams(n=1, max_new_tokens=3, seed=4))
        snapshot, metrics = multi.metrics_snapshot()
        seen.append((set(metrics), snapshot))
    assert seen[0][0] == seen[1][0]
    assert {"tools/note/calls", "environment/a/solved", "environment/a/tries"} <= seen[0][0]
    # Guess's parts weigh by its dialogues: none in the second call
    assert seen[0][1].metric_weights["environment/a/tries"] == 2 and seen[1][1].metric_weights["environment/a/tries"] == 0


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


# ---------------------------------------------------------------------------- config and trainer


def _no_hints(a, b):
    """Add.

    Args:
        a: x
        b: y
    """
    return a + b


@pytest.mark.parametrize("values, says", [
    ({"tools": ["no_such_tool"]}, "worker.rollout.multi_turn.tools': unknown tool 'no_such_tool'"),
    ({"tools": [f"{__file__}:_no_hints"]}, "has no JSON schema"),
    ({"environment": "no_such_environment"}, "worker.rollout.multi_turn.environment': unknown environment"),
    ({"environment": "radiology_zoom", "reward_weights": {"solved": 2.0}}, "not a reward part"),
])
def test_bad_tools_and_environments_are_named_at_load(values, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")) as caught:
        dialogue_parts(MultiTurnConfig(**values))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("rollout, says", [
    ({"multi_turn": {"environment": "verifier"}}, "names the verifier"),
    ({"multi_turn": {"environment": "radiology_zoom"}, "verifier": {"enable": True, "backend": "rule"}},
     "the verifier is the run's environment"),
    ({"multi_turn": {"max_turns": 0, "tools": ["x"]}}, "multi_turn.max_turns' must be >= 1"),
])
def test_dialogue_settings_that_cannot_run_are_refused(rollout, says, tmp_path):
    from grouprl.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"worker": {"rollout": rollout}}))
    with pytest.raises(ConfigError, match=says):
        load_config(str(path))


@pytest.fixture(scope="module")
def sums(text_task, tmp_path_factory):
    """Sums, and a tiny model whose saved chat template is Qwen2.5-Instruct's (tools in the system
    message, calls in <tool_call> blocks, results in <tool_response> blocks)."""
    import shutil
    from dataclasses import replace as copy

    from transformers import AutoTokenizer

    records = [{"problem": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(1, 5) for b in range(1, 4)]
    task = text_task(records, [CALLS, "<tool_response>", "</tool_response>"])
    model = tmp_path_factory.mktemp("tool_model") / "model"
    shutil.copytree(task.model, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = QWEN25
    tokenizer.save_pretrained(model)
    return copy(task, model=model)


def test_a_trl_environment_and_tool_list_train_a_step(sums, tmp_path):
    from grouprl.trainer.grpo import GRPOTrainer

    module = tmp_path / "agent_parts.py"
    module.write_text(TRL_ENVIRONMENT)
    config = config_from_dict(sums.config(tmp_path / "run", [{"name": "length", "kwargs": {"target": 3}}], **{
        "data.max_response_length": 5, "data.rollout_batch_size": 2, "worker.actor.global_batch_size": 2,
        "worker.rollout.n": 2, "trainer.max_steps": 1, "trainer.val_freq": -1,
        "worker.rollout.multi_turn": {"environment": f"{module}:Adder", "tools": [f"{module}:multiply"],
                                      "max_turns": 2, "reward_weights": {"Adder": 0.5}}}))
    trainer = GRPOTrainer(config)
    trainer.engine = ScriptedFirstTurn(trainer.engine, trainer.processor, CALLS)
    before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.named_parameters())
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in metrics if "actor/pg_loss" in m)
    assert step["tools/calls"] == 8 and step["tools/add/calls"] == 4 and step["tools/errors"] == 0
    # the environment's reward is a component: logged under its part's name, weighted 0.5
    assert step["rewards/Adder/mean"] == 1.0
    assert {c.key: c.weight for c in trainer.rewards.components} == {"length": 1.0, "Adder": 0.5}
    rollouts = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert all(r["dialogue"][1]["role"] == "tool" and r["tool_calls"] == 2 for r in rollouts)
    batch = trainer.last_step.batch
    assert bool((batch.loss_mask <= batch.policy_mask).all())
    assert bool((batch.response_mask.sum(-1) > batch.policy_mask.sum(-1)).all())  # tool text: attended, no loss


GAMES = textwrap.dedent('''
    from grouprl.rollout.environments import Environment, Step


    class Echo(Environment):
        """Done when the turn repeats the answer's first letter; each turn scores a try."""
        reward_parts = ("tries", "echoed")

        def reset(self, sample):
            self.letter = (sample.answer or "x")[0]

        def step(self, message):
            if self.letter in message:
                return Step(done=True, reward={"tries": 1.0, "echoed": 1.0})
            return Step([{"role": "user", "content": "Again."}], reward={"tries": 1.0})


    class Quiet(Environment):
        """Ends every dialogue at once, with no reward of its own."""
''')


def test_two_processes_run_dialogues_with_environments_picked_per_record(tmp_path, torchrun, read_jsonl):
    """bf16 over two gloo processes: each record picks its environment, the processes take different numbers
    of turns, and the step's metrics reduce (the same keys on both)."""
    import yaml

    from grouprl.models.tiny import build_tiny_text_lm

    words = ["yes", "no", "maybe", "left"]
    records = [{"problem": f"Say {w} {i}", "answer": w, "game": "echo" if i % 2 else "quiet"}
               for i in range(4) for w in words]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "games.py").write_text(GAMES)
    build_tiny_text_lm(tmp_path / "model", [r["problem"] for r in records] + words + ["Again."], seed=0)
    config = {
        "data": {"train_files": ["train.jsonl"], "max_response_length": 4, "rollout_batch_size": 4},
        "worker": {"actor": {"model": {"model_path": "model", "dtype": "bfloat16"}, "optim": {"lr": 1e-3},
                             "global_batch_size": 4, "micro_batch_size_per_device_for_update": 4},
                   "rollout": {"n": 2, "multi_turn": {
                       "environments": {"echo": "games.py:Echo", "quiet": "games.py:Quiet"},
                       "environment_field": "game", "tools": ["calculator"], "tool_parser": "hermes",
                       "max_turns": 3}},
                   "reward": {"functions": [{"name": "length", "kwargs": {"target": 3}}]}},
        "trainer": {"max_steps": 2, "logger": ["jsonl"], "device": "cpu", "output_dir": "run"},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    torchrun("-m", "grouprl", "train", "config.yaml", cwd=tmp_path)
    assert json.loads((tmp_path / "run" / "run_info.json").read_text())["num_processes"] == 2
    steps = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "actor/pg_loss" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["multiturn/stop_reason/stop"] + m["multiturn/stop_reason/max_turns"] + \
            m["multiturn/stop_reason/length"] == pytest.approx(1.0)
        assert "tools/calculator/calls" in m and "rewards/tries/mean" in m and "environment/echo/tries" in m
    rollouts = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    assert {r["stop_reason"] for r in rollouts} <= {"stop", "max_turns", "length"}
