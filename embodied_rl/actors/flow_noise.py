"""Flow-Noise / ReinFlow (Zhang et al. 2025): a learned noise network turns the flow policy's K
Euler steps into a Markov chain of Gaussian transitions with a tractable likelihood.

    x_{i+1} = ft.denoise_step(x_i, i, cond) + sigma_i * z,
    log sigma_i = noise_net([x_i, t_i, cond]) squashed into [log min_std, log max_std]

The velocity network (a trainable copy) and the noise network are both trained.
Likelihood: each executed chunk entry's (Ta x A) log-density *averaged over the K transitions*
(pi_RL's joint log-prob), then aggregated over the entries by `logprob_reduce`: "sum" gives the
chunk one ratio (pi_RL's chunk level), "mean" is ReinFlow's own normalisation (the chain's
log-prob over K x Ta x A), "none" gives every entry its own ratio and clip (pi_RL's token level: a
far looser trust region over the chunk) (actors/base.py, LOGPROB_REDUCE). The
entropy bonus uses the same aggregation. Works with flow and shortcut policies at any K (1-4 is
the point: few steps are cheap) and with diffusion policies (their DDIM eta=0 step).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from embodied_rl.actors.base import ActorOutput, ChainActor, gaussian_entropy, gaussian_logprob, mlp
from embodied_rl.policies.base import Obs


class FlowNoiseActor(ChainActor):
    kind = "flow_noise"

    def __init__(
        self,
        policy,
        num_envs: int = 1,
        min_std: float = 0.08,
        max_std: float = 0.16,
        noise_hidden: int = 128,
        critic_hidden: int = 256,
        logprob_reduce: str = "sum",
    ):
        super().__init__(policy, critic_hidden, logprob_reduce)
        if not 0 < min_std <= max_std:
            raise ValueError(f"need 0 < min_std <= max_std, got {min_std}, {max_std}")
        self._config = dict(min_std=min_std, max_std=max_std, noise_hidden=noise_hidden,
                            critic_hidden=critic_hidden, logprob_reduce=logprob_reduce)
        self.log_min, self.log_max = math.log(min_std), math.log(max_std)
        chunk = policy.horizon * policy.action_dim
        self.noise_net = mlp(chunk + 1 + policy.cond_dim, chunk, noise_hidden, 2)
        self.times = policy.timesteps().float()

    def noise_std(self, x: Tensor, i: int, cond: Tensor) -> Tensor:
        t = torch.full((len(x), 1), float(self.times[i]), device=x.device)
        raw = self.noise_net(torch.cat([x.flatten(1), t, cond], dim=-1)).view_as(x)
        # tanh keeps the log-std inside [log min_std, log max_std] (ReinFlow's bounded noise)
        log_std = self.log_min + 0.5 * (torch.tanh(raw) + 1) * (self.log_max - self.log_min)
        return log_std.exp()

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False) -> ActorOutput:
        cond = self.encode(obs)
        x = torch.randn((len(cond), *self.policy.noise_shape), device=cond.device)
        chain = [x]
        for i in range(self.num_steps):
            mean = self.ft.denoise_step(x, i, cond)
            x = mean if deterministic else mean + self.noise_std(x, i, cond) * torch.randn_like(mean)
            chain.append(x)
        stash = {"chain": torch.stack(chain, dim=1)}  # [N, K + 1, H, A]
        logprob, _ = self.evaluate(obs, stash)
        return ActorOutput(self.to_actions(x), logprob, self.get_value(self.latest_obs(obs)), stash)

    def _transitions(self, cond: Tensor, chain: Tensor):
        for i in range(self.num_steps):
            yield i, self.ft.denoise_step(chain[:, i], i, cond), self.noise_std(chain[:, i], i, cond)

    def evaluate(self, obs: Obs, stash: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        cond = self.encode(obs)
        chain = stash["chain"]
        logprob = torch.zeros_like(chain[:, 0])  # [N, H, A]: per entry, averaged over the K transitions
        entropy = torch.zeros_like(chain[:, 0])
        for i, mean, std in self._transitions(cond, chain):
            logprob = logprob + gaussian_logprob(chain[:, i + 1], mean, std) / self.num_steps
            entropy = entropy + gaussian_entropy(std) / self.num_steps
        return self.chunk_logprob(logprob), self.chunk_logprob(entropy)

    def base_kl(self, obs: Obs, stash: dict[str, Tensor]) -> Tensor:
        cond = self.encode(obs)
        chain = stash["chain"]
        total = torch.zeros(len(chain), device=chain.device)
        for i, mean, std in self._transitions(cond, chain):
            with torch.no_grad():
                base_mean = self.policy.denoise_step(chain[:, i], i, cond)
            total = total + self.chunk_mean(0.5 * ((mean - base_mean) / std.detach()) ** 2)
        return total
