"""FLUX.1 (grouprl.domains.diffusion.families.flux): loading a FluxPipeline directory, the pipeline's own
encoding, sampling that equals FluxPipeline.__call__, the trainer's algorithms on the tiny stand-in, and the
example recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from grouprl.domains.diffusion.families.flux import (  # noqa: E402
    FLUX_LORA_TARGETS,
    FluxConditioning,
    FluxFlowModel,
    build_tiny_flux_pipeline,
    rope_axes,
)
from grouprl.domains.diffusion.models import load_flow_model  # noqa: E402
from grouprl.domains.diffusion.pipeline import sample  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# prompts of the shapes corpus the tiny tokenizers were built from (one token a word)
PROMPTS = ["a red square on the left", "two green squares on the left"]


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory):
    """``tiny_flux(**options)``: a tiny FluxPipeline directory (build_tiny_flux_pipeline), built once per
    session for each set of options; tests only read it."""
    built = {}

    def get(**options):
        key = repr(sorted(options.items()))
        if key not in built:
            built[key] = build_tiny_flux_pipeline(tmp_path_factory.mktemp("flux") / "model", **options)
        return built[key]

    return get


@pytest.fixture
def flux_config(flow_config, tiny_flux):
    """``flux_config(out, **overrides)``: conftest's flow run (Flow-GRPO-Fast) on the tiny FLUX.1-dev with its
    VAE: 2 prompts x 2 images of 16 x 16 px (8 x 8 latents, 16 tokens), 3 steps, validation at step 2."""

    def config(out, **extra):
        return flow_config(out, **{
            "worker.actor.model.model_path": str(tiny_flux()), "worker.rollout.n": 2,
            "worker.rollout.height": 16, "worker.rollout.width": 16, "worker.rollout.num_steps": 3,
            "worker.rollout.val_num_steps": 3, "worker.rollout.guidance_scale": 3.5,
            "worker.rollout.micro_batch_size": 2, "worker.actor.micro_batch_size": 2,
            "worker.rollout.sde_window_size": 1, "worker.rollout.sde_window_range": [0, 2], **extra})

    return config


def lora_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters() if "lora_" in k}


# ---------------------------------------------------------------- loading and conditioning


def test_a_flux_pipeline_loads_as_the_flux_family_and_encodes_as_its_pipeline(tiny_flux):
    model = load_flow_model(tiny_flux())
    assert isinstance(model, FluxFlowModel) and model.family == "flux" and not model.video
    # the tiny T5 tokenizer allows 12 tokens: prompts are padded to that, not to the requested 256
    assert model.max_sequence_length == 12
    text = model.condition(PROMPTS, guidance_scale=3.5)
    embeds, pooled, text_ids = model.pipeline.encode_prompt(prompt=PROMPTS, prompt_2=None,
                                                            max_sequence_length=12)
    assert torch.equal(text.embeds, embeds) and torch.equal(text.pooled, pooled)
    assert torch.equal(text.text_ids, text_ids) and text.guidance_embeds
    assert model.latent_shape(16, 16) == (4, 8, 8)  # 4 latent channels, VAE factor 2
    assert model.default_size == 128 * 2  # the pipeline's default_sample_size x the VAE factor
    with pytest.raises(ValueError, match="multiples of 4"):
        model.latent_shape(18, 16)
    with pytest.raises(ValueError, match="not videos"):
        model.schedule(3, 16, 16, frames=5)


def test_conditioning_rows_select_and_concatenate_whatever_the_prompt_lengths(tiny_flux):
    model = load_flow_model(tiny_flux())
    short, long = model.condition(["a square"]), model.condition(["two green squares on the left"])
    both = model.condition(["a square", "two green squares on the left"])
    assert short.embeds.shape == long.embeds.shape  # padded to max_sequence_length, not the batch's longest
    assert torch.equal(torch.cat([short.embeds, long.embeds]), both.embeds)
    picked = both.select([1, 1, 0]).to("cpu")
    assert isinstance(picked, FluxConditioning) and picked.text_ids.shape == (model.max_sequence_length, 3)
    assert torch.equal(picked.embeds, both.embeds[[1, 1, 0]]) and torch.equal(picked.pooled, both.pooled[[1, 1, 0]])


def test_an_unsupported_pipeline_names_its_class_and_the_supported_families(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    with pytest.raises(ValueError) as error:
        load_flow_model(tmp_path)
    message = str(error.value)
    assert "'KandinskyPipeline' is not a supported flow model family" in message
    assert "FluxPipeline (flux)" in message and "StableDiffusion3Pipeline (sd3)" in message


def test_lora_targets_are_flow_grpos_flux_modules(tiny_flux):
    model = load_flow_model(tiny_flux(variant="schnell", vae=False))
    assert model.lora_targets() == list(FLUX_LORA_TARGETS)  # one double and one single block have all twelve


def test_rope_axes_split_a_head_in_fluxs_proportions():
    assert rope_axes(128) == (16, 56, 56)  # FLUX.1's axes_dims_rope
    assert rope_axes(8) == (2, 2, 4) and sum(rope_axes(24)) == 24
    with pytest.raises(ValueError, match="attention_head_dim"):
        rope_axes(7)


# ---------------------------------------------------------------- sampling = the pipeline's own


@pytest.mark.parametrize("options", [{"variant": "dev"}, {"variant": "schnell", "vae": False}],
                         ids=["dev-vae", "schnell-pixels"])
def test_the_sampler_gives_the_pipelines_own_latents(tiny_flux, options):
    """FluxPipeline.__call__ from the same noise (packed by its own helper) ends where our sampler's ODE does:
    the conditioning, the guidance embedding, timestep / 1000 and the resolution-dependent shift all match."""
    model = load_flow_model(tiny_flux(**options))
    size, steps, scale = 16, 3, 3.5
    noise = torch.randn(2, *model.latent_shape(size, size), generator=torch.Generator().manual_seed(1))
    pipeline = model.pipeline
    out = pipeline(prompt=PROMPTS, height=size, width=size, num_inference_steps=steps, guidance_scale=scale,
                   latents=pipeline._pack_latents(noise, *noise.shape), output_type="latent",
                   max_sequence_length=model.max_sequence_length).images
    expected = pipeline._unpack_latents(out, size, size, pipeline.vae_scale_factor)
    ours = sample(model.transformer, model.condition(PROMPTS, scale), noise, model.schedule(steps, size, size),
                  guidance_scale=scale, noise_level=0.0)
    torch.testing.assert_close(ours.final, expected, atol=1e-5, rtol=0)
    ours_sigmas = model.schedule(steps, size, size).sigmas
    assert pipeline.scheduler.sigmas.tolist() == pytest.approx(ours_sigmas.tolist())
    if options["variant"] == "dev":  # the guidance embedding is used: another scale, another image
        other = sample(model.transformer, model.condition(PROMPTS, 1.0), noise, model.schedule(steps, size, size),
                       guidance_scale=1.0, noise_level=0.0)
        assert not torch.allclose(other.final, ours.final)


def test_dev_shifts_by_the_image_size_and_schnell_does_not(tiny_flux):
    dev, schnell = load_flow_model(tiny_flux()), load_flow_model(tiny_flux(variant="schnell", vae=False))
    assert dev.schedule(4, 16, 16).sigmas.tolist() != pytest.approx(dev.schedule(4, 32, 32).sigmas.tolist())
    assert schnell.schedule(4, 16, 16).sigmas.tolist() == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert schnell.schedule(4, 16, 16).sigmas.tolist() == pytest.approx(schnell.schedule(4, 32, 32).sigmas.tolist())


def test_decode_and_encode_go_through_the_vae_or_read_pixels(tiny_flux):
    model = load_flow_model(tiny_flux())
    latents = torch.randn(2, *model.latent_shape(16, 16), generator=torch.Generator().manual_seed(2))
    images = model.decode(latents)
    assert [im.size for im in images] == [(16, 16)] * 2
    assert model.encode_images(images).shape == latents.shape
    pixels = load_flow_model(tiny_flux(variant="schnell", vae=False))
    x = torch.rand(1, 3, 8, 8) * 2 - 1
    assert torch.equal(pixels.encode_images(x), x)
    assert pixels.latent_shape(8, 8) == (3, 8, 8) and pixels.default_size == 128


# ---------------------------------------------------------------- the trainer


@pytest.mark.parametrize("algorithm", ["flow_grpo", "flow_grpo_fast", "grpo_guard", "diffusion_nft"])
def test_each_algorithm_trains_and_validates_the_tiny_flux(flux_config, tmp_path, read_jsonl, algorithm):
    from grouprl.domains.diffusion.trainer import flow_trainer

    extra = {"algorithm.name": algorithm}
    if algorithm == "diffusion_nft":
        extra.update({"algorithm.kl_coef": 0.0, "worker.rollout.noise_level": 0.0, "algorithm.timestep_fraction": 0.5})
    trainer = flow_trainer(flux_config(tmp_path / "run", **extra))
    assert isinstance(trainer.model, FluxFlowModel)
    before = lora_state(trainer)
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in lora_state(trainer).items())
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]
    assert any(m["step"] == 2 and any(k.startswith("val/") for k in m) for m in metrics)
    assert (tmp_path / "run" / "val_images" / "step_000002.png").is_file()


def test_a_resumed_flux_run_equals_the_straight_run(flux_config, tmp_path, read_jsonl):
    from grouprl.domains.diffusion.trainer import flow_trainer

    full = flow_trainer(flux_config(tmp_path / "full"))
    full.train()
    flow_trainer(flux_config(tmp_path / "cut", **{"trainer.max_steps": 1})).train()
    resumed = flow_trainer(flux_config(tmp_path / "cut", **{"trainer.resume": "auto"}))
    resumed.train()
    a, b = lora_state(full), lora_state(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    def rewards(out):
        return [m["reward/mean"] for m in read_jsonl(out / "metrics.jsonl") if "reward/mean" in m]

    assert rewards(tmp_path / "cut") == rewards(tmp_path / "full")


@pytest.mark.parametrize("mode", ["one_step_off", "async_reward"])
def test_async_modes_train_the_tiny_flux(flux_config, tmp_path, read_jsonl, mode):
    from grouprl.domains.diffusion.trainer import flow_trainer

    trainer = flow_trainer(flux_config(tmp_path / "run", **{"trainer.async_mode": mode, "trainer.val_freq": 0}))
    before = lora_state(trainer)
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in lora_state(trainer).items())
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in m] == [1, 2]


# ---------------------------------------------------------------- the recipe


def test_the_flux_recipe_loads_with_flow_grpos_settings():
    from grouprl.domains.diffusion.config import load_flow_config

    config = load_flow_config(ROOT / "examples" / "flow_grpo_flux.yaml")
    algo, actor, rollout = config.algorithm, config.worker.actor, config.worker.rollout
    # yifan123/flow_grpo config/grpo.py pickscore_flux, config/base.py, scripts/train_flux.py
    assert (algo.name, algo.kl_coef, algo.clip_range, algo.adv_clip_max, algo.timestep_fraction) == \
        ("flow_grpo", 0.0, 1e-4, 5.0, 0.99)
    assert (rollout.num_steps, rollout.val_num_steps, rollout.guidance_scale, rollout.noise_level) == (6, 28, 3.5, 0.9)
    assert (rollout.height, rollout.width, rollout.n) == (512, 512, 24)
    assert (actor.model.lora.rank, actor.model.lora.alpha, actor.model.lora.target_modules) == (64, 128, ["attention"])
    assert (actor.optim.lr, actor.optim.weight_decay, actor.max_grad_norm) == (3e-4, 1e-4, 1.0)
    assert actor.ema.enabled and actor.ema.decay == 0.9
    assert [f.name for f in config.worker.reward.functions] == ["pickscore"]


def test_the_prompt_length_key_reaches_the_model(flux_config, tmp_path):
    """worker.actor.model.max_sequence_length sets the T5 tokens per prompt; unset, FluxPipeline's 512 capped by
    the tokenizer (the tiny one's 12)."""
    from grouprl.domains.diffusion.trainer import flow_trainer

    short = flow_trainer(flux_config(tmp_path / "short", **{"worker.actor.model.max_sequence_length": 5}))
    assert short.model.max_sequence_length == 5
    assert short.model.condition(["a red square on the left"]).embeds.shape[1] == 5
    assert flow_trainer(flux_config(tmp_path / "unset")).model.max_sequence_length == 12
