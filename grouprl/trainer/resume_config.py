"""Whether a checkpoint may be resumed under this run's config: the keys that change what trains, compared.

A checkpoint saves the resolved config it was trained with (``trainer_state.json``, under
``extra.config``). Resuming it under a config that trains something else (another model,
algorithm, reward or data) would splice two experiments into one run without a word, as when
two EasyR1 experiments share ``save_checkpoint_path`` with ``find_last_checkpoint: true``
(grouprl's ``trainer.resume: auto``): the second "resumes" the first. So such a resume is
refused, naming each differing key with both values, unless ``trainer.resume_if_config_changed``.

Every key counts except those that only say how a run is carried out, not what it trains:
where it writes and what it logs, when it validates and saves and stops (``trainer.max_steps``,
``trainer.total_epochs``), validation itself (every ``val_*`` key), micro-batch and chunk sizes
(memory only: the update's normalisers are global), the parallel strategy, and an engine's or a
server's transport settings (memory, timeouts, retries, addresses).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grouprl.config import ConfigError

# Keys (a section covers everything under it) that do not change what a run trains.
RUN_ONLY_KEYS: tuple[str, ...] = (
    # where the run writes, what it logs, when it validates, saves and stops
    "trainer.project_name", "trainer.experiment_name", "trainer.output_dir", "trainer.total_epochs",
    "trainer.max_steps", "trainer.max_wall_seconds", "trainer.logger", "trainer.save_freq", "trainer.save_limit",
    "trainer.save_checkpoint_path", "trainer.resume", "trainer.resume_if_config_changed", "trainer.log_rollouts",
    "trainer.log_completions", "trainer.device", "trainer.save_on_signal", "trainer.fail_on_unscored_steps",
    "trainer.distributed_timeout", "trainer.best_metric", "trainer.best_mode", "trainer.health",
    # memory and speed only: the same update, computed in other pieces or on other processes
    "worker.actor.log_prob_chunk_tokens", "worker.actor.padding_free", "worker.actor.dynamic_batching",
    "worker.actor.strategy", "worker.actor.model.enable_gradient_checkpointing",
    "worker.rollout.gpu_memory_utilization", "worker.rollout.enforce_eager", "worker.rollout.tensor_parallel_size",
    "worker.rollout.max_num_batched_tokens", "worker.rollout.enable_chunked_prefill",
    "worker.rollout.enable_sleep_mode", "worker.rollout.static_cache",
    "worker.actor.offload", "worker.ref.offload",  # where states wait (host memory or the GPU)
    # how a server is reached (a restarted job's reward server has another address), not what it scores
    "worker.reward.reward_server", "worker.reward.server_batch_size", "worker.reward.server_max_concurrency",
    "worker.reward.server_timeout", "worker.reward.server_retries", "worker.reward.timeout",
    "worker.rollout.verifier.base_url", "worker.rollout.verifier.api_key", "worker.rollout.verifier.timeout",
    "worker.rollout.verifier.max_retries", "worker.rollout.verifier.retry_backoff",
    "worker.rollout.verifier.http_concurrency",
    # `grouprl sft`'s settings: the warm start is done before an RL run's first step
    "sft",
    # the flow trainer's moving average of the weights: validation and export read it, the update does not
    "worker.actor.ema",
)


def _run_only(key: str) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    if leaf.startswith("val_") or leaf.startswith("micro_batch_size"):  # validation; memory
        return True
    return any(key == k or key.startswith(k + ".") for k in RUN_ONLY_KEYS)


def _flatten(values: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def training_changes(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` for each dotted key whose value differs between two
    configs (``redacted`` dicts) and that changes what trains (not in :data:`RUN_ONLY_KEYS`, no
    ``val_*`` or ``micro_batch_size*`` leaf). A key only one of them has (a grouprl version that
    added or dropped it) is not compared."""
    old, new = _flatten(saved), _flatten(current)
    return [(key, old[key], new[key]) for key in sorted(old.keys() & new.keys())
            if old[key] != new[key] and not _run_only(key)]


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_resume_config(checkpoint: Path, saved: dict | None, current: dict, *, allowed: bool) -> list[str]:
    """Refuse (ConfigError, one line) to resume ``checkpoint``, saved with the config ``saved``,
    under ``current`` when they differ in what trains, unless ``allowed``
    (``trainer.resume_if_config_changed``); then return the differences, one ``key: old -> new``
    each, for the caller to print. ``saved`` None (a checkpoint of an older grouprl): nothing to compare."""
    if saved is None:
        return []
    changes = [f"{key}: {_shown(old)} -> {_shown(new)}" for key, old, new in training_changes(saved, current)]
    if changes and not allowed:
        raise ConfigError(f"checkpoint {checkpoint} was trained with another config ({'; '.join(changes)}); "
                          "resume it with the config it was saved with, start afresh in another "
                          "trainer.save_checkpoint_path, or set trainer.resume_if_config_changed=true")
    return changes
