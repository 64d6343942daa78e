"""Radiology: clinically accurate chest X-ray reports (EditGRPO, CheXPO-v2, RadVLM-GRPO).

    from grouprl.domains.radiology import label_report, edit_report, evaluate_file

- ``rewards``: the report score components (RadGraph-style F1, CheXpert-label F1,
  RaTEScore, BERTScore, GREEN, ...), the CheXpert-style labeler, the rewards built on
  them, RadVLM's task rewards;
- ``findings``: the synthetic task's finding-level rewards;
- ``server``: the reward server (EditGRPO's and RadVLM-GRPO's protocols) and its client;
- ``edits``: EditGRPO's post-rollout edits, a rollout transform;
- ``sample_selection``: CheXPO-v2's hard-sample mining and stratified sampling;
- ``evaluation``: report evaluation with bootstrap intervals (``grouprl eval``);
- ``synthetic``: procedural chest X-ray studies and RadVLM-style tasks;
- ``tools``: the ``zoom`` tool, an enlarged region of the chest film for the policy (``ZoomEnvironment``);
- ``demo``: ``grouprl demo`` and ``grouprl demo --compare``.

Names are imported on first use, so ``import grouprl.domains.radiology`` is cheap.
"""

from __future__ import annotations

from grouprl.registry import lazy_attributes

_EXPORTS = {
    "label_report": "grouprl.domains.radiology.rewards.chexpert",
    "label_reports": "grouprl.domains.radiology.rewards.chexpert",
    "extract_graph": "grouprl.domains.radiology.rewards.entities",
    "get_component": "grouprl.domains.radiology.rewards.components",
    "register_component": "grouprl.domains.radiology.rewards.components",
    "score_components": "grouprl.domains.radiology.rewards.components",
    "kg_consistency": "grouprl.domains.radiology.rewards.kg",
    "radgraph_scores": "grouprl.domains.radiology.rewards.radgraph_f1",
    "chexpert_f1": "grouprl.domains.radiology.rewards.label_metrics",
    "extract_findings": "grouprl.domains.radiology.findings",
    "finding_f1": "grouprl.domains.radiology.findings",
    "edit_report": "grouprl.domains.radiology.edits",
    "EditTransform": "grouprl.domains.radiology.edits",
    "evaluate_file": "grouprl.domains.radiology.evaluation",
    "generate_file": "grouprl.domains.radiology.evaluation",
    "select_samples": "grouprl.domains.radiology.sample_selection",
    "RewardServerClient": "grouprl.domains.radiology.server.client",
    "serve": "grouprl.domains.radiology.server.app",
    "create_app": "grouprl.domains.radiology.server.app",
    "generate_studies": "grouprl.domains.radiology.synthetic.cxr",
    "write_dataset": "grouprl.domains.radiology.synthetic.cxr",
    "ZoomEnvironment": "grouprl.domains.radiology.tools",
    "run_demo": "grouprl.domains.radiology.demo",
    "run_compare_seeds": "grouprl.domains.radiology.demo",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
