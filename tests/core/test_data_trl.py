"""TRL's dataset formats read as they are: standard and conversational, prompt-only and
prompt-completion, and TRL's vision-language records (an ``images`` or ``image`` column).

How rewards then receive these rows (TRL's forms): tests/core/test_rewards_trl.py.
"""

from __future__ import annotations

import json
import re

import pytest
from PIL import Image

from grouprl.data import DataError, load_samples
from grouprl.data.loading import samples_from_records

SYSTEM = {"role": "system", "content": "Answer briefly."}
USER = {"role": "user", "content": "What is 2+2?"}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def text(t: str) -> list[dict]:
    return [{"type": "text", "text": t}]


def test_standard_prompt_only(tmp_path):
    ds = load_samples(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "The sky is", "solution": "blue"}]))
    s = ds[0]
    assert s.messages == [{"role": "user", "content": text("The sky is")}]
    assert s.answer is None and s.columns == {"solution": "blue", "answer": None}
    assert s.reward_prompt() == "The sky is" and s.reward_completion(" blue") == " blue"


def test_standard_prompt_completion(tmp_path):
    ds = load_samples(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "The sky is", "completion": " blue."}]))
    assert ds[0].answer == " blue." and ds[0].columns == {"answer": " blue."}
    assert not ds[0].conversational


def test_conversational_prompt_only_keeps_the_system_message(tmp_path):
    ds = load_samples(write_jsonl(tmp_path / "d.jsonl", [{"prompt": [SYSTEM, USER], "solution": "4", "level": 1}]))
    s = ds[0]
    assert s.messages == [{"role": "system", "content": text("Answer briefly.")},
                          {"role": "user", "content": text("What is 2+2?")}]
    assert s.columns == {"solution": "4", "level": 1, "answer": None}
    # rewards get TRL's forms: the record's messages, and each completion as an assistant message list
    assert s.reward_prompt() == [SYSTEM, USER]
    assert s.reward_completion("4") == [{"role": "assistant", "content": "4"}]


def test_conversational_prompt_completion_is_the_reference(tmp_path):
    record = {"prompt": [USER], "completion": [{"role": "assistant", "content": "4"}]}
    ds = load_samples(write_jsonl(tmp_path / "d.jsonl", [record]), format="trl")
    assert ds[0].answer == "4" and ds[0].columns == {"answer": "4"}
    assert ds[0].reward_prompt() == [USER]


def test_vlm_images_column_with_image_parts(tmp_path):
    Image.new("RGB", (6, 5), (255, 0, 0)).save(tmp_path / "red.png")
    record = {"images": ["red.png"],
              "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
              "completion": [{"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]}
    s = load_samples(write_jsonl(tmp_path / "d.jsonl", [record]))[0]
    assert s.messages == [{"role": "user", "content": [{"type": "image"}, *text("Colour?")]}]
    assert s.images[0].size == (6, 5) and s.answer == "Red."
    # as TRL's prepare_multimodal_messages gives them to rewards: each image part holds its image
    prompt = s.reward_prompt()
    assert prompt[0]["content"][0]["image"] is s.images[0] and prompt[0]["content"][1] == text("Colour?")[0]


def test_vlm_single_image_column_goes_before_the_first_user_text(tmp_path):
    image = Image.new("RGB", (4, 4), (0, 0, 255))
    ds = samples_from_records([{"image": image, "prompt": [SYSTEM, {"role": "user", "content": "Colour?"}],
                                "solution": "blue"}])
    s = ds[0]
    assert s.messages[1] == {"role": "user", "content": [{"type": "image"}, *text("Colour?")]}
    assert s.messages[0] == {"role": "system", "content": text("Answer briefly.")}
    assert len(s.images) == 1 and s.columns == {"solution": "blue", "answer": None}


def test_saved_hf_vlm_dataset(tmp_path):
    """TRL's VLM datasets as `datasets` stores them: content parts a struct (text None on image parts),
    images an Image feature."""
    datasets = pytest.importorskip("datasets")
    image = Image.new("RGB", (3, 3), (0, 255, 0))
    parts = [{"type": "image", "text": None}, {"type": "text", "text": "Colour?"}]
    ds = datasets.Dataset.from_dict({"images": [[image]], "prompt": [[{"role": "user", "content": parts}]],
                                     "solution": ["green"]})
    ds.save_to_disk(str(tmp_path / "vlm"))
    s = load_samples(tmp_path / "vlm")[0]
    assert s.images[0].getpixel((0, 0)) == (0, 255, 0)
    assert s.messages == [{"role": "user", "content": [{"type": "image"}, *text("Colour?")]}]
    assert s.columns["solution"] == "green"


def test_system_prompt_and_format_prompt_reach_the_reward_prompt(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [USER]}])
    s = load_samples(path, system_prompt="Think first.", format_prompt="{{ content }} Box it.")[0]
    assert s.reward_prompt() == [{"role": "system", "content": "Think first."},
                                 {"role": "user", "content": "What is 2+2? Box it."}]
    assert s.messages[1] == {"role": "user", "content": text("What is 2+2? Box it.")}


def test_easyr1_with_prompt_key_prompt_stays_easyr1(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2+2?", "answer": "4", "images": []}])
    s = load_samples(path, prompt_key="prompt")[0]
    assert s.answer == "4" and s.record_prompt is None


@pytest.mark.parametrize("bad, field, message", [
    ({"prompt": 3}, "prompt", "expected a string \\(standard\\) or a non-empty list of messages"),
    ({"prompt": []}, "prompt", "got an empty list"),
    ({"prompt": [{"role": "bot", "content": "x"}]}, "prompt[0].role", "expected one of"),
    ({"prompt": [{"role": "user", "content": 5}]}, "prompt[0].content", "expected a string or a list of parts"),
    ({"prompt": [{"role": "user", "content": [{"type": "video"}]}]}, "prompt[0].content[0]", "expected a part"),
    ({"prompt": [{"role": "user", "content": [{"type": "text"}]}]}, "prompt[0].content[0].text", "expected a string"),
    ({"prompt": [SYSTEM]}, "prompt", "no user message"),
    ({"prompt": "x", "completion": [{"role": "user", "content": "y"}]}, "completion[0].role", "assistant's"),
    ({"prompt": "x", "completion": 7}, "completion", "expected a string"),
    ({"prompt": "x", "answer": 4}, "answer", "expected a string"),
    ({"prompt": "x", "completion": "a", "answer": "b"}, "answer", "differs from 'completion'"),
    ({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]}, "prompt",
     "1 <image> placeholder but 0 images"),
])
def test_bad_records_name_file_record_and_field(tmp_path, bad, field, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, bad])
    with pytest.raises(DataError, match=rf"bad\.jsonl: record 1: field '{re.escape(field)}': .*{message}"):
        load_samples(path, format="trl")


def test_skip_bad_records_with_trl_records(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": 1}, {"prompt": [USER]}])
    ds = load_samples(path, skip_bad_records=True)
    assert len(ds) == 2 and ds.skipped == 1 and "record 1: field 'prompt'" in ds.skipped_details[0]


def test_data_format_trl_is_a_config_choice():
    from grouprl.config import load_config

    assert load_config(base={"data": {"format": "trl"}}).data.format == "trl"
