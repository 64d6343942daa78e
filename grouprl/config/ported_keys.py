"""EasyR1's (and older EasyR1 seeds') config keys that grouprl's schema does not have: one table.

A config written for EasyR1 (``examples/config.yaml`` of hiyouga/EasyR1, or a seed built on
an older EasyR1) loads in grouprl. Every key of :data:`PORTED_KEYS` is taken out of the
values before they are built into the schema, and is handled in one of three ways:

- **mapped**: grouprl has the behaviour under its own key; the value is written there (a
  grouprl key the user set too, to a different value, is an error naming both keys unless
  the entry says EasyR1's key wins) and a note says so;
- **noted**: infrastructure grouprl does differently (FSDP knobs, Ray's node and GPU counts,
  padding-free kernels); the value is dropped with a note naming the key and what grouprl
  does instead;
- **refused**: a value whose meaning grouprl cannot honour and whose loss would change what
  the run computes (a custom chat template, sequence parallelism):
  a ConfigError naming the key and what to do. Each entry's ``refuse`` says why in a comment.

Notes are warnings on the ``grouprl.config.ported_keys`` logger, one line each, never silent. The entries
hold EasyR1's meaning (``easyr1``) and grouprl's (``grouprl``), so this table is also the
reference for porting a config by hand.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grouprl.config.schema import ConfigError

_MISSING = object()


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PortedKey:
    key: str  # EasyR1's dotted key; a section (worker.actor.fsdp) covers everything under it
    easyr1: str  # what it means in EasyR1
    grouprl: str  # what grouprl does instead (the note's text)
    # mapped keys: (value, all values) -> {grouprl dotted key: value}; None for a noted key
    convert: Callable[[Any, dict], dict[str, Any]] | None = None
    # (value, all values) -> the reason it cannot be honoured, or None when it can
    refuse: Callable[[Any, dict], str | None] | None = None
    overrides: bool = False  # the mapped value wins over the same grouprl key set by the user
    quiet_when: Callable[[Any], bool] | None = None  # values that need no note (EasyR1's "off")


def _get(values: dict, dotted: str, default: Any = _MISSING) -> Any:
    node: Any = values
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _pop(values: dict, dotted: str) -> Any:
    parts = dotted.split(".")
    node = _get(values, ".".join(parts[:-1])) if len(parts) > 1 else values
    if not isinstance(node, dict) or parts[-1] not in node:
        return _MISSING
    return node.pop(parts[-1])


def _set(values: dict, dotted: str, value: Any) -> None:
    node = values
    for part in dotted.split(".")[:-1]:
        node = node.setdefault(part, {})
    node[dotted.split(".")[-1]] = value


def _nonempty(reason: str) -> Callable[[Any, dict], str | None]:
    return lambda value, _: reason if value not in (None, "", {}, []) else None


def _val_override(value: Any, _: dict) -> dict[str, Any]:
    value = value or {}
    out = {}
    if "temperature" in value:
        out["worker.rollout.val_temperature"] = value["temperature"]
    if "top_p" in value:
        out["worker.rollout.val_top_p"] = value["top_p"]
    if "n" in value:
        out["worker.rollout.val_n"] = value["n"]
    return out


def _val_override_refuse(value: Any, _: dict) -> str | None:
    # Validation only: sampling settings other than temperature, top_p and n cannot be set apart
    # from training's; validation samples with no top_k (noted, not refused: it changes validation
    # scores, never what is trained).
    if value is not None and not isinstance(value, dict):
        return f"expects a mapping, got {value!r}"
    return None


def _filter_rounds(value: Any, values: dict) -> dict[str, Any]:
    return {"algorithm.max_filter_rounds": max(int(value) - 1, 0)}


def _filter_rounds_refuse(value: Any, values: dict) -> str | None:
    # -1 (no limit) would let a data set with no learnable group generate forever; grouprl bounds it.
    if isinstance(value, bool) or not isinstance(value, int):
        return f"expects an integer, got {value!r}"
    if value <= 0 and _get(values, "algorithm.online_filtering", False):
        return ("grouprl always bounds the generation rounds of online filtering; "
                "set a positive number (algorithm.max_filter_rounds = this - 1)")
    return None


def _resume_path(value: Any, _: dict) -> dict[str, Any]:
    return {} if value in (None, "") else {"trainer.resume": value}


def _find_last(value: Any, values: dict) -> dict[str, Any]:
    # EasyR1 reads load_checkpoint_path first, else the newest checkpoint under save_checkpoint_path
    if value is True and _get(values, "trainer.load_checkpoint_path", None) in (None, "") \
            and _get(values, "trainer.resume", None) is None:
        return {"trainer.resume": "auto"}
    return {}


def _disable_kl(value: Any, _: dict) -> dict[str, Any]:
    # EasyR1: no reference model and no KL term at all, whatever kl_coef and use_kl_loss say
    return {"algorithm.kl_coef": 0.0} if value is True else {}


def _old_kl_coef(value: Any, values: dict) -> dict[str, Any]:
    # EasyR1 before 0.3: actor.kl_loss_coef weighs the KL loss (use_kl_loss), algorithm.kl_coef the
    # KL in the reward; grouprl's single kl_coef takes whichever of the two the run uses.
    return {"algorithm.kl_coef": value} if _get(values, "worker.actor.use_kl_loss", False) is True else {}


_LOSS_AVG = {"token": "token-mean", "seq": "seq-mean-token-mean"}
_LOSS_TYPE = {"default": "vanilla", "gspo": "gspo", "cispo": "cispo", "sapo": "sapo"}
_LOGGERS = {"file": "jsonl", "console": "console", "tensorboard": "tensorboard", "wandb": "wandb", "jsonl": "jsonl"}


def _builtin_scorer(value: Any, always: bool = False) -> str | None:
    # EasyR1 0.2 named built-in scorers (math, r1v); grouprl has no scorers under those names, and a run
    # scored by something else trains toward something else: refused with what to write instead.
    if value is None or (not always and isinstance(value, str) and (":" in value or value.endswith(".py"))):
        return None
    return (f"EasyR1's built-in scorer {value!r} is not in grouprl; set worker.reward.reward_function to "
            "path/to/file.py:function (EasyR1's examples/reward_function/*.py work as they are)")


def _choice(table: dict, target: str) -> Callable[[Any, dict], dict[str, Any]]:
    return lambda value, _: {target: table[value]}


def _choice_refuse(table: dict) -> Callable[[Any, dict], str | None]:
    return lambda value, _: None if value in table else f"accepts one of {', '.join(table)}; got {value!r}"


def _gdpo(value: Any, _: dict) -> dict[str, Any]:
    if value != "gdpo":
        return {"algorithm.adv_estimator": value}
    return {"algorithm.adv_estimator": "grpo", "algorithm.multi_objective_aggregation": "normalize_then_sum"}


def _gdpo_refuse(value: Any, values: dict) -> str | None:
    given = _get(values, "algorithm.multi_objective_aggregation", None)
    if value == "gdpo" and given not in (None, "normalize_then_sum"):
        return f"gdpo means algorithm.multi_objective_aggregation: normalize_then_sum, but it is set to {given!r}"
    return None


def _loggers(value: Any, _: dict) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    return {"trainer.logger": list(dict.fromkeys(_LOGGERS.get(n, n) for n in names))}


def _note(key, easyr1, grouprl, refuse=None, quiet_when=None) -> PortedKey:
    return PortedKey(key, easyr1, grouprl, refuse=refuse, quiet_when=quiet_when)


def _map(key, easyr1, grouprl, convert, refuse=None, overrides=False) -> PortedKey:
    return PortedKey(key, easyr1, grouprl, convert=convert, refuse=refuse, overrides=overrides)


def _rename(key, target, easyr1) -> PortedKey:
    return _map(key, easyr1, f"read as {target}", lambda value, _: {target: value})


_LAUNCHER = "grouprl takes the process count from the launcher (torchrun / accelerate launch)"
_FSDP = ("grouprl shards with torch FSDP2 when worker.actor.strategy is fsdp and holds the reference "
         "policy as the actor's starting weights (or the actor with LoRA off); CPU offload is "
         "worker.actor.offload / worker.ref.offload")


def _cpu_offload(target: str) -> Callable[[Any, dict], dict[str, Any]]:
    # EasyR1 has two switches for one place: FSDP's own CPU offload (fsdp.enable_cpu_offload) and
    # moving the states out between phases (offload.offload_params); either keeps the weights off
    # the GPU while unused, so grouprl offloads when either is on (true wins over the other's false).
    return lambda value, _: {target: True} if value is True else {}


def _bool_refuse(value: Any, _: dict) -> str | None:
    return None if isinstance(value, bool) else f"expects true or false, got {value!r}"

PORTED_KEYS: tuple[PortedKey, ...] = (
    # ---------------------------------------------------------------- data
    _note("data.filter_overlong_prompts", "drop prompts longer than max_prompt_length before training",
          "grouprl does not filter: a prompt longer than data.max_prompt_length fails, naming the sample"),
    _note("data.filter_overlong_prompts_workers", "processes for filter_overlong_prompts",
          "grouprl does not filter prompts (see data.filter_overlong_prompts)"),
    _note("data.mini_rollout_batch_size", "prompts per generation round (verl's gen_batch_size)",
          "grouprl generates data.rollout_batch_size prompts per round", quiet_when=lambda v: v is None),
    _note("data.video_key", "record field with videos", "grouprl reads images only (data.image_key)",
          ),
    _note("data.video_fps", "frames per second sampled from videos", "grouprl reads images only"),
    # A chat template changes every prompt the policy sees: refused, not noted.
    _note("data.override_chat_template", "a chat template replacing the tokenizer's", "the tokenizer's own",
          refuse=_nonempty("grouprl uses the processor's own chat template; save the model with the template "
                           "you want"), quiet_when=lambda v: v is None),
    # ---------------------------------------------------------------- algorithm
    _map("algorithm.disable_kl", "no reference model and no KL, whatever kl_coef says",
         "true sets algorithm.kl_coef 0 (grouprl's KL is on when kl_coef > 0)", _disable_kl, overrides=True),
    _note("algorithm.lam", "GAE lambda", "grouprl has no GAE (no critic); unused",
          quiet_when=lambda v: v == 1.0),
    # An adaptive KL controller changes the KL weight over the run: refused.
    _note("algorithm.kl_type", "fixed or adaptive KL controller", "a fixed algorithm.kl_coef",
          refuse=lambda v, _: None if v == "fixed" else "grouprl has only a fixed KL coefficient (algorithm.kl_coef)",
          quiet_when=lambda v: v == "fixed"),
    _note("algorithm.kl_horizon", "adaptive KL controller", "unused (a fixed KL coefficient)"),
    _note("algorithm.kl_target", "adaptive KL controller", "unused (a fixed KL coefficient)"),
    # verl's GDPO reads its dimensions from the entries of compute_score's dict; grouprl's are the rewards
    # of worker.reward.functions, each with its weight: another choice of dimensions would train on
    # something else, so refused.
    _note("algorithm.gdpo_reward_keys", "verl: the reward dimensions GDPO normalises apart (compute_score's keys)",
          "each reward of worker.reward.functions is a dimension",
          refuse=_nonempty("grouprl's GDPO normalises each reward of worker.reward.functions apart; write each "
                           "dimension as its own reward function"), quiet_when=lambda v: v is None),
    _note("algorithm.gdpo_reward_weights", "verl: the weights of gdpo_reward_keys",
          "worker.reward.functions[i].weight",
          refuse=_nonempty("grouprl's GDPO weighs each reward by worker.reward.functions[i].weight"),
          quiet_when=lambda v: v is None),
    # ---------------------------------------------------------------- worker.actor
    _note("worker.actor.use_torch_compile", "torch.compile of the actor", "grouprl runs the actor eagerly"),
    # Sequence parallelism splits each sequence over GPUs; without it the micro-batch sizes the user
    # chose for that memory would fail late (out of memory): refused when > 1.
    _note("worker.actor.ulysses_size", "Ulysses sequence-parallel degree",
          "grouprl has no sequence parallelism; each process holds whole sequences",
          refuse=lambda v, _: None if v in (None, 1) else "grouprl has no sequence parallelism (use 1)"),
    _note("worker.actor.ulysses_sequence_parallel_size", "Ulysses sequence-parallel degree (EasyR1 < 0.3)",
          "grouprl has no sequence parallelism; each process holds whole sequences",
          refuse=lambda v, _: None if v in (None, 1) else "grouprl has no sequence parallelism (use 1)"),
    # before the section's note below, which takes whatever this leaves under worker.actor.fsdp
    _map("worker.actor.fsdp.enable_cpu_offload", "FSDP's own CPU offload of the actor's parameters, gradients "
         "and optimizer step", "true sets worker.actor.offload.offload_params (FSDP2's CPUOffloadPolicy)",
         _cpu_offload("worker.actor.offload.offload_params"), refuse=_bool_refuse, overrides=True),
    _note("worker.actor.fsdp", "FSDP sharding of the actor", _FSDP),
    _map("worker.actor.loss_avg_mode", "token: mean over all tokens; seq: mean per response, then over responses",
         "algorithm.loss_agg_mode (token-mean / seq-mean-token-mean)",
         _choice(_LOSS_AVG, "algorithm.loss_agg_mode"), refuse=_choice_refuse(_LOSS_AVG)),
    _map("worker.actor.loss_type", "policy loss: default (PPO clip), gspo, cispo",
         "algorithm.policy_loss (vanilla / gspo / cispo; their clip ranges are worker.actor.gspo / .cispo)",
         _choice(_LOSS_TYPE, "algorithm.policy_loss"), refuse=_choice_refuse(_LOSS_TYPE)),
    _rename("worker.actor.tau_positive", "worker.actor.sapo.tau_pos", "SAPO's gate temperature, positive advantages"),
    _rename("worker.actor.tau_negative", "worker.actor.sapo.tau_neg", "SAPO's gate temperature, negative advantages"),
    _rename("worker.actor.use_kl_loss", "algorithm.use_kl_loss", "KL as a loss term (EasyR1 < 0.3)"),
    _map("worker.actor.kl_loss_coef", "weight of the KL loss (EasyR1 < 0.3)",
         "algorithm.kl_coef when use_kl_loss", _old_kl_coef, overrides=True),
    _rename("worker.actor.kl_loss_type", "algorithm.kl_penalty", "KL estimator of the KL loss (EasyR1 < 0.3)"),
    _note("worker.actor.model.tokenizer_path", "tokenizer directory, default model_path",
          "grouprl loads the processor from worker.actor.model.model_path",
          # another tokenizer changes every token id: refused
          refuse=lambda v, vals: None if v in (None, _get(vals, "worker.actor.model.model_path", None))
          else "grouprl loads the tokenizer from worker.actor.model.model_path; save them together",
          quiet_when=lambda v: v is None),
    _note("worker.actor.model.override_config", "changes to the model's HF config", "the checkpoint's config",
          refuse=_nonempty("grouprl loads the checkpoint's config as saved; edit its config.json"),
          quiet_when=lambda v: not v),
    _note("worker.actor.model.lora.exclude_modules", "modules LoRA leaves out (e.g. .*visual.*)",
          "grouprl's LoRA leaves the vision tower out unless worker.actor.model.lora.include_vision"),
    # A warm-up counted in steps cannot become a ratio before the run's length is known: refused.
    _note("worker.actor.optim.lr_warmup_steps", "warm-up steps (over lr_warmup_ratio)",
          "worker.actor.optim.lr_warmup_ratio",
          refuse=lambda v, _: None if v is None else "grouprl's warm-up is worker.actor.optim.lr_warmup_ratio",
          quiet_when=lambda v: v is None),
    # ---------------------------------------------------------------- worker.rollout
    _map("worker.rollout.name", "rollout engine (vllm)", "worker.rollout.engine",
         lambda v, _: {"worker.rollout.engine": v}),
    _note("worker.rollout.seed", "vLLM's sampling seed", "grouprl seeds sampling from trainer.seed"),
    _note("worker.rollout.dtype", "vLLM's dtype", "the engine runs in worker.actor.model.dtype"),
    # Generating past EOS changes every response: refused.
    _note("worker.rollout.ignore_eos", "keep generating past EOS", "responses end at EOS",
          refuse=lambda v, _: "grouprl's responses end at EOS" if v else None, quiet_when=lambda v: not v),
    _note("worker.rollout.max_model_len", "vLLM's context length",
          "grouprl sizes it as data.max_prompt_length + data.max_response_length"),
    _note("worker.rollout.disable_log_stats", "vLLM's statistics logging", "grouprl logs its own rollout metrics"),
    _note("worker.rollout.disable_tqdm", "vLLM's progress bar", "grouprl shows none"),
    _map("worker.rollout.val_override_config", "sampling settings for validation (temperature, top_p, n, ...)",
         "temperature -> worker.rollout.val_temperature, top_p -> worker.rollout.val_top_p, "
         "n -> worker.rollout.val_n; validation samples with no top_k", _val_override, refuse=_val_override_refuse),
    # ---------------------------------------------------------------- worker.ref, worker.reward, worker
    # grouprl's reference is whole on each process, not sharded: offloaded, it moves to the accelerator
    # whole for its forward, where FSDP's offload streams one unit at a time (a higher peak, noted)
    _map("worker.ref.fsdp.enable_cpu_offload", "FSDP's own CPU offload of the reference model",
         "true sets worker.ref.offload.offload_params (the whole reference visits the accelerator for "
         "its forward, not one FSDP unit at a time)",
         _cpu_offload("worker.ref.offload.offload_params"), refuse=_bool_refuse, overrides=True),
    _note("worker.ref.fsdp", "FSDP sharding of the reference model", _FSDP),
    _note("worker.ref.strategy", "the reference model's parallelism", _FSDP),
    _note("worker.hybrid_engine", "actor and rollout share the GPUs (Ray)",
          "grouprl always generates and trains in the same processes"),
    _note("worker.critic", "the critic (GAE)", "grouprl has no critic; unused"),
    _note("worker.reward.skip_special_tokens", "decode responses without special tokens for scoring",
          "grouprl's rewards read responses decoded without special tokens"),
    _note("worker.reward.num_cpus", "Ray CPUs per reward worker", "grouprl scores in the training processes "
          "(worker.reward.timeout bounds a call)"),
    _map("worker.reward.score_function", "path/to/file.py:function scoring a response (EasyR1 0.3), or a "
         "built-in scorer's name (math, r1v; EasyR1 0.2)", "worker.reward.reward_function",
         lambda v, _: {"worker.reward.reward_function": v}, refuse=lambda v, _: _builtin_scorer(v)),
    _rename("worker.reward.score_function_kwargs", "worker.reward.reward_function_kwargs",
            "keyword arguments of score_function (EasyR1 0.3)"),
    # EasyR1 < 0.3's built-in scorers by name (math, r1v): grouprl ships them as files to point to.
    _note("worker.reward.compute_score", "a built-in scorer by name (math, r1v; EasyR1 < 0.3)", "none",
          refuse=lambda v, _: _builtin_scorer(v, always=True), quiet_when=lambda v: v is None),
    # ---------------------------------------------------------------- trainer
    _rename("trainer.total_episodes", "trainer.total_epochs", "passes over the training data (EasyR1 < 0.3)"),
    _note("trainer.nnodes", "Ray nodes", _LAUNCHER),
    _note("trainer.n_gpus_per_node", "GPUs per node", _LAUNCHER),
    _map("trainer.max_try_make_batch", "most generation rounds to fill a batch under online filtering (-1: no limit)",
         "algorithm.max_filter_rounds = this - 1 (rounds after the first); a batch still short then trains "
         "on the groups it has instead of failing", _filter_rounds, refuse=_filter_rounds_refuse),
    _note("trainer.critic_warmup", "steps training only the critic", "grouprl has no critic",
          quiet_when=lambda v: not v),
    _note("trainer.save_model_only", "checkpoints without optimizer state",
          "grouprl's checkpoints always hold the optimizer state (resumable); `grouprl export` writes the model"),
    _map("trainer.load_checkpoint_path", "the checkpoint to resume from", "a path sets trainer.resume", _resume_path),
    _map("trainer.find_last_checkpoint", "resume from the newest checkpoint under save_checkpoint_path",
         "trainer.resume: auto (when no path is given)", _find_last),
    _note("trainer.ray_timeline", "Ray's timeline file", "grouprl does not use Ray", quiet_when=lambda v: v is None),
    _note("trainer.remove_previous_ckpt", "delete the previous checkpoint when saving (EasyR1 < 0.3)",
          "trainer.save_limit keeps the newest checkpoints"),
    _note("trainer.remove_ckpt_after_load", "delete a checkpoint once resumed (EasyR1 < 0.3)",
          "grouprl keeps it (trainer.save_limit)"),
)

# Values of keys grouprl has too, read the way EasyR1 writes them.
PORTED_VALUES: tuple[PortedKey, ...] = (
    # verl's and NeMo-RL's GDPO is an estimator; in grouprl (and TRL) it is how several rewards are combined.
    _map("algorithm.adv_estimator", "gdpo (verl, NeMo-RL): each reward normalised in its group, then summed",
         "gdpo is adv_estimator grpo with algorithm.multi_objective_aggregation: normalize_then_sum",
         _gdpo, refuse=_gdpo_refuse),
    _map("trainer.logger", "console, file (generations to a JSON file), tensorboard, wandb, mlflow, swanlab",
         "file -> jsonl", _loggers),
    # EasyR1 writes null for "no floor"; grouprl's default 0.0 means the same.
    _map("worker.actor.optim.min_lr_ratio", "floor of the decayed lr, null = none", "null -> 0.0",
         lambda v, _: {"worker.actor.optim.min_lr_ratio": 0.0 if v is None else v}),
)


def _describe(entry: PortedKey, value: Any) -> str:
    shown = value if not isinstance(value, dict) else "{...}"
    return f"{entry.key}={shown!r}"


def port_values(values: dict, *, warn: bool = True) -> dict:
    """``values`` with every key of :data:`PORTED_KEYS` taken out (mapped or noted) and the EasyR1
    spellings of :data:`PORTED_VALUES` read; each note a warning on this module's logger (``warn``).

    Raises ConfigError listing every value grouprl cannot honour, and every mapped key whose
    grouprl key is set too, differently.
    """
    ported, notes = port_values_with_notes(values)
    if warn and os.environ.get("RANK", "0") == "0":  # once per run, not once per process (torchrun sets RANK)
        for note in notes:
            logger.warning("grouprl: %s", note)
    return ported


def port_values_with_notes(values: dict) -> tuple[dict, list[str]]:
    """(ported values, the notes, one line each) for ``values``; ``values`` itself is not changed."""
    original = values
    values = copy.deepcopy(values)
    notes: list[str] = []
    errors: list[str] = []
    mapped: dict[str, tuple[Any, PortedKey]] = {}
    entries = [(e, True) for e in PORTED_KEYS] + [(e, False) for e in PORTED_VALUES]
    for entry, foreign in entries:  # foreign: a key grouprl's schema does not have
        value = _get(values, entry.key)
        if value is _MISSING:
            continue
        if foreign:
            _pop(values, entry.key)
        if entry.refuse is not None and (reason := entry.refuse(value, original)):
            errors.append(f"'{entry.key}' ({entry.easyr1}): {reason}")
            continue
        if entry.convert is None:
            if entry.quiet_when is None or not entry.quiet_when(value):
                notes.append(f"config key {_describe(entry, value)}: accepted, not used: {entry.grouprl}")
            continue
        targets = entry.convert(value, original)
        for target, new in targets.items():
            given = _get(original, target)
            if foreign and given is not _MISSING and given != new and not entry.overrides:
                errors.append(f"'{entry.key}' means {target}={new!r}, but {target} is set to {given!r}; "
                              "keep one of them")
                continue
            if target in mapped and mapped[target][0] != new:
                errors.append(f"'{entry.key}' and '{mapped[target][1].key}' both set {target}, differently")
                continue
            mapped[target] = (new, entry)
            _set(values, target, new)
        if foreign:
            if targets:
                shown = ", ".join(f"{t}={v!r}" for t, v in targets.items())
                notes.append(f"config key {_describe(entry, value)} is EasyR1's; read as {shown}")
            else:
                notes.append(f"config key {_describe(entry, value)} is EasyR1's; nothing to set ({entry.grouprl})")
        elif value is not None and targets.get(entry.key) != value:
            notes.append(f"config key {_describe(entry, value)} is EasyR1's spelling; read as "
                         f"{entry.key}={targets[entry.key]!r} ({entry.grouprl})")
    if errors:
        raise ConfigError("config keys grouprl cannot honour: " + "; ".join(errors))
    return values, notes
