"""Health alarms (grouprl.trainer.health): each alarm fires on a history that shows its failure and stays
quiet on a healthy one; in a run, alarms are logged as health/<alarm>, appended to alarms.jsonl once,
and survive resume."""

from __future__ import annotations

import json
import logging
import math
import random

import pytest

from grouprl.config import ConfigError, HealthConfig, config_from_dict
from grouprl.trainer import health
from grouprl.trainer.health import ALARMS, HealthWatch, trend


# ---------------------------------------------------------------------------- synthetic histories


def healthy_rows(steps: int = 120, seed: int = 0) -> list[dict]:
    """A working GRPO run's reduced step metrics: the reward rising slowly, everything else steady or
    drifting as it does in practice, with step-to-step noise."""
    rng = random.Random(seed)
    rows = []
    for s in range(1, steps + 1):
        rows.append({
            "reward/mean": 0.4 + 0.002 * s + rng.gauss(0, 0.05),
            "response_length/mean": 60 + 0.05 * s + rng.gauss(0, 4),
            "response/truncation_rate": max(0.0, 0.03 + rng.gauss(0, 0.02)),
            "actor/entropy": 1.0 - 0.002 * s + rng.gauss(0, 0.03),
            "frac_reward_zero_std": min(1.0, max(0.0, 0.35 + rng.gauss(0, 0.1))),
            "actor/ratio_mean": 1.0 + rng.gauss(0, 0.005),
            "actor/clipfrac": abs(0.04 + rng.gauss(0, 0.02)),
            "actor/kl": 0.0 if s == 1 else 0.001 + 0.0002 * s * (1 + rng.gauss(0, 0.1)),
            "actor/grad_norm": abs(0.5 + rng.gauss(0, 0.1)),
            "actor/pg_loss": rng.gauss(0, 0.02),
            "actor/kl_loss": 0.001,
            "actor/nonfinite_grad_steps": 0.0,
        })
    return rows


def healthy_validations(steps: int = 120, every: int = 10, seed: int = 1) -> dict[int, dict]:
    """Validations every ``every`` steps (from step 0): the held-out metric improving with the reward."""
    rng = random.Random(seed)
    return {s: {"val/report/finding_f1_micro": 0.3 + 0.001 * s + rng.gauss(0, 0.01),
                "val/report/finding_f1_micro_se": 0.02, "val/reward/mean@1": 0.4 + 0.002 * s}
            for s in range(0, steps + 1, every)}


def run_watch(tmp_path, rows, validations=None, **config):
    """Feed ``rows`` (and ``validations``, {step: values}) to a HealthWatch as the run loop does;
    returns ({step: health metrics, the validation's changes merged}, alarms.jsonl's records)."""
    watch = HealthWatch(HealthConfig(**config), tmp_path, main=True)
    watch.open(-1)
    logged = {}
    validations = validations or {}
    if 0 in validations:
        watch.after_validation(0, validations[0])
    for step, values in enumerate(rows, start=1):
        logged[step] = watch.after_step(step, values)
        if step in validations:
            logged[step].update(watch.after_validation(step, validations[step]))
    path = tmp_path / "alarms.jsonl"
    alarms = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return logged, alarms


def fired(logged: dict, alarm: str) -> list[int]:
    return [s for s, values in logged.items() if values[f"health/{alarm}"] == 1.0]


WATCH = {"val/report/finding_f1_micro": "max"}


# ---------------------------------------------------------------------------- the statistic


def test_trend_by_hand():
    # y = 2x + 1 exactly: the change over x 0..3 is 6, with no spread
    t = trend([0, 1, 2, 3], [1, 3, 5, 7])
    assert t.change == pytest.approx(6) and t.se == 0 and t.z == math.inf
    # two points with their standard errors: change / sqrt(se1^2 + se2^2)
    t = trend([0, 10], [0.5, 0.3], [0.03, 0.04])
    assert t.change == pytest.approx(-0.2) and t.se == pytest.approx(0.05) and t.z == pytest.approx(-4)
    # residuals: y = 0, 1, 0, 1 about its line; s^2 = sum r^2 / (m - 2), Var(b) = s^2 / S
    t = trend([0, 1, 2, 3], [0, 1, 0, 1])
    b, s2 = 0.2, (0.2 ** 2 + 0.6 ** 2 + 0.6 ** 2 + 0.2 ** 2) / 2  # residuals about 0.2, 0.4, 0.6, 0.8
    assert t.change == pytest.approx(3 * b) and t.se == pytest.approx(3 * math.sqrt(s2 / 5))
    assert trend([0, 1], [0, 1]) is None  # two points and no standard errors: no noise to judge by


# ---------------------------------------------------------------------------- each alarm: quiet, then firing


def test_a_healthy_run_raises_no_alarm(tmp_path):
    logged, alarms = run_watch(tmp_path, healthy_rows(), healthy_validations(), watch=WATCH)
    assert alarms == []
    assert all(set(v) == {f"health/{a}" for a in ALARMS} and not any(v.values()) for v in logged.values())


def _gaming(rows, validations):
    for s, v in validations.items():  # the held-out metric falls beyond its standard errors
        v["val/report/finding_f1_micro"] = 0.3 - 0.0015 * s
    return rows, validations


def _length(rows, validations):
    for i, r in enumerate(rows[60:]):  # +5% a step: doubled in 15 steps
        r["response_length/mean"] = 60 * 1.05 ** i
    return rows, validations


def _truncation(rows, validations):
    for r in rows[50:]:
        r["response/truncation_rate"] = 0.4
    return rows, validations


def _entropy(rows, validations):
    for r in rows[40:]:
        r["actor/entropy"] = 0.05
    return rows, validations


def _no_spread(rows, validations):
    for r in rows[30:]:
        r["frac_reward_zero_std"] = 1.0
    return rows, validations


def _ratio(rows, validations):
    rows[70]["actor/ratio_mean"] = 3.5
    return rows, validations


def _clipfrac(rows, validations):
    rows[70]["actor/clipfrac"] = 0.8
    return rows, validations


def _kl(rows, validations):
    rows[70]["actor/kl"] = 2.0
    return rows, validations


def _grad(rows, validations):
    rows[70]["actor/grad_norm"] = 40.0
    return rows, validations


def _nan_loss(rows, validations):
    rows[70]["actor/pg_loss"] = math.nan
    return rows, validations


def _skipped(rows, validations):
    rows[70]["actor/nonfinite_grad_steps"] = 1.0
    return rows, validations


@pytest.mark.parametrize("alarm, breaks, first", [
    ("reward_gaming", _gaming, None),
    ("length_growth", _length, 78),  # steps 74-78 average 2x steps 59-63
    ("truncation", _truncation, 53),  # steps 49-53: three of five at 0.4 average above 0.2
    ("entropy_collapse", _entropy, 45),
    ("no_reward_spread", _no_spread, 35),
    ("ratio_blowup", _ratio, 71),
    ("ratio_blowup", _clipfrac, 71),
    ("kl_blowup", _kl, 71),
    ("grad_norm_blowup", _grad, 71),
    ("nan", _nan_loss, 71),
    ("nan", _skipped, 71),
])
def test_each_alarm_fires_once_on_its_failure(tmp_path, caplog, alarm, breaks, first):
    rows, validations = breaks(healthy_rows(), healthy_validations())
    with caplog.at_level(logging.WARNING, logger="grouprl.trainer.health"):
        logged, alarms = run_watch(tmp_path, rows, validations, watch=WATCH)
    assert [a["alarm"] for a in alarms] == [alarm]  # this alarm, once, and no other
    steps = fired(logged, alarm)
    assert steps and steps[0] == alarms[0]["step"]
    if first is not None:
        assert alarms[0]["step"] == first
    warnings = [r.getMessage() for r in caplog.records if "health alarm" in r.getMessage()]
    assert len(warnings) == 1 and f"health alarm {alarm} at step {alarms[0]['step']}" in warnings[0]
    assert alarms[0]["message"] in warnings[0] and "\n" not in warnings[0]


def test_gaming_needs_the_reward_to_rise_beyond_its_noise(tmp_path):
    rows, validations = _gaming(healthy_rows(), healthy_validations())
    rng = random.Random(5)
    for r in rows:  # a flat reward: the held-out fall alone is no gaming
        r["reward/mean"] = 0.5 + rng.gauss(0, 0.05)
    logged, alarms = run_watch(tmp_path, rows, validations, watch=WATCH)
    assert alarms == [] and not fired(logged, "reward_gaming")


def test_gaming_evidence_and_its_count_from_the_validation_on(tmp_path):
    rows, validations = _gaming(healthy_rows(), healthy_validations())
    logged, alarms = run_watch(tmp_path, rows, validations, watch=WATCH, gaming_window=40)
    (alarm,) = alarms
    assert alarm["step"] in validations  # judged at a validation, counted from its step on
    assert fired(logged, "reward_gaming")[0] == alarm["step"]
    assert alarm["metric"] == "val/report/finding_f1_micro" and alarm["metric_z"] <= -2 and alarm["reward_z"] >= 2
    assert set(alarm["metric_steps"]) <= set(range(alarm["step"] - 40, alarm["step"] + 1))


def test_gaming_on_a_min_metric_and_on_a_held_out_reward(tmp_path):
    rows, validations = healthy_rows(), healthy_validations()
    for s, v in validations.items():  # lower is better, and it rises: worse
        v["val/loss"] = 1.0 + 0.01 * s + random.Random(s).gauss(0, 0.02)
    logged, alarms = run_watch(tmp_path, rows, validations, watch={"val/loss": "min"},
                               reward_key="val/reward/mean@1")
    assert [a["alarm"] for a in alarms] == ["reward_gaming"] and alarms[0]["reward_key"] == "val/reward/mean@1"
    logged, alarms = run_watch(tmp_path / "quiet", rows, healthy_validations(), watch={"val/loss": "min"})
    assert alarms == []  # not logged: nothing to judge (and said once, see below)


def test_a_watched_metric_validation_never_logs_is_said_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="grouprl.trainer.health"):
        run_watch(tmp_path, healthy_rows(30), healthy_validations(30), watch={"val/report/finding_f1_mcro": "max"})
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "trainer.health.watch" in said[0] and "val/report/finding_f1_micro" in said[0]


def test_gaming_with_two_validations_judges_by_their_standard_errors(tmp_path):
    """The report demo's shape: a validation before training and one at the end, nothing between."""
    rows = healthy_rows(12)
    for s, r in enumerate(rows, start=1):
        r["reward/mean"] = 1.09 + 0.006 * s + random.Random(s).gauss(0, 0.01)
    validations = {0: {"val/report/finding_f1_micro": 0.175, "val/report/finding_f1_micro_se": 0.03},
                   12: {"val/report/finding_f1_micro": 0.041, "val/report/finding_f1_micro_se": 0.02}}
    logged, alarms = run_watch(tmp_path, rows, validations, watch=WATCH, gaming_window=12)
    assert [(a["alarm"], a["step"], a["metric_steps"]) for a in alarms] == [("reward_gaming", 12, [0, 12])]
    assert alarms[0]["metric_z"] == pytest.approx(-0.134 / math.sqrt(0.03 ** 2 + 0.02 ** 2))
    for v in validations.values():  # within its noise: quiet
        v["val/report/finding_f1_micro_se"] = 0.08
    assert run_watch(tmp_path / "noisy", rows, validations, watch=WATCH, gaming_window=12)[1] == []
    for v in validations.values():  # no standard errors, two points: no noise to judge by, quiet
        del v["val/report/finding_f1_micro_se"]
    assert run_watch(tmp_path / "bare", rows, validations, watch=WATCH, gaming_window=12)[1] == []


def test_blowups_need_their_floor(tmp_path):
    rows = healthy_rows(30)
    for s, r in enumerate(rows, start=1):  # KL from tiny values: a 20x jump, but below kl_floor
        r["actor/kl"] = 1e-5 * (20 if s == 20 else 1)
    logged, alarms = run_watch(tmp_path, rows)
    assert alarms == []
    logged, alarms = run_watch(tmp_path / "low", rows, kl_floor=1e-5)
    assert [(a["alarm"], a["step"]) for a in alarms] == [("kl_blowup", 20)]


def test_entropy_collapse_is_measured_from_the_runs_start(tmp_path):
    rows = healthy_rows(120)
    for s, r in enumerate(rows, start=1):  # -3% a step: never sudden, below a tenth of the start by step ~78
        r["actor/entropy"] = 0.97 ** s
    logged, alarms = run_watch(tmp_path, rows)
    assert [a["alarm"] for a in alarms] == ["entropy_collapse"] and 70 < alarms[0]["step"] < 85


def test_flow_run_keys_judge_ratio_and_no_spread(tmp_path):
    """The flow trainer logs actor/ratio/mean and no response lengths: its alarms read what it logs."""
    rows = [{"reward/mean": 0.5, "frac_reward_zero_std": 0.2, "actor/ratio/mean": 1.0, "actor/clipfrac": 0.1,
             "actor/grad_norm": 1.0, "actor/pg_loss": 0.0} for _ in range(20)]
    logged, alarms = run_watch(tmp_path, rows)
    assert alarms == []
    rows[10]["actor/ratio/mean"] = 0.2
    for r in rows[12:]:
        r["frac_reward_zero_std"] = 1.0
    logged, alarms = run_watch(tmp_path / "bad", rows)
    assert [(a["alarm"], a["step"]) for a in alarms] == [("ratio_blowup", 11), ("no_reward_spread", 17)]


def test_disabled_judges_nothing(tmp_path):
    rows, validations = _nan_loss(*_no_spread(healthy_rows(), healthy_validations()))
    logged, alarms = run_watch(tmp_path, rows, validations, enabled=False)
    assert alarms == [] and all(v == {} for v in logged.values())


def test_state_carries_fired_alarms_and_history(tmp_path):
    rows = _no_spread(healthy_rows(), {})[0]
    first = HealthWatch(HealthConfig(), tmp_path, main=True)
    for step, values in enumerate(rows[:40], start=1):
        first.after_step(step, values)
    assert first.fired == {"no_reward_spread": 35}
    state = json.loads(json.dumps(first.state()))  # through a checkpoint's JSON
    second = HealthWatch(HealthConfig(), tmp_path, main=True)
    second.load(state)
    assert second.after_step(41, rows[40])["health/no_reward_spread"] == 1.0
    assert len((tmp_path / "alarms.jsonl").read_text().splitlines()) == 1  # not fired again
    # cut back at resume to the checkpoint's step, as metrics.jsonl
    second.open(30)
    assert (tmp_path / "alarms.jsonl").read_text() == ""


@pytest.mark.parametrize("key, value", [
    ("watch", {"val/x": "up"}), ("window", 1), ("recent", 0), ("noise_z", 0.0), ("length_growth", 1.0),
    ("max_truncation", 1.5), ("entropy_collapse", 0.0), ("max_zero_std", float("inf")), ("ratio_max", 0.5),
    ("kl_floor", -1.0), ("reward_key", ""),
])
def test_bad_values_name_their_key(say_task, tmp_path, key, value):
    cfg = say_task(2).config(tmp_path, [{"name": "accuracy"}], **{f"trainer.health.{key}": value})
    with pytest.raises(ConfigError, match=rf"'trainer\.health\.{key}'"):
        config_from_dict(cfg)


# ---------------------------------------------------------------------------- in a run

NOISY = '''
import random


def noisy(prompts, completions, **kwargs):
    return [random.random() for _ in completions]
'''


def _run_config(task, out, reward, **overrides) -> dict:
    # a tiny untrained model writes until data.max_response_length cuts it: truncation is its normal
    return task.config(out, [reward], **{
        "trainer.health.max_truncation": 1.0, "worker.actor.global_batch_size": 4, "worker.actor.micro_batch_size_per_device_for_update": 16,
        "worker.actor.micro_batch_size_per_device_for_experience": 16, "trainer.seed": 3, **overrides})


def test_a_run_without_reward_spread_fires_and_keeps_it_over_resume(say_task, tmp_path, read_jsonl,
                                                                    interrupt_at_step):
    """accuracy on a tiny untrained model: every response scores 0, no group has spread."""
    from grouprl.trainer.grpo import GRPOTrainer

    task = say_task(2)
    cfg = _run_config(task, tmp_path / "run", {"name": "accuracy"}, **{
        "trainer.max_steps": 4, "trainer.save_freq": 2, "trainer.health.recent": 1})
    interrupt_at_step(GRPOTrainer(config_from_dict(cfg)), 4)  # steps 1-3 logged, checkpoint at 2
    run = tmp_path / "run"
    assert [(a["step"], a["alarm"]) for a in read_jsonl(run / "alarms.jsonl")] == [(1, "no_reward_spread")]
    cfg["trainer"]["resume"] = "auto"
    GRPOTrainer(config_from_dict(cfg)).train()
    alarms = read_jsonl(run / "alarms.jsonl")
    assert [(a["step"], a["alarm"]) for a in alarms] == [(1, "no_reward_spread")]  # fired once, before the checkpoint
    assert alarms[0]["value"] == 1.0 and alarms[0]["threshold"] == 0.9
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["health/no_reward_spread"] == 1.0 and r["health/nan"] == 0.0 for r in rows)
    schema = json.loads((run / "metrics_schema.json").read_text())
    assert schema["health/no_reward_spread"] == "max"


def test_an_alarm_after_the_checkpoint_is_cut_back_and_fires_again_once(say_task, tmp_path, read_jsonl,
                                                                         interrupt_at_step):
    from grouprl.trainer.grpo import GRPOTrainer

    cfg = _run_config(say_task(2), tmp_path / "run", {"name": "accuracy"}, **{
        "trainer.max_steps": 4, "trainer.save_freq": 2, "trainer.health.recent": 3})
    interrupt_at_step(GRPOTrainer(config_from_dict(cfg)), 4)  # fired at step 3, after the checkpoint at 2
    assert [a["step"] for a in read_jsonl(tmp_path / "run" / "alarms.jsonl")] == [3]
    cfg["trainer"]["resume"] = "auto"
    GRPOTrainer(config_from_dict(cfg)).train()
    assert [a["step"] for a in read_jsonl(tmp_path / "run" / "alarms.jsonl")] == [3]


GAMED = '''
import random


def rising(prompts, completions, trainer_state=None, **kwargs):
    return [trainer_state.global_step + 0.1 * random.random() for _ in completions]


def falling(prompts, completions, trainer_state=None, **kwargs):
    return [1.0 - 0.2 * trainer_state.global_step for _ in completions]
'''


def test_a_gamed_run_fires_at_its_validation(say_task, tmp_path, read_jsonl):
    """The reward rises every step while a held-out measure (a second reward, as validation logs it)
    falls at every validation: reward_gaming fires at the validation that shows both, and counts from it."""
    from grouprl.trainer.grpo import GRPOTrainer

    rewards = tmp_path / "gamed.py"
    rewards.write_text(GAMED)
    task = say_task(2)
    cfg = task.config(tmp_path / "run", [{"name": f"{rewards}:rising"}, {"name": f"{rewards}:falling", "weight": 0.01}], **{
        "data.val_files": [str(task.data)], "trainer.max_steps": 4, "trainer.val_freq": 2,
        "trainer.val_before_train": True, "trainer.health.max_truncation": 1.0,
        "trainer.health.watch": {f"val/rewards/{rewards}:falling/mean@1": "max"},
        "worker.actor.global_batch_size": 4, "worker.actor.micro_batch_size_per_device_for_update": 16})
    GRPOTrainer(config_from_dict(cfg)).train()
    run = tmp_path / "run"
    (alarm,) = read_jsonl(run / "alarms.jsonl")
    # at step 2 the reward has two steps, too few for a spread; at step 4, four rising ones
    assert (alarm["step"], alarm["alarm"], alarm["metric_steps"]) == (4, "reward_gaming", [0, 2, 4])
    assert alarm["metric_values"] == pytest.approx([1.0, 0.6, 0.2])
    rows = read_jsonl(run / "metrics.jsonl")
    gaming = [(r["step"], r["health/reward_gaming"]) for r in rows if "health/reward_gaming" in r]
    assert gaming == [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0), (4, 1.0)]  # the validation's row comes last


def test_a_healthy_run_stays_quiet(say_task, tmp_path, read_jsonl):
    from grouprl.trainer.grpo import GRPOTrainer

    reward = tmp_path / "noisy.py"
    reward.write_text(NOISY)
    cfg = _run_config(say_task(2), tmp_path / "run", {"name": f"{reward}:noisy"}, **{
        "trainer.max_steps": 3, "trainer.health.recent": 1, "trainer.health.window": 2})
    GRPOTrainer(config_from_dict(cfg)).train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 3 and all(r[f"health/{a}"] == 0.0 for r in rows for a in ALARMS)
    assert not (tmp_path / "run" / "alarms.jsonl").exists()


def test_a_run_with_health_disabled_logs_no_health_metric(say_task, tmp_path, read_jsonl):
    from grouprl.trainer.grpo import GRPOTrainer

    cfg = _run_config(say_task(2), tmp_path / "run", {"name": "accuracy"}, **{
        "trainer.max_steps": 1, "trainer.health.enabled": False, "trainer.health.recent": 1})
    GRPOTrainer(config_from_dict(cfg)).train()
    (row,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert not any(k.startswith("health/") for k in row)
    assert not (tmp_path / "run" / "alarms.jsonl").exists()
