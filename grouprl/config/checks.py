"""Cross-field checks of a built Config: what one field's type cannot say (ranges, combinations, registry names).

The registries (advantage estimators, losses, engines) are pluggable, so they are read
when a config is checked, not when this module is imported.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from grouprl.config.schema import Config, ConfigError


def _check_name(key: str, value: str, registry) -> None:
    """``value`` is a name in ``registry`` (a :class:`grouprl.registry.Registry`, plugins' names included)."""
    known = registry.names()
    if value not in known:
        raise ConfigError(f"config key '{key}' accepts one of {', '.join(known)}; got {value!r}")


def _positive(key: str, value: int | float, allow_zero: bool = False) -> None:
    """``value`` > 0 (``allow_zero``: >= 0) and finite: written so that NaN fails too (``nan < 0`` is false),
    and no size, rate or coefficient means anything at infinity."""
    if not (math.isfinite(value) and (value > 0 or (value == 0 and allow_zero))):
        raise ConfigError(f"config key '{key}' must be {'>= 0' if allow_zero else '> 0'} and finite; got {value}")


def validate(config: Config) -> None:
    """Checks that need more than one field or a registry."""
    from grouprl import algorithms  # registries are pluggable, so read them at validation time
    from grouprl.rollout.engine import ROLLOUT_ENGINES

    algo, actor, rollout = config.algorithm, config.worker.actor, config.worker.rollout
    _check_name("algorithm.adv_estimator", algo.adv_estimator, algorithms.ADVANTAGE_ESTIMATORS)
    _check_name("algorithm.policy_loss", algo.policy_loss, algorithms.POLICY_LOSSES)
    _check_name("algorithm.loss_agg_mode", algo.loss_agg_mode, algorithms.LOSS_AGG_MODES)
    _check_name("algorithm.kl_penalty", algo.kl_penalty, algorithms.KL_ESTIMATORS)
    _check_name("worker.rollout.engine", rollout.engine, ROLLOUT_ENGINES)
    if algo.adv_std_level in ("group", "batch") and not algo.norm_adv_by_std_in_grpo:
        raise ConfigError(f"config key 'algorithm.adv_std_level' is {algo.adv_std_level} but "
                          "'algorithm.norm_adv_by_std_in_grpo' is false (no std); set one of them")
    if algo.adv_std_level == "batch" and algo.adv_estimator != "grpo":
        raise ConfigError(f"config key 'algorithm.adv_std_level': batch is for adv_estimator grpo; "
                          f"got {algo.adv_estimator!r}")
    from grouprl.config.algorithm_options import check_algorithm_options

    check_algorithm_options(config)
    if algo.multi_objective_aggregation == "normalize_then_sum" \
            and algo.adv_estimator not in algorithms.GROUP_RELATIVE_ESTIMATORS:
        raise ConfigError(f"config key 'algorithm.multi_objective_aggregation': normalize_then_sum normalises each "
                          f"reward within its group and needs a group-relative adv_estimator "
                          f"({', '.join(sorted(algorithms.GROUP_RELATIVE_ESTIMATORS))}); "
                          f"{algo.adv_estimator!r} has no group baseline")
    _positive("algorithm.kl_coef", algo.kl_coef, allow_zero=True)
    _check_losses_options(config)
    _positive("worker.rollout.n", rollout.n)
    _check_distillation(config)
    # pure distillation (a teacher, no reward) has no group to compare with: one response per prompt will do
    pure_distillation = algo.distilling and not has_reward(config)
    if rollout.n < 2 and algo.adv_estimator in algorithms.GROUP_RELATIVE_ESTIMATORS and not pure_distillation:
        raise ConfigError(f"config key 'worker.rollout.n' is {rollout.n}, but algorithm.adv_estimator "
                          f"'{algo.adv_estimator}' compares each response with the others of its group: with one "
                          "response per prompt every advantage is 0 and nothing trains; set n >= 2")
    if not (rollout.temperature > 0 and math.isfinite(rollout.temperature)):
        # the loss scores sampled tokens at the sampling temperature; greedy rollouts have none
        # (and give every response of a group the same text, so no group-relative signal)
        raise ConfigError(f"config key 'worker.rollout.temperature' must be > 0 and finite for training rollouts; "
                          f"got {rollout.temperature} (greedy decoding is for validation: worker.rollout.val_temperature)")
    _positive("worker.rollout.val_temperature", rollout.val_temperature, allow_zero=True)
    for key in ("top_p", "val_top_p"):
        if not 0 < getattr(rollout, key) <= 1:
            raise ConfigError(f"config key 'worker.rollout.{key}' must be in (0, 1]; got {getattr(rollout, key)}")
    _positive("worker.rollout.val_n", rollout.val_n)
    # Under a launcher (WORLD_SIZE set) the layout is the run's: checked here, at load. Without one the
    # config may only be read (an EasyR1 config as shipped, `grouprl plan`): the trainer checks it
    # before it loads anything, for its one process.
    if launch_world_size() is not None:
        check_tensor_parallel_layout(rollout.tensor_parallel_size, engine=rollout.engine,
                                     world_size=launch_world_size(),
                                     dialogues=rollout.verifier.enable or rollout.multi_turn.enabled)
    from grouprl.trainer.task_metrics import check_task_metric_names  # domains register task metrics

    check_task_metric_names(config.trainer.val_metrics)
    rollout.verifier.check("worker.rollout.verifier")
    rollout.multi_turn.check("worker.rollout.multi_turn")
    _check_dialogue_kind(rollout)
    config.trainer.health.check("trainer.health")
    if rollout.verifier.backend != "auto":
        from grouprl.config.verifier_backends import backend_names

        if rollout.verifier.backend not in backend_names():  # a domain may register more (reasoning: rule)
            raise ConfigError(f"config key 'worker.rollout.verifier.backend': unknown verifier backend "
                              f"{rollout.verifier.backend!r} (known: {', '.join(backend_names())}, or auto)")
    _positive("data.rollout_batch_size", config.data.rollout_batch_size)
    _positive("data.max_response_length", config.data.max_response_length)
    _positive("worker.actor.global_batch_size", actor.global_batch_size)
    _positive("worker.actor.micro_batch_size_per_device_for_update", actor.micro_batch_size_per_device_for_update)
    _positive("worker.actor.micro_batch_size_per_device_for_experience", actor.micro_batch_size_per_device_for_experience)
    _positive("worker.actor.log_prob_chunk_tokens", actor.log_prob_chunk_tokens, allow_zero=True)
    _positive("worker.actor.ppo_epochs", actor.ppo_epochs)
    _positive("worker.actor.optim.lr", actor.optim.lr, allow_zero=True)
    _positive("worker.actor.entropy_coeff", actor.entropy_coeff, allow_zero=True)
    actor.entropy_control.check("worker.actor.entropy_control")
    if config.data.rollout_batch_size % actor.global_batch_size:
        raise ConfigError(
            f"config key 'data.rollout_batch_size' ({config.data.rollout_batch_size}) must be a multiple of "
            f"'worker.actor.global_batch_size' ({actor.global_batch_size})"
        )
    model = actor.model
    if model.dtype == "float16":
        raise ConfigError("config key 'worker.actor.model.dtype': float16 training needs loss scaling, which "
                          "grouprl does not do; use bfloat16 (bf16 compute over fp32 master weights)")
    if actor.optim.strategy == "adamw_bf16" and model.dtype != "bfloat16":
        raise ConfigError("config key 'worker.actor.optim.strategy': adamw_bf16 keeps parameters and optimizer "
                          f"state in bf16 and needs 'worker.actor.model.dtype: bfloat16'; got {model.dtype!r}")
    if config.trainer.async_mode == "one_step_off" and algo.online_filtering:
        raise ConfigError("config key 'trainer.async_mode': one_step_off with 'algorithm.online_filtering' is not "
                          "supported yet (dynamic sampling agrees across processes while the next batch generates)")
    if actor.strategy == "fsdp" and model.lora.rank > 0:
        raise ConfigError("config key 'worker.actor.strategy': fsdp with LoRA ('worker.actor.model.lora.rank' > 0) "
                          "is not supported yet; LoRA adapters are small enough for ddp")
    if actor.offload.enabled and actor.strategy != "fsdp":
        key = "offload_params" if actor.offload.offload_params else "offload_optimizer"
        raise ConfigError(f"config key 'worker.actor.offload.{key}': CPU offload goes through FSDP2's "
                          f"CPUOffloadPolicy and needs 'worker.actor.strategy: fsdp' (launched with torchrun); "
                          f"got {actor.strategy!r}")
    if len(actor.optim.betas) != 2:
        raise ConfigError(f"config key 'worker.actor.optim.betas' needs two numbers; got {actor.optim.betas}")
    if config.worker.reward.functions and config.worker.reward.reward_function:
        raise ConfigError("set either 'worker.reward.functions' or 'worker.reward.reward_function', not both")
    if config.worker.reward.reward_type is not None and not config.worker.reward.reward_function:
        raise ConfigError(f"config key 'worker.reward.reward_type' ({config.worker.reward.reward_type}) says how "
                          "'worker.reward.reward_function' is called, and that key is not set (the functions of "
                          "'worker.reward.functions' are told apart by their signature and file)")
    _check_mean_filter(config)
    _check_verl_rollout_correction(config)
    check_best(config.trainer)
    if config.worker.reward.timeout is not None and not config.worker.reward.timeout > 0:
        raise ConfigError(f"config key 'worker.reward.timeout' must be seconds > 0 or null (no limit); "
                          f"got {config.worker.reward.timeout}")
    for i, fn in enumerate(config.worker.reward.functions):
        if not fn.name:
            raise ConfigError(f"config key 'worker.reward.functions[{i}].name' is empty")
    if config.trainer.resume not in (None, "auto") and not Path(config.trainer.resume).exists():
        raise ConfigError(f"config key 'trainer.resume': no checkpoint at {config.trainer.resume}")
    _check_loggers(config)


def has_reward(config: Config) -> bool:
    """Whether the run has a reward: in-process functions, EasyR1's reward_function or a reward server."""
    r = config.worker.reward
    return bool(r.functions or r.reward_function or r.reward_server)


def _check_distillation(config: Config) -> None:
    """``algorithm.teacher`` and ``algorithm.distill_coef``; without a reward (pure distillation) the
    options that read rewards are refused, as they would act on no score."""
    algo = config.algorithm
    if not algo.distilling:
        if algo.distill_coef is not None:
            raise ConfigError(f"config key 'algorithm.distill_coef' ({algo.distill_coef}) weighs the teacher's "
                              "advantage, and no teacher is set: set 'algorithm.teacher.model_path'")
        return
    if not algo.teacher.model_path:
        raise ConfigError("config key 'algorithm.teacher.model_path' is empty; give the teacher's model directory")
    if algo.distill_coef is not None:
        _positive("algorithm.distill_coef", algo.distill_coef, allow_zero=True)
    if has_reward(config):
        return
    if algo.distill_coef == 0:
        raise ConfigError("config key 'algorithm.distill_coef' is 0 and the run has no reward "
                          "('worker.reward.functions'): nothing would train; give a coefficient > 0 or a reward")
    for key, on in (("algorithm.online_filtering", algo.online_filtering),
                    ("algorithm.overlong_buffer.enable", algo.overlong_buffer.enable),
                    ("algorithm.filter_key", algo.mean_filter is not None)):
        if on:
            raise ConfigError(f"config key '{key}' acts on rewards, and this run has none (pure distillation from "
                              "'algorithm.teacher'); set a reward in 'worker.reward.functions' or turn it off")


def _check_losses_options(config: Config) -> None:
    """Off-policy sequence masking's threshold, and the unbiased KL's preconditions."""
    algo = config.algorithm
    if algo.off_policy_sequence_masking.delta is not None:
        _positive("algorithm.off_policy_sequence_masking.delta", algo.off_policy_sequence_masking.delta)
    if algo.unbiased_kl and not (algo.use_kl_loss and algo.kl_coef > 0):
        raise ConfigError("config key 'algorithm.unbiased_kl' weighs the KL loss term, and this run has none: "
                          "it needs 'algorithm.use_kl_loss: true' and 'algorithm.kl_coef' > 0 "
                          f"(got use_kl_loss {algo.use_kl_loss}, kl_coef {algo.kl_coef})")


def _check_loggers(config: Config) -> None:
    """trainer.logger names registered loggers whose packages are installed (checked before the model
    loads, not when the logger starts); trainer.log_samples_freq is -1 or a number of steps."""
    from grouprl.errors import check_installed
    from grouprl.trainer.trackers import LOGGERS

    t = config.trainer
    for name in t.logger:
        _check_name("trainer.logger", name, LOGGERS)
        backend = LOGGERS.get(name)
        if backend.package is not None:
            check_installed(backend.package, extra=backend.extra,
                            needed_by=f"config key 'trainer.logger' (it includes {name})")
    if t.log_samples_freq != -1 and t.log_samples_freq < 1:
        raise ConfigError("config key 'trainer.log_samples_freq' is a number of steps >= 1, or -1 for no samples; "
                          f"got {t.log_samples_freq}")
    if t.log_samples_rows < 1:
        raise ConfigError(f"config key 'trainer.log_samples_rows' must be >= 1; got {t.log_samples_rows}")


def check_best(trainer) -> None:
    """``trainer.best_metric`` / ``trainer.best_mode`` (a ``TrainerConfig``, of any trainer kind): a mode
    needs a metric, the metric is a validation key, and the run validates at all."""
    if trainer.best_mode is not None and trainer.best_metric is None:
        raise ConfigError(f"config key 'trainer.best_mode' ({trainer.best_mode}) says how 'trainer.best_metric' "
                          "ranks validations, and that key is not set (name a validation metric, e.g. "
                          "val/reward/mean@1)")
    if trainer.best_metric is None:
        return
    if not trainer.best_metric.startswith("val/"):
        raise ConfigError(f"config key 'trainer.best_metric' must be a validation metric as metrics.jsonl names it, "
                          f"starting with val/ (e.g. val/reward/mean@1); got {trainer.best_metric!r}")
    if trainer.val_freq <= 0 and not trainer.val_before_train and not trainer.val_only:
        raise ConfigError(f"config key 'trainer.best_metric' ({trainer.best_metric}) ranks validations, and the run "
                          f"never validates ('trainer.val_freq' is {trainer.val_freq}, 'trainer.val_before_train' "
                          "false); set trainer.val_freq")


def _check_mean_filter(config: Config) -> None:
    """EasyR1's online filtering keys: filter_low < filter_high, and filter_key names a reward component
    (or may name a part of a user reward's score: those parts are known once it has scored, and the
    trainer checks them then)."""
    algo, reward = config.algorithm, config.worker.reward
    rule = algo.mean_filter
    if rule is None:
        return
    key, low, high = rule
    if not low < high:
        raise ConfigError(f"config keys 'algorithm.filter_low' ({low}) and 'algorithm.filter_high' ({high}): "
                          "online filtering keeps groups whose mean lies strictly between them; need low < high")
    if not key.strip():
        raise ConfigError("config key 'algorithm.filter_key' is empty; name a reward component (e.g. overall)")
    if not algo.online_filtering:
        return  # EasyR1's example config sets all three with filtering off: nothing reads them
    names = [reward.reward_function.strip()] if reward.reward_function else [f.name.strip() for f in reward.functions]
    # the keys a reward set gives them (grouprl.rewards.contract.reward_keys, a layer below config)
    known = ["overall", *(f"{n}@{i}" if names.count(n) > 1 else n for i, n in enumerate(names))]
    if reward.reward_server:
        known.append("reward_server")
    if algo.overlong_buffer.enable:
        known.append("overlong")
    # a function from a file or module may be an EasyR1 reward, whose score has parts (format, accuracy)
    user_functions = reward.reward_type is not None or any(":" in n or n.endswith(".py") for n in names)
    if key not in known and not user_functions:
        raise ConfigError(f"config key 'algorithm.filter_key': {key!r} names no reward component; the run's "
                          f"components are {', '.join(known)} (parts such as accuracy come from an EasyR1 "
                          "reward function's scores)")


def _check_verl_rollout_correction(config: Config) -> None:
    """verl's rollout-correction keys (``grouprl.config.rollout_correction``): conflicts, thresholds, bypass loss."""
    from grouprl import algorithms
    from grouprl.config.rollout_correction import resolve_verl_correction

    key = "algorithm.rollout_correction"
    verl = resolve_verl_correction(config.algorithm.rollout_correction, key)
    if verl is None:
        return
    if verl.rollout_is is not None:
        try:
            algorithms.parse_is_threshold(verl.rollout_is_threshold)
        except ValueError as exc:
            raise ConfigError(f"config key '{key}.rollout_is_threshold': {exc}") from None
    elif verl.rollout_is_batch_normalize:
        raise ConfigError(f"config key '{key}.rollout_is_batch_normalize' normalises IS weights, and "
                          f"'{key}.rollout_is' is null (no IS weights); set rollout_is or drop it")
    if verl.rollout_rs is not None:
        try:
            options = algorithms.parse_rs_options(verl.rollout_rs)
            algorithms.parse_rs_thresholds(options, verl.rollout_rs_threshold)
        except ValueError as exc:
            raise ConfigError(f"config key '{key}.rollout_rs': {exc}") from None
    if verl.bypass_mode and config.algorithm.off_policy_sequence_masking.delta is not None:
        raise ConfigError(f"config key 'algorithm.off_policy_sequence_masking.delta': off-policy sequence masking "
                          f"is not supported with '{key}.bypass_mode' yet (bypass corrects in its own loss); "
                          "use a decoupled preset, or rollout_rs for verl's rejection")
    if verl.loss_type == "reinforce":
        if not verl.bypass_mode:
            raise ConfigError(f"config key '{key}.loss_type' reinforce is bypass mode's loss; "
                              f"set '{key}.bypass_mode: true' or loss_type ppo_clip")
        if config.algorithm.policy_loss not in ("vanilla", "reinforce"):
            raise ConfigError(f"config key '{key}.loss_type' reinforce replaces the policy loss, and "
                              f"'algorithm.policy_loss' is {config.algorithm.policy_loss!r}; use loss_type ppo_clip "
                              "(the configured loss with ratio pi_theta / pi_rollout) or drop policy_loss")


# ---------------------------------------------------------------- tensor-parallel rollouts (docs/engines.md)
TP_KEY = "worker.rollout.tensor_parallel_size"
TP_ENGINES = ("vllm",)  # the engines that run tensor-parallel: only vLLM shards a model across processes


def launch_world_size(environ: dict[str, str] | None = None) -> int | None:
    """The number of training processes the launcher started (``WORLD_SIZE``; torchrun, accelerate), or None.

    None when no launcher set it: a plain ``python``/``grouprl`` process, or a tool that
    only reads the config (``grouprl plan``), where the layout is checked later, against
    the process group the run actually has.
    """
    value = (os.environ if environ is None else environ).get("WORLD_SIZE")
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        return None


def check_tensor_parallel_layout(tensor_parallel_size: int, *, engine: str, world_size: int | None,
                                 dialogues: bool = False) -> None:
    """Refuse a tensor-parallel layout that cannot run, with one line naming the key (ConfigError).

    ``tp`` must be >= 1; ``tp > 1`` needs the vllm engine and single-call rollouts (a
    multi-turn dialogues make a different number of ``generate`` calls on each process,
    and a group's processes must call together); with ``world_size`` known, ``tp`` must
    be at most ``world_size`` and divide it (``world_size = tp * groups``).
    """
    tp = tensor_parallel_size
    if tp < 1:
        raise ConfigError(f"config key '{TP_KEY}' must be >= 1; got {tp}")
    if tp == 1:
        return
    if engine not in TP_ENGINES:
        raise ConfigError(f"config key '{TP_KEY}' is {tp}, but worker.rollout.engine {engine!r} samples on one device "
                          f"per process; tensor-parallel rollouts need worker.rollout.engine: vllm")
    if dialogues:
        raise ConfigError(f"config key '{TP_KEY}' is {tp}, but multi-turn dialogues (worker.rollout.verifier or "
                          "worker.rollout.multi_turn) take turns that differ by process, and the processes of a "
                          "tensor-parallel group must generate together; use tensor_parallel_size: 1 with them")
    if world_size is None:
        return
    if tp > world_size:
        raise ConfigError(f"config key '{TP_KEY}' is {tp}, more than the {world_size} training process(es): a "
                          f"tensor-parallel group is made of training processes (launch at least {tp})")
    if world_size % tp:
        raise ConfigError(f"config key '{TP_KEY}' ({tp}) must divide the number of training processes ({world_size}): "
                          "each group of tp consecutive processes runs one vLLM engine")


def _check_dialogue_kind(rollout) -> None:
    """One environment per run's dialogues: the verifier (``worker.rollout.verifier``, its own keys) or
    ``worker.rollout.multi_turn``'s; tools may go with either."""
    multi = rollout.multi_turn
    named = [multi.environment] + list(multi.environments.values())
    if "verifier" in named and not rollout.verifier.enable:
        raise ConfigError("config key 'worker.rollout.multi_turn.environment' names the verifier, which is set and "
                          "turned on by 'worker.rollout.verifier' (enable: true, its backend and limits); set those "
                          "and leave the environment out")
    if rollout.verifier.enable and (multi.environment or multi.environments):
        raise ConfigError("config key 'worker.rollout.multi_turn.environment' is set and so is "
                          "'worker.rollout.verifier.enable': the verifier is the run's environment; set one of them")
