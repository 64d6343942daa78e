"""Sampling with transformers ``generate``, on the policy itself or on a copy of its weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Iterator

import torch
from transformers import GenerationConfig

from grouprl.data.sample import Sample
from grouprl.models.inputs import (
    collate_model_inputs,
    encode_prompts,
    forward_kwargs,
    left_pad,
    model_device,
    pad_token_id,
    placeholder_token_ids,
    tokenizer_of,
    unwrap_model,
)
from grouprl.rollout.batch import RolloutBatch
from grouprl.rollout.logprobs import suppress_tokens
from grouprl.rollout.engine import EncodedPrompt, RolloutEngine, SamplingParams

# Chat models end a turn with one of these; a checkpoint's tokenizer may name only one of them as EOS.
_TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")


class HFGenerationEngine(RolloutEngine):
    """Batched ``model.generate``: n samples per prompt, micro-batched.

    ``model`` is the policy itself (the engine then sees every optimizer step at
    once), or with ``holds_weights=True`` a separate copy the engine owns: a bf16
    rollout copy beside fp32 master weights, or an unsharded copy of an FSDP policy,
    whose forward passes are collectives that generation cannot keep in step across
    processes. A copy is refreshed by ``update_weights``.
    """

    def __init__(
        self,
        model,
        processor,
        *,
        max_prompt_length: int | None = None,
        micro_batch_size: int | None = None,
        truncation: str = "error",
        holds_weights: bool = False,
    ) -> None:
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be a positive integer or None, got {micro_batch_size!r}")
        self.model = model
        self.processor = processor
        self.max_prompt_length = max_prompt_length
        self.micro_batch_size = micro_batch_size
        self.truncation = truncation
        self.pad_token_id = pad_token_id(processor)
        self.eos_token_ids = _eos_token_ids(processor, model)
        self.suppressed_token_ids = placeholder_token_ids(model)
        self.holds_weights = holds_weights
        if holds_weights:
            unwrap_model(model).requires_grad_(False)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the trained weights into the engine's copy, casting to its dtype, one tensor at a time."""
        if not self.holds_weights:
            return  # the engine samples from the policy itself: every optimizer step is already visible
        params = dict(unwrap_model(self.model).named_parameters())
        seen = set()
        for name, tensor in named_tensors:
            target = params.get(name)
            if target is None:
                raise KeyError(f"the rollout copy has no parameter {name!r} (it has e.g. {list(params)[:3]})")
            if target.shape != tensor.shape:
                raise ValueError(f"parameter {name!r}: rollout copy {tuple(target.shape)}, trained {tuple(tensor.shape)}")
            target.copy_(tensor)
            seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            raise KeyError(f"update_weights left {len(missing)} parameter(s) of the rollout copy stale, e.g. {missing[:3]}")

    def generate(self, samples: list[Sample], params: SamplingParams, *,
                 prompts: list[EncodedPrompt] | None = None) -> RolloutBatch:
        prompt_ids, prompt_mask, inputs = self._encode(samples, prompts)
        n = params.n
        group_index = torch.arange(len(samples)).repeat_interleave(n)
        row_prompt_ids = prompt_ids.repeat_interleave(n, dim=0)
        row_prompt_mask = prompt_mask.repeat_interleave(n, dim=0)
        row_inputs = [inputs[i] for i in group_index.tolist()]
        rows = len(group_index)
        step = self.micro_batch_size or rows

        model = unwrap_model(self.model)
        device = model_device(model)
        config = self._generation_config(params)
        tokens: list[torch.Tensor] = []
        log_probs: list[torch.Tensor] = []
        with _eval_mode(model), torch.no_grad(), _seeded(params.seed, device), _only_generation_config(model, config):
            for start in range(0, rows, step):
                ids, mask = _trim_left(row_prompt_ids[start : start + step], row_prompt_mask[start : start + step])
                new, logits = self._generate_rows(model, ids, mask, row_inputs[start : start + step], config)
                tokens.append(new)
                if params.return_log_probs:
                    # the distribution sampled from: placeholders suppressed, as the trainer scores it
                    logits = suppress_tokens(logits.float() / params.log_prob_temperature, self.suppressed_token_ids)
                    picked = logits.gather(-1, new.to(logits.device).unsqueeze(-1)).squeeze(-1)
                    log_probs.append((picked - torch.logsumexp(logits, dim=-1)).cpu())

        response_ids, response_mask, truncated = self._finish(tokens)
        rollout_log_probs = None
        if params.return_log_probs:
            width = response_ids.shape[1]
            rollout_log_probs = torch.cat([_fit(lp, width, 0.0) for lp in log_probs]) * response_mask
        tokenizer = tokenizer_of(self.processor)
        responses = tokenizer.batch_decode(
            [row[: int(m.sum())] for row, m in zip(response_ids, response_mask)], skip_special_tokens=True
        )
        return RolloutBatch(
            samples=[samples[i] for i in group_index.tolist()],
            group_index=group_index,
            prompt_ids=row_prompt_ids,
            prompt_mask=row_prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            responses=responses,
            truncated=truncated,
            model_inputs=row_inputs,
            rollout_log_probs=rollout_log_probs,
        )

    def _encode(self, samples: list[Sample], prompts: list[EncodedPrompt] | None):
        """Left-padded prompt ids, mask and per-prompt model inputs, from messages or given token ids."""
        if prompts is None:
            return encode_prompts(self.processor, samples, max_prompt_length=self.max_prompt_length,
                                  truncation=self.truncation)
        if len(prompts) != len(samples):
            raise ValueError(f"got {len(prompts)} encoded prompts for {len(samples)} samples")
        # A continuation is not held to max_prompt_length (that is the first prompt's limit): a
        # dialogue's context grows by design, and whoever continues it owns its length budget.
        ids, mask = left_pad([p.ids for p in prompts], self.pad_token_id)
        return ids, mask, [dict(p.model_inputs) for p in prompts]

    def _generate_rows(self, model, ids: torch.Tensor, mask: torch.Tensor, inputs: list[dict],
                       config: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One ``generate`` call: the new tokens [b, T] (on the CPU) and, when asked, their logits [b, T, V]."""
        device = model_device(model)
        kwargs = forward_kwargs(model, ids.to(device), mask.to(device), collate_model_inputs(inputs), generation=True)
        out = model.generate(**kwargs, generation_config=config)
        new = out.sequences[:, ids.shape[1] :].cpu()
        logits = torch.stack(out.logits, dim=1) if config.output_logits else None
        return new, logits

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        # Only what the params say: a checkpoint's own sampling defaults
        # (Qwen-VL-Instruct ships top_k=1, repetition_penalty=1.05) would make the
        # sampler differ from the policy whose log-probs the loss uses.
        sampling = {}
        if not params.greedy:
            sampling = dict(temperature=float(params.temperature), top_p=float(params.top_p), top_k=params.top_k or 0)
        return GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            output_logits=params.return_log_probs,
            # An image placeholder in a response would be fed to the vision merger as
            # an image slot on the next forward and break it ("tokens: 514, features: 512").
            suppress_tokens=self.suppressed_token_ids or None,
            **sampling,
        )

    def _finish(self, tokens: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-pad micro-batch outputs; mask everything after the first EOS."""
        width = max(t.shape[1] for t in tokens)
        ids = torch.cat([_fit(t, width, self.pad_token_id) for t in tokens])
        is_eos = torch.isin(ids, torch.tensor(self.eos_token_ids))
        has_eos = is_eos.any(dim=1)
        # Index of the first EOS, or the full width when there is none.
        first = torch.where(has_eos, is_eos.long().argmax(dim=1), torch.full_like(has_eos, width, dtype=torch.long))
        positions = torch.arange(width).unsqueeze(0)
        mask = (positions <= first.unsqueeze(1)).long()
        # A row without EOS ran to max_new_tokens; rows that stopped early were
        # padded by generate with pad ids, which the mask must not count.
        ran = torch.cat([torch.full((t.shape[0],), t.shape[1]) for t in tokens])
        mask = mask * (positions < ran.unsqueeze(1)).long()
        ids = ids.masked_fill(mask == 0, self.pad_token_id)
        keep = int(mask.sum(dim=1).max()) if len(mask) else 0
        return ids[:, :keep], mask[:, :keep], ~has_eos


def _eos_token_ids(processor, model) -> list[int]:
    tokenizer = tokenizer_of(processor)
    ids: list[int] = []

    def add(value):
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(v for v in value if isinstance(v, int))

    add(tokenizer.eos_token_id)
    add(getattr(getattr(unwrap_model(model), "generation_config", None), "eos_token_id", None))
    vocab = tokenizer.get_vocab()
    for token in _TURN_END_TOKENS:
        if token in vocab:
            ids.append(vocab[token])
    if not ids:
        raise ValueError("no EOS token: neither the tokenizer nor the model's generation config names one")
    return sorted(set(ids))


def _trim_left(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the padding columns every row of this micro-batch has (they cost compute, change nothing)."""
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if len(used) else 0
    return ids[:, start:], mask[:, start:]


def _fit(t: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


@contextlib.contextmanager
def _eval_mode(model) -> Iterator[None]:
    # Remember every module's mode, not just the root's: a frozen part may be in
    # eval on purpose while the rest trains.
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Seed sampling without moving the caller's RNG streams (restored on exit)."""
    if seed is None:
        yield
        return
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def _only_generation_config(model, config: GenerationConfig) -> Iterator[None]:
    """Hide the checkpoint's generation_config during the call.

    transformers fills every field we leave unset from ``model.generation_config``
    (and then from global defaults such as top_k=50), so a temporary bare config
    keeps the checkpoint's sampling settings out of the rollout.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = base.generation_config
    base.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=saved.bos_token_id
    )
    try:
        yield
    finally:
        base.generation_config = saved
