"""Residual off-policy actor (ResFiT): a small per-step correction on top of a frozen chunk policy.

    base action  b_t   the frozen BC policy executed open-loop chunk by chunk (a PolicyRunner)
    residual     r_t = scale * tanh(u),  u = MLP([f(o_t), b_t])  (SAC: u ~ N(mu, sigma); TD3: u = mu)
                 f = the base policy's features of the observation (actors.base.head_input)
    executed     a_t = clip(b_t + r_t, -1, 1)

The MLP's last layer starts at zero, so before any update the agent is exactly the base policy.
`ResidualPolicyNet` is the trained network, `ResidualAgent` the evaluation agent (deterministic
residual) and `build_residual_agent` makes it from a "residual_offpolicy" checkpoint
(actors/checkpoint.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from embodied_rl.actors.base import head_input, layer_norm_mlp
from embodied_rl.actors.checkpoint import AgentCheckpoint, with_prefix
from embodied_rl.policies.base import Obs
from embodied_rl.policies.runner import PolicyRunner, first_tensor, map_obs

AGENT_KIND = "residual_offpolicy"
LOG_STD_MIN, LOG_STD_MAX = -5.0, 1.0


class ResidualPolicyNet(nn.Module):
    """r = scale * tanh(u) * dims, u from an MLP on [obs, base action]; zero-initialised last layer.

    stochastic=True (SAC): u ~ N(mu, exp(log_std)), `sample` returns (r, log_prob) with the tanh
    correction. stochastic=False (TD3): u = mu and `sample` returns (r, zeros).
    `dims` (1 or 0 per action dim; default all 1) switches the residual off on the dims it may not
    move: those the demonstrations hold constant (algos/residual_offpolicy.py `residual_dims`).
    """

    def __init__(self, obs_dim: int, action_dim: int, hidden_sizes: list[int], scale: float,
                 stochastic: bool = True, init_std: float = 0.3, dims: list[float] | None = None):
        super().__init__()
        self.action_dim = action_dim
        self.scale = float(scale)
        self.stochastic = stochastic
        dims = [1.0] * action_dim if dims is None else [float(d) for d in dims]
        if len(dims) != action_dim:
            raise ValueError(f"residual_dims has {len(dims)} entries for {action_dim} action dims")
        # not in the state dict: agent.json carries it (checkpoints without it move every dim)
        self.register_buffer("dims", torch.tensor(dims), persistent=False)
        self.trunk = layer_norm_mlp(obs_dim + action_dim, 2 * action_dim if stochastic else action_dim, hidden_sizes)
        last = self.trunk[-1]
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        if stochastic:
            with torch.no_grad():
                last.bias[action_dim:] = math.log(init_std)

    def _head(self, obs: Tensor, base: Tensor) -> tuple[Tensor, Tensor | None]:
        out = self.trunk(torch.cat([obs, base], dim=-1))
        if not self.stochastic:
            return out, None
        mean, log_std = out.split(self.action_dim, dim=-1)
        return mean, log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)

    def forward(self, obs: Tensor, base: Tensor) -> Tensor:
        """The deterministic residual (evaluation)."""
        mean, _ = self._head(obs, base)
        return self.scale * torch.tanh(mean) * self.dims

    def sample(self, obs: Tensor, base: Tensor) -> tuple[Tensor, Tensor]:
        mean, log_std = self._head(obs, base)
        if log_std is None:
            return self.scale * torch.tanh(mean) * self.dims, torch.zeros(len(obs), device=obs.device)
        std = log_std.exp()
        u = mean + std * torch.randn_like(mean)
        log_prob = torch.distributions.Normal(mean, std).log_prob(u) - torch.log(1 - torch.tanh(u) ** 2 + 1e-6)
        return self.scale * torch.tanh(u) * self.dims, (log_prob * self.dims).sum(-1)  # a switched-off dim has no entropy


class ResidualAgent:
    """Base policy + deterministic residual, per env step: `reset(mask)`, `act(obs) -> [N, A]`."""

    def __init__(self, net: ResidualPolicyNet, policy: Any, num_envs: int, normalize_obs: bool = True):
        self.net = net
        self.policy, self.normalize_obs = policy, normalize_obs
        self.base = PolicyRunner(policy, num_envs, seed=0)

    def reset(self, mask: Tensor) -> None:
        self.base.reset(mask)

    @torch.no_grad()
    def act(self, obs: Obs) -> Tensor:
        base = self.base.act(obs)
        device = next(self.net.parameters()).device
        features = head_input(self.policy, map_obs(lambda o: o.to(device), obs), self.normalize_obs)
        residual = self.net(features, base.to(device)).to(first_tensor(obs).device)
        return (base + residual).clamp(-1.0, 1.0)


def make_residual_net(config: dict[str, Any]) -> ResidualPolicyNet:
    """The network a residual_offpolicy checkpoint's config describes ("learner": sac | td3;
    checkpoints written before the key was renamed call it "actor")."""
    learner = config["learner"] if "learner" in config else config["actor"]
    return ResidualPolicyNet(config["obs_dim"], config["action_dim"], list(config["hidden_sizes"]),
                             config["residual_scale"], stochastic=learner == "sac", dims=config.get("residual_dims"))


def residual_tensors(net: ResidualPolicyNet, critic: nn.Module) -> dict[str, Tensor]:
    """What a residual_offpolicy checkpoint holds: actor.* (the network) and critic.* (the Q ensemble)."""
    return {**{f"actor.{k}": v for k, v in net.state_dict().items()},
            **{f"critic.{k}": v for k, v in critic.state_dict().items()}}


def build_residual_agent(checkpoint: AgentCheckpoint, num_envs: int) -> ResidualAgent:
    """The evaluation agent of a residual_offpolicy checkpoint (residual SAC or TD3)."""
    config = checkpoint.config
    net = make_residual_net(config)
    net.load_state_dict(with_prefix("actor.", checkpoint.tensors))
    net = net.to(checkpoint.base_policy.device).eval()
    # checkpoints written before observation normalisation existed have no normalize_obs
    return ResidualAgent(net, checkpoint.base_policy, num_envs, bool(config.get("normalize_obs", False)))
