"""Qwen2-VL and Qwen3-VL through grouprl's real code path, on tiny random models built offline.

The README says grouprl loads and trains Qwen2-VL, Qwen2.5-VL, Qwen3-VL and text
LMs through the transformers Auto classes; Qwen2.5-VL and Qwen2 text are covered
by test_models / test_engine / test_trainer. Here each other VLM family is built
from a config, saved with ``save_pretrained``, loaded back with
``load_model_and_processor`` and taken through the image-token check, batched
generation and the log-prob recomputation that training relies on.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import (
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from grouprl.data.sample import Sample
from grouprl.models.loading import check_image_tokens, load_model_and_processor
from grouprl.models.tiny import (
    CHAT_TEMPLATE,
    IM_END,
    IMAGE_PAD,
    PAD_TOKEN,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    _generation_config,
    _seeded_init,
    _special_ids,
    _vocab_for,
    build_tokenizer,
)
from grouprl.rollout.batch import RolloutBatch
from grouprl.rollout.engine import SamplingParams
from grouprl.rollout.hf_engine import HFGenerationEngine
from grouprl.rollout.logprobs import compute_log_probs

CORPUS = [
    "Heart size is normal. No pleural effusion or pneumothorax.",
    "Mild cardiomegaly. Small left pleural effusion.",
    "No acute cardiopulmonary process. Lungs are clear.",
] * 4

HIDDEN, HEADS, KV_HEADS, LAYERS = 64, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
HALF = HEAD_DIM // 2
MROPE_SECTION = [HALF - 2 * (HALF // 3), HALF // 3, HALF // 3]
VISION_HIDDEN, VISION_HEADS, VISION_DEPTH = 32, 2, 2
MERGE = 2
IMAGE_SIZE = 112


def _text_config(tokenizer, ids, **extra):
    return dict(
        vocab_size=_vocab_for(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=4096,
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD_TOKEN],
        **extra,
    )


def _image_processor(patch_size):
    return Qwen2VLImageProcessor(
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=MERGE,
        min_pixels=(patch_size * MERGE) ** 2,
        max_pixels=IMAGE_SIZE * IMAGE_SIZE,
    )


def build_tiny_qwen2_vl(out_dir):
    tokenizer = build_tokenizer(CORPUS)
    ids = _special_ids(tokenizer)
    patch = 14
    config = Qwen2VLConfig(
        text_config=_text_config(
            tokenizer,
            ids,
            max_window_layers=LAYERS,
            rope_scaling={"type": "mrope", "mrope_section": MROPE_SECTION},
            rope_theta=10000.0,
        ),
        vision_config=dict(
            depth=VISION_DEPTH,
            embed_dim=VISION_HIDDEN,
            hidden_size=HIDDEN,  # Qwen2-VL's merger projects to the LM width
            mlp_ratio=2,
            num_heads=VISION_HEADS,
            patch_size=patch,
            spatial_merge_size=MERGE,
            temporal_patch_size=2,
        ),
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    model = _seeded_init(0, lambda: Qwen2VLForConditionalGeneration(config))
    model.generation_config = _generation_config(ids)
    processor = Qwen2VLProcessor(
        image_processor=_image_processor(patch),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    return out_dir


def build_tiny_qwen3_vl(out_dir):
    tokenizer = build_tokenizer(CORPUS)
    ids = _special_ids(tokenizer)
    patch = 16  # Qwen3-VL's patch size
    config = Qwen3VLConfig(
        text_config=_text_config(
            tokenizer,
            ids,
            head_dim=HEAD_DIM,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": MROPE_SECTION,
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=VISION_DEPTH,
            hidden_size=VISION_HIDDEN,
            intermediate_size=2 * VISION_HIDDEN,
            num_heads=VISION_HEADS,
            patch_size=patch,
            spatial_merge_size=MERGE,
            temporal_patch_size=2,
            out_hidden_size=HIDDEN,
            num_position_embeddings=64,  # an 8x8 grid of learned positions, interpolated
            deepstack_visual_indexes=[0],
        ),
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    model = _seeded_init(0, lambda: Qwen3VLForConditionalGeneration(config))
    model.generation_config = _generation_config(ids)
    processor = Qwen3VLProcessor(
        image_processor=_image_processor(patch),
        tokenizer=tokenizer,
        # Built explicitly: the default path would look for files on the hub.
        video_processor=Qwen3VLVideoProcessor(patch_size=patch, merge_size=MERGE, temporal_patch_size=2),
        chat_template=CHAT_TEMPLATE,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    return out_dir


FAMILIES = [
    pytest.param(build_tiny_qwen2_vl, Qwen2VLForConditionalGeneration, Qwen2VLProcessor, id="qwen2_vl"),
    pytest.param(build_tiny_qwen3_vl, Qwen3VLForConditionalGeneration, Qwen3VLProcessor, id="qwen3_vl"),
]


def _sample():
    return Sample(
        messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}],
        images=[Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (180, 40, 40))],
        answer="Clear.",
    )


@pytest.mark.parametrize(("build", "model_cls", "processor_cls"), FAMILIES)
def test_vlm_family_loads_generates_and_scores(tmp_path, build, model_cls, processor_cls):
    path = build(tmp_path / "model")

    model, processor, is_vlm = load_model_and_processor(path)
    assert is_vlm is True
    assert type(model) is model_cls
    assert type(processor) is processor_cls

    sample = _sample()
    n_image_tokens = check_image_tokens(processor, model, sample)
    assert n_image_tokens > 0

    engine = HFGenerationEngine(model, processor)
    batch = engine.generate(
        [sample, sample], SamplingParams(n=2, max_new_tokens=6, seed=0, return_log_probs=True)
    )
    assert isinstance(batch, RolloutBatch)
    assert len(batch) == 4
    assert batch.rollout_log_probs is not None
    assert batch.response_mask.sum() > 0

    with torch.no_grad():
        log_probs, _ = compute_log_probs(model, batch, micro_batch_size=4)
    mask = batch.response_mask.bool()
    diff = (log_probs - batch.rollout_log_probs).abs()[mask]
    assert diff.max().item() < 1e-4, f"max |recomputed - sampler| log-prob = {diff.max().item():.3g}"

    # the static-cache engine (hf_static): images at prefill, a static cache and a traced decoder
    # (torch.compile's eager backend, no code generation) give what plain generate gives
    from grouprl.rollout.static_engine import StaticCacheEngine

    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=6, return_log_probs=True)
    want = engine.generate([sample, sample], greedy)
    static = StaticCacheEngine(model, processor, micro_batch_size=8, compile_backend="eager", prompt_bucket=16)
    got = static.generate([sample, sample], greedy)
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.response_mask, want.response_mask)
    torch.testing.assert_close(got.rollout_log_probs, want.rollout_log_probs, atol=1e-4, rtol=0)
