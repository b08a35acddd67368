"""Shortcut model (Frans et al. 2024): a flow policy whose velocity also sees the step size d.

s(x, t, d) is trained on two targets in every batch:
- flow matching at d = 0 (the instantaneous velocity), on 1 - shortcut_fraction of the batch;
- self-consistency on shortcut_fraction (~1/4): s(x_t, t, 2d) = (s(x_t, t, d) + s(x', t + d, d)) / 2
  with x' = x_t + d s(x_t, t, d), the target under stop-gradient. 2d is drawn from
  {1, 1/2, ..., 2/max_steps} and t from the multiples of 2d; the finest d = 1/max_steps queries d = 0.
Sampling takes K Euler steps of size d = 1/K (K a power of two <= max_steps; default 4).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from embodied_rl.policies.flow import FlowPolicy


class ShortcutPolicy(FlowPolicy):
    policy_type = "shortcut"
    num_times = 2  # t and d

    def __init__(
        self,
        *args: Any,
        max_steps: int = 64,
        shortcut_fraction: float = 0.25,
        num_inference_steps: int = 4,
        time_sampling: str = "uniform",
        **kwargs: Any,
    ):
        if max_steps < 2 or max_steps & (max_steps - 1):
            raise ValueError(f"shortcut max_steps must be a power of two >= 2, got {max_steps}")
        if not 0.0 <= shortcut_fraction < 1.0:
            raise ValueError(f"shortcut_fraction must be in [0, 1), got {shortcut_fraction}")
        self.max_steps = max_steps
        super().__init__(*args, num_inference_steps=num_inference_steps, time_sampling=time_sampling, **kwargs)
        self.shortcut_fraction = shortcut_fraction
        self.config.update(max_steps=max_steps, shortcut_fraction=shortcut_fraction)
        self.set_num_inference_steps(self.num_inference_steps)  # validates K

    def set_num_inference_steps(self, steps: int) -> None:
        if steps < 1 or steps > self.max_steps or steps & (steps - 1):
            raise ValueError(f"shortcut num_inference_steps must be a power of two <= {self.max_steps}, got {steps}")
        super().set_num_inference_steps(steps)

    def velocity(self, x: Tensor, t: Tensor | float, cond: Tensor, d: Tensor | float | None = None) -> Tensor:
        """s(x, t, d); d defaults to the sampling step size 1/K."""
        n = len(x)
        t = self._expand_time(t, n, x.device)
        d = self._expand_time(self.dt if d is None else d, n, x.device)
        return self.net(x, torch.stack([t, d], dim=-1) * self.time_scale, cond)

    def _step_velocity(self, x: Tensor, i: int, cond: Tensor) -> Tensor:
        return self.velocity(x, float(self.timesteps()[i]), cond, self.dt)

    def bc_loss(self, batch: dict[str, Tensor]) -> Tensor:
        cond = self.encode_batch(batch)
        x1 = self.normalize_action(batch["action"])
        x0 = torch.randn_like(x1)
        n = len(x1)
        n_shortcut = int(round(n * self.shortcut_fraction))
        n_flow = n - n_shortcut
        device = x1.device

        # Flow-matching part: d = 0, target x1 - x0.
        t_flow = self.sample_train_times(n_flow, device)
        # Self-consistency part: big step 2d = 1 / 2^k, t on the multiples of 2d.
        levels = int(math.log2(self.max_steps))
        k = torch.randint(0, levels, (n_shortcut,), device=device)
        sections = (2**k).float()  # number of big steps that cover [0, 1]
        t_short = torch.floor(torch.rand(n_shortcut, device=device) * sections) / sections
        d_half = 0.5 / sections

        t = torch.cat([t_flow, t_short])
        x_t = (1 - t[:, None, None]) * x0 + t[:, None, None] * x1
        x_s, c_s = x_t[n_flow:], cond[n_flow:]
        with torch.no_grad():
            d_query = torch.where(d_half <= 1.0 / self.max_steps, torch.zeros_like(d_half), d_half)
            v1 = self.velocity(x_s, t_short, c_s, d_query)
            x_mid = x_s + d_half[:, None, None] * v1
            v2 = self.velocity(x_mid, t_short + d_half, c_s, d_query)
            shortcut_target = (v1 + v2) / 2
        d = torch.cat([torch.zeros(n_flow, device=device), 2 * d_half])
        target = torch.cat([(x1 - x0)[:n_flow], shortcut_target])
        return F.mse_loss(self.velocity(x_t, t, cond, d), target)
