"""Flow matching (rectified flow) policy: a velocity field integrated with K Euler steps.

Convention: t=0 is noise, t=1 is data; x_t = (1 - t) x_0 + t x_1 with x_0 ~ N(0, I) and the
regression target v = x_1 - x_0. The grid is t_i = i / K, dt = 1 / K; step i is
x_{i+1} = x_i + dt * v(x_i, t_i). `step_mean_std(x, i, cond, sigma)` is the SDE step with the same
marginals as the ODE (Flow-SDE / Flow-GRPO):

    mean = x + dt * (v + sigma^2 / 2 * score),  score = -(x - t v) / (1 - t),  std = sigma sqrt(dt)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from embodied_rl.policies.base import ChunkPolicy

TIME_SAMPLING = ("uniform", "logit_normal")


class FlowPolicy(ChunkPolicy):
    policy_type = "flow"
    is_flow = True
    time_scale = 1000.0  # t in [0, 1] is scaled before its sinusoidal embedding

    def __init__(self, *args: Any, time_sampling: str = "logit_normal", **kwargs: Any):
        super().__init__(*args, **kwargs)
        if time_sampling not in TIME_SAMPLING:
            raise ValueError(f"unknown time_sampling '{time_sampling}' (choose from: {', '.join(TIME_SAMPLING)})")
        self.time_sampling = time_sampling
        self.config.update(time_sampling=time_sampling)

    @property
    def dt(self) -> float:
        return 1.0 / self.num_inference_steps

    def timesteps(self) -> Tensor:
        return torch.arange(self.num_inference_steps, dtype=torch.float32) / self.num_inference_steps

    def velocity(self, x: Tensor, t: Tensor | float, cond: Tensor) -> Tensor:
        times = self._expand_time(t, len(x), x.device)[:, None] * self.time_scale
        return self.net(x, times, cond)

    def _step_velocity(self, x: Tensor, i: int, cond: Tensor) -> Tensor:
        """The velocity used by grid step i (the shortcut model adds its step size)."""
        return self.velocity(x, float(self.timesteps()[i]), cond)

    def denoise_step(self, x: Tensor, i: int, cond: Tensor) -> Tensor:
        return x + self.dt * self._step_velocity(x, i, cond)

    def step_mean_std(
        self, x: Tensor, i: int, cond: Tensor, noise_level: float | Tensor = 0.5
    ) -> tuple[Tensor, Tensor]:
        """Mean and std of the marginal-preserving SDE version of Euler step i; noise_level is
        the diffusion coefficient sigma (a float or a tensor broadcastable to x)."""
        t = float(self.timesteps()[i])
        v = self._step_velocity(x, i, cond)
        sigma = torch.as_tensor(noise_level, dtype=x.dtype, device=x.device)
        score = -(x - t * v) / (1.0 - t)
        mean = x + self.dt * (v + 0.5 * sigma**2 * score)
        std = (sigma * self.dt**0.5).expand_as(mean)
        return mean, std

    def sde_noise_level(self, i: int, scale: float) -> float:
        """Flow-GRPO's and pi_RL's schedule, sigma_i = a sqrt((1 - t_i) / t_i) with t_0 = 0 read as
        the next grid point dt: large near the noise (std a at step 0), small near the data (the
        step that lands on the actions: 0.1 a at K = 10), so exploration stays on the flow's
        paths instead of jittering the final actions."""
        t = float(self.timesteps()[i])
        return scale * ((1.0 - t) / max(t, self.dt)) ** 0.5

    def sample_train_times(self, n: int, device: torch.device) -> Tensor:
        if self.time_sampling == "logit_normal":  # more weight on the middle of the path (SD3)
            return torch.sigmoid(torch.randn(n, device=device))
        return torch.rand(n, device=device)

    def bc_loss(self, batch: dict[str, Tensor]) -> Tensor:
        cond = self.encode_batch(batch)
        x1 = self.normalize_action(batch["action"])
        x0 = torch.randn_like(x1)
        t = self.sample_train_times(len(x1), x1.device)
        x_t = (1 - t[:, None, None]) * x0 + t[:, None, None] * x1
        return F.mse_loss(self.velocity(x_t, t, cond), x1 - x0)
