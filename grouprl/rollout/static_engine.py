"""``hf_static``: transformers ``generate`` with a static KV cache and a compiled decoder step.

A static cache gives every decode step the same tensor shapes, so transformers can
``torch.compile`` the forward of the decode steps (the prefill, and with it a VLM's
vision encoder, runs eagerly). A compiled graph is specialised to its shapes:
[rows, 1] inputs over a cache of ``prompt width + max_new_tokens``. So that one
compilation serves a whole run, each ``generate`` call is padded into a bucket:
the prompt width up to a multiple of ``prompt_bucket`` tokens (on the left, where
padding changes nothing), and the rows up to ``micro_batch_size`` (with copies of
the first row, whose outputs are dropped). A run then compiles once per
(row bucket, width bucket, max_new_tokens), typically once for training and once
for validation, and reuses the graphs at every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import CompileConfig

from grouprl.models.inputs import model_device
from grouprl.rollout.engine import SamplingParams
from grouprl.rollout.hf_engine import HFGenerationEngine


class StaticCacheEngine(HFGenerationEngine):
    """``HFGenerationEngine`` with a static cache, a compiled decoder and shape buckets.

    ``compile=False`` keeps the static cache and the buckets but decodes eagerly.
    ``compile_backend`` is torch.compile's backend (a name or a callable);
    ``compile_mode`` its mode (default: ``reduce-overhead``, i.e. CUDA graphs, on a GPU;
    ``default`` elsewhere).
    """

    def __init__(self, model, processor, *, max_prompt_length: int | None = None,
                 micro_batch_size: int | None = None, truncation: str = "error", holds_weights: bool = False,
                 compile: bool = True, compile_backend: str | Callable = "inductor", compile_mode: str | None = None,
                 prompt_bucket: int = 64) -> None:
        super().__init__(model, processor, max_prompt_length=max_prompt_length, micro_batch_size=micro_batch_size,
                         truncation=truncation, holds_weights=holds_weights)
        if prompt_bucket < 1:
            raise ValueError(f"prompt_bucket must be a positive number of tokens, got {prompt_bucket!r}")
        self.compile = compile
        self.compile_backend = compile_backend
        self.compile_mode = compile_mode
        self.prompt_bucket = prompt_bucket
        self.shapes: set[tuple[int, int, int]] = set()  # (rows, prompt width, max_new_tokens) generated with

    @classmethod
    def from_config(cls, model, processor, *, config, holds_weights: bool) -> "StaticCacheEngine":
        roll = config.worker.rollout
        static = roll.static_cache
        return cls(model, processor, max_prompt_length=config.data.max_prompt_length,
                   micro_batch_size=roll.micro_batch_size, holds_weights=holds_weights, compile=static.compile,
                   compile_backend=static.backend, compile_mode=static.mode, prompt_bucket=static.prompt_bucket)

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        config = super()._generation_config(params)
        config.cache_implementation = "static"
        config.disable_compile = not self.compile
        if self.compile:
            device = model_device(self.model)
            mode = self.compile_mode or ("reduce-overhead" if device.type == "cuda" else "default")
            compile_config = CompileConfig(fullgraph=False, dynamic=False, backend=self.compile_backend, mode=mode)
            # transformers compiles on its own only on accelerators; this flag (its documented
            # testing hook) asks it to compile here too, e.g. on a CPU
            compile_config._compile_all_devices = True
            config.compile_config = compile_config
        return config

    def _generate_rows(self, model, ids: torch.Tensor, mask: torch.Tensor, inputs: list[dict],
                       config: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows, width = ids.shape
        bucket_width = math.ceil(width / self.prompt_bucket) * self.prompt_bucket
        if self.max_prompt_length is not None:
            bucket_width = max(width, min(bucket_width, self.max_prompt_length))
        bucket_rows = max(rows, self.micro_batch_size or rows)
        pad = bucket_width - width
        ids = torch.nn.functional.pad(ids, (pad, 0), value=self.pad_token_id)
        mask = torch.nn.functional.pad(mask, (pad, 0), value=0)
        if bucket_rows > rows:
            # copies of a real row, not empty ones: a row of padding alone attends to nothing
            extra = bucket_rows - rows
            ids = torch.cat([ids, ids[:1].expand(extra, -1)])
            mask = torch.cat([mask, mask[:1].expand(extra, -1)])
            inputs = list(inputs) + [inputs[0]] * extra
        self.shapes.add((bucket_rows, bucket_width, config.max_new_tokens))
        new, logits = super()._generate_rows(model, ids, mask, inputs, config)
        return new[:rows], None if logits is None else logits[:rows]
