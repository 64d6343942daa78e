"""`grouprl demo --quick` runs the whole pipeline and writes its outputs (the full demo's gain is in docs/demos.md)."""

import json
import math

import pytest
import yaml
import torch

from grouprl.domains.radiology import demo
from grouprl.cli import main


def load_weights(model_dir):
    from grouprl.models.loading import load_model_and_processor

    model, _, _ = load_model_and_processor(str(model_dir))
    return model.state_dict()


def same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def test_quick_demo_end_to_end(tmp_path, capsys, monkeypatch):
    # Each evaluation's result is tagged with the call that made it, and the weights it
    # saw are kept, so the summary's rows can be traced back to the model they scored.
    real_evaluate, seen = demo.evaluate, []

    def evaluate(model, processor, samples, **kwargs):
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return {**real_evaluate(model, processor, samples, **kwargs), "evaluation_call": len(seen) - 1}

    monkeypatch.setattr(demo, "evaluate", evaluate)
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for model in ("sft", "sft_grpo"):
        assert 0.0 <= summary[model]["mean_reward"] <= 3.0  # the sum of three scores in [0, 1]
        for key in ("finding_f1_micro", "finding_f1_macro", "finding_f1_per_sample"):
            assert 0.0 <= summary[model][key] <= 1.0

    # GRPO moved the weights, by small steps (12 Adam steps at lr 1e-4) from the SFT model
    steps = summary["sizes"]["grpo_steps"]
    sft = load_weights(out / "sft_model")
    grpo = load_weights(out / "grpo" / "checkpoints" / f"global_step_{steps}" / "model")
    assert sft.keys() == grpo.keys()
    changed = max((sft[k] - grpo[k]).abs().max().item() for k in sft)
    assert 0.0 < changed < 1e-2
    # and the summary's rows are the evaluations of those two models, not one copied: the SFT row the
    # demo's evaluate of the SFT model, the SFT+GRPO row the GRPO run's own last validation (the
    # validation metric report on its greedy reports), which is exactly what evaluate gives the GRPO model
    assert same_weights(seen[summary["sft"]["evaluation_call"]], sft) and len(seen) == 1
    from grouprl.data import load_samples
    from grouprl.models.loading import load_model_and_processor

    val = load_samples([str(out / "data" / "val" / "data.json")], format="llava")
    grpo_model, processor, _ = load_model_and_processor(str(out / "grpo" / "checkpoints" / f"global_step_{steps}"
                                                            / "model"))
    again = real_evaluate(grpo_model, processor, [val[i] for i in range(len(val))])
    assert {k: summary["sft_grpo"][k] for k in again} == again
    validation = [m for m in map(json.loads, (out / "grpo" / "metrics.jsonl").read_text().splitlines())
                  if "val/report/finding_f1_micro" in m]
    # validated before training and every val_every steps, so that the health alarms can watch the F1
    every = summary["sizes"].get("val_every", steps)
    assert [m["step"] for m in validation] == list(range(0, steps + 1, every))
    assert {k: validation[-1][f"val/report/{k}"] for _, k in demo.TABLE_COLUMNS} == \
        {k: again[k] for _, k in demo.TABLE_COLUMNS}
    # `grouprl validate` on the demo's checkpoint reproduces the held-out table's SFT+GRPO row
    assert main(["validate", str(out / "grpo" / "config.yaml"), "--checkpoint",
                 str(out / "grpo" / "checkpoints" / f"global_step_{steps}"), "--out", str(tmp_path / "val")]) == 0
    validated = json.loads((tmp_path / "val" / "validation.json").read_text())["metrics"]
    assert {k: validated[f"val/report/{k}"] for _, k in demo.TABLE_COLUMNS} == \
        {k: summary["sft_grpo"][k] for _, k in demo.TABLE_COLUMNS}

    # the training curve comes from GRPO's updates: every step had a learning signal and took a step
    metrics = [m for m in map(json.loads, (out / "grpo" / "metrics.jsonl").read_text().splitlines())
               if "reward/mean" in m]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    rollouts = [json.loads(x) for x in (out / "grpo" / "rollouts.jsonl").read_text().splitlines()]
    per_step = summary["sizes"]["prompts_per_step"] * summary["sizes"]["n"]
    for m in metrics:
        step_rollouts = [r for r in rollouts if r["step"] == m["step"]]
        assert len(step_rollouts) == per_step
        assert m["reward/mean"] == pytest.approx(sum(r["score"] for r in step_rollouts) / per_step)
        assert m["reward/std"] > 0 and any(abs(r["advantage"]) > 0 for r in step_rollouts)
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0 and m["actor/lr"] > 0

    png = out / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and summary["reward_curve"] == str(png)
    printed = capsys.readouterr().out
    assert "SFT+GRPO" in printed and "summary.json" in printed
    # the quick run is small, not degenerate: the SFT model writes reports that score, and the GRPO
    # model's row differs from it
    for model in ("sft", "sft_grpo"):
        assert summary[model]["mean_words"] >= 5 and summary[model]["mean_reward"] > 0.3
    assert any(summary["sft"][key] != summary["sft_grpo"][key] for _, key in demo.TABLE_COLUMNS)
    # and it says what it is, and what the full run shows
    assert " ".join(printed.split()).count("--quick is the demo made small") == 1
    # the demo data went through the real loader in LLaVA format, with images on disk
    assert (out / "data" / "train" / "data.json").exists() and list((out / "data" / "train" / "images").glob("*.png"))


def test_quick_compare_trains_four_variants_from_one_sft(tmp_path, plumbing_sizes):
    out = tmp_path / "cmp"
    assert main(["demo", "--quick", "--compare", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["models"]) == ["SFT", "SFT+GRPO", "SFT+Dr.GRPO", "SFT+EditGRPO", "SFT+GDPO"]
    # the model it built is recorded, so `--seeds` never reuses a seed run with another model
    assert summary["model"] == demo.DEMO_MODEL == {"vocab_size": 1024}
    assert (out / "compare_rewards.png").read_bytes()[:4] == b"\x89PNG"
    edit_metrics = [json.loads(x) for x in (out / "editgrpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in edit_metrics if not any(k.startswith("val/") for k in m)]  # the validation has its own rows
    assert steps and all("edits/edit_rate" in m for m in steps)
    drgrpo = (out / "drgrpo" / "config.yaml").read_text()
    assert "seq-mean-token-sum-norm" in drgrpo and "norm_adv_by_std_in_grpo: false" in drgrpo
    # GDPO: the composite's three parts trained as three rewards, each normalised on its own, and logged so
    gdpo = [json.loads(x) for x in (out / "gdpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in gdpo if "reward/mean" in m]
    assert steps and "multi_objective_aggregation: normalize_then_sum" in (out / "gdpo" / "config.yaml").read_text()
    for part in ("radgraphf1", "cxb14micro", "ratescore"):
        assert all(f"advantages/{part}/std" in m and f"rewards/{part}/mean" in m for m in steps), part


def test_guided_and_compare_are_separate_demos(tmp_path, capsys):
    assert main(["demo", "--guided", "--compare", "--quick", "--out", str(tmp_path / "x")]) == 2
    assert "--guided and --compare" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
