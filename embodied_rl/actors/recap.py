"""Advantage-conditioned acting (RECAP, as in pi*0.6): a chunk policy conditioned on a binary
"is this action better than usual" indicator, sampled with the positive indicator.

The indicator enters the policy as an additive offset of its conditioning vector (the
`cond_offset` of `ChunkPolicy.encode_batch`): row 0 of `IndicatorEmbedding` for a negative
advantage, row 1 for a positive one, and no offset for "no indicator" (the unconditioned
policy, trained with indicator dropout). Both rows start at zero, so before any update the
conditioned policy is the BC policy.

Acting uses classifier-free guidance with weight w on every denoising step:

    x_{i+1} = step(x_i, cond) + w * (step(x_i, cond + e_pos) - step(x_i, cond))

Every policy's deterministic step (Euler for flow and shortcut, DDIM for diffusion) is affine in
the network output with coefficients that do not depend on it, so mixing the steps is the same as
mixing the velocities (or noise predictions). w = 1 samples the conditioned policy alone (one
network call per step); w > 1 sharpens toward the positive indicator (two calls).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from embodied_rl.policies.base import ChunkPolicy, Obs
from embodied_rl.policies.runner import ChunkExecutor, executed_actions, map_obs

AGENT_KIND = "recap"


class IndicatorEmbedding(nn.Module):
    """Offsets of the policy's conditioning: row 0 negative, row 1 positive; zero at the start."""

    def __init__(self, cond_dim: int):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(2, int(cond_dim)))

    def forward(self, positive: Tensor) -> Tensor:
        """[B] bool -> [B, cond_dim]."""
        return self.table[positive.long().to(self.table.device)]


@torch.no_grad()
def guided_sample(policy: ChunkPolicy, cond: Tensor, offset: Tensor, noise: Tensor, guidance: float) -> Tensor:
    """The deterministic chain from `noise`, each step guided toward `cond + offset` with weight
    `guidance` (see the module docstring). Returns the normalised chunk (not clipped)."""
    x = noise
    for i in range(policy.num_inference_steps):
        conditioned = policy.denoise_step(x, i, cond + offset)
        if guidance != 1.0:
            unconditioned = policy.denoise_step(x, i, cond)
            conditioned = unconditioned + guidance * (conditioned - unconditioned)
        x = conditioned
    return x


class RecapAgent(ChunkExecutor):
    """Plans chunks with the positive indicator and guidance weight `guidance`, from noise drawn
    with the agent's own generator (seeded with `seed`; evaluate() reseeds it every round)."""

    def __init__(self, policy: ChunkPolicy, indicator: IndicatorEmbedding, num_envs: int, guidance: float,
                 seed: int | None = None):
        generator = torch.Generator(device=policy.device)
        if seed is not None:
            generator.manual_seed(seed)
        super().__init__(num_envs, policy.n_obs_steps, policy.n_action_steps, policy.action_dim, generator)
        self.policy, self.indicator, self.guidance = policy, indicator, float(guidance)

    def plan(self, history: Obs, envs: Tensor) -> Tensor:
        policy = self.policy
        subset = map_obs(lambda h: h[envs.to(h.device)].to(policy.device), history)
        cond = policy.encode_obs(subset)
        offset = self.indicator(torch.ones(len(cond), dtype=torch.bool)).to(cond)
        noise = policy.initial_noise(len(cond), self.generator)
        chunk = policy.unnormalize_action(guided_sample(policy, cond, offset, noise, self.guidance))
        return executed_actions(policy, chunk).float()


def build_recap_agent(checkpoint: Any, num_envs: int) -> RecapAgent:
    """The evaluation agent of a RECAP checkpoint: its base_policy/ holds the fine-tuned policy,
    agent.safetensors the indicator embedding, agent.json the guidance weight."""
    policy = checkpoint.base_policy.eval()
    indicator = IndicatorEmbedding(policy.cond_dim)
    indicator.load_state_dict({"table": checkpoint.tensors["indicator.table"]})
    return RecapAgent(policy, indicator.to(policy.device), num_envs, float(checkpoint.config["guidance"]))
