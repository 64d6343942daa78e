"""The one update loop: epochs over mini-batches of micro-batches, for every trainer.

GRPO, SFT (and the flow trainer to come) differ only in how a micro-batch is scored
(``log_prob_fn``) and what loss it gives (``loss_fn``). Everything else lives here
once: exact global normalisers across micro-batches and processes, compute
precision, when gradients are reduced across processes, clipping, skipping
non-finite steps, and how the loss is reported.

A batch is anything with ``len()``, ``select(rows)`` and a ``loss_mask`` [B, T]
(``RolloutBatch``); one that also has ``prompt_mask`` and ``response_mask`` can be cut
into micro-batches by token count (``UpdateSettings.token_budget``, see
``trainer.micro_batches``). Every process must hold the same number of rows: under FSDP each
forward and backward is a collective, and under DDP each mini-batch must end in one
gradient reduction on every process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grouprl.rollout.logprobs import pad_fraction
from grouprl.trainer.metrics import StepMetrics
from grouprl.trainer.micro_batches import plan_micro_batches, row_token_counts
from grouprl.trainer.parallel import clip_grad_norm, gradient_sync
from grouprl.trainer.precision import Precision


@dataclass(frozen=True)
class Normalisers:
    """Totals of the whole mini-batch over all processes (see ``algorithms.aggregation``).

    With them the micro-batch losses of all processes add up to the mini-batch loss,
    in value and in gradient.
    """

    num_tokens: float  # loss-mask tokens
    num_seqs: float  # rows
    norm_len: float  # the constant C of seq-mean-token-sum-norm

    def as_options(self) -> dict[str, float]:
        return {"num_tokens": self.num_tokens, "num_seqs": self.num_seqs, "norm_len": self.norm_len}


# (model, micro_batch) -> (log_prob [b, T] differentiable, entropy [b, T] or None)
LogProbFn = Callable[[Any, Any], tuple[torch.Tensor, torch.Tensor | None]]
# (micro_batch, log_prob, entropy, normalisers, metrics) -> (loss, {name: part of the loss to report})
LossFn = Callable[[Any, torch.Tensor, torch.Tensor | None, Normalisers, StepMetrics],
                  tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class UpdateSettings:
    num_minibatches: int = 1  # optimizer steps per epoch
    epochs: int = 1
    micro_batch_size: int = 4  # rows per forward/backward
    max_grad_norm: float = 1.0
    norm_len: float = 1.0
    # Tokens (prompt + response, padding not counted) per micro-batch: micro-batches are then
    # filled by tokens and ``micro_batch_size`` is not used (dynamic batching, for batches with
    # prompt_mask / response_mask). None: ``micro_batch_size`` rows each.
    token_budget: int | None = None
    # the log-prob function packs each micro-batch's rows (worker.actor.padding_free): for perf/pad_fraction
    padding_free: bool = False


def minibatch_rows(num_rows: int, num_minibatches: int) -> list[torch.Tensor]:
    """Row indices of each mini-batch: contiguous, sizes differing by at most one.

    Exactly ``min(num_minibatches, num_rows)`` non-empty parts (``Tensor.chunk`` can
    return fewer parts than asked, which changed the number of optimizer steps).
    """
    parts = max(1, min(num_minibatches, num_rows))
    return [rows for rows in torch.arange(num_rows).tensor_split(parts) if len(rows)]


def check_same_rows(num_rows: int, accelerator) -> None:
    """Fail on every process, instead of hanging, when the processes hold different numbers of rows."""
    if accelerator.num_processes == 1:
        return
    counts = torch.tensor([num_rows, -num_rows], dtype=torch.int64, device=accelerator.device)
    torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
    if int(counts[0]) != num_rows or int(counts[1]) != -num_rows:
        raise RuntimeError(f"process {accelerator.process_index} holds {num_rows} rows for the update, others "
                           f"between {-int(counts[1])} and {int(counts[0])}; every process must hold the same number")


def global_normalisers(mini, accelerator, norm_len: float) -> Normalisers:
    counts = torch.tensor([float(mini.loss_mask.sum()), float(len(mini))], dtype=torch.float64,
                          device=accelerator.device)
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(counts)
    # An all-masked mini-batch has a zero token total; its losses are 0 anyway.
    return Normalisers(num_tokens=max(float(counts[0]), 1.0), num_seqs=float(counts[1]), norm_len=norm_len)


def run_update(
    model,
    optimizer: torch.optim.Optimizer,
    batch,
    *,
    log_prob_fn: LogProbFn,
    loss_fn: LossFn,
    accelerator,
    precision: Precision,
    settings: UpdateSettings,
    metrics: StepMetrics,
    prefix: str = "actor",
    on_step_end: Callable[[], None] | None = None,
) -> int:
    """Train ``model`` on ``batch``; returns the number of optimizer steps taken.

    For each epoch, the rows are cut into mini-batches (one optimizer step each) and
    each mini-batch into micro-batches of ``settings.micro_batch_size`` rows, or of at
    most ``settings.token_budget`` tokens when set and the batch has ``prompt_mask`` /
    ``response_mask`` (``trainer.micro_batches.plan_micro_batches``; every process then
    takes the same number), whose losses are backpropagated one at a time. ``loss_fn``
    must aggregate with the mini-batch ``Normalisers`` so that the micro-batch losses of all processes sum to
    the mini-batch loss; the backward pass multiplies by the number of processes
    because DDP and FSDP average gradients over them.

    Reported: ``perf/micro_batches`` per optimizer step and, for token rows,
    ``perf/pad_fraction``, the share of padding in the positions the forwards compute
    (0 when ``settings.padding_free``: ``log_prob_fn`` then packs the rows).
    Under ``prefix``: each part ``loss_fn`` names, summed over micro-batches
    and processes (its true value) and averaged over optimizer steps; ``grad_norm``;
    ``nonfinite_grad_steps``, optimizer steps skipped because the gradient norm was not
    finite (the gradients are dropped and the weights left as they were).
    ``on_step_end`` is called after each optimizer step, taken or skipped, on every process
    together (the entropy controller's update, ``trainer.entropy_control``).
    """
    world = accelerator.num_processes
    check_same_rows(len(batch), accelerator)
    plan = [rows for _ in range(settings.epochs) for rows in minibatch_rows(len(batch), settings.num_minibatches)]
    device = accelerator.device
    has_tokens = hasattr(batch, "prompt_mask") and hasattr(batch, "response_mask")
    by_tokens = settings.token_budget is not None and has_tokens
    # the flow trainer's rows have no tokens: the budget does not apply to them
    tokens = row_token_counts(batch) if by_tokens else None
    steps = skipped = 0
    model.train()
    try:
        for mb_rows in plan:
            mini = batch.select(mb_rows)
            norms = global_normalisers(mini, accelerator, settings.norm_len)
            # Composition does not change the loss: every micro-batch divides by the mini-batch totals.
            if by_tokens:
                micro = plan_micro_batches(tokens[mb_rows], rows_per_micro_batch=settings.micro_batch_size,
                                           token_budget=settings.token_budget, accelerator=accelerator)
            else:
                micro = list(torch.arange(len(mini)).split(settings.micro_batch_size))
            metrics.mean("perf/micro_batches", float(len(micro)))
            if has_tokens:
                metrics.mean("perf/pad_fraction", pad_fraction(mini.prompt_mask, mini.response_mask, micro,
                                                               padding_free=settings.padding_free))
            for i, rows in enumerate(micro):
                part = mini.select(rows)
                with gradient_sync(model, accelerator, enabled=i == len(micro) - 1):
                    with precision.autocast(device):
                        log_prob, entropy = log_prob_fn(model, part)
                    loss, reported = loss_fn(part, log_prob.float(), entropy, norms, metrics)
                    (loss * world).backward()
                for name, value in reported.items():
                    metrics.sum(f"{prefix}/{name}", float(value) / len(plan))
            grad_norm = clip_grad_norm(model, accelerator, settings.max_grad_norm)
            finite = math.isfinite(grad_norm)
            if finite:
                optimizer.step()
                steps += 1
            else:
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            metrics.mean(f"{prefix}/grad_norm", grad_norm if finite else math.nan, 1.0 if finite else 0.0)
            if on_step_end is not None:
                on_step_end()
    finally:
        model.eval()
    # the norm is global, so every process skipped the same steps: a mean keeps the count
    metrics.mean(f"{prefix}/nonfinite_grad_steps", float(skipped))
    return steps
