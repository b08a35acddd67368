"""Residual off-policy RL (ResFiT): SAC or TD3 on a per-step residual over a frozen chunk policy.

Ankile et al. (2025), "From Imitation to Refinement: Residual RL for Precise Assembly" / ResFiT:
a frozen BC policy proposes b_t; an actor on [obs, b_t] adds a bounded correction (zero at the
start); the critic is an ensemble Q_1..Q_E(s, b, a) with LayerNorm whose TD target is the
minimum over a random pair of target critics (REDQ); n-step returns are computed per env over
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
from omegaconf import OmegaConf
from torch import Tensor, nn

from embodied_rl import distributed
from embodied_rl.actors import save_agent
from embodied_rl.actors.base import head_input, layer_norm_mlp
from embodied_rl.actors.residual_offpolicy import (
    AGENT_KIND,
    ResidualAgent,
    make_residual_net,
    residual_tensors,
)
from embodied_rl.algos.common import FinetuneLoop, env_snapshot, reward_settings, training_reward
from embodied_rl.algos.interventions import (
    TRIGGERS,
    InterventionSchedule,
    expert_state,
    load_expert_state,
)
from embodied_rl.algos.wsrl import CRITIC, FULL, WARMUP, WarmStart
from embodied_rl.errors import UserError
from embodied_rl.policies import PolicyRunner
from embodied_rl.policies.base import Obs
from embodied_rl.policies.runner import index_obs, map_obs, where_obs

# --------------------------------------------------------------------------------------------
# Pure pieces: n-step returns and the random-pair target
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


def random_pair_min(q_values: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """[E, B] ensemble values -> [B]: the minimum over two distinct critics drawn at random
    (one pair per batch, as in REDQ)."""
    ensemble = q_values.shape[0]
    if ensemble < 2:
        return q_values[0]
    pair = torch.randperm(ensemble, generator=generator)[:2].to(q_values.device)
    return q_values[pair].min(0).values


class QEnsemble(nn.Module):
    """E LayerNorm critics Q(s, b, a) -> [E, B]."""

    def __init__(self, obs_dim: int, action_dim: int, hidden_sizes: list[int], ensemble: int):
        super().__init__()
        self.critics = nn.ModuleList(layer_norm_mlp(obs_dim + 2 * action_dim, 1, hidden_sizes) for _ in range(ensemble))

    def forward(self, obs: Tensor, base: Tensor, action: Tensor) -> Tensor:
        x = torch.cat([obs, base, action], dim=-1)
        return torch.stack([q(x).squeeze(-1) for q in self.critics])


# --------------------------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------------------------

FIELDS = ("obs", "base", "action", "reward", "discount", "next_obs", "next_base")


class Replay:
    """A circular buffer of n-step transitions (torch tensors on one device) holding at most
    `capacity`. Its storage grows (doubling) as it fills, so a short run or a small share of the
    steps (the intervened ones) does not hold `capacity` rows of memory."""

    def __init__(self, capacity: int, obs_dim: int, action_dim: int, device: torch.device):
        self.dims = {"obs": obs_dim, "base": action_dim, "action": action_dim, "reward": 0, "discount": 0,
                     "next_obs": obs_dim, "next_base": action_dim}
        self.capacity, self.size, self.pos, self.device = int(capacity), 0, 0, device
        self.data: dict[str, Tensor] = {}
        self._reserve(min(self.capacity, 1024))

    def _reserve(self, rows: int) -> None:
        """Storage for at least `rows` transitions (at most `capacity`)."""
        held = len(self.data["obs"]) if self.data else 0
        if rows <= held:
            return
        rows = min(self.capacity, max(rows, 2 * held))
        grown = {k: torch.zeros((rows, d) if d else (rows,), device=self.device) for k, d in self.dims.items()}
        for key, value in self.data.items():
            grown[key][:held] = value
        self.data = grown

    def add(self, batch: dict[str, Tensor]) -> None:
        n = len(batch["obs"])
        self._reserve(min(self.pos + n, self.capacity))  # the buffer wraps only once it is full
        idx = (self.pos + torch.arange(n)) % self.capacity
        for key in FIELDS:
            self.data[key][idx.to(self.data[key].device)] = batch[key].to(self.data[key])
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, n: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        return self.rows(torch.randint(0, self.size, (n,), generator=generator))

    def rows(self, idx: Tensor) -> dict[str, Tensor]:
        """The transitions at positions `idx` (< size)."""
        return {k: v[idx.to(v.device)] for k, v in self.data.items()}

    def state_dict(self) -> dict[str, Any]:
        """The filled part of the buffer and its write position (what a checkpoint saves)."""
        return {"data": {k: v[: self.size].cpu() for k, v in self.data.items()},
                "pos": torch.tensor(self.pos), "size": torch.tensor(self.size)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        size = int(state["size"])
        if size > self.capacity:
            raise UserError(f"the saved replay buffer holds {size} transitions, more than algo.buffer_size={self.capacity}")
        self._reserve(size)
        for key, value in state["data"].items():
            self.data[key][:size] = value.to(self.data[key])
        self.pos, self.size = int(state["pos"]) % self.capacity, size


def demo_transitions(dataset: Any, policy: Any, gamma: float, success_terminates: bool, device: torch.device,
                     sparse: bool = False) -> dict[str, Tensor]:
    """1-step transitions of a demo dataset; base actions relabelled by running the base policy's
    queue over each episode (replanning every n_action_steps from the episode's start, as online).
    The last step of a successful episode is terminal when the task ends on success; the last
    step of any other episode has no next observation and is dropped. `sparse`: the reward is 1
    on the last step of a successful episode, else 0 (the online `algo.reward=success`)."""
    obs_all = dataset_obs(dataset, policy)
    act_all = torch.as_tensor(np.asarray(dataset.action), dtype=torch.float32)
    rew_all = torch.as_tensor(np.asarray(dataset.reward), dtype=torch.float32)
    successes = np.asarray(dataset.episode_success, dtype=bool) if hasattr(dataset, "episode_success") else None
    to, ha = int(policy.n_obs_steps), int(policy.n_action_steps)
    start_index = to - 1
    out: dict[str, list[Tensor]] = {k: [] for k in FIELDS}
    for episode in range(dataset.num_episodes):
        start, end = dataset.episode_bounds(episode)
        obs, act, rew = index_obs(obs_all, slice(start, end)), act_all[start:end], rew_all[start:end]
        length = end - start
        anchors = torch.arange(0, length, ha)
        window = (anchors[:, None] - torch.arange(to - 1, -1, -1)[None]).clamp(min=0)  # history indices
        with torch.no_grad():
            device_p = next(policy.parameters()).device
            history = map_obs(lambda o, rows=window, device=device_p: o[rows].to(device), obs)
            chunks = policy.predict_chunk(history, generator=torch.Generator(device=device_p).manual_seed(episode))
        base = chunks[:, start_index : start_index + ha].reshape(-1, act.shape[-1])[:length].float().cpu()
        terminal = bool(successes[episode]) and success_terminates if successes is not None else False
        if sparse:
            rew = torch.zeros(length)
            if successes is not None and bool(successes[episode]):
                rew[-1] = 1.0
        last = length if terminal else length - 1
        if last <= 0:
            continue
        nxt = torch.arange(1, last + 1).clamp(max=length - 1)
        discount = torch.full((last,), gamma)
        if terminal:
            discount[-1] = 0.0
        for key, value in (("obs", index_obs(obs, slice(0, last))), ("base", base[:last]), ("action", act[:last]),
                           ("reward", rew[:last]), ("discount", discount), ("next_obs", index_obs(obs, nxt)),
                           ("next_base", base[nxt])):
            out[key].append(value)
    if not out["obs"]:
        raise UserError("the demo dataset has no usable transitions (episodes of length 1?)")
    return {k: map_obs(lambda *parts: torch.cat(parts).to(device), *v) for k, v in out.items()}


def dataset_obs(dataset: Any, policy: Any) -> Obs:
    """Every step's observation of a demo dataset as the env gives it to `policy`: the state
    tensor [T, D], or a dict with the pixels and instruction ids where the policy reads them."""
    state = torch.as_tensor(np.asarray(dataset.obs), dtype=torch.float32)
    entries: dict[str, Tensor] = {}
    if policy.obs_mode == "pixels":
        if dataset.pixels is None:
            raise UserError(f"the base policy reads pixels but the demo dataset '{dataset.path}' has none")
        entries["pixels"] = torch.from_numpy(np.asarray(dataset.pixels))
    if policy.instructions:
        if dataset.instruction is None:
            raise UserError(f"the base policy reads instructions but the demo dataset '{dataset.path}' has none")
        entries["instruction"] = torch.as_tensor(np.asarray(dataset.instruction), dtype=torch.long)
    return {"state": state, **entries} if entries else state


def find_demo_path(cfg: Any) -> Path | None:
    """algo.data, else the data path the BC checkpoint recorded (config.json "extra")."""
    explicit = cfg.algo.get("data")
    if explicit:
        path = Path(explicit)
        if not path.exists():
            raise UserError(f"algo.data '{path}' does not exist")
        return path
    if not cfg.get("checkpoint"):
        return None
    from embodied_rl.policies import read_config

    checkpoint = Path(cfg.checkpoint)
    for candidate in (checkpoint, checkpoint / "checkpoints" / "last", checkpoint / "base_policy"):
        if (candidate / "config.json").exists():
            try:
                extra = read_config(candidate).get("extra", {}) or {}
            except Exception:
                continue
            for key in ("data", "data_path", "dataset"):
                if extra.get(key) and Path(extra[key]).exists():
                    return Path(extra[key])
    return None


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResidualOffPolicyConfig:
    """configs/algo/residual_offpolicy.yaml (the one home of its defaults; algo=residual_sac is
    the same file under its former name)."""

    name: str
    learner: str               # td3 | sac
    residual_scale: float
    residual_penalty: float
    normalize_obs: bool
    actor_hidden_sizes: list[int]
    critic_hidden_sizes: list[int]
    ensemble: int
    n_step: int
    gamma: float
    tau: float
    actor_lr: float
    critic_lr: float
    batch_size: int
    buffer_size: int
    utd_ratio: float
    demo_fraction: float
    data: str | None
    init_alpha: float
    target_entropy: Any        # "auto" or a number
    exploration_noise: float
    target_noise: float
    policy_delay: int
    reward: str
    warmup_env_steps: int
    critic_only_steps: int
    interventions: str         # none | expert
    intervention_trigger: str  # stall | random
    stall_steps: int
    intervention_prob: float
    intervention_steps: int

    @classmethod
    def from_cfg(cls, algo: Any) -> ResidualOffPolicyConfig:
        config = cls(**OmegaConf.to_container(algo, resolve=True))
        checks = [
            ("learner", config.learner in ("td3", "sac"), "td3 or sac"),
            ("residual_scale", config.residual_scale > 0, "> 0"),
            ("residual_penalty", config.residual_penalty >= 0, ">= 0"),
            ("actor_hidden_sizes", all(h >= 1 for h in config.actor_hidden_sizes), "a list of sizes >= 1"),
            ("critic_hidden_sizes", all(h >= 1 for h in config.critic_hidden_sizes), "a list of sizes >= 1"),
            ("ensemble", config.ensemble >= 2, ">= 2"),
            ("n_step", config.n_step >= 1, ">= 1"),
            ("gamma", 0.0 <= config.gamma <= 1.0, "in [0, 1]"),
            ("tau", 0.0 < config.tau <= 1.0, "in (0, 1]"),
            ("actor_lr", config.actor_lr > 0, "> 0"),
            ("critic_lr", config.critic_lr > 0, "> 0"),
            ("batch_size", config.batch_size >= 1, ">= 1"),
            ("buffer_size", config.buffer_size >= 1, ">= 1"),
            ("utd_ratio", config.utd_ratio > 0, "> 0"),
            ("demo_fraction", 0.0 <= config.demo_fraction < 1.0, "in [0, 1)"),
            ("init_alpha", config.init_alpha > 0, "> 0"),
            ("target_entropy", config.target_entropy == "auto" or isinstance(config.target_entropy, (int, float)),
             "auto or a number"),
            ("exploration_noise", config.exploration_noise >= 0, ">= 0"),
            ("target_noise", config.target_noise >= 0, ">= 0"),
            ("policy_delay", config.policy_delay >= 1, ">= 1"),
            ("warmup_env_steps", config.warmup_env_steps >= 0, ">= 0"),
            ("critic_only_steps", config.critic_only_steps >= 0, ">= 0"),
            ("interventions", config.interventions in ("none", "expert"), "none or expert"),
            ("intervention_trigger", config.intervention_trigger in TRIGGERS, " or ".join(TRIGGERS)),
            ("stall_steps", config.stall_steps >= 1, ">= 1"),
            ("intervention_prob", 0.0 <= config.intervention_prob <= 1.0, "in [0, 1]"),
            ("intervention_steps", config.intervention_steps >= 1, ">= 1"),
        ]
        for key, ok, expected in checks:
            if not ok:
                raise UserError(f"algo.{key} must be {expected}, got {getattr(config, key)!r}")
        return config


def validate_config(cfg: Any) -> None:
    """Called by `embodied-rl finetune` before any work."""
    config = ResidualOffPolicyConfig.from_cfg(cfg.algo)
    reward_settings(cfg)
    find_demo_path(cfg)  # a bad algo.data is an error
    if config.interventions == "expert" and not cfg.task.get("expert", False):
        raise UserError(f"algo.interventions=expert needs a scripted expert; task {cfg.task.name} has none")


# --------------------------------------------------------------------------------------------
# The learner
# --------------------------------------------------------------------------------------------


class ResidualSAC:
    """Residual actor + Q ensemble + their optimisers and updates (TD3 or SAC, config `learner`).
    `state_dict()` / `load_state_dict()` cover every network, target, the entropy coefficient and
    the learner's RNG (a checkpoint resumes it exactly)."""

    def __init__(self, algo: ResidualOffPolicyConfig, obs_dim: int, action_dim: int, device: torch.device, seed: int):
        self.algo, self.device = algo, device
        # the residual network's constructor arguments (agent.json); "actor" names the learner
        self.config = {"obs_dim": obs_dim, "action_dim": action_dim, "hidden_sizes": list(algo.actor_hidden_sizes),
                       "residual_scale": algo.residual_scale, "actor": algo.learner,
                       "normalize_obs": algo.normalize_obs}
        self.actor = make_residual_net(self.config).to(device)
        self.actor_target = make_residual_net(self.config).to(device).requires_grad_(False)
        self.actor_target.load_state_dict(self.actor.state_dict())
        self.critic = QEnsemble(obs_dim, action_dim, list(algo.critic_hidden_sizes), int(algo.ensemble)).to(device)
        self.critic_target = QEnsemble(obs_dim, action_dim, list(algo.critic_hidden_sizes), int(algo.ensemble)).to(device)
        self.critic_target.load_state_dict(self.critic.state_dict())
        self.critic_target.requires_grad_(False)
        # foreach: one kernel per step for all parameters (the per-tensor CPU default was ~12% of an update)
        self.actor_optimizer = torch.optim.Adam(self.actor.parameters(), lr=float(algo.actor_lr), foreach=True)
        self.critic_optimizer = torch.optim.Adam(self.critic.parameters(), lr=float(algo.critic_lr), foreach=True)
        self.log_alpha = torch.tensor(float(np.log(algo.init_alpha)), device=device, requires_grad=True)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=float(algo.critic_lr))
        self.target_entropy = float(algo.target_entropy) if algo.target_entropy != "auto" else -float(action_dim)
        self.generator = torch.Generator().manual_seed(seed)
        self.updates = 0

    def optimizers(self) -> dict[str, Any]:
        return {"actor": self.actor_optimizer, "critic": self.critic_optimizer, "alpha": self.alpha_optimizer}

    def explore(self, obs: Tensor, base: Tensor) -> Tensor:
        """Residual for data collection: SAC samples; TD3 adds Gaussian exploration noise."""
        with torch.no_grad():
            residual, _ = self.actor.sample(obs, base)
            if self.algo.learner == "td3":
                noise = torch.randn_like(residual) * float(self.algo.exploration_noise) * self.actor.scale
                residual = (residual + noise).clamp(-self.actor.scale, self.actor.scale)
        return residual

    def _next_action(self, obs: Tensor, base: Tensor) -> tuple[Tensor, Tensor]:
        if self.algo.learner == "td3":  # target policy smoothing
            residual = self.actor_target(obs, base)
            noise = (torch.randn_like(residual) * float(self.algo.target_noise) * self.actor.scale).clamp(
                -0.5 * self.actor.scale, 0.5 * self.actor.scale)
            return (base + residual + noise).clamp(-1, 1), torch.zeros(len(obs), device=obs.device)
        residual, log_prob = self.actor.sample(obs, base)
        return (base + residual).clamp(-1, 1), log_prob

    def update(self, batch: dict[str, Tensor], update_actor: bool) -> dict[str, float]:
        alpha = self.log_alpha.exp().detach() if self.algo.learner == "sac" else torch.zeros((), device=self.device)
        with torch.no_grad():
            next_action, next_log_prob = self._next_action(batch["next_obs"], batch["next_base"])
            next_q = random_pair_min(self.critic_target(batch["next_obs"], batch["next_base"], next_action), self.generator)
            target = batch["reward"] + batch["discount"] * (next_q - alpha * next_log_prob)
        q = self.critic(batch["obs"], batch["base"], batch["action"])
        critic_loss = ((q - target[None]) ** 2).mean(1).sum()
        self.critic_optimizer.zero_grad()
        critic_loss.backward()
        distributed.average_gradients(self.critic.parameters())
        self.critic_optimizer.step()
        stats = {"train/critic_loss": critic_loss.item(), "train/q": q.mean().item()}

        self.updates += 1
        delay = int(self.algo.policy_delay) if self.algo.learner == "td3" else 1
        if update_actor and self.updates % delay == 0:
            residual, log_prob = self.actor.sample(batch["obs"], batch["base"])
            if self.algo.learner == "td3":
                residual = self.actor(batch["obs"], batch["base"])
            action = (batch["base"] + residual).clamp(-1, 1)
            self.critic.requires_grad_(False)  # the actor loss needs dQ/da only, not critic weight grads
            q_pi = self.critic(batch["obs"], batch["base"], action).mean(0)
            self.critic.requires_grad_(True)
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
            _polyak(self.actor, self.actor_target, float(self.algo.tau))
        _polyak(self.critic, self.critic_target, float(self.algo.tau))
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


@torch.no_grad()
def _polyak(source: nn.Module, target: nn.Module, tau: float) -> None:
    torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), tau)


# --------------------------------------------------------------------------------------------
# embodied-rl finetune algo=residual_offpolicy
# --------------------------------------------------------------------------------------------


DATA_PARALLEL = True  # runs under torchrun (embodied_rl/distributed.py)


def finetune(cfg: Any, run: Any, env: Any, policy: Any) -> dict[str, Any]:
    """Collect with base + residual, update at the UTD ratio, evaluate and checkpoint."""
    from embodied_rl.data.dataset import DemoDataset

    algo = ResidualOffPolicyConfig.from_cfg(cfg.algo)
    seed = int(cfg.seed)
    torch.manual_seed(seed)
    device = torch.device(str(cfg.device))
    policy.eval()
    policy.requires_grad_(False)
    num_envs = int(env.num_envs)
    obs_dim = policy.feature_dim if algo.normalize_obs else policy.obs_dim  # the size of head_input
    action_dim = int(env.single_action_space.shape[0])
    learner = ResidualSAC(algo, obs_dim, action_dim, device, seed)
    distributed.broadcast_modules([learner.actor, learner.actor_target, learner.critic, learner.critic_target])
    distributed.seed_rank(seed)  # the ranks explore and sample their replay with different noise
    warm_start = WarmStart(algo.warmup_env_steps, algo.critic_only_steps)
    sparse = reward_settings(cfg).sparse
    replay = Replay(algo.buffer_size, obs_dim, action_dim, device)

    def features(obs: Obs) -> Tensor:  # what the actor and the critics see (the replay stores it)
        return head_input(policy, map_obs(lambda o: o.to(device), obs), algo.normalize_obs)

    demos = None
    demo_path = find_demo_path(cfg) if algo.demo_fraction > 0 else None
    if demo_path is not None:
        task = getattr(env, "task", None)
        demos = demo_transitions(DemoDataset.load(demo_path), policy, algo.gamma,
                                 bool(getattr(task, "success_terminates", True)), device, sparse)
        for key in ("obs", "next_obs"):
            demos[key] = features(demos[key])
    interventions = expert = None
    if algo.interventions == "expert":
        from embodied_rl.envs.experts import make_expert

        interventions = InterventionSchedule(num_envs, algo.intervention_trigger, algo.stall_steps,
                                             algo.intervention_prob, algo.intervention_steps,
                                             distributed.rank_seed(seed) + 3)
        expert = make_expert(cfg.task.name, env, quality=1.0,
                             generator=torch.Generator().manual_seed(distributed.rank_seed(seed) + 4))
    intervened = Replay(algo.buffer_size, obs_dim, action_dim, device)  # the expert's steps: demos too
    demo_batch = int(round(algo.batch_size * algo.demo_fraction))
    demo_generator = torch.Generator().manual_seed(distributed.rank_seed(seed) + 1)

    def sample_demos(n: int) -> dict[str, Tensor]:
        """n transitions drawn uniformly from the demos and the intervened steps together."""
        offline = len(demos["obs"]) if demos is not None else 0
        idx = torch.randint(0, offline + intervened.size, (n,), generator=demo_generator)
        parts = []
        if offline:
            parts.append({k: demos[k][idx[idx < offline].to(device)] for k in FIELDS})
        if intervened.size:
            parts.append(intervened.rows(idx[idx >= offline] - offline))
        return {k: torch.cat([part[k] for part in parts]) for k in FIELDS}

    def write_agent(path: Path) -> None:
        save_agent(path, AGENT_KIND, learner.config, residual_tensors(learner.actor, learner.critic), policy)

    def make_agent(n: int) -> ResidualAgent:
        return ResidualAgent(learner.actor, policy, n, algo.normalize_obs)

    loop = FinetuneLoop(cfg, run, make_agent, policy.env_options())
    saved = loop.resume({"learner": learner}, learner.optimizers(), write_agent)
    queue = PolicyRunner(policy, num_envs, seed=distributed.rank_seed(seed))
    window: list[dict[str, Tensor]] = []  # the last n_step steps, whose n-step returns are not complete yet
    pending_updates = 0.0
    stats: dict[str, float] = {}
    assisted = torch.zeros(num_envs, dtype=torch.bool)  # episodes the expert drove at least one step of
    driven_steps = window_steps = 0
    unassisted: list[float] = []  # the successes of episodes without interventions, this logging window
    if saved is None or saved["env"] is None:  # new episodes: a new run, or a backend without snapshots
        obs, _ = env.reset(seed=distributed.rank_seed(seed + loop.env_steps))
        base = queue.act(obs)
    else:  # continue exactly where the checkpoint stopped
        env.set_state(saved["env"])
        obs, base, window = saved["obs"], saved["base"], saved["window"]
        queue.load_state_dict(saved["queue"])
    if saved is not None:
        demo_generator.set_state(saved["demo_generator"])
        pending_updates = float(saved["pending_updates"])
        if "replay" in saved:
            replay.load_state_dict(saved["replay"]["online"])
            intervened.load_state_dict(saved["replay"]["intervened"])
        if interventions is not None:
            interventions.load_state_dict(saved["interventions"])
            load_expert_state(expert, saved["expert"])
            assisted, unassisted = saved["assisted"], saved["unassisted"].tolist()
            driven_steps, window_steps = (int(x) for x in saved["intervention_window"])

    def loop_state() -> dict[str, Any]:
        state = {"env": env_snapshot(env), "obs": obs, "base": base, "window": window, "queue": queue.state_dict(),
                 "demo_generator": demo_generator.get_state(), "pending_updates": torch.tensor(pending_updates),
                 "replay": {"online": replay.state_dict(), "intervened": intervened.state_dict()}}
        if interventions is not None:
            state.update(interventions=interventions.state_dict(), expert=expert_state(expert), assisted=assisted,
                         unassisted=torch.tensor(unassisted, dtype=torch.float64),
                         intervention_window=torch.tensor([driven_steps, window_steps]))
        return state

    loop.start(f"finetune {algo.name}")
    while loop.env_steps < loop.total_env_steps:
        phase = warm_start.phase(loop.env_steps)
        obs_features = features(obs)  # once per step: for the actor now, and for the replay
        residual = torch.zeros_like(base) if phase == WARMUP else learner.explore(obs_features, base.to(device)).to(base.device)
        action = (base + residual).clamp(-1.0, 1.0)
        driven = torch.zeros(num_envs, dtype=torch.bool)
        if interventions is not None:  # the expert takes over where the trigger fires
            driven, starting = interventions.begin()
            if bool(starting.any()):  # a takeover plans afresh from the env's current state
                expert.reset(starting)
            if bool(driven.any()):
                action = torch.where(driven[:, None].to(action.device), expert.act(obs).to(action), action)
            assisted |= driven
            driven_steps += int(driven.sum())
        window_steps += num_envs
        next_obs, reward, terminated, truncated, info = env.step(action)
        done = terminated | truncated
        if interventions is not None:
            interventions.after_step(reward, done)
            ended = info["_episode"].cpu()
            unassisted += info["episode"]["success_once"].cpu()[ended & ~assisted].float().tolist()
            assisted &= ~done.cpu()
        final_obs = where_obs(done, info["final_obs"], next_obs)
        bootstrap_base = queue.peek(final_obs, done)  # what the base policy would do at final_obs
        queue.reset(done.cpu())
        next_base = queue.act(next_obs)
        window.append({"obs": obs_features, "base": base, "action": action,
                       "reward": training_reward(reward, info, sparse), "terminated": terminated,
                       "truncated": truncated, "next_obs": features(final_obs),
                       "next_base": torch.where(done[:, None], bootstrap_base, next_base), "driven": driven})
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
            pending_updates += algo.utd_ratio * num_envs
            while pending_updates >= 1:
                pending_updates -= 1
                take_demos = demo_batch if (demos is not None or intervened.size > 0) else 0
                batch = replay.sample(algo.batch_size - take_demos)
                if take_demos:
                    extra = sample_demos(take_demos)
                    batch = {k: torch.cat([batch[k], extra[k]]) for k in FIELDS}
                stats = learner.update(batch, update_actor=phase == FULL)
                for key in ("train/critic_loss", "train/actor_loss"):  # divergence stops the run
                    if key in stats:
                        loop.check_finite(key, stats[key], stats)

        row = {**stats, "train/phase": {WARMUP: 0, CRITIC: 1, FULL: 2}[phase]}
        if interventions is not None:
            row["train/intervention_rate"] = driven_steps / max(1, window_steps)
            if unassisted:
                row["rollout/success_rate_unassisted"] = sum(unassisted) / len(unassisted)
        if loop.log(row):
            driven_steps = window_steps = 0
            unassisted = []
        loop.boundary(loop_state)
    return loop.finish(loop_state())
