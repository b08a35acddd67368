"""Residual Gaussian actor (ResiP, Ankile et al. 2024): a small policy adds a correction to the
frozen base policy's action at every env step.

    base = PolicyRunner(policy).act(obs)                      # the base chunk policy, executed
    mean, std = head([policy.obs_features(obs), base])        # zero-initialised mean
    action = clamp(base + action_scale * (mean + std * z), -1, 1)

`action_scale` is one number or one per action dimension (e.g. a larger one for a gripper, so the
residual can overrule the base's open/close). The likelihood is that of the residual sample
r = mean + std * z (summed over action dims); the base action is stashed, so the base policy's own
sampling noise is part of the environment. The base policy's action queue is reset per env at
every episode end (`reset(mask)`), so no episode starts with the leftovers of the previous one.
`chunk_critic=True` replaces the critic on the observation with ChunkStateCritic (below), whose
state includes the base policy's queued chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from embodied_rl import core
from embodied_rl.actors.base import (
    Actor,
    ActorOutput,
    Critic,
    gaussian_draw_terms,
    mlp,
)
from embodied_rl.actors.gaussian import GaussianHead
from embodied_rl.errors import UserError
from embodied_rl.policies.base import Obs
from embodied_rl.policies.runner import first_tensor, index_obs


def residual_scale(action_scale: float | list[float], action_dim: int) -> Tensor:
    """The residual's scale per action dimension [A]: one number for all, or one per dimension."""
    scale = torch.as_tensor(action_scale, dtype=torch.float32).flatten()
    if scale.numel() == 1:
        scale = scale.expand(action_dim).clone()
    if scale.numel() != action_dim or not bool((scale > 0).all()):
        raise UserError(f"action_scale must be one positive number or {action_dim} of them (one per action dim), "
                        f"got {action_scale}")
    return scale


class ChunkStateCritic(nn.Module):
    """The residual MDP's critic when its state includes the base policy's queued chunk.

    The residual acts at every env step, but the base policy draws a new chunk only every H
    steps, and on push_t that draw decides most of the outcome (per-state success 0.1-0.9 under
    the BC policy's sampling noise). A critic on the observation alone cannot tell a lucky draw
    from a good correction: every advantage carries the draw's luck. This critic has two heads:

        V(o, q)  = chunk_net([features of o, queued base actions (current first, zero-padded),
                              one-hot position in the chunk])     # after the draw: the MDP state
        V0(o)    = net(features of o)                                # before the next draw: E_q V(o, q)

    The draw is a chance node between two MDP steps, so the TD error across it bootstraps from
    V0 (`next_value` where the queue is empty): r + gamma V0(o') - V(o, q) does not depend on
    which chunk comes next, and neither does any TD error inside a chunk (the simulator is
    deterministic; only the residual's own noise differs). V0 regresses on the returns of the
    states where a chunk was just drawn, whose expectation over the draw is E_q V(o, q).
    """

    def __init__(self, policy, hidden: int = 256, layers: int = 2):
        super().__init__()
        self._features = policy.obs_features  # a bound method of the frozen policy: not a submodule
        self.horizon = policy.n_action_steps
        self.net = mlp(policy.feature_dim, 1, hidden, layers)
        self.chunk_net = mlp(policy.feature_dim + self.horizon * (policy.action_dim + 1), 1, hidden, layers)

    def forward(self, obs: Obs) -> Tensor:
        return self.net(self._features(obs)).squeeze(-1)

    def with_chunk(self, obs: Obs, chunk_state: Tensor) -> Tensor:
        return self.chunk_net(torch.cat([self._features(obs), chunk_state], -1)).squeeze(-1)

    def drawn(self, chunk_state: Tensor) -> Tensor:
        """Whether each state is the first of its chunk (the one-hot position is 0) [N]."""
        return chunk_state[:, -self.horizon] > 0.5


def queued_chunk_state(queue: Tensor, position: Tensor) -> Tensor:
    """[N, H * A + H]: the actions queue[n, position[n]:] moved to the front (zero-padded), and a
    one-hot of position (< H) in the chunk."""
    horizon, action_dim = queue.shape[1:]
    steps = position[:, None] + torch.arange(horizon, device=queue.device)
    index = steps.clamp(max=horizon - 1)[..., None].expand(-1, -1, action_dim)
    ahead = queue.gather(1, index) * (steps < horizon)[..., None]
    return torch.cat([ahead.flatten(1), torch.nn.functional.one_hot(position, horizon).float()], -1)


class ResidualBase(Actor):
    """What the per-step and the chunk residual share: the residual, a Gaussian draw around the
    base action scaled by `action_scale` (`_head(obs, base) -> mean, std`), its likelihood summed
    over its entries (L = 1), and its KL to the base."""

    def _draw(self, obs: Obs, base: Tensor, deterministic: bool) -> tuple[Tensor, dict[str, Tensor]]:
        """(the actions, the stash) of a residual drawn on `base`: the mean when deterministic."""
        mean, std = self._head(obs, base)
        residual = mean if deterministic else mean + std * torch.randn_like(mean)
        actions = (base + self.action_scale * residual.view_as(base)).clamp(-1.0, 1.0)
        return actions, {"base_action": base, "residual": residual}

    def evaluate(self, obs: Obs, stash: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        mean, std = self._head(obs, stash["base_action"])
        return gaussian_draw_terms(stash["residual"], mean, std)

    def base_kl(self, obs: Obs, stash: dict[str, Tensor]) -> Tensor:
        """KL(N(mean, std) || N(0, std)): how far the residual mean pulls away from the base."""
        mean, std = self._head(obs, stash["base_action"])
        return 0.5 * ((mean / std) ** 2).sum(-1)


class ResidualActor(ResidualBase):
    kind = "residual"
    chunked = False

    def __init__(
        self,
        policy,
        num_envs: int,
        action_scale: float | list[float] = 0.1,
        init_std: float = 1.0,
        learn_std: bool = False,
        hidden: int = 256,
        layers: int = 2,
        critic_hidden: int = 256,
        chunk_critic: bool = True,
    ):
        super().__init__()
        from embodied_rl.policies import PolicyRunner

        self._config = dict(action_scale=action_scale, init_std=init_std, learn_std=learn_std,
                            hidden=hidden, layers=layers, critic_hidden=critic_hidden, chunk_critic=chunk_critic)
        self.policy = policy.eval().requires_grad_(False)
        self.runner = PolicyRunner(policy, num_envs)
        self.register_buffer("action_scale", residual_scale(action_scale, policy.action_dim), persistent=False)
        self.head = GaussianHead(policy.feature_dim + policy.action_dim, policy.action_dim, hidden, layers,
                                 init_std=init_std, learn_std=learn_std, zero_init=True)
        self.chunk_critic = bool(chunk_critic)
        self.critic = ChunkStateCritic(policy, critic_hidden) if self.chunk_critic else Critic(policy, critic_hidden)

    def _head(self, obs: Obs, base_action: Tensor) -> tuple[Tensor, Tensor]:
        return self.head(torch.cat([self.policy.obs_features(obs), base_action], dim=-1))

    def _chunk_state(self, position: Tensor, device: torch.device) -> Tensor:
        return queued_chunk_state(self.runner.queue, position.clamp(max=self.runner.queue.shape[1] - 1)).to(device)

    def next_value(self, next_obs: Obs) -> Tensor:
        if not self.chunk_critic:
            return self.get_value(next_obs)
        position = self.runner.next_index  # == H where the next step draws a chunk (or the env was reset)
        device = first_tensor(next_obs).device
        midchunk = (position < self.runner.queue.shape[1]).to(device)
        value = torch.empty(len(midchunk), device=device)
        value[~midchunk] = self.critic(index_obs(next_obs, ~midchunk))  # each head only where it applies
        value[midchunk] = self.critic.with_chunk(index_obs(next_obs, midchunk),
                                                 self._chunk_state(position, device)[midchunk])
        return value

    def value_loss(self, obs: Obs, stash: dict[str, Tensor], old_value: Tensor, returns: Tensor,
                   mask: Tensor, clip: float | None) -> Tensor:
        if not self.chunk_critic:
            return super().value_loss(obs, stash, old_value, returns, mask, clip)
        state = stash["chunk_state"]
        loss = core.value_loss(self.critic.with_chunk(obs, state), old_value, returns, mask, clip=clip)[0]
        drawn = mask.bool() & self.critic.drawn(state)
        if bool(drawn.any()):  # V0 on the returns of the states right after a draw
            loss = loss + 0.5 * core.agg_loss((self.critic(obs) - returns) ** 2, drawn, "token-mean")
        return loss

    def reset(self, mask: Tensor) -> None:
        self.runner.reset(mask)

    def runtime_state(self) -> dict[str, Tensor]:
        return self.runner.state_dict()  # the base policy's obs histories, queues and generator

    def load_runtime_state(self, state: dict[str, Tensor]) -> None:
        self.runner.load_state_dict(state)

    def for_eval(self, num_envs: int) -> ResidualActor:
        """A shallow copy sharing every module, with its own base-policy runner."""
        import copy

        from embodied_rl.policies import PolicyRunner

        clone = copy.copy(self)
        clone.runner = PolicyRunner(self.policy, num_envs)
        return clone

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False) -> ActorOutput:
        actions, stash = self._draw(obs, self.runner.act(obs).float(), deterministic)
        if self.chunk_critic:  # the base action just taken is queue[next_index - 1]
            stash["chunk_state"] = self._chunk_state(self.runner.next_index - 1, first_tensor(obs).device)
            value = self.critic.with_chunk(obs, stash["chunk_state"])
        else:
            value = self.get_value(obs)
        logprob, _ = self.evaluate(obs, stash)
        return ActorOutput(actions, logprob, value, stash)


class ResidualChunkActor(ResidualBase):
    """The residual at the chunk level: one MDP step is one executed chunk (envs.step_chunk).

        base = policy.predict_chunk(obs history)[executed]           # [N, Ta, A], frozen, sampled
        mean, std = head([policy.encode_obs(obs history), base])    # [N, Ta * A], zero-initialised mean
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
        self.hold_chunk_policy(policy)
        self.register_buffer("action_scale", residual_scale(action_scale, policy.action_dim), persistent=False)
        chunk = policy.n_action_steps * policy.action_dim
        self.head = GaussianHead(policy.cond_dim + chunk, chunk, hidden, layers,
                                 init_std=init_std, learn_std=learn_std, zero_init=True)
        self.critic = Critic(policy, critic_hidden)

    def _head(self, obs: Obs, base: Tensor) -> tuple[Tensor, Tensor]:
        return self.head(torch.cat([self.policy.encode_obs(obs), base.flatten(1)], dim=-1))

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False) -> ActorOutput:
        actions, stash = self._draw(obs, self.policy.predict_chunk(obs)[:, self.executed].float(), deterministic)
        logprob, _ = self.evaluate(obs, stash)
        return ActorOutput(actions, logprob, self.get_value(self.latest_obs(obs)), stash)
