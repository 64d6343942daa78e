"""`grouprl demo --guided --quick`: GRPO and Guided-GRPO from one SFT model, compared (the full demo's numbers are in docs/demos.md)."""

import json
import math

import pytest
import yaml
import torch

from grouprl.domains.reasoning import demo
from grouprl.cli import main


def load_weights(model_dir):
    from grouprl.models.loading import load_model_and_processor

    model, _, _ = load_model_and_processor(str(model_dir))
    return model.state_dict()


def same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def test_quick_guided_demo_compares_grpo_and_guided_grpo_from_one_sft(tmp_path, capsys, monkeypatch):
    # every evaluation is tagged with the call that made it and the weights it saw, so the
    # summary's rows can be traced back to the model they scored
    real_evaluate, seen = demo.evaluate_arithmetic, []

    def evaluate_arithmetic(model, processor, samples, **kwargs):
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return {**real_evaluate(model, processor, samples, **kwargs), "evaluation_call": len(seen) - 1}

    monkeypatch.setattr(demo, "evaluate_arithmetic", evaluate_arithmetic)
    out = tmp_path / "guided"
    assert main(["demo", "--guided", "--quick", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["models"]) == ["SFT", "SFT+GRPO", "SFT+Guided-GRPO"]
    assert summary["verifier"]["backend"] == "rule"
    n_val = summary["held_out_problems"]
    for row in summary["models"].values():
        assert len(row["correct"]) == n_val and row["accuracy"] == sum(row["correct"]) / n_val
        # three evaluations of the same problems: greedy, guided dialogues, pass@3
        assert row["with_verifier"] == sum(row["correct_with_verifier"]) / n_val
        assert row["pass_at_3"] == sum(row["correct_pass_at_3"]) / n_val
    # whether feedback helps the SFT model at all, measured before any RL and printed
    check = summary["feedback_check"]
    assert check["problems"] == n_val and 0 < check["wrong_first_answers"] <= n_val
    assert set(check["fix_rate"]) == set(demo.FEEDBACK_KINDS) and all(0 <= r <= 1 for r in check["fix_rate"].values())

    # both runs start from the one SFT model, with the same seed, prompts and budget; only the verifier differs
    grpo_cfg, guided_cfg = (yaml.safe_load((out / run / "config.yaml").read_text()) for run in ("grpo", "guided"))
    assert guided_cfg["worker"]["rollout"].pop("verifier")["enable"] is True
    assert grpo_cfg["worker"]["rollout"].pop("verifier")["enable"] is False
    # GRPO's steps match Guided-GRPO's policy tokens, at the SFT model's sampled first-turn length
    steps = {run: cfg["trainer"].pop("max_steps") for run, cfg in (("grpo", grpo_cfg), ("guided", guided_cfg))}
    rows_per_step = summary["sizes"]["prompts_per_step"] * summary["sizes"]["n"]
    guided_tokens = summary["training"]["SFT+Guided-GRPO"]["policy_tokens"]
    assert steps["guided"] == summary["sizes"]["grpo_steps"]
    assert steps["grpo"] == max(steps["guided"], round(
        guided_tokens / (rows_per_step * summary["models"]["SFT"]["sampled_tokens_mean"])))
    for run, label in (("grpo", "SFT+GRPO"), ("guided", "SFT+Guided-GRPO")):
        assert summary["training"][label]["steps"] == steps[run]
    for cfg in (grpo_cfg, guided_cfg):
        cfg["trainer"].pop("output_dir"), cfg["trainer"].pop("experiment_name")
    assert grpo_cfg == guided_cfg
    assert grpo_cfg["worker"]["actor"]["model"]["model_path"] == str(out / "sft_model")

    # the summary's rows are the evaluations of the saved models, not one copied
    sft = load_weights(out / "sft_model")
    for run, label in (("grpo", "SFT+GRPO"), ("guided", "SFT+Guided-GRPO")):
        trained = load_weights(out / run / "checkpoints" / f"global_step_{steps[run]}" / "model")
        assert not same_weights(trained, sft)
        assert same_weights(seen[summary["models"][label]["evaluation_call"]], trained)
    assert same_weights(seen[summary["models"]["SFT"]["evaluation_call"]], sft)

    # the guided run's samples were dialogues with the rule verifier; the plain run's were single turns
    rollouts = {run: [json.loads(x) for x in (out / run / "rollouts.jsonl").read_text().splitlines()]
                for run in ("grpo", "guided")}
    assert all("dialogue" not in r for r in rollouts["grpo"])
    assert all(r["dialogue"] and 1 <= r["num_turns"] <= demo.GUIDED_MAX_TURNS for r in rollouts["guided"])
    metrics = [json.loads(x) for x in (out / "guided" / "metrics.jsonl").read_text().splitlines()]
    assert summary["training"]["SFT+Guided-GRPO"]["turns_mean"] == pytest.approx(
        sum(m["multiturn/turns"] for m in metrics) / len(metrics))
    # SFT saw correction dialogues: the slipped answer and the rule verifier's own reply to it
    corrections = [json.loads(x) for x in (out / "data" / "corrections.jsonl").read_text().splitlines()]
    # (step-level: it names the slipped step, tests/reasoning/test_rule_verifier.py)
    assert corrections and all(c["messages"][2]["content"].startswith("Step ") for c in corrections)

    assert (out / "guided_rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    raw = capsys.readouterr().out
    printed = raw.replace("\n", "")  # rich wraps long paths at the console's width
    words = " ".join(raw.split())  # and sentences at spaces
    assert "SFT+Guided-GRPO" in printed and "summary.json" in printed
    assert "does feedback help the SFT model?" in words and check["verdict"] in words
    # the quick run is small, not degenerate: the SFT model answers in the format, and some answers are right
    assert summary["models"]["SFT"]["format_rate"] >= 0.5
    assert any(row["accuracy"] > 0 for row in summary["models"].values())
    # and it says what it is, and what the full run shows
    assert words.count("--quick is the demo made small") == 1


# the seeds' plumbing at the smallest sizes that run every stage: the quick sizes are for people
PLUMBING = dict(train=48, corrections=8, val=12, max_value=10, sft_epochs=1, grpo_steps=1, n=2, prompts_per_step=2)


def test_guided_seeds_report_intervals_and_paired_differences_from_each_seed(tmp_path, capsys, monkeypatch):
    from grouprl.domains.demos.seed_stats import paired_interval, t_interval, verdict

    monkeypatch.setattr(demo, "GUIDED_QUICK", PLUMBING)
    out = tmp_path / "seeds"
    argv = ["demo", "--guided", "--quick", "--seeds", "2", "--seed", "3", "--out", str(out)]
    assert main(argv) == 0
    agg = json.loads((out / "guided_seeds.json").read_text())
    assert agg["seeds"] == [3, 4] and agg["k"] == 2 and agg["reused_seeds"] == []
    seeds = {s: json.loads((out / f"seed_{s}" / "summary.json").read_text()) for s in (3, 4)}
    assert [seeds[s]["seed"] for s in (3, 4)] == [3, 4]
    # every number comes from the seeds' own summaries
    for model in ("SFT", "SFT+GRPO", "SFT+Guided-GRPO"):
        for _, key in demo.GUIDED_METRICS:
            values = [seeds[s]["models"][model][key] for s in (3, 4)]
            row, iv = agg["models"][model][key], t_interval(values)
            assert row["values"] == values and (row["low"], row["high"]) == (pytest.approx(iv.low), pytest.approx(iv.high))
    for better, worse in (("SFT+Guided-GRPO", "SFT+GRPO"), ("SFT+GRPO", "SFT")):
        for _, key in demo.GUIDED_METRICS:
            a, b = ([seeds[s]["models"][m][key] for s in (3, 4)] for m in (better, worse))
            row = agg["paired"][f"{better} - {worse}"][key]
            assert row["values"] == pytest.approx([x - y for x, y in zip(a, b)])
            assert row["verdict"] == verdict(paired_interval(a, b))
    printed = " ".join(capsys.readouterr().out.split())
    assert "paired by seed" in printed and "Guided-GRPO - GRPO" in printed and "GRPO - SFT" in printed

    # run again: both seeds are complete and reused, nothing is trained
    monkeypatch.setattr(demo, "_run_guided_demo", lambda *a, **k: pytest.fail("a complete seed must be reused"))
    assert main(argv) == 0
    assert json.loads((out / "guided_seeds.json").read_text())["reused_seeds"] == [3, 4]
    # a seed directory holding files the demo does not write is refused before anything runs
    (out / "seed_5").mkdir()
    (out / "seed_5" / "notes.txt").write_text("mine")
    assert main(["demo", "--guided", "--quick", "--seeds", "3", "--seed", "3", "--out", str(out)]) == 2
    assert "notes.txt" in capsys.readouterr().err and (out / "seed_5" / "notes.txt").read_text() == "mine"
    assert main(["demo", "--guided", "--quick", "--seeds", "0", "--out", str(out)]) == 2
    assert "--seeds must be at least 1" in capsys.readouterr().err


def test_seed_summaries_reuse_a_complete_seed_and_rerun_an_interrupted_one_clean(tmp_path):
    from rich.console import Console

    (tmp_path / "seed_0").mkdir()
    (tmp_path / "seed_0" / "summary.json").write_text(json.dumps({"seed": 0}))
    (tmp_path / "seed_1" / "grpo").mkdir(parents=True)
    (tmp_path / "seed_1" / "grpo" / "metrics.jsonl").write_text("{}\n")  # an interrupted run's log
    (tmp_path / "seed_1" / "notes.txt").write_text("not the demo's")
    ran = []

    def run(seed_dir, seed):
        ran.append((seed, sorted(p.name for p in seed_dir.iterdir())))
        (seed_dir / "summary.json").write_text(json.dumps({"seed": seed}))

    summaries, reused = demo.seed_summaries(tmp_path, {0: "complete", 1: "incomplete", 2: "new"},
                                            lambda d, s: (d.mkdir(exist_ok=True), run(d, s)), {"grpo"},
                                            Console(file=None, quiet=True))
    assert reused == [0] and summaries == {0: {"seed": 0}, 1: {"seed": 1}, 2: {"seed": 2}}
    # the interrupted seed's own entries went before it ran again; what the demo does not write stayed
    assert ran == [(1, ["notes.txt"]), (2, [])]
