"""The chunk MDP of the chunk-level off-policy methods (QC-FQL, SAC Flow): one MDP step is the
base policy's executed chunk (n_action_steps env steps, envs.step_chunk).

`ChunkRollout` runs chunks in the env and returns their transitions (offpolicy.CHUNK_FIELDS:
cond, executed chunk in the normalised action space, summed reward, discount, next cond). A
chunk's reward is the sum of its steps' rewards; its discount is gamma ** steps (the steps that
counted), 0 where the episode terminated inside the chunk, and with the success reward also at a
time limit (no bootstrap); a dense reward bootstraps a truncated chunk from a history of the final
observation repeated (the steps before it belong to the finished episode's chunk). The demos'
chunk transitions: offpolicy.demo_chunk_transitions.

`ChunkOffPolicy` is both methods' data side and online loop: each keeps its learner, its actor
and its offline phase.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from embodied_rl.actors.base import HistoryEnv
from embodied_rl.algos.common import (
    FinetuneLoop,
    RewardSettings,
    env_snapshot,
    training_reward,
)
from embodied_rl.algos.offpolicy import MixedBatches, OffPolicyConfig, Replay, UpdateBudget
from embodied_rl.envs.api import step_chunk
from embodied_rl.policies.runner import ObsHistory, executed_actions, map_obs


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


class ChunkOffPolicy:
    """The data side of a chunk-level off-policy run: the env in chunks (`rollout`), the replay,
    batches that mix the demos in (`batches`), the update budget and every generator they draw
    from; `state()` is the checkpoint's loop state and `start` continues from it."""

    def __init__(self, env: Any, policy: Any, rewards: RewardSettings, algo: OffPolicyConfig,
                 demos: dict[str, Tensor] | None, seed: int, device: torch.device, act_generator: torch.Generator):
        self.rollout = ChunkRollout(env, policy, rewards, algo.gamma, device)
        self.num_envs, self.chunk_steps = int(env.num_envs), int(policy.n_action_steps)
        shapes = {"cond": (policy.cond_dim,), "chunk": (self.chunk_steps, int(policy.action_dim)), "reward": (),
                  "discount": (), "next_cond": (policy.cond_dim,)}
        self.replay = Replay(algo.buffer_size, shapes, device)
        self.generators = {"demo_generator": torch.Generator().manual_seed(seed + 1),
                           "replay_generator": torch.Generator().manual_seed(seed + 2),
                           "act_generator": act_generator}
        self.batches = MixedBatches(self.replay, demos, algo.batch_size, algo.demo_fraction,
                                    self.generators["replay_generator"], self.generators["demo_generator"])
        self.budget = UpdateBudget(algo.utd_ratio)

    def start(self, saved: dict[str, Any] | None, seed: int) -> None:
        """New episodes for a fresh run, else everything as the checkpoint saved it."""
        self.rollout.start(saved, seed)
        if saved is None:
            return
        if "replay" in saved:  # absent with save_replay=false: the resumed run refills it
            self.replay.load_state_dict(saved["replay"])
        for name, generator in self.generators.items():
            generator.set_state(saved[name])
        self.budget.load_state_dict(saved["pending_updates"])

    def state(self) -> dict[str, Any]:
        return {**self.rollout.state(), "replay": self.replay.state_dict(), "pending_updates": self.budget.state_dict(),
                **{name: generator.get_state() for name, generator in self.generators.items()}}

    @torch.no_grad()
    def collect(self, act: Callable[[Tensor], Tensor]) -> dict[str, Any]:
        """One chunk in every env from `act(cond) -> normalised chunk [N, H, A]` into the replay;
        earns its update budget. Returns the env's info."""
        cond = self.rollout.cond()
        transition, info = self.rollout.step(cond, act(cond))
        self.replay.add(transition)
        self.budget.add(self.num_envs)
        return info

    def updates(self) -> Iterator[dict[str, Tensor]]:
        """One batch per gradient step the budget allows now."""
        while self.budget.take():
            yield self.batches.sample()

    def train(self, loop: FinetuneLoop, act: Callable[[Tensor], Tensor],
              update: Callable[[dict[str, Tensor]], dict[str, float]], stats: dict[str, float]) -> dict[str, Any]:
        """The online phase, until the loop's env steps are done: a chunk in every env from `act`,
        the gradient steps it earned (`update(batch) -> stats`; a non-finite loss stops the run),
        the metrics row (`stats` until the first update) and the loop's boundary. Returns the
        loop's result."""
        while loop.env_steps < loop.total_env_steps:
            info = self.collect(act)
            loop.advance(self.num_envs * self.chunk_steps, info)  # the batch steps every chunk step (envs.step_chunk)
            for batch in self.updates():
                stats = update(batch)
                for key in ("train/critic_loss", "train/actor_loss"):
                    if key in stats:  # a critic-only step has no actor loss
                        loop.check_finite(key, stats[key], stats)
            loop.log(stats)
            loop.boundary(self.state)
        return loop.finish(self.state)
