"""grouprl's own error types that more than one layer raises, each reported by the CLI as one line.

- :class:`MissingExtra`: an optional dependency is not installed; the message names the
  extra that installs it (``pip install 'grouprl[server]'``). A ``ModuleNotFoundError``,
  so ``except ImportError`` clauses keep working.
  :data:`FEATURE_EXTRAS`: which config settings need which extra (an :class:`Extra` each),
  read by the code that requires it and by `grouprl doctor`.
- :class:`ModelPathError`: a model path that holds no model (missing, or a grouprl
  checkpoint or run directory where a model directory was expected). A
  ``FileNotFoundError``.
- :class:`OutputError`: an output directory grouprl cannot write to (read-only, a file in
  the way, no permission), found before any model is loaded; :class:`CheckpointSaveError`:
  a checkpoint that could not be written (a full disk). Both ``OSError`` subclasses.

`grouprl` (:func:`grouprl.cli.main`) prints either as one line on stderr and exits with
status 2; ``grouprl --debug`` shows the traceback instead.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


class MissingExtra(ModuleNotFoundError):
    """An optional dependency that is not installed: names what needs it and the extra to install."""

    def __init__(self, module: str, *, extra: str, needed_by: str):
        super().__init__(f"{needed_by} needs {module}, which is not installed: pip install 'grouprl[{extra}]'",
                         name=module)
        self.extra = extra
        self.needed_by = needed_by


def require(module: str, *, extra: str, needed_by: str) -> ModuleType:
    """``import module``, or :class:`MissingExtra` naming ``needed_by`` and the extra that installs it.

    Only the module itself missing is turned into :class:`MissingExtra`; an installed module that
    fails to import for another reason (a broken dependency of its own) keeps its own error.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        # ``import x`` with sys.modules["x"] = None raises ImportError with name "x" too
        if exc.name is not None and (exc.name == module or module.startswith(exc.name + ".")):
            raise MissingExtra(module, extra=extra, needed_by=needed_by) from exc
        raise


def check_installed(module: str, *, extra: str, needed_by: str) -> None:
    """:class:`MissingExtra` when ``module`` cannot be found, without importing it (for a check made
    early, before the slow work that precedes its use)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module with no spec
        found = False
    if not found:
        raise MissingExtra(module, extra=extra, needed_by=needed_by)


@dataclass(frozen=True)
class Extra:
    """An optional module a feature needs, the grouprl extra that installs it, and who needs it (for messages)."""

    module: str
    extra: str
    needed_by: str

    def require(self) -> ModuleType:
        return require(self.module, extra=self.extra, needed_by=self.needed_by)

    def installed(self) -> bool:
        try:
            check_installed(self.module, extra=self.extra, needed_by=self.needed_by)
        except MissingExtra:
            return False
        return True


# The config settings that need an extra, keyed "dotted.key: value" (several conditions joined by ", ",
# all of them true; a key may name a config property): the code that uses the feature requires its
# entry, and `grouprl doctor` reads the same table to check a config before it runs.
# (trainer.logger's backends carry theirs: grouprl.trainer.trackers.Backend.package / .extra.)
FEATURE_EXTRAS: dict[str, Extra] = {
    "worker.rollout.engine: vllm": Extra("vllm", "vllm", "worker.rollout.engine 'vllm'"),
    "worker.rollout.verifier.enable: True, worker.rollout.verifier.resolved_backend: http":
        Extra("openai", "guided", "the http verifier"),
    "kind: flow": Extra("diffusers", "diffusion", "the flow trainer (and `grouprl demo --flow`)"),
}


class ModelPathError(FileNotFoundError):
    """No model where a path pointed: it does not exist, or it is a grouprl checkpoint or run directory."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path

    def __str__(self) -> str:  # FileNotFoundError's own __str__ shows errno/filename fields we do not set
        return self.args[0]


class OutputError(OSError):
    """A directory grouprl must write to that it cannot (read-only, a file in the way, no permission,
    a full disk), found before the run started: names the path and the operating system's reason."""

    def __init__(self, message: str, path: str, errno_: int | None = None):
        super().__init__(message)
        self.path = path
        self.errno_ = errno_

    def __str__(self) -> str:  # OSError's own __str__ would show errno/filename fields we do not set
        return self.args[0]


class CheckpointSaveError(OutputError):
    """A checkpoint that could not be written (a full disk, a quota): the checkpoint path and the
    reason. Nothing of it looks complete, and the previous checkpoint stays usable."""
