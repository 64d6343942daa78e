"""GRPO-family training: one step read top to bottom in ``GRPOTrainer.step`` and ``GRPOTrainer.rollout``.

    prompts -> engine.generate (n per prompt, a micro-batch at a time) -> RolloutBatch
            -> rollout transforms -> rewards -> (dynamic sampling) -> old / ref log-probs
            -> advantages -> run_update (PPO epochs over mini-batches of micro-batches)
            -> rollout copy refreshed -> logs, checkpoint

The run around the steps (resume, save, metric reduction, writers, validation cadence, the
one-step-off prefetcher) is ``trainer.loop.TrainingLoop``'s. Every process runs the same steps
on its own shard of the prompts and holds the same number of rows at the update; metrics are
reduced across processes by kind (``trainer.metrics``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from grouprl import algorithms
from grouprl.config import Config, ConfigError
from grouprl.config.algorithm_options import resolve_options
from grouprl.config.rollout_correction import resolve_verl_correction
from grouprl.rewards import RewardResult
from grouprl.rollout.batch import RolloutBatch
from grouprl.rollout.transforms import RolloutTransform
from grouprl.trainer.entropy_control import STATE_KEY as ENTROPY_STATE
from grouprl.trainer.entropy_control import EntropyControl
from grouprl.trainer.loop import StepResult, TrainingLoop, check_output_dirs
from grouprl.trainer.metrics import StepMetrics
from grouprl.trainer.parallel import batch_moments, full_named_parameters, mark
from grouprl.trainer.policy import build_optimizer, build_scheduler, setup_policy
from grouprl.trainer.prompt_stream import PromptStream
from grouprl.trainer.reward_advantages import reward_advantages
from grouprl.trainer.reward_metrics import join_results, record_rewards
from grouprl.trainer.rollout_correction import bypass_old_log_probs, correct_decoupled
from grouprl.trainer.rollout_correction import record as record_correction
from grouprl.trainer.task_metrics import validation_task_metrics
from grouprl.trainer.update import Normalisers, UpdateSettings, run_update
from grouprl.trainer.val_metrics import group_rows, record_val_metrics


def reference_model_needed(config: Config) -> bool:
    """Whether the run loads a separate reference model: a KL term and no LoRA (with LoRA the reference
    is the policy with its adapters off: no second copy). ``grouprl plan`` asks the same question."""
    return config.algorithm.kl_coef > 0 and config.worker.actor.model.lora.rank <= 0


def rollout_weights(engine_owns_weights: bool, precision_rollout_copy: bool, *, sharded: bool,
                    async_mode: str) -> tuple[bool, bool]:
    """``(holds_weights, copy_here)``: whether generation samples from weights of its own, and whether
    grouprl holds that copy itself (not an engine that loads its own, vLLM). ``grouprl plan`` uses it too.

    A copy when the policy's own weights cannot serve: fp32 masters (sampling from a bf16 copy reads half
    the bytes per token), an FSDP policy (its forward passes are collectives that generation cannot keep in
    step), one_step_off (generation samples while the policy trains), or an engine that loads its own.
    """
    holds = engine_owns_weights or precision_rollout_copy or sharded or async_mode == "one_step_off"
    return holds, holds and not engine_owns_weights


def build_rewards(config: Config, *, optional: bool = False, environment_parts: list[str] = ()):
    """The run's RewardSet; with none configured, None when ``optional`` (pure distillation), else a ConfigError.

    ``environment_parts``: the reward parts the run's environments declare
    (:func:`grouprl.rollout.multiturn.dialogue_parts`), each one more component under its own name,
    weighted by ``worker.rollout.multi_turn.reward_weights`` (default 1)."""
    from grouprl.rewards import RewardComponent, RewardLoadError, RewardSet, RewardSpec

    r = config.worker.reward
    if r.reward_function:
        specs = [RewardSpec(name=r.reward_function, weight=1.0, kwargs=dict(r.reward_function_kwargs))]
    else:
        specs = [RewardSpec(name=f.name, weight=f.weight, kwargs=dict(f.kwargs), on_error=f.on_error)
                 for f in r.functions]
    try:
        # reward_type (EasyR1's key) says how its reward_function is called; functions' by their signature
        reward_type = r.reward_type if r.reward_function else None
        rewards = RewardSet.from_specs(specs, timeout=r.timeout, reward_type=reward_type) if specs else None
    except RewardLoadError as exc:  # the message names the reward; say where it was set
        key = "worker.reward.reward_function" if r.reward_function else "worker.reward.functions"
        raise RewardLoadError(f"config key '{key}': {exc}") from exc
    if r.reward_server:
        from grouprl.rewards.registry import REWARD_SERVER_CLIENTS

        client = REWARD_SERVER_CLIENTS.get("reward_server")(r)  # an unknown name is a ConfigError
        # the server's composite is one more weighted component beside any in-process rewards
        components = list(rewards.components) if rewards is not None else []
        components.append(RewardComponent("reward_server", client, r.reward_server_weight, None))
        rewards = RewardSet(components, timeout=r.timeout)
    if environment_parts:
        from grouprl.rollout.environments import environment_reward

        components = list(rewards.components) if rewards is not None else []
        taken = {c.key for c in components} & set(environment_parts)
        if taken:
            raise ConfigError(f"config key 'worker.rollout.multi_turn': the environment reward part(s) "
                              f"{', '.join(sorted(taken))} have the name of a reward in 'worker.reward'; rename one")
        weights = config.worker.rollout.multi_turn.reward_weights
        components += [RewardComponent(part, environment_reward(part), float(weights.get(part, 1.0)), None)
                       for part in environment_parts]
        rewards = RewardSet(components, timeout=r.timeout)
    if rewards is None and not optional:
        raise ConfigError("no reward: set 'worker.reward.functions', 'worker.reward.reward_function' "
                          "or 'worker.reward.reward_server'")
    return rewards


def _data_source(sample) -> str | None:
    """A validation record's ``data_source`` field (verl's name), its metrics' group; None without one."""
    value = sample.columns.get("data_source")
    return None if value is None else str(value)


def reward_thresholds(config: Config, keys: list[str]) -> dict[str, float]:
    """Each reward key's pass@k threshold: ``worker.reward.functions[i].threshold`` in order, else 1."""
    r = config.worker.reward
    given = [] if r.reward_function else [f.threshold for f in r.functions]
    return {key: float(given[i]) if i < len(given) else 1.0 for i, key in enumerate(keys)}


def reward_inputs(batch: RolloutBatch) -> tuple[list, list, list[list[int]]]:
    """Each row's prompt, completion and completion token ids as reward functions receive them:
    strings, or for a TRL conversational dataset TRL's message lists (``Sample.reward_prompt``)."""
    lengths = batch.response_mask.sum(-1).tolist()
    return ([s.reward_prompt() for s in batch.samples],
            [s.reward_completion(text) for s, text in zip(batch.samples, batch.responses)],
            [batch.response_ids[row, :int(n)].tolist() for row, n in enumerate(lengths)])


def reward_columns(batch: RolloutBatch) -> dict[str, list]:
    """Dataset fields of each row's prompt plus rollout extras, as TRL-style per-row columns."""
    keys = {k for s in batch.samples for k in s.columns}
    columns = {k: [s.columns.get(k) for s in batch.samples] for k in sorted(keys)}
    columns["answer"] = [s.answer for s in batch.samples]
    columns.update(batch.extras)
    return columns


def grpo_loss(mb: RolloutBatch, log_prob: torch.Tensor, entropy, norms: Normalisers, metrics: StepMetrics, *,
              algorithm, loss_options: dict, bypass=None,
              entropy_control: EntropyControl | None = None):
    """The GRPO-family loss of one micro-batch (a ``run_update`` loss function, with the
    ``algorithm`` config section and the policy loss's resolved options bound): the policy loss, plus the KL term when it is a loss, less ``entropy_control``'s
    applied coefficient times the token-mean entropy (``algorithms.entropy_bonus``). Reports
    ``pg_loss`` and ``kl_loss``; records clip fractions, ratio, entropy and KL as token-weighted
    means. ``bypass`` (verl's bypass mode, a ``VerlRolloutCorrection``): the loss against the
    sampler's log-probs, corrected per micro-batch."""
    old = log_prob.detach() if mb.old_log_probs is None else mb.old_log_probs
    tokens = float(mb.loss_mask.sum())
    options = {**loss_options, **norms.as_options()}
    if bypass is not None:
        pg_loss, pg_metrics, corr = algorithms.compute_bypass_policy_loss(
            log_prob, old, mb.advantages, mb.loss_mask, loss_type=bypass.loss_type, policy_loss=algorithm.policy_loss,
            rollout_is=bypass.rollout_is, rollout_is_threshold=bypass.rollout_is_threshold,
            rollout_is_batch_normalize=bypass.rollout_is_batch_normalize, rollout_rs=bypass.rollout_rs,
            rollout_rs_threshold=bypass.rollout_rs_threshold, loss_agg_mode=algorithm.loss_agg_mode, **options)
        record_correction(metrics, corr)
    else:
        weights = off_policy_masked_weights(mb, log_prob, old, algorithm.off_policy_sequence_masking.delta, metrics)
        pg_loss, pg_metrics = algorithms.compute_policy_loss(
            algorithm.policy_loss, log_prob, old, mb.advantages, mb.loss_mask, loss_agg_mode=algorithm.loss_agg_mode,
            token_weights=weights, **options)
    for key, value in pg_metrics.items():
        metrics.mean(f"actor/{key}", value, tokens)
    if entropy is not None:
        metrics.mean("actor/entropy", _masked_mean(entropy.detach(), mb.loss_mask), tokens)
    reported = {"pg_loss": pg_loss.detach()}
    loss = pg_loss
    if algorithm.kl_coef > 0 and algorithm.use_kl_loss:
        if algorithm.unbiased_kl:
            kl = algorithms.unbiased_kl_penalty(log_prob, mb.ref_log_probs, old, algorithm.kl_penalty,
                                                response_mask=mb.loss_mask)
        else:
            kl = algorithms.kl_penalty(log_prob, mb.ref_log_probs, algorithm.kl_penalty, response_mask=mb.loss_mask)
        kl_loss = algorithms.aggregate_loss(kl, mb.loss_mask, algorithm.loss_agg_mode, **norms.as_options())
        loss = loss + algorithm.kl_coef * kl_loss
        reported["kl_loss"] = kl_loss.detach()
        metrics.mean("actor/kl", _masked_mean(kl.detach(), mb.loss_mask), tokens)
    if entropy_control is not None and entropy_control.enabled:
        coef = entropy_control.applied()
        if coef:
            # refused rather than dropped: a bonus without gradient would train nothing, silently
            if entropy is None or (log_prob.requires_grad and not entropy.requires_grad):
                raise RuntimeError("worker.actor.entropy_coeff applies, but the log-prob function returned an "
                                   "entropy without gradient (compute_log_probs(..., entropy_grad=True))")
            loss = loss - coef * algorithms.entropy_bonus(entropy, mb.loss_mask, num_tokens=norms.num_tokens)
        entropy_control.observe(entropy, mb.loss_mask)
    return loss, reported


def off_policy_masked_weights(mb: RolloutBatch, log_prob: torch.Tensor, old: torch.Tensor, delta: float | None,
                              metrics: StepMetrics) -> torch.Tensor | None:
    """The micro-batch's token weights with off-policy sequence masking applied (``delta`` None: unchanged).

    The sampler's log-probs are the engine's where the run has them (a row a transform rewrote was
    never sampled: the old policy's for it), else the old policy's; the rollout-correction weights,
    if any, are multiplied by the mask. Logs ``actor/off_policy_masked_frac``, the fraction of
    valid tokens whose loss is dropped (token-weighted; with one advantage per response, the
    responses dropped weighted by their length)."""
    if delta is None:
        return mb.token_weights
    sampler = old
    if mb.rollout_log_probs is not None:
        sampler = torch.where(mb.edited.unsqueeze(-1), old, mb.rollout_log_probs.to(old.dtype))
    mask = algorithms.off_policy_sequence_mask(mb.advantages, log_prob, sampler, mb.loss_mask, delta=delta)
    tokens = float((mb.loss_mask != 0).sum())
    dropped = float(((mask == 0) & (mb.loss_mask != 0)).sum())
    metrics.mean("actor/off_policy_masked_frac", dropped / tokens if tokens else 0.0, tokens)
    return mask if mb.token_weights is None else mb.token_weights * mask


def _turn_lengths(batch: RolloutBatch) -> torch.Tensor:
    """[B] the length that ``data.max_response_length`` limits: the response's, or in a multi-turn
    response the longest policy turn's (each turn gets that many tokens)."""
    spans = batch.extras.get("spans")
    if spans is None:
        return batch.response_mask.sum(-1)
    return torch.tensor([max(end - start for start, end, kind in row if kind == "policy") for row in spans])


def _fill_unscored(totals: list[float | None], group_index: torch.Tensor) -> torch.Tensor:
    """Scores [B] where a row no reward applied to takes its group's mean of scored rows (0 if none).

    Such a row is left out of the loss; at the group's mean it moves neither the
    group's baseline nor, under GRPO, gets an advantage of its own.
    """
    scored = torch.tensor([t is not None for t in totals])
    values = torch.tensor([0.0 if t is None else t for t in totals], dtype=torch.float32)
    if bool(scored.all()):
        return values
    for g in group_index[~scored].unique().tolist():
        rows = group_index == g
        have = rows & scored
        values[rows & ~scored] = values[have].mean() if have.any() else 0.0
    return values


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.bool()
    total = int(mask.sum())
    return float(torch.where(mask, values, torch.zeros_like(values)).sum() / total) if total else 0.0


def micro_batches(prompts: list, rows: int | None, n: int) -> list[list]:
    """The prompts of each rollout micro-batch: ``rows`` responses (``n`` per prompt) each, all at once if None."""
    per_part = max(1, (rows or len(prompts) * n) // n)
    return [prompts[i:i + per_part] for i in range(0, len(prompts), per_part)]


def earliest_groups(batches: list[RolloutBatch], take: int, *, pad_token_id: int) -> RolloutBatch:
    """The rows of the first ``take`` groups of ``batches`` (kept in dynamic sampling's rounds), as one batch."""
    batch = RolloutBatch.concat(batches, pad_token_id=pad_token_id)
    groups = batch.group_index.unique()[:take]
    return batch.select(torch.isin(batch.group_index, groups).nonzero().squeeze(-1))


def filter_values(batch: RolloutBatch, key: str) -> torch.Tensor:
    """[B] the per-row values ``algorithm.filter_key`` names, NaN where they do not apply: ``overall``, the
    reward that trains (``batch.scores``); a reward component's key; a part of an EasyR1 reward's score as
    ``<key>/<part>``, or as the part's name alone (EasyR1's way) when one reward has such a part.

    ConfigError naming the key and what the rewards gave when it names none of them.
    """
    if key == "overall":
        return batch.scores.detach().to(torch.float64)
    components = batch.reward_components
    if key in components:
        found = key
    else:
        matches = [k for k in components if k.endswith("/" + key)]
        if len(matches) != 1:
            why = f"several rewards have a part {key!r} ({', '.join(matches)}); name one as <key>/{key}" if matches \
                else f"{key!r} names no reward component or part"
            raise ConfigError(f"config key 'algorithm.filter_key': {why}; the rewards gave: "
                              f"{', '.join(['overall', *components])}")
        found = matches[0]
    return torch.tensor([float("nan") if v is None else float(v) for v in components[found]], dtype=torch.float64)


Transformed = list[tuple[object, dict]]  # (rollout transform or dialogue runner, the metrics it reported)


class RoundScoring:
    """Transforms and scores one round's rollout micro-batches as they are generated.

    In line (``overlap`` False): once the round is complete, its micro-batches are joined and
    the transforms and rewards see the whole round. Overlapped (async_reward, one_step_off):
    each micro-batch is transformed as it arrives and scored in a worker thread while the next
    one generates, so that slow rewards (a reward server, a judge model) hide behind
    generation; the transforms must then work group by group. ``score_s`` adds up the seconds
    spent scoring.
    """

    def __init__(self, transform: Callable[[RolloutBatch, Transformed], tuple[RolloutBatch, Transformed]],
                 score: Callable[[RolloutBatch], RewardResult], *, overlap: bool, pad_token_id: int):
        self.transform, self._score, self.pad_token_id = transform, score, pad_token_id
        self.score_s = 0.0
        self._parts: list[tuple[RolloutBatch, Transformed]] = []
        self._scoring: list[concurrent.futures.Future] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grouprl-rewards") if overlap else None

    def __enter__(self) -> "RoundScoring":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def score(self, batch: RolloutBatch) -> RewardResult:
        mark("reward")  # on the main thread only (an overlapped round scores in a worker)
        t0 = time.perf_counter()
        result = self._score(batch)
        self.score_s += time.perf_counter() - t0
        return result

    def add(self, batch: RolloutBatch, transformed: Transformed) -> None:
        """One generated micro-batch, with what its dialogue runner reported."""
        if self._pool is None:
            self._parts.append((batch, transformed))
            return
        batch, transformed = self.transform(batch, transformed)
        self._parts.append((batch, transformed))
        self._scoring.append(self._pool.submit(self.score, batch))  # scores while the next one generates

    def scored(self) -> list[tuple[RolloutBatch, Transformed, RewardResult]]:
        """(batch, its transforms' metrics, its rewards) of each part scored: the round, or each micro-batch."""
        if self._pool is None:
            joined = RolloutBatch.concat([b for b, _ in self._parts], pad_token_id=self.pad_token_id)
            batch, transformed = self.transform(joined, [pair for _, pairs in self._parts for pair in pairs])
            return [(batch, transformed, self.score(batch))]
        return [(b, t, f.result()) for (b, t), f in zip(self._parts, self._scoring)]


# the side of the prompt images a run saves for its report (rollout records' "images")
PROMPT_IMAGE_SIDE = 256


def prompt_images(samples, limit: int) -> list[tuple[str, Any]]:
    """The images of the first prompts among ``samples`` (rows of a batch; a group's rows share their
    prompt), at most ``limit``, each captioned with its sample's id: what the loggers show of a VLM
    run's prompts. Empty for text prompts."""
    images, seen = [], set()
    for sample in samples:
        if sample.id in seen:
            continue
        seen.add(sample.id)
        images.extend((f"{sample.id} image {i}", image) for i, image in enumerate(sample.images))
        if len(images) >= limit:
            break
    return images[:limit]


class GRPOTrainer(TrainingLoop):
    """Trains a policy with a group-relative algorithm chosen by the config.

    ``rollout_transforms`` run on every RolloutBatch after generation and before
    rewards (post-rollout edits and verifier turns plug in here). A transform may
    report ``last_metrics`` (a dict), with ``metric_kinds`` naming the keys that are
    counts to sum across processes (the rest are means weighted by rows).
    """

    def __init__(self, config: Config, *, train_dataset=None, val_dataset=None, reward_set=None,
                 rollout_transforms: list[RolloutTransform] | None = None):
        from accelerate.utils import set_seed

        from grouprl.data import load_datasets

        t, actor, roll = config.trainer, config.worker.actor, config.worker.rollout
        check_output_dirs(config)  # before the data and the model load
        from grouprl.config.checks import check_tensor_parallel_layout, launch_world_size

        check_tensor_parallel_layout(roll.tensor_parallel_size, engine=roll.engine,
                                     world_size=launch_world_size() or 1,
                                     dialogues=roll.verifier.enable or roll.multi_turn.enabled)
        set_seed(t.seed)  # before the policy is built: LoRA adapters are initialised at random
        if train_dataset is None:
            train_dataset, loaded_val = load_datasets(config.data)
            val_dataset = val_dataset if val_dataset is not None else loaded_val
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        # tools and environments named by worker.rollout.multi_turn, loaded before any model: a bad name fails now
        from grouprl.rollout.multiturn import dialogue_parts

        self.dialogue_parts = dialogue_parts(roll.multi_turn) if roll.multi_turn.enabled else None
        # None: no reward, the teacher alone trains (pure distillation)
        self.rewards = reward_set if reward_set is not None else build_rewards(
            config, optional=config.algorithm.distilling,
            environment_parts=self.dialogue_parts.reward_parts if self.dialogue_parts else [])
        self.reward_thresholds = reward_thresholds(config, self.rewards.keys if self.rewards is not None else [])
        self.rollout_transforms = list(rollout_transforms or [])

        trained = setup_policy(actor, t)
        accelerator = trained.accelerator
        self.model, self.policy, self.processor = trained.model, trained.policy, trained.processor
        self.is_vlm, self.precision, self.sharded = trained.is_vlm, trained.precision, trained.sharded
        stream = PromptStream(train_dataset, config.data.rollout_batch_size, seed=config.data.seed,
                              shuffle=config.data.shuffle, rank=accelerator.process_index,
                              world_size=accelerator.num_processes)
        super().__init__(config, accelerator=accelerator, stream=stream)
        # the chosen estimator's and loss's options, as their registered options classes declare them
        self.estimator_options = resolve_options(config, "adv_estimator")
        self.loss_options = resolve_options(config, "policy_loss")
        self.uses_lora = actor.model.lora.rank > 0
        self.ref_model = None  # a FrozenModel: on the CPU between its forwards when worker.ref.offload says so
        if reference_model_needed(config):
            from grouprl.models.frozen import FrozenModel

            # with LoRA the reference is the policy with adapters off: no second copy
            offload = config.worker.ref.offload.offload_params
            self.ref_model = FrozenModel(
                self._frozen_copy(config.worker.ref.model_path or actor.model.model_path,
                                  device="cpu" if offload else None),
                device=self.accelerator.device, offload=offload)
        self.teacher = None
        if config.algorithm.distilling:
            from grouprl.trainer.teacher import Teacher

            self.teacher = Teacher.load(config.algorithm.teacher, student_processor=self.processor,
                                        frozen_dtype=self.precision.frozen_dtype, device=self.accelerator.device)

        self.entropy_control = EntropyControl(actor.entropy_coeff, actor.entropy_control, accelerator=accelerator)
        self.optimizer = build_optimizer(self.model, actor)
        self.scheduler = build_scheduler(self.optimizer, actor, self.total_steps)
        self.update_settings = UpdateSettings(
            num_minibatches=config.data.rollout_batch_size // actor.global_batch_size, epochs=actor.ppo_epochs,
            micro_batch_size=actor.micro_batch_size_per_device_for_update, max_grad_norm=actor.max_grad_norm,
            norm_len=float(config.data.max_response_length), padding_free=actor.padding_free)

        from grouprl.models.loading import check_image_tokens
        from grouprl.rollout.engine import engine_class
        from grouprl.rollout.transforms import build_rollout_transforms

        # Generation runs on a copy of the weights when the policy's own cannot serve:
        # fp32 masters (sampling from a bf16 copy reads half the bytes per token), an FSDP
        # policy (its forward passes are collectives that generation cannot keep in step),
        # or an engine that loads its own (vLLM).
        engine_cls = engine_class(roll.engine)
        # one_step_off samples while the policy trains: generation needs weights of its own
        holds_weights, copy_here = rollout_weights(engine_cls.owns_weights, self.precision.rollout_copy,
                                                   sharded=self.sharded, async_mode=t.async_mode)
        rollout_model = self._frozen_copy(actor.model.model_path) if copy_here else self.policy
        self.engine = engine_cls.from_config(rollout_model, self.processor, config=config, holds_weights=holds_weights)
        self._sync_rollout_weights()
        # registered rollout transforms that the config turns on (EditGRPO's edits: worker.rollout.extractor*)
        self.rollout_transforms += build_rollout_transforms(config, processor=self.processor, engine=self.engine)
        self.multiturn = self._multiturn()
        self._check_async_mode()
        correction = config.algorithm.rollout_correction
        # verl's keys or preset (None: TRL's level / mode / clip_*); bypass: the sampler's log-probs are the old ones
        self.verl_correction = resolve_verl_correction(correction)
        self.bypass = self.verl_correction if self.verl_correction and self.verl_correction.bypass_mode else None
        if self.bypass is not None and self.bypass.loss_type == "reinforce":  # bypass REINFORCE replaces the loss
            self.loss_options = resolve_options(config, "policy_loss", name="reinforce")
        # the sampler's log-probs differ from the trainer's when another engine or stale weights sampled
        self.correct_rollout = (correction.enable if correction.enable is not None
                                else engine_cls.owns_weights or t.async_mode == "one_step_off"
                                or self.verl_correction is not None)
        if self.is_vlm:
            # fail before training, not at step 300, when processor and model disagree
            check_image_tokens(self.processor, self.policy, train_dataset[0])

    def _multiturn(self):
        """Multi-turn dialogues: Guided-GRPO's verifier (``worker.rollout.verifier``) or the tools and
        environments of ``worker.rollout.multi_turn``; None for single-turn rollouts."""
        roll = self.config.worker.rollout
        verifier_cfg, multi = roll.verifier, roll.multi_turn
        if not (verifier_cfg.enable or multi.enabled):
            return None
        key = "worker.rollout.verifier.enable" if verifier_cfg.enable else "worker.rollout.multi_turn"
        if self.rollout_transforms:
            names = ", ".join(type(t).__name__ for t in self.rollout_transforms)
            raise ConfigError(f"config key '{key}': multi-turn dialogues cannot be combined with rollout "
                              f"transforms ({names}: EditGRPO's edits rewrite single responses)")
        from grouprl.rollout.multiturn import MultiTurnRollout
        from grouprl.rollout.tools import ToolLimits, ToolLoadError
        from grouprl.rollout.verifier import build_verifier

        parts = self.dialogue_parts
        if verifier_cfg.enable:
            environments, limits_config = build_verifier(verifier_cfg, tokenizer=self.processor), verifier_cfg
        else:
            environments, limits_config = parts.pool, multi
        multiturn = MultiTurnRollout(
            environments, self.processor, limits_config, end_of_turn_ids=list(self.engine.eos_token_ids),
            tools=parts.tools if parts else [], tool_parser=multi.tool_parser, environment_field=multi.environment_field,
            tool_limits=ToolLimits(per_turn=multi.max_tool_calls_per_turn, per_dialogue=multi.max_tool_calls,
                                   timeout=multi.tool_timeout))
        if parts and (parts.tools or parts.environment_tools):
            try:  # the policy's tool-call format, now rather than at the first dialogue
                multiturn.tool_parser
            except ToolLoadError as exc:
                raise ConfigError(f"config key 'worker.rollout.multi_turn.tool_parser': {exc}") from None
        return multiturn

    def _check_async_mode(self) -> None:
        mode, roll = self.config.trainer.async_mode, self.config.worker.rollout
        if mode == "async_reward" and roll.micro_batch_size is None:
            raise ConfigError("config key 'trainer.async_mode': async_reward scores each rollout micro-batch while "
                              "the next generates; set 'worker.rollout.micro_batch_size' (rows per micro-batch)")
        chunked = mode != "sync" and roll.micro_batch_size is not None
        global_transforms = [type(t).__name__ for t in self.rollout_transforms if not getattr(t, "group_local", False)]
        if chunked and global_transforms:
            raise ConfigError(
                f"config key 'trainer.async_mode': {mode} transforms rollouts one micro-batch at a time, but "
                f"{', '.join(global_transforms)} chooses rows across the whole batch (EditGRPO's "
                "'algorithm.force_gt_num' or 'worker.rollout.extractor_num_para' > 0); use sync, or num_para -1")

    def _frozen_copy(self, path: str, device: str | None = None):
        """The model at ``path`` in the precision's frozen dtype, on ``device`` (None: this process's), never
        trained."""
        from grouprl.models.loading import load_model_and_processor

        model, _, _ = load_model_and_processor(path, dtype=self.precision.frozen_dtype,
                                               trust_remote_code=self.config.worker.actor.model.trust_remote_code)
        return model.requires_grad_(False).eval().to(device or self.accelerator.device)

    def _sync_rollout_weights(self) -> None:
        """Give the engine the trained weights (a collective for a sharded policy)."""
        if self.engine.holds_weights:
            self.engine.update_weights(full_named_parameters(self.model))

    # ------------------------------------------------------------------ rollout

    def on_resume(self) -> None:
        self._sync_rollout_weights()
        self.entropy_control.load(self.state.extra.get(ENTROPY_STATE))

    def run_info_extras(self) -> dict:
        return {"strategy": self.config.worker.actor.strategy,
                "rollout_weights": "copy" if self.engine.holds_weights else "policy",
                # what waits in host memory (worker.actor.offload, worker.ref.offload)
                "offload": [name for name, on in (("actor", self.config.worker.actor.offload.enabled),
                                                  ("ref", self.ref_model is not None and self.ref_model.offload))
                            if on]}

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> StepResult:
        """One training step on this process; its metrics are not yet reduced across processes."""
        cfg, algo = self.config, self.config.algorithm
        metrics = StepMetrics()
        t0 = time.perf_counter()
        # 1. the batch: generated and scored now, or (one_step_off) during the last step's update
        stale = self.prefetcher.holds(step)
        mark("rollout")
        batch = self.prefetcher.take(metrics) if stale else self.rollout(step, metrics)
        self.rollout_taken(step, metrics, stale=stale)
        t_rollout = time.perf_counter() - t0
        # every process takes this branch together: dynamic sampling agrees on the count
        metrics.mean("actor/skipped_step", float(batch is None))
        metrics.mean("actor/lr", self.scheduler.get_last_lr()[0])
        if batch is None:  # every group had zero reward spread, even after the extra rounds
            with warnings.catch_warnings():
                # the schedule counts training steps, taken or skipped; torch warns when the
                # first one is skipped, before any optimizer step
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
                self.scheduler.step()
            self.prefetcher.wait(metrics)
            return StepResult(metrics)

        # 2. old and reference log-probs; the sampler's mismatch corrected
        kl_on = algo.kl_coef > 0
        kl_in_reward = kl_on and not algo.use_kl_loss
        settings = self.update_settings
        actor = cfg.worker.actor
        if actor.dynamic_batching:
            # EasyR1's budget: the micro-batch's rows times the batch's padded width
            width = batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
            settings = replace(settings, token_budget=actor.micro_batch_size_per_device_for_update * width)
        # With one update per rollout the sampling policy is the one being trained, so
        # its log-probs come for free from the update's own forward (ratio exactly 1).
        # (A stale batch, or one sampled by another engine, has other log-probs: recompute them.)
        on_policy = settings.epochs == 1 and settings.num_minibatches == 1 and not stale
        t_log_probs = time.perf_counter()
        mark("log-probs")
        # distillation's advantage needs the sampling student's log-probs before the update;
        # in verl's bypass mode the sampler's are the old ones (set by _correct_rollout)
        needed = not on_policy or kl_in_reward or self.correct_rollout or self.teacher is not None
        if needed and self.bypass is None:
            batch.old_log_probs = self._log_probs(self.model, batch)
        if self.correct_rollout:
            self._correct_rollout(batch, metrics)
        if kl_on:
            batch.ref_log_probs = self._reference_log_probs(batch)
        if self.teacher is not None:
            with self.teacher.on_device() as teacher:
                teacher_log_probs = self._log_probs(teacher, batch)
        metrics.max("timing/log_probs_s", time.perf_counter() - t_log_probs)

        # 3. advantages, from the scores less the KL penalty when it is in the reward
        token_rewards = None
        if kl_in_reward:
            kl = algorithms.kl_penalty(batch.old_log_probs, batch.ref_log_probs, algo.kl_penalty,
                                       response_mask=batch.loss_mask)
            token_rewards = -algo.kl_coef * kl
            metrics.mean("reward/kl_penalty", _masked_mean(kl, batch.loss_mask), float(batch.loss_mask.sum()))
        batch.advantages = self._advantages(batch.scores, batch, token_rewards, metrics) if self.rewards is not None else None
        if self.teacher is not None:
            from grouprl.trainer.teacher import distillation_advantages

            coef = 1.0 if algo.distill_coef is None else algo.distill_coef
            batch.advantages = distillation_advantages(batch.advantages, teacher_log_probs, batch.old_log_probs,
                                                       batch.loss_mask, coef, metrics)

        # 4. the update; an engine with accelerator memory of its own (vLLM) gives it up
        # meanwhile, unless it is generating the next batch (one_step_off)
        loss_fn = functools.partial(grpo_loss, algorithm=algo, loss_options=self.loss_options,
                                    bypass=self.bypass, entropy_control=self.entropy_control)
        sleeping = self.engine.supports_sleep and not self.prefetcher.running
        if sleeping:
            self.engine.sleep()
        t_update = time.perf_counter()
        mark("update")
        self.state.optimizer_steps += run_update(
            self.model, self.optimizer, batch, log_prob_fn=self._log_prob_fn, loss_fn=loss_fn,
            accelerator=self.accelerator, precision=self.precision, settings=settings, metrics=metrics,
            on_step_end=lambda: self.entropy_control.step_end(metrics))
        if self.entropy_control.enabled:  # saved with the step's checkpoint
            self.state.extra[ENTROPY_STATE] = self.entropy_control.state()
        self.scheduler.step()
        metrics.max("timing/update_s", time.perf_counter() - t_update)

        # 5. the engine's weights follow, once it is done generating the next batch
        self.prefetcher.wait(metrics)
        t_sync = time.perf_counter()
        mark("weight-sync")
        self._sync_rollout_weights()
        if sleeping:
            self.engine.wake_up()
        metrics.max("timing/weight_sync_s", time.perf_counter() - t_sync)

        # 6. what was trained on, for the logs
        self._batch_metrics(batch, metrics)
        metrics.max("timing/step_s", time.perf_counter() - t0)
        metrics.max("timing/rollout_s", t_rollout)
        metrics.sum("perf/tokens", float(batch.response_mask.sum() + batch.prompt_mask.sum()))
        metrics.sum("perf/samples", float(len(batch)))
        log = cfg.trainer
        return StepResult(metrics, batch=batch,
                          records=self.rollout_records(batch) if log.log_rollouts else None,
                          completions=self.completion_records(batch) if log.log_completions else None,
                          images=prompt_images(batch.samples, log.log_samples_rows))

    def rollout(self, step: int, metrics: StepMetrics) -> RolloutBatch | None:
        """Generate, transform and score this step's batch; None when dynamic sampling kept no group.

        A round draws a batch of prompts and generates it a rollout micro-batch
        (``worker.rollout.micro_batch_size`` rows) at a time, each with a seed of its own, so
        that every async mode samples the same responses; transforms and rewards take each
        micro-batch as it comes (async modes) or the whole round (sync), see ``RoundScoring``.
        Without dynamic sampling a step is one round. With it (DAPO,
        ``algorithm.online_filtering``) only groups whose rewards differ are kept (or, with
        EasyR1's keys, those whose mean ``filter_key`` lies between its bounds), and rounds
        of new prompts are drawn until every process has its share of groups (or the extra
        rounds run out); then every process keeps the same number of groups, the fewest any
        process found, so all take the same number of optimizer steps. Groups found beyond
        that are dropped and counted (``dynamic_sampling/unused_groups``).
        """
        algo, async_mode = self.config.algorithm, self.config.trainer.async_mode
        params = self._sampling(step)
        pad = self.engine.pad_token_id
        wanted = self.config.data.rollout_batch_size // self.accelerator.num_processes
        kept: list[RolloutBatch] = []
        kept_groups = rounds = 0
        spent = {"generate": 0.0, "reward": 0.0}
        try:
            while True:
                chunks = micro_batches(self.stream.next_batch(), self.config.worker.rollout.micro_batch_size, params.n)
                overlap = async_mode != "sync" and len(chunks) > 1
                with RoundScoring(self._transform, self._score, overlap=overlap, pad_token_id=pad) as scoring:
                    for k, chunk in enumerate(chunks):
                        # a seed per micro-batch, and per round: an extra round's samples are independent too
                        sampling = replace(params, seed=params.seed + 7919 * rounds + 104_729 * k)
                        t0 = time.perf_counter()
                        mark("generate")
                        if self.multiturn is not None:
                            batch = self.multiturn.generate(self.engine, chunk, sampling)
                        else:
                            batch = self.engine.generate(chunk, sampling)
                        spent["generate"] += time.perf_counter() - t0
                        scoring.add(batch, [self.multiturn.metrics_snapshot()] if self.multiturn else [])
                    scored = scoring.scored()
                spent["reward"] += scoring.score_s
                if rounds == 0:  # what the policy produced, before any filtering
                    for part, transformed, result in scored:
                        self._record_rollout(part, result, transformed, metrics)
                batch = RolloutBatch.concat([part for part, _, _ in scored], pad_token_id=pad)
                if not algo.online_filtering:
                    return batch
                keep = self._groups_to_keep(batch)
                if keep.any():
                    part = batch.select(keep.nonzero().squeeze(-1))
                    kept.append(part)
                    kept_groups += int(part.group_index.unique().numel())
                rounds += 1
                # the same decision on every process: they draw the same number of prompt batches
                mark("dynamic-sampling")
                fewest = self._fewest_over_processes(kept_groups)
                if fewest >= wanted or rounds > algo.max_filter_rounds:
                    break
        finally:
            # a process's own seconds over all rounds; scoring overlaps generation in the
            # asynchronous modes, so the two may add up to more than the rollout took
            metrics.max("timing/generate_s", spent["generate"])
            metrics.max("timing/reward_s", spent["reward"])
        take = min(fewest, wanted)
        metrics.max("dynamic_sampling/rounds", rounds)
        metrics.sum("dynamic_sampling/kept_groups", take)
        metrics.sum("dynamic_sampling/unused_groups", kept_groups - take)
        return earliest_groups(kept, take, pad_token_id=pad) if take else None

    def rollout_ahead(self, step: int, metrics: StepMetrics) -> RolloutBatch | None:
        # its own CUDA stream, so that generation kernels can run beside the update's
        stream = torch.cuda.Stream() if self.accelerator.device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            batch = self.rollout(step, metrics)
        if stream is not None:
            stream.synchronize()
        return batch

    # ------------------------------------------------------------------ rollout parts

    def _sampling(self, step: int, *, validation: bool = False):
        from grouprl.rollout.engine import SamplingParams

        r = self.config.worker.rollout
        # seeded by (run seed, step, process) so a resumed run samples what the original would have
        seed = (self.config.trainer.seed * 1_000_003 + step * 101 + self.accelerator.process_index) % 2**31
        return SamplingParams(
            n=r.val_n if validation else r.n,
            temperature=r.val_temperature if validation else r.temperature,
            top_p=r.val_top_p if validation else r.top_p,
            top_k=None if validation or r.top_k <= 0 else r.top_k,
            max_new_tokens=self.config.data.max_response_length,
            seed=seed,
            # off-policy sequence masking compares the sampler's log-probs with the trained policy's
            return_log_probs=(self.config.trainer.log_completions or self.correct_rollout
                              or self.config.algorithm.off_policy_sequence_masking.delta is not None)
            and not validation,
        )

    def _transform(self, batch: RolloutBatch, transformed: Transformed) -> tuple[RolloutBatch, Transformed]:
        """The rollout transforms in order, each one's metrics added to ``transformed``."""
        for t in self.rollout_transforms:
            batch = t(batch)
            transformed.append((t, dict(getattr(t, "last_metrics", {}))))
        return batch, transformed

    def _reward_scores(self, batch: RolloutBatch, *, allow_unscored: bool = False):
        """The reward set on ``batch``, called as TRL's GRPOTrainer calls reward functions."""
        prompts, completions, completion_ids = reward_inputs(batch)
        return self.rewards.score(prompts, completions, reward_columns(batch), completion_ids=completion_ids,
                                  trainer_state=self._reward_trainer_state(), allow_unscored=allow_unscored)

    def _reward_trainer_state(self):
        """The run's position as TRL's rewards read it: a ``transformers.TrainerState`` whose
        ``global_step`` counts the steps done (0 while the first is scored, as in TRL), with
        ``max_steps`` and a fractional ``epoch``. A fresh copy per call: rewards cannot change the run."""
        from transformers import TrainerState

        per_epoch = max(1, self.stream.batches_per_epoch)
        return TrainerState(global_step=self.state.global_step, max_steps=self.total_steps,
                            epoch=self.state.epoch + self.state.batch_in_epoch / per_epoch,
                            num_train_epochs=math.ceil(self.total_steps / per_epoch))

    def _score(self, batch: RolloutBatch):
        """Rewards, overlong shaping and truncation masking, in place; returns the RewardResult."""
        algo = self.config.algorithm
        if self.rewards is None:  # pure distillation: no score; the teacher gives the advantages
            batch.scores = torch.zeros(len(batch))
            if algo.mask_truncated_completions:
                batch.loss_mask = algorithms.mask_truncated(batch.loss_mask, batch.truncated)
            return None
        result = self._reward_scores(batch, allow_unscored=True)
        batch.reward_components = dict(result.components)
        for key, parts in result.parts.items():  # an EasyR1 reward's format, accuracy, ...: recorded, not summed
            batch.reward_components.update({f"{key}/{part}": values for part, values in parts.items()})
        batch.reward_logs = dict(result.logged_columns)
        scores = _fill_unscored(result.total, batch.group_index)
        unscored = torch.tensor([t is None for t in result.total], dtype=torch.bool)
        if unscored.any():
            # no reward applies (e.g. an empty reference sent to no server): the row is not trained
            batch.loss_mask = batch.loss_mask * (~unscored).unsqueeze(-1).to(batch.loss_mask.dtype)
        if algo.overlong_buffer.enable:
            lengths = _turn_lengths(batch)
            penalty = algorithms.overlong_penalty(
                lengths, max_length=self.config.data.max_response_length,
                buffer_length=algo.overlong_buffer.length, penalty_factor=algo.overlong_buffer.penalty_factor)
            batch.reward_components["overlong"] = penalty.tolist()
            scores = scores + penalty
        batch.scores = scores
        if algo.mask_truncated_completions:
            batch.loss_mask = algorithms.mask_truncated(batch.loss_mask, batch.truncated)
        return result

    def _record_rollout(self, batch: RolloutBatch, result, transformed: list[tuple[object, dict]],
                        metrics: StepMetrics) -> None:
        """What the policy produced, before any filtering; ``transformed`` pairs each transform with its metrics."""
        rows = len(batch)
        if result is not None:  # None: no reward (pure distillation), so no reward metrics
            record_rewards(metrics, result, self.rewards.keys)
            metrics.sum("reward/unscored_rows", float(sum(t is None for t in result.total)))
            zero_std = algorithms.reward_std_per_group(batch.scores, batch.group_index) == 0
            metrics.mean("frac_reward_zero_std", float(zero_std.float().mean()) if rows else 0.0, rows)
        for transform, transform_metrics in transformed:
            kinds = getattr(transform, "metric_kinds", {})
            weights = getattr(transform, "metric_weights", {})  # a mean over other than the rows
            for key, value in transform_metrics.items():
                if kinds.get(key) == "sum":
                    metrics.sum(key, value)
                else:
                    metrics.mean(key, value, weights.get(key, rows))
        if transformed and result is not None:
            for name, mask in (("edited", batch.edited), ("unedited", ~batch.edited)):
                count = int(mask.sum())
                metrics.mean(f"edits/reward_{name}_mean", float(batch.scores[mask].mean()) if count else 0.0, count)

    def _batch_std(self, scores: torch.Tensor) -> float:
        """The unbiased std of the raw rewards over every process's rows (TRL's scale_rewards=batch
        takes the whole batch too), taken as 1 below two rows."""
        _, std, n = batch_moments(scores, self.accelerator)
        return std if n > 1 else 1.0

    def _groups_to_keep(self, batch: RolloutBatch) -> torch.Tensor:
        """Online filtering's rows to keep, BoolTensor [B]: grouprl's std rule (std_g > filter_min_std), or
        EasyR1's when its keys are set (filter_low < mean_g(filter_key) < filter_high, and also
        std_g > filter_min_std when that is > 0)."""
        algo = self.config.algorithm
        rule = algo.mean_filter
        if rule is None:
            return algorithms.filter_groups(batch.scores, batch.group_index, min_std=algo.filter_min_std)
        key, low, high = rule
        keep = algorithms.filter_groups_by_mean(filter_values(batch, key), batch.group_index, low=low, high=high)
        if algo.filter_min_std > 0:
            keep &= algorithms.filter_groups(batch.scores, batch.group_index, min_std=algo.filter_min_std)
        return keep

    def _sum_over_processes(self, values: torch.Tensor) -> torch.Tensor:
        """float64 ``values`` summed element-wise over the processes (an all-reduce; itself with one)."""
        if self.accelerator.num_processes == 1:
            return values
        t = values.to(dtype=torch.float64, device=self.accelerator.device)
        torch.distributed.all_reduce(t)
        return t.cpu()

    def _fewest_over_processes(self, value: int) -> int:
        if self.accelerator.num_processes == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.accelerator.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return int(t)

    # ------------------------------------------------------------------ log-probs

    def _log_prob_fn(self, model, batch: RolloutBatch):
        from grouprl.rollout.logprobs import compute_log_probs

        actor = self.config.worker.actor
        return compute_log_probs(model, batch, micro_batch_size=len(batch),
                                 temperature=self.config.worker.rollout.temperature, with_entropy=True,
                                 padding_free=actor.padding_free, chunk_tokens=actor.log_prob_chunk_tokens,
                                 # the entropy's backward costs memory and time: only when the bonus applies now
                                 entropy_grad=self.entropy_control.applied() != 0)

    def _experience_micro_batches(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """The no-grad forwards' micro-batches: fixed rows, or (dynamic_batching) a token budget."""
        from grouprl.trainer.micro_batches import plan_micro_batches, row_token_counts

        actor = self.config.worker.actor
        budget = None
        if actor.dynamic_batching:
            budget = actor.micro_batch_size_per_device_for_experience * (batch.prompt_ids.shape[1]
                                                                          + batch.response_ids.shape[1])
        return plan_micro_batches(row_token_counts(batch), rows_per_micro_batch=actor.micro_batch_size_per_device_for_experience,
                                  token_budget=budget, accelerator=self.accelerator)

    @torch.no_grad()
    def _log_probs(self, model, batch: RolloutBatch) -> torch.Tensor:
        """Log-probs without gradient, computed the way the update computes them (same precision)."""
        from grouprl.rollout.logprobs import compute_log_probs

        actor = self.config.worker.actor
        # the reference runs in its own (frozen) dtype; the policy as the update will run it
        context = self.precision.autocast(self.accelerator.device) if model is self.model else contextlib.nullcontext()
        with context:
            return compute_log_probs(model, batch, micro_batch_size=actor.micro_batch_size_per_device_for_experience,
                                     micro_batches=self._experience_micro_batches(batch),
                                     temperature=self.config.worker.rollout.temperature,
                                     padding_free=actor.padding_free, chunk_tokens=actor.log_prob_chunk_tokens)[0]

    @torch.no_grad()
    def _reference_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        if self.ref_model is not None:
            with self.ref_model.on_device() as ref_model:
                return self._log_probs(ref_model, batch)
        with self.policy.disable_adapter():
            return self._log_probs(self.model, batch)

    def _correct_rollout(self, batch: RolloutBatch, metrics: StepMetrics) -> None:
        """Importance weights between the trainer's old log-probs and the sampler's, with their mismatch logged."""
        if batch.rollout_log_probs is None:
            raise RuntimeError("rollout correction is on, but the engine returned no sampler log-probs")
        if self.bypass is not None:  # verl's bypass: corrected in the loss, per micro-batch
            batch.old_log_probs = bypass_old_log_probs(batch, lambda: self._log_probs(self.model, batch))
            return
        if self.verl_correction is not None:
            correct_decoupled(batch, self.verl_correction, metrics, sum_over_processes=self._sum_over_processes)
            return
        c = self.config.algorithm.rollout_correction
        weights = algorithms.rollout_importance_weights(batch.old_log_probs, batch.rollout_log_probs,
                                                        batch.loss_mask, level=c.level, mode=c.mode,
                                                        clip_max=c.clip_max, clip_min=c.clip_min)
        sampled = ~batch.edited  # a rewritten row was never sampled: nothing to correct
        weights = torch.where(sampled.unsqueeze(-1), weights, batch.loss_mask.to(weights.dtype))
        batch.token_weights = weights
        rows = batch.select(sampled.nonzero().squeeze(-1))
        stats = algorithms.rollout_mismatch_metrics(rows.old_log_probs, rows.rollout_log_probs, rows.loss_mask,
                                                    weights[sampled], level=c.level)
        for key, (value, weight) in stats.items():
            metrics.mean(key, value, weight)

    # ------------------------------------------------------------------ advantages, metrics, records

    def _advantages(self, scores: torch.Tensor, batch: RolloutBatch, token_rewards, metrics: StepMetrics) -> torch.Tensor:
        """The estimator's advantages: its resolved options, and the run-time inputs it declares
        (``algorithms.ADVANTAGE_ESTIMATOR_INPUTS``), each computed only when declared. With a group
        estimator each reward's own advantages are logged, and under GDPO (normalize_then_sum) trained."""
        algo = self.config.algorithm
        name = algo.adv_estimator
        if name in algorithms.GROUP_RELATIVE_ESTIMATORS:  # each reward's own advantages: GDPO's, and logged
            gdpo = reward_advantages(batch, self.rewards.weights, token_rewards, estimator=name,
                                     options=self.estimator_options, aggregation=algo.multi_objective_aggregation,
                                     metrics=metrics,
                                     batch_moments_fn=functools.partial(batch_moments, accelerator=self.accelerator))
            if gdpo is not None:
                return gdpo
        inputs = algorithms.estimator_inputs(name, self.estimator_options)
        options: dict = {**self.estimator_options, "response_mask": batch.loss_mask}
        if "token_rewards" in inputs:
            if token_rewards is not None:
                options["token_rewards"] = token_rewards
        elif token_rewards is not None:
            scores = scores + token_rewards.sum(-1)  # outcome estimators see the sequence's KL-adjusted return
        if "batch_std" in inputs:  # every process's rows: a collective, on every process alike
            options["batch_std"] = self._batch_std(scores)
        if "baseline_scores" in inputs:
            options["baseline_scores"] = self._greedy_baseline(batch)
        return algorithms.compute_advantages(name, scores, batch.group_index, **options)

    @torch.no_grad()
    def _greedy_baseline(self, batch: RolloutBatch) -> torch.Tensor:
        """ReMax: the reward of one greedy response per prompt, broadcast to that prompt's rows."""
        first_row = {}
        for row, g in enumerate(batch.group_index.tolist()):
            first_row.setdefault(g, row)
        prompts = [batch.samples[r] for r in first_row.values()]
        params = replace(self._sampling(self.state.global_step), n=1, temperature=0.0)
        greedy = self.engine.generate(prompts, params)
        result = self._reward_scores(greedy)
        by_group = dict(zip(first_row, result.total))
        return torch.tensor([by_group[g] for g in batch.group_index.tolist()], dtype=torch.float32)

    def _batch_metrics(self, batch: RolloutBatch, metrics: StepMetrics) -> None:
        lengths = batch.response_mask.sum(-1).float()
        per_row_adv = (batch.advantages * batch.loss_mask).sum(-1) / batch.loss_mask.sum(-1).clamp(min=1)
        metrics.moments("response_length", lengths.tolist())
        # the policy's own tokens (a multi-turn response also holds template and verifier text)
        metrics.moments("response/policy_tokens", batch.policy_mask.sum(-1).float().tolist())
        metrics.max("response_length/max", float(lengths.max()))
        metrics.min("response_length/min", float(lengths.min()))
        metrics.mean("response/truncation_rate", float(batch.truncated.float().mean()), len(batch))
        metrics.moments("advantages", per_row_adv.tolist())
        metrics.sum("batch/responses", float(len(batch)))

    def rollout_records(self, batch: RolloutBatch) -> list[dict]:
        adv = (batch.advantages * batch.loss_mask).sum(-1) / batch.loss_mask.sum(-1).clamp(min=1)
        records = []
        for i, sample in enumerate(batch.samples):
            records.append({
                "id": sample.id,
                "group": int(batch.group_index[i]),
                "prompt": sample.prompt_text(),
                "response": batch.responses[i],
                "reference": sample.answer,
                "rewards": {k: v[i] for k, v in batch.reward_components.items()},
                "score": float(batch.scores[i]),
                "advantage": float(adv[i]),
                "truncated": bool(batch.truncated[i]),
                "edited": bool(batch.edited[i]),
                **{k: v[i] for k, v in batch.extras.items()},
                **({"logged": {k: v[i] for k, v in batch.reward_logs.items()}} if batch.reward_logs else {}),
                **({"images": self._prompt_image_files(sample)} if sample.images else {}),
            })
        return records

    def _prompt_image_files(self, sample) -> list[str]:
        """The prompt's images as files of the run directory, for the run report (grouprl.report): each
        saved once, at most PROMPT_IMAGE_SIDE px a side, as ``prompt_images/<hash of the sample id>_<i>.png``;
        their paths relative to the run directory."""
        import hashlib

        from grouprl.files import AtomicFile

        digest = hashlib.sha256(str(sample.id).encode()).hexdigest()[:16]
        names = []
        for j, image in enumerate(sample.images):
            name = f"prompt_images/{digest}_{j}.png"
            path = self.run_dir / name
            if not path.exists():
                path.parent.mkdir(exist_ok=True)
                small = image.convert("RGB")
                small.thumbnail((PROMPT_IMAGE_SIDE, PROMPT_IMAGE_SIDE))
                with AtomicFile(path, "wb") as fh:
                    small.save(fh, format="PNG")
            names.append(name)
        return names

    def completion_records(self, batch: RolloutBatch) -> list[dict]:
        """CheXPO's completions log: each response's tokens with the sampler's per-token log-probs."""
        from grouprl.models.inputs import tokenizer_of

        tokenizer = tokenizer_of(self.processor)
        records = []
        for i, sample in enumerate(batch.samples):
            length = int(batch.response_mask[i].sum())
            ids = batch.response_ids[i, :length].tolist()
            sampled = batch.rollout_log_probs is not None and not bool(batch.edited[i])
            logps = batch.rollout_log_probs[i, :length].tolist() if sampled else None
            records.append({
                "id": sample.id,
                "prompt": sample.prompt_text(),
                "completion": batch.responses[i],
                "tokens": tokenizer.convert_ids_to_tokens(ids),
                "token_ids": ids,
                # None for rows a rollout transform rewrote: the sampler never produced those tokens
                "log_probs": logps,
                "rewards": {k: v[i] for k, v in batch.reward_components.items()},
            })
        return records


    # ------------------------------------------------------------------ validation

    @torch.no_grad()
    def validate(self, step: int) -> StepResult | None:
        """Greedy (by default) responses to this process's share of the validation set, scored.

        Besides the per-response reward metrics (``rewards/{key}/mean`` ...), ``worker.rollout.val_n``
        responses per prompt give per-prompt ``mean@k``, ``best@k``, ``worst@k``, ``pass@k`` with
        standard errors, per data source too (module ``val_metrics``); the task metrics that
        ``trainer.val_metrics`` names score the whole validation set (module ``task_metrics``). A process may get no
        validation sample (fewer samples than processes): it still reports every key, with no
        weight. None without a validation set.
        """
        if self.val_dataset is None or len(self.val_dataset) == 0:
            return None
        metrics = StepMetrics()
        params = self._sampling(step, validation=True)
        size = self.config.data.val_batch_size
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        indices = list(range(len(self.val_dataset)))[rank::world]
        results, records, prompt_of_row, row_sources, images, generations = [], [], [], [], [], []
        for start in range(0, len(indices), size):
            samples = [self.val_dataset[i] for i in indices[start:start + size]]
            mark("generate")
            if self.multiturn is not None:  # the verifier sees no reference in validation
                batch = self.multiturn.generate(self.engine, samples, params, validation=True)
            else:
                batch = self.engine.generate(samples, params)
            mark("reward")
            # no reward (pure distillation): the task metrics (trainer.val_metrics) are the validation
            result = self._reward_scores(batch, allow_unscored=True) if self.rewards is not None else None
            results.append(result)
            # a prompt's val_n responses all come from this call, on this process: its per-prompt metrics are whole
            prompt_of_row.extend(start + int(g) for g in batch.group_index)
            row_sources.extend(_data_source(s) for s in batch.samples)
            records.extend({"id": s.id, "response": r, "reference": s.answer, "score": sc}
                           for s, r, sc in zip(batch.samples, batch.responses,
                                               result.total if result is not None else [None] * len(batch)))
            if not images:
                images = prompt_images(batch.samples, self.config.trainer.log_samples_rows)
            if self.config.trainer.val_metrics:  # the task metrics' rows, gathered below
                generations.extend({"completion": r, "reference": s.answer, "prompt": s.prompt_text(),
                                    "prompt_index": indices[start + int(g)], "columns": dict(s.columns)}
                                   for s, r, g in zip(batch.samples, batch.responses, batch.group_index))
        if self.engine.group_calls:
            # a tensor-parallel vLLM group generates together: a process with a smaller share (rank 0 has
            # the most) joins the group calls it has no prompts for
            most = -(-len(range(0, len(self.val_dataset), world)) // size)
            for _ in range(most - -(-len(indices) // size)):
                self.engine.join_group_call()
        if self.rewards is not None:
            self._record_val_rewards(metrics, results, prompt_of_row, row_sources, params.n)
        mark("task_metrics")
        validation_task_metrics(metrics, self.config.trainer.val_metrics, generations, self.accelerator)
        return StepResult(metrics, records=records, images=images)

    def _record_val_rewards(self, metrics: StepMetrics, results: list, prompt_of_row: list[int],
                            row_sources: list, n: int) -> None:
        """Validation's reward metrics, per response and per prompt (mean@k, best@k, pass@k ...), per data source too."""
        joined = join_results(results, self.rewards.keys, self.rewards.weights)
        record_rewards(metrics, joined, self.rewards.keys)
        groups = group_rows(prompt_of_row)
        prompt_sources = [row_sources[rows[0]] for rows in groups]
        sources = sorted({s for s in prompt_sources if s is not None})
        if self.accelerator.num_processes > 1:  # every process declares every source's keys
            from accelerate.utils import gather_object

            sources = sorted(set(gather_object(sources)))
        record_val_metrics(metrics, groups, joined.components, joined.total, n, self.reward_thresholds,
                           prompt_sources, sources)
