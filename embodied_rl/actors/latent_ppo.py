"""Latent-noise Gaussian actor for PPO (DSRL's idea, trained on-policy): the policy chooses the
initial noise w of the frozen BC sampler, and the deterministic sampler turns it into the chunk.

    mean = noise_bound * tanh(head(normalised obs history))   # zero-initialised: mean 0
    w = mean + std * z                                          # [H, A]; std learned, starts at 1
    chunk = policy.predict_chunk(obs, noise=w)[executed]        # deterministic given w (DDIM / ODE)

At initialisation w ~ N(0, I), exactly the BC policy's own sampling, so fine-tuning starts at the
BC policy. The steering acts where BC policies are weakest: which of its modes, and which of the
sampler's outcomes, it picks in a given state. One MDP step is one executed chunk.
logprob: Gaussian log-density of w, summed over the H x A entries; L = 1.

Acting is always stochastic (w sampled): a BC chunk policy's quality rests on its sampling noise
(on push_t the zero-noise policy succeeds far less often than the sampled one), so the mean noise
is no deterministic stand-in for it. `deterministic=True` therefore also samples w.
"""

from __future__ import annotations

import torch
from torch import Tensor

from embodied_rl.actors.base import Actor, ActorOutput, Critic, gaussian_draw_terms
from embodied_rl.actors.gaussian import GaussianHead
from embodied_rl.policies.base import Obs


class LatentNoiseActor(Actor):
    kind = "latent_noise"
    chunked = True

    def __init__(
        self,
        policy,
        num_envs: int = 1,
        noise_bound: float = 2.5,
        init_std: float = 1.0,
        learn_std: bool = True,
        hidden: int = 256,
        layers: int = 2,
        critic_hidden: int = 256,
    ):
        super().__init__()
        self._config = dict(noise_bound=noise_bound, init_std=init_std, learn_std=learn_std,
                            hidden=hidden, layers=layers, critic_hidden=critic_hidden)
        self.hold_chunk_policy(policy)
        self.noise_bound = noise_bound
        noise_dim = policy.horizon * policy.action_dim
        self.head = GaussianHead(policy.cond_dim, noise_dim, hidden, layers,
                                 init_std=init_std, learn_std=learn_std, zero_init=True)
        self.critic = Critic(policy, critic_hidden)

    def _head(self, obs: Obs) -> tuple[Tensor, Tensor]:
        mean, std = self.head(self.policy.encode_obs(obs))
        return self.noise_bound * torch.tanh(mean / self.noise_bound), std

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False) -> ActorOutput:
        mean, std = self._head(obs)
        noise = mean + std * torch.randn_like(mean)
        chunk = self.policy.predict_chunk(obs, noise=noise.view(len(noise), *self.policy.noise_shape))
        stash = {"noise": noise}
        logprob, _ = self.evaluate(obs, stash)
        return ActorOutput(chunk[:, self.executed].clamp(-1.0, 1.0), logprob,
                           self.get_value(self.latest_obs(obs)), stash)

    def evaluate(self, obs: Obs, stash: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        mean, std = self._head(obs)
        return gaussian_draw_terms(stash["noise"], mean, std)

    def base_kl(self, obs: Obs, stash: dict[str, Tensor]) -> Tensor:
        """KL(N(mean, std) || N(0, I)): how far the noise policy is from the BC sampler's prior."""
        mean, std = self._head(obs)
        return (0.5 * (std**2 + mean**2 - 1) - std.log()).sum(-1)
