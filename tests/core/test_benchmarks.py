"""Smoke tests of the benchmark scripts: each runs end to end on the CPU at its smallest settings.

Nothing else runs them, and a script that stops working does so silently (bench_vs_trl.py once
did). These check that each finishes and writes its JSON with the expected fields and sane
values; they say nothing about the speeds measured.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def run(script: str, *args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{script} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    return proc


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_gpu_run(run_result: dict, steps: int) -> None:
    assert len(run_result["steps"]) == steps
    for step in run_result["steps"]:
        assert positive(step["step_s"]) and positive(step["tokens"]) and positive(step["responses"])
        assert positive(step["rollout_s"]) and positive(step["generate_s"]) and positive(step["update_s"])
        assert step["reward_s"] >= 0 and step["log_probs_s"] >= 0
        assert step["rollout_s"] <= step["step_s"] and step["generate_s"] <= step["rollout_s"] + 1e-6
        assert positive(step["response_length_mean"])
        assert step["peak_allocated_bytes"] is None  # CPU: no CUDA memory to read
    summary = run_result["summary"]
    assert summary["timed_steps"] == steps - 1
    assert positive(summary["step_s"]) and positive(summary["tokens_per_s"]) and positive(summary["tokens_per_step"])
    # tokens/s is the timed steps' prompt + response tokens over their time
    timed = run_result["steps"][1:]
    expected = sum(s["tokens"] for s in timed) / sum(s["step_s"] for s in timed)
    assert summary["tokens_per_s"] == pytest.approx(expected)
    assert positive(run_result["parameters"]) and run_result["trainable_parameters"] <= run_result["parameters"]


def test_bench_gpu_cpu_smoke(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run("bench_gpu.py", "--device", "cpu", "--shape", "tiny", "--engines", "hf", "hf_static", "--steps", "2",
               "--batching", "padded", "packed_dynamic",
               "--override", "worker.rollout.static_cache.backend=eager", "--out", str(out), cwd=tmp_path)
    assert "tokens/s" in proc.stdout and "grouprl hf_static" in proc.stdout
    report = json.loads(out.read_text())
    assert report["settings"]["device"] == "cpu" and report["settings"]["steps"] == 2
    assert report["machine"]["torch"] and report["aims"] == {"tokens_per_s": 1800.0, "vs_trl": 2.0}
    entry = report["shapes"]["tiny"]
    assert set(entry["runs"]) == {"grouprl hf", "grouprl hf_static", "grouprl hf packed_dynamic",
                                  "grouprl hf_static packed_dynamic"}
    for label, result in entry["runs"].items():  # packed rows compute no padding
        pad = result["summary"]["pad_fraction"]
        assert pad == 0.0 if label.endswith("packed_dynamic") else 0.0 <= pad < 1.0, (label, pad)
    assert entry["settings"]["n"] == 2 and entry["settings"]["prompts_per_step"] == 2
    assert entry["settings"]["kl_coef"] == 0.01  # the EditGRPO recipe's settings reached the runs
    for label, result in entry["runs"].items():
        check_gpu_run(result, steps=2)
        assert result["engine"] == label.split()[1]
        # 2 prompts x 2 responses of at most 8 tokens, plus the prompts
        assert all(s["responses"] == 4 for s in result["steps"])
        assert result["vs_trl"] is None and result["vs_aim"] is None  # no TRL run; the aim is editgrpo-3b's
    # vLLM was not asked for; nothing skipped
    assert entry["skipped"] == {}


def test_bench_gpu_refuses_gpu_shapes_on_a_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "bench_gpu.py"), "--device", "cpu", "--shape", "editgrpo-3b",
                           "--out", str(tmp_path / "x.json")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "only the tiny shapes" in proc.stderr and "editgrpo-3b" in proc.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL (pip install 'grouprl[bench]')")
def test_bench_gpu_trl_and_vlm_cpu_smoke(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run("bench_gpu.py", "--device", "cpu", "--shape", "tiny-vlm", "--engines", "hf", "vllm", "--trl",
               "--steps", "2", "--out", str(out), cwd=tmp_path)
    assert "skipped" in proc.stdout  # vllm, on a CPU
    entry = json.loads(out.read_text())["shapes"]["tiny-vlm"]
    assert set(entry["runs"]) == {"grouprl hf", "TRL generate"}
    assert "grouprl vllm" in entry["skipped"]
    assert entry["settings"]["edits"] and entry["settings"]["rewards"] == ["editgrpo_composite"]
    for result in entry["runs"].values():
        check_gpu_run(result, steps=2)
    trl = entry["runs"]["TRL generate"]
    assert trl["trl_settings"]["num_generations"] == 2 and trl["trl_settings"]["loss_type"] == "dr_grpo"
    assert trl["trl_settings"]["beta"] == 0.01 and trl["timed_methods"]["rollout"]
    grouprl = entry["runs"]["grouprl hf"]
    assert grouprl["vs_trl"] == pytest.approx(grouprl["summary"]["tokens_per_s"] / trl["summary"]["tokens_per_s"])
    # the same prompts (with their image tokens) in both: token counts per step within a few percent
    assert grouprl["summary"]["tokens_per_step"] == pytest.approx(trl["summary"]["tokens_per_step"], rel=0.25)


def test_bench_async_smoke(tmp_path):
    out = tmp_path / "async.json"
    proc = run("bench_async.py", "--steps", "3", "--prompts", "2", "--n", "2", "--micro-batch", "2", "--tokens", "4", "--repeats", "1",
               "--reward-call-latency", "0", "--reward-row-latency", "0", "--out", str(out), cwd=tmp_path)
    assert "vs sync" in proc.stdout
    report = json.loads(out.read_text())
    assert report["settings"]["reward_call_latency"] == report["settings"]["reward_row_latency"] == 0
    assert set(report["results"]) == {"sync", "async_reward", "one_step_off"}
    for result in report["results"].values():
        assert len(result["step_seconds"]) == 3 and all(positive(s) for s in result["step_seconds"])
        assert positive(result["median_step_seconds"])


def test_bench_vs_trl_smoke(tmp_path):
    out = tmp_path / "vs_trl.json"
    run("bench_vs_trl.py", "--frameworks", "grouprl", "--steps", "3", "--repeats", "1", "--n", "2",
        "--prompts-per-step", "2", "--max-new-tokens", "4", "--last-k", "2", "--out", str(out), cwd=tmp_path)
    report = json.loads(out.read_text())
    assert report["settings"]["frameworks"] == "grouprl" and report["ratio_grouprl_over_trl"] is None
    result = report["results"]["grouprl"]
    assert positive(result["samples_per_s"]) and positive(result["seconds_per_step"])
    assert result["samples_per_s_runs"] == [result["samples_per_s"]]
    run_ = result["runs"][0]
    assert run_["timed_steps"] == 2 and len(run_["rewards"]) == 3 and len(run_["completion_lengths"]) == 3
    assert all(0.0 <= r <= 1.0 for r in run_["rewards"])
    assert all(0 < length <= 4 for length in run_["completion_lengths"])


def test_bench_precision_smoke(tmp_path):
    out = tmp_path / "precision.json"
    run("bench_precision.py", "--device", "cpu", "--modes", "fp32", "lora", "--prompts", "1", "--n", "2",
        "--tokens", "4", "--out", str(out), cwd=tmp_path)
    report = json.loads(out.read_text())
    assert report["shape"] == "small" and report["device"] == "cpu"
    fp32, lora = report["results"]["fp32"], report["results"]["lora"]
    for result in (fp32, lora):
        assert positive(result["seconds"]) and positive(result["peak_rss_bytes"]) and positive(result["parameters"])
        assert result["peak_bytes"] is None
    # fp32: 4 bytes of weights, 8 of AdamW state, 4 of reference weights, 4 of gradients per parameter
    per_param = {k: v / fp32["parameters"] for k, v in fp32["tensor_bytes"].items()}
    assert per_param["trained_weights"] == pytest.approx(4.0) and per_param["optimizer_state"] == pytest.approx(8.0)
    assert lora["tensor_bytes"]["trained_weights"] < fp32["tensor_bytes"]["trained_weights"] / 4


def test_bench_gpu_merges_separate_runs(tmp_path, monkeypatch):
    """Runs made one per invocation (a GPU session's time limit) are compared after merging."""
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH / "bench_gpu.py")
    bench_gpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu", bench_gpu)  # its dataclass looks itself up there
    monkeypatch.syspath_prepend(str(BENCH))
    spec.loader.exec_module(bench_gpu)

    def report(label: str, tokens_per_s: float) -> dict:
        summary = {"step_s": 2.0, **{k: 0.5 for k in bench_gpu.TIMING_KEYS}, "tokens_per_step": 2 * tokens_per_s,
                   "tokens_per_s": tokens_per_s, "peak_allocated_bytes": 2**30, "timed_steps": 1}
        return {"settings": {"steps": 2}, "machine": {}, "aims": {},
                "shapes": {"editgrpo-3b": {"settings": {"n": 5}, "skipped": {"grouprl vllm": "not importable"},
                                           "runs": {label: {"steps": [], "summary": summary}}}}}

    paths = []
    for i, (label, rate) in enumerate((("grouprl hf", 900.0), ("grouprl vllm", 2700.0), ("TRL vllm", 1000.0))):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(report(label, rate)))
    out = tmp_path / "merged.json"
    assert bench_gpu.main(["--merge", *map(str, paths), "--out", str(out)]) == 0
    entry = json.loads(out.read_text())["shapes"]["editgrpo-3b"]
    assert set(entry["runs"]) == {"grouprl hf", "grouprl vllm", "TRL vllm"}
    assert entry["skipped"] == {}  # a later file ran what an earlier one skipped
    vllm = entry["runs"]["grouprl vllm"]
    assert vllm["vs_trl"] == pytest.approx(2.7) and vllm["vs_aim"] == pytest.approx(1.5)
    assert vllm["meets_aims"] == {"tokens_per_s": True, "vs_trl": True}
    assert entry["runs"]["grouprl hf"]["meets_aims"] == {"tokens_per_s": False, "vs_trl": False}


def test_bench_flow_smoke(tmp_path):
    pytest.importorskip("diffusers")
    out = tmp_path / "flow.json"
    proc = run("bench_flow.py", "--steps", "2", "--prompts", "2", "--n", "2", "--micro-batch", "4", "--size", "8",
               "--layers", "1", "--repeats", "1", "--reward-call-latency", "0", "--reward-image-latency", "0",
               "--only", "flow_grpo", "flow_grpo_fast", "flow_grpo_fast+one_step_off", "diffusion_nft",
               "--out", str(out), cwd=tmp_path)
    assert "Flow-GRPO-Fast / Flow-GRPO" in proc.stdout
    report = json.loads(out.read_text())
    # --only: the runs named (async reward and NFT with 2 times left out to keep the test short)
    assert set(report["results"]) == {"flow_grpo", "flow_grpo_fast", "flow_grpo_fast+one_step_off", "diffusion_nft"}
    assert set(report["ratios"]) == {"fast_vs_flow_grpo", "one_step_off_vs_sync", "nft_vs_fast"}
    for result in report["results"].values():
        assert len(result["step_seconds"]) == 2 and all(positive(s) for s in result["step_seconds"])
        assert result["images_per_s"] == pytest.approx(4 / result["median_step_seconds"])
    fast, slow = report["results"]["flow_grpo_fast"], report["results"]["flow_grpo"]
    assert report["ratios"]["fast_vs_flow_grpo"] == pytest.approx(fast["images_per_s"] / slow["images_per_s"])
    off = report["results"]["flow_grpo_fast+one_step_off"]
    assert report["ratios"]["one_step_off_vs_sync"] == pytest.approx(off["images_per_s"] / fast["images_per_s"])
    nft = report["results"]["diffusion_nft"]
    assert report["ratios"]["nft_vs_fast"] == pytest.approx(nft["images_per_s"] / fast["images_per_s"])
    assert "DiffusionNFT (9 times) / Flow-GRPO-Fast" in proc.stdout


def test_bench_clinical_smoke(tmp_path):
    """Scoring speed, the server (2 scoring processes) under 1 and 2 clients for both request shapes,
    the split test, and a baseline tree measured beside this one (here: this repository again)."""
    out = tmp_path / "clinical.json"
    root = BENCH.parent
    proc = run("bench_clinical.py", "--reports", "30", "--refs", "3", "--rollouts", "2", "--requests", "2",
               "--clients", "2", "--workers", "2", "--baseline", str(root), "--out", str(out), cwd=tmp_path)
    assert "aim < 250" in proc.stdout and "EditGRPO's / grouprl's CPU per pair" in proc.stdout
    report = json.loads(out.read_text())
    assert list(report["trees"]) == [root.resolve().name, "this"]
    assert report["grpo_shape"]["pairs"] == 6 and report["grpo_shape"]["distinct_refs"] == 3
    for tree in report["trees"].values():
        assert all(positive(v) for v in tree["scoring"].values())
        loads = tree["server_workers_2"]
        assert set(loads) == {"grpo_1_client", "grpo_2_clients", "distinct_1_client", "distinct_2_clients",
                              "grpo_1_client_editgrpo_keys", "grpo_2_clients_editgrpo_keys"}
        for name, load in loads.items():
            clients = 1 if "_1_client" in name else 2
            # one serving process holds every connection; the requests are spread over the scoring processes
            assert load["requests"] == 2 * clients and load["clients_per_process"] == [clients]
            assert sum(load["requests_per_scoring_process"]) == 2 * clients
            assert 1 <= len(load["requests_per_scoring_process"]) <= 2
            assert 0 < load["p50_ms"] <= load["p99_ms"] <= load["max_ms"] and positive(load["pairs_per_s"])
            assert load["server_cpu_ms_per_pair"] >= 0 and load["server_cores_used"] >= 0
    split = report["split"]
    assert set(split) == {"whole_1_client", "whole_2_clients", "split_1_client", "split_2_clients"}
    assert all(s["requests"] == (2 if "_1_" in name else 4) for name, s in split.items())


def test_bench_clinical_grpo_requests_vary_their_reference(monkeypatch):
    """GRPO-shaped requests: each reference once per rollout, with responses that are variations of
    it (sharing most of its sentences), a few verbatim and a few repeated, not unrelated reports."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_clinical", BENCH / "bench_clinical.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    hyps, refs = bench.shapes(32, 5, seed=3)["grpo"]
    assert len(hyps) == 160 and len(set(refs)) == 32
    assert all(len(set(refs[i:i + 5])) == 1 for i in range(0, 160, 5))  # groups of 5 share their reference

    def sentences(text: str) -> set[str]:
        return {s for s in bench._SENTENCE_END.split(text) if s}

    shared = [len(sentences(h) & sentences(r)) / len(sentences(r)) for h, r in zip(hyps, refs)]
    assert sum(shared) / len(shared) > 0.6  # mostly the reference's own sentences
    verbatim = sum(h == r for h, r in zip(hyps, refs))
    assert 0 < verbatim < 40
    repeated = sum(hyps[i] == hyps[i - 1] and refs[i] == refs[i - 1] for i in range(1, 160))
    assert 8 <= repeated < 40  # about a tenth of the 128 that can repeat, beside chance equalities
    distinct_hyps, distinct_refs = bench.shapes(32, 5, seed=3)["distinct"]
    assert len(set(distinct_hyps)) == len(set(distinct_refs)) == 160


def test_bench_plan_smoke(tmp_path):
    out = tmp_path / "plan.json"
    proc = run("bench_plan.py", "--device", "cpu", "--modes", "mixed", "--prompts", "1", "--n", "2", "--tokens", "4",
               "--out", str(out), cwd=tmp_path)
    assert "| mixed | activations |" in proc.stdout
    rows = json.loads(out.read_text())["results"]["mixed"]["rows"]
    # the weights' parts are exact; every part the plan predicts is within 15% of the live bytes
    assert rows["weights"][0] == rows["weights"][1] > 0 and rows["rollout_copy"][0] == rows["rollout_copy"][1] > 0
    for part, (predicted, measured) in rows.items():
        assert abs(predicted - measured) <= 0.15 * measured, (part, predicted, measured)


def test_bench_flow_families_smoke(tmp_path):
    pytest.importorskip("diffusers")
    out = tmp_path / "families.json"
    proc = run("bench_flow.py", "--families", "sd3", "wan", "--steps", "2", "--prompts", "2", "--n", "2",
               "--micro-batch", "4", "--size", "16", "--frames", "5", "--repeats", "1", "--reward-call-latency", "0",
               "--reward-image-latency", "0", "--out", str(out), cwd=tmp_path)
    assert "vs sd3" in proc.stdout
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"sd3", "wan"} and set(report["ratios"]) == {"sd3_vs_sd3", "wan_vs_sd3"}
    assert report["ratios"]["sd3_vs_sd3"] == 1.0
    # a step of Wan makes 2 x 2 videos of 5 frames: frames per second
    assert report["results"]["wan"]["images_per_step"] == 2 * 2 * 5
    assert report["results"]["sd3"]["images_per_step"] == 2 * 2
    for result in report["results"].values():
        assert len(result["step_seconds"]) == 2 and all(positive(s) for s in result["step_seconds"])
