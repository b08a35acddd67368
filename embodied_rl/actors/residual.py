"""Residual Gaussian actor (ResiP, Ankile et al. 2024): a small policy adds a correction to the
frozen base policy's action at every env step.

    base = PolicyRunner(policy).act(obs)                      # the base chunk policy, executed
    mean, std = head([normalised obs, base])                  # zero-initialised mean
    action = clamp(base + action_scale * (mean + std * z), -1, 1)

The likelihood is that of the residual sample r = mean + std * z (summed over action dims); the
base action is stashed, so the base policy's own sampling noise is part of the environment. The
base policy's action queue is reset per env at every episode end (`reset(mask)`), so no episode
starts with the leftovers of the previous one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from embodied_rl.actors.base import Actor, ActorOutput, Critic, gaussian_entropy, gaussian_logprob
from embodied_rl.actors.gaussian import GaussianHead


class ResidualActor(Actor):
    kind = "residual"
    chunked = False

    def __init__(
        self,
        policy,
        num_envs: int,
        action_scale: float = 0.1,
        init_std: float = 1.0,
        learn_std: bool = True,
        hidden: int = 256,
        layers: int = 2,
        critic_hidden: int = 256,
    ):
        super().__init__()
        from embodied_rl.policies import PolicyRunner

        self._config = dict(action_scale=action_scale, init_std=init_std, learn_std=learn_std,
                            hidden=hidden, layers=layers, critic_hidden=critic_hidden)
        self.policy = policy.eval().requires_grad_(False)
        self.runner = PolicyRunner(policy, num_envs)
        self.action_scale = action_scale
        self.head = GaussianHead(policy.obs_dim + policy.action_dim, policy.action_dim, hidden, layers,
                                 init_std=init_std, learn_std=learn_std, zero_init=True)
        self.critic = Critic(policy, critic_hidden)

    def _head(self, obs: Tensor, base_action: Tensor) -> tuple[Tensor, Tensor]:
        obs_norm = self.policy.normalizer.normalize("obs", obs.float())
        return self.head(torch.cat([obs_norm, base_action], dim=-1))

    def reset(self, mask: Tensor) -> None:
        self.runner.reset(mask)

    def for_eval(self, num_envs: int) -> ResidualActor:
        """A shallow copy sharing every module, with its own base-policy runner."""
        import copy

        from embodied_rl.policies import PolicyRunner

        clone = copy.copy(self)
        clone.runner = PolicyRunner(self.policy, num_envs)
        return clone

    @torch.no_grad()
    def act(self, obs: Tensor, deterministic: bool = False) -> ActorOutput:
        base_action = self.runner.act(obs).float()
        mean, std = self._head(obs, base_action)
        residual = mean if deterministic else mean + std * torch.randn_like(mean)
        actions = (base_action + self.action_scale * residual).clamp(-1.0, 1.0)
        stash = {"base_action": base_action, "residual": residual}
        logprob, _ = self.evaluate(obs, stash)
        return ActorOutput(actions, logprob, self.get_value(obs), stash)

    def evaluate(self, obs: Tensor, stash: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        mean, std = self._head(obs, stash["base_action"])
        logprob = gaussian_logprob(stash["residual"], mean, std).sum(-1, keepdim=True)
        entropy = gaussian_entropy(std).sum(-1, keepdim=True)
        return logprob, entropy

    def base_kl(self, obs: Tensor, stash: dict[str, Tensor]) -> Tensor:
        """KL(N(mean, std) || N(0, std)): how far the residual mean pulls away from the base."""
        mean, std = self._head(obs, stash["base_action"])
        return 0.5 * ((mean / std) ** 2).sum(-1)
