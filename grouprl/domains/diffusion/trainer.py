"""Flow-GRPO, Flow-GRPO-Fast, GRPO-Guard and DiffusionNFT: group-relative RL for flow-matching image models.

One training step, top to bottom (``FlowTrainer.step``; the algorithm's parts are its subclasses' hooks):

1. take ``data.rollout_batch_size`` prompts, each repeated ``worker.rollout.n`` times;
2. sample images with the current weights, a micro-batch at a time
   (``pipeline.sample``, under the same precision context as the update's re-scoring,
   so that the first ratio of an update is 1 in bf16 too): SDE steps where the
   algorithm trains (every step but the last for Flow-GRPO and GRPO-Guard, of which
   the first ``timestep_fraction`` are trained; a random window for Flow-GRPO-Fast),
   ODE steps elsewhere (``worker.rollout.deterministic_last_step``); the trained steps
   keep their input, output, log-probability and mean (a ``FlowRollout``);
3. score the images with the image rewards; with ``trainer.async_mode: async_reward``
   micro-batch k is scored while k+1 samples; with ``one_step_off`` steps 1-3 of step
   k+1 run in the run loop's prefetcher thread, on a copy of the weights from before
   step k's update, while step k trains (the old log-probs and means of such a
   one-update-stale batch are recomputed with the current weights before the update,
   so the clip acts around them; the staleness is logged);
4. advantages per group, std over the whole batch or per group, clipped
   (``objectives.group_advantages``); every trained step of an image gets its advantage;
5. with a KL term, the reference means (the policy with LoRA off) of every trained step;
6. the update: ``trainer.update.run_update``, the loop the language trainer uses,
   over rows that are (image, trained step) pairs: the step's log-probability under
   the current weights (``scheduler.sde_step`` scoring the stored next sample), the
   clipped ratio loss (GRPO-Guard: on the normalised ratio, reweighted by 1/|dt|) and
   beta times the KL of the means. Without a KL term the rows of images whose advantage
   is 0 are not run through the model (their loss and gradient are 0; the normaliser
   still counts them, so the update is the one that trains them), counted as
   ``actor/zero_advantage_rows`` and ``actor/skipped_rows``;
7. with ``worker.actor.ema``, after every optimizer step of the update, the moving average
   of the trained weights, which validation samples with and checkpoints hold beside the
   weights.

That is ``FlowGRPOTrainer`` (``algorithm.name`` flow_grpo, flow_grpo_fast, grpo_guard).
``DiffusionNFTTrainer`` (diffusion_nft, ``nft.py``) takes the same stages with
other rows: its "old" LoRA adapter samples (step 2: the ODE, or SDE steps, none stored);
each image's clean sample is noised afresh at ``int(num_steps * timestep_fraction)`` of
the schedule's times (``batches.nft_rows``: rows are (image, time) pairs); step 5 computes the
old adapter's velocity (and with a KL term the adapters-off one) at each row; the update
trains the other adapter's velocity with ``nft.nft_loss``; after it the old adapter
moves towards the trained one (``nft.update_old_policy``). Checkpoints hold both adapters.

The run around the steps (checkpoints, resume, metric reduction and the metrics'
schema, logs, validation cadence, the one-step-off prefetcher) is the language
trainer's: ``trainer.loop.TrainingLoop``; reward metrics are written by
``trainer.reward_metrics``. Each validation samples the validation prompts with the ODE
(``val_num_steps``, no noise, fixed seeds) and saves an image grid.
"""

from __future__ import annotations

import abc
import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from grouprl.config import ConfigError
from grouprl.errors import ModelPathError
from grouprl.domains.diffusion.config import FlowConfig, nft_timesteps, sde_range, trained_steps
from grouprl.domains.diffusion.nft import (
    forward_noised,
    nft_loss,
    old_policy_decay,
    optimality_probability,
    update_old_policy,
)
from grouprl.domains.diffusion.objectives import (
    clipped_policy_loss,
    flow_kl,
    group_advantages,
    guard_log_ratio,
    guard_reweight,
    ratio_outside_clip,
)
from grouprl.domains.diffusion.batches import FlowBatch, FlowRollout, NFTBatch, nft_rows, rows_of
from grouprl.domains.diffusion.pipeline import encode, sample, velocity
from grouprl.domains.diffusion.scheduler import sde_step, sde_window
from grouprl.files import RecordsError, read_json_records
from grouprl.trainer.loop import StepResult, TrainingLoop, check_output_dirs
from grouprl.trainer.metrics import StepMetrics
from grouprl.trainer.parallel import batch_moments, make_accelerator, mark
from grouprl.trainer.precision import precision_policy
from grouprl.trainer.prompt_stream import PromptStream
from grouprl.trainer.reward_metrics import join_results, record_rewards
from grouprl.trainer.task_metrics import validation_task_metrics
from grouprl.trainer.val_metrics import record_val_metrics
from grouprl.trainer.update import UpdateSettings, run_update


# ---------------------------------------------------------------------------- data


def load_prompts(files: list[str], prompt_key: str, max_samples: int | None = None) -> list[dict]:
    """Prompt records: a JSON list or JSON lines of ``{prompt_key: str, ...metadata}``, or ``.txt`` files with
    one prompt per line (Flow-GRPO's OCR and PickScore datasets); errors name the file and line or record."""
    records = []
    for name in files:
        path = Path(name)
        if not path.exists():
            raise ConfigError(f"prompt file not found: {path}")
        if path.suffix == ".txt":
            records += [{prompt_key: line.strip()} for line in path.read_text().splitlines() if line.strip()]
            continue
        try:
            found = read_json_records(path)
        except RecordsError as exc:
            raise ConfigError(str(exc)) from exc
        for index, record in enumerate(found):
            if not isinstance(record.get(prompt_key), str):
                raise ConfigError(f"{path}: record {index}: field '{prompt_key}' (data.prompt_key) is missing or "
                                  "not a string")
        records += found
    if max_samples is not None:
        records = records[:max_samples]
    return records


def zero_std_fraction(total: list[float], n: int) -> float:
    """``frac_reward_zero_std`` of one process's images, as the language trainer logs it: the share of
    images whose group (the n consecutive images of a prompt) has rewards all equal, std_g = 0,
    so that they give no learning signal. 0 for no image."""
    from grouprl.algorithms import reward_std_per_group

    if not total:
        return 0.0
    scores = torch.tensor(total, dtype=torch.float32)  # as the language trainer's scores
    return float((reward_std_per_group(scores, torch.arange(len(total)) // n) == 0).double().mean())


# ---------------------------------------------------------------------------- the trainer

OLD_ADAPTER = "old"  # DiffusionNFT's sampling adapter (NVlabs' name); PEFT saves it in model/old/


class FlowTrainer(TrainingLoop):
    """Trains LoRA adapters of a flow-matching transformer; the run loop is ``TrainingLoop``'s, the step
    this class's (the stages of the module docstring), and what differs per algorithm a subclass's hooks:
    ``FlowGRPOTrainer`` (Flow-GRPO, Flow-GRPO-Fast, GRPO-Guard) and ``DiffusionNFTTrainer``.
    ``flow_trainer(config)`` builds the one ``algorithm.name`` asks for."""

    def __init__(self, config: FlowConfig, *, train_records: list[dict] | None = None,
                 val_records: list[dict] | None = None):
        from accelerate.utils import set_seed

        from grouprl.domains.diffusion.config import require_diffusers, resolve_flow_defaults

        require_diffusers()
        resolve_flow_defaults(config)  # a FlowConfig built in code, not through flow_config_from_dict
        from grouprl.domains.diffusion.models import FLOW_FAMILIES, family_of_path, load_flow_model
        from grouprl.domains.diffusion.rewards import ImageRewardSet
        from grouprl.trainer.policy import build_scheduler

        t, actor, rollout = config.trainer, config.worker.actor, config.worker.rollout
        if config.algorithm.name not in self.algorithms:
            raise ConfigError(f"config key 'algorithm.name' is {config.algorithm.name!r}, which {type(self).__name__} "
                              f"does not train (it trains {', '.join(self.algorithms)}); flow_trainer(config) picks "
                              "the trainer of an algorithm")
        check_output_dirs(config)  # before the model loads
        set_seed(t.seed)
        accelerator = make_accelerator(t)
        if t.device == "cuda" and accelerator.device.type != "cuda":
            raise ConfigError("config key 'trainer.device' is cuda but no CUDA device is available")
        self.device = accelerator.device
        # LoRA adapters in fp32 over a base in the model dtype (see trainer.precision)
        self.precision = precision_policy(actor.model.dtype, "adamw", lora=True)
        if not actor.model.model_path:
            raise ConfigError("config key 'worker.actor.model.model_path' is not set")
        try:
            # the family from the model's index, so that a crossed video / image setting stops before the load
            name = family_of_path(actor.model.model_path)
        except (ModelPathError, ValueError) as exc:
            raise ConfigError(f"config key 'worker.actor.model.model_path': {exc}") from exc
        video = FLOW_FAMILIES.get(name).video
        if video and rollout.num_frames is None:
            raise ConfigError(f"config key 'worker.rollout.num_frames' is not set, and {actor.model.model_path} is a "
                              f"text-to-video model ({name}): set the frames per video")
        if not video and rollout.num_frames is not None:
            raise ConfigError(f"config key 'worker.rollout.num_frames' is {rollout.num_frames}, but "
                              f"{actor.model.model_path} is an image model ({name}): remove it")
        try:
            self.model = load_flow_model(actor.model.model_path, dtype=self.precision.load_dtype, device=self.device,
                                         max_sequence_length=actor.model.max_sequence_length)
        except ModelPathError as exc:
            raise ConfigError(f"config key 'worker.actor.model.model_path': {exc}") from exc
        self.policy = self._add_lora(self.model.transformer, actor.model.lora)
        self.prepare_policy()
        from grouprl.domains.diffusion.ema import EMAWeights

        self.ema = EMAWeights.from_config(self.policy, actor.ema) if actor.ema.enabled else None
        # checkpoints hold the adapters (the pipeline's parts never change) and, beside them, the moving
        # average (model/ema.safetensors, written by save_extras) and what a subclass adds there
        self.processor = None
        self.train_model = accelerator.prepare(self.policy)
        # one_step_off samples while the policy trains: sampling needs weights of its own
        self.sampler = self._frozen_copy(self.policy) if t.async_mode == "one_step_off" else self.policy
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=actor.optim.lr, betas=tuple(actor.optim.betas),
                                           weight_decay=actor.optim.weight_decay)
        train_records = train_records if train_records is not None else load_prompts(
            config.data.train_files, config.data.prompt_key, config.data.max_samples)
        self.val_records = val_records if val_records is not None else load_prompts(
            config.data.val_files, config.data.prompt_key, config.data.val_max_samples)
        stream = PromptStream(train_records, config.data.rollout_batch_size, seed=config.data.seed,
                              shuffle=config.data.shuffle, rank=accelerator.process_index,
                              world_size=accelerator.num_processes)
        super().__init__(config, accelerator=accelerator, stream=stream)
        self.scheduler = build_scheduler(self.optimizer, actor, self.total_steps)
        reward = config.worker.reward
        self.rewards = ImageRewardSet.from_specs(reward.functions, timeout=reward.timeout)
        self.val_rewards = ImageRewardSet.from_specs(reward.val_functions or reward.functions, timeout=reward.timeout)
        # validation's pass@k: each reward's threshold, in the order of its keys
        self.val_thresholds = {key: float(spec.threshold) for key, spec in
                               zip(self.val_rewards.keys, reward.val_functions or reward.functions)}
        self.sched = self.model.schedule(rollout.num_steps, rollout.height, rollout.width, rollout.num_frames)

    def _add_lora(self, transformer, lora):
        from peft import LoraConfig, get_peft_model

        targets = self.model.lora_targets() if lora.target_modules in (["attention"], ["all-linear"]) \
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

    def prepare_rollout_ahead(self) -> None:
        self._sync_sampler()  # the sampler is idle: its last rollout was taken

    def rollout_ahead(self, step: int, metrics: StepMetrics) -> FlowRollout:
        return self.rollout(step, metrics, model=self.sampler)

    def run_info_extras(self) -> dict:
        return {"rollout_weights": self.rollout_weights(),
                "validation_weights": "ema" if self.ema is not None else "policy"}

    def rollout_weights(self) -> str:
        """run_info.json's ``rollout_weights``: which weights sample the training images."""
        return "copy" if self.sampler is not self.policy else "policy"

    def save_extras(self, model_dir: Path) -> None:
        """Beside the adapters in each checkpoint: the moving average (``model/ema.safetensors``)."""
        if self.ema is not None:
            self.ema.save_pretrained(model_dir)

    def on_resume(self) -> None:
        """What ``save_extras`` wrote, from the checkpoint just restored (``resumed_checkpoint``)."""
        if self.ema is not None:
            self.ema.load(self.resumed_checkpoint())

    def resumed_checkpoint(self) -> Path:
        """The checkpoint ``trainer.resume`` chose: a path, or under ``auto`` the step directory of the
        restored step."""
        resume = self.config.trainer.resume
        return Path(resume) if resume != "auto" else \
            self.config.checkpoint_dir / f"global_step_{self.state.global_step}"

    # ------------------------------------------------------------------ the algorithm's hooks

    algorithms: tuple[str, ...] = ()  # the algorithm.name values the class trains

    def prepare_policy(self) -> None:
        """After the LoRA adapter is added, before the EMA, the accelerator and the optimizer see the policy."""

    def sampling_adapter(self):
        """The context the training rollouts sample in (the trained adapter: nothing to switch)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def _trained_steps(self, generator: torch.Generator) -> tuple[list[int], list[int]]:
        """(SDE steps, stored and trained steps) of this step's rollouts."""

    @abc.abstractmethod
    def training_rows(self, step: int, rollout: FlowRollout, advantages: torch.Tensor, metrics: StepMetrics):
        """The update's rows of a rollout whose images have ``advantages``."""

    @abc.abstractmethod
    def prepare_rows(self, batch, metrics: StepMetrics, *, stale: bool) -> None:
        """Fill in what the rows' loss compares with; ``stale``: the rollout was sampled one update ago."""

    @abc.abstractmethod
    def update_fns(self):
        """(forward, loss) for ``run_update``, looked up at each step (a test may replace either)."""

    def after_update(self, metrics: StepMetrics) -> None:
        """After the optimizer and learning-rate steps, before the moving average."""

    @abc.abstractmethod
    def rollout_metrics(self, rollout: FlowRollout, metrics: StepMetrics) -> None:
        """``rollout/trained_steps`` and the like: what of each image was trained."""

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> StepResult:
        """One training step on this process (the stages of the module docstring); its metrics are not yet
        reduced across processes. The result keeps no batch: its rows hold every trained step's latents."""
        actor = self.config.worker.actor
        metrics = StepMetrics()
        t0 = time.perf_counter()
        # 1-3. the images, scored: sampled now, or (one_step_off) by the sampler during the last step's update
        stale = self.prefetcher.holds(step)
        mark("rollout")
        rollout = self.prefetcher.take(metrics) if stale else self.rollout(step, metrics)
        self.rollout_taken(step, metrics, stale=stale)
        # 4. advantages per image, every trained step of an image a row
        advantages = self._advantages(torch.tensor(rollout.rewards.total, dtype=torch.float32))
        batch = self.training_rows(step, rollout, advantages, metrics)
        mark("log-probs")
        # 5. what the loss compares with, fixed during the update (the reference's means; DiffusionNFT's
        # old-adapter and reference velocities)
        self.prepare_rows(batch, metrics, stale=stale)
        # 6. the update; the rows are shuffled so that each optimizer step mixes steps (times) and images
        perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(step))
        batch = batch.select(perm)
        metrics.mean("actor/lr", self.scheduler.get_last_lr()[0])
        u0 = time.perf_counter()
        mark("update")
        forward, loss = self.update_fns()
        taken = 0

        def after_optimizer_step() -> None:
            # 7. the moving average, after every optimizer step (counted over the run, as the peers count it)
            nonlocal taken
            taken += 1
            if self.ema is not None:
                updated = self.ema.update(self.state.optimizer_steps + taken)
                metrics.mean("actor/ema_decay", self.ema.last_decay, 1.0 if updated else 0.0)

        self.state.optimizer_steps += run_update(
            self.train_model, self.optimizer, batch, log_prob_fn=forward, loss_fn=loss,
            accelerator=self.accelerator, precision=self.precision,
            settings=UpdateSettings(num_minibatches=actor.num_minibatches, epochs=actor.ppo_epochs,
                                    micro_batch_size=actor.micro_batch_size, max_grad_norm=actor.max_grad_norm),
            metrics=metrics, on_step_end=after_optimizer_step)
        self.scheduler.step()
        self.after_update(metrics)
        metrics.max("timing/update_s", time.perf_counter() - u0)
        # what was trained on, for the logs
        record_rewards(metrics, rollout.rewards, self.rewards.keys)
        metrics.mean("frac_reward_zero_std", zero_std_fraction(rollout.rewards.total, self.config.worker.rollout.n),
                     len(rollout.prompts))
        metrics.moments("advantages", advantages.tolist())
        self.rollout_metrics(rollout, metrics)
        metrics.max("timing/step_s", time.perf_counter() - t0)
        metrics.sum("perf/images", float(len(rollout.prompts)))
        records = self.rollout_records(rollout, advantages) if self.config.trainer.log_rollouts else None
        return StepResult(metrics, records=records)

    def rollout(self, step: int, metrics: StepMetrics, model=None) -> FlowRollout:
        """Draw this step's prompts, sample n images per prompt with ``model`` (the policy by default), score them."""
        config, rollout = self.config, self.config.worker.rollout
        model = self.policy if model is None else model
        records = self.stream.next_batch()
        # one generator per step and process: a resumed run draws the same noise
        seed = np.random.SeedSequence([config.trainer.seed, step, self.accelerator.process_index]).generate_state(1)[0]
        generator = torch.Generator().manual_seed(int(seed))
        sde_steps, store = self._trained_steps(generator)
        prompts = [r[config.data.prompt_key] for r in records for _ in range(rollout.n)]
        metadata = {k: [r.get(k) for r in records for _ in range(rollout.n)]
                    for k in sorted({k for r in records for k in r if k != config.data.prompt_key})}
        text = encode(self.model, prompts, rollout.guidance_scale).to(self.device)
        # async_reward: micro-batch k is scored in a worker thread while k + 1 samples
        scorer = ThreadPoolExecutor(1, thread_name_prefix="grouprl-image-reward") \
            if config.trainer.async_mode == "async_reward" else None
        trajectories, scored = [], []
        score = self._scorer(self.rewards)  # images, or a video model's frames
        t0 = time.perf_counter()
        sample_s = 0.0
        try:
            for start in range(0, len(prompts), rollout.micro_batch_size):
                rows = list(range(start, min(start + rollout.micro_batch_size, len(prompts))))
                s0 = time.perf_counter()
                mark("sample")
                # the update re-scores these steps under this precision context, with inputs in this dtype
                with self.precision.autocast(self.device), self.sampling_adapter():
                    traj = sample(model, text.select(rows), self._noise(len(rows), generator), self.sched,
                                  guidance_scale=rollout.guidance_scale, noise_level=rollout.noise_level,
                                  kind=rollout.kind, sde_steps=sde_steps, store=store, generator=generator,
                                  input_dtype=self.precision.compute_dtype)
                sample_s += time.perf_counter() - s0
                trajectories.append(traj)
                args = (self.model.decode(traj.final), [prompts[i] for i in rows],
                        {k: [v[i] for i in rows] for k, v in metadata.items()})
                mark("reward")
                scored.append(scorer.submit(score, *args) if scorer else score(*args))
            wait0 = time.perf_counter()
            results = [s.result() for s in scored] if scorer else scored
            metrics.max("timing/reward_wait_s", time.perf_counter() - wait0)
        finally:
            if scorer is not None:
                scorer.shutdown(wait=True, cancel_futures=True)
        metrics.max("timing/sample_s", sample_s)
        metrics.max("timing/rollout_s", time.perf_counter() - t0)
        return FlowRollout(trajectories=trajectories, text=text, prompts=prompts, steps=store,
                           rewards=join_results(results, self.rewards.keys, self.rewards.weights))

    def _scorer(self, rewards):
        """How ``rewards`` (an image reward set) score a batch of samples: as images, or for a video model
        frame by frame (``video.score_videos``, ``worker.reward.video_frames`` of each video)."""
        if not self.model.video:
            return rewards.score
        import functools

        from grouprl.domains.diffusion.video import score_videos

        return functools.partial(score_videos, rewards, frames=self.config.worker.reward.video_frames)

    def rollout_records(self, rollout: FlowRollout, advantages: torch.Tensor) -> list[dict]:
        """rollouts.jsonl: each image's prompt, reward components, score, advantage and trained steps."""
        components, total, adv = rollout.rewards.components, rollout.rewards.total, advantages.tolist()
        return [{"prompt": p, "rewards": {k: v[i] for k, v in components.items()}, "score": total[i],
                 "advantage": adv[i], "steps": rollout.steps} for i, p in enumerate(rollout.prompts)]

    # ------------------------------------------------------------------ rollout parts

    def _noise(self, n: int, generator: torch.Generator) -> torch.Tensor:
        rollout = self.config.worker.rollout
        shape = self.model.latent_shape(rollout.height, rollout.width, rollout.num_frames)
        return torch.randn((n, *shape), generator=generator).to(self.device)

    def _advantages(self, total: torch.Tensor) -> torch.Tensor:
        """This process's advantages: the core ``grpo`` estimator over its own groups, with (``global_std``)
        the std of every process's rewards (``trainer.parallel.batch_moments``, as the language trainer's
        std_level batch). Each process holds whole groups (n images of each of its prompts), so only that
        std needs the other processes, as Flow-GRPO gathers their rewards for it."""
        algo, n = self.config.algorithm, self.config.worker.rollout.n
        batch_std = None
        if algo.global_std:
            _, std, count = batch_moments(total.to(self.device), self.accelerator)
            batch_std = std if count > 1 else 1.0
        return group_advantages(total, n, global_std=algo.global_std, clip=algo.adv_clip_max, batch_std=batch_std)

    # ------------------------------------------------------------------ validation

    @torch.no_grad()
    def validate(self, step: int) -> StepResult | None:
        """ODE samples of the validation prompts (fixed noise), their rewards and an image grid; with
        ``worker.actor.ema`` sampled with the moving average of the weights (the weights are put back after).

        ``worker.rollout.val_n = k`` images per prompt, each from its own noise (drawn in order from one
        generator seeded with ``val_seed``: reproducible, and k = 1 draws what one image per prompt always
        drew), give ``mean@k``, ``best@k``, ``worst@k`` and ``pass@k`` per reward and for the weighted total,
        per ``data_source`` too, as the language trainer's (``grouprl.trainer.val_metrics``); the task
        metrics that ``trainer.val_metrics`` names score every image of the whole set
        (``grouprl.trainer.task_metrics``: the completions are PIL images). A process may get no
        validation prompt (fewer prompts than processes): it still reports every key, with no weight.
        None without validation prompts.
        """
        from PIL import Image

        from grouprl.domains.diffusion.images import save_grid

        if not self.val_records:
            return None
        config, rollout = self.config, self.config.worker.rollout
        metrics = StepMetrics()
        rank, world, k = self.accelerator.process_index, self.accelerator.num_processes, rollout.val_n
        positions = list(range(len(self.val_records)))[rank::world]
        records = [self.val_records[i] for i in positions]
        scale = rollout.val_guidance_scale if rollout.val_guidance_scale is not None else rollout.guidance_scale
        sched = self.model.schedule(rollout.val_num_steps, rollout.height, rollout.width, rollout.num_frames)
        generator = torch.Generator().manual_seed(rollout.val_seed)
        # one row per image: a prompt's k images together
        row_records = [r for r in records for _ in range(k)]
        prompts = [r[config.data.prompt_key] for r in row_records]
        metadata = {key: [r.get(key) for r in row_records]
                    for key in sorted({key for r in records for key in r if key != config.data.prompt_key})}
        images = []
        mark("sample")
        # flow_grpo validates (and saves) the moving average: the raw weights come back after the block
        with self.ema.applied() if self.ema is not None else contextlib.nullcontext():
            for start in range(0, len(records), config.data.val_batch_size):
                chunk_prompts = prompts[start * k:(start + config.data.val_batch_size) * k]
                text = encode(self.model, chunk_prompts, scale).to(self.device)
                with self.precision.autocast(self.device):  # as the training rollouts
                    traj = sample(self.policy, text, self._noise(len(chunk_prompts), generator), sched,
                                  guidance_scale=scale, noise_level=0.0, input_dtype=self.precision.compute_dtype)
                images.extend(self.model.decode(traj.final))
        mark("reward")
        result = self._scorer(self.val_rewards)(images, prompts, metadata)
        if self.model.video:  # a video stands for itself by its middle frame in the grid and the task metrics
            from grouprl.domains.diffusion.video import preview_frame

            images = [preview_frame(video) for video in images]
        record_rewards(metrics, result, self.val_rewards.keys)
        groups = [list(range(i * k, (i + 1) * k)) for i in range(len(records))]
        prompt_sources = [None if r.get("data_source") is None else str(r["data_source"]) for r in records]
        sources = sorted({s for s in prompt_sources if s is not None})
        if world > 1:  # every process declares every source's keys
            from accelerate.utils import gather_object

            sources = sorted(set(gather_object(sources)))
        record_val_metrics(metrics, groups, result.components, result.total, k, self.val_thresholds,
                           prompt_sources, sources)
        if config.trainer.val_metrics:
            mark("task_metrics")
            rows = [{"completion": image, "reference": r.get("answer"), "prompt": p,
                     "prompt_index": positions[i // k],
                     "columns": {key: v for key, v in r.items() if key != config.data.prompt_key}}
                    for i, (image, p, r) in enumerate(zip(images, prompts, row_records))]
            validation_task_metrics(metrics, config.trainer.val_metrics, rows, self.accelerator)
        logged = []
        if self.is_main and rollout.val_images_to_log > 0:
            shown = rollout.val_images_to_log
            path = save_grid(images[:shown], self.run_dir / "val_images" / f"step_{step:06d}.png",
                             # long prompts shortened: the caption wraps, so it grows with the text
                             captions=[f"{p if len(p) <= 80 else p[:77] + '...'}\nreward {s:.2f}"
                                       for p, s in zip(prompts[:shown], result.total[:shown])])
            with Image.open(path) as saved:  # the loggers get the grid as saved, captions included
                logged.append((f"validation step {step}", saved.copy()))
        return StepResult(metrics, records=[{"prompt": p, "score": s} for p, s in zip(prompts, result.total)],
                          images=logged)


class FlowGRPOTrainer(FlowTrainer):
    """Flow-GRPO, Flow-GRPO-Fast and GRPO-Guard: the clipped ratio of each stored SDE step's
    log-probability, per (image, trained step) row (``batches.FlowBatch``)."""

    algorithms = ("flow_grpo", "flow_grpo_fast", "grpo_guard")

    def training_rows(self, step: int, rollout: FlowRollout, advantages: torch.Tensor,
                      metrics: StepMetrics) -> FlowBatch:
        """Every stored step of an image a row, with the image's advantage (``batches.rows_of``)."""
        batch = rows_of(rollout.trajectories, self.sched, advantages, rollout.text)
        zero = int((batch.advantages == 0).sum())
        metrics.sum("actor/zero_advantage_rows", float(zero))
        metrics.sum("actor/skipped_rows", float(zero if self._skips_zero_advantage() else 0))
        return batch

    def prepare_rows(self, batch: FlowBatch, metrics: StepMetrics, *, stale: bool) -> None:
        """A one-update-stale batch's old log-probs and means recomputed; with a KL term the reference's means."""
        if stale:
            self._recompute_old(batch, metrics)
        if self.config.algorithm.kl_coef > 0:
            batch.ref_mean = self._reference_means(batch)

    def update_fns(self):
        return self._log_prob_fn, self._loss_fn

    def rollout_metrics(self, rollout: FlowRollout, metrics: StepMetrics) -> None:
        metrics.mean("rollout/trained_steps", float(len(rollout.steps)))
        metrics.mean("rollout/first_trained_step", float(rollout.steps[0]) if rollout.steps else math.nan)

    # ------------------------------------------------------------------ rollout parts

    def _trained_steps(self, generator: torch.Generator) -> tuple[list[int], list[int]]:
        """(SDE steps, stored and trained steps) of this step's rollouts; the last step is an ODE step with
        ``worker.rollout.deterministic_last_step``."""
        algo, rollout = self.config.algorithm, self.config.worker.rollout
        last = rollout.num_steps - 1 if rollout.deterministic_last_step else rollout.num_steps
        if algo.name == "flow_grpo_fast":
            window = list(sde_window(rollout.num_steps, rollout.sde_window_size, sde_range(rollout),
                                     generator=generator))
            return window, window
        return list(range(last)), trained_steps(rollout.num_steps, algo.timestep_fraction,
                                                rollout.deterministic_last_step)

    # ------------------------------------------------------------------ update

    # whether the update leaves zero-advantage rows out of the forward pass when that changes nothing
    # (no KL term); False runs every row, as the tests compare
    skip_zero_advantage = True

    def _skips_zero_advantage(self) -> bool:
        return self.skip_zero_advantage and self.config.algorithm.kl_coef == 0

    def _score(self, model, part: FlowBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log-probability [b], mean, std [b]) of every row's stored step under ``model``'s weights."""
        rollout = self.config.worker.rollout
        text = part.text.select(part.image)
        dtype = self.precision.compute_dtype
        v = velocity(model, part.latents.to(dtype), part.timestep.to(self.device), text, rollout.guidance_scale)
        out = sde_step(v.float(), part.latents, part.sigma, part.sigma_next, noise_level=rollout.noise_level,
                       kind=rollout.kind, prev_sample=part.next_latents)
        return out.log_prob, out.mean, out.std

    def _log_prob_fn(self, model, part: FlowBatch):
        """The update's scoring: ``(log_prob [b, 1], (mean, std, counted [b] bool))``.

        Without a KL term a row whose advantage is 0 has loss max(-0 r, -0 clip(r)) = 0 and gradient 0
        whatever the weights, so it is not run through the model: its log-probability is the old one
        (ratio 1) and its mean the old mean. Its row still counts in the normaliser (run_update divides
        by the rows of the mini-batch, ``FlowBatch.loss_mask``), so the loss and gradient are those of
        training it: a mean over every (image, trained step) row, zero-advantage ones included, as
        Flow-GRPO's mean over samples without its masking. (flow_grpo drops those samples, KL term
        included, and averages over the rest: without a KL term the same gradient direction, larger
        by rows / kept rows.) A micro-batch whose rows all have A = 0 runs its first row, whose loss
        is 0, so that every micro-batch has a graph (and under DDP every process a backward).
        ``counted`` marks the rows the ratio metrics count: the rows with A != 0.
        """
        counted = torch.ones(len(part), dtype=torch.bool)
        if not self._skips_zero_advantage():
            log_prob, mean, std = self._score(model, part)
            return log_prob[:, None], (mean, std, counted)
        counted = part.advantages != 0
        rows = counted.nonzero()[:, 0] if counted.any() else torch.zeros(1, dtype=torch.long)
        if len(rows) == len(part):
            log_prob, mean, std = self._score(model, part)
            return log_prob[:, None], (mean, std, counted)
        log_prob, mean, _ = self._score(model, part.select(rows))
        rollout = self.config.worker.rollout
        # the step's std depends on the schedule alone: any velocity gives it
        std = sde_step(torch.zeros_like(part.latents, dtype=torch.float32), part.latents, part.sigma,
                       part.sigma_next, noise_level=rollout.noise_level, kind=rollout.kind,
                       prev_sample=part.next_latents).std
        index = (rows.to(log_prob.device),)
        log_prob = part.old_log_prob.to(log_prob).index_put(index, log_prob)
        mean = part.old_mean.to(mean).index_put(index, mean)
        return log_prob[:, None], (mean, std, counted)

    def _loss_fn(self, part: FlowBatch, log_prob, aux, norms, metrics: StepMetrics):
        algo = self.config.algorithm
        mean, std, counted = aux
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
        # the ratio metrics count the rows trained (not those skipped with a zero advantage)
        counted = counted.to(ratio.device)
        ratio, clipped, n = ratio.detach()[counted], clipped[counted], float(counted.sum())
        log_ratio_abs = (log_prob.detach() - part.old_log_prob.to(log_prob.device))[counted].abs()
        metrics.moments("actor/ratio", ratio.tolist())
        # the peers' clipfrac (|r - 1| > eps) and the rows whose gradient the clip zeroes (objectives)
        metrics.mean("actor/clipfrac", float(ratio_outside_clip(ratio, algo.clip_range).float().mean()) if n else 0.0, n)
        metrics.mean("actor/clipped_grad_frac", float(clipped.float().mean()) if n else 0.0, n)
        metrics.mean("actor/log_ratio_abs", float(log_ratio_abs.mean()) if n else 0.0, n)
        return loss, reported

    @torch.no_grad()
    def _reference_means(self, batch: FlowBatch) -> torch.Tensor:
        """The reference's step means (the policy with LoRA off), micro-batch by micro-batch."""
        out = []
        with self.policy.disable_adapter():
            for rows in torch.arange(len(batch)).split(self.config.worker.actor.micro_batch_size):
                part = batch.select(rows)
                with self.precision.autocast(self.device):
                    _, mean, _ = self._score(self.policy, part)
                out.append(mean.float())
        return torch.cat(out)

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
                log_prob, mean, _ = self._score(self.policy, batch.select(rows))
            log_probs.append(log_prob.float())
            means.append(mean.float())
        current = torch.cat(log_probs)
        metrics.mean("async/behaviour_log_ratio_abs", float((current - batch.old_log_prob).abs().mean()),
                     float(len(batch)))
        batch.old_log_prob, batch.old_mean = current, torch.cat(means)


class DiffusionNFTTrainer(FlowTrainer):
    """DiffusionNFT (``nft.py``): a second LoRA adapter ("old") samples; the rows are (image, time) pairs
    of each clean sample noised afresh (``batches.NFTBatch``); the loss is ``nft.nft_loss`` on the trained
    adapter's velocity; after each step the old adapter moves towards the trained one. Checkpoints hold
    both adapters (PEFT writes the old one to ``model/old/``)."""

    algorithms = ("diffusion_nft",)

    def prepare_policy(self) -> None:
        self._add_old_adapter()

    def sampling_adapter(self):
        """DiffusionNFT samples with its old adapter."""
        return self._old_adapter()

    def rollout_weights(self) -> str:
        return "old_adapter"

    def on_resume(self) -> None:
        """The moving average and the old adapter from the checkpoint just restored."""
        super().on_resume()
        self._load_old_adapter(self.resumed_checkpoint())

    def training_rows(self, step: int, rollout: FlowRollout, advantages: torch.Tensor,
                      metrics: StepMetrics) -> NFTBatch:
        return self._nft_batch(step, rollout, advantages)

    def prepare_rows(self, batch: NFTBatch, metrics: StepMetrics, *, stale: bool) -> None:
        # never stale: the config refuses one_step_off (its old adapter samples, and moves after each step)
        self._nft_velocities(batch)

    def update_fns(self):
        return self._nft_velocity_fn, self._nft_loss_fn

    def after_update(self, metrics: StepMetrics) -> None:
        """The old adapter follows the trained one."""
        metrics.mean("actor/old_policy_decay", self._update_old_adapter())

    def rollout_metrics(self, rollout: FlowRollout, metrics: StepMetrics) -> None:
        # the training times per image (drawn per image, so no first step)
        metrics.mean("rollout/trained_steps", float(nft_timesteps(self.config.worker.rollout.num_steps,
                                                                  self.config.algorithm.timestep_fraction)))

    def _trained_steps(self, generator: torch.Generator) -> tuple[list[int], list[int]]:
        """Any sampler, no step stored: the ODE, or SDE steps with a noise level (the last an ODE step with
        ``worker.rollout.deterministic_last_step``)."""
        rollout = self.config.worker.rollout
        last = rollout.num_steps - 1 if rollout.deterministic_last_step else rollout.num_steps
        return (list(range(last)) if rollout.noise_level > 0 else []), []

    # ------------------------------------------------------------------ the old adapter

    def _add_old_adapter(self) -> None:
        """DiffusionNFT's old policy: a second LoRA adapter (``OLD_ADAPTER``) beside the trained one, a
        copy of it to start; it samples, and follows the trained one after each step (``nft.update_old_policy``)."""
        self.policy.add_adapter(OLD_ADAPTER, self.policy.peft_config["default"])
        self.policy.set_adapter("default")  # the trained adapter active and the only one with gradients
        with torch.no_grad():
            for old, trained in self._old_pairs():
                old.data = old.data.to(self.precision.param_dtype)
                old.copy_(trained)

    def _old_pairs(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """(old adapter tensor, trained adapter tensor) pairs, matched by name."""
        params = dict(self.policy.named_parameters())
        pairs = [(params[name.replace(".default.", f".{OLD_ADAPTER}.")], p) for name, p in params.items()
                 if "lora_" in name and ".default." in name]
        if not pairs:
            raise RuntimeError("diffusion_nft: the policy has no LoRA adapter tensors to pair with the old adapter")
        return pairs

    @contextlib.contextmanager
    def _old_adapter(self):
        """The old adapter active inside the block (PEFT's set_adapter also moves requires_grad to it:
        the trained adapter is made active, and the only one with gradients, again after the block)."""
        self.policy.set_adapter(OLD_ADAPTER)
        try:
            yield
        finally:
            self.policy.set_adapter("default")

    def _load_old_adapter(self, path: Path) -> None:
        """The old adapter PEFT's save_pretrained wrote beside the trained one (``model/old/``)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        from grouprl.trainer.checkpoint import CheckpointError

        file = path / "model" / OLD_ADAPTER / "adapter_model.safetensors"
        if not file.exists():
            raise CheckpointError(f"checkpoint {path} has no DiffusionNFT old adapter ({file}); it was not saved by a "
                                  "diffusion_nft run")
        result = set_peft_model_state_dict(self.policy, load_file(str(file)), adapter_name=OLD_ADAPTER)
        missing = [k for k in getattr(result, "missing_keys", []) if f".{OLD_ADAPTER}." in k]
        if missing:
            raise CheckpointError(f"{file} does not match the model's old adapter: missing {missing[:3]}")
        self.policy.set_adapter("default")

    @torch.no_grad()
    def _update_old_adapter(self) -> float:
        """old <- d old + (1 - d) theta after the step, d from the optimizer steps taken (NVlabs' global_step)."""
        nft = self.config.algorithm.nft
        decay = old_policy_decay(self.state.optimizer_steps, flat=nft.decay_flat, rate=nft.decay_rate,
                                 ceiling=nft.decay_ceiling)
        old, trained = zip(*self._old_pairs())
        update_old_policy(list(old), list(trained), decay)
        return decay

    # ------------------------------------------------------------------ rows and loss

    def _nft_batch(self, step: int, rollout: FlowRollout, advantages: torch.Tensor) -> NFTBatch:
        """The rows of DiffusionNFT's update: each image at its training times with fresh noise (drawn from a
        generator of the run's seed, step and process: a resumed run draws the same)."""
        seed = np.random.SeedSequence([self.config.trainer.seed, step, self.accelerator.process_index, 1])
        generator = torch.Generator().manual_seed(int(seed.generate_state(1)[0]))
        times = nft_timesteps(self.config.worker.rollout.num_steps, self.config.algorithm.timestep_fraction)
        return nft_rows([traj.final for traj in rollout.trajectories], self.sched, advantages, rollout.text, times,
                        generator)

    @torch.no_grad()
    def _nft_velocities(self, batch: NFTBatch) -> None:
        """v_old (the old adapter) and, with a KL term, v_ref (adapters off) at every row's x_t: fixed
        during the update (the old adapter changes after it), so computed once, micro-batch by micro-batch,
        under the update's precision context."""
        olds, refs = [], []
        for rows in torch.arange(len(batch)).split(self.config.worker.actor.micro_batch_size):
            part = batch.select(rows)
            with self.precision.autocast(self.device):
                with self._old_adapter():
                    olds.append(self._nft_velocity(self.policy, part).float())
                if self.config.algorithm.kl_coef > 0:
                    with self.policy.disable_adapter():
                        refs.append(self._nft_velocity(self.policy, part).float())
        batch.v_old = torch.cat(olds)
        batch.v_ref = torch.cat(refs) if refs else None

    def _nft_velocity(self, model, part: NFTBatch) -> torch.Tensor:
        """``model``'s velocity at ``x_t = (1 - t) x0 + t eps`` without guidance (DiffusionNFT trains CFG-free)."""
        x_t, _ = forward_noised(part.x0, part.noise, part.t)
        text = part.text.select(part.image)
        return velocity(model, x_t.to(self.device, self.precision.compute_dtype), part.timestep.to(self.device),
                        text, 1.0)

    def _nft_velocity_fn(self, model, part: NFTBatch):
        """run_update's forward for DiffusionNFT: the trained velocity [b, C, H, W] in place of a log-prob."""
        return self._nft_velocity(model, part), None

    def _nft_loss_fn(self, part: NFTBatch, v_theta, _aux, norms, metrics: StepMetrics):
        """The mean over rows of ``nft.nft_loss`` (+ kl_coef mean((v_theta - v_ref)^2), NVlabs' KL)."""
        algo = self.config.algorithm
        device = v_theta.device
        _, target = forward_noised(part.x0.to(device), part.noise.to(device), part.t.to(device))
        r = optimality_probability(part.advantages.to(device), algo.adv_clip_max)
        v_old = part.v_old.to(device)
        per_row = nft_loss(v_theta, v_old, target, r, algo.nft.beta, t=part.t.to(device),
                           adaptive_weighting=algo.nft.adaptive_weighting, adv_clip_max=algo.adv_clip_max)
        pg_loss = per_row.sum() / norms.num_seqs
        loss, reported = pg_loss, {"pg_loss": pg_loss.detach()}
        dims = tuple(range(1, v_theta.dim()))
        if algo.kl_coef > 0:
            kl = (v_theta - part.v_ref.to(device)).pow(2).mean(dims)
            kl_loss = kl.sum() / norms.num_seqs
            loss = loss + algo.kl_coef * kl_loss
            reported["kl_loss"] = kl_loss.detach()
        n = float(len(part))
        # how far the trained velocity has moved from the old one (NVlabs' old_deviate)
        metrics.mean("actor/old_deviation", float((v_theta.detach() - v_old).pow(2).mean()), n)
        metrics.moments("actor/optimality", r.tolist())
        return loss, reported


def flow_trainer(config: FlowConfig, **kwargs) -> FlowTrainer:
    """The trainer of ``config.algorithm.name``: ``DiffusionNFTTrainer`` for diffusion_nft, else
    ``FlowGRPOTrainer`` (the ``flow`` trainer kind builds runs through this)."""
    for cls in (FlowGRPOTrainer, DiffusionNFTTrainer):
        if config.algorithm.name in cls.algorithms:
            return cls(config, **kwargs)
    raise ConfigError(f"config key 'algorithm.name' is {config.algorithm.name!r}: no flow trainer trains it")
