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

    Three masks over the response, kept apart:
    - ``response_mask``, the attention mask: 1 on every real token of the response
      (what the model sees), 0 on padding;
    - ``policy_mask``: 1 on the tokens the policy sampled (EOS included). In a
      single-turn response it equals ``response_mask``; a multi-turn response also
      holds template and verifier tokens between the policy's turns, seen but not
      sampled;
    - ``loss_mask``: the tokens trained on. It starts as ``policy_mask``; stages that
      drop tokens from the loss (truncation masking, edit masking, unscored rows)
      change it alone.

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
    policy_mask: torch.Tensor | None = None  # [B, R], default: response_mask
    loss_mask: torch.Tensor | None = None  # [B, R], default: policy_mask
    old_log_probs: torch.Tensor | None = None  # [B, R]
    ref_log_probs: torch.Tensor | None = None  # [B, R]
    rollout_log_probs: torch.Tensor | None = None  # [B, R], the sampler's own, when the engine was asked for them
    reward_components: dict[str, list[float | None]] = field(default_factory=dict)
    scores: torch.Tensor | None = None  # [B] float, the weighted reward
    advantages: torch.Tensor | None = None  # [B, R]
    # [B, R] per-token loss weights: the importance weights between the sampler and the trainer
    # (``algorithms.rollout_importance_weights``), when the rollout is corrected
    token_weights: torch.Tensor | None = None
    edited: torch.Tensor | None = None  # [B] bool, set by rollout transforms
    extras: dict[str, list[Any]] = field(default_factory=dict)  # per-row values passed to rewards as columns
    # per-row values reward functions logged with TRL's log_extra(column, values), for the rollouts JSONL
    reward_logs: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy_mask is None:
            self.policy_mask = self.response_mask.clone()
        if self.loss_mask is None:
            self.loss_mask = self.policy_mask.clone()
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
            policy_mask=take(self.policy_mask),
            loss_mask=take(self.loss_mask),
            old_log_probs=take(self.old_log_probs),
            ref_log_probs=take(self.ref_log_probs),
            rollout_log_probs=take(self.rollout_log_probs),
            reward_components={k: [v[i] for i in keep] for k, v in self.reward_components.items()},
            scores=take(self.scores),
            advantages=take(self.advantages),
            token_weights=take(self.token_weights),
            edited=take(self.edited),
            extras={k: [v[i] for i in keep] for k, v in self.extras.items()},
            reward_logs={k: [v[i] for i in keep] for k, v in self.reward_logs.items()},
        )

    @classmethod
    def concat(cls, batches: list["RolloutBatch"], *, pad_token_id: int, renumber_groups: bool = True) -> "RolloutBatch":
        """Rows of several batches in order, re-padded to a common prompt and response width.

        Used when more rollouts are generated to fill a batch (dynamic sampling).
        Each batch's groups are kept apart: with ``renumber_groups`` the group
        ids of a batch are shifted past those of the batches before it, since
        separate ``generate`` calls all number their prompts from 0. Prompts are
        left-padded with ``pad_token_id``, responses right-padded; masks and
        per-token values pad with 0.
        """
        if not batches:
            raise ValueError("RolloutBatch.concat: no batches")
        if len(batches) == 1:
            return batches[0]
        p_width = max(b.prompt_ids.shape[1] for b in batches)
        r_width = max(b.response_ids.shape[1] for b in batches)

        def left(t, width, value):
            return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

        def right(t, width, value):
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        def optional(name, fn):
            values = [getattr(b, name) for b in batches]
            if all(v is None for v in values):
                return None
            if any(v is None for v in values):
                raise ValueError(f"RolloutBatch.concat: {name} is set in some batches and not in others")
            return torch.cat([fn(v) for v in values])

        def per_row(name):
            keys = [set(getattr(b, name)) for b in batches]
            if any(k != keys[0] for k in keys):
                raise ValueError(f"RolloutBatch.concat: {name} keys differ between batches: {[sorted(k) for k in keys]}")
            return {k: [v for b in batches for v in getattr(b, name)[k]] for k in keys[0]}

        groups, offset = [], 0
        for b in batches:
            shifted = b.group_index + offset if renumber_groups else b.group_index
            groups.append(shifted)
            if renumber_groups and len(b):
                offset = int(shifted.max()) + 1

        if any(bool(b.model_inputs) != bool(batches[0].model_inputs) for b in batches) and any(len(b) for b in batches):
            raise ValueError("RolloutBatch.concat: model_inputs are set in some batches and not in others")
        return cls(
            samples=[s for b in batches for s in b.samples],
            group_index=torch.cat(groups),
            prompt_ids=torch.cat([left(b.prompt_ids, p_width, pad_token_id) for b in batches]),
            prompt_mask=torch.cat([left(b.prompt_mask, p_width, 0) for b in batches]),
            response_ids=torch.cat([right(b.response_ids, r_width, pad_token_id) for b in batches]),
            response_mask=torch.cat([right(b.response_mask, r_width, 0) for b in batches]),
            responses=[r for b in batches for r in b.responses],
            truncated=torch.cat([b.truncated for b in batches]),
            model_inputs=[m for b in batches for m in b.model_inputs],
            policy_mask=optional("policy_mask", lambda t: right(t, r_width, 0)),
            loss_mask=optional("loss_mask", lambda t: right(t, r_width, 0)),
            old_log_probs=optional("old_log_probs", lambda t: right(t, r_width, 0)),
            ref_log_probs=optional("ref_log_probs", lambda t: right(t, r_width, 0)),
            rollout_log_probs=optional("rollout_log_probs", lambda t: right(t, r_width, 0)),
            reward_components=per_row("reward_components"),
            scores=optional("scores", lambda t: t),
            advantages=optional("advantages", lambda t: right(t, r_width, 0)),
            token_weights=optional("token_weights", lambda t: right(t, r_width, 0)),
            edited=optional("edited", lambda t: t),
            extras=per_row("extras"),
            # a reward may log a column for some parts only: None on the other parts' rows
            reward_logs={k: [v for b in batches for v in b.reward_logs.get(k, [None] * len(b))]
                         for k in dict.fromkeys(k for b in batches for k in b.reward_logs)},
        )
