"""The reasoning domain's parts, registered by name (the ``reasoning`` entry point of ``grouprl.plugins``).

Registered lazily: naming a part imports its module, so loading the plugin costs nothing.
"""

from grouprl.rollout.verifier import VERIFIER_BACKENDS

VERIFIER_BACKENDS.register("rule", "grouprl.domains.reasoning.verifier:RuleVerifier")
