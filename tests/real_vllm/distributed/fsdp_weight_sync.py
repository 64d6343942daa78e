"""Run under `torchrun --nproc_per_node 2`: an FSDP2 policy's gathered weights pushed into each process's vLLM.

Every process sets the policy up as the trainer does (``setup_policy`` with
``worker.actor.strategy: fsdp``: Accelerate starts the process group, grouprl shards
the model with FSDP2) and starts its colocated ``VLLMEngine`` (``from_config``, so
``distributed_executor_backend="external_launcher"``). Each process samples its own
prompts, scores vLLM's samples with a plain (unsharded) copy of the checkpoint, then
perturbs the sharded policy and the plain copy by the same seeded noise, streams the
policy's gathered weights into vLLM (``engine.update_weights(full_named_parameters(model))``,
the trainer's call) and samples again. The script only measures; it writes what it
saw to ``<out>/rank<r>.json`` and tests/real_vllm/test_vllm_distributed.py judges it.

    torchrun --nproc_per_node 2 tests/real_vllm/distributed/fsdp_weight_sync.py MODEL_DIR OUT_DIR DTYPE ENFORCE_EAGER
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# the engine core in this process (update_weights reaches the model); 1 GB of CPU KV cache
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

from weight_checks import PROMPTS, diff, perturb_alike, rows  # noqa: E402 (a sibling; after the env above)


def main() -> None:
    from torch.distributed.tensor import DTensor

    from grouprl.config import config_from_dict
    from grouprl.data.sample import Sample
    from grouprl.models.weight_sync import gathered_named_parameters
    from grouprl.rollout.engine import SamplingParams
    from grouprl.rollout.logprobs import compute_log_probs
    from grouprl.rollout.vllm_engine import VLLMEngine
    from grouprl.trainer.parallel import full_named_parameters
    from grouprl.trainer.policy import build_policy, setup_policy

    model_dir, out, dtype, enforce_eager = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    config = config_from_dict({
        "data": {"max_prompt_length": 48, "max_response_length": 8},
        "worker": {"actor": {"model": {"model_path": model_dir, "dtype": dtype}, "strategy": "fsdp"},
                   "rollout": {"engine": "vllm", "enforce_eager": enforce_eager, "gpu_memory_utilization": 0.3,
                               "max_num_batched_tokens": 512}},
        "trainer": {"device": "cpu" if not torch.cuda.is_available() else "cuda", "seed": 7},
    })
    policy = setup_policy(config.worker.actor, config.trainer)  # Accelerate's process group, FSDP2 shards
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    result: dict = {"rank": rank, "world_size": world, "sharded": policy.sharded,
                    "dtensor_params": sum(isinstance(p, DTensor) for p in policy.model.parameters())}
    engine = VLLMEngine.from_config(policy.policy, policy.processor, config=config, holds_weights=True)
    vllm_config = engine.llm.llm_engine.vllm_config
    result["executor_backend"] = vllm_config.parallel_config.distributed_executor_backend
    result["weight_sync_path"] = engine.weight_sync_path

    # the plain copies the trainer's log-probs come from: the checkpoint, and (below) the perturbed policy
    device = policy.accelerator.device
    base, _, _ = build_policy(config.worker.actor.model, policy.precision)
    base = base.to(device).eval().requires_grad_(False)
    perturbed, _, _ = build_policy(config.worker.actor.model, policy.precision)
    perturbed = perturbed.to(device).eval().requires_grad_(False)

    mine = PROMPTS[2 * rank: 2 * rank + 2]
    samples = [Sample(messages=[{"role": "user", "content": text}], index=i) for i, text in enumerate(mine)]
    result["prompts"] = mine
    # each process its own seed, as the trainer gives it
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=11 + rank, return_log_probs=True)

    def scored(model, batch):
        with torch.no_grad():
            lp, _ = compute_log_probs(model, batch, micro_batch_size=len(batch), temperature=1.0)
        return lp

    before = engine.generate(samples, params)
    result["before"] = {"vllm_vs_checkpoint": diff(before.rollout_log_probs, scored(base, before),
                                                   before.response_mask),
                        "responses": rows(before)}

    # the same seeded noise on every process: added to the policy's shards and to the plain copy
    perturb_alike(policy.policy, perturbed)
    plain = dict(perturbed.named_parameters())

    # what the stream carries, checked on the way through (the trainer's call otherwise)
    streamed: dict[str, float] = {}

    def watched(named):
        for name, tensor in named:
            want = plain[name]
            streamed[name] = float((tensor.float() - want.float()).abs().max()) \
                if tuple(tensor.shape) == tuple(want.shape) else float("inf")
            yield name, tensor

    engine.update_weights(watched(full_named_parameters(policy.model)))
    result["streamed"] = {"count": len(streamed), "params": len(plain), "max_abs_diff": max(streamed.values())}
    # weight_sync's own gatherer (named_weights_for_sync's default source) gives the same whole tensors
    streamed.clear()
    for _ in watched(gathered_named_parameters(policy.model)):
        pass
    result["gathered"] = {"count": len(streamed), "params": len(plain), "max_abs_diff": max(streamed.values())}

    after = engine.generate(samples, params)
    vllm_after = after.rollout_log_probs
    result["after"] = {
        "vllm_vs_perturbed": diff(vllm_after, scored(perturbed, after), after.response_mask),
        "vllm_vs_checkpoint": diff(vllm_after, scored(base, after), after.response_mask),
        # the sharded policy's own forward (a collective) on the same tokens: the perturbation is the plain copy's
        "fsdp_vs_perturbed": diff(scored(policy.model, after), scored(perturbed, after), after.response_mask),
    }
    torch.distributed.barrier()
    # vLLM's EngineCore.shutdown tears down "its" distributed environment, which under the external
    # launcher is the trainer's process group: recorded, not relied on
    engine.close()
    result["process_group_after_close"] = torch.distributed.is_initialized()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
