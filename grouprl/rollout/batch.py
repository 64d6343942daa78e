"""RolloutBatch: the one object that moves between the stages of a training step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from grouprl.data.sample import Sample


@dataclass
class RolloutBatch:
    """Everything known about a set of sampled responses, one row per response.

    Rows of the same prompt share ``group_index``. Prompts are left-padded and
    responses right-padded, so ``torch.cat([prompt_ids, response_ids], 1)`` is a
    valid model input with ``attention_mask = cat([prompt_mask, response_mask])``.
    ``response_mask`` is 1 on the tokens the policy produced (EOS included) and
    0 on padding; stages that drop tokens from the loss (truncation masking, edit
    masking) do it on ``loss_mask``, which starts as a copy of ``response_mask``.

    ``model_inputs`` holds one dict per row of extra model inputs for that row's
    prompt (``pixel_values``, ``image_grid_thw`` for Qwen-VL models), so that any
    subset of rows can be re-collated into a micro-batch.

    Stages fill the optional fields as they run: log-probs (engine / actor),
    ``reward_components`` and ``scores`` (rewards), ``advantages`` (algorithms).
    """

    samples: list[Sample]
    group_index: torch.Tensor  # [B] long, the prompt each row answers
    prompt_ids: torch.Tensor  # [B, P]
    prompt_mask: torch.Tensor  # [B, P]
    response_ids: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R]
    responses: list[str]
    truncated: torch.Tensor  # [B] bool, no EOS within max_new_tokens
    model_inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    loss_mask: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None  # [B, R]
    ref_log_probs: torch.Tensor | None = None  # [B, R]
    reward_components: dict[str, list[float | None]] = field(default_factory=dict)
    scores: torch.Tensor | None = None  # [B] float, the weighted reward
    advantages: torch.Tensor | None = None  # [B, R]
    edited: torch.Tensor | None = None  # [B] bool, set by rollout transforms
    extras: dict[str, list[Any]] = field(default_factory=dict)  # per-row values passed to rewards as columns

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.response_mask.clone()
        if self.edited is None:
            self.edited = torch.zeros(len(self.samples), dtype=torch.bool)

    def __len__(self) -> int:
        return len(self.samples)

    def select(self, rows: list[int] | torch.Tensor) -> "RolloutBatch":
        """The sub-batch of the given rows, in that order (used for micro-batches and group filtering)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        keep = idx.tolist()

        def take(t):
            return None if t is None else t[idx]

        return RolloutBatch(
            samples=[self.samples[i] for i in keep],
            group_index=self.group_index[idx],
            prompt_ids=self.prompt_ids[idx],
            prompt_mask=self.prompt_mask[idx],
            response_ids=self.response_ids[idx],
            response_mask=self.response_mask[idx],
            responses=[self.responses[i] for i in keep],
            truncated=self.truncated[idx],
            model_inputs=[self.model_inputs[i] for i in keep] if self.model_inputs else [],
            loss_mask=take(self.loss_mask),
            old_log_probs=take(self.old_log_probs),
            ref_log_probs=take(self.ref_log_probs),
            reward_components={k: [v[i] for i in keep] for k, v in self.reward_components.items()},
            scores=take(self.scores),
            advantages=take(self.advantages),
            edited=take(self.edited),
            extras={k: [v[i] for i in keep] for k, v in self.extras.items()},
        )
