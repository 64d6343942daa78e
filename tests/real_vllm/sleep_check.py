"""One sleep level on CUDA, in a process of its own: ``python sleep_check.py MODEL_DIR LEVEL``.

vLLM's sleep mode takes its memory from one CuMem pool per process ("CuMem allocator can only be
used for one instance per process", vLLM 0.24), so each level gets a fresh process, as a training
process has one engine. Starts the engine with sleep mode at LEVEL, sleeps, wakes, pushes changed
weights (level 2 discarded the old ones: every tensor must be resent) and checks that vLLM samples
from them. Exit status 0 when it does; the gap is printed either way.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import cuda_device  # noqa: E402
from test_real_vllm_engine import gap, load, perturb, sample, start_engine, text_samples  # noqa: E402


def main(path: str, level: int) -> int:
    device = cuda_device()
    model, processor = load(path, device)
    engine = start_engine(model, processor, path, device, enable_sleep_mode=True, sleep_level=level)
    assert engine.supports_sleep, "sleep mode is off on CUDA"
    engine.sleep()
    engine.wake_up()
    perturb(model, seed=10 + level)
    engine.update_weights(model.named_parameters())
    worst, mean = gap(model, sample(engine, text_samples(), seed=7))
    print(f"sleep level {level}: |vLLM - trainer| max {worst:.4g}, mean {mean:.4g}")
    engine.close()
    return 0 if worst <= device.log_prob_atol and mean <= device.mean_atol else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], int(sys.argv[2])))
