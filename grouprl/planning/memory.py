"""The memory of one training step, part by part: pure functions of counts and dtypes, in bytes.

Each function holds one part of the peak and the formula it computes; ``grouprl.planning.plan``
adds them up per device. Symbols: ``P`` parameters, ``b`` bytes of one element of a dtype,
``N`` shards (FSDP processes; 1 under DDP), ``T`` tokens of a micro-batch, and of the language
model ``L`` layers, ``h`` hidden size, ``kv = kv_heads * head_dim``, ``I`` the MLP's
intermediate size, ``a`` attention heads, ``V`` the vocabulary.

The activation formulas count what autograd keeps for the backward of a Qwen2/Llama-style
decoder layer (RMSNorm, rotary attention through ``sdpa``, SwiGLU MLP), as measured on the
live tensors of a real forward (``tests/core/test_plan.py``, ``benchmarks/bench_plan.py``):

- full precision (one dtype ``b``), per token per layer: the layer input, the attention
  norm's two products, the rotated queries, the attention output and its log-sum-exp, the
  middle residual and the MLP norm's two products (``8h``), the rotated keys and the values
  (``2 kv``), the gate and up projections, the SiLU and their product (``4I``):
  ``b (8h + 2kv + 4I) + 4a``;
- mixed precision (bf16 autocast over fp32 weights): the residual stream stays fp32 (``4h + kv``
  at 4 bytes), the autocast copies and matrix products are bf16 (``7h + 4kv + 4I`` at 2 bytes),
  and autocast keeps a bf16 copy of every weight matrix for the backward (``2 P_linear``, the output
  layer's included, with or without checkpointing: ``autocast_copy_bytes``);
- with an attention mask (a padded micro-batch, or padding-free rows packed into one, which
  transformers keeps apart by masking) grouped-query attention copies the keys and values to
  every head (``+2h`` at the compute dtype), and each layer keeps the float mask in the compute
  dtype: ``[rows, 1, S, S]`` padded, ``[1, 1, T, T]`` packed (quadratic in the micro-batch's tokens);
- after the last layer: its output and the final norm's two products, ``3h`` at the residual's ``b``;
- with gradient checkpointing only each layer's input is kept (``L h b``, and the boolean mask),
  and the backward recomputes one layer at a time (one layer's full activations on top).
"""

from __future__ import annotations

import math

GIB = 2**30


def weights_bytes(parameters: int, dtype_bytes: int, shards: int = 1) -> int:
    """Weights held on one device: ``ceil(P / N) * b`` (FSDP shards them; ``N = 1`` keeps them whole)."""
    return math.ceil(parameters / shards) * dtype_bytes


def adamw_state_bytes(trained_parameters: int, state_bytes: int, shards: int = 1) -> int:
    """AdamW's two moment estimates of the trained parameters: ``2 * ceil(P_trained / N) * b_state``."""
    return 2 * math.ceil(trained_parameters / shards) * state_bytes


def gradient_bytes(trained_parameters: int, grad_bytes: int, shards: int = 1) -> int:
    """Gradients at the optimizer step (the trained parameters' dtype): ``ceil(P_trained / N) * b``."""
    return math.ceil(trained_parameters / shards) * grad_bytes


def kv_cache_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV cache of one token: ``2 (keys and values) * L * kv_heads * head_dim * b``."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def vllm_bytes(gpu_memory: int, utilization: float) -> int:
    """What vLLM takes on its device: ``gpu_memory_utilization * device memory`` (weights, KV cache, graphs)."""
    return int(utilization * gpu_memory)


def vllm_kv_tokens(gpu_memory: int, utilization: float, weight_bytes: int, kv_bytes_per_token: int) -> int:
    """Tokens vLLM's KV cache holds: ``(utilization * memory - weights) / kv bytes per token`` (0 when the weights
    alone exceed its share)."""
    return max(0, (vllm_bytes(gpu_memory, utilization) - weight_bytes) // kv_bytes_per_token)


def layer_activation_bytes(tokens: int, *, hidden: int, kv_dim: int, intermediate: int, heads: int,
                           residual_bytes: int, compute_bytes: int, masked: bool = False, grouped: bool = False,
                           mask_elements: int = 0) -> int:
    """Bytes one decoder layer keeps for its backward over ``T`` tokens (the module docstring's terms).

    One dtype (``residual_bytes == compute_bytes == b``): ``T (b (8h + 2kv + 4I) + 4a)``.
    Mixed (fp32 residual, bf16 compute): ``T (4 (4h + kv) + 2 (7h + 4kv + 4I) + 4a)``.
    Masked with grouped-query attention: ``+ 2 h T b_compute``; masked: ``+ b_compute mask_elements`` (the
    float mask sdpa keeps: ``rows * S^2`` padded, ``T^2`` for one packed row).
    """
    if residual_bytes == compute_bytes:
        per_token = compute_bytes * (8 * hidden + 2 * kv_dim + 4 * intermediate)
    else:
        per_token = (residual_bytes * (4 * hidden + kv_dim)
                     + compute_bytes * (7 * hidden + 4 * kv_dim + 4 * intermediate))
    per_token += 4 * heads
    total = tokens * per_token
    if masked and grouped:
        total += 2 * hidden * tokens * compute_bytes
    if masked:
        total += compute_bytes * mask_elements
    return total


def activation_bytes(tokens: int, *, layers: int, hidden: int, kv_dim: int, intermediate: int, heads: int,
                     residual_bytes: int, compute_bytes: int, checkpointing: bool, masked: bool = False,
                     grouped: bool = False, mask_elements: int = 0) -> int:
    """What one micro-batch's forward keeps for its backward (the language model; the output layer is chunked apart).

    Without checkpointing: ``L * layer_activation_bytes + 3 h T b_residual``. With checkpointing:
    ``L h T b_residual + 3 h T b_residual + mask_elements`` (the boolean mask); the backward's recompute
    of one layer is ``recompute_bytes``. Autocast's weight copies are ``autocast_copy_bytes``, apart.
    """
    final = 3 * hidden * tokens * residual_bytes
    if checkpointing:
        return layers * hidden * tokens * residual_bytes + final + (mask_elements if masked else 0)
    layer = layer_activation_bytes(tokens, hidden=hidden, kv_dim=kv_dim, intermediate=intermediate, heads=heads,
                                   residual_bytes=residual_bytes, compute_bytes=compute_bytes, masked=masked,
                                   grouped=grouped, mask_elements=mask_elements)
    return layers * layer + final


def autocast_copy_bytes(linear_parameters: int, *, mixed: bool, sharded: bool) -> int:
    """The bf16 copies autocast casts every trained weight matrix to and keeps (its cast cache) until the
    backward: ``2 P_linear`` (the decoder's linear layers and the output layer) in mixed precision, with or
    without checkpointing. FSDP2 gathers its parameters in bf16 already (its mixed-precision policy) and frees
    them layer by layer: 0 there, and 0 when compute and weights share a dtype."""
    return 2 * linear_parameters if mixed and not sharded else 0


def recompute_bytes(tokens: int, *, checkpointing: bool, **layer) -> int:
    """The backward's extra with checkpointing: one layer's activations, recomputed (``layer_activation_bytes``);
    0 without."""
    return layer_activation_bytes(tokens, **layer) if checkpointing else 0


def logprob_chunk_bytes(positions: int, vocab: int, chunk_tokens: int, *, compute_bytes: int = 4,
                        with_entropy: bool = True, backward: bool = True) -> int:
    """Peak of the output layer's logits while log-probs are taken ``chunk_tokens`` positions at a time.

    ``c = min(chunk_tokens, positions)`` (all positions when ``chunk_tokens`` is 0): ``c V`` float32 logits
    (the log-sum-exp needs no temporary of that size), with the entropy metric its softmax, the logits with
    suppressed tokens zeroed and their product (``+3 c V``), in the backward of a checkpointed chunk the
    logits' gradient (``+ c V``), each 4 bytes; plus the model's own ``c V`` logits in the compute dtype
    when it is not float32: ``c V (4 (1 + 3 [entropy] + 1 [backward]) + (b_compute if b_compute != 4))``.
    """
    c = min(chunk_tokens, positions) if chunk_tokens else positions
    copies = 1 + (3 if with_entropy else 0) + (1 if backward else 0)
    return c * vocab * (4 * copies + (compute_bytes if compute_bytes != 4 else 0))


def unchunked_logits_bytes(positions: int, vocab: int, chunk_tokens: int) -> int:
    """Logits kept for the backward when log-probs are not chunked (``chunk_tokens`` 0): ``M V 4``; chunked
    log-probs keep none (each chunk is recomputed in the backward)."""
    return 0 if chunk_tokens and positions > chunk_tokens else positions * vocab * 4
