"""Engines continuing a dialogue whose context holds images returned by a tool (0, 1 or 2 of them).

A dialogue's next turn is generated from its context, an ``EncodedPrompt``: the sample's first
prompt (its own image), a policy turn, then a tool message with the returned images, their
placeholders expanded and their tensors appended to the model inputs
(:mod:`grouprl.rollout.turn_tokens`). The vllm engine re-processes images itself: its request must
carry the sample's image and then the returned ones, against ids with one placeholder per image
(checked here without vLLM; tests/real_vllm/test_vllm_tools.py runs it on the real one). hf_lean
prefills a vision-language prompt with the model's own forward: it must sample from such a context
what ``hf`` samples, with the log-probs the trainer scores.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from grouprl.data.sample import Sample
from grouprl.models.inputs import encode_prompts, end_of_turn_id, render_prompt, tokenizer_of
from grouprl.models.loading import load_model_and_processor
from grouprl.rollout.engine import EncodedPrompt, SamplingParams
from grouprl.rollout.hf_engine import HFGenerationEngine
from grouprl.rollout.lean_engine import LeanGenerationEngine
from grouprl.rollout.logprobs import compute_log_probs
from grouprl.rollout.turn_tokens import append_model_inputs, between_turns
from grouprl.rollout.vllm_engine import check_prompt_images, prompt_images, vllm_prompt

from test_engine import with_eos_bias  # the engine tests' EOS bias

SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
TURN = "Zoom in."
COLOURS = [(30, 200, 30), (30, 30, 200)]


@pytest.fixture(scope="module")
def vlm(paths):
    model, processor, _ = load_model_and_processor(paths["vlm"])
    with_eos_bias(model, processor.tokenizer.convert_tokens_to_ids("<|im_end|>"), probability=0.1)
    return model.eval(), processor


def first_sample() -> Sample:
    return Sample(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Findings?"}]}],
                  images=[Image.new("RGB", (112, 112), (200, 30, 30))], index=0)


def dialogue_context(processor, sample: Sample, returned: int, colours=COLOURS) -> tuple[EncodedPrompt,
                                                                                      list[Image.Image]]:
    """The context of a dialogue's second turn: ``sample``'s prompt, the turn TURN, then a tool message
    returning ``returned`` pictures of ``colours`` (and a line of text); and those pictures."""
    ids, mask, inputs = encode_prompts(processor, [sample])
    tokenizer = tokenizer_of(processor)
    turn = tokenizer(TURN, add_special_tokens=False)["input_ids"] + [end_of_turn_id(processor)]
    pictures = [Image.new("RGB", (56 + 28 * k, 84), colours[k]) for k in range(returned)]
    message = {"role": "tool", "name": "zoom",
               "content": [*({"type": "image", "image": p} for p in pictures), {"type": "text", "text": "zoomed"}]}
    between = between_turns(processor, [message], after_end_of_turn=True, images_before=len(sample.images))
    context = torch.cat([ids[0][mask[0].bool()], torch.tensor(turn), torch.tensor(between.ids, dtype=torch.long)])
    return EncodedPrompt(context, append_model_inputs(inputs[0], between.model_inputs), list(between.images)), pictures


@pytest.mark.parametrize("returned", [0, 1, 2])
def test_vllm_request_of_a_dialogue_carries_the_samples_image_then_the_returned_ones(vlm, returned):
    model, processor = vlm
    image_id = model.config.image_token_id
    sample = first_sample()
    context, pictures = dialogue_context(processor, sample, returned)
    images = prompt_images(sample, context)
    request = vllm_prompt(context.ids.tolist(), images, image_token_id=image_id)

    # the very images, in the order of their placeholders: the sample's, then the tool's
    assert [id(x) for x in request["multi_modal_data"]["image"]] == [id(x) for x in sample.images + pictures]
    # the ids are the dialogue as the chat template writes it, one placeholder per image (vLLM expands them)
    text = (render_prompt(processor, sample) + TURN + "<|im_end|>\n<|im_start|>tool\n" + SLOT * returned
            + "zoomed<|im_end|>\n<|im_start|>assistant\n")
    assert request["prompt_token_ids"] == tokenizer_of(processor)(text, add_special_tokens=False)["input_ids"]
    assert request["prompt_token_ids"].count(image_id) == 1 + returned
    assert len(context.model_inputs["image_grid_thw"]) == 1 + returned

    # the image checks count the returned images too
    rows, inputs = [context.ids.tolist()], [context.model_inputs]
    check_prompt_images([sample], rows, inputs, image_token_id=image_id, limit_images=1 + returned, prompts=[context])
    if returned:
        with pytest.raises(ValueError, match=rf"limit_images={returned} "):
            check_prompt_images([sample], rows, inputs, image_token_id=image_id, limit_images=returned,
                                prompts=[context])
        # a context that lost its returned images: its placeholders and tensors are more than the images
        lost = EncodedPrompt(context.ids, context.model_inputs, [])
        with pytest.raises(ValueError, match=rf"holds {1 + returned} image\(s\) but the sample has 1"):
            check_prompt_images([sample], rows, inputs, image_token_id=image_id, prompts=[lost])
        with pytest.raises(ValueError, match=rf"placeholders \(id {image_id}\) for {1 + returned} image\(s\)"):
            check_prompt_images([sample], rows, [{}], image_token_id=image_id, prompts=[lost])


def test_prompt_images_without_a_dialogue_are_the_samples():
    sample = first_sample()
    assert prompt_images(sample) == sample.images
    extra = Image.new("RGB", (28, 28))
    context = EncodedPrompt(torch.tensor([1, 2]), {}, [extra])
    assert prompt_images(sample, context) == [*sample.images, extra]
    with pytest.raises(ValueError, match="returned in its dialogue"):
        check_prompt_images([sample], [[1, 2]], [{}], image_token_id=None, limit_images=1, prompts=[context])


@pytest.mark.parametrize("returned", [1, 2])
def test_hf_lean_continues_a_context_with_returned_images_as_hf_and_the_trainer(vlm, returned):
    """Qwen2.5-VL on the written-out decoder and on the model's forward: the returned images' pixels and
    M-RoPE positions reach hf_lean's prefill, so it samples hf's tokens with the trainer's log-probs."""
    model, processor = vlm
    sample = first_sample()
    context, _ = dialogue_context(processor, sample, returned)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=5, return_log_probs=True)
    want = HFGenerationEngine(model, processor).generate([sample], params, prompts=[context])
    for fused in (None, False):
        got = LeanGenerationEngine(model, processor, fused=fused).generate([sample], params, prompts=[context])
        assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.response_mask, want.response_mask)
        torch.testing.assert_close(got.rollout_log_probs, want.rollout_log_probs, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        scored, _ = compute_log_probs(model, got, micro_batch_size=3)
    torch.testing.assert_close(scored * got.response_mask, got.rollout_log_probs, atol=1e-5, rtol=1e-5)
    # not a vacuous match: the returned pixels count (other colours, same sizes: other log-probs)
    other, _ = dialogue_context(processor, sample, returned, colours=COLOURS[::-1])
    assert torch.equal(other.ids, context.ids)
    got.model_inputs = [other.model_inputs] * len(got)
    with torch.no_grad():
        elsewhere, _ = compute_log_probs(model, got, micro_batch_size=3)
    assert float((elsewhere - scored).abs().max()) > 1e-3


def test_vllm_continues_contexts_longer_than_the_first_prompt_within_its_context(vlm):
    """A dialogue's context outgrows max_prompt_length (turns, tool results, returned images' patches): the
    vllm engine continues it while it fits vLLM's context (max_model_len), and names that limit past it."""
    from grouprl.rollout.vllm_engine import VLLMEngine

    model, processor = vlm
    engine = object.__new__(VLLMEngine)  # no vllm.LLM: _encode is grouprl's own
    engine.processor, engine.pad_token_id = processor, 0
    engine.max_prompt_length, engine.max_model_len = 16, 48
    sample = first_sample()
    long = EncodedPrompt(torch.arange(1, 40))
    ids, mask, inputs = engine._encode([sample], [long])
    assert torch.equal(ids[0][mask[0].bool()], long.ids) and inputs == [{}]
    with pytest.raises(ValueError, match=r"sample .*: the context to continue has 48 tokens, and the vllm engine's "
                                         r"context holds 48"):
        engine._encode([sample], [EncodedPrompt(torch.arange(1, 49))])
