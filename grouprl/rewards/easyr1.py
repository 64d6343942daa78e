"""EasyR1's reward functions, called as they are: the adapter from EasyR1's contracts to grouprl's.

An EasyR1 reward file (``examples/reward_function/math.py`` of hiyouga/EasyR1 and the files
written after it) scores responses with ``compute_score`` in one of these shapes, told apart by
``worker.reward.reward_type`` (EasyR1's key), else by the file's ``REWARD_TYPE``, else by the
function's signature:

=============  ==========================================================  ====================
reward_type    called as                                                    EasyR1 version
=============  ==========================================================  ====================
batch          ``compute_score(reward_inputs: list[dict]) -> list[dict]``   0.3.1 and later
sequential     ``compute_score(reward_input: dict) -> dict``                0.3.1 and later
batch          ``compute_score(predicts: list[str], ground_truths: list[str]) -> list[dict]``  0.3.0
sequential,    ``compute_score(predict_str: str, ground_truth: str) -> dict | float``   before 0.3.1
function
=============  ==========================================================  ====================

Each input dict holds what EasyR1 builds: ``response`` (the decoded response), ``response_length``
(its token count, from the ``completion_ids`` column the trainer passes, TRL's name) and
``ground_truth`` (the ``answer`` column: the record's reference). ``worker.reward.reward_function_kwargs``
are bound to the function, as EasyR1 binds them. A returned dict's ``overall`` is the score that
trains; its other entries (``format``, ``accuracy``, ...) are the reward's *parts*, logged beside it
(``rewards/<key>/<part>/mean``, and ``<key>/<part>`` in each rollout record) and never added to the
total. A float is an ``overall`` with no parts.

The adapter is a callable with grouprl's text contract, ``f(prompts, completions, **columns)``
(by position or by keyword), so a reward set scores it like any other reward. Its result is a
:class:`ScoredParts`: the list of ``overall`` values with the parts attached.
"""

from __future__ import annotations

import functools
import inspect
import math
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from grouprl.rewards.contract import RewardError, completion_text
from grouprl.rewards.registry import RewardLoadError

# EasyR1's reward_type values: batch and sequential (0.3.1 on), function (before: one response a call)
REWARD_TYPES = ("batch", "sequential", "function")
OVERALL = "overall"  # the entry of an EasyR1 score that trains (EasyR1's RewardScore)

_GROUPRL_INPUTS = ("prompts", "completions")


class ScoredParts(list):
    """The ``overall`` score of each row (the list a reward returns), with ``parts``: part name ->
    per-row values (None where a row's score has no such part), in the order the parts first appear."""

    def __init__(self, overall: Sequence[float], parts: Mapping[str, list[float | None]]):
        super().__init__(overall)
        self.parts = dict(parts)


class EasyR1Reward:
    """An EasyR1 reward function (its options already bound) behind grouprl's text contract.

    ``batch``: one call for all rows (else one call per row); ``dict_inputs``: EasyR1's
    ``RewardInput`` dicts (0.3.1 on), else ``(response(s), ground_truth(s))`` positionally.
    ``name`` is how messages name it (the config reference).
    """

    def __init__(self, fn: Callable[..., Any], name: str, *, batch: bool, dict_inputs: bool):
        self.fn, self.name, self.batch, self.dict_inputs = fn, name, batch, dict_inputs
        self.__name__ = getattr(_unwrapped(fn), "__name__", type(fn).__name__)
        # scoring's error messages point at the user's function, not at this adapter
        self.__wrapped__ = fn
        # ... while its call takes grouprl's arguments (signature() stops at __signature__ rather
        # than following __wrapped__ to the EasyR1 function's own parameters)
        self.__signature__ = inspect.signature(self.__call__, follow_wrapped=False)
        # every part name returned so far, so that a batch whose rows lack a part still reports it
        self.part_names: list[str] = []

    @property
    def reward_type(self) -> str:
        return "batch" if self.batch else "sequential"

    def __call__(self, prompts: Sequence[Any] | None = None, completions: Sequence[Any] | None = None,
                 **columns: Any) -> ScoredParts:
        if completions is None:
            raise TypeError(f"EasyR1 reward {self.name}: called without completions")
        responses = [completion_text(c) for c in completions]
        n = len(responses)
        truths = _column(columns, "answer", n, self.name)
        lengths = _response_lengths(columns, n, self.name)
        if self.dict_inputs:
            inputs: list[Any] = []
            for i, response in enumerate(responses):
                item = {"response": response, "ground_truth": truths[i]}
                if lengths is not None:
                    item["response_length"] = lengths[i]
                inputs.append(item)
            if self.batch:
                scores = self.fn(inputs)
            else:
                scores = [self.fn(item) for item in inputs]
        elif self.batch:
            scores = self.fn(responses, truths)
        else:
            scores = [self.fn(response, truth) for response, truth in zip(responses, truths)]
        return self._check(scores, n)

    def _check(self, scores: Any, n: int) -> ScoredParts:
        """The scores as overall values and parts; RewardError naming the function and the row otherwise."""
        where = f"EasyR1 reward {self.name} ({self.reward_type})"
        if isinstance(scores, (str, bytes, Mapping)) or not isinstance(scores, Sequence):
            raise RewardError(f"{where} returned a {type(scores).__name__}; expected a list of {n} score dicts",
                              reward=self.name)
        if len(scores) != n:
            raise RewardError(f"{where} returned {len(scores)} scores for {n} responses (expected {n})",
                              reward=self.name)
        overall: list[float] = []
        rows: list[dict[str, float | None]] = []
        for row, score in enumerate(scores):
            if isinstance(score, Mapping):
                if OVERALL not in score:
                    raise RewardError(f"{where}: the score of row {row} has no '{OVERALL}' (its keys: "
                                      f"{', '.join(map(str, score)) or 'none'}); '{OVERALL}' is the score trained",
                                      reward=self.name, row=row)
                parts = {str(k): _number(v, f"{where}: row {row}, '{k}'", row, self.name, allow_none=k != OVERALL)
                         for k, v in score.items()}
                overall.append(parts.pop(OVERALL))
                rows.append(parts)
            else:  # the oldest contract returns the overall score alone
                overall.append(_number(score, f"{where}: row {row}", row, self.name, allow_none=False))
                rows.append({})
            for part in rows[-1]:
                if part not in self.part_names:
                    self.part_names.append(part)
        return ScoredParts(overall, {p: [r.get(p) for r in rows] for p in self.part_names})


def _unwrapped(fn: Any) -> Any:
    while isinstance(fn, functools.partial):  # the options bound to it
        fn = fn.func
    return fn


def _number(value: Any, what: str, row: int, name: str, *, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        raise RewardError(f"{what} is a {type(value).__name__} ({value!r}); expected a number",
                          reward=name, row=row)
    f = float(value)
    if not math.isfinite(f):
        raise RewardError(f"{what} is {f}; a score must be a finite number", reward=name, row=row)
    return f


def _column(columns: Mapping[str, Any], key: str, n: int, name: str) -> list[Any]:
    if key not in columns:
        raise RewardError(f"EasyR1 reward {name}: no '{key}' column (the reference, EasyR1's ground_truth) "
                          f"was passed; columns: {', '.join(sorted(columns)) or 'none'}", reward=name)
    values = list(columns[key])
    if len(values) != n:
        raise RewardError(f"EasyR1 reward {name}: column '{key}' has {len(values)} values for {n} responses",
                          reward=name)
    return values


def _response_lengths(columns: Mapping[str, Any], n: int, name: str) -> list[int] | None:
    """Each response's token count (EasyR1's response_length): from ``completion_ids`` (TRL's column,
    the trainer passes it) or a ``response_length`` column; None when neither was passed (then the
    inputs have no ``response_length``, and a function that reads it fails with a KeyError naming it)."""
    # TRL's call passes completion_ids=None when the caller has no token ids
    if columns.get("completion_ids") is not None:
        return [len(ids) for ids in _column(columns, "completion_ids", n, name)]
    if columns.get("response_length") is not None:
        return [int(v) for v in _column(columns, "response_length", n, name)]
    return None


# ------------------------------------------------------------------ telling the contracts apart


def easyr1_reward(fn: Callable[..., Any], name: str, options: Mapping[str, Any], *,
                  reward_type: str | None = None) -> EasyR1Reward | None:
    """``fn`` (with ``options`` bound) behind grouprl's contract when it is an EasyR1 reward, None when
    it is a grouprl reward (``f(prompts, completions, **kwargs)``).

    Which: ``reward_type`` when given (``batch``, ``sequential`` or ``function``); else the
    signature: a function naming ``prompts`` or ``completions``, or with ``**kwargs`` and no
    required parameter, is grouprl's; else the function's file's ``REWARD_TYPE`` (EasyR1 0.4 on),
    else the signature again: one with one required
    positional parameter (besides ``options``) is EasyR1's batch (EasyR1's default) unless
    annotated as a dict or a str, one with two is EasyR1's sequential
    ``(predict_str, ground_truth)`` unless annotated as lists. The number of required parameters
    says whether the inputs are dicts (one) or response and ground truth (two).
    Raises :class:`RewardLoadError` naming the function when it fits no contract, or when an
    option is not one of its parameters.
    """
    if reward_type is not None and reward_type not in REWARD_TYPES:
        raise RewardLoadError(f"reward {name!r}: reward_type must be one of {', '.join(REWARD_TYPES)}; "
                              f"got {reward_type!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # no signature to read (some C callables): called with grouprl's contract
    params = list(signature.parameters.values())
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is inspect.Parameter.empty and p.name not in options]
    grouprl_names = [p.name for p in params if p.name in _GROUPRL_INPUTS]
    if reward_type is None and grouprl_names:
        return None
    declared = _declared_type(fn)
    if reward_type is None and declared is None and var_keyword and not required:
        return None
    if grouprl_names:
        raise RewardLoadError(
            f"reward {name!r} takes {', '.join(grouprl_names)} (grouprl's contract f(prompts, completions, "
            f"**kwargs)), but worker.reward.reward_type is {reward_type!r} (EasyR1's); drop the key, or write "
            "the function as EasyR1's compute_score(reward_inputs)")
    named = {p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    for option in options:
        if option not in named and not var_keyword:
            raise RewardLoadError(f"reward {name!r} has no option {option!r} (worker.reward.reward_function_kwargs); "
                                  f"its parameters are: {', '.join(p.name for p in params) or '(none)'}")
    if len(required) not in (1, 2):
        given = f"reward_type {reward_type!r}" if reward_type else "its signature"
        raise RewardLoadError(
            f"reward {name!r} fits neither grouprl's contract f(prompts, completions, **kwargs) nor EasyR1's "
            f"compute_score(reward_inputs) / compute_score(predict_str, ground_truth) (by {given}, it takes "
            f"{len(required)} required argument(s): {', '.join(p.name for p in required) or 'none'}); "
            "set worker.reward.reward_type or fix its parameters")
    kind = reward_type or declared or _type_from_annotation(fn, required[0], len(required))
    batch = kind == "batch"
    bound = _bind(fn, options)
    return EasyR1Reward(bound, name, batch=batch, dict_inputs=len(required) == 1)


def _bind(fn: Callable[..., Any], options: Mapping[str, Any]) -> Callable[..., Any]:
    return functools.partial(fn, **options) if options else fn


def _declared_type(fn: Callable[..., Any]) -> str | None:
    """The ``REWARD_TYPE`` of the file that defines ``fn`` (EasyR1 reads it there), if it declares one."""
    declared = getattr(_unwrapped(fn), "__globals__", {}).get("REWARD_TYPE")
    if declared is None:
        return None
    if declared not in REWARD_TYPES:
        raise RewardLoadError(f"reward file of {getattr(fn, '__name__', fn)!r}: REWARD_TYPE must be one of "
                              f"{', '.join(REWARD_TYPES)}; got {declared!r}")
    return declared


def _type_from_annotation(fn: Callable[..., Any], first: inspect.Parameter, required: int) -> str:
    """batch or sequential from the first parameter's annotation; EasyR1's default when it has none:
    batch for dict inputs (REWARD_TYPE's default), sequential for (predict_str, ground_truth)."""
    try:
        hints = typing.get_type_hints(_unwrapped(fn))
    except Exception:  # an annotation that names something unimportable: read the raw one
        hints = {}
    annotation = hints.get(first.name, first.annotation)
    origin = typing.get_origin(annotation) or annotation
    text = annotation if isinstance(annotation, str) else ""
    if origin in (list, Sequence, typing.List) or text.lower().startswith(("list", "sequence")):
        return "batch"
    if origin in (dict, Mapping, str, typing.Dict) or text.lower().startswith(("dict", "str", "mapping")):
        return "sequential"
    return "batch" if required == 1 else "sequential"
