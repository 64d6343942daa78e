"""grouprl's GRPOTrainer against TRL's GRPOTrainer: throughput and reward at equal settings.

    python benchmarks/bench_vs_trl.py                      # defaults: about 1-2 minutes on 2 CPU cores
    python benchmarks/bench_vs_trl.py --steps 100 --n 8 --prompts-per-step 4 --max-new-tokens 16 \
        --seed 0 --out bench.json

One run builds a tiny Qwen2 causal LM (``grouprl.models.tiny.build_tiny_text_lm``)
and a synthetic task once, into a temporary directory, then trains it from the
same starting weights with each framework, each in its own Python subprocess (so
neither's imports, thread pools or allocator state touch the other), one after
the other, with the same number of torch threads.

The task: prompts such as ``Say apple`` whose answer is ``apple``; the reward is
``difflib.SequenceMatcher(None, completion.strip(), answer).ratio()`` (1.0 for an
exact answer, partial credit for overlap). It is one plain function with TRL's
reward contract, ``f(prompts, completions, answer, **kwargs)``, passed to both
trainers as it is (TRL hands it chat-message completions for chat prompts, grouprl
strings; the function reads either).

Settings matched (grouprl key = TRL ``GRPOConfig`` field):

- model, tokenizer, dtype: the same saved tiny model, float32, CPU
  (``trainer.device=cpu`` = ``use_cpu=True, bf16=False, fp16=False``);
  no gradient checkpointing (TRL's default is on; turned off here)
- prompts: the same records, rendered with the same chat template
  (grouprl EasyR1 ``problem`` -> user turn; TRL conversational ``prompt``);
  their order per epoch is each framework's own seeded shuffle
- group size: ``worker.rollout.n`` = ``num_generations`` (``--n``)
- prompts per step: ``data.rollout_batch_size`` = ``worker.actor.global_batch_size``
  = ``--prompts-per-step``; TRL: ``per_device_train_batch_size`` x
  ``gradient_accumulation_steps`` = ``steps_per_generation`` x the micro-batch =
  prompts x n completions, so one generation batch is one optimizer step
- micro-batch: ``worker.actor.micro_batch_size_per_device_for_update`` =
  ``per_device_train_batch_size`` (``--micro-batch``, default the whole batch)
- one update per rollout: ``worker.actor.ppo_epochs=1`` = ``num_iterations=1``;
  neither computes separate old-policy log-probs (ratio is exactly 1)
- max completion length: ``data.max_response_length`` = ``max_completion_length``
- sampling: temperature 1.0, top-p 1.0, no top-k (``top_k=-1`` = ``top_k=0``),
  stop on ``<|im_end|>`` / ``<|endoftext|>`` (both read the model's EOS list);
  TRL samples with transformers ``generate``, grouprl by default with its
  ``hf_lean`` engine (the same distribution from its own decoding loop;
  ``--engine hf`` samples with ``generate`` too)
- no KL, no reference model: ``algorithm.kl_coef=0`` = ``beta=0.0``
- advantages: ``algorithm.adv_estimator=grpo`` with
  ``norm_adv_by_std_in_grpo=true`` = ``scale_rewards="group"``: (r - group mean)
  / (group std + eps); eps is 1e-6 in grouprl and 1e-4 in TRL (not configurable
  in either; it only matters for groups with near-zero reward spread)
- loss: ``algorithm.policy_loss=vanilla`` (PPO clip) with
  ``algorithm.loss_agg_mode=token-mean`` = ``loss_type="dapo"`` (token losses
  summed over the whole step's batch and divided by its number of response
  tokens); clip ``clip_ratio_low=clip_ratio_high=0.2``, no dual clip =
  ``epsilon=epsilon_high=0.2``, ``delta=None``
- optimizer: AdamW, ``--lr``, betas (0.9, 0.999), weight decay 0, constant
  schedule, no warm-up, gradient clipping at norm 1.0 (``max_grad_norm``)
- no truncated-completion masking, no entropy bonus, no dynamic sampling
- seed: ``trainer.seed`` and ``data.seed`` = ``seed`` and ``data_seed``

What is timed: the wall time from the end of the first (warm-up) step to the end
of the last, inside each framework's own training loop, so it covers generation,
rewards, advantages, the update and each loop's per-step bookkeeping (metrics,
grouprl's rollouts JSONL) for ``--steps - 1`` steps; model loading, trainer
construction, the warm-up step and the final checkpoint are outside it.
samples/s = completions trained on per second. The mean reward is over the
last ``--last-k`` steps; completion lengths are reported too, because a policy
that learns to answer shorter also generates faster.

Each framework runs ``--repeats`` times, in alternating order (A B B A ...), and
its best run's samples/s is reported (the usual way to read a timing on a shared
machine: interference only ever slows a run down); every run's figure is in the
JSON. Torch threads default to 1: a model this small gains nothing from
intra-op parallelism, and multi-threaded timings on a 2-core machine swing by 10x
or more as soon as another process takes a core (OpenMP threads wait on each
other). Pass ``--threads 2`` on an idle machine to compare the two anyway.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = [
    "apple", "river", "stone", "green", "cloud", "seven", "light", "house",
    "tiger", "piano", "water", "chair", "bread", "music", "north", "paper",
]
TEMPLATES = ["Say {w}", "Please say {w}", "Repeat the word {w}", "Answer with {w}"]
INSTALL_HINT = "pip install 'grouprl[bench]'"


def say_word_reward(prompts, completions, answer, **kwargs):
    """Similarity of the completion to the word the prompt asks for, in [0, 1] (TRL reward contract)."""
    scores = []
    for completion, word in zip(completions, answer):
        if not isinstance(completion, str):  # TRL: chat completions are lists of messages
            completion = completion[-1]["content"]
        scores.append(difflib.SequenceMatcher(None, completion.strip(), word).ratio())
    return scores


def records() -> list[dict]:
    return [{"problem": t.format(w=w), "answer": w} for t in TEMPLATES for w in WORDS]


# ---------------------------------------------------------------------------- workers (one per subprocess)


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)


def run_grouprl(spec: dict) -> dict:
    from grouprl.config import config_from_dict
    from grouprl.rewards import RewardSet
    from grouprl.trainer.grpo import GRPOTrainer

    P, n, micro = spec["prompts_per_step"], spec["n"], spec["micro_batch"]
    cfg = {
        "data": {"train_files": [spec["data"]], "max_response_length": spec["max_new_tokens"],
                 "rollout_batch_size": P, "shuffle": True, "seed": spec["seed"]},
        "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True, "policy_loss": "vanilla",
                      "loss_agg_mode": "token-mean", "kl_coef": 0.0},
        "worker": {
            "actor": {"model": {"model_path": spec["model"], "dtype": "float32"},
                      "optim": {"lr": spec["lr"], "betas": [0.9, 0.999], "weight_decay": 0.0,
                                "lr_scheduler_type": "constant", "lr_warmup_ratio": 0.0},
                      "global_batch_size": P, "ppo_epochs": 1, "max_grad_norm": 1.0,
                      "micro_batch_size_per_device_for_update": micro,
                      "micro_batch_size_per_device_for_experience": micro,
                      "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_dual": None},
            "rollout": {"n": n, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "engine": spec["engine"]},
        },
        "trainer": {"output_dir": spec["run_dir"], "max_steps": spec["steps"], "logger": ["jsonl"],
                    "device": "cpu", "seed": spec["seed"], "save_freq": -1, "async_mode": spec["async_mode"]},
    }
    trainer = GRPOTrainer(config_from_dict(cfg), reward_set=RewardSet.from_specs([say_word_reward]))
    ends, rewards, lengths = [], [], []
    step = trainer.step

    def timed_step(i):
        result = step(i)
        ends.append(time.perf_counter())
        values = result.metrics.local()  # one process: its own values are the step's
        rewards.append(values["reward/mean"])
        lengths.append(values["response_length/mean"])
        return result

    trainer.step = timed_step
    trainer.train()
    return {"step_ends": ends, "rewards": rewards, "lengths": lengths}


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    P, n, micro = spec["prompts_per_step"], spec["n"], spec["micro_batch"]
    accumulation = P * n // micro
    rows = [{"prompt": [{"role": "user", "content": r["problem"]}], "answer": r["answer"]} for r in records()]
    # transformers 5 renamed gradient_checkpointing (TRL defaults it to on) to activation_checkpointing
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    no_checkpointing = {"activation_checkpointing" if "activation_checkpointing" in names
                        else "gradient_checkpointing": False}
    args = GRPOConfig(
        output_dir=spec["run_dir"], seed=spec["seed"], data_seed=spec["seed"],
        use_cpu=True, bf16=False, fp16=False, **no_checkpointing,
        num_generations=n, max_completion_length=spec["max_new_tokens"],
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_iterations=1,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        loss_type="dapo", scale_rewards="group", epsilon=0.2, epsilon_high=0.2,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        max_steps=spec["steps"], logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    ends, rewards, lengths = [], [], []

    class Recorder(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                lengths.append(float(logs.get("completions/mean_length", float("nan"))))

    trainer = GRPOTrainer(model=model, reward_funcs=[say_word_reward], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          callbacks=[Recorder()])
    trainer.train()
    return {"step_ends": ends, "rewards": rewards, "lengths": lengths}


def worker_main(framework: str, spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    _set_threads(spec["threads"])
    raw = (run_grouprl if framework == "grouprl" else run_trl)(spec)
    ends = raw["step_ends"]
    if len(ends) != spec["steps"] or len(raw["rewards"]) != spec["steps"]:
        raise RuntimeError(f"{framework}: recorded {len(ends)} step ends and {len(raw['rewards'])} rewards, "
                           f"expected {spec['steps']} of each")
    timed_steps = spec["steps"] - 1
    seconds = ends[-1] - ends[0]
    samples = timed_steps * spec["prompts_per_step"] * spec["n"]
    k = min(spec["last_k"], spec["steps"])
    import torch

    result = {
        "framework": framework,
        "version": _version(framework),
        "torch_threads": torch.get_num_threads(),
        "timed_steps": timed_steps,
        "timed_seconds": seconds,
        "seconds_per_step": seconds / timed_steps,
        "samples_per_s": samples / seconds,
        "reward_last_k": sum(raw["rewards"][-k:]) / k,
        "reward_first_step": raw["rewards"][0],
        "completion_length_mean": sum(raw["lengths"]) / len(raw["lengths"]),
        "rewards": raw["rewards"],
        "completion_lengths": raw["lengths"],
    }
    Path(result_path).write_text(json.dumps(result, indent=2))


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------- driver


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="training steps per framework; the first is warm-up (untimed)")
    p.add_argument("--n", type=int, default=8, help="completions per prompt (group size)")
    p.add_argument("--prompts-per-step", type=int, default=4, help="prompts per step (= one optimizer step)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="max completion length")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="completions per forward/backward (default: the whole step's batch)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in each subprocess (default 1: the tiny model gains nothing from more, "
                        "and multi-threaded timings swing wildly when anything else runs on the machine)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per framework, in alternating order (A B B A ...); samples/s is the best run's")
    p.add_argument("--last-k", type=int, default=10, help="mean reward over the last k steps")
    p.add_argument("--hidden-size", type=int, default=64, help="tiny model width")
    p.add_argument("--layers", type=int, default=2, help="tiny model depth")
    p.add_argument("--frameworks", default="grouprl,trl", help="comma-separated subset of grouprl,trl")
    p.add_argument("--engine", default="hf_lean",
                   help="grouprl's rollout engine (worker.rollout.engine): hf_lean (default: its own decoding loop, "
                        "the fastest for a model this small on a CPU), hf (transformers generate, as TRL samples) "
                        "or hf_static")
    p.add_argument("--async-mode", default="sync", choices=["sync", "async_reward", "one_step_off"],
                   help="grouprl's trainer.async_mode (one_step_off generates the next batch during the update)")
    p.add_argument("--out", default="bench_vs_trl.json", help="where to write the JSON result")
    p.add_argument("--keep", default=None, help="keep the model, data, logs and run directories under this path")
    p.add_argument("--_worker", choices=["grouprl", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--_spec", help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._worker:
        return args
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is an untimed warm-up)")
    if args.n < 2:
        p.error("--n must be at least 2 (group-relative advantages need a group)")
    if args.repeats < 1 or args.threads < 1 or args.last_k < 1:
        p.error("--repeats, --threads and --last-k must be at least 1")
    batch = args.prompts_per_step * args.n
    args.micro_batch = args.micro_batch or batch
    if batch % args.micro_batch:
        p.error(f"--micro-batch ({args.micro_batch}) must divide prompts-per-step x n ({batch})")
    if args.prompts_per_step > len(records()):
        p.error(f"--prompts-per-step must be at most {len(records())}, the dataset size")
    return args


def build_inputs(root: Path, args) -> tuple[Path, Path]:
    from grouprl.models.tiny import build_tiny_text_lm

    recs = records()
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    corpus = [r["problem"] for r in recs] + WORDS
    model = build_tiny_text_lm(root / "model", corpus, seed=args.seed, hidden_size=args.hidden_size,
                               layers=args.layers)
    return data, model


def run_worker(framework: str, spec: dict, root: Path, repeat: int) -> dict:
    tag = f"{framework}.{repeat}"
    spec_path, result_path, log_path = (root / f"{tag}.{x}" for x in ("spec.json", "result.json", "log"))
    spec = {**spec, "run_dir": str(root / f"{tag}_run")}
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", framework, "--_spec", str(spec_path),
           "--_result", str(result_path)]
    print(f"[bench] {framework}: {spec['steps']} steps (run {repeat + 1}) ...", end=" ", flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        print("failed", flush=True)
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"[bench] the {framework} run failed (exit {proc.returncode}); last lines of {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    result["subprocess_wall_s"] = time.perf_counter() - start
    print(f"{result['samples_per_s']:.1f} samples/s, load {os.getloadavg()[0]:.2f}", flush=True)
    return result


def summarize(runs: list[dict]) -> dict:
    best = max(runs, key=lambda r: r["samples_per_s"])
    mean = lambda key: sum(r[key] for r in runs) / len(runs)  # noqa: E731
    return {
        "version": best["version"],
        "torch_threads": best["torch_threads"],
        "samples_per_s": best["samples_per_s"],
        "seconds_per_step": best["seconds_per_step"],
        "samples_per_s_runs": [r["samples_per_s"] for r in runs],
        "reward_last_k": mean("reward_last_k"),
        "reward_first_step": runs[0]["reward_first_step"],
        "completion_length_mean": mean("completion_length_mean"),
        "runs": runs,
    }


def print_table(summary: dict[str, dict], ratio: float | None, args) -> None:
    k = min(args.last_k, args.steps)
    header = (f"{'framework':<10} {'version':<9} {'samples/s':>10} {'s/step':>8} "
              f"{f'reward last {k}':>14} {'reward step 1':>14} {'mean len':>9}")
    print()
    print(header)
    print("-" * len(header))
    for name, r in summary.items():
        print(f"{name:<10} {r['version']:<9} {r['samples_per_s']:>10.1f} {r['seconds_per_step']:>8.3f} "
              f"{r['reward_last_k']:>14.3f} {r['reward_first_step']:>14.3f} {r['completion_length_mean']:>9.2f}")
    if ratio is not None:
        print(f"\nthroughput grouprl / TRL: {ratio:.2f}x")
    print(f"({args.prompts_per_step} prompts x {args.n} completions per step, <= {args.max_new_tokens} new tokens, "
          f"{args.steps} steps, {args.threads} torch thread(s); samples/s = completions per second, best of "
          f"{args.repeats} run(s), first step untimed; rewards averaged over runs)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._worker:
        worker_main(args._worker, args._spec, args._result)
        return 0
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = set(frameworks) - {"grouprl", "trl"}
    if unknown or not frameworks:
        raise SystemExit(f"--frameworks: expected a subset of grouprl,trl; got {args.frameworks!r}")
    if "trl" in frameworks and importlib.util.find_spec("trl") is None:
        raise SystemExit("TRL is not installed, and this benchmark compares grouprl against it. Install it with\n"
                         f"    {INSTALL_HINT}\n(or run only grouprl with --frameworks grouprl)")

    load_at_start = list(os.getloadavg())
    tmp = None
    if args.keep:
        root = Path(args.keep)
        root.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="grouprl_bench_")
        root = Path(tmp.name)
    try:
        print(f"[bench] building the tiny model and data in {root}; load average {load_at_start[0]:.2f}", flush=True)
        data, model = build_inputs(root, args)
        spec = {"data": str(data), "model": str(model), "steps": args.steps, "n": args.n,
                "prompts_per_step": args.prompts_per_step, "max_new_tokens": args.max_new_tokens,
                "micro_batch": args.micro_batch, "lr": args.lr, "seed": args.seed, "threads": args.threads,
                "last_k": args.last_k, "engine": args.engine, "async_mode": args.async_mode}
        runs: dict[str, list[dict]] = {name: [] for name in frameworks}
        for repeat in range(args.repeats):
            # alternate the order so that neither framework always runs on a warmer (or busier) machine
            for name in frameworks if repeat % 2 == 0 else frameworks[::-1]:
                runs[name].append(run_worker(name, spec, root, repeat))
    finally:
        if tmp is not None:
            tmp.cleanup()

    summary = {name: summarize(r) for name, r in runs.items()}
    ratio = None
    if {"grouprl", "trl"} <= summary.keys():
        ratio = summary["grouprl"]["samples_per_s"] / summary["trl"]["samples_per_s"]
    print_table(summary, ratio, args)
    settings = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("out", "keep")}
    out = {
        "settings": settings,
        "machine": {"cpu_count": os.cpu_count(), "load_avg_at_start": load_at_start,
                    "load_avg_at_end": list(os.getloadavg()), "python": sys.version.split()[0],
                    "torch": _version("torch"), "transformers": _version("transformers")},
        "results": summary,
        "ratio_grouprl_over_trl": ratio,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"[bench] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
