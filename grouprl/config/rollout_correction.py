"""verl's rollout-correction keys and presets under ``algorithm.rollout_correction``, resolved to one setting.

``algorithm.rollout_correction`` has two spellings of the correction between the sampler's and
the trainer's log-probs:

- TRL's (``level``, ``mode``, ``clip_max``, ``clip_min``; grouprl's original keys): truncated or
  masked IS weights;
- verl's (0.9.1, ``RolloutCorrectionConfig``): ``rollout_is`` + ``rollout_is_threshold`` (TIS or
  IcePop weights), ``rollout_is_batch_normalize``, ``rollout_rs`` + ``rollout_rs_threshold``
  (rejection sampling), ``bypass_mode`` + ``loss_type``, or a ``preset`` naming one of verl's
  factory classmethods (``decoupled_geo_rs``, ``bypass_pg_is``, ...).

A verl key is "given" when it is not null. Once any verl key or a preset is given, verl's
spelling decides everything: no IS weights unless ``rollout_is`` says so, and the TRL keys must
keep their defaults (a changed one is a ConfigError naming both), so neither silently overrides
the other. A preset fills the keys its verl classmethod sets (with verl's default thresholds);
a key also given explicitly with another value is a ConfigError naming the preset and the key.
Keys neither given nor set by the preset take verl's dataclass defaults (``VERL_DEFAULTS``;
``rollout_is`` takes verl's YAML default, null). ``enable: false`` beside verl's keys is an error too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TIS, GEO, K3 = 2.0, "0.999_1.001", 0.01  # verl's default thresholds: IS upper bound, Geo-RS ratio bounds, K3 bound
_DECOUPLED = {"bypass_mode": False}  # the presets' names say decoupled; verl's default, made a conflict check


def _bypass(loss_type: str) -> dict[str, Any]:
    return {"bypass_mode": True, "loss_type": loss_type}


# verl 0.9.1 trainer/config/algorithm.py, RolloutCorrectionConfig's classmethods with their default arguments:
# the keys each one passes to the constructor.
VERL_PRESETS: dict[str, dict[str, Any]] = {
    "decoupled_token_is": {"rollout_is": "token", "rollout_is_threshold": TIS, "rollout_rs": None, **_DECOUPLED},
    "decoupled_seq_is": {"rollout_is": "sequence", "rollout_is_threshold": TIS, "rollout_rs": None, **_DECOUPLED},
    "decoupled_token_icepop": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0", "rollout_rs": None,
                               **_DECOUPLED},
    "decoupled_seq_is_rs": {"rollout_is": "sequence", "rollout_is_threshold": TIS, "rollout_rs": "seq_sum_k1",
                            "rollout_rs_threshold": "0.5_2.0", **_DECOUPLED},
    "decoupled_geo_rs": {"rollout_is": None, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": GEO, **_DECOUPLED},
    "decoupled_geo_rs_seq_tis": {"rollout_is": "sequence", "rollout_is_threshold": TIS, "rollout_rs": "seq_mean_k1",
                                 "rollout_rs_threshold": GEO, **_DECOUPLED},
    "decoupled_geo_rs_token_tis": {"rollout_is": "token", "rollout_is_threshold": TIS, "rollout_rs": "seq_mean_k1",
                                   "rollout_rs_threshold": GEO, **_DECOUPLED},
    "decoupled_k3_rs": {"rollout_is": None, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": K3, **_DECOUPLED},
    "decoupled_k3_rs_seq_tis": {"rollout_is": "sequence", "rollout_is_threshold": TIS, "rollout_rs": "seq_mean_k3",
                                "rollout_rs_threshold": K3, **_DECOUPLED},
    "decoupled_k3_rs_token_tis": {"rollout_is": "token", "rollout_is_threshold": TIS, "rollout_rs": "seq_mean_k3",
                                  "rollout_rs_threshold": K3, **_DECOUPLED},
    "bypass_ppo_clip": {"rollout_is": None, "rollout_rs": None, **_bypass("ppo_clip")},
    "bypass_ppo_clip_geo_rs": {"rollout_is": None, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": GEO,
                               **_bypass("ppo_clip")},
    "bypass_ppo_clip_k3_rs": {"rollout_is": None, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": K3,
                              **_bypass("ppo_clip")},
    "bypass_pg_is": {"rollout_is": "sequence", "rollout_is_threshold": TIS, "rollout_rs": None,
                     **_bypass("reinforce")},
    "bypass_pg_token_icepop": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0", "rollout_rs": None,
                               **_bypass("reinforce")},
    "bypass_pg_geo_rs": {"rollout_is": None, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": GEO,
                         **_bypass("reinforce")},
    "bypass_pg_geo_rs_seq_tis": {"rollout_is": "sequence", "rollout_is_threshold": TIS, "rollout_rs": "seq_mean_k1",
                                 "rollout_rs_threshold": GEO, **_bypass("reinforce")},
    "bypass_pg_geo_rs_token_tis": {"rollout_is": "token", "rollout_is_threshold": TIS, "rollout_rs": "seq_mean_k1",
                                   "rollout_rs_threshold": GEO, **_bypass("reinforce")},
    "disabled": {"rollout_is": None, "rollout_rs": None},  # metrics only
}
VERL_PRESET_NAMES = tuple(VERL_PRESETS)

# verl's RolloutCorrectionConfig defaults for what neither the user nor the preset set; rollout_is is
# the YAML default (null: no IS weights), not the dataclass's "sequence", which every preset overrides anyway.
VERL_DEFAULTS: dict[str, Any] = {"rollout_is": None, "rollout_is_threshold": TIS, "rollout_is_batch_normalize": False,
                                 "rollout_rs": None, "rollout_rs_threshold": None, "bypass_mode": False,
                                 "loss_type": "ppo_clip"}
VERL_KEYS = tuple(VERL_DEFAULTS)
# TRL's spelling and its defaults (schema.RolloutCorrectionConfig)
TRL_DEFAULTS: dict[str, Any] = {"level": "sequence", "mode": "mask", "clip_max": 3.0, "clip_min": None}


@dataclass(frozen=True)
class VerlRolloutCorrection:
    """verl's rollout correction, every field resolved (verl's names and meanings)."""

    rollout_is: str | None
    rollout_is_threshold: float | str
    rollout_is_batch_normalize: bool
    rollout_rs: str | None
    rollout_rs_threshold: float | str | None
    bypass_mode: bool
    loss_type: str


def _number_or_text(value: Any) -> Any:
    """A threshold read as text (the schema reads them as strings, so that "1_5" stays IcePop's bounds,
    not float's 15) back to a number when it is one plain number ("2.0" -> 2.0)."""
    if isinstance(value, str) and "_" not in value and "," not in value:
        try:
            return float(value)
        except ValueError:
            return value
    return value


def resolve_verl_correction(section, key: str = "algorithm.rollout_correction") -> VerlRolloutCorrection | None:
    """verl's setting from ``section`` (a ``RolloutCorrectionConfig``), or None when it gives no verl key
    and no preset (TRL's spelling then applies). ConfigError for the conflicts the module docstring names."""
    from grouprl.config.schema import ConfigError  # schema imports this module's preset names

    given = {k: _number_or_text(getattr(section, k)) for k in VERL_KEYS if getattr(section, k) is not None}
    if section.preset is None and not given:
        return None
    values = dict(VERL_DEFAULTS)
    if section.preset is not None:
        for k, v in VERL_PRESETS[section.preset].items():
            if k in given and given[k] != v:
                raise ConfigError(f"config key '{key}.{k}' is {given[k]!r}, but '{key}.preset' {section.preset} "
                                  f"sets it to {v!r}; drop one of them")
        values.update(VERL_PRESETS[section.preset])
    values.update(given)
    verl_key = f"{key}.preset" if section.preset is not None else f"{key}.{next(iter(given))}"
    changed = [k for k, default in TRL_DEFAULTS.items() if getattr(section, k) != default]
    if changed:
        raise ConfigError(f"config key '{key}.{changed[0]}' (TRL's spelling) cannot be combined with '{verl_key}' "
                          f"(verl's): use one spelling; verl's IS weights are rollout_is and rollout_is_threshold")
    if section.enable is False:
        raise ConfigError(f"config key '{key}.enable' is false, but '{verl_key}' asks for rollout correction; "
                          "drop one of them")
    return VerlRolloutCorrection(**values)
