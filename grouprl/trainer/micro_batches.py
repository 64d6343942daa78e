"""How a mini-batch is cut into micro-batches: a fixed number of rows, or by token count.

Pure planning: these functions only choose row positions; ``trainer.update.run_update``
selects and trains on them. Which rows share a micro-batch never changes the loss or its
gradient, because every micro-batch loss is divided by the totals of the whole mini-batch
(``trainer.update.Normalisers``); only memory use and speed depend on the plan.

Dynamic batching (EasyR1's ``worker.actor.dynamic_batching``): rows differ a lot in length
(prompt tokens + response tokens), so micro-batches of a fixed number of rows are either
mostly padding or, for the longest rows, too large. With a token budget, micro-batches are
filled by tokens instead: few long rows or many short ones, each micro-batch holding at most
``token_budget`` tokens.

Across processes every process must run the same number of micro-batches: under DDP the
backward of each one is a point where gradients may be reduced, and under FSDP every
forward and backward is a collective. Processes plan their own rows, so the counts are
agreed with an all-reduce (see :func:`plan_micro_batches`).
"""

from __future__ import annotations

import heapq
import math

import torch


def row_token_counts(batch) -> torch.Tensor:
    """Real tokens of each row, prompt + response: ``prompt_mask.sum(1) + response_mask.sum(1)`` [B], int64.

    ``batch`` is a ``RolloutBatch`` (anything with ``prompt_mask`` [B, P] and ``response_mask``
    [B, R]). Padding is not counted: it is what the token budget is meant to bound apart from.
    """
    return (batch.prompt_mask.sum(1) + batch.response_mask.sum(1)).to(torch.int64)


def plan_micro_batches(token_counts: torch.Tensor, *, rows_per_micro_batch: int,
                       token_budget: int | None = None, accelerator=None) -> list[torch.Tensor]:
    """Row positions (into ``token_counts``) of each micro-batch; every row in exactly one.

    ``token_budget=None``: contiguous micro-batches of ``rows_per_micro_batch`` rows, the last
    one shorter (``torch.arange(n).split(rows_per_micro_batch)``).

    With ``token_budget`` (``rows_per_micro_batch`` is then not used), the rule is:

    1. a row of more than ``token_budget`` tokens goes alone;
    2. the other rows are packed by LPT (longest processing time first): sorted by length,
       longest first (ties: lower position first), each goes to the least-loaded bin (ties:
       the lower bin), with ``m`` bins, for the smallest ``m >= ceil(tokens / token_budget)``
       at which no bin exceeds the budget (LPT always fits with one row per bin, so such an
       ``m`` exists; it is the fewest bins for LPT, not necessarily for an optimal packing);
    3. across processes (``accelerator.num_processes > 1``), the number of micro-batches is
       ``K = max`` over processes (one all-reduce); a process with fewer splits its
       most-loaded bin of two rows or more into two (by LPT again) until it has ``K``.
       Splitting never raises a bin's load, so the budget still holds. Every process holds
       the same number of rows, so ``K <= rows``.

    Rows inside a micro-batch are in ascending position order; micro-batches are ordered by
    their first row. The plan depends only on the counts (and ``K``): deterministic.

    Returns a list of 1-D int64 tensors. Raises ValueError for ``rows_per_micro_batch < 1``,
    ``token_budget < 1``, counts that are not a 1-D tensor of non-negative integers, and
    RuntimeError when another process needs more micro-batches than this one has rows.
    """
    if isinstance(rows_per_micro_batch, bool) or not isinstance(rows_per_micro_batch, int) \
            or rows_per_micro_batch < 1:
        raise ValueError(f"rows_per_micro_batch must be an integer >= 1, got {rows_per_micro_batch!r}")
    if token_budget is not None and (isinstance(token_budget, bool) or not isinstance(token_budget, int)
                                     or token_budget < 1):
        raise ValueError(f"token_budget must be None or an integer >= 1 (tokens per micro-batch), "
                         f"got {token_budget!r}")
    if not isinstance(token_counts, torch.Tensor) or token_counts.dim() != 1:
        raise ValueError(f"token_counts must be a 1-D tensor of tokens per row, got "
                         f"{getattr(token_counts, 'shape', type(token_counts).__name__)}")
    if token_counts.is_floating_point() or token_counts.is_complex() or bool((token_counts < 0).any()):
        raise ValueError("token_counts must hold non-negative integers (tokens per row)")
    n = len(token_counts)
    if token_budget is None:
        # Every process holds the same rows, hence the same count: nothing to agree on.
        return list(torch.arange(n).split(rows_per_micro_batch))

    counts = [int(c) for c in token_counts.tolist()]
    bins = _pack(counts, token_budget)
    if accelerator is not None and accelerator.num_processes > 1:
        # Every process must call this collective, whatever its own rows: no early return above.
        agreed = torch.tensor([len(bins)], dtype=torch.int64, device=accelerator.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        target = int(agreed[0])
        if target > n:
            raise RuntimeError(f"process {accelerator.process_index} holds {n} rows but another process plans "
                               f"{target} micro-batches; every process must hold the same number of rows")
        bins = _split_to(bins, counts, target)
    bins.sort(key=lambda rows: rows[0])
    return [torch.tensor(rows, dtype=torch.int64) for rows in bins]


def _lpt(rows: list[int], counts: list[int], m: int) -> tuple[list[list[int]], int]:
    """``rows`` spread over ``m`` bins by LPT: (bins, rows ascending in each; largest load)."""
    order = sorted(rows, key=lambda r: (-counts[r], r))
    # (load, rows, bin): the least-loaded bin pops first, then the one with fewer rows (so that
    # rows of 0 tokens still fill every bin while rows >= m), then the lowest
    heap = [(0, 0, b) for b in range(m)]
    bins: list[list[int]] = [[] for _ in range(m)]
    for r in order:
        load, size, b = heapq.heappop(heap)
        bins[b].append(r)
        heapq.heappush(heap, (load + counts[r], size + 1, b))
    return [sorted(b) for b in bins if b], max(load for load, _, _ in heap)


def _pack(counts: list[int], budget: int) -> list[list[int]]:
    """Fewest LPT bins within ``budget``; each row over the budget alone (rule 1 and 2)."""
    alone = [[r] for r, c in enumerate(counts) if c > budget]
    rest = [r for r, c in enumerate(counts) if c <= budget]
    if not rest:
        return alone
    # No packing into fewer bins than the tokens need; LPT may need a few more than that bound.
    m = max(1, math.ceil(sum(counts[r] for r in rest) / budget))
    while True:
        bins, largest = _lpt(rest, counts, m)
        if largest <= budget:  # reached at m = len(rest) at the latest: one row per bin
            return alone + bins
        m += 1


def _split_to(bins: list[list[int]], counts: list[int], target: int) -> list[list[int]]:
    """Split the most-loaded bin of two or more rows into two until there are ``target`` bins (rule 3)."""
    bins = [list(b) for b in bins]
    while len(bins) < target:
        # a one-row bin cannot be split; with fewer bins than rows some bin has two
        splittable = [i for i, b in enumerate(bins) if len(b) > 1]
        heaviest = max(splittable, key=lambda i: (sum(counts[r] for r in bins[i]), -bins[i][0]))
        halves, _ = _lpt(bins.pop(heaviest), counts, 2)
        bins.extend(halves)
    return bins
