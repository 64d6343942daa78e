"""Rewards for the two-process tests, uneven across processes on purpose.

Process 0 gets a reward spread in every group; process 1 only in the groups of
prompts with an image, so under dynamic sampling it keeps fewer groups per round
than process 0, and one reward applies to none of its rows.
"""

import os
import zlib


def _varied(completion: str) -> float:
    # a stable function of the text (str hash() changes from process to process)
    return (zlib.crc32(completion.encode()) % 7) / 6


def rank_zero_only(prompts, completions, **kwargs):
    """A score on process 0; None ("not applicable") for every row of process 1's shard."""
    if os.environ.get("RANK") == "1":
        return [None] * len(completions)
    return [_varied(c) for c in completions]


def images_on_rank_one(prompts, completions, **kwargs):
    """On process 1, a spread for prompts with an image and a constant for text-only ones; 0 on process 0."""
    if os.environ.get("RANK") != "1":
        return [0.0] * len(completions)
    return [_varied(c) if "<image>" in p else 0.5 for p, c in zip(prompts, completions)]
