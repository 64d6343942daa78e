"""Where a wrong key points: TRL's and EasyR1's names lead to grouprl's key before any spelling
match, and a key or value that is wrong says where it was set (the file and line, or the command line)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from grouprl.config import ConfigError, all_keys, load_config, read_config_values
from grouprl.config.trl_names import TRL_NAMES, markdown_table


def error(overrides=(), path=None) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(path, list(overrides))
    return str(exc.value)


@pytest.mark.parametrize("name, key, not_meant", [
    ("num_generations", "worker.rollout.n", "val_generations_to_log"),
    ("beta", "algorithm.kl_coef", "did you mean"),
    ("trainer.num_generations", "worker.rollout.n", "val_generations_to_log"),  # dotted, under a wrong section
    ("learning_rate", "worker.actor.optim.lr", "did you mean"),
    ("loss_type", "algorithm.loss_agg_mode", "did you mean"),
])
def test_trl_names_point_to_the_grouprl_key_before_spelling(name, key, not_meant):
    msg = error([f"{name}=1"])
    assert msg.startswith(f"unknown config key '{name}' from the command line (TRL's GRPOConfig name: use {key}")
    assert not_meant not in msg


def test_easyr1_keys_in_the_wrong_place_name_easyr1s_key():
    msg = error(["find_last_checkpoint=true"])
    assert "(EasyR1's trainer.find_last_checkpoint: trainer.resume: auto" in msg
    msg = error(["actor.loss_avg_mode=token"])  # the unknown key is the section actor, not its leaf
    assert "did you mean worker.actor" in msg


def test_several_unknown_keys_each_get_their_port_hint():
    msg = error(["num_generations=4", "beta=0.1", "worker.rollout.nn=3"])
    assert msg.startswith("unknown config keys: ") and "\n" not in msg
    assert "'num_generations' from the command line (TRL's GRPOConfig name: use worker.rollout.n)" in msg
    assert "'beta' from the command line (TRL's GRPOConfig name: use algorithm.kl_coef" in msg
    assert "'worker.rollout.nn' from the command line (did you mean worker.rollout.n" in msg


def test_the_trl_table_names_real_trl_fields_and_grouprl_keys():
    trl = pytest.importorskip("trl")
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    keys = set(all_keys())
    for entry in TRL_NAMES:
        assert entry.trl in fields, f"{entry.trl} is not a field of TRL {trl.__version__}'s GRPOConfig"
        assert entry.key in keys, f"{entry.key} ({entry.trl}) is not a grouprl key"
    table = markdown_table()
    assert all(f"| `{e.trl}` | `{e.key}` |" in table for e in TRL_NAMES)


def test_the_docs_trl_table_is_the_codes():
    """docs/training.md shows the table the errors read, not a second copy that can drift."""
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    assert markdown_table().strip() in docs


def write(tmp_path, text: str, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


CONFIG = """\
data:
  train_files: [a.jsonl]
worker:
  rollout:
    n: five
    num_generations: 4
trainer:
  max_steps: 3
"""


def test_an_unknown_key_from_a_file_names_the_file_and_line(tmp_path):
    path = write(tmp_path, CONFIG)
    msg = error(path=path)
    assert msg.startswith(f"unknown config key 'worker.rollout.num_generations' in {path}, line 6 "
                          "(TRL's GRPOConfig name: use worker.rollout.n)")


def test_a_bad_value_names_where_it_was_set(tmp_path):
    path = write(tmp_path, CONFIG.replace("    num_generations: 4\n", ""))
    assert error(path=path) == f"config key 'worker.rollout.n' expects an integer, got 'five' (in {path}, line 5)"
    # an override replaces the file's value: the command line is where to fix it
    msg = error(["worker.rollout.n=six"], path=path)
    assert msg.endswith("got 'six' (from the command line)")
    # a check across fields names the key it reports
    msg = error(["worker.rollout.n=1"], path=path)
    assert msg.startswith("config key 'worker.rollout.n' is 1") and msg.endswith("(from the command line)")
    assert error(["worker.rollout.n=2", "trainer.max_steps=x"], path=path).endswith("(from the command line)")


def test_a_base_a_file_and_overrides_combined(tmp_path):
    path = write(tmp_path, "worker:\n  rollout:\n    temperature: 0.7\n")
    values = read_config_values(path, ["trainer.seed=3"], base={"data": {"shuffle": False}, "trainer": {"seed": 1}})
    assert values == {"data": {"shuffle": False}, "trainer": {"seed": 3}, "worker": {"rollout": {"temperature": 0.7}}}
    assert values.sources["worker.rollout.temperature"] == f"in {path}, line 3"
    assert values.sources["trainer.seed"] == "from the command line"
    assert "data.shuffle" not in values.sources  # a base's values are the caller's, not the user's
    msg = error(["worker.rollout.temperature=0"], path=path)
    assert msg.endswith("(from the command line)")
    assert error([], path=write(tmp_path, "worker:\n  rollout:\n    temperature: 0\n", "t.yaml")).endswith(
        f"(in {tmp_path / 't.yaml'}, line 3)")
