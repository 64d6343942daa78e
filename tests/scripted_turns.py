"""A policy turn forced in a test: a random tiny policy never writes a tool call, and what a dialogue test
checks is what the rollout does with one (tests/core/test_agents.py, tests/radiology/test_zoom_end_to_end.py)."""

from __future__ import annotations

import torch

from grouprl.models.inputs import end_of_turn_id, tokenizer_of
from grouprl.rollout.logprobs import compute_log_probs


class ScriptedFirstTurn:
    """The trainer's engine, except that a rollout's first turn is ``text`` (and its end-of-turn token)
    instead of sampled: a random tiny policy never writes a tool call, and what is under test is what the
    rollout does with one. Later turns are sampled by the real engine from the dialogue's context."""

    def __init__(self, engine, processor, text: str, model=None):
        self.engine, self.calls, self.model = engine, [], model
        tokenizer = tokenizer_of(processor)
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [end_of_turn_id(processor)]
        self.text = text

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, samples, params, prompts=None):
        batch = self.engine.generate(samples, params, prompts=prompts)
        self.calls.append(prompts)
        if prompts is None:
            rows = len(batch)
            batch.response_ids = torch.tensor([self.ids] * rows)
            batch.response_mask = torch.ones(rows, len(self.ids), dtype=torch.long)
            batch.policy_mask = None
            batch.responses = [self.text] * rows
            batch.truncated = torch.zeros(rows, dtype=torch.bool)
            batch.rollout_log_probs = None
            if params.return_log_probs:  # what a sampler reports for these tokens: the model's log-probs of them
                with torch.no_grad():
                    batch.rollout_log_probs = compute_log_probs(self.model, batch, micro_batch_size=rows)[0]
        return batch
