"""Gather what ``benchmarks/gpu_check.sh`` ran into one JSON and a short Markdown table.

    python benchmarks/gpu_report.py OUT_DIR [--mode quick|full]

Reads ``OUT_DIR/gpu.txt`` (nvidia-smi), ``stages.log`` (each stage's exit status and seconds),
``tests.xml`` (pytest's JUnit report of tests/real_vllm) and ``bench_*.json`` (``bench_gpu.py``'s
reports); writes ``OUT_DIR/gpu_check.json`` and ``OUT_DIR/gpu_check.md``. Anything missing is
reported as missing, never filled in.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent


def read_stages(path: Path) -> dict[str, dict]:
    stages = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1].startswith("rc=") and parts[2].startswith("seconds="):
                stages[parts[0]] = {"rc": int(parts[1][3:]), "seconds": int(parts[2][8:])}
    return stages


def read_tests(path: Path) -> dict | None:
    """Every test case of a JUnit XML report: name, outcome, seconds, and the message of a failure or skip."""
    if not path.exists():
        return None
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (found.get("message") or found.text or "").strip().splitlines()[0][:300] if (
                    found.get("message") or found.text) else ""
                break
        cases.append({"name": case.get("name"), "file": case.get("classname"), "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0.0), 2), "message": message})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "cases": cases}


def read_benchmarks(out: Path) -> tuple[dict | None, str | None]:
    """``bench_gpu.py --merge`` over every ``bench_*.json``: the merged report (ratios to TRL recomputed
    across files) and its table; also written to ``OUT_DIR/bench.json``."""
    paths = sorted(str(p) for p in out.glob("bench_*.json"))
    if not paths:
        return None, None
    sys.path.insert(0, str(HERE))
    import bench_gpu

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        bench_gpu.merge_reports(paths, str(out / "bench.json"))
    table = "\n".join(line for line in buffer.getvalue().strip("\n").splitlines() if not line.startswith("[bench]"))
    return json.loads((out / "bench.json").read_text()), table


def markdown(result: dict, table: str | None) -> str:
    lines = [f"# GPU check ({result['mode']})", "", f"GPU: {result['gpu'] or 'unknown'}", ""]
    machine = (result.get("benchmarks") or {}).get("machine") or {}
    if machine:
        versions = ", ".join(f"{k} {machine[k]}" for k in ("torch", "transformers", "vllm", "trl") if machine.get(k))
        lines += [f"Versions: {versions}", ""]
    lines += ["| stage | exit | seconds |", "|---|---:|---:|"]
    for name, stage in result["stages"].items():
        lines.append(f"| {name} | {stage['rc']} | {stage['seconds']} |")
    tests = result.get("tests")
    lines += ["", "## tests/real_vllm on CUDA", ""]
    if tests is None:
        lines.append("no report (the stage did not run or did not finish)")
    else:
        lines.append(", ".join(f"{v} {k}" for k, v in tests["counts"].items() if v))
        lines += ["", "| test | outcome | seconds |", "|---|---|---:|"]
        for case in tests["cases"]:
            note = f" ({case['message']})" if case["message"] and case["outcome"] != "passed" else ""
            lines.append(f"| {case['name']} | {case['outcome']}{note} | {case['seconds']} |")
    lines += ["", "## Throughput and memory (benchmarks/bench_gpu.py)", ""]
    if result.get("benchmarks"):
        lines += ["```", table, "```"]
    else:
        lines.append("no report (the stages did not run or did not finish)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--mode", default="full")
    args = p.parse_args(argv)
    out = args.out
    gpu = (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else None
    benchmarks, table = read_benchmarks(out)
    result = {"mode": args.mode, "gpu": gpu, "stages": read_stages(out / "stages.log"),
              "tests": read_tests(out / "tests.xml"), "benchmarks": benchmarks}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result, table)
    (out / "gpu_check.md").write_text(text)
    print(text)
    ok = all(s["rc"] == 0 for s in result["stages"].values()) and result["tests"] is not None \
        and not (result["tests"]["counts"]["failed"] or result["tests"]["counts"]["error"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
