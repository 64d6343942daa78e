"""CheXbert (Smit et al. 2020): the BERT labeler of the 14 CheXpert observations, from a local checkpoint.

The model is BERT-base (bert-base-uncased architecture) read at its [CLS] token,
a dropout, and 14 linear heads over the [CLS] hidden state, one per condition in
CheXbert's order (``HEAD_ORDER``, No Finding last). Each of the first 13 heads
has 4 classes -- 0 blank (not mentioned), 1 positive, 2 negative, 3 uncertain --
and the No Finding head has 2 -- 0 blank, 1 positive. A head's argmax maps to
grouprl's labels (:data:`CLASS_TO_LABEL`): blank -> None, positive -> 1,
negative -> 0, uncertain -> -1, keyed by the observation names of
:data:`grouprl.domains.radiology.rewards.chexpert.OBSERVATIONS`.

Reading a report follows CheXbert's own preprocessing: surrounding whitespace
stripped, line breaks and runs of whitespace collapsed to one space, WordPiece
tokens wrapped in [CLS] ... [SEP] and cut at 512 (the first 510 word pieces and
[SEP]). One deliberate difference: an empty or blank text is not a report, so all
its labels are None and its embedding is the zero vector, as the rule-based
labeler and the BERTScore encoder treat it (CheXbert would label the bare
[CLS][SEP], and a normal reference would then reward an empty answer).

Weights: the published ``chexbert.pth`` is a ``torch.save`` of
``{"model_state_dict": ..., "optimizer_state_dict": ..., "epoch": ...}`` from a
``DataParallel`` model, so its keys read ``module.bert.embeddings...`` and
``module.linear_heads.{i}.weight``. It is read with ``torch.load(weights_only=True)``
(PyTorch's restricted unpickler: tensors and plain containers only, no code runs);
a ``.safetensors`` file with the same keys (with or without ``module.``) is read
with safetensors. Nothing else is ever unpickled. The BERT shape (layers, hidden
size, vocabulary, positions) is read off the tensors; the number of attention heads,
which no tensor shape shows, comes from ``num_attention_heads=``, else from a
``config.json`` in the tokenizer directory (a local bert-base-uncased directory has
one), else hidden size / 64 as in every BERT. The tokenizer is a local
bert-base-uncased tokenizer directory (``vocab.txt`` or ``tokenizer.json``); nothing
is downloaded.

Scores built on it say ``labeler=chexbert:<checkpoint path>`` (:func:`chexbert_backend`).
:func:`register_chexbert_components` registers ``chexbert14micro``,
``chexbert5micro`` and ``chexbert_bal_acc``, the per-sample scores of
:mod:`grouprl.domains.radiology.rewards.label_metrics` on CheXbert labels.
:meth:`CheXbertLabeler.embed` gives the [CLS] hidden states that RadCliQ's s_emb
compares (:meth:`CheXbertLabeler.similarity`).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from grouprl.domains.radiology.rewards.chexpert import OBSERVATIONS
from grouprl.domains.radiology.rewards.backends import register_backend_component
from grouprl.domains.radiology.rewards.components import Component
from grouprl.domains.radiology.rewards.label_metrics import (
    INDEX_5,
    INDEX_14,
    chexpert_f1,
    label_balanced_accuracy,
    label_f1,
    to_binary,
)

if TYPE_CHECKING:
    import torch

# CheXbert's head order: the CheXpert conditions with No Finding last.
HEAD_ORDER: tuple[str, ...] = (
    "Enlarged Cardiomediastinum",
    "Cardiomegaly",
    "Lung Opacity",
    "Lung Lesion",
    "Edema",
    "Consolidation",
    "Pneumonia",
    "Atelectasis",
    "Pneumothorax",
    "Pleural Effusion",
    "Pleural Other",
    "Fracture",
    "Support Devices",
    "No Finding",
)
assert sorted(HEAD_ORDER) == sorted(OBSERVATIONS)
HEAD_CLASSES: tuple[int, ...] = (4,) * 13 + (2,)
# Class index of a head -> grouprl label (1 positive, 0 negative, -1 uncertain, None blank).
CLASS_TO_LABEL: dict[int, int | None] = {0: None, 1: 1, 2: 0, 3: -1}
MAX_LENGTH = 512  # BERT's position limit; CheXbert cuts reports there

_PREFIX = "module."
_WRAPPERS = ("model_state_dict", "state_dict")
_IGNORED_EXTRA = re.compile(r"^bert\.embeddings\.position_ids$")  # a buffer older transformers saved
_WHITESPACE = re.compile(r"\s+")

_LOCK = threading.Lock()
_LABELERS: dict[tuple[str, str, str], "CheXbertLabeler"] = {}


def chexbert_backend(checkpoint_path: str | Path) -> str:
    return f"labeler=chexbert:{checkpoint_path}"


def preprocess(text: str) -> str:
    """CheXbert's report cleaning: strip, collapse line breaks and whitespace runs to one space."""
    return _WHITESPACE.sub(" ", text.replace("\n", " ")).strip()


# ----------------------------------------------------------------------------- loading
def read_state_dict(path: str | Path) -> dict[str, "torch.Tensor"]:
    """The tensors of a CheXbert checkpoint, keys without the ``module.`` prefix.

    ``.safetensors`` through safetensors; anything else (``.pth``, ``.pt``, ``.bin``)
    through ``torch.load(weights_only=True)``, which refuses any object other than
    tensors and plain containers. A ``model_state_dict`` (or ``state_dict``) wrapper
    is unwrapped; the optimizer state next to it is ignored.
    """
    import torch

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"CheXbert checkpoint {path} not found (a local .pth or .safetensors file)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        raw: Any = load_file(str(path), device="cpu")
    else:
        try:
            raw = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:  # UnpicklingError and friends: never retry without weights_only
            raise ValueError(
                f"could not read {path} with torch.load(weights_only=True) ({type(exc).__name__}: {exc}); "
                f"grouprl never unpickles arbitrary objects -- convert the checkpoint to .safetensors"
            ) from exc
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path} holds a {type(raw).__name__}, not a state dict")
    for key in _WRAPPERS:
        if isinstance(raw.get(key), Mapping):
            raw = raw[key]
            break
    state: dict[str, torch.Tensor] = {}
    for key, value in raw.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor")
        state[key[len(_PREFIX):] if key.startswith(_PREFIX) else key] = value
    return state


def _bert_config(state: Mapping[str, "torch.Tensor"], tokenizer_path: Path, num_attention_heads: int | None,
                 source: Path):
    """A BertConfig whose shapes are read off the checkpoint's tensors."""
    from transformers import BertConfig

    needed = ("bert.embeddings.word_embeddings.weight", "bert.embeddings.position_embeddings.weight",
              "bert.embeddings.token_type_embeddings.weight", "bert.encoder.layer.0.intermediate.dense.weight")
    missing = [k for k in needed if k not in state]
    if missing:
        raise ValueError(f"{source} is not a CheXbert checkpoint: missing keys {', '.join(missing)}")
    vocab_size, hidden = state[needed[0]].shape
    layers = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"bert\.encoder\.layer\.(\d+)\.", k)))
    config_file = tokenizer_path / "config.json"
    config = BertConfig.from_json_file(str(config_file)) if config_file.is_file() else BertConfig()
    if num_attention_heads is None:
        if config_file.is_file():
            num_attention_heads = config.num_attention_heads
        elif hidden % 64 == 0:
            num_attention_heads = hidden // 64
        else:
            raise ValueError(f"cannot tell the number of attention heads of {source} (hidden size {hidden}); "
                             f"pass num_attention_heads=")
    if hidden % num_attention_heads:
        raise ValueError(f"hidden size {hidden} of {source} is not divisible by {num_attention_heads} heads")
    config.vocab_size = vocab_size
    config.hidden_size = hidden
    config.num_hidden_layers = layers
    config.num_attention_heads = num_attention_heads
    config.intermediate_size = state[needed[3]].shape[0]
    config.max_position_embeddings = state[needed[1]].shape[0]
    config.type_vocab_size = state[needed[2]].shape[0]
    return config


def build_chexbert_module(config, *, dropout: float = 0.1):
    """An untrained CheXbert: ``bert`` (BertModel), ``dropout`` and 14 ``linear_heads``.

    Its state-dict keys are those of the published checkpoint without ``module.``.
    """
    import torch
    from transformers import BertModel

    module = torch.nn.Module()
    module.bert = BertModel(config)
    module.dropout = torch.nn.Dropout(dropout)
    module.linear_heads = torch.nn.ModuleList(torch.nn.Linear(config.hidden_size, n) for n in HEAD_CLASSES)
    return module


def _check_keys(module, state: Mapping[str, "torch.Tensor"], source: Path) -> None:
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected and not _IGNORED_EXTRA.match(k)]
    problems = []
    if missing:
        heads = [k for k in missing if k.startswith("linear_heads.")]
        rest = [k for k in missing if not k.startswith("linear_heads.")]
        shown = heads + rest[: max(0, 20 - len(heads))]
        more = len(missing) - len(shown)
        problems.append(f"missing {len(missing)} keys: {', '.join(shown)}" + (f" (and {more} more)" if more else ""))
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(unexpected[:20])}" +
                        (f" (and {len(unexpected) - 20} more)" if len(unexpected) > 20 else ""))
    for key, tensor in expected.items():
        if key in state and tuple(state[key].shape) != tuple(tensor.shape):
            problems.append(f"{key} has shape {tuple(state[key].shape)}, expected {tuple(tensor.shape)}")
    if problems:
        raise ValueError(
            f"{source} does not match the CheXbert architecture (BERT + 13 four-class heads + a two-class "
            f"No Finding head): " + "; ".join(problems)
        )


def _load_tokenizer(path: Path):
    from transformers import BertTokenizerFast

    if not path.is_dir():
        raise FileNotFoundError(
            f"CheXbert tokenizer directory {path} not found (a local bert-base-uncased tokenizer: vocab.txt or "
            f"tokenizer.json); nothing is downloaded"
        )
    return BertTokenizerFast.from_pretrained(str(path), local_files_only=True)


# ----------------------------------------------------------------------------- labeler
class CheXbertLabeler:
    """CheXbert from a local checkpoint and tokenizer directory (see the module doc).

    ``label_reports(texts)`` gives one ``{observation: 1 | 0 | -1 | None}`` dict per
    text, keyed like :func:`grouprl.domains.radiology.rewards.label_report`; ``embed(texts)``
    the [CLS] hidden states, shape ``(len(texts), hidden)``. Labels of the last
    ``cache_size`` distinct texts are kept, since references repeat every epoch.
    """

    def __init__(
        self,
        checkpoint_path: str | Path,
        *,
        tokenizer_path: str | Path,
        device: str = "cpu",
        batch_size: int = 32,
        num_attention_heads: int | None = None,
        cache_size: int = 8192,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.checkpoint_path = Path(checkpoint_path).expanduser()
        self.tokenizer_path = Path(tokenizer_path).expanduser()
        self.device = device
        self.batch_size = batch_size
        self.backend = chexbert_backend(checkpoint_path)
        self.tokenizer = _load_tokenizer(self.tokenizer_path)
        state = read_state_dict(self.checkpoint_path)
        config = _bert_config(state, self.tokenizer_path, num_attention_heads, self.checkpoint_path)
        module = build_chexbert_module(config)
        _check_keys(module, state, self.checkpoint_path)
        module.load_state_dict({k: v for k, v in state.items() if not _IGNORED_EXTRA.match(k)}, strict=True)
        self.model = module.to(device).eval()
        self.hidden_size = config.hidden_size
        self.max_length = min(MAX_LENGTH, config.max_position_embeddings)
        if len(self.tokenizer) > config.vocab_size:
            raise ValueError(f"tokenizer {self.tokenizer_path} has {len(self.tokenizer)} tokens but the checkpoint's "
                             f"vocabulary has {config.vocab_size}; use the tokenizer the model was trained with")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, dict[str, int | None]] = OrderedDict()
        self._cache_size = cache_size

    # ------------------------------------------------------------------ model calls
    def _forward(self, texts: Sequence[str]) -> tuple[list[dict[str, int | None]], "torch.Tensor"]:
        """Labels and [CLS] states of non-blank texts, in length-sorted batches."""
        import torch

        cleaned = [preprocess(t) for t in texts]
        order = sorted(range(len(cleaned)), key=lambda i: len(cleaned[i]))
        labels: list[dict[str, int | None]] = [{}] * len(cleaned)
        states = torch.zeros(len(cleaned), self.hidden_size)
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            enc = self.tokenizer([cleaned[i] for i in rows], padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt", return_token_type_ids=False)
            enc = {k: v.to(self.device) for k, v in enc.items()}
            with torch.inference_mode():
                hidden = self.model.bert(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])[0]
                cls = hidden[:, 0, :]
                dropped = self.model.dropout(cls)
                choices = [head(dropped).argmax(dim=-1).cpu().tolist() for head in self.model.linear_heads]
            states[rows] = cls.float().cpu()
            for j, row in enumerate(rows):
                by_head = {name: CLASS_TO_LABEL[choices[h][j]] for h, name in enumerate(HEAD_ORDER)}
                labels[row] = {name: by_head[name] for name in OBSERVATIONS}
        return labels, states

    def _check(self, texts: Sequence[str]) -> list[str]:
        if isinstance(texts, str):
            raise TypeError("pass a list of report texts, not a single string")
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"report {i} must be a string, got {type(text).__name__}")
        return texts

    def label_reports(self, texts: Sequence[str]) -> list[dict[str, int | None]]:
        """One label dict per text (1 positive, 0 negative, -1 uncertain, None not mentioned)."""
        texts = self._check(texts)
        blank = dict.fromkeys(OBSERVATIONS)
        with self._lock:
            todo = [t for t in dict.fromkeys(texts) if t.strip() and t not in self._cache]
            if todo:
                labels, _ = self._forward(todo)
                for text, found in zip(todo, labels):
                    self._cache[text] = found
            out = []
            for text in texts:
                if not text.strip():
                    out.append(dict(blank))
                    continue
                self._cache.move_to_end(text)
                out.append(dict(self._cache[text]))
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return out

    def label_report(self, text: str) -> dict[str, int | None]:
        return self.label_reports([text])[0]

    def embed(self, texts: Sequence[str]) -> "torch.Tensor":
        """[CLS] hidden states of the last layer, ``(len(texts), hidden)``; zeros for a blank text."""
        import torch

        texts = self._check(texts)
        unique = [t for t in dict.fromkeys(texts) if t.strip()]
        out = torch.zeros(len(texts), self.hidden_size)
        if unique:
            with self._lock:
                _, states = self._forward(unique)
            where = {t: i for i, t in enumerate(unique)}
            for row, text in enumerate(texts):
                if text in where:
                    out[row] = states[where[text]]
        return out

    def similarity(self, hyps: Sequence[str], refs: Sequence[str]) -> list[float]:
        """Cosine similarity of the CheXbert embeddings of each pair (RadCliQ's s_emb); 0 when a side is blank."""
        import torch

        hyps, refs = self._check(hyps), self._check(refs)
        if len(hyps) != len(refs):
            raise ValueError(f"got {len(hyps)} hypotheses for {len(refs)} references")
        states = self.embed([*hyps, *refs])
        h, r = states[: len(hyps)], states[len(hyps):]
        cos = torch.nn.functional.cosine_similarity(h, r, dim=-1, eps=1e-12)
        return [0.0 if not a.strip() or not b.strip() else float(c) for a, b, c in zip(hyps, refs, cos)]

    # ------------------------------------------------------------------ scores
    def _binary_pairs(self, hyps: Sequence[str], refs: Sequence[str], uncertain_as_positive: bool):
        hyps, refs = self._check(hyps), self._check(refs)
        if len(hyps) != len(refs):
            raise ValueError(f"got {len(hyps)} hypotheses for {len(refs)} references")
        labels = self.label_reports([*hyps, *refs])
        binary = [to_binary(x, uncertain_as_positive=uncertain_as_positive) for x in labels]
        return binary[: len(hyps)], binary[len(hyps):]

    def per_sample(self, score: str, hyps: Sequence[str], refs: Sequence[str], *,
                   uncertain_as_positive: bool = True) -> list[float]:
        """``"f1_14"``, ``"f1_5"`` or ``"bal_acc"`` of each pair, as label_metrics defines them."""
        fn, classes = {"f1_14": (label_f1, INDEX_14), "f1_5": (label_f1, INDEX_5),
                       "bal_acc": (label_balanced_accuracy, INDEX_14)}[score]
        h, r = self._binary_pairs(hyps, refs, uncertain_as_positive)
        return [fn(a, b, classes) for a, b in zip(h, r)]

    def corpus_f1(self, hyps: Sequence[str], refs: Sequence[str], *, uncertain_as_positive: bool = True,
                  zero_division: float = 0.0) -> dict[str, Any]:
        """:func:`grouprl.domains.radiology.rewards.label_metrics.chexpert_f1` on CheXbert labels (the papers' CheXbert F1)."""
        hyps, refs = self._check(hyps), self._check(refs)
        if len(hyps) != len(refs):
            raise ValueError(f"got {len(hyps)} hypotheses for {len(refs)} references")
        labels = self.label_reports([*hyps, *refs])
        out = chexpert_f1(labels[: len(hyps)], labels[len(hyps):], uncertain_as_positive=uncertain_as_positive,
                          zero_division=zero_division)
        out["backend"] = self.backend
        return out


def load_chexbert(checkpoint_path: str | Path, *, tokenizer_path: str | Path, device: str = "cpu",
                  **kwargs: Any) -> CheXbertLabeler:
    """A :class:`CheXbertLabeler`, loaded once per process per (checkpoint, tokenizer, device)."""
    key = (str(Path(checkpoint_path).expanduser().resolve()), str(Path(tokenizer_path).expanduser().resolve()), device)
    with _LOCK:
        labeler = _LABELERS.get(key)
        if labeler is None:
            labeler = _LABELERS[key] = CheXbertLabeler(checkpoint_path, tokenizer_path=tokenizer_path, device=device,
                                                       **kwargs)
    return labeler


# ----------------------------------------------------------------------------- components
_COMPONENTS = {
    "chexbert14micro": ("f1_14", "Per-sample CheXbert-label micro F1 over the 14 classes"),
    "chexbert5micro": ("f1_5", "Per-sample CheXbert-label micro F1 over the five classes"),
    "chexbert_bal_acc": ("bal_acc", "Per-sample balanced accuracy of the 14 CheXbert labels against the reference's"),
}


def register_chexbert_components(
    checkpoint_path: str | Path,
    tokenizer_path: str | Path,
    *,
    device: str = "cpu",
    batch_size: int = 32,
    uncertain_as_positive: bool = True,
    replace: bool = False,
) -> list[Component]:
    """Register ``chexbert14micro``, ``chexbert5micro`` and ``chexbert_bal_acc`` (backend
    ``labeler=chexbert:<checkpoint>``). The model loads on first use, once per process."""
    backend = chexbert_backend(checkpoint_path)
    out = []
    for name, (score, description) in _COMPONENTS.items():
        def component(hyps: list[str], refs: list[str], _score: str = score) -> list[float]:
            labeler = load_chexbert(checkpoint_path, tokenizer_path=tokenizer_path, device=device,
                                    batch_size=batch_size)
            return labeler.per_sample(_score, hyps, refs, uncertain_as_positive=uncertain_as_positive)

        component.__name__ = name
        component.__doc__ = f"{description} (CheXbert at {checkpoint_path})."
        out.append(register_backend_component(name, backend, component, description, replace=replace))
    return out
