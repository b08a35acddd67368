import math

import numpy as np
import pytest
import torch
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st
from stable_baselines3.common.buffers import RolloutBuffer

from embodied_rl.core import (
    discounted_returns,
    gae,
    group_advantages,
    masked_gae,
    masked_whiten,
)

FLOAT_DTYPES = [torch.float32, torch.float64]
PROPERTY = settings(max_examples=40, deadline=None)
finite = st.floats(min_value=-10, max_value=10, allow_nan=False, allow_infinity=False)
unit = st.floats(min_value=0.0, max_value=1.0)


def tensor(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def reward_to_go(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """Plain Python reference along the last dim."""
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    for t in reversed(range(rewards.shape[-1])):
        running = rewards[..., t] + gamma * running
        out[..., t] = running
    return out


# ---------------------------------------------------------------- masked_gae


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_masked_gae_right_padded_by_hand(dtype):
    rewards = tensor([[1.0, 2.0, 0.0]], dtype)
    values = tensor([[0.5, 1.0, 0.0]], dtype)
    mask = torch.tensor([[1, 1, 0]])
    # gamma = lam = 0.5, walking back from t = 2:
    # t=2 masked: nothing moves, advantage = carried 0
    # t=1: delta = 2 + 0.5*0 - 1 = 1                  -> A1 = 1, next value = 1
    # t=0: delta = 1 + 0.5*1 - 0.5 = 1, A0 = 1 + 0.25*1 = 1.25
    advantages, returns = masked_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    assert advantages.dtype == dtype
    torch.testing.assert_close(advantages, tensor([[1.25, 1.0, 0.0]], dtype))
    torch.testing.assert_close(returns, tensor([[1.75, 2.0, 0.0]], dtype))


def test_masked_gae_skips_interior_masked_position():
    # An observation token in the middle (mask 0) is stepped over.
    rewards = tensor([[1.0, 5.0, 2.0]])
    values = tensor([[0.5, 9.0, 1.0]])
    mask = torch.tensor([[True, False, True]])
    # t=2: delta = 2 - 1 = 1                               -> A2 = 1, next value = 1
    # t=1 masked: advantage = carried A2 = 1, next value stays 1 (its 9 is ignored)
    # t=0: delta = 1 + 0.5*1 - 0.5 = 1, A0 = 1 + 0.25*A2 = 1.25
    advantages, returns = masked_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    torch.testing.assert_close(advantages, tensor([[1.25, 1.0, 1.0]]))
    torch.testing.assert_close(returns, tensor([[1.75, 10.0, 2.0]]))


def test_masked_gae_carries_no_gradient():
    values = torch.ones(2, 3, requires_grad=True)
    advantages, returns = masked_gae(torch.ones(2, 3), values, torch.ones(2, 3), 0.9, 0.9)
    assert not advantages.requires_grad and not returns.requires_grad


def test_masked_gae_shape_errors():
    with pytest.raises(ValueError, match=r"masked_gae: rewards \[4, 5\] and values \[4, 6\]"):
        masked_gae(torch.zeros(4, 5), torch.zeros(4, 6), torch.ones(4, 5), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"masked_gae: rewards must be 2-D \[B, L\], got \[5\]"):
        masked_gae(torch.zeros(5), torch.zeros(5), torch.ones(5), 1.0, 1.0)


@PROPERTY
@given(data=st.data(), length=st.integers(1, 10), valid=st.integers(1, 10))
def test_masked_gae_unit_gamma_lam_is_reward_to_go_minus_value(data, length, valid):
    valid = min(valid, length)
    rewards = tensor(data.draw(st.lists(finite, min_size=length, max_size=length)))[None]
    values = tensor(data.draw(st.lists(finite, min_size=length, max_size=length)))[None]
    mask = torch.zeros(1, length)
    mask[:, :valid] = 1
    advantages, _ = masked_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    expected = reward_to_go(rewards[:, :valid], 1.0) - values[:, :valid]
    torch.testing.assert_close(advantages[:, :valid], expected)
    torch.testing.assert_close(advantages[:, valid:], torch.zeros(1, length - valid).double())


@PROPERTY
@given(data=st.data(), length=st.integers(1, 10), gamma=unit, lam=unit)
def test_masked_gae_equals_gae_on_compacted_row(data, length, gamma, lam):
    # Skipping masked positions must be the same as deleting them.
    rewards = tensor(data.draw(st.lists(finite, min_size=length, max_size=length)))[None]
    values = tensor(data.draw(st.lists(finite, min_size=length, max_size=length)))[None]
    keep = data.draw(st.lists(st.booleans(), min_size=length, max_size=length))
    mask = torch.tensor([keep])
    advantages, _ = masked_gae(rewards, values, mask, gamma, lam)
    compact_rewards, compact_values = rewards[mask][None], values[mask][None]
    compact, _ = masked_gae(
        compact_rewards, compact_values, torch.ones_like(compact_rewards), gamma, lam
    )
    torch.testing.assert_close(advantages[mask], compact[0])


# ---------------------------------------------------------------- gae (env rollouts)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gae_termination_truncation_by_hand(dtype):
    # One env, four steps: t1 truncated (final obs worth 4), t2 terminated (final obs worth
    # 100, must be ignored), t3 is the end of the rollout (next obs worth 2).
    rewards = tensor([[1.0], [1.0], [1.0], [1.0]], dtype)
    values = tensor([[1.0], [2.0], [3.0], [4.0]], dtype)
    next_values = tensor([[2.0], [4.0], [100.0], [2.0]], dtype)
    terminated = torch.tensor([[False], [False], [True], [False]])
    truncated = torch.tensor([[0.0], [1.0], [0.0], [0.0]])  # float flags work too
    # gamma = lam = 0.5
    # t3: delta = 1 + 0.5*2 - 4 = -2                       A3 = -2 (nothing to carry)
    # t2: terminated, delta = 1 - 3 = -2                   A2 = -2 (no carry)
    # t1: truncated,  delta = 1 + 0.5*4 - 2 = 1            A1 = 1 (no carry across the cut)
    # t0: delta = 1 + 0.5*2 - 1 = 1                        A0 = 1 + 0.25*A1 = 1.25
    advantages, returns = gae(rewards, values, next_values, terminated, truncated, 0.5, 0.5)
    assert advantages.dtype == dtype
    torch.testing.assert_close(advantages, tensor([[1.25], [1.0], [-2.0], [-2.0]], dtype))
    torch.testing.assert_close(returns, tensor([[2.25], [3.0], [1.0], [2.0]], dtype))


def test_gae_terminated_and_truncated_together_means_no_bootstrap():
    ones = torch.ones(1, 1)
    advantages, _ = gae(ones, ones, 50 * ones, ones.bool(), ones.bool(), 0.9, 0.9)
    torch.testing.assert_close(advantages, torch.zeros(1, 1))  # 1 - 1, the 50 is ignored


def test_gae_shape_errors():
    z = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"gae: rewards \[3, 2\] and next_values \[3, 1\]"):
        gae(z, z, torch.zeros(3, 1), z.bool(), z.bool(), 0.9, 0.9)
    with pytest.raises(ValueError, match=r"gae: rewards must be 2-D \[T, N\]"):
        gae(z[0], z[0], z[0], z[0].bool(), z[0].bool(), 0.9, 0.9)


@PROPERTY
@given(data=st.data(), steps=st.integers(1, 12))
def test_gae_unit_gamma_lam_is_reward_to_go_minus_value(data, steps):
    rewards = tensor(data.draw(st.lists(finite, min_size=steps, max_size=steps)))[:, None]
    values = tensor(data.draw(st.lists(finite, min_size=steps, max_size=steps)))[:, None]
    next_values = torch.cat([values[1:], tensor([[123.0]])])  # the 123 is cut by termination
    terminated = torch.zeros(steps, 1, dtype=torch.bool)
    terminated[-1] = True
    truncated = torch.zeros_like(terminated)
    advantages, returns = gae(rewards, values, next_values, terminated, truncated, 1.0, 1.0)
    rtg = reward_to_go(rewards.T, 1.0).T
    torch.testing.assert_close(advantages, rtg - values)
    torch.testing.assert_close(returns, rtg)


@PROPERTY
@given(data=st.data(), rows=st.integers(1, 4), length=st.integers(1, 8), gamma=unit, lam=unit)
def test_gae_on_single_episode_rows_equals_masked_gae(data, rows, length, gamma, lam):
    cells = st.lists(finite, min_size=rows * length, max_size=rows * length)
    rewards = tensor(data.draw(cells)).reshape(rows, length)
    values = tensor(data.draw(cells)).reshape(rows, length)
    expected, expected_returns = masked_gae(rewards, values, torch.ones_like(rewards), gamma, lam)

    # The same rows as a time-major rollout: each column is one episode that terminates at
    # its last step, so the value after it is 0 (the bootstrap value is irrelevant).
    rewards_tn, values_tn = rewards.T, values.T
    next_values = torch.cat([values_tn[1:], torch.full((1, rows), 7.0).double()])
    terminated = torch.zeros(length, rows, dtype=torch.bool)
    terminated[-1] = True
    advantages, returns = gae(
        rewards_tn, values_tn, next_values, terminated, torch.zeros_like(terminated), gamma, lam
    )
    torch.testing.assert_close(advantages.T, expected)
    torch.testing.assert_close(returns.T, expected_returns)


@pytest.mark.parametrize("gamma, lam", [(0.99, 0.95), (0.9, 1.0), (0.5, 0.0)])
def test_gae_matches_stable_baselines3(gamma, lam):
    steps, num_envs = 24, 4
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(steps, num_envs, generator=generator, dtype=torch.float64)
    values = torch.randn(steps, num_envs, generator=generator, dtype=torch.float64)
    final_obs_values = torch.randn(steps, num_envs, generator=generator, dtype=torch.float64)
    after_rollout_values = torch.randn(num_envs, generator=generator, dtype=torch.float64)
    terminated = torch.rand(steps, num_envs, generator=generator) < 0.1
    truncated = torch.rand(steps, num_envs, generator=generator) < 0.1
    # Make sure every case is present: both kinds of ending mid-rollout, both at the last
    # step, and one step that is terminated and truncated at once.
    terminated[3, 0] = truncated[7, 1] = True
    terminated[-1, 2] = truncated[-1, 3] = True
    terminated[10, 0] = truncated[10, 0] = True
    ended = terminated | truncated

    # Our convention: next_values holds the value of the real next observation.
    next_values = torch.cat([values[1:], after_rollout_values[None]])
    next_values = torch.where(ended, final_obs_values, next_values)
    advantages, returns = gae(rewards, values, next_values, terminated, truncated, gamma, lam)

    # SB3's convention: a truncation is a "done" whose reward gets gamma * V(final_obs) added
    # (the TimeLimit.truncated fix in OnPolicyAlgorithm.collect_rollouts).
    time_limit = truncated & ~terminated
    sb3_rewards = rewards + gamma * final_obs_values * time_limit
    episode_starts = torch.zeros(steps, num_envs)
    episode_starts[0] = 1.0
    episode_starts[1:] = ended[:-1].double()

    box = spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
    buffer = RolloutBuffer(
        steps, box, box, device="cpu", gae_lambda=lam, gamma=gamma, n_envs=num_envs
    )
    for t in range(steps):
        buffer.add(
            obs=np.zeros((num_envs, 1), dtype=np.float32),
            action=np.zeros((num_envs, 1), dtype=np.float32),
            reward=sb3_rewards[t].numpy(),
            episode_start=episode_starts[t].numpy(),
            value=values[t],
            log_prob=torch.zeros(num_envs),
        )
    buffer.compute_returns_and_advantage(last_values=after_rollout_values, dones=ended[-1].numpy())

    torch.testing.assert_close(
        advantages, torch.from_numpy(buffer.advantages).double(), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        returns, torch.from_numpy(buffer.returns).double(), atol=1e-5, rtol=0
    )


# ---------------------------------------------------------------- masked_whiten


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_masked_whiten_by_hand(dtype):
    x = tensor([1.0, 2.0, 3.0, 100.0], dtype)
    mask = torch.tensor([1, 1, 1, 0])
    # mean over the mask = 2, unbiased variance = (1 + 0 + 1) / 2 = 1;
    # the padded 100 is mapped by the same affine map: (100 - 2) / 1 = 98.
    whitened = masked_whiten(x, mask)
    expected = tensor([-1.0, 0.0, 1.0, 98.0], dtype) / math.sqrt(1 + 1e-8)
    torch.testing.assert_close(whitened, expected)


def test_masked_whiten_ignores_inf_in_padding_and_needs_two_values():
    x = tensor([[1.0, 3.0, float("inf")]])
    mask = torch.tensor([[1, 1, 0]])
    torch.testing.assert_close(masked_whiten(x, mask)[:, :2], tensor([[-1.0, 1.0]]) / 2**0.5)
    with pytest.raises(ValueError, match="masked_whiten: mask has 1 valid position"):
        masked_whiten(x, torch.tensor([[1, 0, 0]]))
    with pytest.raises(ValueError, match=r"masked_whiten: x \[1, 3\] and mask \[3\]"):
        masked_whiten(x, torch.ones(3))


# ---------------------------------------------------------------- group_advantages


SCORES = [1.0, 2.0, 3.0, 4.0, 8.0, 7.0]
GROUPS = [0, 0, 0, 1, 1, 2]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_grpo_by_hand(dtype):
    scores = tensor(SCORES, dtype)
    # group 0: mean 2, std 1 -> (-1, 0, 1) / (1 + eps)
    # group 1: mean 6, std sqrt(((-2)^2 + 2^2) / 1) = sqrt(8) -> (-2, 2) / sqrt(8)
    # group 2 has one member: mean 0, std 1 -> 7 / (1 + eps)
    eps = 1e-6
    expected = tensor(
        [
            -1 / (1 + eps),
            0.0,
            1 / (1 + eps),
            -2 / (8**0.5 + eps),
            2 / (8**0.5 + eps),
            7 / (1 + eps),
        ],
        dtype,
    )
    got = group_advantages(scores, torch.tensor(GROUPS))
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected)


def test_dr_grpo_by_hand():
    got = group_advantages(tensor(SCORES), torch.tensor(GROUPS), normalize_std=False)
    torch.testing.assert_close(got, tensor([-1.0, 0.0, 1.0, -2.0, 2.0, 7.0]))


def test_rloo_by_hand():
    # group 0: 1 - (2+3)/2 = -1.5, 2 - (1+3)/2 = 0, 3 - (1+2)/2 = 1.5
    # group 1: 4 - 8 = -4, 8 - 4 = 4; group 2 alone keeps its score 7
    got = group_advantages(tensor(SCORES), torch.tensor(GROUPS), method="rloo")
    torch.testing.assert_close(got, tensor([-1.5, 0.0, 1.5, -4.0, 4.0, 7.0]))


def test_group_ids_can_be_any_labels_in_any_order():
    by_int = group_advantages(tensor(SCORES), torch.tensor(GROUPS))
    # Interleaved, non-contiguous integer ids and string uids give the same numbers.
    order = [3, 0, 5, 1, 4, 2]
    shuffled = group_advantages(tensor(SCORES)[order], torch.tensor([90, 7, 3, 7, 90, 7]))
    torch.testing.assert_close(shuffled, by_int[order])
    uids = ["a", "a", "a", "b", "b", "c"]
    torch.testing.assert_close(group_advantages(tensor(SCORES), uids), by_int)


def test_group_advantages_errors():
    with pytest.raises(ValueError, match=r"group_advantages: scores \[3\] and group_ids \[2\]"):
        group_advantages(torch.zeros(3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="unknown method 'ppo'"):
        group_advantages(torch.zeros(3), torch.tensor([0, 0, 1]), method="ppo")
    with pytest.raises(ValueError, match=r"scores must be 1-D \[B\]"):
        group_advantages(torch.zeros(3, 1), torch.tensor([0, 0, 1]))


@PROPERTY
@given(
    entries=st.lists(st.tuples(finite, st.integers(0, 4)), min_size=1, max_size=12),
    method=st.sampled_from(["grpo", "rloo"]),
    normalize_std=st.booleans(),
)
def test_group_advantages_match_per_group_loop(entries, method, normalize_std):
    scores = tensor([score for score, _ in entries])
    groups = torch.tensor([group for _, group in entries])
    got = group_advantages(scores, groups, method=method, normalize_std=normalize_std)
    for g in groups.unique():
        members = scores[groups == g]
        n = members.numel()
        if method == "rloo":
            expected = members if n == 1 else members - (members.sum() - members) / (n - 1)
        else:
            mean, std = (0.0, 1.0) if n == 1 else (members.mean(), members.std())
            expected = members - mean
            if normalize_std:
                expected = expected / (std + 1e-6)
        torch.testing.assert_close(got[groups == g], expected)


# ---------------------------------------------------------------- discounted_returns


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_discounted_returns_by_hand(dtype):
    rewards = tensor([[1.0, 2.0, 3.0, 7.0], [4.0, 0.0, 0.0, 0.0]], dtype)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # gamma 0.5, row 0: G2 = 3, G1 = 2 + 0.5*3 = 3.5, G0 = 1 + 0.5*3.5 = 2.75;
    # the 7 sits in the padding and must not leak back; padding returns 0.
    got = discounted_returns(rewards, mask, gamma=0.5)
    expected = tensor([[2.75, 3.5, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]], dtype)
    torch.testing.assert_close(got, expected)


def test_discounted_returns_shape_error():
    with pytest.raises(ValueError, match=r"discounted_returns: rewards \[2, 3\] and mask \[2, 4\]"):
        discounted_returns(torch.zeros(2, 3), torch.ones(2, 4), 1.0)


@PROPERTY
@given(data=st.data(), length=st.integers(1, 10), gamma=unit)
def test_discounted_returns_full_mask_is_reward_to_go(data, length, gamma):
    rewards = tensor(data.draw(st.lists(finite, min_size=length, max_size=length)))[None]
    got = discounted_returns(rewards, torch.ones_like(rewards), gamma)
    torch.testing.assert_close(got, reward_to_go(rewards, gamma))
