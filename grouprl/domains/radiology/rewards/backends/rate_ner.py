"""RaTE-NER entities and a RaTEScore on them, from local model directories.

RaTE-NER (Zhao et al. 2024) is a token-classification model (RaTE-NER-Deberta is a
DeBERTa-v3) that tags radiology text with BIO tags over five entity types:
``ABNORMALITY``, ``NON-ABNORMALITY``, ``DISEASE``, ``NON-DISEASE``, ``ANATOMY``
(11 labels with ``O``, :data:`RATE_NER_LABELS` in the published order). The labels
are read from the model's ``config.id2label``; a config with generic names
(``LABEL_0``...) needs ``labels=`` (the published list is :data:`RATE_NER_LABELS`).

How :meth:`RateNER.extract` reads a report, as RaTEScore does, one sentence at a time:

1. the report is cut into sentences the way the rule-based extractor cuts it
   (:func:`grouprl.domains.radiology.rewards.entities.sentence_spans`), so an entity's
   ``sentence`` indexes the same list in either backend;
2. each sentence is tokenized (a fast tokenizer, for word ids and character
   offsets; cut at the model's length limit, 512 word pieces at most) and tagged;
3. word pieces are aggregated into words: a word takes the tag of its first piece;
4. BIO decoding over the words: ``B-T`` opens an entity of type T; ``I-T`` extends
   an open entity of type T, and otherwise opens one (a continuation without its
   beginning is still an entity, as most NER decoders read it); ``O`` closes.

Entities come back as :class:`grouprl.domains.radiology.rewards.ratescore.RateEntity`:
``text`` is the span lower-cased with single spaces (``head`` the same; a model
entity has no separate modifiers), ``start``/``end`` character offsets into the
report, ``sentence`` the sentence index.

:class:`RateScoreModel` scores with these entities the way
:mod:`grouprl.domains.radiology.rewards.ratescore` scores the rule-based ones: each entity's
score is its best ``similarity x affinity(type pair)`` in the other report, the
weighted means over the generated and over the reference entities are precision and
recall, and the score is their F1 (both without entities 1.0, one without 0.0).
The type affinities and weights are ratescore.py's own (``affinity``,
``TYPE_WEIGHTS``), imported, not copied; :func:`entity_fscore` is that formula on
any two entity lists with any similarity. Similarity is the cosine of mean-pooled
sentence embeddings from a local encoder directory (``encoder_path``; RaTEScore uses
BioLORD-2023-C; any sentence-transformers or transformers encoder directory with
safetensors weights, loaded through :func:`grouprl.domains.radiology.rewards.bertscore.load_encoder`),
clipped at 0, or without an encoder ratescore.py's character-trigram similarity.
Identical entity texts have similarity 1.0 either way, so identical reports score 1.0.
RaTEScore's learned affinity matrix and negation penalty are not reproduced: scores
are RaTEScore-like, not the published metric, and the backend string says which
NER model and which similarity produced them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grouprl.domains.radiology.rewards.backends import register_backend_component
from grouprl.domains.radiology.rewards.components import Component
from grouprl.domains.radiology.rewards.entities import sentence_spans
from grouprl.domains.radiology.rewards.ratescore import RATE_TYPES, TYPE_WEIGHTS, RateEntity, affinity, text_similarity

RATE_NER_LABELS: tuple[str, ...] = (
    "B-ABNORMALITY", "I-ABNORMALITY", "B-NON-ABNORMALITY", "I-NON-ABNORMALITY", "B-DISEASE", "I-DISEASE",
    "B-NON-DISEASE", "I-NON-DISEASE", "B-ANATOMY", "I-ANATOMY", "O",
)
NGRAM_SIMILARITY = "char-trigram"

_LOCK = threading.Lock()
_NER: dict[tuple[str, str, tuple | None], "RateNER"] = {}


def parse_tag(label: str) -> tuple[str, str | None]:
    """``"B-ANATOMY"`` -> ``("B", "ANATOMY")``, ``"O"`` -> ``("O", None)``; anything else is refused."""
    if label == "O":
        return "O", None
    prefix, _, kind = label.partition("-")
    if prefix not in ("B", "I") or kind not in RATE_TYPES:
        raise ValueError(f"{label!r} is not a RaTE-NER tag (O, or B-/I- followed by one of {', '.join(RATE_TYPES)})")
    return prefix, kind


def decode_bio(tags: Sequence[str]) -> list[tuple[int, int, str]]:
    """Entity spans ``(first, last + 1, type)`` over a tag sequence (see the module doc, step 4)."""
    spans: list[tuple[int, int, str]] = []
    start, kind = -1, None
    for i, tag in enumerate(tags):
        prefix, tag_kind = parse_tag(tag)
        if prefix == "I" and kind == tag_kind:
            continue
        if kind is not None:
            spans.append((start, i, kind))
        start, kind = (i, tag_kind) if prefix != "O" else (-1, None)
    if kind is not None:
        spans.append((start, len(tags), kind))
    return spans


def _normalise(span: str) -> str:
    return " ".join(span.lower().split())


class RateNER:
    """A RaTE-NER token classifier from a local transformers directory (see the module doc)."""

    def __init__(self, model_path: str | Path, device: str = "cpu", *, labels: Sequence[str] | None = None,
                 batch_size: int = 32, cache_size: int = 8192):
        import torch  # noqa: F401
        from transformers import AutoModelForTokenClassification, AutoTokenizer

        path = Path(model_path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"RaTE-NER model directory {path} not found or has no config.json "
                                    f"(a local transformers token-classification directory; nothing is downloaded)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path = path
        self.device = device
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(f"{path}: RaTE-NER needs a fast tokenizer (tokenizer.json) for word ids and offsets")
        # safetensors only: a pickled pytorch_model.bin is never loaded.
        self.model = AutoModelForTokenClassification.from_pretrained(str(path), local_files_only=True,
                                                                     use_safetensors=True).to(device).eval()
        n = self.model.config.num_labels
        if labels is None:
            id2label = self.model.config.id2label
            labels = [id2label[i] for i in range(n)]
            if all(str(x).startswith("LABEL_") for x in labels):
                raise ValueError(f"{path}: config.id2label has generic names ({labels[0]}, ...); pass "
                                 f"labels=RATE_NER_LABELS if this is the published RaTE-NER order")
        labels = list(labels)
        if len(labels) != n:
            raise ValueError(f"{path}: {len(labels)} labels given for a classifier with {n} outputs")
        for label in labels:
            parse_tag(label)  # refuses a tag outside the RaTE-NER scheme, naming it
        self.labels = labels
        limits = [512]
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if isinstance(positions, int) and positions > 0:
            limits.append(positions)
        tok_limit = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tok_limit, int) and 0 < tok_limit < 1_000_000:
            limits.append(tok_limit)
        self.max_length = min(limits)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[RateEntity, ...]] = OrderedDict()
        self._cache_size = cache_size

    def _tag_sentences(self, sentences: Sequence[str]) -> list[list[tuple[int, int, str]]]:
        """Per sentence, its entities as character spans ``(start, end, type)`` within the sentence."""
        import torch

        out: list[list[tuple[int, int, str]]] = [[] for _ in sentences]
        order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
        for begin in range(0, len(order), self.batch_size):
            rows = order[begin:begin + self.batch_size]
            enc = self.tokenizer([sentences[i] for i in rows], padding=True, truncation=True,
                                 max_length=self.max_length, return_offsets_mapping=True, return_tensors="pt")
            offsets = enc.pop("offset_mapping").tolist()
            inputs = {k: v.to(self.device) for k, v in enc.items()}
            with torch.inference_mode():
                predicted = self.model(**inputs).logits.argmax(dim=-1).cpu().tolist()
            for j, row in enumerate(rows):
                sentence = sentences[row]
                words: dict[int, list[int]] = {}  # word id -> [tag id of its first piece, start, end]
                for pos, word in enumerate(enc.word_ids(j)):
                    if word is None:
                        continue
                    a, b = offsets[j][pos]
                    if word not in words:
                        words[word] = [predicted[j][pos], a, b]
                    else:
                        words[word][1] = min(words[word][1], a)
                        words[word][2] = max(words[word][2], b)
                ordered = [words[w] for w in sorted(words)]
                tags = [self.labels[w[0]] for w in ordered]
                for first, stop, kind in decode_bio(tags):
                    a, b = ordered[first][1], ordered[stop - 1][2]
                    while a < b and sentence[a].isspace():  # some tokenizers count the leading space
                        a += 1
                    if a < b:
                        out[row].append((a, b, kind))
        return out

    def _extract(self, texts: Sequence[str]) -> list[tuple[RateEntity, ...]]:
        pieces: list[tuple[int, int, int]] = []  # (text index, sentence index, sentence start)
        sentences: list[str] = []
        for t, text in enumerate(texts):
            for s, (a, b) in enumerate(sentence_spans(text)):
                pieces.append((t, s, a))
                sentences.append(text[a:b])
        found: list[list[RateEntity]] = [[] for _ in texts]
        for (t, s, offset), spans, sentence in zip(pieces, self._tag_sentences(sentences), sentences):
            for a, b, kind in spans:
                text = _normalise(sentence[a:b])
                found[t].append(RateEntity(text, text, kind, s, offset + a, offset + b))
        return [tuple(x) for x in found]

    def extract(self, texts: Sequence[str]) -> list[tuple[RateEntity, ...]]:
        """The entities of each text, in reading order (see the module doc)."""
        if isinstance(texts, str):
            raise TypeError("pass a list of report texts, not a single string")
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"report {i} must be a string, got {type(text).__name__}")
        with self._lock:
            todo = [t for t in dict.fromkeys(texts) if t not in self._cache]
            if todo:
                for text, entities in zip(todo, self._extract(todo)):
                    self._cache[text] = entities
            out = []
            for text in texts:
                self._cache.move_to_end(text)
                out.append(self._cache[text])
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return out


def load_rate_ner(model_path: str | Path, device: str = "cpu", *, labels: Sequence[str] | None = None,
                  **kwargs: Any) -> RateNER:
    """A :class:`RateNER`, loaded once per process per (path, device, labels)."""
    key = (str(Path(model_path).expanduser().resolve()), device, tuple(labels) if labels is not None else None)
    with _LOCK:
        ner = _NER.get(key)
        if ner is None:
            ner = _NER[key] = RateNER(model_path, device, labels=labels, **kwargs)
    return ner


# ----------------------------------------------------------------------------- scoring
Similarity = Callable[[str, str], float]


def _side(entities: Sequence[RateEntity], others: Sequence[RateEntity], similarity: Similarity) -> float:
    total = weight_sum = 0.0
    for e in entities:
        best = 0.0
        for o in others:
            weight = affinity(e.type, o.type)
            if weight > best:  # else it cannot win (and affinity 0 pairs are skipped)
                best = max(best, weight * similarity(e.text, o.text))
        w = TYPE_WEIGHTS[e.type]
        total += w * best
        weight_sum += w
    return total / weight_sum


def entity_fscore(hyp_entities: Sequence[RateEntity], ref_entities: Sequence[RateEntity],
                  similarity: Similarity = text_similarity) -> float:
    """ratescore.py's F-score on two entity lists: the weighted means of each side's best
    ``similarity x affinity`` in the other are precision and recall; both empty 1.0, one empty 0.0."""
    if not hyp_entities and not ref_entities:
        return 1.0
    if not hyp_entities or not ref_entities:
        return 0.0
    p, r = _side(hyp_entities, ref_entities, similarity), _side(ref_entities, hyp_entities, similarity)
    return 2 * p * r / (p + r) if p + r else 0.0


def rate_backend(ner_path: str | Path, encoder_path: str | Path | None = None) -> str:
    similarity = f"encoder:{encoder_path}" if encoder_path is not None else NGRAM_SIMILARITY
    return f"ratescore=rate-ner:{ner_path} (similarity={similarity})"


class RateScoreModel:
    """A RaTEScore-style score with RaTE-NER entities (see the module doc)."""

    def __init__(self, ner_path: str | Path, encoder_path: str | Path | None = None, *, device: str = "cpu",
                 labels: Sequence[str] | None = None, batch_size: int = 32, cache_size: int = 65536):
        self.ner = load_rate_ner(ner_path, device, labels=labels, batch_size=batch_size)
        self.encoder = None
        if encoder_path is not None:
            from grouprl.domains.radiology.rewards.bertscore import load_encoder

            self.encoder = load_encoder(encoder_path, device=device)
        self.batch_size = batch_size
        self.backend = rate_backend(ner_path, encoder_path)
        self._vectors: OrderedDict[str, Any] = OrderedDict()  # entity text -> unit sentence embedding
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def entities(self, texts: Sequence[str]) -> list[tuple[RateEntity, ...]]:
        return self.ner.extract(texts)

    def _similarity_for(self, entity_lists: Sequence[Sequence[RateEntity]]) -> Similarity:
        if self.encoder is None:
            return text_similarity
        with self._lock:
            needed = {e.text for entities in entity_lists for e in entities}
            todo = [t for t in needed if t not in self._vectors]
            if todo:
                for text, encoded in zip(todo, self.encoder.encode(todo, batch_size=self.batch_size)):
                    self._vectors[text] = encoded.sentence
            vectors = {t: self._vectors[t] for t in needed}
            for text in needed:
                self._vectors.move_to_end(text)
            while len(self._vectors) > self._cache_size:
                self._vectors.popitem(last=False)

        def cosine(a: str, b: str) -> float:
            if a == b:
                return 1.0
            return min(1.0, max(0.0, float(vectors[a] @ vectors[b])))

        return cosine

    def score(self, hyps: Sequence[str], refs: Sequence[str]) -> list[float]:
        """The score of each (generated, reference) pair, in [0, 1]."""
        hyps, refs = list(hyps), list(refs)
        if len(hyps) != len(refs):
            raise ValueError(f"got {len(hyps)} hypotheses for {len(refs)} references")
        found = self.entities([*hyps, *refs])
        h, r = found[: len(hyps)], found[len(hyps):]
        similarity = self._similarity_for(found)
        return [entity_fscore(a, b, similarity) for a, b in zip(h, r)]


_SCORERS: dict[tuple[str, str | None, str], RateScoreModel] = {}


def register_rate_components(ner_path: str | Path, encoder_path: str | Path | None = None, *, device: str = "cpu",
                             labels: Sequence[str] | None = None, replace: bool = False) -> Component:
    """Register ``ratescore_model`` (backend ``ratescore=rate-ner:<path> (similarity=...)``); the
    models load on first use, once per process."""
    key = (str(ner_path), None if encoder_path is None else str(encoder_path), device)

    def ratescore_model(hyps: list[str], refs: list[str]) -> list[float]:
        with _LOCK:
            scorer = _SCORERS.get(key)
        if scorer is None:
            scorer = RateScoreModel(ner_path, encoder_path, device=device, labels=labels)
            with _LOCK:
                scorer = _SCORERS.setdefault(key, scorer)
        return scorer.score(hyps, refs)

    description = "RaTEScore-style entity-aware F-score with RaTE-NER entities"
    return register_backend_component("ratescore_model", rate_backend(ner_path, encoder_path), ratescore_model,
                                      description, replace=replace)
