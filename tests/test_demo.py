"""`grouprl demo --quick` runs the whole pipeline and writes its outputs (the full demo's gain is in the README)."""

import json

from grouprl.cli import main


def test_quick_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for model in ("sft", "sft_grpo"):
        for key in ("mean_reward", "finding_f1_micro", "finding_f1_macro", "finding_f1_per_sample"):
            assert 0.0 <= summary[model][key] <= 1.0
    assert summary["grpo_improved_finding_f1"] == (summary["sft_grpo"]["finding_f1_micro"] > summary["sft"]["finding_f1_micro"])
    png = out / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == summary["sizes"]["grpo_steps"]
    printed = capsys.readouterr().out
    assert "SFT+GRPO" in printed and "summary.json" in printed
    # the demo data went through the real loader in LLaVA format, with images on disk
    assert (out / "data" / "train" / "data.json").exists() and list((out / "data" / "train" / "images").glob("*.png"))


def test_quick_compare_trains_three_variants_from_one_sft(tmp_path):
    out = tmp_path / "cmp"
    assert main(["demo", "--quick", "--compare", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["models"]) == ["SFT", "SFT+GRPO", "SFT+Dr.GRPO", "SFT+EditGRPO"]
    assert (out / "compare_rewards.png").read_bytes()[:4] == b"\x89PNG"
    edit_metrics = [json.loads(x) for x in (out / "editgrpo" / "metrics.jsonl").read_text().splitlines()]
    assert all("edits/edit_rate" in m for m in edit_metrics)
    drgrpo = (out / "drgrpo" / "config.yaml").read_text()
    assert "seq-mean-token-sum-norm" in drgrpo and "norm_adv_by_std_in_grpo: false" in drgrpo
