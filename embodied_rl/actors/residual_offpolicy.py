"""Residual off-policy actor (ResFiT): a small per-step correction on top of a frozen chunk policy.

    base action  b_t   the frozen BC policy executed open-loop chunk by chunk (BaseActionQueue)
    residual     r_t = scale * tanh(u),  u = MLP([obs, b_t])  (SAC: u ~ N(mu, sigma); TD3: u = mu)
    executed     a_t = clip(b_t + r_t, -1, 1)

The MLP's last layer starts at zero, so before any update the agent is exactly the base policy.
`ResidualAgent` is the evaluation agent (deterministic residual) and `load_agent` the loader
named in a residual_sac checkpoint's agent.json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from embodied_rl.actors.latent_noise import ObsHistory, read_agent_json, state_obs
from embodied_rl.errors import UserError

AGENT_KIND = "residual_sac"
LOADER = "embodied_rl.actors.residual_offpolicy:load_agent"
LOG_STD_MIN, LOG_STD_MAX = -5.0, 1.0


def mlp(input_dim: int, output_dim: int, hidden_sizes: list[int]) -> nn.Sequential:
    """Linear -> LayerNorm -> ReLU per hidden layer, then a plain Linear."""
    layers: list[nn.Module] = []
    last = input_dim
    for size in hidden_sizes:
        layers += [nn.Linear(last, size), nn.LayerNorm(size), nn.ReLU()]
        last = size
    layers.append(nn.Linear(last, output_dim))
    return nn.Sequential(*layers)


class BaseActionQueue:
    """The frozen base policy executed one action per step, per env: an obs history and a queue
    of n_action_steps actions; an env replans (alone) when its queue is empty. `reset(mask)`
    forgets both, so a queue never leaks into the next episode."""

    def __init__(self, policy: Any, num_envs: int, seed: int = 0):
        self.policy = policy
        self.num_envs = int(num_envs)
        self.n_action_steps = int(policy.n_action_steps)
        self.start = int(policy.n_obs_steps) - 1
        self.history = ObsHistory(int(policy.n_obs_steps))
        self.queue: Tensor | None = None
        self.index = torch.full((self.num_envs,), self.n_action_steps, dtype=torch.long)
        self.fresh = torch.ones(self.num_envs, dtype=torch.bool)
        self.generator = torch.Generator(device=_device(policy))
        self.generator.manual_seed(int(seed))
        self.sampler_calls = 0

    def reset(self, mask: Tensor | None = None) -> None:
        mask = torch.ones(self.num_envs, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool().cpu()
        self.index[mask] = self.n_action_steps
        self.fresh |= mask

    @torch.no_grad()
    def _plan(self, history: Tensor) -> Tensor:
        self.sampler_calls += 1
        device = _device(self.policy)
        chunk = self.policy.predict_chunk(history.to(device), generator=self.generator)
        return chunk[:, self.start : self.start + self.n_action_steps].float()

    def act(self, obs: Tensor) -> Tensor:
        """Push `obs` into the history and return the base action [N, A] (advancing the queue)."""
        if self.history.buffer is None:
            self.history.reset(obs)
        else:
            self.history.push(obs)
            self.history.reset(obs, self.fresh.to(obs.device))
        self.fresh[:] = False
        replan = self.index >= self.n_action_steps
        if bool(replan.any()):
            ids = torch.nonzero(replan).flatten()
            chunk = self._plan(self.history.get()[ids.to(obs.device)]).to(obs.device)
            if self.queue is None:
                self.queue = torch.zeros(self.num_envs, self.n_action_steps, chunk.shape[-1], device=obs.device)
            self.queue[ids.to(obs.device)] = chunk
            self.index[ids] = 0
        action = self.queue[torch.arange(self.num_envs, device=obs.device), self.index.to(obs.device)]
        self.index += 1
        return action

    def peek(self, obs: Tensor, mask: Tensor) -> Tensor:
        """The base action the envs in `mask` would take at `obs` (e.g. a truncated episode's
        final observation, to bootstrap from), without changing any state. Rows outside the mask
        are zero."""
        out = torch.zeros(self.num_envs, self.queue.shape[-1], device=obs.device)
        mask = mask.to(obs.device)
        if not bool(mask.any()):
            return out
        queued = (self.index < self.n_action_steps).to(obs.device)
        take = mask & queued
        if bool(take.any()):
            ids = torch.nonzero(take).flatten()
            out[ids] = self.queue[ids, self.index.to(obs.device)[ids]]
        plan = mask & ~queued
        if bool(plan.any()):
            ids = torch.nonzero(plan).flatten()
            history = torch.cat([self.history.buffer[ids, 1:], obs[ids].unsqueeze(1)], dim=1)
            out[ids] = self._plan(history)[:, 0].to(obs.device)
        return out


def _device(policy: Any) -> torch.device:
    device = getattr(policy, "device", None)
    if device is None:
        device = next(policy.parameters()).device
    return torch.device(device)


class ResidualActor(nn.Module):
    """r = scale * tanh(u), u from an MLP on [obs, base action]; zero-initialised last layer.

    stochastic=True (SAC): u ~ N(mu, exp(log_std)), `sample` returns (r, log_prob) with the tanh
    correction. stochastic=False (TD3): u = mu and `sample` returns (r, zeros).
    """

    def __init__(self, obs_dim: int, action_dim: int, hidden_sizes: list[int], scale: float,
                 stochastic: bool = True, init_std: float = 0.3):
        super().__init__()
        self.action_dim = action_dim
        self.scale = float(scale)
        self.stochastic = stochastic
        self.trunk = mlp(obs_dim + action_dim, 2 * action_dim if stochastic else action_dim, hidden_sizes)
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
        return self.scale * torch.tanh(mean)

    def sample(self, obs: Tensor, base: Tensor) -> tuple[Tensor, Tensor]:
        mean, log_std = self._head(obs, base)
        if log_std is None:
            return self.scale * torch.tanh(mean), torch.zeros(len(obs), device=obs.device)
        std = log_std.exp()
        u = mean + std * torch.randn_like(mean)
        log_prob = torch.distributions.Normal(mean, std).log_prob(u) - torch.log(1 - torch.tanh(u) ** 2 + 1e-6)
        return self.scale * torch.tanh(u), log_prob.sum(-1)


def actor_obs(policy: Any, obs: Tensor, normalize: bool) -> Tensor:
    """What the residual actor and the critics see: the observation normalised by the base policy's
    normaliser (fitted on the demos; min-max to [-1, 1] by default). Raw metre-scaled inputs bury
    the millimetre offsets that decide a peg insertion. `normalize=False`: the raw observation
    (checkpoints written before normalisation existed)."""
    return policy.normalizer.normalize("obs", obs.float()) if normalize else obs


class ResidualAgent:
    """Base policy + deterministic residual, per env step: `reset(mask)`, `act(obs) -> [N, A]`."""

    def __init__(self, actor: ResidualActor, policy: Any, num_envs: int, normalize_obs: bool = True):
        self.actor = actor
        self.policy, self.normalize_obs = policy, normalize_obs
        self.queue = BaseActionQueue(policy, num_envs)

    def reset(self, mask: Tensor) -> None:
        self.queue.reset(mask)

    @torch.no_grad()
    def act(self, obs: Any) -> Tensor:
        obs = state_obs(obs)
        base = self.queue.act(obs)
        device = next(self.actor.parameters()).device
        features = actor_obs(self.policy, obs.to(device), self.normalize_obs)
        residual = self.actor(features, base.to(device)).to(obs.device)
        return (base + residual).clamp(-1.0, 1.0)


def save_residual_actor(path: str | Path, actor: ResidualActor, critics: nn.Module, base_policy: Any,
                        config: dict[str, Any]) -> None:
    """agent.json + actor.safetensors (actor.* and critic.* tensors) + base_policy/."""
    from safetensors.torch import save_file

    from embodied_rl.policies import save_policy

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"actor.{k}": v.detach().cpu().contiguous() for k, v in actor.state_dict().items()}
    tensors.update({f"critic.{k}": v.detach().cpu().contiguous() for k, v in critics.state_dict().items()})
    save_file(tensors, str(path / "actor.safetensors"))
    save_policy(base_policy, path / "base_policy")
    (path / "agent.json").write_text(json.dumps({"loader": LOADER, "kind": AGENT_KIND, **config}, indent=2) + "\n")


def make_actor(config: dict[str, Any]) -> ResidualActor:
    return ResidualActor(config["obs_dim"], config["action_dim"], list(config["hidden_sizes"]),
                         config["residual_scale"], stochastic=config["actor"] == "sac")


def load_tensors(path: str | Path, prefix: str) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(Path(path) / "actor.safetensors"))
    except Exception as error:
        raise UserError(f"checkpoint '{path}': cannot read actor.safetensors ({error})") from None
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def load_agent(path: str | Path, num_envs: int, device: str | torch.device = "cpu") -> ResidualAgent:
    """The `agent.json` loader of residual_sac checkpoints (see docs/finetuning.md)."""
    from embodied_rl.policies import load_policy

    config = read_agent_json(path)
    actor = make_actor(config)
    try:
        actor.load_state_dict(load_tensors(path, "actor."))
    except RuntimeError as error:
        raise UserError(f"checkpoint '{path}': actor weights do not match agent.json ({error})") from None
    base_policy = load_policy(Path(path) / "base_policy", device=device).eval()
    return ResidualAgent(actor.to(device).eval(), base_policy, num_envs, bool(config.get("normalize_obs", False)))
