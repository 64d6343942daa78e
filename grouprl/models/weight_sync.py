"""The trained weights under the names of the model's saved checkpoint, for an engine that loads its own copy.

An inference engine such as vLLM builds its model from the checkpoint on disk and
loads new weights through the same code (``load_weights``), so it expects the
*checkpoint's* parameter names, one whole tensor per name. The training process
holds something else:

- transformers 5 renames some weights on load (Qwen2.5-VL's ``visual.*`` and
  ``model.*`` on disk are ``model.visual.*`` and ``model.language_model.*`` in memory);
- a tied output head (``lm_head.weight`` shared with the input embeddings) is one
  tensor under two names, and the checkpoint holds it once;
- DDP and accelerate wrap the model (``module.``); FSDP2 shards every parameter;
- a peft LoRA policy is ``base_model.model.<name>``, its adapted layers hold
  ``<layer>.base_layer.weight`` plus ``lora_A`` / ``lora_B`` factors.

``checkpoint_names`` maps the first two with transformers' own machinery, the one
``save_pretrained`` uses (``remove_tied_weights_from_state_dict`` then
``revert_weight_conversion``), so a model family's renaming rules are never
copied here. ``named_weights_for_sync`` streams ``(checkpoint name, whole tensor)``
pairs: gathered from FSDP shards one at a time, LoRA adapters folded into their
base weights.

LoRA is merged *out of place*: a layer's merged weight is computed from its base
weight and factors as they arrive (``W + (B @ A) * scaling``, what peft's
``merge_and_unload`` adds) and yielded as a new tensor; the policy itself is never
merged, so there is nothing to unmerge and training continues bit for bit where it
was, whether or not the consumer reads the stream to the end. Because the merge
works on the streamed tensors, it needs no access to the layer's own (possibly
sharded) parameters: the same code serves a plain, a DDP and an FSDP2 policy.

No vLLM import here: the names and tensors are plain transformers / torch objects.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from grouprl.models.inputs import unwrap_model

_PEFT_PREFIX = "base_model.model."
# Wrappers some tools put around modules; they are not part of the checkpoint names.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")
# The LoRA factors of an adapted layer (relative to the layer), with the adapter name captured.
_LORA_FACTOR = re.compile(r"^(lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.([^.]+)(?:\.(weight|bias))?$")


def transformers_model(model):
    """The transformers model inside DDP / accelerate wrappers and a peft wrapper."""
    base = unwrap_model(model)
    return base.get_base_model() if hasattr(base, "get_base_model") else base


def _peft_prefix(model) -> str:
    """``base_model.model.`` for a PeftModel (its parameter names carry it), else ''."""
    root = unwrap_model(model)
    return _PEFT_PREFIX if root is not transformers_model(model) else ""


# ---------------------------------------------------------------------------- names


def checkpoint_names(model) -> dict[str, str]:
    """Each parameter name of ``model`` -> the name its tensor has in the model's saved checkpoint.

    Keys are the names of ``unwrap_model(model).named_parameters(remove_duplicate=False)``:
    DDP / accelerate wrappers removed, a PeftModel kept (``base_model.model.`` and
    ``.base_layer`` in its names). Values are what ``save_pretrained`` writes (and
    what vLLM's ``load_weights`` expects): transformers' load-time renames
    reverted with its own ``revert_weight_conversion``.

    Tied weights: the names that share one parameter (``lm_head.weight`` and the
    input embeddings under ``tie_word_embeddings``) all map to the one name the
    checkpoint keeps, chosen by transformers' ``remove_tied_weights_from_state_dict``
    (the embeddings). A head that was untied at run time (a separate tensor) keeps
    its own name. The sync streams each tensor once, under that name; vLLM ties the
    head to the embeddings itself when the config says so.

    Left out: LoRA factors (``lora_A`` / ``lora_B``: ``named_weights_for_sync`` folds
    them into their base weight) and the frozen originals of peft's
    ``modules_to_save`` (the trained copy maps to the base name instead).

    Raises NotImplementedError for a model whose checkpoint differs from memory by
    more than names (transformers converters that fuse or split tensors, e.g. MoE
    experts): one name per tensor cannot describe it.
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError as err:  # transformers 4 renamed through _checkpoint_conversion_mapping instead
        raise ImportError("weight sync by checkpoint name needs transformers >= 5 (its save_pretrained conversion "
                          "machinery)") from err

    root = unwrap_model(model)
    base = transformers_model(model)
    prefix = _peft_prefix(model)
    wrappers = _modules_to_save_wrappers(root)
    lora = _has_lora_layers(root)

    # names relative to the transformers model, as its state_dict has them
    relative: dict[str, str] = {}  # full name -> name inside `base`
    params: dict[str, torch.Tensor] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        inner = name[len(prefix):] if prefix and name.startswith(prefix) else name
        if (lora and _lora_tensor(inner)) or not _is_synced_copy(inner, wrappers):
            continue
        relative[name] = inner
        params[inner] = param
    if not params:
        return {}

    # Tied weights: the state dict save_pretrained would write keeps one name per tensor.
    detached = {inner: p.detach() for inner, p in params.items()}
    kept = set(remove_tied_weights_from_state_dict(dict(detached), base))
    owner_of: dict[int, str] = {}
    for inner in sorted(kept):
        owner_of.setdefault(id(params[inner]), inner)
    alias = {}
    for inner, p in params.items():
        if inner in kept:
            alias[inner] = inner
        elif id(p) in owner_of:
            alias[inner] = owner_of[id(p)]
        else:  # pragma: no cover - transformers dropped a name whose tensor no kept name holds
            raise RuntimeError(f"{inner!r} is left out of the checkpoint but shares its tensor with no kept name")

    # Renames: revert_weight_conversion on shape-only (meta) tensors, matched back by identity.
    clean = {inner: _clean_name(inner) for inner in kept}
    meta = {clean[inner]: torch.empty(tuple(params[inner].shape), dtype=params[inner].dtype, device="meta")
            for inner in sorted(kept)}
    source_of = {id(t): name for name, t in meta.items()}
    reverted = revert_weight_conversion(base, dict(meta))
    on_disk: dict[str, str] = {}
    for target, tensor in reverted.items():
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        source = source_of.get(id(tensor))
        if source is None:
            raise NotImplementedError(
                f"{type(base).__name__}: its checkpoint stores {target!r} as a converted tensor (fused, split or "
                "permuted by a transformers WeightConverter), not a renamed parameter; weight sync by name "
                "does not support it")
        on_disk[source] = target
    missing = sorted(set(meta) - set(on_disk))
    if missing:
        raise NotImplementedError(f"{type(base).__name__}: transformers' conversion consumed {missing[:3]} "
                                  "without a one-to-one checkpoint name")
    return {name: on_disk[clean[alias[inner]]] for name, inner in relative.items()}


def _clean_name(inner: str) -> str:
    """A peft / wrapper-free parameter name: ``.base_layer`` and ``.modules_to_save.<adapter>`` removed."""
    for part in _WRAPPER_PARTS:
        inner = inner.replace(part, "")
    inner = inner.replace(".base_layer.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", inner)


def _lora_tensor(inner: str) -> bool:
    """Whether the name is a LoRA factor or another adapter-only tensor (a LoRA variant's: ``lora_magnitude_vector``)."""
    return any(part.startswith("lora_") for part in inner.split("."))


def _has_lora_layers(root) -> bool:
    return any(hasattr(m, "lora_A") and hasattr(m, "base_layer") for m in root.modules())


def _modules_to_save_wrappers(root) -> dict[str, torch.nn.Module]:
    """peft's ModulesToSaveWrapper modules by their name relative to the transformers model."""
    prefix = _PEFT_PREFIX if hasattr(root, "get_base_model") else ""
    found = {}
    for name, module in root.named_modules():
        if hasattr(module, "modules_to_save") and hasattr(module, "original_module"):
            found[name.removeprefix(prefix) if prefix else name] = module
    return found


def _is_synced_copy(inner: str, wrappers: dict[str, torch.nn.Module]) -> bool:
    """False for a modules_to_save wrapper's frozen original and its inactive adapters' copies."""
    for path, wrapper in wrappers.items():
        if not inner.startswith(path + "."):
            continue
        rest = inner[len(path) + 1:]
        if rest.startswith("original_module."):
            return False
        if rest.startswith("modules_to_save."):
            adapter = rest.split(".")[1]
            active = getattr(wrapper, "active_adapters", None) or [getattr(wrapper, "active_adapter", None)]
            return adapter == (active[0] if isinstance(active, (list, tuple)) else active)
    return True


# ---------------------------------------------------------------------------- tensors


@dataclass
class _LoraLayerPlan:
    """What the stream must deliver for one adapted layer before its merged weight can be yielded."""

    path: str  # full name of the layer (as in unwrap_model(model))
    kind: str  # "linear" or "embedding"
    adapters: list[str]  # the adapters whose delta the forward applies (empty: the base weight as is)
    scaling: dict[str, float]
    fan_in_fan_out: bool
    lora_bias: dict[str, bool]
    has_bias: bool
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # base.weight / base.bias -> full parameter name

    def needed(self) -> set[str]:
        need = {"base.weight"} | ({"base.bias"} if self.has_bias else set())
        for a in self.adapters:
            if self.kind == "linear":
                need |= {f"lora_A.{a}.weight", f"lora_B.{a}.weight"}
                if self.lora_bias.get(a):
                    need.add(f"lora_B.{a}.bias")
            else:
                need |= {f"lora_embedding_A.{a}", f"lora_embedding_B.{a}"}
        return need

    def complete(self) -> bool:
        return self.needed() <= set(self.parts)

    def merged(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's effective weight (and bias): base + sum of active adapters' deltas."""
        weight = self.parts["base.weight"]
        bias = self.parts.get("base.bias")
        if not self.adapters:
            return weight, bias
        # in fp32, then back to the base's dtype: what peft's merge computes for bf16 on the CPU
        merged = weight.float()
        merged_bias = bias.float() if bias is not None else None
        for a in self.adapters:
            if self.kind == "linear":
                delta = self.parts[f"lora_B.{a}.weight"].float() @ self.parts[f"lora_A.{a}.weight"].float()
                if self.fan_in_fan_out:
                    delta = delta.T
                if self.lora_bias.get(a):
                    merged_bias = merged_bias + self.parts[f"lora_B.{a}.bias"].float() * self.scaling[a]
            else:
                delta = (self.parts[f"lora_embedding_B.{a}"].float() @ self.parts[f"lora_embedding_A.{a}"].float()).T
            merged = merged + delta.to(merged.device) * self.scaling[a]
        return merged.to(weight.dtype), (merged_bias.to(bias.dtype) if bias is not None else None)


def _lora_plans(model) -> tuple[dict[str, tuple[_LoraLayerPlan, str]], set[str]]:
    """For each parameter of an adapted layer: (its layer's plan, its role); and the names to drop.

    Roles: ``base.weight`` / ``base.bias`` and the factor names relative to the layer
    (``lora_A.default.weight``). Factors of adapters the forward does not use are dropped.
    """
    root = unwrap_model(model)
    by_param: dict[str, tuple[_LoraLayerPlan, str]] = {}
    dropped: set[str] = set()
    for path, layer in root.named_modules():
        if not (hasattr(layer, "base_layer") and hasattr(layer, "lora_A") and hasattr(layer, "scaling")):
            continue
        kind = _lora_kind(layer, path)
        merged_already = bool(getattr(layer, "merged_adapters", None))
        disabled = bool(getattr(layer, "disable_adapters", False))
        active = [] if merged_already or disabled else list(getattr(layer, "active_adapters", []) or [])
        adapters = [a for a in active if a in (layer.lora_A if kind == "linear" else layer.lora_embedding_A)]
        variants = getattr(layer, "lora_variant", {}) or {}
        for a in adapters:
            if a in variants:
                raise NotImplementedError(f"{path}: adapter {a!r} is a LoRA variant ({type(variants[a]).__name__}, "
                                          "e.g. DoRA); only plain LoRA is merged for weight sync")
        base_layer = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer.base_layer
        plan = _LoraLayerPlan(path=path, kind=kind, adapters=adapters, scaling=dict(layer.scaling),
                              fan_in_fan_out=bool(getattr(layer, "fan_in_fan_out", False)),
                              lora_bias=dict(getattr(layer, "lora_bias", {}) or {}),
                              has_bias=getattr(base_layer, "bias", None) is not None)
        for rel, _ in layer.named_parameters(remove_duplicate=False):
            full = f"{path}.{rel}" if path else rel
            if rel.startswith("base_layer."):
                role = "base." + rel.rsplit(".", 1)[-1]  # base.weight / base.bias (through nested base_layers)
                plan.names[role] = full
                by_param[full] = (plan, role)
                continue
            match = _LORA_FACTOR.match(rel)
            if match and match.group(2) in adapters:
                by_param[full] = (plan, rel)
            else:
                dropped.add(full)  # an unused adapter's factors, or a variant's tensors of one
    return by_param, dropped


def _lora_kind(layer, path: str) -> str:
    if len(getattr(layer, "lora_embedding_A", {}) or {}):
        return "embedding"
    base_layer = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer.base_layer
    if isinstance(base_layer, torch.nn.Linear) or type(layer).__name__ == "Linear":
        return "linear"
    raise NotImplementedError(f"{path}: LoRA on {type(base_layer).__name__} layers is not merged for weight sync "
                              "(only Linear and Embedding)")


def gathered_named_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of every parameter of ``unwrap_model(model)``, one at a time.

    A sharded (FSDP2) parameter is gathered from all processes as it is yielded: a
    collective, so every process must consume the whole iterator. The trainer's
    ``full_named_parameters`` does the same; either can feed ``named_weights_for_sync``.
    """
    for name, param in unwrap_model(model).named_parameters():
        full = getattr(param, "full_tensor", None)
        yield name, (full() if full is not None else param).detach()


def named_weights_for_sync(
    model, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, whole tensor)`` of the model's effective weights, each tensor once.

    ``model`` is the policy as trained: plain, DDP-wrapped, FSDP2-sharded or a peft
    LoRA model. ``named_tensors`` are its ``(name, whole tensor)`` pairs, names as in
    ``unwrap_model(model)`` (the trainer's ``full_named_parameters``); by default they
    are gathered here (``gathered_named_parameters``). Every pair is consumed, so a
    gathering collective stays in step across processes.

    Under LoRA each adapted layer's weight is yielded merged (base + the active
    adapters' ``B @ A * scaling``, in fp32, cast back to the base dtype) under the
    base model's checkpoint name; no ``lora_*`` tensor and no ``.base_layer`` /
    ``base_model.model.`` name comes out, and the model is left untouched (the
    merge is out of place). Yielded tensors may be the policy's own (detached)
    parameters: read them, do not modify them.
    """
    names = checkpoint_names(model)
    plans, dropped = _lora_plans(model)
    every = {name for name, _ in unwrap_model(model).named_parameters(remove_duplicate=False)}
    dropped |= every - set(names) - set(plans)
    if named_tensors is None:
        named_tensors = gathered_named_parameters(model)
    sent: set[str] = set()
    pending: dict[int, _LoraLayerPlan] = {}
    for name, tensor in named_tensors:
        if name in plans:
            plan, role = plans[name]
            plan.parts[role] = tensor.detach()
            pending[id(plan)] = plan
            if plan.complete():
                weight, bias = plan.merged()
                plan.parts.clear()
                del pending[id(plan)]
                for suffix, value in (("weight", weight), ("bias", bias)):
                    if value is None:
                        continue
                    target = names[plan.names[f"base.{suffix}"]]
                    if target not in sent:
                        sent.add(target)
                        yield target, value
            continue
        if name in dropped:
            continue  # adapter-only tensors the forward does not use, frozen originals of modules_to_save
        target = names.get(name)
        if target is None:
            raise KeyError(f"named_weights_for_sync: {name!r} is not a parameter of the "
                           f"{type(unwrap_model(model)).__name__} (names as in unwrap_model(model), e.g. "
                           f"{next(iter(names), None)!r})")
        if target in sent:
            continue  # a tied alias of a tensor already sent
        sent.add(target)
        yield target, tensor.detach()
    if pending:
        incomplete = sorted(p.path for p in pending.values())
        raise KeyError(f"named_weights_for_sync: the stream ended before the LoRA layers {incomplete[:3]} got all "
                       f"of their base weight and factors")
