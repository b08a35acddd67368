"""DSRL and DSRL-NA: SAC in the latent-noise space of a frozen diffusion / flow policy.

DSRL (Wagenmaker et al., 2025, "Steering Your Diffusion Policy with Latent Space RL") keeps the
BC policy frozen and learns a policy over its initial noise w: each decision samples w from the
noise actor, runs the deterministic sampler once (w -> action chunk) and executes the chunk. The
noise MDP is an ordinary continuous-control problem, so Stable-Baselines3's SAC trains it as is,
on `LatentNoiseVecEnv` (actions: the noise box [-m, m]^(H*A)) with LayerNorm MLPs.

DSRL-NA (noise aliasing) adds a critic on executed actions, Q_A(s, a), trained by TD, and
distils it into the noise critic Q_W(s, w) by regressing Q_W(s, w) onto Q_A(s, pi_base(s, w))
for noises drawn from the base policy's prior: many noises map to the same chunk, and Q_W learns
that from Q_A instead of from separate, noisy TD targets. The noise actor maximises Q_W.

Both variants use the WSRL stages (algos/wsrl.py): base-policy rollouts, critic-only updates,
then full SAC. `finetune(cfg, run, env, policy)` is the `embodied-rl finetune algo=dsrl|dsrl_na`
entry point; see docs/finetuning.md ("Off-policy").
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from stable_baselines3 import SAC
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.utils import polyak_update, update_learning_rate
from torch import Tensor

from embodied_rl.actors import save_agent
from embodied_rl.actors.base import layer_norm_mlp
from embodied_rl.actors.latent_noise import (
    ACTION_CRITIC,
    ACTIVATIONS,
    AGENT_KIND,
    CRITIC_REDUCTIONS,
    LatentNoiseVecEnv,
    LayerNormSACPolicy,
    NoiseActorAgent,
    _ScaledActor,
    best_candidates,
    make_noise_critic,
)
from embodied_rl.algos.common import (
    AlgoConfig,
    EnvEvaluation,
    FinetuneLoop,
    env_snapshot,
    reward_settings,
)
from embodied_rl.algos.wsrl import CRITIC, FULL, WARMUP, WarmStart, deploy_check, judged_deployment
from embodied_rl.errors import UserError
from embodied_rl.policies import executed_actions

# --------------------------------------------------------------------------------------------
# Replay buffer that also keeps what DSRL-NA needs to re-run the base policy
# --------------------------------------------------------------------------------------------


class NoiseReplayBuffer(ReplayBuffer):
    """SB3's ReplayBuffer plus, per transition, the executed chunk and the base policy's
    conditioning (`encode_obs` of its obs history) before and after the step (from the VecEnv's
    infos): with it the base policy's sampler can be re-run on any noise."""

    def __init__(self, *args: Any, executed_dim: int = 0, cond_dim: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.executed = np.zeros((self.buffer_size, self.n_envs, executed_dim), np.float32)
        self.cond = np.zeros((self.buffer_size, self.n_envs, cond_dim), np.float32)
        self.next_cond = np.zeros((self.buffer_size, self.n_envs, cond_dim), np.float32)

    def add(self, obs, next_obs, action, reward, done, infos) -> None:
        self.executed[self.pos] = np.stack([info["executed_chunk"] for info in infos])
        self.cond[self.pos] = np.stack([info["base_cond"] for info in infos])
        self.next_cond[self.pos] = np.stack([info["next_base_cond"] for info in infos])
        super().add(obs, next_obs, action, reward, done, infos)

    def sample_with_extras(self, batch_size: int) -> tuple[ReplayBufferSamples, dict[str, Tensor]]:
        upper = self.buffer_size if self.full else self.pos
        rows = np.random.randint(0, upper, size=batch_size)
        envs = np.random.randint(0, self.n_envs, size=batch_size)
        samples = ReplayBufferSamples(
            *map(
                self.to_torch,
                (
                    self.observations[rows, envs],
                    self.actions[rows, envs],
                    self.next_observations[rows, envs],
                    (self.dones[rows, envs] * (1 - self.timeouts[rows, envs])).reshape(-1, 1),
                    self.rewards[rows, envs].reshape(-1, 1),
                ),
            )
        )
        extras = {
            "executed": self.to_torch(self.executed[rows, envs]),
            "cond": self.to_torch(self.cond[rows, envs]),
            "next_cond": self.to_torch(self.next_cond[rows, envs]),
        }
        return samples, extras


# --------------------------------------------------------------------------------------------
# SB3's SAC with the warm-start stages and the noise-aliasing critic
# --------------------------------------------------------------------------------------------


class DSRL(SAC):
    """stable_baselines3.SAC on a LatentNoiseVecEnv.

    - warm-up: actions are the base policy's own noise, w ~ N(0, I) clipped to [-m, m]; no updates;
      after it, samples of the noise actor, or with `rollout_candidates` N > 1 (DSRL-NA) the best of N
      samples under Q_A (the training rollouts act as the best-of-N evaluation agent does);
    - critic-only: SAC's critic update alone (the actor and the entropy coefficient stay put);
    - full: SB3's own `SAC.train` (DSRL) or the DSRL-NA update (noise_aliasing=True).
    """

    def __init__(
        self,
        env: LatentNoiseVecEnv,
        warm_start: WarmStart,
        noise_aliasing: bool = False,
        action_critic_arch: list[int] | None = None,
        action_critics: int = 2,
        critic_reduction: str = "min",
        actor_q: str = "noise_critic",
        value_expectile: float | None = None,
        activation: str = "relu",
        value_bounds: tuple[float, float] | None = None,
        rollout_candidates: int = 1,
        policy_delay: int = 1,
        actor_lr: float | None = None,
        **sac_kwargs: Any,
    ):
        self.noise_env = env
        self.actor_lr = actor_lr
        self.policy_delay = policy_delay
        self.rollout_candidates = rollout_candidates
        self.warm_start = warm_start
        self.noise_aliasing = noise_aliasing
        self.actor_q = actor_q
        self.value_expectile = value_expectile
        self.value_bounds = value_bounds
        if noise_aliasing:
            cond_dim = int(env.policy.cond_dim)
            executed_dim = env.n_action_steps * env.noise_shape[1]
            sac_kwargs["replay_buffer_class"] = NoiseReplayBuffer
            sac_kwargs["replay_buffer_kwargs"] = {"executed_dim": executed_dim, "cond_dim": cond_dim}
        super().__init__(LayerNormSACPolicy, env, **sac_kwargs)
        self.stats: dict[str, float] = {}
        if noise_aliasing:
            obs_dim = env.observation_space.shape[0]
            arch = list(action_critic_arch or self.policy.net_arch)
            self.action_critic = make_noise_critic(obs_dim, executed_dim, arch, action_critics, activation,
                                                   critic_reduction).to(self.device)
            self.action_critic_target = copy.deepcopy(self.action_critic).requires_grad_(False)
            self.action_critic_optimizer = torch.optim.Adam(self.action_critic.parameters(), lr=self.learning_rate)
            if value_expectile is not None:  # V(s), the expectile of Q_A over the replayed chunks (IQL)
                self.value_net = layer_norm_mlp(obs_dim, 1, arch, ACTIVATIONS[activation]).to(self.device)
                self.value_optimizer = torch.optim.Adam(self.value_net.parameters(), lr=self.learning_rate)
        if actor_lr is not None:
            update_learning_rate(self.actor.optimizer, actor_lr)
        if value_bounds is not None:  # every bootstrapped Q (the target networks' outputs) stays in the bounds
            low, high = value_bounds
            self.critic_target.register_forward_hook(lambda _m, _i, qs: tuple(q.clamp(low, high) for q in qs))
            for q_net in getattr(self, "action_critic_target", []):
                q_net.register_forward_hook(lambda _m, _i, q: q.clamp(low, high))

    # ---- acting ----
    def _sample_action(self, learning_starts: int, action_noise=None, n_envs: int = 1):
        if self.warm_start.phase(self.noise_env.env_steps) == WARMUP:
            bound = self.noise_env.noise_bound
            noise = np.clip(np.random.randn(n_envs, *self.action_space.shape), -bound, bound).astype(np.float32)
            return noise, self.policy.scale_action(noise)
        if self.rollout_candidates > 1:
            return self._best_of_n_action(n_envs)
        return super()._sample_action(learning_starts, action_noise, n_envs)

    @torch.no_grad()
    def _best_of_n_action(self, n_envs: int) -> tuple[np.ndarray, np.ndarray]:
        """N noises per env from the actor, each turned into its chunk by the base policy on the env's
        history; the env executes the one the action critics value most (SB3's pair: the noise in
        the env's box, and scaled to [-1, 1] for the replay)."""
        k = self.rollout_candidates
        obs = torch.as_tensor(self._last_obs, dtype=torch.float32, device=self.device).repeat_interleave(k, dim=0)
        scaled = self.actor(obs, deterministic=False)  # [n * k, H * A] in [-1, 1]
        env = self.noise_env
        cond = env.policy.encode_obs(env.history.get()).repeat_interleave(k, dim=0)
        chosen = scaled[best_candidates(self.action_critic, obs, self._base_chunk(cond, scaled), k)].cpu().numpy()
        return self.policy.unscale_action(chosen), chosen

    # ---- learning ----
    def train(self, gradient_steps: int, batch_size: int = 64, env_steps: int | None = None) -> None:
        """`gradient_steps` updates of the current phase; `env_steps` (default: the VecEnv's count) is
        how many env steps the replay holds, which sets the phase (a pipelined loop passes the count
        from before the step in flight)."""
        phase = self.warm_start.phase(self.noise_env.env_steps if env_steps is None else env_steps)
        if phase == WARMUP:
            return
        if self.noise_aliasing:
            self._train_noise_aliasing(gradient_steps, batch_size, update_actor=phase == FULL)
        elif phase == CRITIC:
            self._train_critic_only(gradient_steps, batch_size)
        else:
            super().train(gradient_steps, batch_size)
            self.stats = {k: float(v) for k, v in self.logger.name_to_value.items() if k.startswith("train/")}

    def _entropy_coef(self) -> Tensor:
        if self.ent_coef_optimizer is not None:
            return torch.exp(self.log_ent_coef.detach())
        return self.ent_coef_tensor

    def _train_critic_only(self, gradient_steps: int, batch_size: int) -> None:
        self.policy.set_training_mode(True)
        losses = []
        for _ in range(gradient_steps):
            data = self.replay_buffer.sample(batch_size)
            with torch.no_grad():
                next_actions, next_log_prob = self.actor.action_log_prob(data.next_observations)
                next_q = torch.cat(self.critic_target(data.next_observations, next_actions), dim=1).min(1, keepdim=True)[0]
                next_q = next_q - self._entropy_coef() * next_log_prob.reshape(-1, 1)
                target = data.rewards + (1 - data.dones) * self.gamma * next_q
            loss = 0.5 * sum(F.mse_loss(q, target) for q in self.critic(data.observations, data.actions))
            self.critic.optimizer.zero_grad()
            loss.backward()
            self.critic.optimizer.step()
            polyak_update(self.critic.parameters(), self.critic_target.parameters(), self.tau)
            losses.append(loss.item())
        self._n_updates += gradient_steps
        self.stats = {"train/critic_loss": float(np.mean(losses))}

    def _base_chunk(self, cond: Tensor, scaled_noise: Tensor) -> Tensor:
        """Executed part of pi_base(history, w) flattened, for scaled noises w/m in [-1, 1], from the
        base policy's conditioning on the history."""
        env = self.noise_env
        policy = env.policy
        cond = cond.to(policy.device)
        noise = (scaled_noise * env.noise_bound).reshape(len(cond), *env.noise_shape).to(cond)
        chunk = policy.unnormalize_action(policy.sample(cond, noise))
        return executed_actions(policy, chunk).reshape(len(cond), -1).to(self.device)

    def _update_learning_rate(self, optimizers: Any) -> None:
        """SB3's SAC.train sets every optimizer to its one learning rate; the actor keeps `actor_lr`."""
        super()._update_learning_rate(optimizers)
        if self.actor_lr is not None:
            update_learning_rate(self.actor.optimizer, self.actor_lr)

    def _train_noise_aliasing(self, gradient_steps: int, batch_size: int, update_actor: bool) -> None:
        self.policy.set_training_mode(True)
        stats: dict[str, list[float]] = {}
        for step in range(self._n_updates, self._n_updates + gradient_steps):
            data, extra = self.replay_buffer.sample_with_extras(batch_size)
            ent_coef = self._entropy_coef()

            # 1. Q_A(s, a) by TD on executed chunks; the next chunk is pi_base(s', pi_W(s')), or with
            # value_expectile the next state's V(s'): in-sample, never the value of the actor's own chunk
            with torch.no_grad():
                if self.value_expectile is None:
                    next_noise, next_log_prob = self.actor.action_log_prob(data.next_observations)
                    next_executed = self._base_chunk(extra["next_cond"], next_noise)
                    next_q = self.action_critic_target.value(data.next_observations, next_executed)
                    next_q = next_q - ent_coef * next_log_prob.reshape(-1, 1)
                else:
                    next_q = self.value_net(data.next_observations)
                    if self.value_bounds is not None:
                        next_q = next_q.clamp(*self.value_bounds)
                target = data.rewards + (1 - data.dones) * self.gamma * next_q
            q_action = self.action_critic.members(data.observations, extra["executed"])
            action_critic_loss = 0.5 * ((q_action - target) ** 2).mean(0).sum()
            self.action_critic_optimizer.zero_grad()
            action_critic_loss.backward()
            self.action_critic_optimizer.step()

            polyak_update(self.action_critic.parameters(), self.action_critic_target.parameters(), self.tau)
            stats.setdefault("train/action_critic_loss", []).append(action_critic_loss.item())
            if self.value_expectile is not None:
                stats.setdefault("train/value_loss", []).append(self._train_value(data, extra))

            # 2. distil Q_W(s, w) <- Q_A(s, pi_base(s, w)) on prior noises and the replayed ones (only where
            # the actor ascends Q_W: with actor_q=action_critic nothing reads it)
            if self.actor_q == "noise_critic":
                stats.setdefault("train/noise_critic_loss", []).append(self._distil_noise_critic(data, extra))

            # 3. the noise actor and the entropy coefficient (as in SAC), on Q_W or on Q_A of the chunk the
            # frozen base makes of the actor's noise (the gradient flows through the base sampler into the noise);
            # once per policy_delay critic steps, as TD3: through the sampler it costs tens of critic steps
            if update_actor and step % self.policy_delay == 0:
                actions_pi, log_prob = self.actor.action_log_prob(data.observations)
                log_prob = log_prob.reshape(-1, 1)
                if self.ent_coef_optimizer is not None:
                    ent_coef_loss = -(self.log_ent_coef * (log_prob + self.target_entropy).detach()).mean()
                    self.ent_coef_optimizer.zero_grad()
                    ent_coef_loss.backward()
                    self.ent_coef_optimizer.step()
                if self.actor_q == "action_critic":
                    executed_pi = self._base_chunk(extra["cond"], actions_pi)
                    q_pi = self.action_critic.value(data.observations, executed_pi)
                else:
                    q_pi = torch.cat(self.critic(data.observations, actions_pi), dim=1).min(1, keepdim=True)[0]
                actor_loss = (ent_coef * log_prob - q_pi).mean()
                self.actor.optimizer.zero_grad()
                actor_loss.backward()
                self.actor.optimizer.step()
                stats.setdefault("train/actor_loss", []).append(actor_loss.item())
                stats.setdefault("train/ent_coef", []).append(float(ent_coef))
        self._n_updates += gradient_steps
        self.stats = {k: float(np.mean(v)) for k, v in stats.items()}

    def _train_value(self, data: Any, extra: dict[str, Tensor]) -> float:
        """IQL's expectile regression: V(s) -> the value_expectile-expectile of Q_A_target(s, a) (the
        ensemble's value) over the replayed chunks a (0.5: their mean; towards 1: the best of them)."""
        with torch.no_grad():
            q = self.action_critic_target.value(data.observations, extra["executed"])
        diff = q - self.value_net(data.observations)
        weight = torch.abs(self.value_expectile - (diff < 0).float())
        loss = (weight * diff ** 2).mean()
        self.value_optimizer.zero_grad()
        loss.backward()
        self.value_optimizer.step()
        return loss.item()

    def _distil_noise_critic(self, data: Any, extra: dict[str, Tensor]) -> float:
        with torch.no_grad():
            bound = self.noise_env.noise_bound
            prior = torch.randn_like(data.actions).mul(1.0 / bound).clamp(-1.0, 1.0)  # w/m, w ~ N(0, I)
            prior_executed = self._base_chunk(extra["cond"], prior)
            obs2 = torch.cat([data.observations, data.observations])
            noise2 = torch.cat([prior, data.actions])
            executed2 = torch.cat([prior_executed, extra["executed"]])
            distil_target = self.action_critic.value(obs2, executed2)
        noise_critic_loss = 0.5 * sum(F.mse_loss(q, distil_target) for q in self.critic(obs2, noise2))
        self.critic.optimizer.zero_grad()
        noise_critic_loss.backward()
        self.critic.optimizer.step()
        return noise_critic_loss.item()


# --------------------------------------------------------------------------------------------
# Config, building and running (embodied-rl finetune algo=dsrl|dsrl_na)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DSRLConfig(AlgoConfig):
    """configs/algo/dsrl.yaml (dsrl_na.yaml extends it and adds the DSRL-NA keys)."""

    name: str
    noise_bound: float
    hidden_sizes: list[int]
    activation: str            # relu | tanh, of every hidden layer
    n_critics: int
    lr: float
    actor_lr: float | None     # the noise actor's learning rate; null: lr
    buffer_size: int
    batch_size: int
    gamma: float
    tau: float
    utd_ratio: float
    policy_delay: int          # critic steps per actor step (DSRL-NA; plain DSRL runs SB3's SAC, one each)
    ent_coef: Any              # "auto", "auto_<initial value>" or a fixed number
    target_entropy: Any        # "auto" or a number
    reward: str
    bootstrap_truncation: Any  # auto | true | false (algos.common.reward_settings)
    clip_target_q: Any        # auto: bootstrapped Q clamped to [0, 1] under the success reward; false: never
    eval_noise: str            # sample | mean: what the evaluation agent takes from the noise actor
    eval_candidates: int       # noises per decision of the evaluation agent; > 1 (DSRL-NA): the best under Q_A
    rollout_candidates: int    # the same for the training rollouts after the warm-up
    warmup_env_steps: int
    critic_only_steps: int
    action_critics: int | None  # DSRL-NA only
    critic_reduction: str | None  # DSRL-NA only: min | mean, how the Q_A ensemble makes one value
    actor_q: str | None         # DSRL-NA only: noise_critic (Q_W) | action_critic (Q_A through the base sampler)
    value_expectile: float | None  # DSRL-NA only: null (TD on the actor's next chunk) or IQL's expectile in (0, 1)
    deploy: str                # judged | latest: what evaluations and checkpoints act with (algos/wsrl.py JudgedWeights)
    pipeline: bool             # the envs step while the learner trains on the replay so far

    @classmethod
    def from_cfg(cls, algo: Any) -> DSRLConfig:
        values = OmegaConf.to_container(algo, resolve=True)
        values.setdefault("action_critics", None)  # the keys exist in dsrl_na.yaml only
        values.setdefault("critic_reduction", None)
        values.setdefault("actor_q", None)
        values.setdefault("value_expectile", None)
        return cls(**values).checked()

    def checks(self) -> list[tuple[str, bool, str]]:
        ent_coef = str(self.ent_coef)
        return [
            ("noise_bound", self.noise_bound > 0, "> 0"),
            ("hidden_sizes", all(h >= 1 for h in self.hidden_sizes), "a list of sizes >= 1"),
            ("activation", self.activation in ACTIVATIONS, " or ".join(ACTIVATIONS)),
            ("n_critics", self.n_critics >= 1, ">= 1"),
            ("lr", self.lr > 0, "> 0"),
            ("actor_lr", self.actor_lr is None or (_is_number(self.actor_lr) and float(self.actor_lr) > 0), "null or > 0"),
            deploy_check(self.deploy),
            ("pipeline", isinstance(self.pipeline, bool), "true or false"),
            ("buffer_size", self.buffer_size >= 1, ">= 1"),
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("gamma", 0.0 <= self.gamma <= 1.0, "in [0, 1]"),
            ("tau", 0.0 < self.tau <= 1.0, "in (0, 1]"),
            ("utd_ratio", self.utd_ratio > 0, "> 0"),
            ("policy_delay", self.policy_delay == 1 or (self.policy_delay > 1 and self.action_critics is not None),
             "1, or > 1 with algo=dsrl_na (SB3's SAC, plain DSRL's learner, steps its actor with every critic step)"),
            ("ent_coef", ent_coef == "auto" or _is_number(ent_coef.removeprefix("auto_")),
             "auto, auto_<number> or a number"),
            ("target_entropy", self.target_entropy == "auto" or _is_number(self.target_entropy), "auto or a number"),
            ("eval_noise", self.eval_noise in ("sample", "mean"), "sample or mean"),
            ("eval_candidates", self.eval_candidates == 1 or (self.eval_candidates > 1 and self.action_critics is not None
                                                              and self.eval_noise == "sample"),
             "1, or > 1 with algo=dsrl_na and eval_noise=sample (its action critics rank sampled candidates)"),
            ("rollout_candidates", self.rollout_candidates == 1 or (self.rollout_candidates > 1
                                                                    and self.action_critics is not None),
             "1, or > 1 with algo=dsrl_na (its action critics rank the candidates)"),
            ("clip_target_q", self.clip_target_q in ("auto", False), "auto or false"),
            ("warmup_env_steps", self.warmup_env_steps >= 0, ">= 0"),
            ("critic_only_steps", self.critic_only_steps >= 0, ">= 0"),
            ("action_critics", self.action_critics is None or self.action_critics >= 1, ">= 1"),
            ("critic_reduction", self.critic_reduction in (None, *CRITIC_REDUCTIONS), " or ".join(CRITIC_REDUCTIONS)),
            ("actor_q", self.actor_q in (None, "noise_critic", "action_critic"), "noise_critic or action_critic"),
            ("value_expectile", self.value_expectile is None or (_is_number(self.value_expectile)
                                                                 and 0.0 < float(self.value_expectile) < 1.0),
             "null or a number in (0, 1)"),
        ]


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bool)


def validate_config(cfg: Any) -> None:
    """Called by `embodied-rl finetune` before any work."""
    DSRLConfig.from_cfg(cfg.algo)
    reward_settings(cfg)


def make_dsrl(algo: DSRLConfig, vec_env: LatentNoiseVecEnv, seed: int, device: str = "cpu") -> DSRL:
    """A DSRL model from the algo config (configs/algo/dsrl.yaml, dsrl_na.yaml). Under the success
    reward (1 on the chunk that succeeds, which ends the episode) no return exceeds 1 or falls
    below 0: with `clip_target_q: auto` the target networks' Q stays in [0, 1]."""
    gradient_steps = max(1, int(round(algo.utd_ratio * vec_env.num_envs)))
    noise_aliasing = algo.action_critics is not None
    model = DSRL(
        vec_env,
        warm_start=WarmStart(algo.warmup_env_steps, algo.critic_only_steps),
        noise_aliasing=noise_aliasing,
        action_critics=algo.action_critics if noise_aliasing else 0,
        critic_reduction=algo.critic_reduction or "min",
        actor_q=algo.actor_q or "noise_critic",
        value_expectile=None if algo.value_expectile is None else float(algo.value_expectile),
        activation=algo.activation,
        value_bounds=(0.0, 1.0) if algo.clip_target_q == "auto" and vec_env.sparse_reward else None,
        rollout_candidates=algo.rollout_candidates,
        policy_delay=algo.policy_delay,
        learning_rate=algo.lr,
        actor_lr=None if algo.actor_lr is None else float(algo.actor_lr),
        buffer_size=algo.buffer_size,
        learning_starts=0,
        batch_size=algo.batch_size,
        tau=algo.tau,
        gamma=algo.gamma,
        train_freq=1,
        gradient_steps=gradient_steps,
        ent_coef=algo.ent_coef if str(algo.ent_coef).startswith("auto") else float(algo.ent_coef),
        target_entropy="auto" if algo.target_entropy == "auto" else float(algo.target_entropy),
        policy_kwargs={"net_arch": list(algo.hidden_sizes), "n_critics": algo.n_critics,
                       "activation_fn": ACTIVATIONS[algo.activation]},
        seed=seed,
        device=device,
        verbose=0,
    )
    model.set_logger(Logger(folder=None, output_formats=[]))
    return model


def noise_agent_factory(model: DSRL, base_policy: Any, algo: DSRLConfig):
    def make(num_envs: int) -> NoiseActorAgent:
        actor = _ScaledActor(model.actor, model.noise_env.noise_bound)
        return NoiseActorAgent(actor, base_policy, num_envs, model.noise_env.noise_bound,
                               deterministic=algo.eval_noise == "mean", candidates=algo.eval_candidates,
                               action_critic=model.action_critic if algo.eval_candidates > 1 else None)

    return make


def _agent_config(algo: DSRLConfig, vec_env: LatentNoiseVecEnv) -> dict[str, Any]:
    return {
        "variant": algo.name,
        "noise_bound": vec_env.noise_bound,
        "noise_shape": list(vec_env.noise_shape),
        "obs_dim": int(vec_env.observation_space.shape[0]),
        "obs_features": True,  # the noise actor reads policy.obs_features (actors.base.head_input)
        "net_arch": list(algo.hidden_sizes),
        "activation": algo.activation,
        "n_critics": algo.n_critics,
        "critic_reduction": algo.critic_reduction or "min",
        "eval_noise": algo.eval_noise,
        "eval_candidates": algo.eval_candidates,
    }


def _acting(model: DSRL, algo: DSRLConfig) -> torch.nn.Module:
    """What the evaluation agent acts with, as one module (what judged deployment swaps and an agent
    checkpoint holds): SB3's policy, and with best-of-N DSRL-NA's action critics that rank the candidates."""
    if algo.eval_candidates == 1:
        return model.policy
    return torch.nn.ModuleDict({"policy": model.policy, "action_critic": model.action_critic})


def _agent_tensors(model: DSRL, algo: DSRLConfig) -> dict[str, Tensor]:
    tensors = dict(model.policy.state_dict())
    if algo.eval_candidates > 1:
        tensors.update({ACTION_CRITIC + name: value for name, value in model.action_critic.state_dict().items()})
    return tensors


def _optimizers(model: DSRL) -> dict[str, Any]:
    optimizers = {"actor": model.actor.optimizer, "critic": model.critic.optimizer}
    if model.ent_coef_optimizer is not None:
        optimizers["ent_coef"] = model.ent_coef_optimizer
    if model.noise_aliasing:
        optimizers["action_critic"] = model.action_critic_optimizer
    if model.value_expectile is not None:
        optimizers["value"] = model.value_optimizer
    return optimizers


class _Learner:
    """Everything DSRL learns or counts, as one state_dict for checkpoints: SB3's policy (actor,
    critics, targets), the entropy coefficient, DSRL-NA's action critics, SB3's counters."""

    def __init__(self, model: DSRL):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        model = self.model
        state = {"policy": model.policy.state_dict(), "num_timesteps": torch.tensor(model.num_timesteps),
                 "n_updates": torch.tensor(model._n_updates), "episode_num": torch.tensor(model._episode_num)}
        if model.ent_coef_optimizer is not None:
            state["log_ent_coef"] = model.log_ent_coef.detach().cpu()
        if model.noise_aliasing:
            state["action_critic"] = model.action_critic.state_dict()
            state["action_critic_target"] = model.action_critic_target.state_dict()
        if model.value_expectile is not None:
            state["value_net"] = model.value_net.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model = self.model
        model.policy.load_state_dict(state["policy"])
        model.num_timesteps, model._n_updates = int(state["num_timesteps"]), int(state["n_updates"])
        model._episode_num = int(state["episode_num"])
        if "log_ent_coef" in state:
            with torch.no_grad():
                model.log_ent_coef.copy_(state["log_ent_coef"].to(model.device))
        if model.noise_aliasing:
            model.action_critic.load_state_dict(state["action_critic"])
            model.action_critic_target.load_state_dict(state["action_critic_target"])
        if model.value_expectile is not None:
            model.value_net.load_state_dict(state["value_net"])


REPLAY_ARRAYS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts",
                 "executed", "cond", "next_cond")


def replay_state(buffer: ReplayBuffer) -> dict[str, Any]:
    """The filled rows of an SB3 replay buffer (and DSRL-NA's extras) as tensors."""
    rows = buffer.buffer_size if buffer.full else buffer.pos
    arrays = {name: torch.from_numpy(np.ascontiguousarray(getattr(buffer, name)[:rows]))
              for name in REPLAY_ARRAYS if getattr(buffer, name, None) is not None}
    return {"arrays": arrays, "pos": torch.tensor(buffer.pos), "full": torch.tensor(buffer.full)}


def load_replay_state(buffer: ReplayBuffer, state: dict[str, Any]) -> None:
    for name, value in state["arrays"].items():
        target = getattr(buffer, name)
        if len(value) > len(target):
            raise UserError(f"the saved replay buffer holds {len(value)} rows, more than algo.buffer_size allows")
        target[: len(value)] = value.numpy()
    buffer.pos, buffer.full = int(state["pos"]), bool(state["full"])


def finetune(cfg: Any, run: Any, env: Any, policy: Any) -> dict[str, Any]:
    """`embodied-rl finetune algo=dsrl|dsrl_na`: train, evaluate, checkpoint; return the headline.

    The loop is SB3's off-policy step written out (sample an action, step the VecEnv, store the
    transition, train), so that a checkpoint falls between two whole steps and a resumed run
    continues exactly; Stable-Baselines3 still does the acting, the replay and the SAC update."""
    algo = DSRLConfig.from_cfg(cfg.algo)
    policy.eval()
    policy.requires_grad_(False)
    rewards = reward_settings(cfg)
    vec_env = LatentNoiseVecEnv(env, policy, noise_bound=algo.noise_bound, seed=int(cfg.seed),
                                sparse_reward=rewards.sparse, bootstrap_truncation=rewards.bootstrap_truncation)
    model = make_dsrl(algo, vec_env, seed=int(cfg.seed), device=str(cfg.device))
    config = _agent_config(algo, vec_env)

    evaluation, write_agent = judged_deployment(
        algo.deploy, EnvEvaluation(cfg, run, noise_agent_factory(model, policy, algo), policy.env_options()),
        _acting(model, algo), lambda path: save_agent(path, AGENT_KIND, config, _agent_tensors(model, algo), policy))
    loop = FinetuneLoop(cfg, run, evaluation)
    saved = loop.resume({"learner": _Learner(model)}, _optimizers(model), write_agent)
    if saved is not None:
        vec_env.load_state_dict(saved["vec_env"])
    if saved is None or saved["env"] is None:  # new episodes: a new run, or a backend without snapshots
        model._last_obs = vec_env.reset()
    else:  # continue exactly where the checkpoint stopped
        env.set_state(saved["env"])
        model._last_obs = saved["last_obs"].numpy()
    if saved is not None and "replay" in saved:
        load_replay_state(model.replay_buffer, saved["replay"])

    def loop_state() -> dict[str, Any]:
        return {"env": env_snapshot(env), "vec_env": vec_env.state_dict(),
                "last_obs": torch.from_numpy(np.asarray(model._last_obs)), "replay": replay_state(model.replay_buffer)}

    loop.start(f"finetune {algo.name}", instructions=env.instructions)
    # with `pipeline` the envs execute the chosen chunks in a thread while the learner trains on the replay
    # so far, and the new transitions join it after: simulator and learner overlap, and the actor acts on
    # weights one VecEnv step older than in the serial order (whose update has seen the step it follows)
    stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsrl-envs") if algo.pipeline else None
    while loop.env_steps < loop.total_env_steps:
        model.policy.set_training_mode(False)
        noise, buffer_noise = model._sample_action(0, None, vec_env.num_envs)
        if stepper is None:
            new_obs, rewards, dones, infos = vec_env.step(noise)
        else:
            replayed_env_steps = vec_env.env_steps
            stepping = stepper.submit(vec_env.step, noise)
            if model.replay_buffer.size():  # the first chunk's update has nothing to learn from yet
                model.train(model.gradient_steps, model.batch_size, env_steps=replayed_env_steps)
            new_obs, rewards, dones, infos = stepping.result()
        model.num_timesteps += vec_env.num_envs
        model._store_transition(model.replay_buffer, buffer_noise, new_obs, rewards, dones, infos)  # sets _last_obs
        if stepper is None:
            model.train(model.gradient_steps, model.batch_size)

        loop.advance(vec_env.env_steps - loop.env_steps)
        loop.record_episodes(list(vec_env.episode_returns), [float(s) for s in vec_env.episode_successes],
                             learned_successes=[float(s) for s in vec_env.episode_learned_successes],
                             instructions=list(vec_env.episode_instructions))
        for finished in (vec_env.episode_returns, vec_env.episode_successes, vec_env.episode_learned_successes,
                         vec_env.episode_instructions):
            finished.clear()
        for key in ("train/critic_loss", "train/actor_loss", "train/noise_critic_loss", "train/action_critic_loss"):
            if key in model.stats:  # divergence stops the run
                loop.check_finite(key, model.stats[key], model.stats)
        loop.log({**model.stats, "train/phase": {WARMUP: 0, CRITIC: 1, FULL: 2}[model.warm_start.phase(loop.env_steps)]})
        loop.boundary(loop_state)
    if stepper is not None:
        stepper.shutdown()
    return loop.finish(loop_state)


__all__ = ["AGENT_KIND", "DSRL", "DSRLConfig", "NoiseReplayBuffer", "finetune", "make_dsrl"]
