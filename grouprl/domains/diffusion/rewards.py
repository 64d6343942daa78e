"""Image rewards for the flow (diffusion) trainer: the contract, the registry, scoring a batch, the built-ins.

An image reward is a callable::

    fn(images: list[PIL.Image.Image], prompts: list[str], **metadata) -> list[float | None]

called with keyword arguments for the metadata: per-row lists aligned with the images
(the prompt record's other fields, e.g. ``text``, the OCR target). A function must
accept ``**metadata`` for the columns it ignores. ``None`` means "not applicable to this
row". ``async def`` functions are awaited on the event loop; plain functions run in a
worker thread (``asyncio.to_thread``) so that a slow one (OCR, a local model) does not
hold up the others: every reward of a set runs concurrently. Images are RGB and shared
between the rewards of a set: a reward must not modify them in place.

Reference a reward by registered name (``ocr``, ``vlm_judge``, ``image_brightness``),
``path/to/file.py:function`` or ``module:function``; combine several with weights::

    rewards = ImageRewardSet.from_specs([{"name": "ocr"}, {"name": "vlm_judge", "weight": 0.5,
                                                            "kwargs": {"base_url": "http://judge:8000/v1"}}])
    result = rewards.score(images, prompts, {"text": targets})
    result.components["ocr"], result.total, result.metrics()

or in one call, ``score_images(specs, images, prompts, metadata)``.

Failures are never a score. A reward that raises fails the batch with a
:class:`~grouprl.rewards.RewardError` naming it and the number of rows, unless its
spec says ``on_error: none``: its rows are then None, the error is kept in
``result.errors`` and logged. A wrong number of values, a non-number or a NaN is a bug
in the reward and always raises. As on the text side (:class:`grouprl.rewards.RewardSet`),
``total[i]`` is the weighted sum of the rewards that apply to row ``i``, and a row no
reward applies to is an error, or None (unscored, never 0) with ``allow_unscored``.

The registry is separate from the text rewards' (the two contracts differ); loading
from a file or module reuses the text registry's loader, so a file named by both shares
one module object.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import functools
import inspect
import io
import logging
import math
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from grouprl.rewards.chat_endpoint import ChatCallError, ChatEndpoint, UnusableReply, excerpt
from grouprl.rewards.contract import RewardError, RewardResult, RewardSpec, reward_keys
from grouprl.rewards.registry import RewardLoadError, _load_from_file, _load_from_module, _qualified_name

logger = logging.getLogger(__name__)

ImageRewardFn = Callable[..., Any]

# Keyword names the contract itself uses; a metadata column or option by these names would be ambiguous.
_RESERVED = ("images", "prompts")
ON_ERROR = ("raise", "none")

_IMAGE_REGISTRY: dict[str, ImageRewardFn] = {}


# ---------------------------------------------------------------------------- registry


def register_image_reward(name: str) -> Callable[[ImageRewardFn], ImageRewardFn]:
    """Decorator registering an image reward under ``name`` (returns the function unchanged).

    The same rules as the text rewards' :func:`~grouprl.rewards.register_reward`: no ``:``
    (reserved for ``file.py:function``) or ``@`` (the ``name@i`` keys of a name used twice
    in one set); re-registering the same function (a module reloaded) is allowed, another
    function under a taken name is not.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"image reward name must be a non-empty string, got {name!r}")
    if ":" in name or "@" in name:
        raise ValueError(f"image reward name {name!r} may not contain ':' or '@'")

    def decorate(fn: ImageRewardFn) -> ImageRewardFn:
        if not callable(fn):
            raise TypeError(f"register_image_reward({name!r}) needs a callable, got {type(fn).__name__}")
        existing = _IMAGE_REGISTRY.get(name)
        if existing is not None and _qualified_name(existing) != _qualified_name(fn):
            raise ValueError(
                f"image reward name {name!r} is already registered to {_qualified_name(existing)}; "
                f"cannot register {_qualified_name(fn)} under it"
            )
        _IMAGE_REGISTRY[name] = fn
        return fn

    return decorate


def list_image_rewards() -> list[str]:
    """The registered image reward names, sorted."""
    return sorted(_IMAGE_REGISTRY)


def get_image_reward(name_or_path: str) -> ImageRewardFn:
    """The image reward for a registered name, ``path/to/file.py:function`` or ``module:function``.

    Raises :class:`~grouprl.rewards.RewardLoadError` naming the reference when the name
    is unknown, the file or module is missing, or it has no such function.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise RewardLoadError(f"an image reward reference must be a non-empty string, got {name_or_path!r}")
    ref = name_or_path.strip()
    if ref in _IMAGE_REGISTRY:
        return _IMAGE_REGISTRY[ref]
    if ":" in ref:
        # rpartition: the function name never holds ':', a Windows drive letter may.
        source, _, function = ref.rpartition(":")
        if not function:
            raise RewardLoadError(f"image reward {ref!r} names no function after ':'")
        try:
            if source.endswith(".py"):
                return _load_from_file(source, function)
            return _load_from_module(source, function)
        except RewardLoadError as exc:
            raise RewardLoadError(f"image reward {ref!r}: {exc}") from exc
    if ref.endswith(".py"):
        raise RewardLoadError(f"image reward {ref!r} names a file but no function; write it as {ref}:function_name")
    raise RewardLoadError(
        f"unknown image reward {ref!r}. Known image rewards: {', '.join(list_image_rewards()) or '(none)'}; "
        "or reference a function as path/to/file.py:function (text rewards such as 'accuracy' are a "
        "different contract and are not image rewards)"
    )


# ---------------------------------------------------------------------------- specs


@dataclass
class ImageRewardSpec:
    """One image reward of a set, as written in config.

    ``name``, ``weight`` and ``kwargs`` as in :class:`~grouprl.rewards.RewardSpec` (and
    checked by it); ``kwargs`` are bound to the function when it is loaded.
    ``on_error``: ``raise`` (default: a reward that raises fails the batch) or ``none``
    (its rows become None for that batch; the error is recorded and logged), for a
    remote judge whose outages should cost rows rather than the run.
    """

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    on_error: str = "raise"

    def __post_init__(self) -> None:
        checked = RewardSpec(self.name, self.weight, self.kwargs)  # the text side's checks and messages
        self.weight, self.kwargs = checked.weight, checked.kwargs
        if self.on_error not in ON_ERROR:
            raise RewardLoadError(
                f"image reward {self.name!r}: on_error must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}"
            )

    @classmethod
    def coerce(cls, spec: Any) -> "ImageRewardSpec":
        """A spec from itself, a reference string, a mapping {name, weight, kwargs, on_error}, or an
        object with those attributes (a :class:`~grouprl.rewards.RewardSpec`, the config's
        ``RewardFunctionConfig``; ``on_error`` is read when the object has it)."""
        if isinstance(spec, ImageRewardSpec):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, Mapping):
            unknown = sorted(set(spec) - {"name", "weight", "kwargs", "on_error"})
            if unknown:
                raise RewardLoadError(
                    f"image reward spec {dict(spec)!r} has unknown keys {unknown}; "
                    "allowed: name, weight, kwargs, on_error"
                )
            if "name" not in spec:
                raise RewardLoadError(f"image reward spec {dict(spec)!r} has no 'name'")
            return cls(spec["name"], spec.get("weight", 1.0), spec.get("kwargs") or {}, spec.get("on_error", "raise"))
        if hasattr(spec, "name") and hasattr(spec, "weight"):
            return cls(spec.name, spec.weight, getattr(spec, "kwargs", None) or {}, getattr(spec, "on_error", "raise"))
        raise RewardLoadError(
            f"an image reward spec must be a name, a mapping or a spec object, got {type(spec).__name__}"
        )


@dataclass(frozen=True)
class ImageReward:
    """A loaded image reward: its key in results, the function (options bound), weight and failure policy."""

    key: str
    fn: ImageRewardFn
    weight: float = 1.0
    on_error: str = "raise"

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.fn.keywords) if isinstance(self.fn, functools.partial) else {}


@dataclass
class ImageRewardResult(RewardResult):
    """:class:`~grouprl.rewards.RewardResult` plus ``errors``: key -> why, for the rewards that
    failed with ``on_error: none`` (their rows are None in ``components``)."""

    errors: dict[str, str] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The text side's metrics, plus ``rewards/{key}/failed`` (1.0 when it failed this batch) for every key."""
        out = super().metrics()
        for key in self.components:
            out[f"rewards/{key}/failed"] = 1.0 if key in self.errors else 0.0
        return out


# ---------------------------------------------------------------------------- scoring


class ImageRewardSet:
    """Several image rewards with weights; :meth:`ascore` / :meth:`score` run them concurrently on a batch."""

    def __init__(self, rewards: Sequence[ImageReward]):
        if not rewards:
            raise RewardLoadError("an image reward set needs at least one reward")
        keys = [r.key for r in rewards]
        if len(set(keys)) != len(keys):
            raise RewardLoadError(f"image reward keys must be unique, got {keys}")
        self.rewards = list(rewards)

    @classmethod
    def from_specs(cls, specs: Iterable[Any]) -> "ImageRewardSet":
        """Load every spec (see :meth:`ImageRewardSpec.coerce`; a plain function is keyed by its ``__name__``).

        A name used more than once gets ``name@i`` for every use, ``i`` its position in ``specs``.
        Options are checked against the function's parameters now, not at the first batch.
        """
        loaded: list[tuple[str, ImageRewardFn, float, str]] = []
        for item in specs:
            if callable(item) and not isinstance(item, (str, Mapping)) and not hasattr(item, "weight"):
                name = getattr(item, "__name__", type(item).__name__)
                _check_signature(name, item, {})
                loaded.append((name, item, 1.0, "raise"))
                continue
            spec = ImageRewardSpec.coerce(item)
            fn = get_image_reward(spec.name)
            _check_signature(spec.name, fn, spec.kwargs)
            bound = functools.partial(fn, **spec.kwargs) if spec.kwargs else fn
            loaded.append((spec.name.strip(), bound, spec.weight, spec.on_error))
        keys = reward_keys([name for name, *_ in loaded])
        return cls([ImageReward(key, fn, weight, on_error) for key, (_, fn, weight, on_error) in zip(keys, loaded)])

    @property
    def keys(self) -> list[str]:
        return [r.key for r in self.rewards]

    @property
    def weights(self) -> dict[str, float]:
        return {r.key: r.weight for r in self.rewards}

    async def ascore(
        self, images: Sequence[Any], prompts: Sequence[str], metadata: Mapping[str, Sequence[Any]] | None = None,
        *, allow_unscored: bool = False,
    ) -> ImageRewardResult:
        """Score a batch on the caller's event loop: async rewards awaited, sync ones in worker threads, all at once."""
        images, columns = self._check_inputs(images, prompts, metadata)
        n = len(images)
        if not n:
            return ImageRewardResult({k: [] for k in self.keys}, [], self.weights)
        # return_exceptions: every reward finishes (no orphaned threads or requests), and
        # errors are then reported in spec order under the right reward's name.
        outcomes = await asyncio.gather(
            *(_call(r.fn, images, prompts, columns) for r in self.rewards), return_exceptions=True
        )
        return self._combine(outcomes, n, allow_unscored)

    def score(
        self, images: Sequence[Any], prompts: Sequence[str], metadata: Mapping[str, Sequence[Any]] | None = None,
        *, allow_unscored: bool = False,
    ) -> ImageRewardResult:
        """:meth:`ascore` for plain code. Inside a running event loop (where ``asyncio.run`` refuses
        and blocking would deadlock) it runs on a fresh loop in a worker thread."""
        scoring = self.ascore(images, prompts, metadata, allow_unscored=allow_unscored)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(scoring)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grouprl-image-rewards") as pool:
            return pool.submit(asyncio.run, scoring).result()

    def _check_inputs(self, images, prompts, metadata) -> tuple[list[Any], dict[str, list[Any]]]:
        n = len(images)
        if len(prompts) != n:
            raise ValueError(f"got {len(prompts)} prompts for {n} images; pass one prompt per image")
        checked_images = [_as_rgb(image, row) for row, image in enumerate(images)]
        columns: dict[str, list[Any]] = {}
        for name, values in (metadata or {}).items():
            if name in _RESERVED:
                raise ValueError(f"metadata column {name!r} clashes with the image reward argument of that name")
            if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
                raise ValueError(f"metadata column {name!r} must be a per-row list, got {type(values).__name__}")
            if len(values) != n:
                raise ValueError(f"metadata column {name!r} has {len(values)} values for {n} images")
            columns[name] = list(values)
        for reward in self.rewards:
            clash = sorted(set(reward.options) & set(columns))
            if clash:
                raise RewardError(
                    f"image reward {reward.key!r}: option(s) {clash} have the same name as metadata column(s); "
                    "the column would silently override the option. Rename the column.",
                    reward=reward.key,
                )
        return checked_images, columns

    def _combine(self, outcomes: list[Any], n: int, allow_unscored: bool) -> ImageRewardResult:
        components: dict[str, list[float | None]] = {}
        errors: dict[str, str] = {}
        for reward, raw in zip(self.rewards, outcomes):
            if isinstance(raw, Exception):
                error = _wrap(reward.key, raw, n)
                if reward.on_error != "none":
                    raise error from raw
                logger.warning("%s; its rows are left unscored (on_error=none)", error)
                errors[reward.key] = str(error)
                components[reward.key] = [None] * n
                continue
            if isinstance(raw, BaseException):  # KeyboardInterrupt, cancellation: not the reward's fault
                raise raw
            components[reward.key] = _validate(reward.key, raw, n)
        total: list[float | None] = []
        for row in range(n):
            applicable = [(r.weight, components[r.key][row])
                          for r in self.rewards if components[r.key][row] is not None]
            if applicable:
                total.append(float(sum(w * v for w, v in applicable)))
            elif allow_unscored:
                total.append(None)  # unscored: the caller leaves the row out; never a 0
            else:
                failed = f"; failed: {', '.join(f'{k} ({e})' for k, e in errors.items())}" if errors else ""
                raise RewardError(
                    f"row {row}: every image reward returned None ({', '.join(self.keys)}){failed}; "
                    "at least one reward must apply to each row (or score with allow_unscored=True)",
                    row=row,
                )
        return ImageRewardResult(components=components, total=total, weights=self.weights, errors=errors)

    def __repr__(self) -> str:
        return f"ImageRewardSet({', '.join(f'{r.key}*{r.weight:g}' for r in self.rewards)})"


def score_images(
    specs: ImageRewardSet | Iterable[Any], images: Sequence[Any], prompts: Sequence[str],
    metadata: Mapping[str, Sequence[Any]] | None = None, *, allow_unscored: bool = False,
) -> ImageRewardResult:
    """Score a batch with ``specs`` (an :class:`ImageRewardSet`, or specs to load): per-reward values and the total.

    ``result.components[key][i]`` is reward ``key`` on row ``i`` (None: not applicable);
    ``result.total[i] = sum(weight[k] * components[k][i])`` over the rewards applying to row ``i``.
    """
    rewards = specs if isinstance(specs, ImageRewardSet) else ImageRewardSet.from_specs(specs)
    return rewards.score(images, prompts, metadata, allow_unscored=allow_unscored)


async def ascore_images(
    specs: ImageRewardSet | Iterable[Any], images: Sequence[Any], prompts: Sequence[str],
    metadata: Mapping[str, Sequence[Any]] | None = None, *, allow_unscored: bool = False,
) -> ImageRewardResult:
    """:func:`score_images` on the caller's event loop."""
    rewards = specs if isinstance(specs, ImageRewardSet) else ImageRewardSet.from_specs(specs)
    return await rewards.ascore(images, prompts, metadata, allow_unscored=allow_unscored)


async def _call(fn: ImageRewardFn, images: list[Any], prompts: list[str], columns: dict[str, list[Any]]) -> Any:
    # Fresh list copies: a reward that mutates its inputs must not change what the next one sees.
    images, prompts, kwargs = list(images), list(prompts), {k: list(v) for k, v in columns.items()}
    if _is_async(fn):
        return await fn(images, prompts, **kwargs)
    out = await asyncio.to_thread(fn, images, prompts, **kwargs)
    if inspect.isawaitable(out):  # a plain callable handing back a coroutine
        out = await out
    return out


def _is_async(fn: Any) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _as_rgb(image: Any, row: int) -> Any:
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise TypeError(f"images[{row}] must be a PIL.Image, got {type(image).__name__}")
    # load() now: lazily decoded images read by several reward threads at once would race.
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def _check_signature(name: str, fn: ImageRewardFn, options: Mapping[str, Any]) -> None:
    """Fail at load, not at the first batch, on functions that break the contract or on mistyped options."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # some C callables have no signature; their errors surface when called
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise RewardLoadError(
            f"image reward {name!r} must accept **metadata: it is called with every metadata column, "
            "including ones it does not use"
        )
    named = {
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    } - set(_RESERVED)
    for option in options:
        if option in _RESERVED:
            raise RewardLoadError(f"image reward {name!r}: {option!r} cannot be an option")
        # An option the function does not name would vanish into **metadata: a typo would be ignored.
        if option not in named:
            raise RewardLoadError(
                f"image reward {name!r} has no option {option!r}; its named parameters are: "
                f"{', '.join(sorted(named)) or '(none)'}"
            )


def _wrap(key: str, exc: Exception, n: int) -> RewardError:
    return RewardError(
        f"image reward {key!r} raised {type(exc).__name__} on a batch of {n} row(s): {exc}",
        reward=key, row=getattr(exc, "row", None),
    )


def _validate(key: str, raw: Any, n: int) -> list[float | None]:
    if isinstance(raw, (str, bytes, Mapping)) or not hasattr(raw, "__iter__"):
        raise RewardError(f"image reward {key!r} returned a {type(raw).__name__}; "
                          f"expected a list of {n} floats or None", reward=key)
    values = list(raw)
    if len(values) != n:
        raise RewardError(f"image reward {key!r} returned {len(values)} values for {n} images", reward=key)
    out: list[float | None] = []
    for row, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        # numpy scalars and 0-d tensors are fine; "0.5" is a bug in the reward, not a score to parse.
        if isinstance(v, (str, bytes)) or not hasattr(type(v), "__float__"):
            raise RewardError(f"image reward {key!r} returned a {type(v).__name__} ({v!r}) at row {row}; "
                              "expected a float or None", reward=key, row=row)
        f = float(v)
        if not math.isfinite(f):
            raise RewardError(f"image reward {key!r} returned {f} at row {row}; a reward must be a finite number "
                              "or None", reward=key, row=row)
        out.append(f)
    return out


# ---------------------------------------------------------------------------- text targets and edit distance

_QUOTED = re.compile(r'"([^"]*)"')
_SPACES = re.compile(r"\s+")


def quoted_text(prompt: str) -> str | None:
    """The text between the first pair of ASCII double quotes of ``prompt`` (``'a sign saying "OPEN"'`` -> ``OPEN``),
    or None when it has no closed pair. Flow-GRPO's OCR prompts put the text to render there."""
    m = _QUOTED.search(prompt)
    return m.group(1) if m else None


def normalize_ocr_text(text: str) -> str:
    """Lowercase and remove every whitespace character.

    Flow-GRPO's OCR reward (``flow_grpo/ocr.py``) does ``text.replace(' ', '').lower()``
    on both sides: case and word spacing are not what the reward trains. Every
    whitespace character (newlines, tabs) goes here, not only the space, since a
    multi-line target or a VLM's reply may hold line breaks.
    """
    return _SPACES.sub("", text).lower()


def levenshtein(a: str, b: str) -> int:
    """The edit distance between ``a`` and ``b``: the fewest single-character insertions,
    deletions and substitutions that turn one into the other.

    Wagner-Fischer dynamic programming keeping one row: d[i][j] = min(d[i-1][j] + 1,
    d[i][j-1] + 1, d[i-1][j-1] + (a[i] != b[j])); O(len(a) len(b)) time, O(min) memory.
    """
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(recognised: str, target: str, *, substring_match: bool = True) -> float:
    """1 - min(d, len(t)) / len(t), with r, t the normalised recognised and target texts
    (:func:`normalize_ocr_text`) and d = levenshtein(r, t); in [0, 1].

    ``substring_match`` (Flow-GRPO's rule): d = 0 when t occurs in r, so extra text
    around the target (a caption, a logo) is not penalised. Raises ValueError when the
    target is empty after normalisation (the ratio is undefined).
    """
    r, t = normalize_ocr_text(recognised), normalize_ocr_text(target)
    if not t:
        raise ValueError(f"OCR target {target!r} is empty after normalisation")
    distance = 0 if substring_match and t in r else levenshtein(r, t)
    return 1.0 - min(distance, len(t)) / len(t)


def ocr_targets(prompts: Sequence[str], text: Sequence[Any] | None = None) -> list[str | None]:
    """Each row's target: the ``text`` metadata value when given (and not None), else the prompt's quoted text.

    None (the row is not applicable) when neither gives a target that is non-empty after normalisation.
    """
    if text is not None and len(text) != len(prompts):
        raise ValueError(f"metadata column 'text' has {len(text)} values for {len(prompts)} prompts")
    targets: list[str | None] = []
    for row, prompt in enumerate(prompts):
        target = text[row] if text is not None and text[row] is not None else quoted_text(prompt)
        target = None if target is None else str(target)
        targets.append(target if target is not None and normalize_ocr_text(target) else None)
    return targets


# ---------------------------------------------------------------------------- built-in: ocr

# One engine for the process: building it loads three ONNX models (about a second). The
# lock guards building and every call, as RapidOCR's pipeline is not documented thread-safe
# and sync rewards run in worker threads.
_OCR_ENGINE: Any = None
_OCR_LOCK = threading.Lock()


def _ocr_engine() -> Any:
    """The shared RapidOCR engine; call with ``_OCR_LOCK`` held."""
    global _OCR_ENGINE
    if _OCR_ENGINE is None:
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as exc:
            raise ImportError(
                "the 'ocr' image reward needs rapidocr_onnxruntime: pip install 'grouprl[ocr]' "
                "(or pip install rapidocr_onnxruntime)"
            ) from exc
        _OCR_ENGINE = RapidOCR()
    return _OCR_ENGINE


def read_text(image: Any) -> str:
    """The text RapidOCR finds in ``image``: its detected strings concatenated in its reading
    order (top to bottom, left to right); ``""`` when it finds none.

    RapidOCR keeps the strings it recognises with confidence >= 0.5 (its ``text_score``);
    Flow-GRPO's PaddleOCR reading keeps every string with confidence > 0.
    """
    with _OCR_LOCK:
        result, _ = _ocr_engine()(image)  # a PIL image: RapidOCR converts RGB to its BGR itself
    return "".join(entry[1] for entry in result or [])


@register_image_reward("ocr")
def ocr_reward(
    images: Sequence[Any], prompts: Sequence[str], *, text: Sequence[str | None] | None = None,
    substring_match: bool = True, **metadata: Any,
) -> list[float | None]:
    """OCR accuracy (Flow-GRPO): :func:`ocr_score` of RapidOCR's reading (:func:`read_text`) against the target.

    The target is the ``text`` metadata column when given, else the text between the
    prompt's first pair of double quotes (:func:`ocr_targets`); a row without one gets
    None and is not read. An OCR failure raises (Flow-GRPO scores it 0: here it is never
    a score). Needs ``rapidocr_onnxruntime`` (``pip install 'grouprl[ocr]'``).
    """
    targets = ocr_targets(prompts, text)
    return [
        None if target is None else ocr_score(read_text(image), target, substring_match=substring_match)
        for image, target in zip(images, targets)
    ]


# ---------------------------------------------------------------------------- built-in: image_brightness


@register_image_reward("image_brightness")
def image_brightness_reward(images: Sequence[Any], prompts: Sequence[str], **metadata: Any) -> list[float]:
    """The mean pixel value in [0, 1] (over R, G, B and every pixel; 0 black, 1 white).

    A trivial sanity reward: its optimum is obvious, so a trainer that learns it works end to end.
    """
    from PIL import ImageStat

    return [sum(ImageStat.Stat(image.convert("RGB")).mean) / (3 * 255.0) for image in images]


# ---------------------------------------------------------------------------- built-in: vlm_judge

JUDGE_API_KEY_ENV = "GROUPRL_JUDGE_API_KEY"
JUDGE_MODES = ("unified_reward", "ocr")

UNIFIED_REWARD_PROMPT = (
    "You are judging an image that was generated from a caption.\n"
    "Caption: {prompt}\n\n"
    "Rate how well the image matches the caption: the objects it names and how many there are, "
    "their colours, attributes and positions, any text it asks for, and the image's overall quality. "
    "Explain your reasoning in a few sentences, then end your reply with one line of the form\n"
    "Final Score: x\n"
    "where x is a number from 1 (the image does not match the caption) to 5 (it matches perfectly)."
)
OCR_PROMPT = (
    "Read all the text written in this image. Reply with that text exactly as written and nothing "
    "else. If the image holds no text, reply with an empty message."
)

# The last match is the verdict: an earlier one may be the model quoting the instruction.
# Markdown bold around the label or the number ("**Final Score:** 4") is common.
_FINAL_SCORE = re.compile(r"final\s*score\s*\**\s*:\s*\**\s*([0-9]+(?:\.[0-9]+)?)", re.IGNORECASE)


class JudgeError(RewardError):
    """A VLM judge call failed after its retries, or its reply could not be used.

    ``url`` is the endpoint, ``row`` the batch row, ``attempts`` how many requests were
    made, ``status`` the last HTTP status (None when no answer came back).
    """

    def __init__(self, message: str, *, url: str, row: int, attempts: int = 0, status: int | None = None):
        super().__init__(message, reward="vlm_judge", row=row)
        self.url = url
        self.attempts = attempts
        self.status = status


def parse_final_score(reply: str) -> float | None:
    """The number of the last ``Final Score: x`` line of a judge's reply, or None without one."""
    matches = _FINAL_SCORE.findall(reply or "")
    return float(matches[-1]) if matches else None


def unified_reward_score(reply: str, *, row: int, url: str) -> float:
    """x / 5 for a reply ending ``Final Score: x`` with x in [1, 5] (UnifiedReward's scale).

    A reply without a score, or one off the scale, raises :class:`JudgeError` naming the
    row: a judge that did not judge gives no score, never 0.
    """
    x = parse_final_score(reply)
    if x is None:
        raise JudgeError(f"VLM judge {url} gave no 'Final Score: x' line for row {row}; reply: {excerpt(reply)}",
                         url=url, row=row)
    if not 1.0 <= x <= 5.0:
        raise JudgeError(f"VLM judge {url} gave Final Score {x:g} for row {row}, off the 1-5 scale", url=url, row=row)
    return x / 5.0


def image_data_url(image: Any) -> str:
    """``data:image/png;base64,...`` of the image encoded as PNG (lossless: the judge sees the pixels scored)."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def judge_messages(data_url: str, text: str) -> list[dict[str, Any]]:
    """One user message holding the image (as a data URL) and then the instruction."""
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "text", "text": text},
    ]}]


@register_image_reward("vlm_judge")
async def vlm_judge_reward(
    images: Sequence[Any], prompts: Sequence[str], *, base_url: str | None = None, model: str = "",
    mode: str = "unified_reward", api_key: str | None = None, text: Sequence[str | None] | None = None,
    timeout: float = 60.0, max_retries: int = 3, retry_backoff: float | None = None, concurrency: int = 8,
    max_tokens: int = 1024, temperature: float = 0.0, **metadata: Any,
) -> list[float | None]:
    """A VLM judge behind an OpenAI-compatible ``POST {base_url}/chat/completions`` (vLLM, SGLang, a hosted API).

    Each image goes as a PNG data URL in one user message with the instruction of ``mode``:

    - ``unified_reward``: rate how well the image matches its prompt, ending with
      ``Final Score: x`` (1-5); reward x / 5 (:func:`unified_reward_score`);
    - ``ocr``: read the text in the image; reward :func:`ocr_score` of the reply against
      the target (:func:`ocr_targets`: the ``text`` column or the prompt's quoted text;
      a row without one gets None and is not sent).

    The bearer key is ``api_key`` or ``$GROUPRL_JUDGE_API_KEY`` (neither: no
    Authorization header). Requests go through the ``openai`` SDK
    (:class:`grouprl.rewards.chat_endpoint.ChatEndpoint`); at most ``concurrency`` are
    in flight; each gets ``timeout`` seconds and is retried up to ``max_retries`` times
    on timeouts, connection errors, 408, 409, 429 and 5xx, after the server's
    ``Retry-After`` or else 0.5 s doubling up to 8 s (``retry_backoff`` is no longer
    accepted: the SDK sets the back-off). A call still failing, another HTTP error or
    an unusable reply raises :class:`JudgeError` naming the URL and the row (the first
    failure cancels the batch's other requests).
    """
    if mode not in JUDGE_MODES:
        raise ValueError(f"vlm_judge: mode must be one of {', '.join(JUDGE_MODES)}, got {mode!r}")
    if not base_url:
        raise ValueError("vlm_judge needs the option 'base_url' (e.g. http://host:8000/v1)")
    if retry_backoff is not None:
        raise ValueError("vlm_judge: the option 'retry_backoff' is no longer supported: retries wait as the openai "
                         "client does (the server's Retry-After, else 0.5 s doubling up to 8 s); remove it, and "
                         "bound the retries with 'max_retries' and 'timeout'")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"vlm_judge: concurrency must be a positive integer, got {concurrency!r}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"vlm_judge: max_retries must be a non-negative integer, got {max_retries!r}")
    key = api_key if api_key is not None else os.environ.get(JUDGE_API_KEY_ENV) or None
    endpoint = ChatEndpoint(base_url, api_key=key, timeout=timeout, max_retries=max_retries, connections=concurrency,
                            extra="judge", user="the 'vlm_judge' image reward")
    url = endpoint.url
    targets = ocr_targets(prompts, text) if mode == "ocr" else [None] * len(images)
    limit = asyncio.Semaphore(concurrency)

    async def one(row: int) -> float | None:
        if mode == "ocr" and targets[row] is None:
            return None
        instruction = OCR_PROMPT if mode == "ocr" else UNIFIED_REWARD_PROMPT.format(prompt=prompts[row])
        async with limit:
            # PNG encoding takes milliseconds per image: off the loop, so requests keep flowing.
            data_url = await asyncio.to_thread(image_data_url, images[row])
            body = {"model": model, "messages": judge_messages(data_url, instruction),
                    "max_tokens": max_tokens, "temperature": temperature}
            try:
                reply = await endpoint.acomplete(body)
            except UnusableReply as exc:
                raise JudgeError(f"VLM judge {url} answered row {row} without a reply text: {exc}", url=url,
                                 row=row, attempts=exc.attempts, status=exc.status) from None
            except ChatCallError as exc:
                what = (f"refused row {row}" if exc.refused else
                        f"failed for row {row} after {exc.attempts} attempt(s) "
                        f"(last status {exc.status if exc.status is not None else 'none'})")
                raise JudgeError(f"VLM judge {url} {what}: {exc}", url=url, row=row, attempts=exc.attempts,
                                 status=exc.status) from None
        if mode == "ocr":
            return ocr_score(reply.text, targets[row])
        return unified_reward_score(reply.text, row=row, url=url)

    try:
        tasks = [asyncio.ensure_future(one(row)) for row in range(len(images))]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            # The first failure decides the batch: stop the other requests' retries too.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
    finally:
        await endpoint.aclose()


@register_image_reward("shapes")
def shapes_task_reward(images: list[Any], prompts: list[str], **metadata: Any) -> list[float]:
    """The synthetic shapes task's rule reward (``grouprl.domains.diffusion.shapes.shapes_reward``): colour,
    position and count read from the pixels, in [0, 1]. Registered here so configs can name it."""
    from grouprl.domains.diffusion.shapes import shapes_reward

    return shapes_reward(images, prompts, **metadata)
