"""`grouprl demo --flow`: Flow-GRPO-Fast on a tiny flow model, on a CPU, offline.

1. Build a tiny pixel-space SD3 transformer (16 x 16 RGB) with a tiny CLIP text
   encoder (``tiny.build_tiny_pixel_flow``); with ``--model flux`` or ``--model qwen-image``
   a tiny pixel-space stand-in of that family instead (``MODELS``: a FluxPipeline of
   FLUX.1-schnell's kind, a QwenImagePipeline, each saved without a VAE).
2. Pretrain it with the rectified-flow loss on synthetic images of coloured squares
   placed as a short prompt asks ("two red squares on the left"; ``shapes``), so it
   roughly follows prompts.
3. Train it with Flow-GRPO-Fast (``FlowGRPOTrainer``, LoRA on the attention
   projections) against the rule reward that checks colour, position and count from
   the pixels (``shapes.shapes_reward``).
4. Score the pretrained and the trained model the same way: ODE sampling (no noise,
   ``EVAL_STEPS`` steps, the same fixed noise) on held-out prompts whose (colour,
   position, count) combinations never occur in training.

Writes ``summary.json``, ``samples.png`` (the same held-out prompts and noise, before
and after), ``reward_curve.png`` and the training run under the output directory.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from grouprl.cli import demo_dir, demo_resumes
from grouprl.files import follow_umask, write_text_atomic
from grouprl.domains.demos.curves import curve_line, plot_reward_curves

FULL = dict(pretrain_steps=1500, pretrain_batch=32, pairs=4096, grpo_steps=200, prompts_per_step=4, n=8, held_out=64)
# --quick: every stage in about a minute of CPU, long enough a pretraining that the model draws squares
QUICK = dict(pretrain_steps=1200, pretrain_batch=16, pairs=2048, grpo_steps=8, prompts_per_step=2, n=4, held_out=16)
QUICK_NOTE = (f"--quick is the demo made small ({QUICK['pretrain_steps']} pretraining steps, {QUICK['grpo_steps']} RL steps, "
              f"{QUICK['held_out']} held-out prompts), so its "
              "numbers are noisy. The full run (grouprl demo --flow, about 4-5 minutes on 2 CPU cores) takes the "
              "held-out reward from about 0.78 to 0.90 with Flow-GRPO-Fast.")
IMAGE_SIZE = 16
EVAL_STEPS = 20
TRAIN_PROMPTS = 512  # the prompt pool RL draws from (training combinations only)
QUICK_NOTE_COMPARE = ("--quick is the comparison made small (its numbers are noise); the full run is "
                      "grouprl demo --flow --compare.")


def _build_sd3(out: Path, seed: int) -> Path:
    from grouprl.domains.diffusion.tiny import build_tiny_pixel_flow

    return build_tiny_pixel_flow(out, seed=seed, image_size=IMAGE_SIZE)


def _build_flux(out: Path, seed: int) -> Path:
    # schnell's kind: no guidance embedding and no resolution shift, as the SD3 demo model has neither
    from grouprl.domains.diffusion.families.flux import build_tiny_flux_pipeline

    return build_tiny_flux_pipeline(out, seed=seed, vae=False, variant="schnell", image_size=IMAGE_SIZE,
                                    num_layers=2, num_single_layers=2, num_attention_heads=4, attention_head_dim=16,
                                    embed_dim=64)


def _build_qwen_image(out: Path, seed: int) -> Path:
    from grouprl.domains.diffusion.families.qwen_image import build_tiny_qwen_image_pipeline

    return build_tiny_qwen_image_pipeline(out, seed=seed, vae=False, image_size=IMAGE_SIZE, num_layers=4,
                                          num_attention_heads=4, attention_head_dim=16, text_hidden_size=64)


# text-encoder tokens per prompt of the stand-ins with a T5 / Qwen2.5-VL encoder: the task's prompts are at most
# 8 words, and the pipelines' 512 would make every step attend over hundreds of padding tokens
PROMPT_TOKENS = 16

# `--model`: the tiny pixel-space model the demo pretrains and trains: (its description, its builder)
MODELS = {"sd3": ("tiny SD3 transformer", _build_sd3),
          "flux": ("tiny FLUX.1 transformer (schnell's kind)", _build_flux),
          "qwen-image": ("tiny Qwen-Image transformer", _build_qwen_image)}


def flow_demo_config(out: Path, model_path: Path, prompts: Path, sizes: dict, seed: int,
                     max_sequence_length: int | None = None) -> dict:
    """The Flow-GRPO-Fast run of the demo, as a plain config dict (``kind: flow``); ``max_sequence_length``:
    the prompt length the model was pretrained with (a stand-in with a T5 / Qwen2.5-VL encoder)."""
    config = {
        "kind": "flow",
        "data": {"train_files": [str(prompts)], "rollout_batch_size": sizes["prompts_per_step"], "seed": seed},
        "algorithm": {
            "name": "flow_grpo_fast", "global_std": True, "kl_coef": 0.0,
            # ratios of a 768-element image stay within ~1 +- 3e-5 of 1 (see notes), so SD3.5's
            # 1e-5 would clip nearly every update; this range rarely clips at this size
            "clip_range": 1e-3,
        },
        "worker": {
            "actor": {"model": {"model_path": str(model_path), "lora": {"rank": 16, "alpha": 16}},
                      "optim": {"lr": 3e-4, "weight_decay": 0.0}, "micro_batch_size": 32, "num_minibatches": 2},
            "rollout": {"n": sizes["n"], "num_steps": 10, "guidance_scale": 1.0, "noise_level": 0.7, "kind": "sde",
                        "height": IMAGE_SIZE, "width": IMAGE_SIZE, "sde_window_size": 3, "sde_window_range": [0, 7],
                        "micro_batch_size": 32},
            "reward": {"functions": [{"name": "shapes"}]},
        },
        "trainer": {"output_dir": str(out / "flow_grpo_fast"), "experiment_name": "demo-flow",
                    "max_steps": sizes["grpo_steps"], "logger": ["console", "jsonl"], "save_freq": -1,
                    "save_limit": 1, "val_freq": -1, "seed": seed, "device": "cpu"},
    }
    if max_sequence_length is not None:
        config["worker"]["actor"]["model"]["max_sequence_length"] = max_sequence_length
    return config


def nft_demo_config(out: Path, model_path: Path, prompts: Path, sizes: dict, seed: int,
                    max_wall_seconds: float | None = None, max_sequence_length: int | None = None) -> dict:
    """The DiffusionNFT run of ``--flow --compare``: the Fast run's model, prompts, group, LoRA and optimizer,
    with DiffusionNFT's sampler (the 10-step ODE from the old adapter, no guidance) and loss."""
    config = flow_demo_config(out, model_path, prompts, sizes, seed, max_sequence_length)
    config["algorithm"] = {"name": "diffusion_nft", "global_std": True, "kl_coef": 0.0,
                           "timestep_fraction": NFT_TIMESTEP_FRACTION, "nft": {"beta": NFT_BETA}}
    config["worker"]["rollout"]["noise_level"] = 0.0
    config["trainer"].update(output_dir=str(out / "diffusion_nft"), experiment_name="demo-flow-nft")
    if max_wall_seconds is not None:  # as long as the Fast run trained, at most 10 times its steps
        config["trainer"].update(max_wall_seconds=max_wall_seconds, max_steps=10 * sizes["grpo_steps"])
    return config


# DiffusionNFT in the comparison: NVlabs' beta (1.0) and 3 of the 10 times per image (the Fast window's
# 3 trained steps), so that a step costs about what a Fast step costs
NFT_BETA = 1.0
NFT_TIMESTEP_FRACTION = 0.3


def evaluate(model, prompts: list[str], *, seed: int) -> dict:
    """ODE samples (``EVAL_STEPS`` steps, fixed noise) of ``prompts``, scored by the shapes reward."""
    from grouprl.domains.diffusion.pretrain import sample_ode
    from grouprl.domains.diffusion.shapes import shapes_metric, shapes_reward

    images = sample_ode(model, prompts, num_steps=EVAL_STEPS, guidance_scale=1.0, seed=seed,
                        height=IMAGE_SIZE, width=IMAGE_SIZE)
    # mean_reward: the validation metric shapes, the number a flow run logs as val/shapes/mean_reward
    return {"mean_reward": shapes_metric(images, [None] * len(images), prompts=prompts)["mean_reward"],
            "scores": shapes_reward(images, prompts), "images": images}


class _Pretrained:
    """Stage 1 of every flow demo: the tiny model pretrained on the shapes, the prompts, the pretrained score."""

    def __init__(self, out: Path, sizes: dict, seed: int, console, title: str, model_name: str = "sd3") -> None:
        from grouprl.domains.diffusion import shapes
        from grouprl.domains.diffusion.models import load_flow_model
        from grouprl.domains.diffusion.pretrain import pretrain_flow

        console.rule(f"[bold]{title}")
        self.model_name = model_name
        description, build = MODELS[model_name]
        init = build(out / "init_model", seed)
        self.max_sequence_length = None if model_name == "sd3" else PROMPT_TOKENS
        model = load_flow_model(init, max_sequence_length=self.max_sequence_length)
        self.n_params = sum(p.numel() for p in model.transformer.parameters())
        pairs = shapes.make_pairs(sizes["pairs"], seed=seed, size=IMAGE_SIZE, split="train")
        self.held_out = shapes.make_prompts(sizes["held_out"], seed + 1, "held_out")
        train_prompts = shapes.make_prompts(TRAIN_PROMPTS, seed + 2, "train")
        self.prompts_file = out / "data" / "train_prompts.jsonl"
        write_text_atomic(self.prompts_file, "".join(json.dumps({"prompt": p}) + "\n" for p in train_prompts))
        console.print(f"{description} ({self.n_params / 1e6:.2f}M parameters, {IMAGE_SIZE}x{IMAGE_SIZE} "
                      f"pixels); {len(pairs)} pretraining images; {len(self.held_out)} held-out prompts of "
                      "combinations never seen in training")
        console.rule("[bold]rectified-flow pretraining")
        t0 = time.perf_counter()
        self.losses = pretrain_flow(model, pairs, steps=sizes["pretrain_steps"], batch_size=sizes["pretrain_batch"],
                                    lr=1e-3, seed=seed, warmup_steps=min(20, sizes["pretrain_steps"] // 5),
                                    lr_schedule="cosine")
        self.seconds = time.perf_counter() - t0
        self.path = out / "pretrained_model"
        if self.path.exists():
            shutil.rmtree(self.path)
        shutil.copytree(init, self.path)
        model.transformer.save_pretrained(self.path / "transformer")
        follow_umask(self.path)  # safetensors writes 0600 files
        console.print(f"loss {self.losses[0]:.3f} -> {self.loss_last20:.3f} (mean of the last 20 steps)")
        self.result = evaluate(model, self.held_out, seed=seed + 3)

    @property
    def loss_last20(self) -> float:
        return sum(self.losses[-20:]) / len(self.losses[-20:])


def _start(out: str | Path, quick: bool, seed: int, title: str, model: str = "sd3"):
    """What every flow demo starts with: diffusers checked, the sizes, the output directory, the seed and
    the pretrained model (``_Pretrained``); returns ``(console, sizes, out, pretrained)``."""
    from rich.console import Console

    from grouprl.domains.diffusion.config import require_diffusers

    require_diffusers()
    if model not in MODELS:
        from grouprl.cli import UsageError

        raise UsageError(f"--model {model!r} is not one of the flow demo's models: {', '.join(MODELS)}")
    console = Console()
    sizes = QUICK if quick else FULL
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # an earlier run of this command, stopped (Ctrl-C) or finished: its RL runs resume from their checkpoints
    # (the pretraining, seeded, is run again: its model is the one they were trained from)
    settings = {"demo": "flow", "seed": seed, "sizes": sizes, **({"model": model} if model != "sd3" else {})}
    resuming = demo_resumes(out, settings,
                            stages=[out / "flow_grpo_fast" / "checkpoints", out / "diffusion_nft" / "checkpoints"])
    torch.manual_seed(seed)
    pretrained = _Pretrained(out, sizes, seed, console, title, model)
    pretrained.resuming = resuming
    return console, sizes, out, pretrained


def _train(config: dict, held_out: list[str], seed: int, *, resume: bool = False) -> dict:
    """Train one RL run from the pretrained model and score it on the held-out prompts; its seconds, steps
    and training images per second. ``resume``: from the run's last checkpoint, if it has one."""
    from grouprl.cli import DEMO_RESUME_HINT
    from grouprl.domains.diffusion.config import flow_config_from_dict
    from grouprl.domains.diffusion.trainer import flow_trainer

    if resume:
        config = {**config, "trainer": {**config["trainer"], "resume": "auto"}}
    trainer = flow_trainer(flow_config_from_dict(config))
    trainer.resume_hint = DEMO_RESUME_HINT
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    trainer.model.transformer = trainer.policy  # the LoRA-wrapped transformer samples the trained model
    result = evaluate(trainer.model, held_out, seed=seed + 3)
    steps = trainer.state.global_step
    images = steps * config["data"]["rollout_batch_size"] * config["worker"]["rollout"]["n"]
    return {**result, "seconds": seconds, "steps": steps, "images_per_s": images / seconds}


def _table(title: str, rows: dict[str, dict]):
    from rich.table import Table

    table = Table(title=title)
    for column in ("model", "mean reward", "reward >= 0.5", "RL steps", "train s", "images/s"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for name, r in rows.items():
        trained = "steps" in r
        table.add_row(name, f"{r['mean_reward']:.3f}", f"{sum(s >= 0.5 for s in r['scores']) / len(r['scores']):.3f}",
                      str(r["steps"]) if trained else "-", f"{r['seconds']:.0f}" if trained else "-",
                      f"{r['images_per_s']:.1f}" if trained else "-")
    return table


def _summary(pre: _Pretrained, sizes: dict, seed: int, runs: dict[str, dict], **extra) -> dict:
    return {
        "model": pre.model_name,
        "task": "coloured squares placed as the prompt asks (grouprl.domains.diffusion.shapes), 16x16 RGB",
        "reward": "shapes (coverage of the asked colour in the asked half, minus stray pixels, halved on a wrong count)",
        "evaluation": f"ODE sampling, {EVAL_STEPS} steps, fixed noise, held-out prompt combinations",
        "model_parameters": pre.n_params,
        "sizes": sizes,
        "seed": seed,
        "pretrain_loss_first": pre.losses[0],
        "pretrain_loss_last20": pre.loss_last20,
        "pretrain_seconds": pre.seconds,
        "held_out_prompts": pre.held_out,
        "pretrained": {"mean_reward": pre.result["mean_reward"], "scores": pre.result["scores"]},
        **{name: {k: v for k, v in r.items() if k != "images"} for name, r in runs.items()},
        **extra,
    }


def _default_dir(base: str, model: str) -> str:
    return base if model == "sd3" else f"{base}-{model}"


def run_flow_demo(out: str | Path | None = None, *, quick: bool = False, seed: int = 0, model: str = "sd3") -> dict:
    """Pretrain, evaluate, Flow-GRPO-Fast, evaluate; one table, summary.json, samples.png, reward_curve.png
    (in ``out``, default runs/demo-flow, runs/demo-flow-quick with ``quick``; runs/demo-flow-flux and so on
    for another ``model``, a name of ``MODELS``)."""
    from grouprl.domains.diffusion.images import save_grid

    t_start = time.perf_counter()
    console, sizes, out, pre = _start(
        demo_dir(out, _default_dir("runs/demo-flow", model), quick), quick, seed,
        f"grouprl demo --flow: Flow-GRPO-Fast on coloured squares, {MODELS.get(model, ('?',))[0]}, CPU", model)
    console.rule("[bold]Flow-GRPO-Fast")
    after = _train(flow_demo_config(out, pre.path, pre.prompts_file, sizes, seed, pre.max_sequence_length),
                   pre.held_out, seed,
                   resume=pre.resuming)

    console.rule("[bold]held-out prompts, ODE sampling, the same noise")
    rows = {"pretrained": pre.result, "pretrained + Flow-GRPO-Fast": after}
    console.print(_table(f"held-out prompts (n={len(pre.held_out)}): shapes reward in [0, 1] (colour, side, count)",
                         rows))
    if quick:
        console.print(QUICK_NOTE if model == "sd3" else QUICK_NOTE.split(" The full run")[0])
    k = min(16, len(pre.held_out))
    grid = save_grid(pre.result["images"][:k] + after["images"][:k], out / "samples.png", columns=k,
                     captions=[f"{p}\nreward {s:.2f}" for p, s in zip(pre.held_out[:k] * 2,
                                                                      pre.result["scores"][:k] + after["scores"][:k])],
                     row_labels=list(rows))
    curves = {"Flow-GRPO-Fast": out / "flow_grpo_fast" / "metrics.jsonl"}
    curve = plot_reward_curves(curves, out / "reward_curve.png", xlabel="Flow-GRPO-Fast step",
                               ylabel="mean training reward\n(shapes, SDE samples)",
                               title="grouprl demo --flow: Flow-GRPO-Fast on coloured squares")
    summary = _summary(pre, sizes, seed, {"flow_grpo_fast": after}, algorithm="flow_grpo_fast",
                       wall_seconds=time.perf_counter() - t_start, samples=str(grid),
                       reward_curve=str(curve) if curve else None)
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2))
    console.print(f"samples (top: pretrained, bottom: trained): {grid.resolve()}")
    console.print(curve_line(curve, "reward curve", curves))
    from grouprl.report import write_report

    for label, metrics in curves.items():  # each training run's HTML report (grouprl report)
        console.print(f"run report ({label}): {write_report(metrics.parent).resolve()}")
    console.print(f"summary: {(out / 'summary.json').resolve()}")
    return summary


def run_flow_compare(out: str | Path | None = None, *, quick: bool = False, seed: int = 0,
                     model: str = "sd3") -> dict:
    """`grouprl demo --flow --compare`: Flow-GRPO-Fast, then DiffusionNFT for as long as Fast trained, from the
    same pretrained model on the same prompts; one table (held-out reward before and after, training images
    per second), one grid, both reward curves."""
    from grouprl.domains.diffusion.images import save_grid

    t_start = time.perf_counter()
    console, sizes, out, pre = _start(demo_dir(out, _default_dir("runs/demo-flow-compare", model), quick), quick,
                                      seed, "grouprl demo --flow --compare: Flow-GRPO-Fast vs "
                                      "DiffusionNFT, the same model, prompts and training time, CPU", model)
    console.rule(f"[bold]Flow-GRPO-Fast, {sizes['grpo_steps']} steps")
    fast = _train(flow_demo_config(out, pre.path, pre.prompts_file, sizes, seed, pre.max_sequence_length),
                  pre.held_out, seed,
                  resume=pre.resuming)
    console.rule(f"[bold]DiffusionNFT, {fast['seconds']:.0f} s (as long as Flow-GRPO-Fast trained)")
    nft = _train(nft_demo_config(out, pre.path, pre.prompts_file, sizes, seed, max_wall_seconds=fast["seconds"],
                                 max_sequence_length=pre.max_sequence_length),
                 pre.held_out, seed, resume=pre.resuming)

    console.rule("[bold]held-out prompts, ODE sampling, the same noise")
    rows = {"pretrained": pre.result, "Flow-GRPO-Fast": fast, "DiffusionNFT": nft}
    console.print(_table(f"held-out prompts (n={len(pre.held_out)}): shapes reward in [0, 1]; the same training "
                         "time for both", rows))
    console.print("images/s: training images sampled per second of training (Fast: 10-step SDE/ODE rollouts with a "
                  f"3-step window; NFT: 10-step ODE rollouts from its old adapter, {NFT_TIMESTEP_FRACTION:g} of the "
                  "times trained per image).")
    if quick:
        console.print(QUICK_NOTE_COMPARE)
    k = min(16, len(pre.held_out))
    grid = save_grid([im for r in rows.values() for im in r["images"][:k]], out / "samples.png", columns=k,
                     captions=[f"{p}\nreward {s:.2f}" for r in rows.values()
                               for p, s in zip(pre.held_out[:k], r["scores"][:k])],
                     row_labels=list(rows))
    curves = {"Flow-GRPO-Fast": out / "flow_grpo_fast" / "metrics.jsonl",
              "DiffusionNFT": out / "diffusion_nft" / "metrics.jsonl"}
    curve = plot_reward_curves(curves, out / "reward_curve.png", xlabel="training step",
                               ylabel="mean training reward\n(shapes, rollout samples)",
                               title="grouprl demo --flow --compare: the same training time")
    summary = _summary(pre, sizes, seed, {"flow_grpo_fast": fast, "diffusion_nft": nft},
                       algorithms=["flow_grpo_fast", "diffusion_nft"],
                       nft_settings={"beta": NFT_BETA, "timestep_fraction": NFT_TIMESTEP_FRACTION},
                       wall_seconds=time.perf_counter() - t_start, samples=str(grid),
                       reward_curve=str(curve) if curve else None)
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2))
    console.print(f"samples (rows: pretrained, Flow-GRPO-Fast, DiffusionNFT): {grid.resolve()}")
    console.print(curve_line(curve, "reward curves", curves))
    from grouprl.report import write_report

    for label, metrics in curves.items():  # each training run's HTML report (grouprl report)
        console.print(f"run report ({label}): {write_report(metrics.parent).resolve()}")
    console.print(f"summary: {(out / 'summary.json').resolve()}")
    return summary
