"""Flow-GRPO, Flow-GRPO-Fast and GRPO-Guard: group-relative RL for flow-matching image models.

One training step, top to bottom (``FlowGRPOTrainer.step``):

1. take ``data.rollout_batch_size`` prompts, each repeated ``worker.rollout.n`` times;
2. sample images with the current weights, a micro-batch at a time
   (``pipeline.sample``): SDE steps where the algorithm trains (every step but the
   last few for Flow-GRPO and GRPO-Guard, a random window for Flow-GRPO-Fast), ODE
   steps elsewhere; the trained steps keep their input, output, log-probability and
   mean;
3. score the images with the image rewards (``rewards.score_images``); with
   ``trainer.async_mode: async_reward`` micro-batch k is scored while k+1 samples;
   with ``one_step_off`` steps 1-3 of step k+1 run in a worker thread, on a copy of
   the weights from before step k's update, while step k trains (the old log-probs
   and means of such a one-update-stale batch are recomputed with the current weights
   before the update, so the clip acts around them; the staleness is logged);
4. advantages per group, std over the whole batch or per group, clipped
   (``objectives.group_advantages``); every trained step of an image gets its advantage;
5. with a KL term, the reference means (the policy with LoRA off) of every trained step;
6. the update: ``trainer.update.run_update``, the loop the language trainer uses,
   over rows that are (image, trained step) pairs: the step's log-probability under
   the current weights (``sampling.sde_step`` scoring the stored next sample), the
   clipped ratio loss (GRPO-Guard: on the normalised ratio, reweighted by 1/|dt|) and
   beta times the KL of the means.

Checkpoints, resume, metrics and logs are the language side's (``trainer.checkpoint``,
``trainer.logging``, ``trainer.metrics``); each validation samples the validation
prompts with the ODE (``val_num_steps``, no noise, fixed seeds) and saves an image grid.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from grouprl.config import ConfigError, write_text_atomic
from grouprl.domains.diffusion.config import FlowConfig
from grouprl.domains.diffusion.objectives import (
    clipped_policy_loss,
    flow_kl,
    group_advantages,
    guard_log_ratio,
    guard_reweight,
)
from grouprl.domains.diffusion.pipeline import PromptEmbeddings, Schedule, encode, sample, schedule, velocity
from grouprl.domains.diffusion.scheduler import sde_step, sde_window, train_timesteps
from grouprl.trainer import checkpoint as ckpt
from grouprl.trainer.logging import MetricsLogger, RolloutWriter, truncate_jsonl
from grouprl.trainer.metrics import SchemaFile, StepMetrics
from grouprl.trainer.precision import precision_policy
from grouprl.trainer.prompt_stream import PromptStream
from grouprl.trainer.update import UpdateSettings, run_update


# ---------------------------------------------------------------------------- data


def load_prompts(files: list[str], prompt_key: str, max_samples: int | None = None) -> list[dict]:
    """Prompt records: JSON lines ``{prompt_key: str, ...metadata}``, or ``.txt`` files with one prompt per
    line (Flow-GRPO's OCR and PickScore datasets); errors name the file and line."""
    records = []
    for name in files:
        path = Path(name)
        if not path.exists():
            raise ConfigError(f"prompt file not found: {path}")
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            if path.suffix == ".txt":
                records.append({prompt_key: line.strip()})
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}, line {number}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or not isinstance(record.get(prompt_key), str):
                raise ConfigError(f"{path}, line {number}: field '{prompt_key}' (data.prompt_key) is missing or not a string")
            records.append(record)
    if max_samples is not None:
        records = records[:max_samples]
    return records


# ---------------------------------------------------------------------------- the batch of trained steps


@dataclass
class FlowBatch:
    """Rows are (image, trained step) pairs: what ``run_update`` cuts into micro-batches.

    Text conditioning is held once per image (``text``) and indexed by ``image``, since
    an SD3 prompt embedding is far larger than a latent.
    """

    image: torch.Tensor  # [R] index into text / advantages of images
    latents: torch.Tensor  # [R, C, H, W], the sample before the step
    next_latents: torch.Tensor  # [R, C, H, W], the sample after it (re-scored)
    old_log_prob: torch.Tensor  # [R]
    old_mean: torch.Tensor  # [R, C, H, W]
    sigma: torch.Tensor  # [R]
    sigma_next: torch.Tensor  # [R]
    timestep: torch.Tensor  # [R], the transformer's timestep
    advantages: torch.Tensor  # [R]
    text: PromptEmbeddings  # per image
    ref_mean: torch.Tensor | None = None  # [R, C, H, W], the reference's means (KL)

    def __len__(self) -> int:
        return len(self.image)

    @property
    def loss_mask(self) -> torch.Tensor:
        # one "token" per row: run_update's normalisers then count rows
        return torch.ones(len(self), 1)

    def select(self, rows) -> "FlowBatch":
        rows = torch.as_tensor(rows, dtype=torch.long)
        pick = {name: getattr(self, name)[rows] for name in
                ("image", "latents", "next_latents", "old_log_prob", "old_mean", "sigma", "sigma_next", "timestep",
                 "advantages")}
        return FlowBatch(**pick, text=self.text, ref_mean=None if self.ref_mean is None else self.ref_mean[rows])


def rows_of(traj_parts: list, sched: Schedule, advantages: torch.Tensor, text: PromptEmbeddings) -> FlowBatch:
    """Flatten the trajectories' stored steps into rows; every step of an image gets the image's advantage."""
    latents, nxt, logp, means, image, steps = [], [], [], [], [], []
    offset = 0
    for traj in traj_parts:
        b, s = traj.log_probs.shape
        latents.append(traj.latents.reshape(b * s, *traj.latents.shape[2:]))
        nxt.append(traj.next_latents.reshape(b * s, *traj.latents.shape[2:]))
        means.append(traj.means.reshape(b * s, *traj.latents.shape[2:]))
        logp.append(traj.log_probs.reshape(b * s))
        image.append((torch.arange(b) + offset).repeat_interleave(s))
        steps.append(torch.tensor(traj.steps, dtype=torch.long).repeat(b))
        offset += b
    step = torch.cat(steps)
    image = torch.cat(image)
    return FlowBatch(image=image, latents=torch.cat(latents), next_latents=torch.cat(nxt), old_log_prob=torch.cat(logp),
                     old_mean=torch.cat(means), sigma=sched.sigmas[step], sigma_next=sched.sigmas[step + 1],
                     timestep=sched.timesteps[step], advantages=advantages[image], text=text)


# ---------------------------------------------------------------------------- the trainer


class FlowGRPOTrainer:
    def __init__(self, config: FlowConfig, *, train_records: list[dict] | None = None,
                 val_records: list[dict] | None = None):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        from grouprl.domains.diffusion.config import require_diffusers

        require_diffusers()
        from grouprl.domains.diffusion.models import load_flow_model
        from grouprl.domains.diffusion.rewards import ImageRewardSet
        from grouprl.trainer.policy import build_scheduler

        self.config = config
        t, actor, rollout = config.trainer, config.worker.actor, config.worker.rollout
        set_seed(t.seed)
        self.accelerator = Accelerator(cpu=t.device == "cpu")
        if t.device == "cuda" and self.accelerator.device.type != "cuda":
            raise ConfigError("config key 'trainer.device' is cuda but no CUDA device is available")
        self.is_main = self.accelerator.is_main_process
        self.device = self.accelerator.device
        self.run_dir = config.run_dir
        self.schema_file = SchemaFile(self.run_dir / "metrics_schema.json", enabled=self.is_main)
        # LoRA adapters in fp32 over a base in the model dtype (see trainer.precision)
        self.precision = precision_policy(actor.model.dtype, "adamw", lora=True)
        if not actor.model.model_path:
            raise ConfigError("config key 'worker.actor.model.model_path' is not set")
        self.model = load_flow_model(actor.model.model_path, dtype=self.precision.load_dtype, device=self.device)
        self.policy = self._add_lora(self.model.transformer)
        self.train_model = self.accelerator.prepare(self.policy)
        # one_step_off samples while the policy trains: sampling needs weights of its own
        self.sampler = self._frozen_copy(self.policy) if t.async_mode == "one_step_off" else self.policy
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=actor.optim.lr, betas=tuple(actor.optim.betas),
                                           weight_decay=actor.optim.weight_decay)
        train_records = train_records if train_records is not None else load_prompts(
            config.data.train_files, config.data.prompt_key, config.data.max_samples)
        self.val_records = val_records if val_records is not None else load_prompts(
            config.data.val_files, config.data.prompt_key, config.data.val_max_samples)
        world = self.accelerator.num_processes
        self.stream = PromptStream(train_records, config.data.rollout_batch_size, seed=config.data.seed,
                                   shuffle=config.data.shuffle, rank=self.accelerator.process_index, world_size=world)
        self.total_steps = t.max_steps or t.total_epochs * self.stream.batches_per_epoch
        self.scheduler = build_scheduler(self.optimizer, actor, self.total_steps)
        self.rewards = ImageRewardSet.from_specs(config.worker.reward.functions)
        self.val_rewards = ImageRewardSet.from_specs(config.worker.reward.val_functions or config.worker.reward.functions)
        self.sched = schedule(self.model.scheduler, rollout.num_steps)
        self.state = ckpt.TrainerState()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grouprl-image-reward")
        self._background: ThreadPoolExecutor | None = None  # one_step_off: the rollout worker
        self._pending = None  # one_step_off: (step, future of that step's rollout and metrics)
        self._consumed_stream = self.stream.state()  # the data position after the last batch trained on

    def _add_lora(self, transformer):
        from peft import LoraConfig, get_peft_model

        from grouprl.domains.diffusion.models import lora_target_modules

        lora = self.config.worker.actor.model.lora
        targets = lora_target_modules(transformer) if lora.target_modules in (["attention"], ["all-linear"]) \
            else lora.target_modules
        transformer.requires_grad_(False)
        model = get_peft_model(transformer, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                       target_modules=targets, init_lora_weights="gaussian"))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(self.precision.param_dtype)
        return model

    @staticmethod
    def _frozen_copy(policy):
        import copy

        sampler = copy.deepcopy(policy).eval()
        sampler.requires_grad_(False)
        return sampler

    @torch.no_grad()
    def _sync_sampler(self) -> None:
        """Copy the policy's adapter weights into the sampler (the base weights never change)."""
        trained = {name: p for name, p in self.policy.named_parameters() if p.requires_grad}
        for name, p in self.sampler.named_parameters():
            if name in trained:
                p.copy_(trained[name])

    # ------------------------------------------------------------------ rollout

    def _trained_steps(self, generator: torch.Generator) -> tuple[list[int], list[int]]:
        """(SDE steps, stored and trained steps) of this step's rollouts."""
        algo, rollout = self.config.algorithm, self.config.worker.rollout
        if algo.name == "flow_grpo_fast":
            window = list(sde_window(rollout.num_steps, rollout.sde_window_size, tuple(rollout.sde_window_range),
                                     generator=generator))
            return window, window
        trained = list(train_timesteps(rollout.num_steps, algo.timestep_fraction))
        return list(range(rollout.num_steps)), trained

    def _noise(self, n: int, generator: torch.Generator) -> torch.Tensor:
        rollout = self.config.worker.rollout
        shape = self.model.latent_shape(rollout.height, rollout.width)
        return torch.randn((n, *shape), generator=generator).to(self.device)

    @staticmethod
    def _score(rewards, images, prompts, metadata) -> dict[str, list[float | None]]:
        """``{reward key: values, "total": weighted sums}`` for a batch of images."""
        result = rewards.score(images, prompts, metadata)
        return {**result.components, "total": list(result.total)}

    def rollout(self, records: list[dict], step: int, metrics: StepMetrics, model=None):
        """Sample n images per record with ``model`` (the policy by default) and score them.

        Returns (trajectories, text, scores, prompts, stored steps).
        """
        config, rollout = self.config, self.config.worker.rollout
        model = self.policy if model is None else model
        # one generator per step and process: a resumed run draws the same noise
        seed = np.random.SeedSequence([config.trainer.seed, step, self.accelerator.process_index]).generate_state(1)[0]
        generator = torch.Generator().manual_seed(int(seed))
        sde_steps, store = self._trained_steps(generator)
        prompts = [r[config.data.prompt_key] for r in records for _ in range(rollout.n)]
        metadata = {k: [r.get(k) for r in records for _ in range(rollout.n)]
                    for k in sorted({k for r in records for k in r if k != config.data.prompt_key})}
        text = encode(self.model, prompts, rollout.guidance_scale)
        text = PromptEmbeddings(*(None if x is None else x.to(self.device) for x in
                                  (text.embeds, text.pooled, text.negative_embeds, text.negative_pooled)))
        parts, pending, scored = [], [], []
        t0 = time.perf_counter()
        sample_s = 0.0
        for start in range(0, len(prompts), rollout.micro_batch_size):
            rows = list(range(start, min(start + rollout.micro_batch_size, len(prompts))))
            s0 = time.perf_counter()
            traj = sample(model, text.select(rows), self._noise(len(rows), generator), self.sched,
                          guidance_scale=rollout.guidance_scale, noise_level=rollout.noise_level, kind=rollout.kind,
                          sde_steps=sde_steps, store=store, generator=generator)
            sample_s += time.perf_counter() - s0
            parts.append(traj)
            images = self.model.decode(traj.final)
            args = (self.rewards, images, [prompts[i] for i in rows], {k: [v[i] for i in rows] for k, v in metadata.items()})
            if config.trainer.async_mode == "async_reward":
                pending.append(self._executor.submit(self._score, *args))  # scored while the next part samples
            else:
                scored.append(self._score(*args))
        wait0 = time.perf_counter()
        scored.extend(f.result() for f in pending)
        metrics.mean("timing/reward_wait_s", time.perf_counter() - wait0)
        metrics.mean("timing/sample_s", sample_s)
        metrics.mean("timing/rollout_s", time.perf_counter() - t0)
        scores = {name: [v for part in scored for v in part[name]] for name in scored[0]}
        return parts, text, scores, prompts, store

    def _next_rollout(self, step: int, metrics: StepMetrics):
        """This step's rollout, and whether it was sampled before the last update (one_step_off).

        In one_step_off mode the rollout of step k+1 (prompts drawn here, in order) is
        sampled and scored in a worker thread by the sampler, a copy of the weights from
        before step k's update, while step k trains; the first step, and the first after
        a resume, sample in line.
        """
        if self.config.trainer.async_mode != "one_step_off":
            records = self.stream.next_batch()
            self._consumed_stream = self.stream.state()
            return self.rollout(records, step, metrics), False
        stale = self._pending is not None and self._pending[0] == step
        if stale:
            t0 = time.perf_counter()
            out, rollout_metrics = self._pending[1].result()
            metrics.mean("timing/rollout_wait_s", time.perf_counter() - t0)
            metrics.merge(rollout_metrics)
        else:
            records = self.stream.next_batch()
            out = self.rollout(records, step, metrics)
        self._pending = None
        metrics.mean("async/staleness_steps", float(stale))
        # what a checkpoint after this step records: the next batch is drawn below
        self._consumed_stream = self.stream.state()
        if step < self.total_steps:
            self._sync_sampler()  # the sampler is idle: its last rollout was collected above
            if self._background is None:
                self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grouprl-flow-rollout")
            records = self.stream.next_batch()
            self._pending = (step + 1, self._background.submit(self._rollout_in_background, records, step + 1))
        return out, stale

    def _rollout_in_background(self, records: list[dict], step: int):
        metrics = StepMetrics()
        return self.rollout(records, step, metrics, model=self.sampler), metrics

    # ------------------------------------------------------------------ update

    def _log_prob_fn(self, model, part: FlowBatch):
        rollout = self.config.worker.rollout
        text = part.text.select(part.image)
        dtype = self.precision.compute_dtype
        v = velocity(model, part.latents.to(dtype), part.timestep.to(self.device), text, rollout.guidance_scale)
        out = sde_step(v.float(), part.latents, part.sigma, part.sigma_next, noise_level=rollout.noise_level,
                       kind=rollout.kind, prev_sample=part.next_latents)
        return out.log_prob[:, None], (out.mean, out.std)

    def _loss_fn(self, part: FlowBatch, log_prob, aux, norms, metrics: StepMetrics):
        algo = self.config.algorithm
        mean, std = aux
        log_prob = log_prob[:, 0]
        if algo.name == "grpo_guard":
            log_ratio = guard_log_ratio(log_prob, part.old_log_prob, mean, part.old_mean, std)
            per_row, ratio, clipped = clipped_policy_loss(log_ratio, torch.zeros_like(log_ratio), part.advantages,
                                                          algo.clip_range)
            per_row = guard_reweight(per_row, part.sigma_next - part.sigma)
        else:
            per_row, ratio, clipped = clipped_policy_loss(log_prob, part.old_log_prob, part.advantages, algo.clip_range)
        pg_loss = per_row.sum() / norms.num_seqs
        loss = pg_loss
        reported = {"pg_loss": pg_loss.detach()}
        if algo.kl_coef > 0:
            # Flow-GRPO's KL divides by the SDE's noise level sigma_t (std / sqrt|dt|); its CPS code by the step std
            sigma_t = std if self.config.worker.rollout.kind == "cps" else \
                std / (part.sigma - part.sigma_next).abs().sqrt().clamp_min(1e-12)
            kl = flow_kl(mean, part.ref_mean, sigma_t)
            kl_loss = kl.sum() / norms.num_seqs
            loss = loss + algo.kl_coef * kl_loss
            reported["kl_loss"] = kl_loss.detach()
        metrics.moments("actor/ratio", ratio.detach().tolist())
        metrics.mean("actor/clipfrac", float(clipped.float().mean()), float(len(clipped)))
        metrics.mean("actor/log_ratio_abs", float((log_prob.detach() - part.old_log_prob).abs().mean()), float(len(clipped)))
        return loss, reported

    @torch.no_grad()
    def _reference_means(self, batch: FlowBatch) -> torch.Tensor:
        """The reference's step means (the policy with LoRA off), micro-batch by micro-batch."""
        out = []
        with self.policy.disable_adapter():
            for rows in torch.arange(len(batch)).split(self.config.worker.actor.micro_batch_size):
                part = batch.select(rows)
                with self.precision.autocast(self.device):
                    _, (mean, _) = self._log_prob_fn(self.policy, part)
                out.append(mean.float())
        return torch.cat(out)

    def _advantages(self, total: torch.Tensor) -> torch.Tensor:
        """This process's advantages; the std of ``global_std`` is that of every process's batch.

        Each process holds whole groups (n images of each of its prompts), so only the
        global std needs the other processes' rewards, as Flow-GRPO gathers them.
        """
        algo, n = self.config.algorithm, self.config.worker.rollout.n
        world = self.accelerator.num_processes
        if world == 1 or not algo.global_std:
            return group_advantages(total, n, global_std=algo.global_std, clip=algo.adv_clip_max)
        everyone = self.accelerator.gather(total.to(self.device)).cpu()  # process-major: groups stay consecutive
        mine = slice(self.accelerator.process_index * len(total), (self.accelerator.process_index + 1) * len(total))
        return group_advantages(everyone, n, global_std=True, clip=algo.adv_clip_max)[mine]

    @torch.no_grad()
    def _recompute_old(self, batch: FlowBatch, metrics: StepMetrics) -> None:
        """One-update-stale rows: old log-probs and means under the current weights.

        PPO's clip then bounds the move from the weights being updated, as in the
        synchronous loop, instead of flagging every row of a stale batch as clipped
        (Flow-GRPO's clip ranges are around 1e-4). The rows' log-ratio between the
        current weights and the sampler is logged as ``async/behaviour_log_ratio_abs``.
        """
        log_probs, means = [], []
        for rows in torch.arange(len(batch)).split(self.config.worker.actor.micro_batch_size):
            with self.precision.autocast(self.device):
                log_prob, (mean, _) = self._log_prob_fn(self.policy, batch.select(rows))
            log_probs.append(log_prob[:, 0].float())
            means.append(mean.float())
        current = torch.cat(log_probs)
        metrics.mean("async/behaviour_log_ratio_abs", float((current - batch.old_log_prob).abs().mean()),
                     float(len(batch)))
        batch.old_log_prob, batch.old_mean = current, torch.cat(means)

    def step(self, step: int) -> StepMetrics:
        algo, actor = self.config.algorithm, self.config.worker.actor
        metrics = StepMetrics()
        t0 = time.perf_counter()
        (parts, text, scores, prompts, store), stale = self._next_rollout(step, metrics)
        advantages = self._advantages(torch.tensor(scores["total"], dtype=torch.float32))
        batch = rows_of(parts, self.sched, advantages, text)
        if stale:
            self._recompute_old(batch, metrics)
        if algo.kl_coef > 0:
            batch.ref_mean = self._reference_means(batch)
        # Flow-GRPO shuffles (image, step) rows so each optimizer step mixes steps and images
        perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(step))
        batch = batch.select(perm)
        u0 = time.perf_counter()
        steps = run_update(self.train_model, self.optimizer, batch, log_prob_fn=self._log_prob_fn,
                           loss_fn=self._loss_fn, accelerator=self.accelerator, precision=self.precision,
                           settings=UpdateSettings(num_minibatches=actor.num_minibatches, epochs=actor.ppo_epochs,
                                                   micro_batch_size=actor.micro_batch_size,
                                                   max_grad_norm=actor.max_grad_norm),
                           metrics=metrics)
        self.scheduler.step()
        self.state.optimizer_steps += steps
        metrics.mean("timing/update_s", time.perf_counter() - u0)
        for name, values in scores.items():
            finite = [v for v in values if v is not None]
            key = "reward/mean" if name == "total" else f"rewards/{name}/mean"
            metrics.mean(key, sum(finite) / len(finite) if finite else math.nan, float(len(finite)))
        metrics.moments("reward/total", [v for v in scores["total"] if v is not None])
        metrics.moments("advantages", advantages.tolist())
        metrics.mean("actor/lr", self.scheduler.get_last_lr()[0])
        metrics.mean("rollout/trained_steps", float(len(store)))
        metrics.mean("rollout/first_trained_step", float(store[0]) if store else math.nan)
        elapsed = time.perf_counter() - t0
        metrics.mean("timing/step_s", elapsed)
        metrics.sum("perf/images", float(len(prompts)))
        self._last = {"prompts": prompts, "scores": scores, "advantages": advantages.tolist(), "steps": store}
        return metrics

    # ------------------------------------------------------------------ validation

    @torch.no_grad()
    def validate(self, step: int) -> StepMetrics:
        """ODE samples of the validation prompts (fixed noise), their rewards and an image grid."""
        from grouprl.domains.diffusion.images import save_grid

        config, rollout = self.config, self.config.worker.rollout
        metrics = StepMetrics()
        records = self.val_records[self.accelerator.process_index::self.accelerator.num_processes]
        if not records:
            return metrics
        scale = rollout.val_guidance_scale if rollout.val_guidance_scale is not None else rollout.guidance_scale
        sched = schedule(self.model.scheduler, rollout.val_num_steps)
        self.sched = schedule(self.model.scheduler, rollout.num_steps)  # set_timesteps changed the scheduler's state
        generator = torch.Generator().manual_seed(rollout.val_seed)
        images, prompts, metadata = [], [], {}
        for start in range(0, len(records), config.data.val_batch_size):
            chunk = records[start:start + config.data.val_batch_size]
            chunk_prompts = [r[config.data.prompt_key] for r in chunk]
            text = encode(self.model, chunk_prompts, scale)
            text = PromptEmbeddings(*(None if x is None else x.to(self.device) for x in
                                      (text.embeds, text.pooled, text.negative_embeds, text.negative_pooled)))
            traj = sample(self.policy, text, self._noise(len(chunk), generator), sched, guidance_scale=scale,
                          noise_level=0.0)
            images.extend(self.model.decode(traj.final))
            prompts.extend(chunk_prompts)
            for k in {k for r in chunk for k in r if k != config.data.prompt_key}:
                metadata.setdefault(k, [])
            for k in metadata:
                metadata[k].extend(r.get(k) for r in chunk)
        scores = self._score(self.val_rewards, images, prompts, metadata)
        for name, values in scores.items():
            finite = [v for v in values if v is not None]
            metrics.mean("reward/mean" if name == "total" else f"rewards/{name}/mean",
                         sum(finite) / len(finite) if finite else math.nan, float(len(finite)))
        if self.is_main and rollout.val_images_to_log > 0:
            k = rollout.val_images_to_log
            save_grid(images[:k], self.run_dir / "val_images" / f"step_{step:06d}.png",
                      captions=[f"{p[:40]} ({s:.2f})" for p, s in zip(prompts[:k], scores["total"][:k])])
        return metrics

    # ------------------------------------------------------------------ the loop

    def _resume(self) -> bool:
        path = ckpt.resume_path(self.config.trainer.resume, self.config.checkpoint_dir)
        if path is None:
            return False
        self.state = ckpt.restore_checkpoint(path, self.policy, self.optimizer, self.scheduler,
                                             process_index=self.accelerator.process_index,
                                             num_processes=self.accelerator.num_processes)
        self.stream.load_state(self.state.extra["stream"])
        self._consumed_stream = self.stream.state()
        self.accelerator.print(f"resumed from {path} at step {self.state.global_step}")
        return True

    def save(self) -> Path | None:
        from accelerate.utils import gather_object

        # the position after the last batch trained on (one_step_off has drawn the next already)
        self.state.extra["stream"] = dict(self._consumed_stream)
        rng_states = gather_object([ckpt.rng_state()]) if self.accelerator.num_processes > 1 else [ckpt.rng_state()]
        path = None
        if self.is_main:
            path = ckpt.save_checkpoint(self.config.checkpoint_dir, self.state, self.policy, self.optimizer,
                                        self.scheduler, save_limit=self.config.trainer.save_limit,
                                        rng_states=rng_states)
        self.accelerator.wait_for_everyone()
        return path

    def run_info(self) -> dict:
        """How this run is laid out (written to ``run_info.json``): processes, device, precision."""
        return {"num_processes": self.accelerator.num_processes, "device": str(self.accelerator.device),
                "precision": self.precision.describe(), "async_mode": self.config.trainer.async_mode,
                "rollout_weights": "copy" if self.sampler is not self.policy else "policy"}

    def _reduce(self, metrics: StepMetrics, prefix: str = "") -> dict[str, float]:
        self.schema_file.record(metrics, prefix)
        values = metrics.reduce(self.accelerator)
        if "perf/images" in values and values.get("timing/step_s"):
            values["perf/images_per_s"] = values.pop("perf/images") / values["timing/step_s"]
        return values

    def _records(self) -> list[dict]:
        last = self._last
        return [{"prompt": p, "rewards": {k: v[i] for k, v in last["scores"].items() if k != "total"},
                 "score": last["scores"]["total"][i], "advantage": last["advantages"][i], "steps": last["steps"]}
                for i, p in enumerate(last["prompts"])]

    def train(self) -> dict[str, float]:
        from grouprl.config import redacted, save_config

        t = self.config.trainer
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.config, self.run_dir / "config.yaml")
            write_text_atomic(self.run_dir / "run_info.json", json.dumps(self.run_info(), indent=2))
        resume_step = self.state.global_step if self._resume() else None
        self.logger = MetricsLogger(self.run_dir, t.logger, total_steps=self.total_steps, config=redacted(self.config),
                                    project=t.project_name, experiment=t.experiment_name, enabled=self.is_main,
                                    initial_step=self.state.global_step, resume_step=resume_step)
        rollouts = RolloutWriter(self.run_dir / "rollouts.jsonl", enabled=self.is_main and t.log_rollouts,
                                 resume_step=resume_step)
        if self.is_main and resume_step is not None:
            truncate_jsonl(self.run_dir / "rollouts.jsonl", resume_step)
        last: dict[str, float] = {}
        try:
            if t.val_before_train and self.state.global_step == 0 and self.val_records:
                self.logger.log(0, self._reduce(self.validate(0), "val/"), prefix="val/")
            while self.state.global_step < self.total_steps:
                step = self.state.global_step + 1
                metrics = self._reduce(self.step(step))
                self.state.global_step = step
                self.state.epoch = self.stream.epoch
                self.state.batch_in_epoch = self.stream.batch_in_epoch
                self.logger.log(step, metrics)
                last = metrics
                if t.log_rollouts:
                    from accelerate.utils import gather_object

                    records = self._records()
                    if self.accelerator.num_processes > 1:
                        records = gather_object(records)
                    rollouts.write(step, records)
                if t.val_freq > 0 and step % t.val_freq == 0 and self.val_records:
                    self.logger.log(step, self._reduce(self.validate(step), "val/"), prefix="val/")
                if t.save_freq > 0 and step % t.save_freq == 0:
                    self.save()
            if not (t.save_freq > 0 and self.state.global_step % t.save_freq == 0):
                self.save()
        finally:
            if self._background is not None:
                self._background.shutdown(wait=True, cancel_futures=True)
            self._executor.shutdown(wait=True, cancel_futures=True)
            rollouts.close()
            self.logger.close()
        return last
