"""Reward names -> functions: the registry of built-ins and loading user rewards by reference.

A reward is referenced in config in one of three ways:

- a registered name (``"accuracy"``), see :func:`register_reward`;
- ``path/to/file.py:function``, a function in a Python file, loaded from that file
  (a relative path is resolved against the current directory);
- ``package.module:function``, a function in an importable module.

Domain packages (the radiology rewards, the finding-level rewards) are not imported
by the core: each is a *plugin*, an entry point in the ``grouprl.plugins`` group
(see ``[project.entry-points."grouprl.plugins"]`` in pyproject.toml) naming a module
that registers its rewards when imported. The plugins are imported the first time a
name is not found, and by :func:`registered_rewards`.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
import threading
from pathlib import Path
from typing import Callable

RewardFn = Callable[..., object]

_REGISTRY: dict[str, RewardFn] = {}

# One module object per resolved file, so that two specs naming functions of the same
# file share its module state (caches, clients) instead of executing it twice.
_FILE_MODULES: dict[Path, object] = {}
_FILE_LOCK = threading.Lock()

from grouprl.config import ConfigError
from grouprl.registry import PLUGIN_GROUP, Registry

# How ``worker.reward.reward_server`` is scored: a factory ``f(reward_config) -> reward``
# (a callable with the reward contract) registered under the config key's name,
# "reward_server", by the domain that serves the protocol (radiology's client).
REWARD_SERVER_CLIENTS: Registry = Registry("reward server client", error=ConfigError)


class RewardLoadError(ValueError):
    """A reward reference that cannot be turned into a function (unknown name, bad file, bad options)."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under ``name`` (returns the function unchanged).

    Names may not contain ``:`` (reserved for ``file.py:function`` references) or ``@``
    (reserved for the ``name@i`` keys of a name used twice in one reward set).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    if ":" in name or "@" in name:
        raise ValueError(f"reward name {name!r} may not contain ':' or '@'")

    def decorate(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"register_reward({name!r}) needs a callable, got {type(fn).__name__}")
        existing = _REGISTRY.get(name)
        # Re-executing the defining module (reload, notebooks) registers "the same" function
        # again; a different function under a taken name is a real clash.
        if existing is not None and _qualified_name(existing) != _qualified_name(fn):
            raise ValueError(
                f"reward name {name!r} is already registered to {_qualified_name(existing)}; "
                f"cannot register {_qualified_name(fn)} under it"
            )
        _REGISTRY[name] = fn
        return fn

    return decorate


def load_plugins() -> list[str]:
    """Import every installed ``grouprl.plugins`` entry point (:func:`grouprl.registry.load_plugins`).

    A plugin that fails to import raises :class:`RewardLoadError` naming it: a broken
    plugin must not silently take its rewards away.
    """
    from grouprl import registry

    try:
        return registry.load_plugins()
    except registry.PluginError as exc:
        raise RewardLoadError(str(exc)) from exc


def registered_rewards() -> list[str]:
    """The registered reward names, those of every installed plugin included, sorted."""
    load_plugins()
    return sorted(_REGISTRY)


def get_reward(name_or_spec: str) -> RewardFn:
    """The reward function for a registered name, ``path/to/file.py:function`` or ``module:function``."""
    if not isinstance(name_or_spec, str) or not name_or_spec.strip():
        raise RewardLoadError(f"a reward reference must be a non-empty string, got {name_or_spec!r}")
    ref = name_or_spec.strip()
    if ref in _REGISTRY:
        return _REGISTRY[ref]
    if ":" not in ref and not ref.endswith(".py"):
        # A name not registered yet may belong to a plugin nobody has imported.
        load_plugins()
        if ref in _REGISTRY:
            return _REGISTRY[ref]
    if ":" in ref:
        # rpartition: the function name never holds ':', a Windows drive letter may.
        source, _, function = ref.rpartition(":")
        if not function:
            raise RewardLoadError(f"reward reference {ref!r} names no function after ':'")
        if source.endswith(".py"):
            return _load_from_file(source, function)
        return _load_from_module(source, function)
    if ref.endswith(".py"):
        raise RewardLoadError(
            f"reward reference {ref!r} names a file but no function; write it as {ref}:function_name"
        )
    raise RewardLoadError(_unknown_name_message(ref))


def _unknown_name_message(ref: str) -> str:
    known = registered_rewards()
    plugins = load_plugins()
    close = difflib.get_close_matches(ref, known, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    # No plugin at all usually means grouprl runs from a source tree that was never
    # installed, so the entry points that bring in the domain rewards do not exist.
    origin = (f"plugins loaded: {', '.join(plugins)}" if plugins else
              f"no {PLUGIN_GROUP} entry points are installed; `pip install -e .` adds grouprl's")
    return (
        f"unknown reward {ref!r}. Known rewards: {', '.join(known) or '(none)'} ({origin}); "
        f"or reference a function as path/to/file.py:function.{hint}"
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


def _qualified_name(fn: RewardFn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
