"""Per-token log-probabilities of responses under a model (current policy, old policy, reference)."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable

import torch
import torch.utils.checkpoint

from grouprl.models.inputs import (
    collate_model_inputs,
    forward_kwargs,
    forward_parameters,
    model_config,
    model_device,
    placeholder_token_ids,
    text_position_ids,
    unwrap_model,
)


def suppress_tokens(logits: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """``logits`` with the columns ``token_ids`` set to -inf: the distribution restricted to the other tokens.

    ``log softmax(logits)[y] - log(1 - sum_{s in S} softmax(logits)[s])`` for every y not
    in S. This is the policy every engine samples from (placeholder tokens suppressed) and
    the one the trainer scores, so the sampler's log-probs and the trainer's are of the same
    distribution: vLLM's processed log-probs include its logit bias, and on a random tiny VLM
    the suppressed tokens hold about 1.5% of the mass (log-probs 1.4e-2 apart otherwise). On
    a trained checkpoint their mass is negligible and this changes nothing measurable.
    In place: pass a tensor that nothing else (autograd included) reads afterwards.
    """
    if not token_ids:
        return logits
    logits[..., token_ids] = float("-inf")
    return logits
from grouprl.rollout.batch import RolloutBatch

# Tokens per chunk of the output layer: [chunk, vocabulary] float32 logits at a time (4096 x 151,936
# is 2.5 GB, which is why it is not larger; 1024 keeps a 3B model's step far below its activations).
DEFAULT_CHUNK_TOKENS = 1024


def score_positions(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    *,
    temperature: float = 1.0,
    suppressed: list[int] | None = None,
    with_entropy: bool = False,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``targets`` (and the entropy) at each of ``M`` positions, chunk by chunk.

    ``z = project(hidden[m]) / temperature`` (the output layer, in float32; the suppressed
    tokens' columns set to -inf, see ``suppress_tokens``), then
    ``log_prob[m] = z[targets[m]] - logsumexp(z)`` and
    ``entropy[m] = logsumexp(z) - sum_v softmax(z)_v z_v``.

    ``hidden`` is ``[M, H]`` (or already logits, with ``project`` the identity). The ``[M,
    vocabulary]`` logits exist ``chunk_tokens`` rows at a time: with gradients on, each chunk
    runs under activation checkpointing, so the backward pass recomputes that chunk's logits
    instead of keeping all of them (peak memory no longer grows with rows x tokens x
    vocabulary). ``chunk_tokens=None`` (or 0): one chunk, no checkpointing, the logits of all
    positions at once. The entropy is a metric, computed outside autograd, unless
    ``entropy_grad`` (an entropy bonus in the loss): then it is differentiable too, through the
    same checkpointed chunks, so its backward pass also holds one chunk's logits at a time.
    """
    if len(hidden) == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    size = chunk_tokens if chunk_tokens else len(hidden)
    checkpointed = bool(chunk_tokens) and torch.is_grad_enabled() and len(hidden) > size
    log_probs, entropies = [], []
    for start in range(0, len(hidden), size):
        h, t = hidden[start : start + size], targets[start : start + size]
        if checkpointed:
            lp, ent = torch.utils.checkpoint.checkpoint(
                _score_chunk, h, t, project, temperature, suppressed, with_entropy, entropy_grad, use_reentrant=False)
        else:
            lp, ent = _score_chunk(h, t, project, temperature, suppressed, with_entropy, entropy_grad)
        log_probs.append(lp)
        entropies.append(ent)
    return torch.cat(log_probs), (torch.cat(entropies) if with_entropy else None)


def _score_chunk(h, targets, project, temperature, suppressed, with_entropy, entropy_grad=False):
    model_logits = project(h)
    logits = model_logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if suppressed:
        # in place on a copy made here (the float cast or the temperature); the model's own output is copied first
        logits = suppress_tokens(logits.clone() if logits is model_logits else logits, suppressed)
    normalizer = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normalizer
    entropy = None
    if with_entropy:
        # a metric: outside autograd, the [M, vocab] softmax is not saved for the backward pass
        with torch.no_grad() if not entropy_grad else contextlib.nullcontext():
            entropy = _entropy(logits, normalizer)
    return log_probs, entropy


def _entropy(logits: torch.Tensor, normalizer: torch.Tensor) -> torch.Tensor:
    """``H = logsumexp(z) - sum_v softmax(z)_v z_v`` at each row of ``logits`` z (``normalizer`` its logsumexp).

    A suppressed token (logit -inf, probability 0) adds 0, not 0 * -inf; its logit is replaced
    by 0 before the product, not after, so that the gradient there is 0 too (the product's
    backward multiplies by the logit: 0 * -inf is nan).
    """
    probs = torch.softmax(logits, dim=-1)
    finite = torch.where(probs > 0, logits, 0.0)
    return normalizer - (probs * finite).sum(-1)


def output_layer(model) -> torch.nn.Linear | None:
    """The model's output layer when its logits are exactly ``output_layer(final hidden states)``.

    None for models that change the logits after that layer (Gemma's soft-capping, Cohere's
    logit scale) or whose output layer is not a plain linear layer (a LoRA-adapted one): those
    are scored from the model's own logits, still chunked.
    """
    base = unwrap_model(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return None
    config = model_config(model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(text, name, None) not in (None, 1, 1.0):
            return None
    return head


@contextlib.contextmanager
def _scoring_output_layer(head: torch.nn.Linear, score: Callable[[torch.Tensor], torch.Tensor]):
    """The model's output layer returns ``score(hidden)`` instead of logits, for one forward.

    The layer's ``forward`` is replaced on the instance only: parameter names, hooks (FSDP's
    unsharding, DDP's gradient hooks) and the model's own forward stay as they are, and the
    scores come back through the model's outputs as its ``logits``.
    """
    head.forward = score
    try:
        yield
    finally:
        del head.forward


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The real tokens of a padded batch as one row: ``(packed_ids [1, N], positions [1, N], flat_index [B, L])``.

    ``positions`` restart at 0 for each sequence (transformers reads a restart as the start of a
    new sequence and attends within sequences only); ``flat_index[b, j]`` is the packed position
    of token ``(b, j)`` (meaningful where ``attention_mask`` is 1).
    """
    real = attention_mask.bool()
    flat_index = real.flatten().long().cumsum(0).view_as(attention_mask) - 1
    positions = text_position_ids(attention_mask)
    return input_ids[real].unsqueeze(0), positions[real].unsqueeze(0), flat_index


# model -> whether its modules build their masks with transformers' masking utilities
_BUILDS_PACKED_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_padding_free(model) -> None:
    """Refuse, naming the model and its attention, when a packed row would attend across sequences.

    transformers separates packed sequences by their position restarts in the causal masks it
    builds (``masking_utils``, for ``sdpa`` and ``eager``) and in flash-attention's
    variable-length path; a model that builds its mask another way, or flex attention on the
    CPU (no backward there), would mix the sequences of a micro-batch.
    """
    import sys

    from transformers import masking_utils

    base = unwrap_model(model)
    if hasattr(base, "get_base_model"):
        base = base.get_base_model()
    config = model_config(model)
    attention = getattr(config, "_attn_implementation", None)
    supported = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
    if attention not in supported:
        raise ValueError(f"worker.actor.padding_free needs one of the attention implementations {supported}; "
                         f"{type(base).__name__} uses {attention!r} (set padding_free: false)")
    if base not in _BUILDS_PACKED_MASKS:  # a scan of every module: once per model, not per micro-batch
        _BUILDS_PACKED_MASKS[base] = hasattr(masking_utils, "find_packed_sequence_indices") and any(
            getattr(sys.modules.get(type(m).__module__), "create_causal_mask", None) is masking_utils.create_causal_mask
            for m in base.modules() if type(m).__module__.startswith("transformers.models."))
    if not _BUILDS_PACKED_MASKS[base]:
        raise ValueError(f"worker.actor.padding_free: {type(base).__name__} does not build its attention masks with "
                         "transformers' masking utilities, which separate packed sequences (needs transformers >= 4.56 "
                         "and a model that uses them); set padding_free: false")


def _mrope_positions(model, input_ids, attention_mask, extra, token_types) -> torch.Tensor | None:
    """Qwen-VL's 3-D M-RoPE positions ``[3, B, L]`` of a padded batch with images, as the model builds them
    (``token_types``: the ``mm_token_type_ids`` of ``forward_kwargs``, or None)."""
    base = unwrap_model(model)
    if hasattr(base, "get_base_model"):
        base = base.get_base_model()
    inner = getattr(base, "model", base)
    rope_index = getattr(inner, "get_rope_index", None)
    if rope_index is None:
        return None
    kwargs = {k: extra[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in extra}
    parameters = inspect.signature(rope_index).parameters
    if "mm_token_type_ids" in parameters:
        kwargs["mm_token_type_ids"] = token_types
    positions, _ = rope_index(input_ids, attention_mask=attention_mask, **kwargs)
    return positions


def _packed_kwargs(model, input_ids, attention_mask, extra) -> tuple[dict, torch.Tensor]:
    """Forward kwargs of the batch's real tokens packed into one row, and ``flat_index`` (``pack_rows``)."""
    packed_ids, positions, flat_index = pack_rows(input_ids, attention_mask)
    real = attention_mask.bool()
    kwargs = {"input_ids": packed_ids, "attention_mask": None}
    kwargs.update({k: v.to(input_ids.device) for k, v in extra.items()})
    has_vision = any(k in extra for k in ("image_grid_thw", "video_grid_thw"))
    token_types = forward_kwargs(model, input_ids, attention_mask, extra).get("mm_token_type_ids") \
        if has_vision else None
    mrope = _mrope_positions(model, input_ids, attention_mask, extra, token_types) if has_vision else None
    if mrope is not None:
        # [4, 1, N]: the text positions first (transformers builds the packed mask from them),
        # then the temporal, height and width positions of each token, restarting per sequence
        mrope = mrope.to(input_ids.device)[:, real].unsqueeze(1)
        kwargs["position_ids"] = torch.cat([positions.unsqueeze(0), mrope], dim=0)
        if token_types is not None:
            kwargs["mm_token_type_ids"] = token_types[real].unsqueeze(0)
    elif has_vision:
        raise ValueError(f"worker.actor.padding_free: {type(unwrap_model(model)).__name__} has images but no "
                         "M-RoPE position builder (get_rope_index) to pack them with; set padding_free: false")
    else:
        kwargs["position_ids"] = positions
    return kwargs, flat_index


def forward_response_log_probs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    model_inputs: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    padding_free: bool = False,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass over ``cat(prompt, response)``; log-probs of the response tokens.

    ``log_prob[i, t] = log softmax(logits[i, P + t - 1] / temperature)[response_ids[i, t]]``,
    the softmax over the vocabulary less the model's multimodal placeholder tokens, which no
    engine ever samples (``suppress_tokens``), and ``entropy[i, t] = -sum_v p_v log p_v`` of the
    same distribution, both 0 where ``response_mask`` is 0 and at placeholder tokens (images
    returned between the turns of a dialogue, attended to but never sampled). Shapes ``[B, R]``, on the model's
    device; ``log_prob`` is differentiable when grad is enabled (the policy-loss micro-batch),
    ``entropy`` only with ``entropy_grad`` (an entropy bonus in the loss; otherwise it is logged,
    not optimised, and costs no backward memory). ``model_inputs`` is the collated dict of
    the rows' extra inputs (or the per-row dicts, collated here).

    The logits are computed only at the response positions, from the final hidden states,
    ``chunk_tokens`` positions at a time (``score_positions``): never ``[B, L, vocabulary]``.
    ``padding_free``: the rows' real tokens run as one packed row with positions restarting
    per sequence (``check_padding_free`` says which models can), so no pad token is computed.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score responses, got {temperature!r} (greedy rollouts: use 1.0)")
    if isinstance(model_inputs, list):
        model_inputs = collate_model_inputs(model_inputs)
    device = model_device(model)
    width = response_ids.shape[1]
    # Padding columns shared by every row cost a full forward each and change
    # nothing (positions count real tokens only), so drop them.
    prompt_ids, prompt_mask = _trim_prompt(prompt_ids, prompt_mask)
    # At least one column even when every row is masked: the forward still runs, since
    # under FSDP each forward is a collective that every process must join.
    if width == 0:
        raise ValueError("responses have no tokens (width 0); nothing to score")
    used = max(_used_width(response_mask), 1)
    response_ids, response_mask = response_ids[:, :used], response_mask[:, :used]
    rows, prompt_width = len(response_ids), prompt_ids.shape[1]

    input_ids = torch.cat([prompt_ids, response_ids], dim=1).to(device)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).to(device)
    targets = response_ids.to(device)
    mask = response_mask.to(device).bool()
    suppressed = placeholder_token_ids(model)
    if suppressed:
        # A placeholder in a response is an image an environment or tool returned mid-dialogue (the
        # text between turns): attended to, never sampled (probability 0 under the suppressed policy),
        # so not scored: its log-prob is 0 like padding's, not -inf.
        mask = mask & ~torch.isin(targets, torch.tensor(suppressed, device=device))

    if padding_free:
        check_padding_free(model)
        kwargs, flat_index = _packed_kwargs(model, input_ids, attention_mask, model_inputs)
        # response token (i, t) is predicted by the packed token just before it
        source = (flat_index[:, prompt_width:] - 1)[mask]
    else:
        kwargs = forward_kwargs(model, input_ids, attention_mask, model_inputs)
        if "logits_to_keep" in forward_parameters(model):
            # the prompt positions' outputs are never used
            kwargs["logits_to_keep"] = used + 1
        kept = kwargs.get("logits_to_keep", input_ids.shape[1])
        # response token (i, t) is predicted at kept column (kept - used - 1) + t of row i
        grid = torch.arange(rows, device=device).unsqueeze(1) * kept + (kept - used - 1) + torch.arange(
            used, device=device)
        source = grid[mask]
    picked_targets = targets[mask]
    settings = dict(temperature=temperature, suppressed=suppressed, with_entropy=with_entropy,
                    chunk_tokens=chunk_tokens, entropy_grad=entropy_grad)
    head = output_layer(model)
    if head is not None:
        def score(hidden):
            flat = hidden.reshape(-1, hidden.shape[-1])[source]
            lp, ent = score_positions(flat, picked_targets, lambda h: torch.nn.functional.linear(h, head.weight,
                                                                                                 head.bias),
                                      **settings)
            return torch.stack([lp, ent if ent is not None else torch.zeros_like(lp)], -1)

        with _scoring_output_layer(head, score):
            scored = model(**kwargs, use_cache=False).logits
        lp, ent = scored[..., 0], scored[..., 1]
    else:
        logits = model(**kwargs, use_cache=False).logits
        lp, ent = score_positions(logits.reshape(-1, logits.shape[-1])[source], picked_targets, lambda z: z,
                                  **settings)
    # a select, not a multiply: padded positions hold 0 whatever was computed there
    log_probs = torch.zeros(rows, width, dtype=lp.dtype, device=device).masked_scatter(
        torch.nn.functional.pad(mask, (0, width - used)), lp)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(rows, width, dtype=torch.float32, device=device).masked_scatter(
            torch.nn.functional.pad(mask, (0, width - used)), ent.float() if entropy_grad else ent.detach().float())
    return log_probs, entropy


def compute_log_probs(
    model,
    batch: RolloutBatch,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    rows: list[int] | torch.Tensor | None = None,
    micro_batches: list[torch.Tensor] | None = None,
    padding_free: bool = False,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropies) of ``batch``'s responses, micro-batch by micro-batch.

    Returns ``[len(rows), R]`` tensors (all rows by default, in that order) on the device of
    ``batch.response_ids``. The micro-batches are ``micro_batch_size`` consecutive rows, or
    ``micro_batches`` (positions into ``rows``, each row once: a token-budget plan). Run it
    under ``torch.no_grad()`` for old-policy and reference log-probs; with grad enabled the
    results stay differentiable (the entropies only with ``entropy_grad``).
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
    index = torch.arange(len(batch)) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    plan = list(torch.arange(len(index)).split(micro_batch_size)) if micro_batches is None else micro_batches
    out_device = batch.response_ids.device
    width = batch.response_ids.shape[1]
    order, log_probs, entropies = [], [], []
    for part in plan:
        part = torch.as_tensor(part, dtype=torch.long)
        chunk = index[part]
        keep = chunk.tolist()
        lp, ent = forward_response_log_probs(
            model,
            batch.prompt_ids[chunk],
            batch.prompt_mask[chunk],
            batch.response_ids[chunk],
            batch.response_mask[chunk],
            collate_model_inputs([batch.model_inputs[i] for i in keep]) if batch.model_inputs else {},
            temperature,
            with_entropy=with_entropy,
            padding_free=padding_free,
            chunk_tokens=chunk_tokens,
            entropy_grad=entropy_grad,
        )
        order.append(part)
        log_probs.append(lp.to(out_device))
        if with_entropy:
            entropies.append(ent.to(out_device))
    empty = torch.zeros(0, width, device=out_device)
    if not log_probs:
        return empty, (empty if with_entropy else None)
    positions = torch.cat(order)
    if sorted(positions.tolist()) != list(range(len(index))):
        raise ValueError(f"micro_batches must hold each of the {len(index)} rows exactly once")
    # back to row order: out[positions[k]] = cat(log_probs)[k]
    inverse = torch.empty_like(positions)
    inverse[positions] = torch.arange(len(positions))
    inverse = inverse.to(out_device)
    log_probs_out = torch.cat(log_probs)[inverse]
    entropy_out = torch.cat(entropies)[inverse] if with_entropy else None
    return log_probs_out, entropy_out


def pad_fraction(prompt_mask: torch.Tensor, response_mask: torch.Tensor, micro_batches: list[torch.Tensor], *,
                 padding_free: bool) -> float:
    """Share of the token positions the forward passes compute that are padding (``perf/pad_fraction``).

    A padded micro-batch computes ``rows x (its widest prompt + its longest response)``
    positions (``forward_response_log_probs`` trims the columns no row uses); a packed one only
    its real tokens, so 0.
    """
    real = float(prompt_mask.sum() + response_mask.sum())
    if padding_free or real == 0:
        return 0.0
    computed = 0.0
    for part in micro_batches:
        part = torch.as_tensor(part, dtype=torch.long)
        p = prompt_mask[part].any(dim=0).nonzero()
        prompt_width = prompt_mask.shape[1] - int(p[0]) if len(p) else 0
        computed += len(part) * (prompt_width + max(_used_width(response_mask[part]), 1))
    return 1.0 - real / computed if computed else 0.0


def _trim_prompt(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if len(used) else ids.shape[1]
    return ids[:, start:], mask[:, start:]


def _used_width(mask: torch.Tensor) -> int:
    used = mask.any(dim=0).nonzero()
    return int(used[-1]) + 1 if len(used) else 0
