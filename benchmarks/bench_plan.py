"""`grouprl plan`'s predictions against what real runs hold, part by part, for bench_precision's shapes.

For each precision mode, in its own subprocess: one GRPO step with grouprl's trainer
(``bench_precision.one_step``: KL on, gradient checkpointing on) gives the live bytes of the
trained weights (with a LoRA run's frozen base), AdamW's state, the gradients at the optimizer
step, the reference model and the rollout copy; then real update forwards of the same model
(``grouprl.planning.live_bytes.update_forward_bytes``: the log-prob forward the loss runs, with
and without gradient checkpointing) give the activations kept for the backward, and
``score_positions`` the peak of a log-prob chunk. Each is printed beside the plan of the same
config (``grouprl.planning.plan``) and the ratio predicted / measured.

On a GPU (``--device cuda``) the step's ``torch.cuda.max_memory_allocated`` is printed beside the
plan's peak (the update phase, no vLLM: the hf engine).

    python benchmarks/bench_plan.py                      # the small shape on the CPU (39M parameters)
    python benchmarks/bench_plan.py --shape 0.5b --device cuda
    python benchmarks/bench_plan.py --shape 3b --device cuda --modes mixed
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_precision import MODES, SHAPES, build, one_step, run_child, step_overrides  # noqa: E402

DEFAULT_MODES = ["fp32", "mixed", "lora"]
WEIGHT_PARTS = {"weights": ("trained_weights", "frozen_weights"), "optimizer_state": ("optimizer_state",),
                "gradients": ("gradients",), "reference": ("reference",), "rollout_copy": ("rollout_copy",)}


def child(root: Path, mode: str, device: str, prompts: int, n: int, tokens: int, micro_batch: int) -> dict:
    """One mode: predicted and measured bytes of each part."""
    import torch

    from grouprl.config import load_config
    from grouprl.models.loading import load_model_and_processor
    from grouprl.planning import memory
    from grouprl.planning.live_bytes import logprob_chunk_peak, update_forward_bytes
    from grouprl.planning.model_shape import model_shape
    from grouprl.planning.plan import plan_memory, settings_from_config

    overrides = step_overrides(root, mode, device, prompts, n, tokens, micro_batch)
    config = load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    lora = config.worker.actor.model.lora
    shape = model_shape(str(root / "model"), lora_rank=lora.rank, lora_alpha=lora.alpha)
    settings = settings_from_config(config)
    step = one_step(root, mode, device, prompts, n, tokens, micro_batch)
    rows = {}
    plan = plan_memory(shape, settings, None)
    for part, measured_keys in WEIGHT_PARTS.items():
        rows[part] = (plan.parts[part], sum(step["tensor_bytes"].get(k, 0) for k in measured_keys))
    if step["peak_bytes"] is not None:
        rows["step peak (cuda max allocated)"] = (plan.phase_totals["update"], step["peak_bytes"])

    # activations of one update micro-batch as the update runs it, with and without checkpointing
    mixed = settings.dtype == "bfloat16" and settings.optim_strategy == "adamw" and settings.lora_rank == 0
    prompt, chunk = 64, settings.chunk_tokens
    for checkpointing in (False, True):
        model, _, _ = load_model_and_processor(root / "model", dtype="float32" if mixed or settings.dtype == "float32"
                                               else "bfloat16", gradient_checkpointing=checkpointing)
        model.to(device).train()
        if settings.lora_rank:
            break  # the adapters' activations: not planned apart (the base's are the same as without)
        s = dataclasses.replace(settings, checkpointing=checkpointing, prompt_length=prompt, response_length=tokens)
        parts = plan_memory(shape, s, None).parts
        measured = update_forward_bytes(model, rows=micro_batch, prompt=prompt, response=tokens, mixed=mixed,
                                        padding_free=False, chunk_tokens=chunk)
        name = "activations" + (" (checkpointing)" if checkpointing else "")
        # what the forward keeps: the layers' activations, autocast's weight copies, and the logits of the
        # response positions when they fit one chunk (a single chunk is not checkpointed)
        kept_logits = memory.unchunked_logits_bytes(micro_batch * tokens, shape.vocab, chunk)
        rows[name] = (parts["activations"] + parts["autocast_weight_copies"] + kept_logits, measured)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    positions = micro_batch * tokens
    chunk_peak = logprob_chunk_peak(positions=positions, hidden=shape.hidden, vocab=shape.vocab,
                                    chunk_tokens=min(chunk, positions // 2), backward=True, with_entropy=True,
                                    mixed=mixed)
    rows["log-prob chunk (update)"] = (memory.logprob_chunk_bytes(positions, shape.vocab, min(chunk, positions // 2),
                                                                  compute_bytes=2 if mixed else 4), chunk_peak)
    return {"rows": rows, "parameters": shape.parameters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=DEFAULT_MODES)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="response tokens per sample")
    parser.add_argument("--micro-batch", type=int, default=4, help="responses per update forward")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._child:
        result = child(Path(args._child[0]), args._child[1], args.device, args.prompts, args.n, args.tokens,
                       args.micro_batch)
        print("RESULT " + json.dumps(result))
        return

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = build(Path(tmp), args.shape)
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--_child", str(root), mode, "--device", args.device,
                   "--prompts", str(args.prompts), "--n", str(args.n), "--tokens", str(args.tokens),
                   "--micro-batch", str(args.micro_batch)]
            results[mode] = run_child(cmd, mode)
            print(f"{mode}: done", file=sys.stderr)

    params = next(iter(results.values()))["parameters"]
    print(f"\nplan vs live bytes, {args.shape} shape ({params / 1e6:.0f}M parameters), {args.device}, "
          f"{args.prompts} prompts x {args.n} samples x {args.tokens} tokens, micro-batch {args.micro_batch}, KL on\n")
    print("| mode | part | predicted MiB | measured MiB | predicted / measured |\n|---|---|---:|---:|---:|")
    for mode, result in results.items():
        for part, (predicted, measured) in result["rows"].items():
            ratio = f"{predicted / measured:.3f}" if measured else ("-" if predicted == 0 else "inf")
            print(f"| {mode} | {part} | {predicted / 2**20:.2f} | {measured / 2**20:.2f} | {ratio} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "settings": vars(args), "results": results},
                                             indent=2))


if __name__ == "__main__":
    main()
