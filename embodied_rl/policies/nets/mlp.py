"""A residual MLP denoiser: the chunk is flattened, conditioning enters every block by FiLM."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_embedding(t: Tensor, dim: int) -> Tensor:
    """[N] -> [N, dim] sin/cos features over geometric frequencies (as in DDPM)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = t.float()[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class TimeEmbedding(nn.Module):
    """Embeds `num_times` scalars per sample (t, or t and a step size) into one vector."""

    def __init__(self, num_times: int, dim: int):
        super().__init__()
        self.dim = dim
        self.mlp = nn.Sequential(nn.Linear(num_times * dim, dim * 2), nn.SiLU(), nn.Linear(dim * 2, dim))

    def forward(self, times: Tensor) -> Tensor:  # [N, num_times]
        features = [sinusoidal_embedding(times[:, k], self.dim) for k in range(times.shape[1])]
        return self.mlp(torch.cat(features, dim=-1))


class ResidualBlock(nn.Module):
    def __init__(self, hidden_dim: int, cond_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden_dim)
        self.film = nn.Linear(cond_dim, 2 * hidden_dim)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_dim, hidden_dim * 2), nn.SiLU(), nn.Linear(hidden_dim * 2, hidden_dim)
        )

    def forward(self, h: Tensor, c: Tensor) -> Tensor:
        scale, shift = self.film(c).chunk(2, dim=-1)
        return h + self.mlp(self.norm(h) * (1 + scale) + shift)


class ResidualMLP(nn.Module):
    """(x [N, H, A], times [N, num_times], cond [N, C]) -> [N, H, A]."""

    def __init__(
        self,
        action_dim: int,
        horizon: int,
        cond_dim: int,
        num_times: int = 1,
        hidden_dim: int = 256,
        num_blocks: int = 3,
        time_dim: int = 64,
    ):
        super().__init__()
        self.time_embedding = TimeEmbedding(num_times, time_dim)
        self.cond_mlp = nn.Sequential(nn.Linear(time_dim + cond_dim, hidden_dim), nn.SiLU())
        self.input = nn.Linear(horizon * action_dim, hidden_dim)
        self.blocks = nn.ModuleList(ResidualBlock(hidden_dim, hidden_dim) for _ in range(num_blocks))
        self.out_norm = nn.LayerNorm(hidden_dim)
        self.output = nn.Linear(hidden_dim, horizon * action_dim)

    def forward(self, x: Tensor, times: Tensor, cond: Tensor) -> Tensor:
        c = self.cond_mlp(torch.cat([self.time_embedding(times), cond], dim=-1))
        h = self.input(x.flatten(1)) + c
        for block in self.blocks:
            h = block(h, c)
        return self.output(self.out_norm(h)).view_as(x)
