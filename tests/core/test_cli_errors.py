"""Anticipated errors of `grouprl` are one line on stderr naming what is wrong, with exit code 2:
a bad data file, an unknown or missing reward, a reward that raises or breaks the contract (at
the user's own file:line), a missing model path, a checkpoint where a model is expected (or the
reverse), a missing optional package (named with its extra), a YAML syntax error. ``--debug``
shows the traceback instead; ``--version`` prints the version."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from grouprl.cli import main

WORDS = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A tiny text model; a good training file, a missing one and one with a malformed record, a config for
    each; a user's reward file; a config file that is not YAML; what a checkpoint, a run folder and a LoRA
    checkpoint hold (enough to tell them from a model); a flow config whose model is missing."""
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
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    good = yaml.safe_load((root / "missing.yaml").read_text())
    good["data"]["train_files"] = [str(root / "data.jsonl")]
    (root / "good.yaml").write_text(yaml.safe_dump(good))
    (root / "rewards.py").write_text(USER_REWARDS)
    (root / "broken.yaml").write_text("data:\n  train_files: [a.jsonl\n  max_response_length: : 4\n")
    (root / "checkpoint" / "model").mkdir(parents=True)  # what a grouprl checkpoint holds (enough to tell)
    for step in (2, 10):
        (root / "old_run" / "checkpoints" / f"global_step_{step}" / "model").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "afile").write_text("a file where a directory should be\n")
    (root / "lora" / "model").mkdir(parents=True)  # a LoRA checkpoint whose adapter names no base model
    (root / "lora" / "model" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": None}))
    (root / "prompts.jsonl").write_text('{"prompt": "a red square"}\n{"prompt": "a blue circle"}\n')
    flow = {"kind": "flow", "data": {"train_files": [str(root / "prompts.jsonl")], "rollout_batch_size": 2},
            "worker": {"actor": {"model": {"model_path": str(root / "no_flow_model"), "lora": {"rank": 4, "alpha": 4}}},
                       "rollout": {"n": 2, "height": 16, "width": 16}, "reward": {"functions": [{"name": "shapes"}]}},
            "trainer": {"output_dir": str(root / "flow_run"), "max_steps": 1, "logger": ["jsonl"], "device": "cpu"}}
    (root / "flow.yaml").write_text(yaml.safe_dump(flow))
    return root


# a user's reward file: each function breaks the reward contract in its own way
USER_REWARDS = """\
def raises(prompts, completions, **columns):
    return [len(c) / 0 for c in completions]


def short(prompts, completions, **columns):
    return [1.0]


def strings(prompts, completions, **columns):
    return ["1.0" for _ in completions]


def nan(prompts, completions, **columns):
    return [float("nan") for _ in completions]


def parses(prompts, completions, **columns):
    import json
    return json.loads("{not json")
"""


@pytest.fixture
def quiet_loading():
    """No "Loading weights" progress bar on stderr (transformers') in the cases that load the model."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    yield
    hf_logging.enable_progress_bar()


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


def reward(ref: str) -> str:
    return f"worker.reward.functions=[{{name: '{ref}'}}]"


# id -> (command line, modules made missing, exit code, what the line names: strings each in it);
# "{root}" in either stands for the project's folder
CASES = {
    "unknown reward name": (["train", "{root}/good.yaml", reward("no_such_reward")], (), 2,
                            ["grouprl: reward error: config key 'worker.reward.functions': ",
                             "unknown reward 'no_such_reward'", "accuracy"]),
    "missing reward file": (["train", "{root}/good.yaml", reward("{root}/no_rewards.py:score")], (), 2,
                            ["grouprl: reward error: ", "{root}/no_rewards.py not found", "'score'"]),
    "missing reward function": (["train", "{root}/good.yaml", reward("{root}/rewards.py:no_such_fn")], (), 2,
                                ["grouprl: reward error: ", "rewards.py has no function 'no_such_fn'", "raises"]),
    "reward raises": (["train", "{root}/good.yaml", reward("{root}/rewards.py:raises")], (), 2,
                      ["grouprl: reward error: ", "'{root}/rewards.py:raises' raised ZeroDivisionError",
                       "at {root}/rewards.py:2 in ", ": return [len(c) / 0 for c in completions]"]),
    "reward raises inside a library": (["train", "{root}/good.yaml", reward("{root}/rewards.py:parses")], (), 2,
                                       ["raised JSONDecodeError", "at {root}/rewards.py:19 in parses: "
                                        "return json.loads(\"{not json\")"]),
    "reward returns too few values": (["train", "{root}/good.yaml", reward("{root}/rewards.py:short")], (), 2,
                                      ["grouprl: reward error: ", "rewards.py:short' returned 1 values",
                                       "function short at {root}/rewards.py:5"]),
    "reward returns strings": (["train", "{root}/good.yaml", reward("{root}/rewards.py:strings")], (), 2,
                               ["grouprl: reward error: ", "returned a str ('1.0') at row 0",
                                "function strings at {root}/rewards.py:9"]),
    "reward returns NaN": (["train", "{root}/good.yaml", reward("{root}/rewards.py:nan")], (), 2,
                           ["grouprl: reward error: ", "returned nan at row 0", "function nan at {root}/rewards.py:13"]),
    "missing model path": (["train", "{root}/good.yaml", "worker.actor.model.model_path={root}/no_model"], (), 2,
                           ["grouprl: config error: ", "'worker.actor.model.model_path'", "{root}/no_model",
                            "does not exist"]),
    "checkpoint as model path": (["train", "{root}/good.yaml", "worker.actor.model.model_path={root}/checkpoint"],
                                 (), 2, ["'worker.actor.model.model_path'", "{root}/checkpoint is a grouprl checkpoint",
                                         "grouprl export {root}/checkpoint"]),
    "sft: missing model path": (["sft", "{root}/good.yaml", "worker.actor.model.model_path={root}/no_model"], (), 2,
                                ["grouprl: config error: ", "'worker.actor.model.model_path'", "{root}/no_model"]),
    "flow: missing model path": (["train", "{root}/flow.yaml"], (), 2,
                                 ["grouprl: config error: ", "'worker.actor.model.model_path'",
                                  "'{root}/no_flow_model' is not a directory (it does not exist)"]),
    "flow: a folder with no flow model": (["train", "{root}/flow.yaml", "worker.actor.model.model_path={root}/empty"],
                                          (), 2, ["'worker.actor.model.model_path'", "'{root}/empty' has neither"]),
    "export a model folder": (["export", "{root}/model", "--out", "{root}/merged"], (), 2,
                              ["grouprl: model error: ", "{root}/model is a model directory, not a grouprl checkpoint"]),
    "export a run folder": (["export", "{root}/old_run", "--out", "{root}/merged"], (), 2,
                            ["grouprl: model error: ", "{root}/old_run is a grouprl run directory",
                             "{root}/old_run/checkpoints/global_step_10"]),
    "export an empty folder": (["export", "{root}/empty", "--out", "{root}/merged"], (), 2,
                               ["grouprl: model error: ", "{root}/empty is not a grouprl checkpoint"]),
    "export a missing folder": (["export", "{root}/nowhere", "--out", "{root}/merged"], (), 2,
                                ["grouprl: model error: ", "checkpoint {root}/nowhere does not exist"]),
    "export LoRA with no base model": (["export", "{root}/lora", "--out", "{root}/merged"], (), 2,
                                       ["grouprl: model error: ", "{root}/lora holds a LoRA adapter", "--base-model"]),
    "generate from a checkpoint": (["generate", "--model", "{root}/checkpoint", "--data", "{root}/data.jsonl",
                                    "--out", "{root}/preds.jsonl"], (), 2,
                                   ["grouprl: model error: ", "{root}/checkpoint is a grouprl checkpoint",
                                    "grouprl export {root}/checkpoint"]),
    "generate from a run folder": (["generate", "--model", "{root}/old_run", "--data", "{root}/data.jsonl",
                                    "--out", "{root}/preds.jsonl"], (), 2,
                                   ["grouprl: model error: ", "{root}/old_run is a grouprl run directory",
                                    "grouprl export {root}/old_run/checkpoints/global_step_10"]),
    "generate from a missing model": (["generate", "--model", "{root}/no_model", "--data", "{root}/data.jsonl",
                                       "--out", "{root}/preds.jsonl"], (), 2,
                                      ["grouprl: model error: ", "'{root}/no_model' does not exist"]),
    "wandb logger without wandb": (["train", "{root}/good.yaml", "trainer.logger=[jsonl,wandb]"], ("wandb",), 2,
                                   ["grouprl: missing package: ", "'trainer.logger'", "pip install 'grouprl[wandb]'"]),
    "mlflow logger without mlflow": (["train", "{root}/good.yaml", "trainer.logger=[jsonl,mlflow]"], ("mlflow",), 2,
                                     ["grouprl: missing package: ", "'trainer.logger'", "pip install 'grouprl[mlflow]'"]),
    "trackio logger without trackio": (["train", "{root}/good.yaml", "trainer.logger=[trackio]"], ("trackio",), 2,
                                       ["grouprl: missing package: ", "'trainer.logger'",
                                        "pip install 'grouprl[trackio]'"]),
    "demo --flow without diffusers": (["demo", "--flow", "--quick", "--out", "{root}/flow"], ("diffusers",), 2,
                                      ["grouprl: missing package: ", "grouprl demo --flow", "diffusers",
                                       "pip install 'grouprl[diffusion]'"]),
    "serve rewards without uvicorn": (["serve", "rewards", "--port", "1"], ("uvicorn",), 2,
                                      ["grouprl: missing package: ", "uvicorn", "pip install 'grouprl[server]'"]),
    "NaN learning rate": (["train", "{root}/good.yaml", "worker.actor.optim.lr=nan"], (), 2,
                          ["grouprl: config error: config key 'worker.actor.optim.lr' expects a number, got nan"]),
    "NaN in a nullable float": (["train", "{root}/good.yaml", "trainer.max_wall_seconds=.nan"], (), 2,
                                ["config key 'trainer.max_wall_seconds' expects a number, got nan"]),
    "NaN flow learning rate": (["train", "{root}/flow.yaml", "worker.actor.optim.lr=nan"], (), 2,
                               ["config key 'worker.actor.optim.lr' expects a number, got nan"]),
    "infinite learning rate": (["train", "{root}/good.yaml", "worker.actor.optim.lr=inf"], (), 2,
                               ["grouprl: config error: config key 'worker.actor.optim.lr' must be >= 0 and finite; "
                                "got inf"]),
    "infinite temperature": (["train", "{root}/good.yaml", "worker.rollout.temperature=inf"], (), 2,
                             ["config key 'worker.rollout.temperature' must be > 0 and finite"]),
    "empty model directory": (["train", "{root}/good.yaml", "worker.actor.model.model_path={root}/empty"], (), 2,
                              ["grouprl: config error: ", "'worker.actor.model.model_path'",
                               "{root}/empty has no config.json", "(it is empty)"]),
    "generate from an empty directory": (["generate", "--model", "{root}/empty", "--data", "{root}/data.jsonl",
                                          "--out", "{root}/preds.jsonl"], (), 2,
                                         ["grouprl: model error: ", "{root}/empty has no config.json"]),
    "run directory is a file": (["train", "{root}/good.yaml", "trainer.output_dir={root}/afile"], (), 2,
                                ["grouprl: output error: cannot write to the run directory ('trainer.output_dir') "
                                 "{root}/afile: {root}/afile is a file, not a directory"]),
    "run directory under a file": (["train", "{root}/good.yaml", "trainer.output_dir={root}/afile/run"], (), 2,
                                   ["grouprl: output error: ", "{root}/afile/run",
                                    "{root}/afile is a file, so no directory can be made under it"]),
    "checkpoint directory under a file": (["train", "{root}/good.yaml",
                                           "trainer.save_checkpoint_path={root}/afile/checkpoints"], (), 2,
                                          ["grouprl: output error: ", "'trainer.save_checkpoint_path'",
                                           "{root}/afile/checkpoints"]),
    "flow: run directory under a file": (["train", "{root}/flow.yaml", "trainer.output_dir={root}/afile/flow"], (), 2,
                                         ["grouprl: output error: ", "{root}/afile/flow", "{root}/afile is a file"]),
    "sft: run directory under a file": (["sft", "{root}/good.yaml", "trainer.output_dir={root}/afile/run"], (), 2,
                                        ["grouprl: output error: ", "directory of the SFT model {root}/afile/run"]),
    "demo --out under a file": (["demo", "--quick", "--out", "{root}/afile/demo"], (), 2,
                                ["grouprl: output error: cannot write to the demo's run directory (--out) "
                                 "{root}/afile/demo: {root}/afile is a file"]),
    "YAML syntax error": (["train", "{root}/broken.yaml"], (), 2,
                          ["grouprl: config error: ", "config file {root}/broken.yaml is not valid YAML",
                           "line 3, column"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_anticipated_error_is_one_line_naming_it(project, capsys, monkeypatch, quiet_loading, case):
    argv, missing, code, named = CASES[case]
    for module in missing:  # as if the optional package were not installed
        monkeypatch.setitem(sys.modules, module, None)
    assert main([a.replace("{root}", str(project)) for a in argv]) == code
    line = one_error_line(capsys)
    for text in named:
        assert text.replace("{root}", str(project)) in line, line
    assert "grouprl/rewards/" not in line and "grouprl/trainer/" not in line  # the user's frames, not grouprl's
    assert "<unicode string>" not in line  # a YAML error names the file, not PyYAML's stream


def test_debug_shows_the_traceback(project, capsys):
    from grouprl.data.formats import DataError

    for argv in (["--debug", "train", str(project / "missing.yaml")], ["train", str(project / "missing.yaml"), "--debug"]):
        with pytest.raises(DataError, match="no_such_file.jsonl"):
            main(argv)
    assert capsys.readouterr().err == ""


def test_an_unexpected_error_keeps_its_traceback(project, monkeypatch):
    """Only the anticipated kinds become one line: a bug is not swallowed."""
    import grouprl.config

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(grouprl.config, "read_config_values", broken)
    with pytest.raises(KeyError, match="a bug"):
        main(["train", str(project / "good.yaml")])


def test_version(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"grouprl {importlib.metadata.version('grouprl')}" and out[len("grouprl "):][0].isdigit()


def test_the_command_line_exits_with_the_code_and_one_line(project):
    """The real entry point, in a process of its own: `python -m grouprl` with uvicorn missing, and --version."""
    import os
    import subprocess
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    missing = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.modules['uvicorn'] = None; "
                              "sys.argv[0] = 'grouprl'; runpy.run_module('grouprl', run_name='__main__')",
                              "serve", "rewards", "--port", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 2, missing.stderr
    assert missing.stderr.strip().splitlines() == [
        "grouprl: missing package: the reward server (grouprl serve rewards) needs uvicorn, which is not installed: "
        "pip install 'grouprl[server]'"]
    version = subprocess.run([sys.executable, "-m", "grouprl", "--version"], capture_output=True, text=True, env=env,
                             timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("grouprl ") and version.stderr == ""


def test_a_hub_id_that_cannot_be_fetched_is_one_line(project, capsys, monkeypatch):
    # offline, as on a cluster's compute nodes: the hub id is neither cached nor reachable
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(project / "empty_hf_home"))
    argv = ["generate", "--model", "nobody-here/no-such-model", "--data", f"{project}/data.jsonl",
            "--out", f"{project}/preds.jsonl"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("grouprl: model error: 'nobody-here/no-such-model' is not a local directory")
    assert "hf download nobody-here/no-such-model" in err


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_config_command_without_arguments_prints_its_usage(capsys, command):
    assert main([command]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"usage: grouprl {command} CONFIG.yaml [key=value ...]"
    assert len(lines) == 2 and "key=value" in lines[1] and "data.train_files" not in lines[1]


@pytest.mark.parametrize("words, wanted", [
    (["--num_generations", "4"], "write worker.rollout.n=4 (num_generations is TRL's GRPOConfig name)"),
    (["--num-generations=4"], "write worker.rollout.n=4"),
    (["--worker.rollout.n", "4"], "write worker.rollout.n=4"),
    (["--find_last_checkpoint", "true"], "write trainer.find_last_checkpoint=true (find_last_checkpoint is "
                                         "EasyR1's trainer.find_last_checkpoint"),
    (["--temprature", "1"], "'temprature' is not a config key (did you mean"),
])
@pytest.mark.parametrize("command", ["train", "sft"])
def test_an_hf_style_option_says_overrides_are_key_value(project, capsys, command, words, wanted):
    assert main([command, str(project / "good.yaml"), *words]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"grouprl {command}: '{' '.join(words)}': overrides are key=value, not --key value; ")
    assert wanted in line


def test_easyr1s_config_equals_file_form_reads_the_file(project, capsys):
    # the file is read: its missing data file is the error, and an override after it applies
    assert main(["train", f"config={project / 'missing.yaml'}", "worker.rollout.n=2"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("grouprl: data error: ") and "no_such_file.jsonl" in line
    assert main(["train", f"config={project / 'good.yaml'}", "num_generations=2"]) == 2
    assert one_error_line(capsys) == ("grouprl: config error: unknown config key 'num_generations' from the command "
                                      "line (TRL's GRPOConfig name: use worker.rollout.n)")
    assert main(["train", str(project / "good.yaml"), f"config={project / 'missing.yaml'}"]) == 2
    assert "one config file" in one_error_line(capsys)


def test_an_unknown_key_in_the_file_names_the_file_and_line(project, tmp_path, capsys):
    config = yaml.safe_load((project / "good.yaml").read_text())
    config["trainer"]["beta"] = 0.04
    path = tmp_path / "with_beta.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=True))
    line_no = next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip().startswith("beta:"))
    assert main(["train", str(path)]) == 2
    assert one_error_line(capsys) == (f"grouprl: config error: unknown config key 'trainer.beta' in {path}, line "
                                      f"{line_no} (TRL's GRPOConfig name: use algorithm.kl_coef; with "
                                      "algorithm.use_kl_loss: true for TRL's KL loss)")


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading any model fails the test: what is checked before the load must be reported first."""
    import grouprl.models.loading

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the output directory was checked")

    monkeypatch.setattr(grouprl.models.loading, "load_model_and_processor", loaded)


def test_an_unusable_output_directory_is_reported_before_the_model_loads(project, capsys, no_model_loads):
    argv = ["train", str(project / "good.yaml"), f"trainer.output_dir={project / 'afile' / 'run'}"]
    assert main(argv) == 2
    assert one_error_line(capsys).startswith("grouprl: output error: ")


def test_a_read_only_file_system_is_one_line_with_the_systems_reason(project, capsys, monkeypatch, no_model_loads):
    """Tests run as root, where no mode bit stops a write: the probe's write is refused as a read-only
    mount refuses it (EROFS), and only the probe's: every other file opens as usual."""
    import errno
    import os

    import grouprl.files

    real_open = os.open

    def read_only(path, *args, **kwargs):
        if ".grouprl-write-probe." in str(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(grouprl.files.os, "open", read_only)
    run = project / "read_only_run"
    assert main(["train", str(project / "good.yaml"), f"trainer.output_dir={run}"]) == 2
    line = one_error_line(capsys)
    assert line == (f"grouprl: output error: cannot write to the run directory ('trainer.output_dir') {run}: "
                    f"Read-only file system: {run}/{line.rsplit('/', 1)[1]}")
    assert ".grouprl-write-probe." in line
    assert not [p for p in run.iterdir()]  # the probe left nothing behind


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(project, capsys, monkeypatch, quiet_loading):
    """The second checkpoint's optimizer file hits ENOSPC half written: the run ends with one line naming
    the checkpoint and the reason (exit 2, as an unwritable output directory), nothing of step 2 is
    left (no hidden copy, no global_step_2), step 1 verifies intact, and a run resumes from it."""
    import errno
    import os

    from grouprl.trainer import checkpoint as ckpt

    real_save = ckpt.save_file
    saves = []

    def disk_fills(tensors, filename, *args, **kwargs):
        saves.append(filename)
        if "global_step_2" in filename:
            with open(filename, "wb") as fh:  # what a write cut short leaves
                fh.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", disk_fills)
    run = project / "full_disk_run"
    argv = ["train", str(project / "good.yaml"), f"trainer.output_dir={run}", "trainer.max_steps=3",
            "trainer.save_freq=1"]
    assert main(argv) == 2
    line = one_error_line(capsys)
    step1, step2 = run / "checkpoints" / "global_step_1", run / "checkpoints" / "global_step_2"
    assert line.startswith(f"grouprl: checkpoint error: could not write checkpoint {step2}: no space left on device")
    assert f"the previous checkpoint {step1} is intact" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["global_step_1", ckpt.TRACKER]
    assert ckpt.verify_checkpoint(step1).intact
    monkeypatch.setattr(ckpt, "save_file", real_save)
    assert main([*argv, "trainer.resume=auto"]) == 0
    assert [step for step, _ in ckpt.step_dirs(run / "checkpoints")] == [1, 2, 3]
