"""Old import paths of moved modules, kept working for one release with a warning that names the new path.

A config may name a function by module path (``grouprl.rewards.radiology.kg:kg_consistency``);
such paths keep resolving after a move. A module left at the old path holds one call::

    from grouprl.moved import alias_package
    alias_package(__name__, "grouprl.new.place")

Importing the old name, or any module under it, warns once (``FutureWarning``, shown by
default) and gives the module at the new place, the same object, so that nothing runs twice
and registrations are not duplicated.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module prefix -> new module prefix, for submodules of the moved packages
_ALIASES: dict[str, str] = {}
# submodules renamed in the move: old full name -> new full name
_RENAMED: dict[str, str] = {}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} has moved to {new}; the old path works until the next release", FutureWarning,
                  stacklevel=3)


def new_name(old: str) -> str | None:
    """Where the module once called ``old`` lives now, or None when it did not move."""
    if old in _RENAMED:
        return _RENAMED[old]
    for prefix, target in _ALIASES.items():
        if old == prefix or old.startswith(prefix + "."):
            return target + old[len(prefix):]
    return None


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``old.sub`` for every aliased ``old``: its module is ``new.sub``, imported under its own name."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _ALIASES or new_name(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        target = new_name(spec.name)
        _warn(spec.name, target)
        return importlib.import_module(target)

    def exec_module(self, module) -> None:  # the module at the new place has run already
        pass


_FINDER = _MovedFinder()


def alias_package(old: str, new: str, *, renamed: dict[str, str] | None = None) -> None:
    """Make ``old`` (the module calling this) and every ``old.x`` the modules ``new`` and ``new.x``.

    ``renamed`` maps submodules whose name changed too (``{"sampling": "scheduler"}``).
    """
    _ALIASES[old] = new
    for before, after in (renamed or {}).items():
        _RENAMED[f"{old}.{before}"] = f"{new}.{after}"
    if _FINDER not in sys.meta_path:
        # first: the new package's __path__ would otherwise let the path finder load its
        # files a second time under the old names
        sys.meta_path.insert(0, _FINDER)
    _warn(old, new)
    # the old module's entry becomes the new module: the import statement that ran this returns it
    sys.modules[old] = importlib.import_module(new)
