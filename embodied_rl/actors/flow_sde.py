"""Flow-SDE (pi_RL, 2025): one randomly chosen step of the chain is made stochastic by the
ODE-to-SDE conversion; the rest stay the deterministic ODE / DDIM steps.

Per chunk and env, a step j ~ Uniform{0..K-1} is drawn; step j is sampled from
`ft.step_mean_std(x_j, j, cond, policy.sde_noise_level(j, a))` (flow: the marginal-preserving SDE
step with pi_RL's schedule sigma_j = a sqrt((1 - t_j) / t_j), std sigma_j sqrt(dt); diffusion:
DDIM with eta = a), every other step is `ft.denoise_step`. Training recomputes that one
transition only: logprob is its Gaussian log-density over the executed chunk entries, summed
(`logprob_reduce="sum"`, pi_RL's chunk level: the clip bounds the chunk's log-ratio), averaged, or
one column per entry (actors/base.py, LOGPROB_REDUCE).
"""

from __future__ import annotations

import torch
from torch import Tensor

from embodied_rl.actors.base import ActorOutput, ChainActor, gaussian_entropy, gaussian_logprob
from embodied_rl.policies.base import Obs


class FlowSDEActor(ChainActor):
    kind = "flow_sde"

    def __init__(
        self,
        policy,
        num_envs: int = 1,
        noise_level: float = 0.5,
        min_std: float = 0.01,
        critic_hidden: int = 256,
        logprob_reduce: str = "sum",
    ):
        super().__init__(policy, critic_hidden, logprob_reduce)
        if noise_level <= 0 or min_std <= 0:
            raise ValueError(f"noise_level and min_std must be > 0, got {noise_level}, {min_std}")
        self._config = dict(noise_level=noise_level, min_std=min_std, critic_hidden=critic_hidden,
                            logprob_reduce=logprob_reduce)
        # the noise level of each grid step (the policy's schedule of the scale a)
        self.step_levels = [policy.sde_noise_level(i, noise_level) for i in range(policy.num_inference_steps)]
        # DDIM's last step has std 0 at any eta; a floor keeps that step's likelihood finite
        self.min_std = min_std

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False) -> ActorOutput:
        cond = self.encode(obs)
        n = len(cond)
        x = torch.randn((n, *self.policy.noise_shape), device=cond.device)
        chosen = torch.randint(self.num_steps, (n,), device=cond.device)
        x_before = x.clone()
        x_after = x.clone()
        for i in range(self.num_steps):
            if deterministic:
                x = self.ft.denoise_step(x, i, cond)
                continue
            here = (chosen == i)[:, None, None]
            # noise level a on the chosen envs, 0 (the plain ODE/DDIM step) elsewhere
            mean, std = self.ft.step_mean_std(x, i, cond, self.step_levels[i] * here.float())
            std = torch.where(here, std.clamp_min(self.min_std), torch.zeros_like(std))
            x_next = mean + std * torch.randn_like(mean)
            x_before = torch.where(here, x, x_before)
            x_after = torch.where(here, x_next, x_after)
            x = x_next
        stash = {"x_before": x_before, "x_after": x_after, "step": chosen}
        logprob, _ = self.evaluate(obs, stash)
        return ActorOutput(self.to_actions(x), logprob, self.get_value(self.latest_obs(obs)), stash)

    def _transition(self, cond: Tensor, stash: dict[str, Tensor]):
        """Mean and std of each row's chosen step (one network call per distinct step)."""
        x, step = stash["x_before"], stash["step"]
        mean = torch.zeros_like(x)
        std = torch.ones_like(x)
        for i in step.unique().tolist():
            rows = step == i
            m, s = self.ft.step_mean_std(x[rows], int(i), cond[rows], self.step_levels[int(i)])
            mean = mean.index_put((rows,), m)
            std = std.index_put((rows,), s.clamp_min(self.min_std))
        return mean, std

    def evaluate(self, obs: Obs, stash: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        mean, std = self._transition(self.encode(obs), stash)
        logprob = self.chunk_logprob(gaussian_logprob(stash["x_after"], mean, std))
        return logprob, self.chunk_logprob(gaussian_entropy(std))

    def base_kl(self, obs: Obs, stash: dict[str, Tensor]) -> Tensor:
        cond = self.encode(obs)
        mean, std = self._transition(cond, stash)
        with torch.no_grad():
            base_mean = torch.zeros_like(mean)
            step = stash["step"]
            for i in step.unique().tolist():
                rows = step == i
                m, _ = self.policy.step_mean_std(stash["x_before"][rows], int(i), cond[rows], self.step_levels[int(i)])
                base_mean[rows] = m
        return self.chunk_mean(0.5 * ((mean - base_mean) / std) ** 2)
