"""`grouprl train` / `grouprl sft` report a bad data file like a config error: one line, exit code 2."""

from __future__ import annotations

import json

import pytest
import yaml

from grouprl.cli import main

WORDS = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A tiny text model, a good training file, one with a malformed record, and a config for each."""
    from grouprl.models.tiny import build_tiny_text_lm

    root = tmp_path_factory.mktemp("cli_errors")
    records = [{"problem": f"Say {w} {i}", "answer": w} for i in range(2) for w in WORDS]
    build_tiny_text_lm(root / "model", [r["problem"] for r in records] + WORDS, seed=0)
    bad = [*records[:2], {"problem": 7, "answer": "yes"}, *records[2:]]  # record 2: problem is not text
    (root / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    for name, data in (("missing", root / "no_such_file.jsonl"), ("malformed", root / "bad.jsonl")):
        config = {
            "data": {"train_files": [str(data)], "max_response_length": 4, "rollout_batch_size": 2},
            "worker": {"actor": {"model": {"model_path": str(root / "model")}, "global_batch_size": 2},
                       "rollout": {"n": 2}, "reward": {"functions": [{"name": "accuracy"}]}},
            "trainer": {"max_steps": 1, "logger": ["jsonl"], "device": "cpu", "output_dir": str(root / "run")},
            "sft": {"batch_size": 2, "micro_batch_size": 2},
        }
        (root / f"{name}.yaml").write_text(yaml.safe_dump(config))
    return root


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("command", ["train", "sft"])
def test_missing_data_file_is_one_line_and_exit_code_2(project, capsys, command):
    assert main([command, str(project / "missing.yaml")]) == 2
    line = one_error_line(capsys)
    assert line.startswith("grouprl: data error: ") and "no_such_file.jsonl" in line


@pytest.mark.parametrize("command", ["train", "sft"])
def test_malformed_record_names_file_record_and_field(project, capsys, command):
    assert main([command, str(project / "malformed.yaml")]) == 2
    line = one_error_line(capsys)
    assert line.startswith("grouprl: data error: ")
    assert "bad.jsonl" in line and "record 2" in line and "problem" in line
