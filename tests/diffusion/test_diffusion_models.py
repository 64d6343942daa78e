"""Flow models built offline, saved, and loaded back: the tiny SD3 pipeline (two CLIPs, T5, VAE; and
without T5) and the pixel-space demo model."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import StableDiffusion3Pipeline  # noqa: E402
from transformers import CLIPTokenizer, T5TokenizerFast  # noqa: E402

from grouprl.domains.diffusion import shapes  # noqa: E402
from grouprl.domains.diffusion.models import FLOW_INDEX, load_flow_model, lora_target_modules  # noqa: E402
from grouprl.domains.diffusion.pipeline import encode, sample, schedule  # noqa: E402
from grouprl.domains.diffusion.tiny import (  # noqa: E402
    build_clip_tokenizer,
    build_t5_tokenizer,
    build_tiny_sd3_pipeline,
)

PROMPTS = ["a red square on the left", "two blue squares at the top"]


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return build_tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3"), seed=0)


@pytest.fixture(scope="module")
def sd3_no_t5_dir(tmp_path_factory):
    return build_tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3_no_t5"), seed=0, t5=False)


@pytest.fixture(scope="module")
def pixel_dir(tiny_pixel_flow):
    return tiny_pixel_flow(seed=0)


def test_clip_tokenizer_makes_task_words_single_tokens_and_reloads(tmp_path):
    tokenizer = build_clip_tokenizer(shapes.corpus(), model_max_length=12)
    for word in {w for prompt in shapes.corpus() for w in prompt.split()}:
        ids = tokenizer(word, add_special_tokens=False).input_ids
        assert tokenizer.convert_ids_to_tokens(ids) == [word + "</w>"]
    # Unseen words fall back to byte symbols, never the unknown token.
    ids = tokenizer("A pink dot").input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.unk_token_id not in ids[1:-1]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a pink dot"
    tokenizer.save_pretrained(tmp_path)
    again = CLIPTokenizer.from_pretrained(tmp_path)
    batch = ["two yellow squares on the right", ""]
    assert again(batch, padding="max_length").input_ids == tokenizer(batch, padding="max_length").input_ids
    assert again.model_max_length == 12


def test_t5_tokenizer_makes_words_single_pieces_and_reloads(tmp_path):
    tokenizer = build_t5_tokenizer(shapes.corpus() + ['A sign that says "HELLO"'], model_max_length=16)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    ids = tokenizer('A sign that says "HELLO"').input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == ["\u2581A", "\u2581sign", "\u2581that", "\u2581says",
                                                    '\u2581"HELLO"', "</s>"]
    # Unseen words fall back to characters, never the unknown token.
    ids = tokenizer("A pink Dot").input_ids
    assert tokenizer.unk_token_id not in ids and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "A pink Dot"
    tokenizer.save_pretrained(tmp_path)
    again = T5TokenizerFast.from_pretrained(tmp_path)
    batch = ["two yellow squares on the right", ""]
    padded = tokenizer(batch, padding="max_length", max_length=16).input_ids
    assert again(batch, padding="max_length", max_length=16).input_ids == padded
    assert padded[1] == [1] + [0] * 15


def test_tiny_sd3_pipeline_loads_through_diffusers_and_generates(sd3_dir):
    index = json.loads((sd3_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["text_encoder_3"] == ["transformers", "T5EncoderModel"] and index["tokenizer_3"][0] == "transformers"
    pipeline = StableDiffusion3Pipeline.from_pretrained(sd3_dir)
    pipeline.set_progress_bar_config(disable=True)
    assert type(pipeline.text_encoder_3).__name__ == "T5EncoderModel"
    out = pipeline(PROMPTS[0], num_inference_steps=2, height=32, width=32, guidance_scale=2.0,
                   max_sequence_length=8, generator=torch.Generator().manual_seed(0))
    assert out.images[0].size == (32, 32) and out.images[0].mode == "RGB"


def test_load_flow_model_sd3_encodes_like_the_pipeline(sd3_dir):
    model = load_flow_model(sd3_dir, max_sequence_length=8)
    assert model.pipeline is not None and model.vae is not None and len(model.text_encoders) == 3
    embeds, pooled = model.encode_prompts(PROMPTS)
    # SD3.5's layout: the two CLIPs' 77 tokens (width 32 each, side by side, zero-padded to T5's 128),
    # then the 8 T5 tokens; the pooled vector is the two CLIPs' only.
    assert model.transformer.config.joint_attention_dim == 128
    assert embeds.shape == (2, 77 + 8, 128) and pooled.shape == (2, 64)
    assert torch.count_nonzero(embeds[:, :77, 64:]) == 0
    expected, _, expected_pooled, _ = model.pipeline.encode_prompt(
        PROMPTS, None, None, device="cpu", do_classifier_free_guidance=False, max_sequence_length=8)
    torch.testing.assert_close(embeds, expected)
    torch.testing.assert_close(pooled, expected_pooled)
    # The last 8 tokens are T5's own states of the prompts (what SD3 leaves as zeros without T5).
    tokenizer, t5 = model.tokenizers[2], model.text_encoders[2]
    ids = tokenizer(PROMPTS, padding="max_length", max_length=8, truncation=True, return_tensors="pt").input_ids
    torch.testing.assert_close(embeds[:, 77:], t5(ids).last_hidden_state)
    assert embeds[:, 77:].abs().mean() > 0.1
    empty, _ = model.encode_prompts([""] * 2)
    assert not torch.allclose(empty[0], embeds[0])
    assert not torch.allclose(empty[0, 77:], embeds[0, 77:])
    assert not any(p.requires_grad for e in model.text_encoders for p in e.parameters())

    assert model.latent_shape(32, 32) == (4, 32, 32) and model.default_size == 32
    with pytest.raises(ValueError, match="multiples of 2"):
        model.latent_shape(31, 32)
    images = [shapes.render(p, 32, np.random.default_rng(0)) for p in PROMPTS]
    latents = model.encode_images(images)
    assert latents.shape == (2, 4, 32, 32)
    decoded = model.decode(latents)
    assert [im.size for im in decoded] == [(32, 32)] * 2


def test_sd3_vae_with_downsampling_scales_latents(tmp_path):
    model = load_flow_model(build_tiny_sd3_pipeline(tmp_path / "sd3", sample_size=16, vae_blocks=2))
    assert model.vae_scale_factor == 2 and model.default_size == 32
    assert model.latent_shape(32, 64) == (4, 16, 32)
    latents = model.encode_images(torch.zeros(1, 3, 32, 64))
    assert latents.shape == (1, 4, 16, 32)
    assert model.decode(latents)[0].size == (64, 32)


def test_t5_weights_reach_the_sampled_latents(sd3_dir):
    # The sampler's latents depend on T5: changing only its weights changes them.
    model = load_flow_model(sd3_dir, max_sequence_length=8)
    sched = schedule(model.scheduler, 2)
    noise = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))

    def latents():
        text = encode(model, PROMPTS, guidance_scale=1.0)
        return sample(model.transformer, text, noise, sched, guidance_scale=1.0, noise_level=0.0).final

    before = latents()
    assert before.shape == (2, 4, 32, 32) and torch.equal(latents(), before)  # deterministic
    # New T5 token embeddings (rescaling T5's output would not do: SD3 layer-normalises its context).
    embeddings = model.text_encoders[2].shared.weight
    with torch.no_grad():
        embeddings.copy_(torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(1)))
    # T5's 8 of the 85 context tokens move the images by ~2e-3 (the CLIPs by ~0.1); without T5 not at all.
    assert (latents() - before).abs().max() > 2e-4


def test_sd3_without_t5_pads_zero_t5_tokens(sd3_no_t5_dir):
    index = json.loads((sd3_no_t5_dir / "model_index.json").read_text())
    assert index["text_encoder_3"] == [None, None] and index["tokenizer_3"] == [None, None]
    model = load_flow_model(sd3_no_t5_dir, max_sequence_length=8)
    assert len(model.text_encoders) == 2 and model.transformer.config.joint_attention_dim == 64
    embeds, pooled = model.encode_prompts(PROMPTS)
    # Two CLIPs of width 32, 77 tokens each, side by side, then 8 zero T5 tokens.
    assert embeds.shape == (2, 77 + 8, 64) and pooled.shape == (2, 64)
    assert torch.count_nonzero(embeds[:, 77:]) == 0 and torch.count_nonzero(embeds[:, :77]) > 0


def test_load_flow_model_errors_name_the_path_and_component(sd3_dir, pixel_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither model_index.json"):
        load_flow_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_flow_model(tmp_path / "absent")
    broken = tmp_path / "no_vae"
    shutil.copytree(sd3_dir, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(FileNotFoundError, match=r"no_vae is missing the 'vae' component"):
        load_flow_model(broken)
    broken = tmp_path / "no_transformer"
    shutil.copytree(pixel_dir, broken)
    index = json.loads((broken / FLOW_INDEX).read_text())
    index["transformer"] = None
    (broken / FLOW_INDEX).write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"no_transformer/flow_model.json lists no 'transformer'"):
        load_flow_model(broken)


def test_pixel_flow_model_loads_encodes_and_round_trips(pixel_dir):
    model = load_flow_model(pixel_dir)
    assert model.vae is None and model.pipeline is None and model.default_size == 16
    n_params = sum(p.numel() for p in model.transformer.parameters())
    assert 0.5e6 < n_params < 0.7e6
    assert model.latent_shape(16, 16) == (3, 16, 16)
    embeds, pooled = model.encode_prompts(PROMPTS + [""])
    assert embeds.shape == (3, 12, 64) and pooled.shape == (3, 64)
    # Prompts that differ in one word get different conditioning.
    left, right = model.encode_prompts(["a red square on the left", "a red square on the right"])[1]
    assert not torch.allclose(left, right)

    images = [shapes.render(p, 16, np.random.default_rng(i)) for i, p in enumerate(PROMPTS)]
    latents = model.encode_images(images)
    assert latents.shape == (2, 3, 16, 16) and latents.min() >= -1 and latents.max() <= 1
    for image, back in zip(images, model.decode(latents)):
        assert np.array_equal(np.asarray(image), np.asarray(back))

    with torch.no_grad():
        v = model.transformer(hidden_states=latents, timestep=torch.tensor([500.0, 500.0]),
                              encoder_hidden_states=embeds[:2], pooled_projections=pooled[:2]).sample
    assert v.shape == latents.shape


def test_lora_targets_exist_and_peft_wraps_them(pixel_dir):
    from peft import LoraConfig

    model = load_flow_model(pixel_dir)
    targets = lora_target_modules(model.transformer)
    assert targets == ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                       "attn.add_v_proj", "attn.to_add_out"]
    names = [n for n, m in model.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    matched = [n for n in names if any(n.endswith("." + t) for t in targets)]
    # 4 blocks x 8 projections, less the last block's to_add_out (its text output is unused).
    assert len(matched) == 4 * 8 - 1

    model.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian"))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.transformer.named_modules() if ".lora_A" in n}
    assert wrapped == set(matched)
    trainable = [n for n, p in model.transformer.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    embeds, pooled = model.encode_prompts(PROMPTS)
    out = model.transformer(hidden_states=torch.zeros(2, 3, 16, 16), timestep=torch.tensor([300.0, 700.0]),
                            encoder_hidden_states=embeds, pooled_projections=pooled).sample
    out.pow(2).mean().backward()
    assert all(p.grad is not None for p in model.transformer.parameters() if p.requires_grad)


def test_lora_targets_of_a_one_block_sd3(sd3_dir):
    model = load_flow_model(sd3_dir)
    # One block is also the last: it has no to_add_out, so that name is left out.
    assert lora_target_modules(model.transformer) == [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
        "attn.add_v_proj"]
    with pytest.raises(ValueError, match="none of the attention projections"):
        lora_target_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_lora_targets_leave_sd35s_second_attention_out_as_the_peers_do(tmp_path):
    """SD3.5's dual-attention blocks have a second, image-only attention (attn2) whose projections are named
    to_q/k/v/out.0 too; the peers' ``attn.``-prefixed targets (flow_grpo, NVlabs' DiffusionNFT) do not wrap it."""
    from peft import LoraConfig

    model = load_flow_model(build_tiny_sd3_pipeline(tmp_path / "sd35", num_layers=2, dual_attention=True))
    linear = [n for n, m in model.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    second = [n for n in linear if ".attn2." in n]
    assert len(second) == 2 * 4  # both blocks dual-attention: q, k, v, out of attn2
    model.transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=model.lora_targets()))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.transformer.named_modules() if ".lora_A" in n}
    assert not wrapped & set(second)
    # two blocks x 8 projections, less the last block's to_add_out: 15 wrapped, 23 with attn2's 8
    assert len(wrapped) == 15
