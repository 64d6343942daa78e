"""The generation-engine interface: what the trainer asks of any way of sampling responses."""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from grouprl.data.sample import Sample
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


class RolloutEngine(abc.ABC):
    """Samples responses for prompts.

    ``generate`` returns one row per response, the ``n`` rows of a prompt
    consecutive, ``group_index`` the prompt's position in ``samples``.
    An engine that holds its own copy of the weights (``holds_weights``: a bf16
    rollout copy, vLLM) receives the trained ones through ``update_weights`` after
    each training step.
    """

    holds_weights: bool = False

    @abc.abstractmethod
    def generate(self, samples: list[Sample], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` responses for each sample."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(parameter name, whole tensor)`` pairs, names as in the policy's transformers model."""
