"""The options an algorithm takes, declared by the algorithm: a small dataclass registered with it.

Each advantage estimator and policy loss is registered with its options class
(``register_policy_loss("gspo", options=GSPOOptions)``). The class's fields are the
function's keyword parameters that a user sets (clip ranges, temperatures, the std level);
its defaults are the algorithm's defaults. The config validates an algorithm's options
against its class by name (``algorithm.policy_loss_options``,
``algorithm.adv_estimator_options``), and the trainer passes them through unchanged, so a
new algorithm is one function plus one registration: no trainer code names it.

Everything else a function takes is an input the trainer computes at run time (tensors such
as ``response_mask``, ``token_rewards``, ``baseline_scores``, ``batch_std``): never an option.
A function registered without an options class gets one made from its keyword-only
parameters that have defaults, less those inputs.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options class of an algorithm that takes none."""


def options_from_signature(fn: Callable, *, inputs: Iterable[str], name: str) -> type:
    """A dataclass of ``fn``'s keyword-only parameters with defaults, less the run-time ``inputs``.

    For an algorithm registered without an options class: its options are what a user could
    set, and a keyword parameter without a default is an input the caller must provide.
    """
    skipped = set(inputs)
    spec = [
        (p.name, Any, dataclasses.field(default=p.default))
        for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty
        and p.name not in skipped
    ]
    if not spec:
        return NoOptions
    return dataclasses.make_dataclass(f"{name}_options", spec, frozen=True)


def check_options_class(kind: str, name: str, fn: Callable, options: type) -> None:
    """``options`` is a dataclass whose every field is a keyword parameter of ``fn``; TypeError otherwise.

    Checked at registration, so that a field the function would reject is found when the
    algorithm is registered, not in the middle of a run.
    """
    if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise TypeError(f"{kind} {name!r}: options must be a dataclass type; got {options!r}")
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [f.name for f in dataclasses.fields(options) if f.name not in params and not takes_any]
    if missing:
        raise TypeError(f"{kind} {name!r}: its options class {options.__name__} has field(s) "
                        f"{', '.join(missing)} that the function does not take")


def register_with_options(registry, table: dict[str, type], *, kind: str, name: str, options: type | None,
                          inputs: Iterable[str], overwrite: bool) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` in ``registry`` under ``name`` and its options class in ``table``:
    ``options``, or one made from ``fn``'s signature (less the run-time ``inputs``), checked against ``fn``."""
    def decorator(fn: Callable) -> Callable:
        cls = options if options is not None else options_from_signature(fn, inputs=inputs, name=name)
        check_options_class(kind, name, fn, cls)
        registry.register(name, fn, overwrite=overwrite)
        table[name] = cls
        return fn

    return decorator


def option_names(options: type) -> list[str]:
    """The option names of an options class, in declaration order."""
    return [f.name for f in dataclasses.fields(options)]


def option_defaults(options: type) -> dict[str, Any]:
    """Each option's default (every field of a registered options class has one)."""
    out = {}
    for f in dataclasses.fields(options):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def unknown_option_message(kind: str, name: str, options: type, unknown: str) -> str:
    """'<kind> <name> takes no option <unknown>' with its options and the closest name."""
    names = option_names(options)
    close = difflib.get_close_matches(unknown, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    takes = f"its options are {', '.join(names)}" if names else "it takes no options"
    return f"{kind} {name!r} takes no option {unknown!r} ({takes}){hint}"


def split_options(kind: str, name: str, options: type, given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` checked against ``options`` by name; TypeError naming the algorithm and the first unknown option."""
    allowed = set(option_names(options))
    for key in given:
        if key not in allowed:
            raise TypeError(unknown_option_message(kind, name, options, key))
    return dict(given)
