"""The Actor contract: what RL trains, wrapped around a (frozen) ChunkPolicy.

    out = actor.act(obs, deterministic=False)   # out.actions, out.logprob, out.value, out.stash
    logprob, entropy = actor.evaluate(obs, out.stash)   # recomputes the likelihood of the sample

- A *per-step* actor (`chunked = False`, the residual actor) takes obs [N, D] and returns
  actions [N, A]: one MDP step is one env step.
- A *chunk* actor (`chunked = True`: DPPO, Flow-Noise/ReinFlow, Flow-SDE) takes the obs history
  [N, n_obs_steps, D] and returns the executed part of a chunk [N, n_action_steps, A]: one MDP
  step is one chunk (rewards summed over the executed steps, envs.step_chunk).
- `logprob` and `entropy` are [N, L]: L likelihood positions per MDP step (1 for most actors,
  the number of fine-tuned denoising steps for DPPO). PPO clips each column with
  `clip_coefs(clip)[l]` and weights its advantage by `advantage_weights[l]`.
- `stash` is a dict of tensors with leading N: everything `evaluate` needs (the sampled chain,
  the chosen step, the base action), so `evaluate(obs, act(obs).stash)` gives back exactly
  `act`'s logprob: the importance ratio is 1 before the first update.
- Observations are what the env returns: a Tensor [N, D], or a dict of [N, ...] entries
  ("state", "pixels", "instruction"); chunk actors take their history, [N, n_obs_steps, ...].
  Heads and critics read the frozen base policy's features (`policy.obs_features` per step,
  `policy.encode_obs` per history), never the raw state, so they work for every observation type.
- The critic (`get_value(obs) -> [N]`) sees the latest env observation. `out.value` is the
  value of the MDP state `act` acted in, `next_value(next_obs)` that of the state that follows
  (before the actor acts on it), and `value_loss(...)` regresses the critic on the returns; by
  default all three are `get_value` on the env observation. The residual actor's
  `chunk_critic` overrides them: its MDP state includes the base policy's queued chunk.
- `base_kl(obs, stash) -> [N]`: a regulariser toward the base policy (0 when the actor equals it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from embodied_rl import core
from embodied_rl.errors import UserError
from embodied_rl.policies.base import Obs
from embodied_rl.policies.runner import ChunkExecutor, ObsHistory, first_tensor, map_obs


@dataclass
class ActorOutput:
    actions: Tensor  # [N, A] (per-step actor) or [N, n_action_steps, A] (chunk actor), in [-1, 1]
    logprob: Tensor  # [N, L]
    value: Tensor  # [N]
    stash: dict[str, Tensor] = field(default_factory=dict)


def mlp(in_dim: int, out_dim: int, hidden: int = 256, layers: int = 2, act=nn.Tanh) -> nn.Sequential:
    dims = [in_dim] + [hidden] * layers
    modules: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        modules += [nn.Linear(a, b), act()]
    modules.append(nn.Linear(dims[-1], out_dim))
    return nn.Sequential(*modules)


def layer_norm_mlp(input_dim: int, output_dim: int, hidden_sizes: list[int], act=nn.ReLU) -> nn.Sequential:
    """Linear -> LayerNorm -> act per hidden layer, then a plain Linear to output_dim (none when
    output_dim <= 0: a trunk). The off-policy actors and critics use it."""
    modules: list[nn.Module] = []
    last = input_dim
    for size in hidden_sizes:
        modules += [nn.Linear(last, size), nn.LayerNorm(size), act()]
        last = size
    if output_dim > 0:
        modules.append(nn.Linear(last, output_dim))
    return nn.Sequential(*modules)


class Critic(nn.Module):
    """V(obs) on the base policy's features of the env observation (`policy.obs_features`:
    normalised state, image features, instruction embedding), so it fits every policy."""

    def __init__(self, policy: nn.Module, hidden: int = 256, layers: int = 2):
        super().__init__()
        self._features = policy.obs_features  # a bound method of the frozen policy: not a submodule
        self.net = mlp(policy.feature_dim, 1, hidden, layers)

    def forward(self, obs: Obs) -> Tensor:
        return self.net(self._features(obs)).squeeze(-1)


def head_input(policy: Any, obs: Obs, features: bool = True) -> Tensor:
    """What an off-policy head reads: the base policy's features of the observation
    (`policy.obs_features`), or with `features=False` the raw state, for checkpoints written
    before features existed (state observations only)."""
    if features:
        return policy.obs_features(obs)
    if isinstance(obs, dict):
        raise UserError("this checkpoint's heads read the raw state: they support state observations only")
    return obs.float()


def gaussian_logprob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Elementwise log N(x; mean, std^2)."""
    var = std**2
    return -((x - mean) ** 2) / (2 * var) - std.log() - 0.5 * torch.log(torch.tensor(2 * torch.pi))


def gaussian_entropy(std: Tensor) -> Tensor:
    """Elementwise entropy of N(., std^2)."""
    return 0.5 + 0.5 * torch.log(torch.tensor(2 * torch.pi)) + std.log()


def gaussian_draw_terms(sample: Tensor, mean: Tensor, std: Tensor) -> tuple[Tensor, Tensor]:
    """(logprob [N, 1], entropy [N, 1]) of one diagonal Gaussian draw [N, D], summed over its D
    entries: the likelihood of an actor that draws its whole action at once (L = 1)."""
    return gaussian_logprob(sample, mean, std).sum(-1, keepdim=True), gaussian_entropy(std).sum(-1, keepdim=True)


class Actor(nn.Module):
    """Base class; see the module docstring for the contract."""

    kind: str = ""
    chunked: bool = False
    n_obs_steps: int = 1
    n_action_steps: int = 1
    num_logprob_positions: int = 1

    def act(self, obs: Obs, deterministic: bool = False) -> ActorOutput:
        raise NotImplementedError

    def evaluate(self, obs: Obs, stash: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def get_value(self, obs: Obs) -> Tensor:
        return self.critic(obs)

    def next_value(self, next_obs: Obs) -> Tensor:
        """V of the state reached, before the actor acts on it (GAE's bootstrap) [N]."""
        return self.get_value(next_obs)

    def value_loss(self, obs: Obs, stash: dict[str, Tensor], old_value: Tensor, returns: Tensor,
                   mask: Tensor, clip: float | None) -> Tensor:
        """The critic's regression on the returns of the states the rollout acted in."""
        return core.value_loss(self.get_value(self.latest_obs(obs)), old_value, returns, mask, clip=clip)[0]

    def latest_obs(self, obs: Obs) -> Obs:
        """The env observation (one step per env) inside what `act` takes."""
        return map_obs(lambda o: o[:, -1], obs) if self.chunked else obs

    def reset(self, mask: Tensor) -> None:
        """Forget per-env state where mask is set (the residual actor's base-policy queue)."""

    def runtime_state(self) -> dict[str, Tensor]:
        """Per-env state that is not a weight (the residual actor's base-policy queue), as
        tensors: a checkpoint saves it so a resumed run continues exactly."""
        return {}

    def load_runtime_state(self, state: dict[str, Tensor]) -> None:
        """Restore what `runtime_state` returned."""

    def hold_chunk_policy(self, policy: nn.Module) -> None:
        """A chunk actor's base: `policy`, frozen, whose obs history and executed chunk steps
        (indices n_obs_steps - 1 ... n_obs_steps - 1 + n_action_steps, as PolicyRunner executes
        them) are this actor's."""
        self.policy = policy.eval().requires_grad_(False)
        self.n_obs_steps = policy.n_obs_steps
        self.n_action_steps = policy.n_action_steps
        self.executed = slice(policy.n_obs_steps - 1, policy.n_obs_steps - 1 + policy.n_action_steps)

    def for_eval(self, num_envs: int) -> Actor:
        """This actor for an eval env of `num_envs` copies (same weights, own per-env state)."""
        return self

    def base_kl(self, obs: Obs, stash: dict[str, Tensor]) -> Tensor:
        reference = first_tensor(obs)
        return torch.zeros(reference.shape[0], device=reference.device)

    def clip_coefs(self, clip: float) -> list[float]:
        return [clip] * self.num_logprob_positions

    def advantage_weights(self) -> Tensor:
        return torch.ones(self.num_logprob_positions)

    def actor_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.named_parameters() if p.requires_grad and not name.startswith("critic.")]

    def critic_parameters(self) -> list[nn.Parameter]:
        return list(self.critic.parameters())

    def config(self) -> dict[str, Any]:
        """Constructor keyword arguments (JSON) written to agent.json."""
        return dict(self._config)

    def weights(self) -> dict[str, Tensor]:
        """Every tensor of the actor but the frozen base policy's: what a checkpoint saves."""
        return {key: value for key, value in self.state_dict().items() if not key.startswith("policy.")}

    def save(self, directory: Path) -> None:
        """Write the agent checkpoint (actors/checkpoint.py): agent.json, agent.safetensors, base_policy/."""
        from embodied_rl.actors.checkpoint import save_agent

        save_agent(directory, self.kind, self.config(), self.weights(), self.policy)


class HistoryEnv:
    """Wraps a BatchedEnv so that `envs.step_chunk` feeds every per-step observation into an
    ObsHistory (auto-reset rows and envs reset again at the chunk's end restart their history)."""

    def __init__(self, env: Any, history: ObsHistory):
        self.env = env
        self.history = history
        self.num_envs = env.num_envs
        self.device = env.device
        self.action_dim = env.action_dim

    def step(self, action: Tensor):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.history.push(obs, terminated | truncated)
        return obs, reward, terminated, truncated, info

    def reset(self, seed=None, env_ids=None, group_size=None):
        obs, info = self.env.reset(seed=seed, env_ids=env_ids, group_size=group_size)
        if env_ids is None:
            self.history.reset(obs)
        else:
            device = first_tensor(obs).device
            mask = torch.zeros(self.num_envs, dtype=torch.bool, device=device)
            mask[torch.as_tensor(env_ids, device=device)] = True
            self.history.reset(obs, mask)
        return obs, info


class ActorAgent(ChunkExecutor):
    """An Actor as an evaluation agent (`reset(mask)` / `act(obs) -> [N, A]`), deterministic by
    default. A chunk actor's chunks run through the ChunkExecutor (obs history, action queue per
    env); a per-step actor acts on every observation (the residual actor runs its base policy's
    chunks itself)."""

    def __init__(self, actor: Actor, num_envs: int, deterministic: bool = True):
        super().__init__(num_envs, actor.n_obs_steps, actor.n_action_steps, actor.policy.action_dim)
        self.actor = actor
        self.deterministic = deterministic

    def reset(self, mask: Tensor | None = None) -> None:
        if mask is None:
            mask = torch.ones(self.num_envs, dtype=torch.bool)
        mask = torch.as_tensor(mask, dtype=torch.bool).cpu()
        super().reset(mask)
        self.actor.reset(mask)

    @torch.no_grad()
    def act(self, obs: Obs) -> Tensor:
        if not self.actor.chunked:
            return self.actor.act(obs, deterministic=self.deterministic).actions
        return super().act(obs)

    def plan(self, history: Tensor, envs: Tensor) -> Tensor:
        # the actor samples for the whole batch, as in training; rows with queued actions are dropped
        chunk = self.actor.act(history, deterministic=self.deterministic).actions
        return chunk[envs.to(chunk.device)]


# How a chain actor aggregates log-densities over the executed chunk entries (Ta x A), which sets
# what PPO's clip bounds: "mean", the average entry's log-ratio (ReinFlow's scale); "sum", the whole
# chunk's log-ratio (pi_RL's chunk-level log-prob: Flow-SDE, Flow-Noise); "none", every entry its own
# ratio and clip, the loss averaged over entries (pi_RL's token-level log-prob).
LOGPROB_REDUCE = ("mean", "sum", "none")


class ChainActor(Actor):
    """Shared by the actors that make the policy's own denoising / integration chain stochastic
    (DPPO, Flow-Noise, Flow-SDE). Holds the frozen base policy and a trainable copy `ft` whose
    network (`ft.net`) RL updates; the obs encoder and normaliser stay frozen. The chain runs in
    the normalised action space; only the executed part of the chunk (`executed`) enters the
    likelihood and the env.
    """

    chunked = True

    def __init__(self, policy, critic_hidden: int = 256, logprob_reduce: str = "mean"):
        super().__init__()
        import copy

        if logprob_reduce not in LOGPROB_REDUCE:
            raise ValueError(f"logprob_reduce must be one of {', '.join(LOGPROB_REDUCE)}, got {logprob_reduce!r}")
        self.logprob_reduce = logprob_reduce

        self.hold_chunk_policy(policy)
        self.ft = copy.deepcopy(self.policy)
        self.ft.net.requires_grad_(True)
        self.num_steps = policy.num_inference_steps
        if logprob_reduce == "none":  # one likelihood column per executed entry
            self.num_logprob_positions = policy.n_action_steps * policy.action_dim
        self.critic = Critic(policy, critic_hidden)

    @torch.no_grad()
    def encode(self, obs: Obs) -> Tensor:
        return self.policy.encode_obs(obs)

    def to_actions(self, x: Tensor) -> Tensor:
        """Normalised chunk [N, H, A] -> executed env actions [N, n_action_steps, A]."""
        return self.policy.unnormalize_action(x)[:, self.executed].clamp(-1.0, 1.0)

    def chunk_mean(self, values: Tensor) -> Tensor:
        """Mean over the executed chunk entries: [N, H, A] -> [N]."""
        return values[:, self.executed].flatten(1).mean(-1)

    def chunk_logprob(self, values: Tensor) -> Tensor:
        """Log-densities (or entropies) of the executed chunk entries as likelihood columns,
        reduced by `logprob_reduce`: [N, H, A] -> [N, 1] (mean, sum) or [N, Ta * A] (none)."""
        executed = values[:, self.executed].flatten(1)
        if self.logprob_reduce == "none":
            return executed
        return (executed.sum(-1) if self.logprob_reduce == "sum" else executed.mean(-1))[:, None]

    def actor_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.named_parameters()
                if p.requires_grad and not name.startswith(("critic.", "policy."))]
