"""Entropy regularisation: the bonus ``- c * H`` (``algorithms.entropy``), its differentiable entropy through the
chunked and padding-free log-prob paths, its exactness under micro-batches, Skywork-OR1's adaptive coefficient
against TRL's code, the coefficient across a resume, and the config keys."""

from __future__ import annotations

import copy
import functools
import json
import math
import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from grouprl import algorithms
from grouprl.config import ConfigError, EntropyControlConfig, config_from_dict, load_config
from grouprl.models.inputs import forward_kwargs
from grouprl.rollout.logprobs import compute_log_probs, forward_response_log_probs, score_positions
from grouprl.trainer.entropy_control import EntropyControl
from grouprl.config.algorithm_options import resolve_options
from grouprl.trainer.grpo import GRPOTrainer, grpo_loss
from grouprl.trainer.metrics import StepMetrics
from grouprl.trainer.precision import precision_policy
from grouprl.trainer.update import UpdateSettings, run_update

HERE = Path(__file__).resolve().parent
CORPUS = ["a b c d e f g h i j k l m n o p"]
MODES = [pytest.param(False, None, id="padded-full"), pytest.param(False, 2, id="padded-chunked"),
         pytest.param(True, None, id="packed-full"), pytest.param(True, 2, id="packed-chunked")]


# the distributed check's batch builder and recording optimizer (its main() runs only under torchrun)
GRAD_CHECK = SimpleNamespace(**runpy.run_path(str(HERE / "distributed" / "grad_check.py")))


@pytest.fixture(scope="module")
def model(tiny_text_lm):
    return AutoModelForCausalLM.from_pretrained(tiny_text_lm(CORPUS, seed=0))


@pytest.fixture(scope="module")
def batch(model):
    return GRAD_CHECK.make_batch(model.config.vocab_size, rows=8, prompt=5, response=7,
                                 prompt_lengths=(5, 2, 3, 5, 1, 4, 5, 2))


def direct_entropy(model, b, temperature: float = 1.0) -> torch.Tensor:
    """The definition, with autograd: one padded forward, the full-vocabulary softmax at each response position,
    H = -sum_v p_v log p_v, 0 where the response mask is 0. [B, R]."""
    ids = torch.cat([b.prompt_ids, b.response_ids], 1)
    mask = torch.cat([b.prompt_mask, b.response_mask], 1)
    logits = model(**forward_kwargs(model, ids, mask, {}), use_cache=False).logits.float() / temperature
    logits = logits[:, b.prompt_ids.shape[1] - 1 : -1]
    log_p = torch.log_softmax(logits, -1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return torch.where(b.response_mask.bool(), entropy, 0.0)


def grads_of(model, value: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    value.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got: dict, expected: dict, rel: float = 1e-4) -> None:
    assert got.keys() == expected.keys()
    scale = max(float(g.abs().max()) for g in expected.values())
    assert scale > 1e-4  # a real gradient
    diff = max(float((got[n] - expected[n]).abs().max()) for n in expected)
    assert diff <= rel * scale, (diff, scale)


# ---------------------------------------------------------------------------- the pure functions


def test_entropy_bonus_is_the_token_mean_over_the_mask_with_the_given_total():
    g = torch.Generator().manual_seed(0)
    entropy = torch.rand(4, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=g) > 0.4).long()
    entropy[mask == 0] = float("nan")  # padding: never read
    direct = entropy[mask.bool()].sum() / mask.sum()
    torch.testing.assert_close(algorithms.entropy_bonus(entropy, mask), direct, rtol=0, atol=1e-12)
    # micro-batches divided by the whole batch's token total add up to the whole batch's mean
    parts = sum(algorithms.entropy_bonus(entropy[rows], mask[rows], num_tokens=float(mask.sum()))
                for rows in (slice(0, 1), slice(1, 3), slice(3, 4)))
    torch.testing.assert_close(parts, direct, rtol=0, atol=1e-12)
    assert float(algorithms.entropy_bonus(entropy, torch.zeros_like(mask))) == 0.0


@pytest.mark.parametrize("chunk", [None, 3])
def test_score_positions_entropy_value_and_gradient_equal_the_softmax_definition(chunk):
    """The chunked, checkpointed entropy (suppressed tokens included) against -sum p log p by autograd."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(10, 12, generator=g, requires_grad=True)
    targets = torch.randint(0, 10, (10,), generator=g)
    suppressed = [10, 11]  # placeholder tokens: probability 0, logit -inf
    weights = torch.randn(10, generator=g)
    _, entropy = score_positions(logits, targets, lambda z: z, temperature=0.7, suppressed=suppressed,
                                 with_entropy=True, chunk_tokens=chunk, entropy_grad=True)
    (grad,) = torch.autograd.grad((entropy * weights).sum(), logits)
    kept = logits[:, :10] / 0.7  # the distribution restricted to the other tokens
    log_p = torch.log_softmax(kept, -1)
    direct = -(log_p.exp() * log_p).sum(-1)
    (expected,) = torch.autograd.grad((direct * weights).sum(), logits)
    torch.testing.assert_close(entropy, direct, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
    assert (grad[:, 10:] == 0).all()


# ---------------------------------------------------------------------------- the log-prob paths


@pytest.mark.parametrize(("padding_free", "chunk"), MODES)
def test_entropy_and_its_gradient_equal_the_full_logits_on_every_path(model, batch, padding_free, chunk):
    b = batch
    expected = direct_entropy(model, b, temperature=0.8)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2)) * b.response_mask
    expected_grads = grads_of(model, (expected * weights).sum())
    _, entropy = forward_response_log_probs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, {},
                                            0.8, with_entropy=True, padding_free=padding_free, chunk_tokens=chunk,
                                            entropy_grad=True)
    torch.testing.assert_close(entropy, expected, rtol=1e-5, atol=2e-6)
    assert_same_grads(grads_of(model, (entropy * weights).sum()), expected_grads)


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_entropys_backward_holds_one_chunk_of_logits(model, batch, padding_free):
    """With the entropy differentiable, what autograd keeps is still at most one chunk of [tokens, vocabulary]."""
    vocab, b = model.config.vocab_size, batch

    from test_logprob_packing import largest_saved_rows  # tests/core, same folder

    def largest_saved_logits(chunk):
        most, (_, entropy) = largest_saved_rows(
            lambda: forward_response_log_probs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask,
                                               {}, with_entropy=True, padding_free=padding_free, chunk_tokens=chunk,
                                               entropy_grad=True), vocab)
        assert entropy.requires_grad
        return most

    assert largest_saved_logits(None) >= int(b.response_mask.sum())  # all positions at once: the contrast
    assert largest_saved_logits(2) <= 2


def test_the_entropy_is_differentiable_only_when_asked(model, batch):
    _, metric = compute_log_probs(model, batch, micro_batch_size=3, with_entropy=True, chunk_tokens=2)
    _, bonus = compute_log_probs(model, batch, micro_batch_size=3, with_entropy=True, chunk_tokens=2,
                                 entropy_grad=True)
    assert not metric.requires_grad
    torch.testing.assert_close(bonus.detach(), metric)
    assert max(float(g.abs().max()) for g in grads_of(model, bonus.sum()).values()) > 1e-4


# ---------------------------------------------------------------------------- the loss in the update loop


def _update_grads(model, batch, coef: float, micro: int, *, padding_free: bool = False) -> dict[str, torch.Tensor]:
    """The gradient run_update's one optimizer step sees with grpo_loss and a fixed entropy coefficient."""
    cfg = config_from_dict({"algorithm": {"loss_agg_mode": "seq-mean-token-mean"},
                            "worker": {"actor": {"entropy_coeff": coef}}})
    control = EntropyControl(coef, cfg.worker.actor.entropy_control)
    loss_fn = functools.partial(grpo_loss, algorithm=cfg.algorithm, loss_options=resolve_options(cfg, "policy_loss"), entropy_control=control)

    def log_prob_fn(m, mb):
        return compute_log_probs(m, mb, micro_batch_size=len(mb), with_entropy=True, chunk_tokens=2,
                                 padding_free=padding_free, entropy_grad=control.applied() != 0)

    trained = copy.deepcopy(model)
    optimizer = GRAD_CHECK.RecordingOptimizer(trained.parameters())
    accelerator = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"),
                                  clip_grad_norm_=torch.nn.utils.clip_grad_norm_)
    run_update(trained, optimizer, batch, log_prob_fn=log_prob_fn, loss_fn=loss_fn, accelerator=accelerator,
               precision=precision_policy("float32"), metrics=StepMetrics(),
               settings=UpdateSettings(num_minibatches=1, micro_batch_size=micro, max_grad_norm=1e9, norm_len=7.0))
    names = {id(p): n for n, p in trained.named_parameters()}
    (seen,) = optimizer.seen
    return {names[i]: g for i, g in seen.items()}


@pytest.mark.parametrize(("micro", "padding_free"), [(8, False), (3, False), (3, True)])
def test_the_bonus_adds_minus_c_times_the_token_mean_entropy_gradient(model, batch, micro, padding_free):
    """grad(L_policy - c H) - grad(L_policy) = -c grad(H), H the token mean of the full-logit entropy over the
    whole batch, however the batch is cut into micro-batches (micro 8: one batch; 3: three of unequal tokens)."""
    c = 4.0  # large beside the policy gradient, whose float32 rounding the difference carries
    without = _update_grads(model, batch, 0.0, micro, padding_free=padding_free)
    with_bonus = _update_grads(model, batch, c, micro, padding_free=padding_free)
    h = direct_entropy(model, batch)
    direct = grads_of(model, h.sum() / batch.loss_mask.sum())  # the token mean: loss_agg_mode plays no part
    assert_same_grads({n: (with_bonus[n] - without[n]) / -c for n in direct}, direct)


# ---------------------------------------------------------------------------- the adaptive controller vs TRL


class TRLEntropyControl:
    """Transcribed from TRL 1.16, trl/trainer/grpo_trainer.py, GRPOTrainer.compute_loss (the entropy bonus,
    lines ~3186-3245) and __init__ (lines ~846-857), with no top-entropy mask (effective_mask = mask) and
    ``accelerator.reduce(..., "sum")`` given as ``reduce``."""

    def __init__(self, entropy_coef, use_adaptive_entropy, entropy_target, entropy_coef_min, entropy_coef_max,
                 entropy_coef_delta, reduce=lambda t: t):
        self.entropy_coef, self.use_adaptive_entropy = entropy_coef, use_adaptive_entropy
        self.args = SimpleNamespace(entropy_target=entropy_target, entropy_coef_min=entropy_coef_min,
                                    entropy_coef_max=entropy_coef_max, entropy_coef_delta=entropy_coef_delta)
        self._last_world_entropy = float("inf")
        self._entropy_window_stats = None
        self.reduce = reduce

    def micro_batch(self, entropies, mask, *, accumulation_steps, sync_gradients):
        """(apply_coef, entropy_loss) of one micro-batch; the coefficient moves when sync_gradients."""
        effective_mask = mask
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation_steps
        if self.use_adaptive_entropy:
            apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            apply_coef = self.entropy_coef
        if self.use_adaptive_entropy:
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            if self._entropy_window_stats is None:
                self._entropy_window_stats = stats
            else:
                self._entropy_window_stats = self._entropy_window_stats + stats
            if sync_gradients:
                window_stats = self.reduce(self._entropy_window_stats)
                world_entropy = (window_stats[0] / window_stats[1].clamp(min=1.0)).item()
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + self.args.entropy_coef_delta,
                                            self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - self.args.entropy_coef_delta,
                                            self.args.entropy_coef_min)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        return apply_coef, entropy_loss


# each step's mean entropy: above the target 0.2 for a while (the coefficient falls to its floor), below it
# (it climbs to its ceiling), then above again
LEVELS = [0.26] * 4 + [0.14] * 5 + [0.26] * 3


def _windows(levels, micro: int, *, seed: int, tokens_each: int | None = 5):
    """One optimizer step per level, of ``micro`` micro-batches (entropy [3, 6] float64 around the level, mask);
    each micro-batch holds ``tokens_each`` tokens (None: unequal counts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for level in levels:
        window = []
        for _ in range(micro):
            entropy = (level + 0.05 * torch.randn(3, 6, generator=g, dtype=torch.float64)).clamp(min=0)
            if tokens_each is None:
                mask = (torch.rand(3, 6, generator=g) > 0.5).to(torch.float64)
            else:
                mask = torch.zeros(18, dtype=torch.float64)
                mask[torch.randperm(18, generator=g)[:tokens_each]] = 1
                mask = mask.view(3, 6)
            window.append((entropy, mask))
        out.append(window)
    return out


@pytest.mark.parametrize("adaptive", [True, False])
def test_the_controller_and_its_gate_follow_trls_code(adaptive):
    settings = dict(target=0.2, coef_min=0.001, coef_max=0.012, delta=0.004)
    ours = EntropyControl(0.004, EntropyControlConfig(adaptive=adaptive, **settings))
    trl = TRLEntropyControl(0.004, adaptive, settings["target"], settings["coef_min"], settings["coef_max"],
                            settings["delta"])
    seen_coefs, applied = set(), []
    for window in _windows(LEVELS, 3, seed=0):
        tokens = sum(float(m.sum()) for _, m in window)
        for k, (entropy, mask) in enumerate(window):
            trl_coef, trl_loss = trl.micro_batch(entropy, mask, accumulation_steps=len(window),
                                                 sync_gradients=k == len(window) - 1)
            assert ours.applied() == trl_coef
            # equal token counts per micro-batch: TRL's per-micro-batch means are the window's token mean
            bonus = algorithms.entropy_bonus(entropy, mask, num_tokens=tokens)
            torch.testing.assert_close(bonus, trl_loss, rtol=0, atol=1e-12)
            ours.observe(entropy, mask)
            applied.append(trl_coef)
        metrics = StepMetrics()
        ours.step_end(metrics)
        assert ours.coef == pytest.approx(trl.entropy_coef, abs=1e-15)
        assert metrics.local()["actor/entropy_coeff"] == pytest.approx(trl.entropy_coef, abs=1e-15)
        seen_coefs.add(round(ours.coef, 9))
    if adaptive:  # both bounds reached, both ways taken, and the gate both shut and open
        assert {settings["coef_min"], settings["coef_max"]} <= seen_coefs
        assert 0.0 in applied and any(a > 0 for a in applied)
        assert ours.last_entropy == pytest.approx(trl._last_world_entropy, abs=1e-15)
    else:
        assert seen_coefs == {0.004} and set(applied) == {0.004}


def test_the_controller_takes_every_processs_tokens(monkeypatch):
    """Two processes: the step's entropy is the token-weighted mean over both (sums and counts reduced), as
    TRL's accelerator.reduce of [sum, count]."""
    settings = dict(target=0.2, coef_min=0.0, coef_max=1.0, delta=0.01)
    here, there = _windows(LEVELS, 2, seed=3, tokens_each=None), _windows(LEVELS, 2, seed=4, tokens_each=None)
    others = [torch.tensor([float(sum((e * m).sum() for e, m in w)), float(sum(m.sum() for _, m in w))],
                           dtype=torch.float64) for w in there]
    pending = iter(others)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t: t.add_(next(pending)))
    accelerator = SimpleNamespace(num_processes=2, process_index=0, device=torch.device("cpu"))
    ours = EntropyControl(0.05, EntropyControlConfig(adaptive=True, **settings), accelerator=accelerator)
    other_iter = iter(others)
    trl = TRLEntropyControl(0.05, True, settings["target"], settings["coef_min"], settings["coef_max"],
                            settings["delta"], reduce=lambda t: t + next(other_iter))
    ups = downs = 0
    for window in here:
        for k, (entropy, mask) in enumerate(window):
            trl.micro_batch(entropy, mask, accumulation_steps=len(window), sync_gradients=k == len(window) - 1)
            ours.observe(entropy, mask)
        before = ours.coef
        ours.step_end(StepMetrics())
        ups, downs = ups + (ours.coef > before), downs + (ours.coef < before)
        assert ours.coef == pytest.approx(trl.entropy_coef, abs=1e-15)
        assert ours.last_entropy == pytest.approx(trl._last_world_entropy, abs=1e-15)
    assert ups and downs


def test_unequal_micro_batches_give_the_window_mean_where_trl_averages_means():
    """The one difference from TRL, stated in algorithms/entropy.py: TRL's bonus is each micro-batch's own mean
    over the accumulation steps; grouprl's the whole mini-batch's token mean (what one big batch gives)."""
    (window,) = _windows([0.2], 3, seed=5, tokens_each=None)
    tokens = sum(float(m.sum()) for _, m in window)
    ours = sum(algorithms.entropy_bonus(e, m, num_tokens=tokens) for e, m in window)
    whole = torch.cat([e for e, _ in window])[torch.cat([m for _, m in window]).bool()].mean()
    trl = TRLEntropyControl(0.1, False, 0.2, 0.0, 1.0, 0.005)
    trls = sum(trl.micro_batch(e, m, accumulation_steps=3, sync_gradients=False)[1] for e, m in window)
    torch.testing.assert_close(ours, whole, rtol=0, atol=1e-12)
    assert abs(float(trls) - float(whole)) > 1e-4


def test_a_window_without_tokens_leaves_the_coefficient():
    ours = EntropyControl(0.3, EntropyControlConfig(adaptive=True, target=0.2))
    ours.observe(torch.ones(2, 3), torch.zeros(2, 3))
    ours.step_end(StepMetrics())
    assert ours.coef == 0.3 and math.isinf(ours.last_entropy)
    with pytest.raises(ValueError, match="finite entropy"):
        algorithms.adaptive_entropy_coef(0.1, float("nan"), target=0.2, coef_min=0, coef_max=1, delta=0.01)


# ---------------------------------------------------------------------------- the trainer


def _config(say_task, out: Path, **overrides) -> dict:
    return say_task(3).config(out, [{"name": "accuracy"}, {"name": "length", "weight": 0.5, "kwargs": {"target": 1}}],
                              **{"worker.actor.global_batch_size": 4, "worker.actor.log_prob_chunk_tokens": 3,
                                 "trainer.seed": 3, "trainer.max_steps": 1, **overrides})


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_with_a_fixed_coefficient_trains_the_bonus_and_logs_it(say_task, tmp_path):
    grads = {}
    for coef in (0.0, 0.5):
        trainer = GRPOTrainer(config_from_dict(_config(say_task, tmp_path / f"c{coef}",
                                                       **{"worker.actor.entropy_coeff": coef})))
        step = trainer.optimizer.step

        def recording_step(*args, _trainer=trainer, _step=step, _coef=coef, **kwargs):
            grads[_coef] = {n: p.grad.clone() for n, p in _trainer.policy.named_parameters() if p.grad is not None}
            return _step(*args, **kwargs)

        trainer.optimizer.step = recording_step
        trainer.train()
    (plain,), (bonus,) = _metrics(tmp_path / "c0.0"), _metrics(tmp_path / "c0.5")
    assert "actor/entropy_coeff" not in plain  # off: nothing logged, no entropy backward
    assert bonus["actor/entropy_coeff"] == bonus["actor/entropy_coeff_applied"] == 0.5
    # the same rollouts (same seed); the bonus changes the gradient
    assert plain["reward/mean"] == bonus["reward/mean"]
    assert max(float((grads[0.5][n] - grads[0.0][n]).abs().max()) for n in grads[0.0]) > 1e-4


def test_the_adaptive_coefficient_moves_each_step_and_survives_a_resume(say_task, tmp_path):
    """Target far above any entropy: each optimizer step adds delta; the gate opens after the first step. A run
    stopped after step 1 and resumed logs at step 2 what an uninterrupted run would (0.02, applied 0.01)."""
    run = tmp_path / "run"
    overrides = {"worker.actor.entropy_control": {"adaptive": True, "target": 100.0, "delta": 0.01},
                 "trainer.save_freq": 1}
    GRPOTrainer(config_from_dict(_config(say_task, run, **overrides))).train()
    saved = json.loads((run / "checkpoints" / "global_step_1" / "trainer_state.json").read_text())
    assert saved["extra"]["entropy_control"]["coef"] == pytest.approx(0.01)
    assert 0 < saved["extra"]["entropy_control"]["last_entropy"] < 100
    resumed = GRPOTrainer(config_from_dict(_config(say_task, run, **overrides,
                                                   **{"trainer.max_steps": 2, "trainer.resume": "auto"})))
    resumed.train()
    first, second = _metrics(run)
    assert (first["actor/entropy_coeff"], first["actor/entropy_coeff_applied"]) == pytest.approx((0.01, 0.0))
    assert (second["actor/entropy_coeff"], second["actor/entropy_coeff_applied"]) == pytest.approx((0.02, 0.01))


# ---------------------------------------------------------------------------- config


def test_easyr1s_entropy_coeff_loads_and_trls_names_point_to_the_keys():
    cfg = load_config(HERE / "configs" / "easyr1_config_v0.2.yaml",
                      ["worker.reward.compute_score=null", "worker.reward.reward_function=math.py:compute_score",
                       "worker.actor.strategy=fsdp"])  # EasyR1's strategy, which its offload keys need
    assert cfg.worker.actor.entropy_coeff == 1e-3 and not cfg.worker.actor.entropy_control.adaptive
    with pytest.raises(ConfigError, match=r"TRL's GRPOConfig name: use worker\.actor\.entropy_control\.target"):
        load_config(None, ["entropy_target=0.3"])


@pytest.mark.parametrize("key, value", [
    ("worker.actor.entropy_coeff", -0.01), ("worker.actor.entropy_coeff", float("nan")),
    ("worker.actor.entropy_coeff", float("inf")), ("worker.actor.entropy_control.delta", -0.1),
    ("worker.actor.entropy_control.target", float("nan")), ("worker.actor.entropy_control.coef_max", float("inf")),
])
def test_a_negative_or_non_finite_entropy_setting_is_a_config_error_naming_the_key(key, value):
    *section, leaf = key.split(".")
    values: dict = {}
    node = values
    for part in section:
        node = node.setdefault(part, {})
    node[leaf] = value
    with pytest.raises(ConfigError, match=f"config key '{key}' (must be >= 0 and finite|expects a number)"):
        config_from_dict(values)


def test_coef_min_above_coef_max_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'worker\.actor\.entropy_control\.coef_min' \(0\.5\) is above"):
        config_from_dict({"worker": {"actor": {"entropy_control": {"coef_min": 0.5, "coef_max": 0.1}}}})
