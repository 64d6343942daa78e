"""The radiology domain's parts, registered by name (the ``radiology`` entry point of ``grouprl.plugins``).

Importing this module registers the report rewards (``editgrpo_composite``,
``kg_consistency``, the RadVLM task rewards, the synthetic task's ``finding_f1``...).
"""

import grouprl.domains.radiology.findings  # noqa: F401
import grouprl.domains.radiology.rewards  # noqa: F401
import grouprl.domains.radiology.rewards.radvlm_tasks  # noqa: F401
