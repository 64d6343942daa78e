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


DIALOGUE_COLUMN = "turns"  # a record's turns between its prompt and its answer (dialogue_batch)


def dialogue_batch(processor, samples: list[Sample], *, max_prompt_length: int | None,
                   max_response_length: int) -> RolloutBatch:
    """:func:`answer_batch` for dialogues: the response is a multi-turn trace in token space, as a
    multi-turn rollout builds it, with only the assistant's turns trained.

    A sample's column ``turns`` (:data:`DIALOGUE_COLUMN`; none: a single answer) holds the messages
    between its prompt and its reference answer: ``{"role": "assistant", "content": text}`` turns and
    the observation messages after each (``user`` / ``tool``, as the rollout appends them). The
    response is, in order: each assistant turn's ids + the end-of-turn token (``policy_mask`` 1),
    the observation messages as :func:`grouprl.rollout.turn_tokens.between_turns` renders them
    after that end-of-turn token (``policy_mask`` 0: attended, not trained), and the answer + the
    end-of-turn token (``policy_mask`` 1). A response longer than ``max_response_length`` is an
    error naming the sample (cutting it would train a turn without its end).
    """
    from grouprl.models.inputs import encode_prompts, end_of_turn_id, tokenizer_of
    from grouprl.rollout.turn_tokens import between_turns

    tokenizer = tokenizer_of(processor)
    prompt_ids, prompt_mask, model_inputs = encode_prompts(processor, samples, max_prompt_length=max_prompt_length)
    end = end_of_turn_id(tokenizer)
    rows, masks = [], []
    for s in samples:
        if s.answer is None:
            raise ValueError(f"{s.source}: record {s.index}: field 'answer': SFT needs a reference answer")
        turns = s.columns.get(DIALOGUE_COLUMN) or []
        if not isinstance(turns, list):
            raise ValueError(f"{s.source}: record {s.index}: field {DIALOGUE_COLUMN!r} must be a list of messages")
        ids: list[int] = []
        policy: list[int] = []
        pending: list[dict] = []

        def close_observation() -> None:
            if pending:
                between = between_turns(processor, pending, after_end_of_turn=True,
                                        chat_template_kwargs=s.chat_template_kwargs).ids
                ids.extend(between)
                policy.extend([0] * len(between))
                pending.clear()

        for j, message in enumerate(turns + [{"role": "assistant", "content": s.answer}]):
            role = message.get("role") if isinstance(message, dict) else None
            if role == "assistant":
                if not isinstance(message.get("content"), str):
                    raise ValueError(f"{s.source}: record {s.index}: field {DIALOGUE_COLUMN!r}, message {j}: "
                                     "an assistant turn's content must be text")
                if not pending and ids:
                    raise ValueError(f"{s.source}: record {s.index}: field {DIALOGUE_COLUMN!r}, message {j}: "
                                     "two assistant turns with no message between them")
                close_observation()
                turn = tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [end]
                ids.extend(turn)
                policy.extend([1] * len(turn))
            else:
                pending.append(message)  # between_turns names a bad role or content
        if len(ids) > max_response_length:
            raise ValueError(f"{s.source}: record {s.index}: the dialogue is {len(ids)} tokens, more than "
                             f"data.max_response_length ({max_response_length})")
        rows.append(ids)
        masks.append(policy)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end
    response_ids = torch.full((len(samples), width), pad, dtype=torch.long)
    response_mask = torch.zeros((len(samples), width), dtype=torch.long)
    policy_mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, (ids, policy) in enumerate(zip(rows, masks)):
        response_ids[i, : len(ids)] = torch.tensor(ids)
        response_mask[i, : len(ids)] = 1
        policy_mask[i, : len(ids)] = torch.tensor(policy)
    return RolloutBatch(
        samples=list(samples), group_index=torch.arange(len(samples)), prompt_ids=prompt_ids,
        prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask, policy_mask=policy_mask,
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


def run_sft(config: Config, *, train_dataset=None, output_dir: str | Path | None = None,
            batch_fn=answer_batch) -> Path:
    """Train on reference answers and save a Hugging Face model (adapters merged) to ``output_dir``.

    The same update loop, precision policy and process handling as GRPO training
    (``trainer.update.run_update``); one optimizer step per batch of ``sft.batch_size``.
    ``batch_fn``: how a batch of samples becomes the trained responses (:func:`answer_batch`, or
    :func:`dialogue_batch` for multi-turn traces).
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
                batch = batch_fn(processor, [train_dataset[int(i)] for i in indices],
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
