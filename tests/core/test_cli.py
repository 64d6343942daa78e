"""The command line: train / sft / export and config errors (two processes: tests/test_distributed.py)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from grouprl.cli import main

WORDS = ["yes", "no", "maybe", "left", "right"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from grouprl.models.tiny import build_tiny_text_lm

    root = tmp_path_factory.mktemp("cli")
    records = [{"problem": f"Say {w} {i}", "answer": w} for i in range(4) for w in WORDS]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    build_tiny_text_lm(root / "model", [r["problem"] for r in records] + WORDS, seed=0)
    config = {
        "data": {"train_files": [str(root / "train.jsonl")], "max_response_length": 5, "rollout_batch_size": 4},
        "worker": {"actor": {"model": {"model_path": str(root / "model")}, "optim": {"lr": 1e-3},
                             "global_batch_size": 4, "micro_batch_size_per_device_for_update": 8},
                   "rollout": {"n": 2}, "reward": {"functions": [{"name": "accuracy"}]}},
        "trainer": {"max_steps": 1, "logger": ["jsonl"], "device": "cpu"},
        "sft": {"batch_size": 4, "micro_batch_size": 4},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return root


def test_train_with_overrides_then_export(project, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(project / "config.yaml"), f"trainer.output_dir={run}", "worker.rollout.n=3"]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["worker"]["rollout"]["n"] == 3
    assert "run directory" in capsys.readouterr().out
    assert main(["export", str(run / "checkpoints" / "global_step_1"), "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").exists()
    assert list((tmp_path / "merged").glob("*.safetensors"))


def test_sft_writes_a_loadable_model_that_learned(project, tmp_path):
    from grouprl.config import load_config
    from grouprl.models.loading import load_model_and_processor
    from grouprl.trainer.sft import answer_batch, run_sft
    from grouprl.data import load_samples
    from grouprl.rollout.logprobs import compute_log_probs

    samples = list(load_samples(str(project / "train.jsonl")))[:4]
    base, processor, _ = load_model_and_processor(str(project / "model"))
    batch = answer_batch(processor, samples, max_prompt_length=None, max_response_length=8)

    def nll(model):
        with torch.no_grad():
            lp, _ = compute_log_probs(model, batch, micro_batch_size=8)
        return float(-(lp * batch.response_mask).sum() / batch.response_mask.sum())

    out = tmp_path / "sft_model"
    cfg = load_config(project / "config.yaml", [f"trainer.output_dir={tmp_path / 'run'}", "sft.epochs=5",
                                                "worker.actor.optim.lr=1e-2"])
    run_sft(cfg, output_dir=out)
    trained, _, _ = load_model_and_processor(str(out))
    assert nll(trained) < nll(base) - 0.5


@pytest.mark.parametrize("override, says", [
    ("worker.rollout.multi_turn.tools=[calculater]", "config key 'worker.rollout.multi_turn.tools': unknown tool "
                                                     "'calculater'"),
    ("worker.rollout.multi_turn.environment=no_such_env", "config key 'worker.rollout.multi_turn.environment': "
                                                          "unknown environment 'no_such_env'"),
    # the tiny model's chat template shows no tool-call format: the parser must be named
    ("worker.rollout.multi_turn.environment=radiology_zoom", "config key 'worker.rollout.multi_turn.tool_parser'"),
])
def test_an_unknown_tool_or_environment_is_one_line_and_exit_2(project, tmp_path, capsys, override, says):
    assert main(["train", str(project / "config.yaml"), f"trainer.output_dir={tmp_path / 'run'}", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the weights' progress bar, for the parser
    assert says in err and err.startswith("grouprl: config error:")


def test_config_error_exit_code_and_message(project, capsys):
    assert main(["train", str(project / "config.yaml"), "worker.rollout.nn=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'worker.rollout.nn'" in err and "worker.rollout.n" in err
