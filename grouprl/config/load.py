"""Reading a run configuration: YAML files, dotted command-line overrides, building and checking values.

    grouprl train config.yaml worker.rollout.n=5 algorithm.loss_agg_mode=seq-mean-token-sum-norm

Values are merged (file over ``base``, overrides over both) as plain dicts, then built
into the schema's dataclasses (:mod:`grouprl.config.schema`): an unknown key fails with
the closest valid keys, every value is checked against its field's type and choices.
Also the way back out: ``to_dict``, ``redacted`` (secrets removed) and ``save_config``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import difflib
import os
import re
import types
from pathlib import Path
from typing import Any, NamedTuple, Union, get_args, get_origin, get_type_hints

import yaml

from grouprl.config.checks import validate
from grouprl.config.schema import Config, ConfigError
from grouprl.files import write_text_atomic


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (leaves and sections)."""
    keys = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(all_keys(hints[f.name], key + "."))
    return keys


# The schema whose keys an unknown key is compared with: the language trainer's Config, or
# another root (the flow trainer's) while `build_config` builds one.
_SCHEMA_ROOT: contextvars.ContextVar[type] = contextvars.ContextVar("grouprl_config_schema_root")
# The unknown keys met while one config is built: all of them are reported in one error, so a
# config from elsewhere (EasyR1's) is not fixed one key per run. A bad value met meanwhile is
# kept (the first is raised once no key is unknown) so that the keys after it are read too.
_UNKNOWN: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("grouprl_config_unknown", default=None)
_BAD_VALUES: contextvars.ContextVar[list[ConfigError] | None] = contextvars.ContextVar("grouprl_config_bad",
                                                                                        default=None)
# Where each dotted key of the values being built came from ("config.yaml, line 3", "the command
# line"), while `config_sources` holds them: errors naming a key say where to fix it.
_SOURCES: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("grouprl_config_sources",
                                                                                  default=None)


def _suggestions(key: str) -> list[str]:
    valid = all_keys(_SCHEMA_ROOT.get(Config))
    leaf = key.rsplit(".", 1)[-1]
    near = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    # A right leaf name under the wrong section is the common mistake: suggest by leaf too.
    near += [k for k in valid if k.rsplit(".", 1)[-1] == leaf and k not in near][:3]
    return near


def _where(key: str) -> str:
    """`` in FILE, line N`` or `` from the command line`` for a key being built, else ""."""
    sources = _SOURCES.get() or {}
    found = sources.get(key) or sources.get(re.sub(r"\[\d+\]", "", key))  # functions[0].name: its list
    return f" {found}" if found else ""


@contextlib.contextmanager
def config_sources(values: dict):
    """While building ``values`` (from :func:`read_config_values`, which records where each key came
    from), a ConfigError that names a key says where it was set: in which file and line, or on the
    command line. Unknown keys are told so where the error is made; any other error naming a
    ``config key '...'`` (a bad value, a cross-field check, the trainer's own) is told so here."""
    sources = getattr(values, "sources", None) or {}
    token = _SOURCES.set(sources)
    try:
        yield
    except ConfigError as exc:
        message = str(exc)
        named = re.search(r"config key '([^']+)'", message)
        where = _where(named.group(1)) if named else ""
        if where and where not in message and len(exc.args) == 1:
            # the first key named is the one at fault; keep the error's type (a CheckpointError stays one)
            exc.args = (f"{message}{where.replace(' ', ' (', 1)})",)
        raise
    finally:
        _SOURCES.reset(token)


class PortedName(NamedTuple):
    """A key of another trainer's config, as grouprl reads it (:func:`ported_name`)."""

    key: str  # what to write: grouprl's key (TRL), or EasyR1's full key, which grouprl reads
    origin: str  # "TRL's GRPOConfig name" or "EasyR1's trainer.find_last_checkpoint"
    note: str  # how its values or meaning translate ("" when they do not differ)

    def describe(self) -> str:
        """E.g. ``TRL's GRPOConfig name: use worker.rollout.n``."""
        if self.origin.startswith("TRL"):
            return f"{self.origin}: use {self.key}" + (f"; {self.note}" if self.note else "")
        return f"{self.origin}: {self.note}"


def ported_name(key: str, root: type | None = None) -> PortedName | None:
    """What a key from another trainer's config is in grouprl, or None: ``key`` (dotted or bare)
    read against EasyR1's keys (:mod:`grouprl.config.ported_keys`, whose full names grouprl reads)
    and TRL's ``GRPOConfig`` names (:mod:`grouprl.config.trl_names`), e.g. ``num_generations`` ->
    ``worker.rollout.n``.

    The port tables come before spelling: ``num_generations`` is spelled like
    ``trainer.val_generations_to_log`` and ``beta`` like ``data``, and neither is meant. Order:
    an EasyR1 key that ``key`` is, or whose last two or more parts it is (``actor.loss_avg_mode``),
    then TRL's name for the last part, then an EasyR1 key with the same last part. A TRL entry whose
    grouprl key is not in ``root``'s schema (another trainer's config) is not offered.
    """
    from grouprl.config.ported_keys import PORTED_KEYS
    from grouprl.config.trl_names import BY_TRL_NAME

    valid = set(all_keys(root or _SCHEMA_ROOT.get(Config)))
    parts = key.split(".")
    leaf = parts[-1]

    def easyr1(entry) -> PortedName:
        return PortedName(entry.key, f"EasyR1's {entry.key}", entry.grouprl)

    if len(parts) > 1:
        for entry in PORTED_KEYS:
            if entry.key == key or entry.key.endswith("." + key):
                return easyr1(entry)
    trl = BY_TRL_NAME.get(leaf)
    if trl is not None and trl.key in valid:
        return PortedName(trl.key, "TRL's GRPOConfig name", trl.values)
    for entry in PORTED_KEYS:
        if entry.key.rsplit(".", 1)[-1] == leaf:
            return easyr1(entry)
    return None


def port_hint(key: str, root: type | None = None) -> str | None:
    """What ``key`` is called in grouprl (:func:`ported_name`), in words, or None."""
    found = ported_name(key, root)
    return None if found is None else found.describe()


def suggest_keys(key: str, root: type | None = None) -> list[str]:
    """The valid keys of ``root``'s schema (default: the language trainer's) closest to ``key`` in spelling."""
    token = _SCHEMA_ROOT.set(root or _SCHEMA_ROOT.get(Config))
    try:
        return _suggestions(key)
    finally:
        _SCHEMA_ROOT.reset(token)


def _unknown_key(key: str) -> ConfigError:
    return _unknown_keys([key])


def _unknown_keys(keys: list[str]) -> ConfigError:
    """One error for every unknown key (one line), each with where it came from (file and line, or
    the command line) and what it is in grouprl: its name in the port tables, else the closest valid keys."""
    if len(keys) == 1:
        port, where = port_hint(keys[0]), _where(keys[0])
        if port is not None:
            return ConfigError(f"unknown config key '{keys[0]}'{where} ({port})")
        near = _suggestions(keys[0])
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        return ConfigError(f"unknown config key '{keys[0]}'{where}{hint}")
    parts = []
    for key in keys:
        port, where = port_hint(key), _where(key)
        if port is not None:
            parts.append(f"'{key}'{where} ({port})")
            continue
        near = _suggestions(key)
        parts.append(f"'{key}'{where}" + (f" (did you mean {', '.join(near)}?)" if near else ""))
    return ConfigError(f"unknown config keys: {', '.join(parts)}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _not_nan(number: float, key: str) -> float:
    """``number``, unless NaN: no setting means "not a number", and NaN passes every range check
    (``nan < 0`` and ``nan >= 0`` are both false), so it is refused here, once for every key.
    Infinity is a value (a timeout, a norm that never clips); the range checks refuse it where it is not."""
    if math.isnan(number):
        raise ConfigError(f"config key '{key}' expects a number, got nan")
    return number


def _coerce(value: Any, tp: Any, key: str, choices: tuple | None = None) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        # each type is tried on its own: its errors (unknown keys included) raise, not collected
        unknown_token, bad_token = _UNKNOWN.set(None), _BAD_VALUES.set(None)
        try:
            for arg in args:
                if arg is type(None):
                    continue
                try:
                    return _coerce(value, arg, key, choices)
                except ConfigError as exc:
                    errors.append(str(exc))
        finally:
            _UNKNOWN.reset(unknown_token)
            _BAD_VALUES.reset(bad_token)
        raise ConfigError(errors[0] if len(errors) == 1 else f"config key '{key}': {value!r} is not a valid {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' is a section; expected a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is list:
        (item_tp,) = get_args(tp)
        if isinstance(value, str) and item_tp is str:
            # `data.train_files=a.jsonl,b.jsonl` on the command line
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' expects a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' expects a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}' expects true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}' expects an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML reads 1e-6 as a string (no dot); accept what float() accepts
            if isinstance(value, str):
                try:
                    number = float(value)
                except ValueError:
                    pass
                else:
                    return _not_nan(number, key)
            raise ConfigError(f"config key '{key}' expects a number, got {value!r}")
        return _not_nan(float(value), key)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"config key '{key}' expects a string, got {value!r}")
        value = str(value)
        if choices and value not in choices:
            raise ConfigError(f"config key '{key}' accepts one of {', '.join(choices)}; got {value!r}")
        return value
    raise ConfigError(f"config key '{key}': unsupported type {tp}")  # a schema bug, not a user error


def _build(cls: type, values: dict, prefix: str = ""):
    hints = get_type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    unknown = _UNKNOWN.get()
    for key, value in values.items():
        if key not in names:
            if unknown is None:
                raise _unknown_key(f"{prefix}{key}")
            unknown.append(f"{prefix}{key}")  # reported with the others once the whole config is read
            continue
        f = names[key]
        bad = _BAD_VALUES.get()
        try:
            kwargs[key] = _coerce(value, hints[key], f"{prefix}{key}", f.metadata.get("choices"))
        except ConfigError as exc:
            if bad is None:
                raise
            bad.append(exc)  # raised once every key is read, after the unknown ones
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{dotted}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """``["a.b=1", "c=x"]`` -> nested dict; values are parsed as YAML (``true``, ``3``, ``[a, b]``)."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        value = yaml.safe_load(raw) if raw.strip() else None
        _set_dotted(tree, key, value)
    return tree


def merge_values(base: dict, extra: dict) -> dict:
    """``extra`` over ``base``, nested sections merged key by key (neither is changed)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_values(out[key], value)
        else:
            out[key] = value
    return out


def build_config(root: type, values: dict):
    """``values`` checked against the dataclass schema ``root`` (types, choices, unknown keys with suggestions)."""
    token = _SCHEMA_ROOT.set(root)
    unknown: list[str] = []
    bad: list[ConfigError] = []
    unknown_token, bad_token = _UNKNOWN.set(unknown), _BAD_VALUES.set(bad)
    try:
        built = _build(root, values or {})
        if unknown:  # the unknown keys first: a bad value may come from a misplaced key
            raise _unknown_keys(unknown)
        if bad:
            raise bad[0]
        return built
    finally:
        _UNKNOWN.reset(unknown_token)
        _BAD_VALUES.reset(bad_token)
        _SCHEMA_ROOT.reset(token)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: where (line and column, 1-based) and what, without the quoted source."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    what = "; ".join(str(part) for part in (getattr(exc, "context", None), getattr(exc, "problem", None)) if part)
    what = what or " ".join(str(exc).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark is not None else what


class ConfigValues(dict):
    """A config's plain values, and ``sources``: where each dotted key (sections too) was set, as
    ``"in FILE, line N"`` or ``"from the command line"`` (what :func:`config_sources` reports)."""

    def __init__(self, values: dict, sources: dict[str, str]):
        super().__init__(values)
        self.sources = sources


def _yaml_lines(text: str) -> dict[str, int]:
    """Every dotted key of a YAML mapping and its (1-based) line; keys inside lists are left out."""
    lines: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                dotted = f"{prefix}{key_node.value}"
                lines[dotted] = key_node.start_mark.line + 1
                walk(value_node, dotted + ".")

    walk(yaml.compose(text, Loader=yaml.SafeLoader), "")
    return lines


def _dotted_paths(tree: dict, prefix: str = "") -> list[str]:
    paths = []
    for key, value in tree.items():
        paths.append(f"{prefix}{key}")
        if isinstance(value, dict):
            paths.extend(_dotted_paths(value, f"{prefix}{key}."))
    return paths


def read_config_values(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                       base: dict | None = None) -> ConfigValues:
    """The YAML file (optional) over ``base`` with dotted overrides applied, as a plain dict
    (a :class:`ConfigValues`, which also says where each key came from: the file and line, or
    the command line; keys of ``base`` have no source)."""
    values: dict = dict(base or {})
    sources: dict[str, str] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        try:
            text = path.read_text()
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(exc)}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        values = merge_values(values, loaded)
        sources.update({key: f"in {path}, line {line}" for key, line in _yaml_lines(text).items()})
    tree = parse_overrides(overrides or [])
    for key in _dotted_paths(tree):
        sources[key] = "from the command line"
    return ConfigValues(merge_values(values, tree), sources)


def config_from_dict(values: dict) -> Config:
    """The language trainer's Config from plain values: EasyR1's and the seeds' keys ported
    (:mod:`grouprl.config.ported_keys`, each noted), then built and validated."""
    from grouprl.config.ported_keys import port_values

    config = build_config(Config, port_values(values or {}))
    validate(config)
    return config


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None, base: dict | None = None) -> Config:
    """Read a YAML file (optional) over ``base`` and apply dotted overrides, then validate; an error
    naming a key says where it was set (the file and line, or the command line)."""
    values = read_config_values(path, overrides, base)
    with config_sources(values):
        return config_from_dict(values)


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def redacted(config: Config) -> dict:
    """The config as a dict for files and loggers: every field marked secret (API keys) is None."""
    return _without_secrets(to_dict(config), type(config))


def _without_secrets(values: dict, cls: type = Config) -> dict:
    """``values`` (``to_dict`` of a ``cls``) with every field marked secret set to None."""
    hints = get_type_hints(cls)
    out = dict(values)
    for f in dataclasses.fields(cls):
        if f.metadata.get("secret"):
            out[f.name] = None
        elif dataclasses.is_dataclass(hints[f.name]) and isinstance(out.get(f.name), dict):
            out[f.name] = _without_secrets(out[f.name], hints[f.name])
    return out


def save_config(config: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML, atomically, with secrets (API keys) left out."""
    write_text_atomic(Path(path), yaml.safe_dump(redacted(config), sort_keys=False))

