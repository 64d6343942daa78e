"""The reasoning domain's parts, registered by name (the ``reasoning`` entry point of ``grouprl.plugins``).

The rule verifier as the verifier backend ``rule``, the validation metric ``exact_match``
(single-turn accuracy, as the demo's), and Guided-GRPO's demo as `grouprl demo --guided`. Registered lazily: naming a part imports its module, so loading
the plugin costs nothing.
"""

from grouprl.cli import DEMOS, Demo
from grouprl.rollout.verifier import VERIFIER_BACKENDS
from grouprl.trainer.task_metrics import TASK_METRICS

VERIFIER_BACKENDS.register("rule", "grouprl.domains.reasoning.verifier:RuleVerifier")
TASK_METRICS.register("exact_match", "grouprl.domains.reasoning.exact_match:exact_match")
DEMOS.register("guided", Demo(
    run="grouprl.domains.reasoning.demo:run_guided_demo", flag="--guided",
    help="Guided-GRPO's demo: synthetic arithmetic word problems, SFT, then GRPO and Guided-GRPO (rule verifier, "
         "at most 3 turns) from the same SFT model, compared on held-out problems (default out runs/demo-guided)",
    options=(("--seeds", dict(
        type=int, metavar="K",
        help="with --guided: the run for seeds seed..seed+K-1 (in <out>/seed_<s>/; finished seeds are reused), "
             "then mean accuracies with 95%% t-intervals and the paired differences Guided-GRPO - GRPO and "
             "GRPO - SFT")),)))
