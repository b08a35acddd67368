"""Diffusion policy: trained with DDPM, sampled with DDIM (eta=0).

The network predicts `prediction_type`: epsilon, v or x0 ("sample", the default, which the MLP
learns much better than epsilon: the epsilon loss is dominated by the nearly unlearnable
low-noise timesteps). `predict_noise` always returns epsilon, so every step formula below and the
RL actors work in epsilon whatever the network predicts. A checkpoint written before the option
existed predicted epsilon; `load_policy` says so for it.

Both schedulers come from diffusers and share one beta schedule (squaredcos_cap_v2, 100 train
steps). `timesteps()` is the DDIM grid of K integer timesteps, e.g. [90, 80, ..., 0] for K=10.
`step_mean_std(x, i, cond, eta)` is the DDIM step with eta (eta=1 on the full grid is the DDPM
posterior, which DPPO uses as a Gaussian transition); its mean at eta=0 is `denoise_step`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from embodied_rl.policies.base import ChunkPolicy

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


class DiffusionPolicy(ChunkPolicy):
    policy_type = "diffusion"

    def __init__(
        self,
        *args: Any,
        num_train_timesteps: int = 100,
        beta_schedule: str = "squaredcos_cap_v2",
        prediction_type: str = "sample",
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        if prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"unknown prediction_type '{prediction_type}' (choose from: {', '.join(PREDICTION_TYPES)})")
        self.prediction_type = prediction_type
        from diffusers import DDIMScheduler, DDPMScheduler

        schedule = dict(
            num_train_timesteps=num_train_timesteps, beta_schedule=beta_schedule,
            clip_sample=True, prediction_type="epsilon",
        )
        self.train_scheduler = DDPMScheduler(**schedule)
        self.scheduler = DDIMScheduler(**schedule, set_alpha_to_one=True, steps_offset=0)
        self.config.update(
            num_train_timesteps=num_train_timesteps, beta_schedule=beta_schedule,
            prediction_type=prediction_type,
        )
        self.set_num_inference_steps(self.num_inference_steps)

    def set_num_inference_steps(self, steps: int) -> None:
        if not 1 <= steps <= self.scheduler.config.num_train_timesteps:
            raise ValueError(f"num_inference_steps must be in [1, {self.scheduler.config.num_train_timesteps}]")
        super().set_num_inference_steps(steps)
        self.scheduler.set_timesteps(steps)

    def timesteps(self) -> Tensor:
        return self.scheduler.timesteps.clone()

    def _alpha(self, t: Tensor | float | int, x: Tensor) -> Tensor:
        """alpha_bar_t broadcast to x ([N, 1, 1] or a scalar)."""
        alphas = self.train_scheduler.alphas_cumprod.to(x)
        t = torch.as_tensor(t, device=alphas.device).long()
        return alphas[t].reshape(-1, 1, 1) if t.ndim else alphas[t]

    def predict_noise(self, x: Tensor, t: Tensor | float | int, cond: Tensor) -> Tensor:
        """epsilon(x_t, t, cond); t is a train timestep in [0, 100). The network predicts
        `prediction_type` (epsilon, v or x0); other targets are converted to epsilon here."""
        times = self._expand_time(t, len(x), x.device)[:, None]
        out = self.net(x, times, cond)
        if self.prediction_type == "epsilon":
            return out
        alpha = self._alpha(t, x)
        if self.prediction_type == "v_prediction":  # eps = sqrt(a) v + sqrt(1-a) x
            return alpha.sqrt() * out + (1 - alpha).sqrt() * x
        return (x - alpha.sqrt() * out) / (1 - alpha).sqrt()  # sample: out is x0

    def denoise_step(self, x: Tensor, i: int, cond: Tensor) -> Tensor:
        t = self.scheduler.timesteps[i]
        eps = self.predict_noise(x, t, cond)
        return self.scheduler.step(eps, t, x, eta=0.0).prev_sample

    def step_mean_std(
        self, x: Tensor, i: int, cond: Tensor, noise_level: float | Tensor = 1.0
    ) -> tuple[Tensor, Tensor]:
        """Mean and std of DDIM step i with eta=noise_level: x_next ~ N(mean, std^2)."""
        t = self.scheduler.timesteps[i]
        prev_t = t - self.scheduler.config.num_train_timesteps // self.num_inference_steps
        alphas = self.scheduler.alphas_cumprod
        alpha_t = alphas[t]
        alpha_prev = alphas[prev_t] if prev_t >= 0 else self.scheduler.final_alpha_cumprod
        variance = (1 - alpha_prev) / (1 - alpha_t) * (1 - alpha_t / alpha_prev)
        eta = torch.as_tensor(noise_level, dtype=x.dtype, device=x.device)
        std = eta * variance.to(x).sqrt()
        eps = self.predict_noise(x, t, cond)
        x0 = ((x - (1 - alpha_t).sqrt() * eps) / alpha_t.sqrt()).clamp(-1.0, 1.0)
        direction = (1 - alpha_prev - std**2).clamp_min(0).sqrt() * eps
        mean = alpha_prev.sqrt() * x0 + direction
        return mean, std.expand_as(mean)

    def bc_loss(self, batch: dict[str, Tensor]) -> Tensor:
        cond = self.encode_batch(batch)
        x0 = self.normalize_action(batch["action"])
        noise = torch.randn_like(x0)
        t = torch.randint(0, self.train_scheduler.config.num_train_timesteps, (len(x0),), device=x0.device)
        x_t = self.train_scheduler.add_noise(x0, noise, t)
        times = t.float()[:, None]
        target = {"epsilon": noise, "sample": x0,
                  "v_prediction": self.train_scheduler.get_velocity(x0, noise, t)}[self.prediction_type]
        return F.mse_loss(self.net(x_t, times, cond), target)
