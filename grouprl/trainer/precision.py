"""Precision is a policy, not a dtype: where each copy of the weights lives, and in which dtype.

``worker.actor.model.dtype`` names the *compute* dtype; ``worker.actor.optim.strategy``
decides what the optimizer updates. Bytes per parameter of the model (AdamW, weights +
gradients + the two moment estimates, then the frozen copies; activations not counted):

| mode (dtype, strategy)            | trained weights | grads | AdamW m, v | reference (KL on) | rollout copy | total |
|-----------------------------------|----------------:|------:|-----------:|------------------:|-------------:|------:|
| float32, adamw                    | 4 (fp32)        | 4     | 8          | 4 (fp32)          | 0 (shared)   | 20    |
| bfloat16, adamw (mixed, default)  | 4 (fp32 master) | 4     | 8          | 2 (bf16)          | 2 (bf16)     | 20    |
| bfloat16, adamw_bf16 (lossy)      | 2 (bf16)        | 2     | 4          | 2 (bf16)          | 0 (shared)   | 10    |

Under LoRA with bfloat16 the base is frozen in bf16 (2 bytes per parameter), the
adapters, their gradients and AdamW state take 4 + 4 + 8 bytes per adapter
parameter, the reference is the policy with its adapters off and the rollout
samples from the policy itself: about 2 bytes per model parameter in all.

Mixed precision is what EasyR1 and verl do: the optimizer updates fp32 master weights
(at lr 1e-6 a bf16 weight of scale 0.02 cannot represent most updates: its spacing
there is 1.2e-4), while matrix products run in bf16 under ``torch.autocast``. The
reference model and the rollout copy never train, so they are held in bf16; the
rollout copy is refreshed from the master weights after every training step.
``adamw_bf16`` (the seeds' name) halves the memory and silently loses small updates.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """The dtypes of one training run.

    ``param_dtype``: the trained parameters, hence their gradients and AdamW's state.
    ``compute_dtype``: forward and backward matrix products (autocast when it differs).
    ``frozen_dtype``: weights that never train: the reference model, the rollout copy,
    and the frozen base under LoRA adapters.
    """

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    frozen_dtype: torch.dtype
    lora: bool = False

    @property
    def mixed(self) -> bool:
        """Whether compute runs in a lower precision than the trained weights."""
        return self.compute_dtype != self.param_dtype

    @property
    def load_dtype(self) -> torch.dtype:
        """The dtype to load the policy in: the master dtype, or the frozen base's under LoRA."""
        return self.frozen_dtype if self.lora else self.param_dtype

    @property
    def rollout_copy(self) -> bool:
        """Whether generation needs its own copy of the weights in ``frozen_dtype``.

        Full fine-tuning with fp32 masters samples from a bf16 copy (generation reads every
        weight once per token, so fp32 weights under autocast would cost twice the reads).
        Under LoRA the base already is bf16 and the adapters are small: no copy.
        """
        return self.mixed and not self.lora

    def autocast(self, device: torch.device | str) -> ContextManager:
        """The context for forward passes of the trained model (a no-op when not mixed)."""
        if not self.mixed:
            return contextlib.nullcontext()
        device_type = torch.device(device).type
        return torch.autocast(device_type=device_type, dtype=self.compute_dtype)

    def describe(self) -> str:
        names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        what = "adapters" if self.lora else "weights"
        return (f"trained {what} and optimizer state {names[self.param_dtype]}, compute {names[self.compute_dtype]}, "
                f"frozen weights {names[self.frozen_dtype]}")


def precision_policy(dtype: str, strategy: str = "adamw", *, lora: bool = False,
                     checkpoint_dtype: torch.dtype | None = None) -> Precision:
    """The precision of a run from ``worker.actor.model.dtype`` and ``worker.actor.optim.strategy``.

    ``dtype="auto"`` takes the checkpoint's own dtype (``checkpoint_dtype``, fp32 when unknown).
    float32 -> fp32 everywhere. bfloat16 + adamw -> fp32 trained weights and optimizer
    state, bf16 compute and frozen copies. bfloat16 + adamw_bf16 -> bf16 everywhere.
    Under LoRA the trained weights are the adapters; the base is frozen in the compute dtype.
    """
    if dtype == "auto":
        resolved = checkpoint_dtype or torch.float32
    elif dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join([*_DTYPES, 'auto'])}")
    if resolved == torch.float16:
        raise ValueError("float16 training needs loss scaling, which grouprl does not do; use bfloat16")
    if strategy not in ("adamw", "adamw_bf16"):
        raise ValueError(f"optimizer strategy {strategy!r} is not one of adamw, adamw_bf16")
    if resolved == torch.float32:
        if strategy == "adamw_bf16":
            raise ValueError("optimizer strategy adamw_bf16 needs dtype bfloat16")
        return Precision(torch.float32, torch.float32, torch.float32, lora)
    if strategy == "adamw_bf16":
        return Precision(resolved, resolved, resolved, lora)
    return Precision(torch.float32, resolved, resolved, lora)
