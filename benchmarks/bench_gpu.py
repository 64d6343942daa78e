"""One GPU: grouprl's rollout engines and TRL's GRPOTrainer on the EditGRPO recipe shape, in one run.

    python benchmarks/bench_gpu.py --trl --out bench_gpu.json        # GPU: editgrpo-3b and text-0.5b, every engine, TRL
    python benchmarks/bench_gpu.py --shape editgrpo-3b --engines vllm --trl --workdir /tmp/bench_gpu
    python benchmarks/bench_gpu.py --batching padded packed_dynamic --trl   # also padding-free + dynamic batching
    python benchmarks/bench_gpu.py --device cpu --shape tiny --engines hf hf_static --steps 2 \\
        --override worker.rollout.static_cache.backend=eager     # CPU smoke run, under a minute

Shapes (random weights, grouprl's tiny byte-level tokenizer, real embedding-row counts):

- ``editgrpo-3b``: Qwen2.5-VL-3B-Instruct's architecture (text: hidden 2048, 36 layers, 16 heads,
  2 KV heads, MLP 11008, 151,936 embedding rows, tied, M-RoPE [16, 24, 24]; vision: 32 blocks of
  width 1280, MLP 3420, 16 heads, patch 14, merge 2, window 112, full attention in blocks 7, 15,
  23, 31), synthetic chest X-rays of 616 x 616 pixels (inside the recipe's 262,144-401,408 pixel
  range: 484 image tokens), trained with ``examples/editgrpo_qwen25vl3b.yaml`` as it is but for
  n=5, 32 prompts per step, responses up to 256 tokens, and EditGRPO's clinical composite scored
  in process (``editgrpo_composite``) instead of by the reward server;
- ``text-0.5b``: Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864,
  151,936 rows, tied) on ``bench_vs_trl.py``'s "Say apple" task and its string-similarity reward,
  with the same recipe's optimisation settings (edits off: they need reports);
- ``tiny`` / ``tiny-vlm``: a 2-layer Qwen2 / Qwen2.5-VL of width 64 for a CPU smoke run
  (``--device cpu`` allows only these).

Runs: for every shape, one grouprl run per engine and batching mode (``--engines``,
``worker.rollout.engine``; ``--batching``: ``padded``, the default, ``padding_free``, ``dynamic``
and ``packed_dynamic``, EasyR1's ``padding_free`` and ``dynamic_batching``; vLLM is
skipped, with the reason printed, where it cannot be imported or the device is a CPU), and with
``--trl`` one run of TRL's ``GRPOTrainer`` at the same settings (``use_vllm=True, vllm_mode="colocate"``
where vLLM imports on a GPU, else its ``generate``). Each run is its own subprocess, one after the
other, ``--steps`` optimizer steps of which the first is untimed (the static cache compiles, vLLM
starts and captures its graphs, allocators warm up).

TRL's settings come from the resolved grouprl config of the same shape (grouprl key = ``GRPOConfig``):
``worker.rollout.n`` = ``num_generations``; ``data.rollout_batch_size`` x n completions = one
generation batch = one optimizer step (``per_device_train_batch_size`` =
``micro_batch_size_per_device_for_update``, ``gradient_accumulation_steps`` = ``steps_per_generation``
= prompts x n / micro-batch, ``num_iterations=1``); ``data.max_response_length`` =
``max_completion_length``; temperature, top-p, top-k; ``algorithm.kl_coef`` = ``beta`` (TRL's KL is
the k3 estimator, grouprl's ``low_var_kl`` is k3 clipped to [-10, 10]); ``loss_agg_mode``
``seq-mean-token-sum-norm`` / ``token-mean`` / ``seq-mean-token-mean`` = ``loss_type`` ``dr_grpo`` /
``dapo`` / ``grpo``; ``norm_adv_by_std_in_grpo`` = ``scale_rewards`` ``group`` or ``none``;
``clip_ratio_low/high`` = ``epsilon/epsilon_high``; ``clip_ratio_dual`` = ``delta`` (TRL's ratio cap
changes only negative-advantage tokens while ``epsilon_high < delta - 1``: the dual clip); AdamW lr,
betas, weight decay, constant schedule, ``max_grad_norm``; ``enable_gradient_checkpointing`` =
``gradient_checkpointing``; ``dtype: bfloat16`` (fp32 masters, bf16 compute) = an fp32 model with
``bf16=True``, the reference model in bf16 in both (``model_init_kwargs``); ``freeze_vision_tower`` =
the same ``grouprl.models.loading.freeze`` applied to TRL's model; vLLM: the same
``gpu_memory_utilization``, sleep mode on in both, ``max_model_len`` = max prompt + response length,
and ``detokenize=False`` (grouprl's engine passes it too; both frameworks decode the ids themselves,
and a random model samples ids beyond the tiny tokenizer's). EditGRPO's post-rollout edits
(``worker.rollout.extractor``) have no TRL counterpart: they stay on in grouprl's 3B runs
(``--no-edits`` turns them off).

What is reported, per run: the median over the timed steps of the step time (wall clock, the
device synchronised) and of its parts from grouprl's timing metrics (``timing/rollout_s``: generation,
edits and rewards; ``timing/generate_s``; ``timing/reward_s``; ``timing/log_probs_s``: old and
reference log-probs; ``timing/update_s``; ``timing/weight_sync_s``); for TRL the same parts timed by
wrapping its ``_generate_and_score_completions`` (rollout, less the weight sync), ``_generate``,
``_calculate_rewards``, ``_get_per_token_logps_and_entropies`` inside the rollout, and
``vllm_generation.sync_weights`` (update = the rest of the step); tokens/s per GPU counted as verl
counts them, prompt + response tokens of the step's batch (grouprl: ``perf/tokens``; TRL: the growth
of ``state.num_input_tokens_seen``, which TRL counts the same way), summed over the timed steps and
divided by their summed step time; the peak of ``torch.cuda.max_memory_allocated`` over the run (and
the device's used memory at each step's end, which also covers memory vLLM allocates outside torch's
counter); the ratio of each grouprl run's tokens/s to TRL's, and on ``editgrpo-3b`` to EasyR1's
published 1,800 tokens/s per GPU (3B, 8 x H100, vLLM). The JSON (``--out``) holds every setting and
every step's numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECIPE = HERE.parent / "examples" / "editgrpo_qwen25vl3b.yaml"
sys.path.insert(0, str(HERE))
import bench_vs_trl  # noqa: E402  (the text task and its reward, shared with the TRL comparison)

ENGINES = ("hf", "hf_static", "vllm")
# How the log-prob and update forwards batch their rows (--batching): padded rectangles (grouprl's
# default), padding-free packed rows, micro-batches by token count, or both (EasyR1's setting)
BATCHING = {
    "padded": {},
    "padding_free": {"worker.actor.padding_free": True},
    "dynamic": {"worker.actor.dynamic_batching": True},
    "packed_dynamic": {"worker.actor.padding_free": True, "worker.actor.dynamic_batching": True},
}
AIM_TOKENS_PER_S = 1800.0  # EasyR1's published figure for 3B, per GPU
AIM_VS_TRL = 2.0
INSTALL_HINT = "pip install 'grouprl[bench]'"

QWEN25VL_3B = dict(
    hidden_size=2048, layers=36, heads=16, kv_heads=2, intermediate_size=11008, model_vocab_size=151936,
    mrope_section=[16, 24, 24], rope_theta=1e6, max_position_embeddings=128000,
    vision_hidden_size=1280, vision_depth=32, vision_heads=16, vision_intermediate_size=3420, patch_size=14,
    window_size=112, fullatt_block_indexes=[7, 15, 23, 31], image_size=616, vocab_size=1024, save_dtype="bfloat16",
)
QWEN25_05B = dict(
    hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864, model_vocab_size=151936,
    rope_theta=1e6, max_position_embeddings=32768, save_dtype="bfloat16",
)


@dataclasses.dataclass(frozen=True)
class Shape:
    kind: str  # "vlm": synthetic chest X-ray reports, the clinical reward; "text": Say-a-word, string similarity
    model: dict
    n: int
    prompts: int
    max_new_tokens: int
    gpu_only: bool
    studies: int = 0  # synthetic studies written (vlm)


SHAPES = {
    "editgrpo-3b": Shape("vlm", QWEN25VL_3B, n=5, prompts=32, max_new_tokens=256, gpu_only=True, studies=64),
    "text-0.5b": Shape("text", QWEN25_05B, n=5, prompts=32, max_new_tokens=256, gpu_only=True),
    "tiny": Shape("text", dict(hidden_size=64, layers=2), n=2, prompts=2, max_new_tokens=8, gpu_only=False),
    "tiny-vlm": Shape("vlm", dict(hidden_size=64, layers=2, vocab_size=1024), n=2, prompts=2, max_new_tokens=8,
                      gpu_only=False, studies=4),
}
CPU_SHAPES = [name for name, s in SHAPES.items() if not s.gpu_only]

TIMING_KEYS = ("rollout_s", "generate_s", "reward_s", "log_probs_s", "update_s", "weight_sync_s")


# ---------------------------------------------------------------------------- inputs (built in a subprocess)


def build_shape(name: str, root: Path, seed: int, device: str) -> dict:
    """Write the shape's model and data under ``root``; returns where they are."""
    import torch

    shape = SHAPES[name]
    root.mkdir(parents=True, exist_ok=True)
    if shape.kind == "vlm":
        from grouprl.domains.radiology.synthetic.cxr import corpus

        data = write_cxr(root / "data", shape.studies, seed=seed, size=shape.model.get("image_size", 112))
        text = corpus()
        from grouprl.models.tiny import build_tiny_vlm as builder
    else:
        recs = bench_vs_trl.records()
        data = root / "data" / "train.jsonl"
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("".join(json.dumps(r) + "\n" for r in recs))
        text = [r["problem"] for r in recs] + bench_vs_trl.WORDS
        from grouprl.models.tiny import build_tiny_text_lm as builder
    t0 = time.perf_counter()
    where = "cpu"
    if device == "cuda":
        try:  # random init of billions of weights is much faster on the GPU
            with torch.device("cuda"):
                builder(root / "model", text, seed=seed, **shape.model)
            where = "cuda"
        except Exception as exc:  # noqa: BLE001 - fall back to the CPU build
            print(f"[bench] building on the GPU failed ({exc!r}); building on the CPU", flush=True)
    if where == "cpu":
        builder(root / "model", text, seed=seed, **shape.model)
    info = {"model": str(root / "model"), "data": str(data), "build_s": time.perf_counter() - t0, "built_on": where}
    (root / "build.json").write_text(json.dumps({"spec": build_spec(name, seed), **info}, indent=2))
    return info


def write_cxr(directory: Path, n: int, *, seed: int, size: int) -> Path:
    """``n`` synthetic studies as LLaVA records with ``size`` x ``size`` PNGs.

    Films are painted at a quarter of the size (at least 112 pixels; painting a 616-pixel film
    takes about a second) and scaled up: only their pixel count matters here.
    """
    from PIL import Image

    from grouprl.domains.radiology.synthetic.cxr import PROMPT, generate_study

    (directory / "images").mkdir(parents=True, exist_ok=True)
    paint = min(size, max(112, size // 4))
    records = []
    for i in range(n):
        study = generate_study(i, seed=seed, image_size=paint)
        image = study.image if paint == size else study.image.resize((size, size), Image.BICUBIC)
        relative = f"images/{study.id}.png"
        image.save(directory / relative)
        records.append({"id": study.id, "image": relative,
                        "conversations": [{"from": "human", "value": "<image>\n" + PROMPT},
                                          {"from": "gpt", "value": study.report}]})
    path = directory / "data.json"
    path.write_text(json.dumps(records, indent=1))
    return path


def build_spec(name: str, seed: int) -> dict:
    shape = SHAPES[name]
    return {"shape": name, "seed": seed, "model": shape.model, "studies": shape.studies, "version": 1}


# ---------------------------------------------------------------------------- grouprl settings


def grouprl_overrides(name: str, inputs: dict, args, engine: str, run_dir: Path, batching: str = "padded") -> list[str]:
    """Dotted overrides of the EditGRPO recipe for one grouprl run (the user's ``--override`` last)."""
    shape = SHAPES[name]
    values = {
        "data.train_files": [inputs["data"]], "data.val_files": [],
        "data.max_response_length": args.max_new_tokens or shape.max_new_tokens,
        "data.rollout_batch_size": args.prompts or shape.prompts, "data.seed": args.seed,
        "worker.actor.global_batch_size": args.prompts or shape.prompts,
        "worker.rollout.n": args.n or shape.n, "worker.rollout.engine": engine,
        "worker.rollout.gpu_memory_utilization": args.vllm_gpu_memory_utilization,
        "worker.actor.model.model_path": inputs["model"], "worker.actor.model.dtype": args.dtype,
        "worker.reward.reward_server": None,
        "trainer.output_dir": str(run_dir), "trainer.max_steps": args.steps, "trainer.logger": [],
        "trainer.log_rollouts": False, "trainer.save_freq": -1, "trainer.val_freq": -1,
        "trainer.val_before_train": False, "trainer.device": args.device, "trainer.seed": args.seed,
    }
    if args.micro_batch:
        values["worker.actor.micro_batch_size_per_device_for_update"] = args.micro_batch
    if shape.kind == "vlm":
        values["worker.reward.functions"] = [{"name": "editgrpo_composite"}]
        if shape.gpu_only is False:  # tiny films: below the recipe's pixel range
            values["data.min_pixels"] = None
            values["data.max_pixels"] = None
    else:
        values.update({"data.format": "easyr1", "data.min_pixels": None, "data.max_pixels": None,
                       "worker.reward.functions": [], "worker.rollout.extractor": False})
    if args.no_edits:
        values["worker.rollout.extractor"] = False
        values["algorithm.force_gt_num"] = 0
    values.update(BATCHING[batching])
    return [f"{k}={json.dumps(v)}" for k, v in values.items()] + list(args.override)


def resolved_config(overrides: list[str]):
    from grouprl.config import load_config

    return load_config(RECIPE, overrides)


LOSS_TYPES = {"seq-mean-token-sum-norm": "dr_grpo", "token-mean": "dapo", "seq-mean-token-mean": "grpo"}


def trl_settings(config, args) -> dict:
    """TRL ``GRPOConfig`` fields matching a resolved grouprl config (see the module docstring)."""
    algo, actor, roll = config.algorithm, config.worker.actor, config.worker.rollout
    prompts, n, micro = config.data.rollout_batch_size, roll.n, actor.micro_batch_size_per_device_for_update
    if (prompts * n) % micro:
        raise SystemExit(f"micro-batch {micro} must divide prompts x n = {prompts * n} for TRL's accumulation")
    if algo.loss_agg_mode not in LOSS_TYPES:
        raise SystemExit(f"no TRL loss_type for loss_agg_mode {algo.loss_agg_mode!r}")
    accumulation = prompts * n // micro
    bf16 = actor.model.dtype == "bfloat16"
    settings = dict(
        seed=args.seed, data_seed=args.seed, bf16=bf16, fp16=False, use_cpu=args.device == "cpu",
        num_generations=n, max_completion_length=config.data.max_response_length,
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_iterations=actor.ppo_epochs,
        temperature=roll.temperature, top_p=roll.top_p, top_k=max(roll.top_k, 0),
        beta=algo.kl_coef if algo.use_kl_loss else 0.0,
        loss_type=LOSS_TYPES[algo.loss_agg_mode], scale_rewards="group" if algo.norm_adv_by_std_in_grpo else "none",
        epsilon=actor.clip_ratio_low, epsilon_high=actor.clip_ratio_high, delta=actor.clip_ratio_dual,
        learning_rate=actor.optim.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=actor.optim.weight_decay, adam_beta1=actor.optim.betas[0], adam_beta2=actor.optim.betas[1],
        max_grad_norm=actor.max_grad_norm, max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
        model_init_kwargs={"dtype": "bfloat16" if bf16 else "float32"},  # TRL builds the reference from it
    )
    return settings


# ---------------------------------------------------------------------------- measuring (in the run's subprocess)


class Probe:
    """Per-step memory readings on a GPU (nothing on a CPU)."""

    def __init__(self, device: str):
        import torch

        self.cuda = device == "cuda" and torch.cuda.is_available()
        self.torch = torch
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def describe(self) -> dict:
        if not self.cuda:
            return {}
        props = self.torch.cuda.get_device_properties(0)
        return {"gpu": props.name, "gpu_memory_bytes": props.total_memory, "cuda": self.torch.version.cuda}

    def read_and_reset(self) -> dict:
        if not self.cuda:
            return {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "device_used_bytes": None}
        cuda = self.torch.cuda
        free, total = cuda.mem_get_info()
        out = {"peak_allocated_bytes": cuda.max_memory_allocated(), "peak_reserved_bytes": cuda.max_memory_reserved(),
               "device_used_bytes": total - free}
        cuda.reset_peak_memory_stats()
        return out


def run_grouprl(spec: dict) -> dict:
    from grouprl.config import load_config
    from grouprl.trainer.grpo import GRPOTrainer

    config = load_config(RECIPE, spec["overrides"])
    reward_set = None
    if spec["kind"] == "text":
        from grouprl.rewards import RewardSet

        reward_set = RewardSet.from_specs([bench_vs_trl.say_word_reward])
    probe = Probe(spec["device"])
    trainer = GRPOTrainer(config, reward_set=reward_set)
    steps = []
    for k in range(1, spec["steps"] + 1):
        probe.sync()
        t0 = time.perf_counter()
        metrics = trainer.step(k).metrics
        probe.sync()
        wall = time.perf_counter() - t0
        trainer.state.global_step = k
        v = metrics.local()  # one process: its own values are the step's
        steps.append({
            "step_s": wall, "grouprl_step_s": v.get("timing/step_s"),
            **{key: v.get(f"timing/{key}") for key in TIMING_KEYS},
            "tokens": v.get("perf/tokens", 0.0), "responses": v.get("perf/samples", 0.0),
            "response_length_mean": v.get("response_length/mean"), "reward_mean": v.get("reward/mean"),
            "pad_fraction": v.get("perf/pad_fraction"),
            **probe.read_and_reset(),
        })
    params = list(trainer.policy.parameters())
    return {"steps": steps, "parameters": sum(p.numel() for p in params),
            "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
            "engine": config.worker.rollout.engine, "precision": trainer.precision.describe(),
            "machine": probe.describe()}


def trl_dataset(spec: dict):
    from datasets import Dataset

    if spec["kind"] == "text":
        rows = [{"prompt": [{"role": "user", "content": r["problem"]}], "answer": r["answer"]}
                for r in bench_vs_trl.records()]
        return Dataset.from_list(rows)
    from PIL import Image

    data = Path(spec["data"])
    rows = []
    for record in json.loads(data.read_text()):
        human, gpt = record["conversations"]
        text = human["value"].replace("<image>", "").strip()
        rows.append({"prompt": [{"role": "user", "content": text}],
                     "image": Image.open(data.parent / record["image"]).convert("RGB"), "answer": gpt["value"]})
    return Dataset.from_list(rows)


def run_trl(spec: dict) -> dict:
    import collections

    import torch
    import transformers
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    settings = dict(spec["trl"])
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    # transformers 5 renamed gradient_checkpointing (TRL's default: on) to activation_checkpointing
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    settings[checkpointing] = spec["gradient_checkpointing"]
    if spec["use_vllm"]:
        settings.update(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
                        vllm_gpu_memory_utilization=spec["vllm_gpu_memory_utilization"],
                        vllm_max_model_length=spec["max_model_len"], generation_kwargs={"detokenize": False})
    settings.update(spec["trl_overrides"])
    unknown = sorted(set(settings) - names)
    if unknown:
        raise SystemExit(f"this TRL's GRPOConfig has no field(s) {unknown}")
    args = GRPOConfig(output_dir=spec["run_dir"], **settings)

    vlm = spec["kind"] == "vlm"
    auto_model = transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM
    auto_processor = transformers.AutoProcessor if vlm else transformers.AutoTokenizer
    # fp32 weights: with bf16=True the Trainer computes in bf16 over them, as grouprl's mixed precision does
    model = auto_model.from_pretrained(spec["model"], dtype=torch.float32 if spec["fp32_master"] else torch.bfloat16)
    if spec["freeze_vision_tower"]:
        from grouprl.models.loading import freeze

        freeze(model, freeze_vision_tower=True)
    processor = auto_processor.from_pretrained(spec["model"])
    if vlm:
        from grouprl.rewards import get_reward

        reward = get_reward("editgrpo_composite")
    else:
        reward = bench_vs_trl.say_word_reward

    probe = Probe(spec["device"])
    timers: dict[str, float] = collections.defaultdict(float)
    inside = {"rollout": False}
    steps: list[dict] = []
    marks = {"last": None, "tokens": 0}
    logs_by_step: dict[int, dict] = {}

    def timed(owner, name: str, key: str, *, rollout_only: bool = False, marks_rollout: bool = False) -> bool:
        fn = getattr(owner, name, None)
        if fn is None:
            return False

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            if rollout_only and not inside["rollout"]:
                return fn(*a, **kw)
            probe.sync()
            t0 = time.perf_counter()
            if marks_rollout:
                inside["rollout"] = True
            try:
                return fn(*a, **kw)
            finally:
                if marks_rollout:
                    inside["rollout"] = False
                probe.sync()
                timers[key] += time.perf_counter() - t0

        setattr(owner, name, wrapper)
        return True

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            probe.sync()
            marks["last"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            probe.sync()
            now = time.perf_counter()
            step_s = now - marks["last"]
            marks["last"] = now
            tokens = state.num_input_tokens_seen - marks["tokens"]
            marks["tokens"] = state.num_input_tokens_seen
            rollout, sync = timers.get("rollout"), timers.get("weight_sync", 0.0)
            record = {"step_s": step_s, "tokens": float(tokens), "responses": float(spec["responses"])}
            if wrapped["rollout"]:
                record.update(
                    rollout_s=rollout - sync,
                    generate_s=timers.get("generate", 0.0) - sync if wrapped["generate"] else None,
                    reward_s=timers.get("reward") if wrapped["reward"] else None,
                    log_probs_s=timers.get("log_probs", 0.0) if wrapped["log_probs"] else None,
                    update_s=step_s - rollout,
                    weight_sync_s=sync if wrapped["weight_sync"] else None)
            else:
                record.update({key: None for key in TIMING_KEYS})
            record.update(probe.read_and_reset())
            steps.append(record)
            timers.clear()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                logs_by_step[state.global_step] = dict(logs)

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=trl_dataset(spec),
                          processing_class=processor, callbacks=[Recorder()])
    wrapped = {
        "rollout": timed(trainer, "_generate_and_score_completions", "rollout", marks_rollout=True),
        "generate": timed(trainer, "_generate", "generate"),
        "reward": timed(trainer, "_calculate_rewards", "reward"),
        "log_probs": timed(trainer, "_get_per_token_logps_and_entropies", "log_probs", rollout_only=True),
        "weight_sync": (getattr(trainer, "vllm_generation", None) is not None
                        and timed(trainer.vllm_generation, "sync_weights", "weight_sync")),
    }
    trainer.train()
    for k, record in enumerate(steps, start=1):
        logs = logs_by_step.get(k, {})
        record["response_length_mean"] = logs.get("completions/mean_length")
        record["reward_mean"] = logs.get("reward")
    params = list(trainer.model.parameters())
    return {"steps": steps, "parameters": sum(p.numel() for p in params),
            "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
            "engine": "vllm colocate" if spec["use_vllm"] else "transformers generate",
            "timed_methods": wrapped, "machine": probe.describe(), "trl_settings": settings}


def worker_main(kind: str, spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
        torch.set_num_interop_threads(1)
    if kind == "build":
        result = build_shape(spec["shape"], Path(spec["root"]), spec["seed"], spec["device"])
    else:
        result = run_grouprl(spec) if kind == "grouprl" else run_trl(spec)
        if len(result["steps"]) != spec["steps"]:
            raise RuntimeError(f"{kind}: recorded {len(result['steps'])} steps, expected {spec['steps']}")
    Path(result_path).write_text(json.dumps(result, indent=1))


# ---------------------------------------------------------------------------- driver


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def vllm_unavailable(device: str) -> str | None:
    """Why vLLM cannot run here, or None (imported in a subprocess: the driver stays free of it)."""
    if device != "cuda":
        return "vLLM runs on a GPU here (--device cpu)"
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install 'grouprl[vllm]')"
    proc = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True,
                          env=subprocess_env(None))
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return f"vllm is not importable ({last})"
    return None


def subprocess_env(threads: int | None) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in-process, its model reachable
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def launch(kind: str, spec: dict, root: Path, tag: str, timeout: float | None) -> tuple[dict | None, str | None]:
    """Run one worker subprocess; returns (result, None) or (None, why it failed)."""
    spec_path, result_path, log_path = (root / f"{tag}.{x}" for x in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", kind, "--_spec", str(spec_path),
           "--_result", str(result_path)]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(spec.get("threads")),
                                  timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.perf_counter() - start
    if code != 0 or not result_path.exists():
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
        return None, f"exit {code} after {wall:.0f} s; last lines of {log_path}:\n{tail}"
    result = json.loads(result_path.read_text())
    result["subprocess_wall_s"] = wall
    return result, None


def summarize(result: dict) -> dict:
    """Medians over the timed steps (all but the first), tokens/s, peak memory."""
    timed = result["steps"][1:]

    def median(key):
        values = [s[key] for s in timed if s.get(key) is not None]
        return statistics.median(values) if values else None

    seconds = sum(s["step_s"] for s in timed)
    tokens = sum(s["tokens"] for s in timed)
    peaks = [s["peak_allocated_bytes"] for s in result["steps"] if s.get("peak_allocated_bytes") is not None]
    used = [s["device_used_bytes"] for s in result["steps"] if s.get("device_used_bytes") is not None]
    return {
        "timed_steps": len(timed), "step_s": median("step_s"), **{key: median(key) for key in TIMING_KEYS},
        "tokens_per_step": tokens / len(timed), "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "response_length_mean": median("response_length_mean"), "pad_fraction": median("pad_fraction"),
        "peak_allocated_bytes": max(peaks) if peaks else None, "device_used_max_bytes": max(used) if used else None,
    }


def _fmt(value, spec: str = ".1f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_table(report: dict) -> None:
    cols = ("shape", "run", "s/step", "rollout", "generate", "reward", "log-probs", "update", "sync",
            "tokens/step", "tokens/s", "pad", "peak GiB", "vs TRL", "vs 1,800")
    widths = (12, 30, 7, 8, 8, 7, 9, 7, 6, 11, 9, 5, 8, 7, 8)
    line = " ".join(f"{c:<{w}}" if i < 2 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cols, widths, strict=True)))
    print()
    print(line)
    print("-" * len(line))
    for shape, entry in report["shapes"].items():
        for name, run in entry["runs"].items():
            if "error" in run:
                print(f"{shape:<12} {name:<30} failed: {run['error'].splitlines()[0]}")
                continue
            s = run["summary"]
            peak = s["peak_allocated_bytes"] / 2**30 if s["peak_allocated_bytes"] is not None else None
            cells = [_fmt(s["step_s"], ".2f"), *(_fmt(s[k], ".2f") for k in TIMING_KEYS),
                     _fmt(s["tokens_per_step"], ".0f"), _fmt(s["tokens_per_s"], ".0f"),
                     _fmt(s.get("pad_fraction"), ".2f"), _fmt(peak, ".1f"),
                     _fmt(run.get("vs_trl"), ".2f"), _fmt(run.get("vs_aim"), ".2f")]
            print(f"{shape:<12} {name:<30} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths[2:], strict=True)))
        for what, why in entry["skipped"].items():
            print(f"{shape:<12} {what:<30} skipped: {why}")
    print(f"\n(median seconds per step over the timed steps, all but the first, device synchronised; tokens = "
          f"prompt + response tokens per step, as verl counts them; tokens/s = timed tokens / timed seconds, one "
          f"device; pad = the share of padding in the log-prob and update forwards (perf/pad_fraction); peak = "
          f"torch.cuda.max_memory_allocated; 'vs 1,800': EasyR1's published tokens/s per GPU for 3B, "
          f"editgrpo-3b only; aims: >= {AIM_TOKENS_PER_S:,.0f} tokens/s and >= {AIM_VS_TRL:.0f}x TRL)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--shape", "--shapes", dest="shapes", nargs="+", choices=sorted(SHAPES), default=None,
                   help="default: editgrpo-3b text-0.5b on a GPU, tiny on a CPU (which allows only "
                        f"{', '.join(CPU_SHAPES)})")
    p.add_argument("--engines", nargs="*", choices=ENGINES, default=list(ENGINES),
                   help="grouprl's rollout engines, one run each (vllm is skipped where it cannot run; "
                        "none: TRL alone)")
    p.add_argument("--batching", nargs="+", choices=list(BATCHING), default=["padded"],
                   help="how grouprl's log-prob and update forwards batch rows; one run per engine and choice "
                        "(padding_free: worker.actor.padding_free; dynamic: worker.actor.dynamic_batching; "
                        "packed_dynamic: both)")
    p.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer at the same settings")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run; the first is untimed")
    p.add_argument("--n", type=int, default=None, help="responses per prompt (default: the shape's, 5)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the shape's, 32)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="longest response (default: the shape's, 256)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="responses per forward/backward in the update (default: the recipe's, 2)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="worker.actor.model.dtype (default: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--no-edits", action="store_true", help="turn EditGRPO's post-rollout edits off in grouprl")
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3,
                   help="share of the GPU vLLM may take, grouprl's and TRL's alike (default 0.3, TRL's default: "
                        "the 3B policy's fp32 weights, gradients and AdamW state stay on the GPU beside it)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a grouprl config override for every grouprl run (repeatable), e.g. "
                        "worker.rollout.static_cache.backend=eager")
    p.add_argument("--trl-override", action="append", default=[], metavar="FIELD=VALUE",
                   help="a GRPOConfig field for the TRL run (repeatable; the value is read as YAML)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per subprocess (default: 1 on a CPU, torch's own on a GPU)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before a run is killed and marked failed")
    p.add_argument("--workdir", default=None,
                   help="keep models, data, logs and runs here, and reuse models already built here")
    p.add_argument("--out", default="bench_gpu.json", help="where to write the JSON result")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="run nothing: combine the --out files of runs made separately (later files win for a "
                        "run in several), compare them again, print the table and write --out")
    p.add_argument("--_worker", choices=["build", "grouprl", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--_spec", help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._worker or args.merge:
        return args
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: no GPU is visible to torch")
    if args.shapes is None:
        args.shapes = ["editgrpo-3b", "text-0.5b"] if args.device == "cuda" else ["tiny"]
    if args.device == "cpu":
        too_big = [s for s in args.shapes if SHAPES[s].gpu_only]
        if too_big:
            p.error(f"on a CPU only the tiny shapes run ({', '.join(CPU_SHAPES)}); {', '.join(too_big)} needs a GPU")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is untimed)")
    for name in ("n", "prompts", "max_new_tokens", "micro_batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.n is not None and args.n < 2:
        p.error("--n must be at least 2 (group-relative advantages need a group)")
    for item in args.override + args.trl_override:
        if "=" not in item:
            p.error(f"override {item!r} is not of the form KEY=VALUE")
    return args


def prepare_shape(name: str, root: Path, args, reuse: bool) -> dict:
    """The shape's model and data: built in a subprocess, or reused from ``--workdir``."""
    shape_root = root / name
    marker = shape_root / "build.json"
    if reuse and marker.exists():
        saved = json.loads(marker.read_text())
        if saved.get("spec") == build_spec(name, args.seed) and Path(saved["model"], "config.json").exists():
            print(f"[bench] {name}: reusing the model and data in {shape_root}", flush=True)
            return saved
    print(f"[bench] {name}: building the random model and the data in {shape_root} ...", end=" ", flush=True)
    spec = {"shape": name, "root": str(shape_root), "seed": args.seed, "device": args.device, "threads": args.threads}
    shape_root.mkdir(parents=True, exist_ok=True)
    info, error = launch("build", spec, shape_root, "build", args.timeout)
    if error:
        print("failed", flush=True)
        raise SystemExit(f"[bench] building {name} failed: {error}")
    print(f"{info['build_s']:.0f} s", flush=True)
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._worker:
        worker_main(args._worker, args._spec, args._result)
        return 0
    if args.merge:
        return merge_reports(args.merge, args.out)

    no_vllm = vllm_unavailable(args.device) if "vllm" in args.engines or args.trl else None
    no_trl = None
    if args.trl and importlib.util.find_spec("trl") is None:
        no_trl = f"TRL is not installed ({INSTALL_HINT})"
    machine = {
        "device": args.device, "cpu_count": os.cpu_count(), "load_avg_at_start": list(os.getloadavg()),
        "python": sys.version.split()[0],
        **{name: _version(name) for name in ("grouprl", "torch", "transformers", "trl", "vllm", "accelerate")},
    }

    tmp = None
    if args.workdir:
        root = Path(args.workdir).resolve()
        root.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="grouprl_bench_gpu_")
        root = Path(tmp.name)
    report = {"settings": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "machine": machine,
              "aims": {"tokens_per_s": AIM_TOKENS_PER_S, "vs_trl": AIM_VS_TRL}, "shapes": {}}
    failed = False
    try:
        for name in args.shapes:
            shape = SHAPES[name]
            inputs = prepare_shape(name, root, args, reuse=bool(args.workdir))
            entry = {"inputs": inputs, "model_shape": shape.model, "runs": {}, "skipped": {}}
            report["shapes"][name] = entry
            config = None
            for engine, batching in [(e, b) for e in args.engines for b in args.batching]:
                label = f"grouprl {engine}" + ("" if batching == "padded" else f" {batching}")
                if engine == "vllm" and no_vllm:
                    print(f"[bench] {name}: {label} skipped: {no_vllm}", flush=True)
                    entry["skipped"][label] = no_vllm
                    continue
                run_dir = root / name / f"run_{engine}_{batching}"
                overrides = grouprl_overrides(name, inputs, args, engine, run_dir, batching)
                config = resolved_config(overrides)
                spec = {"kind": shape.kind, "device": args.device, "steps": args.steps, "threads": args.threads,
                        "overrides": overrides}
                entry.setdefault("settings", _settings_of(config))
                print(f"[bench] {name}: {label}, {args.steps} steps ...", end=" ", flush=True)
                result, error = launch("grouprl", spec, root / name, f"grouprl_{engine}_{batching}", args.timeout)
                failed |= _record(entry, label, result, error)
            if args.trl:
                trl_overrides = _yaml_values(args.trl_override)
                # TRL's vLLM colocate mode where vLLM runs (--trl-override use_vllm=false: its generate)
                wanted = trl_overrides.pop("use_vllm", True) is not False
                use_vllm = wanted and no_vllm is None
                label = "TRL vllm" if use_vllm else "TRL generate"
                if no_trl:
                    print(f"[bench] {name}: TRL skipped: {no_trl}", flush=True)
                    entry["skipped"]["TRL"] = no_trl
                else:
                    if config is None:  # no grouprl engine ran: resolve the same settings anyway
                        config = resolved_config(grouprl_overrides(name, inputs, args, "hf", root / name / "run_hf"))
                        entry.setdefault("settings", _settings_of(config))
                    spec = {"kind": shape.kind, "device": args.device, "steps": args.steps, "threads": args.threads,
                            "model": inputs["model"], "data": inputs["data"], "run_dir": str(root / name / "run_trl"),
                            "trl": trl_settings(config, args), "use_vllm": use_vllm,
                            "vllm_gpu_memory_utilization": args.vllm_gpu_memory_utilization,
                            "max_model_len": config.data.max_prompt_length + config.data.max_response_length,
                            "gradient_checkpointing": config.worker.actor.model.enable_gradient_checkpointing,
                            "freeze_vision_tower": config.worker.actor.model.freeze_vision_tower,
                            "fp32_master": True, "responses": config.data.rollout_batch_size * config.worker.rollout.n,
                            "trl_overrides": trl_overrides}
                    print(f"[bench] {name}: {label}, {args.steps} steps ...", end=" ", flush=True)
                    result, error = launch("trl", spec, root / name, "trl", args.timeout)
                    failed |= _record(entry, label, result, error)
            _compare(name, entry)
    finally:
        if tmp is not None:
            tmp.cleanup()

    machine["load_avg_at_end"] = list(os.getloadavg())
    for entry in report["shapes"].values():  # the GPU as the runs saw it (the driver never initialises CUDA)
        for run in entry["runs"].values():
            machine.update(run.get("machine") or {})
    print_table(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"[bench] wrote {args.out}")
    return 1 if failed else 0


def merge_reports(paths: list[str], out: str) -> int:
    """One report from several (each a shape's runs made by separate invocations, e.g. one engine each)."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    merged = {**reports[0], "merged_from": [str(p) for p in paths], "shapes": {}}
    for report in reports:
        for name, entry in report["shapes"].items():
            target = merged["shapes"].setdefault(name, {**entry, "runs": {}, "skipped": {}})
            target.setdefault("settings", entry.get("settings"))
            if entry.get("settings") and target["settings"] and entry["settings"] != target["settings"]:
                print(f"[bench] warning: {name}: the merged runs were made with different settings; "
                      "their ratios compare unlike runs", flush=True)
                target["settings_differ"] = True
            for label, run in entry["runs"].items():
                target["runs"][label] = run
                target["skipped"].pop(label, None)
            for label, why in entry["skipped"].items():
                if label not in target["runs"]:
                    target["skipped"][label] = why
    for name, entry in merged["shapes"].items():
        _compare(name, entry)
    print_table(merged)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(merged, indent=1))
    print(f"[bench] wrote {out}")
    return 0


def _settings_of(config) -> dict:
    d, a, w = config.data, config.algorithm, config.worker
    return {"n": w.rollout.n, "prompts_per_step": d.rollout_batch_size, "max_response_length": d.max_response_length,
            "max_prompt_length": d.max_prompt_length, "dtype": w.actor.model.dtype,
            "micro_batch_update": w.actor.micro_batch_size_per_device_for_update,
            "micro_batch_experience": w.actor.micro_batch_size_per_device_for_experience,
            "gradient_checkpointing": w.actor.model.enable_gradient_checkpointing,
            "freeze_vision_tower": w.actor.model.freeze_vision_tower, "kl_coef": a.kl_coef, "kl_penalty": a.kl_penalty,
            "loss_agg_mode": a.loss_agg_mode, "edits": w.rollout.extractor or a.force_gt_num > 0,
            "rewards": [f.name for f in w.reward.functions] or ["say_word_reward"],
            "min_pixels": d.min_pixels, "max_pixels": d.max_pixels}


def _yaml_values(items: list[str]) -> dict:
    import yaml

    return {k.strip(): yaml.safe_load(v) for k, v in (item.split("=", 1) for item in items)}


def _record(entry: dict, label: str, result: dict | None, error: str | None) -> bool:
    """Store a run's result (or its failure); True when it failed."""
    if error:
        print("failed", flush=True)
        print(f"[bench] {label}: {error}", flush=True)
        entry["runs"][label] = {"error": error}
        return True
    result["summary"] = summarize(result)
    s = result["summary"]
    print(f"{_fmt(s['step_s'], '.2f')} s/step, {_fmt(s['tokens_per_s'], '.0f')} tokens/s", flush=True)
    entry["runs"][label] = result
    return False


def _compare(name: str, entry: dict) -> None:
    """Each grouprl run's tokens/s against TRL's and (editgrpo-3b) against the 1,800 tokens/s aim."""
    trl = next((r for label, r in entry["runs"].items() if label.startswith("TRL") and "summary" in r), None)
    trl_rate = trl["summary"]["tokens_per_s"] if trl else None
    for label, run in entry["runs"].items():
        if "summary" not in run or label.startswith("TRL"):
            continue
        rate = run["summary"]["tokens_per_s"]
        run["vs_trl"] = rate / trl_rate if rate and trl_rate else None
        run["vs_aim"] = rate / AIM_TOKENS_PER_S if rate and name == "editgrpo-3b" else None
        run["meets_aims"] = {"tokens_per_s": run["vs_aim"] >= 1.0 if run["vs_aim"] is not None else None,
                             "vs_trl": run["vs_trl"] >= AIM_VS_TRL if run["vs_trl"] is not None else None}


if __name__ == "__main__":
    sys.exit(main())
