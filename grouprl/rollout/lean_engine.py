"""``hf_lean``: a plain decoding loop for small text models, in place of transformers ``generate``.

For a model of a few hundred thousand to a few million parameters on a CPU, a decode
step's time is almost all Python: ``generate``'s logits processors, stopping criteria
and cache bookkeeping, the modules' ``__call__`` machinery and mask building of the
transformers forward. This engine runs the same decoding with none of that:

- the prompt is prefilled once and each new token decoded against a KV cache;
- for a plain Qwen2 or Llama checkpoint (``fused``: every projection a bare
  ``nn.Linear``, default RoPE, no sliding window) the forward is written out here,
  over the model's own weight tensors and a preallocated cache; any other text model
  runs its own transformers forward with a ``DynamicCache``;
- sampling is ``generate``'s: the placeholder tokens suppressed, then temperature,
  top-k and top-p exactly as transformers' warpers apply them, greedy as the argmax,
  and the token drawn as ``torch.multinomial`` draws it, from the same random numbers:
  with the same seed and the same logits it samples the responses ``hf`` samples;
- a row stops at its first EOS and is fed pad tokens after it, all rows stop once
  every row has (or at ``max_new_tokens``), as in ``generate``;
- the sampler's log-probs are those of ``hf``: the raw logits at the sampling
  temperature, placeholders suppressed, before top-k / top-p.

Vision-language models are refused (their rotary positions depend on the image
grid): use ``hf`` or ``hf_static`` for them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, GenerationConfig

from grouprl.models.inputs import model_config, model_device, unwrap_model
from grouprl.rollout.hf_engine import HFGenerationEngine

ENGINE_NAME = "hf_lean"
_FUSED_TYPES = ("qwen2", "llama")


class LeanGenerationEngine(HFGenerationEngine):
    """``HFGenerationEngine`` with its own decoding loop in place of ``generate`` (text models only).

    ``fused`` picks the forward: None (default) the written-out Qwen2 / Llama decoder
    when the model is one (``fused_decoder_supported``), else the model's own forward;
    False always the model's own forward; True requires the written-out one.
    """

    def __init__(self, model, processor, *, max_prompt_length: int | None = None,
                 micro_batch_size: int | None = None, truncation: str = "error", holds_weights: bool = False,
                 fused: bool | None = None) -> None:
        super().__init__(model, processor, max_prompt_length=max_prompt_length, micro_batch_size=micro_batch_size,
                         truncation=truncation, holds_weights=holds_weights)
        config = model_config(model)
        if self.suppressed_token_ids or getattr(config, "vision_config", None) is not None:
            raise ValueError(f"rollout engine {ENGINE_NAME!r} decodes text-only causal LMs, and "
                             f"{type(unwrap_model(model)).__name__} is a vision-language model; set "
                             "worker.rollout.engine to 'hf' (or 'hf_static') for it")
        supported = fused_decoder_supported(model)
        if fused and not supported:
            raise ValueError(f"rollout engine {ENGINE_NAME!r}: fused=True needs a plain Qwen2 or Llama model "
                             f"(bare nn.Linear projections, default RoPE, full attention); got "
                             f"{type(unwrap_model(model)).__name__}")
        self.fused = supported if fused is None else bool(fused)

    def _generate_rows(self, model, ids: torch.Tensor, mask: torch.Tensor, inputs: list[dict],
                       config: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
        if any(inputs):
            raise ValueError(f"rollout engine {ENGINE_NAME!r} decodes text only, and these prompts carry model "
                             f"inputs ({sorted(set().union(*inputs))}); use worker.rollout.engine 'hf' for them")
        device = model_device(model)
        ids, mask = ids.to(device), mask.to(device)
        forward = _FusedDecoder(model, ids.shape[0], ids.shape[1] + config.max_new_tokens) if self.fused \
            else _ModelForward(model)
        return decode(forward, ids, mask, config, suppressed=self.suppressed_token_ids)


# ---------------------------------------------------------------------------- the decoding loop


@torch.no_grad()
def decode(forward, ids: torch.Tensor, mask: torch.Tensor, config: GenerationConfig, *,
           suppressed: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode up to ``config.max_new_tokens`` tokens after left-padded ``ids``.

    Returns the new tokens [B, T] (on the CPU; pad after a row's EOS) and, when
    ``config.output_logits``, the raw float32 logits of each step [B, T, V], as
    ``generate`` returns them. ``forward(ids, mask, positions)`` gives the next-token
    logits [B, V] of the last column and appends the columns to its cache.
    """
    rows = ids.shape[0]
    eos = torch.tensor(config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id],
                       device=ids.device)
    pad = int(config.pad_token_id)
    # positions as generate makes them: real tokens counted from 0, padding at 1 (never read)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    next_position = mask.long().sum(-1, keepdim=True)
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


def fused_decoder_supported(model) -> bool:
    """Whether ``_FusedDecoder`` computes ``model``'s forward: a plain (no adapters, no quantised or
    otherwise wrapped projections) Qwen2 / Llama causal LM with default RoPE and full attention."""
    model = unwrap_model(model)
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in _FUSED_TYPES:
        return False
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or getattr(config, "hidden_act", None) != "silu":
        return False
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return False
    if getattr(config, "use_sliding_window", False) or getattr(config, "pretraining_tp", 1) not in (None, 1):
        return False
    inner = getattr(model, "model", None)
    if type(getattr(model, "lm_head", None)) is not torch.nn.Linear or inner is None:
        return False
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "attention_scaling", 1.0) != 1.0:
        return False
    for layer in getattr(inner, "layers", []):
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(p) is not torch.nn.Linear for p in projections):
            return False
        if type(layer) not in _DECODER_LAYER_TYPES or getattr(attn, "sliding_window", None):
            return False
    return type(inner.embed_tokens) is torch.nn.Embedding


def _decoder_layer_types() -> tuple[type, ...]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    return Qwen2DecoderLayer, LlamaDecoderLayer


_DECODER_LAYER_TYPES = _decoder_layer_types()


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
    head on the last position only), without their per-module call overhead.
    """

    def __init__(self, model, rows: int, capacity: int) -> None:
        model = unwrap_model(model)
        config = model.config
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm, self.eps = inner.norm.weight, float(config.rms_norm_eps)
        self.lm_head, self.lm_head_bias = model.lm_head.weight, model.lm_head.bias
        self.inv_freq = inner.rotary_emb.inv_freq
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            # q, k, v as one matrix and gate, up as another: fewer, larger matmuls (copied once per call)
            self.layers.append((layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                _stack(a.q_proj, a.k_proj, a.v_proj), a.o_proj.weight, a.o_proj.bias,
                                _stack(m.gate_proj, m.up_proj), m.down_proj.weight, m.down_proj.bias))
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = inner.layers[0].self_attn.scaling if len(inner.layers) else self.head_dim ** -0.5
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        dtype, device = self.embed.dtype, self.embed.device
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.length = 0

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows, width = ids.shape
        start, end = self.length, self.length + width
        hidden = F.embedding(ids, self.embed)
        freqs = positions[..., None].float() * self.inv_freq.float()
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
