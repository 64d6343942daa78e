"""`grouprl demo --flow --quick` runs the whole pipeline: pretraining, Flow-GRPO-Fast, held-out evaluation."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from grouprl.cli import main  # noqa: E402
from grouprl.domains.diffusion import demo  # noqa: E402


def test_quick_flow_demo_end_to_end(tmp_path, capsys, monkeypatch):
    # each evaluation records the transformer it sampled with, so the rows can be traced to the models
    real, seen = demo.evaluate, []

    def evaluate(model, prompts, **kwargs):
        seen.append(model.transformer)
        return real(model, prompts, **kwargs)

    monkeypatch.setattr(demo, "evaluate", evaluate)
    out = tmp_path / "flow"
    assert main(["demo", "--flow", "--quick", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    n = len(summary["held_out_prompts"])
    for row in ("pretrained", "flow_grpo_fast"):
        assert len(summary[row]["scores"]) == n and all(0.0 <= s <= 1.0 for s in summary[row]["scores"])
        assert summary[row]["mean_reward"] == pytest.approx(sum(summary[row]["scores"]) / n)
    # the second evaluation sampled with the trained (LoRA) transformer, the first with the pretrained one
    from peft import PeftModel

    assert len(seen) == 2 and not isinstance(seen[0], PeftModel) and isinstance(seen[1], PeftModel)
    # held-out prompts are combinations the training prompts never use
    train = {json.loads(x)["prompt"] for x in (out / "data" / "train_prompts.jsonl").read_text().splitlines()}
    assert not set(summary["held_out_prompts"]) & train
    metrics = [json.loads(x) for x in (out / "flow_grpo_fast" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, summary["sizes"]["grpo_steps"] + 1))
    assert all("rewards/shapes/mean" in m for m in metrics)
    assert summary["pretrain_loss_last20"] < summary["pretrain_loss_first"]
    for png in ("samples.png", "reward_curve.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out.replace("\n", "")
    assert "Flow-GRPO-Fast" in printed and "summary.json" in printed
    # the quick run is small, not degenerate: the pretrained model already draws what many prompts ask
    assert summary["pretrained"]["mean_reward"] > 0.3
    # and it says what it is, and what the full run shows
    assert " ".join(printed.split()).count("--quick is the demo made small") == 1


def test_flow_demo_is_its_own_demo(tmp_path, capsys):
    assert main(["demo", "--flow", "--guided", "--quick", "--out", str(tmp_path / "x")]) == 2
    assert "choose one" in capsys.readouterr().err


def test_flow_compare_trains_nft_for_the_time_fast_took(tmp_path, capsys, monkeypatch):
    """`grouprl demo --flow --compare` (made smaller still): Flow-GRPO-Fast, then DiffusionNFT from the same
    pretrained model with trainer.max_wall_seconds = Fast's training seconds; one table, one grid, two curves."""
    import yaml

    monkeypatch.setattr(demo, "QUICK", dict(pretrain_steps=100, pretrain_batch=8, pairs=256, grpo_steps=3,
                                            prompts_per_step=2, n=4, held_out=8))
    out = tmp_path / "cmp"
    assert main(["demo", "--compare", "--flow", "--quick", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    fast, nft = summary["flow_grpo_fast"], summary["diffusion_nft"]
    for run in (fast, nft):
        assert len(run["scores"]) == 8 and run["mean_reward"] == pytest.approx(sum(run["scores"]) / 8)
        assert run["images_per_s"] == pytest.approx(run["steps"] * 2 * 4 / run["seconds"])
    assert fast["steps"] == 3 and nft["steps"] >= 1
    saved = yaml.safe_load((out / "diffusion_nft" / "config.yaml").read_text())
    assert saved["algorithm"]["name"] == "diffusion_nft" and saved["worker"]["rollout"]["noise_level"] == 0.0
    assert saved["trainer"]["max_wall_seconds"] == pytest.approx(fast["seconds"])
    assert saved["worker"]["actor"]["model"]["model_path"] == str(out / "pretrained_model")
    nft_steps = [json.loads(x)["step"] for x in (out / "diffusion_nft" / "metrics.jsonl").read_text().splitlines()]
    assert nft_steps == list(range(1, nft["steps"] + 1))
    assert (out / "samples.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["reward_curve"] is None  # too few steps for a curve (the full run draws both)
    printed = " ".join(capsys.readouterr().out.split())
    assert "DiffusionNFT" in printed and "Flow-GRPO-Fast" in printed and "images/s" in printed


@pytest.mark.parametrize("model, family", [("flux", "FluxFlowModel"), ("qwen-image", "QwenImageFlowModel")])
def test_the_flow_demo_runs_on_another_familys_stand_in(tmp_path, capsys, monkeypatch, model, family):
    """`--model flux|qwen-image`: the same demo (pretraining, Flow-GRPO-Fast, held-out evaluation) on a tiny
    pixel-space stand-in of that family, at sizes far below --quick's."""
    real, seen = demo.evaluate, []

    def evaluate(model_, prompts, **kwargs):
        seen.append(type(model_).__name__)
        return real(model_, prompts, **kwargs)

    monkeypatch.setattr(demo, "evaluate", evaluate)
    monkeypatch.setattr(demo, "QUICK", dict(pretrain_steps=4, pretrain_batch=4, pairs=8, grpo_steps=2,
                                             prompts_per_step=2, n=2, held_out=2))
    out = tmp_path / model
    assert main(["demo", "--flow", "--quick", "--model", model, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == model and seen == [family, family]
    metrics = [json.loads(x) for x in (out / "flow_grpo_fast" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    import yaml

    config = yaml.safe_load((out / "flow_grpo_fast" / "config.yaml").read_text())
    assert config["worker"]["actor"]["model"]["max_sequence_length"] == demo.PROMPT_TOKENS
    printed = " ".join(capsys.readouterr().out.split())
    assert demo.MODELS[model][0] in printed and "The full run" not in printed


def test_the_model_option_belongs_to_the_flow_demo(tmp_path, capsys):
    assert main(["demo", "--quick", "--model", "flux", "--out", str(tmp_path / "x")]) == 2
    assert "--model is an option of the --flow demo" in capsys.readouterr().err
