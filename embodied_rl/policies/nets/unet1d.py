"""A small temporal U-Net over the action chunk with FiLM conditioning (diffusion_policy style)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from embodied_rl.policies.nets.mlp import TimeEmbedding


class ConvBlock(nn.Sequential):
    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, n_groups: int):
        super().__init__(
            nn.Conv1d(in_ch, out_ch, kernel_size, padding=kernel_size // 2),
            nn.GroupNorm(n_groups, out_ch),
            nn.Mish(),
        )


class FiLMResidualBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, cond_dim: int, kernel_size: int, n_groups: int):
        super().__init__()
        self.block1 = ConvBlock(in_ch, out_ch, kernel_size, n_groups)
        self.block2 = ConvBlock(out_ch, out_ch, kernel_size, n_groups)
        self.film = nn.Sequential(nn.Mish(), nn.Linear(cond_dim, 2 * out_ch))
        self.skip = nn.Conv1d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        scale, shift = self.film(c).unsqueeze(-1).chunk(2, dim=1)
        h = self.block1(x) * (1 + scale) + shift
        return self.block2(h) + self.skip(x)


class ConditionalUnet1D(nn.Module):
    """(x [N, H, A], times [N, num_times], cond [N, C]) -> [N, H, A].

    H must be divisible by 2 ** (len(down_dims) - 1).
    """

    def __init__(
        self,
        action_dim: int,
        horizon: int,
        cond_dim: int,
        num_times: int = 1,
        down_dims: tuple[int, ...] | list[int] = (64, 128, 256),
        kernel_size: int = 5,
        n_groups: int = 8,
        time_dim: int = 64,
    ):
        super().__init__()
        down_dims = list(down_dims)
        if horizon % (2 ** (len(down_dims) - 1)) != 0:
            raise ValueError(f"unet: horizon {horizon} not divisible by 2**{len(down_dims) - 1}")
        self.time_embedding = TimeEmbedding(num_times, time_dim)
        c_dim = time_dim + cond_dim
        dims = [action_dim] + down_dims
        self.down = nn.ModuleList()
        for level, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            last = level == len(down_dims) - 1
            self.down.append(nn.ModuleList([
                FiLMResidualBlock(d_in, d_out, c_dim, kernel_size, n_groups),
                FiLMResidualBlock(d_out, d_out, c_dim, kernel_size, n_groups),
                nn.Conv1d(d_out, d_out, 3, stride=2, padding=1) if not last else nn.Identity(),
            ]))
        mid = down_dims[-1]
        self.mid = nn.ModuleList([
            FiLMResidualBlock(mid, mid, c_dim, kernel_size, n_groups),
            FiLMResidualBlock(mid, mid, c_dim, kernel_size, n_groups),
        ])
        self.up = nn.ModuleList()
        reversed_dims = down_dims[::-1]
        for d_in, d_out in zip(reversed_dims[:-1], reversed_dims[1:]):
            self.up.append(nn.ModuleList([
                FiLMResidualBlock(d_in * 2, d_out, c_dim, kernel_size, n_groups),
                FiLMResidualBlock(d_out, d_out, c_dim, kernel_size, n_groups),
                nn.ConvTranspose1d(d_out, d_out, 4, stride=2, padding=1),
            ]))
        self.final = nn.Sequential(
            ConvBlock(down_dims[0], down_dims[0], kernel_size, n_groups),
            nn.Conv1d(down_dims[0], action_dim, 1),
        )

    def forward(self, x: Tensor, times: Tensor, cond: Tensor) -> Tensor:
        c = torch.cat([self.time_embedding(times), cond], dim=-1)
        h = x.transpose(1, 2)  # [N, A, H]
        skips = []
        for block1, block2, downsample in self.down:
            h = block2(block1(h, c), c)
            skips.append(h)
            h = downsample(h)
        for block in self.mid:
            h = block(h, c)
        for block1, block2, upsample in self.up:
            h = torch.cat([h, skips.pop()], dim=1)
            h = upsample(block2(block1(h, c), c))
        return self.final(h).transpose(1, 2)
