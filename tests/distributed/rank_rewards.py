"""Rewards for the two-process tests: one applies only on process 0, one everywhere."""

import os


def rank_zero_only(prompts, completions, **kwargs):
    """A score on process 0; None ("not applicable") for every row of process 1's shard."""
    if os.environ.get("RANK") == "1":
        return [None] * len(completions)
    return [float(len(c) % 3) for c in completions]


def text_length(prompts, completions, **kwargs):
    """Varies with the sampled text, so groups have a reward spread for dynamic sampling to keep."""
    return [(len(c) % 5) / 4 for c in completions]
