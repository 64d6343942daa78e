"""The flow trainer's prompt files: JSON lines, a JSON list or plain text; bad ones name the file and where."""

import json

import pytest

from grouprl.config import ConfigError
from grouprl.domains.diffusion.trainer import load_prompts


def test_jsonl_json_list_and_text_files_give_the_same_records(tmp_path):
    rows = [{"prompt": "a red square", "text": "A"}, {"prompt": "a blue circle", "text": "B"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "p.json").write_text(json.dumps(rows))
    (tmp_path / "p.txt").write_text("a red square\n\n  a blue circle \n")
    assert load_prompts([str(tmp_path / "p.jsonl")], "prompt") == rows
    assert load_prompts([str(tmp_path / "p.json")], "prompt") == rows
    assert load_prompts([str(tmp_path / "p.txt")], "prompt") == [{"prompt": r["prompt"]} for r in rows]
    assert load_prompts([str(tmp_path / "p.jsonl"), str(tmp_path / "p.txt")], "prompt", max_samples=3) == \
        [*rows, {"prompt": "a red square"}]


def test_bad_prompt_files_name_the_file_and_record(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl: line 2"):
        load_prompts([str(bad_json)], "prompt")
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"prompt": "ok"}\n{"caption": "x"}\n')
    with pytest.raises(ConfigError, match=r"nofield\.jsonl: record 1: field 'prompt' \(data\.prompt_key\)"):
        load_prompts([str(no_field)], "prompt")
    with pytest.raises(ConfigError, match="prompt file not found"):
        load_prompts([str(tmp_path / "missing.jsonl")], "prompt")
