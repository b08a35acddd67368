"""A diagonal Gaussian head: the trainable part of per-step actors (residual PPO/SAC)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from embodied_rl.actors.base import mlp


class GaussianHead(nn.Module):
    """x [N, in_dim] -> (mean [N, A], std [N, A]).

    `zero_init` zeroes the last layer, so the mean starts at exactly 0 (a residual that starts as
    the base policy). The std is state-independent: learned (`learn_std`) or fixed at
    `init_std`.
    """

    def __init__(
        self,
        in_dim: int,
        action_dim: int,
        hidden: int = 256,
        layers: int = 2,
        init_std: float = 0.1,
        learn_std: bool = True,
        zero_init: bool = True,
        min_std: float = 1e-3,
    ):
        super().__init__()
        self.mean_net = mlp(in_dim, action_dim, hidden, layers)
        if zero_init:
            nn.init.zeros_(self.mean_net[-1].weight)
            nn.init.zeros_(self.mean_net[-1].bias)
        self.log_std = nn.Parameter(torch.full((action_dim,), math.log(init_std)), requires_grad=learn_std)
        self.min_std = min_std

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        mean = self.mean_net(x)
        std = self.log_std.exp().clamp_min(self.min_std).expand_as(mean)
        return mean, std
