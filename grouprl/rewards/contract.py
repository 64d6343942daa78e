"""The reward contract, and combining several rewards into one weighted score per row.

A reward function (compatible with TRL's reward functions) is a callable::

    f(prompts: list[str], completions: list[str], **columns) -> list[float | None]

called with keyword arguments. ``columns`` are per-row lists: the dataset's fields
(``answer``, ...) plus rollout extras. A function must accept ``**kwargs`` for the
columns it ignores. ``None`` means "not applicable to this row". ``async def``
functions (or any callable returning an awaitable) are allowed; the async rewards of
a set run concurrently.

Failures are never turned into a score: an exception, a wrong number of values, a
non-number or a NaN/inf raises :class:`RewardError` naming the reward (and the row).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

from grouprl.rewards.registry import RewardLoadError, get_reward

# Keyword names the contract itself uses; a column or option by these names would be ambiguous.
_RESERVED = ("prompts", "completions")


class RewardError(RuntimeError):
    """A reward function failed or broke the contract while scoring.

    ``reward`` is the component key (``None`` for errors about a row as a whole) and
    ``row`` the row index when the problem is one row's value.
    """

    def __init__(self, message: str, *, reward: str | None = None, row: int | None = None):
        super().__init__(message)
        self.reward = reward
        self.row = row


@dataclass
class RewardSpec:
    """One reward of a set, as written in config.

    ``name`` is a registered name, ``path/to/file.py:function`` or ``module:function``;
    ``kwargs`` are options bound to the function (``functools.partial``) when it is
    loaded, e.g. ``RewardSpec("format", kwargs={"style": "boxed"})``.
    """

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise RewardLoadError(f"reward spec name must be a non-empty string, got {self.name!r}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)):
            raise RewardLoadError(f"reward {self.name!r}: weight must be a number, got {self.weight!r}")
        self.weight = float(self.weight)
        if not math.isfinite(self.weight):
            raise RewardLoadError(f"reward {self.name!r}: weight must be finite, got {self.weight}")
        if not isinstance(self.kwargs, Mapping) or not all(isinstance(k, str) for k in self.kwargs):
            raise RewardLoadError(f"reward {self.name!r}: kwargs must be a mapping of option names to values")
        self.kwargs = dict(self.kwargs)

    @classmethod
    def coerce(cls, spec: "RewardSpec | str | Mapping[str, Any]") -> "RewardSpec":
        """A RewardSpec from itself, a bare reference string, or a config mapping {name, weight, kwargs}."""
        if isinstance(spec, RewardSpec):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, Mapping):
            unknown = sorted(set(spec) - {"name", "weight", "kwargs"})
            if unknown:
                raise RewardLoadError(
                    f"reward spec {dict(spec)!r} has unknown keys {unknown}; allowed: name, weight, kwargs"
                )
            if "name" not in spec:
                raise RewardLoadError(f"reward spec {dict(spec)!r} has no 'name'")
            return cls(spec["name"], spec.get("weight", 1.0), spec.get("kwargs") or {})
        raise RewardLoadError(
            f"a reward spec must be a RewardSpec, a name string or a mapping, got {type(spec).__name__}"
        )


@dataclass(frozen=True)
class RewardComponent:
    """A loaded reward: its key in results, the function (options bound) and its weight."""

    key: str
    fn: Callable[..., Any]
    weight: float
    spec: RewardSpec | None = None

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.fn.keywords) if isinstance(self.fn, functools.partial) else {}


@dataclass
class RewardResult:
    """The scores of one batch: each component's per-row values and the weighted total.

    ``total[i] = sum(weights[k] * components[k][i])`` over the components that are not
    ``None`` at row ``i``; ``None`` where no component applies (only when the set was
    asked to allow unscored rows).
    """

    components: dict[str, list[float | None]]
    total: list[float | None]
    weights: dict[str, float]

    def __len__(self) -> int:
        return len(self.total)

    def metrics(self) -> dict[str, float]:
        """Logging metrics named like TRL's.

        Per component: ``rewards/{key}/mean`` and ``rewards/{key}/std`` over the rows where
        it applies, and ``rewards/{key}/applicable_frac``; then ``reward/mean`` and
        ``reward/std`` of the total. Stds are population stds (defined for one row). A
        component that applies to no row of the batch gets no mean/std rather than NaN
        (a trainer logging over several processes needs every key every step: it records
        the same statistics with their counts instead, see ``trainer.grpo.record_rewards``).
        """
        out: dict[str, float] = {}
        n = len(self.total)
        for key, values in self.components.items():
            applicable = [v for v in values if v is not None]
            if applicable:
                out[f"rewards/{key}/mean"], out[f"rewards/{key}/std"] = _mean_std(applicable)
            out[f"rewards/{key}/applicable_frac"] = len(applicable) / n if n else 0.0
        scored = [t for t in self.total if t is not None]
        if scored:
            out["reward/mean"], out["reward/std"] = _mean_std(scored)
        return out


def reward_keys(names: Sequence[str]) -> list[str]:
    """Each reward's key in results: its name, or ``name@i`` (``i`` its position) for a name used
    more than once, so that two uses of one reward with other options stay apart."""
    return [f"{name}@{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


class RewardSet:
    """Several rewards combined with weights; :meth:`score` runs them on a batch."""

    def __init__(self, components: Sequence[RewardComponent]):
        if not components:
            raise RewardLoadError("a reward set needs at least one reward")
        keys = [c.key for c in components]
        if len(set(keys)) != len(keys):
            raise RewardLoadError(f"reward keys must be unique, got {keys}")
        self.components = list(components)

    @classmethod
    def from_specs(cls, specs: Iterable["RewardSpec | str | Mapping[str, Any] | Callable[..., Any]"]) -> "RewardSet":
        """Load every spec (a RewardSpec, a reference string, a config mapping, or a function).

        Keys are the spec names; a name used more than once gets ``name@i`` for every use,
        ``i`` being its position in ``specs``. A plain function is keyed by its ``__name__``.
        """
        items = list(specs)
        loaded: list[tuple[str, Callable[..., Any], float, RewardSpec | None]] = []
        for item in items:
            if callable(item) and not isinstance(item, (str, RewardSpec)):
                name = getattr(item, "__name__", type(item).__name__)
                _check_signature(name, item, {})
                loaded.append((name, item, 1.0, None))
                continue
            spec = RewardSpec.coerce(item)
            fn = get_reward(spec.name)
            _check_signature(spec.name, fn, spec.kwargs)
            bound = functools.partial(fn, **spec.kwargs) if spec.kwargs else fn
            loaded.append((spec.name.strip(), bound, spec.weight, spec))
        keys = reward_keys([name for name, *_ in loaded])
        return cls([RewardComponent(key, fn, weight, spec) for key, (_, fn, weight, spec) in zip(keys, loaded)])

    @property
    def keys(self) -> list[str]:
        return [c.key for c in self.components]

    @property
    def weights(self) -> dict[str, float]:
        return {c.key: c.weight for c in self.components}

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], columns: Mapping[str, Sequence[Any]] | None = None,
        *, allow_unscored: bool = False,
    ) -> RewardResult:
        """Score a batch. Sync rewards run in order in this thread; async ones run concurrently.

        Safe to call from inside a running event loop (a notebook, an async server): the
        async rewards then run on a fresh loop in a worker thread, so async rewards must
        not depend on objects bound to the caller's loop. From async code prefer
        :meth:`ascore`.

        A row to which no reward applies is an error, unless ``allow_unscored``: its
        total is then None, for the caller to leave the row out (a trainer does, and
        counts it).
        """
        columns = self._check_inputs(prompts, completions, columns)
        if not completions:
            return self._empty()
        results, pending = self._call_all(prompts, completions, columns)
        if pending:
            gathered = _run_concurrently([aw for _, aw in pending])
            for (i, _), value in zip(pending, gathered):
                results[i] = value
        return self._combine(results, len(completions), allow_unscored)

    async def ascore(
        self, prompts: Sequence[str], completions: Sequence[str], columns: Mapping[str, Sequence[Any]] | None = None,
        *, allow_unscored: bool = False,
    ) -> RewardResult:
        """:meth:`score` for async callers: async rewards run on the caller's event loop."""
        columns = self._check_inputs(prompts, completions, columns)
        if not completions:
            return self._empty()
        results, pending = self._call_all(prompts, completions, columns)
        if pending:
            gathered = await _gather([aw for _, aw in pending])
            for (i, _), value in zip(pending, gathered):
                results[i] = value
        return self._combine(results, len(completions), allow_unscored)

    def _check_inputs(self, prompts, completions, columns) -> dict[str, list[Any]]:
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"got {len(prompts)} prompts for {n} completions; pass one prompt per completion")
        checked: dict[str, list[Any]] = {}
        for name, values in (columns or {}).items():
            if name in _RESERVED:
                raise ValueError(f"column {name!r} clashes with the reward function argument of that name")
            if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
                raise ValueError(f"column {name!r} must be a per-row list, got {type(values).__name__}")
            if len(values) != n:
                raise ValueError(f"column {name!r} has {len(values)} values for {n} completions")
            checked[name] = list(values)
        for comp in self.components:
            clash = sorted(set(comp.options) & set(checked))
            if clash:
                raise RewardError(
                    f"reward {comp.key!r}: option(s) {clash} have the same name as batch column(s); "
                    "the column would silently override the option. Rename the column.",
                    reward=comp.key,
                )
        return checked

    def _call_all(self, prompts, completions, columns):
        """Call every reward; returns the sync results and the (index, awaitable) pairs still to run."""
        results: list[Any] = [None] * len(self.components)
        pending: list[tuple[int, Awaitable[Any]]] = []
        for i, comp in enumerate(self.components):
            try:
                # Fresh list copies: a reward that mutates its inputs must not change what the next one sees.
                out = comp.fn(list(prompts), list(completions), **{k: list(v) for k, v in columns.items()})
            except Exception as exc:
                _close(aw for _, aw in pending)
                raise _wrap(comp.key, exc) from exc
            if inspect.isawaitable(out):
                pending.append((i, out))
            else:
                results[i] = out
        return results, pending

    def _combine(self, raw_results: list[Any], n: int, allow_unscored: bool = False) -> RewardResult:
        components: dict[str, list[float | None]] = {}
        for comp, raw in zip(self.components, raw_results):
            if isinstance(raw, Exception):
                raise _wrap(comp.key, raw) from raw
            if isinstance(raw, BaseException):  # KeyboardInterrupt, SystemExit, cancellation: not the reward's fault
                raise raw
            components[comp.key] = _validate(comp.key, raw, n)
        total: list[float | None] = []
        for row in range(n):
            applicable = [
                (c.weight, components[c.key][row]) for c in self.components if components[c.key][row] is not None
            ]
            if not applicable and allow_unscored:
                total.append(None)
                continue
            if not applicable:
                raise RewardError(
                    f"row {row}: every reward returned None ({', '.join(self.keys)}); "
                    "at least one reward must apply to each row",
                    row=row,
                )
            total.append(float(sum(w * v for w, v in applicable)))
        return RewardResult(components=components, total=total, weights=self.weights)

    def _empty(self) -> RewardResult:
        return RewardResult(components={k: [] for k in self.keys}, total=[], weights=self.weights)

    def __repr__(self) -> str:
        parts = ", ".join(f"{c.key}*{c.weight:g}" for c in self.components)
        return f"RewardSet({parts})"


def _check_signature(name: str, fn: Callable[..., Any], options: Mapping[str, Any]) -> None:
    """Fail at load, not at the first rollout, on functions that break the contract or on mistyped options."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # some C callables have no signature; their errors surface when called
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise RewardLoadError(
            f"reward {name!r} must accept **kwargs: it is called with every batch column "
            "(dataset fields and rollout extras), including ones it does not use"
        )
    named = {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    } - set(_RESERVED)
    for option in options:
        if option in _RESERVED:
            raise RewardLoadError(f"reward {name!r}: {option!r} cannot be an option")
        # An option the function does not name would vanish into **kwargs: a typo would be ignored.
        if option not in named:
            raise RewardLoadError(
                f"reward {name!r} has no option {option!r}; its named parameters are: "
                f"{', '.join(sorted(named)) or '(none)'}"
            )


def _wrap(key: str, exc: BaseException) -> RewardError:
    if isinstance(exc, RewardError):
        return exc
    return RewardError(f"reward {key!r} raised {type(exc).__name__}: {exc}", reward=key)


def _validate(key: str, raw: Any, n: int) -> list[float | None]:
    if isinstance(raw, (str, bytes, Mapping)) or not hasattr(raw, "__iter__"):
        raise RewardError(
            f"reward {key!r} returned a {type(raw).__name__}; expected a list of {n} floats or None", reward=key
        )
    values = list(raw)
    if len(values) != n:
        raise RewardError(
            f"reward {key!r} returned {len(values)} values for {n} completions (expected {n}, got {len(values)})",
            reward=key,
        )
    out: list[float | None] = []
    for row, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        # Anything float() accepts except text: numpy scalars and 0-d tensors are fine,
        # "0.5" is a bug in the reward that must not be parsed into a score.
        if isinstance(v, (str, bytes)) or not hasattr(type(v), "__float__"):
            raise RewardError(
                f"reward {key!r} returned a {type(v).__name__} ({v!r}) at row {row}; expected a float or None",
                reward=key,
                row=row,
            )
        try:
            f = float(v)
        except (TypeError, ValueError) as exc:
            raise RewardError(
                f"reward {key!r} returned {v!r} at row {row}, which is not a number: {exc}", reward=key, row=row
            ) from exc
        if not math.isfinite(f):
            raise RewardError(
                f"reward {key!r} returned {f} at row {row}; a reward must be a finite number or None",
                reward=key,
                row=row,
            )
        out.append(f)
    return out


async def _gather(awaitables: list[Awaitable[Any]]) -> list[Any]:
    # return_exceptions: every reward finishes (no orphaned tasks), and errors are then
    # reported in spec order under the right reward's name.
    return await asyncio.gather(*awaitables, return_exceptions=True)


def _run_concurrently(awaitables: list[Awaitable[Any]]) -> list[Any]:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_gather(awaitables))
    # A loop is already running in this thread (asyncio.run would refuse, and blocking on
    # it would deadlock): run the rewards on their own loop in a worker thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grouprl-rewards") as pool:
        return pool.submit(asyncio.run, _gather(awaitables)).result()


def _close(awaitables: Iterable[Awaitable[Any]]) -> None:
    # Coroutines created but never awaited would warn "never awaited" once scoring aborts.
    for aw in awaitables:
        close = getattr(aw, "close", None)
        if close is not None:
            close()


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return float(mean), float(math.sqrt(var))


def completion_text(completion: Any) -> str:
    """A completion's text: TRL passes a string, or for conversational data a list of
    messages whose last one is the reply (its content a string or a list of text parts)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        if isinstance(content, list):
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return str(content)
    raise TypeError(f"a completion must be a string or a list of chat messages, got {type(completion).__name__}")
