"""The one-step chunk policy of Q-chunking with flow Q-learning (QC-FQL; Li, Zhou and Levine 2025,
"Reinforcement Learning with Action Chunking", on FQL: Park, Li and Levine 2025, "Flow Q-Learning").

A one-step policy mu(s, z) maps the base policy's conditioning (its encoding of the obs history)
and a noise sample z (the base policy's noise shape) to a whole normalised action chunk in one
network call. Two forms (`algo.one_step`):
- `flow` (default): one Euler step of a trainable copy of the base flow policy's velocity network,
  mu(s, z) = z + v(z, t=0 | s). It starts as the BC policy sampled with K=1 (the mean chunk the
  velocity field points to from z), so it inherits the BC network's generalisation beyond the
  demo states; on peg_insert that start scores 66% where the K=10 BC policy scores 44%.
- `mlp`: FQL's fresh network, mu(s, z) = tanh(MLP([cond, z])). Distilled on the few demo states,
  it matches the flow there (squared error 0.001 per entry) yet scores 8% on peg_insert: off those
  states it has nothing to go on.
Training (algos/qc_fql.py) pulls mu toward the base flow policy's own chunk for the same z
(distillation) and up the chunk critic Q(s, a_{t:t+h}). The chunk executes clipped to the action
range. Acting draws z ~ N(0, I), like the base policy draws its initial noise, and executes the
chunk's n_action_steps actions (the same slice the base policy executes).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from embodied_rl.actors.base import layer_norm_mlp
from embodied_rl.errors import UserError
from embodied_rl.policies.base import ChunkPolicy, Obs
from embodied_rl.policies.runner import ChunkExecutor, executed_actions, map_obs

AGENT_KIND = "qc_fql"
ONE_STEP_FORMS = ("flow", "mlp")


class FlowOneStep(nn.Module):
    """mu(cond, z) = z + v(z, 0 | cond): one Euler step of a trainable copy of the flow's velocity
    network (the copy's encoder and normaliser stay frozen and are not saved)."""

    def __init__(self, policy: ChunkPolicy):
        super().__init__()
        self.flow = copy.deepcopy(policy)
        self.flow.set_num_inference_steps(1)
        self.flow.requires_grad_(False)
        self.flow.net.requires_grad_(True)

    def forward(self, cond: Tensor, z: Tensor) -> Tensor:
        return self.flow.sample(cond, z)

    def tensors(self) -> dict[str, Tensor]:
        return self.flow.net.state_dict()

    def load_tensors(self, tensors: dict[str, Tensor]) -> None:
        self.flow.net.load_state_dict(tensors)


class MLPOneStep(nn.Module):
    """mu(cond, z) = tanh(MLP([cond, z])) -> normalised chunk [B, horizon, action_dim]."""

    def __init__(self, cond_dim: int, horizon: int, action_dim: int, hidden_sizes: list[int]):
        super().__init__()
        self.horizon, self.action_dim = int(horizon), int(action_dim)
        chunk = self.horizon * self.action_dim
        self.net = layer_norm_mlp(int(cond_dim) + chunk, chunk, list(hidden_sizes))

    def forward(self, cond: Tensor, z: Tensor) -> Tensor:
        out = self.net(torch.cat([cond, z.flatten(1)], dim=-1))
        return torch.tanh(out).view(len(cond), self.horizon, self.action_dim)

    def tensors(self) -> dict[str, Tensor]:
        return self.state_dict()

    def load_tensors(self, tensors: dict[str, Tensor]) -> None:
        self.load_state_dict(tensors)


def one_step_config(policy: ChunkPolicy, form: str, hidden_sizes: list[int]) -> dict[str, Any]:
    """agent.json's config: the form and, for `mlp`, its constructor arguments."""
    if form == "flow":
        return {"one_step": "flow"}
    return {"one_step": "mlp", "cond_dim": int(policy.cond_dim), "horizon": int(policy.horizon),
            "action_dim": int(policy.action_dim), "hidden_sizes": [int(h) for h in hidden_sizes]}


def make_one_step(policy: ChunkPolicy, config: dict[str, Any]) -> FlowOneStep | MLPOneStep:
    # checkpoints written before `flow` existed hold an MLP and no "one_step" key
    form = config.get("one_step", "mlp")
    if form == "flow":
        return FlowOneStep(policy)
    if form == "mlp":
        return MLPOneStep(**{k: v for k, v in config.items() if k != "one_step"})
    raise UserError(f"unknown QC-FQL one-step form '{form}' (choose from: {', '.join(ONE_STEP_FORMS)})")


class OneStepAgent(ChunkExecutor):
    """Plans each chunk with one call of the one-step policy, from noise drawn with the agent's
    own generator (seeded with `seed`; evaluate() reseeds it every round)."""

    def __init__(self, actor: nn.Module, policy: ChunkPolicy, num_envs: int, seed: int | None = None):
        generator = torch.Generator(device=policy.device)
        if seed is not None:
            generator.manual_seed(seed)
        super().__init__(num_envs, policy.n_obs_steps, policy.n_action_steps, policy.action_dim, generator)
        self.actor, self.policy = actor, policy

    def plan(self, history: Obs, envs: Tensor) -> Tensor:
        policy = self.policy
        cond = policy.encode_obs(map_obs(lambda h: h[envs.to(h.device)].to(policy.device), history))
        z = policy.initial_noise(len(cond), self.generator)
        chunk = self.actor(cond, z).clamp(-1.0, 1.0)
        return executed_actions(policy, policy.unnormalize_action(chunk)).float()


def build_one_step_agent(checkpoint: Any, num_envs: int) -> OneStepAgent:
    """The evaluation agent of a QC-FQL checkpoint: agent.safetensors holds actor.* (the one-step
    policy's trained weights) and critic.* (the chunk critic, not needed to act)."""
    policy = checkpoint.base_policy.eval()
    actor = make_one_step(policy, checkpoint.config)
    actor.load_tensors({k.removeprefix("actor."): v for k, v in checkpoint.tensors.items() if k.startswith("actor.")})
    return OneStepAgent(actor.to(policy.device).eval(), policy, num_envs)
