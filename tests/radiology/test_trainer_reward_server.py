"""GRPO with `worker.reward.reward_server`: the real server on 127.0.0.1 scores the rollouts; a dead one stops training."""

from __future__ import annotations

import json
import socket

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from grouprl.config import config_from_dict  # noqa: E402
from grouprl.domains.radiology.server import app as server  # noqa: E402
from grouprl.rewards import RewardError  # noqa: E402
from grouprl.domains.radiology.server.client import RewardServerError  # noqa: E402
from grouprl.trainer.grpo import GRPOTrainer  # noqa: E402


@pytest.fixture(scope="module")
def setup(cxr_vlm, cxr_data):
    return {"data": cxr_data(4, seed=1, format="easyr1"), "model": cxr_vlm}


@pytest.fixture(scope="module")
def live_server(serve_app):
    # the real EditGRPO composite: radgraphf1 + cxb14micro + ratescore
    with serve_app(server.create_app()) as port:
        yield f"http://127.0.0.1:{port}/predict"


def config(setup, out, url):
    return {
        "data": {"train_files": [str(setup["data"])], "max_response_length": 8, "rollout_batch_size": 2},
        "worker": {"actor": {"model": {"model_path": str(setup["model"])}, "global_batch_size": 2},
                   "rollout": {"n": 2},
                   "reward": {"reward_server": url, "server_retries": 1, "server_timeout": 5,
                              "functions": [{"name": "length", "weight": 0.1, "kwargs": {"max_length": 100}}]}},
        "trainer": {"output_dir": str(out), "max_steps": 1, "logger": ["jsonl"], "device": "cpu"},
    }


def test_rewards_come_from_the_server(setup, live_server, tmp_path):
    GRPOTrainer(config_from_dict(config(setup, tmp_path / "run", live_server))).train()
    rollouts = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4
    for r in rollouts:
        assert set(r["rewards"]) == {"length", "reward_server"}
        assert 0.0 <= r["rewards"]["reward_server"] <= 3.0  # the composite of three [0, 1] scores
        assert r["score"] == pytest.approx(r["rewards"]["reward_server"] + 0.1 * r["rewards"]["length"])


def test_a_dead_server_stops_training_instead_of_scoring_zero(setup, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/predict"
    trainer = GRPOTrainer(config_from_dict(config(setup, tmp_path / "run", dead)))
    with pytest.raises(RewardError, match="reward_server.*127.0.0.1") as exc:
        trainer.train()
    assert isinstance(exc.value.__cause__, RewardServerError)
    # no checkpoint was saved (the directory itself is made, and probed for writing, before the model loads)
    assert not any((tmp_path / "run" / "checkpoints").iterdir())


def test_empty_references_are_not_sent_and_training_goes_on(setup, live_server, tmp_path):
    # Two of the four studies lose their reference report; the server would answer 400 to them.
    data = tmp_path / "data.jsonl"
    records = [json.loads(x) for x in setup["data"].read_text().splitlines()]
    for r in records[::2]:
        r["answer"] = "" if r is records[0] else "  \n"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "images").symlink_to(setup["data"].parent / "images")
    cfg = config(setup, tmp_path / "run", live_server)
    cfg["data"].update(train_files=[str(data)], rollout_batch_size=4)
    cfg["worker"]["actor"]["global_batch_size"] = 4
    trainer = GRPOTrainer(config_from_dict(cfg))
    trainer.train()
    rollouts = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 8
    empty = [r for r in rollouts if not r["reference"].strip()]
    assert len(empty) == 4 and all(r["rewards"]["reward_server"] is None for r in empty)
    assert all(r["rewards"]["reward_server"] is not None for r in rollouts if r["reference"].strip())
    client = next(c.fn for c in trainer.rewards.components if c.key == "reward_server")
    assert client.skipped_empty_references == 4


def test_rows_no_reward_applies_to_are_left_out_and_counted(setup, live_server, tmp_path):
    """With the server as the only reward, an empty reference leaves its rows with no score at all."""
    data = tmp_path / "data.jsonl"
    records = [json.loads(x) for x in setup["data"].read_text().splitlines()]
    records[0]["answer"] = ""
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "images").symlink_to(setup["data"].parent / "images")
    cfg = config(setup, tmp_path / "run", live_server)
    cfg["worker"]["reward"]["functions"] = []
    cfg["data"].update(train_files=[str(data)], rollout_batch_size=4, shuffle=False)
    cfg["worker"]["actor"]["global_batch_size"] = 4
    trainer = GRPOTrainer(config_from_dict(cfg))
    trainer.train()
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["reward/unscored_rows"] == 2  # the n=2 responses to the study without a reference
    assert metrics["rewards/reward_server/applicable_frac"] == pytest.approx(6 / 8)
    batch = trainer.last_step.batch
    unscored = [i for i, r in enumerate(batch.reward_components["reward_server"]) if r is None]
    assert len(unscored) == 2 and not batch.loss_mask[unscored].any()  # not trained on
    assert batch.loss_mask[[i for i in range(len(batch)) if i not in unscored]].any()
