"""Per-token log-probabilities of responses under a model (current policy, old policy, reference)."""

from __future__ import annotations

import torch

from grouprl.models.inputs import (
    collate_model_inputs,
    forward_kwargs,
    forward_parameters,
    model_device,
    placeholder_token_ids,
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass over ``cat(prompt, response)``; log-probs of the response tokens.

    ``log_prob[i, t] = log softmax(logits[i, P + t - 1] / temperature)[response_ids[i, t]]``,
    the softmax over the vocabulary less the model's multimodal placeholder tokens, which no
    engine ever samples (``suppress_tokens``), and ``entropy[i, t] = -sum_v p_v log p_v`` of the same distribution, both 0
    where ``response_mask`` is 0. Shapes ``[B, R]``, on the model's device;
    ``log_prob`` is differentiable when grad is enabled (the policy-loss
    micro-batch), ``entropy`` never is (it is logged, not optimised).
    ``model_inputs`` is the collated dict of the rows' extra inputs (or the
    per-row dicts, collated here).
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

    input_ids = torch.cat([prompt_ids, response_ids], dim=1).to(device)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).to(device)
    kwargs = forward_kwargs(model, input_ids, attention_mask, model_inputs)
    if "logits_to_keep" in forward_parameters(model):
        # Logits of the prompt positions are never used; with a 150k vocabulary they are most of the memory.
        kwargs["logits_to_keep"] = used + 1
    logits = model(**kwargs, use_cache=False).logits
    model_logits = logits[:, -(used + 1) : -1, :]
    logits = model_logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = response_ids.to(device)
    mask = response_mask.to(device=device, dtype=logits.dtype)
    suppressed = placeholder_token_ids(model)
    if suppressed:
        if (torch.isin(targets, torch.tensor(suppressed, device=device)) & mask.bool()).any():
            raise ValueError(f"a response holds a multimodal placeholder token (ids {suppressed}), which no engine "
                             "samples and the policy gives probability 0; responses must be plain text")
        # in place on a copy made here (the float cast or the temperature); the model's own output is copied first
        logits = suppress_tokens(logits.clone() if logits is model_logits else logits, suppressed)
    normalizer = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # select, not multiply: a padded position's logits may be anything, inf included
    token_log_probs = torch.where(mask.bool(), picked - normalizer, torch.zeros_like(picked))
    log_probs = torch.nn.functional.pad(token_log_probs, (0, width - used))
    entropy = None
    if with_entropy:
        # A metric, never differentiated: outside autograd the [B, R, vocab]
        # softmax is not saved for the backward pass (one logits-sized tensor less
        # at peak; 260 MB for 32 x 64 tokens over a 32k vocabulary).
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            # a suppressed token (logit -inf, probability 0) adds 0, not 0 * -inf
            expected_logit = torch.where(probs > 0, probs * logits, 0.0).sum(-1)
            token_entropy = torch.where(mask.bool(), normalizer - expected_logit, torch.zeros_like(normalizer))
        entropy = torch.nn.functional.pad(token_entropy, (0, width - used))
    return log_probs, entropy


def compute_log_probs(
    model,
    batch: RolloutBatch,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    rows: list[int] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropies) of ``batch``'s responses, micro-batch by micro-batch.

    Returns ``[len(rows), R]`` tensors (all rows by default) on the device of
    ``batch.response_ids``. Run it under ``torch.no_grad()`` for old-policy and
    reference log-probs; with grad enabled the results stay differentiable.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
    index = torch.arange(len(batch)) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    out_device = batch.response_ids.device
    log_probs, entropies = [], []
    for start in range(0, len(index), micro_batch_size):
        chunk = index[start : start + micro_batch_size]
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
        )
        log_probs.append(lp.to(out_device))
        if with_entropy:
            entropies.append(ent.to(out_device))
    width = batch.response_ids.shape[1]
    empty = torch.zeros(0, width, device=out_device)
    log_probs_out = torch.cat(log_probs) if log_probs else empty
    entropy_out = (torch.cat(entropies) if entropies else empty) if with_entropy else None
    return log_probs_out, entropy_out


def _trim_prompt(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if len(used) else ids.shape[1]
    return ids[:, start:], mask[:, start:]


def _used_width(mask: torch.Tensor) -> int:
    used = mask.any(dim=0).nonzero()
    return int(used[-1]) + 1 if len(used) else 0
