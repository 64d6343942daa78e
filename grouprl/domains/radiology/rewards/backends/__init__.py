"""Model backends of the clinical metrics: the published models, from local files only.

The default clinical scores are rule-based and offline (``labeler=rules``,
``radgraph=rules``, ``ratescore=rules-ngram``). These backends run the models the
papers use, when a user has their weights on disk; nothing here downloads. Each
registers its own report score components (names distinct from the rule-based
ones), whose backend string names the model file, so a score always says where it
came from. Importing this package imports neither torch nor any backend: each
module loads its libraries when it is used.

- :mod:`.chexbert` -- CheXbert (BERT-base + 14 linear heads) from ``chexbert.pth``
  (read with ``torch.load(weights_only=True)``) or a ``.safetensors`` copy, plus a
  local bert-base-uncased tokenizer directory. ``CheXbertLabeler`` (labels and
  [CLS] embeddings), ``register_chexbert_components`` -> ``chexbert14micro``,
  ``chexbert5micro``, ``chexbert_bal_acc`` (backend ``labeler=chexbert:<path>``).
  Needs only grouprl's core dependencies (torch, transformers, safetensors).
- :mod:`.rate_ner` -- RaTE-NER (a token-classification model, e.g. the DeBERTa
  RaTE-NER-Deberta) from a local transformers directory, and a RaTEScore with its
  entities: ``RateNER``, ``RateScoreModel``, ``register_rate_components`` ->
  ``ratescore_model`` (backend ``ratescore=rate-ner:<path> ...``). Entity similarity
  from a local sentence encoder directory (BioLORD in the paper) or the rule-based
  character-trigram similarity. Core dependencies only.
- :mod:`.radgraph_model` -- the RadGraph model through the ``radgraph`` package
  (extra ``grouprl[radgraph]``), from an extracted model directory (config.json,
  vocabulary/, weights.th) and a local copy of its BERT: ``RadGraphModel``,
  ``graph_from_annotation`` (the package's JSON -> ``ReportGraph``),
  ``register_radgraph_components`` -> ``radgraph_model_f1`` and
  ``radgraph_model_f1_package`` (backend ``radgraph=radgraph-package:<model>``).
  radgraph 0.1.18 (the current release) needs transformers < 5.

The BERTScore encoder backend lives with BERTScore
(:func:`grouprl.domains.radiology.rewards.bertscore.register_bertscore_component`).
"""

from __future__ import annotations

import importlib
from typing import Any

from grouprl.domains.radiology.rewards.components import COMPONENTS, Component, ComponentFn, register_component

_EXPORTS = {
    "CheXbertLabeler": "chexbert",
    "load_chexbert": "chexbert",
    "register_chexbert_components": "chexbert",
    "RateNER": "rate_ner",
    "RateScoreModel": "rate_ner",
    "register_rate_components": "rate_ner",
    "RadGraphModel": "radgraph_model",
    "graph_from_annotation": "radgraph_model",
    "register_radgraph_components": "radgraph_model",
}

__all__ = [*_EXPORTS, "register_backend_component"]


def __getattr__(name: str) -> Any:  # PEP 562: a backend module is imported when one of its names is used
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def register_backend_component(name: str, backend: str, fn: ComponentFn, description: str, *,
                               higher_is_better: bool = True, replace: bool = False) -> Component:
    """Register a model-backed component; registering the same backend again is a no-op.

    A different backend under a taken name is refused unless ``replace=True``, so two
    checkpoints never silently share one component name.
    """
    existing = COMPONENTS.get(name, None)
    if existing is not None:
        if existing.backend == backend and not replace:
            return existing
        if not replace:
            raise ValueError(f"report score component {name!r} is already registered with backend "
                             f"{existing.backend!r}; pass replace=True to swap it for {backend!r}")
    register_component(name, backend=backend, description=description, higher_is_better=higher_is_better,
                       overwrite=True)(fn)
    return COMPONENTS[name]
