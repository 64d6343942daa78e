"""The tokens between two policy turns (grouprl.rollout.turn_tokens): observation messages, user and
tool, text and images, as the model's own chat template and processor write them.

The expected text is written out here from the published templates (tests/core/chat_templates),
not derived from the code under test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from grouprl.models.inputs import end_of_turn_id, tokenizer_of
from grouprl.models.tiny import build_tokenizer
from grouprl.rollout.multiturn import turn_boundary_ids
from grouprl.rollout.turn_tokens import BetweenTurns, append_model_inputs, between_turns

TEMPLATES = Path(__file__).parent / "chat_templates"
REPLY = "Check the left side again."
END = "<|im_end|>"
SLOT = "<|vision_start|><|image_pad|><|vision_end|>"


def template_text(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def processors(paths):
    """``processors(name)``: the tiny tokenizer (text templates) or the tiny Qwen2.5-VL processor, carrying
    the published template ``name`` (None: the tiny model's own)."""
    from transformers import AutoProcessor

    def make(name: str | None, *, vision: bool = True):
        if not vision:
            processor = build_tokenizer([REPLY, "zoomed 4", "<tool_response>"])
            processor.add_tokens(["<think>", "</think>"], special_tokens=True)
        else:
            processor = AutoProcessor.from_pretrained(paths["vlm"])
        if name is not None:
            processor.chat_template = template_text(name)
        return processor

    return make


def expanded(processor, text: str, grids: list[torch.Tensor]) -> list[int]:
    """``text`` tokenized with its k-th image slot's one placeholder repeated (grid t*h*w / merge^2) times."""
    merge = processor.image_processor.merge_size
    for grid in grids:
        text = text.replace("<|image_pad|>", "<|placeholder|>" * (int(grid.prod()) // merge**2), 1)
    return tokenizer_of(processor)(text.replace("<|placeholder|>", "<|image_pad|>"),
                                   add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name,vision,kwargs", [(None, True, {}), ("Qwen2.5-Instruct", False, {}),
                                                ("Qwen3", False, {"enable_thinking": False}),
                                                ("Qwen2.5-VL", True, {}), ("Qwen3-VL", True, {})])
def test_one_plain_user_message_gives_the_turn_boundary_ids(processors, name, vision, kwargs):
    processor = processors(name, vision=vision)
    for ended in (True, False):
        for content in (REPLY, [{"type": "text", "text": REPLY}]):
            got = between_turns(processor, [{"role": "user", "content": content}], after_end_of_turn=ended,
                                chat_template_kwargs=kwargs)
            assert got.ids == turn_boundary_ids(processor, REPLY, after_end_of_turn=ended, chat_template_kwargs=kwargs)
            assert got.model_inputs == {} and got.images == []
    cut = between_turns(processor, [{"role": "user", "content": REPLY}], after_end_of_turn=False).ids
    assert cut[0] == end_of_turn_id(processor)


def test_consecutive_tool_results_are_one_user_block_as_qwen_templates_write_them(processors):
    results = [{"role": "tool", "name": "add", "content": "4"}, {"role": "tool", "name": "add", "content": "zoomed 4"}]
    expected = (f"{END}\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\nzoomed 4\n"
                f"</tool_response>{END}\n<|im_start|>assistant\n")
    for name, vision in (("Qwen2.5-Instruct", False), ("Qwen3-VL", True)):
        processor = processors(name, vision=vision)
        got = between_turns(processor, results, after_end_of_turn=False)
        assert tokenizer_of(processor).decode(got.ids) == expected
        # a tool result and then a user message: each where the template puts it
        got = between_turns(processor, [results[0], {"role": "user", "content": REPLY}], after_end_of_turn=True)
        assert tokenizer_of(processor).decode(got.ids) == (
            f"\n<|im_start|>user\n<tool_response>\n4\n</tool_response>{END}\n<|im_start|>user\n{REPLY}{END}\n"
            "<|im_start|>assistant\n")


def test_returned_images_become_their_placeholder_runs_and_pixel_values(processors):
    processor = processors("Qwen3-VL")
    grey = np.full((40, 60), 128, np.uint8)
    colour = np.zeros((80, 50, 3), np.uint8)
    colour[..., 0] = 200
    pil = Image.new("RGBA", (56, 56), (10, 200, 30, 255))
    messages = [{"role": "tool", "name": "zoom", "content": [{"type": "image", "image": grey},
                                                             {"type": "text", "text": "zoomed"}]},
                {"role": "tool", "name": "zoom", "content": [{"type": "image", "image": colour}]},
                {"role": "user", "content": [{"type": "text", "text": REPLY}, {"type": "image", "image": pil}]}]
    got = between_turns(processor, messages, after_end_of_turn=True)
    assert isinstance(got, BetweenTurns)
    assert [i.mode for i in got.images] == ["RGB"] * 3 and [i.size for i in got.images] == [(60, 40), (50, 80), (56, 56)]
    assert np.array_equal(np.asarray(got.images[0])[..., 1], grey)
    # the processor's own tensors for these images, in order
    reference = processor.image_processor(images=got.images, return_tensors="pt")
    assert torch.equal(got.model_inputs["image_grid_thw"], reference["image_grid_thw"])
    torch.testing.assert_close(got.model_inputs["pixel_values"], reference["pixel_values"], atol=0, rtol=0)
    assert not {"input_ids", "attention_mask", "mm_token_type_ids"} & set(got.model_inputs)
    text = (f"\n<|im_start|>user\n<tool_response>\n{SLOT}zoomed\n</tool_response>\n<tool_response>\n{SLOT}\n"
            f"</tool_response>{END}\n<|im_start|>user\n{REPLY}{SLOT}{END}\n<|im_start|>assistant\n")
    assert got.ids == expanded(processor, text, list(reference["image_grid_thw"]))


def test_pictures_are_numbered_on_from_the_images_already_in_the_dialogue(processors):
    processor = processors("Qwen2.5-VL")
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    got = between_turns(processor, [{"role": "user", "content": [{"type": "image", "image": image}]}],
                        after_end_of_turn=True, chat_template_kwargs={"add_vision_id": True}, images_before=2)
    assert "Picture 3: <|vision_start|>" in tokenizer_of(processor).decode(got.ids)


def test_append_model_inputs_puts_the_later_images_after_in_order():
    earlier = {"pixel_values": torch.zeros(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    later = {"pixel_values": torch.ones(16, 3), "image_grid_thw": torch.tensor([[1, 4, 4]]), "extra": torch.ones(1)}
    merged = append_model_inputs(earlier, later)
    assert merged["image_grid_thw"].tolist() == [[1, 2, 2], [1, 4, 4]]
    assert torch.equal(merged["pixel_values"], torch.cat([earlier["pixel_values"], later["pixel_values"]]))
    assert torch.equal(merged["extra"], later["extra"])
    assert append_model_inputs({}, later).keys() == later.keys()


@pytest.mark.parametrize("messages,vision,error", [
    ([{"role": "user", "content": "ok"}, {"role": "tool", "content": [{"type": "image", "image": np.zeros((8, 8), np.uint8)}]}],
     False, r"observation message 1 holds an image, but \w+ is a text-only tokenizer"),
    ([{"role": "assistant", "content": "ok"}], True, r"observation message 0: role 'assistant' is not one of"),
    ([{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}], True,
     r"observation message 0, part 0: content part type 'video' is not one of \('text', 'image'\)"),
    ([{"role": "tool", "content": [{"type": "image", "image": np.zeros((8, 8), np.float32)}]}], True,
     r"observation message 0, part 0: an image array must be uint8 of shape HxW or HxWx3"),
    ([{"role": "tool", "content": [{"type": "image", "image": "film.png"}]}], True,
     r"observation message 0, part 0: an image part needs a PIL image or a numpy array"),
    ([{"role": "user", "content": 3}], True, r"observation message 0: content must be a string or a list of parts"),
])
def test_bad_observation_messages_are_named(processors, messages, vision, error):
    with pytest.raises(ValueError, match=error):
        between_turns(processors(None, vision=vision), messages, after_end_of_turn=True)


def test_a_template_that_drops_an_image_is_named(processors):
    processor = processors(None)
    processor.chat_template = processor.chat_template.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
    with pytest.raises(ValueError, match=r"wrote 0 image slot\(s\) \(<\|image_pad\|>\) for the 1 image\(s\)"):
        between_turns(processor, [{"role": "tool", "content": [{"type": "image", "image": Image.new("RGB", (28, 28))}]}],
                      after_end_of_turn=True)
