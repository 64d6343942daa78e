"""Flow validation over k images per prompt (val/.../mean@k, best@k, worst@k, pass@k, per data source) and
the task metrics named in trainer.val_metrics on the images, with the shapes metric of the flow demo."""

from __future__ import annotations

import json

import numpy as np
import pytest

from grouprl.config import ConfigError
from grouprl.trainer.task_metrics import TASK_METRICS
from grouprl.trainer.val_metrics import prompt_metrics


def pixel_mean(completions, references, *, prompts, prompt_index, **columns):
    """An image metric over the whole set: the mean pixel value of every image, and how many it saw."""
    values = [float(np.asarray(image.convert("RGB"), dtype=np.float64).mean() / 255.0) for image in completions]
    return {"mean": sum(values) / len(values), "images": len(completions), "prompts": len(set(prompt_index)),
            "sourced": sum(s is not None for s in columns["data_source"])}


def test_flow_validation_over_k_images_per_prompt_and_task_metrics(flow_config, tmp_path, read_jsonl, monkeypatch):
    from grouprl.domains.diffusion.trainer import FlowGRPOTrainer

    monkeypatch.setitem(TASK_METRICS, "pixel_mean", pixel_mean)
    val = tmp_path / "val.jsonl"
    prompts = ["a red square on the left", "a blue square on the right", "two green squares on the left"]
    val.write_text("".join(json.dumps({"prompt": p, "data_source": s}) + "\n" for p, s in zip(prompts, "aba")))
    threshold = 0.1
    run = tmp_path / "run"
    config = flow_config(run, **{"data.val_files": [str(val)], "data.val_batch_size": 2, "trainer.max_steps": 1,
                                 "trainer.val_freq": 1, "trainer.save_freq": -1, "trainer.val_generations_to_log": 100,
                                 "trainer.val_metrics": ["pixel_mean", "shapes"], "worker.rollout.val_n": 3,
                                 "worker.reward.functions": [{"name": "image_brightness", "threshold": threshold}]})
    trainer = FlowGRPOTrainer(config)
    trainer.train()
    line = next(m for m in read_jsonl(run / "metrics.jsonl") if "val/reward/mean" in m)
    scores = [g["score"] for g in read_jsonl(run / "val_generations.jsonl")]
    assert len(scores) == 9
    by_prompt = [scores[i * 3:(i + 1) * 3] for i in range(3)]
    assert all(len(set(s)) == 3 for s in by_prompt)  # each image from its own noise
    per_prompt = [prompt_metrics(s, 3, threshold) for s in by_prompt]
    for metric in ("mean@3", "best@3", "worst@3", "pass@3"):
        expected = np.mean([p[metric] for p in per_prompt])
        assert line[f"val/rewards/image_brightness/{metric}"] == pytest.approx(expected, abs=1e-9)
        assert f"val/rewards/image_brightness/{metric}_se" in line
    assert line["val/reward/best@3"] == pytest.approx(np.mean([p["best@3"] for p in per_prompt]), abs=1e-9)
    assert line["val/b/reward/mean@3"] == pytest.approx(np.mean(by_prompt[1]), abs=1e-9)
    assert line["val/a/reward/mean@3"] == pytest.approx(np.mean(by_prompt[0] + by_prompt[2]), abs=1e-9)
    # the task metrics saw every image of the whole set at once: the brightness reward is the pixel mean
    assert line["val/pixel_mean/mean"] == pytest.approx(np.mean(scores), abs=1e-6)
    assert (line["val/pixel_mean/images"], line["val/pixel_mean/prompts"], line["val/pixel_mean/sourced"]) == (9, 3, 9)
    assert 0 <= line["val/shapes/mean_reward"] <= 1 and 0 <= line["val/shapes/pass_rate"] <= 1
    # reproducible from val_seed: the same weights give the same images again
    again = trainer.validate(1).metrics.local()
    assert again["rewards/image_brightness/best@3"] == line["val/rewards/image_brightness/best@3"]


def test_flow_config_checks_val_n_and_val_metrics(flow_config, tmp_path):
    with pytest.raises(ConfigError, match="worker.rollout.val_n"):
        flow_config(tmp_path, **{"worker.rollout.val_n": 0})
    with pytest.raises(ConfigError, match=r"'trainer.val_metrics'.*did you mean shapes"):
        flow_config(tmp_path, **{"trainer.val_metrics": ["shape"]})


def test_the_shapes_metric_is_the_demo_tables_numbers():
    from grouprl.domains.diffusion.shapes import render, shapes_metric, shapes_reward
    from PIL import Image

    prompts = ["a red square on the left", "two blue squares on the right", "a green square on the left"]
    rng = np.random.default_rng(0)
    images = [render(p, 16, rng) for p in prompts[:2]] + [Image.new("RGB", (16, 16))]
    scores = shapes_reward(images, prompts)
    assert scores[0] > 0.5 and scores[1] > 0.5 and scores[2] == 0
    assert shapes_metric(images, [None] * 3, prompts=prompts) == {"mean_reward": pytest.approx(sum(scores) / 3),
                                                                   "pass_rate": pytest.approx(2 / 3)}
