"""The verifier's backends by name (``worker.rollout.verifier.backend``).

``http`` and ``local`` are built in (:mod:`grouprl.rollout.verifier` registers their classes when
it is imported); a domain registers more (the reasoning domain's ``rule``). The registry lives
with the config, which checks the key against it at load, so that the check need not import the
verifier, a module that itself imports the config.
"""

from __future__ import annotations

from grouprl.config.schema import ConfigError
from grouprl.registry import Registry

BUILT_IN_BACKENDS = ("http", "local")

# backend name -> Verifier subclass, built as cls(config, tokenizer=...)
VERIFIER_BACKENDS: Registry[type] = Registry("verifier backend", error=ConfigError)


def backend_names() -> list[str]:
    """Every backend a config may name: the built-in ones and those registered (plugins included)."""
    return sorted(set(BUILT_IN_BACKENDS) | set(VERIFIER_BACKENDS.names()))
