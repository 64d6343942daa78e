"""CPU offload (``worker.actor.offload``, ``worker.ref.offload``; docs/distributed.md "CPU offload").

What the CPU can test: the keys (grouprl's, EasyR1's mapped onto them, an impossible layout refused
with one line and exit code 2); FSDP2's ``CPUOffloadPolicy`` really handed to every unit of the actor
on a two-process gloo mesh, the shards, gradients and AdamW state in host memory, and the same step as
without offload; an offloaded run's checkpoint resuming to the uninterrupted run's weights and
optimizer state; the reference model moved to the device for its forward only, its log-probs bit for
bit those of a reference that never moves. GPU peak memory with and without offload is not measured
here (no GPU). On a CPU mesh the states are in host memory with or without offload; what tells the two
apart there is the policy each FSDP unit holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from grouprl.config import ConfigError, config_from_dict, load_config

HERE = Path(__file__).parent
EASYR1 = HERE / "configs" / "easyr1_config.yaml"


# ---------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("key", ["offload_params", "offload_optimizer"])
def test_actor_offload_needs_fsdp_one_line_naming_the_key(key):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [f"worker.actor.offload.{key}=true"])
    message = str(exc.value)
    assert "\n" not in message and f"worker.actor.offload.{key}" in message
    assert "worker.actor.strategy: fsdp" in message and "'ddp'" in message
    cfg = load_config(None, [f"worker.actor.offload.{key}=true", "worker.actor.strategy=fsdp"])
    assert cfg.worker.actor.offload.enabled


def test_actor_offload_without_fsdp_exits_2_at_load(tmp_path, capsys):
    from grouprl.cli import main

    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"worker": {"actor": {"offload": {"offload_params": True}}}}))
    assert main(["train", str(tmp_path / "config.yaml")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "worker.actor.offload.offload_params" in lines[0], lines


def test_reference_offload_needs_no_fsdp():
    assert load_config(None, ["worker.ref.offload.offload_params=true"]).worker.ref.offload.offload_params


def test_easyr1_example_offloads_once_its_strategy_is_fsdp(monkeypatch, tmp_path):
    # its loggers include wandb, which the config check imports: a stand-in (as in test_ported_keys.py)
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"worker\.actor\.offload\.offload_params.*strategy: fsdp"):
        load_config(EASYR1)
    cfg = load_config(EASYR1, ["worker.actor.strategy=fsdp"])
    assert cfg.worker.actor.offload.offload_params and cfg.worker.actor.offload.offload_optimizer
    # ref.fsdp.enable_cpu_offload: true wins over ref.offload.offload_params: false (either offloads in EasyR1)
    assert cfg.worker.ref.offload.offload_params


@pytest.mark.parametrize("enable, given, expected", [(True, False, True), (False, True, True), (False, False, False)])
def test_easyr1_fsdp_cpu_offload_keys_read_as_offload(enable, given, expected):
    cfg = load_config(None, ["worker.actor.strategy=fsdp", f"worker.actor.fsdp.enable_cpu_offload={enable}",
                             f"worker.actor.offload.offload_params={given}",
                             f"worker.ref.fsdp.enable_cpu_offload={enable}",
                             f"worker.ref.offload.offload_params={given}"])
    assert cfg.worker.actor.offload.offload_params is expected and cfg.worker.ref.offload.offload_params is expected


def test_easyr1_fsdp_cpu_offload_is_refused_when_not_a_boolean():
    with pytest.raises(ConfigError, match=r"worker\.ref\.fsdp\.enable_cpu_offload.*expects true or false"):
        load_config(None, ["worker.ref.fsdp.enable_cpu_offload=maybe"])


def test_offload_policy_pins_host_memory_only_with_an_accelerator():
    from torch.distributed.fsdp import CPUOffloadPolicy

    from grouprl.trainer.parallel import offload_policy

    assert offload_policy(torch.device("cpu")) == CPUOffloadPolicy(pin_memory=False)
    assert offload_policy(torch.device("cuda", 0)) == CPUOffloadPolicy(pin_memory=True)


def test_turning_offload_on_to_resume_is_not_a_changed_config():
    # the run that ran out of memory resumes with offload on: where states wait changes nothing trained
    from grouprl.trainer.resume_config import training_changes

    off = {"worker": {"actor": {"offload": {"offload_params": False, "offload_optimizer": False}},
                      "ref": {"offload": {"offload_params": False}}}}
    on = {"worker": {"actor": {"offload": {"offload_params": True, "offload_optimizer": True}},
                     "ref": {"offload": {"offload_params": True}}}}
    assert training_changes(off, on) == []


def test_offloaded_gpu_runs_get_gloo_beside_nccl_for_the_host_gradients(monkeypatch):
    # clipping the norm of gradient shards in host memory is a collective on CPU tensors, which NCCL
    # cannot carry: GPU processes that offload get gloo for those (Accelerate's own choice for its offload)
    from grouprl.trainer.parallel import process_group_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert process_group_backend("auto", offload=True) == process_group_backend("cuda", True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend("cuda", offload=False) is None  # Accelerate's NCCL
    assert process_group_backend("cpu", offload=True) is None  # gloo already
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert process_group_backend("auto", offload=True) is None


# ---------------------------------------------------------------------------- the reference model


class RecordingLinear(torch.nn.Linear):
    """A Linear that records where each ``to()`` sends it."""

    def __init__(self):
        super().__init__(3, 2)
        self.moves: list[str] = []

    def to(self, *args, **kwargs):
        self.moves.append(str(torch.device(args[0])))
        return super().to(*args, **kwargs)


def test_frozen_model_offloaded_visits_its_device_for_the_block_only():
    from grouprl.models.frozen import FrozenModel

    model = RecordingLinear()
    # the device the weights visit: on a CPU-only machine the CPU itself; the moves are what is tested
    held = FrozenModel(model, device="cpu:0", offload=True)
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    assert model.moves == ["cpu"] and held.location == torch.device("cpu")
    with held.on_device() as inside:
        assert inside is model and held.location == torch.device("cpu:0")
    assert model.moves == ["cpu", "cpu:0", "cpu"] and held.location == torch.device("cpu")
    with pytest.raises(RuntimeError, match="boom"), held.on_device():
        raise RuntimeError("boom")
    assert model.moves[-1] == "cpu" and held.location == torch.device("cpu")  # back after a failure too

    kept = RecordingLinear()
    resident = FrozenModel(kept, device="cpu:0")
    with resident.on_device():
        pass
    assert kept.moves == ["cpu:0"] and resident.location == torch.device("cpu:0")  # never moves again


def test_teacher_is_the_frozen_model_holder():
    from grouprl.models.frozen import FrozenModel
    from grouprl.trainer.teacher import Teacher

    assert issubclass(Teacher, FrozenModel)


def test_offloaded_reference_moves_for_its_forward_and_gives_the_same_log_probs(say_task, tmp_path, monkeypatch):
    from grouprl.trainer.grpo import GRPOTrainer

    task = say_task(4)
    moves: list[str] = []
    to = torch.nn.Module.to

    def recording_to(module, *args, **kwargs):
        if getattr(module, "_is_reference", False):
            moves.append(str(torch.device(args[0])))
        return to(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    seen: dict[bool, list[torch.Tensor]] = {}
    for offload in (False, True):
        config = config_from_dict(task.config(tmp_path / f"run{offload}", [{"name": "accuracy"}], **{
            "algorithm.kl_coef": 0.1, "worker.ref.offload.offload_params": offload, "trainer.max_steps": 1,
            "trainer.seed": 3, "worker.actor.global_batch_size": 4}))
        trainer = GRPOTrainer(config)
        assert trainer.ref_model.offload is offload
        assert trainer.run_info_extras()["offload"] == (["ref"] if offload else [])
        trainer.ref_model.model._is_reference = True
        reference = trainer._reference_log_probs
        seen[offload] = []

        def recording(batch, reference=reference, out=seen[offload]):
            out.append(reference(batch))
            return out[-1]

        monkeypatch.setattr(trainer, "_reference_log_probs", recording)
        moves.clear()
        trainer.train()
        assert moves == ([str(trainer.accelerator.device), "cpu"] if offload else [])
        assert all(p.device.type == "cpu" for p in trainer.ref_model.model.parameters())
    assert len(seen[True]) == len(seen[False]) == 1
    assert torch.equal(seen[True][0], seen[False][0])  # bit for bit


# ---------------------------------------------------------------------------- the actor, two processes


WORDS = ["yes", "no", "maybe", "left", "right"]


def _fsdp_project(tmp_path: Path, **actor) -> Path:
    from grouprl.models.tiny import build_tiny_text_lm

    records = [{"problem": f"Say {w} {i}", "answer": w} for i in range(4) for w in WORDS]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    build_tiny_text_lm(tmp_path / "model", [r["problem"] for r in records] + WORDS, seed=0)
    config = {
        "data": {"train_files": ["train.jsonl"], "max_response_length": 5, "rollout_batch_size": 4},
        "worker": {"actor": {"model": {"model_path": "model", "dtype": "bfloat16"}, "strategy": "fsdp",
                             "offload": {"offload_params": True, "offload_optimizer": True},
                             "optim": {"lr": 1e-3}, "global_batch_size": 2,
                             "micro_batch_size_per_device_for_update": 1, **actor},
                   "rollout": {"n": 2}, "reward": {"functions": [{"name": "accuracy"}]}},
        "algorithm": {"kl_coef": 0.05},
        "trainer": {"max_steps": 2, "save_freq": 1, "logger": ["jsonl"], "device": "cpu"},
    }
    config["worker"]["ref"] = {"offload": {"offload_params": True}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "config.yaml"


def test_offloaded_fsdp_run_keeps_its_states_on_the_cpu_and_resumes_exactly(tmp_path, torchrun, read_jsonl):
    """Two processes train with the actor and the reference offloaded (the run is then inspected: every FSDP
    unit holds CPUOffloadPolicy; shards, gradients and AdamW state on the CPU; a step equal to one without
    offload); resuming its step-1 checkpoint reaches its step-2 weights and optimizer state."""
    _fsdp_project(tmp_path)
    (tmp_path / "out").mkdir()
    torchrun(str(HERE / "distributed" / "offload_check.py"), "out", "config.yaml", "trainer.output_dir=full",
             cwd=tmp_path)
    for rank in range(2):
        result = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        assert result["world"] == 2 and result["units"] >= 2  # decoder layers and the root
        assert all(p == {"offload": "CPUOffloadPolicy", "pin_memory": False, "param_dtype": "torch.bfloat16"}
                   for p in result["policies"]), result["policies"]
        assert result["param_devices"] == result["grad_devices"] == ["cpu"]
        assert result["optimizer_state_devices"] == ["cpu"] and result["optimizer_states"] > 0
        assert result["same_as_without_offload"]
    info = json.loads((tmp_path / "full" / "run_info.json").read_text())
    assert info["num_processes"] == 2 and info["strategy"] == "fsdp" and info["offload"] == ["actor", "ref"]

    torchrun("-m", "grouprl", "train", "config.yaml", "trainer.output_dir=resumed",
             "trainer.resume=full/checkpoints/global_step_1", cwd=tmp_path)

    def saved(run: str, step: int, name: str) -> dict[str, torch.Tensor]:
        return load_file(str(tmp_path / run / "checkpoints" / f"global_step_{step}" / name))

    full, resumed = saved("full", 2, "model/model.safetensors"), saved("resumed", 2, "model/model.safetensors")
    assert any(not torch.equal(full[k], v) for k, v in saved("full", 1, "model/model.safetensors").items())
    assert full.keys() == resumed.keys() and all(torch.equal(resumed[k], full[k]) for k in full)
    full_opt, resumed_opt = saved("full", 2, "optimizer.safetensors"), saved("resumed", 2, "optimizer.safetensors")
    assert full_opt and full_opt.keys() == resumed_opt.keys()
    assert all(torch.equal(resumed_opt[k], full_opt[k]) for k in full_opt)
    assert [m["step"] for m in read_jsonl(tmp_path / "resumed" / "metrics.jsonl")] == [2]
