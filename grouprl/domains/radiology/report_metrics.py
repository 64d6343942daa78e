"""The report demo's held-out table as one function, and as the validation metric ``report``.

:func:`report_scores` scores generated reports against their references the way the
demo's held-out table does (``grouprl demo``): the EditGRPO reward components and their
sum, CheXpert-label F1 over the 14 observations, RadGraph F1, finding-level F1 against
the generator's labels, and words per report. :func:`report_metric` is its numbers under
the task-metric contract (:mod:`grouprl.trainer.task_metrics`), registered as ``report``, so
that ``trainer.val_metrics: [report]`` logs them as ``val/report/<key>`` at each validation.

Keys (corpus-level: pooled over every report, not means of per-report values, except the
``mean_*`` keys, which are means over reports):

- ``mean_reward``: mean of the EditGRPO composite, radgraphf1 + cxb14micro + ratescore
  (``editgrpo_composite``, the demo's reward), each ``mean_<component>`` beside it;
- ``chexpert_micro_f1_14``, ``chexpert_macro_f1_14``: CheXpert-label F1 over 14 observations;
- ``radgraph_f1_partial``: RadGraph corpus F1 (partial match);
- ``finding_f1_micro``, ``finding_f1_macro``, ``finding_accuracy``: finding-level scores, and
  ``finding_f1_per_sample``, the mean of each report's finding F1;
- ``mean_words``: words per generated report.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def report_metric(completions: Sequence[str], references: Sequence[str], **columns) -> dict[str, float]:
    """The validation metric ``report``: the held-out table's numbers for the reports ``completions``
    against ``references`` (see the module docstring); every response of every prompt is one report."""
    from grouprl.domains.radiology.findings import corpus_finding_scores
    from grouprl.domains.radiology.rewards import chexpert_f1_reports, radgraph_corpus_f1, score_components
    from grouprl.domains.radiology.rewards.rewards import EDITGRPO_COMPONENTS

    reports, refs = _checked(completions, references)
    components = score_components(reports, refs, EDITGRPO_COMPONENTS)
    rewards = [sum(values) for values in zip(*components.values())]
    findings = corpus_finding_scores(reports, refs)
    chexpert = chexpert_f1_reports(reports, refs)
    radgraph = radgraph_corpus_f1(reports, refs)
    return {
        "mean_reward": sum(rewards) / len(rewards),
        **{f"mean_{name}": sum(v) / len(v) for name, v in components.items()},
        "chexpert_micro_f1_14": chexpert["micro_f1_14"],
        "chexpert_macro_f1_14": chexpert["macro_f1_14"],
        "radgraph_f1_partial": radgraph["partial"],
        "finding_f1_micro": findings["micro_f1"],
        "finding_f1_macro": findings["macro_f1"],
        "finding_f1_per_sample": findings["sample_f1"],
        "finding_accuracy": findings["accuracy"],
        "mean_words": sum(len(r.split()) for r in reports) / len(reports),
    }


def report_details(reports: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """What the demo's summary.json keeps beside the numbers: each score's ``backends`` and three ``examples``."""
    from grouprl.domains.radiology.findings import BACKEND as FINDINGS_BACKEND
    from grouprl.domains.radiology.rewards.chexpert import BACKEND as CHEXPERT_BACKEND
    from grouprl.domains.radiology.rewards.components import get_component
    from grouprl.domains.radiology.rewards.rewards import EDITGRPO_COMPONENTS

    reports, refs = _checked(reports, references)
    return {
        "backends": {name: get_component(name).backend for name in EDITGRPO_COMPONENTS}
        | {"findings": FINDINGS_BACKEND, "chexpert_f1": CHEXPERT_BACKEND},
        "examples": [{"reference": r, "generated": g} for r, g in list(zip(refs, reports))[:3]],
    }


def report_scores(reports: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """:func:`report_metric`'s numbers and :func:`report_details`: one row of the demo's held-out table."""
    return {**report_metric(reports, references), **report_details(reports, references)}


def _checked(reports: Sequence[str], references: Sequence) -> tuple[list[str], list[str]]:
    reports, refs = list(reports), list(references)
    if not reports:
        raise ValueError("no reports to score")
    missing = [i for i, r in enumerate(refs) if not isinstance(r, str)]
    if missing:
        raise ValueError(f"row {missing[0]} has no reference report ({len(missing)} rows without one)")
    return reports, refs
