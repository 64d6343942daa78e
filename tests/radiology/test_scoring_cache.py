"""The batch-scoped scoring fast path (``radiology/batch_parses.py``): same scores, less work.

Scoring a batch with several components inside one ``batch_scope`` must give exactly
(bit for bit) the scores of the straightforward computation, pair by pair and from
scratch, while parsing and labelling each distinct text once for all components.
"""

from __future__ import annotations

import threading

import pytest

from grouprl.domains.radiology.synthetic.cxr import generate_studies
from grouprl.domains.radiology.rewards import entities, label_metrics, radgraph_f1, score_components
from grouprl.domains.radiology.rewards import weighted_accuracy
from grouprl.domains.radiology.rewards.batch_parses import active_scope, batch_cached, batch_scope
from grouprl.domains.radiology.rewards.chexpert import label_report
from grouprl.domains.radiology.rewards.entities import extract_graph
from grouprl.domains.radiology.rewards.kg import kg_consistency
from grouprl.domains.radiology.rewards.label_metrics import (
    INDEX_5,
    INDEX_14,
    label_accuracy,
    label_balanced_accuracy,
    label_f1,
    label_macro_f1,
    to_binary,
)
from grouprl.domains.radiology.rewards.radgraph_f1 import radgraph_scores
from grouprl.domains.radiology.rewards.ratescore import ratescore

# Every rule-based component that shares work through the batch scope: EditGRPO's
# composite and every key its client reads, plus the other levels and the KG reward.
NAMES = ["radgraphf1", "radgraph_precision", "radgraph_recall", "radgraph_simple", "radgraph_complete",
         "cxb14micro", "cxb5micro", "cxb14macro", "cxb5macro", "cxb_accuracy", "cxb_bal_acc",
         weighted_accuracy.NAME, "ratescore", "kg_consistency"]


def straightforward(hyp: str, ref: str) -> dict[str, float]:
    """Every component's value for one pair, from scratch: both texts parsed and labelled afresh and
    the scores computed from those graphs and labels, so no text-keyed or batch cache answers."""
    hg, rg = extract_graph(hyp), extract_graph(ref)
    rad = radgraph_scores(hg, rg)
    hl, rl = label_report(hyp), label_report(ref)
    hb, rb = to_binary(hl), to_binary(rl)
    return {
        "radgraphf1": rad["partial"][2], "radgraph_precision": rad["partial"][0],
        "radgraph_recall": rad["partial"][1], "radgraph_simple": rad["simple"][2],
        "radgraph_complete": rad["complete"][2],
        "cxb14micro": label_f1(hb, rb, INDEX_14), "cxb5micro": label_f1(hb, rb, INDEX_5),
        "cxb14macro": label_macro_f1(hb, rb, INDEX_14), "cxb5macro": label_macro_f1(hb, rb, INDEX_5),
        "cxb_accuracy": label_accuracy(hb, rb, INDEX_14), "cxb_bal_acc": label_balanced_accuracy(hb, rb, INDEX_14),
        weighted_accuracy.NAME: weighted_accuracy.weighted_label_agreement(hb, rb, [None] * len(hb)),
        "ratescore": ratescore(hg, rg),
        "kg_consistency": kg_consistency(hg, rg),
    }


def varied_batch() -> tuple[list[str], list[str]]:
    """GRPO-like groups and the awkward cases: duplicates, empty and blank responses, long texts,
    texts that differ only at their end or share a long beginning, a response equal to another
    group's reference."""
    reports = [s.report for s in generate_studies(24, seed=7, image_size=28)]
    refs_pool, others = reports[:8], reports[8:]
    hyps: list[str] = []
    refs: list[str] = []
    for g, ref in enumerate(refs_pool):
        sentences = ref.split(". ")
        group = [
            ref,  # verbatim
            ". ".join(sentences[1:]) or "No acute process.",  # a sentence missed
            others[g] + " " + ref,  # a report added in front: same ending as the reference
            ref + " " + others[g],  # the reference followed by more: same beginning
            ref,  # a duplicate response within the group
        ]
        hyps += group
        refs += [ref] * len(group)
    long_text = " ".join(others) * 3  # some 2,000 words
    hyps += ["", "   ", long_text, reports[1], long_text + " No pneumothorax.", "No effusion.", "No effusion!"]
    refs += [reports[0], reports[0], reports[2], reports[0], long_text, "Small left effusion.", "No effusion."]
    return hyps, refs


@pytest.fixture
def fresh_caches():
    """Text-keyed LRU caches from other tests must not answer for these."""
    from grouprl.domains.radiology.rewards import kg, ratescore as ratescore_module

    for module in (entities, ratescore_module, kg):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()


def test_fast_path_scores_equal_the_straightforward_per_pair_computation(fresh_caches):
    hyps, refs = varied_batch()
    fast = score_components(hyps, refs, NAMES)
    expected = [straightforward(h, r) for h, r in zip(hyps, refs)]
    for name in NAMES:
        slow = [e[name] for e in expected]
        mismatched = [i for i, (a, b) in enumerate(zip(fast[name], slow)) if a != b]
        assert not mismatched, f"{name} differs at pairs {mismatched[:5]}: {fast[name][mismatched[0]]} vs " \
                               f"{slow[mismatched[0]]}"
    # the batch is varied enough to tell components and pairs apart
    assert len(set(fast["radgraphf1"])) > 5 and len(set(fast["ratescore"])) > 5 and len(set(fast["cxb14micro"])) > 3


def test_component_alone_and_inside_a_shared_scope_agree(fresh_caches):
    hyps, refs = varied_batch()
    with batch_scope():
        shared = score_components(hyps, refs, NAMES)
    alone = {name: score_components(hyps, refs, [name])[name] for name in NAMES}
    assert alone == shared


def test_uncertain_labels_are_cached_apart_for_each_convention():
    hyps = ["Possible pneumonia. Small left effusion.", "May represent atelectasis.", "No effusion."]
    refs = ["Pneumonia. Left effusion.", "Atelectasis.", "Possible effusion."]
    with batch_scope():  # both conventions in one scope: a cache keyed by text alone would mix them
        positive = label_metrics.cxb14micro(hyps, refs)
        negative = label_metrics.cxb14micro(hyps, refs, uncertain_as_positive=False)
    for convention, values in ((True, positive), (False, negative)):
        expected = [label_f1(to_binary(label_report(h), uncertain_as_positive=convention),
                             to_binary(label_report(r), uncertain_as_positive=convention)) for h, r in zip(hyps, refs)]
        assert values == expected
    assert positive != negative


def _counting(monkeypatch, module, name: str) -> list[str]:
    calls: list[str] = []
    original = getattr(module, name)

    def counted(text, *args, **kwargs):
        calls.append(text)
        return original(text, *args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_each_distinct_text_is_parsed_and_labelled_once_for_all_components(monkeypatch, fresh_caches):
    hyps, refs = varied_batch()
    # every lookup that gets past the batch scope to graph_of's LRU counts: the scope alone must share the graphs
    graphs = _counting(monkeypatch, entities, "_recent_graph")
    labels = _counting(monkeypatch, label_metrics, "label_report")  # what every label-based component calls
    score_components(hyps, refs, NAMES)
    distinct = set(hyps) | set(refs)
    assert sorted(graphs) == sorted(distinct)
    assert sorted(labels) == sorted(distinct)


def test_reference_keys_are_derived_once_per_distinct_reference(monkeypatch, fresh_caches):
    hyps, refs = varied_batch()
    keys = _counting(monkeypatch, radgraph_f1, "key_strings")
    binaries = _counting(monkeypatch, label_metrics, "to_binary")
    # F1, precision and recall all read the partial level: one key set per distinct text
    score_components(hyps, refs, ["radgraphf1", "radgraph_precision", "radgraph_recall", "cxb14micro", "cxb5micro"])
    distinct = len(set(hyps) | set(refs))
    assert len(keys) == distinct
    assert len(binaries) == distinct


def test_scope_is_shared_by_nested_blocks_private_to_its_thread_and_dropped_after():
    calls = []

    @batch_cached
    def length(text: str) -> int:
        calls.append(text)
        return len(text)

    assert active_scope() is None
    seen_in_thread = []
    with batch_scope() as outer:
        with batch_scope() as inner:
            assert inner is outer
            assert length("abc") == length("abc") == 3
        thread = threading.Thread(target=lambda: seen_in_thread.append(active_scope()))
        thread.start()
        thread.join()
        assert active_scope() is outer and outer.entries(length.__wrapped__) == 1
    assert calls == ["abc"]
    assert seen_in_thread == [None]
    assert active_scope() is None
    length("abc")  # outside a scope: computed again, kept nowhere
    assert calls == ["abc", "abc"]


def test_bad_input_is_still_refused_with_its_row():
    with pytest.raises(TypeError, match="hypothesis 1 must be a string"):
        score_components(["a", None], ["b", "c"], ["cxb14micro"])
    with pytest.raises(ValueError, match="2 hypotheses for 1 references"):
        score_components(["a", "b"], ["c"], ["radgraphf1"])
