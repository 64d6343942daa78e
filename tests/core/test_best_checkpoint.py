"""The best checkpoint (trainer.best_metric / best_mode) and validation-only runs (grouprl validate, trainer.val_only).

Which validation wins is scripted here (a metric ``probe`` added to each validation's real
metrics, its value chosen per step), so that each test knows the step that must be kept;
the validation-only tests use the real ``val/reward/mean@1``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grouprl.cli import main
from grouprl.config import ConfigError, config_from_dict
from grouprl.trainer import checkpoint as ckpt
from grouprl.trainer.best import improves
from grouprl.trainer.grpo import GRPOTrainer

NAN = float("nan")


@pytest.fixture(scope="module")
def task(say_task):
    return say_task(2)


def config(task, out: Path, **overrides) -> dict:
    # small and cheap: one micro-batch per update, a reward that costs nothing
    return task.config(out, [{"name": "length", "kwargs": {"target": 2}}], **{
        "data.val_files": [str(task.data)], "data.val_max_samples": 4, "data.val_batch_size": 4,
        "data.rollout_batch_size": 2, "worker.rollout.n": 2, "worker.actor.global_batch_size": 2,
        "worker.actor.micro_batch_size_per_device_for_update": 4,
        "worker.actor.micro_batch_size_per_device_for_experience": 4, "trainer.seed": 3,
        "trainer.val_freq": 1, **overrides})


def scripted(trainer, values: dict[int, float]) -> dict[int, dict[str, torch.Tensor]]:
    """Each validation also logs ``val/probe`` = ``values[step]``; returns the weights after each step
    (filled as the run goes), to compare checkpoints with."""
    validate, step = trainer.validate, trainer.step
    weights: dict[int, dict[str, torch.Tensor]] = {}

    def validate_with_probe(current):
        result = validate(current)
        result.metrics.mean("probe", values[current])
        return result

    def step_noting_weights(current):
        result = step(current)
        weights[current] = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
        return result

    trainer.validate, trainer.step = validate_with_probe, step_noting_weights
    return weights


def saved_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model" / "model.safetensors"))


def assert_holds(checkpoint: Path, weights: dict[str, torch.Tensor]) -> None:
    saved = saved_weights(checkpoint)
    shared = set(saved) & set(weights)
    assert shared
    for key in shared:
        torch.testing.assert_close(saved[key], weights[key], rtol=0, atol=0)


def best_state(run: Path) -> tuple[int, dict]:
    state = ckpt.load_trainer_state(run / "checkpoints" / "best")
    return state.global_step, state.extra["best"]


# ---------------------------------------------------------------------------- the rule


def test_improves_is_strict_and_nan_never_wins():
    assert improves(0.5, None, "max") and improves(-3.0, None, "min")
    assert improves(0.6, 0.5, "max") and not improves(0.5, 0.5, "max") and not improves(0.4, 0.5, "max")
    assert improves(0.4, 0.5, "min") and not improves(0.5, 0.5, "min") and not improves(0.6, 0.5, "min")
    for bad in (NAN, math.inf, -math.inf):
        assert not improves(bad, None, "max") and not improves(bad, 0.5, "min")


@pytest.mark.parametrize("overrides, needle", [
    ({"trainer.best_mode": "max"}, "'trainer.best_mode' (max) says how 'trainer.best_metric'"),
    ({"trainer.best_metric": "val/probe", "trainer.best_mode": "highest"}, "'trainer.best_mode' accepts one of max, min"),
    ({"trainer.best_metric": "reward/mean"}, "'trainer.best_metric' must be a validation metric"),
    ({"trainer.best_metric": "val/probe", "trainer.val_freq": -1}, "the run never validates"),
])
def test_bad_best_settings_are_config_errors(task, tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict(config(task, tmp_path / "run", **overrides))


@pytest.mark.parametrize("how", ["linked", "written"])
def test_keeping_best_survives_a_crash_at_every_point(tmp_path, monkeypatch, how):
    """Replacing best/ (version 1) with step 2's checkpoint (version 2) and dying at any rename, fsync or
    removal leaves a whole best/, the old or the new, and no hidden copy once the directory is listed."""
    from test_checkpoint_logs import SimulatedCrash, VersionedModel, crash_at, save_version, version_of

    outcomes = set()
    for k in range(1, 200):
        root = tmp_path / f"{how}{k}"
        ckpt.keep_best(root, save_version(root, 1, version=1))
        source = save_version(root, 2, version=2)
        with crash_at(monkeypatch, k):
            try:
                if how == "linked":
                    ckpt.keep_best(root, source)
                else:
                    ckpt.save_best(root, ckpt.TrainerState(global_step=2, extra={"version": 2}), VersionedModel(2),
                                   torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=2.0), None)
                crashed = False
            except SimulatedCrash:
                crashed = True
        assert [s for s, _ in ckpt.step_dirs(root)] == [1, 2], k  # recovers; best/ is not a step
        got = version_of(root / "best")
        assert got in (1, 2) and ckpt.verify_checkpoint(root / "best").intact, k
        assert not [p.name for p in root.iterdir() if p.name.startswith(".best")], k
        outcomes.add(got)
        if not crashed:
            assert got == 2
            break
    else:
        pytest.fail("keeping best never ran to the end")
    assert outcomes == {1, 2}


# ---------------------------------------------------------------------------- in a run


def test_best_is_the_winning_steps_checkpoint_and_never_pruned(task, tmp_path):
    """Step 0's NaN never wins, step 3 (not a saved step) wins and is written, step 4's tie keeps step 3;
    save_limit 1 prunes the step checkpoints around it, never best/, and resume=auto never picks it."""
    run = tmp_path / "run"
    trainer = GRPOTrainer(config_from_dict(config(task, run, **{
        "trainer.max_steps": 4, "trainer.save_freq": 2, "trainer.save_limit": 1, "trainer.val_before_train": True,
        "trainer.best_metric": "val/probe"})))
    weights = scripted(trainer, {0: NAN, 1: 0.2, 2: 0.5, 3: 0.9, 4: 0.9})
    trainer.train()
    best = run / "checkpoints" / "best"
    assert ckpt.verify_checkpoint(best).intact
    assert best_state(run) == (3, {"metric": "val/probe", "mode": "max", "step": 3, "value": 0.9})
    assert_holds(best, weights[3])
    info = json.loads((run / "run_info.json").read_text())["best"]
    assert info == {"metric": "val/probe", "mode": "max", "step": 3, "value": 0.9, "path": str(best.resolve())}
    assert [s for s, _ in ckpt.step_dirs(run / "checkpoints")] == [4]
    assert ckpt.resume_path("auto", run / "checkpoints") == run / "checkpoints" / "global_step_4"
    # every later checkpoint carries the record a resume needs
    assert ckpt.load_trainer_state(run / "checkpoints" / "global_step_4").extra["best"]["step"] == 3


def test_a_resumed_run_keeps_a_better_best(task, tmp_path, interrupt_at_step):
    """Killed at step 4 after best/ took step 3 (0.95; the last checkpoint, step 2, records step 1's 0.9):
    the resumed run's step 3 scores 0.92, which beats the checkpoint's record but not best/'s."""
    run = tmp_path / "run"
    values = {"trainer.max_steps": 4, "trainer.save_freq": 2, "trainer.best_metric": "val/probe",
              "trainer.resume": "auto"}
    first = GRPOTrainer(config_from_dict(config(task, run, **values)))
    scripted(first, {1: 0.9, 2: 0.5, 3: 0.95})
    interrupt_at_step(first, 4)
    assert [s for s, _ in ckpt.step_dirs(run / "checkpoints")] == [2] and best_state(run)[0] == 3
    kept = (run / "checkpoints" / "best" / "model" / "model.safetensors").stat().st_ino
    second = GRPOTrainer(config_from_dict(config(task, run, **values)))
    scripted(second, {3: 0.92, 4: 0.6})
    second.train()
    assert best_state(run) == (3, {"metric": "val/probe", "mode": "max", "step": 3, "value": 0.95})
    assert (run / "checkpoints" / "best" / "model" / "model.safetensors").stat().st_ino == kept
    assert json.loads((run / "run_info.json").read_text())["best"]["value"] == 0.95


def test_best_of_a_saved_step_is_linked_and_made_again_on_resume(task, tmp_path):
    """best/ of a step saved anyway is that checkpoint's files hard-linked (one copy on disk). A run killed
    between saving the winning step and linking best/ (here: best/ deleted) makes best/ from that step's
    checkpoint when it resumes it, and the record it holds is the value to beat (min: lower wins)."""
    import shutil

    run = tmp_path / "run"
    values = {"trainer.save_freq": 2, "trainer.best_metric": "val/probe", "trainer.best_mode": "min",
              "trainer.resume": "auto"}
    first = GRPOTrainer(config_from_dict(config(task, run, **{**values, "trainer.max_steps": 2})))
    weights = scripted(first, {1: 0.5, 2: 0.1})
    first.train()
    best, step_2 = run / "checkpoints" / "best", run / "checkpoints" / "global_step_2"
    assert best_state(run)[0] == 2 and ckpt.verify_checkpoint(best).intact
    for name in ("model/model.safetensors", "optimizer.safetensors", "trainer_state.json"):
        assert os.path.samefile(best / name, step_2 / name), name
    shutil.rmtree(best)
    second = GRPOTrainer(config_from_dict(config(task, run, **{**values, "trainer.max_steps": 3})))
    scripted(second, {3: 0.3})
    second.train()
    assert best_state(run) == (2, {"metric": "val/probe", "mode": "min", "step": 2, "value": 0.1})
    assert ckpt.verify_checkpoint(best).intact
    assert_holds(best, weights[2])


def test_a_best_metric_the_validation_does_not_log_stops_the_run(task, tmp_path):
    trainer = GRPOTrainer(config_from_dict(config(task, tmp_path / "run", **{
        "trainer.max_steps": 1, "trainer.best_metric": "val/reward/mean@4"})))
    with pytest.raises(ConfigError, match=r"'val/reward/mean@4', which the validation at step 1 did not log "
                                          r"\(did you mean val/reward/mean@1.*it logged: .*val/reward/mean@1"):
        trainer.train()


# ---------------------------------------------------------------------------- validation-only runs, export


@pytest.fixture(scope="module")
def trained(task, tmp_path_factory):
    """A finished run (best by the real val/reward/mean@1) and its config file."""
    root = tmp_path_factory.mktemp("best_run")
    values = config(task, root / "run", **{"trainer.max_steps": 2, "trainer.save_freq": 1,
                                            "trainer.best_metric": "val/reward/mean@1"})
    (root / "config.yaml").write_text(json.dumps(values))
    assert main(["train", str(root / "config.yaml")]) == 0
    return root


def val_lines(run: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: {k: v for k, v in x.items() if k.startswith("val/") and not k.startswith("val/timing/")}
            for x in lines if any(k.startswith("val/") for k in x)}


def assert_same_metrics(written: dict, logged: dict) -> None:
    written = {k: v for k, v in written.items() if not k.startswith("val/timing/")}
    assert set(written) == set(logged)
    for key, value in logged.items():
        assert written[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_validate_reproduces_the_runs_validation(trained, tmp_path, capsys):
    run = trained / "run"
    out = tmp_path / "val"
    assert main(["validate", str(trained / "config.yaml"), "--checkpoint", str(run / "checkpoints" / "global_step_2"),
                 "--out", str(out)]) == 0
    written = json.loads((out / "validation.json").read_text())
    assert written["step"] == 2 and written["checkpoint"] == str((run / "checkpoints" / "global_step_2").resolve())
    assert_same_metrics(written["metrics"], val_lines(run)[2])
    generations = [json.loads(x) for x in (run / "val_generations.jsonl").read_text().splitlines()]
    assert [g["response"] for g in written["generations"]] == [g["response"] for g in generations if g["step"] == 2]
    shown = capsys.readouterr().out
    assert "validation of checkpoint" in shown and "val/reward/mean@1" in shown
    assert sorted(p.name for p in out.iterdir()) == ["validation.json"]  # no checkpoint, no training files
    assert [s for s, _ in ckpt.step_dirs(run / "checkpoints")] == [1, 2]


def test_validate_the_best_checkpoint_then_export_it(trained, tmp_path):
    from grouprl.models.loading import load_model_and_processor

    run = trained / "run"
    assert main(["validate", str(trained / "config.yaml"), "--checkpoint", "best", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "validation.json").read_text())
    best = json.loads((run / "run_info.json").read_text())["best"]
    assert written["step"] == best["step"] and written["checkpoint"] == best["path"]
    assert written["metrics"]["val/reward/mean@1"] == pytest.approx(best["value"])
    assert_same_metrics(written["metrics"], val_lines(run)[best["step"]])
    assert main(["export", str(run / "checkpoints" / "best"), "--out", str(tmp_path / "merged")]) == 0
    merged, _, _ = load_model_and_processor(str(tmp_path / "merged"))
    assert_holds(run / "checkpoints" / "best", merged.state_dict())


def test_val_only_validates_and_does_not_train(trained, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", str(trained / "config.yaml"), f"trainer.output_dir={out}", "trainer.val_only=true",
                 f"trainer.resume={trained / 'run' / 'checkpoints' / 'global_step_1'}"]) == 0
    assert "trainer.val_only: validating" in capsys.readouterr().out
    written = json.loads((out / "validation.json").read_text())
    assert written["step"] == 1
    assert_same_metrics(written["metrics"], val_lines(trained / "run")[1])
    assert not (out / "metrics.jsonl").exists() and not list((out / "checkpoints").iterdir())


@pytest.mark.parametrize("argv, needle", [
    (["--checkpoint", "{root}/nowhere"], "--checkpoint {root}/nowhere: there is no checkpoint at"),
    (["--checkpoint", "latest", "trainer.save_checkpoint_path={root}/empty"], "--checkpoint latest: there is no "),
    (["--checkpoint", "best", "trainer.save_checkpoint_path={root}/empty"], "--checkpoint best: there is no best"),
    (["worker.rollout.val_n=0"], "config key 'worker.rollout.val_n' must be > 0"),
    (["data.val_files=[]"], "config key 'data.val_files' is empty: there is nothing to validate"),
])
def test_validate_errors_are_one_line(trained, tmp_path, capsys, argv, needle):
    (tmp_path / "empty").mkdir()
    argv = [a.replace("{root}", str(tmp_path)) for a in argv]
    assert main(["validate", str(trained / "config.yaml"), "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert needle.replace("{root}", str(tmp_path)) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out" / "validation.json").exists()
