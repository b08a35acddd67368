"""DPPO (Ren et al. 2024): the diffusion policy's denoising steps as Gaussian transitions.

Step i of the policy's own grid is DDIM with eta (`policy.step_mean_std(x, i, cond, eta)`; eta=1
is the DDPM posterior). Only the last `ft_denoising_steps` = K' steps use the trainable copy and
enter the likelihood; the first K - K' run the frozen base (sampled too, part of the env).

- Two std floors: transitions are *sampled* with std >= min_sampling_std (exploration) and their
  likelihood is computed with std >= min_logprob_std (a stable ratio); both act and evaluate use
  the likelihood floor, so the ratio starts at exactly 1.
- logprob [N, K']: one column per fine-tuned denoising step, the Gaussian log-density averaged
  over the executed chunk entries (H_exec x A). PPO treats each (env step, denoising step) as a
  sample: column k's advantage is weighted by denoising_discount ** (K' - 1 - k) and clipped with
  `clip_coefs(clip)[k]`, which rises from clip_base (earliest step) to clip (the last step).
  With K' = 1 the schedule is just [clip] (no 0/0: DPPO's NaN clip coefficient).
Works with any ChunkPolicy whose step_mean_std takes a noise level (diffusion; flow: the SDE).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from embodied_rl.actors.base import ActorOutput, ChainActor, gaussian_entropy, gaussian_logprob
from embodied_rl.policies.base import Obs


class DPPOActor(ChainActor):
    kind = "dppo"

    def __init__(
        self,
        policy,
        num_envs: int = 1,
        ft_denoising_steps: int = 0,
        eta: float = 0.3,
        min_sampling_std: float = 0.05,
        min_logprob_std: float = 0.05,
        denoising_discount: float = 0.99,
        clip_base: float = 0.001,
        clip_rate: float = 3.0,
        critic_hidden: int = 256,
    ):
        super().__init__(policy, critic_hidden)
        k = policy.num_inference_steps
        ft_steps = k if ft_denoising_steps <= 0 else int(ft_denoising_steps)
        if not 1 <= ft_steps <= k:
            raise ValueError(f"ft_denoising_steps must be in [1, {k}] (or 0 = all), got {ft_denoising_steps}")
        self._config = dict(ft_denoising_steps=ft_steps, eta=eta, min_sampling_std=min_sampling_std,
                            min_logprob_std=min_logprob_std, denoising_discount=denoising_discount,
                            clip_base=clip_base, clip_rate=clip_rate, critic_hidden=critic_hidden)
        self.ft_steps = ft_steps
        self.first_ft = k - ft_steps
        self.eta = eta
        self.min_sampling_std = min_sampling_std
        self.min_logprob_std = min_logprob_std
        self.denoising_discount = denoising_discount
        self.clip_base = clip_base
        self.clip_rate = clip_rate
        self.num_logprob_positions = ft_steps

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False) -> ActorOutput:
        cond = self.encode(obs)
        x = torch.randn((len(cond), *self.policy.noise_shape), device=cond.device)
        chain = []
        for i in range(self.num_steps):
            model = self.ft if i >= self.first_ft else self.policy
            if i >= self.first_ft:
                chain.append(x)
            if deterministic:
                x = model.denoise_step(x, i, cond)
                continue
            mean, std = model.step_mean_std(x, i, cond, self.eta)
            x = mean + std.clamp_min(self.min_sampling_std) * torch.randn_like(mean)
        chain.append(x)
        stash = {"chain": torch.stack(chain, dim=1)}  # [N, K' + 1, H, A]
        logprob, _ = self.evaluate(obs, stash)
        return ActorOutput(self.to_actions(x), logprob, self.get_value(self.latest_obs(obs)), stash)

    def _transition(self, model, cond: Tensor, chain: Tensor, k: int) -> tuple[Tensor, Tensor]:
        mean, std = model.step_mean_std(chain[:, k], self.first_ft + k, cond, self.eta)
        return mean, std.clamp_min(self.min_logprob_std)

    def evaluate(self, obs: Obs, stash: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        cond = self.encode(obs)
        chain = stash["chain"]
        logprobs, entropies = [], []
        for k in range(self.ft_steps):
            mean, std = self._transition(self.ft, cond, chain, k)
            logprobs.append(self.chunk_mean(gaussian_logprob(chain[:, k + 1], mean, std)))
            entropies.append(self.chunk_mean(gaussian_entropy(std)))
        return torch.stack(logprobs, dim=1), torch.stack(entropies, dim=1)

    def base_kl(self, obs: Obs, stash: dict[str, Tensor]) -> Tensor:
        """KL between the fine-tuned and the base transitions at the stashed chain states."""
        cond = self.encode(obs)
        chain = stash["chain"]
        total = torch.zeros(len(chain), device=chain.device)
        for k in range(self.ft_steps):
            mean, std = self._transition(self.ft, cond, chain, k)
            with torch.no_grad():
                base_mean, _ = self._transition(self.policy, cond, chain, k)
            total = total + self.chunk_mean(0.5 * ((mean - base_mean) / std) ** 2)
        return total / self.ft_steps

    def clip_coefs(self, clip: float) -> list[float]:
        """Exponential ramp from clip_base (earliest fine-tuned step) to clip (the last)."""
        if self.ft_steps == 1:
            return [clip]
        coefs = []
        for k in range(self.ft_steps):
            fraction = k / (self.ft_steps - 1)
            ramp = (math.exp(self.clip_rate * fraction) - 1) / (math.exp(self.clip_rate) - 1)
            coefs.append(self.clip_base + (clip - self.clip_base) * ramp)
        return coefs

    def advantage_weights(self) -> Tensor:
        exponents = torch.arange(self.ft_steps - 1, -1, -1, dtype=torch.float32)
        return self.denoising_discount**exponents
