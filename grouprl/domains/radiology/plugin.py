"""The radiology domain's parts, registered by name (the ``radiology`` entry point of ``grouprl.plugins``).

Importing this module registers the report rewards (``editgrpo_composite``,
``kg_consistency``, the RadVLM task rewards, the synthetic task's ``finding_f1``...),
EditGRPO's edits as the rollout transform ``editgrpo_edits`` (built from
``worker.rollout.extractor*``) and as a view of the run report (``grouprl report``), the
validation metric ``report`` (the demo's held-out table), the client of
``worker.reward.reward_server``, the commands `grouprl generate`, `eval`, `sample` and
`serve rewards`, the environment ``radiology_zoom`` (a ``zoom`` tool over the study's film), and the report demos (`grouprl demo`, the default, and `grouprl demo --compare`).
Commands and demos are
registered by reference: their module is imported when the command line is built.
"""

import grouprl.domains.radiology.findings  # noqa: F401
import grouprl.domains.radiology.rewards  # noqa: F401
import grouprl.domains.radiology.rewards.radvlm_tasks  # noqa: F401

from grouprl.cli import COMMANDS, DEMOS
from grouprl.report.views import RECORD_VIEWS
from grouprl.rewards.registry import REWARD_SERVER_CLIENTS
from grouprl.rollout.environments import ENVIRONMENTS
from grouprl.rollout.transforms import ROLLOUT_TRANSFORMS
from grouprl.trainer.task_metrics import TASK_METRICS

ROLLOUT_TRANSFORMS.register("editgrpo_edits", "grouprl.domains.radiology.edits:edit_transform_from_config")
RECORD_VIEWS.register("editgrpo_edits", "grouprl.domains.radiology.report_view:EDIT_VIEW")
REWARD_SERVER_CLIENTS.register("reward_server", "grouprl.domains.radiology.server.client:client_from_config")
TASK_METRICS.register("report", "grouprl.domains.radiology.report_metrics:report_metric")
ENVIRONMENTS.register("radiology_zoom", "grouprl.domains.radiology.tools:ZoomEnvironment")

COMMANDS.register("generate", "grouprl.domains.radiology.commands:GENERATE")
COMMANDS.register("eval", "grouprl.domains.radiology.commands:EVAL")
COMMANDS.register("sample", "grouprl.domains.radiology.commands:SAMPLE")
COMMANDS.register("serve rewards", "grouprl.domains.radiology.commands:SERVE_REWARDS")
DEMOS.register("reports", "grouprl.domains.radiology.commands:REPORT_DEMO")
DEMOS.register("compare", "grouprl.domains.radiology.commands:COMPARE_DEMO")
DEMOS.register("distill", "grouprl.domains.radiology.commands:DISTILL_DEMO")
