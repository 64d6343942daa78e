"""Advantage estimators against hand-computed values."""

import math

import pytest
import torch

from grouprl.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages, register_advantage_estimator

# Three groups with arbitrary, interleaved ids: 7 -> rows 0, 1, 3 (scores 1, 0, 1);
# 3 -> rows 2, 4 (scores 0, 2); 42 -> row 5 alone (score 5).
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 5.0], dtype=torch.float64)
GROUPS = torch.tensor([7, 7, 3, 7, 3, 42])
# Group 7: mean 2/3, unbiased var (1/9 + 4/9 + 1/9) / 2 = 1/3, std 1/sqrt(3).
# Group 3: mean 1, unbiased var (1 + 1) / 1 = 2, std sqrt(2).
SQRT3 = math.sqrt(3.0)
SQRT2 = math.sqrt(2.0)


def close(actual, expected, atol=1e-9):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=atol, rtol=0), f"\n{actual}\n!=\n{expected}"


def test_grpo_hand_values():
    adv = compute_advantages("grpo", SCORES, GROUPS, eps=0.0)
    close(adv, [(1 / 3) * SQRT3, (-2 / 3) * SQRT3, -1 / SQRT2, (1 / 3) * SQRT3, 1 / SQRT2, 0.0])


def test_grpo_default_eps_is_small():
    adv = compute_advantages("grpo", SCORES, GROUPS)
    close(adv, [(1 / 3) / (1 / SQRT3 + 1e-6), (-2 / 3) / (1 / SQRT3 + 1e-6), -1 / (SQRT2 + 1e-6), (1 / 3) / (1 / SQRT3 + 1e-6), 1 / (SQRT2 + 1e-6), 0.0])


def test_grpo_without_std_normalisation_dr_grpo():
    adv = compute_advantages("grpo", SCORES, GROUPS, norm_by_std=False)
    close(adv, [1 / 3, -2 / 3, -1.0, 1 / 3, 1.0, 0.0])


def test_grpo_group_without_reward_spread_gets_zero():
    scores = torch.tensor([0.5, 0.5, 0.5, 1.0, 0.0])
    groups = torch.tensor([10, 10, 10, -4, -4])
    adv = compute_advantages("grpo", scores, groups)
    close(adv, [0.0, 0.0, 0.0, 0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)], atol=1e-6)


def test_grpo_broadcast_to_tokens_with_ragged_mask():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 1, 0]])
    adv = compute_advantages("grpo", SCORES, GROUPS, eps=0.0, response_mask=mask)
    a, b, c = (1 / 3) * SQRT3, (-2 / 3) * SQRT3, 1 / SQRT2
    close(adv, [[a, a, a], [b, b, 0], [-c, 0, 0], [a, a, a], [0, 0, 0], [0, 0, 0]])


def test_rloo_hand_values():
    # R_i minus the mean of the other responses of its group; the lone row 5 gets 0.
    adv = compute_advantages("rloo", SCORES, GROUPS)
    close(adv, [1 - 0.5, 0 - 1.0, 0 - 2.0, 1 - 0.5, 2 - 0.0, 0.0])


def test_grpo_passk_credits_only_the_best():
    scores = torch.tensor([3.0, 1.0, 0.0, 0.0, 2.0, 5.0], dtype=torch.float64)
    groups = torch.tensor([1, 1, 1, 8, 8, 0])
    # Group 1: [3, 1, 0], mean 4/3, var (25/9 + 1/9 + 16/9)/2 = 7/3; gap 3 - 1 = 2.
    # Group 8: [0, 2], std sqrt(2), gap 2. Group 0 has one response: 0.
    adv = compute_advantages("grpo_passk", scores, groups, eps=0.0)
    close(adv, [2 / math.sqrt(7 / 3), 0, 0, 0, 2 / SQRT2, 0])
    adv = compute_advantages("grpo_passk", scores, groups, norm_by_std=False)
    close(adv, [2.0, 0, 0, 0, 2.0, 0])


def test_grpo_passk_tie_gives_zero():
    # Group 7 has two responses at the top score 1: the gap is 0.
    adv = compute_advantages("grpo_passk", SCORES, GROUPS, eps=0.0)
    close(adv, [0, 0, 0, 0, 2 / SQRT2, 0])


def test_remax():
    scores = torch.tensor([1.0, 0.0, 2.0])
    adv = compute_advantages("remax", scores, torch.tensor([0, 0, 1]), baseline_scores=torch.tensor([0.5, 0.5, 3.0]))
    close(adv, [0.5, -0.5, -1.0])
    with pytest.raises(ValueError, match="baseline_scores"):
        compute_advantages("remax", scores, torch.tensor([0, 0, 1]))


def test_reinforce_plus_plus_outcome_only():
    scores = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # Returns: row 0 [1, 1, 1], row 1 [-1, -1, -]. Valid mean 1/5, deviations 0.8 (x3), -1.2 (x2),
    # unbiased var (3 * 0.64 + 2 * 1.44) / 4 = 1.2.
    adv = compute_advantages("reinforce_plus_plus", scores, torch.tensor([0, 0]), response_mask=mask, eps=0.0)
    s = math.sqrt(1.2)
    close(adv, [[0.8 / s, 0.8 / s, 0.8 / s], [-1.2 / s, -1.2 / s, 0.0]])


def test_reinforce_plus_plus_token_rewards_and_gamma():
    scores = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # The 7.0 sits on a masked token and must be ignored.
    token_rewards = torch.tensor([[0.5, 0.0, 0.0], [0.0, 0.25, 7.0]], dtype=torch.float64)
    # Rewards: row 0 [0.5, 0, 1]; row 1 [0, 0.25 - 1, -]. gamma 1/2:
    # G row 0 = [0.5 + 0.5 * 0.5, 0 + 0.5 * 1, 1] = [0.75, 0.5, 1]; row 1 = [0.5 * -0.75, -0.75] = [-0.375, -0.75].
    # Mean 1.125 / 5 = 0.225; deviations 0.525, 0.275, 0.775, -0.6, -0.975; var 2.2625 / 4 = 0.565625.
    adv = compute_advantages(
        "reinforce_plus_plus", scores, torch.tensor([3, 9]), response_mask=mask,
        token_rewards=token_rewards, gamma=0.5, eps=0.0,
    )
    s = math.sqrt(0.565625)
    close(adv, [[0.525 / s, 0.275 / s, 0.775 / s], [-0.6 / s, -0.975 / s, 0.0]])


def test_reinforce_plus_plus_baseline():
    scores = torch.tensor([1.0, 0.0, 3.0], dtype=torch.float64)
    groups = torch.tensor([4, 4, 9])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    # Group-centred: [0.5, -0.5, 0]; on tokens: 0.5 (x2), -0.5 (x3), 0 (x1). Mean -1/12;
    # deviations 7/12, -5/12, 1/12; var (2*49 + 3*25 + 1) / 144 / 5 = 29/120.
    adv = compute_advantages("reinforce_plus_plus_baseline", scores, groups, response_mask=mask, eps=0.0)
    s = math.sqrt(29 / 120)
    close(adv, [[7 / 12 / s, 7 / 12 / s, 0], [-5 / 12 / s] * 3, [1 / 12 / s, 0, 0]])


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_token_level_estimators_need_response_mask(name):
    with pytest.raises(ValueError, match="response_mask"):
        compute_advantages(name, SCORES, GROUPS)


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="valid names") as info:
        compute_advantages("grpoo", SCORES, GROUPS)
    for name in ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "grpo_passk"):
        assert name in str(info.value)


def test_unknown_option_is_named():
    with pytest.raises(TypeError, match="gamma"):
        compute_advantages("grpo", SCORES, GROUPS, gamma=0.9)
    with pytest.raises(TypeError, match="norm_by_std"):
        compute_advantages("rloo", SCORES, GROUPS, norm_by_std=False)


def test_integer_scores_are_accepted():
    adv = compute_advantages("rloo", torch.tensor([1, 0, 1, 1]), torch.tensor([0, 0, 1, 1]))
    close(adv, [1.0, -1.0, 0.0, 0.0])


def test_register_custom_estimator():
    @register_advantage_estimator("test_doubled")
    def doubled(scores, group_index, *, factor=2.0):
        return scores * factor

    try:
        mask = torch.tensor([[1, 0], [1, 1]])
        adv = compute_advantages("test_doubled", torch.tensor([1.0, 3.0]), torch.tensor([0, 1]), response_mask=mask, factor=3.0)
        close(adv, [[3.0, 0.0], [9.0, 9.0]])
        register_advantage_estimator("test_doubled")(doubled)  # the same function again: a module run twice

        def tripled(scores, group_index):
            return scores * 3

        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_doubled")(tripled)
        register_advantage_estimator("test_doubled", overwrite=True)(tripled)
        close(compute_advantages("test_doubled", torch.tensor([1.0]), torch.tensor([0])), [3.0])
    finally:
        del ADVANTAGE_ESTIMATORS["test_doubled"]


def test_reinforce_plus_plus_discounts_over_valid_tokens_only():
    # Row 0 has a hole at position 1 (e.g. template tokens between two turns); the 9.0 there is dropped.
    scores = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])
    token_rewards = torch.tensor([[0.5, 9.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    # Valid steps of row 0 are t = 0, 2, 3 with rewards 0.5, 0, 1; gamma 1/2 once per valid step:
    # G3 = 1, G2 = 0 + 0.5 * 1 = 0.5, G0 = 0.5 + 0.5 * 0.5 = 0.75 (the hole is not a step).
    # Row 1: G1 = -1, G0 = -0.5. Valid returns [0.75, 0.5, 1, -0.5, -1]: mean 0.15,
    # deviations 0.6, 0.35, 0.85, -0.65, -1.15, unbiased var 2.95 / 4.
    adv = compute_advantages(
        "reinforce_plus_plus", scores, torch.tensor([0, 1]), response_mask=mask,
        token_rewards=token_rewards, gamma=0.5, eps=0.0,
    )
    s = math.sqrt(2.95 / 4)
    close(adv, [[0.6 / s, 0.0, 0.35 / s, 0.85 / s], [-0.65 / s, -1.15 / s, 0.0, 0.0]])


def test_reinforce_plus_plus_hole_equals_the_row_without_it():
    # Removing the masked columns of a row must not change its valid tokens' advantages.
    generator = torch.Generator().manual_seed(0)
    token_rewards = torch.randn(2, 6, generator=generator, dtype=torch.float64)
    scores = torch.tensor([0.3, -1.2], dtype=torch.float64)
    holed = torch.tensor([[1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    packed = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]])
    packed_rewards = token_rewards.clone()
    packed_rewards[0, :3] = token_rewards[0, [0, 3, 4]]
    options = {"gamma": 0.8, "eps": 0.0}
    a = compute_advantages("reinforce_plus_plus", scores, [0, 1], response_mask=holed, token_rewards=token_rewards, **options)
    b = compute_advantages("reinforce_plus_plus", scores, [0, 1], response_mask=packed, token_rewards=packed_rewards, **options)
    close(a[0, [0, 3, 4]], b[0, :3])
    close(a[1], b[1])
    assert torch.all(a[holed == 0] == 0)


def test_reinforce_plus_plus_gamma_one_with_hole_is_unchanged():
    # gamma = 1: whether the hole is a step or not makes no difference (same as before the
    # valid-tokens-only discounting). Row 0 returns [1.5, -, 1, 1]; row 1 [-1, -1].
    scores = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])
    token_rewards = torch.tensor([[0.5, 9.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    adv = compute_advantages("reinforce_plus_plus", scores, [0, 1], response_mask=mask, token_rewards=token_rewards, eps=0.0)
    # Mean 1.5 / 5 = 0.3; deviations 1.2, 0.7, 0.7, -1.3, -1.3; var (1.44 + 0.98 + 3.38) / 4 = 1.45.
    s = math.sqrt(1.45)
    close(adv, [[1.2 / s, 0.0, 0.7 / s, 0.7 / s], [-1.3 / s, -1.3 / s, 0.0, 0.0]])


def test_grpo_batch_std_level_trl_scale_rewards_batch():
    # TRL's scale_rewards="batch": (R_i - mean_g) / std over the whole batch's raw rewards.
    # Batch mean 9/6 = 1.5; squared deviations .25 + 2.25 + 2.25 + .25 + .25 + 12.25 = 17.5;
    # unbiased var 17.5 / 5 = 3.5.
    adv = compute_advantages("grpo", SCORES, GROUPS, std_level="batch", eps=0.0)
    s = math.sqrt(3.5)
    close(adv, [(1 / 3) / s, (-2 / 3) / s, -1 / s, (1 / 3) / s, 1 / s, 0.0])
    # a std computed over more rows (the other processes') is used as given
    close(compute_advantages("grpo", SCORES, GROUPS, std_level="batch", batch_std=2.0, eps=0.0),
          [1 / 6, -1 / 3, -0.5, 1 / 6, 0.5, 0.0])
    # the other levels agree with the older switch
    close(compute_advantages("grpo", SCORES, GROUPS, std_level="none"),
          compute_advantages("grpo", SCORES, GROUPS, norm_by_std=False))
    close(compute_advantages("grpo", SCORES, GROUPS, std_level="group", norm_by_std=False),
          compute_advantages("grpo", SCORES, GROUPS))
    with pytest.raises(ValueError, match="std_level='global'"):
        compute_advantages("grpo", SCORES, GROUPS, std_level="global")


def test_trainer_passes_the_configured_std_level():
    from types import SimpleNamespace

    from grouprl.config import load_config
    from grouprl.config.algorithm_options import resolve_options
    from grouprl.trainer.grpo import GRPOTrainer
    from grouprl.trainer.metrics import StepMetrics

    def advantages(*overrides):
        config = load_config(None, list(overrides))
        trainer = SimpleNamespace(config=config, accelerator=SimpleNamespace(num_processes=1),
                                  estimator_options=resolve_options(config, "adv_estimator"),
                                  rewards=SimpleNamespace(weights={"r": 1.0}))
        trainer._batch_std = GRPOTrainer._batch_std.__get__(trainer)
        batch = SimpleNamespace(loss_mask=torch.ones(6, 2), group_index=GROUPS, scores=SCORES,
                                reward_components={"r": SCORES.tolist()})
        return GRPOTrainer._advantages(trainer, SCORES, batch, None, StepMetrics())[:, 0]

    close(advantages("algorithm.adv_std_level=batch"),
          compute_advantages("grpo", SCORES, GROUPS, std_level="batch"))
    close(advantages("algorithm.norm_adv_by_std_in_grpo=false"), [1 / 3, -2 / 3, -1.0, 1 / 3, 1.0, 0.0])
    close(advantages(), compute_advantages("grpo", SCORES, GROUPS))
    # the estimator's own options key, over the older one
    close(advantages("algorithm.adv_estimator_options={std_level: batch}"),
          compute_advantages("grpo", SCORES, GROUPS, std_level="batch"))
    close(advantages("algorithm.adv_std_level=batch", "algorithm.adv_estimator_options={std_level: none}"),
          [1 / 3, -2 / 3, -1.0, 1 / 3, 1.0, 0.0])


def _batch_std_on_rank(rank, port, shards, out):
    from types import SimpleNamespace

    from grouprl.trainer.grpo import GRPOTrainer

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        trainer = SimpleNamespace(accelerator=SimpleNamespace(num_processes=2, device=torch.device("cpu")))
        out[rank] = GRPOTrainer._batch_std(trainer, torch.tensor(shards[rank]))
    finally:
        torch.distributed.destroy_process_group()


def test_batch_std_spans_every_process():
    # scale_rewards=batch in TRL takes the std over the gathered batch; so does grouprl across processes
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shards = [[1.0, 0.0, 0.0], [1.0, 2.0, 5.0]]
    out = mp.Manager().dict()
    mp.spawn(_batch_std_on_rank, args=(port, shards, out), nprocs=2, join=True)
    assert out[0] == out[1] == pytest.approx(math.sqrt(3.5), abs=1e-12)  # SCORES' batch std, by hand above
