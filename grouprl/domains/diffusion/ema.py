"""An exponential moving average (EMA) of the trained weights, for validation and checkpoints.

Flow-GRPO keeps one of the LoRA weights in every SD3 recipe and evaluates (and saves) it instead of the
raw weights: the policy moves at lr 3e-4 with a noisy gradient, and the average is the smoother model.
Here the raw weights keep training; the average is held beside them (``worker.actor.ema``), swapped in
for validation, and written into each checkpoint as ``model/ema.safetensors``.

Why not diffusers' ``EMAModel``: its decay is always capped by (1 + n) / (10 + n) (no constant decay),
its state is a list of tensors by position meant for ``torch.save`` (grouprl never unpickles a file),
and it has no update interval. The update itself is one line (``ema_update_``); the average is keyed
by parameter name, so a checkpoint says which tensor is which.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

EMA_FILE = "ema.safetensors"


def ema_decay(step: int, *, decay: float, start_step: int = 0, warmup: bool = False) -> float:
    """The decay d of the update after optimizer step ``step`` (counted from 1 over the run).

    d = 0 (the average copies the weights) for step <= ``start_step``; after it d = ``decay``, or with
    ``warmup`` d = min(decay, (1 + n) / (10 + n)), n = step - start_step (diffusers' EMAModel and
    flow_grpo's cap, so that the average of the first steps is not dominated by the initial weights).
    """
    if step <= start_step:
        return 0.0
    if warmup:
        n = step - start_step
        return min(decay, (1 + n) / (10 + n))
    return decay


def ema_due(step: int, *, start_step: int = 0, update_interval: int = 1) -> bool:
    """Whether the average is updated after optimizer step ``step``: every step up to ``start_step`` (it follows
    the weights there), then every ``update_interval``-th step after it."""
    return step <= start_step or (step - start_step) % update_interval == 0


@torch.no_grad()
def ema_update_(average: dict[str, torch.Tensor], params: dict[str, torch.Tensor], decay: float) -> None:
    """In place, for every name: ema = decay * ema + (1 - decay) * param.

    decay = 0 copies the parameter exactly (0 * ema + 1 * param); the average keeps its own dtype
    (fp32 for fp32 adapters), the parameter is cast to it.
    """
    if average.keys() != params.keys():
        missing, extra = sorted(average.keys() - params.keys()), sorted(params.keys() - average.keys())
        raise KeyError(f"the average and the parameters name different tensors: only averaged {missing[:3]}, "
                       f"only trained {extra[:3]}")
    for name, value in average.items():
        value.mul_(decay).add_(params[name].detach().to(value.dtype), alpha=1 - decay)


def trained_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The parameters the optimizer trains (``requires_grad``), by name."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class EMAWeights:
    """The average of ``model``'s trained parameters, with the settings of ``worker.actor.ema``.

    ``save_pretrained(directory)`` writes ``directory/ema.safetensors``: the run loop calls it with the
    checkpoint's ``model/`` directory while the checkpoint is still being written in its hidden
    temporary directory (the loop's ``save_extras`` hook), so the average
    is renamed into place with the rest, listed in the manifest and verified on resume.
    """

    def __init__(self, model, *, decay: float, start_step: int = 0, update_interval: int = 1, warmup: bool = False):
        self.model = model
        self.decay, self.start_step, self.update_interval, self.warmup = decay, start_step, update_interval, warmup
        self.average = {name: p.detach().clone() for name, p in trained_parameters(model).items()}
        self.last_decay = 0.0  # the decay of the last update (logged)

    @classmethod
    def from_config(cls, model, config) -> EMAWeights:
        return cls(model, decay=config.decay, start_step=config.start_step, update_interval=config.update_interval,
                   warmup=config.warmup)

    def update(self, step: int) -> bool:
        """After optimizer step ``step``: update the average if it is due (``ema_due``); whether it was."""
        if not ema_due(step, start_step=self.start_step, update_interval=self.update_interval):
            return False
        self.last_decay = ema_decay(step, decay=self.decay, start_step=self.start_step, warmup=self.warmup)
        ema_update_(self.average, trained_parameters(self.model), self.last_decay)
        return True

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self) -> Iterator[None]:
        """The model holds the average inside the block and its own weights (bit for bit) after it."""
        params = trained_parameters(self.model)
        kept = {name: p.detach().clone() for name, p in params.items()}
        try:
            for name, p in params.items():
                p.copy_(self.average[name])
            yield
        finally:
            for name, p in params.items():
                p.copy_(kept[name])

    def save_pretrained(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {name: value.detach().cpu().contiguous() for name, value in self.average.items()}
        save_file(tensors, str(directory / EMA_FILE), metadata={"format": "pt", "decay": repr(self.decay)})

    def load(self, checkpoint: Path) -> bool:
        """Restore the average from a checkpoint (``checkpoint/model/ema.safetensors``); False when it has none,
        and the average then starts again from the restored weights (with a warning)."""
        path = Path(checkpoint) / "model" / EMA_FILE
        if not path.exists():
            warnings.warn(f"checkpoint {checkpoint} holds no EMA weights ({EMA_FILE}, saved without "
                          "worker.actor.ema.enabled): the average starts again from the resumed weights", stacklevel=2)
            self.average = {name: p.detach().clone() for name, p in trained_parameters(self.model).items()}
            return False
        saved = load_file(str(path))
        if saved.keys() != self.average.keys():
            raise ValueError(f"{path} averages other tensors than this model trains (e.g. "
                             f"{sorted(saved.keys() ^ self.average.keys())[:3]})")
        for name, value in self.average.items():
            value.copy_(saved[name].to(value.device))
        return True
