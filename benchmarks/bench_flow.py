"""Flow trainer throughput: images per second per process, and what async reward and one-step-off buy, in one run.

Trains the same tiny pixel-space SD3 transformer on the same prompts with
Flow-GRPO (every step an SDE step, 9 of 10 trained), Flow-GRPO-Fast (a window of 2
trained steps), Flow-GRPO-Fast with ``trainer.async_mode: async_reward`` and with
``one_step_off`` (the next step's rollout sampled and scored while this step
trains), and DiffusionNFT (ODE rollouts from its old adapter; 9 of the 10 times trained per
image as NVlabs' default, and 2 as Fast's window), each in its own subprocess, with an image reward that waits a fixed time per call plus a
time per image (like a VLM judge or an OCR server) on top of its cheap work. Reports
the median images per second per process over ``--repeats`` runs of each
configuration (alternating order; each run's first step, which starts up, left out)
and the ratios: Fast over Flow-GRPO, async reward over sync, one-step-off over sync and
DiffusionNFT over Fast.

``--families`` measures the model families instead, side by side in one run: Flow-GRPO-Fast
on each family's tiny stand-in with its VAE (SD3, FLUX.1-dev, Qwen-Image, Wan; ``FAMILIES``),
all at ``--size`` pixels, Wan's samples ``--frames``-frame videos scored on every frame;
images per second (frames per second for video) and each family's ratio to SD3. The
stand-ins are random and tiny (one block each), so the ratios say what each family's
pipeline costs around the same small transformer work, not what the real models cost.

    python benchmarks/bench_flow.py                          # CPU, a few minutes
    python benchmarks/bench_flow.py --size 64 --layers 8     # a larger stand-in
    python benchmarks/bench_flow.py --device cuda            # on a GPU (absolute figures there)
    python benchmarks/bench_flow.py --only flow_grpo_fast diffusion_nft   # a subset of the runs
    python benchmarks/bench_flow.py --families                 # SD3, FLUX.1, Qwen-Image, Wan side by side
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_NFT = {"worker.rollout.noise_level": 0.0}  # DiffusionNFT samples with the ODE
RUNS = {  # name -> (algorithm, async mode, config overrides)
    "flow_grpo": ("flow_grpo", "sync", {}),
    "flow_grpo_fast": ("flow_grpo_fast", "sync", {}),
    "flow_grpo_fast+async_reward": ("flow_grpo_fast", "async_reward", {}),
    "flow_grpo_fast+one_step_off": ("flow_grpo_fast", "one_step_off", {}),
    "diffusion_nft": ("diffusion_nft", "sync", {**_NFT, "algorithm.timestep_fraction": 0.99}),
    "diffusion_nft(2 times)": ("diffusion_nft", "sync", {**_NFT, "algorithm.timestep_fraction": 0.2}),
}

# --families: family -> how its tiny stand-in (with its VAE) is built, "module:function" and keyword arguments
FAMILIES = {
    "sd3": ("grouprl.domains.diffusion.tiny:build_tiny_sd3_pipeline", {"sample_size": None, "vae_blocks": 1}),
    "flux": ("grouprl.domains.diffusion.families.flux:build_tiny_flux_pipeline", {"image_size": None}),
    "qwen_image": ("grouprl.domains.diffusion.families.qwen_image:build_tiny_qwen_image_pipeline",
                   {"image_size": None}),
    "wan": ("grouprl.domains.diffusion.families.wan:build_tiny_wan_pipeline", {}),
}


def build_family(family: str, out: Path, size: int) -> Path:
    """The tiny stand-in of ``family`` at ``size`` pixels (None-valued keywords take the size)."""
    import importlib

    reference, kwargs = FAMILIES[family]
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)(out, **{k: size if v is None else v
                                                                 for k, v in kwargs.items()})


REWARD = '''
import os
import time

import numpy as np

PER_CALL = float(os.environ["BENCH_REWARD_CALL_LATENCY"])
PER_IMAGE = float(os.environ["BENCH_REWARD_IMAGE_LATENCY"])


def slow_red(images, prompts, **metadata):
    time.sleep(PER_CALL + PER_IMAGE * len(images))  # a round trip to a judge server, say
    return [float(np.asarray(im, dtype=np.float32)[..., 0].mean() / 255) for im in images]
'''


def child(root: Path, name: str, args) -> dict:
    from grouprl.domains.diffusion.config import flow_config_from_dict
    from grouprl.domains.diffusion.trainer import flow_trainer

    family = name if name in FAMILIES else None
    algorithm, mode, overrides = ("flow_grpo_fast", "sync", {}) if family else RUNS[name]
    if family:
        overrides = {"worker.actor.model.model_path": str(root / f"model_{family}"),
                     "worker.actor.model.max_sequence_length": 16}
        if family == "wan":
            overrides["worker.rollout.num_frames"] = args.frames
    values = {
        "kind": "flow",
        "data": {"train_files": [str(root / "prompts.jsonl")], "rollout_batch_size": args.prompts},
        "algorithm": {"name": algorithm, "kl_coef": args.kl, "clip_range": 1e-3},
        "worker": {
            "actor": {"model": {"model_path": str(root / "model"), "lora": {"rank": 16, "alpha": 16}},
                      "micro_batch_size": args.micro_batch},
            "rollout": {"n": args.n, "num_steps": 10, "height": args.size, "width": args.size, "guidance_scale": 1.0,
                        "micro_batch_size": args.micro_batch, "sde_window_size": 2, "sde_window_range": [0, 10]},
            "reward": {"functions": [{"name": f"{root / 'reward.py'}:slow_red"}]},
        },
        "trainer": {"max_steps": args.steps, "logger": [], "device": args.device, "save_freq": 10_000,
                    "log_rollouts": False, "output_dir": str(root / f"run_{name}"), "async_mode": mode},
    }
    for key, value in overrides.items():
        *parents, last = key.split(".")
        node = values
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    config = flow_config_from_dict(values)
    trainer = flow_trainer(config)
    times = []
    original = trainer.step

    def timed(step):
        t0 = time.perf_counter()
        out = original(step)
        if args.device == "cuda":
            import torch

            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        return out

    trainer.step = timed
    trainer.train()
    frames = args.frames if family == "wan" else 1
    return {"step_seconds": times, "images_per_step": args.prompts * args.n * frames}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8, help="images per sampler call and per update micro-batch")
    parser.add_argument("--size", type=int, default=16, help="image side in pixels (pixel-space model)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kl", type=float, default=0.0, help="KL coefficient (adds a reference pass)")
    parser.add_argument("--reward-call-latency", type=float, default=0.05, help="seconds each reward call waits")
    parser.add_argument("--reward-image-latency", type=float, default=0.01, help="seconds per image scored")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, in alternating order")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", nargs="+", choices=list(RUNS), metavar="RUN",
                        help=f"run only these configurations (of {', '.join(RUNS)})")
    parser.add_argument("--families", nargs="*", choices=list(FAMILIES), metavar="FAMILY",
                        help=f"measure model families instead (all of {', '.join(FAMILIES)} when none is named)")
    parser.add_argument("--frames", type=int, default=5, help="--families: frames per Wan video (4k + 1)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print("RESULT " + json.dumps(child(Path(args._child[0]), args._child[1], args)))
        return

    from grouprl.domains.diffusion.shapes import make_prompts
    from grouprl.domains.diffusion.tiny import build_tiny_pixel_flow

    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prompts = make_prompts(64, 0, "train")
        (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        (root / "reward.py").write_text(REWARD)
        if args.families is not None:
            names = args.families or list(FAMILIES)
            for family in names:
                build_family(family, root / f"model_{family}", args.size)
        else:
            build_tiny_pixel_flow(root / "model", image_size=args.size, num_layers=args.layers)
            names = [name for name in RUNS if not args.only or name in args.only]
        env = {**os.environ, "BENCH_REWARD_CALL_LATENCY": str(args.reward_call_latency),
               "BENCH_REWARD_IMAGE_LATENCY": str(args.reward_image_latency)}
        for repeat in range(args.repeats):
            # the order alternates, so that no configuration always runs on a warmer (or busier) machine
            for name in names if repeat % 2 == 0 else names[::-1]:
                cmd = [sys.executable, __file__, "--_child", str(root), name]
                for flag in ("steps", "prompts", "n", "micro_batch", "size", "layers", "kl", "device", "frames"):
                    cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if proc.returncode or line is None:
                    sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
                run = json.loads(line[len("RESULT "):])
                result = results.setdefault(name, {"runs": []})
                result["runs"].append(run["step_seconds"])
                result["images_per_step"] = run["images_per_step"]

    if args.families is not None:
        report_families(args, names, results)
        return
    images = args.prompts * args.n
    print(f"\n{args.steps} steps of {args.prompts} prompts x {args.n} images, {args.size}x{args.size} px, 10 denoising "
          f"steps, {args.device}; reward latency {args.reward_call_latency} s per call + "
          f"{args.reward_image_latency} s per image\n")
    print(f"{'configuration':<30} {'median s/step':>14} {'images/s/process':>17}")
    for name in names:
        r = results[name]
        steady = sorted(t for run in r["runs"] for t in (run[1:] or run))  # the first step starts up
        r["step_seconds"] = r["runs"][0]
        r["median_step_seconds"] = steady[len(steady) // 2]
        r["images_per_s"] = images / r["median_step_seconds"]
        print(f"{name:<30} {r['median_step_seconds']:>14.3f} {r['images_per_s']:>17.2f}")
    # name -> (numerator run, denominator run, how it is printed)
    wanted = {
        "fast_vs_flow_grpo": ("flow_grpo_fast", "flow_grpo", "Flow-GRPO-Fast / Flow-GRPO"),
        "async_reward_vs_sync": ("flow_grpo_fast+async_reward", "flow_grpo_fast", "async reward / sync (Fast)"),
        "one_step_off_vs_sync": ("flow_grpo_fast+one_step_off", "flow_grpo_fast", "one-step-off / sync (Fast)"),
        "nft_vs_fast": ("diffusion_nft", "flow_grpo_fast", "DiffusionNFT (9 times) / Flow-GRPO-Fast"),
        "nft_2_times_vs_fast": ("diffusion_nft(2 times)", "flow_grpo_fast", "DiffusionNFT (2 times) / Flow-GRPO-Fast"),
    }
    ratios = {key: results[a]["images_per_s"] / results[b]["images_per_s"]
              for key, (a, b, _) in wanted.items() if a in results and b in results}
    if ratios:
        print("\n" + "; ".join(f"{wanted[key][2]}: {value:.2f}x" for key, value in ratios.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "results": results, "ratios": ratios}, indent=2))


def report_families(args, names: list[str], results: dict) -> None:
    """The --families table: each family's median seconds per step, images (frames) per second, ratio to SD3."""
    print(f"\nFlow-GRPO-Fast, {args.steps} steps of {args.prompts} prompts x {args.n} samples, {args.size}x{args.size} "
          f"px (Wan: {args.frames}-frame videos), each family's tiny stand-in with its VAE, {args.device}\n")
    print(f"{'family':<12} {'median s/step':>14} {'images/s':>10} {'vs sd3':>8}")
    for name in names:
        r = results[name]
        steady = sorted(t for run in r["runs"] for t in (run[1:] or run))
        r["median_step_seconds"] = steady[len(steady) // 2]
        r["step_seconds"] = r["runs"][0]
        r["images_per_s"] = r["images_per_step"] / r["median_step_seconds"]  # frames for a video family
    ratios = {f"{name}_vs_sd3": results[name]["images_per_s"] / results["sd3"]["images_per_s"]
              for name in names if "sd3" in results}
    for name in names:
        r = results[name]
        ratio = ratios.get(f"{name}_vs_sd3")
        unit = " (frames)" if name == "wan" else ""
        print(f"{name:<12} {r['median_step_seconds']:>14.3f} {r['images_per_s']:>10.2f} "
              f"{'' if ratio is None else f'{ratio:.2f}x':>8}{unit}")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "results": results, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
