"""`grouprl demo --guided`: GRPO against Guided-GRPO on synthetic arithmetic, on a laptop CPU.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from grouprl.config import config_from_dict, merge_values
from grouprl.files import read_json_records, write_text_atomic
from grouprl.domains.demos.curves import curve_line, plot_reward_curves


# ---------------------------------------------------------------------------- `grouprl demo --guided`
#
# Guided-GRPO against GRPO on synthetic arithmetic word problems ("a + b - c" and the
# like, grouprl.domains.reasoning.synthetic_math) with a tiny Qwen2 text model: an SFT warm start,
# then both runs from the same SFT model, seed, prompts and budget (steps, prompts and
# samples per step); the guided run's samples are dialogues with the rule verifier
# (at most GUIDED_MAX_TURNS policy turns, every turn trained: full_turn). Both are
# scored by Guided-GRPO's reward and evaluated the same way: single-turn greedy answers
# to held-out problems, no verifier.

# corrections: SFT also sees that many two-turn dialogues (a worked solution with one slip, the rule
# verifier's reply to it, then the right solution), so that the SFT model, like the instruct models
# the seed starts from, can read a verifier's reply; both RL runs start from this one SFT model.
GUIDED_FULL = dict(train=2000, corrections=500, val=500, max_value=10, sft_epochs=4, grpo_steps=40, n=8,
                   prompts_per_step=16)
# --quick: every stage in about a minute of CPU; the SFT model answers in the right format and gets some right
GUIDED_QUICK = dict(train=512, corrections=128, val=64, max_value=10, sft_epochs=8, grpo_steps=6, n=4,
                    prompts_per_step=4)
GUIDED_QUICK_NOTE = (f"--quick is the demo made small ({GUIDED_QUICK['train']} problems, {GUIDED_QUICK['grpo_steps']} RL steps, "
                     f"{GUIDED_QUICK['val']} held-out problems), so a difference of a few problems between rows is "
                     "noise. The full run (grouprl demo --guided, about 10 minutes on 2 CPU cores) does the same on "
                     "500 held-out problems; over two seeds (--seeds 2) neither RL method beats the SFT model or "
                     "the other beyond the noise (see docs/demos.md).")
GUIDED_REWARD = "guided"  # 0.8 accuracy + 0.1 format + 0.1 verifier hallucination score (0.5 without a verifier)
GUIDED_MAX_TURNS = 3
GUIDED_MODEL = dict(hidden_size=128, layers=4, heads=4, kv_heads=2, vocab_size=512)
GUIDED_RESPONSE_TOKENS = 48  # the worked solutions are 25-35 tokens
GUIDED_RUNS = {"grpo": "SFT+GRPO", "guided": "SFT+Guided-GRPO"}


def model_config(model_path: str) -> dict:
    """``worker.actor.model`` for a demo's tiny model at ``model_path`` (float32: CPU)."""
    return {"model_path": model_path, "dtype": "float32"}


def guided_demo_configs(out: Path, data: dict[str, Path], sizes: dict, seed: int) -> tuple[dict, dict, dict]:
    """The SFT, GRPO and Guided-GRPO configs of ``grouprl demo --guided``, as plain dicts."""
    common_data = {"train_files": [str(data["train"])], "val_files": [], "format": "auto",
                   "max_prompt_length": 256, "max_response_length": GUIDED_RESPONSE_TOKENS, "seed": seed}
    trainer = {"logger": ["console", "jsonl"], "seed": seed, "device": "cpu"}
    sft = {
        "data": {**common_data, "train_files": [str(data["train"]), str(data["corrections"])]},
        "worker": {"actor": {"model": model_config(str(out / "init_model")),
                             "optim": {"lr": 3e-3, "weight_decay": 0.0, "lr_scheduler_type": "cosine",
                                       "lr_warmup_ratio": 0.05}}},
        "sft": {"epochs": sizes["sft_epochs"], "batch_size": 32, "micro_batch_size": 32},
        "trainer": {**trainer, "output_dir": str(out / "sft"), "experiment_name": "demo-guided-sft"},
    }
    grpo = {
        "data": {**common_data, "rollout_batch_size": sizes["prompts_per_step"]},
        "algorithm": {"adv_estimator": "grpo", "loss_agg_mode": "token-mean", "kl_coef": 0.0},
        "worker": {
            "actor": {"model": model_config(str(out / "sft_model")),
                      # above ~1e-4 the tiny policy's held-out accuracy falls within 40 steps (5e-4: 0.23 -> 0.06)
                      "optim": {"lr": 3e-5, "weight_decay": 0.0},
                      "global_batch_size": sizes["prompts_per_step"],
                      "micro_batch_size_per_device_for_update": 64,
                      "micro_batch_size_per_device_for_experience": 128},
            "rollout": {"n": sizes["n"], "temperature": 1.0},
            "reward": {"functions": [{"name": GUIDED_REWARD, "weight": 1.0}]},
        },
        "trainer": {**trainer, "output_dir": str(out / "grpo"), "experiment_name": "demo-guided-grpo",
                    "max_steps": sizes["grpo_steps"], "save_freq": -1, "save_limit": 1, "val_freq": -1},
    }
    guided = merge_values(grpo, {
        "worker": {"rollout": {"verifier": {"enable": True, "backend": "rule", "max_turns": GUIDED_MAX_TURNS,
                                            "train_scope": "full_turn"}}},
        "trainer": {"output_dir": str(out / "guided"), "experiment_name": "demo-guided-guided"},
    })
    return sft, grpo, guided


def correction_records(problems, *, seed: int) -> list[dict]:
    """Two-turn SFT dialogues: a slipped solution, the rule verifier's own reply to it, the right solution."""
    import random

    from grouprl.config import VerifierConfig
    from grouprl.domains.reasoning.synthetic_math import correction_record, slip_solution
    from grouprl.domains.reasoning.verifier import RuleVerifier
    from grouprl.rollout.verifier import VerifierRequest

    verifier = RuleVerifier(VerifierConfig(enable=True, backend="rule"))
    records = []
    for i, p in enumerate(problems):
        wrong = slip_solution(p, random.Random(f"{seed}:slip:{i}"))
        reply = verifier.reply_many([VerifierRequest(problem=p.text, reference=p.solution, turns=[wrong])])[0]
        records.append(correction_record(p, i, wrong, reply.text))
    return records


EVAL_TURNS = 3  # the dialogue evaluation's most policy turns, and the k of pass@k beside it


@torch.no_grad()
def evaluate_arithmetic(model, processor, samples, *, max_new_tokens: int = GUIDED_RESPONSE_TOKENS,
                        batch_size: int = 100, seed: int = 0) -> dict:
    """Three evaluations on the same held-out problems:

    - ``accuracy``: single-turn greedy answers (with ``format_rate``, ``correct``);
    - ``with_verifier``: greedy dialogues of at most ``EVAL_TURNS`` turns with the rule verifier, which
      sees the reference (the right answer in the last turn counts): what the model does when guided;
    - ``pass_at_3``: any of ``EVAL_TURNS`` independent samples (temperature 1) right: what as many
      unguided tries give, the baseline the dialogues are to beat (``sampled_tokens_mean``: their
      mean length).
    """
    from grouprl.config import VerifierConfig
    from grouprl.domains.reasoning.exact_match import answer_right, exact_match
    from grouprl.domains.reasoning.verifier import RuleVerifier
    from grouprl.rollout.engine import SamplingParams
    from grouprl.rollout.hf_engine import HFGenerationEngine
    from grouprl.rollout.multiturn import MultiTurnRollout

    def right(sample, response: str) -> bool:
        return answer_right(response, sample.answer)

    engine = HFGenerationEngine(model, processor)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, seed=seed)
    sampled = SamplingParams(n=EVAL_TURNS, temperature=1.0, max_new_tokens=max_new_tokens, seed=seed + 1)
    verifier_config = VerifierConfig(enable=True, backend="rule", max_turns=EVAL_TURNS)
    dialogues = MultiTurnRollout(RuleVerifier(verifier_config), processor, verifier_config,
                                 end_of_turn_ids=list(engine.eos_token_ids))
    responses, guided, any_of_k, sampled_tokens = [], [], [], []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        responses.extend(engine.generate(chunk, greedy).responses)
        guided.extend(right(s, r) for s, r in zip(chunk, dialogues.generate(engine, chunk, greedy).responses))
        tries = engine.generate(chunk, sampled)
        sampled_tokens.extend(tries.response_mask.sum(dim=1).tolist())
        any_of_k.extend(any(right(s, r) for r in tries.responses[i * EVAL_TURNS:(i + 1) * EVAL_TURNS])
                        for i, s in enumerate(chunk))
    correct = [right(s, r) for s, r in zip(samples, responses)]
    return {
        **exact_match(responses, [s.answer for s in samples]),  # accuracy, format_rate: the validation metric
        "with_verifier": sum(guided) / len(samples),
        "pass_at_3": sum(any_of_k) / len(samples),
        "sampled_tokens_mean": sum(sampled_tokens) / len(sampled_tokens),  # of the pass@3 samples
        "correct": correct,
        "correct_with_verifier": guided,
        "correct_pass_at_3": any_of_k,
        "sample_ids": [s.id for s in samples],
        "examples": [{"problem": s.prompt_text(), "reference": s.answer, "generated": r}
                     for s, r in list(zip(samples, responses))[:3]],
    }


# a reply that says only that the answer is wrong: what the verifier's hint is measured against
TRY_AGAIN = "That is not right. Try again."
FEEDBACK_SAMPLES = 4  # second turns sampled per wrongly answered problem, for each kind of feedback
FEEDBACK_KINDS = ("verifier hint", "try again", "resample")


@torch.no_grad()
def feedback_check(model, processor, samples, *, k: int = FEEDBACK_SAMPLES, seed: int = 0,
                   max_new_tokens: int = GUIDED_RESPONSE_TOKENS) -> dict:
    """Whether feedback helps ``model`` at all, before any RL: on the problems whose greedy first
    answer is wrong, the share of ``k`` sampled second turns (temperature 1, as in training) that are
    right after the rule verifier's reply ("verifier hint"), after a content-free "That is not right.
    Try again." ("try again"), and of ``k`` independent samples of the first turn ("resample").

    Guided-GRPO can only beat GRPO through what the verifier says: if the hint fixes no more than
    "try again" or a fresh sample, a comparison of the two cannot show the verifier's effect.
    ``verdict`` says which, with the difference against twice its standard error (the k samples of
    one problem are not independent, so it is a lower bound on the noise)."""
    from grouprl.config import VerifierConfig
    from grouprl.domains.reasoning.exact_match import answer_right
    from grouprl.domains.reasoning.verifier import RuleVerifier
    from grouprl.rollout.engine import EncodedPrompt, SamplingParams
    from grouprl.rollout.hf_engine import HFGenerationEngine
    from grouprl.rollout.multiturn import problem_text, turn_boundary_ids
    from grouprl.rollout.verifier import VerifierRequest

    def right(sample, response: str) -> bool:
        return answer_right(response, sample.answer)

    engine = HFGenerationEngine(model, processor)
    first = engine.generate(samples, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, seed=seed))
    wrong = [i for i, (sample, response) in enumerate(zip(samples, first.responses)) if not right(sample, response)]
    result = {"problems": len(samples), "wrong_first_answers": len(wrong), "samples_per_problem": k}
    if not wrong:
        return {**result, "fix_rate": {}, "verdict": "every first answer is right: nothing to fix"}
    wrong_samples = [samples[i] for i in wrong]
    verifier = RuleVerifier(VerifierConfig(enable=True, backend="rule"))
    hints = verifier.reply_many([VerifierRequest(problem=problem_text(samples[i]), reference=samples[i].answer,
                                                 turns=[first.responses[i]]) for i in wrong])
    sampling = SamplingParams(n=k, temperature=1.0, max_new_tokens=max_new_tokens, seed=seed + 1)

    def fix_rate(batch) -> float:
        return sum(right(batch.samples[row], r) for row, r in enumerate(batch.responses)) / len(batch.responses)

    def second_turns(messages: list[str]):
        prompts = []
        for i, message in zip(wrong, messages):
            length = int(first.response_mask[i].sum())
            boundary = turn_boundary_ids(processor, message, after_end_of_turn=not bool(first.truncated[i]),
                                         chat_template_kwargs=samples[i].chat_template_kwargs)
            ids = torch.cat([first.prompt_ids[i][first.prompt_mask[i].bool()], first.response_ids[i, :length],
                             torch.tensor(boundary, dtype=torch.long)])
            prompts.append(EncodedPrompt(ids, dict(first.model_inputs[i]) if first.model_inputs else {}))
        return engine.generate(wrong_samples, sampling, prompts=prompts)

    rates = {"verifier hint": fix_rate(second_turns([h.text for h in hints])),
             "try again": fix_rate(second_turns([TRY_AGAIN] * len(wrong))),
             "resample": fix_rate(engine.generate(wrong_samples, sampling))}
    best_other = max(("try again", "resample"), key=rates.get)
    n = len(wrong) * k
    gain = rates["verifier hint"] - rates[best_other]
    se = (sum(r * (1 - r) for r in (rates["verifier hint"], rates[best_other])) / n) ** 0.5
    against = ", ".join(f"{rates['verifier hint'] - rates[other]:+.3f} against {other}"
                        for other in ("try again", "resample"))
    if gain > 2 * se:
        verdict = f"the verifier's hint fixes more wrong answers than either alternative ({against}; 2 SE {2 * se:.3f})"
    else:
        verdict = (f"the verifier's hint fixes no more wrong answers than {best_other} ({against}; 2 SE "
                   f"{2 * se:.3f}): on this model, Guided-GRPO against GRPO cannot show the verifier's effect")
    return {**result, "fix_rate": rates, "hint_gain": gain, "hint_gain_2se": 2 * se, "verdict": verdict,
            "helps": gain > 2 * se}


def training_summary(metrics_file: Path, rows_per_step: int) -> dict:
    """Per-run means over the training steps: reward, and for dialogues, turns and how they ended;
    ``policy_tokens``, the tokens the policy sampled over the run (``rows_per_step`` samples a step)."""
    rows = read_json_records(metrics_file)
    rows = [r for r in rows if r.get("reward/mean") is not None]
    out = {"steps": len(rows), "reward_mean": sum(r["reward/mean"] for r in rows) / len(rows),
           "policy_tokens": round(sum(r["response/policy_tokens/mean"] for r in rows) * rows_per_step),
           "reward_first_5": sum(r["reward/mean"] for r in rows[:5]) / len(rows[:5]),
           "reward_last_5": sum(r["reward/mean"] for r in rows[-5:]) / len(rows[-5:])}
    for key, name in (("multiturn/turns", "turns_mean"), ("multiturn/stop_reason/stop", "stop_rate"),
                      ("multiturn/stop_reason/max_turns", "max_turns_rate"), ("multiturn/stop_reason/length", "length_rate"),
                      ("verifier/failures", "verifier_failures"), ("tools/calls", "tool_calls_per_step"),
                      ("tools/errors", "tool_errors_per_step")):
        values = [r[key] for r in rows if key in r]
        if values:
            out[name] = sum(values) / len(values) if name != "verifier_failures" else sum(values)
    return out


def run_guided_demo(out: str | Path | None = None, *, quick: bool = False, seed: int = 0,
                    seeds: int | None = None) -> dict:
    """SFT, then GRPO and Guided-GRPO from the same SFT model; one table, summary.json, one plot.
    With ``seeds`` K: that run for seeds seed .. seed+K-1 in <out>/seed_<s>/ and the statistics
    over them (``run_guided_seeds``). Default ``out``: runs/demo-guided (runs/demo-guided-quick with ``quick``)."""
    from grouprl.cli import demo_dir

    out = demo_dir(out, "runs/demo-guided", quick)
    if seeds is not None:
        from grouprl.cli import UsageError

        try:  # K >= 1, and no seed directory holds another run's results or foreign files
            statuses = {s: guided_seed_status(Path(out) / f"seed_{s}", s, GUIDED_QUICK if quick else GUIDED_FULL)
                        for s in seed_range(seed, seeds)}
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return run_guided_seeds(out, statuses, quick=quick)
    return _run_guided_demo(out, quick=quick, seed=seed)


# ---------------------------------------------------------------------------- `--guided --seeds K`
#
# The demo repeated over seeds seed .. seed+K-1, each a whole run in <out>/seed_<s>/ (its own
# problems, tiny model, SFT start and RL runs); the models of one seed share data and SFT start,
# so Guided-GRPO against GRPO, and GRPO against SFT, are judged on per-seed differences.

GUIDED_METRICS = [("greedy", "accuracy"), ("guided", "with_verifier"), (f"pass@{EVAL_TURNS}", "pass_at_3")]
GUIDED_ORDER = [GUIDED_RUNS["guided"], GUIDED_RUNS["grpo"], "SFT"]  # the seed's claim, best first
# what one seed's run writes; anything else in its directory is not ours to delete
_GUIDED_ENTRIES = {"data", "init_model", "sft", "sft_model", *GUIDED_RUNS, "guided_rewards.png", "summary.json"}


def seed_range(seed: int, seeds: int) -> range:
    if seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {seeds}")
    return range(seed, seed + seeds)


def guided_seed_status(seed_dir: Path, seed: int, sizes: dict) -> str:
    """What ``seed_dir`` holds for this seed (``seed_dir_status``): "new", "complete" (this seed's
    finished run at these sizes) or "incomplete" (an interrupted run, run again from the start);
    a ValueError for another run's results or files the demo does not write."""
    from grouprl.domains.demos.seed_stats import seed_dir_status

    return seed_dir_status(
        seed_dir, wanted={"seed": seed, "sizes": sizes, "model": GUIDED_MODEL},
        describe=lambda summary: {key: summary.get(key) for key in ("seed", "sizes", "model")},
        entries=_GUIDED_ENTRIES)


def seed_summaries(out: Path, statuses: dict[int, str], run: Callable[[Path, int], None], entries: set[str],
                   console) -> tuple[dict[int, dict], list[int]]:
    """Each seed's ``summary.json``, running ``run(seed_dir, seed)`` for the seeds not complete (an
    interrupted one from the start: its ``entries`` removed first, since a fresh trainer appends to the
    logs it finds); and the seeds reused."""
    summaries, reused = {}, []
    for s, status in statuses.items():
        seed_dir = out / f"seed_{s}"
        if status == "complete":
            console.print(f"seed {s}: complete results in {seed_dir}, reused (not run again)")
            reused.append(s)
        else:
            if status == "incomplete":
                console.print(f"seed {s}: an interrupted run in {seed_dir}, run again from the start")
                for entry in seed_dir.iterdir():
                    if entry.name in entries or entry.name.startswith("."):
                        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            run(seed_dir, s)
        summaries[s] = json.loads((seed_dir / "summary.json").read_text())
    return summaries, reused


def run_guided_seeds(out: str | Path, statuses: dict[int, str], *, quick: bool = False) -> dict:
    """Each seed's run (a complete one reused, an interrupted one run again from the start), then each
    model's mean accuracy (three ways) with its 95% t-interval, the paired differences Guided-GRPO -
    GRPO and GRPO - SFT with their verdicts, and guided_seeds.json in ``out``."""
    from rich.console import Console
    from rich.table import Table

    from grouprl.domains.demos.seed_stats import format_difference, format_mean, summarize_seeds

    console = Console()
    out = Path(out)
    t_start = time.perf_counter()
    summaries, reused = seed_summaries(out, statuses, lambda d, s: _run_guided_demo(d, quick=quick, seed=s),
                                       _GUIDED_ENTRIES, console)
    per_seed = {s: {name: {key: row[key] for _, key in GUIDED_METRICS} for name, row in summary["models"].items()}
                for s, summary in summaries.items()}
    metrics = [key for _, key in GUIDED_METRICS]
    stats = summarize_seeds(per_seed, metrics=metrics, order=GUIDED_ORDER)
    k = stats["k"]
    console.rule(f"[bold]{k} seed(s): {', '.join(map(str, stats['seeds']))}")
    if k == 1:
        console.print("one seed: means only; an interval needs at least 2 seeds (--seeds 2 or more)")
    table = Table(title="held-out accuracy, mean over seeds ± the 95% t-interval's half-width")
    table.add_column("model")
    for title, _ in GUIDED_METRICS:
        table.add_column(title, justify="right")
    for name in stats["models"]:
        table.add_row(name, *(format_mean(stats["models"][name][key]) for key in metrics))
    console.print(table)
    pairs = Table(title="paired by seed: the mean difference [95% interval] and its verdict")
    for title in ("difference", "accuracy", "mean, 95% interval", "verdict"):
        pairs.add_column(title, justify="right" if title.startswith("mean") else "left",
                         no_wrap=title != "verdict")
    for pair, rows in stats["paired"].items():
        label = pair.replace("SFT+", "")  # "Guided-GRPO - GRPO": the rows share the SFT start
        for title, key in GUIDED_METRICS:
            pairs.add_row(label, title, format_difference(rows[key]), rows[key]["verdict"])
            label = ""
    console.print(pairs)
    result = {**stats, "metrics": dict(GUIDED_METRICS), "seed_dirs": {s: str(out / f"seed_{s}") for s in statuses},
              "reused_seeds": reused, "wall_seconds": time.perf_counter() - t_start}
    write_text_atomic(out / "guided_seeds.json", json.dumps(result, indent=2))
    console.print(f"summary: {(out / 'guided_seeds.json').resolve()}")
    return result


def _run_guided_demo(out: str | Path = "runs/demo-guided", *, quick: bool = False, seed: int = 0) -> dict:
    """One seed's run: SFT, then Guided-GRPO and GRPO from the same SFT model."""
    from rich.console import Console
    from rich.table import Table

    from grouprl.data import load_samples
    from grouprl.domains.reasoning import synthetic_math as sm
    from grouprl.models.loading import load_model_and_processor
    from grouprl.models.tiny import build_tiny_text_lm
    from grouprl.trainer.grpo import GRPOTrainer
    from grouprl.trainer.sft import run_sft

    from grouprl.cli import DEMO_RESUME_HINT, demo_resumes

    console = Console()
    sizes = GUIDED_QUICK if quick else GUIDED_FULL
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # an earlier run of this command, stopped (Ctrl-C) or finished: its SFT model and checkpoints go on
    resuming = demo_resumes(out, {"demo": "guided", "seed": seed, "sizes": sizes, "model": GUIDED_MODEL},
                            stages=[out / "sft_model", *(out / key / "checkpoints" for key in GUIDED_RUNS)])
    torch.manual_seed(seed)
    t_start = time.perf_counter()

    console.rule("[bold]grouprl demo --guided: arithmetic word problems, GRPO vs Guided-GRPO")
    train = sm.generate_problems(sizes["train"], seed=seed, max_value=sizes["max_value"])
    held_out = sm.generate_problems(sizes["val"], seed=seed + 10_000, max_value=sizes["max_value"],
                                    exclude=[p.key for p in train])
    data = {"train": sm.write_dataset(out / "data" / "train.jsonl", train),
            "corrections": sm.write_records(out / "data" / "corrections.jsonl",
                                            correction_records(train[:sizes["corrections"]], seed=seed)),
            "val": sm.write_dataset(out / "data" / "val.jsonl", held_out)}
    build_tiny_text_lm(out / "init_model", sm.corpus(sizes["max_value"]), seed=seed, **GUIDED_MODEL)
    console.print(f"{len(train)} training and {len(held_out)} held-out problems (no arithmetic shared) and a "
                  f"tiny Qwen2 written under {out}")

    sft_cfg, grpo_cfg, guided_cfg = guided_demo_configs(out, data, sizes, seed)
    console.rule("[bold]1/4 SFT warm start on worked solutions")
    t0 = time.perf_counter()
    if resuming and (out / "sft_model" / "config.json").exists():  # written whole or not at all
        console.print(f"the SFT model of the earlier run is reused: {out / 'sft_model'}")
    else:
        run_sft(config_from_dict(sft_cfg), output_dir=out / "sft_model")
    seconds = {"SFT": time.perf_counter() - t0}

    val = load_samples([str(data["val"])], format="easyr1")
    samples = [val[i] for i in range(len(val))]
    sft_model, processor, _ = load_model_and_processor(str(out / "sft_model"))
    results = {"SFT": evaluate_arithmetic(sft_model, processor, samples)}
    # first, whether feedback helps the SFT model at all; the comparison below means little if not
    feedback = feedback_check(sft_model, processor, samples, seed=seed)
    check = Table(title=f"does feedback help the SFT model? second turns on the {feedback['wrong_first_answers']} "
                        f"of {feedback['problems']} held-out problems its greedy answer gets wrong, "
                        f"{feedback['samples_per_problem']} samples each (temperature 1)")
    for column in ("after", "right"):
        check.add_column(column, justify="left" if column == "after" else "right")
    for kind, rate in feedback["fix_rate"].items():
        check.add_row({"verifier hint": "the rule verifier's hint", "try again": f'"{TRY_AGAIN}"',
                       "resample": "nothing (a new first turn)"}[kind], f"{rate:.3f}")
    console.print(check)
    console.print(feedback["verdict"])
    del sft_model
    curves, training = {}, {}
    rows_per_step = sizes["prompts_per_step"] * sizes["n"]
    # Guided-GRPO first: its dialogues sample several turns per prompt, so GRPO then gets as many steps
    # as match its policy tokens, at the SFT model's sampled first-turn length (the table shows the
    # tokens each run used)
    for i, (key, cfg) in enumerate((("guided", guided_cfg), ("grpo", grpo_cfg))):
        label = GUIDED_RUNS[key]
        if key == "grpo":
            per_step = rows_per_step * results["SFT"]["sampled_tokens_mean"]
            cfg = merge_values(cfg, {"trainer": {"max_steps": max(
                sizes["grpo_steps"], round(training[GUIDED_RUNS["guided"]]["policy_tokens"] / per_step))}})
        console.rule(f"[bold]{i + 2}/4 {label}")
        t0 = time.perf_counter()
        if resuming:
            cfg = merge_values(cfg, {"trainer": {"resume": "auto"}})
        trainer = GRPOTrainer(config_from_dict(cfg))
        trainer.resume_hint = DEMO_RESUME_HINT
        trainer.train()
        seconds[label] = time.perf_counter() - t0
        results[label] = evaluate_arithmetic(trainer.policy, trainer.processor, samples)
        curves[label] = out / key / "metrics.jsonl"
        training[label] = training_summary(curves[label], rows_per_step)
        del trainer
    results = {name: results[name] for name in ("SFT", *GUIDED_RUNS.values())}
    curves = {name: curves[name] for name in GUIDED_RUNS.values()}

    console.rule("[bold]4/4 held-out evaluation")
    table = Table(title=f"held-out arithmetic problems (n={len(samples)}): accuracy three ways",
                  caption=f"greedy = single-turn greedy; guided = greedy dialogues of at most {EVAL_TURNS} turns "
                          f"with the rule verifier, which sees the reference; pass@{EVAL_TURNS} = any of "
                          f"{EVAL_TURNS} samples at temperature 1; format = greedy answers in the boxed format")
    for title in ("model", "greedy", "guided", f"pass@{EVAL_TURNS}", "format"):
        table.add_column(title, justify="left" if title == "model" else "right", no_wrap=True)
    for name, r in results.items():
        table.add_row(name, f"{r['accuracy']:.3f}", f"{r['with_verifier']:.3f}", f"{r['pass_at_3']:.3f}",
                      f"{r['format_rate']:.3f}")
    console.print(table)
    runs = Table(title="the training runs",
                 caption=f"reward = training reward ({GUIDED_REWARD}: 0.8 accuracy + 0.1 format + 0.1 hallucination "
                         "score, 0.5 without a verifier; of the final turn for dialogues), mean of the first 5 -> "
                         f"last 5 steps; turns = policy turns per training dialogue (at most {GUIDED_MAX_TURNS}); "
                         f"tokens = policy tokens sampled; same SFT start and seed, {sizes['prompts_per_step']} "
                         f"prompts x {sizes['n']} samples a step, GRPO as many steps as match Guided-GRPO's tokens")
    for title in ("run", "reward", "turns", "steps", "tokens", "seconds"):
        runs.add_column(title, justify="left" if title == "run" else "right", no_wrap=True)
    runs.add_row("SFT", "", "", "", "", f"{seconds['SFT']:.0f}")
    for name in GUIDED_RUNS.values():
        t = training[name]
        runs.add_row(name, f"{t['reward_first_5']:.3f} -> {t['reward_last_5']:.3f}",
                     f"{t['turns_mean']:.2f}" if "turns_mean" in t else "1", f"{t['steps']}",
                     f"{t['policy_tokens']:,}", f"{seconds[name]:.0f}")
    console.print(runs)
    if quick:
        console.print(GUIDED_QUICK_NOTE)

    png = plot_reward_curves(curves, out / "guided_rewards.png",
                             ylabel=f"mean training reward\n({GUIDED_REWARD}; dialogues: final turn)",
                             title="grouprl demo --guided: GRPO vs Guided-GRPO, arithmetic")
    sft_row, grpo_row, guided_row = (results[k] for k in ("SFT", *GUIDED_RUNS.values()))
    summary = {
        "task": "synthetic arithmetic word problems (grouprl.domains.reasoning.synthetic_math)",
        "reward": GUIDED_REWARD,
        "verifier": {"backend": "rule", "max_turns": GUIDED_MAX_TURNS, "train_scope": "full_turn"},
        "evaluation": (f"held-out problems: single-turn greedy (accuracy), greedy dialogues of at most {EVAL_TURNS} "
                       f"turns with the rule verifier seeing the reference (with_verifier), any of {EVAL_TURNS} "
                       "samples at temperature 1 (pass_at_3)"),
        "held_out_problems": len(samples),
        "sizes": sizes,
        "model": GUIDED_MODEL,
        "seed": seed,
        "models": results,
        "feedback_check": feedback,
        "training": training,
        "seconds": seconds,
        "sft": sft_row,
        "sft_grpo": grpo_row,
        "sft_guided_grpo": guided_row,
        "accuracy": {name: r["accuracy"] for name, r in results.items()},
        "format_rate": {name: r["format_rate"] for name, r in results.items()},
        "guided_turns_mean": training[GUIDED_RUNS["guided"]].get("turns_mean"),
        "guided_minus_grpo_accuracy": guided_row["accuracy"] - grpo_row["accuracy"],
        "wall_seconds": time.perf_counter() - t_start,
        "reward_curve": str(png) if png else None,
    }
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2))
    console.print(curve_line(png, "reward curves", curves))
    from grouprl.report import write_report

    for label, metrics in curves.items():  # each training run's HTML report (grouprl report)
        console.print(f"run report ({label}): {write_report(metrics.parent).resolve()}")
    console.print(f"summary: {(out / 'summary.json').resolve()}")
    return summary
