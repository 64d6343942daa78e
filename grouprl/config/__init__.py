"""Typed run configuration in the EasyR1/verl shape, read from YAML with dotted overrides.

    grouprl train config.yaml worker.rollout.n=5 algorithm.loss_agg_mode=seq-mean-token-sum-norm

- :mod:`~grouprl.config.schema`: the dataclasses, one per section; every key a user can
  write is a field there.
- :mod:`~grouprl.config.load`: YAML files, dotted overrides, building values into the
  schema (unknown keys fail with the closest valid ones) and writing a config back out.
- :mod:`~grouprl.config.checks`: checks across fields and against the registries.
- :mod:`~grouprl.config.ported_keys`: EasyR1's keys that grouprl's schema lacks, one table:
  each mapped onto grouprl's key, accepted with a one-line note, or refused with the reason.
- :mod:`~grouprl.config.trl_names`: TRL's ``GRPOConfig`` names and grouprl's keys, one table,
  read by the unknown-key error (``num_generations``: use ``worker.rollout.n``).

Everything is importable from ``grouprl.config`` itself. ``write_text_atomic`` is
:func:`grouprl.files.write_text_atomic`, kept here for the modules that import it from
this package.
"""

from grouprl.config.checks import validate
from grouprl.config.load import (
    ConfigValues,
    all_keys,
    build_config,
    config_from_dict,
    config_sources,
    load_config,
    merge_values,
    parse_overrides,
    port_hint,
    ported_name,
    read_config_values,
    redacted,
    save_config,
    suggest_keys,
    to_dict,
)
from grouprl.config.schema import (
    DEFAULT_VERIFIER_TEMPLATE,
    ActorConfig,
    AlgorithmConfig,
    CISPOConfig,
    Config,
    ConfigError,
    DataConfig,
    EntropyControlConfig,
    GSPOConfig,
    HealthConfig,
    LoraConfig,
    ModelConfig,
    OffPolicySequenceMaskingConfig,
    OptimConfig,
    OverlongConfig,
    RefConfig,
    RewardConfig,
    RewardFunctionConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    RunPaths,
    SAPOConfig,
    SFTConfig,
    StaticCacheConfig,
    TeacherConfig,
    TrainerConfig,
    VerifierConfig,
    MultiTurnConfig,
    WorkerConfig,
    choices,
)
from grouprl.files import write_text_atomic

__all__ = [
    "DEFAULT_VERIFIER_TEMPLATE",
    "ActorConfig",
    "AlgorithmConfig",
    "CISPOConfig",
    "Config",
    "ConfigError",
    "ConfigValues",
    "DataConfig",
    "EntropyControlConfig",
    "GSPOConfig",
    "HealthConfig",
    "LoraConfig",
    "ModelConfig",
    "OffPolicySequenceMaskingConfig",
    "OptimConfig",
    "OverlongConfig",
    "RefConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunPaths",
    "SAPOConfig",
    "SFTConfig",
    "StaticCacheConfig",
    "TeacherConfig",
    "TrainerConfig",
    "VerifierConfig",
    "MultiTurnConfig",
    "WorkerConfig",
    "all_keys",
    "build_config",
    "choices",
    "config_from_dict",
    "config_sources",
    "load_config",
    "merge_values",
    "parse_overrides",
    "port_hint",
    "ported_name",
    "read_config_values",
    "redacted",
    "save_config",
    "suggest_keys",
    "to_dict",
    "validate",
    "write_text_atomic",
]
