#!/usr/bin/env bash
# One GPU, one command: the vllm engine's tests against a real vLLM on CUDA, the throughput benchmark on
# the 0.5B text and EditGRPO 3B shapes with every engine and TRL, and the peak memory of a 3B step.
#
#   bash benchmarks/gpu_check.sh OUT_DIR            # everything (about an hour on one H100)
#   bash benchmarks/gpu_check.sh OUT_DIR --quick    # the tests, then shorter benchmark runs
#   GPU_CHECK_BUDGET_S=540 bash benchmarks/gpu_check.sh OUT_DIR --quick   # every stage cut to fit 540 s in all
#   GPU_CHECK_STAGES="tests bench_3b_vllm" bash benchmarks/gpu_check.sh OUT_DIR --quick   # only these stages
#
# Needs: one CUDA GPU; python3 with torch, transformers, peft, accelerate; vLLM (and TRL for its runs)
# importable; grouprl installed from this checkout (pip install --no-deps -e .). On a machine without
# a package index, benchmarks/vllm_gpu_wheels.sh prepares vLLM 0.24.0 (verl's pin; its torch is 2.11)
# with TRL and datasets as parts to carry there; its header says how to unpack them.
#
# Writes OUT_DIR/gpu_check.json (the machine, the test results, every benchmark run) and
# OUT_DIR/gpu_check.md (a short table), with each stage's log beside them. A stage that fails is
# recorded as failed and the next one still runs; the exit status says whether all passed.
set -uo pipefail
out="${1:?usage: $0 OUT_DIR [--quick]}"
mode="${2:-full}"
here="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$out"
cd "$here"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
# vLLM's engine core in the training process (update_weights reaches its model)
export VLLM_ENABLE_V1_MULTIPROCESSING=0
# tests/real_vllm on CUDA: bf16, CUDA graphs, sleep levels 1 and 2, load_weights (tests/real_vllm/conftest.py)
export GROUPRL_VLLM_DEVICE=cuda GROUPRL_REQUIRE_VLLM=1
status=0
deadline=$((SECONDS + ${GPU_CHECK_BUDGET_S:-86400}))
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit (cut to the budget), log to OUT_DIR/NAME.log
  local name=$1 limit=$2; shift 2
  # GPU_CHECK_STAGES="tests bench_3b_vllm": only the stages named
  if [[ -n "${GPU_CHECK_STAGES:-}" && " $GPU_CHECK_STAGES " != *" $name "* ]]; then return; fi
  local left=$((deadline - SECONDS - 15))
  (( left < limit )) && limit=$left
  if (( limit < 30 )); then
    echo "$name rc=124 seconds=0" | tee -a "$out/stages.log"; echo "[gpu_check] $name: not run, no time left"
    status=1; return
  fi
  echo "[gpu_check] $name: $*" | tee -a "$out/stages.log"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=30 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$out/stages.log"
  tail -n 3 "$out/$name.log"
  [[ $rc -eq 0 ]] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$out/gpu.txt" 2>&1

if [[ "$mode" == "--quick" ]]; then
  stage tests 210 python3 -m pytest -q -p no:cacheprovider tests/real_vllm --junitxml="$out/tests.xml" --timeout 150
  # one run per stage, so that a run cut short by the budget loses only itself
  quick="--steps 2 --prompts 8 --n 4 --max-new-tokens 128 --workdir /tmp/gpu_check"
  stage bench_text_vllm 200 python3 benchmarks/bench_gpu.py --shape text-0.5b --engines vllm $quick \
    --out "$out/bench_text_vllm.json"
  stage bench_3b_vllm 400 python3 benchmarks/bench_gpu.py --shape editgrpo-3b --engines vllm $quick \
    --out "$out/bench_3b_vllm.json"
  stage bench_text_trl 200 python3 benchmarks/bench_gpu.py --shape text-0.5b --engines --trl $quick \
    --out "$out/bench_text_trl.json"
  stage bench_text_hf 150 python3 benchmarks/bench_gpu.py --shape text-0.5b --engines hf $quick \
    --out "$out/bench_text_hf.json"
else
  stage tests 1200 python3 -m pytest -q -p no:cacheprovider tests/real_vllm --junitxml="$out/tests.xml"
  stage bench_text 1800 python3 benchmarks/bench_gpu.py --shape text-0.5b --trl --workdir /tmp/gpu_check \
    --out "$out/bench_text.json"
  stage bench_3b 3600 python3 benchmarks/bench_gpu.py --shape editgrpo-3b --trl --workdir /tmp/gpu_check \
    --out "$out/bench_3b.json"
fi
python3 benchmarks/gpu_report.py "$out" --mode "${mode#--}" || status=1
exit $status
