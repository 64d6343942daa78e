"""The tiny builders' shape options (used by benchmarks/bench_gpu.py to build real checkpoints' shapes)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from grouprl.models.tiny import build_tiny_text_lm, build_tiny_vlm

CORPUS = ["the lungs are clear", "no pleural effusion", "the heart is enlarged"] * 3


def rope(config: dict) -> dict:
    """RoPE settings of a saved config, wherever this transformers version writes them."""
    return {**config, **(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}


def test_vlm_shape_options_reach_the_saved_config_and_it_generates(tmp_path):
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    out = build_tiny_vlm(tmp_path / "vlm", CORPUS, hidden_size=48, heads=2, kv_heads=1, vision_depth=3,
                         model_vocab_size=1000, vision_intermediate_size=40, window_size=112,
                         fullatt_block_indexes=[0, 2], mrope_section=[4, 4, 4], rope_theta=1e6,
                         max_position_embeddings=8192, save_dtype="bfloat16")
    config = json.loads((out / "config.json").read_text())
    text, vision = config.get("text_config", config), config["vision_config"]
    assert text["vocab_size"] == 1000
    assert rope(text)["rope_theta"] == 1e6 and text["max_position_embeddings"] == 8192
    assert rope(text)["mrope_section"] == [4, 4, 4]
    assert vision["intermediate_size"] == 40 and vision["window_size"] == 112
    assert vision["fullatt_block_indexes"] == [0, 2] and vision["depth"] == 3
    assert (config.get("dtype") or config.get("torch_dtype")) == "bfloat16"

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(out)
    assert model.dtype == torch.bfloat16  # the saved weights are bf16
    assert model.get_input_embeddings().weight.shape[0] == 1000
    processor = AutoProcessor.from_pretrained(out)
    assert len(processor.tokenizer) < 1000  # rows beyond the tokenizer's, as real checkpoints pad
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[Image.new("RGB", (112, 112), 128)], return_tensors="pt")
    torch.manual_seed(0)
    out_ids = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=True)
    assert out_ids.shape[1] == inputs["input_ids"].shape[1] + 4


def test_text_lm_shape_options(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = build_tiny_text_lm(tmp_path / "lm", CORPUS, model_vocab_size=4096, rope_theta=1e6,
                             max_position_embeddings=2048, save_dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 4096 and rope(config)["rope_theta"] == 1e6
    assert config["max_position_embeddings"] == 2048
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer(["the lungs"], return_tensors="pt")
    torch.manual_seed(0)
    generated = model.generate(**ids, max_new_tokens=3, min_new_tokens=3, do_sample=True)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 3


def test_defaults_unchanged(tmp_path):
    out = build_tiny_vlm(tmp_path / "vlm", CORPUS)
    config = json.loads((out / "config.json").read_text())
    vision = config["vision_config"]
    assert vision["intermediate_size"] == 64 and vision["window_size"] == 56
    assert vision["fullatt_block_indexes"] == [1]
    assert config["text_config"]["vocab_size"] % 64 == 0
    assert (config.get("dtype") or config.get("torch_dtype")) == "float32"


def test_bad_shape_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="model_vocab_size"):
        build_tiny_text_lm(tmp_path / "a", CORPUS, model_vocab_size=10)
    with pytest.raises(ValueError, match="mrope_section"):
        build_tiny_vlm(tmp_path / "b", CORPUS, mrope_section=[1, 1, 1])
    with pytest.raises(ValueError, match="fullatt_block_indexes"):
        build_tiny_vlm(tmp_path / "c", CORPUS, fullatt_block_indexes=[5])
    with pytest.raises(ValueError, match="save_dtype"):
        build_tiny_text_lm(tmp_path / "d", CORPUS, save_dtype="int8")
