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


def update_forward_bytes(model, *, rows: int, prompt: int, response: int, mixed: bool, padding_free: bool,
                         chunk_tokens: int, seed: int = 0) -> int:
    """Bytes a real update forward keeps for its backward: grouprl's ``forward_response_log_probs`` with
    gradients (the entropy metric on, as the update runs it) over ``rows`` random rows of ``prompt`` +
    ``response`` tokens, one of them left-padded by two tokens (a padded batch carries an attention mask),
    under bf16 autocast when ``mixed``. The backward then runs, so the graph measured is the one trained.
    """
    from grouprl.rollout.logprobs import forward_response_log_probs

    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(5, vocab, (rows, prompt), generator=g)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    prompt_mask[0, :2] = 0
    response_ids = torch.randint(5, vocab, (rows, response), generator=g)
    response_mask = torch.ones(rows, response, dtype=torch.long)
    context = torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed)
    with context, LiveTensors() as live:
        log_probs, _ = forward_response_log_probs(model, prompt_ids, prompt_mask, response_ids, response_mask, {},
                                                  with_entropy=True, padding_free=padding_free,
                                                  chunk_tokens=chunk_tokens)
        held = live.current
    log_probs.sum().backward()
    return held


def logprob_chunk_peak(*, positions: int, hidden: int, vocab: int, chunk_tokens: int, backward: bool,
                       with_entropy: bool, mixed: bool, seed: int = 0) -> int:
    """The most bytes alive while grouprl's ``score_positions`` takes log-probs of ``positions`` random hidden
    states through a random ``[vocab, hidden]`` output layer, ``chunk_tokens`` at a time (and, with
    ``backward``, back through them)."""
    from grouprl.rollout.logprobs import score_positions

    dtype = torch.bfloat16 if mixed else torch.float32
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(positions, hidden, generator=g).to(dtype).requires_grad_(backward)
    head = torch.randn(vocab, hidden, generator=g).to(dtype)
    targets = torch.randint(0, vocab, (positions,), generator=g)
    with torch.set_grad_enabled(backward), LiveTensors() as live:
        log_probs, _ = score_positions(states, targets, lambda h: torch.nn.functional.linear(h, head),
                                       with_entropy=with_entropy, chunk_tokens=chunk_tokens)
        if backward:
            log_probs.sum().backward()
    return live.peak
