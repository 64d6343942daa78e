"""`grouprl demo --compare --seeds K`: the statistics over seeds, and the multi-seed demo end to end."""

import json
import math
import shutil

import pytest

from grouprl.domains.radiology import demo
from grouprl.cli import main
from grouprl.domains.demos.seed_stats import (HOLDS, NO_INTERVAL, REVERSED, WITHIN, chain_verdict,
                                              paired_differences, paired_interval, summarize_seeds, t_interval,
                                              t_quantile, verdict)

# ---------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995])
def test_t_quantile_matches_closed_forms(p):
    # df = 1 is the Cauchy distribution: t_p = tan(pi (p - 1/2)); df = 2: t_p = (2p - 1) / sqrt(2 p (1 - p))
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-12)
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-12)
    assert t_quantile(1 - p, 3) == pytest.approx(-t_quantile(p, 3), rel=1e-12)


def test_t_quantile_known_table_values_and_normal_limit():
    # printed t tables (two-sided 95%): 12.706, 4.303, 3.182, 2.776, 2.262, 1.984 (df 100);
    # towards the normal quantile 1.95996 as df grows (df 10,000: 1.96020)
    for df, t in ((1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (9, 2.2622), (100, 1.9840),
                  (10_000, 1.96020)):
        assert t_quantile(0.975, df) == pytest.approx(t, abs=1e-4)
    assert t_quantile(0.5, 5) == 0.0


@pytest.mark.parametrize("p, df", [(0.0, 3), (1.0, 3), (0.975, 0), (0.975, -1), (0.975, math.inf),
                                   (0.975, math.nan)])
def test_t_quantile_rejects_bad_arguments(p, df):
    with pytest.raises(ValueError, match="t_quantile"):
        t_quantile(p, df)


def test_t_interval_by_hand():
    # values 1, 2, 3, 4: mean 2.5, sd sqrt(5/3) = 1.2909944, t_{0.975, 3} = 3.1824463,
    # half-width 3.1824463 * 1.2909944 / 2 = 2.0542603
    iv = t_interval([1, 2, 3, 4])
    assert iv.n == 4 and iv.mean == 2.5
    assert iv.sd == pytest.approx(1.2909944, abs=1e-7)
    assert iv.half_width == pytest.approx(2.0542603, abs=1e-6)
    assert (iv.low, iv.high) == (pytest.approx(0.4457397, abs=1e-6), pytest.approx(4.5542603, abs=1e-6))
    # 90%: t_{0.95, 3} = 2.3533634, half-width 2.3533634 * 1.2909944 / 2 = 1.5190896
    assert t_interval([1, 2, 3, 4], confidence=0.9).half_width == pytest.approx(1.5190896, abs=1e-6)
    # no spread, no width (not NaN)
    same = t_interval([0.3, 0.3, 0.3])
    assert (same.low, same.high, same.sd) == (pytest.approx(0.3), pytest.approx(0.3), 0.0)


def test_one_seed_gives_a_mean_and_no_interval():
    iv = t_interval([0.42])
    assert iv.mean == 0.42 and iv.sd is None and iv.low is None and iv.high is None and iv.half_width is None
    assert verdict(iv) == NO_INTERVAL == "no interval from one seed"
    assert json.dumps(iv.as_dict(), allow_nan=False)  # null, never NaN


@pytest.mark.parametrize("values, match", [([], "at least one value"), ([1.0, float("nan")], "finite"),
                                           ([1.0, math.inf], "finite"), ("0.5", "sequence"),
                                           ([True, False], "finite number")])
def test_t_interval_rejects_bad_values(values, match):
    with pytest.raises(ValueError, match=match):
        t_interval(values)


def test_t_interval_rejects_bad_confidence():
    for c in (0.0, 1.0, 95):
        with pytest.raises(ValueError, match="confidence"):
            t_interval([1, 2], confidence=c)


def test_paired_interval_and_verdicts_by_hand():
    # differences 0.1, 0.15, 0.2: mean 0.15, sd 0.05, t_{0.975, 2} = 4.3026527,
    # half-width 4.3026527 * 0.05 / sqrt(3) = 0.1242069 -> [0.0257931, 0.2742069], above 0
    a, b = [0.5, 0.6, 0.7], [0.4, 0.45, 0.5]
    assert paired_differences(a, b) == pytest.approx([0.1, 0.15, 0.2])
    iv = paired_interval(a, b)
    assert iv.mean == pytest.approx(0.15) and iv.half_width == pytest.approx(0.1242069, abs=1e-6)
    assert iv.low == pytest.approx(0.0257931, abs=1e-6)
    assert verdict(iv) == HOLDS == "holds beyond the noise"
    assert verdict(paired_interval(b, a)) == REVERSED == "reversed beyond the noise"
    # differences 0.1, -0.05, 0.2: mean 0.0833, interval straddles 0
    assert verdict(paired_interval([0.5, 0.6, 0.7], [0.4, 0.65, 0.5])) == WITHIN == "within the noise"
    with pytest.raises(ValueError, match="each seed needs both"):
        paired_differences([1, 2, 3], [1, 2])


def test_pairing_by_seed_removes_the_shared_seed_effect():
    # the seeds move both models together: each model's own interval is wide and the two overlap,
    # but every seed has a better than b by about 0.05, so the paired difference holds
    a, b = [0.5, 0.7, 0.9], [0.45, 0.66, 0.84]
    ia, ib = t_interval(a), t_interval(b)
    assert ia.low < ib.high and ib.low < ia.high
    assert verdict(paired_interval(a, b)) == HOLDS


def test_chain_verdict():
    assert chain_verdict([HOLDS, HOLDS]) == HOLDS
    assert chain_verdict([HOLDS, WITHIN]) == WITHIN
    assert chain_verdict([HOLDS, REVERSED]) == REVERSED
    assert chain_verdict([WITHIN, REVERSED]) == REVERSED
    assert chain_verdict([NO_INTERVAL, NO_INTERVAL]) == NO_INTERVAL
    with pytest.raises(ValueError, match="no links"):
        chain_verdict([])


def _results(rows):
    """results[seed][model][metric] from {seed: (a, b, c)} values of one metric "m"."""
    return {s: {"A": {"m": a}, "B": {"m": b}, "C": {"m": c}} for s, (a, b, c) in rows.items()}


def test_summarize_seeds_intervals_pairs_and_chain():
    results = _results({0: (0.5, 0.4, 0.3), 1: (0.6, 0.45, 0.2), 2: (0.7, 0.5, 0.45)})
    out = summarize_seeds(results, metrics=["m"], order=["A", "B", "C"])
    assert out["seeds"] == [0, 1, 2] and out["k"] == 3 and out["ordering"] == "A > B > C"
    a = out["models"]["A"]["m"]
    assert a["values"] == [0.5, 0.6, 0.7] and a["mean"] == pytest.approx(0.6)
    assert a["half_width"] == pytest.approx(t_interval([0.5, 0.6, 0.7]).half_width)
    ab, bc = out["paired"]["A - B"]["m"], out["paired"]["B - C"]["m"]
    assert ab["values"] == pytest.approx([0.1, 0.15, 0.2]) and ab["verdict"] == HOLDS
    assert bc["values"] == pytest.approx([0.1, 0.25, 0.05]) and bc["verdict"] == WITHIN
    assert out["ordering_verdict"] == {"m": WITHIN}
    json.dumps(out, allow_nan=False)


def test_summarize_seeds_one_seed_and_bad_input():
    one = summarize_seeds(_results({3: (0.5, 0.4, 0.3)}), metrics=["m"], order=["A", "B", "C"])
    assert one["k"] == 1 and one["models"]["A"]["m"]["low"] is None
    assert one["paired"]["A - B"]["m"]["verdict"] == NO_INTERVAL and one["ordering_verdict"]["m"] == NO_INTERVAL
    json.dumps(one, allow_nan=False)
    with pytest.raises(ValueError, match="no seeds"):
        summarize_seeds({}, metrics=["m"], order=["A", "B"])
    ragged = _results({0: (0.5, 0.4, 0.3), 1: (0.6, 0.45, 0.2)})
    del ragged[1]["C"]
    with pytest.raises(ValueError, match="seed 1 has models"):
        summarize_seeds(ragged, metrics=["m"], order=["A", "B"])
    with pytest.raises(ValueError, match="lacks"):
        summarize_seeds(_results({0: (0.5, 0.4, 0.3)}), metrics=["m", "x"], order=["A", "B"])
    with pytest.raises(ValueError, match="order must name"):
        summarize_seeds(_results({0: (0.5, 0.4, 0.3)}), metrics=["m"], order=["A", "Z"])


# ---------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("argv, message", [
    (["--compare", "--seeds", "0"], "at least 1"),
    (["--compare", "--seeds", "-2"], "at least 1"),
    (["--seeds", "2"], "is an option of the --compare, --guided and --tools demos; use it with one of them"),
    (["--guided", "--compare", "--seeds", "2"], "--guided and --compare are separate demos; choose one"),
    (["--flow", "--seeds", "2"], "is an option of the --compare, --guided and --tools demos; use it with one of them"),
])
def test_seeds_rejects_bad_use_before_running_anything(tmp_path, capsys, argv, message):
    out = tmp_path / "x"
    assert main(["demo", "--quick", "--out", str(out), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_seeds_refuses_a_directory_holding_another_run(tmp_path, capsys):
    out = tmp_path / "cmp"
    (out / "seed_0").mkdir(parents=True)
    summary = {"seed": 0, "sizes": demo.QUICK, "model": demo.DEMO_MODEL, "models": dict.fromkeys(demo.COMPARE_MODELS)}
    (out / "seed_0" / "summary.json").write_text(json.dumps(summary))
    # the full-size run must not reuse (or overwrite) a quick run's results
    assert main(["demo", "--compare", "--seeds", "2", "--out", str(out)]) == 2
    assert "holds another run's results" in capsys.readouterr().err
    # an interrupted directory with files the demo does not write is not deleted
    (out / "seed_1").mkdir()
    (out / "seed_1" / "notes.txt").write_text("mine")
    assert main(["demo", "--quick", "--compare", "--seeds", "2", "--out", str(out)]) == 2
    assert "notes.txt" in capsys.readouterr().err
    assert (out / "seed_1" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["seed_0", "seed_1"]


@pytest.fixture(scope="module", autouse=True)
def _plumbing_sizes(demo_plumbing_sizes):
    """Every test here runs the demo at the plumbing sizes (tests/radiology/conftest.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo, "QUICK", demo_plumbing_sizes)
        yield


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory):
    """`grouprl demo --quick --compare --seeds 2 --seed 5` once, for the tests below to read or copy."""
    out = tmp_path_factory.mktemp("seeds") / "cmp"
    assert main(["demo", "--quick", "--compare", "--seeds", "2", "--seed", "5", "--out", str(out)]) == 0
    return out


def test_quick_two_seeds_end_to_end(two_seeds):
    out = two_seeds
    agg = json.loads((out / "compare_seeds.json").read_text())
    assert agg["seeds"] == [5, 6] and agg["k"] == 2 and agg["reused_seeds"] == []
    assert list(agg["models"]) == demo.COMPARE_MODELS
    assert agg["ordering"] == "SFT+EditGRPO > SFT+Dr.GRPO > SFT+GRPO"
    # every number comes from the seeds' own summaries: the mean and interval of the two values,
    # and the paired differences seed by seed
    seeds = {s: json.loads((out / f"seed_{s}" / "summary.json").read_text()) for s in (5, 6)}
    assert all(seeds[s]["seed"] == s for s in seeds)
    for model in demo.COMPARE_MODELS:
        for _, key in demo.TABLE_COLUMNS:
            values = [seeds[s]["models"][model][key] for s in (5, 6)]
            row = agg["models"][model][key]
            assert row["values"] == values and row["mean"] == pytest.approx(sum(values) / 2)
            iv = t_interval(values)
            assert (row["low"], row["high"]) == (pytest.approx(iv.low), pytest.approx(iv.high))
    chain = {"SFT+EditGRPO - SFT+Dr.GRPO": ("SFT+EditGRPO", "SFT+Dr.GRPO"),
             "SFT+Dr.GRPO - SFT+GRPO": ("SFT+Dr.GRPO", "SFT+GRPO")}
    # GDPO against GRPO too, compared the same way, outside the ordering's verdict
    pairs = {**chain, "SFT+GDPO - SFT+GRPO": ("SFT+GDPO", "SFT+GRPO")}
    assert list(agg["paired"]) == list(pairs)
    for name, (better, worse) in pairs.items():
        # no ordering on the word count: longer reports are not better ones
        assert list(agg["paired"][name]) == ["mean_reward", "mean_radgraphf1", "mean_cxb14micro", "mean_ratescore",
                                             "finding_f1_micro", "finding_f1_macro"]
        for key, row in agg["paired"][name].items():
            diffs = [seeds[s]["models"][better][key] - seeds[s]["models"][worse][key] for s in (5, 6)]
            assert row["values"] == pytest.approx(diffs)
            assert row["verdict"] == verdict(paired_interval(*zip(*[(seeds[s]["models"][better][key],
                                                                    seeds[s]["models"][worse][key]) for s in (5, 6)])))
    for key in demo.ORDERED_METRICS:
        assert agg["ordering_verdict"][key] == chain_verdict([agg["paired"][p][key]["verdict"] for p in chain])
    assert (out / "compare_seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each seed is a whole compare run of its own
    for s in (5, 6):
        assert (out / f"seed_{s}" / "compare_rewards.png").exists()
        for run in demo.VARIANTS:
            assert (out / f"seed_{s}" / run / "metrics.jsonl").exists()
    assert not list(out.glob(".*"))  # no temporaries left by the atomic writes


def _stamps(directory):
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_resume_reuses_a_finished_seed_and_reruns_an_interrupted_one(two_seeds, tmp_path, capsys, monkeypatch):
    out = tmp_path / "cmp"
    shutil.copytree(two_seeds, out)
    (out / "seed_6" / "summary.json").unlink()  # seed 6 was interrupted before its summary
    before = _stamps(out / "seed_5")
    ran, real_run_demo = [], demo.run_demo

    def run_demo(*args, **kwargs):
        ran.append(kwargs["seed"])
        return real_run_demo(*args, **kwargs)

    monkeypatch.setattr(demo, "run_demo", run_demo)
    capsys.readouterr()
    assert main(["demo", "--quick", "--compare", "--seeds", "2", "--seed", "5", "--out", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps lines at the console's width
    assert ran == [6]
    assert "seed 5 (1/2): complete results in" in printed and "reused (not run again)" in printed
    assert "interrupted run" in printed and "1 seed(s) run, 1 reused" in printed
    assert _stamps(out / "seed_5") == before
    agg = json.loads((out / "compare_seeds.json").read_text())
    assert agg["reused_seeds"] == [5] and agg["seeds"] == [5, 6]
    # the interrupted seed started over clean: its logs hold one run's steps, not two appended
    steps = agg["sizes"]["grpo_steps"]
    for run in demo.VARIANTS:
        rows = [json.loads(x) for x in (out / "seed_6" / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "reward/mean" in r] == list(range(1, steps + 1))
        assert [r["step"] for r in rows if "val/reward/mean" in r] == [0, steps]  # before training and at the end


def test_one_seed_reports_means_and_says_there_is_no_interval(two_seeds, tmp_path, capsys, monkeypatch):
    out = tmp_path / "cmp"
    shutil.copytree(two_seeds / "seed_5", out / "seed_5")
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("seed 5 is complete and must be reused"))
    capsys.readouterr()
    assert main(["demo", "--quick", "--compare", "--seeds", "1", "--seed", "5", "--out", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps lines at the console's width
    assert "one seed: means only" in printed and "needs at least 2 seeds" in printed
    text = (out / "compare_seeds.json").read_text()
    assert "NaN" not in text
    agg = json.loads(text)
    assert agg["k"] == 1 and agg["models"]["SFT+GRPO"]["mean_reward"]["low"] is None
    assert set(agg["ordering_verdict"].values()) == {NO_INTERVAL}
    assert (out / "compare_seeds.png").read_bytes()[:4] == b"\x89PNG"
