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
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from stable_baselines3 import SAC
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.utils import polyak_update
from torch import Tensor

from embodied_rl.actors.latent_noise import (
    AGENT_KIND,
    LOADER,
    LatentNoiseVecEnv,
    LayerNormSACPolicy,
    NoiseActorAgent,
    _ScaledActor,
    executable,
    make_noise_critic,
    save_noise_actor,
)
from embodied_rl.algos.wsrl import CRITIC, FULL, WARMUP, WarmStart, sparse_reward
from embodied_rl.errors import UserError

# --------------------------------------------------------------------------------------------
# Replay buffer that also keeps what DSRL-NA needs to re-run the base policy
# --------------------------------------------------------------------------------------------


class NoiseReplayBuffer(ReplayBuffer):
    """SB3's ReplayBuffer plus, per transition, the executed chunk and the base policy's obs
    history before and after the step (taken from the VecEnv's infos)."""

    def __init__(self, *args: Any, executed_dim: int = 0, history_dim: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.executed = np.zeros((self.buffer_size, self.n_envs, executed_dim), np.float32)
        self.history = np.zeros((self.buffer_size, self.n_envs, history_dim), np.float32)
        self.next_history = np.zeros((self.buffer_size, self.n_envs, history_dim), np.float32)

    def add(self, obs, next_obs, action, reward, done, infos) -> None:
        self.executed[self.pos] = np.stack([info["executed_chunk"] for info in infos])
        self.history[self.pos] = np.stack([info["base_history"] for info in infos])
        self.next_history[self.pos] = np.stack([info["next_base_history"] for info in infos])
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
            "history": self.to_torch(self.history[rows, envs]),
            "next_history": self.to_torch(self.next_history[rows, envs]),
        }
        return samples, extras


# --------------------------------------------------------------------------------------------
# SB3's SAC with the warm-start stages and the noise-aliasing critic
# --------------------------------------------------------------------------------------------


class DSRL(SAC):
    """stable_baselines3.SAC on a LatentNoiseVecEnv.

    - warm-up: actions are the base policy's own noise, w ~ N(0, I) clipped to [-m, m]; no updates;
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
        **sac_kwargs: Any,
    ):
        self.noise_env = env
        self.warm_start = warm_start
        self.noise_aliasing = noise_aliasing
        if noise_aliasing:
            history_dim = env.history.n_obs_steps * env.observation_space.shape[0]
            executed_dim = env.n_action_steps * env.noise_shape[1]
            sac_kwargs["replay_buffer_class"] = NoiseReplayBuffer
            sac_kwargs["replay_buffer_kwargs"] = {"executed_dim": executed_dim, "history_dim": history_dim}
        super().__init__(LayerNormSACPolicy, env, **sac_kwargs)
        self.stats: dict[str, float] = {}
        if noise_aliasing:
            obs_dim = env.observation_space.shape[0]
            arch = list(action_critic_arch or self.policy.net_arch)
            self.action_critic = make_noise_critic(obs_dim, executed_dim, arch, action_critics).to(self.device)
            self.action_critic_target = copy.deepcopy(self.action_critic).requires_grad_(False)
            self.action_critic_optimizer = torch.optim.Adam(self.action_critic.parameters(), lr=self.learning_rate)

    # ---- acting ----
    def _sample_action(self, learning_starts: int, action_noise=None, n_envs: int = 1):
        if self.warm_start.phase(self.noise_env.env_steps) == WARMUP:
            bound = self.noise_env.noise_bound
            noise = np.clip(np.random.randn(n_envs, *self.action_space.shape), -bound, bound).astype(np.float32)
            return noise, self.policy.scale_action(noise)
        return super()._sample_action(learning_starts, action_noise, n_envs)

    # ---- learning ----
    def train(self, gradient_steps: int, batch_size: int = 64) -> None:
        phase = self.warm_start.phase(self.noise_env.env_steps)
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

    def _base_chunk(self, history: Tensor, scaled_noise: Tensor) -> Tensor:
        """Executed part of pi_base(history, w) flattened, for scaled noises w/m in [-1, 1]."""
        env = self.noise_env
        policy_device = env.policy.device if hasattr(env.policy, "device") else self.device
        history = history.reshape(len(history), env.history.n_obs_steps, -1).to(policy_device)
        noise = (scaled_noise * env.noise_bound).reshape(len(history), *env.noise_shape).to(policy_device)
        chunk = env.policy.predict_chunk(history, noise=noise)
        return executable(env.policy, chunk).reshape(len(history), -1).to(self.device)

    def _action_q(self, critic: torch.nn.ModuleList, obs: Tensor, executed: Tensor) -> Tensor:
        inputs = torch.cat([obs, executed], dim=1)
        return torch.cat([q(inputs) for q in critic], dim=1)

    def _train_noise_aliasing(self, gradient_steps: int, batch_size: int, update_actor: bool) -> None:
        self.policy.set_training_mode(True)
        stats: dict[str, list[float]] = {}
        for _ in range(gradient_steps):
            data, extra = self.replay_buffer.sample_with_extras(batch_size)
            ent_coef = self._entropy_coef()

            # 1. Q_A(s, a) by TD on executed chunks; the next chunk is pi_base(s', pi_W(s'))
            with torch.no_grad():
                next_noise, next_log_prob = self.actor.action_log_prob(data.next_observations)
                next_executed = self._base_chunk(extra["next_history"], next_noise)
                next_q = self._action_q(self.action_critic_target, data.next_observations, next_executed).min(1, keepdim=True)[0]
                next_q = next_q - ent_coef * next_log_prob.reshape(-1, 1)
                target = data.rewards + (1 - data.dones) * self.gamma * next_q
            q_action = self._action_q(self.action_critic, data.observations, extra["executed"])
            action_critic_loss = 0.5 * ((q_action - target) ** 2).mean(0).sum()
            self.action_critic_optimizer.zero_grad()
            action_critic_loss.backward()
            self.action_critic_optimizer.step()

            # 2. distil Q_W(s, w) <- Q_A(s, pi_base(s, w)) on prior noises and the replayed ones
            with torch.no_grad():
                bound = self.noise_env.noise_bound
                prior = torch.randn_like(data.actions).mul(1.0 / bound).clamp(-1.0, 1.0)  # w/m, w ~ N(0, I)
                prior_executed = self._base_chunk(extra["history"], prior)
                obs2 = torch.cat([data.observations, data.observations])
                noise2 = torch.cat([prior, data.actions])
                executed2 = torch.cat([prior_executed, extra["executed"]])
                distil_target = self._action_q(self.action_critic, obs2, executed2).min(1, keepdim=True)[0]
            noise_critic_loss = 0.5 * sum(F.mse_loss(q, distil_target) for q in self.critic(obs2, noise2))
            self.critic.optimizer.zero_grad()
            noise_critic_loss.backward()
            self.critic.optimizer.step()
            polyak_update(self.action_critic.parameters(), self.action_critic_target.parameters(), self.tau)
            stats.setdefault("train/action_critic_loss", []).append(action_critic_loss.item())
            stats.setdefault("train/noise_critic_loss", []).append(noise_critic_loss.item())

            # 3. the noise actor and the entropy coefficient, on Q_W (as in SAC)
            if update_actor:
                actions_pi, log_prob = self.actor.action_log_prob(data.observations)
                log_prob = log_prob.reshape(-1, 1)
                if self.ent_coef_optimizer is not None:
                    ent_coef_loss = -(self.log_ent_coef * (log_prob + self.target_entropy).detach()).mean()
                    self.ent_coef_optimizer.zero_grad()
                    ent_coef_loss.backward()
                    self.ent_coef_optimizer.step()
                q_pi = torch.cat(self.critic(data.observations, actions_pi), dim=1).min(1, keepdim=True)[0]
                actor_loss = (ent_coef * log_prob - q_pi).mean()
                self.actor.optimizer.zero_grad()
                actor_loss.backward()
                self.actor.optimizer.step()
                stats.setdefault("train/actor_loss", []).append(actor_loss.item())
                stats.setdefault("train/ent_coef", []).append(float(ent_coef))
        self._n_updates += gradient_steps
        self.stats = {k: float(np.mean(v)) for k, v in stats.items()}


# --------------------------------------------------------------------------------------------
# Building and running (embodied-rl finetune algo=dsrl|dsrl_na)
# --------------------------------------------------------------------------------------------


def _target_entropy(value: Any) -> str | float:
    if isinstance(value, str) and value == "auto":
        return "auto"
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(f"bad value for 'algo.target_entropy': expected 'auto' or a number, got {value!r}") from None


def make_dsrl(algo: Any, vec_env: LatentNoiseVecEnv, seed: int, device: str = "cpu") -> DSRL:
    """A DSRL model from the algo config (configs/algo/dsrl.yaml, dsrl_na.yaml)."""
    utd = float(algo.utd_ratio)
    if utd <= 0:
        raise UserError(f"algo.utd_ratio must be > 0, got {utd}")
    gradient_steps = max(1, int(round(utd * vec_env.num_envs)))
    model = DSRL(
        vec_env,
        warm_start=WarmStart.from_config(algo),
        noise_aliasing=algo.name == "dsrl_na",
        action_critics=int(algo.get("action_critics", 2)),
        learning_rate=float(algo.lr),
        buffer_size=int(algo.buffer_size),
        learning_starts=0,
        batch_size=int(algo.batch_size),
        tau=float(algo.tau),
        gamma=float(algo.gamma),
        train_freq=1,
        gradient_steps=gradient_steps,
        ent_coef=algo.ent_coef if str(algo.ent_coef).startswith("auto") else float(algo.ent_coef),
        target_entropy=_target_entropy(algo.target_entropy),
        policy_kwargs={"net_arch": list(algo.hidden_sizes), "n_critics": int(algo.n_critics)},
        seed=seed,
        device=device,
        verbose=0,
    )
    model.set_logger(Logger(folder=None, output_formats=[]))
    return model


def noise_agent_factory(model: DSRL, base_policy: Any):
    def make(num_envs: int) -> NoiseActorAgent:
        actor = _ScaledActor(model.actor, model.noise_env.noise_bound)
        return NoiseActorAgent(actor, base_policy, num_envs, model.noise_env.noise_bound)

    return make


def _agent_config(algo: Any, vec_env: LatentNoiseVecEnv) -> dict[str, Any]:
    return {
        "variant": str(algo.name),
        "noise_bound": vec_env.noise_bound,
        "noise_shape": list(vec_env.noise_shape),
        "obs_dim": int(vec_env.observation_space.shape[0]),
        "net_arch": list(algo.hidden_sizes),
        "n_critics": int(algo.n_critics),
    }


def _optimizers(model: DSRL) -> dict[str, Any]:
    optimizers = {"actor": model.actor.optimizer, "critic": model.critic.optimizer}
    if model.ent_coef_optimizer is not None:
        optimizers["ent_coef"] = model.ent_coef_optimizer
    if model.noise_aliasing:
        optimizers["action_critic"] = model.action_critic_optimizer
    return optimizers


def _extra_state(model: DSRL) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if model.ent_coef_optimizer is not None:
        state["log_ent_coef"] = model.log_ent_coef.detach().cpu()
    if model.noise_aliasing:
        state["action_critic"] = model.action_critic.state_dict()
        state["action_critic_target"] = model.action_critic_target.state_dict()
    return state


class _FinetuneLoop(BaseCallback):
    """Per VecEnv step: stop at cfg.env_steps, log, evaluate and checkpoint every eval_every."""

    def __init__(self, cfg: Any, run: Any, model: DSRL, base_policy: Any, evaluator: Any, save):
        super().__init__()
        self.cfg, self.run, self.dsrl, self.base_policy = cfg, run, model, base_policy
        self.evaluator, self.save = evaluator, save
        self.log_every = max(1, int(cfg.get("log_every", 0) or cfg.num_envs * 50))
        self.next_log = model.noise_env.env_steps + self.log_every
        from embodied_rl.runs import progress

        self.bar = progress(total=int(cfg.env_steps), desc=f"finetune {cfg.algo.name}")
        self.bar.update(model.noise_env.env_steps)
        self.last_steps = model.noise_env.env_steps

    def _on_step(self) -> bool:
        vec_env = self.dsrl.noise_env
        steps = vec_env.env_steps
        self.bar.update(steps - self.last_steps)
        self.last_steps = steps
        if steps >= self.next_log:
            metrics = dict(self.dsrl.stats)
            metrics["train/phase"] = {WARMUP: 0, CRITIC: 1, FULL: 2}[self.dsrl.warm_start.phase(steps)]
            if vec_env.episode_returns:
                metrics["rollout/return"] = float(np.mean(vec_env.episode_returns))
                metrics["rollout/success_rate"] = float(np.mean(vec_env.episode_successes))
                vec_env.episode_returns.clear()
                vec_env.episode_successes.clear()
            self.run.log(steps, metrics)
            self.next_log = steps + self.log_every
        done = steps >= int(self.cfg.env_steps)
        if not done and self.evaluator.due(steps):
            self.evaluator.maybe_evaluate(steps, noise_agent_factory(self.dsrl, self.base_policy))
            self.save(steps)
        return not done


def finetune(cfg: Any, run: Any, env: Any, policy: Any) -> dict[str, Any]:
    """`embodied-rl finetune algo=dsrl|dsrl_na`: train, evaluate, checkpoint; return the headline."""
    from safetensors.torch import load_file

    from embodied_rl.algos.common import (
        Evaluator,
        headline_from_eval,
        load_training_state,
        restore,
        save_checkpoint,
    )

    algo = cfg.algo
    policy.eval()
    policy.requires_grad_(False)
    vec_env = LatentNoiseVecEnv(env, policy, noise_bound=float(algo.noise_bound), seed=int(cfg.seed),
                                sparse_reward=sparse_reward(cfg))
    model = make_dsrl(algo, vec_env, seed=int(cfg.seed), device=str(cfg.device))
    config = _agent_config(algo, vec_env)

    counters: dict[str, Any] = {}
    resumed = load_training_state(run)
    if resumed is not None:
        model.policy.load_state_dict(load_file(str(resumed["path"] / "actor.safetensors")))
        counters = restore(resumed, _optimizers(model))
        extra = resumed["state"]
        if "log_ent_coef" in extra:
            with torch.no_grad():
                model.log_ent_coef.copy_(extra["log_ent_coef"].to(model.device))
        if model.noise_aliasing:
            model.action_critic.load_state_dict(extra["action_critic"])
            model.action_critic_target.load_state_dict(extra["action_critic_target"])
        vec_env.env_steps = int(counters["env_steps"])
        model.num_timesteps = int(counters["num_timesteps"])
        model._n_updates = int(counters.get("n_updates", 0))
        # the replay buffer is not saved: it refills from the resumed actor's rollouts

    def save(step: int) -> None:
        save_checkpoint(
            run,
            step,
            lambda path: save_noise_actor(path, model.policy, policy, config),
            _optimizers(model),
            {"env_steps": vec_env.env_steps, "num_timesteps": model.num_timesteps, "n_updates": model._n_updates,
             **evaluator.clock()},
            _extra_state(model),
        )

    evaluator = Evaluator(cfg, run, counters=counters)
    if resumed is None and evaluator.every > 0:
        from embodied_rl.policies import PolicyRunner

        evaluator.maybe_evaluate(0, lambda n: PolicyRunner(policy, n), force=True)  # the base policy
    if vec_env.env_steps < int(cfg.env_steps):
        loop = _FinetuneLoop(cfg, run, model, policy, evaluator, save)
        model.learn(total_timesteps=int(cfg.env_steps), callback=loop, reset_num_timesteps=resumed is None)
        loop.bar.close()
    save(vec_env.env_steps)
    info = evaluator.last_info
    if evaluator.every > 0 and evaluator.last_step != vec_env.env_steps:
        info = evaluator.maybe_evaluate(vec_env.env_steps, noise_agent_factory(model, policy), force=True)
    evaluator.close()
    run.log(vec_env.env_steps, {"train/wall_s": evaluator.clock()["wall_s"]})
    return headline_from_eval(info, vec_env.env_steps, run)


__all__ = ["AGENT_KIND", "DSRL", "LOADER", "NoiseReplayBuffer", "finetune", "make_dsrl"]
