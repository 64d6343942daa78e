"""Dynamic batching: micro-batches planned by token count (``grouprl.trainer.micro_batches``).

The plan decides memory and speed only: ``run_update`` with a token budget must give the
gradients of fixed micro-batches, for every loss aggregation. Two processes are checked in
tests/core/test_distributed.py (tests/core/distributed/grad_check.py).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grouprl.trainer.micro_batches import plan_micro_batches, row_token_counts

HERE = Path(__file__).parent


def _grad_check():
    """tests/core/distributed/grad_check.py as a module (its batch builder and recording optimizer)."""
    spec = importlib.util.spec_from_file_location("grad_check", HERE / "distributed" / "grad_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_plan(plan, counts, budget):
    """Every row exactly once, ascending inside each micro-batch, within the budget unless alone."""
    rows = torch.cat(plan).tolist() if plan else []
    assert sorted(rows) == list(range(len(counts))), plan
    for part in plan:
        assert part.dtype == torch.int64 and part.dim() == 1 and len(part) > 0
        assert part.tolist() == sorted(part.tolist())
        if budget is not None and len(part) > 1:
            assert int(counts[part].sum()) <= budget, (part, counts[part])
    assert [int(p[0]) for p in plan] == sorted(int(p[0]) for p in plan)  # ordered by first row


# ---------------------------------------------------------------------------- planning


@pytest.mark.parametrize("n", [0, 1, 5, 8, 13])
@pytest.mark.parametrize("k", [1, 3, 4, 20])
def test_no_budget_is_the_fixed_row_split(n, k):
    counts = torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(n))
    plan = plan_micro_batches(counts, rows_per_micro_batch=k)
    expected = torch.arange(n).split(k)
    assert len(plan) == len(expected) and all(torch.equal(a, b) for a, b in zip(plan, expected))


@pytest.mark.parametrize("seed", range(20))
def test_every_row_once_and_the_budget_holds(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=g))
    counts = torch.randint(0, 120, (n,), generator=g)
    budget = int(torch.randint(1, 300, (1,), generator=g))
    plan = plan_micro_batches(counts, rows_per_micro_batch=4, token_budget=budget)
    _check_plan(plan, counts, budget)
    again = plan_micro_batches(counts, rows_per_micro_batch=4, token_budget=budget)
    assert [p.tolist() for p in plan] == [p.tolist() for p in again]  # deterministic
    # no fewer micro-batches than the tokens need, and a row over the budget is alone
    fitting = int(counts[counts <= budget].sum())
    assert len(plan) >= -(-fitting // budget) + int((counts > budget).sum())
    for part in plan:
        if bool((counts[part] > budget).any()):
            assert len(part) == 1


def test_rows_over_the_budget_go_alone():
    counts = torch.tensor([5, 300, 5, 250, 5])
    plan = plan_micro_batches(counts, rows_per_micro_batch=2, token_budget=100)
    assert [p.tolist() for p in plan] == [[0, 2, 4], [1], [3]]


def test_skewed_lengths_take_fewer_micro_batches_than_fixed_rows():
    # two long rows and fourteen short ones: 2 rows x the longest is 200 tokens
    counts = torch.tensor([100, 100] + [10] * 14)
    fixed = plan_micro_batches(counts, rows_per_micro_batch=2)
    dynamic = plan_micro_batches(counts, rows_per_micro_batch=2, token_budget=200)
    _check_plan(dynamic, counts, 200)
    assert len(fixed) == 8 and len(dynamic) == 2
    # balanced: LPT puts one long row and seven short ones in each
    assert sorted(int(counts[p].sum()) for p in dynamic) == [170, 170]


def test_lpt_balances_the_bins():
    counts = torch.tensor([9, 8, 7, 6, 5, 4, 3, 2, 1, 1, 1, 1])
    plan = plan_micro_batches(counts, rows_per_micro_batch=1, token_budget=17)
    loads = [int(counts[p].sum()) for p in plan]
    assert len(plan) == 3  # 48 tokens: ceil(48 / 17) = 3 bins suffice
    assert max(loads) - min(loads) <= int(counts.max())  # LPT's bound on the spread


def test_zero_token_rows_are_planned():
    counts = torch.zeros(5, dtype=torch.int64)
    plan = plan_micro_batches(counts, rows_per_micro_batch=1, token_budget=1)
    _check_plan(plan, counts, 1)
    assert len(plan) == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"rows_per_micro_batch": 0}, "rows_per_micro_batch"),
    ({"rows_per_micro_batch": 2, "token_budget": 0}, "token_budget"),
    ({"rows_per_micro_batch": 2, "token_budget": -5}, "token_budget"),
    ({"rows_per_micro_batch": 2, "token_budget": 2.5}, "token_budget"),
    ({"rows_per_micro_batch": 2, "token_budget": True}, "token_budget"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_micro_batches(torch.tensor([1, 2, 3]), **kwargs)


@pytest.mark.parametrize("counts", [torch.tensor([[1, 2]]), torch.tensor([1.0, 2.0]), torch.tensor([3, -1])])
def test_bad_token_counts_are_named(counts):
    with pytest.raises(ValueError, match="token_counts"):
        plan_micro_batches(counts, rows_per_micro_batch=2, token_budget=10)


class _Agreement:
    """Stands in for the all-reduce MAX of the local counts: the others planned ``other`` micro-batches."""

    def __init__(self, other: int):
        self.other, self.calls = other, 0

    def __call__(self, tensor, op=None):
        self.calls += 1
        assert op == torch.distributed.ReduceOp.MAX
        tensor.copy_(torch.maximum(tensor, torch.tensor([self.other], dtype=tensor.dtype)))


@pytest.mark.parametrize("other", [1, 2, 5, 9])
def test_processes_agree_on_the_largest_count(monkeypatch, other):
    counts = torch.tensor([6, 7, 6, 6, 3, 1, 2, 8, 5])
    alone = plan_micro_batches(counts, rows_per_micro_batch=1, token_budget=14)
    agreement = _Agreement(other)
    monkeypatch.setattr(torch.distributed, "all_reduce", agreement)
    accelerator = SimpleNamespace(num_processes=2, process_index=1, device=torch.device("cpu"))
    plan = plan_micro_batches(counts, rows_per_micro_batch=1, token_budget=14, accelerator=accelerator)
    assert agreement.calls == 1
    assert len(plan) == max(other, len(alone))
    _check_plan(plan, counts, 14)  # splitting never breaks the budget


def test_more_micro_batches_elsewhere_than_rows_here_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.distributed, "all_reduce", _Agreement(4))
    accelerator = SimpleNamespace(num_processes=2, process_index=0, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="same number of rows"):
        plan_micro_batches(torch.tensor([1, 1, 1]), rows_per_micro_batch=1, token_budget=10, accelerator=accelerator)


def test_row_token_counts_are_prompt_and_response_tokens():
    batch = SimpleNamespace(prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                            response_mask=torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]]))
    assert row_token_counts(batch).tolist() == [3, 6]


# ---------------------------------------------------------------------------- run_update


ROWS = 12
LENGTHS = (9, 1, 2, 8, 1, 1, 9, 2, 3, 1, 7, 1)  # response tokens: few long rows, many short ones
PROMPTS = (6, 2, 3, 6, 2, 1, 5, 3, 2, 2, 6, 3)  # prompt tokens (left-padded)


@pytest.fixture(scope="module")
def trained(tiny_text_lm):
    from transformers import AutoModelForCausalLM

    grad_check = _grad_check()
    model = AutoModelForCausalLM.from_pretrained(tiny_text_lm(["a b c d e f g h i j k l"], seed=0))
    batch = grad_check.make_batch(model.config.vocab_size, rows=ROWS, prompt=6, response=9, lengths=LENGTHS,
                                  prompt_lengths=PROMPTS)
    batch.group_index = torch.arange(ROWS) // 4
    return SimpleNamespace(model=model, batch=batch, RecordingOptimizer=grad_check.RecordingOptimizer)


def _update(trained, mode: str, **settings):
    """Gradients each optimizer step saw, tokens of each micro-batch, and the metrics of one run_update."""
    from grouprl.config import config_from_dict
    from grouprl.config.algorithm_options import resolve_options
    from grouprl.rollout.logprobs import compute_log_probs
    from grouprl.trainer.grpo import grpo_loss
    from grouprl.trainer.metrics import StepMetrics
    from grouprl.trainer.precision import precision_policy
    from grouprl.trainer.update import UpdateSettings, run_update

    cfg = config_from_dict({"algorithm": {"loss_agg_mode": mode, "kl_coef": 0.1, "kl_penalty": "k2"}})
    loss_fn = functools.partial(grpo_loss, algorithm=cfg.algorithm, loss_options=resolve_options(cfg, "policy_loss"))
    tokens: list[int] = []

    def log_prob_fn(model, mb):
        tokens.append(int(row_token_counts(mb).sum()) if len(mb) > 1 else -1)  # -1: a lone row, any size
        return compute_log_probs(model, mb, micro_batch_size=len(mb), temperature=1.0, with_entropy=True)

    model = copy.deepcopy(trained.model)
    optimizer = trained.RecordingOptimizer(model.parameters())
    accelerator = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"),
                                  clip_grad_norm_=torch.nn.utils.clip_grad_norm_)
    metrics = StepMetrics()
    run_update(model, optimizer, trained.batch, log_prob_fn=log_prob_fn, loss_fn=loss_fn, accelerator=accelerator,
               precision=precision_policy("float32"), metrics=metrics,
               settings=UpdateSettings(num_minibatches=2, max_grad_norm=1e9, norm_len=9.0, **settings))
    names = {id(p): name for name, p in model.named_parameters()}
    grads = [{names[i]: g for i, g in seen.items()} for seen in optimizer.seen]
    return grads, tokens, metrics.local()


def test_the_rows_have_skewed_token_counts(trained):
    counts = row_token_counts(trained.batch)
    assert counts.tolist() == [p + r for p, r in zip(PROMPTS, LENGTHS)]
    assert int(counts.max()) >= 3 * int(counts.min())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_token_budget_gives_the_gradients_of_fixed_micro_batches(trained, mode):
    from grouprl.algorithms.aggregation import LOSS_AGG_MODES

    assert mode in LOSS_AGG_MODES
    fixed, fixed_tokens, fixed_metrics = _update(trained, mode, micro_batch_size=2)
    budget = 24  # fixed pairs hold 5 to 19 tokens
    dynamic, dynamic_tokens, dynamic_metrics = _update(trained, mode, micro_batch_size=2, token_budget=budget)
    # two mini-batches of six rows: three micro-batches of two rows each; by tokens, fewer
    assert fixed_metrics["perf/micro_batches"] == 3.0 and len(fixed_tokens) == 6
    assert dynamic_metrics["perf/micro_batches"] == len(dynamic_tokens) / 2 < 3.0
    assert all(t <= budget for t in dynamic_tokens)
    assert len(fixed) == len(dynamic) == 2
    for step_fixed, step_dynamic in zip(fixed, dynamic):
        assert sorted(step_fixed) == sorted(step_dynamic)
        scale = max(float(g.abs().max()) for g in step_fixed.values())
        assert scale > 1e-3  # a real gradient
        diff = max(float((step_fixed[n] - step_dynamic[n]).abs().max()) for n in step_fixed)
        assert diff <= 1e-6 * max(1.0, scale), (mode, diff, scale)
    for key in ("actor/pg_loss", "actor/kl_loss"):
        assert dynamic_metrics[key] == pytest.approx(fixed_metrics[key], rel=1e-5, abs=1e-7)


def test_batches_without_token_masks_keep_fixed_rows():
    """The flow trainer's batches have no prompt / response masks: a budget leaves their micro-batches alone."""
    from grouprl.trainer.metrics import StepMetrics
    from grouprl.trainer.precision import precision_policy
    from grouprl.trainer.update import Normalisers, UpdateSettings, run_update

    class Rows:
        def __init__(self, n):
            self.loss_mask = torch.ones(n, 1)

        def __len__(self):
            return len(self.loss_mask)

        def select(self, rows):
            return Rows(len(rows))

    weight = torch.nn.Parameter(torch.ones(1))
    model = torch.nn.Module()
    model.weight = weight
    sizes: list[int] = []

    def log_prob_fn(m, mb):
        sizes.append(len(mb))
        return m.weight.expand(len(mb), 1), None

    def loss_fn(mb, log_prob, entropy, norms: Normalisers, metrics):
        return log_prob.sum() / norms.num_seqs, {}

    accelerator = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"),
                                  clip_grad_norm_=torch.nn.utils.clip_grad_norm_)
    metrics = StepMetrics()
    run_update(model, torch.optim.SGD(model.parameters(), lr=0.0), Rows(7), log_prob_fn=log_prob_fn,
               loss_fn=loss_fn, accelerator=accelerator, precision=precision_policy("float32"),
               settings=UpdateSettings(micro_batch_size=3, token_budget=1), metrics=metrics)
    assert sizes == [3, 3, 1] and metrics.local()["perf/micro_batches"] == 3.0

