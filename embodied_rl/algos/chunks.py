"""What the chunk-level off-policy methods (QC-FQL, SAC Flow) share: one MDP step is the base
policy's executed chunk (n_action_steps env steps, envs.step_chunk).

- `ChunkCritic`: an ensemble of LayerNorm MLPs Q(cond, executed chunk) on the frozen policy's
  conditioning (its encoding of the obs history).
- `ChunkReplay`: chunk transitions (cond, executed chunk in the normalised action space, summed
  reward, discount, next cond); `demo_chunk_transitions` makes them from a demo dataset.
- `ChunkRollout`: runs chunks in the env and returns their transitions. A chunk's reward is the
  sum of its steps' rewards; its discount is gamma ** steps (the steps that counted), 0 where the
  episode terminated inside the chunk, and with the success reward also at a time limit (no
  bootstrap); a dense reward bootstraps a truncated chunk from a history of the final observation
  repeated (the steps before it belong to the finished episode's chunk).
Demo transitions start at every step t of an episode whose next h actions are in the episode (a
successful episode's last chunks end at its terminal step, padded with its last action).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from embodied_rl.actors.base import HistoryEnv, layer_norm_mlp
from embodied_rl.algos.common import RewardSettings, env_snapshot, training_reward
from embodied_rl.algos.sac import dataset_obs
from embodied_rl.envs.api import step_chunk
from embodied_rl.errors import UserError
from embodied_rl.policies.runner import ObsHistory, executed_actions, map_obs


class ChunkCritic(nn.Module):
    """E LayerNorm critics Q(cond, executed chunk) -> [E, B]."""

    def __init__(self, cond_dim: int, chunk_dim: int, hidden_sizes: list[int], ensemble: int):
        super().__init__()
        self.critics = nn.ModuleList(layer_norm_mlp(cond_dim + chunk_dim, 1, hidden_sizes) for _ in range(ensemble))

    def forward(self, cond: Tensor, chunk: Tensor) -> Tensor:
        x = torch.cat([cond, chunk.flatten(1)], dim=-1)
        return torch.stack([q(x).squeeze(-1) for q in self.critics])


FIELDS = ("cond", "chunk", "reward", "discount", "next_cond")


class ChunkReplay:
    """A circular buffer of chunk transitions (cond, executed chunk, reward, discount, next cond)."""

    def __init__(self, capacity: int, cond_dim: int, chunk_shape: tuple[int, int], device: torch.device):
        shapes = {"cond": (cond_dim,), "chunk": chunk_shape, "reward": (), "discount": (), "next_cond": (cond_dim,)}
        self.data = {k: torch.zeros((int(capacity), *s), device=device) for k, s in shapes.items()}
        self.capacity, self.size, self.pos = int(capacity), 0, 0

    def add(self, batch: dict[str, Tensor]) -> None:
        idx = (self.pos + torch.arange(len(batch["cond"]))) % self.capacity
        for key in FIELDS:
            self.data[key][idx.to(self.data[key].device)] = batch[key].to(self.data[key])
        self.pos = (self.pos + len(idx)) % self.capacity
        self.size = min(self.size + len(idx), self.capacity)

    def sample(self, n: int, generator: torch.Generator) -> dict[str, Tensor]:
        idx = torch.randint(0, self.size, (n,), generator=generator)
        return {k: v[idx.to(v.device)] for k, v in self.data.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"data": {k: v[: self.size].cpu() for k, v in self.data.items()},
                "pos": torch.tensor(self.pos), "size": torch.tensor(self.size)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        size = int(state["size"])
        if size > self.capacity:
            raise UserError(f"the saved replay buffer holds {size} transitions, more than algo.buffer_size={self.capacity}")
        for key, value in state["data"].items():
            self.data[key][:size] = value.to(self.data[key])
        self.pos, self.size = int(state["pos"]) % self.capacity, size


def normalised_q(q: Tensor) -> Tensor:
    """Q in units of the batch's mean |Q| (FQL's normalize_q_loss), so that the weights of an
    actor's other terms mean the same whatever the reward scale; the scale carries no gradient."""
    return q / q.abs().mean().detach().clamp(min=1e-6)


@torch.no_grad()
def demo_chunk_transitions(dataset: Any, policy: Any, gamma: float, success_terminates: bool, sparse: bool,
                           device: torch.device) -> dict[str, Tensor]:
    """Chunk transitions of a demo dataset (see the module docstring), with the chunk in the
    policy's normalised action space and the obs histories encoded by the frozen policy."""
    obs_all = dataset_obs(dataset, policy)
    actions = torch.as_tensor(np.asarray(dataset.action), dtype=torch.float32)
    rewards = torch.as_tensor(np.asarray(dataset.reward), dtype=torch.float32)
    successes = np.asarray(dataset.episode_success, dtype=bool)
    to, h = int(policy.n_obs_steps), int(policy.n_action_steps)
    out: dict[str, list[Tensor]] = {k: [] for k in FIELDS}
    for episode in range(dataset.num_episodes):
        start, end = dataset.episode_bounds(episode)
        length = end - start
        terminal = bool(successes[episode]) and success_terminates
        reward = torch.zeros(length) if sparse else rewards[start:end]
        if sparse and bool(successes[episode]):
            reward[-1] = 1.0
        # a chunk may run past the end only where the episode ended in a terminal state
        starts = torch.arange(length if terminal else length - h)
        if len(starts) == 0:
            continue
        steps = starts[:, None] + torch.arange(h)[None]                      # [n, h]
        inside = steps < length
        clipped = steps.clamp(max=length - 1)
        chunk = actions[start:end][clipped]                                  # the last action pads
        chunk_reward = (reward[clipped] * inside).sum(1)
        ended = ~inside.all(1) | (terminal & (steps[:, -1] == length - 1))
        discount = torch.where(ended, torch.zeros(len(starts)), torch.full((len(starts),), gamma ** h))

        def history(at: Tensor, first: int = start) -> Any:  # the obs histories ending at steps `at`
            rows = (at[:, None] - torch.arange(to - 1, -1, -1)[None]).clamp(min=0) + first
            return map_obs(lambda o: o[rows].to(policy.device), obs_all)

        out["cond"].append(policy.encode_obs(history(starts)).to(device))
        out["next_cond"].append(policy.encode_obs(history((starts + h).clamp(max=length - 1))).to(device))
        out["chunk"].append(policy.normalize_action(chunk.to(policy.device)).clamp(-1, 1).to(device))
        out["reward"].append(chunk_reward.to(device))
        out["discount"].append(discount.to(device))
    if not out["cond"]:
        raise UserError(f"the demo dataset has no episode longer than a chunk ({h} steps)")
    return {k: torch.cat(v) for k, v in out.items()}


class ChunkRollout:
    """The env seen in executed chunks of the (frozen-encoder) policy: the obs history, the resets,
    and one chunk transition per `step` (see the module docstring)."""

    def __init__(self, env: Any, policy: Any, rewards: RewardSettings, gamma: float, device: torch.device):
        self.env, self.policy, self.rewards, self.gamma, self.device = env, policy, rewards, gamma, device
        self.history = ObsHistory(policy.n_obs_steps)
        self.henv = HistoryEnv(env, self.history)

    def start(self, saved: dict[str, Any] | None, seed: int) -> None:
        """New episodes (a fresh run, or a backend without snapshots), else the saved envs and histories."""
        if saved is None or saved["env"] is None:
            self.henv.reset(seed=seed)
        else:
            self.env.set_state(saved["env"])
            self.history.buffer = saved["history"]

    def state(self) -> dict[str, Any]:
        return {"env": env_snapshot(self.env), "history": self.history.buffer}

    def cond(self) -> Tensor:
        """The policy's conditioning of every env's current obs history."""
        policy = self.policy
        return policy.encode_obs(map_obs(lambda h: h.to(policy.device), self.history.get()))

    @torch.no_grad()
    def step(self, cond: Tensor, normalized: Tensor) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Execute each env's chunk (normalised [N, H, A], from `cond`); returns (its transition, info)."""
        policy = self.policy
        env_chunk = executed_actions(policy, policy.unnormalize_action(normalized))
        _, reward, terminated, truncated, info = step_chunk(self.henv, env_chunk)
        terminated, truncated = terminated.to(self.device), truncated.to(self.device)
        next_cond = self.cond()  # a finished env's history already holds its next episode
        if self.rewards.bootstrap_truncation:  # ... so a truncated chunk bootstraps from its final observation
            final = map_obs(lambda o: o[:, None].expand(-1, policy.n_obs_steps, *o.shape[1:]).to(policy.device),
                            info["final_obs"])
            next_cond = torch.where(truncated[:, None], policy.encode_obs(final), next_cond)
            ends = terminated
        else:
            ends = terminated | truncated
        transition = {"cond": cond, "chunk": executed_actions(policy, normalized.clamp(-1.0, 1.0)),
                      "reward": training_reward(reward, info, self.rewards.sparse).to(self.device),
                      "discount": self.gamma ** info["steps"].to(self.device).float() * (~ends).float(),
                      "next_cond": next_cond}
        return transition, info


def restore_generators(saved: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    for name, generator in generators.items():
        generator.set_state(saved[name])
