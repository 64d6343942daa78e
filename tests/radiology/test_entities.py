"""Rule-based entity and relation extraction in the RadGraph schema (grouprl.domains.radiology.rewards.entities)."""

import pytest

from grouprl.domains.radiology.rewards.entities import (
    ANAT_DP,
    OBS_DA,
    OBS_DP,
    OBS_U,
    extract_graph,
    graph_of,
    split_sentences,
)

A, P, U, N = ANAT_DP, OBS_DP, OBS_U, OBS_DA


def entities(text):
    return [(e.text, e.label) for e in extract_graph(text).entities]


def triples(text):
    return set(extract_graph(text).triples())


# (sentence, entities in reading order as (text, label), relations as (source, type, target))
CASES = [
    (
        "There is a small left pleural effusion.",
        [("small", P), ("left", A), ("pleura", A), ("effusion", P)],
        {("small", "modify", "effusion"), ("left", "modify", "pleura"), ("effusion", "located_at", "pleura")},
    ),
    (
        "Opacity in the left lower lobe.",
        [("opacity", P), ("left", A), ("lower", A), ("lobe", A)],
        {("opacity", "located_at", "lobe"), ("left", "modify", "lobe"), ("lower", "modify", "lobe")},
    ),
    (  # list negation across commas and "or"
        "No focal consolidation, pleural effusion or pneumothorax.",
        [("focal", N), ("consolidation", N), ("pleura", A), ("effusion", N), ("pneumothorax", N)],
        {("focal", "modify", "consolidation"), ("effusion", "located_at", "pleura")},
    ),
    (  # "without" negates, the clause's subject gives the location
        "Lungs are clear without consolidation or edema.",
        [("lung", A), ("clear", P), ("consolidation", N), ("edema", N)],
        {("clear", "located_at", "lung"), ("consolidation", "located_at", "lung"), ("edema", "located_at", "lung")},
    ),
    ("Pneumothorax is not seen.", [("pneumothorax", N)], set()),
    (
        "The heart is mildly enlarged.",
        [("heart", A), ("mild", P), ("enlarged", P)],
        {("mild", "modify", "enlarged"), ("enlarged", "located_at", "heart")},
    ),
    (
        "Left basilar opacity may represent atelectasis.",
        [("left", A), ("base", A), ("opacity", P), ("atelectasis", U)],
        {("left", "modify", "base"), ("opacity", "located_at", "base"), ("opacity", "suggestive_of", "atelectasis")},
    ),
    (
        "Retrocardiac opacity concerning for pneumonia.",
        [("retrocardiac region", A), ("opacity", P), ("pneumonia", U)],
        {("opacity", "located_at", "retrocardiac region"), ("opacity", "suggestive_of", "pneumonia")},
    ),
    (  # a modifier takes its observation's label
        "Possible small right apical pneumothorax.",
        [("small", U), ("right", A), ("apex", A), ("pneumothorax", U)],
        {("small", "modify", "pneumothorax"), ("right", "modify", "apex"), ("pneumothorax", "located_at", "apex")},
    ),
    ("Pneumonia cannot be excluded.", [("pneumonia", U)], set()),
    (
        "The endotracheal tube terminates 4 cm above the carina.",
        [("endotracheal tube", P), ("carina", A)],
        {("endotracheal tube", "located_at", "carina")},
    ),
    (  # a course word after the verb still modifies the observation it is said of
        "Moderate pulmonary edema has improved.",
        [("moderate", P), ("lung", A), ("edema", P), ("improved", P)],
        {("moderate", "modify", "edema"), ("improved", "modify", "edema"), ("edema", "located_at", "lung")},
    ),
    (
        "Bibasilar atelectasis versus pneumonia.",
        [("bilateral", A), ("base", A), ("atelectasis", U), ("pneumonia", U)],
        {("bilateral", "modify", "base"), ("atelectasis", "located_at", "base")},
    ),
    (  # "and the lungs are ..." starts a new subject
        "Heart size is normal and the lungs are clear.",
        [("heart", A), ("normal", P), ("lung", A), ("clear", P)],
        {("normal", "located_at", "heart"), ("clear", "located_at", "lung")},
    ),
    (  # "but" ends the negation's scope
        "There is no pneumothorax, but a small right effusion is present.",
        [("pneumothorax", N), ("small", P), ("right", A), ("effusion", P)],
        {("small", "modify", "effusion"), ("effusion", "located_at", "right")},
    ),
    (  # a removed device is absent
        "Interval removal of the right IJ catheter.",
        [("right", A), ("internal jugular vein", A), ("catheter", N)],
        {("right", "modify", "internal jugular vein"), ("catheter", "located_at", "internal jugular vein")},
    ),
    (
        "Minimal patchy airspace disease within the lingula, may reflect atelectasis or consolidation.",
        [("minimal", P), ("patchy", P), ("airspace", A), ("disease", P), ("lingula", A), ("atelectasis", U),
         ("consolidation", U)],
        {("minimal", "modify", "disease"), ("patchy", "modify", "disease"), ("disease", "located_at", "airspace"),
         ("disease", "located_at", "lingula"), ("disease", "suggestive_of", "atelectasis"),
         ("disease", "suggestive_of", "consolidation")},
    ),
]


@pytest.mark.parametrize("text, expected_entities, expected_triples", CASES, ids=[c[0][:40] for c in CASES])
def test_extraction_on_hand_written_sentences(text, expected_entities, expected_triples):
    assert entities(text) == expected_entities
    assert triples(text) == expected_triples


@pytest.mark.parametrize("text", [
    "No pleural effusion or pneumothorax.",
    "No pneumothorax, pleural effusion, or focal consolidation.",
    "There is no evidence of pneumothorax, effusion or consolidation.",
    "Pneumothorax, effusion, or consolidation is not seen.",
    "Without effusion or pneumothorax.",
])
def test_list_negation_reaches_every_item(text):
    observations = [e for e in extract_graph(text).entities if e.label != A]
    assert len(observations) >= 2
    assert all(e.label == N for e in observations), [(e.text, e.label) for e in observations]


@pytest.mark.parametrize("text, expected", [
    ("No pneumothorax and the heart is enlarged.", {"pneumothorax": N, "enlarged": P}),
    ("The heart is enlarged and effusion is not seen.", {"enlarged": P, "effusion": N}),
    ("No pneumothorax, the heart is enlarged.", {"pneumothorax": N, "enlarged": P}),
    ("No pneumothorax. Effusion.", {"pneumothorax": N, "effusion": P}),
    # "no change" is not a negation of what follows
    ("No change in the small left effusion.", {"effusion": P, "small": P}),
    # "to suggest" carries the negation on instead of hedging
    ("No focal consolidation to suggest pneumonia.", {"consolidation": N, "pneumonia": N}),
])
def test_negation_scope_ends_where_it_should(text, expected):
    labels = {e.text: e.label for e in extract_graph(text).entities}
    assert {k: labels.get(k) for k in expected} == expected


@pytest.mark.parametrize("text, expected", [
    ("Effusion may be present.", {"effusion": U}),
    ("Likely atelectasis.", {"atelectasis": U}),
    ("Atelectasis is likely.", {"atelectasis": U}),
    ("Pneumothorax cannot be excluded.", {"pneumothorax": U}),
    ("Cannot exclude pneumonia.", {"pneumonia": U}),
    ("Questionable nodule in the right upper lobe.", {"nodule": U}),
    ("The heart may be enlarged.", {"enlarged": U}),
    # hedging the suggested observation, not the one that suggests it
    ("Opacity, likely atelectasis.", {"opacity": P, "atelectasis": U}),
    ("Findings consistent with pneumonia.", {"pneumonia": P}),
])
def test_uncertainty(text, expected):
    labels = {e.text: e.label for e in extract_graph(text).entities}
    assert {k: labels.get(k) for k in expected} == expected


def test_suggestive_of_links_only_the_phrase_a_weak_cue_follows():
    assert ("opacity", "suggestive_of", "atelectasis") in triples("LLL opacity, likely atelectasis.")
    assert not any(t[1] == "suggestive_of" for t in triples("Cardiomegaly and likely small effusion."))
    assert ("opacity", "suggestive_of", "pneumonia") in triples(
        "Right basilar opacity which may represent atelectasis or early pneumonia.")


@pytest.mark.parametrize("abbreviated, written_out", [
    ("LLL OPACITY.", "left lower lobe opacity."),
    ("No PTX.", "No pneumothorax."),
    ("Blunting of the left CP angle.", "Blunting of the left costophrenic angle."),
    ("ETT in place.", "Endotracheal tube in place."),
    ("Bibasilar atelectasis.", "Atelectasis at both bases."),
    ("NO PLEURAL EFFUSIONS.", "no pleural effusion."),
    ("Findings suggest CHF.", "Findings suggest congestive heart failure."),
])
def test_abbreviations_and_case_build_the_same_graph(abbreviated, written_out):
    assert sorted(entities(abbreviated)) == sorted(entities(written_out))
    assert triples(abbreviated) == triples(written_out)


def test_paraphrases_normalise_to_one_graph():
    # adjective -> noun and plural -> singular
    assert triples("Enlarged heart.") == triples("The heart is enlarged.") == triples("Cardiac enlargement.")
    assert triples("Low lung volumes.") == triples("Lung volumes are low.")
    assert entities("Bilateral pleural effusions.") == [("bilateral", A), ("pleura", A), ("effusion", P)]


def test_sentence_index_and_spans():
    text = "Heart size is normal.\nNo effusion.  Small right pneumothorax."
    g = extract_graph(text)
    assert split_sentences(text) == ["Heart size is normal.", "No effusion.", "Small right pneumothorax."]
    by_text = {e.text: e for e in g.entities}
    assert by_text["heart"].sentence == 0
    assert by_text["effusion"].sentence == 1
    assert by_text["pneumothorax"].sentence == 2
    e = by_text["pneumothorax"]
    assert text[e.start:e.end] == "pneumothorax"
    lll = extract_graph("See LLL.").entities
    assert [x.text for x in lll] == ["left", "lower", "lobe"]
    assert {("See LLL."[x.start:x.end]) for x in lll} == {"LLL"}  # expanded entities share the span


def test_ids_are_positions_and_relations_point_at_them():
    g = extract_graph("Small right pleural effusion. Opacity in the RUL, likely pneumonia.")
    assert [e.id for e in g.entities] == list(range(len(g.entities)))
    for r in g.relations:
        assert 0 <= r.source < len(g.entities) and 0 <= r.target < len(g.entities)
        assert r.type in ("located_at", "modify", "suggestive_of")


def test_empty_and_entity_free_text():
    assert extract_graph("").entities == ()
    assert extract_graph("   \n ").relations == ()
    assert extract_graph("The patient was seen today.").entities == ()
    with pytest.raises(TypeError):
        extract_graph(None)


def test_pathological_input_stays_linear():
    # one long clause full of cues: scopes are capped, so this must not blow up
    text = " ".join(["no effusion or possible pneumonia and"] * 2000)
    g = extract_graph(text)
    assert len(g.entities) == 4000


def test_graph_of_is_cached_and_immutable():
    a = graph_of("Small left effusion.")
    assert graph_of("Small left effusion.") is a
    with pytest.raises((AttributeError, TypeError)):
        a.entities[0].label = "OBS-DA"


def test_sentence_spans_equal_editgrpos_split():
    """sentence_spans matches the stripped, non-empty pieces of EditGRPO's split
    (re.split(r"(?<=[.!?])\\s+|\\n+")) on texts full of its edge cases."""
    import random

    from grouprl.domains.radiology.rewards.entities import _SENTENCE_BOUNDARY, sentence_spans

    def by_split(text):
        spans, pos = [], 0
        for m in list(_SENTENCE_BOUNDARY.finditer(text)) + [None]:
            end = m.start() if m else len(text)
            piece = text[pos:end]
            if piece.strip():
                start = pos + len(piece) - len(piece.lstrip())
                spans.append((start, start + len(piece.strip())))
            pos = m.end() if m else pos
        return spans

    assert _SENTENCE_BOUNDARY.pattern == r"(?<=[.!?])\s+|\n+"
    rng = random.Random(0)
    alphabet = ["a", "b", " ", "  ", ".", "!", "?", "\n", "\t", "\u00a0", "\r", "\u2028", "x."]
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 14)))
        assert sentence_spans(text) == by_split(text), repr(text)
