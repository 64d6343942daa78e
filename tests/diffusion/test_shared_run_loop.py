"""The language and the flow trainer run in one loop (``grouprl.trainer.loop``): the metrics both
log have the same kind, every ``timing/*`` key is the slowest process's, and rewards are logged
under one schema."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from grouprl.config import config_from_dict  # noqa: E402
from grouprl.domains.diffusion.config import flow_config_from_dict  # noqa: E402
from grouprl.domains.diffusion.trainer import FlowGRPOTrainer  # noqa: E402
from grouprl.trainer.grpo import GRPOTrainer  # noqa: E402

WORDS = ["yes", "no", "maybe", "left", "right"]


def language_run(root, out):
    from grouprl.models.tiny import build_tiny_text_lm

    records = [{"problem": f"Say {w}", "answer": w} for w in WORDS]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    model = build_tiny_text_lm(root / "model", [r["problem"] for r in records] + WORDS, seed=0)
    GRPOTrainer(config_from_dict({
        "data": {"train_files": [str(root / "train.jsonl")], "val_files": [str(root / "train.jsonl")],
                 "max_response_length": 4, "rollout_batch_size": 2, "val_max_samples": 2},
        "algorithm": {"kl_coef": 0.01},
        "worker": {"actor": {"model": {"model_path": str(model)}, "global_batch_size": 2},
                   "rollout": {"n": 2},
                   "reward": {"functions": [{"name": "length", "kwargs": {"target": 2}}]}},
        "trainer": {"output_dir": str(out), "max_steps": 1, "logger": ["jsonl"], "device": "cpu", "val_freq": 1},
    })).train()


def flow_run(root, out):
    from grouprl.domains.diffusion.tiny import build_tiny_pixel_flow

    model = build_tiny_pixel_flow(root / "flow", image_size=8, num_layers=1, num_attention_heads=2,
                                  attention_head_dim=8, embed_dim=16)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"a red square {i}"}) + "\n" for i in range(2)))
    FlowGRPOTrainer(flow_config_from_dict({
        "kind": "flow",
        "data": {"train_files": [str(root / "prompts.jsonl")], "val_files": [str(root / "prompts.jsonl")],
                 "rollout_batch_size": 2},
        "algorithm": {"name": "flow_grpo_fast", "kl_coef": 0.04},
        "worker": {"actor": {"model": {"model_path": str(model), "lora": {"rank": 2, "alpha": 4}},
                             "micro_batch_size": 4},
                   "rollout": {"n": 2, "num_steps": 3, "height": 8, "width": 8, "micro_batch_size": 4,
                               "sde_window_size": 1, "sde_window_range": [0, 3], "val_num_steps": 3},
                   "reward": {"functions": [{"name": "image_brightness"}]}},
        "trainer": {"output_dir": str(out), "max_steps": 1, "logger": ["jsonl"], "device": "cpu", "val_freq": 1},
    })).train()


def test_both_trainers_log_shared_keys_alike_and_timings_as_the_slowest_process(tmp_path):
    language_run(tmp_path, tmp_path / "language")
    flow_run(tmp_path, tmp_path / "flow")
    schemas = {name: json.loads((tmp_path / name / "metrics_schema.json").read_text()) for name in ("language", "flow")}
    language, flow = schemas["language"], schemas["flow"]
    shared = language.keys() & flow.keys()
    assert {"timing/step_s", "timing/update_s", "timing/rollout_s", "actor/lr", "actor/pg_loss", "actor/kl_loss",
            "actor/grad_norm", "advantages", "reward", "val/reward"} <= shared
    assert {k: language[k] for k in shared} == {k: flow[k] for k in shared}
    for name, schema in schemas.items():
        timings = {k: kind for k, kind in schema.items() if k.startswith("timing/")}
        assert timings and set(timings.values()) == {"max"}, (name, timings)
    # one reward schema: each component's moments and applicable fraction, in training and validation
    for schema, key in ((language, "length"), (flow, "image_brightness")):
        for prefix in ("", "val/"):
            assert schema[f"{prefix}rewards/{key}"] == "moments"
            assert schema[f"{prefix}rewards/{key}/applicable_frac"] == "mean"
    for schema in (language, flow):  # 1 where no row on any process was scored: the least over them
        assert schema["reward/unscored_steps"] == "min"
    # counts become rates over the slowest process's step time
    for name, rate in (("language", "perf/tokens_per_s"), ("flow", "perf/images_per_s")):
        first = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
        assert first[rate] > 0 and first["reward/std"] is not None


def test_the_flow_trainer_resumes_only_under_its_checkpoints_config(flow_config, tmp_path, capsys):
    """The loop's resume check holds for the flow trainer too: another algorithm setting is refused in
    one line naming it; a run already at its last step says nothing is left to train."""
    from grouprl.config import ConfigError

    plain = {"trainer.max_steps": 1, "trainer.val_freq": -1}
    FlowGRPOTrainer(flow_config(tmp_path / "run", **plain)).train()
    checkpoint = tmp_path / "run" / "checkpoints" / "global_step_1"
    changed = FlowGRPOTrainer(flow_config(tmp_path / "run", **plain, **{"trainer.resume": "auto",
                                                                         "algorithm.clip_range": 0.2}))
    with pytest.raises(ConfigError, match=r"global_step_1 was trained with another config "
                                          r"\(algorithm\.clip_range: 0\.01 -> 0\.2\)"):
        changed.train()
    capsys.readouterr()
    same = FlowGRPOTrainer(flow_config(tmp_path / "run", **plain, **{"trainer.resume": "auto"}))
    same.train()
    assert (f"grouprl: nothing left to train: checkpoint {checkpoint} is at step 1 and the run ends at step 1 "
            "(trainer.max_steps)") in capsys.readouterr().out
