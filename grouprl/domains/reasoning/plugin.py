"""The reasoning domain's parts, registered by name (the ``reasoning`` entry point of ``grouprl.plugins``).

The rule verifier as the verifier backend ``rule``, the validation metric ``exact_match``
(single-turn accuracy, as the demo's), the tool ``calculator`` (+ - * / on numbers), Guided-GRPO's
demo as `grouprl demo --guided` and the calculator's as `grouprl demo --tools`. Registered lazily: naming a part imports its module, so loading
the plugin costs nothing.
"""

from grouprl.cli import DEMOS, Demo
from grouprl.rollout.tools import TOOLS
from grouprl.rollout.verifier import VERIFIER_BACKENDS
from grouprl.trainer.task_metrics import TASK_METRICS

VERIFIER_BACKENDS.register("rule", "grouprl.domains.reasoning.verifier:RuleVerifier")
TASK_METRICS.register("exact_match", "grouprl.domains.reasoning.exact_match:exact_match")
TOOLS.register("calculator", "grouprl.domains.reasoning.tool_demo:calculator")
DEMOS.register("guided", Demo(
    run="grouprl.domains.reasoning.demo:run_guided_demo", flag="--guided",
    help="Guided-GRPO's demo: synthetic arithmetic word problems, SFT, then GRPO and Guided-GRPO (rule verifier, "
         "at most 3 turns) from the same SFT model, compared on held-out problems (default out runs/demo-guided)",
    options=(("--seeds", dict(
        type=int, metavar="K",
        help="with --guided: the run for seeds seed..seed+K-1 (in <out>/seed_<s>/; finished seeds are reused), "
             "then mean accuracies with 95%% t-intervals and the paired differences Guided-GRPO - GRPO and "
             "GRPO - SFT")),)))
DEMOS.register("tools", Demo(
    run="grouprl.domains.reasoning.tool_demo:run_tool_demo", flag="--tools",
    help="tool use: the tiny policy learns to call a calculator for its arithmetic (SFT on tool-using traces, "
         "then GRPO with the tool), against the same budget without the tool, on held-out problems "
         "(default out runs/demo-tools)",
    options=(("--seeds", dict(
        type=int, metavar="K",
        help="with --tools: both runs for seeds seed..seed+K-1 (in <out>/seed_<s>/; finished seeds are reused), "
             "then mean accuracies with 95%% t-intervals and the paired differences calculator - no tool")),)))
