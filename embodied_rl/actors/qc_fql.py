"""The one-step chunk policy of Q-chunking with flow Q-learning (QC-FQL; Li, Zhou and Levine 2025,
"Reinforcement Learning with Action Chunking", on FQL: Park, Li and Levine 2025, "Flow Q-Learning").

`OneStepPolicy` maps the base policy's conditioning (its encoding of the obs history) and a
noise sample z (the base policy's noise shape) to a whole normalised action chunk in one network
call: mu(s, z) = tanh(MLP([cond, z])). Training (algos/qc_fql.py) pulls it toward the base flow
policy's own chunk for the same z (distillation) and up the chunk critic Q(s, a_{t:t+h}).
Acting draws z ~ N(0, I), like the base policy draws its initial noise, and executes the chunk's
n_action_steps actions (the same slice the base policy executes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from embodied_rl.actors.base import layer_norm_mlp
from embodied_rl.policies.base import ChunkPolicy, Obs
from embodied_rl.policies.runner import ChunkExecutor, executed_actions, map_obs

AGENT_KIND = "qc_fql"


class OneStepPolicy(nn.Module):
    """mu(cond, z) -> normalised chunk [B, horizon, action_dim] in [-1, 1]."""

    def __init__(self, cond_dim: int, horizon: int, action_dim: int, hidden_sizes: list[int]):
        super().__init__()
        self.horizon, self.action_dim = int(horizon), int(action_dim)
        chunk = self.horizon * self.action_dim
        self.net = layer_norm_mlp(int(cond_dim) + chunk, chunk, list(hidden_sizes))

    def forward(self, cond: Tensor, z: Tensor) -> Tensor:
        out = self.net(torch.cat([cond, z.flatten(1)], dim=-1))
        return torch.tanh(out).view(len(cond), self.horizon, self.action_dim)


def one_step_config(policy: ChunkPolicy, hidden_sizes: list[int]) -> dict[str, Any]:
    """agent.json's config: OneStepPolicy's constructor arguments."""
    return {"cond_dim": int(policy.cond_dim), "horizon": int(policy.horizon), "action_dim": int(policy.action_dim),
            "hidden_sizes": [int(h) for h in hidden_sizes]}


class OneStepAgent(ChunkExecutor):
    """Plans each chunk with one call of the one-step policy, from noise drawn with the agent's
    own generator (seeded with `seed`; evaluate() reseeds it every round)."""

    def __init__(self, actor: OneStepPolicy, policy: ChunkPolicy, num_envs: int, seed: int | None = None):
        generator = torch.Generator(device=policy.device)
        if seed is not None:
            generator.manual_seed(seed)
        super().__init__(num_envs, policy.n_obs_steps, policy.n_action_steps, policy.action_dim, generator)
        self.actor, self.policy = actor, policy

    def plan(self, history: Obs, envs: Tensor) -> Tensor:
        policy = self.policy
        cond = policy.encode_obs(map_obs(lambda h: h[envs.to(h.device)].to(policy.device), history))
        z = policy.initial_noise(len(cond), self.generator)
        return executed_actions(policy, policy.unnormalize_action(self.actor(cond, z))).float()


def build_one_step_agent(checkpoint: Any, num_envs: int) -> OneStepAgent:
    """The evaluation agent of a QC-FQL checkpoint: agent.safetensors holds actor.* (the one-step
    policy) and critic.* (the chunk critic, not needed to act)."""
    policy = checkpoint.base_policy.eval()
    actor = OneStepPolicy(**checkpoint.config)
    actor.load_state_dict({k.removeprefix("actor."): v for k, v in checkpoint.tensors.items() if k.startswith("actor.")})
    return OneStepAgent(actor.to(policy.device).eval(), policy, num_envs)
