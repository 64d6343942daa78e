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
