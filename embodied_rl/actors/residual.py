"""Residual Gaussian actor (ResiP, Ankile et al. 2024): a small policy adds a correction to the
frozen base policy's action at every env step.

    base = PolicyRunner(policy).act(obs)                      # the base chunk policy, executed
    mean, std = head([normalised obs, base])                  # zero-initialised mean
    action = clamp(base + action_scale * (mean + std * z), -1, 1)

`action_scale` is one number or one per action dimension (e.g. a larger one for a gripper, so the
residual can overrule the base's open/close). The likelihood is that of the residual sample
r = mean + std * z (summed over action dims); the base action is stashed, so the base policy's own
sampling noise is part of the environment. The base policy's action queue is reset per env at
every episode end (`reset(mask)`), so no episode starts with the leftovers of the previous one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from embodied_rl.actors.base import Actor, ActorOutput, Critic, gaussian_entropy, gaussian_logprob
from embodied_rl.actors.gaussian import GaussianHead
from embodied_rl.errors import UserError


def residual_scale(action_scale: float | list[float], action_dim: int) -> Tensor:
    """The residual's scale per action dimension [A]: one number for all, or one per dimension."""
    scale = torch.as_tensor(action_scale, dtype=torch.float32).flatten()
    if scale.numel() == 1:
        scale = scale.expand(action_dim).clone()
    if scale.numel() != action_dim or not bool((scale > 0).all()):
        raise UserError(f"action_scale must be one positive number or {action_dim} of them (one per action dim), "
                        f"got {action_scale}")
    return scale


class ResidualActor(Actor):
    kind = "residual"
    chunked = False

    def __init__(
        self,
        policy,
        num_envs: int,
        action_scale: float | list[float] = 0.1,
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
        self.register_buffer("action_scale", residual_scale(action_scale, policy.action_dim), persistent=False)
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


class ResidualChunkActor(Actor):
    """The residual at the chunk level: one MDP step is one executed chunk (envs.step_chunk).

        base = policy.predict_chunk(obs history)[executed]           # [N, Ta, A], frozen, sampled
        mean, std = head([normalised obs history, base])             # [N, Ta * A], zero-initialised mean
        actions = clamp(base + action_scale * (mean + std * z), -1, 1)

    Why: a per-step residual with white noise at 10 Hz needs many samples before the effect of
    one step's noise on a sparse outcome shows; deciding once per chunk gives Ta times fewer,
    larger decisions (as DPPO/ReinFlow do) with the same small, zero-initialised correction.
    logprob: the Gaussian log-density summed over the chunk entries; L = 1.
    """

    kind = "residual_chunk"
    chunked = True

    def __init__(
        self,
        policy,
        num_envs: int = 1,
        action_scale: float | list[float] = 0.1,
        init_std: float = 1.0,
        learn_std: bool = True,
        hidden: int = 256,
        layers: int = 2,
        critic_hidden: int = 256,
    ):
        super().__init__()
        self._config = dict(action_scale=action_scale, init_std=init_std, learn_std=learn_std,
                            hidden=hidden, layers=layers, critic_hidden=critic_hidden)
        self.policy = policy.eval().requires_grad_(False)
        if policy.obs_mode != "state":
            raise ValueError("residual_chunk supports state observations only")
        self.n_obs_steps = policy.n_obs_steps
        self.n_action_steps = policy.n_action_steps
        self.executed = slice(policy.n_obs_steps - 1, policy.n_obs_steps - 1 + policy.n_action_steps)
        self.register_buffer("action_scale", residual_scale(action_scale, policy.action_dim), persistent=False)
        chunk = policy.n_action_steps * policy.action_dim
        self.head = GaussianHead(policy.n_obs_steps * policy.obs_dim + chunk, chunk, hidden, layers,
                                 init_std=init_std, learn_std=learn_std, zero_init=True)
        self.critic = Critic(policy, critic_hidden)

    def _head(self, obs: Tensor, base: Tensor) -> tuple[Tensor, Tensor]:
        obs_norm = self.policy.normalizer.normalize("obs", obs.float()).flatten(1)
        return self.head(torch.cat([obs_norm, base.flatten(1)], dim=-1))

    @torch.no_grad()
    def act(self, obs: Tensor, deterministic: bool = False) -> ActorOutput:
        base = self.policy.predict_chunk(obs)[:, self.executed].float()
        mean, std = self._head(obs, base)
        residual = mean if deterministic else mean + std * torch.randn_like(mean)
        actions = (base + self.action_scale * residual.view_as(base)).clamp(-1.0, 1.0)
        stash = {"base_action": base, "residual": residual}
        logprob, _ = self.evaluate(obs, stash)
        return ActorOutput(actions, logprob, self.get_value(self.latest_obs(obs)), stash)

    def evaluate(self, obs: Tensor, stash: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        mean, std = self._head(obs, stash["base_action"])
        logprob = gaussian_logprob(stash["residual"], mean, std).sum(-1, keepdim=True)
        entropy = gaussian_entropy(std).sum(-1, keepdim=True)
        return logprob, entropy

    def base_kl(self, obs: Tensor, stash: dict[str, Tensor]) -> Tensor:
        mean, std = self._head(obs, stash["base_action"])
        return 0.5 * ((mean / std) ** 2).sum(-1)
