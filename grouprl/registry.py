"""Names -> objects: the one registry type behind every pluggable part of grouprl.

Each kind of part has its own :class:`Registry` (advantage estimators, policy losses,
rewards, image rewards, rollout engines, rollout transforms, verifier backends,
trainer kinds, CLI commands, demos). They all behave the same way:

- ``register(name, obj)`` or ``@register(name)``; ``obj`` may be a ``"module:attr"``
  string, imported the first time the name is asked for, so that registering a part
  never imports its heavy dependencies;
- registering the same object again under its name is allowed (a module executed
  twice, a notebook); another object under a taken name is an error unless
  ``overwrite=True``. "The same" is the same ``module.qualname`` for functions, classes
  and references, equality for other objects (a frozen dataclass entry with its metadata);
- ``get(name)`` returns the object; an unknown name first imports the installed
  plugins, then fails with the closest known names (``get(name, default)`` returns
  ``default`` instead);
- a registry is also a mutable mapping of names to objects (``reg[name]``,
  ``reg[name] = obj`` replaces, ``del reg[name]``, ``len``, iteration over the sorted
  names), so tests and notebooks can swap an entry with ``monkeypatch.setitem``.

Plugins are the domain packages (``grouprl.domains.*``) and any third-party package:
each is an entry point in the ``grouprl.plugins`` group naming a module that registers
its parts when imported. The core never imports a domain; it asks a registry for a name.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import threading
from collections.abc import Callable, Iterator, MutableMapping
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


def resolve(obj: Any) -> Any:
    """``obj``, or the object it names when it is a ``"module:attr"`` reference.

    For registered entries that hold references in their fields (a trainer kind's config
    builder and trainer, a demo's function), so that registering them imports nothing.
    """
    return import_reference(obj) if isinstance(obj, str) else obj


def same_entry(a: Any, b: Any) -> bool:
    """Whether ``b`` may be registered again under the name ``a`` holds (see the module docstring)."""
    if a is b:
        return True
    if isinstance(a, str) or isinstance(b, str) or hasattr(a, "__qualname__") or hasattr(b, "__qualname__"):
        return qualified_name(a) == qualified_name(b)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an __eq__ that cannot compare (arrays): distinct
        return False


def describe(obj: Any) -> str:
    """A registered object in a message: its qualified name, or a short repr of an instance."""
    if isinstance(obj, str) or hasattr(obj, "__qualname__"):
        return qualified_name(obj)
    text = repr(obj)
    return text if len(text) <= 160 else text[:157] + "..."


_MISSING = object()


def lazy_attributes(module: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` (PEP 562) giving each name in ``exports`` (name -> the module
    defining it) from its module, imported on first use: a package exports its public names at its
    top without importing what they need (a domain's diffusers, encoders) when it is imported."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__


class Registry(MutableMapping, Generic[T]):
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
            if existing is not None and not overwrite and not same_entry(existing, obj):
                raise ValueError(f"{self.kind} {name!r} is already registered to {describe(existing)}; "
                                 f"cannot register {describe(obj)} under it (pass overwrite=True to replace it)")
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

    def get(self, name: str, default: Any = _MISSING) -> T:
        """The part registered as ``name``; unknown names load the plugins first, then fail with close
        matches (``self.error``), or give ``default`` when one is passed."""
        if name not in self._entries:
            load_plugins()
        if name not in self._entries:
            if default is not _MISSING:
                return default
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

    def __len__(self) -> int:
        return len(self.names())

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __setitem__(self, name: str, obj: Any) -> None:
        self.register(name, obj, overwrite=True)

    def __delitem__(self, name: str) -> None:
        with self._lock:
            if name not in self._entries:
                raise KeyError(name)
            del self._entries[name]

    def pop(self, name: str, default: Any = _MISSING) -> T:
        """Remove ``name`` and return its object (resolved); ``default`` when it is not registered."""
        with self._lock:
            if name not in self._entries:
                if default is _MISSING:
                    raise KeyError(name)
                return default
            obj = self._resolve(name)
            del self._entries[name]
            return obj

    # a registry is one named place, not a value: compared and hashed by identity
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def items(self) -> list[tuple[str, T]]:
        """(name, object) for every registered part, plugins loaded and lazy references resolved."""
        return [(name, self._resolve(name)) for name in self.names()]

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self._entries)} names)"
