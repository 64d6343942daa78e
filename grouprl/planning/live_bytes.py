"""Bytes of live tensors, measured: what the memory plan's predictions are checked against.

On a GPU ``torch.cuda.max_memory_allocated`` measures a step; a CPU has no such counter (its
resident set also holds Python, torch and the allocator's cache), so the plan's parts are
checked on the CPU against the tensors themselves:

- ``storage_bytes(tensors)``: the bytes of the storages of some tensors, each storage once
  (tied embeddings, views and shared copies are not counted twice);
- ``LiveTensors``: a ``TorchDispatchMode`` that sees every tensor an operation creates while
  it is active and follows its storage until it is freed (a weak reference to the storage),
  so it knows the bytes created inside it that are still alive (``current``: after a forward,
  what autograd keeps for the backward) and their most at any moment (``peak``: the transient
  logits of a log-prob chunk).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """``sum(storage.nbytes())`` over the distinct storages of ``tensors`` (meta tensors hold none)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if t.device.type == "meta" or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


class LiveTensors(TorchDispatchMode):
    """Bytes of the tensors created inside the ``with`` block that are alive now (``current``) and at most (``peak``).

    Storages that existed before the block (parameters, inputs) and the views and in-place
    results that share them are not counted: only what the block's operations allocated.
    """

    def __init__(self):
        super().__init__()
        self._alive: dict[int, tuple[weakref.ref, int]] = {}
        self.current = 0
        self.peak = 0

    def _freed(self, key: int, size: int) -> None:
        if key in self._alive:
            del self._alive[key]
            self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self._alive or key in inputs:
                continue  # a view, an in-place result or a storage from before the block
            ref = weakref.ref(storage, lambda _, key=key, size=size: self._freed(key, size))
            self._alive[key] = (ref, size)
            self.current += size
            self.peak = max(self.peak, self.current)
        return out
