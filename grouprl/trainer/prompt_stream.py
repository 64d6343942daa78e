"""The order in which training prompts are visited, resumable at any batch."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PromptStream:
    """Yields batches of prompts epoch after epoch, in a seeded order per epoch.

    The order of epoch e depends only on (seed, e), so a run resumed at
    (epoch, batch_in_epoch) sees exactly the prompts an uninterrupted run would.
    Under data parallelism each process takes every ``world_size``-th prompt of the
    global batch, so the processes together cover it once.
    """

    def __init__(self, dataset: Sequence, batch_size: int, *, seed: int, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1):
        if batch_size > len(dataset):
            raise ValueError(f"data.rollout_batch_size ({batch_size}) is larger than the dataset ({len(dataset)} records)")
        if batch_size % world_size:
            raise ValueError(f"data.rollout_batch_size ({batch_size}) must be divisible by the number of processes ({world_size})")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.batch_in_epoch = 0

    @property
    def batches_per_epoch(self) -> int:
        # the last partial batch is dropped so every step has the same shape
        return len(self.dataset) // self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def next_batch(self) -> list:
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
        order = self._order(self.epoch)
        start = self.batch_in_epoch * self.batch_size
        indices = order[start:start + self.batch_size][self.rank::self.world_size]
        self.batch_in_epoch += 1
        return [self.dataset[int(i)] for i in indices]

    def state(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
