"""Clinical rewards and metrics for chest X-ray reports.

Every module here registers its per-sample report scores in
``components.COMPONENTS`` when imported, so importing this package makes all of
them available by name (to rewards, the reward server and `grouprl eval`). The
defaults are rule-based and offline; each score records its backend. Heavy
optional libraries (sentence encoders, pycocoevalcap, httpx) are imported only
when their metric is computed.

The package is grouprl's ``radiology`` plugin (a ``grouprl.plugins`` entry point in
pyproject.toml): the reward registry imports it the first time a config names one of
its rewards (``editgrpo_composite``, ``kg_consistency``, ...), so the core never
imports it itself.
"""

from grouprl.domains.radiology.rewards import (  # noqa: F401  (imported to register their components)
    answers,
    bertscore,
    green,
    kg,
    label_metrics,
    nlg,
    radcliq,
    radgraph_f1,
    ratescore,
    rewards,
)
from grouprl.domains.radiology.rewards.chexpert import FIVE, OBSERVATIONS, label_report, label_reports
from grouprl.domains.radiology.rewards.components import COMPONENTS, get_component, register_component, score_components
from grouprl.domains.radiology.rewards.entities import extract_graph
from grouprl.domains.radiology.rewards.kg import kg_consistency
from grouprl.domains.radiology.rewards.label_metrics import chexpert_f1, chexpert_f1_reports
from grouprl.domains.radiology.rewards.radgraph_f1 import radgraph_corpus_f1, radgraph_scores
from grouprl.domains.radiology.rewards.ratescore import match_entities

__all__ = [
    "COMPONENTS", "FIVE", "OBSERVATIONS", "chexpert_f1", "chexpert_f1_reports", "extract_graph", "get_component",
    "kg_consistency", "label_report", "label_reports", "match_entities", "radgraph_corpus_f1", "radgraph_scores",
    "register_component", "score_components",
]
