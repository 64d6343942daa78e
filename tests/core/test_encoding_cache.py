"""Prompts are encoded once: encode_sample remembers a prompt's processor output by its content."""

from __future__ import annotations

import copy

import pytest
import torch

import grouprl.models.inputs as inputs
from grouprl.models.inputs import ENCODING_CACHE, EncodingCache, encode_prompts

from test_engine import image, lm, samples, text_samples, vlm  # noqa: F401  (fixtures and helpers)


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = inputs._encode_sample
    monkeypatch.setattr(inputs, "_encode_sample", lambda p, s: calls.append(s.index) or real(p, s))
    ENCODING_CACHE.clear()
    yield calls
    ENCODING_CACHE.clear()


@pytest.mark.parametrize("which", ["lm", "vlm"])
def test_a_prompt_is_encoded_once_and_gives_what_it_gave(request, which, counted):
    processor = request.getfixturevalue(which)[1]
    batch = text_samples() if which == "lm" else samples()
    ENCODING_CACHE.max_bytes = 0  # off: what the processor itself gives
    want = encode_prompts(processor, batch)
    ENCODING_CACHE.max_bytes = 2**30
    counted.clear()
    for _ in range(3):
        got = encode_prompts(processor, copy.deepcopy(batch))  # other objects, the same content
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert [sorted(x) for x in got[2]] == [sorted(x) for x in want[2]]
        for row, expected in zip(got[2], want[2]):
            assert all(torch.equal(row[k], expected[k]) for k in expected)
    assert counted == [s.index for s in batch]  # the first time only


def test_another_content_is_encoded_anew(vlm, counted):  # noqa: F811
    processor = vlm[1]
    first = samples()[0]
    encode_prompts(processor, [first])
    other_pixels = copy.deepcopy(first)
    other_pixels.images = [image((201, 30, 30))]
    other_text = copy.deepcopy(first)
    other_text.messages[0]["content"][1]["text"] = "Impression?"
    other_kwargs = copy.deepcopy(first)
    other_kwargs.chat_template_kwargs = {"enable_thinking": False}
    for sample in (other_pixels, other_text, other_kwargs, first):
        encode_prompts(processor, [sample])
    assert len(counted) == 4  # three new contents, then the first one remembered
    a, b = encode_prompts(processor, [first])[2][0], encode_prompts(processor, [other_pixels])[2][0]
    assert not torch.equal(a["pixel_values"], b["pixel_values"])


def test_the_cache_keeps_to_its_budget(lm):  # noqa: F811
    processor = lm[1]
    cache = EncodingCache(max_bytes=3 * 8 * 2 * 12)  # about three short prompts' ids and masks
    encoded = {"input_ids": torch.zeros(1, 10, dtype=torch.long), "attention_mask": torch.ones(1, 10, dtype=torch.long)}
    keys = [cache.key(processor, s) for s in text_samples()] + ["k3", "k4"]
    for key in keys:
        cache.put(processor, key, encoded)
    assert cache.get(processor, keys[0]) is None and cache.get(processor, keys[-1]) is not None
    assert EncodingCache(max_bytes=0).key(processor, text_samples()[0]) is None  # off
