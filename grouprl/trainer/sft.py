"""`grouprl sft`: supervised fine-tuning on the reference answers of the same datasets.

The seeds start RL from an SFT checkpoint. SFT here reuses the RL machinery: a
batch of (prompt, reference answer + end token) is a RolloutBatch whose response
is the answer, and the loss is the token-mean negative log-likelihood of it.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from grouprl import algorithms
from grouprl.config import Config, ConfigError, redacted, save_config
from grouprl.data.sample import Sample
from grouprl.files import check_writable_dir
from grouprl.rollout.batch import RolloutBatch
from grouprl.trainer.logging import MetricsLogger
from grouprl.trainer.metrics import StepMetrics
from grouprl.trainer.policy import build_optimizer, build_scheduler, setup_policy
from grouprl.trainer.update import Normalisers, UpdateSettings, run_update


def answer_batch(processor, samples: list[Sample], *, max_prompt_length: int | None, max_response_length: int) -> RolloutBatch:
    """A RolloutBatch whose responses are the samples' reference answers followed by the end-of-turn token."""
    from grouprl.models.inputs import encode_prompts, end_of_turn_id, tokenizer_of

    tokenizer = tokenizer_of(processor)
    prompt_ids, prompt_mask, model_inputs = encode_prompts(processor, samples, max_prompt_length=max_prompt_length)
    end = end_of_turn_id(tokenizer)
    targets = []
    for s in samples:
        if s.answer is None:
            raise ValueError(f"{s.source}: record {s.index}: field 'answer': SFT needs a reference answer")
        ids = tokenizer(s.answer, add_special_tokens=False)["input_ids"][: max_response_length - 1] + [end]
        targets.append(ids)
    width = max(len(t) for t in targets)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end
    response_ids = torch.full((len(samples), width), pad, dtype=torch.long)
    response_mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, ids in enumerate(targets):
        response_ids[i, : len(ids)] = torch.tensor(ids)
        response_mask[i, : len(ids)] = 1
    return RolloutBatch(
        samples=list(samples), group_index=torch.arange(len(samples)), prompt_ids=prompt_ids,
        prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        responses=[s.answer for s in samples], truncated=torch.zeros(len(samples), dtype=torch.bool),
        model_inputs=model_inputs,
    )


def _nll_log_probs(model, batch: RolloutBatch):
    from grouprl.rollout.logprobs import compute_log_probs

    return compute_log_probs(model, batch, micro_batch_size=len(batch), temperature=1.0)


def _nll_loss(mb: RolloutBatch, log_prob: torch.Tensor, entropy, norms: Normalisers, metrics: StepMetrics):
    """Token-mean negative log-likelihood of the reference answers over the whole batch."""
    loss = algorithms.aggregate_loss(-log_prob, mb.loss_mask, "token-mean", num_tokens=norms.num_tokens)
    return loss, {"loss": loss.detach()}


def run_sft(config: Config, *, train_dataset=None, output_dir: str | Path | None = None) -> Path:
    """Train on reference answers and save a Hugging Face model (adapters merged) to ``output_dir``.

    The same update loop, precision policy and process handling as GRPO training
    (``trainer.update.run_update``); one optimizer step per batch of ``sft.batch_size``.
    """
    from accelerate.utils import set_seed

    from grouprl.data import load_datasets

    sft, actor, t = config.sft, config.worker.actor, config.trainer
    set_seed(t.seed)
    if train_dataset is None:
        train_dataset, _ = load_datasets(config.data)
    out = Path(output_dir or config.run_dir / "sft_model")
    check_writable_dir(out.parent, "directory of the SFT model")  # before the model loads (out is made whole, by a rename)
    if sft.batch_size > len(train_dataset):
        raise ConfigError(f"config key 'sft.batch_size' ({sft.batch_size}) is larger than the dataset ({len(train_dataset)})")
    if sft.lr is not None:
        actor.optim.lr = sft.lr

    trained = setup_policy(actor, t)
    accelerator, model, processor = trained.accelerator, trained.model, trained.processor
    rank, world = accelerator.process_index, accelerator.num_processes
    if sft.batch_size % world:
        raise ConfigError(f"config key 'sft.batch_size' ({sft.batch_size}) must be divisible by the number "
                          f"of processes ({world})")
    steps_per_epoch = len(train_dataset) // sft.batch_size
    optimizer = build_optimizer(model, actor)
    scheduler = build_scheduler(optimizer, actor, sft.epochs * steps_per_epoch)
    settings = UpdateSettings(micro_batch_size=sft.micro_batch_size, max_grad_norm=actor.max_grad_norm)
    if accelerator.is_main_process:
        config.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, config.run_dir / "config.yaml")
    logger = MetricsLogger(config.run_dir / "sft", t.logger, total_steps=sft.epochs * steps_per_epoch,
                           config=redacted(config), project=t.project_name, experiment=f"{t.experiment_name}-sft",
                           enabled=accelerator.is_main_process)
    step = 0
    try:
        for epoch in range(sft.epochs):
            order = np.random.default_rng([config.data.seed, epoch]).permutation(len(train_dataset))
            for b in range(steps_per_epoch):
                t0 = time.perf_counter()
                indices = order[b * sft.batch_size:(b + 1) * sft.batch_size][rank::world]
                batch = answer_batch(processor, [train_dataset[int(i)] for i in indices],
                                     max_prompt_length=config.data.max_prompt_length,
                                     max_response_length=config.data.max_response_length)
                metrics = StepMetrics()
                metrics.mean("sft/lr", scheduler.get_last_lr()[0])
                run_update(model, optimizer, batch, log_prob_fn=_nll_log_probs, loss_fn=_nll_loss,
                           accelerator=accelerator, precision=trained.precision, settings=settings,
                           metrics=metrics, prefix="sft")
                scheduler.step()
                step += 1
                metrics.max("timing/step_s", time.perf_counter() - t0)
                metrics.mean("epoch", float(epoch))
                logger.log(step, metrics.reduce(accelerator))
    finally:
        logger.close()
    state_dict = _full_model_state(trained)  # every process takes part in gathering a sharded model
    if accelerator.is_main_process:
        from grouprl.models.export import save_merged

        save_merged(trained.policy, processor, out, state_dict=state_dict)
    accelerator.wait_for_everyone()
    return out


def _full_model_state(trained) -> dict | None:
    """The whole model's weights for a sharded policy (a collective; None otherwise)."""
    if not trained.sharded:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(trained.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
