"""The generation-engine interface, and the registry that picks an engine by name.

    engine = build_engine(config.worker.rollout.engine, model, processor, config=config)
    batch = engine.generate(samples, SamplingParams(n=5, temperature=1.0, max_new_tokens=256))

An engine samples ``n`` responses per prompt. A prompt comes from a Sample's
messages and images, or already in token space (``EncodedPrompt``: ids and the
image tensors they refer to) for a multi-turn rollout to continue from. It returns
a RolloutBatch with response ids, masks and, when asked, the sampler's per-token
log-probs. Engines are chosen by ``worker.rollout.engine``:

- ``hf``: transformers ``generate``;
- ``hf_static``: ``generate`` with a static KV cache and a compiled decoder, compiled
  once per shape bucket;
- ``hf_lean``: a plain decoding loop of its own (prefill, KV cache, ``generate``'s
  sampling), several times faster than ``generate`` for small models on a CPU (text
  models, and Qwen2-VL / Qwen2.5-VL / Qwen3-VL; other vision-language models are refused);
- ``vllm``: vLLM in the training process (``pip install 'grouprl[vllm]'``).

Register another with ``register_engine(name, "package.module:Class")`` (or the class).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from grouprl.data.sample import Sample
from grouprl.registry import Registry
from grouprl.rollout.batch import RolloutBatch


@dataclass
class SamplingParams:
    """How to sample: ``n`` responses per prompt, each at most ``max_new_tokens`` long.

    ``temperature == 0`` or ``do_sample=False`` means greedy decoding.
    ``top_k`` of 0 or None and ``top_p`` of 1.0 disable those filters.
    ``seed`` makes a call reproducible: the same seed, prompts and engine
    settings give the same responses. Give each step (and each process) its
    own seed, or every step resamples the same responses.
    ``return_log_probs`` asks the engine for the sampler's per-token log-probs
    (``RolloutBatch.rollout_log_probs``), at ``temperature`` and before top-k/top-p.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_new_tokens: int = 256
    seed: int | None = None
    do_sample: bool = True
    return_log_probs: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be a positive integer, got n={self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got temperature={self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got top_p={self.top_p!r}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 or None, got top_k={self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be a positive integer, got max_new_tokens={self.max_new_tokens!r}"
            )

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @property
    def log_prob_temperature(self) -> float:
        """The temperature at which the sampled tokens' log-probs are defined (1.0 for greedy)."""
        return 1.0 if self.greedy else float(self.temperature)


@dataclass
class EncodedPrompt:
    """A prompt already in token space, for an engine to continue from.

    ``ids`` [P] are the tokens so far (no padding): a rendered first prompt, or a
    whole dialogue with earlier responses kept as they were sampled. ``model_inputs``
    holds the image tensors those ids refer to (``pixel_values``, ``image_grid_thw``),
    as ``encode_prompts`` produces them. ``images`` are the images that entered the
    dialogue after the sample's own (returned by a tool or an environment), in order:
    an engine that re-processes images itself (vLLM) gives the sample's then these.
    """

    ids: torch.Tensor
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    images: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.ids.dim() != 1 or self.ids.dtype != torch.long or not len(self.ids):
            raise ValueError(f"EncodedPrompt.ids must be a non-empty 1-D long tensor, got {tuple(self.ids.shape)} "
                             f"{self.ids.dtype}")


class RolloutEngine(abc.ABC):
    """Samples responses for prompts.

    ``generate`` returns one row per response, the ``n`` rows of a prompt
    consecutive, ``group_index`` the prompt's position in ``samples``.
    An engine that holds its own copy of the weights (``holds_weights``: a bf16
    rollout copy, vLLM) receives the trained ones through ``update_weights`` after
    each training step. ``sleep`` frees what the engine holds on the accelerator
    while the trainer updates the policy, and ``wake_up`` brings it back; engines
    without such memory (``supports_sleep`` False) do nothing.
    """

    holds_weights: bool = False
    supports_sleep: bool = False
    # whether the engine must own its weights whatever the trainer's precision (vLLM loads its own)
    owns_weights: bool = False
    # whether generate is a collective of several processes (vLLM with tensor parallelism): then each
    # of them calls it equally often, a process without prompts through join_group_call
    group_calls: bool = False

    def join_group_call(self) -> None:
        """Take part in a group's ``generate`` call with no prompts of one's own (``group_calls`` engines)."""

    @classmethod
    def from_config(cls, model, processor, *, config, holds_weights: bool) -> "RolloutEngine":
        """The engine for a training run: ``model`` is the policy, or a frozen copy when ``holds_weights``."""
        roll = config.worker.rollout
        return cls(model, processor, max_prompt_length=config.data.max_prompt_length,
                   micro_batch_size=roll.micro_batch_size, holds_weights=holds_weights)

    @abc.abstractmethod
    def generate(self, samples: list[Sample], params: SamplingParams, *,
                 prompts: list[EncodedPrompt] | None = None) -> RolloutBatch:
        """Sample ``params.n`` responses for each sample (continuing ``prompts[i]`` when given)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(parameter name, whole tensor)`` pairs, names as in the policy's transformers model."""

    def sleep(self) -> None:
        """Release accelerator memory held for generation (weights and KV cache) until ``wake_up``."""

    def wake_up(self) -> None:
        """Take back what ``sleep`` released."""


# ---------------------------------------------------------------------------- the registry


def _check_engine(name: str, engine) -> None:
    if not (isinstance(engine, type) and issubclass(engine, RolloutEngine)):
        raise TypeError(f"rollout engine {name!r} is {engine!r}, not a RolloutEngine subclass")


# name -> "module:Class" (imported when first asked for, so optional engines cost nothing) or the class
ROLLOUT_ENGINES: Registry[type[RolloutEngine]] = Registry("rollout engine", error=ValueError, check=_check_engine)
ROLLOUT_ENGINES.register("hf", "grouprl.rollout.hf_engine:HFGenerationEngine")
ROLLOUT_ENGINES.register("hf_static", "grouprl.rollout.static_engine:StaticCacheEngine")
ROLLOUT_ENGINES.register("hf_lean", "grouprl.rollout.lean_engine:LeanGenerationEngine")
ROLLOUT_ENGINES.register("vllm", "grouprl.rollout.vllm_engine:VLLMEngine")


def register_engine(name: str, engine: str | type[RolloutEngine], *, overwrite: bool = False) -> None:
    """Make ``engine`` (a RolloutEngine subclass, or ``"module:Class"``) available as ``worker.rollout.engine: name``."""
    ROLLOUT_ENGINES.register(name, engine, overwrite=overwrite)


def engine_names() -> list[str]:
    return ROLLOUT_ENGINES.names()


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine class registered as ``name`` (imported on first use)."""
    engine = ROLLOUT_ENGINES.get(name)
    _check_engine(name, engine)  # a class registered directly is checked here, a reference when imported
    return engine


def build_engine(name: str, model, processor, *, config, holds_weights: bool = False) -> RolloutEngine:
    """The engine ``name`` for a training run (see ``RolloutEngine.from_config``)."""
    return engine_class(name).from_config(model, processor, config=config, holds_weights=holds_weights)
