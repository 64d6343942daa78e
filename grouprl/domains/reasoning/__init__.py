"""Reasoning: Guided-GRPO's synthetic arithmetic task, its rule verifier and ``grouprl demo --guided``.

    from grouprl.domains.reasoning import RuleVerifier, generate_problems, run_guided_demo
"""

from __future__ import annotations

from grouprl.registry import lazy_attributes

_EXPORTS = {
    "Problem": "grouprl.domains.reasoning.synthetic_math",
    "generate_problems": "grouprl.domains.reasoning.synthetic_math",
    "write_dataset": "grouprl.domains.reasoning.synthetic_math",
    "RuleVerifier": "grouprl.domains.reasoning.verifier",
    "run_guided_demo": "grouprl.domains.reasoning.demo",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
