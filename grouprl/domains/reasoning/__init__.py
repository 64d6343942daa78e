"""Reasoning: Guided-GRPO's synthetic arithmetic task, its rule verifier and ``grouprl demo --guided``.

    from grouprl.domains.reasoning import RuleVerifier, generate_problems, run_guided_demo
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Problem": "grouprl.domains.reasoning.synthetic_math",
    "generate_problems": "grouprl.domains.reasoning.synthetic_math",
    "write_dataset": "grouprl.domains.reasoning.synthetic_math",
    "RuleVerifier": "grouprl.domains.reasoning.verifier",
    "run_guided_demo": "grouprl.domains.reasoning.demo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'grouprl.domains.reasoning' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
