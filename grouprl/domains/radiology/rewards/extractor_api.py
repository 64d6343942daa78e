"""The answers of EditGRPO's two extractor servers, built from grouprl's rule-based entities.

EditGRPO's post-rollout editor asks an extractor which sentences of a generated report
to replace, delete or add, in one of two dialects (``worker.rollout.extractor_type``):

- ``ratescore`` posts ``{"generations", "ground_truth"}`` to ``/analyze`` and reads, per
  pair, ``false_positives``, ``false_negatives``, ``contradictions`` and
  ``ref_entities_grouped_by_sentence``; each entity has ``text_span``, ``type``,
  ``sentence`` (the sentence text) and an ``embedding``, whose cosine picks the
  replacement sentence (:func:`analyze_pairs`, :func:`attach_embeddings`). Entities
  carry no ``sentence_entities`` list: the seed's client would then compare a mean
  similarity with tau times the number of entities, a threshold no sentence of
  several entities reaches.
- ``radgraph`` posts the same body to ``/extract`` and reads RadGraph annotations of
  each text: ``{"gen_annotations": {"0": annotation, ...}, "gt_annotations": {...}}``,
  an annotation being ``{"text", "entities": {"1": {"tokens", "label", "relations"}},
  "data_source", "data_split"}`` with the RadGraph package's label strings
  ("Observation::definitely present", ...) and relations ``[type, target id]``
  (:func:`radgraph_annotations`). ``tokens`` is the entity's words as written in the
  text, since the client finds an entity's sentence by searching for them; each entity
  also has ``normalized`` (grouprl's lemma, e.g. "pleura" for "pleural") and character
  offsets ``start``/``end`` in place of RadGraph's token indices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grouprl.domains.radiology.rewards import ratescore
from grouprl.domains.radiology.rewards.entities import ANAT_DP, OBS_DA, OBS_DP, OBS_U, graph_of, split_sentences
from grouprl.domains.radiology.rewards.entity_embeddings import EntityEmbedder

# grouprl's labels -> the RadGraph package's label strings (what EditGRPO's client matches on)
RADGRAPH_LABELS = {
    ANAT_DP: "Anatomy::definitely present",
    OBS_DP: "Observation::definitely present",
    OBS_U: "Observation::uncertain",
    OBS_DA: "Observation::definitely absent",
}
BACKEND = "radgraph=rules"


# ----------------------------------------------------------------------------- /analyze


def analyze_pairs(generations: Sequence[str], ground_truth: Sequence[str]) -> list[dict[str, Any]]:
    """EditGRPO's extractor analysis of each (generation, reference) pair, with grouprl's entity matcher.

    Per pair: the entities of both texts (text, type, sentence index and sentence),
    the false positives (generated entities with no counterpart), the false negatives
    (reference entities with none) and the contradictions (same observation, opposite
    polarity), plus EditGRPO's ``ref_entities_grouped_by_sentence``. No embeddings:
    :func:`attach_embeddings` adds them.
    """
    # ratescore.match_entities is looked up at call time so that a replacement (tests) takes effect.
    return [analysis_dict(ratescore.match_entities(gen, ref).to_dict(), split_sentences(gen), split_sentences(ref))
            for gen, ref in zip(generations, ground_truth)]


def analysis_dict(match: Mapping[str, Any], gen_sentences: Sequence[str],
                  ref_sentences: Sequence[str]) -> dict[str, Any]:
    """``EntityMatching.to_dict()`` in the /analyze response's shape, EditGRPO's key names kept.

    Entities get ``sentence_index`` (the matcher's ``sentence``), the ``sentence``
    text itself and EditGRPO's ``text_span``; a contradiction is
    ``{"gen_entity", "ref_entity", "similarity"}``.
    """
    def gen(e):
        return entity_dict(e, gen_sentences)

    def ref(e):
        return entity_dict(e, ref_sentences)

    references = [ref(e) for e in match["ref_entities"]]
    grouped: dict[str, list[dict[str, Any]]] = {}
    for e in references:
        grouped.setdefault(e["sentence"], []).append(e)
    return {
        "generation_entities": [gen(e) for e in match["hyp_entities"]],
        "reference_entities": references,
        "false_positives": [gen(e) for e in match["false_positives"]],
        "false_negatives": [ref(e) for e in match["false_negatives"]],
        "contradictions": [{"gen_entity": gen(c["hyp"]), "ref_entity": ref(c["ref"]),
                            "similarity": float(c["similarity"])} for c in match["contradictions"]],
        "ref_entities_grouped_by_sentence": grouped,
    }


def entity_dict(entity: Mapping[str, Any], sentences: Sequence[str]) -> dict[str, Any]:
    """One matcher entity with EditGRPO's ``text_span`` and its sentence (index and text)."""
    index = int(entity["sentence"])
    out = {k: v for k, v in entity.items() if k != "sentence"}
    out.update(text_span=entity["text"], sentence_index=index,
               sentence=sentences[index].strip() if 0 <= index < len(sentences) else "")
    return out


def attach_embeddings(results: Sequence[Mapping[str, Any]], embedder: EntityEmbedder) -> list[dict[str, Any]]:
    """Copies of /analyze results whose entities in the lists EditGRPO's client reads carry ``embedding``.

    Those lists are ``false_positives``, ``false_negatives``, both sides of
    ``contradictions`` and ``ref_entities_grouped_by_sentence`` (as the seed's server
    sends them); ``generation_entities`` and ``reference_entities`` stay without, so
    that no vector travels twice. Each distinct entity text of the whole batch is
    embedded once, in one call.
    """
    def lists(result):
        yield result.get("false_positives", [])
        yield result.get("false_negatives", [])
        for c in result.get("contradictions", []):
            yield [c["gen_entity"], c["ref_entity"]]
        yield from result.get("ref_entities_grouped_by_sentence", {}).values()

    texts = list(dict.fromkeys(e["text"] for r in results for entities in lists(r) for e in entities))
    vectors = dict(zip(texts, embedder.embed(texts))) if texts else {}

    def with_vector(e):
        return {**e, "embedding": vectors[e["text"]]}

    out = []
    for r in results:
        copy = dict(r)
        copy["false_positives"] = [with_vector(e) for e in r.get("false_positives", [])]
        copy["false_negatives"] = [with_vector(e) for e in r.get("false_negatives", [])]
        copy["contradictions"] = [{**c, "gen_entity": with_vector(c["gen_entity"]),
                                   "ref_entity": with_vector(c["ref_entity"])} for c in r.get("contradictions", [])]
        copy["ref_entities_grouped_by_sentence"] = {
            sentence: [with_vector(e) for e in entities]
            for sentence, entities in r.get("ref_entities_grouped_by_sentence", {}).items()}
        out.append(copy)
    return out


# ----------------------------------------------------------------------------- /extract


def radgraph_annotation(text: str) -> dict[str, Any]:
    """One text's RadGraph-package-shaped annotation (see the module doc); entity ids count from "1"."""
    graph = graph_of(text)
    relations: dict[int, list[list[str]]] = {}
    for r in graph.relations:
        relations.setdefault(r.source, []).append([r.type, str(r.target + 1)])
    entities = {
        str(e.id + 1): {"tokens": text[e.start:e.end], "label": RADGRAPH_LABELS[e.label],
                        "relations": relations.get(e.id, []), "normalized": e.text, "start": e.start, "end": e.end}
        for e in graph.entities
    }
    return {"text": text, "entities": entities, "data_source": None, "data_split": "inference"}


def radgraph_annotations(texts: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{"0": annotation, "1": ...}`` for ``texts`` in order, as the RadGraph package returns them."""
    return {str(i): radgraph_annotation(t) for i, t in enumerate(texts)}
