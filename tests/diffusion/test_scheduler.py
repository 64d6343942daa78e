"""Flow-GRPO sampling and objective math: densities, formulas, determinism, GRPO-Guard, schedules."""

import math

import pytest
import torch

from grouprl.domains.diffusion.objectives import (
    clipped_policy_loss,
    flow_kl,
    group_advantages,
    guard_log_ratio,
    guard_reweight,
)
from grouprl.domains.diffusion.scheduler import (
    cfg_velocity,
    sde_sigma_t,
    sde_step,
    sde_window,
    shifted_sigmas,
    train_timesteps,
)

NOISE = 0.7
# Per-sample steps, one of them from t = 1 (where sigma_t needs the 1 - sigma_next denominator).
SIGMA = torch.tensor([1.0, 0.7, 0.3, 0.05])
SIGMA_NEXT = torch.tensor([0.9, 0.5, 0.1, 0.01])


def latents(seed, shape=(4, 3, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def col(values, ndim=4):
    """[B] -> [B, 1, ..., 1] in float64."""
    return torch.as_tensor(values, dtype=torch.float64).view(-1, *([1] * (ndim - 1)))


def normal_log_prob(sample, mean, std):
    dist = torch.distributions.Normal(mean.double(), col(std, mean.dim()))
    return dist.log_prob(sample.double()).reshape(sample.shape[0], -1).mean(dim=1)


# ---------------------------------------------------------------------------
# Log-probabilities
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_log_prob_is_gaussian_density_of_the_sample(kind):
    x, v = latents(0)
    out = sde_step(v, x, SIGMA, SIGMA_NEXT, noise_level=NOISE, kind=kind, generator=gen(1))
    assert out.log_prob.shape == (4,) and out.std.shape == (4,)
    assert out.log_prob.dtype == torch.float32 and out.prev_sample.dtype == torch.float32
    expected = normal_log_prob(out.prev_sample, out.mean, out.std)
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_rescoring_reproduces_log_prob_and_differentiates_through_velocity(kind):
    x, v = latents(2)
    v = v.requires_grad_()
    drawn = sde_step(v, x, SIGMA, SIGMA_NEXT, noise_level=NOISE, kind=kind, generator=gen(3))
    assert not drawn.prev_sample.requires_grad
    rescored = sde_step(v, x, SIGMA, SIGMA_NEXT, noise_level=NOISE, kind=kind, prev_sample=drawn.prev_sample)
    torch.testing.assert_close(rescored.log_prob, drawn.log_prob, rtol=0, atol=1e-6)
    assert torch.equal(rescored.prev_sample, drawn.prev_sample)
    (grad,) = torch.autograd.grad(rescored.log_prob.sum(), v)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    # The drawn sample is data: no gradient may flow into it from the stored latent.
    assert not rescored.prev_sample.requires_grad


def test_rescoring_a_different_sample_changes_log_prob():
    x, v = latents(4)
    drawn = sde_step(v, x, SIGMA, SIGMA_NEXT, noise_level=NOISE, generator=gen(5))
    moved = sde_step(v, x, SIGMA, SIGMA_NEXT, noise_level=NOISE, prev_sample=drawn.prev_sample + 0.1)
    assert (moved.log_prob < drawn.log_prob).all()


# ---------------------------------------------------------------------------
# Kernels against their formulas, written out independently
# ---------------------------------------------------------------------------


def test_sde_mean_and_std_match_formula():
    x, v = latents(6)
    out = sde_step(v, x, SIGMA, SIGMA_NEXT, noise_level=NOISE, generator=gen(7))
    t, t_next = SIGMA.double(), SIGMA_NEXT.double()
    dt = t_next - t
    # t = 1 takes 1 - sigma_next in the denominator; the others 1 - t.
    denominator = torch.tensor([1 - 0.9, 1 - 0.7, 1 - 0.3, 1 - 0.05], dtype=torch.float64)
    sigma_t = NOISE * torch.sqrt(t / denominator)
    xd, vd = x.double(), v.double()
    mean = xd + (vd + col(sigma_t**2 / (2 * t)) * (xd + col(1 - t) * vd)) * col(dt)
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std.double(), sigma_t * torch.sqrt(-dt), rtol=1e-6, atol=1e-7)


def test_sigma_t_at_one_is_finite():
    value = sde_sigma_t(1.0, 0.9, NOISE)
    assert math.isfinite(float(value))
    assert float(value) == pytest.approx(NOISE * math.sqrt(1 / (1 - 0.9)), rel=1e-5)
    # A single-step schedule 1 -> 0 is finite too.
    out = sde_step(*latents(8)[::-1], 1.0, 0.0, noise_level=NOISE, generator=gen(9))
    assert torch.isfinite(out.log_prob).all() and torch.isfinite(out.prev_sample).all()


def test_cps_mean_and_std_match_formula():
    x, v = latents(10)
    a = 0.8
    out = sde_step(v, x, SIGMA, SIGMA_NEXT, noise_level=a, kind="cps", generator=gen(11))
    t, t_next = SIGMA.double(), SIGMA_NEXT.double()
    std = t_next * math.sin(a * math.pi / 2)
    xd, vd = x.double(), v.double()
    x0_hat, x1_hat = xd - col(t) * vd, xd + col(1 - t) * vd
    mean = col(1 - t_next) * x0_hat + col(torch.sqrt(t_next**2 - std**2)) * x1_hat
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std.double(), std, rtol=1e-6, atol=1e-7)


def test_cps_last_step_has_zero_std_zero_log_prob_and_no_nan_gradient():
    x, v = latents(12, shape=(2, 3, 4, 4))
    v = v.requires_grad_()
    out = sde_step(v, x, torch.tensor([0.2, 0.2]), torch.tensor([0.1, 0.0]), noise_level=0.8, kind="cps", generator=gen(13))
    assert out.std[1] == 0 and out.std[0] > 0
    assert out.log_prob[1] == 0
    assert torch.equal(out.prev_sample[1], out.mean[1].detach())
    (grad,) = torch.autograd.grad(out.log_prob.sum(), v)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_noise_level_zero_is_the_deterministic_euler_step(kind):
    x, v = latents(14)
    first = sde_step(v, x, SIGMA, SIGMA_NEXT, noise_level=0.0, kind=kind, generator=gen(15))
    second = sde_step(v, x, SIGMA, SIGMA_NEXT, noise_level=0.0, kind=kind, generator=gen(16))
    euler = x + v * (SIGMA_NEXT - SIGMA).view(-1, 1, 1, 1)
    assert torch.equal(first.prev_sample, second.prev_sample)
    assert torch.equal(first.prev_sample, euler)
    assert torch.equal(first.std, torch.zeros(4)) and torch.equal(first.log_prob, torch.zeros(4))


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_samples_follow_mean_and_std(kind):
    x, v = latents(17, shape=(2, 4, 64, 64))
    out = sde_step(v, x, torch.tensor([0.8, 0.2]), torch.tensor([0.7, 0.1]), noise_level=NOISE, kind=kind, generator=gen(18))
    residual = (out.prev_sample - out.mean).reshape(2, -1)  # 16384 draws per sample
    assert residual.mean(dim=1).abs().max() < 0.05 * out.std.max()
    torch.testing.assert_close(residual.std(dim=1), out.std, rtol=0.03, atol=0)


def test_inputs_are_computed_in_float32():
    x, v = latents(19)
    out = sde_step(v.bfloat16(), x.bfloat16(), 0.5, 0.4, noise_level=NOISE, generator=gen(20))
    assert {out.prev_sample.dtype, out.log_prob.dtype, out.mean.dtype, out.std.dtype} == {torch.float32}


def test_sde_step_rejects_bad_arguments():
    x, v = latents(21)
    with pytest.raises(ValueError, match="sigma_next"):
        sde_step(v, x, 0.5, 0.5, noise_level=NOISE)
    with pytest.raises(ValueError, match="sigma"):
        sde_step(v, x, 1.2, 0.5, noise_level=NOISE)
    with pytest.raises(ValueError, match="kind"):
        sde_step(v, x, 0.5, 0.4, noise_level=NOISE, kind="ode")
    with pytest.raises(ValueError, match="noise_level"):
        sde_step(v, x, 0.5, 0.4, noise_level=-0.1)
    with pytest.raises(ValueError, match="sigma"):
        sde_step(v, x, torch.tensor([0.5, 0.4]), 0.3, noise_level=NOISE)


# ---------------------------------------------------------------------------
# Objectives
# ---------------------------------------------------------------------------


def guard_setup(sigma, sigma_next, seed, batch=64, shape=(4, 16, 16), dv=1.0):
    """Rollout step under v_old, then re-scored under v_old + dv * noise: (old, new) step outputs."""
    g = gen(seed)
    x = torch.randn(batch, *shape, generator=g)
    v_old = torch.randn(batch, *shape, generator=g)
    v_new = v_old + dv * torch.randn(batch, *shape, generator=g)
    old = sde_step(v_old, x, sigma, sigma_next, noise_level=NOISE, generator=g)
    new = sde_step(v_new, x, sigma, sigma_next, noise_level=NOISE, prev_sample=old.prev_sample)
    return old, new


def z_score(values):
    return float(values.mean() / (values.std() / math.sqrt(values.numel())))


def test_guard_removes_the_log_ratio_drift():
    drifts = {}
    for sigma, sigma_next in ((0.9, 0.8), (0.1, 0.05)):
        old, new = guard_setup(sigma, sigma_next, seed=22)
        plain = new.log_prob - old.log_prob
        guarded = guard_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.std)
        # The plain log-ratio sits clearly below 0 (E = -mean(dmu^2) / (2 s^2)) ...
        expected_drift = -((new.mean - old.mean) ** 2).reshape(64, -1).mean(1) / (2 * new.std**2)
        assert z_score(plain) < -6
        assert float(plain.mean()) == pytest.approx(float(expected_drift.mean()), rel=0.2)
        # ... the normalised one is centred on 0, and far smaller than the drift on its own scale.
        assert abs(z_score(guarded)) < 3
        assert abs(float(guarded.mean())) < 0.2 * abs(float((plain * new.std).mean()))
        drifts[sigma] = float(plain.mean())
    # Low-noise steps drift most.
    assert drifts[0.1] < 5 * drifts[0.9] < 0


def test_guard_log_ratio_is_the_noise_projection():
    old, new = guard_setup(0.5, 0.4, seed=23, batch=4)
    eps = (old.prev_sample - old.mean) / old.std.view(-1, 1, 1, 1)
    expected = (eps * (new.mean - old.mean)).reshape(4, -1).mean(1)
    guarded = guard_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.std)
    torch.testing.assert_close(guarded, expected, rtol=1e-3, atol=1e-6)


def test_guard_reweight_divides_by_step_size():
    loss = torch.tensor([1.0, -2.0, 0.5])
    torch.testing.assert_close(guard_reweight(loss, torch.tensor([-0.1, -0.5, -0.25])), torch.tensor([10.0, -4.0, 2.0]))
    torch.testing.assert_close(guard_reweight(loss, -0.5), loss * 2)
    with pytest.raises(ValueError, match="dt"):
        guard_reweight(loss, 0.0)


def test_clipped_policy_loss_hand_values_and_gradient():
    ratios = torch.tensor([1.5, 0.5, 1.1, 0.5, 1.5], dtype=torch.float64)
    log_prob = torch.tensor([-1.0, -2.0, -0.5, -0.3, -1.2], requires_grad=True)
    old = log_prob.detach() - torch.log(ratios).float()
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0])
    loss, ratio, clipped = clipped_policy_loss(log_prob, old, adv, 0.2)
    # max(-A r, -A clip(r, 0.8, 1.2)): -1.2 (upper clip, A > 0), -0.5, -1.1, 1.6 (lower clip, A < 0), 3.0
    torch.testing.assert_close(loss, torch.tensor([-1.2, -0.5, -1.1, 1.6, 3.0]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ratio, ratios.float(), rtol=1e-5, atol=1e-6)
    assert clipped.tolist() == [True, False, False, True, False]
    (grad,) = torch.autograd.grad(loss.sum(), log_prob)
    # d(-A r)/d log_prob = -A r where unclipped, 0 where clipped.
    torch.testing.assert_close(grad, torch.tensor([0.0, -0.5, -1.1, 0.0, 3.0]), rtol=1e-5, atol=1e-5)


def test_flow_kl_zero_for_equal_means_and_formula_otherwise():
    mean, ref = latents(24)
    sigma_t = torch.tensor([0.5, 1.0, 2.0, 0.1])
    assert torch.equal(flow_kl(mean, mean.clone(), sigma_t), torch.zeros(4))
    expected = ((mean.double() - ref.double()) ** 2).reshape(4, -1).mean(1) / (2 * sigma_t.double() ** 2)
    torch.testing.assert_close(flow_kl(mean, ref, sigma_t).double(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(flow_kl(mean, ref, 0.5), flow_kl(mean, ref, torch.full((4,), 0.5)))


def test_flow_kl_with_step_std_is_the_gaussian_kl():
    mean, ref = latents(25, shape=(2, 5))
    std = torch.tensor([0.3, 0.7])
    exact = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean.double(), col(std, 2)), torch.distributions.Normal(ref.double(), col(std, 2))
    ).mean(1)
    torch.testing.assert_close(flow_kl(mean, ref, std).double(), exact, rtol=1e-5, atol=0)


def test_group_advantages_global_and_per_group_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 5.0])
    group_mean = torch.tensor([1 / 3] * 3 + [8 / 3] * 3, dtype=torch.float64)
    batch_std = math.sqrt(17.5 / 5)  # unbiased std of the six rewards (mean 1.5)
    expected = (rewards.double() - group_mean) / (batch_std + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, 3), expected.float())
    # Group ids of any kind give the same result as a group size, whatever their order.
    prompts = ["a cat", "a cat", "a cat", "a dog", "a dog", "a dog"]
    torch.testing.assert_close(group_advantages(rewards, prompts), expected.float())
    group_std = torch.tensor([math.sqrt(1 / 3)] * 3 + [math.sqrt(13 / 3)] * 3, dtype=torch.float64)
    per_group = (rewards.double() - group_mean) / (group_std + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, 3, global_std=False), per_group.float())


def test_group_advantages_clip_and_constant_groups():
    rewards = torch.tensor([0.0, 0.0, 0.0, 10.0, 0.5, 0.5])
    adv = group_advantages(rewards, 3, clip=1.0)
    assert adv.abs().max() == 1.0 and adv[3] == 1.0
    # A group of equal rewards gets exactly 0, with the global std as with its own.
    assert torch.equal(group_advantages(rewards, 3)[:3], torch.zeros(3))
    assert group_advantages(torch.tensor([0.5, 0.5, 1.0, 0.0]), 2, global_std=False)[:2].abs().max() == 0
    with pytest.raises(ValueError, match="group size"):
        group_advantages(rewards, 4)


# ---------------------------------------------------------------------------
# Windows, trained steps, schedule, guidance
# ---------------------------------------------------------------------------


def test_sde_window_covers_exactly_its_range():
    starts = set()
    for seed in range(300):
        window = sde_window(10, 2, (0, 10), generator=gen(seed))
        assert len(window) == 2 and window.step == 1
        starts.add(window.start)
    assert starts == set(range(9))
    starts = {sde_window(10, 3, (0, 5), generator=gen(seed)).start for seed in range(200)}
    assert starts == {0, 1, 2}
    assert sde_window(10, 5, (3, 8), generator=gen(0)) == range(3, 8)


@pytest.mark.parametrize(
    "args, name",
    [
        ((10, 0, (0, 10)), "window_size"),
        ((10, 11, (0, 10)), "window_size"),
        ((10, 4, (2, 5)), "window_size"),
        ((10, 2, (0, 11)), "window_range"),
        ((10, 2, (-1, 5)), "window_range"),
        ((10, 2, (5, 5)), "window_range"),
        ((10, 2, (0, 5, 7)), "window_range"),
        ((10, 2, (0.0, 5)), "window_range"),
        ((0, 2, (0, 5)), "num_steps"),
    ],
)
def test_sde_window_errors_name_the_argument(args, name):
    with pytest.raises(ValueError, match=name):
        sde_window(*args)


def test_train_timesteps():
    assert train_timesteps(10, 0.99) == range(9)
    assert list(train_timesteps(10, 1.0)) == list(range(10))
    assert train_timesteps(40, 0.5) == range(20)
    with pytest.raises(ValueError, match="timestep_fraction"):
        train_timesteps(10, 0.05)
    with pytest.raises(ValueError, match="timestep_fraction"):
        train_timesteps(10, 1.5)


@pytest.mark.parametrize("num_steps, shift", [(1, 1.0), (2, 3.0), (10, 1.0), (10, 3.0), (40, 3.0), (7, 2.7), (28, 0.5)])
def test_shifted_sigmas_match_diffusers(num_steps, shift):
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    sigmas = shifted_sigmas(num_steps, shift)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (num_steps + 1,)
    assert torch.equal(sigmas, scheduler.sigmas.cpu())
    assert sigmas[0] == 1 and sigmas[-1] == 0 and (sigmas[1:] < sigmas[:-1]).all()


def test_cfg_velocity():
    v_u, v_c = latents(26)
    torch.testing.assert_close(cfg_velocity(v_u, v_c, 4.5), v_u + 4.5 * (v_c - v_u))
    assert torch.equal(cfg_velocity(v_u, v_c, 1.0), v_c)
    assert torch.equal(cfg_velocity(None, v_c, 1.0), v_c)
    torch.testing.assert_close(cfg_velocity(v_u, v_c, 0.0), v_u)
    with pytest.raises(ValueError, match="v_uncond"):
        cfg_velocity(None, v_c, 4.5)
