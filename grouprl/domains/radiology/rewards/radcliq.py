"""RadCliQ-v1 (Yu et al. 2023), lower is better, and its negation, RadVLM-GRPO's reward.

    RadCliQ-v1 = 2.450 - 1.245 * RadGraph - 1.651 * BERTScore - 0.995 * s_emb

with the coefficients as decoded from the original model files by a third party
(approximate; the BLEU weight is about 0 and left out). The original inputs are
RadGraph-F1 (the RadGraph model), BERTScore F1 (distilroberta-base, baseline-rescaled)
and s_emb, the cosine similarity of CheXbert embeddings. None of those models can be
loaded here, so this module computes RadCliQ from stand-ins and says so in its backend:

- RadGraph = the ``radgraphf1`` report score component (whatever backend it has; the
  default is rule-based), looked up in the component registry at call time;
- BERTScore = F1 with all-MiniLM-L6-v2 (:mod:`grouprl.domains.radiology.rewards.bertscore`,
  not rescaled);
- s_emb = cosine similarity of mean-pooled all-MiniLM-L6-v2 sentence embeddings, in
  place of CheXbert's.

Values are therefore not comparable with published RadCliQ numbers; they rank reports
the same way the formula does with these inputs, which is what a reward needs. An
empty report gets RadGraph 0, BERTScore 0 and s_emb 0, so RadCliQ 2.450.

Components: ``radcliq`` (higher_is_better=False) and ``neg_radcliq`` (= -RadCliQ-v1,
the reward RadVLM-GRPO trains with; unlike its server, failures raise instead of
scoring -3).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Sequence

from grouprl.domains.radiology.rewards.components import get_component, register_component

INTERCEPT = 2.450
W_RADGRAPH = 1.245
W_BERTSCORE = 1.651
W_SEMB = 0.995

S_EMB_BACKEND = "s_emb=all-MiniLM-L6-v2 mean-pooled cosine (CheXbert unavailable)"
BACKEND = (
    "radcliq-v1: radgraph=radgraphf1 component (rules by default), bertscore=all-MiniLM-L6-v2 (no rescale), "
    f"{S_EMB_BACKEND}"
)


def radcliq_v1(radgraph: float, bertscore: float, s_emb: float) -> float:
    """RadCliQ-v1 from its three inputs (lower is better)."""
    return INTERCEPT - W_RADGRAPH * radgraph - W_BERTSCORE * bertscore - W_SEMB * s_emb


@dataclass
class RadCliQ:
    """Per-pair RadCliQ-v1 and the inputs it was computed from, with their backend."""

    radcliq: list[float]
    radgraph: list[float]
    bertscore: list[float]
    s_emb: list[float]
    backend: str


def _radgraph_component():
    try:
        return get_component("radgraphf1")
    except KeyError:
        # Registered on import of its module; import it here rather than at the top so
        # that this module does not depend on that one's internals or import cost.
        module = "grouprl.domains.radiology.rewards.radgraph_f1"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            raise RuntimeError(f"RadCliQ needs the report score component 'radgraphf1' ({module})") from exc
        return get_component("radgraphf1")


def radcliq_scores(hyps: Sequence[str], refs: Sequence[str]) -> RadCliQ:
    """RadCliQ-v1 of each (hypothesis, reference) pair from the stand-in inputs (see the module doc)."""
    from grouprl.domains.radiology.rewards.bertscore import encode_pairs, greedy_match, sentence_cosines

    if len(hyps) != len(refs):
        raise ValueError(f"got {len(hyps)} hypotheses for {len(refs)} references")
    hyps, refs = list(hyps), list(refs)
    # One encoder pass gives both BERTScore's token embeddings and s_emb's sentence embeddings.
    enc_h, enc_r = encode_pairs(hyps, refs)
    bs = greedy_match(enc_h, enc_r)[2]
    s_emb = sentence_cosines(enc_h, enc_r)
    radgraph_component = _radgraph_component()
    radgraph = [float(v) for v in radgraph_component.fn(hyps, refs)]
    if len(radgraph) != len(hyps):
        raise ValueError(f"component radgraphf1 returned {len(radgraph)} scores for {len(hyps)} pairs")
    values = [radcliq_v1(g, b, s) for g, b, s in zip(radgraph, bs, s_emb)]
    backend = (
        f"radcliq-v1: radgraph=radgraphf1 ({radgraph_component.backend}), "
        f"bertscore=all-MiniLM-L6-v2 (no rescale), {S_EMB_BACKEND}"
    )
    return RadCliQ(values, radgraph, bs, s_emb, backend)


@register_component("radcliq", backend=BACKEND, higher_is_better=False)
def radcliq_component(hyps: list[str], refs: list[str]) -> list[float]:
    """RadCliQ-v1 from stand-in inputs (rule RadGraph, MiniLM BERTScore and s_emb); lower is better."""
    return radcliq_scores(hyps, refs).radcliq


@register_component("neg_radcliq", backend=BACKEND)
def neg_radcliq_component(hyps: list[str], refs: list[str]) -> list[float]:
    """-RadCliQ-v1 (RadVLM-GRPO's reward), higher is better."""
    return [-v for v in radcliq_scores(hyps, refs).radcliq]
