"""Algorithm options owned by the algorithms: each estimator and loss declares its options class, the config
validates ``algorithm.adv_estimator_options`` / ``policy_loss_options`` by those names, and the older keys
(EasyR1's clip ratios, worker.actor.gspo, adv_std_level, gamma) still set the same options."""

from __future__ import annotations

import pytest

from grouprl.config import ConfigError, load_config
from grouprl.config.algorithm_options import OPTION_KEYS, resolve_options


def options(family, *overrides):
    return resolve_options(load_config(None, list(overrides)), family)


def test_defaults_are_the_older_keys_defaults():
    assert options("policy_loss") == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3, "clip_ratio_dual": 3.0}
    assert options("adv_estimator") == {"std_level": "group", "eps": 1e-6}
    assert options("policy_loss", "algorithm.policy_loss=gspo") == {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
    assert options("policy_loss", "algorithm.policy_loss=sapo") == {"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05}
    assert options("adv_estimator", "algorithm.adv_estimator=rloo") == {}


def test_older_keys_set_the_algorithms_options():
    assert options("policy_loss", "worker.actor.clip_ratio_high=0.28")["clip_ratio_high"] == 0.28
    assert options("policy_loss", "algorithm.policy_loss=gspo", "worker.actor.gspo.clip_ratio_high=5e-4") == \
        {"clip_ratio_low": 3e-4, "clip_ratio_high": 5e-4}
    assert options("policy_loss", "algorithm.policy_loss=sapo", "worker.actor.sapo.tau_neg=2.0")["sapo_tau_neg"] == 2.0
    assert options("adv_estimator", "algorithm.norm_adv_by_std_in_grpo=false")["std_level"] == "none"
    assert options("adv_estimator", "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.9") == \
        {"gamma": 0.9, "eps": 1e-6}
    assert options("adv_estimator", "algorithm.adv_estimator=grpo_passk", "algorithm.adv_std_level=none") == \
        {"norm_by_std": False, "eps": 1e-6}


def test_the_options_mapping_overrides_the_older_keys():
    got = options("policy_loss", "worker.actor.clip_ratio_high=0.28", "algorithm.policy_loss_options={clip_ratio_high: 0.4}")
    assert got["clip_ratio_high"] == 0.4
    assert options("adv_estimator", "algorithm.adv_estimator_options={std_level: batch, eps: 1e-4}") == \
        {"std_level": "batch", "eps": 1e-4}


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.policy_loss=sapo", "algorithm.policy_loss_options={clip_ratio_low: 0.1}"],
     "config key 'algorithm.policy_loss_options.clip_ratio_low': policy loss 'sapo' takes no option 'clip_ratio_low' "
     "(its options are sapo_tau_pos, sapo_tau_neg)"),
    (["algorithm.policy_loss_options={clip_ratio_hgh: 0.1}"], "did you mean 'clip_ratio_high'"),
    (["algorithm.adv_estimator=rloo", "algorithm.adv_estimator_options={eps: 0.1}"],
     "advantage estimator 'rloo' takes no option 'eps' (it takes no options)"),
    (["algorithm.policy_loss_options={clip_ratio_high: high}"],
     "config key 'algorithm.policy_loss_options.clip_ratio_high' expects a number"),
    (["algorithm.adv_estimator_options={std_level: global}"], "std_level' accepts one of group, batch, none"),
    (["algorithm.policy_loss_options={clip_ratio_low: null}"],
     "config key 'algorithm.policy_loss_options.clip_ratio_low' expects a number, got None"),
])
def test_bad_options_name_the_option_and_the_algorithm(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_every_older_key_names_an_option_of_its_algorithm():
    from grouprl import algorithms
    from grouprl.algorithms.options import option_names

    for (family, name), keys in OPTION_KEYS.items():
        cls = (algorithms.policy_loss_options_class if family == "policy_loss"
               else algorithms.advantage_estimator_options_class)(name)
        assert set(keys) <= set(option_names(cls)), (family, name)


def test_the_documented_new_loss_runs_as_written():
    """docs/training.md's example of a new loss: executed as written, then used by name with its option."""
    import re
    from pathlib import Path

    import torch

    from grouprl.algorithms import POLICY_LOSS_OPTIONS, POLICY_LOSSES, compute_policy_loss

    text = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    section = text[text.index("## Algorithm options"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    try:
        exec(compile(code, "docs/training.md", "exec"), {})
        log_prob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        adv = torch.tensor([[1.0, -1.0]])
        loss, _ = compute_policy_loss("scaled_pg", log_prob, log_prob.detach(), adv, torch.ones(1, 2), scale=2.0)
        assert torch.allclose(loss, torch.tensor(-2.0 * (-1.0 + 2.0) / 2))
        got = options("policy_loss", "algorithm.policy_loss=scaled_pg", "algorithm.policy_loss_options={scale: 2.0}")
        assert got == {"scale": 2.0}
    finally:
        POLICY_LOSSES.pop("scaled_pg", None)
        POLICY_LOSS_OPTIONS.pop("scaled_pg", None)


def test_gmpo_takes_its_clip_range_from_its_options_and_checks_it():
    assert options("policy_loss", "algorithm.policy_loss=geo_mean") == {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}
    # the options class checks its values: GMPO's bounds are log-space widths, > 0
    with pytest.raises(ConfigError, match="algorithm.policy_loss_options': policy loss 'geo_mean': clip_ratio_low "
                                          "must be > 0"):
        load_config(None, ["algorithm.policy_loss=geo_mean", "algorithm.policy_loss_options={clip_ratio_low: 0}"])


def test_off_policy_masking_with_verls_bypass_mode_is_refused():
    with pytest.raises(ConfigError, match="off_policy_sequence_masking.delta': .*bypass_mode"):
        load_config(None, ["algorithm.off_policy_sequence_masking.delta=0.5",
                           "algorithm.rollout_correction.preset=bypass_ppo_clip"])


def test_grpo_asks_for_the_cross_process_batch_std_only_at_std_level_batch():
    """The batch std is a collective on every step: the estimator's options say when it is needed."""
    from grouprl.algorithms import estimator_inputs

    assert "batch_std" in estimator_inputs("grpo")  # declared
    assert "batch_std" not in estimator_inputs("grpo", options("adv_estimator"))  # group: not needed
    assert "batch_std" in estimator_inputs("grpo", options("adv_estimator", "algorithm.adv_std_level=batch"))
    assert estimator_inputs("rloo", {}) == {"scores", "group_index"}
