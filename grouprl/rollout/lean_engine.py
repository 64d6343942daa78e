"""``hf_lean``: a plain decoding loop for small models, in place of transformers ``generate``.

For a model of a few hundred thousand to a few million parameters on a CPU, a decode
step's time is almost all Python: ``generate``'s logits processors, stopping criteria
and cache bookkeeping, the modules' ``__call__`` machinery and mask building of the
transformers forward. This engine runs the same decoding with none of that:

- the prompt is prefilled once and each new token decoded against a KV cache;
- for a plain Qwen2 or Llama checkpoint (``fused``: every projection a bare
  ``nn.Linear``, default RoPE, no sliding window) the forward is written out here,
  over the model's own weight tensors and a preallocated cache; any other text model
  runs its own transformers forward with a ``DynamicCache``;
- a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) is prefilled by its own
  forward, with the images and the M-RoPE positions ``generate`` gives it; its decode
  steps, text tokens only, run the written-out decoder over its language model's
  weights from a copy of the prefill's cache when that language model is a plain
  Qwen2-VL / Qwen2.5-VL one, else the model's own forward over that cache;
- sampling is ``generate``'s: the placeholder tokens suppressed, then temperature,
  top-k and top-p exactly as transformers' warpers apply them, greedy as the argmax,
  and the token drawn as ``torch.multinomial`` draws it, from the same random numbers:
  with the same seed and the same logits it samples the responses ``hf`` samples;
- a row stops at its first EOS and is fed pad tokens after it, all rows stop once
  every row has (or at ``max_new_tokens``), as in ``generate``;
- the sampler's log-probs are those of ``hf``: the raw logits at the sampling
  temperature, placeholders suppressed, before top-k / top-p.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, GenerationConfig

from grouprl.models.inputs import collate_model_inputs, forward_kwargs, model_config, model_device, unwrap_model
from grouprl.rollout.hf_engine import HFGenerationEngine

ENGINE_NAME = "hf_lean"
_FUSED_TYPES = ("qwen2", "llama")
_FUSED_VLM_TYPES = ("qwen2_vl", "qwen2_5_vl")
_VLM_TYPES = (*_FUSED_VLM_TYPES, "qwen3_vl")


class LeanGenerationEngine(HFGenerationEngine):
    """``HFGenerationEngine`` with its own decoding loop in place of ``generate``.

    ``fused`` picks the forward of the text decode steps: None (default) the
    written-out decoder when the model's (language) model is a plain Qwen2, Llama,
    Qwen2-VL or Qwen2.5-VL one (``fused_decoder_supported``), else the model's own
    forward; False always the model's own forward; True requires the written-out one.
    A vision-language model's prompt is always prefilled by its own forward.
    """

    def __init__(self, model, processor, *, max_prompt_length: int | None = None,
                 micro_batch_size: int | None = None, truncation: str = "error", holds_weights: bool = False,
                 fused: bool | None = None) -> None:
        super().__init__(model, processor, max_prompt_length=max_prompt_length, micro_batch_size=micro_batch_size,
                         truncation=truncation, holds_weights=holds_weights)
        config = model_config(model)
        self.vision = getattr(config, "vision_config", None) is not None
        if self.vision and _base_model(model).config.model_type not in _VLM_TYPES:
            raise ValueError(f"rollout engine {ENGINE_NAME!r} decodes text LMs and Qwen2-VL, Qwen2.5-VL and "
                             f"Qwen3-VL; {type(unwrap_model(model)).__name__} is another vision-language model: "
                             "set worker.rollout.engine to 'hf' (or 'hf_static') for it")
        supported = fused_decoder_supported(model)
        if fused and not supported:
            raise ValueError(f"rollout engine {ENGINE_NAME!r}: fused=True needs a plain Qwen2, Llama, Qwen2-VL or "
                             f"Qwen2.5-VL model (bare nn.Linear projections, default RoPE, full attention); got "
                             f"{type(unwrap_model(model)).__name__}")
        self.fused = supported if fused is None else bool(fused)

    def _generate_rows(self, model, ids: torch.Tensor, mask: torch.Tensor, inputs: list[dict],
                       config: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = model_device(model)
        ids, mask = ids.to(device), mask.to(device)
        capacity = ids.shape[1] + config.max_new_tokens
        if self.vision:
            kwargs = forward_kwargs(model, ids, mask, collate_model_inputs(inputs), generation=True)
            decoder = _FusedDecoder(model, ids.shape[0], capacity) if self.fused else None
            forward = _VisionPrefill(model, kwargs, decoder)
            return decode(forward, ids, mask, config, suppressed=self.suppressed_token_ids,
                          positions=forward.positions)
        if any(inputs):
            raise ValueError(f"rollout engine {ENGINE_NAME!r}: a text model takes no model inputs, and these "
                             f"prompts carry {sorted(set().union(*inputs))}")
        forward = _FusedDecoder(model, ids.shape[0], capacity) if self.fused else _ModelForward(model)
        return decode(forward, ids, mask, config, suppressed=self.suppressed_token_ids)


# ---------------------------------------------------------------------------- the decoding loop


@torch.no_grad()
def decode(forward, ids: torch.Tensor, mask: torch.Tensor, config: GenerationConfig, *,
           suppressed: list[int] = (), positions: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode up to ``config.max_new_tokens`` tokens after left-padded ``ids``.

    Returns the new tokens [B, T] (on the CPU; pad after a row's EOS) and, when
    ``config.output_logits``, the raw float32 logits of each step [B, T, V], as
    ``generate`` returns them. ``forward(ids, mask, positions)`` gives the next-token
    logits [B, V] of the last column and appends the columns to its cache.

    ``positions`` are the prompt's position ids, [B, L] or (M-RoPE) [k, B, L]; by default
    the real tokens counted from 0. Each new token's are the last column's plus one, as
    ``generate`` extends them.
    """
    rows = ids.shape[0]
    eos = torch.tensor(config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id],
                       device=ids.device)
    pad = int(config.pad_token_id)
    if positions is None:  # as generate makes them: real tokens counted from 0, padding at 1 (never read)
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    next_position = positions[..., -1:] + 1  # left padding: the last column is a real token in every row
    unfinished = torch.ones(rows, dtype=torch.bool, device=ids.device)
    suppressed = list(suppressed)
    tokens, logits_out = [], []
    logits = forward(ids, mask, positions)
    for step in range(config.max_new_tokens):
        logits = logits.float()
        if config.output_logits:
            logits_out.append(logits)
            logits = logits.clone()  # processed in place below
        next_tokens = sample_next(logits, config, suppressed)
        next_tokens = torch.where(unfinished, next_tokens, pad)
        tokens.append(next_tokens)
        unfinished &= ~torch.isin(next_tokens, eos)
        if step + 1 == config.max_new_tokens or not bool(unfinished.any()):
            break
        mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        logits = forward(next_tokens.unsqueeze(1), mask, next_position + step)
    new = torch.stack(tokens, dim=1).cpu()
    return new, (torch.stack(logits_out, dim=1) if config.output_logits else None)


def sample_next(scores: torch.Tensor, config: GenerationConfig, suppressed: list[int]) -> torch.Tensor:
    """One token per row from float32 ``scores`` [B, V] (modified in place), as ``generate`` picks it:
    the argmax of the processed scores when greedy, else a draw from their softmax."""
    scores = process_scores(scores, config, suppressed)
    return sample_categorical(torch.softmax(scores, dim=-1)) if config.do_sample else scores.argmax(dim=-1)


def process_scores(scores: torch.Tensor, config: GenerationConfig, suppressed: list[int]) -> torch.Tensor:
    """The processors ``generate`` builds from grouprl's GenerationConfig, in its order, on ``scores``
    (modified in place): suppress_tokens; then, sampling, temperature (when != 1), top-k (when > 0)
    and top-p (when < 1), each as transformers' warper computes it."""
    if suppressed:
        scores[:, suppressed] = float("-inf")
    if not config.do_sample:
        return scores
    if config.temperature is not None and config.temperature != 1.0:
        scores = scores / config.temperature
    if config.top_k:
        top_k = min(int(config.top_k), scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, top_k)[0][..., -1, None], float("-inf"))
    if config.top_p is not None and config.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - config.top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), float("-inf"))
    return scores


def sample_categorical(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``probs`` [B, V]: ``torch.multinomial(probs, 1)`` itself, which for one
    sample divides by exponential noise and takes the argmax; written out, the same random
    numbers give the same tokens, without multinomial's checks and copies."""
    noise = torch.empty_like(probs).exponential_()
    return probs.div_(noise).argmax(dim=-1)


# ---------------------------------------------------------------------------- forwards


class _ModelForward:
    """The model's own transformers forward over a DynamicCache (any text causal LM)."""

    def __init__(self, model) -> None:
        self.model = model
        self.cache = DynamicCache(config=model_config(model))

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]


class _VisionPrefill:
    """A vision-language model's forward: the prompt, images and all, through the model's own
    forward as ``generate``'s first step calls it; the text tokens after it through ``decoder``
    (a ``_FusedDecoder`` given a copy of that forward's cache) or, without one, through the
    model's own forward over that cache.

    ``positions`` are ``generate``'s for the prompt: [text, t, h, w] rows (M-RoPE, from the
    image grids); computing them sets the model's ``rope_deltas`` as ``generate`` does.
    """

    def __init__(self, model, kwargs: dict, decoder: _FusedDecoder | None) -> None:
        self.model, self.decoder = model, decoder
        base = _base_model(model)
        self.inputs = {k: v for k, v in kwargs.items() if k != "input_ids"}
        self.positions = base._prepare_position_ids_for_generation(kwargs["input_ids"], dict(self.inputs))
        self.cache = DynamicCache(config=base.config.get_text_config(decoder=True))
        self.prefilled = False

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.prefilled:
            self.prefilled = True
            out = self.model(**{**self.inputs, "input_ids": ids, "attention_mask": mask, "position_ids": positions},
                             cache=self.cache, use_cache=True, logits_to_keep=1)
            if self.decoder is not None:
                self.decoder.load_cache(self.cache)
                self.cache = None
            return out.logits[:, -1]
        if self.decoder is not None:
            # a text token's M-RoPE rows; the first (text) row only serves transformers' mask building
            return self.decoder(ids, mask, positions[-3:])
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]


def _base_model(model):
    """The transformers model itself, inside DDP and PEFT wrappers."""
    model = unwrap_model(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _language_model(model):
    """``(inner, text config)`` of a Qwen2 / Llama causal LM (its ``model``) or of a Qwen2-VL /
    Qwen2.5-VL model (its ``model.language_model``); None for any other model."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in _FUSED_TYPES:
        return getattr(model, "model", None), config
    if model_type in _FUSED_VLM_TYPES:
        return getattr(getattr(model, "model", None), "language_model", None), config.get_text_config(decoder=True)
    return None


def fused_decoder_supported(model) -> bool:
    """Whether ``_FusedDecoder`` computes ``model``'s (text) forward: a plain (no adapters, no quantised
    or otherwise wrapped projections) Qwen2 / Llama causal LM, or Qwen2-VL / Qwen2.5-VL language model,
    with default RoPE (M-RoPE's sections for the VLMs) and full attention."""
    model = _base_model(model)  # a PEFT model's adapters sit in the base model's projections
    parts = _language_model(model)
    if parts is None or parts[0] is None:
        return False
    inner, config = parts
    vision = getattr(model.config, "model_type", None) in _FUSED_VLM_TYPES
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or getattr(config, "hidden_act", None) != "silu":
        return False
    if rope.get("mrope_interleaved", False):
        return False
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return False
    if getattr(config, "use_sliding_window", False) or getattr(config, "pretraining_tp", 1) not in (None, 1):
        return False
    if type(getattr(model, "lm_head", None)) is not torch.nn.Linear:
        return False
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "attention_scaling", 1.0) != 1.0:
        return False
    layer_types = _VLM_DECODER_LAYER_TYPES if vision else _DECODER_LAYER_TYPES
    if vision:
        section = list(getattr(rotary, "mrope_section", None) or [])
        head_dim = inner.layers[0].self_attn.head_dim if len(inner.layers) else None
        # the rotary's section recomposition, which _FusedDecoder repeats, is these classes'
        if type(rotary) not in _VLM_ROTARY_TYPES or len(section) != 3 or (head_dim and 2 * sum(section) != head_dim):
            return False
    for layer in getattr(inner, "layers", []):
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(p) is not torch.nn.Linear for p in projections):
            return False
        if type(layer) not in layer_types or getattr(attn, "sliding_window", None):
            return False
    return type(inner.embed_tokens) is torch.nn.Embedding


def _decoder_layer_types() -> tuple[type, ...]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    return Qwen2DecoderLayer, LlamaDecoderLayer


def _vlm_decoder_parts() -> tuple[tuple[type, ...], tuple[type, ...]]:
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl

    return ((qwen2_vl.Qwen2VLDecoderLayer, qwen2_5_vl.Qwen2_5_VLDecoderLayer),
            (qwen2_vl.Qwen2VLRotaryEmbedding, qwen2_5_vl.Qwen2_5_VLRotaryEmbedding))


_DECODER_LAYER_TYPES = _decoder_layer_types()
_VLM_DECODER_LAYER_TYPES, _VLM_ROTARY_TYPES = _vlm_decoder_parts()


def _stack(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights (and biases, zeros where a projection has none) of ``linears`` as one projection."""
    weight = torch.cat([p.weight for p in linears])
    if all(p.bias is None for p in linears):
        return weight, None
    return weight, torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                              for p in linears])


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _FusedDecoder:
    """A Qwen2 / Llama forward written out over the model's weights, with a preallocated KV cache.

    The same operations as the transformers modules (RMSNorm in float32, rotary
    embedding, scaled-dot-product attention with grouped KV heads, SiLU MLP, the LM
    head on the last position only), without their per-module call overhead. For a
    Qwen2-VL / Qwen2.5-VL model it is the language model's forward over token ids: the
    prompt's columns come from the model's own forward (``load_cache``), and positions
    are M-RoPE's [t, h, w] rows.
    """

    def __init__(self, model, rows: int, capacity: int) -> None:
        model = _base_model(model)
        inner, config = _language_model(model)
        self.embed = inner.embed_tokens.weight
        self.norm, self.eps = inner.norm.weight, float(config.rms_norm_eps)
        self.lm_head, self.lm_head_bias = model.lm_head.weight, model.lm_head.bias
        self.inv_freq = inner.rotary_emb.inv_freq
        self.mrope_section = list(getattr(inner.rotary_emb, "mrope_section", None) or []) \
            if model.config.model_type in _FUSED_VLM_TYPES else []
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            # q, k, v as one matrix and gate, up as another: fewer, larger matmuls (copied once per call)
            self.layers.append((layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                _stack(a.q_proj, a.k_proj, a.v_proj), a.o_proj.weight, a.o_proj.bias,
                                _stack(m.gate_proj, m.up_proj), m.down_proj.weight, m.down_proj.bias))
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        # the attention module's own (Qwen2-VL's ignores config.head_dim)
        self.head_dim = (getattr(inner.layers[0].self_attn, "head_dim", None) if len(inner.layers) else None) \
            or getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = inner.layers[0].self_attn.scaling if len(inner.layers) else self.head_dim ** -0.5
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        dtype, device = self.embed.dtype, self.embed.device
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.length = 0

    def load_cache(self, cache: DynamicCache) -> None:
        """Continue after a prompt the model's own forward has run (a VLM's, over its images):
        ``cache``'s keys and values, rotary applied, become this cache's first columns."""
        if self.length or len(cache.layers) != len(self.layers):
            raise ValueError(f"_FusedDecoder.load_cache: an empty cache of {len(self.layers)} layers takes a "
                             f"prefill's {len(cache.layers)}")
        for i, layer in enumerate(cache.layers):
            length = layer.keys.shape[-2]
            self.keys[i][:, :, :length] = layer.keys
            self.values[i][:, :, :length] = layer.values
        self.length = length if self.layers else 0

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows, width = ids.shape
        start, end = self.length, self.length + width
        hidden = F.embedding(ids, self.embed)
        freqs = positions[..., None].float() * self.inv_freq.float()
        if positions.dim() == 3:  # M-RoPE [t, h, w]: each band of frequencies turns by its section's row
            freqs = torch.cat([f[i % 3] for i, f in enumerate(freqs.split(self.mrope_section, dim=-1))], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(hidden.dtype)[:, None], emb.sin().to(hidden.dtype)[:, None]
        keys_mask = mask.bool()[:, None, None, :]  # [B, 1, 1, end]: which cached columns are real tokens
        if width > 1:  # the prompt: causal, and a padding row attends to itself (never read, but finite)
            if start:
                raise ValueError("_FusedDecoder takes the prompt once, then one token at a time")
            causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
            attn_mask = (keys_mask & causal) | torch.eye(width, dtype=torch.bool, device=ids.device)
        else:
            attn_mask = keys_mask
        split = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        for i, (ln1, ln2, (wqkv, bqkv), wo, bo, (wgu, bgu), wd, bd) in enumerate(self.layers):
            x = _rms_norm(hidden, ln1, self.eps)
            q, k, v = F.linear(x, wqkv, bqkv).split(split, dim=-1)
            q = q.reshape(rows, width, self.heads, self.head_dim).transpose(1, 2)
            k = k.reshape(rows, width, self.kv_heads, self.head_dim).transpose(1, 2)
            v = v.reshape(rows, width, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            self.keys[i][:, :, start:end] = k
            self.values[i][:, :, start:end] = v
            out = F.scaled_dot_product_attention(q, self.keys[i][:, :, :end], self.values[i][:, :, :end],
                                                 attn_mask=attn_mask, scale=self.scale,
                                                 enable_gqa=self.heads != self.kv_heads)
            hidden = hidden + F.linear(out.transpose(1, 2).reshape(rows, width, -1), wo, bo)
            x = _rms_norm(hidden, ln2, self.eps)
            gate, up = F.linear(x, wgu, bgu).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, wd, bd)
        self.length = end
        last = _rms_norm(hidden[:, -1], self.norm, self.eps)
        return F.linear(last, self.lm_head, self.lm_head_bias)
