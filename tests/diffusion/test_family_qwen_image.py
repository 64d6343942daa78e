"""Qwen-Image as a flow model family (grouprl.domains.diffusion.families.qwen_image) on tiny stand-ins built
offline: loading through the family registry, prompts as the pipeline encodes them (padded with their mask),
the pipeline's own sampling reproduced by grouprl's sampler (conditioning, true CFG, timesteps, the dynamic
shift), images through the VAE as the pipeline decodes them, and the flow trainer (Flow-GRPO, Fast,
GRPO-Guard, DiffusionNFT, resume, one-step-off, async reward) on the pixel-space stand-in; the example
recipe's settings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from grouprl.domains.diffusion.families.qwen_image import (  # noqa: E402
    LORA_TARGETS,
    NEGATIVE_PROMPT,
    QwenImageConditioning,
    QwenImageFlowModel,
    build_tiny_qwen_image_pipeline,
)
from grouprl.domains.diffusion.models import load_flow_model  # noqa: E402
from grouprl.domains.diffusion.pipeline import sample  # noqa: E402

PROMPTS = ["a red square on the left", "two blue circles at the top of the picture"]
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "flow_grpo_qwen_image.yaml"


@pytest.fixture(scope="session")
def qwen_vae_dir(tmp_path_factory):
    """A tiny QwenImagePipeline with its VAE: 16 x 16 images, 8 x 8 latents of 4 channels."""
    return build_tiny_qwen_image_pipeline(tmp_path_factory.mktemp("qwen_vae") / "model", vae=True)


@pytest.fixture(scope="session")
def qwen_pixel_dir(tmp_path_factory):
    """The pixel-space stand-in (VAE null): 8 x 8 RGB images, 12 packed channels."""
    return build_tiny_qwen_image_pipeline(tmp_path_factory.mktemp("qwen_pixel") / "model", vae=False)


@pytest.fixture(scope="session")
def qwen_vae(qwen_vae_dir):
    return load_flow_model(qwen_vae_dir, max_sequence_length=32)


# ---------------------------------------------------------------- loading and conditioning


def test_loading_gives_the_family_and_the_pipelines_prompt_encoding(qwen_vae):
    model = qwen_vae
    assert isinstance(model, QwenImageFlowModel) and model.family == "qwen_image" and not model.video
    assert type(model.pipeline).__name__ == "QwenImagePipeline"
    assert type(model.text_encoders[0]).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert model.default_size == 16 and model.latent_shape(16, 16) == (4, 8, 8)
    text = model.condition(PROMPTS, guidance_scale=4.0)
    embeds, mask = model.pipeline.encode_prompt(PROMPTS, max_sequence_length=32)
    longest = embeds.shape[1]
    # the pipeline's embeddings and mask, zero-padded (mask 0) from the batch's longest prompt to 32 tokens
    assert text.embeds.shape == (2, 32, embeds.shape[2]) and longest < 32
    assert torch.equal(text.embeds[:, :longest], embeds) and not text.embeds[:, longest:].any()
    assert torch.equal(text.mask[:, :longest], mask) and not text.mask[:, longest:].any()
    assert 0 < int(mask[0].sum()) < int(mask[1].sum()) == longest
    negative, negative_mask = model.pipeline.encode_prompt([NEGATIVE_PROMPT] * 2, max_sequence_length=32)
    n = negative.shape[1]
    assert torch.equal(text.negative_embeds[:, :n], negative) and not text.negative_embeds[:, n:].any()
    assert int(text.negative_mask.sum()) == 2 * n and negative_mask is None  # the pipeline drops an all-ones mask
    assert model.condition(PROMPTS, guidance_scale=1.0).negative_embeds is None
    with pytest.raises(ValueError, match="below 1"):
        model.condition(PROMPTS, guidance_scale=0.5)


def test_micro_batches_concatenate_and_select_repeats_rows(qwen_vae):
    a, b = qwen_vae.condition(PROMPTS[:1], 4.0), qwen_vae.condition(PROMPTS[1:], 4.0)
    assert a.embeds.shape == b.embeds.shape  # one length whatever the prompts
    both = qwen_vae.condition(PROMPTS, 4.0)
    picked = both.select(torch.tensor([1, 1, 0]))
    assert isinstance(picked, QwenImageConditioning) and picked.embeds.shape[0] == 3
    assert torch.equal(picked.mask[0], both.mask[1]) and torch.equal(picked.negative_embeds[2], both.negative_embeds[0])
    assert picked.to("cpu").embeds.device.type == "cpu"


def test_the_transformer_ignores_the_padding_through_the_mask(qwen_vae):
    model = qwen_vae
    text = model.condition(PROMPTS, guidance_scale=1.0)
    longest = int(text.mask.sum(1).max())
    short = QwenImageConditioning(text.embeds[:, :longest], text.mask[:, :longest])
    x = torch.randn(2, *model.latent_shape(16, 16), generator=torch.Generator().manual_seed(1))
    t = torch.full((2,), 700.0)
    padded = text.velocity(model.transformer, x, t, 1.0)
    # padding to max_sequence_length changes the image tokens by float rounding only (not bit for bit)
    torch.testing.assert_close(padded, short.velocity(model.transformer, x, t, 1.0), rtol=0, atol=1e-5)
    unmasked = QwenImageConditioning(text.embeds, torch.ones_like(text.mask))
    assert (unmasked.velocity(model.transformer, x, t, 1.0) - padded).abs().max() > 1e-3


def test_an_unsupported_pipeline_names_its_class_and_the_families(qwen_vae_dir, tmp_path):
    other = tmp_path / "model"
    shutil.copytree(qwen_vae_dir, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "KandinskyV22Pipeline"}))
    with pytest.raises(ValueError) as error:
        load_flow_model(other)
    message = str(error.value)
    assert "'KandinskyV22Pipeline' is not a supported flow model family" in message
    assert "QwenImagePipeline (qwen_image)" in message and "StableDiffusion3Pipeline (sd3)" in message
    assert "\n" not in message


def test_sizes_and_settings_out_of_range_are_one_line_errors(qwen_vae, qwen_vae_dir):
    with pytest.raises(ValueError, match="multiples of 4"):
        qwen_vae.latent_shape(16, 18)
    with pytest.raises(ValueError, match="makes images, not videos"):
        qwen_vae.schedule(3, 16, 16, frames=5)
    with pytest.raises(ValueError, match="max_sequence_length 2000 is outside"):
        load_flow_model(qwen_vae_dir, max_sequence_length=2000)


def test_lora_targets_are_verls_modules_less_the_discarded_text_output(qwen_vae_dir):
    # verl's run_qwen_image_ocr_lora.sh: attention projections and both streams' MLPs; the last block's text
    # queries and text output (add_q_proj, to_add_out, txt_mlp) feed nothing, so they are left out
    model = load_flow_model(qwen_vae_dir)
    blocks = [f"transformer_blocks.0.{t}" for t in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                                    "attn.add_k_proj", "attn.add_v_proj", "img_mlp.net.0.proj",
                                                    "img_mlp.net.2")]
    targets = model.lora_targets()
    assert sorted(targets) == sorted(blocks) and len(targets) == len(blocks) and len(LORA_TARGETS) == 12
    # every wrapped layer gets a gradient from the velocity: none is dead weight
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(model.transformer, LoraConfig(r=2, lora_alpha=4, target_modules=model.lora_targets(),
                                                          init_lora_weights="gaussian"))
    with torch.no_grad():  # B = 0 at init would leave A without a gradient
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    text = model.condition(PROMPTS, 4.0)
    text.velocity(policy, torch.randn(2, 4, 8, 8), torch.full((2,), 500.0), 4.0).square().sum().backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if "lora_" in n}
    assert len(grads) == 2 * len(blocks) and all(g is not None and g.abs().sum() > 0 for g in grads.values())


# ---------------------------------------------------------------- against the pipeline


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_our_sampler_gives_the_pipelines_latents(qwen_vae, guidance):
    """QwenImagePipeline.__call__ (its encoding, true CFG, timesteps / 1000, calculate_shift mu and the
    scheduler's Euler steps) from the same packed noise equals grouprl's sampler at noise level 0."""
    model, pipeline = qwen_vae, qwen_vae.pipeline
    shape = model.latent_shape(16, 16)
    noise = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))
    packed = pipeline._pack_latents(noise, 2, *shape)
    negative = {"negative_prompt": [NEGATIVE_PROMPT] * 2} if guidance > 1 else {}
    theirs = pipeline(prompt=PROMPTS, true_cfg_scale=guidance, height=16, width=16, num_inference_steps=3,
                      latents=packed, output_type="latent", max_sequence_length=32, **negative).images
    theirs = pipeline._unpack_latents(theirs, 16, 16, pipeline.vae_scale_factor)[:, :, 0]
    sched = model.schedule(3, 16, 16)
    # the pipeline's scheduler was left at its schedule: the same sigmas, shifted (not linspace)
    torch.testing.assert_close(sched.sigmas, pipeline.scheduler.sigmas.float())
    assert not torch.allclose(sched.sigmas[:3], torch.linspace(1, 1 / 3, 3))
    ours = sample(model.transformer, model.condition(PROMPTS, guidance), noise, sched, guidance_scale=guidance,
                  noise_level=0.0)
    torch.testing.assert_close(ours.final, theirs, rtol=0, atol=1e-5)
    # the pipeline's images: the same latents decoded through the VAE's normalisation
    images = pipeline(prompt=PROMPTS, true_cfg_scale=guidance, height=16, width=16, num_inference_steps=3,
                      latents=packed, output_type="np", max_sequence_length=32, **negative).images
    decoded = np.stack([np.asarray(image) for image in model.decode(ours.final)]).astype(np.int16)
    assert np.abs(decoded - np.round(images * 255).astype(np.int16)).max() <= 1


def test_encode_images_normalises_the_vae_latents(qwen_vae, qwen_pixel_dir):
    model = qwen_vae
    pixels = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(2)) * 2 - 1
    latents = model.encode_images(pixels)
    raw = model.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()[:, :, 0]
    config = model.vae.config
    expected = (raw - torch.tensor(config.latents_mean).view(1, -1, 1, 1)) / torch.tensor(config.latents_std).view(
        1, -1, 1, 1)
    assert latents.shape == (2, 4, 8, 8)
    torch.testing.assert_close(latents, expected)
    assert model.encode_images(model.decode(latents)).shape == (2, 4, 8, 8)  # PIL images in, through the processor
    pixel = load_flow_model(qwen_pixel_dir)
    assert pixel.vae is None and pixel.default_size == 8 and pixel.latent_shape(8, 8) == (3, 8, 8)
    assert torch.equal(pixel.encode_images(pixels[:, :, :8, :8]), pixels[:, :, :8, :8])


# ---------------------------------------------------------------- the trainer on the pixel stand-in


@pytest.fixture
def qwen_config(qwen_pixel_dir, flow_config):
    """``qwen_config(out, **overrides)``: a 2-step Flow-GRPO-Fast run of the pixel stand-in, true CFG 2 (the
    shared ``flow_config`` with the stand-in and smaller sizes)."""
    sizes = {"worker.actor.model.model_path": str(qwen_pixel_dir), "worker.actor.model.lora.rank": 2,
             "worker.actor.model.lora.alpha": 4, "worker.actor.micro_batch_size": 2,
             "worker.actor.num_minibatches": 1, "worker.rollout.n": 2, "worker.rollout.num_steps": 3,
             "worker.rollout.micro_batch_size": 4, "worker.rollout.sde_window_range": [0, 3],
             "worker.rollout.val_num_steps": 3}
    return lambda out, **extra: flow_config(out, **{**sizes, **extra})


def lora_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters() if "lora_" in k}


ALGORITHMS = {
    "flow_grpo": {"algorithm.name": "flow_grpo", "algorithm.timestep_fraction": 0.67},
    "flow_grpo_fast": {},
    "grpo_guard": {"algorithm.name": "grpo_guard", "algorithm.timestep_fraction": 0.67},
    "diffusion_nft": {"algorithm.name": "diffusion_nft", "algorithm.kl_coef": 0.0, "worker.rollout.noise_level": 0.0,
                      "worker.rollout.guidance_scale": 1.0, "algorithm.timestep_fraction": 0.67},
}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_each_algorithm_trains_and_validates_the_stand_in(qwen_config, tmp_path, read_jsonl, algorithm):
    from grouprl.domains.diffusion.trainer import flow_trainer

    trainer = flow_trainer(qwen_config(tmp_path / "run", **ALGORITHMS[algorithm]))
    assert isinstance(trainer.model, QwenImageFlowModel)
    before = lora_state(trainer)
    # the family's targets (lora.target_modules [attention] asks the model)
    wrapped = {k.split(".lora_")[0].removeprefix("base_model.model.") for k in before}
    assert wrapped == set(load_flow_model(trainer.model.path).lora_targets())
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in lora_state(trainer).items())
    train = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "actor/pg_loss" in m]
    assert [m["step"] for m in train] == [1, 2] and all(m["actor/grad_norm"] > 0 for m in train)
    assert any("val/reward/mean" in m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    assert (tmp_path / "run" / "val_images" / "step_000002.png").read_bytes()[:4] == b"\x89PNG"


def _run(config):
    from grouprl.domains.diffusion.trainer import flow_trainer

    trainer = flow_trainer(config)
    trainer.train()
    return lora_state(trainer)


def test_resume_after_step_one_equals_the_straight_run(qwen_config, tmp_path, read_jsonl):
    full = _run(qwen_config(tmp_path / "full"))
    _run(qwen_config(tmp_path / "cut", **{"trainer.max_steps": 1}))
    resumed = _run(qwen_config(tmp_path / "cut", **{"trainer.resume": "auto"}))
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    rewards = lambda out: [m["reward/mean"] for m in read_jsonl(out / "metrics.jsonl") if "reward/mean" in m]  # noqa
    assert rewards(tmp_path / "cut") == rewards(tmp_path / "full") and len(rewards(tmp_path / "full")) == 2


@pytest.mark.parametrize("mode", ["one_step_off", "async_reward"])
def test_async_modes_train_the_stand_in(qwen_config, tmp_path, read_jsonl, mode):
    from grouprl.domains.diffusion.trainer import flow_trainer

    trainer = flow_trainer(qwen_config(tmp_path / "run", **{"trainer.async_mode": mode}))
    before = lora_state(trainer)
    if mode == "one_step_off":
        assert trainer.sampler is not trainer.policy  # the sampler's own weights
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in lora_state(trainer).items())
    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "actor/pg_loss" in m]
    assert [m["step"] for m in metrics] == [1, 2] and "timing/reward_wait_s" in metrics[0]


# ---------------------------------------------------------------- the recipe

# verl's examples/flowgrpo_trainer/run_qwen_image_ocr_lora.sh with its rollout and actor defaults
RECIPE_SETTINGS = {
    "algorithm.name": "flow_grpo_fast", "algorithm.clip_range": 1e-4, "algorithm.adv_clip_max": 5.0,
    "algorithm.kl_coef": 0.0, "data.rollout_batch_size": 32, "worker.rollout.n": 16,
    "worker.actor.num_minibatches": 2, "worker.actor.micro_batch_size": 16, "worker.actor.model.lora.rank": 64,
    "worker.actor.model.lora.alpha": 128, "worker.actor.model.lora.target_modules": ["attention"],
    "worker.actor.optim.lr": 3e-4, "worker.actor.optim.weight_decay": 1e-4, "worker.rollout.kind": "sde",
    "worker.rollout.noise_level": 1.2, "worker.rollout.sde_window_size": 2, "worker.rollout.sde_window_range": [0, 5],
    "worker.rollout.guidance_scale": 4.0, "worker.rollout.num_steps": 10, "worker.rollout.height": 512,
    "worker.rollout.width": 512, "worker.rollout.val_num_steps": 50, "worker.rollout.val_images_to_log": 8,
    "worker.actor.model.dtype": "bfloat16", "trainer.total_epochs": 15, "trainer.max_steps": 300,
    "trainer.val_freq": 30, "trainer.save_freq": 30, "trainer.val_before_train": False,
}


def test_the_recipe_loads_with_verls_settings():
    from grouprl.domains.diffusion.config import load_flow_config

    config = load_flow_config(RECIPE)  # unknown keys or bad values would raise here
    for key, value in RECIPE_SETTINGS.items():
        node = config
        for part in key.split("."):
            node = getattr(node, part)
        assert node == value, key


def test_the_recipe_runs_a_step_on_the_stand_in(qwen_pixel_dir, prompts, tmp_path, read_jsonl):
    """The recipe's algorithm, sampler and guidance on the pixel stand-in, sizes and batches made tiny."""
    from grouprl.domains.diffusion.config import load_flow_config
    from grouprl.domains.diffusion.trainer import flow_trainer

    overrides = [f"worker.actor.model.model_path={qwen_pixel_dir}", f"data.train_files=[{prompts}/train.jsonl]",
                 f"data.val_files=[{prompts}/val.jsonl]", "data.rollout_batch_size=2", "worker.rollout.n=2",
                 "worker.rollout.height=8", "worker.rollout.width=8", "worker.rollout.num_steps=6",
                 "worker.actor.micro_batch_size=2", "worker.actor.num_minibatches=1",
                 "worker.rollout.micro_batch_size=4",
                 "worker.actor.model.dtype=float32", "trainer.max_steps=1", "trainer.device=cpu",
                 "trainer.logger=[jsonl]", f"trainer.output_dir={tmp_path / 'run'}",
                 "worker.reward.functions=[{name: image_brightness}]"]
    flow_trainer(load_flow_config(RECIPE, overrides)).train()
    (step,) = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "actor/pg_loss" in m]
    assert step["rollout/trained_steps"] == 2 and step["actor/grad_norm"] > 0 and "actor/kl_loss" not in step
