"""`grouprl demo --distill`: the tiny report model distilled on-policy from the demo's SFT+GRPO model, from the
same SFT model for the same steps; the held-out table SFT, SFT+GRPO, SFT+distill (at the plumbing sizes)."""

import json

import torch

from grouprl.cli import main


def test_distill_demo_runs_the_demo_first_then_distils_from_its_grpo_model(tmp_path, plumbing_sizes, read_jsonl):
    from grouprl.domains.radiology import demo
    from grouprl.models.loading import load_model_and_processor

    out = tmp_path / "demo"
    assert main(["demo", "--distill", "--quick", "--out", str(out)]) == 0
    summary = json.loads((out / "distill_summary.json").read_text())
    steps = demo.QUICK["grpo_steps"]
    assert summary["teacher"] == str(out / "grpo" / "checkpoints" / f"global_step_{steps}" / "model")
    assert list(summary["models"]) == ["SFT", "SFT+GRPO", "SFT+distill"]
    for row in summary["models"].values():
        assert 0.0 <= row["mean_reward"] <= 3.0
    rows = read_jsonl(out / "distill" / "metrics.jsonl")
    trained = [r for r in rows if "distill/reverse_kl" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))  # as many steps as GRPO
    assert not [k for r in trained for k in r if k.startswith("reward")]  # pure distillation: no reward
    validations = [r["step"] for r in rows if "val/report/finding_f1_micro" in r]
    grpo_validations = [r["step"] for r in read_jsonl(out / "grpo" / "metrics.jsonl")
                        if "val/report/finding_f1_micro" in r]
    assert validations == grpo_validations  # validated at the same steps
    # the student started from the SFT model and moved
    sft, _, _ = load_model_and_processor(str(out / "sft_model"))
    student, _, _ = load_model_and_processor(str(out / "distill" / "checkpoints" / f"global_step_{steps}" / "model"))
    assert any(not torch.equal(a, b) for a, b in zip(sft.state_dict().values(), student.state_dict().values()))
