"""Memory of one GRPO training step in each precision mode, side by side in one run.

Each mode trains the same randomly initialised Qwen2-shaped model for one step
(generation, reference log-probs for KL, the update) in its own subprocess, with
grouprl's real trainer, and reports:

- the peak memory of the step (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the
  subprocess's peak resident set, which includes Python, torch and the data);
- the bytes of live tensors per model parameter: trained and frozen weights, AdamW's
  state, the reference model and the rollout copy after the step, and the gradients
  as the optimizer step sees them;
- the ratio of each to the fp32 mode.

    python benchmarks/bench_precision.py                 # a ~50M-parameter stand-in, CPU
    python benchmarks/bench_precision.py --shape 3b      # Qwen2.5-3B's text shape, on a GPU
    python benchmarks/bench_precision.py --shape small_qwen_vocab --modes fp32 fp32_full_logits \
        --tokens 256 --micro-batch 8                     # chunked log-probs against whole logits

Modes: ``fp32`` (dtype float32), ``mixed`` (bfloat16 compute over fp32 masters, the
default for bfloat16), ``adamw_bf16`` (parameters and AdamW state in bf16), ``lora``
(rank-64 adapters over a bf16 base); ``fp32_full_logits`` and ``mixed_full_logits`` are fp32
and mixed with the log-probs taken from a micro-batch's whole ``[tokens, vocabulary]`` logits
(``worker.actor.log_prob_chunk_tokens: 0``) instead of chunks of tokens through the output layer.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    # a CPU-sized stand-in with Qwen2's layout
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=True),
    # the small stand-in with Qwen's 151,936-token vocabulary: the output layer's logits dominate
    # a step's memory, as they do for real Qwen models at long responses
    "small_qwen_vocab": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                             num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # Qwen2.5-0.5B's and Qwen2.5-3B's text shapes (the language model of Qwen2.5-VL-3B is the 3B one)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}

MODES = {
    "fp32": {"worker.actor.model.dtype": "float32"},
    "mixed": {"worker.actor.model.dtype": "bfloat16"},
    "adamw_bf16": {"worker.actor.model.dtype": "bfloat16", "worker.actor.optim.strategy": "adamw_bf16"},
    "lora": {"worker.actor.model.dtype": "bfloat16", "worker.actor.model.lora": {"rank": 64, "alpha": 128}},
    # the same as fp32 and mixed, with the log-probs taken from the whole [tokens, vocabulary] logits
    # of a micro-batch at once instead of chunks of log_prob_chunk_tokens (the default, 1024)
    "fp32_full_logits": {"worker.actor.model.dtype": "float32", "worker.actor.log_prob_chunk_tokens": 0},
    "mixed_full_logits": {"worker.actor.model.dtype": "bfloat16", "worker.actor.log_prob_chunk_tokens": 0},
}
DEFAULT_MODES = ["fp32", "mixed", "adamw_bf16", "lora"]


def build(root: Path, shape: str) -> Path:
    """A random model of the shape with grouprl's tiny tokenizer, saved in bf16 (what the hub ships)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grouprl.models.tiny import build_tiny_text_lm

    tiny = build_tiny_text_lm(root / "tokenizer", ["the quick brown fox jumps over the lazy dog"] * 4)
    base = Qwen2Config.from_pretrained(tiny)
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, bos_token_id=base.bos_token_id,
                         eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root / "model")
    for name in os.listdir(tiny):
        if "token" in name or name.endswith(".jinja"):
            (root / "model" / name).write_bytes((tiny / name).read_bytes())
    records = [{"problem": f"Tell me about item {i} of the list", "answer": "fox"} for i in range(64)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def step_overrides(root: Path, mode: str, device: str, prompts: int, n: int, tokens: int, micro_batch: int = 4,
                   chunk_tokens: int | None = None) -> dict:
    """The config of one step in ``mode`` (dotted keys; ``benchmarks/bench_plan.py`` plans the same run)."""
    return {
        "data.train_files": [str(root / "train.jsonl")], "data.max_response_length": tokens,
        "data.rollout_batch_size": prompts, "worker.actor.global_batch_size": prompts,
        "worker.actor.model.model_path": str(root / "model"), "worker.rollout.n": n,
        "worker.actor.micro_batch_size_per_device_for_update": micro_batch,
        "worker.actor.micro_batch_size_per_device_for_experience": 2 * micro_batch,
        **({"worker.actor.log_prob_chunk_tokens": chunk_tokens} if chunk_tokens is not None else {}),
        "worker.actor.model.enable_gradient_checkpointing": True,
        "worker.reward.functions": [{"name": "length", "kwargs": {"target": tokens}}],
        "algorithm.kl_coef": 0.01, "trainer.max_steps": 1, "trainer.logger": [], "trainer.device": device,
        "trainer.log_rollouts": False, "trainer.output_dir": str(root / f"run_{mode}"), "trainer.save_freq": 10,
        **MODES[mode],
    }


def one_step(root: Path, mode: str, device: str, prompts: int, n: int, tokens: int, micro_batch: int = 4,
             chunk_tokens: int | None = None) -> dict:
    """Runs in the subprocess: one training step in ``mode``; returns what it measured."""
    import torch

    from grouprl.config import load_config
    from grouprl.trainer.grpo import GRPOTrainer

    overrides = step_overrides(root, mode, device, prompts, n, tokens, micro_batch, chunk_tokens)
    config = load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    trainer = GRPOTrainer(config)
    # gradients live from the backward to the optimizer step: measure them there
    grad_bytes = []
    step = trainer.optimizer.step

    def measuring_step(*args, **kwargs):
        grad_bytes.append(sum(p.grad.untyped_storage().nbytes() for p in trainer.policy.parameters()
                              if p.grad is not None))
        return step(*args, **kwargs)

    trainer.optimizer.step = measuring_step
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    metrics = trainer.reduce_metrics(trainer.step(1).metrics)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return {"peak_bytes": peak, "seconds": seconds, "tensor_bytes": {**tensor_bytes(trainer),
                                                                      "gradients": max(grad_bytes)},
            "parameters": sum(p.numel() for name, p in trainer.policy.named_parameters() if "lora_" not in name),
            "loss": metrics.get("actor/pg_loss")}


def run_child(cmd: list[str], mode: str) -> dict:
    """Run one mode's subprocess (its own process, so its memory is its own); the dict it printed after RESULT."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        sys.exit(f"mode {mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def tensor_bytes(trainer) -> dict[str, int]:
    """Bytes of the live tensors of each part of the run (shared storage counted once)."""

    from grouprl.planning.live_bytes import storage_bytes as size

    params = list(trainer.policy.parameters())
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if hasattr(v, "untyped_storage") and v.dim()]
    out = {
        "trained_weights": size(p for p in params if p.requires_grad),
        "frozen_weights": size(p for p in params if not p.requires_grad),
        "optimizer_state": size(state),
        "reference": size(trainer.ref_model.model.parameters()) if trainer.ref_model is not None else 0,
        "rollout_copy": size(trainer.engine.model.parameters()) if trainer.engine.holds_weights else 0,
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=DEFAULT_MODES)
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help="worker.actor.log_prob_chunk_tokens of the chunked modes (default: grouprl's)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="response tokens per sample")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--micro-batch", type=int, default=4, help="responses per update forward")
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._child:
        root, mode = Path(args._child[0]), args._child[1]
        result = one_step(root, mode, args.device, args.prompts, args.n, args.tokens, args.micro_batch,
                          args.chunk_tokens)
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print("RESULT " + json.dumps(result))
        return

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = build(Path(tmp), args.shape)
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--_child", str(root), mode, "--device", device,
                   "--prompts", str(args.prompts), "--n", str(args.n), "--tokens", str(args.tokens),
                   "--micro-batch", str(args.micro_batch)]
            if args.chunk_tokens is not None:
                cmd += ["--chunk-tokens", str(args.chunk_tokens)]
            results[mode] = run_child(cmd, mode)
            print(f"{mode}: done in {results[mode]['seconds']:.1f} s", file=sys.stderr)

    peak_key = "peak_bytes" if device == "cuda" else "peak_rss_bytes"
    base = results.get("fp32", next(iter(results.values())))
    params = base["parameters"]
    print(f"\none training step, {args.shape} shape ({params / 1e6:.0f}M parameters), {device}, "
          f"{args.prompts} prompts x {args.n} samples x {args.tokens} tokens, KL on\n")
    print(f"{'mode':<18} {'peak ' + ('allocated' if device == 'cuda' else 'RSS'):>16} {'vs fp32':>8} "
          f"{'tensor bytes/param':>19} {'vs fp32':>8}   breakdown (bytes/param)")
    for mode, r in results.items():
        tb = r["tensor_bytes"]
        per_param = sum(tb.values()) / params
        base_per_param = sum(base["tensor_bytes"].values()) / params
        parts = ", ".join(f"{k} {v / params:.2f}" for k, v in tb.items() if v)
        print(f"{mode:<18} {r[peak_key] / 2**30:>13.2f} GiB {r[peak_key] / base[peak_key]:>8.2f} "
              f"{per_param:>19.2f} {per_param / base_per_param:>8.2f}   {parts}")
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "device": device, "settings": vars(args),
                                              "results": results}, indent=2))


if __name__ == "__main__":
    main()
