"""Hangs end with a name: reward timeouts, a verifier taken as down, and the keys that set them.

(The frozen process of a two-process job: tests/core/test_hangs_distributed.py.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

import pytest

from grouprl.config import ConfigError, VerifierConfig, config_from_dict
from grouprl.rewards import ImageRewardSet, RewardError, RewardLoadError, RewardSet

RELEASE = threading.Event()  # set at the end of the module: the abandoned reward threads then return
# How long a "hung" reward really waits: far beyond any timeout here, and bounded, so that with the
# timeout broken a test fails (the reward returns a score, no error) instead of hanging the suite.
HANG_S = 60


@pytest.fixture(scope="module", autouse=True)
def release_abandoned_threads():
    yield
    RELEASE.set()


def blocked(prompts, completions, **kwargs):
    RELEASE.wait(HANG_S)  # not set while a test waits: a reward that hangs
    return [1.0] * len(completions)


async def async_blocked(prompts, completions, **kwargs):
    await asyncio.sleep(HANG_S)
    return [1.0] * len(completions)


def fine(prompts, completions, **kwargs):
    return [0.5] * len(completions)


def own_timeout(prompts, completions, **kwargs):
    raise TimeoutError("the judge's own deadline")


# ---------------------------------------------------------------------------- reward timeouts


@pytest.mark.parametrize("reward", [blocked, async_blocked], ids=["sync", "async"])
def test_a_reward_that_hangs_fails_the_batch_naming_it_the_rows_and_the_limit(reward):
    rewards = RewardSet.from_specs([fine, reward], timeout=0.2)
    with pytest.raises(RewardError) as err:
        rewards.score(["p"] * 3, ["c"] * 3)
    assert err.value.reward == reward.__name__
    message = str(err.value)
    assert f"reward {reward.__name__!r} timed out" in message
    assert "0.2 s" in message and "worker.reward.timeout" in message and "3 row(s)" in message


@pytest.mark.parametrize("reward", [blocked, async_blocked], ids=["sync", "async"])
def test_on_error_none_leaves_a_timed_out_rewards_rows_unscored(reward, caplog):
    scored, hung = RewardSet.from_specs([fine, reward]).components
    rewards = RewardSet([scored, dataclasses.replace(hung, on_error="none")], timeout=0.2)
    with caplog.at_level(logging.WARNING, logger="grouprl.rewards.scoring"):
        result = rewards.score(["p"] * 2, ["c"] * 2)
    assert result.components[reward.__name__] == [None, None]
    assert result.total == [0.5, 0.5]
    assert "timed out" in result.errors[reward.__name__]
    assert result.metrics()[f"rewards/{reward.__name__}/failed"] == 1.0


def test_an_image_reward_that_hangs_times_out_beside_the_others():
    from PIL import Image

    def image_blocked(images, prompts, **metadata):
        RELEASE.wait(HANG_S)
        return [1.0] * len(images)

    def image_fine(images, prompts, **metadata):
        return [0.25] * len(images)

    images = [Image.new("RGB", (4, 4)) for _ in range(2)]
    with pytest.raises(RewardError, match=r"image reward 'image_blocked' timed out: no result within 0\.2 s.*"
                                          r"2 row\(s\)"):
        ImageRewardSet.from_specs([image_fine, image_blocked], timeout=0.2).score(images, ["a", "b"])


def test_without_a_timeout_or_when_in_time_nothing_changes():
    assert RewardSet.from_specs([fine], timeout=5).score(["p"], ["c"]).total == [0.5]
    # a reward's own TimeoutError is its error, not the set's timeout
    with pytest.raises(RewardError, match="raised TimeoutError: the judge's own deadline"):
        RewardSet.from_specs([own_timeout], timeout=5).score(["p"], ["c"])


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "10", True])
def test_a_reward_timeout_must_be_positive_seconds(bad):
    with pytest.raises(RewardLoadError, match="timeout"):
        RewardSet.from_specs([fine], timeout=bad)


REWARD_FILE = '''
import threading

RELEASE = threading.Event()


def stuck_judge(prompts, completions, **kwargs):
    RELEASE.wait(60)
    return [1.0] * len(completions)
'''


def test_a_training_step_with_a_hung_reward_fails_with_its_name(say_task, tmp_path):
    from grouprl.trainer.grpo import GRPOTrainer

    path = tmp_path / "judge.py"
    path.write_text(REWARD_FILE)
    task = say_task(4)
    config = config_from_dict(task.config(tmp_path / "run", [{"name": f"{path}:stuck_judge"}], **{
        "data.rollout_batch_size": 2, "worker.rollout.n": 2, "worker.actor.global_batch_size": 2,
        "trainer.max_steps": 1, "worker.reward.timeout": 0.5}))
    trainer = GRPOTrainer(config)
    try:
        with pytest.raises(RewardError, match=r"stuck_judge' timed out: no result within 0\.5 s") as err:
            trainer.train()
        assert err.value.reward.endswith(":stuck_judge")
    finally:
        trainer.rewards.components[0].fn.__globals__["RELEASE"].set()


# ---------------------------------------------------------------------------- config keys


def test_the_new_keys_are_validated(say_task, tmp_path):
    task = say_task(4)
    base = task.config(tmp_path / "run", [{"name": "accuracy"}], **{"worker.actor.global_batch_size": 4})
    assert config_from_dict(base).worker.reward.timeout is None
    assert config_from_dict(base).trainer.distributed_timeout == 600
    assert config_from_dict({**base, "worker": {**base["worker"], "reward": {
        **base["worker"]["reward"], "timeout": 30}}}).worker.reward.timeout == 30
    with pytest.raises(ConfigError, match=r"worker\.reward\.timeout"):
        config_from_dict({**base, "worker": {**base["worker"], "reward": {**base["worker"]["reward"],
                                                                           "timeout": 0}}})
    assert VerifierConfig().max_consecutive_failures == 3
    with pytest.raises(ConfigError, match=r"worker\.rollout\.verifier\.max_consecutive_failures' must be >= 1"):
        VerifierConfig(max_consecutive_failures=0).check()


@pytest.mark.parametrize("bad", [0, -5])
def test_distributed_timeout_is_checked_where_the_accelerator_is_made(bad):
    from grouprl.config.schema import TrainerConfig
    from grouprl.trainer.parallel import make_accelerator

    with pytest.raises(ConfigError, match=r"trainer\.distributed_timeout' must be seconds > 0"):
        make_accelerator(TrainerConfig(device="cpu", distributed_timeout=bad))


def test_stages_nest_and_name_the_step():
    from grouprl.trainer.parallel import current_stage, mark, stage, staged

    @staged("save")
    def save():
        return current_stage()

    with stage("train", step=3):
        mark("update")
        assert current_stage() == "train > update"
        with stage("metrics"):
            mark("gather")
            assert current_stage() == "train > update > metrics > gather"
        assert save() == "train > update > save"
    assert current_stage() == ""


# ---------------------------------------------------------------------------- a verifier that is down


def test_a_dead_verifier_ends_the_dialogues_after_max_consecutive_failures(paths, serve_app, caplog):
    pytest.importorskip("fastapi")
    from grouprl.models.inputs import end_of_turn_id, tokenizer_of
    from grouprl.models.loading import load_model_and_processor
    from grouprl.rollout.engine import SamplingParams
    from grouprl.rollout.hf_engine import HFGenerationEngine
    from grouprl.rollout.multiturn import MultiTurnRollout
    from grouprl.rollout.verifier import build_verifier

    from test_engine import text_samples, with_eos_bias
    from test_verifier_http import FakeLLM, create_app

    model, processor, _ = load_model_and_processor(paths["lm"])
    # every turn ends at once with its end-of-turn token: none is cut off, each one goes to the verifier
    with_eos_bias(model, tokenizer_of(processor).convert_tokens_to_ids("<|im_end|>"), probability=0.999)
    engine = HFGenerationEngine(model.eval(), processor)
    llm = FakeLLM()
    llm.status = 500  # every call fails
    with serve_app(create_app(llm), timeout_graceful_shutdown=1) as port:
        url = f"http://127.0.0.1:{port}/v1"
        config = VerifierConfig(enable=True, backend="http", base_url=url, model="teacher", timeout=5.0,
                                max_retries=0, max_turns=10, max_consecutive_failures=2)
        verifier = build_verifier(config)
        try:
            multi = MultiTurnRollout(verifier, processor, config, end_of_turn_ids=[end_of_turn_id(processor)])
            with caplog.at_level(logging.WARNING, logger="grouprl.rollout.multiturn"):
                batch = multi.generate(engine, text_samples()[:1], SamplingParams(n=1, max_new_tokens=8, seed=0))
        finally:
            verifier.close()
    # one dialogue: turn 1 failed (asked to continue), turn 2 failed: the verifier is down, the dialogue ends
    assert batch.extras["num_turns"] == [2]
    assert batch.extras["stop_reason"] == ["verifier_failure"]
    assert verifier.failures == 2 and len(llm.seen) == 2
    assert multi.last_metrics["verifier/failures"] == 2.0 and multi.last_metrics["environment/down"] == 1.0
    down = [r.getMessage() for r in caplog.records if "max_consecutive_failures" in r.getMessage()]
    assert len(down) == 1 and url in down[0]


def test_on_failure_fail_still_raises_at_the_first_failure(paths, serve_app):
    pytest.importorskip("fastapi")
    from grouprl.rollout.verifier import VerifierError, VerifierRequest, build_verifier

    from test_verifier_http import FakeLLM, create_app

    llm = FakeLLM()
    llm.status = 500
    with serve_app(create_app(llm), timeout_graceful_shutdown=1) as port:
        verifier = build_verifier(VerifierConfig(enable=True, backend="http", base_url=f"http://127.0.0.1:{port}/v1",
                                                 model="teacher", max_retries=0, on_failure="fail",
                                                 max_consecutive_failures=5))
        try:
            with pytest.raises(VerifierError):
                verifier.reply_many([VerifierRequest("1 + 1?", "2", ["3"])])
        finally:
            verifier.close()
    assert verifier.failures == 1


def test_only_a_transport_error_becomes_a_collective_failure(monkeypatch):
    """As if on two processes: gloo's timeout is explained with the stage; grouprl's own errors pass as they are."""
    from grouprl.trainer import parallel

    monkeypatch.setattr(parallel, "_group", lambda: (0, 2))
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                        "Timed out waiting 10000ms for recv operation to complete")
    with pytest.raises(parallel.CollectiveFailure) as err:
        with parallel.stage("train", step=4):
            parallel.mark("update")
            raise gloo
    assert err.value.rank == 0 and err.value.stage == "step 4, train > update"
    node = parallel.node_label(parallel.this_process(0))  # e.g. "host vm", or "node 0 of 1, host vm" under torchrun
    assert str(err.value).startswith(f"rank 0 of 2 ({node}): a collective failed at step 4, train > update")
    assert "Timed out waiting 10000ms" in str(err.value) and err.value.__cause__ is gloo
    with pytest.raises(RewardError, match="timed out"):
        with parallel.stage("train", step=4):
            raise RewardError("reward 'judge' timed out: no result within 1 s (worker.reward.timeout)")
