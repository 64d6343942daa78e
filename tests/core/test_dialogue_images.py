"""Images returned mid-dialogue (issue 33, item 3): a VLM dialogue whose observations bring 0, 1 or 2
images is trained on exactly what it was sampled from.

A dialogue is built by hand in token space, as the multi-turn loop builds it: the first prompt
(``encode_sample``, one image), a policy turn, the observation (``between_turns``, images
expanded into their placeholder runs, their tensors appended with ``append_model_inputs``), the
next policy turn, ... It is checked against the processor's own encoding of the whole
conversation rendered at once, then scored: each policy turn from its context (as generation
sees it) and the whole dialogue at once in a padded batch (as the trainer scores it), and the
M-RoPE positions are checked over the whole dialogue. Qwen2-VL, Qwen2.5-VL and Qwen3-VL.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from grouprl.data.sample import Sample
from grouprl.models.inputs import _PER_TOKEN_KEYS, encode_sample, end_of_turn_id, forward_kwargs, left_pad, \
    tokenizer_of
from grouprl.rollout.batch import RolloutBatch
from grouprl.rollout.engine import EncodedPrompt, SamplingParams
from grouprl.rollout.hf_engine import HFGenerationEngine
from grouprl.rollout.logprobs import compute_log_probs, forward_response_log_probs
from grouprl.rollout.turn_tokens import append_model_inputs, between_turns

from test_turn_tokens import template_text  # (`paths`: tests/conftest.py)

MODELS = ("Qwen2-VL", "Qwen2.5-VL", "Qwen3-VL")
TURNS = ("Heart size is normal.", "Small left pleural effusion.", "No pneumothorax.")


def picture(size, colour) -> Image.Image:
    image = Image.new("RGB", size, (90, 90, 90))
    image.paste(colour, (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    return image


def observations(returned: int) -> list[list[dict]]:
    """What comes back after the first and the second policy turn, holding ``returned`` images in all
    (of different sizes, so that images out of order would not fit their placeholders)."""
    grey = np.full((60, 90), 200, np.uint8)  # an array, as a tool may return it
    if returned == 0:
        return [[{"role": "tool", "name": "zoom", "content": "nothing to enlarge"}],
                [{"role": "user", "content": "Look again."}]]
    first = [{"role": "tool", "name": "zoom", "content": [{"type": "image", "image": picture((84, 56), (0, 200, 0))},
                                                          {"type": "text", "text": "right lower lung"}]}]
    if returned == 1:
        return [first, [{"role": "user", "content": "Look again."}]]
    return [first, [{"role": "user", "content": [{"type": "text", "text": "Look again."},
                                                 {"type": "image", "image": grey}]}]]


def first_samples() -> list[Sample]:
    """Two first prompts with pictures of different sizes: rows of different lengths, padded together."""
    return [Sample(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Findings?"}]}],
                   images=[picture(size, (200, 30, 30))], index=i) for i, size in enumerate([(112, 112), (56, 84)])]


# ---------------------------------------------------------------------------- the models


def _qwen_vl(kind: str, processor):
    """A randomly initialised ``kind`` (Qwen2-VL or Qwen3-VL) of a few layers on the tiny tokenizer, and its
    processor: the same construction as ``grouprl.models.tiny.build_tiny_vlm`` for Qwen2.5-VL."""
    from transformers import (GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                              Qwen3VLProcessor)
    from transformers.models.qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = processor.tokenizer
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in
           ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>", "<|im_end|>")}
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=True)
    text = dict(vocab_size=(len(tokenizer) + 63) // 64 * 64, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
    torch.manual_seed(0)
    if kind == "Qwen2-VL":
        config = Qwen2VLConfig(text_config=dict(text, rope_parameters=rope), vision_config=dict(
            depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2), **tokens)
        model = Qwen2VLForConditionalGeneration(config)
        processor = Qwen2VLProcessor(image_processor=processor.image_processor, tokenizer=tokenizer,
                                     video_processor=Qwen2VLVideoProcessor(), chat_template=template_text("Qwen2.5-VL"))
    else:
        config = Qwen3VLConfig(
            text_config=dict(text, head_dim=16, rope_parameters=dict(rope, mrope_interleaved=True)),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                               spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                               num_position_embeddings=64, deepstack_visual_indexes=[0]), **tokens)
        model = Qwen3VLForConditionalGeneration(config)
        image_processor = Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2,
                                                min_pixels=32 * 32, max_pixels=128 * 128)
        processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     video_processor=Qwen3VLVideoProcessor(), chat_template=template_text("Qwen3-VL"))
    model.generation_config = GenerationConfig(bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
                                               eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]])
    return model.eval(), processor


@pytest.fixture(scope="module")
def models(paths):
    """``models(kind)``: (model, processor) of a tiny ``kind``, built once per module."""
    from grouprl.models.loading import load_model_and_processor

    built = {}

    def get(kind: str):
        if kind not in built:
            model, processor, _ = load_model_and_processor(paths["vlm"])
            built[kind] = (model.eval(), processor) if kind == "Qwen2.5-VL" else _qwen_vl(kind, processor)
        return built[kind]

    return get


# ---------------------------------------------------------------------------- the dialogue


class Dialogue:
    """One dialogue in token space: the first prompt, then segments (policy turns and what came between),
    with the model inputs of everything so far, as the multi-turn loop keeps them."""

    def __init__(self, processor, sample: Sample):
        self.processor, self.sample = processor, sample
        encoded = encode_sample(processor, sample)
        self.prompt = encoded["input_ids"][0]
        self.inputs = {k: v for k, v in encoded.items() if k not in _PER_TOKEN_KEYS}
        self.images = list(sample.images)
        self.segments: list[tuple[torch.Tensor, bool]] = []
        self.contexts: list[EncodedPrompt] = []  # what each policy turn was generated from
        self.messages = list(sample.messages)  # the conversation as messages, images as bare slots

    def context(self) -> EncodedPrompt:
        return EncodedPrompt(torch.cat([self.prompt, *[ids for ids, _ in self.segments]]), dict(self.inputs))

    def policy_turn(self, ids: list[int], text: str) -> None:
        self.contexts.append(self.context())
        self.segments.append((torch.tensor(ids, dtype=torch.long), True))
        self.messages.append({"role": "assistant", "content": text})

    def observe(self, messages: list[dict]) -> None:
        between = between_turns(self.processor, messages, after_end_of_turn=True, images_before=len(self.images))
        self.segments.append((torch.tensor(between.ids, dtype=torch.long), False))
        self.inputs = append_model_inputs(self.inputs, between.model_inputs)
        self.images += between.images
        self.messages += [{**m, "content": m["content"] if isinstance(m["content"], str) else
                           [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]} for m in messages]

    @property
    def response(self) -> torch.Tensor:
        return torch.cat([ids for ids, _ in self.segments])

    @property
    def policy(self) -> torch.Tensor:
        return torch.cat([torch.full((len(ids),), int(policy)) for ids, policy in self.segments])


def dialogue(processor, sample: Sample, returned: int) -> Dialogue:
    tokenizer = tokenizer_of(processor)
    d = Dialogue(processor, sample)
    for turn, observation in zip(TURNS, observations(returned) + [None]):
        d.policy_turn(tokenizer(turn, add_special_tokens=False)["input_ids"] + [end_of_turn_id(processor)], turn)
        if observation is not None:
            d.observe(observation)
    return d


def as_batch(dialogues: list[Dialogue]) -> RolloutBatch:
    pad = tokenizer_of(dialogues[0].processor).pad_token_id
    prompt_ids, prompt_mask = left_pad([d.prompt for d in dialogues], pad)
    width = max(len(d.response) for d in dialogues)
    response_ids = torch.full((len(dialogues), width), pad)
    response_mask, policy_mask = torch.zeros_like(response_ids), torch.zeros_like(response_ids)
    for row, d in enumerate(dialogues):
        n = len(d.response)
        response_ids[row, :n], response_mask[row, :n], policy_mask[row, :n] = d.response, 1, d.policy
    return RolloutBatch(samples=[d.sample for d in dialogues], group_index=torch.arange(len(dialogues)),
                        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, policy_mask=policy_mask, responses=list(TURNS[-1:]) * len(dialogues),
                        truncated=torch.zeros(len(dialogues), dtype=torch.bool),
                        model_inputs=[d.inputs for d in dialogues])


def image_runs(ids: torch.Tensor, image_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive image placeholder tokens in ``ids``."""
    runs, start = [], None
    for i, is_image in enumerate((ids == image_id).tolist() + [False]):
        if is_image and start is None:
            start = i
        elif not is_image and start is not None:
            runs.append((start, i))
            start = None
    return runs


# ---------------------------------------------------------------------------- the checks


@pytest.mark.parametrize("returned", [0, 1, 2])
@pytest.mark.parametrize("kind", MODELS)
def test_a_dialogue_with_returned_images_is_trained_on_what_it_was_sampled_from(models, kind, returned):
    model, processor = models(kind)
    dialogues = [dialogue(processor, sample, returned) for sample in first_samples()]

    # the token-space dialogue is the processor's encoding of the whole conversation rendered at once
    for d in dialogues:
        assert len(d.images) == 1 + returned
        text = processor.apply_chat_template(d.messages, tokenize=False)
        whole = processor(text=[text], images=d.images, return_tensors="pt", add_special_tokens=False)
        ids = torch.cat([d.prompt, d.response])
        assert whole["input_ids"][0, :len(ids)].tolist() == ids.tolist()
        assert tokenizer_of(processor).decode(whole["input_ids"][0, len(ids):]).strip() == ""
        assert torch.equal(d.inputs["image_grid_thw"], whole["image_grid_thw"])
        assert torch.equal(d.inputs["pixel_values"], whole["pixel_values"])

    # each policy turn's log-probs from its own context, as generation sees it (the images so far), are the
    # log-probs the trainer computes for it on the whole dialogue at once, in a padded batch of two
    batch = as_batch(dialogues)
    with torch.no_grad():
        trained, _ = compute_log_probs(model, batch, micro_batch_size=len(batch))
        # and packed into one row without padding (worker.actor.padding_free), positions restarting per dialogue
        packed, _ = compute_log_probs(model, batch, micro_batch_size=len(batch), padding_free=True)
        torch.testing.assert_close(packed, trained, atol=1e-5, rtol=0)
        for row, d in enumerate(dialogues):
            at = 0
            for ids, policy in d.segments:
                if policy:
                    context = d.contexts.pop(0)
                    alone, _ = forward_response_log_probs(
                        model, context.ids[None], torch.ones_like(context.ids)[None], ids[None],
                        torch.ones_like(ids)[None], context.model_inputs)
                    torch.testing.assert_close(trained[row, at:at + len(ids)], alone[0], atol=1e-5, rtol=0)
                at += len(ids)
    # the returned images' placeholders are attended, not scored; a loss over the policy tokens back-propagates
    assert bool(torch.isfinite(trained).all())
    image_id = model.config.image_token_id
    returned_placeholders = batch.response_ids == image_id
    assert int(returned_placeholders.sum()) > 0 if returned else int(returned_placeholders.sum()) == 0
    assert bool((trained[returned_placeholders] == 0).all())
    trained, _ = compute_log_probs(model, batch, micro_batch_size=len(batch))
    (trained * batch.policy_mask).sum().backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)

    # M-RoPE over the whole dialogue: one image_grid_thw row per placeholder run, each run laid out on its grid
    merge = processor.image_processor.merge_size
    for d in dialogues:
        ids = torch.cat([d.prompt, d.response])[None]
        grid = d.inputs["image_grid_thw"]
        runs = image_runs(ids[0], image_id)
        assert len(runs) == len(grid) == 1 + returned
        kwargs = forward_kwargs(model, ids, torch.ones_like(ids), {"image_grid_thw": grid})
        positions, _ = model.model.get_rope_index(ids, kwargs["mm_token_type_ids"], image_grid_thw=grid,
                                                  attention_mask=kwargs["attention_mask"])
        for (start, end), (t, h, w) in zip(runs, grid.tolist()):
            assert end - start == t * h * w // merge**2
            _, rows, cols = positions[:, 0, start:end]
            assert len(rows.unique()) == h // merge and len(cols.unique()) == w // merge
            # the text after an image goes on from the image's largest position
            assert int(positions[0, 0, end]) == int(positions[:, 0, start:end].max()) + 1


@pytest.mark.parametrize("kind", MODELS)
def test_hf_generation_continues_from_a_context_holding_returned_images(models, kind):
    model, processor = models(kind)
    dialogues = [dialogue(processor, sample, 2) for sample in first_samples()]
    engine = HFGenerationEngine(model, processor)
    params = SamplingParams(n=1, max_new_tokens=6, seed=5, return_log_probs=True)
    contexts = [d.context() for d in dialogues]
    out = engine.generate([d.sample for d in dialogues], params, prompts=contexts)
    image_id = model.config.image_token_id
    assert [int((c.ids == image_id).sum()) > 0 for c in contexts] == [True, True]
    for row, d in enumerate(dialogues):
        assert torch.equal(out.prompt_ids[row][out.prompt_mask[row].bool()], contexts[row].ids)
        n = int(out.response_mask[row].sum())
        d.segments.append((out.response_ids[row, :n], True))
    # the sampled turn scored within the whole dialogue, in a padded batch: the sampler's log-probs
    batch = as_batch(dialogues)
    with torch.no_grad():
        trained, _ = compute_log_probs(model, batch, micro_batch_size=len(batch))
    for row, d in enumerate(dialogues):
        n = int(out.response_mask[row].sum())
        at = len(d.response) - n
        torch.testing.assert_close(trained[row, at:at + n], out.rollout_log_probs[row, :n], atol=1e-5, rtol=0)
