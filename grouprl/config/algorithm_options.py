"""The options of the run's advantage estimator and policy loss, as the algorithms declare them.

Each estimator and loss is registered with its options class (``grouprl.algorithms.options``).
A config sets them under ``algorithm.adv_estimator_options`` and ``algorithm.policy_loss_options``
by the names the class declares; an option the chosen algorithm does not take is a ConfigError
naming the option and the algorithm. The trainer passes the resolved options through unchanged.

Some options also have keys of their own from before (EasyR1's and verl's, which ported configs
use): ``worker.actor.clip_ratio_*`` for PPO's clip, ``worker.actor.gspo`` / ``cispo`` / ``sapo``,
``algorithm.adv_std_level`` / ``norm_adv_by_std_in_grpo``, ``algorithm.gamma``. ``OPTION_KEYS``
says which option each of those sets and for which algorithm; a value in the options mapping
overrides it. The registries are read here, at validation time, so plugins' algorithms count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grouprl.config.load import _coerce
from grouprl.config.schema import Config, ConfigError


def _key(path: str) -> Callable[[Config], Any]:
    """The value at a dotted config path."""
    def read(config: Config) -> Any:
        value: Any = config
        for part in path.split("."):
            value = getattr(value, part)
        return value

    read.path = path  # type: ignore[attr-defined]
    return read


_PPO_CLIP = {"clip_ratio_low": _key("worker.actor.clip_ratio_low"),
             "clip_ratio_high": _key("worker.actor.clip_ratio_high"),
             "clip_ratio_dual": _key("worker.actor.clip_ratio_dual")}
_GSPO = {"clip_ratio_low": _key("worker.actor.gspo.clip_ratio_low"),
         "clip_ratio_high": _key("worker.actor.gspo.clip_ratio_high")}

# (algorithm family, name) -> {option: how the older key gives it}
OPTION_KEYS: dict[tuple[str, str], dict[str, Callable[[Config], Any]]] = {
    ("policy_loss", "vanilla"): _PPO_CLIP,
    ("policy_loss", "gspo"): _GSPO,
    ("policy_loss", "gspo_token"): _GSPO,
    ("policy_loss", "cispo"): {"clip_ratio_low": _key("worker.actor.cispo.clip_ratio_low"),
                               "clip_ratio_high": _key("worker.actor.cispo.clip_ratio_high")},
    ("policy_loss", "sapo"): {"sapo_tau_pos": _key("worker.actor.sapo.tau_pos"),
                              "sapo_tau_neg": _key("worker.actor.sapo.tau_neg")},
    # the std level: adv_std_level, or norm_adv_by_std_in_grpo (EasyR1/verl) when that is unset
    ("adv_estimator", "grpo"): {"std_level": lambda c: c.algorithm.std_level},
    ("adv_estimator", "grpo_passk"): {"norm_by_std": lambda c: c.algorithm.std_level != "none"},
    ("adv_estimator", "reinforce_plus_plus"): {"gamma": _key("algorithm.gamma")},
}

_FAMILIES = {
    "adv_estimator": ("advantage estimator", "algorithm.adv_estimator_options"),
    "policy_loss": ("policy loss", "algorithm.policy_loss_options"),
}


def _options_class(family: str, name: str) -> type:
    from grouprl import algorithms  # registries are pluggable: read them when a config is checked

    if family == "policy_loss":
        return algorithms.policy_loss_options_class(name)
    return algorithms.advantage_estimator_options_class(name)


def resolve_options(config: Config, family: str, *, name: str | None = None) -> dict[str, Any]:
    """The options of the run's ``family`` algorithm (``adv_estimator`` or ``policy_loss``), or of
    algorithm ``name`` of that family when given (verl's bypass REINFORCE replaces the loss).

    Defaults of its options class, then the older keys that set one of its options
    (``OPTION_KEYS``), then ``algorithm.<family>_options``, each value checked against the
    option's declared type. ConfigError naming the key, the option and the algorithm for an
    option the algorithm does not take or a value of the wrong type.
    """
    import dataclasses
    import difflib
    from typing import get_type_hints

    from grouprl.algorithms.options import option_defaults

    kind, key = _FAMILIES[family]
    name = name if name is not None else getattr(config.algorithm, family)
    cls = _options_class(family, name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = get_type_hints(cls)
    options = option_defaults(cls)
    options.update({option: read(config) for option, read in OPTION_KEYS.get((family, name), {}).items()
                    if option in fields})
    for option, value in getattr(config.algorithm, f"{family}_options").items():
        if option not in fields:
            close = difflib.get_close_matches(option, list(fields), n=1)
            takes = f"its options are {', '.join(fields)}" if fields else "it takes no options"
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"config key '{key}.{option}': {kind} {name!r} takes no option {option!r} "
                              f"({takes}){hint}")
        hint_type = hints.get(option, Any)
        options[option] = value if hint_type is Any else _coerce(value, hint_type, f"{key}.{option}",
                                                                  fields[option].metadata.get("choices"))
    try:  # the options class may check its values (a range, a relation between two)
        cls(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config key '{key}': {kind} {name!r}: {exc}") from exc
    return options


def check_algorithm_options(config: Config) -> None:
    """The run's estimator and loss options resolve, and their values are ones the functions accept.

    A value a function would only reject at its first call (an unknown std level, a None
    where a bound is needed) is checked here, by calling nothing: the loss's own None rule and
    GRPO's std levels.
    """
    from grouprl.algorithms.advantages import STD_LEVELS
    from grouprl.algorithms.options import option_defaults

    estimator = resolve_options(config, "adv_estimator")
    level = estimator.get("std_level")
    if level is not None and level not in STD_LEVELS:
        raise ConfigError(f"config key 'algorithm.adv_estimator_options.std_level' accepts one of "
                          f"{', '.join(STD_LEVELS)}; got {level!r}")
    loss = resolve_options(config, "policy_loss")
    defaults = option_defaults(_options_class("policy_loss", config.algorithm.policy_loss))
    for option, value in loss.items():
        if value is None and defaults.get(option) is not None:
            raise ConfigError(f"config key 'algorithm.policy_loss_options.{option}': policy loss "
                              f"{config.algorithm.policy_loss!r} needs a number for {option}, got null")
