"""The moving average of the trained weights (``worker.actor.ema``): its update, validation with it,
checkpoints that hold it and a resume that continues it exactly."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")

from grouprl.domains.diffusion.ema import EMA_FILE, ema_decay, ema_due, ema_update_  # noqa: E402
from grouprl.domains.diffusion.trainer import FlowGRPOTrainer  # noqa: E402

EMA = {"worker.actor.ema.enabled": True, "worker.actor.ema.decay": 0.9}


def trained(trainer) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in trainer.policy.named_parameters() if p.requires_grad}


def test_ema_update_is_the_decayed_mean_and_copies_before_its_start():
    average, param = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, -2.0])}
    ema_update_(average, param, 0.9)
    assert torch.allclose(average["w"], torch.tensor([0.9 * 1 + 0.1 * 3, 0.9 * 2 + 0.1 * -2]))
    ema_update_(average, param, 0.0)
    assert torch.equal(average["w"], param["w"])  # decay 0 copies exactly
    assert [ema_decay(s, decay=0.9, start_step=2) for s in (1, 2, 3, 50)] == [0.0, 0.0, 0.9, 0.9]
    # warmup: min(decay, (1 + n) / (10 + n)), n steps after the start
    assert [ema_decay(s, decay=0.9, start_step=1, warmup=True) for s in (1, 2, 100)] == [0.0, 2 / 11, 0.9]
    assert [s for s in range(1, 9) if ema_due(s, start_step=2, update_interval=3)] == [1, 2, 5, 8]
    with pytest.raises(KeyError):
        ema_update_({"w": torch.zeros(1)}, {"v": torch.zeros(1)}, 0.9)


def test_ema_follows_the_weights_with_the_configured_decay(flow_config, tmp_path):
    trainer = FlowGRPOTrainer(flow_config(tmp_path / "run", **EMA, **{
        "worker.actor.ema.start_step": 1, "trainer.max_steps": 3, "trainer.val_freq": -1, "trainer.save_freq": -1}))
    weights = []  # the weights each update of the average saw
    real = trainer.ema.update

    def noting(step):
        weights.append(trained(trainer))
        return real(step)

    trainer.ema.update = noting
    trainer.train()
    # one update per optimizer step: 3 training steps of num_minibatches 2
    assert len(weights) == 6 == trainer.state.optimizer_steps
    # optimizer step 1 <= start_step: the average is the weights; then ema = 0.9 ema + 0.1 param
    expected = {k: v.clone() for k, v in weights[0].items()}
    for w in weights[1:]:
        for k in expected:
            expected[k].mul_(0.9).add_(w[k], alpha=1 - 0.9)
    assert all(torch.equal(trainer.ema.average[k], expected[k]) for k in expected)
    assert any(not torch.equal(trainer.ema.average[k], weights[-1][k]) for k in expected)  # it lags


def test_validation_samples_with_the_ema_and_puts_the_weights_back(flow_config, tmp_path, monkeypatch):
    import grouprl.domains.diffusion.trainer as flow_trainer

    trainer = FlowGRPOTrainer(flow_config(tmp_path / "run", **EMA, **{"trainer.save_freq": -1}))
    seen = []
    real = flow_trainer.sample

    def watched(model, *args, **kwargs):
        if kwargs.get("noise_level") == 0.0:  # validation: the ODE
            now = trained(trainer)
            seen.append(all(torch.equal(now[k], trainer.ema.average[k]) for k in now))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(flow_trainer, "sample", watched)
    raw = []
    real_update = trainer.ema.update
    trainer.ema.update = lambda step: (real_update(step), raw.append(trained(trainer)))[0]
    trainer.train()
    assert seen and all(seen)  # every validation batch sampled with the average
    after = trained(trainer)
    assert all(torch.equal(after[k], raw[-1][k]) for k in after)  # the raw weights came back, bit for bit
    assert any(not torch.equal(after[k], trainer.ema.average[k]) for k in after)
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["validation_weights"] == "ema"


def test_checkpoints_hold_the_ema_and_resume_continues_it_exactly(flow_config, tmp_path):
    from safetensors.torch import load_file

    ema = {**EMA, "worker.actor.ema.warmup": True, "trainer.val_freq": -1}
    full = FlowGRPOTrainer(flow_config(tmp_path / "full", **ema, **{"trainer.max_steps": 3}))
    full.train()
    cut = FlowGRPOTrainer(flow_config(tmp_path / "cut", **ema, **{"trainer.max_steps": 1}))
    cut.train()
    saved = tmp_path / "cut" / "checkpoints" / "global_step_1"
    on_disk = load_file(str(saved / "model" / EMA_FILE))
    assert on_disk.keys() == cut.ema.average.keys()
    assert all(torch.equal(on_disk[k], cut.ema.average[k]) for k in on_disk)
    assert f"model/{EMA_FILE}" in json.loads((saved / "manifest.json").read_text())["files"]  # written atomically
    resumed = FlowGRPOTrainer(flow_config(tmp_path / "cut", **ema, **{"trainer.max_steps": 3,
                                                                       "trainer.resume": "auto"}))
    resumed.train()
    a, b = full.ema.average, resumed.ema.average
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(v, trained(full)[k]) for k, v in trained(resumed).items())


def test_resuming_a_checkpoint_without_an_average_starts_it_from_the_weights(flow_config, tmp_path):
    plain = {"trainer.val_freq": -1, "trainer.max_steps": 1}
    FlowGRPOTrainer(flow_config(tmp_path / "run", **plain)).train()
    assert not (tmp_path / "run" / "checkpoints" / "global_step_1" / "model" / EMA_FILE).exists()
    resumed = FlowGRPOTrainer(flow_config(tmp_path / "run", **EMA, **plain, **{"trainer.resume": "auto"}))
    with pytest.warns(UserWarning, match="holds no EMA weights"):
        resumed.resume()
    now = trained(resumed)
    assert all(torch.equal(resumed.ema.average[k], now[k]) for k in now)


def starting_share(updates: int, *, warmup: bool, decay: float = 0.9) -> float:
    """The starting weights' share of the average after ``updates`` updates from step 1: prod_s ema_decay(s)
    (each update keeps d of the average, so of the starting weights' part)."""
    share = 1.0
    for step in range(1, updates + 1):
        share *= ema_decay(step, decay=decay, warmup=warmup)
    return share


SD35_RECIPES = ("flow_grpo_sd35m_ocr.yaml", "flow_grpo_fast_sd35m_ocr.yaml", "diffusion_nft_sd35m_ocr.yaml")


@pytest.mark.parametrize("recipe", SD35_RECIPES)
def test_the_sd35_recipes_warm_the_average_up(recipe):
    """Without the warm-up cap the recipes' average (decay 0.9, one update per optimizer step) would still
    hold 35% / 12% of the starting weights after 10 / 20 optimizer steps; with it,
    prod_{n=1..k} (1 + n) / (10 + n) = 10 / C(k + 10, 9): under 0.01% after 10."""
    from math import comb
    from pathlib import Path

    from grouprl.domains.diffusion.config import load_flow_config

    config = load_flow_config(Path(__file__).resolve().parents[2] / "examples" / recipe)
    ema = config.worker.actor.ema
    assert ema.enabled and ema.warmup and ema.decay == 0.9 and ema.start_step == 0 and ema.update_interval == 1
    without = [round(starting_share(steps, warmup=False), 2) for steps in (10, 20)]
    assert without == [0.35, 0.12]
    with_warmup = [starting_share(steps, warmup=True) for steps in (10, 20)]
    assert with_warmup == pytest.approx([10 / comb(k + 10, 9) for k in (10, 20)], rel=1e-9)
    assert with_warmup[0] < 1e-4
