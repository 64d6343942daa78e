"""Kinds of training run by name: the top-level ``kind`` key of a config file picks one.

A kind says how ``grouprl train`` turns the file's values into a validated config and
which trainer runs it. The core's ``grpo`` (the default, for a file without ``kind``)
is GRPO and its family on language and vision-language models; domains register
others (the diffusion plugin's ``flow``: Flow-GRPO on flow-matching image models).
Both parts may be ``"module:attr"`` references, imported when a run of that kind
starts, so that registering a kind imports nothing heavy (``flow`` needs diffusers only
when it runs, and its trainer then names the extra to install).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grouprl.config import ConfigError
from grouprl.registry import Registry, resolve

DEFAULT_KIND = "grpo"


@dataclass(frozen=True)
class TrainerKind:
    """``config``: values -> validated config (raises ConfigError); ``trainer``: config -> a trainer
    with ``train()``, ``is_main`` and its config's ``run_dir``. Either may be a ``"module:attr"``."""

    config: Callable[[dict], Any] | str
    trainer: Callable[[Any], Any] | str
    description: str = ""

    def build(self, values: dict) -> tuple[Any, Any]:
        """The config and the trainer for a config file's values (the ``kind`` key is the kind's, not the config's)."""
        config = resolve(self.config)({k: v for k, v in values.items() if k != "kind"})
        return config, resolve(self.trainer)(config)


TRAINER_KINDS: Registry[TrainerKind] = Registry("trainer kind", error=ConfigError)
TRAINER_KINDS.register(DEFAULT_KIND, TrainerKind(
    config="grouprl.config:config_from_dict", trainer="grouprl.trainer.grpo:GRPOTrainer",
    description="GRPO-family training of language and vision-language models"))


def register_trainer_kind(name: str, kind: TrainerKind | str, *, overwrite: bool = False) -> TrainerKind | str:
    """Make ``kind`` (or a ``"module:attr"`` reference to one) the run of config files with ``kind: name``."""
    return TRAINER_KINDS.register(name, kind, overwrite=overwrite)


def trainer_kind(values: dict) -> TrainerKind:
    """The kind a config file's values ask for (``kind``, default ``grpo``); ConfigError for an unknown one."""
    name = values.get("kind", DEFAULT_KIND)
    if not isinstance(name, str):
        raise ConfigError(f"config key 'kind' must be a name, one of {', '.join(TRAINER_KINDS.names())}; got {name!r}")
    return TRAINER_KINDS.get(name)
