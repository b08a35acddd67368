"""FPO, Flow Policy Optimization (McAllister et al. 2025, "Flow Matching Policy Gradients"): PPO
on a flow policy without a likelihood of its sampler.

The rollout samples each chunk a with the fine-tuned flow policy (its deterministic Euler chain
from fresh noise, as the BC policy samples) and draws K pairs (t_k, eps_k) with the policy's own
training-time distribution of t. The conditional flow-matching loss of the sample,

    l_theta(a; t, eps) = sum_A || v_theta(x_t, t | s) - (a - eps) ||^2 / n_executed,
    x_t = (1 - t) eps + t a     (the flow policy's convention: t = 0 noise, t = 1 data),

summed over the action dims and averaged over the executed chunk steps, stands in for -log pi:
the PPO loop's ratio exp(logprob - old_logprob) is

    r = exp( mean_k l_old(a; t_k, eps_k) - mean_k l_theta(a; t_k, eps_k) ),

one ratio per chunk, with the same (t_k, eps_k) for the old and the new weights (they travel in
the stash), so r = 1 exactly before the first update. Lowering the loss of an action with a
positive advantage raises its ratio, which the clipped surrogate rewards up to 1 + clip.
`ratio="per_sample"` (FPO++, Yi et al. 2026) instead gives each pair its own ratio
r_k = exp(l_old(a; t_k, eps_k) - l_theta(a; t_k, eps_k)), clipped on its own, and averages the K
clipped surrogates: one pair whose loss moved far no longer decides the clip of the whole chunk.
There is no entropy term (the loop receives zeros). Exploration comes from the initial noise
of each chunk; `action_noise` > 0 adds N(0, action_noise^2) to the sampled chunk (normalised
units, before the [-1, 1] clamp), and the stored chunk is the noisy one, so the loss is that of
the executed action. Needs a flow policy (flow, or vla, which is one): a shortcut model samples
with its step-size-conditioned velocity, not the flow-matching one the loss trains. The velocity
network is fine-tuned, the encoder and normaliser stay frozen.
"""

from __future__ import annotations

import torch
from torch import Tensor

from embodied_rl.actors.base import ActorOutput, ChainActor
from embodied_rl.errors import UserError
from embodied_rl.policies.base import Obs
from embodied_rl.policies.flow import FlowPolicy
from embodied_rl.policies.shortcut import ShortcutPolicy

RATIOS = ("chunk", "per_sample")


class FPOActor(ChainActor):
    kind = "fpo"

    def __init__(self, policy, num_envs: int = 1, num_samples: int = 8, action_noise: float = 0.1,
                 critic_hidden: int = 256, ratio: str = "per_sample"):
        if not isinstance(policy, FlowPolicy) or isinstance(policy, ShortcutPolicy):
            name = getattr(policy, "policy_type", type(policy).__name__)
            raise UserError(f"algo=fpo needs a flow policy (policy=flow or vla), got {name}")
        if int(num_samples) < 1:
            raise UserError(f"algo.actor_kwargs.num_samples must be >= 1, got {num_samples}")
        if float(action_noise) < 0:
            raise UserError(f"algo.actor_kwargs.action_noise must be >= 0, got {action_noise}")
        if ratio not in RATIOS:
            raise UserError(f"algo.actor_kwargs.ratio must be one of {', '.join(RATIOS)}, got {ratio!r}")
        super().__init__(policy, critic_hidden)
        self._config = dict(num_samples=int(num_samples), action_noise=float(action_noise),
                            critic_hidden=critic_hidden, ratio=ratio)
        self.num_samples = int(num_samples)
        self.action_noise = float(action_noise)
        self.ratio = ratio
        # per_sample: one log-prob column per (t, eps) pair, which the PPO loop clips one by one
        self.num_logprob_positions = self.num_samples if ratio == "per_sample" else 1

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False) -> ActorOutput:
        cond = self.encode(obs)
        n, k = len(cond), self.num_samples
        chunk = self.ft.sample(cond, torch.randn((n, *self.policy.noise_shape), device=cond.device))
        value = self.get_value(self.latest_obs(obs))
        if deterministic:  # evaluation acts only: no likelihood surrogate needed
            return ActorOutput(self.to_actions(chunk), torch.zeros(n, self.num_logprob_positions, device=cond.device),
                               value, {})
        if self.action_noise > 0:
            chunk = chunk + self.action_noise * torch.randn_like(chunk)
        chunk = chunk.clamp(-1.0, 1.0)  # the loss is that of the action the env executes
        stash = {"chunk": chunk, "t": self.ft.sample_train_times(n * k, cond.device).view(n, k),
                 "eps": torch.randn((n, k, *self.policy.noise_shape), device=cond.device)}
        logprob, _ = self.evaluate(obs, stash)
        return ActorOutput(self.to_actions(chunk), logprob, value, stash)

    def cfm_losses(self, cond: Tensor, stash: dict[str, Tensor]) -> Tensor:
        """l_theta(a; t_k, eps_k) for every sample and pair: [N, K]."""
        chunk, t, eps = stash["chunk"], stash["t"], stash["eps"]
        n, k = t.shape
        times = t[..., None, None]
        x_t = (1 - times) * eps + times * chunk[:, None]
        velocity = self.ft.velocity(x_t.flatten(0, 1), t.flatten(), cond.repeat_interleave(k, dim=0))
        error = (velocity.view_as(eps) - (chunk[:, None] - eps)) ** 2       # [N, K, H, A]
        return error[:, :, self.executed].sum(-1).mean(-1)

    def evaluate(self, obs: Obs, stash: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The log-prob surrogate: -mean_k l [N, 1] (chunk), or -l per pair [N, K] (per_sample)."""
        losses = self.cfm_losses(self.encode(obs), stash)
        logprob = -losses if self.ratio == "per_sample" else -losses.mean(1, keepdim=True)
        return logprob, torch.zeros_like(logprob)
