"""What the report score components derive from the texts of one scoring batch, shared among them.

A reward request scores one batch with several components (EditGRPO's request reads
RadGraph-style F1, precision and recall, six CheXpert-label scores and the
RaTEScore-style score), and a GRPO batch repeats each reference once per rollout.
The components need the same few things of each text: its graph, its CheXpert
labels, its entity key sets. Inside one :func:`batch_scope` each of those is
computed once per distinct text for every component, instead of once per component
call or per pair::

    with batch_scope():
        f1 = get_component("radgraphf1").fn(hyps, refs)
        micro = get_component("cxb14micro").fn(hyps, refs)   # graphs and labels reused

Functions that share their results this way are marked :func:`batch_cached`:
``entities.graph_of`` (which the RaTEScore-style and KG scores reach through their
own text-keyed caches), ``label_metrics.report_labels`` and ``binary_labels``, and
``radgraph_f1.text_entity_keys``. Outside any scope they compute directly, so a
component called alone opens a scope for its own batch (a ``with batch_scope():``
inside a component reuses its caller's scope when there is one).
``score_components`` runs its components in one scope.

Why a scope and not a process-wide cache: a scope lives exactly as long as its
batch, so it holds every distinct text of the batch however large the batch is (an
LRU cache smaller than the batch misses on every lookup as the components take
turns over it) and nothing after it (every GRPO step brings new responses: a global
cache of derived results would only grow). The bounded text-keyed LRU caches under
it stay (``entities`` keeps 8192 graphs, ``ratescore`` the RaTE entities and
similarities): references recur across requests, and the editor looks texts up one
at a time.

The scope is a context variable: each thread (each server scoring thread) sees
only its own. Cached values are shared, not copied: callers must not mutate them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")
_MISSING = object()  # None is a result like any other


class BatchParses:
    """The memo tables of one batch: for each :func:`batch_cached` function, its arguments -> its result
    (a one-argument function's table is keyed by the argument itself)."""

    __slots__ = ("tables",)

    def __init__(self) -> None:
        self.tables: dict[Callable, dict[Any, Any]] = {}

    def entries(self, fn: Callable | None = None) -> int:
        """How many results are held (of ``fn`` alone when given; ``fn`` is the undecorated function)."""
        if fn is not None:
            return len(self.tables.get(fn, ()))
        return sum(len(table) for table in self.tables.values())


_ACTIVE: ContextVar[BatchParses | None] = ContextVar("grouprl_batch_parses", default=None)


def active_scope() -> BatchParses | None:
    """The scope the current thread is scoring in, or None."""
    return _ACTIVE.get()


@contextmanager
def batch_scope() -> Iterator[BatchParses]:
    """Share derived results among every component call inside the block (one batch).

    Nested scopes are one scope: a component that opens its own inside a caller's
    scope reuses the caller's. The results are dropped when the outermost block ends.
    """
    active = _ACTIVE.get()
    if active is not None:
        yield active
        return
    scope = BatchParses()
    token = _ACTIVE.set(scope)
    try:
        yield scope
    finally:
        _ACTIVE.reset(token)


def batch_cached(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn(*args)`` memoised in the active :func:`batch_scope` by its (hashable) arguments.

    ``fn`` must be a pure function of its arguments: the whole text is the key, so
    two texts share a result only when they are equal. Outside a scope each call
    computes afresh. The undecorated function stays reachable as ``__wrapped__``.
    """

    @functools.wraps(fn)
    def cached(*args: Any) -> T:
        scope = _ACTIVE.get()
        if scope is None:
            return fn(*args)
        table = scope.tables.get(fn)
        if table is None:
            table = scope.tables[fn] = {}
        # one argument (a text): the text is the key, with no tuple for the garbage collector to count
        key = args[0] if len(args) == 1 else args
        value = table.get(key, _MISSING)
        if value is _MISSING:
            value = table[key] = fn(*args)
        return value

    return cached


__all__ = ["BatchParses", "active_scope", "batch_cached", "batch_scope"]
