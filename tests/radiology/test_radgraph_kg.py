"""RadGraph-style F1, knowledge-graph consistency and the RaTEScore-style score and matching."""

import pytest

from grouprl.rewards import get_reward
from grouprl.domains.radiology.rewards.components import get_component, score_components
from grouprl.domains.radiology.rewards.kg import (
    KnowledgeGraph,
    kg_consistency,
    kg_consistency_reward,
    knowledge_graph,
)
from grouprl.domains.radiology.rewards.radgraph_f1 import radgraph_corpus_f1, radgraph_f1, radgraph_scores
from grouprl.domains.radiology.rewards.ratescore import (
    ABNORMALITY,
    ANATOMY,
    NON_ABNORMALITY,
    match_entities,
    rate_entities,
    ratescore,
    text_similarity,
)

REF = "There is a small left pleural effusion."
FLIP = "There is no left pleural effusion."

REPORTS = [
    REF,
    "Opacity in the left lower lobe may represent atelectasis or pneumonia. No pneumothorax.",
    "Heart size is normal. The lungs are clear. No pleural effusion or pneumothorax.",
    "Endotracheal tube terminates 4 cm above the carina. Moderate cardiomegaly is stable.",
    "Bibasilar atelectasis versus pneumonia. Pneumothorax cannot be excluded.",
]


def approx(*values):
    return pytest.approx(values, abs=1e-9)


# ---------------------------------------------------------------- RadGraph F1


def test_radgraph_negation_flip_worked_example():
    # ref: small/DP, left/A, pleura/A, effusion/DP  (small->effusion, left->pleura, effusion->pleura)
    # hyp:           left/A, pleura/A, effusion/DA  (left->pleura, effusion->pleura)
    s = radgraph_scores(FLIP, REF)
    # simple: texts {left, pleura, effusion} vs {small, left, pleura, effusion}: 3 common
    assert s["simple"] == approx(1.0, 3 / 4, 6 / 7)
    # partial: effusion's label differs: 2 common of 3 and 4 -> F1 = 2 (2/3)(1/2) / (2/3 + 1/2) = 4/7
    assert s["partial"] == approx(2 / 3, 1 / 2, 4 / 7)
    # complete: left (modify pleura) and pleura (no relations) match; effusion/DA does not
    assert s["complete"] == approx(2 / 3, 1 / 2, 4 / 7)


def test_radgraph_complete_level_sees_relations():
    # ref: moderate -modify-> cardiomegaly. hyp: moderate -modify-> effusion, cardiomegaly alone
    s = radgraph_scores("Moderate effusion. Cardiomegaly.", "Moderate cardiomegaly.")
    assert s["simple"] == approx(2 / 3, 1.0, 0.8)
    assert s["partial"] == approx(2 / 3, 1.0, 0.8)
    # only cardiomegaly (no relations on either side) matches: P 1/3, R 1/2, F1 0.4
    assert s["complete"] == approx(1 / 3, 1 / 2, 0.4)


def test_radgraph_uncertainty_is_a_label_difference():
    s = radgraph_scores("Pneumonia.", "Possible pneumonia.")
    assert s["simple"][2] == 1.0
    assert s["partial"][2] == 0.0 and s["complete"][2] == 0.0


def test_radgraph_laterality_error():
    # opacity/lower/lobe match (opacity still located_at lobe), left vs right does not: 3 of 4 each side
    s = radgraph_scores("Opacity in the right lower lobe.", "Opacity in the left lower lobe.")
    assert s["partial"] == approx(0.75, 0.75, 0.75)
    assert s["complete"] == approx(0.75, 0.75, 0.75)


@pytest.mark.parametrize("report", REPORTS)
def test_identical_reports_score_one_everywhere(report):
    assert all(v == (1.0, 1.0, 1.0) for v in radgraph_scores(report, report).values())
    assert kg_consistency(report, report) == 1.0
    assert ratescore(report, report) == 1.0
    m = match_entities(report, report, threshold=1.0)
    assert m.false_positives == [] and m.false_negatives == () and m.contradictions == []


def test_empty_responses():
    for level in ("simple", "partial", "complete"):
        assert radgraph_f1("", REF, level) == 0.0
        assert radgraph_f1(REF, "", level) == 0.0
        assert radgraph_f1("", "", level) == 1.0
        assert radgraph_f1("The patient.", "", level) == 1.0  # no entities on either side
    assert kg_consistency("", REF) == 0.0
    assert kg_consistency("", "") == 1.0
    assert ratescore("", REF) == 0.0 and ratescore(REF, "") == 0.0
    assert ratescore("", "") == 1.0


def test_mixed_case_and_abbreviations_score_as_written_out():
    ref = "Opacity in the left lower lobe. No pneumothorax."
    hyp = "LLL OPACITY. NO PTX."
    assert radgraph_scores(hyp, ref)["complete"] == (1.0, 1.0, 1.0)
    assert kg_consistency(hyp, ref) == 1.0
    assert ratescore(hyp, ref) == 1.0


def test_corpus_f1_averages_per_report_f1():
    out = radgraph_corpus_f1([FLIP, REF], [REF, REF])
    assert out["partial"] == pytest.approx((4 / 7 + 1.0) / 2)
    assert out["simple"] == pytest.approx((6 / 7 + 1.0) / 2)
    assert out["partial_precision"] == pytest.approx((2 / 3 + 1.0) / 2)
    assert out["n"] == 2 and out["backend"] == "radgraph=rules"
    with pytest.raises(ValueError):
        radgraph_corpus_f1(["a"], [])


def test_components_are_registered_with_their_backends():
    for name, backend in (("radgraphf1", "radgraph=rules"), ("radgraph_simple", "radgraph=rules"),
                          ("radgraph_complete", "radgraph=rules"), ("kg_consistency", "kg=rules"),
                          ("ratescore", "ratescore=rules-ngram")):
        assert get_component(name).backend == backend
    scores = score_components([FLIP, REF], [REF, REF], ["radgraphf1", "radgraph_simple", "radgraph_complete"])
    assert scores["radgraphf1"] == pytest.approx([4 / 7, 1.0])
    assert scores["radgraph_simple"] == pytest.approx([6 / 7, 1.0])
    assert scores["radgraph_complete"] == pytest.approx([4 / 7, 1.0])


# ---------------------------------------------------------------- knowledge graph


def test_knowledge_graph_types_and_triples():
    kg = knowledge_graph(FLIP)
    assert kg == KnowledgeGraph(
        frozenset({("left", "anatomy"), ("pleura", "anatomy"), ("effusion", "disorder_not_present")}),
        frozenset({("left", "pleura", "modify"), ("effusion", "pleura", "located_at")}),
    )
    devices = knowledge_graph("Endotracheal tube in place. The NG tube has been removed. Possible pneumonia.")
    assert devices.entities == frozenset({("endotracheal tube", "device_present"),
                                          ("nasogastric tube", "device_not_present"), ("pneumonia", "concept")})


def test_kg_consistency_worked_examples():
    # entities: {left, pleura, effusion/not_present} vs {small, left, pleura, effusion/present}: 2 / 5
    # relations: {left-pleura modify, effusion-pleura located_at} vs those + small-effusion modify: 2 / 3
    assert kg_consistency(FLIP, REF) == pytest.approx((2 / 5 + 2 / 3) / 2)
    # device present vs removed: entity IoU 0, no relations on either side -> relation IoU 1
    assert kg_consistency("Endotracheal tube in place.", "The endotracheal tube has been removed.") == 0.5
    # disjoint findings with relations: 0
    assert kg_consistency("Small effusion.", "Moderate cardiomegaly.") == 0.0


def test_kg_consistency_reward_uses_think_span_and_reasoning_column():
    reward = get_reward("kg_consistency")
    assert reward is kg_consistency_reward
    completion = f"<think>{FLIP}</think><answer>Effusion</answer>"
    # the reasoning column wins over answer
    out = reward(["p"], [completion], answer=["Effusion"], reasoning=[REF])
    assert out == pytest.approx([(2 / 5 + 2 / 3) / 2])
    # no reasoning column: the answer is the reference; no <think>: the whole completion
    assert reward(["p"], [REF], answer=[REF]) == [1.0]
    # chat-format completion
    assert reward(["p"], [[{"role": "assistant", "content": completion}]], reasoning=[FLIP]) == [1.0]
    # no reference at all -> not applicable
    assert reward(["p", "q"], [completion, completion]) == [None, None]
    assert reward(["p"], [completion], reasoning=[None], answer=[None]) == [None]


# ---------------------------------------------------------------- RaTEScore-style


def test_rate_entities_types():
    ents = {(e.text, e.type) for e in rate_entities(
        "Small left pleural effusion. No pneumothorax. Possible pneumonia. No pneumonia. Lungs are clear.")}
    assert ents == {("left pleura", ANATOMY), ("small effusion", ABNORMALITY), ("pneumothorax", NON_ABNORMALITY),
                    ("pneumonia", "DISEASE"), ("pneumonia", "NON-DISEASE"), ("lung", ANATOMY),
                    ("clear", NON_ABNORMALITY)}


def test_ratescore_negation_flip_worked_example():
    # hyp: ANATOMY "left pleura" (w .5), NON-ABNORMALITY "effusion" (w .5)
    # ref: ANATOMY "left pleura" (w .5), ABNORMALITY "small effusion" (w 1)
    # opposite polarity has affinity 0: P = (.5*1 + .5*0) / 1 = .5, R = (.5*1 + 1*0) / 1.5 = 1/3
    assert ratescore(FLIP, REF) == pytest.approx(2 * 0.5 * (1 / 3) / (0.5 + 1 / 3))  # 0.4
    assert ratescore(FLIP, REF) < 0.5 < ratescore("Small left pleural effusion.", REF)


def test_ratescore_gives_graded_credit():
    sim = text_similarity("small effusion", "effusion")
    assert 0.7 < sim < 0.8
    assert text_similarity("effusion", "effusion") == 1.0
    partial = ratescore("Left pleural effusion.", REF)  # "effusion" vs "small effusion"
    assert 0.8 < partial < 1.0


def test_negation_flip_moves_every_clinical_metric():
    s = radgraph_scores(FLIP, REF)
    assert s["partial"][2] < 0.6 and s["complete"][2] < 0.6
    assert ratescore(FLIP, REF) < 0.5
    assert kg_consistency(FLIP, REF) < 0.6


# ---------------------------------------------------------------- matching


def test_match_entities_always_matches_identical_entities():
    # many same-type candidates and the strictest threshold: identical entities still match
    ref = "Small effusion. Small opacity. Small nodule. Small mass. Small pneumothorax."
    hyp = "Small nodule."
    m = match_entities(hyp, ref, threshold=1.0)
    assert [(p.hyp.text, p.ref.text, p.similarity, p.relation) for p in m.pairs] == [
        ("small nodule", "small nodule", 1.0, "match")]
    assert {e.text for e in m.false_negatives} == {"small effusion", "small opacity", "small mass",
                                                   "small pneumothorax"}


def test_match_entities_fp_fn_and_contradictions():
    hyp = "No pleural effusion. Small right pneumothorax."
    ref = "Small pleural effusion. No pneumothorax. Cardiomegaly."
    m = match_entities(hyp, ref)
    rel = {p.hyp.text: (p.relation, p.ref.text if p.ref else None) for p in m.pairs}
    assert rel == {
        "pleura": ("match", "pleura"),
        "effusion": ("contradiction", "small effusion"),
        "right": ("fp", None),
        "small pneumothorax": ("contradiction", "pneumothorax"),
    }
    assert [e.text for e in m.false_positives] == ["right"]
    assert [(e.text, e.type, e.sentence) for e in m.false_negatives] == [("cardiomegaly", ABNORMALITY, 2)]
    assert {p.hyp.sentence for p in m.contradictions} == {0, 1}
    # tuples unpack as (hyp entity, ref entity or None, similarity, relation)
    hyp_entity, ref_entity, similarity, relation = m.pairs[0]
    assert relation == "match" and similarity == 1.0 and hyp_entity.text == ref_entity.text
    d = m.to_dict()
    assert set(d) == {"hyp_entities", "ref_entities", "pairs", "false_positives", "false_negatives",
                      "contradictions"}
    assert d["false_negatives"][0]["type"] == ABNORMALITY


def test_match_entities_threshold_is_validated():
    with pytest.raises(ValueError):
        match_entities(REF, REF, threshold=0.0)
