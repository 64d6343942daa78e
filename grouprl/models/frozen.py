"""A frozen model (never trained) that may live in host memory between its uses: the reference
policy (``worker.ref.offload.offload_params``) and on-policy distillation's teacher
(``algorithm.teacher.offload``).

Offloading changes where the weights wait, never what they compute: the same tensors, moved whole
to the accelerator for a forward and back to the CPU after it. The GPU then holds them only while
they run (the peak still includes the whole model for its forward), and each use costs two copies
over the host link.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class FrozenModel:
    """``model`` with ``requires_grad`` False, in eval mode, used through :meth:`on_device`.

    ``offload``: the weights live on the CPU and visit ``device`` for each use; otherwise they stay
    on ``device``. ``location`` is where they are now.
    """

    def __init__(self, model: torch.nn.Module, *, device: torch.device | str, offload: bool = False):
        self.model = model.requires_grad_(False).eval()
        self.device, self.offload = torch.device(device), offload
        self._move(torch.device("cpu") if offload else self.device)

    def _move(self, where: torch.device) -> None:
        self.model.to(where)
        self.location = where

    @contextlib.contextmanager
    def on_device(self) -> Iterator[torch.nn.Module]:
        """The model on ``device`` for the block; back on the CPU after it (also when the block raises)
        when offloading."""
        if self.offload:
            self._move(self.device)
        try:
            yield self.model
        finally:
            if self.offload:
                self._move(torch.device("cpu"))
