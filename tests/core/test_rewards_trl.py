"""TRL's reward functions, unchanged: called by keyword as TRL 1.16's GRPOTrainer calls them.

The data side (TRL's dataset formats): tests/core/test_data_trl.py; a whole `grouprl train` on a TRL
conversational dataset with a TRL-style reward file: test_trl_conversational_run below.
"""

from __future__ import annotations

import json
import math

import pytest
import yaml

from grouprl.rewards import RewardError, RewardLoadError, RewardSet, RewardSpec

PROMPTS = [[{"role": "user", "content": "What is 1/3 as a fraction?"}]] * 2
CONVERSATIONAL = [[{"role": "assistant", "content": r"<think>easy</think>My answer is \boxed{\frac{1}{3}}"}],
                  [{"role": "assistant", "content": r"My answer is \boxed{\frac{1}{2}}"}]]
SOLUTIONS = [r"\frac{1}{3}", r"\frac{1}{3}"]


def test_trl_accuracy_reward_by_name_on_conversational_completions():
    rewards = RewardSet.from_specs(["trl.rewards:accuracy_reward"])
    result = rewards.score(PROMPTS, CONVERSATIONAL, {"solution": SOLUTIONS})
    assert result.components == {"trl.rewards:accuracy_reward": [1.0, 0.0]}
    # it logs its parsed answers through log_extra, as it does in TRL's completions table
    assert result.logged_columns["solution"] == SOLUTIONS
    assert set(result.logged_columns) == {"solution", "gold_parsed", "answer_parsed"}


def test_trl_think_format_reward_by_name_and_in_a_config():
    from grouprl.config import load_config
    from grouprl.trainer.grpo import build_rewards

    direct = RewardSet.from_specs([RewardSpec("trl.rewards:think_format_reward", weight=0.5)])
    assert direct.score(PROMPTS, CONVERSATIONAL).total == [0.5, 0.0]
    config = load_config(base={"worker": {"reward": {"functions": [
        {"name": "trl.rewards:think_format_reward"}, {"name": "trl.rewards:accuracy_reward", "weight": 2.0}]}}})
    result = build_rewards(config).score(PROMPTS, CONVERSATIONAL, {"solution": SOLUTIONS})
    assert result.components == {"trl.rewards:think_format_reward": [1.0, 0.0],
                                 "trl.rewards:accuracy_reward": [1.0, 0.0]}
    assert result.total == [3.0, 0.0]


def test_trl_first_documented_example_reward_len():
    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    result = RewardSet.from_specs([reward_len]).score(["p", "q"], ["a" * 20, "a" * 25])
    assert result.total == [0.0, -5.0]


def test_a_column_named_after_the_completions():
    def f(completions, solution, **kwargs):
        return [float(c == s) for c, s in zip(completions, solution)]

    result = RewardSet.from_specs([f]).score(["p", "q"], ["4", "5"], {"solution": ["4", "4"]})
    assert result.total == [1.0, 0.0]


def test_trainer_state_and_completion_ids_reach_the_reward():
    from transformers import TrainerState

    seen = {}

    def shaped(completions, trainer_state, completion_ids, **kwargs):
        seen.update(state=trainer_state, ids=completion_ids)
        progress = trainer_state.global_step / trainer_state.max_steps
        return [progress * len(ids) for ids in completion_ids]

    state = TrainerState(global_step=3, max_steps=4, epoch=0.5)
    result = RewardSet.from_specs([shaped]).score(["p", "q"], ["a b", "c"], completion_ids=[[5, 6], [7]],
                                                  trainer_state=state)
    assert result.total == [1.5, 0.75]
    assert seen["state"] is state and seen["ids"] == [[5, 6], [7]]
    with pytest.raises(ValueError, match="got 1 completion_ids for 2 completions"):
        RewardSet.from_specs([shaped]).score(["p", "q"], ["a", "b"], completion_ids=[[1]], trainer_state=state)


def test_grouprl_contract_and_builtins_take_strings_and_message_lists():
    def own(prompts, completions, **columns):  # grouprl's documented form
        return [float(len(prompts[i]) > 0) + len(c) for i, c in enumerate(completions)]

    texts = ["<think>x</think><answer>\\boxed{4}</answer>", "4 is it"]
    messages = [[{"role": "assistant", "content": t}] for t in texts]
    specs = ["format", "accuracy", RewardSpec("length", kwargs={"target": 2}), "guided"]
    columns = {"answer": ["4", "5"]}
    as_text = RewardSet.from_specs(specs).score(["q", "q"], texts, columns)
    as_messages = RewardSet.from_specs(specs).score(["q", "q"], messages, columns)
    assert as_messages.components == as_text.components
    assert as_text.components["format"] == [1.0, 0.0] and as_text.components["accuracy"] == [1.0, 0.0]
    assert RewardSet.from_specs([own]).score(["q", "r"], ["ab", "c"]).total == [3.0, 2.0]


def test_a_reward_without_kwargs_that_names_every_argument_is_accepted():
    def explicit(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    assert RewardSet.from_specs([explicit]).score(["p"], ["x"], {"answer": ["x"]}).total == [1.0]
    # a column it does not name is an error naming it and the function, not a silent drop
    with pytest.raises(RewardError, match=r"reward 'explicit' cannot be called with this batch: it has no \*\*kwargs "
                                          r"and no parameter for solution\..*function explicit at .*test_rewards_trl"):
        RewardSet.from_specs([explicit]).score(["p"], ["x"], {"answer": ["x"], "solution": ["x"]})


def test_load_time_checks_name_what_a_reward_lacks():
    def no_state(prompts, completions, answer):
        return [0.0]

    with pytest.raises(RewardLoadError, match=r"reward 'no_state' must accept \*\*kwargs or name every argument it "
                                              r"is given: .*no parameter for completion_ids, trainer_state, log_extra"):
        RewardSet.from_specs([no_state])

    def positional(prompts, completions, /, **kwargs):
        return [0.0]

    with pytest.raises(RewardLoadError, match="takes prompts, completions positionally only"):
        RewardSet.from_specs([positional])
    with pytest.raises(RewardLoadError, match="reward 'length' has no option 'tagret'"):
        RewardSet.from_specs([RewardSpec("length", kwargs={"tagret": 3})])
    with pytest.raises(RewardLoadError, match="'trainer_state' cannot be an option"):
        RewardSet.from_specs([RewardSpec("trl.rewards:think_format_reward", kwargs={"trainer_state": 1})])


def test_a_parameter_nothing_fills_is_an_error_at_the_call():
    def needs_solution(completions, solution, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"reward 'needs_solution' cannot be called with this batch: nothing is "
                                          r"passed for its parameter\(s\) solution.*the columns answer"):
        RewardSet.from_specs([needs_solution]).score(["p"], ["x"], {"answer": ["y"]})


def test_log_metric_is_collected_and_a_bad_log_extra_names_the_reward():
    def logs(completions, log_metric, log_extra, **kwargs):
        log_metric("mean_length", sum(map(len, completions)) / len(completions))
        log_extra("length", [len(c) for c in completions])
        return [1.0] * len(completions)

    result = RewardSet.from_specs([logs]).score(["p", "q"], ["ab", "abcd"])
    assert result.logged_metrics == {"mean_length": [3.0]} and result.logged_columns == {"length": [2, 4]}
    assert result.metrics()["reward_log/mean_length"] == 3.0

    def short_column(completions, log_extra, **kwargs):
        log_extra("x", [1])
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"reward 'short_column' raised ValueError: log_extra\('x', \.\.\.\): "
                                          r"expected one value per row \(2\), got 1 values.*test_rewards_trl.py:\d+ "
                                          r"in short_column"):
        RewardSet.from_specs([short_column]).score(["p", "q"], ["a", "b"])


def test_a_column_named_like_a_trl_argument_is_refused():
    with pytest.raises(ValueError, match="column 'trainer_state' clashes with the reward argument"):
        RewardSet.from_specs(["length"]).score(["p"], ["x"], {"trainer_state": [1]})


REWARD_FILE = '''
import json


def reward_len(completions, trainer_state, completion_ids, solution, record, **kwargs):
    """TRL-style: conversational completions, a dataset column, the trainer's state; notes what it got."""
    with open(record, "a") as f:
        f.write(json.dumps({"completion": completions[0], "prompt": kwargs["prompts"][0], "solution": solution,
                            "state": [type(trainer_state).__module__, type(trainer_state).__name__,
                                      trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch],
                            "ids": [len(ids) for ids in completion_ids]}) + "\\n")
    kwargs["log_metric"]("completions", float(len(completions)))
    kwargs["log_extra"]("words", [len(completion[0]["content"].split()) for completion in completions])
    return [-abs(3 - len(completion[0]["content"].split())) for completion in completions]
'''


def test_trl_conversational_run(tiny_text_lm, tmp_path, capsys):
    from grouprl.cli import main

    words = ["yes", "no", "maybe", "left"]
    records = [{"prompt": [{"role": "system", "content": "Answer in one word."},
                           {"role": "user", "content": f"Say {w} {i}"}], "solution": w}
               for i in range(2) for w in words]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    model = tiny_text_lm([r["prompt"][1]["content"] for r in records] + words + ["Answer in one word."], seed=0)
    (tmp_path / "trl_rewards.py").write_text(REWARD_FILE)
    notes = tmp_path / "notes.jsonl"
    config = {
        "data": {"train_files": [str(data)], "max_response_length": 4, "rollout_batch_size": 2},
        "worker": {"actor": {"model": {"model_path": str(model)}, "optim": {"lr": 1e-3},
                             "global_batch_size": 2, "micro_batch_size_per_device_for_update": 4},
                   "rollout": {"n": 2},
                   "reward": {"functions": [{"name": f"{tmp_path / 'trl_rewards.py'}:reward_len",
                                             "kwargs": {"record": str(notes)}}]}},
        "trainer": {"max_steps": 2, "logger": ["jsonl"], "device": "cpu", "output_dir": str(tmp_path / "run")},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "config.yaml")]) == 0, capsys.readouterr().err
    seen = [json.loads(line) for line in notes.read_text().splitlines()]
    assert len(seen) == 2  # one call per step
    first, second = seen
    assert first["completion"][0]["role"] == "assistant" and isinstance(first["completion"][0]["content"], str)
    assert first["prompt"] in [r["prompt"] for r in records]  # the record's messages, its system message kept
    assert all(s in [r["solution"] for r in records] for s in first["solution"])
    assert first["state"][:4] == ["transformers.trainer_callback", "TrainerState", 0, 2]
    assert second["state"][2] == 1 and math.isclose(second["state"][4], 0.25)  # 1 of 4 batches of an epoch
    assert all(1 <= n <= 4 for n in first["ids"])
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward_log/completions"] for m in metrics if "reward_log/completions" in m] == [4.0, 4.0]
    # log_extra's column is in the rollouts JSONL, TRL's completions table
    rollouts = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 8
    assert all(r["logged"]["words"] == len(r["response"].split()) for r in rollouts)


def test_joined_parts_keep_what_each_part_logged():
    from grouprl.rewards import RewardResult
    from grouprl.trainer.reward_metrics import join_results

    first = RewardResult({"r": [1.0]}, [1.0], {"r": 1.0}, logged_metrics={"m": [1.0]}, logged_columns={"c": ["a"]})
    second = RewardResult({"r": [0.0, 0.5]}, [0.0, 0.5], {"r": 1.0}, logged_metrics={"m": [3.0]})
    joined = join_results([first, second], ["r"], {"r": 1.0})
    assert joined.logged_metrics == {"m": [1.0, 3.0]} and joined.logged_columns == {"c": ["a", None, None]}
    assert joined.metrics()["reward_log/m"] == 2.0


def test_logged_columns_follow_rows_through_select_and_concat():
    import torch

    from grouprl.data.sample import Sample
    from grouprl.rollout.batch import RolloutBatch

    def batch(rows: int, logs: dict) -> RolloutBatch:
        return RolloutBatch(samples=[Sample(messages=[])] * rows, group_index=torch.zeros(rows, dtype=torch.long),
                            prompt_ids=torch.ones(rows, 2, dtype=torch.long), prompt_mask=torch.ones(rows, 2),
                            response_ids=torch.ones(rows, 3, dtype=torch.long), response_mask=torch.ones(rows, 3),
                            responses=["r"] * rows, truncated=torch.zeros(rows, dtype=torch.bool), reward_logs=logs)

    joined = RolloutBatch.concat([batch(2, {"a": [1, 2]}), batch(1, {})], pad_token_id=0)
    assert joined.reward_logs == {"a": [1, 2, None]}
    assert joined.select([2, 0]).reward_logs == {"a": [None, 1]}
