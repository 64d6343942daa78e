"""Wan 2.x text-to-video as a flow model family (``families.wan``) on a tiny ``WanPipeline`` built offline:
loading, the conditioning and the sampler against the pipeline's own ``encode_prompt`` and ``__call__``, the
schedule, frames, LoRA targets, video rewards (``video.score_videos``), the recipe, and the trainer."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("diffusers")

from grouprl.config import ConfigError  # noqa: E402
from grouprl.domains.diffusion.families.wan import WanConditioning, WanFlowModel  # noqa: E402
from grouprl.domains.diffusion.models import load_flow_model  # noqa: E402
from grouprl.domains.diffusion.pipeline import sample  # noqa: E402

PROMPTS = ["a red square on the left", "two blue squares"]
SEQ = 16  # UMT5 tokens per prompt (the pipeline's max_sequence_length)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flow_grpo_wan.yaml"


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory):
    """A tiny WanPipeline with its VAE (16 x 16 pixels and 5 frames are latents [4, 2, 2, 2])."""
    from grouprl.domains.diffusion.families.wan import build_tiny_wan_pipeline

    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("wan") / "model")


@pytest.fixture(scope="session")
def tiny_wan_pixels(tmp_path_factory):
    """The pixel-space stand-in: the VAE saved null, the transformer on RGB frames."""
    from grouprl.domains.diffusion.families.wan import build_tiny_wan_pipeline

    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("wan_pixels") / "model", vae=False)


@pytest.fixture(scope="session")
def wan(tiny_wan):
    return load_flow_model(tiny_wan, max_sequence_length=SEQ)


# ---------------------------------------------------------------- loading and conditioning


def test_load_gives_the_wan_family_and_the_pipelines_prompt_embeddings(wan):
    assert isinstance(wan, WanFlowModel) and (wan.family, wan.video) == ("wan", True)
    assert type(wan.pipeline).__name__ == "WanPipeline" and wan.vae is not None
    text = wan.condition(PROMPTS, 4.5)
    embeds, negative = wan.pipeline.encode_prompt(PROMPTS, do_classifier_free_guidance=True,
                                                  max_sequence_length=SEQ, device=wan.device)
    assert torch.equal(text.embeds, embeds) and torch.equal(text.negative_embeds, negative)
    assert torch.equal(text.negative_embeds, wan.pipeline.encode_prompt([""] * 2, do_classifier_free_guidance=False,
                                                                        max_sequence_length=SEQ)[0])
    # every prompt padded to max_sequence_length (zeros past its tokens): batches of any prompts concatenate
    short = wan.condition(["red"], 4.5)
    assert short.embeds.shape == (1, SEQ, embeds.shape[-1]) and text.embeds.shape[1] == SEQ
    assert short.embeds[0, 2:].abs().sum() == 0 and short.embeds[0, :2].abs().sum() > 0
    assert wan.condition(PROMPTS, 1.0).negative_embeds is None  # no guidance: no negative prompt
    # select with repeated rows, and to()
    picked = text.select(torch.tensor([1, 1, 0])).to("cpu")
    assert torch.equal(picked.embeds, embeds[[1, 1, 0]]) and torch.equal(picked.negative_embeds, negative[[1, 1, 0]])


def test_an_unsupported_pipeline_names_its_class_and_the_families(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideoPipeline"}))
    with pytest.raises(ValueError) as error:
        load_flow_model(tmp_path)
    message = str(error.value)
    assert "'HunyuanVideoPipeline' is not a supported flow model family" in message
    assert "WanPipeline (wan)" in message and "StableDiffusion3Pipeline (sd3)" in message


# ---------------------------------------------------------------- the sampler against the pipeline


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_the_pipelines_own_call_gives_the_samplers_latents_and_frames(wan, guidance):
    """Same noise, 3 steps: WanPipeline.__call__ (its encode_prompt, guidance, timesteps, Euler steps) ends
    where our ODE sampler does with model.condition and model.schedule; its decoded frames are ours."""
    shape = wan.latent_shape(16, 16, 5)
    noise = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))
    call = dict(prompt=PROMPTS, height=16, width=16, num_frames=5, num_inference_steps=3, guidance_scale=guidance,
                latents=noise.clone(), max_sequence_length=SEQ)
    theirs = wan.pipeline(**call, output_type="latent").frames
    ours = sample(wan.transformer, wan.condition(PROMPTS, guidance), noise, wan.schedule(3, 16, 16, 5),
                  guidance_scale=guidance, noise_level=0.0).final
    assert theirs.shape == ours.shape == (2, *shape)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    videos = wan.decode(ours)
    assert len(videos) == 2 and all(len(v) == 5 and v[0].size == (16, 16) for v in videos)
    frames = wan.pipeline(**call, output_type="np").frames  # [B, F, H, W, 3] in [0, 1]
    assert np.array_equal(np.round(frames * 255).astype(np.uint8),
                          np.stack([np.stack([np.asarray(f) for f in v]) for v in videos]))


def test_the_schedule_is_the_models_own_flow_sigmas(wan):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    sched = wan.schedule(3, 16, 16, 5)
    euler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    euler.set_timesteps(3)
    assert torch.equal(sched.sigmas, euler.sigmas) and torch.equal(sched.timesteps, euler.timesteps)
    # the real Wan's UniPC config: flow_grpo's Wan script steps over its sigmas and timesteps
    unipc = WanFlowModel(**{**wan.__dict__, "scheduler": UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)})
    own = UniPCMultistepScheduler.from_config(unipc.scheduler.config)
    own.set_timesteps(20)
    sched = unipc.schedule(20, 240, 416, 33)
    assert torch.equal(sched.sigmas, own.sigmas.float()) and torch.equal(sched.timesteps, own.timesteps.float())
    assert sched.sigmas[-1] == 0 and len(sched.timesteps) == 20 and not torch.equal(sched.sigmas[:3], euler.sigmas[:3])
    plain = WanFlowModel(**{**wan.__dict__, "scheduler": UniPCMultistepScheduler()})
    with pytest.raises(ValueError, match="UniPCMultistepScheduler has no flow sigmas"):
        plain.schedule(20, 16, 16, 5)


def test_latent_frames_as_the_pipeline_and_bad_sizes_refused(wan, tiny_wan_pixels):
    assert wan.latent_shape(16, 16, 5) == (4, 2, 2, 2) and wan.latent_shape(32, 48, 9) == (4, 3, 4, 6)
    assert wan.latent_shape(16, 16, 1) == (4, 1, 2, 2)
    with pytest.raises(ValueError, match="frames - 1 divisible by the VAE's temporal factor 4"):
        wan.latent_shape(16, 16, 6)
    with pytest.raises(ValueError, match="needs the number of frames"):
        wan.latent_shape(16, 16)
    with pytest.raises(ValueError, match="positive multiples of 16"):
        wan.latent_shape(24, 16, 5)
    pixels = load_flow_model(tiny_wan_pixels, max_sequence_length=SEQ)
    assert pixels.vae is None and pixels.latent_shape(8, 8, 5) == (3, 5, 8, 8) and pixels.default_size == 16
    assert wan.default_size == 480  # WanPipeline's default height


def test_pixel_space_frames_round_trip(tiny_wan_pixels):
    model = load_flow_model(tiny_wan_pixels, max_sequence_length=SEQ)
    x = torch.rand(2, 3, 5, 8, 8, generator=torch.Generator().manual_seed(1)) * 2 - 1
    videos = model.decode(x)
    assert [len(v) for v in videos] == [5, 5] and videos[0][0].size == (8, 8)
    assert (model.encode_images(videos) - x).abs().max() <= 1 / 127.5


def test_vae_latents_are_normalised_per_channel(wan):
    videos = wan.decode(torch.zeros(1, 4, 2, 2, 2))
    z = wan.encode_images(videos)
    config = wan.vae.config
    pixels = torch.from_numpy(np.stack([np.asarray(f, dtype=np.float32) for f in videos[0]]))  # [F, H, W, 3]
    raw = wan.vae.encode(pixels.permute(3, 0, 1, 2)[None] / 127.5 - 1.0).latent_dist.mode()
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(z, (raw - mean) / std, atol=1e-6, rtol=1e-5)


def test_lora_targets_are_flow_grpos_present_in_both_attentions(wan):
    from peft import LoraConfig, get_peft_model

    assert wan.lora_targets() == ["to_k", "to_out.0", "to_q", "to_v"]
    transformer = load_flow_model(wan.path, max_sequence_length=SEQ).transformer
    wrapped = get_peft_model(transformer, LoraConfig(r=2, lora_alpha=4, target_modules=wan.lora_targets()))
    names = {n.split(".lora_A")[0] for n, _ in wrapped.named_parameters() if ".lora_A." in n}
    assert {n.split("blocks.0.")[1] for n in names} == {f"{a}.{p}" for a in ("attn1", "attn2")
                                                         for p in ("to_q", "to_k", "to_v", "to_out.0")}


def test_conditioning_expands_the_timestep_per_token_for_wan22_ti2v(wan):
    seen = []

    def transformer(hidden_states, timestep, encoder_hidden_states, return_dict):
        seen.append(timestep)
        return (torch.zeros_like(hidden_states),)

    transformer.config = wan.transformer.config  # patch (1, 2, 2)
    text = WanConditioning(torch.zeros(2, 3, 4), expand_timesteps=True)
    text.velocity(transformer, torch.zeros(2, 4, 3, 4, 6), torch.tensor([500.0, 20.0]), 1.0)
    assert seen[0].shape == (2, 3 * 2 * 3) and torch.equal(seen[0][:, 0], torch.tensor([500.0, 20.0]))


# ---------------------------------------------------------------- video rewards


def test_frame_indices_all_or_evenly_spaced():
    from grouprl.domains.diffusion.video import frame_indices, preview_frame

    assert frame_indices(5) == [0, 1, 2, 3, 4]
    assert frame_indices(33, 9) == list(range(0, 33, 4))  # flow_grpo's every 4th frame of 33
    assert frame_indices(5, 2) == [0, 4] and frame_indices(5, 1) == [0] and frame_indices(5, 3) == [0, 2, 4]
    with pytest.raises(ValueError, match="from 1 to the video's 5 frames"):
        frame_indices(5, 6)
    assert preview_frame(["a", "b", "c", "d", "e"]) == "c"


def _frames(*levels):
    return [Image.new("RGB", (4, 4), (v, v, v)) for v in levels]


def level(images, prompts, **metadata):
    return [float(np.asarray(image)[0, 0, 0]) for image in images]


def test_score_videos_means_each_rewards_frames():
    from grouprl.domains.diffusion.video import score_videos
    from grouprl.rewards import ImageRewardSet

    seen = {}

    def tagged(images, prompts, tag, **metadata):
        seen.setdefault("rows", []).extend(zip(prompts, tag))
        return [1.0] * len(images)

    rewards = ImageRewardSet.from_specs([level, tagged])
    videos = [_frames(0, 10, 20, 30, 40), _frames(100, 100, 100, 100, 200)]
    result = score_videos(rewards, videos, ["p0", "p1"], {"tag": ["a", "b"]})
    assert result.components["level"] == [20.0, 120.0] and result.components["tagged"] == [1.0, 1.0]
    assert result.total == [21.0, 121.0]
    assert seen["rows"] == [("p0", "a")] * 5 + [("p1", "b")] * 5  # each frame with its video's prompt and metadata
    picked = score_videos(rewards, videos, ["p0", "p1"], {"tag": ["a", "b"]}, frames=2)
    assert picked.components["level"] == [20.0, 150.0]  # frames 0 and 4


def test_score_videos_a_none_frame_unscoring_the_video_and_errors_raising():
    from grouprl.domains.diffusion.video import score_videos
    from grouprl.rewards import ImageRewardSet
    from grouprl.rewards.contract import UnscoredError

    def dark_only(images, prompts, **metadata):
        return [1.0 if np.asarray(image).max() < 50 else None for image in images]

    videos = [_frames(0, 10), _frames(0, 90)]
    result = score_videos(ImageRewardSet.from_specs([dark_only]), videos, ["p", "q"], allow_unscored=True)
    assert result.components["dark_only"] == [1.0, None] and result.total == [1.0, None]
    with pytest.raises(UnscoredError, match="video 1"):
        score_videos(ImageRewardSet.from_specs([dark_only]), videos, ["p", "q"])

    def broken(images, prompts, **metadata):
        raise RuntimeError("no OCR engine")

    with pytest.raises(Exception, match="no OCR engine"):
        score_videos(ImageRewardSet.from_specs([broken]), videos, ["p", "q"])


# ---------------------------------------------------------------- config, recipe and the trainer


@pytest.fixture
def wan_values(tiny_wan, flow_values, set_dotted):
    """``wan_values(out, **extra)``: the shared flow run's values (``flow_values``) for the tiny Wan: Flow-GRPO,
    5-frame videos of 16 x 16 scored on 3 frames, and ``extra`` (dotted keys)."""
    sizes = {"algorithm.name": "flow_grpo", "worker.actor.model.lora": {"rank": 2, "alpha": 4},
             "worker.actor.micro_batch_size": 4, "worker.actor.num_minibatches": 1,
             "worker.rollout": {"n": 2, "num_steps": 3, "height": 16, "width": 16, "num_frames": 5,
                                "guidance_scale": 2.0, "micro_batch_size": 4, "sde_window_size": 1,
                                "sde_window_range": [0, 3], "val_num_steps": 3, "val_images_to_log": 2},
             "worker.reward.video_frames": 3}
    # a fresh copy each time: the nested dicts become the run's values, which a test may change
    return lambda out, **extra: set_dotted(flow_values(tiny_wan, out), copy.deepcopy({**sizes, **extra}))


def test_video_frames_key_checked(wan_values, tmp_path):
    from grouprl.domains.diffusion.config import flow_config_from_dict

    assert flow_config_from_dict(wan_values(tmp_path)).worker.reward.video_frames == 3
    with pytest.raises(ConfigError, match="'worker.reward.video_frames' is 3, but 'worker.rollout.num_frames' is not"):
        flow_config_from_dict(wan_values(tmp_path, **{"worker.rollout.num_frames": None}))
    with pytest.raises(ConfigError, match=r"'worker.reward.video_frames' \(6\) exceeds"):
        flow_config_from_dict(wan_values(tmp_path, **{"worker.reward.video_frames": 6}))


def test_the_recipe_loads_with_flow_grpos_wan_settings():
    from grouprl.domains.diffusion.config import load_flow_config

    config = load_flow_config(EXAMPLE)
    rollout, actor, algo = config.worker.rollout, config.worker.actor, config.algorithm
    assert actor.model.model_path == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert (rollout.height, rollout.width, rollout.num_frames) == (240, 416, 33)
    assert (rollout.num_steps, rollout.val_num_steps, rollout.guidance_scale, rollout.n) == (20, 50, 4.5, 4)
    assert (actor.model.lora.rank, actor.model.lora.alpha, actor.optim.lr) == (32, 64, 1e-4)
    assert (algo.name, algo.clip_range, algo.kl_coef, algo.timestep_fraction, algo.global_std) == \
        ("flow_grpo", 1e-3, 0.004, 0.99, False)
    assert config.worker.reward.video_frames == 9 and [f.name for f in config.worker.reward.functions] == ["ocr"]
    assert actor.ema.enabled and actor.model.dtype == "bfloat16"


def test_the_trainer_refuses_a_video_model_without_frames(wan_values, tmp_path):
    from grouprl.domains.diffusion.config import flow_config_from_dict
    from grouprl.domains.diffusion.trainer import flow_trainer

    values = wan_values(tmp_path, **{"worker.rollout.num_frames": None})
    values["worker"]["reward"].pop("video_frames")
    with pytest.raises(ConfigError, match="'worker.rollout.num_frames' is not set.*text-to-video model \\(wan\\)"):
        flow_trainer(flow_config_from_dict(values))


def _lora(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters() if "lora_" in k}


def _train(wan_values, out, **extra):
    from grouprl.domains.diffusion.config import flow_config_from_dict
    from grouprl.domains.diffusion.trainer import flow_trainer

    trainer = flow_trainer(flow_config_from_dict(wan_values(out, **extra)))
    before = _lora(trainer)
    trainer.train()
    return trainer, before


ALGORITHMS = {
    "flow_grpo": {},
    "flow_grpo_fast": {"algorithm.name": "flow_grpo_fast"},
    "grpo_guard": {"algorithm.name": "grpo_guard"},
    "diffusion_nft": {"algorithm.name": "diffusion_nft", "algorithm.kl_coef": 0.0, "worker.rollout.noise_level": 0.0},
}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_each_algorithm_trains_and_validates_on_the_tiny_wan(wan_values, tmp_path, read_jsonl, algorithm):
    trainer, before = _train(wan_values, tmp_path / "run", **ALGORITHMS[algorithm])
    assert any(not torch.equal(before[k], v) for k, v in _lora(trainer).items())
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics if "reward/mean" in m and "val/reward/mean" not in m] == [1, 2]
    assert any("val/reward/mean" in m for m in metrics)
    assert (tmp_path / "run" / "val_images" / "step_000002.png").read_bytes()[:4] == b"\x89PNG"


def test_a_resumed_wan_run_equals_the_straight_one(wan_values, tmp_path, read_jsonl):
    full, _ = _train(wan_values, tmp_path / "full", **{"trainer.val_freq": 0})
    _train(wan_values, tmp_path / "cut", **{"trainer.max_steps": 1, "trainer.val_freq": 0})
    resumed, _ = _train(wan_values, tmp_path / "cut", **{"trainer.resume": "auto", "trainer.val_freq": 0})
    a, b = _lora(full), _lora(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def rewards(out):
        return [m["reward/mean"] for m in read_jsonl(out / "metrics.jsonl") if "reward/mean" in m]

    assert rewards(tmp_path / "cut") == rewards(tmp_path / "full") and len(rewards(tmp_path / "full")) == 2


@pytest.mark.parametrize("mode", ["one_step_off", "async_reward"])
def test_async_modes_train_the_tiny_wan(wan_values, tmp_path, read_jsonl, mode):
    trainer, before = _train(wan_values, tmp_path / "run", **{"trainer.async_mode": mode,
                                                                     "trainer.val_freq": 0})
    assert any(not torch.equal(before[k], v) for k, v in _lora(trainer).items())
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in m] == [1, 2]
