"""The GRPO-family training loop: one step read top to bottom in ``GRPOTrainer.step``.

    prompts -> engine.generate (n per prompt) -> RolloutBatch
            -> rollout transforms -> rewards -> (dynamic sampling) -> old / ref log-probs
            -> advantages -> PPO epochs over mini-batches of micro-batches -> logs, checkpoint
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from grouprl import algorithms
from grouprl.config import Config, ConfigError, save_config, to_dict
from grouprl.rollout.batch import RolloutBatch
from grouprl.trainer import checkpoint as ckpt
from grouprl.trainer.logging import MetricsLogger, RolloutWriter
from grouprl.trainer.policy import build_optimizer, build_policy, build_scheduler
from grouprl.trainer.prompts import PromptStream

RolloutTransform = Callable[[RolloutBatch], RolloutBatch]


def load_datasets(config: Config):
    from grouprl.data import load_samples

    d = config.data
    if not d.train_files:
        raise ConfigError("config key 'data.train_files' is empty")
    common = dict(format=d.format, prompt_key=d.prompt_key, answer_key=d.answer_key, image_key=d.image_key,
                  image_dir=d.image_dir, min_pixels=d.min_pixels, max_pixels=d.max_pixels,
                  system_prompt=d.system_prompt, skip_bad_records=d.skip_bad_records, id_key=d.id_key)
    train = load_samples(d.train_files, max_samples=d.max_samples, **common)
    val = load_samples(d.val_files, max_samples=d.val_max_samples, **common) if d.val_files else None
    return train, val


def build_rewards(config: Config):
    from grouprl.rewards import RewardComponent, RewardSet, RewardSpec

    r = config.worker.reward
    if r.reward_function:
        specs = [RewardSpec(name=r.reward_function, weight=1.0, kwargs=dict(r.reward_function_kwargs))]
    else:
        specs = [RewardSpec(name=f.name, weight=f.weight, kwargs=dict(f.kwargs)) for f in r.functions]
    rewards = RewardSet.from_specs(specs) if specs else None
    if r.reward_server:
        from grouprl.rewards.client import RewardServerClient

        client = RewardServerClient(
            r.reward_server, components=list(r.reward_components), type=r.type, batch_size=r.server_batch_size,
            max_concurrency=r.server_max_concurrency, timeout=r.server_timeout, retries=r.server_retries,
            token=os.environ.get("GROUPRL_REWARD_TOKEN"))
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


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    total = mask.sum()
    return float((values * mask).sum() / total) if total > 0 else 0.0


class GRPOTrainer:
    """Trains a policy with a group-relative algorithm chosen by the config.

    ``rollout_transforms`` run on every RolloutBatch after generation and before
    rewards (post-rollout edits and verifier turns plug in here).
    """

    def __init__(self, config: Config, *, train_dataset=None, val_dataset=None, reward_set=None,
                 rollout_transforms: list[RolloutTransform] | None = None):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.config = config
        t = config.trainer
        self.accelerator = Accelerator(cpu=t.device == "cpu")
        set_seed(t.seed)
        self.is_main = self.accelerator.is_main_process
        self.run_dir = config.run_dir

        if train_dataset is None:
            train_dataset, loaded_val = load_datasets(config)
            val_dataset = val_dataset if val_dataset is not None else loaded_val
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.rewards = reward_set if reward_set is not None else build_rewards(config)
        self.rollout_transforms = list(rollout_transforms or [])

        actor = config.worker.actor
        self.model, self.processor, self.is_vlm = build_policy(actor.model)
        self.uses_lora = actor.model.lora.rank > 0
        self.ref_model = None
        if config.algorithm.kl_coef > 0 and not self.uses_lora:
            # with LoRA the reference is the policy with adapters off: no second copy
            from grouprl.models.loading import load_model_and_processor

            ref_path = config.worker.ref.model_path or actor.model.model_path
            self.ref_model, _, _ = load_model_and_processor(ref_path, dtype=actor.model.dtype,
                                                            trust_remote_code=actor.model.trust_remote_code)
            self.ref_model.requires_grad_(False).eval()
            self.ref_model.to(self.accelerator.device)

        world = self.accelerator.num_processes
        if world > 1 and config.algorithm.online_filtering:
            # processes would keep different numbers of groups and disagree on the number
            # of optimizer steps; balancing them across processes is not implemented yet
            raise ConfigError("algorithm.online_filtering is not supported with more than one process yet")
        self.stream = PromptStream(train_dataset, config.data.rollout_batch_size, seed=config.data.seed,
                                   shuffle=config.data.shuffle, rank=self.accelerator.process_index, world_size=world)
        self.total_steps = t.max_steps or t.total_epochs * self.stream.batches_per_epoch
        updates_per_step = actor.ppo_epochs * (config.data.rollout_batch_size // actor.global_batch_size)
        self.optimizer = build_optimizer(self.model, actor)
        self.scheduler = build_scheduler(self.optimizer, actor, self.total_steps * updates_per_step)
        self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)

        from grouprl.models.loading import check_image_tokens
        from grouprl.rollout.hf_engine import HFGenerationEngine

        self.policy = self.accelerator.unwrap_model(self.model)
        self.engine = HFGenerationEngine(self.policy, self.processor, max_prompt_length=config.data.max_prompt_length,
                                         micro_batch_size=config.worker.rollout.micro_batch_size)
        roll = config.worker.rollout
        if roll.extractor or config.algorithm.force_gt_num > 0:
            from grouprl.rollout.edits import EditTransform
            from grouprl.trainer.sft import end_of_turn_id

            # EditGRPO: edited copies join their group after generation and before rewards,
            # so their old log-probs come from the actor like any other row's
            self.rollout_transforms.append(EditTransform(
                self.processor, eos_token_id=end_of_turn_id(getattr(self.processor, "tokenizer", self.processor)),
                pad_token_id=self.engine.pad_token_id, num_ops_per_para=roll.extractor_num_ops_per_para,
                num_para=roll.extractor_num_para if roll.extractor else 0, tau=roll.extractor_similarity_threshold,
                force_gt_num=config.algorithm.force_gt_num, seed=t.seed, extractor=roll.extractor_type,
                extractor_model_path=roll.extractor_model_path,
                edited_tokens=roll.extractor_edited_tokens))
        if self.is_vlm:
            # fail before training, not at step 300, when processor and model disagree
            check_image_tokens(self.processor, self.policy, train_dataset[0])
        self.state = ckpt.TrainerState()

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
            return_log_probs=self.config.trainer.log_completions and not validation,
        )

    def _score(self, batch: RolloutBatch) -> dict[str, float]:
        """Rewards, overlong shaping and truncation masking, in place; returns the reward metrics."""
        algo = self.config.algorithm
        result = self.rewards.score([s.prompt_text() for s in batch.samples], batch.responses, reward_columns(batch))
        batch.reward_components = result.components
        scores = torch.tensor(result.total, dtype=torch.float32)
        if algo.overlong_buffer.enable:
            lengths = batch.response_mask.sum(-1)
            penalty = algorithms.overlong_penalty(
                lengths, max_length=self.config.data.max_response_length,
                buffer_length=algo.overlong_buffer.length, penalty_factor=algo.overlong_buffer.penalty_factor)
            batch.reward_components["overlong"] = penalty.tolist()
            scores = scores + penalty
        batch.scores = scores
        if algo.mask_truncated_completions:
            batch.loss_mask = algorithms.mask_truncated(batch.loss_mask, batch.truncated)
        return result.metrics()

    def rollout(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Generate, transform and score one step's batch, with DAPO dynamic sampling when on."""
        algo = self.config.algorithm
        params = self._sampling(step)
        wanted = self.config.data.rollout_batch_size // self.accelerator.num_processes
        kept: list[RolloutBatch] = []
        kept_groups, rounds, metrics = 0, 0, {}
        while True:
            prompts = self.stream.next_batch()
            # each extra round draws new prompts; a new seed keeps its samples independent too
            batch = self.engine.generate(prompts, replace(params, seed=params.seed + 7919 * rounds))
            transform_metrics: dict[str, float] = {}
            for transform in self.rollout_transforms:
                batch = transform(batch)
                transform_metrics.update(getattr(transform, "last_metrics", {}))
            reward_metrics = self._score(batch)
            if rounds == 0:
                metrics = reward_metrics  # what the policy produced, before any filtering
                metrics["frac_reward_zero_std"] = float(
                    (algorithms.reward_std_per_group(batch.scores, batch.group_index) == 0).float().mean())
                metrics.update(transform_metrics)
                if self.rollout_transforms:
                    # NaN (not a missing key) when a side is empty: every process logs the same keys
                    for name, rows in (("edited", batch.edited), ("unedited", ~batch.edited)):
                        metrics[f"edits/reward_{name}_mean"] = float(batch.scores[rows].mean()) if rows.any() else math.nan
            if not algo.online_filtering:
                return batch, metrics
            keep = algorithms.filter_groups(batch.scores, batch.group_index, min_std=algo.filter_min_std)
            if keep.any():
                part = batch.select(keep.nonzero().squeeze(-1))
                kept.append(part)
                kept_groups += int(part.group_index.unique().numel())
            rounds += 1
            if kept_groups >= wanted or rounds > algo.max_filter_rounds:
                break
        metrics["dynamic_sampling/rounds"] = float(rounds)
        metrics["dynamic_sampling/kept_groups"] = float(kept_groups)
        if not kept:
            return None, metrics
        batch = RolloutBatch.concat(kept, pad_token_id=self.engine.pad_token_id)
        groups = batch.group_index.unique()[:wanted] if kept_groups > wanted else None  # the earliest groups
        if groups is not None:
            batch = batch.select(torch.isin(batch.group_index, groups).nonzero().squeeze(-1))
        return batch, metrics

    # ------------------------------------------------------------------ log-probs

    @torch.no_grad()
    def _log_probs(self, model, batch: RolloutBatch, *, with_entropy: bool = False):
        from grouprl.rollout.logprobs import compute_log_probs

        return compute_log_probs(model, batch, micro_batch_size=self.config.worker.actor.micro_batch_size_per_device_for_experience,
                                 temperature=self.config.worker.rollout.temperature, with_entropy=with_entropy)

    @torch.no_grad()
    def _reference_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        if self.ref_model is not None:
            return self._log_probs(self.ref_model, batch)[0]
        with self.policy.disable_adapter():
            return self._log_probs(self.policy, batch)[0]

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> dict[str, float]:
        cfg, algo, actor = self.config, self.config.algorithm, self.config.worker.actor
        t0 = time.perf_counter()
        self._last_batch = None
        batch, metrics = self.rollout(step)
        t_rollout = time.perf_counter() - t0
        if batch is None:  # every group had zero reward spread, even after the extra rounds
            metrics["actor/skipped_step"] = 1.0
            return metrics

        n_minibatches = max(1, len(batch) // (actor.global_batch_size * cfg.worker.rollout.n // self.accelerator.num_processes))
        kl_on = algo.kl_coef > 0
        kl_in_reward = kl_on and not algo.use_kl_loss
        # With one update per rollout the sampling policy is the one being trained, so
        # its log-probs come for free from the update's own forward (ratio exactly 1).
        on_policy = actor.ppo_epochs == 1 and n_minibatches == 1
        if not on_policy or kl_in_reward:
            batch.old_log_probs = self._log_probs(self.model, batch)[0]
        if kl_on:
            batch.ref_log_probs = self._reference_log_probs(batch)

        scores = batch.scores
        token_rewards = None
        if kl_in_reward:
            kl = algorithms.kl_penalty(batch.old_log_probs, batch.ref_log_probs, algo.kl_penalty) * batch.loss_mask
            token_rewards = -algo.kl_coef * kl
            metrics["reward/kl_penalty"] = _masked_mean(kl, batch.loss_mask)
        batch.advantages = self._advantages(scores, batch, token_rewards)

        update_metrics = self._update(batch, n_minibatches)
        metrics.update(update_metrics)
        metrics.update(self._batch_metrics(batch))
        elapsed = time.perf_counter() - t0
        tokens = float(batch.response_mask.sum() + batch.prompt_mask.sum())
        metrics.update({"timing/step_s": elapsed, "timing/rollout_s": t_rollout,
                        "perf/tokens_per_s": tokens * self.accelerator.num_processes / elapsed,
                        "perf/samples_per_s": len(batch) * self.accelerator.num_processes / elapsed,
                        "actor/lr": self.scheduler.get_last_lr()[0]})
        self._last_batch = batch
        return metrics

    def _advantages(self, scores: torch.Tensor, batch: RolloutBatch, token_rewards) -> torch.Tensor:
        algo = self.config.algorithm
        name = algo.adv_estimator
        options: dict = {"response_mask": batch.loss_mask}
        if name == "grpo":
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

    def _update(self, batch: RolloutBatch, n_minibatches: int) -> dict[str, float]:
        """PPO epochs over mini-batches; each mini-batch is one optimizer step over micro-batches."""
        from grouprl.rollout.logprobs import compute_log_probs

        cfg, algo, actor = self.config, self.config.algorithm, self.config.worker.actor
        acc = self.accelerator
        self.model.train()
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}

        def add(key, value):
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1

        rows = torch.arange(len(batch))
        minibatches = rows.chunk(n_minibatches)
        for _ in range(actor.ppo_epochs):
            for mb_rows in minibatches:
                mini = batch.select(mb_rows)
                # global normalisers make the micro-batch losses add up to the mini-batch loss,
                # across processes too (DDP averages gradients, hence the x world_size below)
                counts_t = torch.tensor([float(mini.loss_mask.sum()), float(len(mini))], device=acc.device)
                counts_t = acc.reduce(counts_t, reduction="sum")
                agg = {"num_tokens": max(counts_t[0].item(), 1.0), "num_seqs": counts_t[1].item(),
                       "norm_len": cfg.data.max_response_length}
                micro = list(torch.arange(len(mini)).split(actor.micro_batch_size_per_device_for_update))
                for i, mrows in enumerate(micro):
                    mb = mini.select(mrows)
                    sync = contextlib.nullcontext() if i == len(micro) - 1 else acc.no_sync(self.model)
                    with sync:
                        log_prob, entropy = compute_log_probs(
                            self.model, mb, micro_batch_size=len(mb), temperature=cfg.worker.rollout.temperature,
                            with_entropy=True)
                        old = log_prob.detach() if mb.old_log_probs is None else mb.old_log_probs
                        pg_loss, pg_metrics = algorithms.compute_policy_loss(
                            algo.policy_loss, log_prob, old, mb.advantages, mb.loss_mask,
                            clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
                            clip_ratio_dual=actor.clip_ratio_dual, loss_agg_mode=algo.loss_agg_mode, **agg)
                        loss = pg_loss
                        if algo.kl_coef > 0 and algo.use_kl_loss:
                            kl = algorithms.kl_penalty(log_prob, mb.ref_log_probs, algo.kl_penalty)
                            kl_loss = algorithms.aggregate_loss(kl, mb.loss_mask, algo.loss_agg_mode, **agg)
                            loss = loss + algo.kl_coef * kl_loss
                            add("actor/kl_loss", kl_loss.item() * len(micro))
                            add("actor/kl", _masked_mean(kl.detach(), mb.loss_mask))
                        acc.backward(loss * acc.num_processes)
                    add("actor/pg_loss", pg_loss.item() * len(micro))
                    add("actor/entropy", _masked_mean(entropy.detach(), mb.loss_mask))
                    for key, value in pg_metrics.items():
                        add(f"actor/{key}", value)
                grad_norm = acc.clip_grad_norm_(self.model.parameters(), actor.max_grad_norm)
                add("actor/grad_norm", float(grad_norm))
                finite = math.isfinite(float(grad_norm))
                if finite:
                    self.optimizer.step()
                add("actor/nonfinite_grad_steps", 0.0 if finite else 1.0)
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
                self.state.optimizer_steps += 1
        self.model.eval()
        return {k: sums[k] / counts[k] for k in sums}

    def _batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        lengths = batch.response_mask.sum(-1).float()
        adv = batch.advantages
        per_row_adv = (adv * batch.loss_mask).sum(-1) / batch.loss_mask.sum(-1).clamp(min=1)
        return {
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/min": float(lengths.min()),
            "response/truncation_rate": float(batch.truncated.float().mean()),
            "advantages/mean": float(per_row_adv.mean()),
            "advantages/std": float(per_row_adv.std()) if len(batch) > 1 else 0.0,
            "batch/responses": float(len(batch)),
        }

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

    def _mean_over_processes(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each process saw its own shard of the batch; log the mean over all of them."""
        if self.accelerator.num_processes == 1:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([float(metrics[k]) for k in keys], device=self.accelerator.device)
        values = self.accelerator.reduce(values, reduction="mean")
        return dict(zip(keys, values.tolist()))

    def completion_records(self, batch: RolloutBatch) -> list[dict]:
        """CheXPO's completions log: each response's tokens with the sampler's per-token log-probs."""
        from grouprl.models.prompts import tokenizer_of

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
    def validate(self, step: int) -> dict[str, float]:
        if self.val_dataset is None or len(self.val_dataset) == 0:
            return {}
        params = self._sampling(step, validation=True)
        size = self.config.data.val_batch_size
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        indices = list(range(len(self.val_dataset)))[rank::world]
        totals, components, records = [], {}, []
        for start in range(0, len(indices), size):
            samples = [self.val_dataset[i] for i in indices[start:start + size]]
            batch = self.engine.generate(samples, params)
            result = self.rewards.score([s.prompt_text() for s in batch.samples], batch.responses, reward_columns(batch))
            totals.extend(result.total)
            for k, v in result.components.items():
                components.setdefault(k, []).extend(x for x in v if x is not None)
            records.extend({"id": s.id, "response": r, "reference": s.answer, "score": sc}
                           for s, r, sc in zip(batch.samples, batch.responses, result.total))
        metrics = {"reward/mean": sum(totals) / len(totals)}
        for k, v in components.items():
            if v:
                metrics[f"rewards/{k}/mean"] = sum(v) / len(v)
        if self.is_main and records:
            RolloutWriter(self.run_dir / "val_generations.jsonl").write(step, records[: self.config.trainer.val_generations_to_log])
        return metrics

    # ------------------------------------------------------------------ the loop

    def _resume(self) -> None:
        t = self.config.trainer
        if not t.resume:
            return
        path = ckpt.latest_checkpoint(self.config.checkpoint_dir) if t.resume == "auto" else Path(t.resume)
        if path is None:
            return  # "auto" with nothing saved yet: a fresh start
        self.state = ckpt.restore_checkpoint(path, self.policy, self.optimizer, self.scheduler)
        self.stream.load_state(self.state.extra["stream"])
        self.accelerator.print(f"resumed from {path} at step {self.state.global_step}")

    def save(self) -> Path | None:
        self.state.extra["stream"] = self.stream.state()
        path = None
        if self.is_main:
            path = ckpt.save_checkpoint(self.config.checkpoint_dir, self.state, self.policy, self.optimizer,
                                        self.scheduler, processor=self.processor, save_limit=self.config.trainer.save_limit)
        self.accelerator.wait_for_everyone()
        return path

    def train(self) -> dict[str, float]:
        t = self.config.trainer
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.config, self.run_dir / "config.yaml")
        self._resume()
        self.logger = MetricsLogger(self.run_dir, t.logger, total_steps=self.total_steps, config=to_dict(self.config),
                                    project=t.project_name, experiment=t.experiment_name, enabled=self.is_main,
                                    initial_step=self.state.global_step)
        rollouts = RolloutWriter(self.run_dir / "rollouts.jsonl", enabled=self.is_main and t.log_rollouts)
        completions = RolloutWriter(self.run_dir / "completions.jsonl", enabled=self.is_main and t.log_completions)
        last: dict[str, float] = {}
        try:
            if t.val_before_train and self.state.global_step == 0:
                self.logger.log(0, self._mean_over_processes(self.validate(0)), prefix="val/")
            while self.state.global_step < self.total_steps:
                step = self.state.global_step + 1
                metrics = self._mean_over_processes(self.step(step))
                self.state.global_step = step
                self.state.epoch = self.stream.epoch
                self.logger.log(step, metrics)
                last = metrics
                if getattr(self, "_last_batch", None) is not None:
                    if rollouts.enabled:
                        rollouts.write(step, self.rollout_records(self._last_batch))
                    if completions.enabled:
                        completions.write(step, self.completion_records(self._last_batch))
                if t.val_freq > 0 and step % t.val_freq == 0:
                    self.logger.log(step, self._mean_over_processes(self.validate(step)), prefix="val/")
                if t.save_freq > 0 and step % t.save_freq == 0:
                    self.save()
            if not (t.save_freq > 0 and self.state.global_step % t.save_freq == 0):
                self.save()
        finally:
            rollouts.close()
            completions.close()
            self.logger.close()
        return last
