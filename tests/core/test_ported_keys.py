"""Configs that port: EasyR1's example config (today's and the pre-0.3 one older seeds were written
with) loads with each foreign key mapped or noted, values grouprl cannot honour are refused, and
grouprl's own recipes need no porting."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from grouprl.config import ConfigError, all_keys, load_config, read_config_values
from grouprl.config.ported_keys import PORTED_KEYS, PORTED_VALUES, port_values_with_notes

HERE = Path(__file__).resolve().parent
EASYR1 = HERE / "configs" / "easyr1_config.yaml"
EASYR1_V02 = HERE / "configs" / "easyr1_config_v0.2.yaml"
EXAMPLES = HERE.parents[1] / "examples"
# EasyR1's one strategy is FSDP, and its examples offload the actor (worker.actor.offload), which grouprl
# does through FSDP2: they load with grouprl's strategy set to fsdp (without it: tests/core/test_offload.py)
AS_EASYR1 = ["worker.actor.strategy=fsdp"]


def _notes(path, overrides=()):
    return port_values_with_notes(read_config_values(path, list(overrides)))[1]


def _noted_keys(notes):
    return {n.split()[2].split("=")[0] for n in notes}


@pytest.fixture(autouse=True)
def wandb_installed(tmp_path, monkeypatch):
    """EasyR1's examples log to wandb, which its users have installed: a stand-in package, found by
    the config check that wandb can be imported (the check itself is tested in test_cli_errors.py)."""
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_easyr1_example_loads_as_shipped_with_its_prompt_template():
    # format_prompt rewrites every prompt (math.jinja asks for \boxed{} answers the reward reads):
    # it is kept, and read when the data is (tests/core/test_data.py renders EasyR1's math.jinja)
    cfg = load_config(EASYR1, AS_EASYR1)
    assert cfg.data.format_prompt == "./examples/format_prompt/math.jinja"


def test_easyr1_example_loads_with_mapped_values_and_notes(caplog):
    with caplog.at_level(logging.WARNING, logger="grouprl.config.ported_keys"):
        cfg = load_config(EASYR1, AS_EASYR1)
    # mapped onto grouprl's keys
    assert cfg.trainer.resume == "auto"  # find_last_checkpoint: true, no load_checkpoint_path
    assert cfg.trainer.logger == ["jsonl", "wandb"]  # EasyR1's "file" logger
    assert cfg.worker.rollout.val_temperature == 0.6 and cfg.worker.rollout.val_n == 1  # val_override_config
    assert cfg.worker.rollout.val_top_p == 0.95 and cfg.worker.rollout.top_p == 1.0
    assert cfg.algorithm.max_filter_rounds == 19  # max_try_make_batch 20 rounds = 1 + 19 more
    assert cfg.algorithm.kl_coef == 1e-2 and cfg.algorithm.use_kl_loss  # disable_kl: false
    # keys both have, as written
    assert cfg.data.train_files == ["hiyouga/math12k@train"] and cfg.data.prompt_key == "problem"
    assert cfg.data.max_prompt_length == 2048 and cfg.data.rollout_batch_size == 512
    assert cfg.worker.actor.global_batch_size == 128 and cfg.worker.rollout.tensor_parallel_size == 2
    assert cfg.worker.actor.padding_free and cfg.worker.actor.dynamic_batching  # EasyR1's keys, grouprl's too
    assert cfg.worker.actor.model.lora.target_modules == ["all-linear"] and cfg.worker.actor.model.lora.alpha == 64
    assert cfg.worker.reward.reward_function == "./examples/reward_function/math.py:compute_score"
    # online filtering's keys are grouprl's too (read when algorithm.online_filtering is on)
    assert cfg.algorithm.mean_filter == ("overall", 0.01, 0.99) and not cfg.algorithm.online_filtering
    assert load_config(EASYR1, [*AS_EASYR1, "algorithm.online_filtering=true"]).algorithm.online_filtering
    assert cfg.trainer.total_epochs == 15 and cfg.trainer.save_limit == 3
    # its offload keys are grouprl's; the reference's FSDP offload reads as grouprl's reference offload
    assert cfg.worker.actor.offload.offload_params and cfg.worker.actor.offload.offload_optimizer
    assert cfg.worker.ref.offload.offload_params
    # every foreign key said something, one line each, on the logger
    logged = [r.getMessage() for r in caplog.records]
    assert all("\n" not in line and line.startswith("grouprl: config key ") for line in logged)
    noted = _noted_keys(line.removeprefix("grouprl: ") for line in logged)
    assert {"data.filter_overlong_prompts", "algorithm.disable_kl", "worker.actor.ulysses_size", "worker.actor.fsdp", "worker.ref.fsdp",
            "worker.ref.fsdp.enable_cpu_offload", "worker.rollout.val_override_config", "trainer.n_gpus_per_node",
            "trainer.nnodes", "trainer.load_checkpoint_path", "trainer.find_last_checkpoint",
            "trainer.logger", "trainer.max_try_make_batch", "trainer.save_model_only"} <= noted
    assert not {"algorithm.filter_key", "algorithm.filter_low", "algorithm.filter_high"} & noted
    assert any("trainer.n_gpus_per_node=8" in line and "torchrun" in line for line in logged)


def test_easyr1_before_0_3_loads_once_its_builtin_scorer_is_replaced():
    with pytest.raises(ConfigError) as exc:
        load_config(EASYR1_V02)
    msg = str(exc.value)
    assert "worker.reward.compute_score" in msg
    assert "entropy_coeff" not in msg  # its entropy bonus is grouprl's worker.actor.entropy_coeff
    cfg = load_config(EASYR1_V02, [*AS_EASYR1, "worker.reward.compute_score=null",
                                   "worker.reward.reward_function=math.py:compute_score"])
    assert cfg.worker.actor.entropy_coeff == 1e-3
    assert cfg.trainer.total_epochs == 15  # total_episodes
    # the KL loss's own coefficient wins over the in-reward algorithm.kl_coef: 0.0 of that version
    assert cfg.algorithm.use_kl_loss and cfg.algorithm.kl_coef == 1e-2 and cfg.algorithm.kl_penalty == "low_var_kl"
    # reward_type: function (one response a call, that version's only kind) is a key grouprl reads
    assert cfg.worker.reward.reward_type == "function"
    notes = _notes(EASYR1_V02, ["worker.reward.compute_score=null"])
    assert {"worker.actor.ulysses_sequence_parallel_size", "trainer.total_episodes",
            "trainer.remove_previous_ckpt"} <= _noted_keys(notes)
    assert "worker.reward.reward_type" not in _noted_keys(notes)


@pytest.mark.parametrize("override, needle", [
    ("worker.actor.ulysses_size=2", "no sequence parallelism"),
    ("worker.actor.ulysses_sequence_parallel_size=4", "no sequence parallelism"),
    ("algorithm.kl_type=adaptive", "fixed KL coefficient"),
    ("worker.rollout.ignore_eos=true", "end at EOS"),
    ("data.override_chat_template=t.jinja", "chat template"),
    ("worker.actor.model.override_config={attn_implementation: eager}", "config.json"),
    ("worker.reward.score_function=math", "built-in scorer 'math'"),
    ("worker.actor.loss_type=ppo2", "accepts one of default"),
    ("trainer.max_try_make_batch=-1", "bounds the generation rounds"),
])
def test_values_grouprl_cannot_honour_are_refused(override, needle):
    extra = ["algorithm.online_filtering=true"] if "max_try" in override else []
    with pytest.raises(ConfigError, match="cannot honour") as exc:
        load_config(None, [override, *extra])
    assert needle in str(exc.value) and override.split("=")[0] in str(exc.value)


def test_mapped_keys(tmp_path):
    cfg = load_config(None, ["algorithm.disable_kl=true", "algorithm.kl_coef=0.05"])
    assert cfg.algorithm.kl_coef == 0.0  # EasyR1: disable_kl wins over kl_coef
    assert load_config(None, ["algorithm.disable_kl=false", "algorithm.kl_coef=0.05"]).algorithm.kl_coef == 0.05
    (tmp_path / "global_step_5").mkdir()
    cfg = load_config(None, [f"trainer.load_checkpoint_path={tmp_path / 'global_step_5'}",
                             "trainer.find_last_checkpoint=true"])
    assert cfg.trainer.resume == str(tmp_path / "global_step_5")  # the path wins, as in EasyR1
    assert load_config(None, ["trainer.find_last_checkpoint=false"]).trainer.resume is None
    assert load_config(None, ["trainer.total_episodes=3"]).trainer.total_epochs == 3
    cfg = load_config(None, ["worker.reward.score_function=./math.py:compute_score",
                             "worker.reward.score_function_kwargs={w: 1}"])
    assert cfg.worker.reward.reward_function == "./math.py:compute_score"
    assert cfg.worker.reward.reward_function_kwargs == {"w": 1}
    cfg = load_config(None, ["worker.actor.loss_avg_mode=seq", "worker.actor.loss_type=gspo",
                             "worker.actor.tau_positive=0.9", "worker.rollout.name=hf"])
    assert cfg.algorithm.loss_agg_mode == "seq-mean-token-mean" and cfg.algorithm.policy_loss == "gspo"
    assert cfg.worker.actor.sapo.tau_pos == 0.9 and cfg.worker.rollout.engine == "hf"
    assert load_config(None, ["worker.actor.optim.min_lr_ratio=null"]).worker.actor.optim.min_lr_ratio == 0.0


def test_a_mapped_key_and_its_grouprl_key_that_disagree_are_an_error():
    with pytest.raises(ConfigError, match=r"trainer\.total_episodes.*trainer\.total_epochs is set to 5"):
        load_config(None, ["trainer.total_episodes=3", "trainer.total_epochs=5"])
    assert load_config(None, ["trainer.total_episodes=3", "trainer.total_epochs=3"]).trainer.total_epochs == 3


def test_noted_keys_are_never_silent():
    values = {"trainer": {"n_gpus_per_node": 8, "nnodes": 2}, "worker": {"actor": {"use_torch_compile": True}}}
    ported, notes = port_values_with_notes(values)
    assert ported == {"trainer": {}, "worker": {"actor": {}}}
    assert values["trainer"]["n_gpus_per_node"] == 8  # the caller's values are left alone
    assert any(n.startswith("config key trainer.n_gpus_per_node=8: accepted, not used: grouprl takes the "
                            "process count from the launcher") for n in notes)
    assert _noted_keys(notes) == {"trainer.n_gpus_per_node", "trainer.nnodes", "worker.actor.use_torch_compile"}


def test_the_table_maps_only_onto_grouprl_keys():
    grouprl_keys = set(all_keys())
    for entry in PORTED_KEYS:
        assert entry.key not in grouprl_keys, f"{entry.key} is grouprl's own key: it belongs in PORTED_VALUES"
        assert entry.easyr1 and entry.grouprl
    for entry in PORTED_VALUES:
        assert entry.key in grouprl_keys
    assert len({e.key for e in PORTED_KEYS}) == len(PORTED_KEYS)


def _recipes():
    for path in sorted(EXAMPLES.glob("*.yaml")):
        if (yaml.safe_load(path.read_text()) or {}).get("kind") in (None, "grpo"):
            yield path


@pytest.mark.parametrize("recipe", [p.name for p in _recipes()])
def test_the_seed_recipes_need_no_porting(recipe):
    ported, notes = port_values_with_notes(read_config_values(EXAMPLES / recipe))
    assert notes == []
    assert ported == read_config_values(EXAMPLES / recipe)
    load_config(EXAMPLES / recipe)
