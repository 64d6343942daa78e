"""The RadGraph model (Jain et al. 2021; RadGraph-XL) through the ``radgraph`` package, from local files.

The ``radgraph`` package (extra ``grouprl[radgraph]``) runs the trained DyGIE span
and relation extractor and returns, per report, its own JSON::

    {"text": "small left pleural effusion .",        # the report's tokens, space-joined
     "entities": {"1": {"tokens": "small", "label": "OBS-DP", "start_ix": 0, "end_ix": 0,
                        "relations": [["modify", "4"]]},   # [type, id of the target entity]
                  ...}}

:func:`graph_from_annotation` turns that into grouprl's
:class:`~grouprl.domains.radiology.rewards.entities.ReportGraph`, so every RadGraph-F1 level of
:mod:`grouprl.domains.radiology.rewards.radgraph_f1` and the knowledge-graph reward read
model graphs exactly like rule-based ones:

- entity ids are the positions of the package's ids in numeric order; ``text`` is
  the tokens lower-cased with single spaces (ReportGraph's convention);
- labels are RadGraph's four: RadGraph-XL's long names map to them
  (``Anatomy::definitely present`` -> ``ANAT-DP``; ``Observation::...`` ->
  ``OBS-DP`` / ``OBS-U`` / ``OBS-DA`` by certainty, measurement variants included);
  an unknown label is kept as written;
- ``start``/``end`` are character offsets of the tokens in the annotation's text,
  which is the ReportGraph's text, and ``sentence`` indexes
  :func:`~grouprl.domains.radiology.rewards.entities.sentence_spans` of it;
- relations to an id that is not an entity are dropped (the package does the same).

Loading, local only. ``RadGraphModel(path)`` takes an extracted model directory
(``config.json``, ``vocabulary/``, ``weights.th``: the contents of the package's
``radgraph.tar.gz`` / ``radgraph-xl.tar.gz`` from the hub repository
StanfordAIMI/RRG_scorers); ``RadGraphModel("radgraph-xl")`` takes that model from
the package's own cache directory, where it must already be. The package would
download a missing model and the BERT its config names; grouprl does neither: the
model directory must exist, and the BERT named in ``config.json`` must be a local
directory, already in the Hugging Face cache, or given as ``transformer_path=``.
The package wants ``<cache>/<model type>/`` with that BERT's name inside its config,
so the model is staged in a temporary directory (config rewritten to the local BERT,
vocabulary copied, weights linked), loaded, and the directory removed; the user's
files are never written. The package reads ``weights.th`` with
``torch.load(weights_only=True)`` on its CPU path, which is the one used (the model
is moved to ``device`` after loading); its GPU path would call ``torch.load``
without it.

Two F1s: :meth:`RadGraphModel.f1` scores the model graphs with grouprl's RadGraph-F1
levels (``partial`` = entity text + label, component ``radgraph_model_f1``);
:meth:`RadGraphModel.package_f1` with the package's own ``compute_reward`` (its
``partial`` also requires whether an entity has a relation; component
``radgraph_model_f1_package``), which is what published RadGraph numbers and
EditGRPO's reward use. A blank report has an empty graph: grouprl's levels score two
blank reports 1.0, the package scores any pair with a blank side 0.0.

Compatibility: radgraph 0.1.18 (the current release) calls the tokenizer method
``encode_plus``, which transformers 5 removed, so it loads only with transformers < 5;
the error says so.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import tempfile
import threading
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grouprl.domains.radiology.rewards.backends import register_backend_component
from grouprl.domains.radiology.rewards.components import Component
from grouprl.domains.radiology.rewards.entities import (
    ANAT_DP,
    OBS_DA,
    OBS_DP,
    OBS_U,
    Entity,
    Relation,
    ReportGraph,
    sentence_spans,
)
from grouprl.domains.radiology.rewards.radgraph_f1 import LEVELS, radgraph_scores

EXTRA_HINT = "pip install 'grouprl[radgraph]'"
MODEL_TYPES = ("radgraph", "radgraph-xl", "modern-radgraph-xl", "echograph")
MODEL_FILES = ("config.json", "vocabulary", "weights.th")

_LOCK = threading.Lock()
_MODELS: dict[tuple, "RadGraphModel"] = {}
_TOKEN = re.compile(r"\S+")


def import_radgraph():
    """The ``radgraph`` package, or an ImportError that names the extra to install."""
    try:
        import radgraph
        from radgraph import RadGraph  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"the RadGraph model backend needs the radgraph package ({exc}); {EXTRA_HINT}") from exc
    return radgraph


def radgraph_backend(model: str | Path) -> str:
    return f"radgraph=radgraph-package:{model}"


# ----------------------------------------------------------------------------- conversion
def normalise_label(label: str) -> str:
    """RadGraph-XL's ``Kind::[measurement::]certainty`` labels as RadGraph's four; others unchanged."""
    if label in (ANAT_DP, OBS_DP, OBS_U, OBS_DA):
        return label
    low = label.lower()
    if low.startswith("anatomy"):
        return ANAT_DP
    if low.startswith("observation"):
        if low.endswith("definitely absent"):
            return OBS_DA
        if low.endswith("uncertain"):
            return OBS_U
        if low.endswith("definitely present"):
            return OBS_DP
    return label


def graph_from_annotation(annotation: Mapping[str, Any]) -> ReportGraph:
    """One report's annotation in the radgraph package's JSON as a ReportGraph (see the module doc)."""
    if not isinstance(annotation, Mapping):
        raise TypeError(f"a RadGraph annotation is a mapping, got {type(annotation).__name__}")
    text = annotation.get("text", "")
    raw = annotation.get("entities", {})
    if not isinstance(text, str) or not isinstance(raw, Mapping):
        raise TypeError("a RadGraph annotation needs 'text' (a string) and 'entities' (a mapping)")
    tokens = [m.span() for m in _TOKEN.finditer(text)]
    spans = tuple(sentence_spans(text))
    try:
        keys = sorted(raw, key=int)
    except ValueError as exc:
        raise ValueError(f"RadGraph entity ids must be integers written as strings, got {sorted(raw)}") from exc
    position = {str(k): i for i, k in enumerate(keys)}

    def sentence_of(char: int) -> int:
        for s, (a, b) in enumerate(spans):
            if char < b:
                return s if char >= a else max(s - 1, 0)
        return max(len(spans) - 1, 0)

    entities = []
    relations: dict[Relation, None] = {}  # insertion-ordered set
    for i, key in enumerate(keys):
        e = raw[key]
        first, last = int(e["start_ix"]), int(e["end_ix"])
        if not 0 <= first <= last < len(tokens):
            raise ValueError(f"RadGraph entity {key} spans tokens {first}..{last}, but the annotation's text has "
                             f"{len(tokens)} tokens")
        start, end = tokens[first][0], tokens[last][1]
        label = normalise_label(str(e["label"]))
        category = "anatomy" if label == ANAT_DP else "finding"
        entities.append(Entity(i, " ".join(str(e["tokens"]).lower().split()), label, sentence_of(start), start, end,
                               category))
        for relation in e.get("relations", ()):
            kind, target = relation[0], str(relation[1])
            if target in position:
                relations[Relation(i, position[target], str(kind))] = None
    return ReportGraph(text, tuple(entities), tuple(relations), spans)


def graphs_from_output(output: Mapping[str, Mapping[str, Any]]) -> list[ReportGraph]:
    """The package's whole output (``{"0": annotation, "1": ...}``) as graphs, in document order."""
    return [graph_from_annotation(output[k]) for k in sorted(output, key=int)]


# ----------------------------------------------------------------------------- loading
def _model_dir(model_path_or_type: str | Path, radgraph) -> Path:
    path = Path(model_path_or_type).expanduser()
    if path.is_dir():
        return path
    name = str(model_path_or_type)
    if name in MODEL_TYPES:
        cache_dir = Path(getattr(radgraph.radgraph, "CACHE_DIR", "")) / name
        if cache_dir.is_dir() and any(cache_dir.iterdir()):
            return cache_dir
        raise FileNotFoundError(
            f"the {name} model is not in the radgraph package's cache ({cache_dir}); the package would download "
            f"{name}.tar.gz from the Hugging Face hub (StanfordAIMI/RRG_scorers), which grouprl never does: fetch "
            f"and extract it where the hub is reachable and pass the directory (config.json, vocabulary/, weights.th)"
        )
    raise FileNotFoundError(f"RadGraph model {name!r} is neither a local directory nor one of {', '.join(MODEL_TYPES)}")


def _model_type(model_dir: Path, given: str | None) -> str:
    if given is not None:
        if given not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {', '.join(MODEL_TYPES)}, got {given!r}")
        return given
    if model_dir.name in MODEL_TYPES:
        return model_dir.name
    # The vocabulary's label namespaces are named after the dataset, which is the model type.
    found = {p.name.split("__", 1)[0] for p in (model_dir / "vocabulary").glob("*__ner_labels.txt")}
    known = sorted(found & set(MODEL_TYPES))
    if len(known) == 1:
        return known[0]
    raise ValueError(f"cannot tell the model type of {model_dir} (its vocabulary names {sorted(found) or 'none'}); "
                     f"pass model_type= (one of {', '.join(MODEL_TYPES)})")


def _local_transformer(name: str, transformer_path: str | Path | None) -> str:
    if transformer_path is not None:
        path = Path(transformer_path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"transformer_path {path} is not a local transformers directory (no config.json)")
        return str(path)
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # an invalid repo id, no hub library: not in the cache either way
        cached = None
    if isinstance(cached, str):
        return os.path.dirname(cached)
    raise FileNotFoundError(f"the RadGraph config names the transformer {name!r}, which is neither a local directory "
                            f"nor in the Hugging Face cache; pass transformer_path=<a local copy of {name}>")


def _staged_config(config: dict, transformer: str) -> dict:
    config = json.loads(json.dumps(config))
    try:
        config["dataset_reader"]["token_indexers"]["bert"]["model_name"] = transformer
        config["model"]["embedder"]["token_embedders"]["bert"]["model_name"] = transformer
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a RadGraph (DyGIE) config: no {exc} in its bert token indexer / embedder") from exc
    return config


class RadGraphModel:
    """The RadGraph model of the radgraph package, loaded from local files (see the module doc)."""

    def __init__(self, model_path_or_type: str | Path, *, transformer_path: str | Path | None = None,
                 model_type: str | None = None, device: str = "cpu", cache_size: int = 8192):
        radgraph = import_radgraph()
        import torch

        model_dir = _model_dir(model_path_or_type, radgraph)
        missing = [f for f in MODEL_FILES if not (model_dir / f).exists()]
        if missing:
            raise FileNotFoundError(f"RadGraph model directory {model_dir} lacks {', '.join(missing)}")
        self.model_dir = model_dir
        self.model_type = _model_type(model_dir, model_type)
        config = json.loads((model_dir / "config.json").read_text())
        try:
            name = config["model"]["embedder"]["token_embedders"]["bert"]["model_name"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{model_dir / 'config.json'} is not a RadGraph (DyGIE) config: no {exc}") from exc
        self.transformer = _local_transformer(name, transformer_path)
        self.backend = radgraph_backend(model_path_or_type)
        self.device = device

        staged = Path(tempfile.mkdtemp(prefix="grouprl-radgraph-"))
        try:
            target = staged / self.model_type
            target.mkdir()
            (target / "config.json").write_text(json.dumps(_staged_config(config, self.transformer)))
            shutil.copytree(model_dir / "vocabulary", target / "vocabulary")  # the package writes a lock file there
            try:
                (target / "weights.th").symlink_to((model_dir / "weights.th").resolve())
            except OSError:
                shutil.copyfile(model_dir / "weights.th", target / "weights.th")
            with contextlib.redirect_stdout(io.StringIO()):  # the package prints its device
                try:
                    # cuda=-1: the package's CPU path, which reads weights.th with weights_only=True
                    self._radgraph = radgraph.RadGraph(model_type=self.model_type, model_cache_dir=str(staged),
                                                       cuda=-1)
                except AttributeError as exc:
                    if "encode_plus" in str(exc):
                        import transformers

                        raise RuntimeError(
                            f"the installed radgraph package calls tokenizer.encode_plus, which transformers "
                            f"{transformers.__version__} no longer has; RadGraph runs with transformers < 5 "
                            f"(a separate environment)"
                        ) from exc
                    raise
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        self._radgraph.model.to(device)
        self._radgraph.device = torch.device(device)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, dict] = OrderedDict()
        self._cache_size = cache_size

    def _run(self, texts: list[str]) -> list[dict]:
        import torch

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single token or no tokens.*")
            with torch.inference_mode():
                output = self._radgraph(texts)
        missing = [str(i) for i in range(len(texts)) if str(i) not in output]
        if missing:
            raise RuntimeError(f"the radgraph package returned no annotation for report(s) {', '.join(missing)}")
        return [output[str(i)] for i in range(len(texts))]

    def annotate(self, texts: Sequence[str]) -> list[dict]:
        """The package's annotation of each text (a blank text: no entities, not run)."""
        if isinstance(texts, str):
            raise TypeError("pass a list of report texts, not a single string")
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"report {i} must be a string, got {type(text).__name__}")
        with self._lock:
            todo = [t for t in dict.fromkeys(texts) if t.strip() and t not in self._cache]
            if todo:
                for text, annotation in zip(todo, self._run(todo)):
                    self._cache[text] = annotation
            out = []
            for text in texts:
                if not text.strip():
                    out.append({"text": "", "entities": {}})
                    continue
                self._cache.move_to_end(text)
                out.append(self._cache[text])
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return out

    def graphs(self, texts: Sequence[str]) -> list[ReportGraph]:
        return [graph_from_annotation(a) for a in self.annotate(texts)]

    def _pairs(self, hyps: Sequence[str], refs: Sequence[str]) -> tuple[list[dict], list[dict]]:
        hyps, refs = list(hyps), list(refs)
        if len(hyps) != len(refs):
            raise ValueError(f"got {len(hyps)} hypotheses for {len(refs)} references")
        annotations = self.annotate([*hyps, *refs])
        return annotations[: len(hyps)], annotations[len(hyps):]

    def scores(self, hyps: Sequence[str], refs: Sequence[str]) -> list[dict[str, tuple[float, float, float]]]:
        """grouprl's (precision, recall, F1) at every level for each pair, on the model's graphs."""
        h, r = self._pairs(hyps, refs)
        return [radgraph_scores(graph_from_annotation(a), graph_from_annotation(b)) for a, b in zip(h, r)]

    def f1(self, hyps: Sequence[str], refs: Sequence[str], level: str = "partial") -> list[float]:
        """grouprl's RadGraph F1 at ``level`` (simple, partial, complete) for each pair."""
        if level not in LEVELS:
            raise ValueError(f"unknown RadGraph F1 level {level!r}; choose one of {', '.join(LEVELS)}")
        return [s[level][2] for s in self.scores(hyps, refs)]

    def package_f1(self, hyps: Sequence[str], refs: Sequence[str], level: str = "partial") -> list[float]:
        """The radgraph package's own reward at ``level`` (its definitions; 0.0 when a side has no entity)."""
        from radgraph.rewards import compute_reward

        if level not in LEVELS:
            raise ValueError(f"unknown RadGraph F1 level {level!r}; choose one of {', '.join(LEVELS)}")
        h, r = self._pairs(hyps, refs)
        return [float(compute_reward(a, b, level)) for a, b in zip(h, r)]


def load_radgraph_model(model_path_or_type: str | Path, *, transformer_path: str | Path | None = None,
                        model_type: str | None = None, device: str = "cpu") -> RadGraphModel:
    """A :class:`RadGraphModel`, loaded once per process per (model, transformer, type, device)."""
    key = (str(model_path_or_type), None if transformer_path is None else str(transformer_path), model_type, device)
    with _LOCK:
        model = _MODELS.get(key)
        if model is None:
            model = _MODELS[key] = RadGraphModel(model_path_or_type, transformer_path=transformer_path,
                                                 model_type=model_type, device=device)
    return model


def register_radgraph_components(model_path_or_type: str | Path, *, transformer_path: str | Path | None = None,
                                 model_type: str | None = None, device: str = "cpu",
                                 replace: bool = False) -> list[Component]:
    """Register ``radgraph_model_f1`` (grouprl's partial F1 on the model's graphs, backend
    ``radgraph=radgraph-package:<model>``) and ``radgraph_model_f1_package`` (the package's own
    partial reward). The model loads on first use, once per process; the package is checked now."""
    import_radgraph()
    backend = radgraph_backend(model_path_or_type)

    def model() -> RadGraphModel:
        return load_radgraph_model(model_path_or_type, transformer_path=transformer_path, model_type=model_type,
                                   device=device)

    def radgraph_model_f1(hyps: list[str], refs: list[str]) -> list[float]:
        return model().f1(hyps, refs, "partial")

    def radgraph_model_f1_package(hyps: list[str], refs: list[str]) -> list[float]:
        return model().package_f1(hyps, refs, "partial")

    return [
        register_backend_component("radgraph_model_f1", backend, radgraph_model_f1,
                                   "RadGraph F1, partial level (entity text + label), RadGraph model graphs",
                                   replace=replace),
        register_backend_component("radgraph_model_f1_package", f"{backend} (package reward)",
                                   radgraph_model_f1_package,
                                   "RadGraph partial reward as the radgraph package computes it", replace=replace),
    ]
