"""GMPO (``geo_mean``), off-policy sequence masking and the unbiased KL: value and gradient against a
direct implementation, against verl's and TRL's code on the same tensors, the config keys, and tiny runs.

TRL 1.16 is installed: its ``GRPOTrainer.get_off_policy_mask`` is called as it is, and its
``GMPOTrainer._compute_loss`` / ``GRPOTrainer._compute_loss`` are called unchanged on a stand-in
``self`` whose forward returns the test's log-probs (no model, no accelerator). verl needs ray
and cannot be imported: its ``compute_policy_loss_geo_mean`` is transcribed below.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grouprl import algorithms
from grouprl.config import (AlgorithmConfig, ConfigError, OffPolicySequenceMaskingConfig,
                            config_from_dict)
from grouprl.trainer.grpo import GRPOTrainer, grpo_loss
from grouprl.trainer.metrics import StepMetrics
from grouprl.trainer.update import Normalisers

import trl  # noqa: E402  (a dev dependency: pyproject's dev extra)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TRL marks its experimental package as such on import
    from trl.experimental.gmpo import GMPOTrainer

B, R = 8, 7
LENGTHS = [7, 5, 1, 6, 0, 7, 3, 4]  # row 4 has no valid token


def tensors(seed: int, *, spread: float = 0.5):
    """float64 log-probs (current one a leaf), a response mask with padding, per-response advantages.

    Padding holds nan (never read by grouprl; the peers are given 0 there, as their inputs hold)."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(R)[None, :] < torch.tensor(LENGTHS)[:, None]).to(torch.float64)
    old = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3 - 0.05
    log_prob = old + torch.randn(B, R, generator=g, dtype=torch.float64) * spread
    ref = log_prob + torch.randn(B, R, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[3] = 0.0  # sign(A) = 0: verl and TRL treat it apart, the loss is 0 for all
    return log_prob.requires_grad_(), old, ref, adv, mask


def nan_padding(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask != 0, t, torch.full_like(t, float("nan")))


def close(a, b, tol=1e-10):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol, rtol=0), f"\n{a}\n!=\n{b}"


def grad_of(loss_fn, leaf):
    leaf.grad = None
    loss = loss_fn()
    loss.backward()
    g = leaf.grad.clone()
    leaf.grad = None
    return loss.detach(), g


# ---------------------------------------------------------------------------- GMPO


def gmpo_direct(log_prob, old, adv, lengths, low, high):
    """The paper's objective written out row by row: -A_i exp(mean_t c_t), c_t = min(d_t, high) for
    A_i > 0 (the one-sided clip: only the bound that limits improvement), max(d_t, -low) otherwise."""
    losses = []
    for i, n in enumerate(lengths):
        if n == 0:  # nothing to train on: the response adds 0 and counts in the mean
            losses.append(torch.zeros((), dtype=log_prob.dtype))
            continue
        d = log_prob[i, :n] - old[i, :n]
        c = torch.clamp(d, max=high) if adv[i] > 0 else torch.clamp(d, min=-low)
        losses.append(-adv[i] * torch.exp(c.sum() / max(n, 1)))
    return torch.stack(losses).mean()


def ours_gmpo(log_prob, old, adv, mask, low=0.4, high=0.4, **kw):
    return algorithms.compute_policy_loss("geo_mean", nan_padding(log_prob, mask), nan_padding(old, mask),
                                          adv[:, None].expand(B, R).clone(), mask, clip_ratio_low=low,
                                          clip_ratio_high=high, loss_agg_mode="seq-mean-token-mean", **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_geo_mean_value_and_gradient_match_the_direct_formula(seed):
    log_prob, old, _, adv, mask = tensors(seed)
    ours, g_ours = grad_of(lambda: ours_gmpo(log_prob, old, adv, mask, 0.3, 0.5)[0], log_prob)
    direct, g_direct = grad_of(lambda: gmpo_direct(log_prob, old, adv, LENGTHS, 0.3, 0.5), log_prob)
    close(ours, direct)
    close(g_ours, g_direct)
    assert torch.isfinite(g_ours).all() and (g_ours[mask == 0] == 0).all()


def test_geo_mean_clip_is_one_sided_and_sign_aware():
    # one response, A > 0: token 0 above the upper bound (clipped: no gradient), token 1 below the lower
    # bound (not clipped for A > 0: it still pulls); A < 0 mirrors it
    d = torch.tensor([[0.9, -0.9, 0.1]], dtype=torch.float64)
    old = torch.full((1, 3), -1.0, dtype=torch.float64)
    mask = torch.ones(1, 3)
    for sign, clipped_token, free_token in ((1.0, 0, 1), (-1.0, 1, 0)):
        log_prob = (old + d).requires_grad_()
        adv = torch.full((1, 3), sign, dtype=torch.float64)
        loss, metrics = algorithms.compute_policy_loss("geo_mean", log_prob, old, adv, mask, clip_ratio_low=0.4,
                                                       clip_ratio_high=0.4, loss_agg_mode="seq-mean-token-mean")
        loss.backward()
        assert log_prob.grad[0, clipped_token] == 0 and log_prob.grad[0, free_token] != 0
        clipped = (0.4 if sign > 0 else -0.4)
        expected_ratio = math.exp((clipped + d[0, free_token].item() + 0.1) / 3)
        close(loss, -sign * expected_ratio)
        assert metrics["clipfrac"] == pytest.approx(1 / 3)
        assert metrics["clipfrac_high" if sign > 0 else "clipfrac_low"] == pytest.approx(1 / 3)
        assert metrics["ratio_mean"] == pytest.approx(expected_ratio)


def verl_geo_mean(old_log_prob, log_prob, advantages, response_mask, config):
    """verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_policy_loss_geo_mean (without rollout_is_weights),
    transcribed; verl_F.masked_mean(v, m) is sum(v m) / (sum(m) + 1e-8)."""

    def masked_mean(values, mask):
        return (values * mask).sum() / (mask.sum() + 1e-8)

    clip_ratio = config.clip_ratio
    clip_ratio_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    clip_ratio_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    cliprange_low, cliprange_high = clip_ratio_low, clip_ratio_high
    negative_approx_kl = log_prob - old_log_prob
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    pg_loss = torch.mean(pg_losses)
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    pg_clipfrac = masked_mean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = masked_mean((clipped * (advantages < 0)).float(), response_mask)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac.item(), "actor/ppo_kl": ppo_kl.item(),
                     "actor/pg_clipfrac_lower": pg_clipfrac_lower.item()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_geo_mean_matches_verl(seed):
    log_prob, old, _, adv, mask = tensors(seed)
    adv_tokens = adv[:, None].expand(B, R) * mask  # verl's advantages are 0 at padding
    config = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.3, clip_ratio_high=0.5)
    ours, g_ours = grad_of(lambda: ours_gmpo(log_prob, old, adv, mask, 0.3, 0.5)[0], log_prob)
    verl, g_verl = grad_of(lambda: verl_geo_mean(old, log_prob, adv_tokens, mask, config)[0], log_prob)
    # verl adds 1e-8 to each token count (ours clamps it at 1): a relative 1e-8 / n apart, no more
    close(ours, verl, 1e-7)
    close(g_ours, g_verl, 1e-7)
    _, metrics = ours_gmpo(log_prob, old, adv, mask, 0.3, 0.5)
    _, verl_metrics = verl_geo_mean(old, log_prob, adv_tokens, mask, config)
    assert metrics["ppo_kl"] == pytest.approx(verl_metrics["actor/ppo_kl"], abs=1e-8)
    # verl's clip fractions count a token beyond either bound whatever the advantage's sign; ours (and TRL's)
    # only the bound the one-sided clip applies: ours can only be smaller
    assert metrics["clipfrac_high"] <= verl_metrics["actor/pg_clipfrac"] + 1e-12
    assert metrics["clipfrac_low"] <= verl_metrics["actor/pg_clipfrac_lower"] + 1e-12


class _OneProcess:
    """The accelerator calls TRL's loss makes, for one process."""

    num_processes = 1
    sync_gradients = True

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather


def trl_compute_loss(trainer_cls, log_prob, inputs, **attributes):
    """TRL's own ``_compute_loss`` on a stand-in ``self`` whose forward returns ``log_prob``; also its metrics."""
    stand_in = SimpleNamespace(**{
        "top_entropy_quantile": 1.0, "beta": 0.0, "model": SimpleNamespace(training=True),
        "current_gradient_accumulation_steps": 1, "_metrics": defaultdict(lambda: defaultdict(list)),
        "accelerator": _OneProcess(), "get_off_policy_mask": trl.GRPOTrainer.get_off_policy_mask,
        "_get_per_token_logps_and_entropies": lambda *args, **kwargs: (log_prob, torch.zeros_like(log_prob), None),
        **attributes})
    loss = trainer_cls._compute_loss(stand_in, None, inputs)
    return loss, {k: v[-1] for k, v in stand_in._metrics["train"].items()}


def trl_inputs(old, adv, mask, **more):
    return {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
            "completion_ids": torch.zeros(B, R, dtype=torch.long), "completion_mask": mask,
            "advantages": adv, "old_per_token_logps": old, **more}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_geo_mean_matches_trl_gmpo(seed):
    log_prob, old, _, adv, mask = tensors(seed)
    ours, g_ours = grad_of(lambda: ours_gmpo(log_prob, old, adv, mask, 0.3, 0.5)[0], log_prob)
    gmpo = GMPOTrainer
    trl_loss, g_trl = grad_of(lambda: trl_compute_loss(gmpo, log_prob, trl_inputs(old, adv, mask),
                                                       epsilon_low=0.3, epsilon_high=0.5)[0], log_prob)
    # A response with no valid token (row 4) adds -A_i exp(0) to TRL's mean (no gradient), 0 to ours
    empty = torch.tensor(LENGTHS) == 0
    close(ours, trl_loss - (-adv[empty]).sum() / B, 1e-12)
    assert (-adv[empty]).abs().sum() > 0
    close(g_ours, g_trl, 1e-12)
    _, metrics = ours_gmpo(log_prob, old, adv, mask, 0.3, 0.5)
    _, trl_metrics = trl_compute_loss(gmpo, log_prob.detach(), trl_inputs(old, adv, mask),
                                      epsilon_low=0.3, epsilon_high=0.5)
    assert metrics["clipfrac_low"] == pytest.approx(trl_metrics["clip_ratio/low_mean"], abs=1e-12)
    assert metrics["clipfrac_high"] == pytest.approx(trl_metrics["clip_ratio/high_mean"], abs=1e-12)
    assert metrics["clipfrac"] == pytest.approx(trl_metrics["clip_ratio/region_mean"], abs=1e-12)


# ---------------------------------------------------------------------------- off-policy sequence masking


def test_off_policy_mask_by_hand():
    adv = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]])
    log_prob = torch.zeros(4, 2)
    # mean divergence log pi_sampler - log pi_theta per row: 0.6, 0.4, 0.6, nan+0.8 (the nan counts as 0: 0.4)
    sampler = torch.tensor([[0.5, 0.7], [0.4, 0.4], [0.6, 0.6], [float("nan"), 0.8]])
    mask = torch.ones(4, 2)
    m = algorithms.off_policy_sequence_mask(adv, log_prob, sampler, mask, delta=0.5)
    assert m.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    # padding is 0, and a nan there is never read
    mask[1, 1] = 0
    sampler[1, 1] = float("nan")
    assert algorithms.off_policy_sequence_mask(adv, log_prob, sampler, mask, delta=0.3)[1].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="delta > 0"):
        algorithms.off_policy_sequence_mask(adv, log_prob, sampler, mask, delta=0.0)


@pytest.mark.parametrize("per_token", [False, True])
def test_off_policy_mask_matches_trl(per_token):
    g = torch.Generator().manual_seed(5)
    log_prob, old, _, adv, mask = tensors(7)
    sampler = log_prob.detach() + torch.randn(B, R, generator=g, dtype=torch.float64) * 0.2
    sampler = sampler + torch.linspace(-0.3, 0.6, B, dtype=torch.float64)[:, None]  # rows drift apart
    sampler[0, 2] = sampler[5, 0] = float("nan")  # tokens the engine could not score
    advantages = torch.randn(B, R, generator=g, dtype=torch.float64) if per_token else adv[:, None]
    ours = algorithms.off_policy_sequence_mask(advantages.expand(B, R), log_prob, sampler, mask, delta=0.1)
    theirs = trl.GRPOTrainer.get_off_policy_mask(advantages=advantages, per_token_logps=log_prob,
                                                 sampling_per_token_logps=sampler, mask=mask,
                                                 off_policy_threshold=0.1)
    assert ours.requires_grad is False
    close(ours, theirs.expand(B, R) * mask, 0)
    dropped = ((ours == 0) & (mask != 0)).any(-1)
    assert 0 < int(dropped.sum()) < int((mask.sum(-1) > 0).sum())  # the case mixes kept and dropped rows


# ---------------------------------------------------------------------------- the unbiased KL


def test_unbiased_kl_value_and_gradient_match_the_direct_formula():
    log_prob, old, ref, _, mask = tensors(3)
    ours, g_ours = grad_of(lambda: algorithms.unbiased_kl_penalty(
        nan_padding(log_prob, mask), ref, nan_padding(old, mask), "k3", response_mask=mask).sum(), log_prob)
    direct, g_direct = grad_of(lambda: ((torch.exp(ref - log_prob) - (ref - log_prob) - 1)
                                        * torch.exp(log_prob - old) * mask).sum(), log_prob)
    close(ours, direct)
    close(g_ours, g_direct)
    # on-policy (old = sg(log_prob)) the value is the plain k3, the gradient is not
    plain, g_plain = grad_of(lambda: algorithms.kl_penalty(log_prob, ref, "k3", response_mask=mask).sum(), log_prob)
    on_policy, g_on = grad_of(lambda: algorithms.unbiased_kl_penalty(log_prob, ref, log_prob.detach(), "k3",
                                                                     response_mask=mask).sum(), log_prob)
    close(on_policy, plain)
    close(g_on - g_plain, (torch.exp(ref - log_prob) - (ref - log_prob) - 1).detach() * mask)


def micro_batch(log_prob, old, ref, adv, mask, *, rollout=None):
    return SimpleNamespace(old_log_probs=old, ref_log_probs=ref, advantages=adv[:, None].expand(B, R).clone(),
                           loss_mask=mask, token_weights=None, rollout_log_probs=rollout,
                           edited=torch.zeros(B, dtype=torch.bool))


@pytest.mark.parametrize("delta, unbiased", [(None, False), (None, True), (0.1, False), (0.1, True)])
def test_grpo_loss_matches_trl_grpo(delta, unbiased):
    """grouprl's whole GRPO loss (PPO clip, KL loss, masking, the unbiased KL) against TRL's _compute_loss."""
    log_prob, old, ref, adv, mask = tensors(4, spread=0.15)
    sampler = old + torch.linspace(-0.2, 0.5, B, dtype=torch.float64)[:, None]
    sampler[1, 0] = float("nan")
    algorithm = AlgorithmConfig(kl_coef=0.05, loss_agg_mode="seq-mean-token-mean", kl_penalty="k3",
                                unbiased_kl=unbiased)
    algorithm.off_policy_sequence_masking.delta = delta
    norms = Normalisers(num_tokens=float(mask.sum()), num_seqs=float(B), norm_len=float(R))
    metrics = StepMetrics()

    def ours():
        mb = micro_batch(log_prob, old, ref, adv, mask, rollout=nan_padding(sampler, mask))
        return grpo_loss(mb, log_prob, None, norms, metrics, algorithm=algorithm, loss_options={"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_dual": None})[0]

    def theirs():
        inputs = trl_inputs(old, adv, mask, ref_per_token_logps=ref, sampling_per_token_logps=sampler * mask)
        return trl_compute_loss(trl.GRPOTrainer, log_prob, inputs, beta=0.05, epsilon_low=0.2, epsilon_high=0.28,
                                loss_type="grpo", importance_sampling_level="token", off_policy_mask_threshold=delta,
                                args=SimpleNamespace(use_bias_correction_kl=unbiased, delta=None), use_vllm=False,
                                _entropy_bonus_enabled=False, aux_loss_enabled=False)[0]

    value, g_ours = grad_of(ours, log_prob)
    expected, g_trl = grad_of(theirs, log_prob)
    close(value, expected, 1e-12)
    close(g_ours, g_trl, 1e-12)
    logged = metrics.local()
    if delta is None:
        assert "actor/off_policy_masked_frac" not in logged
    else:
        expected_frac = 1 - float((algorithms.off_policy_sequence_mask(
            adv[:, None].expand(B, R), log_prob, sampler, mask, delta=delta) * mask).sum() / mask.sum())
        assert 0 < expected_frac < 1
        assert logged["actor/off_policy_masked_frac"] == pytest.approx(expected_frac)


def test_masking_reads_the_old_log_probs_without_the_engines_and_keeps_rollout_weights():
    log_prob, _, ref, adv, mask = tensors(4)
    old = log_prob.detach()  # the trained policy is the old one: only the engine's log-probs can differ
    adv = -adv.abs() - 0.1  # every response negative: masking depends on the divergence alone
    algorithm = AlgorithmConfig(off_policy_sequence_masking=OffPolicySequenceMaskingConfig(delta=0.05))
    norms = Normalisers(num_tokens=float(mask.sum()), num_seqs=float(B), norm_len=float(R))
    drift = old + torch.linspace(-0.3, 0.3, B, dtype=torch.float64)[:, None]  # the sampler's, when there
    weights = torch.rand(B, R, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def pg_loss(rollout, token_weights=None, edited=None):
        mb = micro_batch(log_prob, old, ref, adv, mask, rollout=rollout)
        mb.token_weights = token_weights
        if edited is not None:
            mb.edited = edited
        return grpo_loss(mb, log_prob, None, norms, StepMetrics(), algorithm=algorithm, loss_options={"clip_ratio_low": 0.2, "clip_ratio_high": 0.3, "clip_ratio_dual": 3.0})[0]

    def expected(sampler, token_weights=None):
        m = algorithms.off_policy_sequence_mask(adv[:, None].expand(B, R), log_prob, sampler, mask, delta=0.05)
        w = m if token_weights is None else m * token_weights
        return algorithms.compute_policy_loss("vanilla", log_prob, old, adv[:, None].expand(B, R), mask,
                                              clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_dual=3.0,
                                              token_weights=w)[0]

    close(pg_loss(drift), expected(drift))
    close(pg_loss(None), expected(old))
    close(pg_loss(drift, weights), expected(drift, weights))
    edited = torch.zeros(B, dtype=torch.bool)
    edited[-3:] = True  # rewritten rows were never sampled: their sampler is the old policy
    close(pg_loss(drift, edited=edited), expected(torch.where(edited[:, None], old, drift)))
    assert not torch.allclose(expected(drift), expected(torch.where(edited[:, None], old, drift)))
    assert not torch.allclose(pg_loss(drift), pg_loss(None))


def test_grpo_loss_takes_gmpos_own_clip_range():
    from grouprl.config.algorithm_options import resolve_options

    log_prob, old, ref, adv, mask = tensors(6)
    cfg = config_from_dict({"algorithm": {"policy_loss": "geo_mean", "loss_agg_mode": "seq-mean-token-mean",
                                          "policy_loss_options": {"clip_ratio_low": 0.1, "clip_ratio_high": 0.25}}})
    norms = Normalisers(num_tokens=float(mask.sum()), num_seqs=float(B), norm_len=float(R))
    loss = grpo_loss(micro_batch(log_prob, old, ref, adv, mask), log_prob, None, norms, StepMetrics(),
                     algorithm=cfg.algorithm,
                     loss_options=resolve_options(cfg, "policy_loss"))[0]
    close(loss, gmpo_direct(log_prob, old, adv, LENGTHS, 0.1, 0.25))
    assert not torch.allclose(loss, gmpo_direct(log_prob, old, adv, LENGTHS, 0.4, 0.4))


# ---------------------------------------------------------------------------- config


def test_config_keys_and_their_errors():
    cfg = config_from_dict({})
    assert cfg.algorithm.off_policy_sequence_masking.delta is None and cfg.algorithm.unbiased_kl is False
    from grouprl.config.algorithm_options import resolve_options

    gmpo = config_from_dict({"algorithm": {"policy_loss": "geo_mean"}})
    assert resolve_options(gmpo, "policy_loss") == {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}
    on = config_from_dict({"algorithm": {"off_policy_sequence_masking": {"delta": 0.5}, "kl_coef": 0.1,
                                         "unbiased_kl": True, "policy_loss": "geo_mean"}})
    assert on.algorithm.off_policy_sequence_masking.delta == 0.5 and on.algorithm.unbiased_kl
    from grouprl.config import load_config

    for bad, key in [
        (["algorithm.off_policy_sequence_masking.delta=0.0"], "algorithm.off_policy_sequence_masking.delta"),
        (["algorithm.off_policy_sequence_masking.delta=-1.0"], "algorithm.off_policy_sequence_masking.delta"),
        (["algorithm.unbiased_kl=true", "algorithm.kl_coef=0.1", "algorithm.use_kl_loss=false"],
         "algorithm.unbiased_kl"),
        (["algorithm.unbiased_kl=true"], "algorithm.unbiased_kl"),  # kl_coef 0: no KL term to weigh
        (["algorithm.policy_loss=geo_mean", "algorithm.policy_loss_options={clip_ratio_low: 0.0}"],
         "algorithm.policy_loss_options"),
        (["algorithm.policy_loss=geo_mean", "algorithm.policy_loss_options={clip_ratio_high: -0.1}"],
         "algorithm.policy_loss_options"),
    ]:
        with pytest.raises(ConfigError, match=f"'{key}'"):
            load_config(None, bad)


# ---------------------------------------------------------------------------- tiny runs


@pytest.fixture(scope="module")
def text_setup(say_task):
    return say_task(6)


def run_config(task, out, **overrides):
    return config_from_dict(task.config(out, [{"name": "accuracy"}, {"name": "length", "weight": 0.5,
                                                                     "kwargs": {"target": 1}}], **{
        "worker.actor.global_batch_size": 4, "worker.actor.micro_batch_size_per_device_for_update": 4,
        "trainer.seed": 3, "trainer.max_steps": 1, **overrides}))


def test_tiny_run_with_gmpo_masking_and_the_unbiased_kl(text_setup, tmp_path):
    config = run_config(text_setup, tmp_path / "run", **{
        "algorithm.policy_loss": "geo_mean", "algorithm.loss_agg_mode": "seq-mean-token-mean",
        "algorithm.off_policy_sequence_masking": {"delta": 0.5}, "algorithm.kl_coef": 0.05,
        "algorithm.unbiased_kl": True, "worker.actor.ppo_epochs": 2})
    trainer = GRPOTrainer(config)
    assert trainer._sampling(1).return_log_probs  # masking compares with the engine's log-probs
    metrics = trainer.train()
    for key in ("actor/clipfrac", "actor/ratio_mean", "actor/off_policy_masked_frac", "actor/kl_loss", "actor/kl"):
        assert key in metrics and math.isfinite(metrics[key]), key
    assert 0.0 <= metrics["actor/off_policy_masked_frac"] <= 1.0
