"""The rule-based finding labeler and the finding-level rewards built on it."""

import numpy as np
import pytest

from grouprl.rewards import RewardSet, get_reward
from grouprl.domains.radiology.findings import (
    BACKEND,
    FINDING_NAMES,
    corpus_finding_scores,
    extract_findings,
    finding_accuracy,
    finding_accuracy_reward,
    finding_f1,
    finding_f1_reward,
)


def labels(text):
    """Only the findings the text mentions."""
    return {k: v for k, v in extract_findings(text).items() if v is not None}


@pytest.mark.parametrize(
    "text, expected",
    [
        # positives and synonyms
        ("The heart is enlarged.", {"cardiomegaly": 1}),
        ("Moderate enlargement of the cardiac silhouette.", {"cardiomegaly": 1}),
        ("CARDIOMEGALY.", {"cardiomegaly": 1}),
        ("Endotracheal tube in standard position.", {"support_device": 1}),
        ("Patchy airspace opacity in the left lower lobe.", {"consolidation": 1}),
        ("Pulmonary vascular congestion.", {"edema": 1}),
        ("Solitary pulmonary nodule in the right upper lung.", {"nodule": 1}),
        # a pleural line belongs to a pneumothorax, not to a catheter
        ("Right pneumothorax with a visible pleural line.", {"pneumothorax": 1}),
        # normal phrasing
        ("Heart size is normal.", {"cardiomegaly": 0}),
        ("The heart is not enlarged.", {"cardiomegaly": 0}),
        ("The costophrenic angles are sharp.", {"left_effusion": 0, "right_effusion": 0}),
        # negation: before, after, in lists, "without"
        ("No pleural effusion or pneumothorax.", {"left_effusion": 0, "right_effusion": 0, "pneumothorax": 0}),
        ("No cardiomegaly, focal consolidation, or pulmonary edema.",
         {"cardiomegaly": 0, "consolidation": 0, "edema": 0}),
        ("Lungs are clear without focal consolidation.", {"consolidation": 0}),
        ("Pneumothorax is not seen.", {"pneumothorax": 0}),
        ("Consolidation or effusion is not seen.", {"consolidation": 0, "left_effusion": 0, "right_effusion": 0}),
        ("Negative for pneumothorax.", {"pneumothorax": 0}),
        ("The pneumothorax has resolved.", {"pneumothorax": 0}),
        ("No lines or tubes.", {"support_device": 0}),
        ("no evidence of EDEMA", {"edema": 0}),
        # uncertainty, including cues that contain a negation word
        ("Possible small left effusion.", {"left_effusion": -1}),
        ("Cannot exclude consolidation in the left lower lobe.", {"consolidation": -1}),
        ("A tiny right pneumothorax cannot be excluded.", {"pneumothorax": -1}),
        ("Edema is likely.", {"edema": -1}),
        ("The heart may be enlarged.", {"cardiomegaly": -1}),
        # laterality of effusions: sided, bilateral, unsided
        ("Small right pleural effusion.", {"right_effusion": 1}),
        ("Large pleural effusion on the left.", {"left_effusion": 1}),
        ("Blunting of the left costophrenic angle.", {"left_effusion": 1}),
        ("Bilateral pleural effusions.", {"left_effusion": 1, "right_effusion": 1}),
        ("Moderate left and small right pleural effusions.", {"left_effusion": 1, "right_effusion": 1}),
        ("No right effusion.", {"right_effusion": 0}),
        ("The left costophrenic angle is sharp.", {"left_effusion": 0}),
        # each cue reaches only its own part of the clause
        ("Possible consolidation without effusion.",
         {"consolidation": -1, "left_effusion": 0, "right_effusion": 0}),
        ("No effusion, and the heart is enlarged.", {"cardiomegaly": 1, "left_effusion": 0, "right_effusion": 0}),
        ("Left effusion, likely right effusion.", {"left_effusion": 1, "right_effusion": -1}),
        ("No pneumothorax but a small left effusion.", {"pneumothorax": 0, "left_effusion": 1}),
        # nothing mentioned
        ("No acute osseous abnormality.", {}),
        ("", {}),
    ],
)
def test_extract_findings_on_hand_written_sentences(text, expected):
    assert labels(text) == expected


def test_report_aggregation_prefers_positive_then_uncertain():
    text = "No pneumothorax. Possible small apical pneumothorax. No edema. Mild pulmonary edema."
    assert labels(text) == {"pneumothorax": -1, "edema": 1}
    assert set(extract_findings(text)) == set(FINDING_NAMES)


def test_labeler_reads_every_generated_report_exactly():
    from grouprl.domains.radiology.synthetic.cxr import sample_findings, sample_layout, write_report

    for i in range(500):
        findings_rng, layout_rng, report_rng = (np.random.default_rng(s) for s in np.random.SeedSequence([11, i]).spawn(3))
        truth = sample_findings(findings_rng)
        report = write_report(truth, sample_layout(layout_rng), report_rng)
        read = extract_findings(report)
        for name in FINDING_NAMES:
            if read[name] is None:
                assert truth[name] == 0, (name, report)  # every present finding is mentioned
            else:
                assert read[name] == truth[name], (name, report, read)


def test_finding_f1_and_accuracy_on_hand_examples():
    ref = extract_findings("Cardiomegaly. Small left pleural effusion. No pneumothorax.")
    assert finding_f1(ref, ref) == 1.0
    # one of two found, one false: TP 1, FP 1, FN 1 -> 2/4
    pred = extract_findings("The heart is enlarged. Right apical pneumothorax.")
    assert finding_f1(pred, ref) == pytest.approx(0.5)
    # uncertain counts as positive
    assert finding_f1(extract_findings("Cardiomegaly. Possible small left effusion."), ref) == 1.0
    # both normal: right; prediction with a finding on a normal study: F1 0
    normal = extract_findings("No acute cardiopulmonary process.")
    assert finding_f1(extract_findings("No pleural effusion."), normal) == 1.0
    assert finding_f1(extract_findings("Cardiomegaly."), normal) == 0.0
    assert finding_f1(normal, ref) == 0.0
    # accuracy over all eight findings: pred disagrees on left_effusion and pneumothorax
    assert finding_accuracy(pred, ref) == pytest.approx(6 / 8)
    assert finding_accuracy(normal, normal) == 1.0


def test_rewards_follow_the_contract_and_are_registered():
    answers = ["Cardiomegaly. No pneumothorax.", "No pleural effusion.", None]
    completions = ["The heart is enlarged.", "Left pleural effusion.", "Cardiomegaly."]
    prompts = ["p"] * 3
    assert finding_f1_reward(prompts, completions, answer=answers) == [1.0, 0.0, None]
    assert finding_accuracy_reward(prompts, completions, answer=answers) == [1.0, 7 / 8, None]
    assert finding_f1_reward(prompts, completions) == [None, None, None]
    # chat-format completions (TRL's conversational rows)
    chat = [[{"role": "assistant", "content": "The heart is enlarged."}]]
    assert finding_f1_reward(["p"], chat, answer=answers[:1]) == [1.0]
    assert get_reward("finding_f1") is finding_f1_reward
    assert get_reward("finding_accuracy") is finding_accuracy_reward
    result = RewardSet.from_specs(["finding_f1", "finding_accuracy"]).score(
        prompts[:2], completions[:2], {"answer": answers[:2], "id": ["a", "b"]}
    )
    assert result.components["finding_f1"] == [1.0, 0.0]


def test_corpus_scores():
    refs = ["Cardiomegaly. No effusion.", "Left pleural effusion.", "No acute cardiopulmonary process."]
    preds = ["The heart is enlarged.", "No pleural effusion. Cardiomegaly.", "Normal heart size."]
    scores = corpus_finding_scores(preds, refs)
    # pairs: cardiomegaly TP 1, FP 1; left_effusion FN 1 -> micro 2/(2+1+1)
    assert scores["micro_f1"] == pytest.approx(0.5)
    # per finding: cardiomegaly 2/3, left_effusion 0 -> macro 1/3
    assert scores["per_finding_f1"] == pytest.approx({"cardiomegaly": 2 / 3, "left_effusion": 0.0})
    assert scores["macro_f1"] == pytest.approx(1 / 3)
    assert scores["sample_f1"] == pytest.approx((1.0 + 0.0 + 1.0) / 3)
    assert scores["n"] == 3 and scores["backend"] == BACKEND
    with pytest.raises(ValueError):
        corpus_finding_scores(preds, refs[:2])
