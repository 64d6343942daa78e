"""Rollout transforms: steps that rewrite a RolloutBatch after generation and before rewards.

A transform is a callable ``transform(batch) -> batch`` (EditGRPO's post-rollout edits
are one). It may report ``last_metrics`` (a dict), with ``metric_kinds`` naming the
keys that are counts to sum across processes (the rest are means weighted by rows), and
set ``group_local = True`` when it works group by group (then it can run on rollout
micro-batches in the asynchronous modes).

Domains register *factories* by name: ``factory(config, *, processor, engine)`` returns
the transform that ``config`` asks for, or None when the config leaves it off. The keys
a factory reads stay where the seeds' users write them (``worker.rollout.extractor*``
for EditGRPO); the trainer asks every registered factory and keeps what they build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from grouprl.config import ConfigError
from grouprl.registry import Registry

if TYPE_CHECKING:  # for the types only: a plugin registering a transform need not import torch
    from grouprl.rollout.batch import RolloutBatch

RolloutTransform = Callable[["RolloutBatch"], "RolloutBatch"]
TransformFactory = Callable[..., "RolloutTransform | None"]

ROLLOUT_TRANSFORMS: Registry[TransformFactory] = Registry("rollout transform", error=ConfigError)


def register_rollout_transform(name: str, factory: TransformFactory | str | None = None):
    """Register a transform factory (or a ``"module:attr"`` reference to one); a decorator without ``factory``."""
    return ROLLOUT_TRANSFORMS.register(name, factory)


def build_rollout_transforms(config, *, processor, engine) -> list[RolloutTransform]:
    """The transforms ``config`` turns on, in the order their factories were registered by name."""
    built = []
    for _, factory in ROLLOUT_TRANSFORMS.items():
        transform = factory(config, processor=processor, engine=engine)
        if transform is not None:
            built.append(transform)
    return built
