"""Defaults that depend on the algorithm (``resolve_flow_defaults``): an unset ``algorithm.kl_coef`` is
flow_grpo's 0.04 for the Flow-GRPO family and NVlabs' 1e-4 for DiffusionNFT, a set one is kept, and the
run both uses and records (config.yaml) the resolved number."""

from __future__ import annotations

import pytest
import yaml

from grouprl.domains.diffusion.config import FLOW_ALGORITHMS, load_flow_config

EXPECTED_KL = {"flow_grpo": 0.04, "flow_grpo_fast": 0.04, "grpo_guard": 0.04, "diffusion_nft": 1e-4}


def write_config(path, algorithm: dict) -> str:
    """A flow config file with only what validation needs, and ``algorithm`` as given."""
    values = {"kind": "flow", "algorithm": algorithm,
              "worker": {"actor": {"model": {"model_path": "unused"}},
                         "reward": {"functions": [{"name": "image_brightness"}]}}}
    path.write_text(yaml.safe_dump(values))
    return str(path)


@pytest.mark.parametrize("name", FLOW_ALGORITHMS)
def test_an_unset_kl_coef_takes_the_algorithms_default(tmp_path, name):
    assert set(EXPECTED_KL) == set(FLOW_ALGORITHMS)
    config = load_flow_config(write_config(tmp_path / "flow.yaml", {"name": name}))
    assert config.algorithm.kl_coef == EXPECTED_KL[name]
    # null in the file is the same as leaving the key out
    config = load_flow_config(write_config(tmp_path / "null.yaml", {"name": name, "kl_coef": None}))
    assert config.algorithm.kl_coef == EXPECTED_KL[name]


@pytest.mark.parametrize(("name", "value"), [("diffusion_nft", 0.04), ("diffusion_nft", 0.0),
                                             ("flow_grpo", 1e-4), ("flow_grpo", 0.0), ("grpo_guard", 0.5)])
def test_a_set_kl_coef_is_kept(tmp_path, name, value):
    config = load_flow_config(write_config(tmp_path / "flow.yaml", {"name": name, "kl_coef": value}))
    assert config.algorithm.kl_coef == value
    # and an override on the command line is kept over the algorithm's default
    config = load_flow_config(write_config(tmp_path / "bare.yaml", {"name": name}), [f"algorithm.kl_coef={value}"])
    assert config.algorithm.kl_coef == value


def test_the_run_uses_and_records_the_resolved_kl_coef(flow_config, tmp_path, read_jsonl):
    pytest.importorskip("diffusers")
    from grouprl.domains.diffusion.trainer import DiffusionNFTTrainer

    out = tmp_path / "run"
    config = flow_config(out, **{"algorithm.name": "diffusion_nft", "algorithm.kl_coef": None,
                                 "worker.rollout.noise_level": 0.0, "worker.rollout.guidance_scale": 1.0,
                                 "algorithm.timestep_fraction": 0.5, "trainer.max_steps": 1,
                                 "trainer.val_freq": -1, "trainer.save_freq": -1})
    DiffusionNFTTrainer(config).train()
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["algorithm"]["kl_coef"] == 1e-4
    # the KL term is on (kl_coef > 0): the reference pass ran and its loss was logged
    steps = [m for m in read_jsonl(out / "metrics.jsonl") if "actor/pg_loss" in m]
    assert len(steps) == 1 and "actor/kl_loss" in steps[0]
    # the saved config loads back to the same run
    assert load_flow_config(str(out / "config.yaml")).algorithm.kl_coef == 1e-4
