"""The flow trainer's image rewards under worker.reward.timeout: a hung one ends the step with its name."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from grouprl.config import ConfigError  # noqa: E402
from grouprl.domains.diffusion.trainer import FlowGRPOTrainer  # noqa: E402
from grouprl.rewards import RewardError  # noqa: E402

STUCK = '''
import threading

RELEASE = threading.Event()


def stuck_scorer(images, prompts, **metadata):
    RELEASE.wait(60)  # bounded: with the timeout broken the test fails instead of hanging
    return [1.0] * len(images)
'''


def test_a_hung_image_reward_fails_the_flow_step_with_its_name(flow_config, tmp_path):
    path = tmp_path / "scorer.py"
    path.write_text(STUCK)
    config = flow_config(tmp_path / "run", **{"worker.reward.functions": [{"name": f"{path}:stuck_scorer"}],
                                              "worker.reward.timeout": 0.5, "trainer.max_steps": 1})
    trainer = FlowGRPOTrainer(config)
    assert trainer.rewards.timeout == trainer.val_rewards.timeout == 0.5
    try:
        with pytest.raises(RewardError, match=r"image reward '.*stuck_scorer' timed out: no result within 0\.5 s"):
            trainer.train()
    finally:
        trainer.rewards.components[0].fn.__globals__["RELEASE"].set()


def test_the_flow_reward_timeout_is_checked(flow_config, tmp_path):
    with pytest.raises(ConfigError, match=r"worker\.reward\.timeout' must be > 0"):
        flow_config(tmp_path / "run", **{"worker.reward.timeout": 0})
