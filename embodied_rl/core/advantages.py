"""Advantage estimators: GAE (token sequences and env rollouts), group baselines, returns.

Two layouts share these functions:
- token sequences, [B, L]: one row per response, right-padded; `mask` is 1 on valid positions.
- env rollouts, [T, N]: time-major; episodes end where `terminated` or `truncated` is set.

Semantics follow verl's `core_algos` (see docs/core.md). Estimators run under `torch.no_grad()`:
an advantage is a fixed target, never something to differentiate through.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def _shape(tensor: torch.Tensor) -> str:
    return str(list(tensor.shape))


def _check_same_shape(function: str, **tensors: torch.Tensor) -> None:
    """Raise a ValueError naming the first pair of tensors whose shapes differ."""
    (first_name, first), *others = tensors.items()
    for name, tensor in others:
        if tensor.shape != first.shape:
            raise ValueError(
                f"{function}: {first_name} {_shape(first)} and {name} {_shape(tensor)} "
                "must have the same shape"
            )


def _check_2d(function: str, name: str, tensor: torch.Tensor, layout: str) -> None:
    if tensor.dim() != 2:
        raise ValueError(f"{function}: {name} must be 2-D {layout}, got {_shape(tensor)}")


@torch.no_grad()
def masked_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over right-padded token sequences [B, L] (verl's `compute_gae_advantage_return`).

    The recursion walks each row from the last position to the first. A position whose mask
    is 0 is skipped: the next value and the running advantage carry over it unchanged, so a
    valid position bootstraps from the value of the next *valid* position (0 after the last
    one). That also skips observation tokens inside multi-turn responses.

    At a masked position the advantage is the carried running advantage (0 in the right
    padding). `returns = advantages + values` everywhere. No whitening: call `masked_whiten`
    if you want it.
    """
    _check_same_shape("masked_gae", rewards=rewards, values=values, mask=mask)
    _check_2d("masked_gae", "rewards", rewards, "[B, L]")
    valid = mask.bool()
    seq_len = rewards.shape[1]

    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    running_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(seq_len)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage_here = delta + gamma * lam * running_advantage
        # Only valid positions move the recursion forward; masked ones pass the state through.
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        running_advantage = torch.where(valid[:, t], advantage_here, running_advantage)
        advantages[:, t] = running_advantage

    returns = advantages + values
    return advantages, returns


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a time-major env rollout [T, N] with terminations and truncations.

    `next_values[t]` is the value of the real observation that followed step t: `values[t + 1]`
    inside an episode, the value of `info["final_obs"]` where the episode ended at t, and the
    value of the observation after the rollout at t = T - 1.

    - terminated[t]: the task ended, there is no future: delta = r - V.
    - truncated[t]: the time limit cut the episode: delta bootstraps from next_values[t], but
      the running advantage does not carry across the boundary (the next step belongs to a
      new episode).
    - both set: termination wins (no bootstrap).
    At t = T - 1 the bootstrap is next_values[T - 1] and there is nothing to carry.
    Returns `(advantages, returns)` with `returns = advantages + values`.
    """
    _check_same_shape(
        "gae",
        rewards=rewards,
        values=values,
        next_values=next_values,
        terminated=terminated,
        truncated=truncated,
    )
    _check_2d("gae", "rewards", rewards, "[T, N]")
    terminated = terminated.bool()
    episode_ended = terminated | truncated.bool()
    not_terminated = (~terminated).to(rewards.dtype)
    not_ended = (~episode_ended).to(rewards.dtype)

    # One-step TD errors for every step at once; only the lambda-sum needs the loop.
    deltas = rewards + gamma * next_values * not_terminated - values

    advantages = torch.zeros_like(rewards)
    running_advantage = rewards.new_zeros(rewards.shape[1])
    for t in reversed(range(rewards.shape[0])):
        running_advantage = deltas[t] + gamma * lam * not_ended[t] * running_advantage
        advantages[t] = running_advantage

    returns = advantages + values
    return advantages, returns


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`(x - mean) * rsqrt(var + eps)` with the mean and unbiased variance taken over the mask.

    Every position is transformed by the same affine map, masked ones included (multiply by
    the mask if you need zeros there). The mean is removed (verl's `shift_mean=True`).
    Needs at least two valid positions for the unbiased variance.
    """
    _check_same_shape("masked_whiten", x=x, mask=mask)
    valid = mask.bool()
    count = valid.sum()
    if count < 2:
        raise ValueError(
            f"masked_whiten: mask has {int(count)} valid position(s); the unbiased variance "
            "needs at least 2"
        )
    # torch.where (not x * mask) so that inf/NaN in padding cannot leak into the statistics.
    x_valid = torch.where(valid, x, torch.zeros_like(x))
    mean = x_valid.sum() / count
    squared_deviation = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x))
    variance = squared_deviation.sum() / (count - 1)
    return (x - mean) * torch.rsqrt(variance + eps)


def _group_index(
    group_ids: torch.Tensor | Sequence[Hashable], device: torch.device
) -> torch.Tensor:
    """Map arbitrary group ids to 0..G-1 (long tensor)."""
    if not isinstance(group_ids, torch.Tensor):
        # Hashable ids (e.g. verl's uid strings): number them in order of first appearance.
        numbering = {group_id: i for i, group_id in enumerate(dict.fromkeys(group_ids))}
        group_ids = torch.tensor([numbering[g] for g in group_ids], dtype=torch.long)
    _, index = torch.unique(group_ids.to(device), return_inverse=True)
    return index


@torch.no_grad()
def group_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable],
    method: str = "grpo",
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Outcome advantages [B] from one scalar score per sample and its group (prompt) id.

    - "grpo": (s - mean_g) / (std_g + eps), std unbiased; without the division when
      `normalize_std` is False (Dr.GRPO). A group of one has mean 0 and std 1 (verl), so its
      advantage is s / (1 + eps), or s without the division.
    - "rloo": s_i minus the mean of the other scores in its group; a group of one keeps s.
    Broadcast to tokens yourself: `advantages[:, None] * mask`.
    """
    if method not in ("grpo", "rloo"):
        raise ValueError(f"group_advantages: unknown method {method!r}; valid: 'grpo', 'rloo'")
    if scores.dim() != 1:
        raise ValueError(f"group_advantages: scores must be 1-D [B], got {_shape(scores)}")
    num_ids = group_ids.shape[0] if isinstance(group_ids, torch.Tensor) else len(group_ids)
    if num_ids != scores.shape[0] or (isinstance(group_ids, torch.Tensor) and group_ids.dim() != 1):
        ids_shape = _shape(group_ids) if isinstance(group_ids, torch.Tensor) else f"[{num_ids}]"
        raise ValueError(
            f"group_advantages: scores {_shape(scores)} and group_ids {ids_shape} "
            "must have the same shape"
        )
    if scores.numel() == 0:
        return scores.clone()

    group = _group_index(group_ids, scores.device)
    num_groups = int(group.max()) + 1
    per_group = scores.new_zeros(num_groups)
    group_size = per_group.index_add(0, group, torch.ones_like(scores))[group]
    group_sum = per_group.index_add(0, group, scores)[group]
    alone = group_size == 1

    if method == "rloo":
        mean_of_others = (group_sum - scores) / (group_size - 1).clamp(min=1)
        return torch.where(alone, scores, scores - mean_of_others)

    group_mean = group_sum / group_size
    squared_deviation = per_group.index_add(0, group, (scores - group_mean) ** 2)[group]
    group_std = (squared_deviation / (group_size - 1).clamp(min=1)).sqrt()
    # verl's convention for a group of one: mean 0, std 1.
    group_mean = torch.where(alone, torch.zeros_like(group_mean), group_mean)
    group_std = torch.where(alone, torch.ones_like(group_std), group_std)
    advantages = scores - group_mean
    if normalize_std:
        advantages = advantages / (group_std + eps)
    return advantages


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go `G_t = r_t + gamma * G_{t+1}` per right-padded row [B, L] (REINFORCE++).

    The running return is reset at every masked position (verl multiplies it by the mask), so
    it restarts after each row's last valid position and rewards in the padding never reach a
    valid position. Masked positions get a return of 0.
    """
    _check_same_shape("discounted_returns", rewards=rewards, mask=mask)
    _check_2d("discounted_returns", "rewards", rewards, "[B, L]")
    valid = mask.bool()

    returns = torch.zeros_like(rewards)
    running_return = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running_return = rewards[:, t] + gamma * running_return
        running_return = torch.where(valid[:, t], running_return, torch.zeros_like(running_return))
        returns[:, t] = running_return
    return returns
