"""SAC Flow: soft actor-critic on the flow policy itself (after Zhang et al. 2025, "SAC Flow:
Sample-Efficient Reinforcement Learning of Flow-Based Policies via Velocity-Reparameterized
Sequential Modeling").

The actor is the flow policy's velocity network (a trainable copy; the encoder and normaliser
stay frozen), sampled as a noise-injected chain: K steps of the marginal-preserving SDE version
of its Euler step (`policy.step_mean_std`, as Flow-SDE),

    x_{i+1} = mean_i(x_i) + std_i * eps_i,   x_0 ~ N(0, I),

so the chain has a tractable log-likelihood, log p = sum_i log N(x_{i+1}; mean_i, std_i^2),
averaged over the executed chunk entries (per action dimension, like the other chain actors).
It is reparameterised: the chunk is a differentiable function of the weights given the noise.
SAC runs over executed chunks (one MDP step = n_action_steps env steps; chunk transitions as in
QC-FQL, algos/chunks.py):
- critic: an ensemble of LayerNorm MLPs Q(s, a_{t:t+h}) on the frozen encoder's conditioning,
  target y = R + gamma^steps * (min_pair Qbar(s', a') - alpha * log p(a' chain | s')), a' drawn
  from the current chain;
- actor: minimise alpha * log p(chain) - mean_e Q_e(s, clip(a)) / mean|Q| + |a - clip(a)|^2
  + action_reg * |a - a_base|^2, through the whole chain. Q is normalised by its batch magnitude
  (FQL's normalize_q_loss). clip is the action range [-1, 1], as executed and stored; the range
  term keeps the chain in it. a_base is the frozen base policy's chunk from the same initial and
  step noise: the last term is zero at the start and grows only as the fine-tuned chain leaves the
  BC policy (without an anchor the actor climbs the critic's errors);
- alpha: fixed (`alpha`), or tuned toward `target_entropy` (per action dimension) when set.
Batches mix online chunks with the demo dataset's chunk transitions (`demo_fraction`; 0 = online
only), `utd_ratio` gradient steps per collected chunk transition. The checkpoint is a plain
policy checkpoint of the fine-tuned flow policy (config.json, model.safetensors): `eval` runs it
like any BC policy (its deterministic ODE from random noise), and it can be fine-tuned again.

`finetune(cfg, run, env, policy)` is `embodied-rl finetune algo=sac_flow`; configs/algo/sac_flow.yaml.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from embodied_rl.actors.base import gaussian_logprob
from embodied_rl.algos.chunks import ChunkOffPolicy
from embodied_rl.algos.common import EnvEvaluation, FinetuneLoop, freeze_and_seed, reward_settings
from embodied_rl.algos.offpolicy import (
    OffPolicyConfig,
    actor_q,
    critic_and_target,
    critic_step,
    demo_chunk_transitions,
    find_demo_path,
    load_demos,
    normalised_q,
    polyak,
    random_min,
)
from embodied_rl.algos.wsrl import deploy_check, judged_deployment
from embodied_rl.errors import UserError
from embodied_rl.policies import PolicyRunner
from embodied_rl.policies.checkpoint import write_policy_files
from embodied_rl.policies.runner import executed_actions


@dataclass(frozen=True)
class SACFlowConfig(OffPolicyConfig):
    """configs/algo/sac_flow.yaml (the one home of its defaults)."""

    noise_level: float
    critic_hidden_sizes: list[int]
    alpha: float
    target_entropy: float | None
    critic_only_steps: int
    action_reg: float
    bootstrap_truncation: Any
    deploy: str

    def checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("noise_level", self.noise_level > 0, "> 0"),
            ("ensemble", self.ensemble >= 1, ">= 1"),
            *super().checks(),
            ("alpha", self.alpha > 0, "> 0"),
            ("batch_size", self.batch_size >= 2, ">= 2"),
            ("demo_fraction", 0.0 <= self.demo_fraction < 1.0, "in [0, 1)"),
            ("critic_only_steps", self.critic_only_steps >= 0, ">= 0"),
            ("action_reg", self.action_reg >= 0, ">= 0"),
            deploy_check(self.deploy),
        ]


def validate_config(cfg: Any) -> None:
    """Called by `embodied-rl finetune` before any work."""
    SACFlowConfig.from_cfg(cfg.algo)
    reward_settings(cfg)
    find_demo_path(cfg)  # a bad algo.data is an error


class FlowChain(nn.Module):
    """The noise-injected chain of a flow policy's trainable copy (see the module docstring)."""

    def __init__(self, policy: Any, noise_level: float):
        super().__init__()
        self.policy = policy  # frozen: the encoder and the normaliser
        self.ft = copy.deepcopy(policy)
        self.ft.requires_grad_(False)
        self.ft.net.requires_grad_(True)
        self.noise_level = float(noise_level)

    def forward(self, cond: Tensor, noise: Tensor, step_noise: Tensor) -> tuple[Tensor, Tensor]:
        """(normalised chunk [N, H, A], log-likelihood of the chain per executed entry [N]) from the
        initial noise [N, H, A] and the step noise [N, K, H, A]; differentiable in the weights."""
        return self.run(self.ft, cond, noise, step_noise)

    def base(self, cond: Tensor, noise: Tensor, step_noise: Tensor) -> Tensor:
        """The frozen base policy's chunk from the same noise (the regulariser's anchor)."""
        with torch.no_grad():
            return self.run(self.policy, cond, noise, step_noise)[0]

    def run(self, flow: Any, cond: Tensor, noise: Tensor, step_noise: Tensor) -> tuple[Tensor, Tensor]:
        x, logprob = noise, torch.zeros(len(noise), device=noise.device)
        for i in range(flow.num_inference_steps):
            mean, std = flow.step_mean_std(x, i, cond, self.noise_level)
            x = mean + std * step_noise[:, i]
            logprob = logprob + executed_actions(self.policy, gaussian_logprob(x, mean, std)).flatten(1).mean(-1)
        return x, logprob

    def noise(self, n: int, generator: torch.Generator | None, device: torch.device) -> tuple[Tensor, Tensor]:
        """(initial noise [N, H, A], step noise [N, K, H, A]) on `device`."""
        shape = self.policy.noise_shape
        noise = torch.randn((n, *shape), generator=generator, device=device if generator is None else "cpu")
        steps = torch.randn((n, self.ft.num_inference_steps, *shape), generator=generator,
                            device=device if generator is None else "cpu")
        return noise.to(device), steps.to(device)

    def draw(self, cond: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        return self(cond, *self.noise(len(cond), generator, cond.device))


class SACFlow:
    """The chain, the chunk critic, the entropy coefficient, their optimisers and one update."""

    def __init__(self, algo: SACFlowConfig, policy: Any, device: torch.device, seed: int):
        self.algo, self.policy = algo, policy
        self.chain = FlowChain(policy, algo.noise_level).to(device)
        critic_input = policy.cond_dim + int(policy.n_action_steps) * int(policy.action_dim)  # Q(cond, chunk)
        self.critic, self.critic_target = critic_and_target(critic_input, algo.critic_hidden_sizes, algo.ensemble,
                                                            device)
        self.log_alpha = torch.tensor(math.log(algo.alpha), device=device, requires_grad=True)
        self.actor_optimizer = torch.optim.Adam(self.chain.ft.net.parameters(), lr=algo.actor_lr)
        self.critic_optimizer = torch.optim.Adam(self.critic.parameters(), lr=algo.critic_lr)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=algo.critic_lr)
        self.generator = torch.Generator().manual_seed(seed)  # the critic pairs

    def optimizers(self) -> dict[str, Any]:
        return {"actor": self.actor_optimizer, "critic": self.critic_optimizer, "alpha": self.alpha_optimizer}

    def update(self, batch: dict[str, Tensor], update_actor: bool) -> dict[str, float]:
        algo = self.algo
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            next_chunk, next_logprob = self.chain.draw(batch["next_cond"])
            next_executed = executed_actions(self.policy, next_chunk).clamp(-1.0, 1.0)
            next_q = random_min(self.critic_target(batch["next_cond"], next_executed), 2, self.generator)
            target = batch["reward"] + batch["discount"] * (next_q - alpha * next_logprob)
        critic_loss, q = critic_step(self.critic, self.critic_optimizer, target, batch["cond"], batch["chunk"])
        stats = {"train/critic_loss": critic_loss.item(), "train/q": q.mean().item(), "train/alpha": float(alpha)}
        if update_actor:
            noise = self.chain.noise(len(batch["cond"]), None, batch["cond"].device)
            chunk, logprob = self.chain(batch["cond"], *noise)
            executed = executed_actions(self.policy, chunk)
            # The env runs the chunk clipped to [-1, 1] and the replay stores it so: the critic reads
            # the clipped chunk. Outside the range a critic only extrapolates, and an unclipped chain
            # followed it there (lift: 36% of the entries beyond 1, up to 6); the clip leaves no
            # gradient on those entries, so a penalty on the excess pulls them back.
            q_pi = actor_q(self.critic, batch["cond"], executed.clamp(-1.0, 1.0))
            # the critic's soft target keeps alpha in reward units; the actor weighs it against Q / mean|Q|
            q_term = -normalised_q(q_pi)
            out_of_range = (executed.abs() - 1.0).clamp(min=0.0).pow(2).flatten(1).sum(-1)
            to_base = torch.zeros_like(q_pi)
            if algo.action_reg > 0:  # the base chain costs a second pass of the velocity network
                base = executed_actions(self.policy, self.chain.base(batch["cond"], *noise))
                to_base = (executed - base).pow(2).flatten(1).sum(-1)
            actor_loss = (alpha * logprob + q_term + out_of_range + algo.action_reg * to_base).mean()
            self.actor_optimizer.zero_grad()
            actor_loss.backward()
            self.actor_optimizer.step()
            stats.update({"train/actor_loss": actor_loss.item(), "train/logprob": logprob.mean().item(),
                          "train/action_reg": to_base.mean().item()})
            if algo.target_entropy is not None:  # tune alpha so that -logprob tracks the target
                alpha_loss = -(self.log_alpha * (logprob.detach() + algo.target_entropy)).mean()
                self.alpha_optimizer.zero_grad()
                alpha_loss.backward()
                self.alpha_optimizer.step()
        polyak(self.critic, self.critic_target, algo.tau)
        return stats

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.chain.ft.net.state_dict(), "critic": self.critic.state_dict(),
                "critic_target": self.critic_target.state_dict(), "log_alpha": self.log_alpha.detach().cpu(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.chain.ft.net.load_state_dict(state["net"])
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.generator.set_state(state["generator"])


def finetune(cfg: Any, run: Any, env: Any, policy: Any) -> dict[str, Any]:
    algo = SACFlowConfig.from_cfg(cfg.algo)
    if not policy.is_flow:
        raise UserError(f"algo=sac_flow fine-tunes a flow policy (policy=flow or vla); this checkpoint holds a "
                        f"{type(policy).__name__}")
    seed, device = freeze_and_seed(cfg, policy)
    rewards = reward_settings(cfg)
    learner = SACFlow(algo, policy, device, seed)
    demos = None
    if algo.demo_fraction > 0:
        dataset, success_terminates = load_demos(cfg, env)
        if dataset is None:
            raise UserError("algo.demo_fraction > 0 needs demonstrations: the BC checkpoint records none; "
                            "pass algo.data=PATH or algo.demo_fraction=0")
        demos = demo_chunk_transitions(dataset, policy, algo.gamma, success_terminates, rewards.demo_sparse, device)
    act_generator = torch.Generator().manual_seed(seed + 3)
    data = ChunkOffPolicy(env, policy, rewards, algo, demos, seed, device, act_generator)

    recorded = {"finetuned_from": str(cfg.checkpoint), "algo": algo.name}
    demo_path = find_demo_path(cfg)
    if demo_path is not None:  # so that a later run finds the demos, as from the BC checkpoint
        recorded["dataset"] = str(demo_path)

    def write_agent(path: Path) -> None:  # the fine-tuned flow policy, as a policy checkpoint
        write_policy_files(learner.chain.ft, path, recorded)

    def make_agent(n: int) -> PolicyRunner:
        return PolicyRunner(learner.chain.ft, n)

    evaluation, write_agent = judged_deployment(algo.deploy, EnvEvaluation(cfg, run, make_agent, policy.env_options()),
                                                learner.chain.ft, write_agent)
    loop = FinetuneLoop(cfg, run, evaluation)
    saved = loop.resume({"learner": learner}, learner.optimizers(), write_agent)
    data.start(saved, seed + loop.env_steps)

    def act(cond: Tensor) -> Tensor:
        return learner.chain.draw(cond, act_generator)[0]  # the stochastic chain explores

    def update(batch: dict[str, Tensor]) -> dict[str, float]:
        return learner.update(batch, update_actor=loop.env_steps > algo.critic_only_steps)

    loop.start(f"finetune {algo.name}", instructions=env.instructions)
    return data.train(loop, act, update, {})
