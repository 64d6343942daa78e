"""Reward names -> functions: the registries of the two reward contracts, and loading a reward by reference.

Each contract (:mod:`grouprl.rewards.contract`) has its own :class:`~grouprl.registry.Registry`:
:data:`REWARDS` for text rewards ``f(prompts, completions, **columns)``, :data:`IMAGE_REWARDS`
for image rewards ``f(images, prompts, **metadata)``; a name means one function of one
contract. A reward is referenced in config in one of three ways:

- a registered name (``"accuracy"``, ``"ocr"``), see :func:`register_reward` and
  :func:`register_image_reward`;
- ``path/to/file.py:function``, a function in a Python file, loaded from that file
  (a relative path is resolved against the current directory);
- ``package.module:function``, a function in an importable module.

Loading by reference is the same for both contracts: one module object per resolved
file, so that a file named by a text and an image reward, or by two specs, is executed
once and its functions share its module state (caches, clients).

Domain packages are not imported by the core: each is a *plugin*, an entry point in the
``grouprl.plugins`` group (see ``[project.entry-points."grouprl.plugins"]`` in
pyproject.toml) naming a module that registers its rewards when imported. The plugins
are imported the first time a name is not found, and by :func:`registered_rewards`.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from grouprl import registry as _registry
from grouprl.config import ConfigError
from grouprl.registry import PLUGIN_GROUP, Registry

RewardFn = Callable[..., object]


class RewardLoadError(ValueError):
    """A reward reference that cannot be turned into a function (unknown name, bad file, bad options)."""


def _callable_only(kind: str) -> Callable[[str, Any], None]:
    def check(name: str, obj: Any) -> None:
        if not callable(obj):
            raise TypeError(f"{kind} {name!r} must be a callable, got {type(obj).__name__}")
    return check


# ':' is reserved for file.py:function references, '@' for the name@i keys of a name used
# twice in one reward set.
REWARDS: Registry[RewardFn] = Registry("reward", error=RewardLoadError, check=_callable_only("reward"),
                                       reserved=":@")
IMAGE_REWARDS: Registry[RewardFn] = Registry("image reward", error=RewardLoadError,
                                             check=_callable_only("image reward"), reserved=":@")
# Each contract's registry, and what its functions are, for messages.
_CONTRACT_REGISTRIES = ((REWARDS, "a text reward, f(prompts, completions, **columns)"),
                        (IMAGE_REWARDS, "an image reward, f(images, prompts, **metadata)"))

# How ``worker.reward.reward_server`` is scored: a factory ``f(reward_config) -> reward``
# (a callable with the reward contract) registered under the config key's name,
# "reward_server", by the domain that serves the protocol (radiology's client).
REWARD_SERVER_CLIENTS: Registry = Registry("reward server client", error=ConfigError)

# One module object per resolved file, so that two specs naming functions of the same
# file share its module state (caches, clients) instead of executing it twice.
_FILE_MODULES: dict[Path, object] = {}
_FILE_LOCK = threading.Lock()


def register_reward(name: str, fn: RewardFn | str | None = None):
    """Register a text reward under ``name``: ``register_reward(name, fn)``, or ``@register_reward(name)``
    (returns the function unchanged); ``fn`` may be a lazy ``"module:function"`` reference.

    Names may not contain ``:`` or ``@``. Registering the same function again (a module
    reloaded) is allowed; another function under a taken name is an error.
    """
    return REWARDS.register(name, fn)


def register_image_reward(name: str, fn: RewardFn | str | None = None):
    """:func:`register_reward` for image rewards (:data:`IMAGE_REWARDS`)."""
    return IMAGE_REWARDS.register(name, fn)


def load_plugins() -> list[str]:
    """Import every installed ``grouprl.plugins`` entry point (:func:`grouprl.registry.load_plugins`).

    A plugin that fails to import raises :class:`RewardLoadError` naming it: a broken
    plugin must not silently take its rewards away.
    """
    try:
        return _registry.load_plugins()
    except _registry.PluginError as exc:
        raise RewardLoadError(str(exc)) from exc


def registered_rewards(registry: Registry = REWARDS) -> list[str]:
    """The names registered in ``registry`` (text rewards by default), those of every installed plugin included, sorted."""
    load_plugins()
    return registry.names(plugins=False)


def get_reward(reference: str, registry: Registry = REWARDS) -> RewardFn:
    """The reward for a name registered in ``registry`` (text rewards by default),
    ``path/to/file.py:function`` or ``module:function``.

    Raises :class:`RewardLoadError` naming the reference when the name is unknown, the
    file or module is missing, or it has no such function.
    """
    kind = registry.kind
    if not isinstance(reference, str) or not reference.strip():
        raise RewardLoadError(f"{kind} reference must be a non-empty string, got {reference!r}")
    ref = reference.strip()
    if ref not in registry and ":" not in ref and not ref.endswith(".py"):
        # A name not registered yet may belong to a plugin nobody has imported.
        load_plugins()
    if ref in registry:
        try:
            return registry.get(ref)
        except (ImportError, TypeError) as exc:  # a lazy "module:function" registration that does not resolve
            raise RewardLoadError(f"{kind} {ref!r} cannot be loaded: {type(exc).__name__}: {exc}") from exc
    if ":" in ref:
        # rpartition: the function name never holds ':', a Windows drive letter may.
        source, _, function = ref.rpartition(":")
        if not function:
            raise RewardLoadError(f"{kind} reference {ref!r} names no function after ':'")
        try:
            return _load_from_file(source, function) if source.endswith(".py") else _load_from_module(source, function)
        except RewardLoadError as exc:
            raise RewardLoadError(f"{kind} {ref!r}: {exc}") from exc
    if ref.endswith(".py"):
        raise RewardLoadError(f"{kind} reference {ref!r} names a file but no function; write it as {ref}:function_name")
    raise RewardLoadError(_unknown_name_message(ref, registry))


def _unknown_name_message(ref: str, registry: Registry) -> str:
    kind = registry.kind
    known = registry.names(plugins=False)  # the plugins are loaded by now
    plugins = load_plugins()
    close = difflib.get_close_matches(ref, known, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    # A name of the other contract is the likeliest mix-up (an image reward in a text run's config).
    other = [what for r, what in _CONTRACT_REGISTRIES if r is not registry and ref in r]
    elsewhere = f" {ref!r} is {other[0]}: another contract." if other else ""
    # No plugin at all usually means grouprl runs from a source tree that was never
    # installed, so the entry points that bring in the domain rewards do not exist.
    origin = (f"plugins loaded: {', '.join(plugins)}" if plugins else
              f"no {PLUGIN_GROUP} entry points are installed; `pip install -e .` adds grouprl's")
    return (
        f"unknown {kind} {ref!r}. Known {kind}s: {', '.join(known) or '(none)'} ({origin}); "
        f"or reference a function as path/to/file.py:function.{elsewhere}{hint}"
    )


def _load_from_file(source: str, function: str) -> RewardFn:
    path = Path(source).expanduser()
    resolved = path.resolve()
    if not resolved.is_file():
        raise RewardLoadError(f"reward file {source} not found (looked at {resolved}) for function {function!r}")
    with _FILE_LOCK:
        module = _FILE_MODULES.get(resolved)
        if module is None:
            module = _exec_file(resolved, source)
            _FILE_MODULES[resolved] = module
    return _function_of(module, function, where=f"reward file {source}")


def _exec_file(resolved: Path, source: str) -> object:
    # A unique module name per path: two files both called rewards.py must not collide
    # in sys.modules. Registering before exec lets the file's dataclasses and pickling
    # find their own module.
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    module_name = f"grouprl_user_rewards_{resolved.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise RewardLoadError(f"reward file {source} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise RewardLoadError(f"reward file {source} failed to import: {type(exc).__name__}: {exc}") from exc
    return module


def _load_from_module(source: str, function: str) -> RewardFn:
    try:
        module = importlib.import_module(source)
    except ImportError as exc:
        raise RewardLoadError(
            f"reward module {source!r} cannot be imported ({exc}); "
            f"for a file, reference it as path/to/file.py:{function}"
        ) from exc
    return _function_of(module, function, where=f"reward module {source}")


def _function_of(module: object, function: str, *, where: str) -> RewardFn:
    if not hasattr(module, function):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardLoadError(
            f"{where} has no function {function!r}; callables defined there: {', '.join(public) or '(none)'}"
        )
    fn = getattr(module, function)
    if not callable(fn):
        raise RewardLoadError(f"{where}: {function!r} is a {type(fn).__name__}, not a callable")
    return fn
