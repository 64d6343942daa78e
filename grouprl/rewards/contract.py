"""The reward contracts, and what scoring with them takes and gives: specs, components, results.

Two contracts, one way of scoring (:mod:`grouprl.rewards.scoring`). A text reward is a
TRL reward function, called as TRL 1.16's ``GRPOTrainer`` calls it: every argument by
keyword::

    f(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=...,
      log_metric=..., **columns) -> list[float | None]

so ``def f(prompts, completions, **columns)`` (grouprl's own form), ``def f(completions,
**kwargs)`` and ``def f(completions, solution, **kwargs)`` all work. ``columns`` are per-row
lists: the dataset's fields (``answer``, ``solution``, ...) plus rollout extras.
``completions`` are strings, or for a TRL conversational dataset one
``[{"role": "assistant", "content": text}]`` list per row (and ``prompts`` its message
lists); :func:`completion_text` reads either. ``completion_ids`` are each completion's
token ids, ``trainer_state`` a ``transformers.TrainerState`` (global_step, max_steps,
epoch; None where the caller has none, e.g. scoring outside a trainer); ``log_metric(name,
value)`` and ``log_extra(column, values)`` (one value per row) do what TRL's do, the reward
set collecting what they are given into :attr:`RewardResult.logged_metrics` /
``logged_columns``. A function without ``**kwargs`` must name every argument it is given. An image reward (the flow trainer's)
is called positionally::

    f(images: list[PIL.Image.Image], prompts: list[str], **metadata) -> list[float | None]

where ``metadata`` are per-row lists aligned with the images (the prompt record's other
fields, e.g. ``text``, the OCR target); images are RGB and shared between the rewards of
a set, which must not modify them in place; it must accept ``**metadata`` for the
columns it ignores. ``None`` means "not applicable to this row". ``async def`` functions
(or any callable returning an awaitable) are allowed.

Failures are never turned into a score: an exception, a wrong number of values, a
non-number or a NaN/inf raises :class:`RewardError` naming the reward (and the row),
unless the reward's spec says ``on_error: none`` for exceptions (its rows are then None
and the error is kept in :attr:`RewardResult.errors`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

from grouprl.registry import Registry
from grouprl.rewards.registry import IMAGE_REWARDS, REWARDS, RewardLoadError

ON_ERROR = ("raise", "none")


class RewardError(RuntimeError):
    """A reward function failed or broke the contract while scoring.

    ``reward`` is the component key (``None`` for errors about a row as a whole) and
    ``row`` the row index when the problem is one row's value.
    """

    def __init__(self, message: str, *, reward: str | None = None, row: int | None = None):
        super().__init__(message)
        self.reward = reward
        self.row = row


class UnscoredError(RewardError):
    """No reward applied where a score was needed: a row scored without ``allow_unscored``, or a
    training step in which no row got a score (``trainer.fail_on_unscored_steps``).

    Its own class because the run, not the reward, failed: ``grouprl train`` reports it in one line
    with exit code 1, where a reward that raised or broke the contract (a wrong reward: its message
    names the reward and the line of its own code) is reported with exit code 2.
    """

class RewardTimeout(TimeoutError):
    """A reward call gave no result within the set's ``timeout`` (``worker.reward.timeout``).

    A reward error like any other (``on_error`` applies). Python cannot interrupt a blocking
    function: a sync reward that timed out is abandoned in its daemon thread and may go on
    running (and holding what it holds) until it returns or the process ends; an async one
    is cancelled.
    """

    def __init__(self, limit: float, *, abandoned: str):
        super().__init__(f"no result within {limit:g} s (worker.reward.timeout); {abandoned}")
        self.limit = limit


@dataclass
class RewardSpec:
    """One reward of a set, as written in config.

    ``name`` is a registered name, ``path/to/file.py:function`` or ``module:function``;
    ``kwargs`` are options bound to the function (``functools.partial``) when it is
    loaded, e.g. ``RewardSpec("format", kwargs={"style": "boxed"})``. ``on_error``:
    ``raise`` (default: a reward that raises fails the batch) or ``none`` (its rows
    become None for that batch; the error is recorded and logged), for a remote judge
    whose outages should cost rows rather than the run.
    """

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    on_error: str = "raise"

    kind: ClassVar[str] = "reward"  # names the reward in this spec's messages

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise RewardLoadError(f"{self.kind} spec name must be a non-empty string, got {self.name!r}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)):
            raise RewardLoadError(f"{self.kind} {self.name!r}: weight must be a number, got {self.weight!r}")
        self.weight = float(self.weight)
        if not math.isfinite(self.weight):
            raise RewardLoadError(f"{self.kind} {self.name!r}: weight must be finite, got {self.weight}")
        if not isinstance(self.kwargs, Mapping) or not all(isinstance(k, str) for k in self.kwargs):
            raise RewardLoadError(f"{self.kind} {self.name!r}: kwargs must be a mapping of option names to values")
        self.kwargs = dict(self.kwargs)
        if self.on_error not in ON_ERROR:
            raise RewardLoadError(
                f"{self.kind} {self.name!r}: on_error must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}"
            )

    @classmethod
    def coerce(cls, spec: Any) -> "RewardSpec":
        """A spec from itself, a bare reference string, a config mapping {name, weight, kwargs, on_error},
        or an object with ``name`` and ``weight`` attributes (the config's ``RewardFunctionConfig``;
        ``kwargs`` and ``on_error`` are read when it has them)."""
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, Mapping):
            unknown = sorted(set(spec) - {"name", "weight", "kwargs", "on_error"})
            if unknown:
                raise RewardLoadError(
                    f"{cls.kind} spec {dict(spec)!r} has unknown keys {unknown}; allowed: name, weight, kwargs, on_error"
                )
            if "name" not in spec:
                raise RewardLoadError(f"{cls.kind} spec {dict(spec)!r} has no 'name'")
            return cls(spec["name"], spec.get("weight", 1.0), spec.get("kwargs") or {}, spec.get("on_error", "raise"))
        if is_spec_object(spec):
            return cls(spec.name, spec.weight, getattr(spec, "kwargs", None) or {}, getattr(spec, "on_error", "raise"))
        raise RewardLoadError(
            f"a {cls.kind} spec must be a RewardSpec, a name string, a mapping or a spec object, "
            f"got {type(spec).__name__}"
        )


class ImageRewardSpec(RewardSpec):
    """A :class:`RewardSpec` of an image reward (its messages say so)."""

    kind: ClassVar[str] = "image reward"


def is_spec_object(obj: Any) -> bool:
    """Whether ``obj`` describes a reward (has ``name`` and ``weight``) rather than being one."""
    return hasattr(obj, "name") and hasattr(obj, "weight")


@dataclass(frozen=True)
class RewardContract:
    """How one kind of reward function is called: what scoring needs to know beyond the functions.

    ``kind`` names the rewards in messages and is their registry's kind; ``inputs`` are
    the two first arguments, in order; ``rows`` is the input whose length is the
    batch size; ``columns`` is what the per-row keyword lists are called in messages
    and ``var_keyword`` the catch-all parameter for the columns a reward ignores.
    ``by_keyword``: the inputs are passed by keyword together with ``call_arguments``
    (TRL's convention: a reward names only what it reads); otherwise positionally, and
    every reward must have ``var_keyword``. ``threads``:
    plain (sync) functions run in worker threads, every reward of a set at once, for
    rewards that are slow and mostly outside the GIL (OCR, a local model); otherwise
    they run in order on the caller's thread, as TRL calls them (rule rewards take
    microseconds, and a model-backed one keeps the caller's thread and memory).
    ``check_row(value, row)`` validates and normalises each value of the ``rows`` input
    before any reward sees it. ``spec`` is the spec type config entries become.
    """

    kind: str
    inputs: tuple[str, str]
    rows: str
    columns: str
    var_keyword: str
    registry: Registry
    threads: bool = False
    check_row: Callable[[Any, int], Any] | None = None
    spec: type[RewardSpec] = RewardSpec  # what from_specs coerces config entries to
    by_keyword: bool = False
    call_arguments: tuple[str, ...] = ()


def rgb_image(image: Any, row: int) -> Any:
    """``image`` as a fully loaded RGB ``PIL.Image`` (the image contract's row check)."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise TypeError(f"images[{row}] must be a PIL.Image, got {type(image).__name__}")
    # load() now: lazily decoded images read by several reward threads at once would race.
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


# TRL 1.16's GRPOTrainer._calculate_rewards passes these besides the prompts, completions and
# columns (and ``environments`` with an environment_factory, which grouprl has no counterpart of).
TRL_CALL_ARGUMENTS = ("completion_ids", "trainer_state", "log_extra", "log_metric")
TEXT = RewardContract("reward", ("prompts", "completions"), rows="completions", columns="column",
                      var_keyword="**kwargs", registry=REWARDS, by_keyword=True, call_arguments=TRL_CALL_ARGUMENTS)
IMAGE = RewardContract("image reward", ("images", "prompts"), rows="images", columns="metadata column",
                       var_keyword="**metadata", registry=IMAGE_REWARDS, threads=True, check_row=rgb_image,
                       spec=ImageRewardSpec)


@dataclass(frozen=True)
class RewardComponent:
    """A loaded reward: its key in results, the function (options bound), its weight, the spec it
    came from (None for a function passed as is) and what a raise does (``on_error``)."""

    key: str
    fn: Callable[..., Any]
    weight: float = 1.0
    spec: RewardSpec | None = None
    on_error: str = "raise"

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.fn.keywords) if isinstance(self.fn, functools.partial) else {}


@dataclass
class RewardResult:
    """The scores of one batch: each component's per-row values and the weighted total.

    ``total[i] = sum(weights[k] * components[k][i])`` over the components that are not
    ``None`` at row ``i`` (:func:`weighted_total`); ``None`` where no component applies
    (only when the set was asked to allow unscored rows). ``errors``: key -> why, for
    the components that raised under ``on_error: none`` (their rows are None).
    ``logged_metrics``: name -> the values rewards gave TRL's ``log_metric`` this batch;
    ``logged_columns``: column -> the per-row values given to ``log_extra`` (the last call wins).
    ``parts``: key -> part -> per-row values, for components whose reward reports parts of
    its score beside it (an EasyR1 reward's ``format``, ``accuracy``, ...); logged, never in
    ``total``.
    """

    components: dict[str, list[float | None]]
    total: list[float | None]
    weights: dict[str, float]
    errors: dict[str, str] = field(default_factory=dict)
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)
    logged_columns: dict[str, list[Any]] = field(default_factory=dict)
    parts: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.total)

    def metrics(self) -> dict[str, float]:
        """Logging metrics named like TRL's.

        Per component: ``rewards/{key}/mean`` and ``rewards/{key}/std`` over the rows where
        it applies, ``rewards/{key}/applicable_frac`` and ``rewards/{key}/failed`` (1.0 when
        it raised this batch under ``on_error: none``); per part of a component,
        ``rewards/{key}/{part}/mean`` and ``/std``; then ``reward/mean`` and
        ``reward/std`` of the total, and ``reward_log/{name}``, the mean of what rewards
        gave ``log_metric(name, value)``. Stds are population stds (defined for one row). A
        component that applies to no row of the batch gets no mean/std rather than NaN
        (a trainer logging over several processes needs every key every step: it records
        the same statistics with their counts instead).
        """
        out: dict[str, float] = {}
        n = len(self.total)
        for key, values in self.components.items():
            applicable = [v for v in values if v is not None]
            if applicable:
                out[f"rewards/{key}/mean"], out[f"rewards/{key}/std"] = _mean_std(applicable)
            out[f"rewards/{key}/applicable_frac"] = len(applicable) / n if n else 0.0
            out[f"rewards/{key}/failed"] = 1.0 if key in self.errors else 0.0
            for part, part_values in self.parts.get(key, {}).items():
                applicable = [v for v in part_values if v is not None]
                if applicable:
                    out[f"rewards/{key}/{part}/mean"], out[f"rewards/{key}/{part}/std"] = _mean_std(applicable)
        scored = [t for t in self.total if t is not None]
        if scored:
            out["reward/mean"], out["reward/std"] = _mean_std(scored)
        for name, values in self.logged_metrics.items():
            out[f"reward_log/{name}"] = sum(values) / len(values)
        return out


def weighted_total(components: Mapping[str, Sequence[float | None]],
                   weights: Mapping[str, float]) -> list[float | None]:
    """Per row, ``sum(weights[k] * components[k][i])`` over the keys (in order) whose value at
    row ``i`` is not None; None at a row where every value is None (or there are no keys)."""
    n = len(next(iter(components.values()), []))
    total: list[float | None] = []
    for row in range(n):
        applicable = [(weights[key], values[row]) for key, values in components.items() if values[row] is not None]
        total.append(float(sum(w * v for w, v in applicable)) if applicable else None)
    return total


def reward_keys(names: Sequence[str]) -> list[str]:
    """Each reward's key in results: its name, or ``name@i`` (``i`` its position) for a name used
    more than once, so that two uses of one reward with other options stay apart."""
    return [f"{name}@{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return float(mean), float(math.sqrt(var))


def completion_text(completion: Any) -> str:
    """A completion's text: a string, or for conversational data (TRL's and grouprl's) a list
    of messages whose last one is the reply (its content a string or a list of text parts).
    Built-in rewards read every completion through it, so they take either form."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        if isinstance(content, list):
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return str(content)
    raise TypeError(f"a completion must be a string or a list of chat messages, got {type(completion).__name__}")
