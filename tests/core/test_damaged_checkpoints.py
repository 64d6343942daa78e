"""A damaged checkpoint is named and skipped: never resumed silently, never a bare KeyError.

A real run saves checkpoints 2 and 4; each test damages checkpoint 4 the way a disk, a copy or a
person would. ``resume=auto`` must fall back to checkpoint 2 with a warning naming the damaged file
and finish with the weights an undamaged run reaches; ``resume=<checkpoint 4>`` must fail naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from grouprl.cli import main as cli_main
from grouprl.config import ConfigError, config_from_dict, save_config
from grouprl.trainer import checkpoint as ckpt
from grouprl.trainer.grpo import GRPOTrainer

LENGTH_REWARD = '''
def length(prompts, completions, **kwargs):
    return [(len(c) % 4) / 3 for c in completions]
'''


@pytest.fixture(scope="module")
def setup(say_task, tmp_path_factory):
    reward = tmp_path_factory.mktemp("damaged") / "length.py"
    reward.write_text(LENGTH_REWARD)
    return {"task": say_task(4, attention_dropout=0.3), "reward": reward}


def config(setup, out: Path, **trainer) -> dict:
    return setup["task"].config(out, [{"name": f"{setup['reward']}:length"}], **{
        "worker.actor.global_batch_size": 4, "worker.rollout.n": 3, "worker.rollout.temperature": 1.0,
        "trainer.max_steps": 4, "trainer.save_freq": 2, "trainer.seed": 5,
        **{f"trainer.{k}": v for k, v in trainer.items()}})


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}


@pytest.fixture(scope="module")
def uninterrupted(setup, tmp_path_factory):
    """A 4-step run's checkpoints (2 and 4) and final weights: what every resume below must reach."""
    run = tmp_path_factory.mktemp("full") / "run"
    trainer = GRPOTrainer(config_from_dict(config(setup, run)))
    trainer.train()
    assert [s for s, _ in ckpt.step_dirs(run / "checkpoints")] == [2, 4]
    return {"checkpoints": run / "checkpoints", "weights": weights(trainer)}


def copied_run(uninterrupted, tmp_path: Path) -> Path:
    """A new run directory holding copies of the uninterrupted run's checkpoints."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted["checkpoints"], run / "checkpoints")
    return run


# ---------------------------------------------------------------------------- damages, each to checkpoint 4


def flip_model_bytes(path: Path) -> None:
    """64 flipped bytes in the tensor data (not the header: the file still parses)."""
    file = path / "model" / "model.safetensors"
    data = bytearray(file.read_bytes())
    for i in range(len(data) - 64, len(data)):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def truncate_optimizer(path: Path) -> None:
    file = path / "optimizer.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def edit_json(file: Path, edit) -> None:
    saved = json.loads(file.read_text())
    edit(saved)
    file.write_text(json.dumps(saved, indent=2))


def edit_global_step(path: Path) -> None:
    edit_json(path / "trainer_state.json", lambda s: s.update(global_step=3))


def edit_data_position(path: Path) -> None:
    def edit(state):
        state["extra"]["stream"]["batch_in_epoch"] -= 1

    edit_json(path / "trainer_state.json", edit)


def edit_optimizer_lr(path: Path) -> None:
    """As a person would in an editor: the learning rate in optimizer.json's text."""
    file = path / "optimizer.json"
    text = file.read_text()
    assert text.count('["lr", 0.01]') == 1
    file.write_text(text.replace('["lr", 0.01]', '["lr", 0.02]'))


def delete_rng_tensors(path: Path) -> None:
    (path / "rng.safetensors").unlink()


def add_weight_file(path: Path) -> None:
    save_file({"extra": torch.zeros(3)}, str(path / "model" / "model-extra.safetensors"))


def delete_manifest(path: Path) -> None:
    (path / "manifest.json").unlink()


# (damage, the file the message must name, a field it must name too)
DAMAGES = [
    (flip_model_bytes, "model/model.safetensors", "SHA-256"),
    (truncate_optimizer, "optimizer.safetensors", "bytes"),
    (edit_global_step, "trainer_state.json", "global_step"),
    (edit_data_position, "trainer_state.json", "data position"),
    (edit_optimizer_lr, "optimizer.json", "SHA-256"),
    (delete_rng_tensors, "rng.safetensors", "missing"),
    (add_weight_file, "model/model-extra.safetensors", "not in the manifest"),
    (delete_manifest, "manifest.json", "missing"),
]


@pytest.mark.parametrize(("damage", "file", "field"), DAMAGES, ids=[d[0].__name__ for d in DAMAGES])
def test_damaged_checkpoint_is_named_and_skipped(setup, uninterrupted, tmp_path, damage, file, field):
    run = copied_run(uninterrupted, tmp_path)
    damaged = run / "checkpoints" / "global_step_4"
    damage(damaged)
    assert ckpt.verify_checkpoint(run / "checkpoints" / "global_step_2").intact

    # a named checkpoint that is damaged is an error naming the file and what is wrong
    with pytest.raises(ckpt.CheckpointError, match=rf"{file}[^;]*{field}") as raised:
        ckpt.resume_path(str(damaged), run / "checkpoints")
    assert isinstance(raised.value, ConfigError) and str(damaged) in str(raised.value)

    # resume=auto falls back to checkpoint 2, says why, and reaches the undamaged run's weights
    resumed = GRPOTrainer(config_from_dict(config(setup, run, resume="auto")))
    with pytest.warns(ckpt.CheckpointWarning, match=rf"global_step_4 is damaged, resuming from .*global_step_2"
                                                    rf".*{file}[^;]*{field}"):
        resumed.train()
    assert resumed.state.global_step == 4
    want, got = uninterrupted["weights"], weights(resumed)
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the undamaged run"
    # the run saved step 4 again over the damaged copy
    assert ckpt.verify_checkpoint(damaged).intact


def test_named_damaged_checkpoint_fails_the_run_in_one_line(setup, uninterrupted, tmp_path, capsys):
    """Through the trainer and the command line: exit code 2 and one line naming the file."""
    run = copied_run(uninterrupted, tmp_path)
    damaged = run / "checkpoints" / "global_step_4"
    flip_model_bytes(damaged)
    trainer = GRPOTrainer(config_from_dict(config(setup, run, resume=str(damaged))))
    with pytest.raises(ckpt.CheckpointError, match="model/model.safetensors"):
        trainer.train()

    save_config(config_from_dict(config(setup, run)), tmp_path / "config.yaml")
    assert cli_main(["train", str(tmp_path / "config.yaml"), f"trainer.resume={damaged}"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("grouprl:")]  # past the progress bars
    assert len(errors) == 1 and "model/model.safetensors: SHA-256" in errors[0] and "Traceback" not in err, err


def test_every_checkpoint_damaged_is_an_error(uninterrupted, tmp_path):
    """Not a silent fresh start over the damaged run: both are named."""
    run = copied_run(uninterrupted, tmp_path)
    flip_model_bytes(run / "checkpoints" / "global_step_4")
    truncate_optimizer(run / "checkpoints" / "global_step_2")
    with pytest.raises(ckpt.CheckpointError, match=r"global_step_4: model/model.safetensors.*"
                                                   r"global_step_2: optimizer.safetensors"):
        ckpt.resume_path("auto", run / "checkpoints")


def make_old(path: Path) -> None:
    """What an older grouprl wrote: no manifest, and no mention of one in trainer_state.json."""
    (path / "manifest.json").unlink()
    edit_json(path / "trainer_state.json", lambda s: s.pop("manifest", None))


def test_checkpoint_without_manifest_loads_with_a_warning(setup, uninterrupted, tmp_path):
    run = copied_run(uninterrupted, tmp_path)
    make_old(run / "checkpoints" / "global_step_4")
    resumed = GRPOTrainer(config_from_dict(config(setup, run, resume="auto")))
    with pytest.warns(ckpt.CheckpointWarning, match="global_step_4 has no manifest.json .*cannot be verified"):
        resumed.train()
    assert resumed.state.global_step == 4
    want, got = uninterrupted["weights"], weights(resumed)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_unverifiable_checkpoint_still_checked_for_readable_files(uninterrupted, tmp_path):
    """Without a manifest, a truncated file or a structure referring to a missing tensor is still named."""
    run = copied_run(uninterrupted, tmp_path)
    old = run / "checkpoints" / "global_step_4"
    make_old(old)
    truncate_optimizer(old)
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer.safetensors: cannot be read"):
        ckpt.resume_path(str(old), run / "checkpoints")
    (old / "optimizer.safetensors").unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer.json: refers to .* optimizer.safetensors"):
        ckpt.resume_path(str(old), run / "checkpoints")


@pytest.fixture(scope="module")
def fresh_trainer(setup, tmp_path_factory):
    return GRPOTrainer(config_from_dict(config(setup, tmp_path_factory.mktemp("fresh") / "run")))


def break_optimizer_reference(path: Path) -> None:
    """optimizer.json names a tensor optimizer.safetensors lacks: once a bare KeyError."""
    file = path / "optimizer.json"
    text = file.read_text()
    assert '.exp_avg"}' in text
    file.write_text(text.replace('.exp_avg"}', '.exp_avg_renamed"}', 1))


def truncate_model(path: Path) -> None:
    file = path / "model" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:100])


def corrupt_json(name: str):
    def corrupt(path: Path) -> None:
        (path / name).write_text((path / name).read_text()[:-5])

    corrupt.__name__ = f"corrupt_{name}"
    return corrupt


@pytest.mark.parametrize(("damage", "file"), [
    (truncate_model, "model/model.safetensors"),
    (truncate_optimizer, "optimizer.safetensors"),
    (break_optimizer_reference, "optimizer.json"),
    (corrupt_json("scheduler.json"), "scheduler.json"),
    (corrupt_json("rng.json"), "rng.json"),
    (corrupt_json("trainer_state.json"), "trainer_state.json"),
], ids=lambda x: getattr(x, "__name__", None) if callable(x) else x)
def test_loading_a_damaged_file_names_it(uninterrupted, fresh_trainer, tmp_path, damage, file):
    """Loading without verifying first (the file damaged in between): the error still names the file."""
    run = copied_run(uninterrupted, tmp_path)
    path = run / "checkpoints" / "global_step_4"
    damage(path)
    t = fresh_trainer
    with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint file \S*{file}"):
        ckpt.restore_checkpoint(path, t.policy, t.optimizer, t.scheduler)


# ---------------------------------------------------------------------------- pruning


class Weights:
    """Stands in for a model: save_pretrained writes one weight file."""

    def __init__(self, value: float):
        self.weight = torch.full((4, 4), value)

    def save_pretrained(self, path: Path, safe_serialization: bool = True) -> None:
        path.mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.weight}, str(path / "model.safetensors"))


def save(root: Path, step: int, **kwargs) -> Path:
    return ckpt.save_checkpoint(root, ckpt.TrainerState(global_step=step), Weights(step), None, None, **kwargs)


def test_pruning_keeps_the_last_intact_checkpoint(tmp_path):
    """A run that fell back from a damaged step 4 to step 2 saves step 3: save_limit=1 must not delete it."""
    root = tmp_path / "checkpoints"
    save(root, 2)
    save(root, 4)
    flip_model_bytes(root / "global_step_4")
    save(root, 3, save_limit=1)
    assert [s for s, _ in ckpt.step_dirs(root)] == [3, 4]
    assert ckpt.verify_checkpoint(root / "global_step_3").intact
    with pytest.warns(ckpt.CheckpointWarning, match="global_step_4 is damaged, resuming from .*global_step_3"):
        assert ckpt.resume_path("auto", root) == root / "global_step_3"
    # once the run saves step 4 again, the limit holds as before
    save(root, 4, save_limit=1)
    assert [s for s, _ in ckpt.step_dirs(root)] == [4] and ckpt.verify_checkpoint(root / "global_step_4").intact


def test_manifest_lists_every_file_and_the_run_facts(uninterrupted):
    path = uninterrupted["checkpoints"] / "global_step_4"
    manifest = json.loads((path / "manifest.json").read_text())
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [f for f in on_disk if f != "manifest.json"]
    for name, entry in manifest["files"].items():
        assert entry["size"] == (path / name).stat().st_size and len(entry["sha256"]) == 64
    state = json.loads((path / "trainer_state.json").read_text())
    assert manifest["global_step"] == 4 and manifest["num_processes"] == 1
    assert manifest["data_position"] == state["extra"]["stream"]


# ---------------------------------------------------------------------------- two processes


def test_two_processes_agree_on_the_fallback(tmp_path, torchrun):
    """The main process alone verifies and warns, and tells the other which checkpoint to load (or that the
    named one is damaged: both stop, neither waits for the other)."""
    import os
    import subprocess
    import sys

    import yaml
    from safetensors.torch import load_file

    from grouprl.models.tiny import build_tiny_text_lm

    words = ["yes", "no", "maybe", "left"]
    records = [{"problem": f"Say {w} {i}", "answer": w} for i in range(4) for w in words]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    build_tiny_text_lm(tmp_path / "model", [r["problem"] for r in records] + words, seed=0)
    (tmp_path / "length.py").write_text(LENGTH_REWARD)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "data": {"train_files": ["train.jsonl"], "max_response_length": 5, "rollout_batch_size": 4},
        "worker": {"actor": {"model": {"model_path": "model"}, "optim": {"lr": 1e-2}, "global_batch_size": 2,
                             "micro_batch_size_per_device_for_update": 2},
                   "rollout": {"n": 2, "temperature": 1.0}, "reward": {"functions": [{"name": "length.py:length"}]}},
        "trainer": {"max_steps": 4, "save_freq": 2, "logger": ["jsonl"], "device": "cpu"},
    }))
    torchrun("-m", "grouprl", "train", "config.yaml", "trainer.output_dir=full", cwd=tmp_path)
    shutil.copytree(tmp_path / "full" / "checkpoints", tmp_path / "resumed" / "checkpoints")
    damaged = tmp_path / "resumed" / "checkpoints" / "global_step_4"
    flip_model_bytes(damaged)

    # a damaged named checkpoint: every process stops with the one-line error (a hang would time out)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    failed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "grouprl", "train", "config.yaml", "trainer.output_dir=resumed",
                             f"trainer.resume={damaged}"], cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0
    # counted, not split into lines: the two processes' lines may interleave on the shared stderr
    errors = failed.stderr.count("grouprl: config error:")
    assert errors == 2 and failed.stderr.count("model/model.safetensors: SHA-256") == 2, failed.stderr

    # auto: one warning (from the main process), both load checkpoint 2 and reach the full run's weights
    proc = torchrun("-m", "grouprl", "train", "config.yaml", "trainer.output_dir=resumed", "trainer.resume=auto",
                    cwd=tmp_path)
    assert proc.stderr.count("global_step_4 is damaged, resuming from") == 1, proc.stderr
    full = load_file(str(tmp_path / "full" / "checkpoints" / "global_step_4" / "model" / "model.safetensors"))
    resumed = load_file(str(damaged / "model" / "model.safetensors"))
    assert all(torch.equal(resumed[k], full[k]) for k in full)
    assert [json.loads(x)["step"] for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()] == [3, 4]
