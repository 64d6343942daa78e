"""Per-sample report scores ("reward components") by name, shared by rewards, the server and `grouprl eval`.

A component scores a batch of generated reports (hyps) against references:
``fn(hyps: list[str], refs: list[str]) -> list[float]``, one value per pair,
higher is better unless its entry says otherwise. Each component records the
backend that produced it (e.g. ``labeler=rules``), so a score is never passed off
as coming from a model it did not come from. EditGRPO's reward server names
(``radgraphf1``, ``cxb14micro``, ``ratescore``, ``cxb_bal_acc``) are component
names here.

Components that share work (a text's graph, its labels) mark the functions that
do it :func:`~grouprl.domains.radiology.rewards.batch_parses.batch_cached`: run several
components inside one ``batch_scope()`` (as :func:`score_components` does) and
each distinct text is parsed once for all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from grouprl.registry import Registry
from grouprl.domains.radiology.rewards.batch_parses import batch_scope

ComponentFn = Callable[[list[str], list[str]], list[float]]


@dataclass(frozen=True)
class Component:
    """A registered score function with what a report of its values needs: where it came from
    (``backend``), one line saying what it measures, and its direction."""

    name: str
    fn: ComponentFn
    backend: str  # e.g. "labeler=rules", "encoder=all-MiniLM-L6-v2"
    description: str = ""
    higher_is_better: bool = True


COMPONENTS: Registry[Component] = Registry("report score component", error=KeyError)


def register_component(name: str, *, backend: str, description: str = "", higher_is_better: bool = True,
                       overwrite: bool = False):
    """Decorator: register ``fn(hyps, refs) -> list[float]`` under ``name``, as a :class:`Component`.

    The same function with the same metadata may be registered again (a module imported
    twice); anything else under a taken name is a ValueError unless ``overwrite=True``.
    The description defaults to the first line of the function's docstring.
    """

    def wrap(fn: ComponentFn) -> ComponentFn:
        first_line = (fn.__doc__ or "").strip().split("\n")[0]
        COMPONENTS.register(name, Component(name, fn, backend, description or first_line, higher_is_better),
                            overwrite=overwrite)
        return fn

    return wrap


def get_component(name: str) -> Component:
    """The component registered as ``name``; KeyError naming the known ones (and the closest) otherwise."""
    return COMPONENTS.get(name)


def score_components(hyps: Sequence[str], refs: Sequence[str], names: Sequence[str]) -> dict[str, list[float]]:
    """Score every (hyp, ref) pair with each named component, one batched call per component.

    Only the named components are computed, all in one :func:`batch_scope`, so each
    distinct text is parsed and labelled once for all of them.
    """
    if len(hyps) != len(refs):
        raise ValueError(f"got {len(hyps)} hypotheses for {len(refs)} references")
    components = [get_component(n) for n in names]  # fail on a bad name before any work
    hyps, refs = list(hyps), list(refs)
    out = {}
    with batch_scope():
        for component in components:
            values = component.fn(hyps, refs)
            if len(values) != len(hyps):
                raise ValueError(f"component {component.name!r} returned {len(values)} scores for {len(hyps)} pairs")
            out[component.name] = [float(v) for v in values]
    return out
