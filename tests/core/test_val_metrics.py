"""Validation over k samples per prompt: mean@k, best@k, worst@k, pass@k and their standard errors
(grouprl.trainer.val_metrics), checked by hand, against verl's definitions, and in a tiny GRPO run."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import numpy as np
import pytest

from grouprl.config import config_from_dict
from grouprl.trainer.grpo import reward_thresholds
from grouprl.trainer.metrics import StepMetrics
from grouprl.trainer.val_metrics import (
    bootstrap_best_worst,
    bootstrap_se,
    expected_best,
    group_rows,
    per_prompt_values,
    prompt_metrics,
    record_val_metrics,
)


# ---------------------------------------------------------------------------- verl, transcribed
# verl/trainer/ppo/metric_utils.py (bootstrap_metric, process_validation_metrics), written out
# here from its formulas (not imported), with its per-call reseeding of numpy's global generator.

def verl_bootstrap_metric(data, subset_size, reduce_fns, n_bootstrap=1000, seed=42):
    np.random.seed(seed)
    data_np = np.array(data, dtype=object)
    idxs = np.random.choice(len(data_np), size=(n_bootstrap, subset_size), replace=True)
    results = np.empty((len(reduce_fns), n_bootstrap))
    for f, fn in enumerate(reduce_fns):
        for b in range(n_bootstrap):
            results[f, b] = fn(data_np[idxs[b]])
    return [(float(np.mean(r)), float(np.std(r))) for r in results]


def verl_process_validation_metrics(data_sources, uids, infos, seed=42):
    grouped = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, source in enumerate(data_sources):
        for var, vals in infos.items():
            grouped[source][uids[i]][var].append(vals[i])

    def gen_ns(n_resps):
        ns, n = [], 2
        while n < n_resps:
            ns.append(n)
            n *= 2
        return ns + [n_resps]

    per_uid = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for source, by_uid in grouped.items():
        for uid, by_var in by_uid.items():
            for var, vals in by_var.items():
                metric = {f"mean@{len(vals)}": float(np.mean(vals))}
                if len(vals) > 1:
                    metric[f"std@{len(vals)}"] = float(np.std(vals))
                    for n in gen_ns(len(vals)):
                        (bm, bs), (wm, ws) = verl_bootstrap_metric(vals, n, [np.max, np.min], seed=seed)
                        metric.update({f"best@{n}/mean": bm, f"best@{n}/std": bs,
                                       f"worst@{n}/mean": wm, f"worst@{n}/std": ws})
                for name, value in metric.items():
                    per_uid[source][var][name].append(value)
    return {s: {v: {m: float(np.mean(x)) for m, x in ms.items()} for v, ms in vs.items()} for s, vs in per_uid.items()}


# ---------------------------------------------------------------------------- by hand


def test_prompt_metrics_by_hand():
    m = prompt_metrics([0.0, 1.0, 1.0], 3, threshold=1.0)
    assert m["mean@3"] == pytest.approx(2 / 3)
    assert m["pass@3"] == 1.0
    # best of 3 draws with replacement from {0, 1, 1}: 1 - (1/3)^3; worst: (2/3)^3
    assert m["best@3"] == pytest.approx(26 / 27, abs=0.02) and m["worst@3"] == pytest.approx(8 / 27, abs=0.03)
    assert prompt_metrics([0.0, 0.0, 0.0], 3, threshold=1.0) == {"mean@3": 0.0, "best@3": 0.0, "worst@3": 0.0,
                                                                  "pass@3": 0.0}
    # one response: verl reports no best/worst; pass@1 is the accuracy
    assert prompt_metrics([1.0], 1, threshold=1.0) == {"mean@1": 1.0, "pass@1": 1.0}
    assert "pass@2" not in prompt_metrics([0.3, 0.9], 2)  # no threshold, no pass@k (the weighted total)


def test_expected_best_by_hand_and_the_bootstrap_estimates_it():
    # max of 2 draws from {0, .5, 1}: P(0) = 1/9, P(.5) = 4/9 - 1/9, P(1) = 1 - 4/9
    assert expected_best([1.0, 0.0, 0.5], 2) == pytest.approx(0.5 * 3 / 9 + 5 / 9)
    rng = np.random.default_rng(0)
    for _ in range(5):
        x = rng.random(4)
        best = bootstrap_best_worst(x, 4)[0]
        assert best == pytest.approx(expected_best(x, 4), abs=0.03)
        assert best < x.max()  # verl's best@k is not the sample maximum


def test_pass_at_k_with_a_threshold():
    assert prompt_metrics([0.2, 0.6], 2, threshold=0.5)["pass@2"] == 1.0
    assert prompt_metrics([0.2, 0.6], 2, threshold=0.7)["pass@2"] == 0.0
    assert prompt_metrics([0.2, 0.6], 2, threshold=0.6)["pass@2"] == 1.0  # at least the threshold passes
    groups = group_rows([0, 0, 1, 1])
    values = per_prompt_values(groups, {"judge": [0.2, 0.6, 0.1, 0.3]}, 2, {"judge": 0.5})
    assert values["judge"]["pass@2"] == [1.0, 0.0]


def test_thresholds_come_from_the_config_in_reward_order(say_task, tmp_path):
    cfg = config_from_dict(say_task(2).config(tmp_path, [{"name": "accuracy"},
                                                         {"name": "length", "threshold": 0.5}],
                                                        **{"worker.actor.global_batch_size": 4}))
    assert reward_thresholds(cfg, ["accuracy", "length"]) == {"accuracy": 1.0, "length": 0.5}


# ---------------------------------------------------------------------------- against verl


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_matches_verl_on_random_data(k):
    rng = np.random.default_rng(k)
    n_prompts = 7
    sources = ["math" if p % 3 else "code" for p in range(n_prompts)]
    score = rng.random(n_prompts * k).round(3).tolist()
    acc = rng.integers(0, 2, n_prompts * k).astype(float).tolist()
    uids = [f"p{p}" for p in range(n_prompts) for _ in range(k)]
    verl = verl_process_validation_metrics([sources[p] for p in range(n_prompts) for _ in range(k)], uids,
                                           {"score": score, "acc": acc})
    metrics = StepMetrics()
    record_val_metrics(metrics, group_rows(uids), {"acc": acc}, score, k, {"acc": 1.0}, sources, ["code", "math"])
    ours = metrics.local()
    for source in ("code", "math"):
        for var, ours_name in (("score", f"{source}/reward"), ("acc", f"{source}/rewards/acc")):
            expected = verl[source][var]
            assert ours[f"{ours_name}/mean@{k}"] == pytest.approx(expected[f"mean@{k}"], abs=1e-12)
            assert ours[f"{ours_name}/best@{k}"] == pytest.approx(expected[f"best@{k}/mean"], abs=1e-12)
            assert ours[f"{ours_name}/worst@{k}"] == pytest.approx(expected[f"worst@{k}/mean"], abs=1e-12)
    # over every prompt: the prompts' mean (each prompt weighs the same)
    everyone = verl_process_validation_metrics(["all"] * len(uids), uids, {"score": score})["all"]["score"]
    assert ours[f"reward/best@{k}"] == pytest.approx(everyone[f"best@{k}/mean"], abs=1e-12)
    assert ours[f"reward/mean@{k}"] == pytest.approx(np.mean(score), abs=1e-12)
    # pass@k, not in verl: any of the prompt's k 0/1 values is 1
    passed = [float(max(acc[p * k:(p + 1) * k]) >= 1) for p in range(n_prompts)]
    assert ours[f"rewards/acc/pass@{k}"] == pytest.approx(np.mean(passed))
    assert f"reward/pass@{k}" not in ours


# ---------------------------------------------------------------------------- standard errors


def test_bootstrap_se_is_the_limit_of_resampling_prompts():
    rng = np.random.default_rng(1)
    v = rng.random(12)
    draws = rng.choice(v, size=(40_000, len(v)), replace=True).mean(axis=1)
    assert bootstrap_se(v) == pytest.approx(draws.std(), rel=0.03)
    assert bootstrap_se(v) == pytest.approx(v.std() / math.sqrt(len(v)))
    assert bootstrap_se([0.7] * 9) == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(bootstrap_se([]))


def test_bootstrap_is_seeded_and_reproducible():
    x = [0.1, 0.9, 0.4]
    assert bootstrap_best_worst(x, 3) == bootstrap_best_worst(x, 3)
    assert bootstrap_best_worst(x, 3) != bootstrap_best_worst(x, 3, seed=7)
    state = np.random.get_state()[1].copy()
    bootstrap_best_worst(x, 3, seed=123)
    assert np.array_equal(np.random.get_state()[1], state)  # unlike verl, numpy's global generator is left alone
    assert bootstrap_best_worst([0.5] * 4, 4) == (0.5, 0.0, 0.5, 0.0)


def test_standard_errors_reduce_exactly_over_processes():
    """Two processes' prompts, reduced (merged) == one process holding every prompt; _se is bootstrap_se."""
    rng = np.random.default_rng(2)
    k, uids = 3, [p for p in range(10) for _ in range(3)]
    score = rng.random(len(uids)).tolist()
    whole, halves = StepMetrics(), [StepMetrics(), StepMetrics()]
    record_val_metrics(whole, group_rows(uids), {}, score, k, {})
    for h, rows in zip(halves, (slice(0, 12), slice(12, None))):
        record_val_metrics(h, group_rows(uids[rows]), {}, score[rows], k, {})
    merged = halves[0].merge(halves[1]).local()
    one = whole.local()
    assert merged.keys() == one.keys()
    for key in one:
        assert merged[key] == pytest.approx(one[key], rel=1e-12)
    means = [np.mean(score[p * k:(p + 1) * k]) for p in range(10)]
    assert one["reward/mean@3_se"] == pytest.approx(bootstrap_se(means), rel=1e-9)
    assert dict(whole.schema)["reward/mean@3"] == "mean_se"
    # constant values: zero standard error; no prompt at all: NaN, with every key still declared
    constant = StepMetrics()
    record_val_metrics(constant, group_rows(uids), {"acc": [1.0] * len(uids)}, [1.0] * len(uids), k, {"acc": 1.0})
    assert constant.local()["rewards/acc/pass@3_se"] == pytest.approx(0.0, abs=1e-7)
    empty = StepMetrics()
    record_val_metrics(empty, [], {"acc": []}, [], k, {"acc": 1.0}, [], ["code"])
    assert math.isnan(empty.local()["code/rewards/acc/best@3_se"])
    base = set(dict(constant.schema))
    assert set(dict(empty.schema)) == base | {f"code/{name}" for name in base}


def test_a_reward_that_applies_to_no_response_of_a_prompt_leaves_it_out():
    values = per_prompt_values(group_rows([0, 0, 1, 1]), {"r": [None, None, 0.5, None]}, 2, {"r": 1.0})
    assert values["r"]["mean@2"] == [0.5] and values["r"]["pass@2"] == [0.0]


# ---------------------------------------------------------------------------- in a run


def test_grpo_run_logs_val_at_k(say_task, tmp_path):
    task = say_task(6)
    records = [json.loads(line) for line in task.data.read_text().splitlines()][:6]
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({**r, "data_source": "even" if i % 2 == 0 else "odd"}) + "\n"
                           for i, r in enumerate(records)))
    from grouprl.trainer.grpo import GRPOTrainer

    cfg = task.config(tmp_path / "run", [{"name": "accuracy"}, {"name": "length", "weight": 0.5,
                                                                 "kwargs": {"target": 1}, "threshold": 0.5}], **{
        "data.val_files": [str(val)], "data.val_batch_size": 4, "trainer.max_steps": 1, "trainer.val_freq": 1,
        "trainer.val_before_train": False, "trainer.val_generations_to_log": 100,
        "worker.rollout.val_n": 3, "worker.rollout.val_temperature": 1.0,
        "worker.actor.global_batch_size": 4})
    trainer = GRPOTrainer(config_from_dict({**cfg, "worker": {**cfg["worker"], "rollout": {
        **cfg["worker"]["rollout"], "val_top_p": 0.9}}}))
    val_params, train_params = trainer._sampling(1, validation=True), trainer._sampling(1)
    assert (val_params.n, val_params.temperature, val_params.top_p) == (3, 1.0, 0.9)
    assert (train_params.n, train_params.top_p) == (4, 1.0)  # training's own settings
    trainer.train()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val_line = next(x for x in lines if "val/reward/mean" in x)
    for prefix in ("val/", "val/even/", "val/odd/"):
        for name in ("rewards/accuracy", "rewards/length"):
            for metric in ("mean@3", "best@3", "worst@3", "pass@3"):
                assert f"{prefix}{name}/{metric}" in val_line and f"{prefix}{name}/{metric}_se" in val_line
        assert f"{prefix}reward/best@3" in val_line and f"{prefix}reward/pass@3" not in val_line
    acc = {m: val_line[f"val/rewards/accuracy/{m}"] for m in ("mean@3", "best@3", "worst@3", "pass@3")}
    assert acc["worst@3"] <= acc["mean@3"] <= acc["best@3"] <= acc["pass@3"] + 1e-12
    # every response scored, k each: the prompts' mean is the responses' mean
    assert acc["mean@3"] == pytest.approx(val_line["val/rewards/accuracy/mean"])
    even, odd = val_line["val/even/reward/mean@3"], val_line["val/odd/reward/mean@3"]
    assert val_line["val/reward/mean@3"] == pytest.approx((even + odd) / 2)  # 3 prompts each
    schema = json.loads((tmp_path / "run" / "metrics_schema.json").read_text())
    assert schema["val/rewards/accuracy/pass@3"] == "mean_se" and schema["val/reward"] == "moments"
    generations = [json.loads(x) for x in (tmp_path / "run" / "val_generations.jsonl").read_text().splitlines()]
    assert len(generations) == 6 * 3
    by_prompt = defaultdict(list)
    for g in generations:
        by_prompt[g["id"]].append(g["score"])
    means = [float(np.mean(v)) for v in by_prompt.values()]
    assert len(means) == 6 and val_line["val/reward/mean@3_se"] == pytest.approx(bootstrap_se(means), abs=1e-9)


def test_two_processes_log_val_at_k_exactly(say_task, tmp_path, torchrun, read_jsonl):
    """Prompts split over two processes, each holding a data source the other lacks: every process
    declares every key, and the reduced values are those of all prompts together."""
    task = say_task(6)
    records = read_jsonl(task.data)[:3]
    sources = ["a", "b", "a"]  # process 0 validates prompts 0 and 2 (a), process 1 prompt 1 (b)
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({**r, "id": f"v{i}", "data_source": s}) + "\n"
                                                for i, (r, s) in enumerate(zip(records, sources))))
    # length: scores that differ between responses, so that the standard errors are not 0
    cfg = task.config(tmp_path / "run", [{"name": "length", "kwargs": {"target": 3}}], **{
        "data.val_files": [str(tmp_path / "val.jsonl")], "trainer.max_steps": 1, "trainer.val_freq": 1,
        "trainer.val_generations_to_log": 100, "worker.rollout.val_n": 3, "worker.rollout.val_temperature": 1.0,
        "worker.actor.global_batch_size": 2, "worker.actor.micro_batch_size_per_device_for_update": 2})
    (tmp_path / "config.yaml").write_text(json.dumps(cfg))
    torchrun("-m", "grouprl", "train", str(tmp_path / "config.yaml"), cwd=tmp_path)
    run = tmp_path / "run"
    assert json.loads((run / "run_info.json").read_text())["num_processes"] == 2
    val_line = next(m for m in read_jsonl(run / "metrics.jsonl") if "val/reward/mean" in m)
    by_prompt = defaultdict(list)
    for g in read_jsonl(run / "val_generations.jsonl"):
        by_prompt[g["id"]].append(g["score"])
    assert sorted(len(v) for v in by_prompt.values()) == [3, 3, 3]
    means = [float(np.mean(by_prompt[f"v{i}"])) for i in range(3)]
    assert val_line["val/reward/mean@3"] == pytest.approx(np.mean(means), abs=1e-9)
    assert bootstrap_se(means) > 0 and val_line["val/reward/mean@3_se"] == pytest.approx(bootstrap_se(means), abs=1e-9)
    assert val_line["val/b/reward/mean@3"] == pytest.approx(means[1], abs=1e-9)
    best = [prompt_metrics(by_prompt[f"v{i}"], 3)["best@3"] for i in (0, 2)]
    assert val_line["val/a/reward/best@3"] == pytest.approx(np.mean(best), abs=1e-9)
