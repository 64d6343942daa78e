"""`grouprl demo`: the whole pipeline on a laptop CPU with nothing downloaded.

1. Synthetic chest X-ray studies (procedural images with visible findings and
   reference reports in varied radiology phrasing) are written to disk in LLaVA
   format and read back through the normal data loader.
2. A tiny Qwen2.5-VL is built from a config, with a tokenizer trained on the
   generator's vocabulary, and saved like any Hugging Face model.
3. SFT warm start on the reference reports (`grouprl sft`).
4. GRPO from the SFT model with a finding-level reward (`grouprl train`).
   The reward is EditGRPO's clinical composite (RadGraph-style F1 + CheXpert-label
   micro F1 + RaTEScore-style score, each rule-based and offline).
5. Both models are evaluated on held-out studies; a before/after table of the
   reward, the clinical metrics and the finding-level F1, a reward-curve PNG
   and summary.json are written to the run directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from grouprl.config import config_from_dict, write_text_atomic

# Sizes chosen so the full demo finishes in a few minutes on 2 CPU cores.
FULL = dict(train=1200, val=96, sft_epochs=8, grpo_steps=120, n=8, prompts_per_step=16)
QUICK = dict(train=96, val=16, sft_epochs=1, grpo_steps=3, n=4, prompts_per_step=8)
REWARD = "editgrpo_composite"  # radgraphf1 + cxb14micro + ratescore, in [0, 3]


def _model_config(model_path: str) -> dict:
    return {"model_path": model_path, "dtype": "float32"}


def demo_configs(out: Path, data: dict[str, Path], sizes: dict, seed: int) -> tuple[dict, dict]:
    """The SFT and GRPO configs the demo runs, as plain dicts (what a user would put in YAML)."""
    common_data = {"train_files": [str(data["train"])], "val_files": [str(data["val"])], "format": "llava",
                   "max_prompt_length": 256, "max_response_length": 96, "seed": seed}
    trainer = {"logger": ["console", "jsonl", "tensorboard"], "seed": seed, "device": "cpu"}
    sft = {
        "data": common_data,
        "worker": {"actor": {"model": _model_config(str(out / "init_model")),
                             "optim": {"lr": 2e-3, "weight_decay": 0.0, "lr_scheduler_type": "cosine",
                                       "lr_warmup_ratio": 0.05}}},
        "sft": {"epochs": sizes["sft_epochs"], "batch_size": 16, "micro_batch_size": 16},
        "trainer": {**trainer, "output_dir": str(out / "sft"), "experiment_name": "demo-sft"},
    }
    grpo = {
        "data": {**common_data, "rollout_batch_size": sizes["prompts_per_step"], "val_batch_size": 64},
        "algorithm": {"adv_estimator": "grpo", "loss_agg_mode": "token-mean", "kl_coef": 0.0},
        "worker": {
            "actor": {"model": _model_config(str(out / "sft_model")),
                      "optim": {"lr": 1e-4, "weight_decay": 0.0},
                      "global_batch_size": sizes["prompts_per_step"],
                      "micro_batch_size_per_device_for_update": 32,
                      "micro_batch_size_per_device_for_experience": 64,
                      "clip_ratio_low": 0.2, "clip_ratio_high": 0.3},
            # 0.7 keeps samples close to what greedy decoding (the evaluation) produces,
            # so what GRPO reinforces shows up in the held-out table
            "rollout": {"n": sizes["n"], "temperature": 0.7},
            "reward": {"functions": [{"name": REWARD, "weight": 1.0}]},
        },
        "trainer": {**trainer, "output_dir": str(out / "grpo"), "experiment_name": "demo-grpo",
                    "max_steps": sizes["grpo_steps"], "save_freq": -1, "save_limit": 1, "val_freq": -1},
    }
    return sft, grpo


@torch.no_grad()
def evaluate(model, processor, samples, *, max_new_tokens: int = 96, batch_size: int = 48) -> dict:
    """Greedy reports for held-out studies: the training reward, clinical metrics and finding-level F1."""
    from grouprl.rewards.findings import corpus_finding_scores
    from grouprl.rewards.radiology import chexpert_f1_reports, radgraph_corpus_f1, score_components
    from grouprl.rewards.radiology.components import get_component
    from grouprl.rewards.radiology.rewards import EDITGRPO_COMPONENTS
    from grouprl.rollout.engine import SamplingParams
    from grouprl.rollout.hf_engine import HFGenerationEngine

    engine = HFGenerationEngine(model, processor)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, seed=0)
    reports = []
    for start in range(0, len(samples), batch_size):
        reports.extend(engine.generate(samples[start:start + batch_size], params).responses)
    refs = [s.answer for s in samples]
    components = score_components(reports, refs, EDITGRPO_COMPONENTS)
    rewards = [sum(values) for values in zip(*components.values())]
    findings = corpus_finding_scores(reports, refs)
    chexpert = chexpert_f1_reports(reports, refs)
    radgraph = radgraph_corpus_f1(reports, refs)
    return {
        "mean_reward": sum(rewards) / len(rewards),
        **{f"mean_{name}": sum(v) / len(v) for name, v in components.items()},
        "chexpert_micro_f1_14": chexpert["micro_f1_14"],
        "chexpert_macro_f1_14": chexpert["macro_f1_14"],
        "radgraph_f1_partial": radgraph["partial"],
        "finding_f1_micro": findings["micro_f1"],
        "finding_f1_macro": findings["macro_f1"],
        "finding_f1_per_sample": findings["sample_f1"],
        "finding_accuracy": findings["accuracy"],
        "backends": {name: get_component(name).backend for name in EDITGRPO_COMPONENTS}
        | {"findings": findings["backend"], "chexpert_f1": chexpert["backend"]},
        "mean_words": sum(len(r.split()) for r in reports) / len(reports),
        "examples": [{"reference": r, "generated": g} for r, g in list(zip(refs, reports))[:3]],
    }


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


_DR_GRPO = {"algorithm": {"norm_adv_by_std_in_grpo": False, "loss_agg_mode": "seq-mean-token-sum-norm"}}
# `grouprl demo --compare`: the seeds' comparison (EditGRPO's table), same SFT start, seed and budget
VARIANTS = {
    "grpo": ("SFT+GRPO", {}),
    "drgrpo": ("SFT+Dr.GRPO", _DR_GRPO),
    "editgrpo": ("SFT+EditGRPO", _merge(_DR_GRPO, {"worker": {"rollout": {
        "extractor": True, "extractor_num_para": -1, "extractor_num_ops_per_para": 1,
        "extractor_similarity_threshold": 0.6}}})),
}


def plot_rewards(curves: dict[str, Path], png: Path) -> None:
    """Mean training reward per GRPO step (faint) and its moving average, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for label, metrics_file in curves.items():
        steps, means = [], []
        for line in metrics_file.read_text().splitlines():
            row = json.loads(line)
            if row.get("reward/mean") is not None:
                steps.append(row["step"])
                means.append(row["reward/mean"])
        window = max(1, len(means) // 12)
        smooth = [sum(means[max(0, i - window + 1):i + 1]) / len(means[max(0, i - window + 1):i + 1])
                  for i in range(len(means))]
        (line,) = ax.plot(steps, smooth, linewidth=2, label=f"{label} (mean of last {window})")
        ax.plot(steps, means, marker="o", markersize=2, alpha=0.25, color=line.get_color())
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"mean training reward\n({REWARD})")
    ax.set_title("grouprl demo: GRPO on synthetic chest X-rays")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(png)


def run_demo(out: str | Path = "runs/demo", *, quick: bool = False, seed: int = 0, compare: bool = False) -> dict:
    """The demo; with ``compare`` it trains GRPO, Dr. GRPO and EditGRPO from the same SFT model."""
    from rich.console import Console
    from rich.table import Table

    from grouprl.data import load_samples
    from grouprl.data.synthetic_cxr import corpus, write_dataset
    from grouprl.models.loading import load_model_and_processor
    from grouprl.models.tiny import build_tiny_vlm
    from grouprl.trainer.grpo import GRPOTrainer
    from grouprl.trainer.sft import run_sft

    console = Console()
    sizes = QUICK if quick else FULL
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    t_start = time.perf_counter()
    variants = list(VARIANTS) if compare else ["grpo"]
    steps = 2 + len(variants)

    console.rule("[bold]grouprl demo: synthetic chest X-ray reports")
    data = {
        "train": write_dataset(out / "data" / "train", sizes["train"], seed=seed, format="llava"),
        "val": write_dataset(out / "data" / "val", sizes["val"], seed=seed + 10_000, format="llava"),
    }
    build_tiny_vlm(out / "init_model", corpus(), seed=seed, vocab_size=1024)
    console.print(f"data and tiny Qwen2.5-VL written under {out}")

    sft_cfg, grpo_cfg = demo_configs(out, data, sizes, seed)
    console.rule(f"[bold]1/{steps} SFT warm start")
    run_sft(config_from_dict(sft_cfg), output_dir=out / "sft_model")

    val = load_samples([str(data["val"])], format="llava")
    samples = [val[i] for i in range(len(val))]
    sft_model, processor, _ = load_model_and_processor(str(out / "sft_model"))
    results = {"SFT": evaluate(sft_model, processor, samples)}
    curves = {}
    for i, key in enumerate(variants):
        label, overrides = VARIANTS[key]
        console.rule(f"[bold]{i + 2}/{steps} {label}")
        cfg = _merge(grpo_cfg, overrides)
        cfg["trainer"] = {**cfg["trainer"], "output_dir": str(out / key), "experiment_name": f"demo-{key}"}
        trainer = GRPOTrainer(config_from_dict(cfg))
        trainer.train()
        results[label] = evaluate(trainer.policy, trainer.processor, samples)
        curves[label] = out / key / "metrics.jsonl"

    console.rule(f"[bold]{steps}/{steps} held-out evaluation")
    table = Table(title=f"held-out synthetic studies (n={len(samples)})",
                  caption="reward = RadGraph F1 + CheXpert micro-F1 + RaTEScore (rule-based backends); "
                          "F1 = finding-level F1 against the generator's labels")
    columns = [("reward", "mean_reward"), ("RadGraph", "mean_radgraphf1"), ("CheXpert", "mean_cxb14micro"),
               ("RaTE", "mean_ratescore"), ("F1 micro", "finding_f1_micro"), ("F1 macro", "finding_f1_macro"),
               ("words", "mean_words")]
    table.add_column("model")
    for title, _ in columns:
        table.add_column(title, justify="right")
    for name, r in results.items():
        table.add_row(name, *(f"{r[key]:.3f}" if key != "mean_words" else f"{r[key]:.1f}" for _, key in columns))
    console.print(table)

    png = out / ("compare_rewards.png" if compare else "reward_curve.png")
    plot_rewards(curves, png)
    before, after = results["SFT"], results["SFT+GRPO"]
    summary = {
        "reward": REWARD,
        "held_out_studies": len(samples),
        "sizes": sizes,
        "seed": seed,
        "models": results,
        "sft": before,
        "sft_grpo": after,
        "reward_gain": after["mean_reward"] - before["mean_reward"],
        "finding_f1_micro_gain": after["finding_f1_micro"] - before["finding_f1_micro"],
        "grpo_improved_finding_f1": after["finding_f1_micro"] > before["finding_f1_micro"],
        "wall_seconds": time.perf_counter() - t_start,
        "reward_curve": str(png),
    }
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2))
    console.print(f"reward curve: {png.resolve()}")
    console.print(f"summary: {(out / 'summary.json').resolve()}")
    return summary
