"""GDPO (normalize_then_sum): against TRL's and verl's code, by hand, with every group estimator, in config and in
a tiny GRPO run, and its batch statistics over two processes."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from grouprl import algorithms
from grouprl.algorithms import compute_advantages, normalize_then_sum, per_reward_advantages
from grouprl.config import ConfigError, config_from_dict
from grouprl.config.ported_keys import port_values_with_notes

HERE = Path(__file__).parent
NAN = math.nan


# ---------------------------------------------------------------------------- TRL, transcribed
# trl 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._generate_and_score_completions, the
# ``multi_objective_aggregation == "normalize_then_sum"`` branch with the unscorable mask before it and the
# nan_to_num after it, written out for a [B, K] tensor of rewards (NaN = the function returned None).
# nanstd is TRL's own (trl.trainer.utils.nanstd), imported, unless another is given.
def trl_normalize_then_sum(rewards_per_func, reward_weights, num_generations, nanstd=None):
    if nanstd is None:
        from trl.trainer.utils import nanstd

    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = (grouped - mean_k) / (std_k + 1e-4)
    reward_k = reward_k.view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


# trl.trainer.utils.nanstd (trl 1.16.0) with its Bessel factor count / (count - 1) in float64: TRL divides two
# int64 tensors, which gives the default dtype (float32), so TRL's std is off by up to ~3e-8 (relative) even on
# float64 rewards. This copy differs from TRL's in that one dtype only.
def nanstd_float64_bessel(tensor, dim=None, keepdim=False):
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True).to(tensor.dtype)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan")))
    std = torch.sqrt(variance * correction)
    return std if keepdim else (std.squeeze() if dim is None else std.squeeze(dim))


# ---------------------------------------------------------------------------- verl, transcribed
# verl 0.9.1, verl/utils/torch_functional.py: masked_mean, masked_var, masked_whiten.
def verl_masked_mean(values, mask):
    return (values * mask).sum() / (mask.sum() + 1e-8)


def verl_masked_var(values, mask):
    mean = verl_masked_mean(values, mask)
    variance = verl_masked_mean((values - mean) ** 2, mask)
    mask_sum = mask.sum()
    return variance * (mask_sum / (mask_sum - 1))


def verl_masked_whiten(values, mask):
    mean, var = verl_masked_mean(values, mask), verl_masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + 1e-8)


# verl 0.9.1, verl/trainer/ppo/core_algos.py: compute_grpo_outcome_advantage (the loop version), and
# compute_gdpo_outcome_advantage from ``score_list`` on (after its extraction of each dimension from
# non_tensor_batch, which puts r_ik on the last valid token), returning the sum before the whitening too.
def verl_grpo(token_level_rewards, response_mask, index, epsilon=1e-6):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            t = torch.stack(id2score[idx])
            id2mean[idx], id2std[idx] = torch.mean(t), torch.std(t)
    for i in range(scores.shape[0]):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
    return scores.unsqueeze(-1) * response_mask


def verl_gdpo(score_list, weights, response_mask, index):
    new_advantage = None
    for i, token_scores in enumerate(score_list):
        normalized = verl_grpo(token_scores, response_mask, index)
        new_advantage = weights[i] * normalized if new_advantage is None else new_advantage + weights[i] * normalized
    return verl_masked_whiten(new_advantage, response_mask) * response_mask, new_advantage


def random_rewards(seed: int, groups: int = 6, n: int = 4, k: int = 3, holes: bool = True):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(groups * n, k, generator=g, dtype=torch.float64)
    scores[:, 0] = (scores[:, 0] > 0.5).double()  # a binary reward, as accuracy is: ties and zero-spread groups
    if holes:
        scores[torch.rand(groups * n, k, generator=g) < 0.25] = NAN
        scores[3] = NAN  # a row no reward scored
        scores[n:2 * n, 1] = NAN  # a group reward 1 never scored
        scores[2 * n:3 * n - 1, 2] = NAN  # a group where reward 2 scored one row
    weights = torch.rand(k, generator=g, dtype=torch.float64) + 0.5
    return scores, weights, torch.arange(groups).repeat_interleave(n)


# ---------------------------------------------------------------------------- against the peers


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_trl_normalize_then_sum_with_its_eps(seed):
    scores, weights, groups = random_rewards(seed)
    ours, _ = normalize_then_sum(scores, weights, groups, estimator_options={"eps": 1e-4}, eps=1e-4)
    theirs = trl_normalize_then_sum(scores.clone(), weights, 4)
    # TRL's float32 Bessel factor (see nanstd_float64_bessel) is the only difference at TRL's eps ...
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
    exact = trl_normalize_then_sum(scores.clone(), weights, 4, nanstd=nanstd_float64_bessel)
    torch.testing.assert_close(ours, exact, rtol=0, atol=1e-12)
    # ... and with grouprl's eps (1e-6 in both divisions) the advantages move by more than that
    default, _ = normalize_then_sum(scores, weights, groups)
    assert not torch.allclose(default, theirs, rtol=0, atol=1e-6)
    torch.testing.assert_close(default, theirs, rtol=0, atol=1e-2)


def test_matches_trl_where_no_reward_is_missing():
    scores, weights, groups = random_rewards(5, holes=False)
    ours, _ = normalize_then_sum(scores, weights, groups, estimator_options={"eps": 1e-4}, eps=1e-4)
    torch.testing.assert_close(ours, trl_normalize_then_sum(scores.clone(), weights, 4), rtol=0, atol=1e-7)
    exact = trl_normalize_then_sum(scores.clone(), weights, 4, nanstd=nanstd_float64_bessel)
    torch.testing.assert_close(ours, exact, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 3])
def test_matches_verl_gdpo_before_its_token_whitening(seed):
    """verl sums the same per-reward GRPO advantages (eps 1e-6); it then whitens over TOKENS (a long response
    weighs more; eps 1e-8 under the root), where grouprl and TRL renormalise over responses."""
    scores, weights, groups = random_rewards(seed, holes=False)
    lengths = torch.randint(1, 7, (scores.shape[0],), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(6) < lengths.unsqueeze(-1)).double()
    token_scores = []
    for k in range(scores.shape[1]):
        t = torch.zeros_like(mask)
        t[torch.arange(len(lengths)), lengths - 1] = scores[:, k]  # verl's placement on the last valid token
        token_scores.append(t)
    verl_final, verl_sum = verl_gdpo(token_scores, weights, mask, groups.numpy())

    ours, per_reward = normalize_then_sum(scores, weights, groups, eps=0.0)
    ours_sum = (weights.unsqueeze(-1) * per_reward).sum(0)
    torch.testing.assert_close(ours_sum.unsqueeze(-1) * mask, verl_sum, rtol=0, atol=1e-9)
    # the renormalisation: verl's masked_whiten with one entry per response is grouprl's (eps aside) ...
    row_whitened = verl_masked_whiten(ours_sum.unsqueeze(-1), torch.ones_like(ours_sum).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(ours, row_whitened, rtol=0, atol=1e-7)
    # ... and over the tokens of ragged responses it is another number
    assert (ours.unsqueeze(-1) * mask - verl_final).abs().max() > 1e-2


# ---------------------------------------------------------------------------- what GDPO is for


def test_distinct_reward_combinations_are_not_collapsed():
    """The paper's example: two binary rewards, two responses per prompt. Summed, a group with (1, 0) vs
    (0, 0) and a group with (1, 1) vs (0, 0) get the same advantages; normalised per reward they do not."""
    scores = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    groups = [0, 0, 1, 1]
    grpo = compute_advantages("grpo", scores.sum(1), groups)
    assert torch.allclose(grpo[:2], grpo[2:])  # collapsed
    gdpo, per_reward = normalize_then_sum(scores, None, groups)
    assert gdpo[2] > gdpo[0] > 0 > gdpo[1] > gdpo[3]
    # by hand: the group sums are 1/sqrt2 * (1, -1) and 2/sqrt2 * (1, -1) (eps aside), whitened over the four rows
    a = torch.tensor([1, -1, 2, -2], dtype=torch.float64) / math.sqrt(2)
    torch.testing.assert_close(gdpo, a / a.std(), rtol=0, atol=1e-5)
    torch.testing.assert_close(per_reward[1], torch.tensor([0, 0, 1, -1], dtype=torch.float64) / math.sqrt(2),
                               rtol=0, atol=1e-5)


GROUP_ESTIMATORS = [("grpo", {"std_level": "group"}), ("grpo", {"std_level": "batch"}), ("grpo", {"std_level": "none"}),
                    ("rloo", {}), ("grpo_passk", {}), ("grpo_passk", {"norm_by_std": False}),
                    ("reinforce_plus_plus_baseline", {})]


@pytest.mark.parametrize("estimator,options", GROUP_ESTIMATORS)
def test_every_group_estimator_normalises_each_reward_on_its_scored_rows(estimator, options):
    scores, weights, groups = random_rewards(7)
    mask = (torch.arange(5) < torch.arange(len(groups)).remainder(5).add(1).unsqueeze(-1)).long()
    adv, per_reward = normalize_then_sum(scores, weights, groups, estimator=estimator, estimator_options=options,
                                         response_mask=mask)
    token_level = estimator == "reinforce_plus_plus_baseline"
    for k in range(scores.shape[1]):
        rows = ~torch.isnan(scores[:, k])
        opts = dict(options)
        if options.get("std_level") == "batch":
            opts["batch_std"] = float(scores[rows, k].std())
        if token_level:
            opts["response_mask"] = mask[rows]
        alone = compute_advantages(estimator, scores[rows, k], groups[rows], **opts)
        torch.testing.assert_close(per_reward[k][rows], alone, rtol=0, atol=1e-12)
        assert bool((per_reward[k][~rows] == 0).all())  # an unscored row gets no A_k
    total = (weights.reshape(-1, *[1] * (per_reward.dim() - 1)) * per_reward).sum(0)
    scored = ~torch.isnan(scores).all(1)
    row = total if not token_level else (total * mask).sum(-1) / mask.sum(-1)
    expected = (total - row[scored].mean()) / (row[scored].std() + 1e-6)
    if token_level:
        expected = expected * mask
        assert adv.shape == mask.shape
    torch.testing.assert_close(adv[scored], expected[scored], rtol=0, atol=1e-12)
    assert bool((adv[~scored] == 0).all())
    rows_adv = adv[scored] if not token_level else (adv * mask).sum(-1)[scored] / mask.sum(-1)[scored]
    assert abs(float(rows_adv.mean())) < 1e-9 and float(rows_adv.std()) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("estimator", ["remax", "reinforce_plus_plus"])
def test_estimators_without_a_group_baseline_are_refused(estimator):
    scores, weights, groups = random_rewards(0)
    with pytest.raises(ValueError, match="not group-relative"):
        normalize_then_sum(scores, weights, groups, estimator=estimator)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        normalize_then_sum(torch.zeros(4), None, [0, 0, 1, 1])
    with pytest.raises(ValueError, match="one entry per reward"):
        normalize_then_sum(torch.zeros(4, 2), [1.0, 2.0, 3.0], [0, 0, 1, 1])
    with pytest.raises(ValueError, match="needs response_mask"):
        per_reward_advantages(torch.zeros(4, 2), [0, 0, 1, 1], estimator="reinforce_plus_plus_baseline")


def test_outside_batch_moments_are_used_for_the_renormalisation_and_the_batch_std():
    scores, weights, groups = random_rewards(4)
    seen = []

    def moments(values):
        seen.append(values.numel())
        return 0.5, 2.0, 100

    adv, per_reward = normalize_then_sum(scores, weights, groups, estimator_options={"std_level": "batch"},
                                         batch_moments_fn=moments, eps=0.0)
    assert len(seen) == scores.shape[1] + 1  # each reward's batch std, then the renormalisation
    total = (weights.unsqueeze(-1) * per_reward).sum(0)
    scored = ~torch.isnan(scores).all(1)
    torch.testing.assert_close(adv[scored], (total[scored] - 0.5) / 2.0, rtol=0, atol=1e-12)
    rows = ~torch.isnan(scores[:, 0])
    alone = compute_advantages("grpo", scores[rows, 0], groups[rows], std_level="batch", batch_std=2.0)
    torch.testing.assert_close(per_reward[0][rows], alone, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------- two processes


def test_batch_moments_on_two_processes_are_the_whole_batchs(tmp_path, torchrun):
    torchrun(str(HERE / "distributed" / "batch_moments_check.py"), str(tmp_path), cwd=tmp_path)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in results] == [2, 2]
    scores = torch.tensor(results[0]["scores"], dtype=torch.float64)
    groups = torch.tensor(results[0]["groups"])
    mean, std, n = algorithms.batch_moments(scores[~scores[:, 0].isnan(), 0])
    whole, _ = normalize_then_sum(scores, [1.0, 0.5], groups, estimator_options={"std_level": "batch"})
    for rank, result in enumerate(results):
        assert result["moments"][2] == n
        assert result["moments"][0] == pytest.approx(mean, abs=1e-12)
        assert result["moments"][1] == pytest.approx(std, abs=1e-12)
        rows = slice(0, 8) if rank == 0 else slice(8, None)
        np.testing.assert_allclose(result["advantages"], whole[rows].numpy(), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------- config


def test_default_is_sum_then_normalize_and_bad_values_are_refused(tmp_path):
    base = {"trainer": {"output_dir": str(tmp_path)}}
    assert config_from_dict(base).algorithm.multi_objective_aggregation == "sum_then_normalize"
    with pytest.raises(ConfigError, match="multi_objective_aggregation"):
        config_from_dict({**base, "algorithm": {"multi_objective_aggregation": "mean"}})


@pytest.mark.parametrize("estimator", ["remax", "reinforce_plus_plus"])
def test_normalize_then_sum_needs_a_group_estimator(tmp_path, estimator):
    values = {"trainer": {"output_dir": str(tmp_path)},
              "algorithm": {"adv_estimator": estimator, "multi_objective_aggregation": "normalize_then_sum"}}
    with pytest.raises(ConfigError, match=f"'algorithm.multi_objective_aggregation'.*{estimator!r} has no group"):
        config_from_dict(values)


def test_verl_and_nemo_rl_gdpo_spelling_is_mapped(tmp_path):
    values = {"trainer": {"output_dir": str(tmp_path)}, "algorithm": {"adv_estimator": "gdpo"}}
    ported, notes = port_values_with_notes(values)
    assert ported["algorithm"] == {"adv_estimator": "grpo", "multi_objective_aggregation": "normalize_then_sum"}
    assert any("algorithm.adv_estimator='gdpo'" in n for n in notes)
    algo = config_from_dict(values).algorithm
    assert (algo.adv_estimator, algo.multi_objective_aggregation) == ("grpo", "normalize_then_sum")
    # other estimators are left alone, silently
    ported, notes = port_values_with_notes({"algorithm": {"adv_estimator": "rloo"}})
    assert ported == {"algorithm": {"adv_estimator": "rloo"}} and notes == []


@pytest.mark.parametrize("algorithm,needle", [
    ({"adv_estimator": "gdpo", "multi_objective_aggregation": "sum_then_normalize"}, "gdpo means"),
    ({"gdpo_reward_keys": ["format", "accuracy"]}, "write each dimension as its own reward function"),
    ({"gdpo_reward_weights": [1.0, 2.0]}, r"functions\[i\]\.weight"),
])
def test_gdpo_values_grouprl_cannot_honour_are_refused(tmp_path, algorithm, needle):
    with pytest.raises(ConfigError, match=needle):
        config_from_dict({"trainer": {"output_dir": str(tmp_path)}, "algorithm": algorithm})


def test_verl_gdpo_keys_left_null_load(tmp_path):
    values = {"trainer": {"output_dir": str(tmp_path)},
              "algorithm": {"adv_estimator": "gdpo", "gdpo_reward_keys": None, "gdpo_reward_weights": None}}
    assert config_from_dict(values).algorithm.multi_objective_aggregation == "normalize_then_sum"


def test_trl_name_points_to_the_key():
    from grouprl.config.trl_names import TRL_NAMES

    assert any(e.trl == "multi_objective_aggregation" and e.key == "algorithm.multi_objective_aggregation"
               for e in TRL_NAMES)


# ---------------------------------------------------------------------------- a tiny run


@pytest.fixture(scope="module")
def two_rewards(say_task):
    return say_task(6)


def run_config(task, out: Path, **overrides) -> dict:
    return task.config(out, [{"name": "accuracy"}, {"name": "length", "weight": 0.5, "kwargs": {"target": 1}}], **{
        "worker.actor.global_batch_size": 4, "worker.actor.micro_batch_size_per_device_for_update": 4,
        "worker.actor.micro_batch_size_per_device_for_experience": 16, "trainer.seed": 3,
        "trainer.max_steps": 1, **overrides})


@pytest.mark.parametrize("overrides", [
    {},
    {"algorithm.overlong_buffer": {"enable": True, "length": 2}},
    {"algorithm.kl_coef": 0.05, "algorithm.use_kl_loss": False},
])
def test_tiny_run_trains_on_gdpo_advantages_and_logs_each_rewards(two_rewards, tmp_path, overrides):
    from grouprl.trainer.grpo import GRPOTrainer

    out = tmp_path / "run"
    config = run_config(two_rewards, out, **{"algorithm.multi_objective_aggregation": "normalize_then_sum",
                                             **overrides})
    trainer = GRPOTrainer(config_from_dict(config))
    before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters() if v.requires_grad}
    metrics = trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.named_parameters() if v.requires_grad)
    keys = ["accuracy", "length"] + (["overlong"] if overrides.get("algorithm.overlong_buffer") else [])
    keys += ["kl_penalty"] if "algorithm.kl_coef" in overrides else []
    for key in keys:
        for stat in ("mean", "std", "min", "max"):
            assert isinstance(metrics[f"advantages/{key}/{stat}"], float), (key, stat)
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    if "algorithm.kl_coef" in overrides:
        return  # the KL dimension is not in the records; its logging is checked above
    # the advantages trained on are GDPO's of the rewards recorded (weights 1 and 0.5, overlong 1)
    weights = {"accuracy": 1.0, "length": 0.5, "overlong": 1.0}
    scores = torch.tensor([[NAN if r["rewards"][k] is None else r["rewards"][k] for k in keys] for r in records],
                          dtype=torch.float64)
    expected, _ = normalize_then_sum(scores, [weights[k] for k in keys], [r["group"] for r in records])
    got = torch.tensor([r["advantage"] for r in records], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert float(expected.abs().max()) > 0.1


def test_sum_then_normalize_run_logs_each_rewards_advantages_too(two_rewards, tmp_path):
    from grouprl.trainer.grpo import GRPOTrainer

    out = tmp_path / "run"
    metrics = GRPOTrainer(config_from_dict(run_config(two_rewards, out))).train()
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    groups = [r["group"] for r in records]
    # the trained advantages are GRPO's of the weighted sum, as before GDPO existed ...
    total = torch.tensor([r["rewards"]["accuracy"] + 0.5 * r["rewards"]["length"] for r in records])
    torch.testing.assert_close(torch.tensor([r["advantage"] for r in records]),
                               compute_advantages("grpo", total, groups), rtol=0, atol=1e-5)
    # ... and each reward's own GRPO advantages are logged for diagnosis
    for key in ("accuracy", "length"):
        alone = compute_advantages("grpo", torch.tensor([float(r["rewards"][key]) for r in records]), groups)
        # StepMetrics.moments logs the population std
        stats = (("max", alone.max()), ("min", alone.min()), ("mean", alone.mean()), ("std", alone.std(correction=0)))
        for stat, value in stats:
            assert metrics[f"advantages/{key}/{stat}"] == pytest.approx(float(value), abs=1e-5), (key, stat)
    assert metrics["advantages/length/max"] > 0.1  # a reward with a spread: the check above is not 0 == 0
