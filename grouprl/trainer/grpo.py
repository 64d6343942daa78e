"""The GRPO-family training loop: one step read top to bottom in ``GRPOTrainer.step``.

    prompts -> engine.generate (n per prompt) -> RolloutBatch
            -> rollout transforms -> rewards -> (dynamic sampling) -> old / ref log-probs
            -> advantages -> run_update (PPO epochs over mini-batches of micro-batches)
            -> rollout copy refreshed -> logs, checkpoint

Every process runs the same steps on its own shard of the prompts and holds the
same number of rows at the update; metrics are reduced across processes by kind
(``trainer.metrics``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from grouprl import algorithms
from grouprl.config import ActorConfig, Config, ConfigError, redacted, save_config, write_text_atomic
from grouprl.rollout.batch import RolloutBatch
from grouprl.rollout.transforms import RolloutTransform
from grouprl.trainer import checkpoint as ckpt
from grouprl.trainer.logging import MetricsLogger, RolloutWriter, truncate_jsonl
from grouprl.trainer.metrics import SchemaFile, StepMetrics
from grouprl.trainer.parallel import full_named_parameters, full_state_dicts
from grouprl.trainer.policy import build_optimizer, build_scheduler, setup_policy
from grouprl.trainer.prompt_stream import PromptStream
from grouprl.trainer.update import Normalisers, UpdateSettings, run_update



def build_rewards(config: Config):
    from grouprl.rewards import RewardComponent, RewardSet, RewardSpec

    r = config.worker.reward
    if r.reward_function:
        specs = [RewardSpec(name=r.reward_function, weight=1.0, kwargs=dict(r.reward_function_kwargs))]
    else:
        specs = [RewardSpec(name=f.name, weight=f.weight, kwargs=dict(f.kwargs)) for f in r.functions]
    rewards = RewardSet.from_specs(specs) if specs else None
    if r.reward_server:
        from grouprl.rewards.registry import REWARD_SERVER_CLIENTS

        client = REWARD_SERVER_CLIENTS.get("reward_server")(r)  # an unknown name is a ConfigError
        # the server's composite is one more weighted component beside any in-process rewards
        components = list(rewards.components) if rewards is not None else []
        components.append(RewardComponent("reward_server", client, r.reward_server_weight, None))
        rewards = RewardSet(components)
    if rewards is None:
        raise ConfigError("no reward: set 'worker.reward.functions', 'worker.reward.reward_function' "
                          "or 'worker.reward.reward_server'")
    return rewards


def reward_columns(batch: RolloutBatch) -> dict[str, list]:
    """Dataset fields of each row's prompt plus rollout extras, as TRL-style per-row columns."""
    keys = {k for s in batch.samples for k in s.columns}
    columns = {k: [s.columns.get(k) for s in batch.samples] for k in sorted(keys)}
    columns["answer"] = [s.answer for s in batch.samples]
    columns.update(batch.extras)
    return columns


def record_rewards(metrics: StepMetrics, result, keys: list[str], prefix: str = "") -> None:
    """Reward statistics under a fixed schema: every component's keys, applicable to any row or not.

    ``rewards/{key}/mean`` and ``/std`` over the rows where the component applies
    (NaN where it applies to none, on every process), ``rewards/{key}/applicable_frac``,
    and ``reward/mean`` / ``reward/std`` of the weighted total.
    """
    n = len(result.total)
    for key in keys:
        values = [v for v in result.components.get(key, []) if v is not None]
        metrics.moments(f"{prefix}rewards/{key}", values)
        metrics.mean(f"{prefix}rewards/{key}/applicable_frac", len(values) / n if n else 0.0, n)
    metrics.moments(f"{prefix}reward", [t for t in result.total if t is not None])


def policy_loss_options(name: str, actor: ActorConfig) -> dict:
    """Each policy loss's own clip range (and SAPO's temperatures) from the actor config."""
    if name in ("gspo", "gspo_token"):
        return {"clip_ratio_low": actor.gspo.clip_ratio_low, "clip_ratio_high": actor.gspo.clip_ratio_high}
    if name == "cispo":
        return {"clip_ratio_low": actor.cispo.clip_ratio_low, "clip_ratio_high": actor.cispo.clip_ratio_high}
    if name == "sapo":
        # no clip: the gate's temperatures take its place (the PPO range is passed and unused)
        return {"clip_ratio_low": actor.clip_ratio_low, "clip_ratio_high": actor.clip_ratio_high,
                "sapo_tau_pos": actor.sapo.tau_pos, "sapo_tau_neg": actor.sapo.tau_neg}
    return {"clip_ratio_low": actor.clip_ratio_low, "clip_ratio_high": actor.clip_ratio_high,
            "clip_ratio_dual": actor.clip_ratio_dual}


def grpo_loss(mb: RolloutBatch, log_prob: torch.Tensor, entropy, norms: Normalisers, metrics: StepMetrics, *,
              algorithm, actor: ActorConfig):
    """The GRPO-family loss of one micro-batch (a ``run_update`` loss function, with the
    ``algorithm`` and ``worker.actor`` config sections bound): the policy loss, plus the
    KL term when it is a loss. Reports ``pg_loss`` and ``kl_loss``; records clip
    fractions, ratio, entropy and KL as token-weighted means."""
    old = log_prob.detach() if mb.old_log_probs is None else mb.old_log_probs
    pg_loss, pg_metrics = algorithms.compute_policy_loss(
        algorithm.policy_loss, log_prob, old, mb.advantages, mb.loss_mask, loss_agg_mode=algorithm.loss_agg_mode,
        token_weights=mb.token_weights, **policy_loss_options(algorithm.policy_loss, actor), **norms.as_options())
    tokens = float(mb.loss_mask.sum())
    for key, value in pg_metrics.items():
        metrics.mean(f"actor/{key}", value, tokens)
    if entropy is not None:
        metrics.mean("actor/entropy", _masked_mean(entropy, mb.loss_mask), tokens)
    reported = {"pg_loss": pg_loss.detach()}
    loss = pg_loss
    if algorithm.kl_coef > 0 and algorithm.use_kl_loss:
        kl = algorithms.kl_penalty(log_prob, mb.ref_log_probs, algorithm.kl_penalty, response_mask=mb.loss_mask)
        kl_loss = algorithms.aggregate_loss(kl, mb.loss_mask, algorithm.loss_agg_mode, **norms.as_options())
        loss = loss + algorithm.kl_coef * kl_loss
        reported["kl_loss"] = kl_loss.detach()
        metrics.mean("actor/kl", _masked_mean(kl.detach(), mb.loss_mask), tokens)
    return loss, reported


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


class GRPOTrainer:
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

        self.config = config
        t, actor, roll = config.trainer, config.worker.actor, config.worker.rollout
        set_seed(t.seed)  # before the policy is built: LoRA adapters are initialised at random
        self.run_dir = config.run_dir
        if train_dataset is None:
            train_dataset, loaded_val = load_datasets(config.data)
            val_dataset = val_dataset if val_dataset is not None else loaded_val
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.rewards = reward_set if reward_set is not None else build_rewards(config)
        self.rollout_transforms = list(rollout_transforms or [])

        trained = setup_policy(actor, t)
        self.accelerator = trained.accelerator
        self.model, self.policy, self.processor = trained.model, trained.policy, trained.processor
        self.is_vlm, self.precision, self.sharded = trained.is_vlm, trained.precision, trained.sharded
        self.is_main = self.accelerator.is_main_process
        self.schema_file = SchemaFile(self.run_dir / "metrics_schema.json", enabled=self.is_main)
        self.uses_lora = actor.model.lora.rank > 0
        self.ref_model = None
        if config.algorithm.kl_coef > 0 and not self.uses_lora:
            # with LoRA the reference is the policy with adapters off: no second copy
            self.ref_model = self._frozen_copy(config.worker.ref.model_path or actor.model.model_path)

        world = self.accelerator.num_processes
        self.stream = PromptStream(train_dataset, config.data.rollout_batch_size, seed=config.data.seed,
                                   shuffle=config.data.shuffle, rank=self.accelerator.process_index, world_size=world)
        self.total_steps = t.max_steps or t.total_epochs * self.stream.batches_per_epoch
        self.optimizer = build_optimizer(self.model, actor)
        self.scheduler = build_scheduler(self.optimizer, actor, self.total_steps)
        self.update_settings = UpdateSettings(
            num_minibatches=config.data.rollout_batch_size // actor.global_batch_size, epochs=actor.ppo_epochs,
            micro_batch_size=actor.micro_batch_size_per_device_for_update, max_grad_norm=actor.max_grad_norm,
            norm_len=float(config.data.max_response_length))

        from grouprl.models.loading import check_image_tokens
        from grouprl.rollout.engine import engine_class
        from grouprl.rollout.transforms import build_rollout_transforms

        # Generation runs on a copy of the weights when the policy's own cannot serve:
        # fp32 masters (sampling from a bf16 copy reads half the bytes per token), an FSDP
        # policy (its forward passes are collectives that generation cannot keep in step),
        # or an engine that loads its own (vLLM).
        engine_cls = engine_class(roll.engine)
        # one_step_off samples while the policy trains: generation needs weights of its own
        holds_weights = (engine_cls.owns_weights or self.precision.rollout_copy or self.sharded
                         or t.async_mode == "one_step_off")
        copy_here = holds_weights and not engine_cls.owns_weights
        rollout_model = self._frozen_copy(actor.model.model_path) if copy_here else self.policy
        self.engine = engine_cls.from_config(rollout_model, self.processor, config=config, holds_weights=holds_weights)
        self._sync_rollout_weights()
        # registered rollout transforms that the config turns on (EditGRPO's edits: worker.rollout.extractor*)
        self.rollout_transforms += build_rollout_transforms(config, processor=self.processor, engine=self.engine)
        self.multiturn = self._multiturn()
        self._check_async_mode()
        correction = config.algorithm.rollout_correction
        # the sampler's log-probs differ from the trainer's when another engine or stale weights sampled
        self.correct_rollout = (correction.enable if correction.enable is not None
                                else engine_cls.owns_weights or t.async_mode == "one_step_off")
        if self.is_vlm:
            # fail before training, not at step 300, when processor and model disagree
            check_image_tokens(self.processor, self.policy, train_dataset[0])
        self.state = ckpt.TrainerState()
        self._pending = None  # one_step_off: (step, future of that step's rollout)
        self._consumed_stream = self.stream.state()  # the data position of the last batch trained on
        self._background = None

    def _multiturn(self):
        """Guided-GRPO's verifier-guided dialogues (``worker.rollout.verifier``), or None."""
        cfg = self.config.worker.rollout.verifier
        if not cfg.enable:
            return None
        if self.rollout_transforms:
            names = ", ".join(type(t).__name__ for t in self.rollout_transforms)
            raise ConfigError(f"config key 'worker.rollout.verifier.enable': verifier dialogues cannot be combined "
                              f"with rollout transforms ({names}: EditGRPO's edits rewrite single responses)")
        from grouprl.rollout.multiturn import MultiTurnRollout
        from grouprl.rollout.verifier import build_verifier

        verifier = build_verifier(cfg, tokenizer=self.processor)
        return MultiTurnRollout(verifier, self.processor, cfg, end_of_turn_ids=list(self.engine.eos_token_ids))

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

    def _frozen_copy(self, path: str):
        """The model at ``path`` in the precision's frozen dtype, on this process's device, never trained."""
        from grouprl.models.loading import load_model_and_processor

        model, _, _ = load_model_and_processor(path, dtype=self.precision.frozen_dtype,
                                               trust_remote_code=self.config.worker.actor.model.trust_remote_code)
        return model.requires_grad_(False).eval().to(self.accelerator.device)

    def _sync_rollout_weights(self) -> None:
        """Give the engine the trained weights (a collective for a sharded policy)."""
        if self.engine.holds_weights:
            self.engine.update_weights(full_named_parameters(self.model))

    # ------------------------------------------------------------------ rollout

    def _sampling(self, step: int, *, validation: bool = False):
        from grouprl.rollout.engine import SamplingParams

        r = self.config.worker.rollout
        # seeded by (run seed, step, process) so a resumed run samples what the original would have
        seed = (self.config.trainer.seed * 1_000_003 + step * 101 + self.accelerator.process_index) % 2**31
        return SamplingParams(
            n=r.val_n if validation else r.n,
            temperature=r.val_temperature if validation else r.temperature,
            top_p=1.0 if validation else r.top_p,
            top_k=None if validation or r.top_k <= 0 else r.top_k,
            max_new_tokens=self.config.data.max_response_length,
            seed=seed,
            return_log_probs=(self.config.trainer.log_completions or self.correct_rollout) and not validation,
        )

    def _score(self, batch: RolloutBatch):
        """Rewards, overlong shaping and truncation masking, in place; returns the RewardResult."""
        algo = self.config.algorithm
        result = self.rewards.score([s.prompt_text() for s in batch.samples], batch.responses, reward_columns(batch),
                                    allow_unscored=True)
        batch.reward_components = result.components
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
        record_rewards(metrics, result, self.rewards.keys)
        metrics.sum("reward/unscored_rows", float(sum(t is None for t in result.total)))
        zero_std = algorithms.reward_std_per_group(batch.scores, batch.group_index) == 0
        metrics.mean("frac_reward_zero_std", float(zero_std.float().mean()) if rows else 0.0, rows)
        for transform, transform_metrics in transformed:
            kinds = getattr(transform, "metric_kinds", {})
            for key, value in transform_metrics.items():
                if kinds.get(key) == "sum":
                    metrics.sum(key, value)
                else:
                    metrics.mean(key, value, rows)
        if transformed:
            for name, mask in (("edited", batch.edited), ("unedited", ~batch.edited)):
                count = int(mask.sum())
                metrics.mean(f"edits/reward_{name}_mean", float(batch.scores[mask].mean()) if count else 0.0, count)

    def _generate_and_score(self, prompts: list, params, metrics: StepMetrics, spent: dict[str, float], *,
                            record: bool = True) -> RolloutBatch:
        """Generate, transform and score one round's prompts, ``worker.rollout.micro_batch_size`` rows at a time.

        sync: every micro-batch is generated, then the transforms and rewards see the
        whole batch. async_reward (and one_step_off): each micro-batch is transformed
        and handed to a worker thread for scoring while the next one generates, so
        slow rewards (a reward server, a judge model) overlap generation; transforms
        must then work group by group. The micro-batches are generated with the same
        seeds either way, so both modes sample the same responses. ``record`` (the first
        round of a step) logs what was sampled; ``spent`` adds up the seconds spent
        generating and scoring over the rounds.
        """
        n = params.n
        per_chunk = max(1, (self.config.worker.rollout.micro_batch_size or len(prompts) * n) // n)
        chunks = [prompts[i:i + per_chunk] for i in range(0, len(prompts), per_chunk)]

        def generate(k: int) -> tuple[RolloutBatch, list[tuple[object, dict]]]:
            """Micro-batch k, with the dialogue runner's metrics when a verifier is on."""
            t0 = time.perf_counter()
            batch = self._sample(chunks[k], replace(params, seed=params.seed + 104_729 * k))
            spent["generate"] += time.perf_counter() - t0
            return batch, [(self.multiturn, dict(self.multiturn.last_metrics))] if self.multiturn else []

        def score(batch: RolloutBatch):
            t0 = time.perf_counter()
            result = self._score(batch)
            spent["reward"] += time.perf_counter() - t0
            return result

        def transform(batch: RolloutBatch, transformed: list) -> tuple[RolloutBatch, list[tuple[object, dict]]]:
            for t in self.rollout_transforms:
                batch = t(batch)
                transformed.append((t, dict(getattr(t, "last_metrics", {}))))
            return batch, transformed

        pad = self.engine.pad_token_id
        if self.config.trainer.async_mode == "sync" or len(chunks) == 1:
            generated = [generate(k) for k in range(len(chunks))]
            batch, transformed = transform(RolloutBatch.concat([b for b, _ in generated], pad_token_id=pad),
                                           [pair for _, pairs in generated for pair in pairs])
            result = score(batch)
            if record:
                self._record_rollout(batch, result, transformed, metrics)
            return batch
        parts, scoring = [], []
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grouprl-rewards") as pool:
            for k in range(len(chunks)):
                batch, transformed = transform(*generate(k))
                parts.append((batch, transformed))
                scoring.append(pool.submit(score, batch))  # scores while the next chunk generates
            results = [f.result() for f in scoring]
        if record:
            for (batch, transformed), result in zip(parts, results):
                self._record_rollout(batch, result, transformed, metrics)
        return RolloutBatch.concat([batch for batch, _ in parts], pad_token_id=pad)

    def _sample(self, samples: list, params, *, validation: bool = False) -> RolloutBatch:
        """One engine call, or, with a verifier, the dialogues that start from it."""
        if self.multiturn is not None:
            return self.multiturn.generate(self.engine, samples, params, validation=validation)
        return self.engine.generate(samples, params)

    def _fewest_over_processes(self, value: int) -> int:
        if self.accelerator.num_processes == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.accelerator.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return int(t)

    def rollout(self, step: int, metrics: StepMetrics) -> RolloutBatch | None:
        """Generate, transform and score one step's batch, with DAPO dynamic sampling when on.

        Dynamic sampling keeps groups whose rewards differ and draws more prompts until
        every process has its share of groups (or the extra rounds run out); then every
        process keeps the same number of groups, the fewest any process found, so all
        take the same number of optimizer steps. Groups found beyond that are dropped
        and counted (``dynamic_sampling/unused_groups``).
        """
        algo = self.config.algorithm
        params = self._sampling(step)
        wanted = self.config.data.rollout_batch_size // self.accelerator.num_processes
        kept: list[RolloutBatch] = []
        kept_groups = rounds = 0
        spent = {"generate": 0.0, "reward": 0.0}
        try:
            while True:
                prompts = self.stream.next_batch()
                # each extra round draws new prompts; a new seed keeps its samples independent too
                batch = self._generate_and_score(prompts, replace(params, seed=params.seed + 7919 * rounds),
                                                 metrics, spent, record=rounds == 0)
                if not algo.online_filtering:
                    return batch
                keep = algorithms.filter_groups(batch.scores, batch.group_index, min_std=algo.filter_min_std)
                if keep.any():
                    part = batch.select(keep.nonzero().squeeze(-1))
                    kept.append(part)
                    kept_groups += int(part.group_index.unique().numel())
                rounds += 1
                # the same decision on every process: they draw the same number of prompt batches
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
        if take == 0:
            return None
        batch = RolloutBatch.concat(kept, pad_token_id=self.engine.pad_token_id)
        groups = batch.group_index.unique()[:take]  # the earliest groups
        return batch.select(torch.isin(batch.group_index, groups).nonzero().squeeze(-1))

    # ------------------------------------------------------------------ log-probs

    def _log_prob_fn(self, model, batch: RolloutBatch):
        from grouprl.rollout.logprobs import compute_log_probs

        return compute_log_probs(model, batch, micro_batch_size=len(batch),
                                 temperature=self.config.worker.rollout.temperature, with_entropy=True)

    @torch.no_grad()
    def _log_probs(self, model, batch: RolloutBatch) -> torch.Tensor:
        """Log-probs without gradient, computed the way the update computes them (same precision)."""
        from grouprl.rollout.logprobs import compute_log_probs

        # the reference runs in its own (frozen) dtype; the policy as the update will run it
        context = self.precision.autocast(self.accelerator.device) if model is self.model else contextlib.nullcontext()
        with context:
            return compute_log_probs(model, batch,
                                     micro_batch_size=self.config.worker.actor.micro_batch_size_per_device_for_experience,
                                     temperature=self.config.worker.rollout.temperature)[0]

    @torch.no_grad()
    def _reference_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        if self.ref_model is not None:
            return self._log_probs(self.ref_model, batch)
        with self.policy.disable_adapter():
            return self._log_probs(self.model, batch)

    # ------------------------------------------------------------------ one-step-off pipeline

    def _next_rollout(self, step: int, metrics: StepMetrics) -> tuple[RolloutBatch | None, bool]:
        """This step's scored batch, and whether it was sampled before the last update (one_step_off).

        In one_step_off mode the batch of step k+1 is generated and scored in a worker
        thread, by the engine's copy of the weights from before step k's update, while
        step k trains; the first step (and the first after a resume) generates in line.
        """
        if self.config.trainer.async_mode != "one_step_off":
            batch = self.rollout(step, metrics)
            self._consumed_stream = self.stream.state()
            return batch, False
        stale = self._pending is not None and self._pending[0] == step
        if stale:
            t0 = time.perf_counter()
            batch, rollout_metrics = self._pending[1].result()
            metrics.max("timing/rollout_wait_s", time.perf_counter() - t0)
            metrics.merge(rollout_metrics)
        else:
            batch = self.rollout(step, metrics)
        self._pending = None
        metrics.mean("async/staleness_steps", float(stale))
        # what a checkpoint after this step must record: the next batch is drawn in the background
        self._consumed_stream = self.stream.state()
        if step < self.total_steps:
            if self._background is None:
                self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grouprl-rollout")
            self._pending = (step + 1, self._background.submit(self._rollout_in_background, step + 1))
        return batch, stale

    def _rollout_in_background(self, step: int) -> tuple[RolloutBatch | None, StepMetrics]:
        metrics = StepMetrics()
        stream = torch.cuda.Stream() if self.accelerator.device.type == "cuda" else None
        # its own CUDA stream, so that generation kernels can run beside the update's
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            batch = self.rollout(step, metrics)
        if stream is not None:
            stream.synchronize()
        return batch, metrics

    def _finish_pending(self, metrics: StepMetrics) -> None:
        """Wait until the next step's rollout, if one is being generated, is done with the engine."""
        if self._pending is not None:
            t0 = time.perf_counter()
            concurrent.futures.wait([self._pending[1]])
            metrics.max("timing/rollout_overhang_s", time.perf_counter() - t0)

    def _correct_rollout(self, batch: RolloutBatch, metrics: StepMetrics) -> None:
        """Importance weights between the trainer's old log-probs and the sampler's, with their mismatch logged."""
        if batch.rollout_log_probs is None:
            raise RuntimeError("rollout correction is on, but the engine returned no sampler log-probs")
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

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> StepMetrics:
        """One training step on this process; returns its metrics, not yet reduced across processes."""
        cfg, algo = self.config, self.config.algorithm
        metrics = StepMetrics()
        t0 = time.perf_counter()
        self._last_batch = None
        batch, stale = self._next_rollout(step, metrics)
        t_rollout = time.perf_counter() - t0
        # every process takes this branch together: dynamic sampling agrees on the count
        metrics.mean("actor/skipped_step", float(batch is None))
        metrics.mean("actor/lr", self.scheduler.get_last_lr()[0])
        if batch is None:  # every group had zero reward spread, even after the extra rounds
            with warnings.catch_warnings():
                # the schedule counts training steps, taken or skipped; torch warns when the
                # first one is skipped, before any optimizer step
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
                self.scheduler.step()
            self._finish_pending(metrics)
            return metrics

        kl_on = algo.kl_coef > 0
        kl_in_reward = kl_on and not algo.use_kl_loss
        settings = self.update_settings
        # With one update per rollout the sampling policy is the one being trained, so
        # its log-probs come for free from the update's own forward (ratio exactly 1).
        # (A stale batch, or one sampled by another engine, has other log-probs: recompute them.)
        on_policy = settings.epochs == 1 and settings.num_minibatches == 1 and not stale
        t_log_probs = time.perf_counter()
        if not on_policy or kl_in_reward or self.correct_rollout:
            batch.old_log_probs = self._log_probs(self.model, batch)
        if self.correct_rollout:
            self._correct_rollout(batch, metrics)
        if kl_on:
            batch.ref_log_probs = self._reference_log_probs(batch)
        metrics.max("timing/log_probs_s", time.perf_counter() - t_log_probs)

        token_rewards = None
        if kl_in_reward:
            kl = algorithms.kl_penalty(batch.old_log_probs, batch.ref_log_probs, algo.kl_penalty,
                                       response_mask=batch.loss_mask)
            token_rewards = -algo.kl_coef * kl
            metrics.mean("reward/kl_penalty", _masked_mean(kl, batch.loss_mask), float(batch.loss_mask.sum()))
        batch.advantages = self._advantages(batch.scores, batch, token_rewards)

        loss_fn = functools.partial(grpo_loss, algorithm=algo, actor=cfg.worker.actor)
        # an engine with accelerator memory of its own (vLLM) gives it up while the update runs,
        # unless it is generating the next batch meanwhile (one_step_off)
        sleeping = self.engine.supports_sleep and self._pending is None
        if sleeping:
            self.engine.sleep()
        t_update = time.perf_counter()
        run_update(self.model, self.optimizer, batch, log_prob_fn=self._log_prob_fn, loss_fn=loss_fn,
                   accelerator=self.accelerator, precision=self.precision, settings=settings, metrics=metrics)
        self.scheduler.step()
        metrics.max("timing/update_s", time.perf_counter() - t_update)
        self._finish_pending(metrics)  # the engine must be idle before its weights change
        t_sync = time.perf_counter()
        self._sync_rollout_weights()
        if sleeping:
            self.engine.wake_up()
        metrics.max("timing/weight_sync_s", time.perf_counter() - t_sync)
        self._batch_metrics(batch, metrics)
        elapsed = time.perf_counter() - t0
        metrics.max("timing/step_s", elapsed)
        metrics.max("timing/rollout_s", t_rollout)
        metrics.sum("perf/tokens", float(batch.response_mask.sum() + batch.prompt_mask.sum()))
        metrics.sum("perf/samples", float(len(batch)))
        self._last_batch = batch
        return metrics

    def _advantages(self, scores: torch.Tensor, batch: RolloutBatch, token_rewards) -> torch.Tensor:
        algo = self.config.algorithm
        name = algo.adv_estimator
        options: dict = {"response_mask": batch.loss_mask}
        if name in ("grpo", "grpo_passk"):
            options["norm_by_std"] = algo.norm_adv_by_std_in_grpo
        if name == "reinforce_plus_plus":
            options["gamma"] = algo.gamma
            if token_rewards is not None:
                options["token_rewards"] = token_rewards
        elif token_rewards is not None:
            scores = scores + token_rewards.sum(-1)  # outcome estimators see the sequence's KL-adjusted return
        if name == "remax":
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
        result = self.rewards.score([s.prompt_text() for s in greedy.samples], greedy.responses, reward_columns(greedy))
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
            })
        return records

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

    def _gather_records(self, records: list[dict]) -> list[dict]:
        """Every process's records, in process order, on every process (for the main one to write)."""
        if self.accelerator.num_processes == 1:
            return records
        from accelerate.utils import gather_object

        return gather_object(records)

    # ------------------------------------------------------------------ validation

    @torch.no_grad()
    def validate(self, step: int) -> StepMetrics:
        """Greedy (by default) responses to this process's share of the validation set, scored.

        A process may get no validation sample (fewer samples than processes): it still
        reports every key, with no weight.
        """
        metrics = StepMetrics()
        if self.val_dataset is None or len(self.val_dataset) == 0:
            return metrics
        params = self._sampling(step, validation=True)
        size = self.config.data.val_batch_size
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        indices = list(range(len(self.val_dataset)))[rank::world]
        totals, components, records = [], {k: [] for k in self.rewards.keys}, []
        for start in range(0, len(indices), size):
            samples = [self.val_dataset[i] for i in indices[start:start + size]]
            batch = self._sample(samples, params, validation=True)  # no reference for a verifier
            result = self.rewards.score([s.prompt_text() for s in batch.samples], batch.responses,
                                        reward_columns(batch), allow_unscored=True)
            totals.extend(result.total)
            for k, v in result.components.items():
                components[k].extend(v)
            records.extend({"id": s.id, "response": r, "reference": s.answer, "score": sc}
                           for s, r, sc in zip(batch.samples, batch.responses, result.total))
        from grouprl.rewards import RewardResult

        record_rewards(metrics, RewardResult(components=components, total=totals, weights=self.rewards.weights),
                       self.rewards.keys)
        records = self._gather_records(records)
        if self.is_main and records:
            RolloutWriter(self.run_dir / "val_generations.jsonl").write(step, records[: self.config.trainer.val_generations_to_log])
        return metrics

    # ------------------------------------------------------------------ the loop

    def _resume(self) -> bool:
        """Load the checkpoint named by ``trainer.resume``; False when starting fresh."""
        path = ckpt.resume_path(self.config.trainer.resume, self.config.checkpoint_dir)
        if path is None:
            return False
        self.state = ckpt.restore_checkpoint(path, self.policy, self.optimizer, self.scheduler,
                                             process_index=self.accelerator.process_index,
                                             num_processes=self.accelerator.num_processes)
        self.stream.load_state(self.state.extra["stream"])
        self._consumed_stream = self.stream.state()
        self._sync_rollout_weights()
        self.accelerator.print(f"resumed from {path} at step {self.state.global_step}")
        return True

    def save(self) -> Path | None:
        """Write a checkpoint (every process takes part; the main one writes)."""
        from accelerate.utils import gather_object

        # the position after the last batch trained on (one_step_off may have drawn the next already)
        self.state.extra["stream"] = dict(self._consumed_stream)
        model_state, optimizer_state = full_state_dicts(self.policy, self.optimizer)
        rng_states = gather_object([ckpt.rng_state()]) if self.accelerator.num_processes > 1 else [ckpt.rng_state()]
        path = None
        if self.is_main:
            path = ckpt.save_checkpoint(self.config.checkpoint_dir, self.state, self.policy, optimizer_state,
                                        self.scheduler, processor=self.processor,
                                        save_limit=self.config.trainer.save_limit, rng_states=rng_states,
                                        model_state_dict=model_state)
        self.accelerator.wait_for_everyone()
        return path

    def run_info(self) -> dict:
        """How this run is laid out (written to ``run_info.json``): processes, strategy, precision."""
        return {"num_processes": self.accelerator.num_processes, "device": str(self.accelerator.device),
                "strategy": self.config.worker.actor.strategy, "precision": self.precision.describe(),
                "rollout_weights": "copy" if self.engine.holds_weights else "policy"}

    def _reduce(self, metrics: StepMetrics, prefix: str = "") -> dict[str, float]:
        """Every process's metrics combined; the main process records each key's kind in metrics_schema.json."""
        self.schema_file.record(metrics, prefix)
        values = metrics.reduce(self.accelerator)
        # rates from totals over all processes and the slowest process's time
        if "perf/tokens" in values and values.get("timing/step_s"):
            values["perf/tokens_per_s"] = values.pop("perf/tokens") / values["timing/step_s"]
            values["perf/samples_per_s"] = values.pop("perf/samples") / values["timing/step_s"]
        return values

    def train(self) -> dict[str, float]:
        t = self.config.trainer
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.config, self.run_dir / "config.yaml")
            write_text_atomic(self.run_dir / "run_info.json", json.dumps(self.run_info(), indent=2))
        resume_step = self.state.global_step if self._resume() else None
        if self.is_main and resume_step is not None:
            # what a killed run wrote after its last checkpoint is written again below
            truncate_jsonl(self.run_dir / "val_generations.jsonl", resume_step)
        self.logger = MetricsLogger(self.run_dir, t.logger, total_steps=self.total_steps, config=redacted(self.config),
                                    project=t.project_name, experiment=t.experiment_name, enabled=self.is_main,
                                    initial_step=self.state.global_step, resume_step=resume_step)
        rollouts = RolloutWriter(self.run_dir / "rollouts.jsonl", enabled=self.is_main and t.log_rollouts,
                                 resume_step=resume_step)
        completions = RolloutWriter(self.run_dir / "completions.jsonl", enabled=self.is_main and t.log_completions,
                                    resume_step=resume_step)
        last: dict[str, float] = {}
        try:
            if t.val_before_train and self.state.global_step == 0:
                self.logger.log(0, self._reduce(self.validate(0), "val/"), prefix="val/")
            while self.state.global_step < self.total_steps:
                step = self.state.global_step + 1
                metrics = self._reduce(self.step(step))
                self.state.global_step = step
                self.state.epoch = self.stream.epoch
                self.logger.log(step, metrics)
                last = metrics
                batch = getattr(self, "_last_batch", None)
                if t.log_rollouts and batch is not None:
                    rollouts.write(step, self._gather_records(self.rollout_records(batch)))
                if t.log_completions and batch is not None:
                    completions.write(step, self._gather_records(self.completion_records(batch)))
                if t.val_freq > 0 and step % t.val_freq == 0:
                    self.logger.log(step, self._reduce(self.validate(step), "val/"), prefix="val/")
                if t.save_freq > 0 and step % t.save_freq == 0:
                    self.save()
            if not (t.save_freq > 0 and self.state.global_step % t.save_freq == 0):
                self.save()
        finally:
            if self._background is not None:
                self._background.shutdown(wait=True, cancel_futures=True)
                self._background, self._pending = None, None
            rollouts.close()
            completions.close()
            self.logger.close()
        return last
