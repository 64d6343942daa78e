"""DiffusionNFT in the flow trainer (``algorithm.name: diffusion_nft``): ODE samples from the old adapter,
the loss on fresh noisings of the clean samples equal to the paper's equations, the old adapter following
the trained one with NVlabs' decay, checkpoints holding it and an exact resume."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

import grouprl.domains.diffusion.trainer as flow_trainer  # noqa: E402
from grouprl.config import ConfigError  # noqa: E402
from grouprl.domains.diffusion.trainer import OLD_ADAPTER, DiffusionNFTTrainer  # noqa: E402

NFT = {"algorithm.name": "diffusion_nft", "algorithm.kl_coef": 0.0, "worker.rollout.noise_level": 0.0,
       "worker.rollout.guidance_scale": 1.0, "algorithm.timestep_fraction": 0.5}


def adapter(trainer, name: str) -> dict[str, torch.Tensor]:
    """One adapter's tensors, keyed by their name with the adapter's name taken out."""
    return {k.replace(f".{name}.", "."): v.detach().clone() for k, v in trainer.policy.named_parameters()
            if "lora_" in k and f".{name}." in k}


def test_nft_samples_with_the_old_adapter_and_trains_the_other(flow_config, tmp_path, monkeypatch, read_jsonl):
    trainer = DiffusionNFTTrainer(flow_config(tmp_path / "run", **NFT))
    start_default, start_old = adapter(trainer, "default"), adapter(trainer, OLD_ADAPTER)
    assert all(torch.equal(start_default[k], start_old[k]) for k in start_default)  # the old policy starts as a copy
    active, real_sample = [], flow_trainer.sample

    def spy(model, *args, **kwargs):
        active.append((list(trainer.policy.active_adapters), kwargs["noise_level"], tuple(kwargs.get("sde_steps", ()))))
        return real_sample(model, *args, **kwargs)

    monkeypatch.setattr(flow_trainer, "sample", spy)
    trainer.train()
    # 2 steps x 8 images in sampler calls of 3 with the old adapter and the ODE; validation (step 2) the trained one
    assert active == [([OLD_ADAPTER], 0.0, ())] * 6 + [(["default"], 0.0, ())]
    assert trainer.policy.active_adapters == ["default"]
    grads = {k for k, p in trainer.policy.named_parameters() if p.requires_grad}
    assert grads and all(".default." in k for k in grads)
    after = adapter(trainer, "default")
    assert any(not torch.equal(start_default[k], after[k]) for k in after)
    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "actor/pg_loss" in m]
    assert len(metrics) == 2 and all(m["rollout/trained_steps"] == 2 for m in metrics)  # int(4 x 0.5) times
    assert all("actor/old_deviation" in m and "actor/old_policy_decay" in m for m in metrics)


@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_the_trainers_loss_is_the_papers_equations(flow_config, tmp_path, kl_coef):
    """One step's rows through the trainer's loss, against the paper's equations written out here:
    x_t = (1 - t) x0 + t eps, v = eps - x0, r = clip(A, -5, 5) / 10 + 1/2, v_old from the old adapter,
    L = mean over rows of r |v+ - v|^2 + (1 - r) |v- - v|^2 (+ kl_coef |v_theta - v_ref|^2)."""
    from grouprl.domains.diffusion.pipeline import PromptEmbeddings, velocity
    from grouprl.trainer.metrics import StepMetrics
    from grouprl.trainer.update import Normalisers

    beta = 0.3
    trainer = DiffusionNFTTrainer(flow_config(tmp_path / "run", **{
        **NFT, "algorithm.nft.beta": beta, "algorithm.nft.adaptive_weighting": False, "algorithm.kl_coef": kl_coef}))
    with torch.no_grad():  # the two adapters apart, so that v_old is not v_theta
        for name, p in trainer.policy.named_parameters():
            if f".{OLD_ADAPTER}." in name:
                p.add_(0.05 * torch.randn_like(p))
    rollout = trainer.rollout(1, StepMetrics())
    advantages = trainer._advantages(torch.tensor(rollout.rewards.total)) * 10  # some beyond the clip
    batch = trainer._nft_batch(1, rollout, advantages)
    trainer._nft_velocities(batch)
    v_theta, _ = trainer._nft_velocity_fn(trainer.policy, batch)
    loss, _ = trainer._nft_loss_fn(batch, v_theta, None, Normalisers(num_tokens=len(batch), num_seqs=len(batch), norm_len=1.0), StepMetrics())

    x0 = torch.cat([t.final for t in rollout.trajectories])[batch.image]
    t = batch.t.view(-1, 1, 1, 1)
    x_t, v = (1 - t) * x0 + t * batch.noise, batch.noise - x0
    text = PromptEmbeddings(rollout.text.embeds[batch.image], rollout.text.pooled[batch.image])
    with torch.no_grad():
        trainer.policy.set_adapter(OLD_ADAPTER)
        v_old = velocity(trainer.policy, x_t, batch.timestep, text, 1.0)
        trainer.policy.set_adapter("default")
        with trainer.policy.disable_adapter():
            v_ref = velocity(trainer.policy, x_t, batch.timestep, text, 1.0)
    v_th = velocity(trainer.policy, x_t, batch.timestep, text, 1.0)
    r = advantages[batch.image].clamp(-5, 5) / 10 + 0.5
    positive, negative = (1 - beta) * v_old + beta * v_th, (1 + beta) * v_old - beta * v_th
    direct = (r * ((positive - v) ** 2).mean((1, 2, 3)) + (1 - r) * ((negative - v) ** 2).mean((1, 2, 3))).mean()
    direct = direct + kl_coef * ((v_th - v_ref) ** 2).mean((1, 2, 3)).mean()
    assert ((r > 0) & (r < 1)).any() and ((r == 0) | (r == 1)).any() and not torch.equal(v_old, v_th)
    torch.testing.assert_close(loss, direct, rtol=1e-5, atol=1e-7)
    grad, = torch.autograd.grad(loss, [p for p in trainer.policy.parameters() if p.requires_grad][:1])
    want, = torch.autograd.grad(direct, [p for p in trainer.policy.parameters() if p.requires_grad][:1])
    torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-8)


def test_the_old_adapter_follows_the_trained_one_with_the_configured_decay(flow_config, tmp_path, monkeypatch):
    """After each step old <- d old + (1 - d) theta, d = min(max(optimizer steps - flat, 0) rate, ceiling):
    num_minibatches 2 makes 2 optimizer steps per training step, so d = 0 (step 1, 2 - 2 = 0) then 0.2."""
    trainer = DiffusionNFTTrainer(flow_config(tmp_path / "run", **{
        **NFT, "algorithm.nft.decay_flat": 2, "algorithm.nft.decay_rate": 0.1, "algorithm.nft.decay_ceiling": 0.2,
        "trainer.val_freq": -1, "trainer.max_steps": 3}))
    seen, real = [], flow_trainer.update_old_policy

    def spy(old, trained, decay):
        before = [o.detach().clone() for o in old]
        real(old, trained, decay)
        seen.append(decay)
        for b, o, p in zip(before, old, trained):
            torch.testing.assert_close(o, decay * b + (1 - decay) * p.detach(), rtol=0, atol=1e-7)

    monkeypatch.setattr(flow_trainer, "update_old_policy", spy)
    trainer.train()
    assert seen == [0.0, 0.2, 0.2]
    old, trained = adapter(trainer, OLD_ADAPTER), adapter(trainer, "default")
    assert old.keys() == trained.keys() and any(not torch.equal(old[k], trained[k]) for k in old)


def test_checkpoints_hold_the_old_adapter_and_resume_continues_exactly(flow_config, tmp_path, read_jsonl):
    nft = {**NFT, "algorithm.nft.decay_rate": 0.3, "trainer.val_freq": -1, "worker.actor.ema.enabled": True}
    full = DiffusionNFTTrainer(flow_config(tmp_path / "full", **nft, **{"trainer.max_steps": 3}))
    full.train()
    cut = DiffusionNFTTrainer(flow_config(tmp_path / "cut", **nft, **{"trainer.max_steps": 1}))
    cut.train()
    saved = tmp_path / "cut" / "checkpoints" / "global_step_1" / "model" / OLD_ADAPTER / "adapter_model.safetensors"
    assert saved.exists()
    resumed = DiffusionNFTTrainer(flow_config(tmp_path / "cut", **nft, **{"trainer.max_steps": 3,
                                                                       "trainer.resume": "auto"}))
    resumed.train()
    for name in ("default", OLD_ADAPTER):
        a, b = adapter(full, name), adapter(resumed, name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    train = lambda out: [m["reward/mean"] for m in read_jsonl(out / "metrics.jsonl") if "reward/mean" in m]  # noqa: E731
    assert train(tmp_path / "cut") == train(tmp_path / "full")


def test_nft_config_errors_name_the_key(flow_config, tmp_path):
    with pytest.raises(ConfigError, match="trainer.async_mode"):
        flow_config(tmp_path / "a", **NFT, **{"trainer.async_mode": "one_step_off"})
    with pytest.raises(ConfigError, match="algorithm.nft.beta"):
        flow_config(tmp_path / "b", **NFT, **{"algorithm.nft.beta": 0.0})
    with pytest.raises(ConfigError, match="algorithm.nft.decay_ceiling"):
        flow_config(tmp_path / "c", **NFT, **{"algorithm.nft.decay_ceiling": 1.5})
    with pytest.raises(ConfigError, match="leave no time"):
        flow_config(tmp_path / "d", **{**NFT, "algorithm.timestep_fraction": 0.2})
    with pytest.raises(ConfigError, match="worker.rollout.noise_level"):  # Flow-GRPO still needs SDE steps
        flow_config(tmp_path / "e", **{"worker.rollout.noise_level": 0.0})
    flow_config(tmp_path / "f", **{**NFT, "worker.rollout.noise_level": 0.7})  # any sampler: SDE samples too
