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

`grouprl demo --compare --seeds K` repeats the comparison over K seeds, each its own
data, model, SFT warm start and RL runs, and reports every metric's mean with a 95%
Student-t interval and whether EditGRPO > Dr.GRPO > GRPO, and GDPO > GRPO, hold beyond the
noise (paired by seed, grouprl.domains.demos.seed_stats). The GDPO arm trains on the composite's
three parts as three rewards, each normalised within its group before the sum.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from grouprl.cli import DEMO_RESUME_HINT, demo_dir, demo_resumes
from grouprl.config import config_from_dict, merge_values
from grouprl.files import AtomicFile, write_text_atomic
from grouprl.domains.demos.curves import curve_line, plot_reward_curves
from grouprl.domains.demos.seed_stats import format_difference, format_mean, seed_dir_status
from grouprl.domains.radiology.rewards.rewards import EDITGRPO_COMPONENTS

# Sizes chosen so the full demo finishes in a few minutes on 2 CPU cores.
FULL = dict(train=1200, val=96, sft_epochs=8, grpo_steps=120, n=8, prompts_per_step=16, val_every=20)
# --quick: every stage, small enough for about a minute of CPU, big enough that the SFT model writes
# reports and GRPO moves the numbers (batch 8 gives SFT twice the updates per study)
QUICK = dict(train=512, val=32, sft_epochs=8, sft_batch=8, grpo_steps=12, n=4, prompts_per_step=8, val_every=4)
QUICK_NOTE = (f"--quick is the demo made small ({QUICK['train']} studies, {QUICK['grpo_steps']} GRPO steps, {QUICK['val']} "
              "held-out studies), so its numbers are "
              "noisy. The full run (grouprl demo, about 4 minutes on 2 CPU cores) takes the held-out reward from "
              "about 1.5 after SFT to about 1.8 after GRPO.")
REWARD = "editgrpo_composite"  # radgraphf1 + cxb14micro + ratescore, in [0, 3]
# build_tiny_vlm's options for the demo model (about 180k parameters); recorded in summary.json
DEMO_MODEL = dict(vocab_size=1024)
# the held-out table's columns: (title, key of evaluate()'s result)
# prompts per greedy generation call, in the demo's evaluation and its GRPO runs' validation alike
VAL_BATCH = 48
TABLE_COLUMNS = [("reward", "mean_reward"), ("RadGraph", "mean_radgraphf1"), ("CheXpert", "mean_cxb14micro"),
                 ("RaTE", "mean_ratescore"), ("F1 micro", "finding_f1_micro"), ("F1 macro", "finding_f1_macro"),
                 ("words", "mean_words")]


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
                             "optim": {"lr": sizes.get("sft_lr", 2e-3), "weight_decay": 0.0, "lr_scheduler_type": "cosine",
                                       "lr_warmup_ratio": 0.05}}},
        "sft": {"epochs": sizes["sft_epochs"], "batch_size": sizes.get("sft_batch", 16), "micro_batch_size": 16},
        "trainer": {**trainer, "output_dir": str(out / "sft"), "experiment_name": "demo-sft"},
    }
    grpo = {
        "data": {**common_data, "rollout_batch_size": sizes["prompts_per_step"], "val_batch_size": VAL_BATCH},
        "algorithm": {"adv_estimator": "grpo", "loss_agg_mode": "token-mean", "kl_coef": 0.0},
        "worker": {
            "actor": {"model": _model_config(str(out / "sft_model")),
                      "optim": {"lr": sizes.get("grpo_lr", 1e-4), "weight_decay": 0.0},
                      "global_batch_size": sizes["prompts_per_step"],
                      "micro_batch_size_per_device_for_update": 32,
                      "micro_batch_size_per_device_for_experience": 64,
                      "clip_ratio_low": 0.2, "clip_ratio_high": 0.3},
            # 0.7 keeps samples close to what greedy decoding (the evaluation) produces,
            # so what GRPO reinforces shows up in the held-out table
            # hf_lean: generate's tokens for the same seed, from a decoding loop without generate's
            # per-step overhead, which is most of a step's time for a model this small
            "rollout": {"n": sizes["n"], "temperature": 0.7, "engine": "hf_lean"},
            "reward": {"functions": [{"name": REWARD, "weight": 1.0}]},
        },
        # the held-out table's row: greedy reports (val_temperature 0, val_n 1) scored by the validation
        # metric report after the last step, every report kept in val_generations.jsonl
        "trainer": {**trainer, "output_dir": str(out / "grpo"), "experiment_name": "demo-grpo",
                    "max_steps": sizes["grpo_steps"], "save_freq": -1, "save_limit": 1,
                    "val_freq": sizes.get("val_every", sizes["grpo_steps"]), "val_before_train": True, "val_metrics": ["report"],
                    "val_generations_to_log": sizes["val"],
                    # reward gaming: the training reward rising while the held-out finding F1 falls
                    "health": {"watch": {"val/report/finding_f1_micro": "max"}, "gaming_window": sizes["grpo_steps"]}},
    }
    grpo["worker"]["rollout"].update(val_temperature=0.0, val_n=1)
    return sft, grpo


def _alarms(run_dir: Path) -> list[dict]:
    """The alarms.jsonl rows of a run (none when the run raised no alarm)."""
    path = run_dir / "alarms.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@torch.no_grad()
def evaluate(model, processor, samples, *, max_new_tokens: int = 96, batch_size: int = VAL_BATCH) -> dict:
    """Greedy reports for held-out studies: the training reward, clinical metrics and finding-level F1
    (``report_metrics.report_scores``, the validation metric ``report``)."""
    from grouprl.domains.radiology.report_metrics import report_scores
    from grouprl.rollout.engine import SamplingParams
    from grouprl.rollout.lean_engine import LeanGenerationEngine

    engine = LeanGenerationEngine(model, processor)  # the reports generate's greedy decoding gives
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, seed=0)
    reports = []
    for start in range(0, len(samples), batch_size):
        reports.extend(engine.generate(samples[start:start + batch_size], params).responses)
    return report_scores(reports, [s.answer for s in samples])


def validated(run_dir: Path) -> dict:
    """The held-out row of a GRPO run from its last validation: the ``val/report/*`` numbers of its
    metrics.jsonl (greedy reports, the validation metric ``report``) and, from the reports in its
    val_generations.jsonl, what summary.json keeps beside them (``report_metrics.report_details``)."""
    from grouprl.domains.radiology.report_metrics import report_details
    from grouprl.files import read_json_records

    prefix = "val/report/"
    rows = [r for r in read_json_records(run_dir / "metrics.jsonl") if f"{prefix}mean_reward" in r]
    if not rows:
        raise RuntimeError(f"{run_dir / 'metrics.jsonl'} has no validation with the metric 'report' (a run "
                           "finished by an older grouprl?); run the demo into a new --out directory")
    last = rows[-1]
    generations = [g for g in read_json_records(run_dir / "val_generations.jsonl") if g["step"] == last["step"]]
    numbers = {k[len(prefix):]: v for k, v in last.items() if k.startswith(prefix)}
    return {**numbers, **report_details([g["response"] for g in generations], [g["reference"] for g in generations])}




_DR_GRPO = {"algorithm": {"norm_adv_by_std_in_grpo": False, "loss_agg_mode": "seq-mean-token-sum-norm"}}
# `grouprl demo --compare`: the seeds' comparison (EditGRPO's table), same SFT start, seed and budget
VARIANTS = {
    "grpo": ("SFT+GRPO", {}),
    "drgrpo": ("SFT+Dr.GRPO", _DR_GRPO),
    "editgrpo": ("SFT+EditGRPO", merge_values(_DR_GRPO, {"worker": {"rollout": {
        "extractor": True, "extractor_num_para": -1, "extractor_num_ops_per_para": 1,
        "extractor_similarity_threshold": 0.6}}})),
    # GDPO: the composite's three parts as three rewards (weights 1: the same sum), each normalised
    # within its group before they are summed; otherwise the GRPO arm
    "gdpo": ("SFT+GDPO", {"algorithm": {"multi_objective_aggregation": "normalize_then_sum"},
                          "worker": {"reward": {"functions": [{"name": part, "weight": 1.0}
                                                              for part in EDITGRPO_COMPONENTS]}}}),
}




def held_out_table(results: dict[str, dict], studies: int, caption: str):
    """The held-out table (a rich Table): one row per model, the TABLE_COLUMNS' values (words to one decimal)."""
    from rich.table import Table

    table = Table(title=f"held-out synthetic studies (n={studies})", caption=caption)
    table.add_column("model")
    for title, _ in TABLE_COLUMNS:
        table.add_column(title, justify="right")
    for name, r in results.items():
        table.add_row(name, *(f"{r[key]:.3f}" if key != "mean_words" else f"{r[key]:.1f}" for _, key in TABLE_COLUMNS))
    return table


def run_demo(out: str | Path | None = None, *, quick: bool = False, seed: int = 0, compare: bool = False) -> dict:
    """The demo (in ``out``, default runs/demo, runs/demo-quick with ``quick``); with ``compare`` it trains
    GRPO, Dr. GRPO, EditGRPO and GDPO from the same SFT model."""
    from rich.console import Console

    from grouprl.data import load_samples
    from grouprl.domains.radiology.synthetic.cxr import corpus, write_dataset
    from grouprl.models.loading import load_model_and_processor
    from grouprl.models.tiny import build_tiny_vlm
    from grouprl.trainer.grpo import GRPOTrainer
    from grouprl.trainer.sft import run_sft

    console = Console()
    sizes = QUICK if quick else FULL
    out = demo_dir(out, "runs/demo", quick)
    out.mkdir(parents=True, exist_ok=True)
    # an earlier run of this command, stopped (Ctrl-C) or finished: its SFT model and checkpoints go on
    resuming = demo_resumes(out, {"demo": "report", "seed": seed, "sizes": sizes, "model": DEMO_MODEL},
                            stages=[out / "sft_model", *(out / key / "checkpoints" for key in VARIANTS)])
    torch.manual_seed(seed)
    t_start = time.perf_counter()
    variants = list(VARIANTS) if compare else ["grpo"]
    steps = 2 + len(variants)

    console.rule("[bold]grouprl demo: synthetic chest X-ray reports")
    data = {
        "train": write_dataset(out / "data" / "train", sizes["train"], seed=seed, format="llava"),
        "val": write_dataset(out / "data" / "val", sizes["val"], seed=seed + 10_000, format="llava"),
    }
    build_tiny_vlm(out / "init_model", corpus(), seed=seed, **DEMO_MODEL)
    console.print(f"data and tiny Qwen2.5-VL written under {out}")

    sft_cfg, grpo_cfg = demo_configs(out, data, sizes, seed)
    console.rule(f"[bold]1/{steps} SFT warm start")
    if resuming and (out / "sft_model" / "config.json").exists():  # written whole or not at all
        console.print(f"the SFT model of the earlier run is reused: {out / 'sft_model'}")
    else:
        run_sft(config_from_dict(sft_cfg), output_dir=out / "sft_model")

    val = load_samples([str(data["val"])], format="llava")
    samples = [val[i] for i in range(len(val))]
    sft_model, processor, _ = load_model_and_processor(str(out / "sft_model"))
    results = {"SFT": evaluate(sft_model, processor, samples)}
    curves = {}
    for i, key in enumerate(variants):
        label, overrides = VARIANTS[key]
        console.rule(f"[bold]{i + 2}/{steps} {label}")
        cfg = merge_values(grpo_cfg, overrides)
        cfg["trainer"] = {**cfg["trainer"], "output_dir": str(out / key), "experiment_name": f"demo-{key}",
                          "resume": "auto" if resuming else None}
        trainer = GRPOTrainer(config_from_dict(cfg))
        trainer.resume_hint = DEMO_RESUME_HINT
        trainer.train()
        results[label] = validated(out / key)
        curves[label] = out / key / "metrics.jsonl"

    console.rule(f"[bold]{steps}/{steps} held-out evaluation")
    console.print(held_out_table(results, len(samples),
                                 "reward = RadGraph F1 + CheXpert micro-F1 + RaTEScore (rule-based backends); "
                                 "F1 = finding-level F1 against the generator's labels"))
    if quick:
        console.print(QUICK_NOTE)

    png = plot_reward_curves(curves, out / ("compare_rewards.png" if compare else "reward_curve.png"),
                             ylabel=f"mean training reward\n({REWARD})",
                             title="grouprl demo: GRPO on synthetic chest X-rays")
    before, after = results["SFT"], results["SFT+GRPO"]
    summary = {
        "reward": REWARD,
        "held_out_studies": len(samples),
        "sizes": sizes,
        "model": DEMO_MODEL,
        "seed": seed,
        "models": results,
        "sft": before,
        "sft_grpo": after,
        "reward_gain": after["mean_reward"] - before["mean_reward"],
        "finding_f1_micro_gain": after["finding_f1_micro"] - before["finding_f1_micro"],
        "grpo_improved_finding_f1": after["finding_f1_micro"] > before["finding_f1_micro"],
        "wall_seconds": time.perf_counter() - t_start,
        "reward_curve": str(png) if png else None,
        # the health alarms each GRPO run raised (alarms.jsonl: reward gaming when the reward rose while
        # the held-out finding F1 fell beyond its noise)
        "health_alarms": {label: _alarms(metrics.parent) for label, metrics in curves.items()},
    }
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2))
    console.print(curve_line(png, "reward curve", curves))
    for label, alarms in summary["health_alarms"].items():
        console.print(f"health alarms ({label}): " + (", ".join(f"{a['alarm']} at step {a['step']}" for a in alarms)
                                                      or "none"))
    from grouprl.report import write_report

    for label, metrics in curves.items():  # each training run's HTML report (grouprl report)
        console.print(f"run report ({label}): {write_report(metrics.parent).resolve()}")
    console.print(f"summary: {(out / 'summary.json').resolve()}")
    return summary


# ---------------------------------------------------------------------------- `grouprl demo --compare --seeds K`
#
# The comparison repeated over seeds seed, seed+1, ..., seed+K-1. Each seed is a whole
# `run_demo(compare=True)` in <out>/seed_<s>/ (its own data, tiny model, SFT warm start and
# RL runs), so the spread over seeds includes all of them. The models of one seed share
# data, SFT start and prompts, so the ordering is tested on per-seed differences.

# the paper's ordering (EditGRPO's table), best first
ORDER = [VARIANTS["editgrpo"][0], VARIANTS["drgrpo"][0], VARIANTS["grpo"][0]]
# GDPO is no link of that ordering; it is tested against GRPO, whose settings it shares but for the reward's split
ALSO_PAIRED = [(VARIANTS["gdpo"][0], VARIANTS["grpo"][0])]
COMPARE_MODELS = ["SFT", *(label for label, _ in VARIANTS.values())]
# longer reports are not better reports: the word count gets an interval but no ordering
ORDERED_METRICS = [key for _, key in TABLE_COLUMNS if key != "mean_words"]
# what run_demo writes into a run directory; anything else there is not ours to delete
_SEED_DIR_ENTRIES = {"data", "init_model", "sft", "sft_model", *VARIANTS, "compare_rewards.png", "summary.json"}


def seed_status(seed_dir: Path, seed: int, sizes: dict) -> str:
    """What ``seed_dir`` holds for this seed (``seed_dir_status``): "new", "complete" (a finished
    compare run of this seed, sizes and model) or "incomplete"; a ValueError for anything else."""
    return seed_dir_status(
        seed_dir, wanted={"seed": seed, "sizes": sizes, "model": DEMO_MODEL, "models": COMPARE_MODELS},
        describe=lambda summary: {"seed": summary.get("seed"), "sizes": summary.get("sizes"),
                                  "model": summary.get("model"), "models": list(summary.get("models", {}))},
        entries=_SEED_DIR_ENTRIES)


def check_seed_dirs(out: str | Path, *, seeds: int, seed: int = 0, quick: bool = False) -> dict[int, str]:
    """`seed_status` of every seed's directory, checked before anything runs; K < 1 is a ValueError."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"--seeds must be a whole number of seeds, at least 1; got {seeds!r}")
    sizes = QUICK if quick else FULL
    return {s: seed_status(Path(out) / f"seed_{s}", s, sizes) for s in range(seed, seed + seeds)}


def _min_s(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s"


def plot_seed_intervals(stats: dict, png: Path) -> None:
    """One panel per metric: each model's mean over seeds (bar), its 95% t-interval (error bar,
    when there are two seeds or more) and the seeds' own values (dots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(stats["models"])
    short = [m.removeprefix("SFT+") for m in models]
    fig, axes = plt.subplots(2, 4, figsize=(12, 5.6))
    for ax, (title, key) in zip(axes.flat, TABLE_COLUMNS):
        for i, m in enumerate(models):
            iv = stats["models"][m][key]
            yerr = None if iv["half_width"] is None else [[iv["half_width"]], [iv["half_width"]]]
            ax.bar(i, iv["mean"], color=f"C{i}", alpha=0.6, yerr=yerr, capsize=4)
            vals = iv["values"]
            offsets = [(j - (len(vals) - 1) / 2) * 0.08 for j in range(len(vals))]
            ax.scatter([i + o for o in offsets], vals, color="black", s=8, zorder=3)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(models)), short, rotation=30, fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    axes.flat[-1].axis("off")
    k = stats["k"]
    what = f"mean over {k} seeds, bars: 95% t-interval, dots: seeds" if k > 1 else "one seed: no interval"
    fig.suptitle(f"grouprl demo --compare, held-out synthetic studies ({what})", fontsize=10)
    fig.tight_layout()
    with AtomicFile(png, "wb") as fh:
        fig.savefig(fh, format="png", dpi=110)
    plt.close(fig)


def run_compare_seeds(out: str | Path | None = None, *, seeds: int, seed: int = 0,
                      quick: bool = False) -> dict:
    """`run_demo(compare=True)` for seeds seed .. seed+seeds-1 in <out>/seed_<s>/ (a finished seed's
    results are reused), then the table of means and 95% t-intervals, the paired ordering test,
    compare_seeds.json and compare_seeds.png in ``out``."""
    from rich.console import Console
    from rich.table import Table

    from grouprl.domains.demos.seed_stats import summarize_seeds

    out = demo_dir(out, "runs/demo-compare", quick)
    statuses = check_seed_dirs(out, seeds=seeds, seed=seed, quick=quick)
    console = Console()
    sizes = QUICK if quick else FULL
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    per_seed, seed_seconds, reused = {}, {}, []
    for i, (s, status) in enumerate(statuses.items()):
        seed_dir = out / f"seed_{s}"
        if status == "complete":
            console.print(f"seed {s} ({i + 1}/{seeds}): complete results in {seed_dir}, reused (not run again)")
            reused.append(s)
        else:
            if status == "incomplete":
                # a fresh trainer appends to the logs it finds; an interrupted seed starts over clean
                console.print(f"seed {s}: {seed_dir} holds an interrupted run (no summary.json); running it again")
                shutil.rmtree(seed_dir)
            console.rule(f"[bold]seed {s} ({i + 1}/{seeds})")
            run_demo(seed_dir, quick=quick, seed=s, compare=True)
        summary = json.loads((seed_dir / "summary.json").read_text())
        per_seed[s] = {m: summary["models"][m] for m in COMPARE_MODELS}
        seed_seconds[s] = summary["wall_seconds"]

    metrics = [key for _, key in TABLE_COLUMNS]
    stats = summarize_seeds(per_seed, metrics=metrics, order=ORDER, ordered_metrics=ORDERED_METRICS, also=ALSO_PAIRED)
    k = stats["k"]
    console.rule(f"[bold]{k} seed(s): {', '.join(map(str, stats['seeds']))}")
    if k == 1:
        console.print("[bold]one seed: means only; an interval (and the ordering test) needs at least 2 seeds "
                      "(--seeds 2 or more)")
    table = Table(title=f"held-out synthetic studies (n={sizes['val']} per seed): mean"
                        + (f" ± half-width of the 95% t-interval over {k} seeds" if k > 1 else " (one seed)"))
    table.add_column("model")
    for title, _ in TABLE_COLUMNS:
        table.add_column(title, justify="right")
    for m, row in stats["models"].items():
        table.add_row(m, *(format_mean(row[key], 1 if key == "mean_words" else 3) for _, key in TABLE_COLUMNS))
    console.print(table)

    titles = dict((key, title) for title, key in TABLE_COLUMNS)
    pairs = list(stats["paired"])
    order_table = Table(title=f"the paper's ordering {stats['ordering']}, and GDPO against GRPO: paired "
                              "differences per seed, mean [95% t-interval]")
    order_table.add_column("metric")
    for pair in pairs:
        order_table.add_column(pair.replace("SFT+", ""), justify="right")
        order_table.add_column("verdict")
    order_table.add_column("whole ordering")
    for key in ORDERED_METRICS:
        cells = []
        for pair in pairs:
            cells += [format_difference(stats["paired"][pair][key]), stats["paired"][pair][key]["verdict"]]
        order_table.add_row(titles[key], *cells, stats["ordering_verdict"][key])
    console.print(order_table)

    png = out / "compare_seeds.png"
    plot_seed_intervals(stats, png)
    wall = time.perf_counter() - t_start
    result = {
        **stats,
        "reward": REWARD,
        "held_out_studies_per_seed": sizes["val"],
        "sizes": sizes,
        "model": DEMO_MODEL,
        "metrics": {key: title for title, key in TABLE_COLUMNS},
        "seed_dirs": {s: str(out / f"seed_{s}") for s in statuses},
        "reused_seeds": reused,
        "seed_wall_seconds": seed_seconds,
        "wall_seconds": wall,
        "plot": str(png),
    }
    write_text_atomic(out / "compare_seeds.json", json.dumps(result, indent=2))
    ran = k - len(reused)
    console.print(f"total wall time {_min_s(wall)} ({ran} seed(s) run, {len(reused)} reused); each seed's "
                  "own run: " + ", ".join(f"seed {s}: {_min_s(t)}" for s, t in seed_seconds.items()))
    console.print(f"plot: {png.resolve()}")
    console.print(f"summary: {(out / 'compare_seeds.json').resolve()}")
    return result


# ---------------------------------------------------------------------------- `grouprl demo --distill`


def distill_config(grpo_cfg: dict, out: Path, teacher: Path) -> dict:
    """The distillation row's config: the GRPO run's (same SFT start, steps, samples, validation) with no
    reward, the teacher's reverse KL alone training the student (pure on-policy distillation)."""
    cfg = merge_values(grpo_cfg, {"algorithm": {"teacher": {"model_path": str(teacher)}}})
    cfg["worker"] = {**cfg["worker"], "reward": {}}
    cfg["trainer"] = {**cfg["trainer"], "output_dir": str(out / "distill"), "experiment_name": "demo-distill",
                      # the reward-gaming alarm reads the training reward, which this run has not
                      "health": {}}
    return cfg


def run_distill_demo(out: str | Path | None = None, *, quick: bool = False, seed: int = 0) -> dict:
    """`grouprl demo --distill`: the tiny report model distilled on-policy from the demo's SFT+GRPO model
    (its last GRPO checkpoint; the demo runs first when ``out`` lacks it), from the same SFT model, for
    the same steps, validated at the same steps; the held-out table SFT, SFT+GRPO, SFT+distill, and
    ``distill_summary.json``."""
    from rich.console import Console

    from grouprl.data import load_samples
    from grouprl.models.loading import load_model_and_processor
    from grouprl.trainer.grpo import GRPOTrainer

    console = Console()
    sizes = QUICK if quick else FULL
    out = demo_dir(out, "runs/demo", quick)
    teacher = out / "grpo" / "checkpoints" / f"global_step_{sizes['grpo_steps']}" / "model"
    if not (teacher / "config.json").exists():
        console.print(f"no SFT+GRPO model at {teacher}: running the demo first")
        run_demo(out, quick=quick, seed=seed)
    data = {"train": out / "data" / "train" / "data.json", "val": out / "data" / "val" / "data.json"}
    _, grpo_cfg = demo_configs(out, data, sizes, seed)
    cfg = distill_config(grpo_cfg, out, teacher)
    console.rule("[bold]SFT+distill: on-policy distillation from the SFT+GRPO model")
    shutil.rmtree(out / "distill", ignore_errors=True)  # a fresh run: its rows are compared with GRPO's
    t0 = time.perf_counter()
    GRPOTrainer(config_from_dict(cfg)).train()
    val = load_samples([str(data["val"])], format="llava")
    samples = [val[i] for i in range(len(val))]
    sft_model, processor, _ = load_model_and_processor(str(out / "sft_model"))
    results = {"SFT": evaluate(sft_model, processor, samples), "SFT+GRPO": validated(out / "grpo"),
               "SFT+distill": validated(out / "distill")}
    console.print(held_out_table(results, len(samples),
                                 f"SFT+distill: {sizes['grpo_steps']} steps of on-policy distillation (reverse KL "
                                 "to the SFT+GRPO model, no reward), as many as GRPO's"))
    kl = [r["distill/reverse_kl"] for r in map(json.loads, (out / "distill" / "metrics.jsonl").read_text().splitlines())
          if "distill/reverse_kl" in r]
    summary = {"teacher": str(teacher), "sizes": sizes, "seed": seed, "models": results,
               "reverse_kl_first_last": [kl[0], kl[-1]] if kl else None,
               "distill_wall_seconds": time.perf_counter() - t0}
    write_text_atomic(out / "distill_summary.json", json.dumps(summary, indent=2))
    console.print(f"summary: {(out / 'distill_summary.json').resolve()}")
    return summary
