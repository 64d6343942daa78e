"""Loss aggregation modes, and their exactness under gradient accumulation."""

import pytest
import torch

from grouprl.algorithms import LOSS_AGG_MODES, aggregate_loss, compute_policy_loss

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]], dtype=torch.float64)
# Row 0 has 2 valid tokens (sum 3), row 1 has 4 (sum 26), row 2 none.
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode, options, expected",
    [
        ("token-mean", {}, 29 / 6),
        ("token-mean", {"num_tokens": 10}, 29 / 10),
        ("seq-mean-token-sum", {}, 29 / 3),
        ("seq-mean-token-sum", {"num_seqs": 5}, 29 / 5),
        # The empty row contributes 0 and still counts: (3/2 + 26/4 + 0) / 3.
        ("seq-mean-token-mean", {}, 8 / 3),
        ("seq-mean-token-mean", {"num_seqs": 4}, 8 / 4),
        ("seq-mean-token-sum-norm", {}, 29 / (3 * 4)),
        ("seq-mean-token-sum-norm", {"norm_len": 8}, 29 / (3 * 8)),
        ("seq-mean-token-sum-norm", {"norm_len": 8, "num_seqs": 6}, 29 / (6 * 8)),
    ],
)
def test_modes_hand_values(mode, options, expected):
    assert aggregate_loss(LOSS, MASK, mode, **options).item() == pytest.approx(expected)


def test_options_a_mode_does_not_use_are_ignored():
    # A trainer passes all three totals whatever the mode.
    assert aggregate_loss(LOSS, MASK, "token-mean", num_tokens=6, num_seqs=99, norm_len=99).item() == pytest.approx(29 / 6)


@pytest.mark.parametrize("mode", MODES)
def test_fully_masked_batch_gives_zero_not_nan(mode):
    value = aggregate_loss(LOSS, torch.zeros_like(MASK), mode)
    assert value.item() == 0.0
    value = aggregate_loss(LOSS, torch.zeros_like(MASK), mode, num_tokens=0, num_seqs=3)
    assert value.item() == 0.0


def test_unknown_mode_lists_modes():
    with pytest.raises(ValueError, match="valid modes") as info:
        aggregate_loss(LOSS, MASK, "sum")
    for mode in MODES:
        assert mode in str(info.value)
    assert sorted(LOSS_AGG_MODES) == sorted(MODES)


def test_unknown_option_is_named():
    with pytest.raises(TypeError, match="num_token"):
        aggregate_loss(LOSS, MASK, "token-mean", num_token=3)


def _ragged_batch(seed=0, B=6, R=7):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 2, 0, 5, 1, 4])  # one empty row, ragged lengths
    mask = (torch.arange(R) < lengths[:, None]).long()
    log_prob = -torch.rand(B, R, generator=generator, dtype=torch.float64)
    old = log_prob + 0.3 * torch.randn(B, R, generator=generator, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=generator, dtype=torch.float64).expand(B, R).contiguous()
    return log_prob, old, adv, mask


def _micro_batches(mask, splits=(2, 3, 1)):
    """Row slices of the batch, each trimmed to its own longest response as a collator would."""
    start = 0
    for size in splits:
        rows = slice(start, start + size)
        width = max(int(mask[rows].sum(-1).max()), 1)
        yield rows, width
        start += size


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_is_exact_under_gradient_accumulation(mode):
    log_prob, old, adv, mask = _ragged_batch()
    B, R = mask.shape
    per_token = lambda lp, o, a: -a * torch.exp(lp - o)  # noqa: E731 - a simple differentiable per-token loss
    options = {"num_tokens": int(mask.sum()), "num_seqs": B, "norm_len": R}

    full_lp = log_prob.clone().requires_grad_()
    full = aggregate_loss(per_token(full_lp, old, adv), mask, mode, norm_len=R)
    full.backward()

    micro_lp = log_prob.clone().requires_grad_()
    total = 0.0
    for rows, width in _micro_batches(mask):
        lp = micro_lp[rows, :width]
        value = aggregate_loss(per_token(lp, old[rows, :width], adv[rows, :width]), mask[rows, :width], mode, **options)
        value.backward()
        total += value.item()

    assert total == pytest.approx(full.item(), rel=1e-12)
    assert torch.allclose(micro_lp.grad, full_lp.grad, atol=1e-12, rtol=0)
    assert full_lp.grad.abs().sum() > 0


def test_without_global_totals_micro_batch_means_are_not_exact():
    # The reason for num_tokens: averaging micro-batch token-means weights tokens unequally.
    log_prob, old, adv, mask = _ragged_batch()
    per_token = -adv * torch.exp(log_prob - old)
    full = aggregate_loss(per_token, mask, "token-mean")
    naive = sum(aggregate_loss(per_token[rows], mask[rows], "token-mean") for rows, _ in _micro_batches(mask)) / 3
    assert abs(naive.item() - full.item()) > 1e-3


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gspo_token", "cispo", "sapo"])
@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_is_exact_under_gradient_accumulation(name, mode):
    log_prob, old, adv, mask = _ragged_batch(seed=1)
    B, R = mask.shape
    clip = {} if name == "sapo" else {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    if name == "vanilla":
        clip["clip_ratio_dual"] = 1.5

    full_lp = log_prob.clone().requires_grad_()
    full, _ = compute_policy_loss(name, full_lp, old, adv, mask, **clip, loss_agg_mode=mode, norm_len=R)
    full.backward()

    micro_lp = log_prob.clone().requires_grad_()
    total = 0.0
    for rows, width in _micro_batches(mask):
        value, _ = compute_policy_loss(
            name, micro_lp[rows, :width], old[rows, :width], adv[rows, :width], mask[rows, :width], **clip,
            loss_agg_mode=mode, num_tokens=int(mask.sum()), num_seqs=B, norm_len=R,
        )
        value.backward()
        total += value.item()

    assert total == pytest.approx(full.item(), rel=1e-10, abs=1e-12)
    assert torch.allclose(micro_lp.grad, full_lp.grad, atol=1e-12, rtol=0)
