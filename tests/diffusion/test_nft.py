"""DiffusionNFT's objective against direct implementations of the paper's equations and of the
released code's adaptive weighting (``grouprl.domains.diffusion.nft``)."""

from __future__ import annotations

import pytest
import torch

from grouprl.domains.diffusion.nft import (
    forward_noised,
    nft_loss,
    old_policy_decay,
    optimality_probability,
    update_old_policy,
)


def tensors(seed: int = 0, shape=(6, 4, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    x0, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    t = torch.rand(shape[0], generator=g) * 0.9 + 0.05
    v_old = torch.randn(shape, generator=g)
    v_theta = v_old + 0.1 * torch.randn(shape, generator=g)
    r = torch.rand(shape[0], generator=g)
    return x0, noise, t, v_old, v_theta, r


def test_the_loss_is_the_papers_equation():
    """L = r ||v+ - v||^2 + (1 - r) ||v- - v||^2 with v+- = (1 -+ beta) v_old +- beta v_theta, v = eps - x0."""
    x0, noise, t, v_old, v_theta, r = tensors()
    beta = 0.3
    _, target = forward_noised(x0, noise, t)
    expected = []
    for i in range(len(x0)):  # one sample at a time, straight from the equations
        v = noise[i] - x0[i]
        v_pos = (1 - beta) * v_old[i] + beta * v_theta[i]
        v_neg = (1 + beta) * v_old[i] - beta * v_theta[i]
        expected.append(r[i] * ((v_pos - v) ** 2).mean() + (1 - r[i]) * ((v_neg - v) ** 2).mean())
    got = nft_loss(v_theta, v_old, target, r, beta, adaptive_weighting=False)
    torch.testing.assert_close(got, torch.stack(expected), rtol=1e-6, atol=1e-7)


def test_adaptive_weighting_is_the_released_codes_x0_space_loss():
    x0, noise, t, v_old, v_theta, r = tensors(1)
    beta, c = 0.1, 5.0
    x_t, target = forward_noised(x0, noise, t)
    tt = t.view(-1, 1, 1, 1)
    dims = (1, 2, 3)
    # the code's form: one-step clean predictions from x_t, errors against x0, self-normalised
    x0_pos = x_t - tt * (beta * v_theta + (1 - beta) * v_old)
    x0_neg = x_t - tt * ((1 + beta) * v_old - beta * v_theta)
    w_pos = (x0_pos - x0).abs().mean(dims, keepdim=True).clamp(min=1e-5)
    w_neg = (x0_neg - x0).abs().mean(dims, keepdim=True).clamp(min=1e-5)
    pos = ((x0_pos - x0) ** 2 / w_pos).mean(dims)
    neg = ((x0_neg - x0) ** 2 / w_neg).mean(dims)
    expected = (r * pos / beta + (1 - r) * neg / beta) * c
    got = nft_loss(v_theta, v_old, target, r, beta, t=t, adaptive_weighting=True, adv_clip_max=c)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_gradient_pulls_towards_good_samples_and_away_from_bad_ones(adaptive):
    x0, noise, t, v_old, _, _ = tensors(2)
    _, target = forward_noised(x0, noise, t)
    n = len(x0)
    for r_value, sign in ((1.0, 1), (0.0, -1), (0.5, 0)):
        v_theta = v_old.clone().requires_grad_(True)  # at the old policy: v+ = v- = v_old
        loss = nft_loss(v_theta, v_old, target, torch.full((n,), r_value), 0.2, t=t, adaptive_weighting=adaptive)
        loss.sum().backward()
        # a small step against the gradient moves v_theta towards v (r = 1) or away from it (r = 0)
        towards = ((v_old - target) * v_theta.grad).flatten(1).sum(1)
        if sign == 0:
            assert v_theta.grad.abs().max() < 1e-6  # r = 1/2: both terms pull equally
        else:
            assert bool((sign * towards > 0).all())
    assert v_old.grad is None


def test_optimality_probability_maps_clipped_advantages_into_0_1():
    a = torch.tensor([-9.0, -5.0, -2.5, 0.0, 2.5, 5.0, 9.0])
    torch.testing.assert_close(optimality_probability(a, 5.0), torch.tensor([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]))
    with pytest.raises(ValueError, match="adv_clip_max"):
        optimality_probability(a, 0.0)


def test_forward_noising_ends_at_the_data_and_the_noise():
    x0, noise, _, _, _, _ = tensors(3)
    n = len(x0)
    start, v = forward_noised(x0, noise, torch.zeros(n))
    end, _ = forward_noised(x0, noise, torch.ones(n))
    torch.testing.assert_close(start, x0)
    torch.testing.assert_close(end, noise)
    torch.testing.assert_close(v, noise - x0)


def test_the_old_policy_follows_a_growing_decay():
    assert old_policy_decay(0) == 0.0 and old_policy_decay(100) == pytest.approx(0.1)
    assert old_policy_decay(10_000) == 0.5  # the ceiling
    assert old_policy_decay(50, flat=75, rate=0.0075, ceiling=0.999) == 0.0
    assert old_policy_decay(175, flat=75, rate=0.0075, ceiling=0.999) == pytest.approx(0.75)
    old, new = [torch.zeros(3), torch.ones(2)], [torch.ones(3), torch.zeros(2)]
    update_old_policy(old, new, 0.25)
    torch.testing.assert_close(old[0], torch.full((3,), 0.75))
    torch.testing.assert_close(old[1], torch.full((2,), 0.25))


def test_bad_inputs_are_named():
    x0, noise, t, v_old, v_theta, r = tensors()
    _, target = forward_noised(x0, noise, t)
    with pytest.raises(ValueError, match="beta"):
        nft_loss(v_theta, v_old, target, r, 0.0, t=t)
    with pytest.raises(ValueError, match="r must have shape"):
        nft_loss(v_theta, v_old, target, r[:2], 0.1, t=t)
    with pytest.raises(ValueError, match="needs t"):
        nft_loss(v_theta, v_old, target, r, 0.1)
    with pytest.raises(ValueError, match="decay"):
        update_old_policy([torch.zeros(1)], [torch.zeros(1)], 1.5)
