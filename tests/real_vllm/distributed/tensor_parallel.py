"""Run under `torchrun --nproc_per_node 2`: one vLLM engine sharded over both processes (tensor parallelism 2).

Every process sets the policy up as the trainer does (``setup_policy`` with
``worker.actor.strategy: fsdp``) and starts its ``VLLMEngine`` (``from_config`` with
``worker.rollout.tensor_parallel_size: 2``): vLLM's external launcher makes the two
processes one engine, each holding half of every sharded layer. Each process then asks
for its own prompts with its own seed (as the trainer does); ``LLM.generate`` is wrapped
to record what the group's call really got (the union of both processes' prompts) and
returned. A second call where both processes ask for the same prompts with the same seed
shows the union deduplicated. The policy's shards and a plain copy get the same seeded
noise, the gathered weights go into vLLM (``update_weights(full_named_parameters(model))``,
each shard slicing its own part) and the processes sample again. The script only
measures; it writes ``<out>/rank<r>.json`` and tests/real_vllm/test_vllm_tensor_parallel.py
judges it.

    torchrun --nproc_per_node 2 tests/real_vllm/distributed/tensor_parallel.py MODEL_DIR OUT_DIR DTYPE ENFORCE_EAGER
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
    from grouprl.config import config_from_dict
    from grouprl.data.sample import Sample
    from grouprl.rollout.engine import SamplingParams
    from grouprl.rollout.logprobs import compute_log_probs
    from grouprl.rollout.vllm_capabilities import vllm_model
    from grouprl.rollout.vllm_engine import VLLMEngine
    from grouprl.trainer.parallel import full_named_parameters
    from grouprl.trainer.policy import build_policy, setup_policy

    model_dir, out, dtype, enforce_eager = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    config = config_from_dict({
        "data": {"max_prompt_length": 48, "max_response_length": 8},
        "worker": {"actor": {"model": {"model_path": model_dir, "dtype": dtype}, "strategy": "fsdp"},
                   "rollout": {"engine": "vllm", "tensor_parallel_size": 2, "enforce_eager": enforce_eager,
                               "gpu_memory_utilization": 0.3, "max_num_batched_tokens": 512}},
        "trainer": {"device": "cpu" if not torch.cuda.is_available() else "cuda", "seed": 7},
    })
    policy = setup_policy(config.worker.actor, config.trainer)  # Accelerate's process group, FSDP2 shards
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    result: dict = {"rank": rank, "world_size": world}
    engine = VLLMEngine.from_config(policy.policy, policy.processor, config=config, holds_weights=True)
    parallel = engine.llm.llm_engine.vllm_config.parallel_config
    result["executor_backend"] = parallel.distributed_executor_backend
    result["vllm_tensor_parallel_size"] = parallel.tensor_parallel_size
    result["weight_sync_path"] = engine.weight_sync_path
    result["engine_seed"] = engine.llm_kwargs["seed"]  # the group's: unseeded requests draw alike on both shards
    # the shard this process holds: vLLM's MLP down projection (a row-parallel layer) takes its slice
    # of the inputs (its weight's shape says nothing on the CPU, where the kernel runs a packed copy)
    full = dict(policy.policy.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    layer = vllm_model(engine.llm).get_submodule("model.layers.0.mlp.down_proj")
    result["down_proj"] = {"full_inputs": int(full.shape[1]), "tp_size": int(layer.tp_size),
                           "tp_rank": int(layer.tp_rank), "inputs_per_shard": int(layer.input_size_per_partition)}

    calls: list[list[list[int]]] = []  # per LLM.generate call: the prompts it got
    answers: list[list[list[int]]] = []  # ... and the first response of each

    generate = engine.llm.generate

    def recorded(prompts, *args, **kwargs):
        outputs = generate(prompts, *args, **kwargs)
        calls.append([list(p["prompt_token_ids"]) for p in prompts])
        answers.append([[int(t) for t in o.outputs[0].token_ids] for o in outputs])
        return outputs

    engine.llm.generate = recorded

    device = policy.accelerator.device
    base, _, _ = build_policy(config.worker.actor.model, policy.precision)
    base = base.to(device).eval().requires_grad_(False)
    perturbed, _, _ = build_policy(config.worker.actor.model, policy.precision)
    perturbed = perturbed.to(device).eval().requires_grad_(False)

    def scored(model, batch):
        with torch.no_grad():
            lp, _ = compute_log_probs(model, batch, micro_batch_size=len(batch), temperature=1.0)
        return lp

    def asked(texts):
        return [Sample(messages=[{"role": "user", "content": text}], index=i) for i, text in enumerate(texts)]

    mine = PROMPTS[2 * rank: 2 * rank + 2]
    result["prompts"] = mine
    # each process its own prompts and its own seed, as the trainer gives them
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=11 + 100 * rank, return_log_probs=True)
    before = engine.generate(asked(mine), params)
    result["before"] = {"vllm_vs_checkpoint": diff(before.rollout_log_probs, scored(base, before),
                                                   before.response_mask),
                        "responses": rows(before), "sample_ids": [s.id for s in before.samples],
                        "prompt_rows": [row[m.bool()].tolist()
                                        for row, m in zip(before.prompt_ids, before.prompt_mask)]}

    # both processes ask for the same prompts with the same seed: the group samples them once
    shared = engine.generate(asked(PROMPTS[:2]), SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5))
    result["shared"] = {"responses": rows(shared)}

    # the same seeded noise on every process: added to the policy's shards and to the plain copy
    perturb_alike(policy.policy, perturbed)
    engine.update_weights(full_named_parameters(policy.model))

    after = engine.generate(asked(mine), params)
    result["after"] = {
        "vllm_vs_perturbed": diff(after.rollout_log_probs, scored(perturbed, after), after.response_mask),
        "vllm_vs_checkpoint": diff(after.rollout_log_probs, scored(base, after), after.response_mask),
        "responses": rows(after),
    }
    result["calls"], result["answers"] = calls, answers
    torch.distributed.barrier()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
