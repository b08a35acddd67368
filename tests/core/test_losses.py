import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embodied_rl.core import agg_loss, entropy_from_logits, kl_penalty, policy_loss, value_loss

FLOAT_DTYPES = [torch.float32, torch.float64]
PROPERTY = settings(max_examples=60, deadline=None)


def tensor(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


# ---------------------------------------------------------------- agg_loss

LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
MASK = [[1, 1, 0], [0, 0, 0], [1, 1, 1]]  # the middle row has no valid position


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 27 / 5),  # (1 + 2 + 7 + 8 + 9) / 5 valid positions
        ("token-sum", 27.0),
        ("seq-mean-token-sum", (3 + 24) / 2),  # rows 0 and 2 count, the empty row does not
        ("seq-mean-token-mean", (1.5 + 8.0) / 2),
        ("seq-mean-token-sum-norm", (3 / 3 + 24 / 3) / 2),  # divided by L = 3
    ],
)
def test_agg_loss_modes_by_hand(dtype, mode, expected):
    got = agg_loss(tensor(LOSS, dtype), torch.tensor(MASK), mode)
    assert got.dtype == dtype and got.dim() == 0
    torch.testing.assert_close(got, tensor(expected, dtype))


def test_agg_loss_norm_uses_loss_scale_factor():
    got = agg_loss(tensor(LOSS), torch.tensor(MASK), "seq-mean-token-sum-norm", 10.0)
    torch.testing.assert_close(got, tensor((3 / 10 + 24 / 10) / 2))


@pytest.mark.parametrize(
    "mode",
    [
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ],
)
def test_agg_loss_all_masked_is_zero_and_padding_nan_is_ignored(mode):
    loss = tensor([[1.0, float("nan")], [2.0, float("inf")]], torch.float32).requires_grad_()
    mask = torch.tensor([[True, False], [False, False]])
    got = agg_loss(loss, mask, mode)
    assert torch.isfinite(got)
    got.backward()
    assert torch.equal(loss.grad[~mask], torch.zeros(3))  # no gradient into padding
    assert agg_loss(loss, torch.zeros(2, 2), mode).item() == 0.0


def test_agg_loss_errors():
    with pytest.raises(ValueError, match="valid modes: token-mean, token-sum, seq-mean-token-sum"):
        agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "mean")
    with pytest.raises(ValueError, match=r"agg_loss: loss_mat \[2, 2\] and mask \[2, 3\]"):
        agg_loss(torch.zeros(2, 2), torch.ones(2, 3), "token-mean")
    with pytest.raises(ValueError, match="needs rows of positions"):
        agg_loss(torch.zeros(4), torch.ones(4), "seq-mean-token-mean")
    # token modes work on a flat minibatch too
    torch.testing.assert_close(
        agg_loss(torch.arange(4.0), torch.ones(4), "token-mean"), tensor(1.5).float()
    )


# ---------------------------------------------------------------- policy_loss


def log(x):
    return math.log(x)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_policy_loss_by_hand(dtype):
    # Four positions, clip 0.2, dual clip 3, old_logp = 0 so the ratio is exp(logp):
    #   A = +1, ratio 1.5: max(-1.5, -1.2) = -1.2        (clip binds)
    #   A = -1, ratio 0.5: max(0.5, 0.8) = 0.8, min(0.8, 3) = 0.8   (clip binds)
    #   A = -1, ratio 5  : max(5, 1.2) = 5, min(5, 3) = 3  (dual clip binds)
    #   A = +2, ratio 1  : -2
    logp = tensor([[log(1.5), log(0.5), log(5.0), 0.0]], dtype)
    old_logp = torch.zeros_like(logp)
    advantages = tensor([[1.0, -1.0, -1.0, 2.0]], dtype)
    mask = torch.ones_like(logp)
    loss, metrics = policy_loss(logp, old_logp, advantages, mask)
    assert loss.dtype == dtype
    torch.testing.assert_close(loss, tensor((-1.2 + 0.8 + 3.0 - 2.0) / 4, dtype))
    torch.testing.assert_close(metrics["clipfrac"], tensor(0.5, dtype))
    torch.testing.assert_close(metrics["clipfrac_lower"], tensor(0.25, dtype))
    torch.testing.assert_close(metrics["approx_kl"], tensor(-log(1.5 * 0.5 * 5.0) / 4, dtype))

    # Without the dual clip the third position costs its full 5.
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, dual_clip=None)
    torch.testing.assert_close(loss, tensor((-1.2 + 0.8 + 5.0 - 2.0) / 4, dtype))
    assert metrics["clipfrac_lower"].item() == 0.0

    # Asymmetric bounds (DAPO's clip-higher): the first position is clipped at 1.28.
    loss, _ = policy_loss(logp, old_logp, advantages, mask, clip_high=0.28)
    torch.testing.assert_close(loss, tensor((-1.28 + 0.8 + 3.0 - 2.0) / 4, dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_policy_loss_ratio_one_is_minus_mean_advantage(dtype):
    generator = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=generator, dtype=dtype).requires_grad_()
    advantages = torch.randn(3, 5, generator=generator, dtype=dtype)
    mask = torch.ones(3, 5)
    loss, metrics = policy_loss(logp, logp.detach(), advantages, mask)
    torch.testing.assert_close(loss, -advantages.mean())
    assert metrics["clipfrac"].item() == 0.0 and metrics["clipfrac_lower"].item() == 0.0
    assert metrics["approx_kl"].item() == 0.0
    assert all(not m.requires_grad for m in metrics.values())
    loss.backward()  # d/dlogp of -A * exp(logp - old) at ratio 1 is -A / count
    torch.testing.assert_close(logp.grad, -advantages / 15)


def test_policy_loss_respects_mask_and_agg():
    logp = torch.zeros(2, 3)
    advantages = tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]]).float()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, _ = policy_loss(logp, logp, advantages, mask, agg="seq-mean-token-mean")
    torch.testing.assert_close(loss, tensor(-(1.5 + 3.0) / 2).float())


def test_policy_loss_clamps_log_ratio():
    # A log-ratio of 1000 would overflow exp(); it is clamped to 20 (loss still finite).
    loss, metrics = policy_loss(
        tensor([[1000.0]]), tensor([[0.0]]), tensor([[1.0]]), torch.ones(1, 1), dual_clip=None
    )
    torch.testing.assert_close(loss, tensor(-1.2))
    torch.testing.assert_close(metrics["approx_kl"], tensor(-20.0))


def test_policy_loss_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"policy_loss: logp \[2, 3\] and advantages \[2, 4\]"):
        policy_loss(z, z, torch.zeros(2, 4), z)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(z, z, z, z, dual_clip=1.0)
    with pytest.raises(ValueError, match="must be >= 0"):
        policy_loss(z, z, z, z, clip_low=-0.1)


@PROPERTY
@given(
    log_ratio=st.floats(-30, 30),
    advantage=st.floats(-50, -1e-3),
    dual_clip=st.floats(1.01, 10),
    clip_low=st.floats(0.0, 0.9),
    clip_high=st.floats(0.0, 2.0),
)
def test_dual_clip_bounds_the_loss(log_ratio, advantage, dual_clip, clip_low, clip_high):
    loss, _ = policy_loss(
        tensor([[log_ratio]]),
        tensor([[0.0]]),
        tensor([[advantage]]),
        torch.ones(1, 1),
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )
    assert loss.item() <= dual_clip * abs(advantage) * (1 + 1e-12)


# ---------------------------------------------------------------- value_loss



def test_mix_policy_loss_is_the_plain_loss_on_the_precedents_own_rows():
    """ReMix on rows the precedent sampled (old_logp == precedent_logp): c = 1, the plain
    loss, its gradient and its metrics exactly."""
    torch.manual_seed(0)
    old = torch.randn(4, 6) - 2
    logp = (old + 0.3 * torch.randn(4, 6)).requires_grad_(True)
    advantages, mask = torch.randn(4, 6), (torch.rand(4, 6) > 0.2).float()
    plain, plain_info = policy_loss(logp, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    (plain_grad,) = torch.autograd.grad(plain, logp)
    mixed, mixed_info = policy_loss(logp, old, advantages, mask, clip_low=0.2, clip_high=0.28, precedent_logp=old)
    (mixed_grad,) = torch.autograd.grad(mixed, logp)
    assert torch.equal(plain, mixed) and torch.equal(plain_grad, mixed_grad)
    assert all(torch.equal(plain_info[key], mixed_info[key]) for key in plain_info)


def test_mix_policy_loss_clips_around_the_precedents_ratio_by_hand():
    """Behaviour policy 0.5, precedent 0.6, current 0.9, clip 0.2: the ratio 1.8 is clipped to
    c + 0.2 = 1.4 (c = 0.6 / 0.5), not to 1.2 as on-policy rows are; below, 0.5 is clipped to
    c - 0.2 = 1.0 for a negative advantage, and the dual clip caps at c * 3 = 3.6."""
    def loss(current, advantage, **extra):
        logp = torch.tensor([[math.log(current)]], requires_grad=True)
        value, info = policy_loss(logp, torch.tensor([[math.log(0.5)]]), torch.tensor([[advantage]]),
                                  torch.ones(1, 1), clip_low=0.2, clip_high=0.2, **extra)
        (grad,) = torch.autograd.grad(value, logp)
        return float(value.detach()), float(grad), info

    precedent = {"precedent_logp": torch.tensor([[math.log(0.6)]])}
    assert loss(0.9, 1.0, **precedent)[:2] == pytest.approx((-1.4, 0.0))  # clipped: no gradient
    assert loss(0.9, 1.0)[0] == pytest.approx(-1.2)
    value, grad, info = loss(0.65, 1.0, **precedent)  # inside [1.0, 1.4]: the ratio itself, and its gradient
    assert (value, grad) == pytest.approx((-1.3, -1.3)) and float(info["clipfrac"]) == 0.0
    assert loss(0.25, -1.0, **precedent)[:2] == pytest.approx((1.0, 0.0))  # 0.5 clipped up to 1.0
    assert loss(2.5, -1.0, **precedent)[0] == pytest.approx(3.6)  # ratio 5 > 3.6: the dual clip
    assert float(loss(0.9, 1.0, **precedent)[2]["approx_kl"]) == pytest.approx(math.log(0.6) - math.log(0.9))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_value_loss_by_hand(dtype):
    values = tensor([2.0, 0.0], dtype)
    old_values = tensor([1.0, 0.2], dtype)
    returns = tensor([3.0, -1.0], dtype)
    mask = torch.ones(2)
    # clip 0.5:
    #   v=2, old=1, R=3: (2-3)^2 = 1; clipped v = 1.5, (1.5-3)^2 = 2.25 -> 2.25 (clip binds)
    #   v=0, old=0.2, R=-1: (0+1)^2 = 1; clipped v = 0 (within 0.2 +- 0.5) -> 1
    loss, metrics = value_loss(values, old_values, returns, mask, clip=0.5)
    torch.testing.assert_close(loss, tensor(0.5 * (2.25 + 1.0) / 2, dtype))
    torch.testing.assert_close(metrics["clipfrac"], tensor(0.5, dtype))
    # No clip: 0.5 * mean(1, 1)
    loss, metrics = value_loss(values, old_values, returns, mask)
    torch.testing.assert_close(loss, tensor(0.5, dtype))
    assert metrics["clipfrac"].item() == 0.0


def test_value_loss_errors():
    with pytest.raises(ValueError, match=r"value_loss: values \[3\] and returns \[4\]"):
        value_loss(torch.zeros(3), torch.zeros(3), torch.zeros(4), torch.ones(3))


# ---------------------------------------------------------------- kl_penalty

# logp = log 0.5, ref_logp = log 0.25: k1 = log 2.
K1 = math.log(2.0)


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("k1", K1),
        ("abs", K1),
        ("k2", 0.5 * K1**2),
        ("k3", 0.5 + K1 - 1),  # kl = ref - logp = -log 2, exp(kl) - kl - 1
        ("k1+", K1),
        ("k3+", 0.5 + K1 - 1),
    ],
)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_kl_penalty_values(kind, expected, dtype):
    got = kl_penalty(tensor([log(0.5)], dtype), tensor([log(0.25)], dtype), kind)
    torch.testing.assert_close(got, tensor([expected], dtype))


@pytest.mark.parametrize(
    "kind, expected_grad",
    [
        ("k1", 1.0),
        ("k2", K1),  # d/dlogp 0.5 * k1^2 = k1
        ("k3", 1 - 0.5),  # d/dlogp exp(ref - logp) - (ref - logp) - 1 = 1 - exp(ref - logp)
        ("k1+", K1),  # straight-through: gradient of k2
        ("k3+", K1),
    ],
)
def test_kl_penalty_gradients(kind, expected_grad):
    logp = tensor([log(0.5)]).requires_grad_()
    kl_penalty(logp, tensor([log(0.25)]), kind).sum().backward()
    torch.testing.assert_close(logp.grad, tensor([expected_grad]))


def test_kl_penalty_k3_is_clamped_and_unknown_kind_fails():
    # ref - logp = 30 is clamped to 20; exp(20) - 21 is then clamped to 10.
    got = kl_penalty(tensor([0.0]), tensor([30.0]), "k3")
    torch.testing.assert_close(got, tensor([10.0]))
    with pytest.raises(ValueError, match="valid kinds: k1, k2, k3, abs, k1\\+, k3\\+"):
        kl_penalty(tensor([0.0]), tensor([0.0]), "low_var")
    with pytest.raises(ValueError, match=r"kl_penalty: logp \[1\] and ref_logp \[2\]"):
        kl_penalty(tensor([0.0]), tensor([0.0, 1.0]), "k1")


# ---------------------------------------------------------------- entropy_from_logits


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_entropy_from_logits_by_hand(dtype):
    # Uniform over 4 (any shift): log 4.  Logits (0, log 3): p = (1/4, 3/4),
    # H = -(1/4 log 1/4 + 3/4 log 3/4).
    logits = tensor([[[5.0, 5.0, 5.0, 5.0], [0.0, log(3.0), -1e4, -1e4]]], dtype)
    expected = tensor([[log(4.0), -(0.25 * log(0.25) + 0.75 * log(0.75))]], dtype)
    got = entropy_from_logits(logits)
    assert got.shape == (1, 2)
    torch.testing.assert_close(got, expected)
