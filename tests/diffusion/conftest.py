"""The diffusion tests' shared fixtures: tiny pixel-space flow models, built once per session, and
the flow trainer's prompts and config.

The core fixtures (tasks, run helpers, torchrun) come from tests/conftest.py.
"""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="session")
def tiny_pixel_flow(tmp_path_factory):
    """``tiny_pixel_flow(**options)``: the directory of the demo's pixel-space flow model
    (``grouprl.domains.diffusion.tiny.build_tiny_pixel_flow``), built once per session for each set of
    options. Tests only read it (``load_flow_model`` gives each its own copy)."""
    pytest.importorskip("diffusers")
    from grouprl.domains.diffusion.tiny import build_tiny_pixel_flow

    built = {}

    def get(**options):
        key = repr(sorted(options.items()))
        if key not in built:
            built[key] = build_tiny_pixel_flow(tmp_path_factory.mktemp("pixel_flow") / "model", **options)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_flow(tiny_pixel_flow):
    """The smallest flow model the trainer tests run: 8 x 8 pixels, one transformer layer."""
    return tiny_pixel_flow(image_size=8, num_layers=1, num_attention_heads=2, attention_head_dim=8, embed_dim=16)


@pytest.fixture(scope="session")
def prompts(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompts")
    words = ["a red square on the left", "a blue square on the right", "two green squares on the left",
             "a red square on the right"]
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "tag": i}) + "\n" for i, p in enumerate(words)))
    (root / "val.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in words[:2]))
    return root


@pytest.fixture(scope="session")
def flow_values(prompts):
    """``flow_values(model_path, out)``: the values of a Flow-GRPO-Fast run of ``model_path`` on the prompts,
    into ``out``: the base of ``flow_config`` and of the family tests' runs, which override it."""

    def values(model_path, out) -> dict:
        return {
            "kind": "flow",
            "data": {"train_files": [str(prompts / "train.jsonl")], "val_files": [str(prompts / "val.jsonl")],
                     "rollout_batch_size": 2, "seed": 3},
            "algorithm": {"name": "flow_grpo_fast", "kl_coef": 0.04, "clip_range": 1e-2},
            "worker": {
                "actor": {"model": {"model_path": str(model_path), "lora": {"rank": 4, "alpha": 8}},
                          "optim": {"lr": 1e-2}, "micro_batch_size": 3, "num_minibatches": 2},
                "rollout": {"n": 4, "num_steps": 4, "height": 8, "width": 8, "guidance_scale": 2.0,
                            "micro_batch_size": 3, "sde_window_size": 2, "sde_window_range": [0, 4],
                            "val_num_steps": 6},
                "reward": {"functions": [{"name": "image_brightness"}]},
            },
            "trainer": {"output_dir": str(out), "max_steps": 2, "logger": ["jsonl"], "save_freq": 1,
                        "device": "cpu", "seed": 5, "val_freq": 2},
        }

    return values


@pytest.fixture
def flow_config(tiny_flow, flow_values, set_dotted):
    """``flow_config(out, **overrides)``: a Flow-GRPO-Fast run of the tiny flow model on the prompts."""
    from grouprl.domains.diffusion.config import flow_config_from_dict

    def config(out, **extra):
        return flow_config_from_dict(set_dotted(flow_values(tiny_flow, out), extra))

    return config
