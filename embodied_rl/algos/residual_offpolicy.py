"""Residual off-policy RL (ResFiT): SAC or TD3 on a per-step residual over a frozen chunk policy.

Ankile et al. (2025), "From Imitation to Refinement: Residual RL for Precise Assembly" / ResFiT:
a frozen BC policy proposes b_t; an actor on [obs, b_t] adds a bounded correction (zero at the
start); the critic is an ensemble Q_1..Q_E(s, b, a) with LayerNorm whose TD target is the
minimum over a random pair of target critics (REDQ; `target_min_of: 1` takes one random critic,
RLPD's setting for sparse long-horizon AntMaze); n-step returns are computed per env over
many parallel envs; each batch mixes demonstrations (actions from the BC dataset, base actions
relabelled by the base policy) and online data, 50/50 by default; the update-to-data ratio is a
config value. The WSRL stages (algos/wsrl.py) come first: base-policy rollouts, critic-only
updates, then actor updates.

Truncation vs termination: a truncated episode bootstraps from info["final_obs"] (and the base
action the base policy would have taken there); a terminated one does not bootstrap.

RLPD (`algo=rlpd`, Ball et al. 2023) is this method with RLPD's settings: SAC, a 10-critic
ensemble, half of every batch from the demos, no warm start. `algo.interventions=expert` adds
HIL-SERL-style takeovers (algos/interventions.py): where the trigger fires, the task's scripted
expert drives the env for `intervention_steps` steps; those transitions (the expert's action as
the action taken) enter the replay and the demo pool, and `train/intervention_rate` (the share of
env steps the expert drove in the logging window) and `rollout/success_rate_unassisted` (episodes
without any intervention) are logged.

`finetune(cfg, run, env, policy)` is the `embodied-rl finetune algo=residual_offpolicy` entry point
(`algo=residual_sac` is its former name).

Data-parallel (torchrun, embodied_rl/distributed.py): each rank steps its own envs into its own
replay shard and samples its own batches; every gradient (critic, actor, entropy coefficient) is
averaged across ranks before its optimiser step, so one gradient step of K ranks sees K batches
and `utd_ratio` counts gradient steps per env step of one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from embodied_rl import distributed
from embodied_rl.actors import save_agent
from embodied_rl.actors.base import head_input
from embodied_rl.actors.residual_offpolicy import (
    AGENT_KIND,
    ResidualAgent,
    make_residual_net,
    residual_tensors,
)
from embodied_rl.algos.common import (
    EnvEvaluation,
    FinetuneLoop,
    PotentialShaping,
    env_snapshot,
    freeze_and_seed,
    reward_settings,
    training_reward,
)
from embodied_rl.algos.interventions import TRIGGERS, ExpertTakeover, InterventionSchedule
from embodied_rl.algos.offpolicy import (
    MixedBatches,
    OffPolicyConfig,
    Replay,
    UpdateBudget,
    actor_q,
    critic_and_target,
    critic_step,
    demo_action_dims,
    demo_transitions,
    find_demo_path,
    load_demos,
    polyak,
    random_min,
)
from embodied_rl.algos.wsrl import (
    CRITIC,
    FULL,
    WARMUP,
    JudgedEvaluation,
    WarmStart,
)
from embodied_rl.errors import UserError
from embodied_rl.policies import PolicyRunner
from embodied_rl.policies.base import Obs
from embodied_rl.policies.runner import map_obs, where_obs

# --------------------------------------------------------------------------------------------
# n-step returns
# --------------------------------------------------------------------------------------------


def nstep_returns(rewards: Tensor, terminated: Tensor, truncated: Tensor, gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    """n-step returns of the first step of a window, per env.

    rewards, terminated, truncated: [n, N], time-major (row 0 is the step whose return is
    wanted). The return stops at the first step k where the episode ended (terminated or
    truncated) or at k = n - 1. Returns (R [N], discount [N], k [N]):
        R = sum_{i<=k} gamma^i r_i,   discount = gamma^(k+1) if not terminated at k else 0,
    and the bootstrap uses the next observation of step k (for a truncated step: final_obs).
    """
    n = rewards.shape[0]
    done = terminated | truncated
    # alive[i]: no episode end strictly before step i
    ended_before = torch.cumsum(done.long(), dim=0) - done.long()
    alive = ended_before == 0
    powers = gamma ** torch.arange(n, dtype=rewards.dtype, device=rewards.device)
    returns = (rewards * alive * powers[:, None]).sum(0)
    first_done = torch.where(done.any(0), done.long().argmax(0), torch.full_like(done[0], n - 1, dtype=torch.long))
    terminal = terminated.gather(0, first_done[None]).squeeze(0)
    discount = gamma ** (first_done + 1).to(rewards.dtype) * (~terminal).to(rewards.dtype)
    return returns, discount, first_done


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResidualOffPolicyConfig(OffPolicyConfig):
    """configs/algo/residual_offpolicy.yaml (the one home of its defaults; algo=residual_sac is
    the same file under its former name)."""

    learner: str               # td3 | sac
    residual_scale: float
    residual_dims: Any         # all | demos: only the action dims the demonstrations move | a list of action dims
    residual_penalty: float
    actor_q: str               # mean | min: what of the critic ensemble the actor maximises
    normalize_obs: bool
    actor_hidden_sizes: list[int]
    critic_hidden_sizes: list[int]
    target_min_of: int         # the TD target is the minimum over this many critics drawn at random
    n_step: int
    init_alpha: float
    target_entropy: Any        # "auto" or a number
    exploration_noise: float
    target_noise: float
    policy_delay: int
    reward_shaping: float      # + coef x potential-based shaping by the env reward (PotentialShaping)
    warmup_env_steps: int
    critic_only_steps: int
    reach_ramp_steps: int      # the residual's bound grows to residual_scale over these env steps (algos/wsrl.py)
    floor_reach: float | None  # what evaluations and checkpoints act with until paired evaluations judge the
                               # training reach better (JudgedReach); None: the training reach
    interventions: str         # none | expert
    intervention_trigger: str  # stall | random
    stall_steps: int
    intervention_prob: float
    intervention_steps: int

    def checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("learner", self.learner in ("td3", "sac"), "td3 or sac"),
            ("residual_scale", self.residual_scale > 0, "> 0"),
            ("residual_dims", self.residual_dims in ("demos", "all") or (
                isinstance(self.residual_dims, list) and len(self.residual_dims) > 0
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in self.residual_dims)
                and len(set(self.residual_dims)) == len(self.residual_dims)),
             "all, demos or a list of distinct action dims (e.g. [0, 1, 2, 6])"),
            ("residual_penalty", self.residual_penalty >= 0, ">= 0"),
            ("actor_q", self.actor_q in ("mean", "min"), "mean or min"),
            ("actor_hidden_sizes", all(h >= 1 for h in self.actor_hidden_sizes), "a list of sizes >= 1"),
            ("critic_hidden_sizes", all(h >= 1 for h in self.critic_hidden_sizes), "a list of sizes >= 1"),
            ("ensemble", self.ensemble >= 2, ">= 2"),
            ("target_min_of", 1 <= self.target_min_of <= self.ensemble, "from 1 to algo.ensemble"),
            ("n_step", self.n_step >= 1, ">= 1"),
            *super().checks(),
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("demo_fraction", 0.0 <= self.demo_fraction < 1.0, "in [0, 1)"),
            ("init_alpha", self.init_alpha > 0, "> 0"),
            ("target_entropy", self.target_entropy == "auto" or isinstance(self.target_entropy, (int, float)),
             "auto or a number"),
            ("exploration_noise", self.exploration_noise >= 0, ">= 0"),
            ("target_noise", self.target_noise >= 0, ">= 0"),
            ("policy_delay", self.policy_delay >= 1, ">= 1"),
            ("reward_shaping", self.reward_shaping >= 0, ">= 0"),
            ("warmup_env_steps", self.warmup_env_steps >= 0, ">= 0"),
            ("critic_only_steps", self.critic_only_steps >= 0, ">= 0"),
            ("reach_ramp_steps", self.reach_ramp_steps >= 0, ">= 0"),
            ("floor_reach", self.floor_reach is None or 0 < self.floor_reach < 1, "in (0, 1) or null"),
            ("interventions", self.interventions in ("none", "expert"), "none or expert"),
            ("intervention_trigger", self.intervention_trigger in TRIGGERS, " or ".join(TRIGGERS)),
            ("stall_steps", self.stall_steps >= 1, ">= 1"),
            ("intervention_prob", 0.0 <= self.intervention_prob <= 1.0, "in [0, 1]"),
            ("intervention_steps", self.intervention_steps >= 1, ">= 1"),
        ]


def validate_config(cfg: Any) -> None:
    """Called by `embodied-rl finetune` before any work."""
    config = ResidualOffPolicyConfig.from_cfg(cfg.algo)
    rewards = reward_settings(cfg)  # a bad algo.reward or reward= is an error
    if config.reward_shaping and not rewards.sparse:
        raise UserError("algo.reward_shaping adds to the sparse success reward: it needs algo.reward auto or success "
                        "on a task with success, and the simulator's reward (not reward=model:PATH)")
    find_demo_path(cfg)  # a bad algo.data is an error
    if isinstance(config.residual_dims, list):
        from embodied_rl.envs.registry import task_class

        action_dim = task_class(cfg.task.name).action_dim
        if max(config.residual_dims) >= action_dim:
            raise UserError(f"algo.residual_dims names action dim {max(config.residual_dims)}; task {cfg.task.name} "
                            f"acts in {action_dim} (0 to {action_dim - 1})")
    if config.interventions == "expert" and not cfg.task.get("expert", False):
        raise UserError(f"algo.interventions=expert needs a scripted expert; task {cfg.task.name} has none")


# --------------------------------------------------------------------------------------------
# The learner
# --------------------------------------------------------------------------------------------


class ResidualOffPolicyLearner:
    """Residual actor + Q ensemble + their optimisers and updates (TD3 or SAC, config `learner`).
    `state_dict()` / `load_state_dict()` cover every network, target, the entropy coefficient and
    the learner's RNG (a checkpoint resumes it exactly)."""

    def __init__(self, algo: ResidualOffPolicyConfig, obs_dim: int, action_dim: int, device: torch.device, seed: int,
                 residual_dims: list[float] | None = None):
        self.algo, self.device = algo, device
        # the residual network's constructor arguments (agent.json)
        residual_dims = [1.0] * action_dim if residual_dims is None else list(residual_dims)
        self.config = {"obs_dim": obs_dim, "action_dim": action_dim, "hidden_sizes": list(algo.actor_hidden_sizes),
                       "residual_scale": algo.residual_scale, "learner": algo.learner,
                       "normalize_obs": algo.normalize_obs, "residual_dims": residual_dims}
        self.actor = make_residual_net(self.config).to(device)
        self.actor_target = make_residual_net(self.config).to(device).requires_grad_(False)
        self.actor_target.load_state_dict(self.actor.state_dict())
        critic_input = obs_dim + 2 * action_dim  # Q(s, b, a)
        self.critic, self.critic_target = critic_and_target(critic_input, algo.critic_hidden_sizes, algo.ensemble,
                                                            device)
        # foreach: one kernel per step for all parameters (the per-tensor CPU default was ~12% of an update)
        self.actor_optimizer = torch.optim.Adam(self.actor.parameters(), lr=float(algo.actor_lr), foreach=True)
        self.critic_optimizer = torch.optim.Adam(self.critic.parameters(), lr=float(algo.critic_lr), foreach=True)
        self.log_alpha = torch.tensor(float(np.log(algo.init_alpha)), device=device, requires_grad=True)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=float(algo.critic_lr))
        self.target_entropy = float(algo.target_entropy) if algo.target_entropy != "auto" else -sum(residual_dims)
        self.generator = torch.Generator().manual_seed(seed)
        self.updates = 0

    def set_reach(self, fraction: float) -> None:
        """Bound the residual to `fraction` of residual_scale (the ramp of WarmStart.reach); the
        saved agent (agent.json) acts with the bound of the moment."""
        scale = float(self.algo.residual_scale) * fraction
        self.actor.scale = self.actor_target.scale = scale
        self.config["residual_scale"] = scale

    def optimizers(self) -> dict[str, Any]:
        return {"actor": self.actor_optimizer, "critic": self.critic_optimizer, "alpha": self.alpha_optimizer}

    def explore(self, obs: Tensor, base: Tensor) -> Tensor:
        """Residual for data collection: SAC samples; TD3 adds Gaussian exploration noise."""
        with torch.no_grad():
            residual, _ = self.actor.sample(obs, base)
            if self.algo.learner == "td3":
                full = float(self.algo.residual_scale)
                noise = torch.randn_like(residual) * float(self.algo.exploration_noise) * full * self.actor.dims
                residual = (residual + noise).clamp(-full, full)
        return residual

    def _next_action(self, obs: Tensor, base: Tensor) -> tuple[Tensor, Tensor]:
        if self.algo.learner == "td3":  # target policy smoothing
            residual = self.actor_target(obs, base)
            noise = (torch.randn_like(residual) * float(self.algo.target_noise) * self.actor.scale).clamp(
                -0.5 * self.actor.scale, 0.5 * self.actor.scale) * self.actor.dims
            return (base + residual + noise).clamp(-1, 1), torch.zeros(len(obs), device=obs.device)
        residual, log_prob = self.actor.sample(obs, base)
        return (base + residual).clamp(-1, 1), log_prob

    def update(self, batch: dict[str, Tensor], update_actor: bool) -> dict[str, float]:
        alpha = self.log_alpha.exp().detach() if self.algo.learner == "sac" else torch.zeros((), device=self.device)
        with torch.no_grad():
            next_action, next_log_prob = self._next_action(batch["next_obs"], batch["next_base"])
            next_q = random_min(self.critic_target(batch["next_obs"], batch["next_base"], next_action),
                                int(self.algo.target_min_of), self.generator)
            target = batch["reward"] + batch["discount"] * (next_q - alpha * next_log_prob)
        critic_loss, q = critic_step(self.critic, self.critic_optimizer, target, batch["obs"], batch["base"],
                                     batch["action"])
        stats = {"train/critic_loss": critic_loss.item(), "train/q": q.mean().item()}

        self.updates += 1
        delay = int(self.algo.policy_delay) if self.algo.learner == "td3" else 1
        if update_actor and self.updates % delay == 0:
            residual, log_prob = self.actor.sample(batch["obs"], batch["base"])
            if self.algo.learner == "td3":
                residual = self.actor(batch["obs"], batch["base"])
            action = (batch["base"] + residual).clamp(-1, 1)
            q_pi = actor_q(self.critic, batch["obs"], batch["base"], action, reduce=self.algo.actor_q)
            # Adam normalises gradient scale away, so even a faint but consistent critic slope
            # saturates tanh within a few hundred updates; the penalty keeps a residual only
            # where dQ/dr beats 2 * residual_penalty * (r / scale).
            penalty = self.algo.residual_penalty * (residual / self.actor.scale).pow(2).sum(-1)
            actor_loss = (alpha * log_prob - q_pi + penalty).mean()
            self.actor_optimizer.zero_grad()
            actor_loss.backward()
            distributed.average_gradients(self.actor.parameters())
            self.actor_optimizer.step()
            stats.update({"train/actor_loss": actor_loss.item(), "train/residual_abs": residual.abs().mean().item()})
            if self.algo.learner == "sac":
                alpha_loss = -(self.log_alpha * (log_prob.detach() + self.target_entropy)).mean()
                self.alpha_optimizer.zero_grad()
                alpha_loss.backward()
                distributed.average_gradients([self.log_alpha])
                self.alpha_optimizer.step()
                stats["train/alpha"] = float(alpha)
            polyak(self.actor, self.actor_target, float(self.algo.tau))
        polyak(self.critic, self.critic_target, float(self.algo.tau))
        return stats

    def state_dict(self) -> dict[str, Any]:
        return {"actor": self.actor.state_dict(), "critic": self.critic.state_dict(),
                "actor_target": self.actor_target.state_dict(), "critic_target": self.critic_target.state_dict(),
                "log_alpha": self.log_alpha.detach().cpu(), "generator": self.generator.get_state(),
                "updates": torch.tensor(self.updates)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("actor", "critic", "actor_target", "critic_target"):
            getattr(self, name).load_state_dict(state[name])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"].to(self.device))
        self.generator.set_state(state["generator"])
        self.updates = int(state["updates"])


# --------------------------------------------------------------------------------------------
# embodied-rl finetune algo=residual_offpolicy
# --------------------------------------------------------------------------------------------


DATA_PARALLEL = True  # runs under torchrun (embodied_rl/distributed.py)


def live_dims(cfg: Any, algo: ResidualOffPolicyConfig, action_dim: int) -> list[float] | None:
    """Per action dim, 1 where the residual acts and 0 where it is off (None: every dim), as
    `residual_dims` says. Why a list: a residual needs only the dims the BC policy gets wrong
    (LIBERO: an oracle residual on translation and gripper reaches 98% at 0.5, as on every dim;
    docs/finetuning.md), and every dim left out is one the actor cannot drift on."""
    if algo.residual_dims == "all":
        return None
    if algo.residual_dims == "demos":
        return demo_action_dims(cfg, action_dim)
    return [1.0 if d in algo.residual_dims else 0.0 for d in range(action_dim)]


def finetune(cfg: Any, run: Any, env: Any, policy: Any) -> dict[str, Any]:
    """Collect with base + residual, update at the UTD ratio, evaluate and checkpoint."""
    algo = ResidualOffPolicyConfig.from_cfg(cfg.algo)
    seed, device = freeze_and_seed(cfg, policy)
    num_envs = int(env.num_envs)
    obs_dim = policy.feature_dim if algo.normalize_obs else policy.obs_dim  # the size of head_input
    action_dim = int(env.single_action_space.shape[0])
    learner = ResidualOffPolicyLearner(algo, obs_dim, action_dim, device, seed, live_dims(cfg, algo, action_dim))
    distributed.broadcast_modules([learner.actor, learner.actor_target, learner.critic, learner.critic_target])
    distributed.seed_rank(seed)  # the ranks explore and sample their replay with different noise
    warm_start = WarmStart(algo.warmup_env_steps, algo.critic_only_steps, algo.reach_ramp_steps)
    rewards = reward_settings(cfg)
    shaping = PotentialShaping(algo.reward_shaping, algo.gamma) if algo.reward_shaping else None
    shapes = {"obs": (obs_dim,), "base": (action_dim,), "action": (action_dim,), "reward": (), "discount": (),
              "next_obs": (obs_dim,), "next_base": (action_dim,)}
    replay = Replay(algo.buffer_size, shapes, device)
    intervened = Replay(algo.buffer_size, shapes, device)  # the expert's steps: demos too

    def features(obs: Obs) -> Tensor:  # what the actor and the critics see (the replay stores it)
        return head_input(policy, map_obs(lambda o: o.to(device), obs), algo.normalize_obs)

    demos = None
    dataset, success_terminates = load_demos(cfg, env) if algo.demo_fraction > 0 else (None, True)
    if dataset is not None:
        demos = demo_transitions(dataset, policy, algo.gamma, success_terminates, device, rewards.demo_sparse)
        for key in ("obs", "next_obs"):
            demos[key] = features(demos[key])
    takeover = ExpertTakeover(num_envs)
    if algo.interventions == "expert":
        from embodied_rl.envs.experts import make_expert

        schedule = InterventionSchedule(num_envs, algo.intervention_trigger, algo.stall_steps, algo.intervention_prob,
                                        algo.intervention_steps, distributed.rank_seed(seed) + 3)
        expert = make_expert(cfg.task.name, env, quality=1.0,
                             generator=torch.Generator().manual_seed(distributed.rank_seed(seed) + 4))
        takeover = ExpertTakeover(num_envs, schedule, expert)
    demo_generator = torch.Generator().manual_seed(distributed.rank_seed(seed) + 1)
    # the online part of a batch draws from torch's global generator (a checkpoint saves it)
    batches = MixedBatches(replay, demos, algo.batch_size, algo.demo_fraction, None, demo_generator, intervened)
    budget = UpdateBudget(algo.utd_ratio)

    def write_agent(path: Path) -> None:
        save_agent(path, AGENT_KIND, learner.config, residual_tensors(learner.actor, learner.critic), policy)

    def make_agent(n: int) -> ResidualAgent:
        return ResidualAgent(learner.actor, policy, n, algo.normalize_obs)

    # every env trains at the ramp's reach; what evaluations and checkpoints act with is judged on
    # paired evaluations: the floor until the training reach is shown better (docs/finetuning.md, "What acts is judged").
    # Judging needs evaluations: with eval_every=0 the start and the end are evaluated, and the end judged
    evaluation = JudgedEvaluation(EnvEvaluation(cfg, run, make_agent, policy.env_options()), learner, algo.floor_reach)
    loop = FinetuneLoop(cfg, run, evaluation)
    saved = loop.resume({"learner": learner}, learner.optimizers(), write_agent)
    loop.start(f"finetune {algo.name}", instructions=env.instructions)  # step 0: the base policy, unjudged
    queue = PolicyRunner(policy, num_envs, seed=distributed.rank_seed(seed))
    window: list[dict[str, Tensor]] = []  # the last n_step steps, whose n-step returns are not complete yet
    stats: dict[str, float] = {}
    if saved is None or saved["env"] is None:  # new episodes: a new run, or a backend without snapshots
        obs, _ = env.reset(seed=distributed.rank_seed(seed + loop.env_steps))
        base = queue.act(obs)
    else:  # continue exactly where the checkpoint stopped
        env.set_state(saved["env"])
        obs, base, window = saved["obs"], saved["base"], saved["window"]
        queue.load_state_dict(saved["queue"])
        if shaping is not None:
            shaping.load_state(saved["shaping"])
    if saved is not None:
        demo_generator.set_state(saved["demo_generator"])
        budget.load_state_dict(saved["pending_updates"])
        if "replay" in saved:  # absent with save_replay=false: the resumed run refills it
            replay.load_state_dict(saved["replay"]["online"])
            intervened.load_state_dict(saved["replay"]["intervened"])
        takeover.load_state_dict(saved)

    def loop_state() -> dict[str, Any]:
        return {"env": env_snapshot(env), "obs": obs, "base": base, "window": window, "queue": queue.state_dict(),
                "demo_generator": demo_generator.get_state(), "pending_updates": budget.state_dict(),
                "replay": {"online": replay.state_dict(), "intervened": intervened.state_dict()},
                **takeover.state_dict(), **({"shaping": shaping.state()} if shaping is not None else {})}

    while loop.env_steps < loop.total_env_steps:
        phase = warm_start.phase(loop.env_steps)
        reach = warm_start.reach(loop.env_steps)
        learner.set_reach(reach)
        obs_features = features(obs)  # once per step: for the actor now, and for the replay
        residual = (torch.zeros_like(base) if phase == WARMUP
                    else learner.explore(obs_features, base.to(device)).to(base.device))
        action = takeover.act(obs, (base + residual).clamp(-1.0, 1.0))
        next_obs, reward, terminated, truncated, info = env.step(action)
        done = terminated | truncated
        takeover.after_step(reward, done, info)
        final_obs = where_obs(done, info["final_obs"], next_obs)
        bootstrap_base = queue.peek(final_obs, done)  # what the base policy would do at final_obs
        queue.reset(done.cpu())
        next_base = queue.act(next_obs)
        train_reward = training_reward(reward, info, rewards.sparse)
        if shaping is not None:
            train_reward = train_reward + shaping(reward, done)
        window.append({"obs": obs_features, "base": base, "action": action,
                       "reward": train_reward, "terminated": terminated,
                       "truncated": truncated, "next_obs": features(final_obs),
                       "next_base": torch.where(done[:, None], bootstrap_base, next_base), "driven": takeover.driven})
        if len(window) == algo.n_step:  # the oldest step now has its n-step return
            steps = {key: torch.stack([w[key] for w in window]) for key in window[0]}
            ret, discount, last = nstep_returns(steps["reward"], steps["terminated"], steps["truncated"], algo.gamma)
            rows = torch.arange(num_envs, device=ret.device)
            transitions = {"obs": steps["obs"][0], "base": steps["base"][0], "action": steps["action"][0],
                           "reward": ret, "discount": discount, "next_obs": steps["next_obs"][last, rows],
                           "next_base": steps["next_base"][last, rows]}
            replay.add(transitions)
            by_expert = steps["driven"][0]
            if bool(by_expert.any()):
                intervened.add({k: v[by_expert.to(v.device)] for k, v in transitions.items()})
            window.pop(0)
        obs, base = next_obs, next_base
        loop.advance(num_envs, info)

        if phase != WARMUP and replay.size > 0:
            budget.add(num_envs)
            while budget.take():
                stats = learner.update(batches.sample(), update_actor=phase == FULL)
                for key in ("train/critic_loss", "train/actor_loss"):  # divergence stops the run
                    if key in stats:
                        loop.check_finite(key, stats[key], stats)

        row = {**stats, "train/phase": {WARMUP: 0, CRITIC: 1, FULL: 2}[phase], "train/reach": reach,
               **takeover.metrics()}
        if loop.log(row):
            takeover.window_logged()
        # what an evaluation or a checkpoint at this boundary acts with
        learner.set_reach(evaluation.deployed_reach(reach))
        evaluation.train_reach = reach
        loop.boundary(loop_state)
    return loop.finish(loop_state)
