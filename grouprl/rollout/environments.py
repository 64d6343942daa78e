"""Environments for multi-turn rollouts: what answers the policy between its turns.

One environment object per dialogue, made by a factory (a class or any callable) and reset
from the dialogue's sample::

    class Guess(Environment):
        reward_parts = ("solved",)           # the reward parts its steps may give

        def reset(self, sample):             # -> text or content parts for the first user message, or None
            self.secret = int(sample.answer)

        def step(self, message):             # the policy's turn (text) -> Step (sync or ``async def``)
            if str(self.secret) in message:
                return Step(done=True, reward={"solved": 1.0})
            return Step([{"role": "user", "content": "Wrong, try again."}])

        def hint(self, digit: int) -> str:   # a public method is a tool (type hints + docstring)
            \"\"\"Whether the secret holds a digit.

            Args:
                digit: the digit, 0 to 9
            \"\"\"
            return str(digit in map(int, str(self.secret)))

``reset`` may return text (or a list of content parts) that is appended to the sample's last
user message, as TRL's environments do. After each policy turn the rollout first runs the tool
calls the turn made (:mod:`grouprl.rollout.tools`; the environment's public methods are tools
beside ``worker.rollout.multi_turn.tools``); a turn without tool calls goes to ``step``, whose
:class:`Step` says what the policy reads next (user or tool messages, text and images), whether
the dialogue is done, and any reward parts. An environment with no ``step`` (a TRL environment:
tools alone) ends the dialogue at the first turn without a tool call.

Rewards: ``Step.reward`` (a number for the single part in ``reward_parts``, or ``{part:
value}``) is summed over a dialogue's steps; ``get_reward()``, when defined, is called once at
the end of the dialogue (TRL's name; it may return a number or parts too). The parts reach the
reward set as components named after the part (weight ``worker.rollout.multi_turn.reward_weights``,
default 1), so they are logged, weighted and checked like any reward; a row whose environment
gave no value for a part is unscored for it (None, never 0). ``columns()``, when defined, gives
more per-dialogue columns for the reward functions (the verifier's hallucination score).

TRL's environments (``GRPOTrainer(environment_factory=...)``) work unchanged: a factory whose
objects are not :class:`Environment` instances is adapted (:class:`TRLEnvironment`): ``reset`` is
called with the record's fields as keyword arguments (``prompt`` and the dataset's columns, as
TRL calls it), public methods are tools, ``get_reward()`` is the reward part named after the
class. What differs is in :class:`TRLEnvironment`'s docstring.

Environments are named like rewards: a name registered in :data:`ENVIRONMENTS`,
``path/to/file.py:Class`` or ``module:Class``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from grouprl.registry import Registry
from grouprl.rewards.registry import RewardLoadError, get_reward


class EnvironmentLoadError(ValueError):
    """An environment reference that cannot be turned into a factory, or a factory whose objects break the protocol."""


class EnvironmentFailure(RuntimeError):
    """An environment call failed under ``on_failure: fail``, or returned what the protocol does not allow."""

# Methods of the protocol, never offered to the policy as tools.
PROTOCOL_METHODS = frozenset({"reset", "step", "step_many", "get_reward", "columns", "metrics", "close"})


@dataclass
class Step:
    """An environment's answer to one policy turn.

    ``messages``: chat messages appended to the dialogue before the next policy turn, role
    ``user`` or ``tool``; content a string or a list of parts (``{"type": "text", "text": ...}``,
    ``{"type": "image", "image": PIL image or array}``). ``done`` ends the dialogue after this
    turn (its messages are then not shown). ``reward``: a number (the environment's single reward
    part) or ``{part: number}``. ``failed``: the environment could not answer (the rollout's
    failure policy applies; ``error`` says why).
    """

    messages: list[dict] = field(default_factory=list)
    done: bool = False
    reward: float | Mapping[str, float] | None = None
    failed: bool = False
    error: str | None = None


class Environment:
    """The protocol's base class; subclass it (or write a TRL environment, adapted by :func:`environment_factory`).

    ``failure_reason`` is the stop reason of a dialogue this environment failed on.
    """

    reward_parts: tuple[str, ...] = ()
    failure_reason: str = "environment_failure"

    def reset(self, sample) -> str | list[dict] | None:
        return None

    def step(self, message: str) -> Step:
        """The answer to the policy's turn ``message`` (not called when the turn made tool calls)."""
        return Step(done=True)

    def tools(self) -> list[Callable[..., Any]]:
        """This dialogue's tools: the public methods other than the protocol's (bound to this object)."""
        return public_methods(self)


def public_methods(obj: Any) -> list[Callable[..., Any]]:
    """``obj``'s public methods, the protocol's (``reset``, ``step``, ``get_reward``, ...) and
    :class:`Environment`'s own left out, in definition order (read from the class, so properties are
    not evaluated)."""
    own = set(vars(Environment))
    names = []
    for cls in reversed(type(obj).__mro__):
        if cls is object or cls is Environment:
            continue
        for name, member in vars(cls).items():
            if (inspect.isfunction(member) and not name.startswith("_") and name not in PROTOCOL_METHODS
                    and name not in own and name not in names):
                names.append(name)
    return [getattr(obj, name) for name in names]


class TRLEnvironment(Environment):
    """A TRL environment (``GRPOTrainer(environment_factory=...)``) under grouprl's protocol.

    As TRL: ``reset(**row)`` with the record's fields (``prompt``, as the record wrote it, and the
    dataset's columns; a multi-environment record's ``environment`` field left out), its text
    appended to the last user message; the public methods are the tools; a turn without a tool call
    ends the dialogue; ``get_reward()`` is one reward part named after the class. What differs:
    grouprl keeps one instance per dialogue for the call (TRL pools instances across batches too,
    and so does grouprl: :class:`EnvironmentPool`), a tool result's error text is
    ``Error: <type>: <message>`` (TRL returns ``{"error": message}``), and the dialogue's limits are
    ``worker.rollout.multi_turn``'s (TRL's ``max_tool_calling_iterations`` is ``max_turns - 1``).
    """

    def __init__(self, inner: Any, field_name: str | None = None) -> None:
        self.inner = inner
        self.field_name = field_name
        self.reward_parts = (type(inner).__name__,) if callable(getattr(inner, "get_reward", None)) else ()

    def reset(self, sample) -> str | list[dict] | None:
        row = {"prompt": sample.record_prompt if sample.record_prompt is not None else sample.messages}
        row.update({k: v for k, v in sample.columns.items() if k != self.field_name})
        return self.inner.reset(**row)

    def step(self, message: str) -> Step:
        return Step(done=True)

    def tools(self) -> list[Callable[..., Any]]:
        return public_methods(self.inner)

    def get_reward(self):
        return self.inner.get_reward()

    def __repr__(self) -> str:
        return f"TRLEnvironment({type(self.inner).__name__})"


def _callable_only(name: str, obj: Any) -> None:
    if not callable(obj):
        raise TypeError(f"environment {name!r} must be a class or a callable that makes one, got {type(obj).__name__}")


# ':' is reserved for file.py:Class references.
ENVIRONMENTS: Registry[Callable[[], Any]] = Registry("environment", error=EnvironmentLoadError,
                                                     check=_callable_only, reserved=":")


def register_environment(name: str, factory: Callable[[], Any] | str | None = None):
    """Register an environment factory under ``name``: ``register_environment(name, Class)`` or as a
    class decorator; ``factory`` may be a lazy ``"module:Class"`` reference."""
    return ENVIRONMENTS.register(name, factory)


def load_environment(reference: str | Callable[[], Any]) -> Callable[[], Any]:
    """The factory a config reference names (a registered name, ``path/file.py:Class``, ``module:Class``),
    or a factory given as is."""
    if callable(reference) and not isinstance(reference, str):
        return reference
    try:
        return get_reward(reference, registry=ENVIRONMENTS)
    except RewardLoadError as exc:  # the loader's message, with the environment's kind in it
        raise EnvironmentLoadError(str(exc)) from exc


def adapt(obj: Any, *, label: str, field_name: str | None = None) -> Environment:
    """``obj`` under the protocol: an :class:`Environment` as it is, a TRL environment (a ``reset``
    method) adapted; anything else an error naming ``label``."""
    if isinstance(obj, Environment):
        return obj
    if callable(getattr(obj, "reset", None)):
        return TRLEnvironment(obj, field_name)
    raise EnvironmentLoadError(f"environment {label!r} made a {type(obj).__name__}, which has no reset() method: an "
                               "environment subclasses grouprl.rollout.environments.Environment or defines reset() "
                               "(TRL's environment_factory contract)")


class EnvironmentPool:
    """Instances of each environment, made once and reset for each dialogue (TRL's "construct once,
    reset often"): a call takes as many as it has dialogues of that environment, making more when
    it needs them."""

    def __init__(self, factories: Mapping[str, Callable[[], Any]], *, field_name: str | None = None) -> None:
        self.factories = dict(factories)
        self.field_name = field_name
        self._pool: dict[str, list[Environment]] = {name: [] for name in self.factories}
        self._parts: list[str] | None = None

    def take(self, names: Iterable[str]) -> list[Environment]:
        """One instance per name, distinct within the call."""
        used: dict[str, int] = {}
        out = []
        for name in names:
            pool = self._pool[name]
            index = used.get(name, 0)
            if index == len(pool):
                pool.append(adapt(self.factories[name](), label=name, field_name=self.field_name))
            used[name] = index + 1
            out.append(pool[index])
        return out

    def reward_parts(self) -> list[str]:
        """Every reward part the pool's environments declare, in order (read from one instance of each)."""
        if self._parts is None:
            parts: list[str] = []
            for name in self.factories:
                env = self.take([name])[0]
                parts += [p for p in env.reward_parts if p not in parts]
            self._parts = parts
        return list(self._parts)


def reward_parts_of(value: Any, env: Environment, *, where: str) -> dict[str, float]:
    """A step's or ``get_reward``'s reward as ``{part: value}``: a number goes to the environment's
    single declared part; each part must be declared and each value a finite number. ``where`` names
    the call in the error."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        parts = dict(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if len(env.reward_parts) != 1:
            raise EnvironmentFailure(f"{where} returned a number, but {env!r} declares {len(env.reward_parts)} reward "
                                     f"part(s) {list(env.reward_parts)}; return {{part: value}} or declare one part")
        parts = {env.reward_parts[0]: value}
    else:
        raise EnvironmentFailure(f"{where} returned a reward of type {type(value).__name__}; a reward is a number "
                                 "or {part: number}")
    for part, v in parts.items():
        if part not in env.reward_parts:
            raise EnvironmentFailure(f"{where} returned reward part {part!r}, which {env!r} does not declare "
                                     f"(reward_parts: {list(env.reward_parts)})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise EnvironmentFailure(f"{where} returned {v!r} for reward part {part!r}; a finite number is needed")
    return {p: float(v) for p, v in parts.items()}


def check_step(value: Any, env: Environment) -> Step:
    """``value`` if it is a well-formed :class:`Step`, else an :class:`EnvironmentFailure` naming what is wrong."""
    if not isinstance(value, Step):
        raise EnvironmentFailure(f"{env!r}.step() returned {type(value).__name__}, not a "
                                 "grouprl.rollout.environments.Step")
    if not isinstance(value.messages, list):
        raise EnvironmentFailure(f"{env!r}.step() returned messages of type {type(value.messages).__name__}, "
                                 "not a list of chat messages")
    for i, message in enumerate(value.messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "tool"):
            raise EnvironmentFailure(f"{env!r}.step() message {i} must be a dict with role 'user' or 'tool', "
                                     f"got {message!r:.120}")
    return value


def environment_reward(part: str):
    """The reward function of the environment reward part ``part``: each row's value from the rollout's
    ``environment_rewards`` column, None where the row's environment gave none (unscored, never 0)."""

    def reward(completions, environment_rewards=None, **columns) -> list[float | None]:
        if environment_rewards is None:
            raise ValueError(f"environment reward part {part!r}: the batch has no environment_rewards column "
                             "(it comes from worker.rollout.multi_turn's dialogues)")
        return [None if row is None else row.get(part) for row in environment_rewards]

    reward.__name__ = part
    return reward
