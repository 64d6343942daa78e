"""Tensor-parallel rollouts without vLLM: the groups, the union of a group's prompts and the split, the refusals.

grouprl.rollout.tensor_parallel's plain functions, and the layout refusals at load (one line,
exit 2, naming worker.rollout.tensor_parallel_size). The engine with a real vLLM and two
processes: tests/real_vllm/test_vllm_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import yaml

from grouprl.cli import main
from grouprl.config import ConfigError, load_config
from grouprl.config.checks import check_tensor_parallel_layout, launch_world_size
from grouprl.rollout.tensor_parallel import (
    request_key,
    rows_of_member,
    tensor_parallel_group_index,
    tensor_parallel_groups,
    union_of_requests,
)

KEY = "worker.rollout.tensor_parallel_size"


def test_groups_are_consecutive_ranks_as_vllm_lays_them_out():
    assert tensor_parallel_groups(4, 2) == [[0, 1], [2, 3]]
    assert tensor_parallel_groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tensor_parallel_groups(3, 1) == [[0], [1], [2]]
    assert tensor_parallel_groups(2, 2) == [[0, 1]]
    # every rank in exactly one group, and its index is the group holding it
    for world, tp in ((8, 2), (6, 3), (4, 4)):
        groups = tensor_parallel_groups(world, tp)
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(rank in groups[tensor_parallel_group_index(rank, tp)] for rank in range(world))
    with pytest.raises(ValueError, match="does not divide"):
        tensor_parallel_groups(6, 4)


def test_union_samples_each_members_prompts_and_each_member_gets_its_own_rows_back():
    members = [["a0", "a1"], ["b0"], [], ["d0", "d1", "d2"]]
    union, takes = union_of_requests(members)
    assert union == ["a0", "a1", "b0", "d0", "d1", "d2"]  # member by member, in rank order
    # the group's one call returns one output per union request; each member takes its own, in its order
    outputs = [f"out({r})" for r in union]
    for mine, take in zip(members, takes):
        assert rows_of_member(outputs, take) == [f"out({r})" for r in mine]
    with pytest.raises(ValueError, match="outside"):
        rows_of_member(outputs[:2], takes[3])


def test_identical_deterministic_requests_are_sampled_once_and_shared():
    # two members asking for the same prompt with the same seed get the same tokens: sampled once
    members = [[("p", 1), ("q", 2)], [("p", 1), ("r", None)], [("r", None)]]
    union, takes = union_of_requests(members, key=lambda item: item if item[1] is not None else None)
    assert union == [("p", 1), ("q", 2), ("r", None), ("r", None)]  # unseeded: two independent draws
    assert takes == [[0, 1], [0, 2], [3]]
    for mine, take in zip(members, takes):
        assert [union[i] for i in take] == mine


def test_request_key_shares_only_seeded_or_greedy_requests():
    prompt = {"prompt_token_ids": [1, 2, 3]}
    seeded = {"n": 2, "temperature": 1.0, "seed": 7}
    assert request_key(prompt, seeded) == request_key(dict(prompt), dict(seeded))
    assert request_key(prompt, seeded) != request_key(prompt, {**seeded, "seed": 8})
    assert request_key(prompt, seeded) != request_key({"prompt_token_ids": [1, 2, 4]}, seeded)
    assert request_key(prompt, {"n": 1, "temperature": 0.0}) is not None  # greedy: deterministic
    assert request_key(prompt, {"n": 2, "temperature": 1.0}) is None  # unseeded sampling: never shared


@pytest.mark.parametrize("tp, engine, world, verifier, says", [
    (0, "vllm", 2, False, "must be >= 1"),
    (2, "hf", 2, False, "need worker.rollout.engine: vllm"),
    (2, "hf_static", None, False, "need worker.rollout.engine: vllm"),
    (4, "vllm", 2, False, "more than the 2 training process(es)"),
    (2, "vllm", 3, False, "must divide the number of training processes (3)"),
    (2, "vllm", 2, True, "worker.rollout.multi_turn"),
])
def test_impossible_layouts_are_refused_naming_the_key(tp, engine, world, verifier, says):
    with pytest.raises(ConfigError, match=KEY) as caught:
        check_tensor_parallel_layout(tp, engine=engine, world_size=world, dialogues=verifier)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_possible_layouts_pass():
    for tp, world in ((1, 1), (1, 3), (2, 2), (2, 4), (4, 8)):
        check_tensor_parallel_layout(tp, engine="vllm", world_size=world)
    check_tensor_parallel_layout(1, engine="hf", world_size=1)
    check_tensor_parallel_layout(2, engine="vllm", world_size=None)  # no launcher: the trainer checks later


def test_launch_world_size_reads_the_launchers_variable():
    assert launch_world_size({"WORLD_SIZE": "4"}) == 4
    assert launch_world_size({}) is None and launch_world_size({"WORLD_SIZE": ""}) is None


@pytest.fixture()
def config_file(tmp_path):
    config = {
        "data": {"train_files": [str(tmp_path / "train.jsonl")], "max_response_length": 4, "rollout_batch_size": 4},
        "worker": {"actor": {"model": {"model_path": str(tmp_path / "model")}, "global_batch_size": 4},
                   "rollout": {"n": 2, "engine": "vllm", "tensor_parallel_size": 2},
                   "reward": {"functions": [{"name": "accuracy"}]}},
        "trainer": {"max_steps": 1, "device": "cpu", "output_dir": str(tmp_path / "run")},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_layout_refused_at_load_under_a_launcher(config_file, monkeypatch, capsys):
    # torchrun / accelerate export WORLD_SIZE: the config is checked against it when it is read
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="must divide the number of training processes"):
        load_config(config_file)
    assert main(["train", str(config_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert KEY in err and len(err.splitlines()) == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert load_config(config_file).worker.rollout.tensor_parallel_size == 2


def test_layout_refused_before_a_single_process_run_loads_anything(config_file, monkeypatch, capsys):
    # no launcher: the config loads (it may only be read), and `grouprl train` refuses it, one process
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert load_config(config_file).worker.rollout.tensor_parallel_size == 2
    assert main(["train", str(config_file)]) == 2  # the model path does not exist: nothing was loaded
    err = capsys.readouterr().err.strip()
    assert "more than the 1 training process(es)" in err and KEY in err and len(err.splitlines()) == 1
    assert main(["train", str(config_file), "worker.rollout.engine=hf"]) == 2
    assert "need worker.rollout.engine: vllm" in capsys.readouterr().err
