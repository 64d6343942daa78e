"""Run under `torchrun --nproc_per_node 2`: the update loop across processes against one process's oracle.

Every process builds the same model and the same batch of 8 rows, trains on its own
half through `run_update` (DDP, micro-batches of 3 rows), and records the gradient
the optimizer sees. The oracle is the gradient of the loss defined on the whole
batch, computed by each process on a plain copy of the model. The script writes
what it measured to `<out>/rank<r>.json`; tests/test_distributed.py judges it.

Then the same with dynamic batching (`UpdateSettings.token_budget`) on a batch whose
first half (process 0) is long rows and second half (process 1) short ones: alone, the
processes would plan different numbers of micro-batches; they must take the same
number, and the gradients must still be the whole-batch oracle's.

    torchrun --nproc_per_node 2 tests/distributed/grad_check.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path

import torch


class RecordingOptimizer(torch.optim.Optimizer):
    """Keeps the gradients it is asked to apply, and applies nothing."""

    def __init__(self, params):
        super().__init__(params, {})
        self.seen: list[dict[int, torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append({id(p): p.grad.detach().clone() for g in self.param_groups for p in g["params"]
                          if p.grad is not None})


def make_batch(vocab: int, rows: int = 8, prompt: int = 5, response: int = 7, lengths=(7, 2, 5, 1, 6, 3, 7, 4),
               prompt_lengths=None):
    """``rows`` rows: responses of ``lengths`` tokens, prompts of ``prompt_lengths`` (left-padded; default all full)."""
    from grouprl.data.sample import Sample
    from grouprl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor(lengths)[:rows]  # unequal: token-mean and per-row norms differ
    mask = (torch.arange(response).unsqueeze(0) < lengths.unsqueeze(1)).long()
    used = torch.full((rows,), prompt) if prompt_lengths is None else torch.tensor(prompt_lengths)[:rows]
    prompt_mask = (torch.arange(prompt).unsqueeze(0) >= prompt - used.unsqueeze(1)).long()
    batch = RolloutBatch(
        samples=[Sample(messages=[{"role": "user", "content": "x"}], index=i) for i in range(rows)],
        group_index=torch.arange(rows) // 4,
        prompt_ids=torch.randint(3, vocab, (rows, prompt), generator=g),
        prompt_mask=prompt_mask,
        response_ids=torch.randint(3, vocab, (rows, response), generator=g),
        response_mask=mask, responses=[""] * rows, truncated=torch.zeros(rows, dtype=torch.bool))
    batch.advantages = torch.randn(rows, 1, generator=g).expand(rows, response) * mask
    batch.old_log_probs = None  # on-policy: ratio 1
    batch.ref_log_probs = (-2.0 - torch.rand(rows, response, generator=g)) * mask
    return batch


def main() -> None:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from grouprl.config import config_from_dict
    from grouprl.config.algorithm_options import resolve_options
    from grouprl.rollout.logprobs import compute_log_probs
    from grouprl.trainer.entropy_control import EntropyControl
    from grouprl.trainer.grpo import grpo_loss
    from grouprl.trainer.metrics import StepMetrics
    from grouprl.trainer.micro_batches import plan_micro_batches, row_token_counts
    from grouprl.trainer.precision import precision_policy
    from grouprl.trainer.update import Normalisers, UpdateSettings, run_update

    model_dir, out = sys.argv[1], Path(sys.argv[2])
    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    batch = make_batch(base.config.vocab_size)
    half = torch.arange(len(batch)).tensor_split(world)[rank]
    result: dict = {"world_size": world, "rank": rank, "modes": {}}

    def log_prob_fn(model, mb, entropy_grad=False):
        return compute_log_probs(model, mb, micro_batch_size=len(mb), temperature=1.0, with_entropy=True,
                                 entropy_grad=entropy_grad)

    def check(mode: str, batch, rows, settings: UpdateSettings, actor: dict | None = None,
              controls: list | None = None) -> tuple[dict, list[int]]:
        """run_update on this process's ``rows`` against the oracle; (measures, tokens of each micro-batch taken).
        ``actor``: worker.actor keys (an entropy bonus); ``controls``: gets the (oracle's, run's) EntropyControl."""
        cfg = config_from_dict({"algorithm": {"loss_agg_mode": mode, "kl_coef": 0.1, "kl_penalty": "k2"},
                                "worker": {"actor": actor or {}}})
        a = cfg.worker.actor
        loss_options = resolve_options(cfg, "policy_loss")
        oracle_control, control = (EntropyControl(a.entropy_coeff, a.entropy_control, accelerator=accelerator)
                                   for _ in range(2))
        for c in (oracle_control, control):
            c.last_entropy = 0.0  # the adaptive gate open from the start (target above 0)
        (controls if controls is not None else []).extend([oracle_control, control])
        loss_fn = functools.partial(grpo_loss, algorithm=cfg.algorithm, loss_options=loss_options,
                                    entropy_control=control)
        bonus = control.applied() != 0

        # the oracle: the whole batch in one piece, one process, no wrapper
        oracle = copy.deepcopy(base)
        lp, ent = log_prob_fn(oracle, batch, bonus)
        loss_fn_whole = functools.partial(grpo_loss, algorithm=cfg.algorithm, loss_options=loss_options,
                                          entropy_control=oracle_control)
        whole = Normalisers(num_tokens=float(batch.loss_mask.sum()), num_seqs=float(len(batch)), norm_len=7.0)
        loss, parts = loss_fn_whole(batch, lp, ent, whole, StepMetrics())
        loss.backward()
        expected = {name: p.grad for name, p in oracle.named_parameters()}

        model = accelerator.prepare(copy.deepcopy(base))
        optimizer = RecordingOptimizer(model.parameters())
        metrics = StepMetrics()
        forwards = []

        def counting_log_prob_fn(m, mb):
            forwards.append(int(row_token_counts(mb).sum()))
            return log_prob_fn(m, mb, bonus)

        run_update(model, optimizer, batch.select(rows), log_prob_fn=counting_log_prob_fn, loss_fn=loss_fn,
                   accelerator=accelerator, precision=precision_policy("float32"), settings=settings,
                   metrics=metrics, on_step_end=lambda: control.step_end(metrics))
        (seen,) = optimizer.seen
        names = {id(p): name for name, p in accelerator.unwrap_model(model).named_parameters()}
        got = {names[i]: g for i, g in seen.items()}
        reduced = metrics.reduce(accelerator)
        accelerator.free_memory()
        return {
            "max_abs_grad_diff": max(float((got[n] - expected[n]).abs().max()) for n in expected),
            "max_abs_grad": max(float(g.abs().max()) for g in expected.values()),
            "same_parameters": sorted(got) == sorted(expected),
            "pg_loss_logged": reduced["actor/pg_loss"], "pg_loss_whole": float(parts["pg_loss"]),
            "kl_loss_logged": reduced["actor/kl_loss"], "kl_loss_whole": float(parts["kl_loss"]),
            "micro_batches_logged": reduced["perf/micro_batches"],
        }, forwards

    fixed = UpdateSettings(num_minibatches=1, micro_batch_size=3, max_grad_norm=1e9, norm_len=7.0)
    for mode in ("token-mean", "seq-mean-token-sum-norm"):
        result["modes"][mode], _ = check(mode, batch, half, fixed)

    # dynamic batching: process 0 holds the long rows (12, 12, 11, 12 tokens: one micro-batch
    # each under a budget of 14), process 1 the short ones (6, 7, 6, 6: two micro-batches
    # alone, four once the processes agree); short prompts are left-padded
    uneven = make_batch(base.config.vocab_size, lengths=(7, 7, 6, 7, 2, 3, 1, 2),
                        prompt_lengths=(5, 5, 5, 5, 4, 4, 5, 4))
    budget = 14
    dynamic = UpdateSettings(num_minibatches=1, micro_batch_size=1, max_grad_norm=1e9, norm_len=7.0,
                             token_budget=budget)
    mine = uneven.select(half)
    result["dynamic"] = {"budget": budget, "token_counts": row_token_counts(mine).tolist(),
                         # this process's plan alone (no agreement)
                         "local_micro_batches": len(plan_micro_batches(row_token_counts(mine), rows_per_micro_batch=1,
                                                                       token_budget=budget)),
                         "modes": {}}
    for mode in ("token-mean", "seq-mean-token-mean"):
        measured, taken = check(mode, uneven, half, dynamic)
        result["dynamic"]["modes"][mode] = {**measured, "micro_batches_taken": len(taken),
                                            "micro_batch_tokens": taken}

    # the adaptive entropy bonus: the gradient is still the whole batch's, and the controller measures the
    # token mean of the entropy over both processes' rows
    controls: list = []
    entropy_actor = {"entropy_coeff": 0.5, "entropy_control": {"adaptive": True, "target": 100.0, "delta": 0.25}}
    measured, _ = check("seq-mean-token-mean", uneven, half, fixed, actor=entropy_actor, controls=controls)
    oracle_control, control = controls
    _, ent = log_prob_fn(base, uneven)
    result["entropy"] = {**measured, "coef": control.coef, "last_entropy": control.last_entropy,
                         "whole_entropy": float(ent.sum() / uneven.loss_mask.sum())}

    # a metric one process logs and the other does not is an error naming it, not a hang
    metrics = StepMetrics()
    metrics.mean("shared", 1.0)
    if rank == 1:
        metrics.mean("only_on_rank_1", 2.0)
    try:
        metrics.reduce(accelerator)
        result["schema_error"] = None
    except RuntimeError as exc:
        result["schema_error"] = str(exc)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
