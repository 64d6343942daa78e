"""The rule-based CheXpert labeler and the CheXpert-label F1 metrics and rewards."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grouprl.domains.radiology.rewards.chexpert import BACKEND, FIVE, OBSERVATIONS, label_report, label_reports
from grouprl.domains.radiology.rewards.components import get_component, score_components
from grouprl.domains.radiology.rewards.label_metrics import (
    chexpert_f1,
    chexpert_f1_reports,
    cxb5micro,
    cxb14micro,
    cxb_bal_acc,
    label_balanced_accuracy,
    label_f1,
    label_pairs,
    to_binary,
)

# Shipped with the tests (tests/data/README.md says where it comes from), so it runs on a fresh clone.
SAMPLE = Path(__file__).resolve().parent / "data" / "chexpert_labeler_sample.jsonl"
# The four sample reports of the CheXpert labeler with its published labels, copied
# from SAMPLE so that the test runs where the shared folder is absent.
PUBLISHED = [
    ("Heart size normal and lungs are clear. No edema or pneumonia. No effusion",
     {"No Finding": 1, "Cardiomegaly": 0, "Edema": 0, "Pneumonia": 0, "Pleural Effusion": 0}),
    ("1. Left pleural effusion with adjacent atelectasis. Right effusion is also present.\n\n"
     "2. Cardiomegaly without overt edema.",
     {"Cardiomegaly": 1, "Edema": 0, "Atelectasis": 1, "Pleural Effusion": 1}),
    ("Minimal patchy airspace disease within the lingula, may reflect atelectasis or consolidation.",
     {"Lung Opacity": 1, "Consolidation": -1, "Atelectasis": -1}),
    ("1. Stable mild cardiomegaly. 2. Hyperexpanded but clear lungs.", {"Cardiomegaly": 1}),
]


def full(mentioned):
    """All 14 labels: the given ones, None for the rest."""
    return {name: mentioned.get(name) for name in OBSERVATIONS}


def test_observation_lists():
    assert OBSERVATIONS == (
        "No Finding", "Enlarged Cardiomediastinum", "Cardiomegaly", "Lung Lesion", "Lung Opacity", "Edema",
        "Consolidation", "Pneumonia", "Atelectasis", "Pneumothorax", "Pleural Effusion", "Pleural Other",
        "Fracture", "Support Devices",
    )
    assert FIVE == ("Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Pleural Effusion")
    assert BACKEND == "labeler=rules"
    assert get_component("cxb14micro").backend == "labeler=rules"


@pytest.mark.parametrize("text, expected", PUBLISHED)
def test_published_sample_labels(text, expected):
    assert label_report(text) == full(expected)


def test_published_sample_file():
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    assert len(rows) == 4
    for row in rows:
        assert label_report(row["text"]) == row["labels"], row["text"]


HAND = [
    # each observation, with synonyms and radiology wording
    ("Widened mediastinum.", {"Enlarged Cardiomediastinum": 1}),
    ("The cardiomediastinal silhouette is within normal limits.",
     {"No Finding": 1, "Enlarged Cardiomediastinum": 0, "Cardiomegaly": 0}),
    ("The heart is mildly enlarged.", {"Cardiomegaly": 1}),
    ("The heart is not enlarged.", {"No Finding": 1, "Cardiomegaly": 0}),
    ("Enlarged cardiac silhouette.", {"Cardiomegaly": 1}),
    ("Right upper lobe nodule.", {"Lung Lesion": 1}),
    ("Mild pulmonary vascular congestion.", {"Edema": 1}),
    ("Apical pleural thickening.", {"Pleural Other": 1}),
    ("Old healed right rib fractures.", {"Fracture": 1}),
    ("Hydropneumothorax.", {"Pneumothorax": 1, "Pleural Effusion": 1}),
    ("Blunting of the left costophrenic angle.", {"Pleural Effusion": 1}),
    # devices: abbreviations, mixed case, "No Finding" ignores them
    ("ET tube terminates 4 cm above the carina. NG tube courses below the diaphragm.",
     {"No Finding": 1, "Support Devices": 1}),
    ("Interval removal of the endotracheal tube.", {"No Finding": 1, "Support Devices": 0}),
    # look-alikes that are no mention
    ("Pericardial effusion. Right pneumothorax with a visible pleural line.", {"Pneumothorax": 1}),
    # negation before, after, and over lists until a scope breaker
    ("No focal consolidation, pleural effusion, or pneumothorax.",
     {"No Finding": 1, "Consolidation": 0, "Pleural Effusion": 0, "Pneumothorax": 0}),
    ("There is no pneumothorax but there is a small left effusion.", {"Pneumothorax": 0, "Pleural Effusion": 1}),
    ("No pneumothorax and stable cardiomegaly.", {"Pneumothorax": 0, "Cardiomegaly": 1}),
    ("Chest tube in place, with no residual pneumothorax.",
     {"No Finding": 1, "Pneumothorax": 0, "Support Devices": 1}),
    ("Previously noted left effusion is no longer seen. The pneumothorax has resolved.",
     {"No Finding": 1, "Pleural Effusion": 0, "Pneumothorax": 0}),
    ("No focal consolidation to suggest pneumonia.", {"No Finding": 1, "Consolidation": 0, "Pneumonia": 0}),
    ("No change in the left pleural effusion.", {"Pleural Effusion": 1}),
    # uncertainty before and after the mention; negated uncertainty stays uncertain
    ("Right lower lobe opacity concerning for pneumonia.", {"Lung Opacity": 1, "Pneumonia": -1}),
    ("Bibasilar opacities likely reflect atelectasis.", {"Lung Opacity": 1, "Atelectasis": -1}),
    ("Atelectasis is likely. A small pneumothorax is not excluded.", {"Atelectasis": -1, "Pneumothorax": -1}),
    ("Left lower lobe consolidation, cannot exclude pneumonia.", {"Consolidation": 1, "Pneumonia": -1}),
    ("Pneumonia cannot be ruled out.", {"Pneumonia": -1}),
    ("Atelectasis versus pneumonia at the left base.", {"Atelectasis": -1, "Pneumonia": -1}),
    ("No effusion, possible atelectasis.", {"Pleural Effusion": 0, "Atelectasis": -1}),
    ("Heart size is borderline.", {"Cardiomegaly": -1}),
    # a modal verb reaches back only when it ends the statement
    ("Effusion may be present at the left base.", {"Pleural Effusion": -1}),
    ("Mild interstitial opacity may be due to chronic lung disease.", {"Lung Opacity": 1}),
    # aggregation: positive beats uncertain beats negative
    ("No definite pneumothorax, though a small apical pneumothorax is possible. Right pneumothorax.",
     {"Pneumothorax": 1}),
    # word wrap is not a sentence end, a capitalised new line or a list marker is
    ("There is no pleural effusion or\npneumothorax.", {"No Finding": 1, "Pleural Effusion": 0, "Pneumothorax": 0}),
    ("No effusion\nCardiomegaly.", {"Pleural Effusion": 0, "Cardiomegaly": 1}),
    ("1) No effusion 2) Cardiomegaly", {"Pleural Effusion": 0, "Cardiomegaly": 1}),
    # "lungs are clear" labels nothing, as in the published sample; No Finding 1
    ("No acute cardiopulmonary process. The lungs are clear.", {"No Finding": 1}),
]


@pytest.mark.parametrize("text, expected", HAND)
def test_hand_labelled_reports(text, expected):
    assert label_report(text) == full(expected)


NEGATIONS = [
    "No pneumothorax.", "Without pneumothorax.", "Negative for pneumothorax.", "Free of pneumothorax.",
    "Resolution of pneumothorax.", "No evidence of pneumothorax.", "Absence of pneumothorax.",
    "No signs of pneumothorax.", "There is no longer a pneumothorax.", "Neither pneumothorax nor effusion.",
    "Pneumothorax is not seen.", "Pneumothorax has resolved.", "Pneumothorax is absent.",
    "Pneumothorax is no longer visualized.", "Pneumothorax has been ruled out.",
    # a hedge reaching a negated mention does not undo the negation
    "No pneumothorax is suspected.",
]
UNCERTAINTIES = [
    "May represent pneumothorax.", "May reflect pneumothorax.", "Could represent pneumothorax.",
    "Possible pneumothorax.", "Possibly pneumothorax.", "Probable pneumothorax.", "Likely pneumothorax.",
    "Questionable pneumothorax.", "Question of pneumothorax.", "Suspected pneumothorax.",
    "Equivocal pneumothorax.", "Concerning for pneumothorax.", "Suspicious for pneumothorax.",
    "Suggestive of pneumothorax.", "Findings suggest pneumothorax.", "Evaluate for pneumothorax.",
    "Differential diagnosis includes pneumothorax.",
    "Cannot exclude pneumothorax.", "Can not rule out pneumothorax.", "Cannot entirely exclude a small pneumothorax.",
    "Pneumothorax cannot be excluded.", "Pneumothorax is not excluded.", "Pneumothorax cannot be ruled out.",
    "Pneumothorax is likely.", "Pneumothorax is possible.", "Pneumothorax may be present.",
]


@pytest.mark.parametrize("text", NEGATIONS)
def test_negation_cues(text):
    assert label_report(text)["Pneumothorax"] == 0


@pytest.mark.parametrize("text", UNCERTAINTIES)
def test_uncertainty_cues(text):
    assert label_report(text)["Pneumothorax"] == -1


def test_mixed_case_and_abbreviations():
    expected = full({"Edema": 1, "Pneumothorax": 0, "Support Devices": 1, "Pleural Effusion": 0})
    assert label_report("Findings consistent with CHF. No PTX. Right PICC line. NO PLEURAL EFFUSION.") == expected
    assert label_report("findings consistent with chf. no ptx. right picc line. no pleural effusion.") == expected
    assert label_report("NO CARDIOMEGALY")["Cardiomegaly"] == 0


def test_empty_text_labels_nothing():
    for text in ("", "   \n"):
        assert label_report(text) == full({})
    # A text that mentions nothing is a report with no finding, as in the original labeler.
    assert label_report("Report.") == full({"No Finding": 1})


def test_no_finding_is_one_or_none():
    assert label_report("No pneumothorax.")["No Finding"] == 1
    assert label_report("Possible pneumothorax.")["No Finding"] is None
    assert label_report("Pneumothorax.")["No Finding"] is None


def test_label_reports_labels_repeats_once():
    out = label_reports(["No effusion.", "Pleural effusion.", "No effusion."])
    assert [o["Pleural Effusion"] for o in out] == [0, 1, 0]
    out[0]["Pleural Effusion"] = 5  # each row is its own dict
    assert out[2]["Pleural Effusion"] == 0


def test_labeler_imports_no_torch():
    code = "import sys, grouprl.domains.radiology.rewards.label_metrics; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---------------------------------------------------------------- metrics


def test_to_binary():
    labels = full({"No Finding": None, "Cardiomegaly": 1, "Edema": -1, "Pneumothorax": 0})
    on = to_binary(labels)
    off = to_binary(labels, uncertain_as_positive=False)
    idx = OBSERVATIONS.index
    assert len(on) == 14 and sum(on) == 2 and on[idx("Cardiomegaly")] == on[idx("Edema")] == 1
    assert sum(off) == 1 and off[idx("Edema")] == 0


REPORTS = [
    "Heart size is normal. The lungs are clear. No pleural effusion or pneumothorax.",
    "Moderate cardiomegaly. Small bilateral pleural effusions with adjacent atelectasis. Possible pneumonia.",
    "ET tube 4 cm above the carina. Right PICC line. No pneumothorax.",
    "",
]


@pytest.mark.parametrize("name", ["cxb14micro", "cxb5micro", "cxb_bal_acc"])
def test_identical_reports_score_one(name):
    scores = score_components(REPORTS, REPORTS, [name])[name]
    assert scores == [1.0] * len(REPORTS)


def test_negation_flip_zeroes_label_f1():
    hyp, ref = ["There is no pleural effusion."], ["There is a pleural effusion."]
    assert label_report(hyp[0])["Pleural Effusion"] == 0
    assert label_report(ref[0])["Pleural Effusion"] == 1
    assert cxb14micro(hyp, ref) == [0.0]  # hyp: No Finding; ref: Pleural Effusion
    assert cxb5micro(hyp, ref) == [0.0]
    # 14 classes, ref positive {PE}, hyp positive {No Finding}: recall 0, specificity 12/13
    assert cxb_bal_acc(hyp, ref) == [pytest.approx((0 + 12 / 13) / 2)]


def test_empty_response():
    ref = ["Heart size is normal. No pleural effusion."]  # No Finding 1
    assert cxb14micro([""], ref) == [0.0]
    assert cxb5micro([""], ref) == [1.0]  # neither has a positive among the five
    assert cxb_bal_acc([""], ref) == [pytest.approx(0.5)]  # misses the one positive, all 13 negatives right
    assert cxb14micro([""], [""]) == [1.0]


def test_per_sample_degenerate_cases():
    zeros, ones = [0] * 14, [1] * 14
    assert label_f1(zeros, zeros) == 1.0
    assert label_balanced_accuracy(zeros, zeros) == 1.0  # only the negatives' recall
    assert label_balanced_accuracy(ones, zeros) == 0.0
    assert label_balanced_accuracy(ones, ones) == 1.0  # only the positives' recall
    assert label_balanced_accuracy(zeros, ones) == 0.0


def test_mismatched_and_bad_inputs():
    with pytest.raises(ValueError):
        cxb14micro(["a"], ["a", "b"])
    with pytest.raises(TypeError):
        label_pairs([None], ["a"])
    with pytest.raises(ValueError):
        chexpert_f1([{}], [])


# A corpus of three pairs, worked by hand.
HYPS = [
    "Cardiomegaly. No pleural effusion.",  # Cardiomegaly
    "No acute cardiopulmonary process.",  # No Finding
    "Left lower lobe pneumonia with small pleural effusion.",  # Pneumonia, Pleural Effusion
]
REFS = [
    "Cardiomegaly. Small left pleural effusion.",  # Cardiomegaly, Pleural Effusion
    "Heart size is normal. No pneumothorax.",  # No Finding (Cardiomegaly 0, Pneumothorax 0)
    "Possible left lower lobe pneumonia.",  # Pneumonia uncertain
]


def test_corpus_metrics_hand_worked():
    result = chexpert_f1_reports(HYPS, REFS)
    # Per class (uncertain as positive): No Finding TP 1 -> F1 1; Cardiomegaly TP 1 -> 1;
    # Pneumonia TP 1 (ref -1 counts) -> 1; Pleural Effusion FN 1 (pair 1) + FP 1 (pair 3) -> 0;
    # the other ten classes have no positive anywhere -> 0 (zero_division).
    assert result["per_class_f1"]["No Finding"] == 1.0
    assert result["per_class_f1"]["Cardiomegaly"] == 1.0
    assert result["per_class_f1"]["Pneumonia"] == 1.0
    assert result["per_class_f1"]["Pleural Effusion"] == 0.0
    # micro 14: TP 3, FP 1, FN 1 -> 6 / 8
    assert result["micro_f1_14"] == pytest.approx(0.75)
    # macro 14: (1 + 1 + 1 + 0 + 10 * 0) / 14
    assert result["macro_f1_14"] == pytest.approx(3 / 14)
    # five classes: Cardiomegaly TP 1; Pleural Effusion FP 1, FN 1 -> micro 2 / 4, macro 1 / 5
    assert result["micro_f1_5"] == pytest.approx(0.5)
    assert result["macro_f1_5"] == pytest.approx(0.2)
    assert result["support"]["Pleural Effusion"] == 1 and result["support"]["Pneumonia"] == 1
    assert result["n"] == 3 and result["backend"] == "labeler=rules" and result["uncertain_as_positive"]

    # Uncertain as negative: the reference's pneumonia is no positive, the hypothesis's is a FP.
    strict = chexpert_f1_reports(HYPS, REFS, uncertain_as_positive=False)
    assert strict["per_class_f1"]["Pneumonia"] == 0.0
    assert strict["micro_f1_14"] == pytest.approx(4 / 7)  # TP 2, FP 2, FN 1
    assert strict["macro_f1_14"] == pytest.approx(2 / 14)

    # zero_division=1 counts the ten empty classes as perfect.
    lenient = chexpert_f1(*label_pairs(HYPS, REFS), zero_division=1.0)
    assert lenient["macro_f1_14"] == pytest.approx(13 / 14)

    # The per-sample components on the same pairs.
    assert cxb14micro(HYPS, REFS) == pytest.approx([2 / 3, 1.0, 2 / 3])
    assert cxb5micro(HYPS, REFS) == pytest.approx([2 / 3, 1.0, 0.0])
    # pair 1: recall 1/2, specificity 12/12; pair 2: 1, 13/13; pair 3: 1/1, 12/13
    assert cxb_bal_acc(HYPS, REFS) == pytest.approx([0.75, 1.0, (1 + 12 / 13) / 2])


def test_macro_and_accuracy_components_on_worked_pairs():
    from grouprl.domains.radiology.rewards.label_metrics import cxb14macro, cxb5macro, cxb_accuracy

    hyp = "Cardiomegaly. Small left pleural effusion. No pneumothorax."
    ref = "Cardiomegaly. Left lower lobe atelectasis. No effusion."
    # positives: hyp {Cardiomegaly, Pleural Effusion}, ref {Cardiomegaly, Atelectasis}
    # macro over classes positive in either: Cardiomegaly 1, Effusion 0, Atelectasis 0 -> 1/3
    assert cxb14macro([hyp], [ref]) == [pytest.approx(1 / 3)]
    # the 5 competition labels contain all three -> also 1/3
    assert cxb5macro([hyp], [ref]) == [pytest.approx(1 / 3)]
    # 14 labels: disagreement on Effusion and Atelectasis only -> 12/14
    assert cxb_accuracy([hyp], [ref]) == [pytest.approx(12 / 14)]
    assert cxb14macro([ref], [ref]) == [1.0] and cxb_accuracy([ref], [ref]) == [1.0]
