"""EasyR1's online filtering: keep a group when filter_low < mean over the group of filter_key < filter_high,
filter_key naming the overall reward, a reward component or a part of an EasyR1 reward's score."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from grouprl.algorithms import filter_groups_by_mean
from grouprl.config import ConfigError, config_from_dict, load_config
from grouprl.rollout.batch import RolloutBatch
from grouprl.trainer.grpo import GRPOTrainer, filter_values

NAN = math.nan


def test_filter_keeps_groups_whose_mean_lies_strictly_between_the_bounds():
    # group means: a 0.5, b 0.0, c 1.0, d 0.25 (= low), e 0.75 (= high), f 0.375
    values = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.25, 0.25, 1.0, 0.5, 0.5, 0.25])
    groups = ["a", "a", "b", "b", "c", "c", "d", "d", "e", "e", "f", "f"]
    keep = filter_groups_by_mean(values, groups, low=0.25, high=0.75)
    assert keep.tolist() == [True, True, False, False, False, False, False, False, False, False, True, True]
    # EasyR1's defaults on a {0, 1} reward: all-wrong and all-right groups go, mixed ones stay
    keep = filter_groups_by_mean(torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0]), [0, 0, 1, 1, 2, 2], low=0.01, high=0.99)
    assert keep.tolist() == [False, False, True, True, False, False]


def test_filter_mean_skips_rows_the_value_does_not_apply_to():
    # group 0: mean of (0.2, 0.6) = 0.4, its NaN row ignored; group 1: no defined value, dropped
    keep = filter_groups_by_mean(torch.tensor([0.2, NAN, 0.6, NAN, NAN]), [0, 0, 0, 1, 1], low=0.3, high=0.5)
    assert keep.tolist() == [True, True, True, False, False]
    # interleaved, unsorted group ids
    keep = filter_groups_by_mean(torch.tensor([0.9, 0.1, 0.9, 0.1]), torch.tensor([7, 3, 7, 3]), low=0.5, high=1.0)
    assert keep.tolist() == [True, False, True, False]
    assert filter_groups_by_mean(torch.zeros(0), [], low=0.0, high=1.0).tolist() == []
    with pytest.raises(ValueError, match="low < high"):
        filter_groups_by_mean(torch.zeros(2), [0, 0], low=0.5, high=0.5)


def _batch(components: dict, scores: list[float]) -> RolloutBatch:
    n = len(scores)
    return RolloutBatch(samples=[None] * n, group_index=torch.arange(n), prompt_ids=torch.zeros(n, 1),
                        prompt_mask=torch.ones(n, 1), response_ids=torch.zeros(n, 1), response_mask=torch.ones(n, 1),
                        responses=[""] * n, truncated=torch.zeros(n, dtype=torch.bool),
                        reward_components=components, scores=torch.tensor(scores))


def test_filter_key_names_overall_a_component_or_a_part():
    batch = _batch({"math.py:f": [0.9, 0.1], "math.py:f/accuracy": [1.0, None], "length": [0.5, 0.25]}, [0.3, 0.7])
    assert filter_values(batch, "overall").tolist() == pytest.approx([0.3, 0.7])
    assert filter_values(batch, "length").tolist() == [0.5, 0.25]
    acc = filter_values(batch, "accuracy")  # a part by its own name, EasyR1's way
    assert acc[0] == 1.0 and math.isnan(acc[1])
    assert filter_values(batch, "math.py:f/accuracy")[0] == 1.0
    with pytest.raises(ConfigError, match=r"algorithm\.filter_key.*'acc' names no reward component or part.*"
                                          r"overall, math\.py:f, math\.py:f/accuracy, length"):
        filter_values(batch, "acc")
    two = _batch({"a.py:f/accuracy": [1.0], "b.py:g/accuracy": [0.0]}, [0.0])
    with pytest.raises(ConfigError, match="several rewards have a part 'accuracy'"):
        filter_values(two, "accuracy")


def test_easyr1_filter_keys_are_schema_keys_with_easyr1_defaults():
    algo = load_config(None, ["algorithm.filter_high=0.9"]).algorithm
    assert algo.mean_filter == ("overall", 0.01, 0.9)
    assert load_config(None).algorithm.mean_filter is None  # unset: grouprl's std rule (filter_min_std)
    algo = load_config(None, ["algorithm.online_filtering=true", "algorithm.filter_key=accuracy",
                              "worker.reward.functions=[{name: accuracy}, {name: format}]"]).algorithm
    assert algo.mean_filter == ("accuracy", 0.01, 0.99)


@pytest.mark.parametrize("overrides, needle", [
    (["algorithm.filter_low=0.6", "algorithm.filter_high=0.4"], "need low < high"),
    (["algorithm.filter_low=0.99"], "need low < high"),  # against EasyR1's default high
    (["algorithm.online_filtering=true", "algorithm.filter_key=acuracy",
      "worker.reward.functions=[{name: accuracy}, {name: format}]"],
     "'acuracy' names no reward component; the run's components are overall, accuracy, format"),
    (["algorithm.filter_key=' '"], "filter_key' is empty"),
])
def test_bad_filter_keys_are_config_errors(overrides, needle):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert needle in str(exc.value) and "algorithm.filter_" in str(exc.value)


def test_a_part_name_is_accepted_when_a_user_reward_may_report_it():
    # parts of a user function's score are known once it has scored (the trainer checks them then)
    cfg = load_config(None, ["algorithm.online_filtering=true", "algorithm.filter_key=accuracy",
                             "worker.reward.reward_function=./math.py:compute_score"])
    assert cfg.algorithm.mean_filter[0] == "accuracy"


# Its overall score is the same for every response (grouprl's std rule would drop every group); its
# "accuracy" part depends only on the prompt's answer, so each group's mean is known in advance.
PER_ANSWER = {"yes": 0.0, "no": 1.0, "maybe": 0.5, "left": 0.25, "right": 0.75, "up": 0.375, "down": 0.625}
REWARD = f'''
REWARD_TYPE = "batch"
PER_ANSWER = {PER_ANSWER!r}
SEEN = []


def compute_score(reward_inputs):
    SEEN.append([x["ground_truth"] for x in reward_inputs])
    return [{{"overall": 0.5, "accuracy": PER_ANSWER[x["ground_truth"]]}} for x in reward_inputs]
'''


def _filtered_run(say_task, tmp_path, filter_key):
    task = say_task(6)
    path = tmp_path / "per_answer.py"
    path.write_text(textwrap.dedent(REWARD))
    values = task.config(tmp_path / "run", [], **{
        "worker.reward.functions": [], "worker.reward.reward_function": f"{path}:compute_score",
        "algorithm.online_filtering": True, "algorithm.max_filter_rounds": 0, "algorithm.filter_key": filter_key,
        "algorithm.filter_low": 0.25, "algorithm.filter_high": 0.75, "data.rollout_batch_size": 8,
        "worker.actor.global_batch_size": 4, "worker.actor.micro_batch_size_per_device_for_update": 4,
        "worker.rollout.n": 2, "trainer.max_steps": 2, "trainer.seed": 3})
    trainer = GRPOTrainer(config_from_dict(values))
    trainer.train()
    seen = trainer.rewards.components[0].fn.fn.__globals__["SEEN"]
    return seen, tmp_path / "run"


def test_trainer_drops_exactly_the_groups_whose_part_mean_is_outside_the_bounds(say_task, tmp_path, read_jsonl):
    seen, run = _filtered_run(say_task, tmp_path, "accuracy")
    assert len(seen) == 2  # one round a step (max_filter_rounds 0), 8 prompts x 2 responses each
    trained = read_jsonl(run / "rollouts.jsonl")
    metrics = read_jsonl(run / "metrics.jsonl")
    for step, answers in enumerate(seen, start=1):
        # a group's rows share its answer, so the rows of the kept groups are the rows of those answers:
        # maybe, up, down; never yes/no (0, 1), nor left/right, whose means equal the bounds
        kept = [a for a in answers if 0.25 < PER_ANSWER[a] < 0.75]
        rows = [r for r in trained if r["step"] == step]
        assert sorted(r["reference"] for r in rows) == sorted(kept), step
        if kept:
            assert next(m for m in metrics if m["step"] == step)["dynamic_sampling/kept_groups"] == len(kept) // 2
    # the run saw groups of each kind, so the rule both kept and dropped some
    every = [a for answers in seen for a in answers]
    assert any(0.25 < PER_ANSWER[a] < 0.75 for a in every) and any(PER_ANSWER[a] in (0.25, 0.75) for a in every)


def test_filter_key_overall_keeps_every_group_of_a_constant_overall(say_task, tmp_path, read_jsonl):
    # overall is 0.5 everywhere: inside (0.25, 0.75), so every group trains, the ones accuracy would drop too
    seen, run = _filtered_run(say_task, tmp_path, "overall")
    trained = read_jsonl(run / "rollouts.jsonl")
    assert sorted(r["reference"] for r in trained) == sorted(a for answers in seen for a in answers)
