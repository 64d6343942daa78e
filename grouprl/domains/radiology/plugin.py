"""The radiology domain's parts, registered by name (the ``radiology`` entry point of ``grouprl.plugins``).

Importing this module registers the report rewards (``editgrpo_composite``,
``kg_consistency``, the RadVLM task rewards, the synthetic task's ``finding_f1``...),
EditGRPO's edits as the rollout transform ``editgrpo_edits`` (built from
``worker.rollout.extractor*``) and the client of ``worker.reward.reward_server``.
"""

import grouprl.domains.radiology.findings  # noqa: F401
import grouprl.domains.radiology.rewards  # noqa: F401
import grouprl.domains.radiology.rewards.radvlm_tasks  # noqa: F401

from grouprl.rewards.registry import REWARD_SERVER_CLIENTS
from grouprl.rollout.transforms import ROLLOUT_TRANSFORMS

ROLLOUT_TRANSFORMS.register("editgrpo_edits", "grouprl.domains.radiology.edits:edit_transform_from_config")
REWARD_SERVER_CLIENTS.register("reward_server", "grouprl.domains.radiology.server.client:client_from_config")
