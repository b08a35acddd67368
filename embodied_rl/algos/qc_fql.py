"""QC-FQL: Q-chunking with flow Q-learning (Li, Zhou and Levine 2025; FQL: Park, Li and Levine 2025).

The MDP step is the executed action chunk a_{t:t+h} (h = n_action_steps of the base policy):
- a critic over whole chunks, an ensemble of LayerNorm MLPs Q_e(s, a_{t:t+h}) on the base
  policy's conditioning (its encoding of the obs history), trained on chunk-level n-step
  backups: y = R_t + discount * min_pair Qbar(s_{t+h}, mu(s_{t+h}, z')), with R_t the chunk's
  rewards and discount = gamma ** steps (0 when the episode terminated inside the chunk);
- a one-step policy mu(s, z) (actors/qc_fql.py; `one_step`: one Euler step of a trainable copy
  of the flow's velocity network, or FQL's fresh MLP) trained with
      L = -Q(s, mu(s, z)) / mean|Q| + alpha * || mu(s, z) - flow(s, z) ||^2,
  the Q term normalised by its batch magnitude (FQL's normalize_q_loss) and flow(s, z) the frozen
  base flow policy's chunk from the same noise z (the distillation term keeps mu near the BC
  policy's support; alpha sets how near); the chunk executes clipped to the action range, and the
  critic reads it so;
- offline pre-training: `offline_updates` gradient steps on the demo dataset's chunk transitions
  before the first env step (step 0's evaluation shows the result); then online fine-tuning,
  collecting chunks with mu and z ~ N(0, I), each batch `demo_fraction` demos and the rest online
  data, `utd_ratio` gradient steps per collected chunk transition.

Rewards (algo.reward, auto = the task's success where it has one), chunk transitions from the
env (algos/chunks.py, shared with SAC Flow) and from the demos (algos/offpolicy.py).

`finetune(cfg, run, env, policy)` is `embodied-rl finetune algo=qc_fql`; configs/algo/qc_fql.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from embodied_rl.actors import save_agent
from embodied_rl.actors.qc_fql import (
    AGENT_KIND,
    ONE_STEP_FORMS,
    OneStepAgent,
    make_one_step,
    one_step_config,
)
from embodied_rl.algos.chunks import ChunkOffPolicy
from embodied_rl.algos.common import EnvEvaluation, FinetuneLoop, freeze_and_seed, reward_settings
from embodied_rl.algos.offpolicy import (
    OffPolicyConfig,
    actor_q,
    critic_and_target,
    critic_step,
    demo_chunk_transitions,
    load_demos,
    normalised_q,
    polyak,
    random_min,
)
from embodied_rl.algos.wsrl import deploy_check, judged_deployment
from embodied_rl.errors import UserError
from embodied_rl.policies.runner import executed_actions


@dataclass(frozen=True)
class QCFQLConfig(OffPolicyConfig):
    """configs/algo/qc_fql.yaml (the one home of its defaults)."""

    one_step: str
    hidden_sizes: list[int]
    alpha: float
    offline_updates: int
    bootstrap_truncation: Any
    deploy: str

    def checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("one_step", self.one_step in ONE_STEP_FORMS, f"one of {', '.join(ONE_STEP_FORMS)}"),
            ("ensemble", self.ensemble >= 1, ">= 1"),
            *super().checks(),
            ("alpha", self.alpha >= 0, ">= 0"),
            ("batch_size", self.batch_size >= 2, ">= 2"),
            ("demo_fraction", 0.0 <= self.demo_fraction <= 1.0, "in [0, 1]"),
            ("offline_updates", self.offline_updates >= 0, ">= 0"),
            deploy_check(self.deploy),
        ]


def validate_config(cfg: Any) -> None:
    """Called by `embodied-rl finetune` before any work."""
    QCFQLConfig.from_cfg(cfg.algo)
    reward_settings(cfg)


# --------------------------------------------------------------------------------------------
# The learner
# --------------------------------------------------------------------------------------------


class QCFQL:
    """The one-step policy, the chunk critic, their targets and optimisers, and one update."""

    def __init__(self, algo: QCFQLConfig, policy: Any, device: torch.device, seed: int):
        self.algo, self.policy = algo, policy
        self.config = one_step_config(policy, algo.one_step, algo.hidden_sizes)
        self.actor = make_one_step(policy, self.config).to(device)
        critic_input = policy.cond_dim + int(policy.n_action_steps) * int(policy.action_dim)  # Q(cond, chunk)
        self.critic, self.critic_target = critic_and_target(critic_input, algo.hidden_sizes, algo.ensemble, device)
        trainable = [p for p in self.actor.parameters() if p.requires_grad]
        self.actor_optimizer = torch.optim.Adam(trainable, lr=algo.actor_lr)
        self.critic_optimizer = torch.optim.Adam(self.critic.parameters(), lr=algo.critic_lr)
        self.generator = torch.Generator().manual_seed(seed)  # z of the updates and the critic pairs

    def optimizers(self) -> dict[str, Any]:
        return {"actor": self.actor_optimizer, "critic": self.critic_optimizer}

    def noise(self, n: int) -> Tensor:
        return torch.randn((n, *self.policy.noise_shape), generator=self.generator).to(self.policy.device)

    def executed(self, chunk: Tensor) -> Tensor:
        """The chunk's executed actions, clipped to the action range as the env runs them."""
        return executed_actions(self.policy, chunk).clamp(-1.0, 1.0)

    def update(self, batch: dict[str, Tensor]) -> dict[str, float]:
        algo, policy = self.algo, self.policy
        n = len(batch["cond"])
        with torch.no_grad():
            next_chunk = self.executed(self.actor(batch["next_cond"], self.noise(n)))
            next_q = random_min(self.critic_target(batch["next_cond"], next_chunk), 2, self.generator)
            target = batch["reward"] + batch["discount"] * next_q
        critic_loss, q = critic_step(self.critic, self.critic_optimizer, target, batch["cond"], batch["chunk"])

        z = self.noise(n)
        with torch.no_grad():  # the frozen flow policy's chunk from the same noise
            flow_chunk = policy.sample(batch["cond"], z).clamp(-1, 1)
        chunk = self.actor(batch["cond"], z)
        distill = (chunk - flow_chunk).pow(2).mean()  # over every chunk element, as FQL
        q_loss = -normalised_q(actor_q(self.critic, batch["cond"], self.executed(chunk))).mean()
        actor_loss = q_loss + algo.alpha * distill
        self.actor_optimizer.zero_grad()
        actor_loss.backward()
        self.actor_optimizer.step()
        polyak(self.critic, self.critic_target, algo.tau)
        return {"train/critic_loss": critic_loss.item(), "train/q": q.mean().item(), "train/actor_loss": actor_loss.item(),
                "train/distill_loss": distill.item()}

    def state_dict(self) -> dict[str, Any]:
        return {"actor": self.actor.tensors(), "critic": self.critic.state_dict(),
                "critic_target": self.critic_target.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.actor.load_tensors(state["actor"])
        for name in ("critic", "critic_target"):
            getattr(self, name).load_state_dict(state[name])
        self.generator.set_state(state["generator"])


# --------------------------------------------------------------------------------------------
# embodied-rl finetune algo=qc_fql
# --------------------------------------------------------------------------------------------


def finetune(cfg: Any, run: Any, env: Any, policy: Any) -> dict[str, Any]:
    algo = QCFQLConfig.from_cfg(cfg.algo)
    if not policy.is_flow:
        raise UserError(f"algo=qc_fql distils a flow policy (policy=flow or vla); this checkpoint holds a {type(policy).__name__}")
    seed, device = freeze_and_seed(cfg, policy)
    rewards = reward_settings(cfg)
    learner = QCFQL(algo, policy, device, seed)
    num_envs = int(env.num_envs)
    dataset, success_terminates = load_demos(cfg, env)
    if dataset is None:
        raise UserError("algo=qc_fql needs demonstrations: the BC checkpoint records none; pass algo.data=PATH")
    demos = demo_chunk_transitions(dataset, policy, algo.gamma, success_terminates, rewards.demo_sparse, device)
    act_generator = torch.Generator(device=policy.device).manual_seed(seed + 3)  # z of the rollouts
    data = ChunkOffPolicy(env, policy, rewards, algo, demos, seed, device, act_generator)

    def write_agent(path: Path) -> None:
        tensors = {**{f"actor.{k}": v for k, v in learner.actor.tensors().items()},
                   **{f"critic.{k}": v for k, v in learner.critic.state_dict().items()}}
        save_agent(path, AGENT_KIND, learner.config, tensors, policy)

    def make_agent(n: int) -> OneStepAgent:
        return OneStepAgent(learner.actor, policy, n)

    # judged: the deployed weights start as the one-step policy after its offline pre-training (the start's evaluation)
    evaluation, write_agent = judged_deployment(algo.deploy, EnvEvaluation(cfg, run, make_agent, policy.env_options()),
                                                torch.nn.ModuleList([learner.actor, learner.critic]), write_agent)
    loop = FinetuneLoop(cfg, run, evaluation)
    loop.counters.setdefault("offline_updates", 0)
    saved = loop.resume({"learner": learner}, learner.optimizers(), write_agent)

    # ---- offline pre-training on the demos (skipped when a checkpoint holds it) ----
    stats: dict[str, float] = {}
    while loop.counters["offline_updates"] < algo.offline_updates:
        stats = learner.update(data.batches.sample())  # the replay is empty: every row is a demo
        loop.counters["offline_updates"] += 1
        loop.check_finite("train/critic_loss", stats["train/critic_loss"], stats)
    if saved is None and algo.offline_updates:
        loop.run.log(0, {f"offline/{k.removeprefix('train/')}": v for k, v in stats.items()})

    # ---- online: the env, seen in chunks; the one-step policy acts on obs histories ----
    data.start(saved, seed + loop.env_steps)

    def act(cond: Tensor) -> Tensor:
        return learner.actor(cond, policy.initial_noise(num_envs, act_generator)).clamp(-1.0, 1.0)

    loop.start(f"finetune {algo.name}", instructions=env.instructions)
    return data.train(loop, act, learner.update, stats)
