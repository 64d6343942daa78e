"""Tiny offline models, loading, prompt encoding, LoRA, freezing and image-token checks."""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from grouprl.data.sample import Sample
from grouprl.models.loading import (
    apply_lora,
    check_image_tokens,
    find_vision_tower,
    freeze,
    load_model_and_processor,
    load_reference_model,
    reference_log_prob_context,
)
from grouprl.models.inputs import collate_model_inputs, encode_prompts
from grouprl.models.tiny import SPECIAL_TOKENS, build_tiny_text_lm, build_tiny_vlm, build_tokenizer
from grouprl.rollout.logprobs import forward_response_log_probs

CORPUS = [
    "Heart size is normal. No pleural effusion or pneumothorax.",
    "Mild cardiomegaly. Small left pleural effusion.",
    "Right pneumothorax is present. No focal consolidation.",
    "No acute cardiopulmonary process. Lungs are clear.",
    "Possible right lower lobe consolidation. Support device in place.",
    "A 12 mm nodule in the left upper lobe. Mild pulmonary edema.",
] * 4


def image(color, size=(112, 112)):
    return Image.new("RGB", size, color)


def vlm_sample(n_images=1, index=0, text="Describe the findings."):
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    images = [image((40 * i + 30, 90, 160), (112 + 28 * i, 112)) for i in range(n_images)]
    return Sample(messages=[{"role": "user", "content": content}], images=images, source="test", index=index)


def text_sample(text, index=0):
    return Sample(messages=[{"role": "user", "content": [{"type": "text", "text": text}]}], source="test", index=index)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        "vlm": build_tiny_vlm(root / "vlm", CORPUS, seed=0),
        "lm": build_tiny_text_lm(root / "lm", CORPUS, seed=0),
    }


@pytest.fixture(scope="module")
def vlm(paths):
    model, processor, is_vlm = load_model_and_processor(paths["vlm"])
    assert is_vlm
    return model, processor


# --- tokenizer -----------------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_specials():
    tokenizer = build_tokenizer(CORPUS)
    assert 256 + len(SPECIAL_TOKENS) <= len(tokenizer) <= 256 + len(SPECIAL_TOKENS) + 256
    for text in CORPUS[:6] + ["unseen: 3.5 cm mass, ¿qué? \n\n  tabs\t", "<|im_end|> inside"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(SPECIAL_TOKENS)
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token == "<|im_end|>"
    # Specials are single tokens even when they appear inside text.
    assert tokenizer.encode("a<|image_pad|>b").count(ids["<|image_pad|>"]) == 1


def test_chat_template_renders_images_and_generation_prompt():
    tokenizer = build_tokenizer(CORPUS)
    messages = [
        {"role": "system", "content": "You are a radiologist."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Findings?"}]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a radiologist.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Findings?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not no_prompt.endswith("assistant\n")


# --- building and loading ------------------------------------------------------------------------------


def test_tiny_vlm_loads_offline_through_auto_classes(paths):
    model = AutoModelForImageTextToText.from_pretrained(paths["vlm"])
    processor = AutoProcessor.from_pretrained(paths["vlm"])
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    tokenizer = processor.tokenizer
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>") == processor.image_token_id
    assert model.config.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert model.config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert model.config.text_config.vocab_size >= len(tokenizer)
    assert (paths["vlm"] / "model.safetensors").exists()
    assert not list(paths["vlm"].glob("*.bin"))


def test_load_model_and_processor_kinds(paths):
    model, tokenizer, is_vlm = load_model_and_processor(paths["lm"], dtype="bfloat16", gradient_checkpointing=True)
    assert not is_vlm
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert next(model.parameters()).dtype == torch.bfloat16
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert tokenizer.pad_token_id is not None and tokenizer.chat_template
    # The reloaded tokenizer encodes exactly like the one that was built.
    built = build_tokenizer(CORPUS)
    for text in CORPUS[:6]:
        assert tokenizer.encode(text) == built.encode(text)


def test_tiny_models_are_seeded(tmp_path):
    a = build_tiny_text_lm(tmp_path / "a", CORPUS, seed=3)
    b = build_tiny_text_lm(tmp_path / "b", CORPUS, seed=3)
    c = build_tiny_text_lm(tmp_path / "c", CORPUS, seed=4)
    wa, wb, wc = (load_model_and_processor(p)[0].model.layers[0].mlp.up_proj.weight for p in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


def test_load_errors(tmp_path, monkeypatch):
    # Offline mode makes the hub attempt fail at once instead of after network retries.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model_and_processor(tmp_path / "missing")
    with pytest.raises(OSError, match="offline"):
        load_model_and_processor("grouprl-tests/no-such-model-anywhere")
    with pytest.raises(ValueError, match="dtype='float64'"):
        load_model_and_processor(tmp_path, dtype="float64")


# --- prompt encoding and image tokens ------------------------------------------------------------------


def test_encode_prompts_with_one_and_two_images(vlm):
    model, processor = vlm
    samples = [vlm_sample(1, index=0), vlm_sample(2, index=1), text_sample("No image here.", index=2)]
    ids, mask, inputs = encode_prompts(processor, samples)
    assert ids.shape == mask.shape and ids.shape[0] == 3
    # Left padding: every row ends with the assistant header, real tokens are contiguous.
    assert bool(mask[:, -1].all())
    assert all(bool((row.diff() >= 0).all()) for row in mask)
    image_id = model.config.image_token_id
    merge = processor.image_processor.merge_size
    for row, extra in zip(ids, inputs[:2]):
        grid = extra["image_grid_thw"]
        assert int((row == image_id).sum()) == int((grid.prod(-1) // merge**2).sum())
        assert extra["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    assert inputs[1]["image_grid_thw"].shape[0] == 2
    assert inputs[2] == {}
    collated = collate_model_inputs(inputs)
    assert torch.equal(collated["image_grid_thw"], torch.cat([inputs[0]["image_grid_thw"], inputs[1]["image_grid_thw"]]))
    assert collated["pixel_values"].shape[0] == inputs[0]["pixel_values"].shape[0] + inputs[1]["pixel_values"].shape[0]
    # The collated micro-batch runs through the model.
    out = model(input_ids=ids, attention_mask=mask, **collated)
    assert out.logits.shape[:2] == ids.shape


def test_check_image_tokens_passes_and_fails_clearly(vlm):
    model, processor = vlm
    assert check_image_tokens(processor, model, vlm_sample(1)) == 16
    assert check_image_tokens(processor, model, vlm_sample(2)) > 16
    wrong = copy.deepcopy(model.config)
    wrong.image_token_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    with pytest.raises(ValueError, match=r"sample test#5: the prompt holds 0 image token\(s\).* implies 16"):
        check_image_tokens(processor, wrong, vlm_sample(1, index=5))
    # A processor that merges differently from the vision tower writes the wrong number of tokens.
    other = copy.deepcopy(processor)
    other.image_processor.merge_size = 1
    with pytest.raises(ValueError, match=r"sample test#6: the prompt holds 64 image token\(s\).*merge_size=2 implies 16"):
        check_image_tokens(other, model, vlm_sample(1, index=6))
    bad = vlm_sample(2, index=7)
    bad.images = bad.images[:1]
    with pytest.raises(ValueError, match=r"sample test#7: the messages have 2 image slot\(s\) but the sample has 1"):
        check_image_tokens(processor, model, bad)


def test_prompt_length_limit(paths):
    _, tokenizer, _ = load_model_and_processor(paths["lm"])
    long = text_sample("Mild cardiomegaly. " * 20, index=3)
    with pytest.raises(ValueError, match=r"sample test#3: the prompt has \d+ tokens, more than max_prompt_length=16"):
        encode_prompts(tokenizer, [long], max_prompt_length=16)
    ids, mask, _ = encode_prompts(tokenizer, [long, text_sample("hi")], max_prompt_length=16, truncation="left")
    assert ids.shape == (2, 16)
    full, _, _ = encode_prompts(tokenizer, [long])
    assert torch.equal(ids[0], full[0, -16:])
    with pytest.raises(ValueError, match="truncation='right'"):
        encode_prompts(tokenizer, [long], truncation="right")


def test_text_tokenizer_refuses_images(paths):
    _, tokenizer, _ = load_model_and_processor(paths["lm"])
    with pytest.raises(ValueError, match="sample test#0 has 1 image"):
        encode_prompts(tokenizer, [vlm_sample(1)])


# --- LoRA, freezing, reference -------------------------------------------------------------------------


def test_lora_on_language_model_only(paths):
    model, _, _ = load_model_and_processor(paths["vlm"])
    peft_model = apply_lora(model, rank=4, alpha=8)
    lora = [n for n, _ in peft_model.named_parameters() if "lora_" in n]
    assert lora and all("language_model" in n for n in lora)
    assert not any("visual" in n for n in lora)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable == lora
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(peft_model, rank=4, alpha=8)


def test_lora_options(paths):
    model, _, _ = load_model_and_processor(paths["vlm"])
    with_vision = apply_lora(model, rank=2, alpha=4, exclude_vision=False)
    assert any("visual" in n and "lora_" in n for n, _ in with_vision.named_parameters())

    model, _, _ = load_model_and_processor(paths["vlm"])
    only_q = apply_lora(model, rank=2, alpha=4, target_modules=["q_proj", "v_proj"])
    lora = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in only_q.named_parameters() if "lora_" in n}
    assert lora == {"q_proj", "v_proj"}

    model, _, _ = load_model_and_processor(paths["vlm"])
    # "qkv" exists only in the vision tower, so with the tower excluded it matches nothing.
    with pytest.raises(ValueError, match=r"LoRA target module 'qkv' matches no module outside the vision tower"):
        apply_lora(model, rank=2, alpha=4, target_modules=["qkv"])


def test_freeze_vision_tower_and_trainable_modules(paths):
    model, _, _ = load_model_and_processor(paths["vlm"])
    name, tower = find_vision_tower(model)
    assert name == "model.visual"
    freeze(model, freeze_vision_tower=True)
    assert not any(p.requires_grad for p in tower.parameters())
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("model.visual."))

    left = freeze(model, freeze_vision_tower=False, trainable_modules=["language_model.layers.1."])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("language_model.layers.1." in n for n in trainable)
    assert left == sum(p.numel() for p in model.parameters() if p.requires_grad)

    with pytest.raises(ValueError, match=r"trainable module 'decoder\.blocks' matches no parameter name; .*model\.visual"):
        freeze(model, freeze_vision_tower=False, trainable_modules=["decoder.blocks"])

    text_model, _, _ = load_model_and_processor(paths["lm"])
    freeze(text_model, freeze_vision_tower=True)  # nothing to freeze on a text model
    assert all(p.requires_grad for p in text_model.parameters())


def test_reference_is_policy_with_adapters_disabled(paths):
    model, tokenizer, _ = load_model_and_processor(paths["lm"])
    ids, mask, _ = encode_prompts(tokenizer, [text_sample("Heart size is normal.")])
    response = torch.tensor([tokenizer.encode("No pleural effusion.<|im_end|>")])
    args = (ids, mask, response, torch.ones_like(response), {})
    with torch.no_grad():
        base_lp, _ = forward_response_log_probs(model, *args)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        with reference_log_prob_context(model):
            pass

    policy = apply_lora(model, rank=4, alpha=8)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
        tuned_lp, _ = forward_response_log_probs(policy, *args)
        with reference_log_prob_context(policy):
            ref_lp, _ = forward_response_log_probs(policy, *args)
    assert torch.allclose(ref_lp, base_lp, atol=1e-5)
    assert not torch.allclose(tuned_lp, base_lp, atol=1e-3)

    reference = load_reference_model(paths["lm"])
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    with torch.no_grad():
        frozen_lp, _ = forward_response_log_probs(reference, *args)
    assert torch.allclose(frozen_lp, base_lp, atol=1e-5)
