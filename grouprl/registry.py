"""Names -> objects: the one registry type behind every pluggable part of grouprl.

Each kind of part has its own :class:`Registry` (advantage estimators, policy losses,
rewards, image rewards, rollout engines, rollout transforms, verifier backends,
trainer kinds, CLI commands, demos). They all behave the same way:

- ``register(name, obj)`` or ``@register(name)``; ``obj`` may be a ``"module:attr"``
  string, imported the first time the name is asked for, so that registering a part
  never imports its heavy dependencies;
- registering the same object again under its name is allowed (a module executed
  twice, a notebook); another object under a taken name is an error unless
  ``overwrite=True``;
- ``get(name)`` returns the object; an unknown name first imports the installed
  plugins, then fails with the closest known names.

Plugins are the domain packages (``grouprl.domains.*``) and any third-party package:
each is an entry point in the ``grouprl.plugins`` group naming a module that registers
its parts when imported. The core never imports a domain; it asks a registry for a name.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

PLUGIN_GROUP = "grouprl.plugins"

# Plugin name -> its imported module. Re-entrant: importing a plugin runs its register
# calls, which may look names up in turn.
_PLUGINS: dict[str, object] = {}
_PLUGINS_DONE = False  # every installed plugin imported; set only after all succeeded
_PLUGIN_LOCK = threading.RLock()


class PluginError(ImportError):
    """An installed plugin that failed to import (its parts would silently be missing otherwise)."""


def load_plugins() -> list[str]:
    """Import every installed ``grouprl.plugins`` entry point not imported yet; the loaded plugins' names.

    A plugin that fails to import raises :class:`PluginError` naming it (and is tried
    again on the next call): a broken plugin must not silently take its parts away.
    """
    global _PLUGINS_DONE
    with _PLUGIN_LOCK:
        if not _PLUGINS_DONE:
            for entry_point in importlib.metadata.entry_points(group=PLUGIN_GROUP):
                if entry_point.name not in _PLUGINS:
                    try:
                        _PLUGINS[entry_point.name] = entry_point.load()
                    except Exception as exc:
                        raise PluginError(
                            f"grouprl plugin {entry_point.name!r} ({entry_point.value}, entry point group "
                            f"{PLUGIN_GROUP}) failed to import: {type(exc).__name__}: {exc}") from exc
            _PLUGINS_DONE = True
        return sorted(_PLUGINS)


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a function or class (of its type for other objects), or the lazy reference itself."""
    if isinstance(obj, str):
        return obj.replace(":", ".")
    target = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"


def import_reference(ref: str) -> Any:
    """The object a ``"package.module:attr"`` reference names."""
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no attribute {attr!r} (reference {ref!r})") from None


class Registry(Generic[T]):
    """Named parts of one kind (see the module docstring).

    ``kind`` names the part in messages ("reward", "rollout engine"); ``error`` is the
    exception an unknown name raises (a ``LookupError`` or ``ValueError`` subclass of
    the caller's, so existing ``except`` clauses keep working); ``check(name, obj)``
    validates each registered object (say, that it is callable): an object when it is
    registered, a ``"module:attr"`` reference when it is first resolved.
    """

    def __init__(self, kind: str, *, error: type[Exception] = KeyError,
                 check: Callable[[str, Any], None] | None = None, reserved: str = ""):
        self.kind = kind
        self.error = error
        self.check = check
        self.reserved = reserved  # characters a name may not hold (e.g. ':' of file.py:function references)
        self._entries: dict[str, Any] = {}  # name -> object, or "module:attr" until first resolved
        self._lock = threading.RLock()

    def register(self, name: str, obj: Any = None, *, overwrite: bool = False):
        """Register ``obj`` (an object or a ``"module:attr"`` string) under ``name``; without
        ``obj``, a decorator that registers what it decorates and returns it unchanged."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        bad = [c for c in self.reserved if c in name]
        if bad:
            raise ValueError(f"{self.kind} name {name!r} may not contain {' or '.join(repr(c) for c in bad)}")
        if obj is None:
            def decorate(target: T) -> T:
                self.register(name, target, overwrite=overwrite)
                return target
            return decorate
        if self.check is not None and not isinstance(obj, str):
            self.check(name, obj)
        with self._lock:
            existing = self._entries.get(name)
            if (existing is not None and not overwrite
                    and qualified_name(existing) != qualified_name(obj)):
                raise ValueError(f"{self.kind} {name!r} is already registered to {qualified_name(existing)}; "
                                 f"cannot register {qualified_name(obj)} under it (pass overwrite=True to replace it)")
            self._entries[name] = obj
        return obj

    def unregister(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)

    def _resolve(self, name: str) -> T:
        with self._lock:
            obj = self._entries[name]
            if isinstance(obj, str):
                obj = import_reference(obj)
                if self.check is not None:
                    self.check(name, obj)
                self._entries[name] = obj
            return obj

    def get(self, name: str) -> T:
        """The part registered as ``name``; unknown names load the plugins first, then fail with close matches."""
        if name not in self._entries:
            load_plugins()
        if name not in self._entries:
            raise self.error(self.unknown_message(name))
        return self._resolve(name)

    def unknown_message(self, name: str) -> str:
        known = self.names()
        close = difflib.get_close_matches(str(name), known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        return f"unknown {self.kind} {name!r} (known: {', '.join(known) or 'none'}){hint}"

    def names(self, *, plugins: bool = True) -> list[str]:
        """Every registered name, those of the installed plugins included (unless ``plugins=False``), sorted."""
        if plugins:
            load_plugins()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def items(self) -> list[tuple[str, T]]:
        """(name, object) for every registered part, plugins loaded and lazy references resolved."""
        return [(name, self._resolve(name)) for name in self.names()]

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self._entries)} names)"
