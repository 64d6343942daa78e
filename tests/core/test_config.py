import pytest
import yaml

from grouprl.config import ConfigError, config_from_dict, load_config, parse_overrides, save_config


def write(tmp_path, data, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_and_yaml_and_overrides(tmp_path):
    path = write(tmp_path, {"worker": {"rollout": {"n": 8}, "actor": {"optim": {"lr": "1e-6"}}},
                            "algorithm": {"loss_agg_mode": "seq-mean-token-sum-norm"}})
    cfg = load_config(path, ["worker.rollout.n=5", "algorithm.norm_adv_by_std_in_grpo=false",
                             "data.train_files=a.jsonl,b.jsonl", "trainer.save_checkpoint_path=/tmp/ck"])
    assert cfg.worker.rollout.n == 5  # the command line wins over the file
    assert cfg.worker.actor.optim.lr == 1e-6  # YAML's "1e-6" string is read as a number
    assert cfg.algorithm.loss_agg_mode == "seq-mean-token-sum-norm"
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert str(cfg.checkpoint_dir) == "/tmp/ck"
    assert cfg.worker.actor.clip_ratio_high == 0.3  # untouched default


def test_unknown_key_names_key_and_nearest(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["worker.rollout.nn=5"])
    msg = str(exc.value)
    assert "worker.rollout.nn" in msg and "worker.rollout.n" in msg
    # right leaf under the wrong section
    with pytest.raises(ConfigError, match=r"algorithm\.lr.*worker\.actor\.optim\.lr"):
        load_config(None, ["algorithm.lr=1e-5"])
    with pytest.raises(ConfigError, match="unknown config key 'trainr'"):
        load_config(write(tmp_path, {"trainr": {"seed": 1}}))


@pytest.mark.parametrize("override, needle", [
    ("worker.rollout.n=five", "worker.rollout.n' expects an integer"),
    ("worker.rollout.n=0", "worker.rollout.n' must be > 0"),
    ("algorithm.norm_adv_by_std_in_grpo=maybe", "expects true or false"),
    ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator' accepts one of"),
    ("algorithm.loss_agg_mode=mean", "loss_agg_mode' accepts one of"),
    ("algorithm.kl_penalty=k9", "kl_penalty' accepts one of"),
    ("worker.actor.model.dtype=fp8", "accepts one of float32, bfloat16"),
    ("worker.rollout.top_p=1.5", "top_p' must be in (0, 1]"),
    ("trainer.logger=[console,swanlab]", "trainer.logger"),
    ("worker.actor=3", "is a section"),
    ("data.rollout_batch_size=6", "multiple of"),
])
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    assert needle in str(exc.value)


def test_reward_function_forms():
    cfg = load_config(None, ["worker.reward.functions=[{name: format, weight: 0.1}, {name: accuracy}]"])
    assert [(f.name, f.weight) for f in cfg.worker.reward.functions] == [("format", 0.1), ("accuracy", 1.0)]
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, ["worker.reward.functions=[{name: format}]", "worker.reward.reward_function=r.py:f"])
    with pytest.raises(ConfigError, match=r"functions\[0\]\.wieght"):
        load_config(None, ["worker.reward.functions=[{name: format, wieght: 1}]"])


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="not of the form key=value"):
        parse_overrides(["worker.rollout.n"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/config.yaml")


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["worker.rollout.n=3", "trainer.experiment_name=x"])
    save_config(cfg, tmp_path / "out" / "config.yaml")
    again = load_config(tmp_path / "out" / "config.yaml")
    assert again == cfg


def test_secrets_never_reach_the_saved_config(tmp_path):
    from grouprl.config import redacted

    config = config_from_dict({"worker": {"rollout": {"verifier": {"api_key": "sk-very-secret"}}}})
    save_config(config, tmp_path / "config.yaml")
    assert "sk-very-secret" not in (tmp_path / "config.yaml").read_text()
    assert redacted(config)["worker"]["rollout"]["verifier"]["api_key"] is None
    assert config.worker.rollout.verifier.api_key == "sk-very-secret"  # the run itself still has it


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "grpo_passk", "reinforce_plus_plus_baseline"])
def test_a_group_of_one_is_refused_for_group_relative_estimators(tmp_path, estimator):
    """n=1 with an estimator whose baseline is the group: every advantage 0, a run that trains nothing."""
    path = tmp_path / "c.yaml"
    path.write_text("worker:\n  rollout:\n    n: 1\n")
    with pytest.raises(ConfigError, match=r"'worker.rollout.n' is 1.*" + estimator):
        load_config(path, [f"algorithm.adv_estimator={estimator}"])
    # estimators with a baseline of their own take one response per prompt
    assert load_config(path, ["algorithm.adv_estimator=reinforce_plus_plus"]).worker.rollout.n == 1


def test_every_unknown_key_is_reported_in_one_message(tmp_path):
    path = write(tmp_path, {"trainr": {"seed": 1}, "worker": {"rollout": {"nn": 5, "temperature": 1.0},
                                                              "actor": {"optim": {"lrr": 1e-6}}},
                            "algorithm": {"lr": 1e-5, "kl_coef": "high"}})  # a bad value too
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert msg.startswith("unknown config keys: ") and "\n" not in msg
    for key in ("'trainr'", "'worker.rollout.nn'", "'worker.actor.optim.lrr'", "'algorithm.lr'"):
        assert f"{key} in {path}, line " in msg  # each key says where it is
    assert msg.count("(did you mean") == 4
    assert "worker.actor.optim.lr" in msg.split("'algorithm.lr'")[1]  # each key keeps its own suggestions


def test_adv_std_level_selects_the_std_and_keeps_the_old_key():
    assert load_config(None, []).algorithm.std_level == "group"
    assert load_config(None, ["algorithm.norm_adv_by_std_in_grpo=false"]).algorithm.std_level == "none"
    assert load_config(None, ["algorithm.adv_std_level=batch"]).algorithm.std_level == "batch"
    assert load_config(None, ["algorithm.adv_std_level=none"]).algorithm.std_level == "none"
    with pytest.raises(ConfigError, match="adv_std_level' accepts one of group, batch, none"):
        load_config(None, ["algorithm.adv_std_level=global"])
    with pytest.raises(ConfigError, match="norm_adv_by_std_in_grpo' is false"):
        load_config(None, ["algorithm.adv_std_level=batch", "algorithm.norm_adv_by_std_in_grpo=false"])
    with pytest.raises(ConfigError, match="batch is for adv_estimator grpo"):
        load_config(None, ["algorithm.adv_std_level=batch", "algorithm.adv_estimator=rloo"])
