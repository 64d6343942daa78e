"""EasyR1's reward files run unchanged: batch, sequential and the older per-sample contracts, loaded through
EasyR1's keys (worker.reward.reward_function, reward_function_kwargs, reward_type); ``overall`` trains, the
other parts are logged; a broken score is a RewardError naming the function and the row."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from grouprl.config import ConfigError, config_from_dict, load_config
from grouprl.rewards import RewardError, RewardLoadError, RewardSet
from grouprl.rewards.easyr1 import EasyR1Reward
from grouprl.trainer.grpo import build_rewards

# Shaped like EasyR1's examples/reward_function/math.py (batch) and r1v.py (sequential), self-contained:
# no mathruler, a \boxed{} answer compared as text.
MATH = '''
import re
from typing import Any

REWARD_NAME = "math"
REWARD_TYPE = "batch"


def format_reward(response: str) -> float:
    pattern = re.compile(r"<think>.*</think>.*\\\\boxed\\{.*\\}.*", re.DOTALL)
    return 1.0 if re.fullmatch(pattern, response) else 0.0


def accuracy_reward(response: str, ground_truth: str) -> float:
    found = re.search(r"\\\\boxed\\{(.*?)\\}", response)
    return 1.0 if found and found.group(1).strip() == ground_truth.strip() else 0.0


def compute_score(reward_inputs: list[dict[str, Any]], format_weight: float = 0.1) -> list[dict[str, float]]:
    scores = []
    for reward_input in reward_inputs:
        response = re.sub(r"\\s*(<|>|/)\\s*", r"\\1", reward_input["response"])
        format_score = format_reward(response)
        accuracy_score = accuracy_reward(response, reward_input["ground_truth"])
        scores.append({
            "overall": (1 - format_weight) * accuracy_score + format_weight * format_score,
            "format": format_score,
            "accuracy": accuracy_score,
            "length": float(reward_input["response_length"]),
        })
    return scores
'''

R1V = '''
import re
from typing import Any

REWARD_NAME = "r1v"
REWARD_TYPE = "sequential"


# unannotated: only the file's REWARD_TYPE says sequential (EasyR1's default is batch)
def compute_score(reward_input, format_weight=0.5):
    response = reward_input["response"]
    format_score = 1.0 if re.fullmatch(r"<think>.*?</think>\\s*<answer>.*?</answer>", response, re.DOTALL) else 0.0
    found = re.search(r"<answer>(.*?)</answer>", response)
    given = found.group(1).strip() if found else response.strip()
    accuracy_score = 1.0 if given == reward_input["ground_truth"].strip() else 0.0
    return {"overall": (1 - format_weight) * accuracy_score + format_weight * format_score,
            "format": format_score, "accuracy": accuracy_score}
'''

# EasyR1 before 0.3.1: one response a call, positional; 0.3.0's batch took two lists
OLD = '''
from typing import Dict, List


def compute_score(predict_str: str, ground_truth: str, format_weight: float = 0.1) -> Dict[str, float]:
    accuracy = 1.0 if predict_str.strip() == ground_truth else 0.0
    return {"overall": accuracy * (1 - format_weight) + format_weight, "accuracy": accuracy}


def plain_score(predict_str, ground_truth):
    return 1.0 if predict_str.strip() == ground_truth else 0.0


def list_batch(predicts: List[str], ground_truths: List[str]) -> List[Dict[str, float]]:
    return [{"overall": float(p == g), "exact": float(p == g)} for p, g in zip(predicts, ground_truths)]
'''

BROKEN = '''
def no_overall(reward_inputs):
    return [{"overall": 1.0}, {"format": 1.0}]


def too_few(reward_inputs):
    return [{"overall": 1.0}]


def nan_overall(reward_input):
    return {"overall": float("nan") if reward_input["ground_truth"] == "b" else 1.0}


def nan_part(reward_inputs):
    return [{"overall": 1.0, "format": float("nan")} for _ in reward_inputs]


def text_score(reward_input):
    return "1.0"


def three(response, ground_truth, extra):
    return 1.0


def grouprl_style(prompts, completions, **kwargs):
    return [1.0 for _ in completions]


def no_kwargs(prompts, completions):
    return [1.0 for _ in completions]
'''

GOOD = r"<think>2+2</think> the answer is \boxed{4}"


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def reward_config(reference: str, **reward) -> dict:
    """A config whose worker.reward holds EasyR1's keys (nothing else is read by build_rewards)."""
    return config_from_dict({"worker": {"reward": {"reward_function": reference, **reward}}})


def score(rewards: RewardSet, completions: list[str], answers: list[str], completion_ids=None, **columns):
    return rewards.score(["q"] * len(completions), completions, {"answer": answers, **columns},
                         completion_ids=completion_ids)


def test_batch_file_through_easyr1_keys_trains_overall_and_logs_parts(tmp_path):
    ref = write(tmp_path, "math.py", MATH) + ":compute_score"
    rewards = build_rewards(reward_config(ref, reward_type="batch", reward_function_kwargs={"format_weight": 0.5}))
    fn = rewards.components[0].fn
    assert isinstance(fn, EasyR1Reward) and fn.batch and fn.dict_inputs
    result = score(rewards, [GOOD, r"\boxed{4}", "<think>x</think> \\boxed{5}"], ["4", "4", "4"],
                   completion_ids=[[1] * 7, [1] * 3, [1] * 5])
    # format_weight 0.5 (the kwargs reached compute_score): overall = 0.5 * accuracy + 0.5 * format
    assert result.total == [1.0, 0.5, 0.5]
    assert result.components[ref] == [1.0, 0.5, 0.5]
    # the parts are logged beside it and never summed into the total
    assert result.parts[ref] == {"format": [1.0, 0.0, 1.0], "accuracy": [1.0, 1.0, 0.0],
                                 "length": [7.0, 3.0, 5.0]}  # response_length: the completion's token count
    metrics = result.metrics()
    assert metrics[f"rewards/{ref}/format/mean"] == pytest.approx(2 / 3)
    assert metrics[f"rewards/{ref}/accuracy/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/mean"] == pytest.approx(2 / 3)


def test_sequential_file_is_detected_from_its_reward_type_and_called_by_keyword(tmp_path):
    ref = write(tmp_path, "r1v.py", R1V) + ":compute_score"
    rewards = build_rewards(reward_config(ref))  # no reward_type: the file's REWARD_TYPE says sequential
    fn = rewards.components[0].fn
    assert not fn.batch and fn.dict_inputs
    # TRL-style keyword call, as a reward set calls its rewards
    out = fn(prompts=["q", "q"], completions=["<think>a</think> <answer>7</answer>", "7"], answer=["7", "8"])
    assert list(out) == [1.0, 0.0] and out.parts == {"format": [1.0, 0.0], "accuracy": [1.0, 0.0]}
    # and a chat-style completion (a list of messages) reads its last message's text
    out = fn(["q"], [[{"role": "assistant", "content": "<think>a</think><answer>7</answer>"}]], answer=["7"])
    assert list(out) == [1.0]


@pytest.mark.parametrize("function, reward_type, expected, parts", [
    ("compute_score", "function", [1.0, 0.3], {"accuracy": [1.0, 0.0]}),  # EasyR1 < 0.3 config value
    ("compute_score", None, [1.0, 0.3], {"accuracy": [1.0, 0.0]}),  # two str parameters: sequential
    ("plain_score", "sequential", [1.0, 0.0], {}),  # a float is the overall score alone
    ("list_batch", None, [1.0, 0.0], {"exact": [1.0, 0.0]}),  # EasyR1 0.3.0: two lists in, a list out
])
def test_older_easyr1_contracts(tmp_path, function, reward_type, expected, parts):
    ref = write(tmp_path, "old.py", OLD) + f":{function}"
    kwargs = {"format_weight": 0.3} if function == "compute_score" else {}  # the default is 0.1
    rewards = build_rewards(reward_config(ref, reward_type=reward_type, reward_function_kwargs=kwargs))
    result = score(rewards, ["yes", "no"], ["yes", "yes"])
    assert result.total == pytest.approx(expected)
    assert result.parts.get(ref, {}) == parts


def test_an_easyr1_file_among_worker_reward_functions_is_one_weighted_component(tmp_path):
    ref = write(tmp_path, "r1v.py", R1V) + ":compute_score"
    cfg = config_from_dict({"worker": {"reward": {"functions": [
        {"name": "accuracy"}, {"name": ref, "weight": 0.5, "kwargs": {"format_weight": 0.0}}]}}})
    result = score(build_rewards(cfg), ["<answer>7</answer>", "<answer>8</answer>"], ["7", "7"])
    # overall (accuracy alone at format_weight 0) weighs 0.5; its parts never enter the total
    assert result.components[ref] == [1.0, 0.0] and result.total == [1.5, 0.0]
    assert set(result.parts) == {ref} and result.parts[ref]["format"] == [0.0, 0.0]


def test_grouprl_functions_under_reward_function_keep_working(tmp_path):
    ref = write(tmp_path, "broken.py", BROKEN) + ":grouprl_style"
    rewards = build_rewards(reward_config(ref))
    assert not isinstance(rewards.components[0].fn, EasyR1Reward)
    assert score(rewards, ["a", "b"], ["a", "a"]).total == [1.0, 1.0]
    # one that forgot **kwargs still gets grouprl's message, not EasyR1's contract
    with pytest.raises(RewardLoadError, match=r"worker\.reward\.reward_function.*must accept \*\*kwargs"):
        build_rewards(reward_config(write(tmp_path, "broken.py", BROKEN) + ":no_kwargs"))


@pytest.mark.parametrize("function, reward_type, needle", [
    ("three", None, "fits neither grouprl's contract"),
    ("grouprl_style", "batch", "reward_type is 'batch'"),
])
def test_a_function_that_fits_no_contract_is_a_load_error_naming_it_and_the_key(tmp_path, function, reward_type,
                                                                                   needle):
    ref = write(tmp_path, "broken.py", BROKEN) + f":{function}"
    with pytest.raises(RewardLoadError) as exc:
        build_rewards(reward_config(ref, reward_type=reward_type))
    msg = str(exc.value)
    assert needle in msg and function in msg and "worker.reward.reward_function" in msg and "\n" not in msg


def test_reward_type_without_reward_function_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'worker\.reward\.reward_type' \(batch\) says how "
                                          r"'worker\.reward\.reward_function' is called"):
        load_config(None, ["worker.reward.reward_type=batch", "worker.reward.functions=[{name: accuracy}]"])
    with pytest.raises(ConfigError, match="accepts one of batch, sequential, function"):
        load_config(None, ["worker.reward.reward_type=batched", "worker.reward.reward_function=m.py:f"])


def test_an_option_the_function_does_not_take_is_a_load_error(tmp_path):
    ref = write(tmp_path, "math.py", MATH) + ":compute_score"
    with pytest.raises(RewardLoadError, match="has no option 'format_wieght'"):
        build_rewards(reward_config(ref, reward_function_kwargs={"format_wieght": 0.5}))


@pytest.mark.parametrize("function, needle, row", [
    ("no_overall", "row 1 has no 'overall' (its keys: format)", 1),
    ("too_few", "returned 1 scores for 2 responses", None),
    ("nan_overall", "row 1, 'overall' is nan", 1),
    ("nan_part", "row 0, 'format' is nan", 0),
    ("text_score", "is a str ('1.0'); expected a number", 0),
])
def test_a_broken_score_is_a_reward_error_naming_the_function_and_the_row(tmp_path, function, needle, row):
    ref = write(tmp_path, "broken.py", BROKEN) + f":{function}"
    rewards = build_rewards(reward_config(ref, reward_type="sequential" if function in ("nan_overall", "text_score")
                                          else "batch"))
    with pytest.raises(RewardError) as exc:
        score(rewards, ["a", "b"], ["a", "b"])
    msg = str(exc.value)
    assert needle in msg and function in msg and "\n" not in msg
    assert exc.value.row == row


def test_an_easyr1_reward_trains_in_a_tiny_run_with_its_parts_logged(say_task, tmp_path, read_jsonl):
    task = say_task(6)
    ref = write(tmp_path, "say.py", '''
        REWARD_TYPE = "batch"

        def compute_score(reward_inputs, weight=1.0):
            out = []
            for x in reward_inputs:
                hit = 1.0 if x["ground_truth"] in x["response"] else 0.0
                short = 1.0 if x["response_length"] <= 3 else 0.0
                out.append({"overall": weight * hit, "hit": hit, "short": short})
            return out
    ''') + ":compute_score"
    values = task.config(tmp_path / "run", [], **{
        "worker.reward.functions": [], "worker.reward.reward_function": ref, "worker.reward.reward_type": "batch",
        "worker.reward.reward_function_kwargs": {"weight": 2.0}, "worker.actor.global_batch_size": 4,
        "trainer.max_steps": 1, "trainer.seed": 3})
    from grouprl.trainer.grpo import GRPOTrainer

    GRPOTrainer(config_from_dict(values)).train()
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    for key in (f"rewards/{ref}/mean", f"rewards/{ref}/hit/mean", f"rewards/{ref}/short/mean", "reward/mean"):
        assert key in metrics, key
    assert metrics["reward/mean"] == pytest.approx(2.0 * metrics[f"rewards/{ref}/hit/mean"])
    rollouts = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    assert rollouts
    for r in rollouts:
        hit = float(r["reference"] in r["response"])
        assert r["rewards"] == {ref: 2.0 * hit, f"{ref}/hit": hit, f"{ref}/short": r["rewards"][f"{ref}/short"]}
        assert r["score"] == 2.0 * hit  # overall trains; the parts do not add to it
