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
from grouprl.config import Config, ConfigError, save_config, to_dict
from grouprl.data.sample import Sample
from grouprl.rollout.batch import RolloutBatch
from grouprl.trainer.logging import MetricsLogger
from grouprl.trainer.policy import build_optimizer, build_policy, build_scheduler


def end_of_turn_id(tokenizer) -> int:
    """The token that ends an assistant turn: the chat template's end marker when there is one."""
    for token in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token in tokenizer.get_vocab():
            return token_id
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token to end the SFT targets with")
    return tokenizer.eos_token_id


def answer_batch(processor, samples: list[Sample], *, max_prompt_length: int | None, max_response_length: int) -> RolloutBatch:
    """A RolloutBatch whose responses are the samples' reference answers followed by the end-of-turn token."""
    from grouprl.models.prompts import encode_prompts

    tokenizer = getattr(processor, "tokenizer", processor)
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


def run_sft(config: Config, *, train_dataset=None, output_dir: str | Path | None = None) -> Path:
    """Train on reference answers and save a Hugging Face model (adapters merged) to ``output_dir``."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from grouprl.rollout.logprobs import compute_log_probs
    from grouprl.trainer.grpo import load_datasets

    sft, actor, t = config.sft, config.worker.actor, config.trainer
    accelerator = Accelerator(cpu=t.device == "cpu")
    set_seed(t.seed)
    if train_dataset is None:
        train_dataset, _ = load_datasets(config)
    out = Path(output_dir or config.run_dir / "sft_model")
    if sft.batch_size > len(train_dataset):
        raise ConfigError(f"config key 'sft.batch_size' ({sft.batch_size}) is larger than the dataset ({len(train_dataset)})")

    model, processor, _ = build_policy(actor.model)
    if sft.lr is not None:
        actor.optim.lr = sft.lr
    steps_per_epoch = len(train_dataset) // sft.batch_size
    optimizer = build_optimizer(model, actor)
    scheduler = build_scheduler(optimizer, actor, sft.epochs * steps_per_epoch)
    model, optimizer = accelerator.prepare(model, optimizer)
    if accelerator.is_main_process:
        config.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, config.run_dir / "config.yaml")
    logger = MetricsLogger(config.run_dir / "sft", t.logger, total_steps=sft.epochs * steps_per_epoch,
                           config=to_dict(config), project=t.project_name, experiment=f"{t.experiment_name}-sft",
                           enabled=accelerator.is_main_process)
    rank, world = accelerator.process_index, accelerator.num_processes
    step = 0
    try:
        model.train()
        for epoch in range(sft.epochs):
            order = np.random.default_rng([config.data.seed, epoch]).permutation(len(train_dataset))
            for b in range(steps_per_epoch):
                t0 = time.perf_counter()
                indices = order[b * sft.batch_size:(b + 1) * sft.batch_size][rank::world]
                batch = answer_batch(processor, [train_dataset[int(i)] for i in indices],
                                     max_prompt_length=config.data.max_prompt_length,
                                     max_response_length=config.data.max_response_length)
                num_tokens = accelerator.reduce(torch.tensor(float(batch.response_mask.sum()), device=accelerator.device), "sum").item()
                total = 0.0
                for rows in torch.arange(len(batch)).split(sft.micro_batch_size):
                    mb = batch.select(rows)
                    log_prob, _ = compute_log_probs(model, mb, micro_batch_size=len(mb), temperature=1.0)
                    loss = algorithms.aggregate_loss(-log_prob, mb.response_mask, "token-mean", num_tokens=num_tokens)
                    accelerator.backward(loss * world)
                    total += loss.item()
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), actor.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                step += 1
                logger.log(step, {"sft/loss": total, "sft/grad_norm": float(grad_norm), "sft/lr": scheduler.get_last_lr()[0],
                                  "timing/step_s": time.perf_counter() - t0, "epoch": float(epoch)})
    finally:
        logger.close()
    model.eval()
    if accelerator.is_main_process:
        from grouprl.models.export import save_merged

        save_merged(accelerator.unwrap_model(model), processor, out)
    accelerator.wait_for_everyone()
    return out
