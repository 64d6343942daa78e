"""EditGRPO's post-rollout edits inside GRPO training, on a tiny VLM and synthetic chest X-rays."""

from __future__ import annotations

import json

from grouprl.config import config_from_dict
from grouprl.trainer.grpo import GRPOTrainer


def test_editgrpo_edits_in_training(cxr_vlm, cxr_data, tmp_path):
    cfg = {
        "data": {"train_files": [str(cxr_data(8, seed=0, format="llava"))], "max_response_length": 10,
                 "rollout_batch_size": 2},
        "algorithm": {"force_gt_num": 1, "norm_adv_by_std_in_grpo": False,
                      "loss_agg_mode": "seq-mean-token-sum-norm"},
        "worker": {"actor": {"model": {"model_path": str(cxr_vlm)}, "global_batch_size": 2},
                   "rollout": {"n": 4, "extractor": True, "extractor_num_para": -1},
                   "reward": {"functions": [{"name": "editgrpo_composite"}]}},
        "trainer": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "logger": ["jsonl"], "device": "cpu",
                    "log_completions": True},
    }
    GRPOTrainer(config_from_dict(cfg)).train()
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["edits/force_gt"] == 1  # force_gt_num=1: one prompt of the step gets its reference
    assert metrics["edits/edit_rate"] > 0
    rollouts = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    forced = [r for r in rollouts if r["edit_operations"] and r["edit_operations"][0]["type"] == "force_gt"]
    assert forced and all(r["response"] == r["reference"] for r in forced)
    assert all(r["edited"] for r in forced)
    completions = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert all((c["log_probs"] is None) == r["edited"] for c, r in zip(completions, rollouts))
