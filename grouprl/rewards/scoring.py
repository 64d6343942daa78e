"""Scoring a batch with several rewards: one implementation for both contracts.

:class:`RewardSet` holds the loaded rewards of one contract (:mod:`grouprl.rewards.contract`)
with their weights; :meth:`RewardSet.score` calls each on the batch, checks what it
returned and combines the components into the weighted total::

    rewards = RewardSet.from_specs([RewardSpec("format", 0.2), RewardSpec("accuracy")])
    result = rewards.score(prompts, completions, {"answer": answers})

    rewards = ImageRewardSet.from_specs([{"name": "ocr"}, {"name": "vlm_judge", "weight": 0.5,
                                                            "kwargs": {"base_url": "http://judge:8000/v1"}}])
    result = rewards.score(images, prompts, {"text": targets})

    result.total, result.components, result.errors, result.metrics()

Async rewards of a set run concurrently; plain functions run in order on the caller's
thread (text) or in worker threads alongside the others (images, see
:attr:`RewardContract.threads`). Failures are never a score: a reward that raises fails
the batch with a :class:`RewardError` naming it and the number of rows, unless its spec
says ``on_error: none`` (its rows are then None, the error is kept in
``result.errors`` and logged). A wrong number of values, a non-number or a NaN is a bug
in the reward and always raises. A row no reward applies to is an error, or None
(unscored, never 0) with ``allow_unscored``.

``timeout`` (``worker.reward.timeout``) bounds each reward call: a call with no result
in time fails with :class:`~grouprl.rewards.contract.RewardTimeout`, a reward error like
any other (``on_error`` applies), so a hung judge or a deadlocked scorer ends the step
with the reward's name instead of stalling the run (and, on several processes, every
process waiting for this one). Python cannot interrupt a blocking function, so with a
timeout a plain function runs in a daemon thread that is abandoned when its time is up:
it may keep running, holding what it holds, until it returns or the process exits. An
async reward is cancelled (it must let cancellation through).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import logging
import math
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Awaitable, Callable, ClassVar, Iterable, Mapping, Sequence

from grouprl.rewards.contract import (
    IMAGE,
    TEXT,
    RewardComponent,
    RewardContract,
    RewardError,
    RewardResult,
    RewardSpec,
    UnscoredError,
    RewardTimeout,
    is_spec_object,
    reward_keys,
    weighted_total,
)
from grouprl.rewards.registry import RewardLoadError, get_reward

logger = logging.getLogger(__name__)

Columns = Mapping[str, Sequence[Any]]


class RewardSet:
    """Several rewards of one contract combined with weights; :meth:`score` runs them on a batch.

    The contract is the class's (:data:`~grouprl.rewards.contract.TEXT` here,
    :data:`~grouprl.rewards.contract.IMAGE` for :class:`ImageRewardSet`).
    """

    contract: ClassVar[RewardContract] = TEXT

    def __init__(self, components: Sequence[RewardComponent], *, timeout: float | None = None):
        kind = self.contract.kind
        if not components:
            raise RewardLoadError(f"{kind} set needs at least one reward")
        keys = [c.key for c in components]
        if len(set(keys)) != len(keys):
            raise RewardLoadError(f"{kind} keys must be unique, got {keys}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not math.isfinite(timeout) or timeout <= 0):
            raise RewardLoadError(f"{kind} timeout must be None (no limit) or seconds > 0, got {timeout!r}")
        self.components = list(components)
        # seconds per reward call (see the module docstring); None waits for ever
        self.timeout = None if timeout is None else float(timeout)

    @classmethod
    def from_specs(cls, specs: Iterable[Any], *, timeout: float | None = None,
                   reward_type: str | None = None) -> "RewardSet":
        """Load every spec: a :class:`RewardSpec`, a reference string, a config mapping
        {name, weight, kwargs, on_error}, a config object with ``name`` and ``weight``, or a function.

        Keys are the spec names; a name used more than once gets ``name@i`` for every use,
        ``i`` being its position in ``specs``. A plain function is keyed by its ``__name__``.
        Options are checked against the function's parameters now, not at the first batch.
        ``timeout``: seconds per reward call (None: no limit), see the module docstring.
        Text rewards written for EasyR1 (``compute_score(reward_inputs)`` and its older forms)
        are called through :class:`~grouprl.rewards.easyr1.EasyR1Reward`: ``reward_type``
        (``batch``, ``sequential``, ``function``; EasyR1's key) says which form, else the
        function's file and signature do (:func:`~grouprl.rewards.easyr1.easyr1_reward`).
        """
        contract = cls.contract
        loaded: list[tuple[str, Callable[..., Any], float, RewardSpec | None]] = []
        for item in specs:
            if callable(item) and not isinstance(item, (str, Mapping, RewardSpec)) and not is_spec_object(item):
                name = getattr(item, "__name__", type(item).__name__)
                adapted = _easyr1(contract, name, item, {}, reward_type)
                if adapted is None:
                    _check_signature(contract, name, item, {})
                loaded.append((name, adapted or item, 1.0, None))
                continue
            spec = contract.spec.coerce(item)
            fn = get_reward(spec.name, contract.registry)
            adapted = _easyr1(contract, spec.name, fn, spec.kwargs, reward_type)
            if adapted is not None:
                loaded.append((spec.name.strip(), adapted, spec.weight, spec))
                continue
            _check_signature(contract, spec.name, fn, spec.kwargs)
            bound = functools.partial(fn, **spec.kwargs) if spec.kwargs else fn
            loaded.append((spec.name.strip(), bound, spec.weight, spec))
        keys = reward_keys([name for name, *_ in loaded])
        return cls([RewardComponent(key, fn, weight, spec, spec.on_error if spec else "raise")
                    for key, (_, fn, weight, spec) in zip(keys, loaded)], timeout=timeout)

    @property
    def keys(self) -> list[str]:
        return [c.key for c in self.components]

    @property
    def weights(self) -> dict[str, float]:
        return {c.key: c.weight for c in self.components}

    def score(self, prompts: Sequence[Any], completions: Sequence[Any], columns: Columns | None = None, *,
              completion_ids: Sequence[Sequence[int]] | None = None, trainer_state: Any = None,
              allow_unscored: bool = False) -> RewardResult:
        """Score a batch of completions (``columns``: per-row lists passed by keyword).

        Every reward is called as TRL calls it (:mod:`grouprl.rewards.contract`): by keyword,
        with ``prompts``, ``completions``, ``completion_ids`` (one token-id list per row; None
        when not given), ``trainer_state`` (None when not given), ``log_extra`` and
        ``log_metric`` (what rewards give them is in the result's ``logged_columns`` and
        ``logged_metrics``) and the columns.

        Safe to call from inside a running event loop (a notebook, an async server): the
        async rewards then run on a fresh loop in a worker thread, so they must not depend
        on objects bound to the caller's loop. From async code prefer :meth:`ascore`.

        A row to which no reward applies is an error, unless ``allow_unscored``: its
        total is then None, for the caller to leave the row out (a trainer does, and
        counts it).
        """
        call = {"completion_ids": completion_ids, "trainer_state": trainer_state}
        return self._score((prompts, completions), columns, allow_unscored, call)

    async def ascore(self, prompts: Sequence[Any], completions: Sequence[Any], columns: Columns | None = None, *,
                     completion_ids: Sequence[Sequence[int]] | None = None, trainer_state: Any = None,
                     allow_unscored: bool = False) -> RewardResult:
        """:meth:`score` for async callers: async rewards run on the caller's event loop."""
        call = {"completion_ids": completion_ids, "trainer_state": trainer_state}
        return await self._ascore((prompts, completions), columns, allow_unscored, call)

    # ------------------------------------------------------------ the one implementation

    def _score(self, inputs: tuple[Sequence[Any], Sequence[Any]], columns: Columns | None,
               allow_unscored: bool, call: Mapping[str, Any] | None = None) -> RewardResult:
        checked_inputs, checked, arguments, logs = self._check_inputs(inputs, columns, call)
        n, outcomes, pending = self._start(checked_inputs, checked, arguments)
        if pending:
            for (i, _, _), value in zip(pending, _run_concurrently([_bounded(aw, left, self.timeout) for _, aw, left in pending])):
                outcomes[i] = value
        return self._combine(outcomes, n, allow_unscored, logs)

    async def _ascore(self, inputs: tuple[Sequence[Any], Sequence[Any]], columns: Columns | None,
                      allow_unscored: bool, call: Mapping[str, Any] | None = None) -> RewardResult:
        checked_inputs, checked, arguments, logs = self._check_inputs(inputs, columns, call)
        n, outcomes, pending = self._start(checked_inputs, checked, arguments)
        if pending:
            for (i, _, _), value in zip(pending, await _gather([_bounded(aw, left, self.timeout) for _, aw, left in pending])):
                outcomes[i] = value
        return self._combine(outcomes, n, allow_unscored, logs)

    def _check_inputs(self, inputs, columns, call=None,
                      ) -> tuple[list[list[Any]], dict[str, list[Any]], dict[str, Any], "_Logs"]:
        """The inputs as lists (the rows input through the contract's row check), the checked columns,
        the contract's call arguments (each of ``call_arguments``: the caller's, None where not given,
        and the log functions of this call) and what those log functions collect."""
        contract = self.contract
        rows_at = contract.inputs.index(contract.rows)
        n = len(inputs[rows_at])
        for name, values in zip(contract.inputs, inputs):
            if len(values) != n:
                raise ValueError(f"got {len(values)} {name} for {n} {contract.rows}; "
                                 f"pass one {_singular(name)} per {_singular(contract.rows)}")
        checked_inputs = [list(values) for values in inputs]
        if contract.check_row is not None:
            checked_inputs[rows_at] = [contract.check_row(value, row) for row, value in enumerate(inputs[rows_at])]
        checked: dict[str, list[Any]] = {}
        for name, values in (columns or {}).items():
            if name in contract.inputs or name in contract.call_arguments:
                raise ValueError(f"{contract.columns} {name!r} clashes with the {contract.kind} argument of that name")
            if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
                raise ValueError(f"{contract.columns} {name!r} must be a per-row list, got {type(values).__name__}")
            if len(values) != n:
                raise ValueError(f"{contract.columns} {name!r} has {len(values)} values for {n} {contract.rows}")
            checked[name] = list(values)
        for comp in self.components:
            clash = sorted(set(comp.options) & set(checked))
            if clash:
                raise RewardError(
                    f"{contract.kind} {comp.key!r}: option(s) {clash} have the same name as {contract.columns}(s); "
                    "the column would silently override the option. Rename the column.",
                    reward=comp.key,
                )
        logs = _Logs(n)
        arguments = {name: (call or {}).get(name) for name in contract.call_arguments}
        if "log_metric" in arguments:
            arguments.update(log_metric=logs.log_metric, log_extra=logs.log_extra)
        ids = arguments.get("completion_ids")
        if ids is not None:
            if len(ids) != n:
                raise ValueError(f"got {len(ids)} completion_ids for {n} {contract.rows}; pass one list of token ids "
                                 f"per {_singular(contract.rows)}")
            # each reward gets its own copy of the rows when it is called (_start)
        return checked_inputs, checked, arguments, logs

    def _start(self, inputs: list[list[Any]], columns: dict[str, list[Any]], arguments: dict[str, Any],
               ) -> tuple[int, list[Any], list[tuple[int, Awaitable[Any], float | None]]]:
        """Call every reward: the number of rows, the outcomes (values or exceptions) of the rewards
        that ran in this thread, and (index, awaitable, seconds left to it) for the ones still to
        run concurrently."""
        n = len(inputs[self.contract.inputs.index(self.contract.rows)])
        if not n:
            return 0, [], []  # an empty batch calls no reward
        outcomes: list[Any] = [None] * len(self.components)
        pending: list[tuple[int, Awaitable[Any], float | None]] = []
        for i, comp in enumerate(self.components):
            # Fresh list copies: a reward that mutates its inputs must not change what the next one sees.
            args = [list(values) for values in inputs]
            kwargs = {k: list(v) for k, v in columns.items()}
            if self.contract.by_keyword:
                # TRL's call: everything by keyword, so a reward names only what it reads
                ids = arguments.get("completion_ids")
                kwargs = {**dict(zip(self.contract.inputs, args)), **arguments, **kwargs,
                          **({"completion_ids": [list(row) for row in ids]} if ids is not None else {})}
                args = []
                problem = _call_problem(self.contract, comp, kwargs)
                if problem is not None:
                    # the reward cannot take this batch's arguments: a contract error whatever on_error says
                    _close(aw for _, aw, _ in pending)
                    raise problem
            if self.contract.threads and not is_async(comp.fn):
                pending.append((i, _in_thread(comp.fn, args, kwargs, comp.key, self.timeout), None))
                continue
            started = time.monotonic()
            try:
                if self.timeout is None or is_async(comp.fn):
                    out = comp.fn(*args, **kwargs)  # an async one only makes its coroutine here
                else:
                    out = _call_within(comp.fn, args, kwargs, comp.key, self.timeout)
            except Exception as exc:
                if comp.on_error != "none":
                    # The batch fails anyway: do not wait for the other rewards' (maybe remote) calls.
                    _close(aw for _, aw, _ in pending)
                    raise _wrap(self.contract, comp.key, exc, n, comp.fn) from exc
                out = exc
            if inspect.isawaitable(out):
                # a plain callable that handed back an awaitable has the rest of its time for it
                left = self.timeout
                if left is not None and not is_async(comp.fn):
                    left = max(0.0, left - (time.monotonic() - started))
                pending.append((i, out, left))
            else:
                outcomes[i] = out
        return n, outcomes, pending

    def _combine(self, outcomes: list[Any], n: int, allow_unscored: bool, logs: "_Logs") -> RewardResult:
        contract = self.contract
        if not n:
            return RewardResult(components={k: [] for k in self.keys}, total=[], weights=self.weights)
        components: dict[str, list[float | None]] = {}
        parts: dict[str, dict[str, list[float | None]]] = {}
        errors: dict[str, str] = {}
        for comp, raw in zip(self.components, outcomes):
            if isinstance(raw, Exception):
                error = _wrap(contract, comp.key, raw, n, comp.fn)
                if comp.on_error != "none":
                    raise error from raw
                logger.warning("%s; its rows are left unscored (on_error=none)", error)
                errors[comp.key] = str(error)
                components[comp.key] = [None] * n
                # the parts it reported before, unscored too: every batch logs the same keys
                if getattr(comp.fn, "part_names", None):
                    parts[comp.key] = {p: [None] * n for p in comp.fn.part_names}
                continue
            if isinstance(raw, BaseException):  # KeyboardInterrupt, SystemExit, cancellation: not the reward's fault
                raise raw
            components[comp.key] = _validate(contract, comp.key, raw, n, _defined_at(comp.fn))
            if getattr(raw, "parts", None):  # an EasyR1 reward's format, accuracy, ...: logged, not weighted
                parts[comp.key] = {p: list(v) for p, v in raw.parts.items()}
        total = weighted_total(components, self.weights)
        if not allow_unscored and None in total:
            row = total.index(None)
            failed = f"; failed: {', '.join(f'{k} ({e})' for k, e in errors.items())}" if errors else ""
            raise UnscoredError(
                f"row {row}: every {contract.kind} returned None ({', '.join(self.keys)}){failed}; "
                "at least one reward must apply to each row (or score with allow_unscored=True)",
                row=row,
            )
        return RewardResult(components=components, total=total, weights=self.weights, errors=errors,
                            logged_metrics=logs.metrics, logged_columns=logs.columns, parts=parts)

    def __repr__(self) -> str:
        parts = ", ".join(f"{c.key}*{c.weight:g}" for c in self.components)
        return f"{type(self).__name__}({parts})"


class ImageRewardSet(RewardSet):
    """A :class:`RewardSet` of image rewards: ``score(images, prompts, metadata)``; every reward of
    the set runs at once (async ones on the event loop, plain functions in worker threads)."""

    contract: ClassVar[RewardContract] = IMAGE

    def score(self, images: Sequence[Any], prompts: Sequence[str], metadata: Columns | None = None, *,
              allow_unscored: bool = False) -> RewardResult:
        """Score a batch of images (``metadata``: per-row lists passed by keyword); see :meth:`RewardSet.score`."""
        return self._score((images, prompts), metadata, allow_unscored)

    async def ascore(self, images: Sequence[Any], prompts: Sequence[str], metadata: Columns | None = None, *,
                     allow_unscored: bool = False) -> RewardResult:
        """:meth:`score` for async callers: async rewards run on the caller's event loop."""
        return await self._ascore((images, prompts), metadata, allow_unscored)


class _Logs:
    """What the rewards of one scoring call give TRL's ``log_metric`` and ``log_extra``.

    Their errors (a name that is not a string, a value that is not a finite number, not one
    value per row) are raised in the reward's call, so they are reported as the reward's.
    """

    def __init__(self, rows: int):
        self.rows = rows
        self.metrics: dict[str, list[float]] = {}
        self.columns: dict[str, list[Any]] = {}

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: a scalar for this batch, averaged with the others of its name."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"log_metric: the name must be a non-empty string, got {name!r}")
        if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__") or not math.isfinite(float(value)):
            raise ValueError(f"log_metric({name!r}, ...): the value must be a finite number, got {value!r}")
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        """TRL's ``log_extra``: a column of per-row values logged with the completions."""
        if not isinstance(column, str) or not column:
            raise TypeError(f"log_extra: the column must be a non-empty string, got {column!r}")
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != self.rows:
            got = f"{len(values)} values" if hasattr(values, "__len__") else type(values).__name__
            raise ValueError(f"log_extra({column!r}, ...): expected one value per row ({self.rows}), got {got}")
        self.columns[column] = list(values)


def _easyr1(contract: RewardContract, name: str, fn: Callable[..., Any], options: Mapping[str, Any],
            reward_type: str | None) -> Callable[..., Any] | None:
    """``fn`` behind grouprl's text contract when it is an EasyR1 reward (options bound), else None."""
    if contract is not TEXT:
        return None
    from grouprl.rewards.easyr1 import easyr1_reward

    return easyr1_reward(fn, name, options, reward_type=reward_type)


def _check_signature(contract: RewardContract, name: str, fn: Callable[..., Any], options: Mapping[str, Any]) -> None:
    """Fail at load, not at the first batch, on functions that break the contract or on mistyped options.

    A by-keyword (TRL) reward must take its parameters by keyword and, without ``**kwargs``,
    name every argument it is always given (the inputs and ``call_arguments``); the columns
    it names are checked against each batch (:func:`_call_problem`). A positional (image)
    reward must have the contract's ``var_keyword``.
    """
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # some C callables have no signature; their errors surface when called
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    always = (*contract.inputs, *contract.call_arguments)
    if contract.by_keyword:
        positional_only = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY]
        if positional_only:
            raise RewardLoadError(
                f"{contract.kind} {name!r} takes {', '.join(positional_only)} positionally only; rewards are "
                f"called by keyword, as TRL calls them ({', '.join(always)} and every {contract.columns})"
            )
        named_all = {p.name for p in params}
        missing = [a for a in always if a not in named_all]
        if not var_keyword and missing:
            raise RewardLoadError(
                f"{contract.kind} {name!r} must accept {contract.var_keyword} or name every argument it is given: "
                f"it is called by keyword with {', '.join(always)} and every {contract.columns}, as TRL calls it, "
                f"and has no parameter for {', '.join(missing)}"
            )
    elif not var_keyword:
        raise RewardLoadError(
            f"{contract.kind} {name!r} must accept {contract.var_keyword}: it is called with every "
            f"{contract.columns}, including ones it does not use"
        )
    named = {
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    } - set(always)
    for option in options:
        if option in always:
            raise RewardLoadError(f"{contract.kind} {name!r}: {option!r} cannot be an option")
        # An option the function does not name would vanish into **kwargs: a typo would be ignored.
        if option not in named:
            raise RewardLoadError(
                f"{contract.kind} {name!r} has no option {option!r}; its named parameters are: "
                f"{', '.join(sorted(named)) or '(none)'}"
            )


def _call_problem(contract: RewardContract, comp: RewardComponent, kwargs: Mapping[str, Any]) -> RewardError | None:
    """Why ``comp`` cannot be called with these keyword arguments (a column it does not accept, a
    parameter nothing fills), as an error naming the reward and where it is defined; else None.

    Python would raise a TypeError too, but one pointing at grouprl's call rather than the
    reward, and without the names the batch does pass."""
    try:
        params = inspect.signature(comp.fn).parameters.values()
    except (TypeError, ValueError):
        return None
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    names = {p.name for p in params}
    unexpected = [] if var_keyword else sorted(set(kwargs) - names)
    missing = [p.name for p in params
               if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
               and p.default is inspect.Parameter.empty and p.name not in kwargs]
    if not unexpected and not missing:
        return None
    columns = sorted(set(kwargs) - set(contract.inputs) - set(contract.call_arguments))
    problems = []
    if missing:
        problems.append(f"nothing is passed for its parameter(s) {', '.join(missing)}")
    if unexpected:
        problems.append(f"it has no {contract.var_keyword} and no parameter for {', '.join(unexpected)}")
    return RewardError(
        f"{contract.kind} {comp.key!r} cannot be called with this batch: {'; '.join(problems)}. Rewards are called "
        f"by keyword, as TRL calls them, with {', '.join((*contract.inputs, *contract.call_arguments))} and the "
        f"{contract.columns}s {', '.join(columns) or '(none)'}{_defined_at(comp.fn)}",
        reward=comp.key,
    )


def _wrap(contract: RewardContract, key: str, exc: BaseException, n: int,
          fn: Callable[..., Any] | None = None) -> RewardError:
    # Always a new error naming this reward (a RewardError raised inside, a judge's, keeps its row),
    # and where it raised: the reward's own line, not grouprl's frames that called it.
    if isinstance(exc, RewardTimeout):
        return RewardError(f"{contract.kind} {key!r} timed out: {exc} (a batch of {n} row(s))", reward=key)
    return RewardError(f"{contract.kind} {key!r} raised {type(exc).__name__}: {exc} (a batch of {n} row(s))"
                       f"{_raised_at(exc, fn)}", reward=key, row=getattr(exc, "row", None))


# Frames in these directories are not the reward author's: grouprl itself, the standard library
# and installed packages (a user's reward that calls numpy is reported at its own line).
_GROUPRL_DIR = Path(__file__).resolve().parents[1]
_LIBRARY_DIRS = tuple({Path(sysconfig.get_paths()[k]).resolve()
                       for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in sysconfig.get_paths()})


def _function_code(fn: Any) -> Any:
    """The code object of a reward function (options' partials and decorators unwrapped), or None."""
    for _ in range(16):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            break
    code = getattr(fn, "__code__", None)
    if code is None and not inspect.isfunction(fn):  # a callable object: its __call__
        code = getattr(getattr(type(fn), "__call__", None), "__code__", None)
    return code


def _defined_at(fn: Any) -> str:
    """``"; function f at file.py:12"`` for a reward whose result broke the contract (it did not raise)."""
    code = _function_code(fn)
    return f"; function {code.co_name} at {code.co_filename}:{code.co_firstlineno}" if code is not None else ""


def _raised_at(exc: BaseException, fn: Any) -> str:
    """``"; at file.py:3 in f: <line>"``: the innermost frame of the reward author's own code in the
    traceback of ``exc`` (else one in the reward function's file, else the innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""

    def authors(frame: traceback.FrameSummary) -> bool:
        if frame.filename.startswith("<"):
            return False
        path = Path(frame.filename).resolve()
        return not any(d == path or d in path.parents for d in (_GROUPRL_DIR, *_LIBRARY_DIRS))

    code = _function_code(fn)
    own = [f for f in frames if code is not None and f.filename == code.co_filename]
    frame = next((f for f in reversed(frames) if authors(f)), None) or (own[-1] if own else None)
    if frame is None and code is not None:
        # raised by grouprl around the function (an adapter's check of what it returned): name the function
        return _defined_at(fn)
    frame = frame or frames[-1]
    line = f": {frame.line.strip()}" if frame.line and frame.line.strip() else ""
    return f"; at {frame.filename}:{frame.lineno} in {frame.name}{line}"


def _validate(contract: RewardContract, key: str, raw: Any, n: int, where: str = "") -> list[float | None]:
    kind, rows = contract.kind, contract.rows
    if isinstance(raw, (str, bytes, Mapping)) or not hasattr(raw, "__iter__"):
        raise RewardError(f"{kind} {key!r} returned a {type(raw).__name__}; expected a list of {n} floats or None{where}",
                          reward=key)
    values = list(raw)
    if len(values) != n:
        raise RewardError(f"{kind} {key!r} returned {len(values)} values for {n} {rows} (expected {n}, "
                          f"got {len(values)}){where}", reward=key)
    out: list[float | None] = []
    for row, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        # Anything float() accepts except text: numpy scalars and 0-d tensors are fine,
        # "0.5" is a bug in the reward that must not be parsed into a score.
        if isinstance(v, (str, bytes)) or not hasattr(type(v), "__float__"):
            raise RewardError(f"{kind} {key!r} returned a {type(v).__name__} ({v!r}) at row {row}; "
                              f"expected a float or None{where}", reward=key, row=row)
        try:
            f = float(v)
        except (TypeError, ValueError) as exc:
            raise RewardError(f"{kind} {key!r} returned {v!r} at row {row}, which is not a number: {exc}{where}",
                              reward=key, row=row) from exc
        if not math.isfinite(f):
            raise RewardError(f"{kind} {key!r} returned {f} at row {row}; a reward must be a finite number or None{where}",
                              reward=key, row=row)
        out.append(f)
    return out


def _singular(plural: str) -> str:
    return plural[:-1] if plural.endswith("s") else plural


def is_async(fn: Any) -> bool:
    """Whether calling ``fn`` (a function, a partial of one or an object with ``__call__``) gives a coroutine."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def start_thread(fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any], key: str,
                 ) -> concurrent.futures.Future:
    """``fn(*args, **kwargs)`` in a new daemon thread; its future.

    Not a pool's thread: a reward that timed out is abandoned, and a daemon thread neither
    holds up the process's exit nor the event loop's shutdown (``asyncio.run`` joins the
    default executor's threads) while it may still be running.
    """
    future: concurrent.futures.Future = concurrent.futures.Future()
    context = contextvars.copy_context()  # what asyncio.to_thread passes on too
    device = _cuda_device()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            if device is not None:
                # the current CUDA device is per thread: a model-backed reward on process k's GPU
                # would otherwise land on GPU 0
                sys.modules["torch"].cuda.set_device(device)
            result = context.run(fn, *args, **kwargs)
        except BaseException as exc:  # handed to the waiting side, which decides
            future.set_exception(exc)
        else:
            future.set_result(result)

    threading.Thread(target=run, name=f"grouprl-reward-{key}", daemon=True).start()
    return future


_ABANDONED = "its thread was abandoned and may still be running"


def _cuda_device() -> int | None:
    """The caller's current CUDA device when torch is loaded and CUDA started, else None (no torch import)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


def _call_within(fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any], key: str, limit: float) -> Any:
    """A plain reward's result, waited for at most ``limit`` seconds (then it is abandoned)."""
    future = start_thread(fn, args, kwargs, key)
    # wait(), not result(timeout): a TimeoutError the reward raises itself is its own error
    concurrent.futures.wait([future], timeout=limit)
    if not future.done():
        raise RewardTimeout(limit, abandoned=_ABANDONED)
    return future.result()


async def _in_thread(fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any], key: str,
                     limit: float | None) -> Any:
    """A plain reward run in its own thread while the event loop runs the others, within ``limit`` seconds."""
    started = time.monotonic()
    future = asyncio.wrap_future(start_thread(fn, args, kwargs, key))
    if limit is not None:
        done, _ = await asyncio.wait({future}, timeout=limit)
        if not done:
            future.cancel()  # stops the waiting only: the thread cannot be stopped
            raise RewardTimeout(limit, abandoned=_ABANDONED)
    out = await future
    if inspect.isawaitable(out):  # a plain callable handing back a coroutine: the rest of its time
        left = None if limit is None else max(0.0, limit - (time.monotonic() - started))
        out = await _bounded(out, left, limit)
    return out


async def _bounded(awaitable: Awaitable[Any], left: float | None, limit: float | None) -> Any:
    """``awaitable``'s result, or :class:`RewardTimeout` (naming ``limit``) after ``left`` seconds."""
    if left is None:
        return await awaitable
    task = asyncio.ensure_future(awaitable)
    # wait(), not wait_for(): a TimeoutError the reward raises itself stays its own error
    done, _ = await asyncio.wait({task}, timeout=left)
    if not done:
        task.cancel()  # an async reward must let the cancellation through
        await asyncio.gather(task, return_exceptions=True)
        raise RewardTimeout(limit, abandoned="it was cancelled")
    return task.result()


async def _gather(awaitables: list[Awaitable[Any]]) -> list[Any]:
    # return_exceptions: every reward finishes (no orphaned tasks or threads), and errors
    # are then reported in spec order under the right reward's name.
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
