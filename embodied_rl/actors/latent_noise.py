"""Latent-noise actors (DSRL): RL steers a frozen diffusion / flow policy through its initial noise.

The base policy's deterministic sampler (DDIM eta=0 or the flow ODE) maps a noise w [H, A] and an
observation history to an action chunk. DSRL treats w as the action of a new MDP:

    LatentNoiseVecEnv   a Stable-Baselines3 VecEnv over a BatchedEnv whose action space is the
                        noise box [-m, m]^(H*A). One VecEnv step = one call of predict_chunk (the
                        sampler runs exactly once per step) + step_chunk of the chunk's first
                        n_action_steps actions, with the rewards summed.
    LayerNormSACPolicy  SB3's SACPolicy with LayerNorm after every hidden Linear.
    NoiseActorAgent     the trained noise actor + base policy as an evaluation agent
                        (reset(mask) / act(obs)); `build_noise_agent` makes it from a "dsrl"
                        checkpoint (actors/checkpoint.py: the SB3 policy's tensors + base_policy/).
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
import torch
from stable_baselines3.common.vec_env import VecEnv
from stable_baselines3.sac.policies import SACPolicy
from torch import Tensor, nn

from embodied_rl.actors.base import head_input, layer_norm_mlp
from embodied_rl.actors.checkpoint import AgentCheckpoint
from embodied_rl.errors import UserError
from embodied_rl.policies.base import Obs
from embodied_rl.policies.runner import (
    ChunkExecutor,
    ObsHistory,
    executed_actions,
    index_obs,
    map_obs,
    where_obs,
)

AGENT_KIND = "dsrl"
ACTION_CRITIC = "action_critic."  # the prefix of DSRL-NA's Q_A tensors in an agent checkpoint
# hidden activations of the noise actor and critics (DSRL's code: Tanh, bounded where data is thin)
ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


class _RecordObs:
    """Wraps a BatchedEnv to record every observation `step` returns (step_chunk only returns
    the last one; a base policy with n_obs_steps > 1 needs the ones before it)."""

    def __init__(self, env: Any):
        self._env = env
        self.observations: list[Tensor] = []

    def step(self, action: Tensor):
        out = self._env.step(action)
        self.observations.append(out[0])
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


# --------------------------------------------------------------------------------------------
# The noise-space VecEnv
# --------------------------------------------------------------------------------------------


class LatentNoiseVecEnv(VecEnv):
    """Stable-Baselines3 VecEnv view of a BatchedEnv + frozen ChunkPolicy; actions are noises.

    action: float32 [N, H*A] in [-noise_bound, noise_bound] (clipped), reshaped to the policy's
    noise_shape (H, A). observation: the base policy's features of the env observation
    [N, policy.feature_dim] (actors.base.head_input; the raw observations and the base policy's obs
    history are kept here, the history reset per env when its episode ends). reward: the sum over the
    executed part of the chunk (step_chunk), or with `sparse_reward` 1 where the chunk ended in
    success and 0 otherwise. An env that finishes mid-chunk reports done with
    `terminal_observation` and starts a fresh episode; a time limit is reported as
    `TimeLimit.truncated` (SB3 then bootstraps from the terminal observation) only with
    `bootstrap_truncation`, else it ends the episode like a termination.

    Counters: `env_steps` (simulator steps taken, all envs), `sampler_calls` (predict_chunk
    calls). info of every env holds "executed_chunk" [Ha*A], "base_cond" [policy.cond_dim] (the
    base policy's conditioning on the history the chunk was sampled from) and "next_base_cond"
    (the same after the chunk, with the terminal observation for a finished env) so that DSRL-NA
    can re-run the base policy's sampler.
    """

    def __init__(self, env: Any, policy: Any, noise_bound: float = 1.5, seed: int | None = None,
                 sparse_reward: bool = False, bootstrap_truncation: bool = True):
        if noise_bound <= 0:
            raise UserError(f"noise_bound must be > 0, got {noise_bound}")
        self.env = env
        self.policy = policy
        self.noise_bound = float(noise_bound)
        self.sparse_reward = bool(sparse_reward)
        self.bootstrap_truncation = bool(bootstrap_truncation)
        self.noise_shape = tuple(int(s) for s in policy.noise_shape)
        self.n_action_steps = int(policy.n_action_steps)
        self.history = ObsHistory(int(policy.n_obs_steps))
        self.env_steps = 0
        self.sampler_calls = 0
        self.episode_returns: list[float] = []
        self.episode_successes: list[bool] = []
        self.episode_learned_successes: list[bool] = []  # reward=model:PATH: the reward model's success
        self.episode_instructions: list[int] = []  # a task with instructions: each episode's instruction id
        self._seed = seed
        self._actions: np.ndarray | None = None
        flat = int(np.prod(self.noise_shape))
        action_space = gymnasium.spaces.Box(-self.noise_bound, self.noise_bound, (flat,), np.float32)
        observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (int(policy.feature_dim),), np.float32)
        self.render_mode = None
        super().__init__(int(env.num_envs), observation_space, action_space)

    # ---- SB3 VecEnv API ----
    def reset(self) -> np.ndarray:
        seed = self._seeds[0] if self._seeds[0] is not None else self._seed
        self._seed = None  # seed only the first reset: later resets continue the env's generator
        obs, _ = self.env.reset(seed=seed)
        self.history.reset(obs)
        self._reset_seeds()
        return self._features(obs).cpu().numpy()

    def _features(self, obs: Obs) -> Tensor:
        return head_input(self.policy, obs).float()

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = actions

    @torch.no_grad()
    def step_wait(self):
        from embodied_rl.envs.api import step_chunk

        device = self.env.device
        noise = torch.as_tensor(np.asarray(self._actions), dtype=torch.float32, device=device)
        noise = noise.reshape(self.num_envs, *self.noise_shape).clamp(-self.noise_bound, self.noise_bound)
        base_history = self.history.get()
        base_cond = self.policy.encode_obs(base_history)
        chunk = self.policy.unnormalize_action(self.policy.sample(base_cond, noise.to(base_cond)))  # = predict_chunk
        self.sampler_calls += 1
        executed = executed_actions(self.policy, chunk).to(device=device, dtype=torch.float32)

        recorder = _RecordObs(self.env)
        obs, reward, terminated, truncated, info = step_chunk(recorder, executed)
        self.env_steps += len(recorder.observations) * self.num_envs
        done = terminated | truncated
        final_obs = info["final_obs"]
        # history after the chunk: for live envs the last To observations, for finished ones the
        # terminal observation (what a bootstrap from the terminal state must see)
        steps = self.history.n_obs_steps
        after = map_obs(lambda h, *seen: torch.cat([h, torch.stack(seen, dim=1)], dim=1)[:, -steps:],
                        base_history, *recorder.observations)
        next_history = map_obs(lambda h, final: torch.cat([h[:, :-1], final[:, None]], dim=1), after,
                               where_obs(done, final_obs, map_obs(lambda h: h[:, -1], after)))
        next_cond = self.policy.encode_obs(next_history)
        self.history.buffer = after
        self.history.reset(obs, done)

        success = info["success"]
        if self.sparse_reward:
            reward = success.float()
        episode = info.get("episode", {})
        infos: list[dict[str, Any]] = []
        executed_flat = executed.reshape(self.num_envs, -1).cpu().numpy()
        base_flat = base_cond.float().cpu().numpy()
        next_flat = next_cond.float().cpu().numpy()
        final_features = self._features(final_obs).cpu().numpy() if bool(done.any()) else None
        done_np = done.cpu().numpy()
        instruction = final_obs.get("instruction") if isinstance(final_obs, dict) else None
        for i in range(self.num_envs):
            item: dict[str, Any] = {
                "executed_chunk": executed_flat[i],
                "base_cond": base_flat[i],
                "next_base_cond": next_flat[i],
                "success": bool(success[i]),
            }
            if done_np[i]:
                item["terminal_observation"] = final_features[i]
                timeout = bool(truncated[i]) and not bool(terminated[i])
                item["TimeLimit.truncated"] = timeout and self.bootstrap_truncation
                if "return" in episode:
                    item["episode"] = {"r": float(episode["return"][i]), "l": int(episode["length"][i])}
                    self.episode_returns.append(float(episode["return"][i]))
                    self.episode_successes.append(bool(episode["success_once"][i]))
                    if "learned_success_once" in episode:
                        self.episode_learned_successes.append(bool(episode["learned_success_once"][i]))
                    if instruction is not None:
                        self.episode_instructions.append(int(instruction[i]))
            infos.append(item)
        return self._features(obs).cpu().numpy(), reward.float().cpu().numpy(), done_np, infos

    def state_dict(self) -> dict[str, Tensor]:
        """What a resumed run needs to continue this VecEnv exactly (the BatchedEnv's own state
        is saved apart): the base policy's obs histories (the last observation included), the counters."""
        state = {"env_steps": torch.tensor(self.env_steps),
                 "sampler_calls": torch.tensor(self.sampler_calls)}
        state.update({f"history.{key}": value for key, value in self.history.state_dict().items()})
        return {key: value.detach().to("cpu", copy=True) for key, value in state.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        device = self.env.device
        self.env_steps, self.sampler_calls = int(state["env_steps"]), int(state["sampler_calls"])
        self.history.load_state_dict({key.removeprefix("history."): value.to(device)
                                      for key, value in state.items() if key.startswith("history.")})
        self._seed = None  # the env continues from its restored state, never from a seeded reset

    def close(self) -> None:
        pass

    def get_attr(self, attr_name: str, indices=None) -> list[Any]:
        return [getattr(self, attr_name, None)] * len(self._get_indices(indices))

    def set_attr(self, attr_name: str, value: Any, indices=None) -> None:
        setattr(self, attr_name, value)

    def env_method(self, method_name: str, *method_args, indices=None, **method_kwargs) -> list[Any]:
        raise NotImplementedError("LatentNoiseVecEnv has no per-env methods")

    def env_is_wrapped(self, wrapper_class, indices=None) -> list[bool]:
        return [False] * len(self._get_indices(indices))

    def _get_indices(self, indices) -> list[int]:
        if indices is None:
            return list(range(self.num_envs))
        if isinstance(indices, int):
            return [indices]
        return list(indices)


# --------------------------------------------------------------------------------------------
# LayerNorm MLPs for SB3's SAC
# --------------------------------------------------------------------------------------------


class LayerNormSACPolicy(SACPolicy):
    """SB3's SACPolicy with LayerNorm after each hidden Linear of the actor and the critics.

    SB3's create_mlp takes post_linear_modules but SACPolicy does not pass them through, so the
    actor trunk and the Q networks are rebuilt here (same sizes, same activation, the layers
    create_mlp(post_linear_modules=[nn.LayerNorm]) makes)."""

    def make_actor(self, features_extractor=None):
        actor = super().make_actor(features_extractor)
        actor.latent_pi = layer_norm_mlp(actor.features_dim, -1, actor.net_arch, actor.activation_fn).to(self.device)
        return actor

    def make_critic(self, features_extractor=None):
        critic = super().make_critic(features_extractor)
        input_dim = critic.q_networks[0][0].in_features  # features + action
        critic.q_networks = []
        for index in range(critic.n_critics):
            q_net = layer_norm_mlp(input_dim, 1, self.critic_kwargs["net_arch"], self.net_args["activation_fn"])
            setattr(critic, f"qf{index}", q_net.to(self.device))
            critic.q_networks.append(getattr(critic, f"qf{index}"))
        return critic


CRITIC_REDUCTIONS = ("min", "mean")


class ActionCritics(nn.ModuleList):
    """An ensemble of LayerNorm Q networks Q(s, x) (DSRL-NA's action-space critic) and how its members
    combine into one value: `min` (clipped double Q, the pessimistic value of SAC and TD3) or `mean`
    (DSRL's reference LIBERO and ALOHA runs: ten critics averaged, less pessimistic, the ensemble's
    size holding the overestimation down)."""

    def __init__(self, networks: list[nn.Module], reduction: str = "min"):
        super().__init__(networks)
        if reduction not in CRITIC_REDUCTIONS:
            raise ValueError(f"critic reduction must be one of {CRITIC_REDUCTIONS}, not {reduction!r}")
        self.reduction = reduction

    def members(self, features: Tensor, executed: Tensor) -> Tensor:
        """Each member's Q [B, n_critics]."""
        inputs = torch.cat([features, executed.to(features)], dim=1)
        return torch.cat([q(inputs) for q in self], dim=1)

    def value(self, features: Tensor, executed: Tensor) -> Tensor:
        """The ensemble's value [B, 1], what every target, the actor and best-of-N read."""
        q = self.members(features, executed)
        return q.min(1, keepdim=True)[0] if self.reduction == "min" else q.mean(1, keepdim=True)


def make_noise_critic(obs_dim: int, action_dim: int, net_arch: list[int], n_critics: int,
                      activation: str = "relu", reduction: str = "min") -> ActionCritics:
    return ActionCritics([layer_norm_mlp(obs_dim + action_dim, 1, list(net_arch), ACTIVATIONS[activation])
                          for _ in range(n_critics)], reduction)


# --------------------------------------------------------------------------------------------
# Evaluation agent and checkpoint
# --------------------------------------------------------------------------------------------


class NoiseActorAgent(ChunkExecutor):
    """Noise actor + frozen base policy as an agent: `reset(mask)`, `act(obs) -> [N, A]`.

    A ChunkExecutor: an env whose queue is empty draws its noise from the actor at its latest
    observation (a sample of its squashed Gaussian, or with `deterministic` its mean, scaled to
    [-m, m]) and samples one chunk with the base policy from its obs history.

    With `candidates` N > 1 and DSRL-NA's `action_critic` (the Q_A ensemble on executed chunks) it
    draws N noises per decision (from the actor, or with `source="prior"` from the base policy's own
    N(0, I) clipped to the box) and executes the chunk the ensemble values most:
    value-guided best-of-N, the policy extraction of Q-chunking (QC) and V-GPS.
    """

    def __init__(self, actor: nn.Module, policy: Any, num_envs: int, noise_bound: float, deterministic: bool = True,
                 obs_features: bool = True, action_critic: ActionCritics | None = None, candidates: int = 1,
                 source: str = "actor"):
        super().__init__(num_envs, policy.n_obs_steps, policy.n_action_steps, policy.action_dim)
        if candidates > 1 and action_critic is None:
            raise ValueError("best-of-N (candidates > 1) needs the action critics that rank the candidates")
        self.actor = actor
        self.policy = policy
        self.obs_features = obs_features
        self.noise_bound = float(noise_bound)
        self.deterministic = deterministic
        self.noise_shape = tuple(int(s) for s in policy.noise_shape)
        self.action_critic = action_critic
        self.candidates = int(candidates)
        self.source = source

    @torch.no_grad()
    def noise(self, obs: Obs) -> Tensor:
        features = head_input(self.policy, obs, self.obs_features)
        actor_device = next(self.actor.parameters()).device
        squashed = self.actor(features.to(actor_device), deterministic=self.deterministic)
        return squashed.to(features.device).reshape(len(features), *self.noise_shape).clamp(-self.noise_bound, self.noise_bound)

    def plan(self, history: Obs, envs: Tensor) -> Tensor:
        history = index_obs(history, envs)
        n, k = len(envs), self.candidates
        if k > 1:
            history = map_obs(lambda h: h.repeat_interleave(k, dim=0), history)
        latest = map_obs(lambda h: h[:, -1], history)
        if self.source == "prior":
            noise = torch.randn(n * k, *self.noise_shape).clamp(-self.noise_bound, self.noise_bound).to(self.policy.device)
        else:
            noise = self.noise(latest)
        executed = executed_actions(self.policy, self.policy.predict_chunk(history, noise=noise))
        if k == 1:
            return executed
        features = head_input(self.policy, latest, self.obs_features)
        return executed[best_candidates(self.action_critic, features, executed.reshape(n * k, -1), k)]


def best_candidates(action_critic: ActionCritics, features: Tensor, executed: Tensor, k: int) -> Tensor:
    """Value-guided best-of-N: rows [n * k] hold k candidate chunks (flattened) per decision, each
    beside its features; the index of each decision's candidate the Q_A ensemble values most [n]."""
    q = action_critic.value(features, executed).reshape(-1, k)
    return q.argmax(1) + torch.arange(len(q), device=q.device) * k


class _ScaledActor(nn.Module):
    """SB3's SAC actor with its [-1, 1] output scaled to the noise box."""

    def __init__(self, sb3_actor: nn.Module, noise_bound: float):
        super().__init__()
        self.sb3_actor = sb3_actor
        self.noise_bound = noise_bound

    def forward(self, obs: Tensor, deterministic: bool = True) -> Tensor:
        return self.sb3_actor(obs, deterministic=deterministic) * self.noise_bound


def make_sb3_policy(obs_dim: int, noise_dim: int, noise_bound: float, net_arch: list[int], n_critics: int = 2,
                    activation: str = "relu") -> LayerNormSACPolicy:
    observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32)
    action_space = gymnasium.spaces.Box(-noise_bound, noise_bound, (noise_dim,), np.float32)
    return LayerNormSACPolicy(
        observation_space, action_space, lr_schedule=lambda _: 3e-4, net_arch=list(net_arch), n_critics=n_critics,
        activation_fn=ACTIVATIONS[activation],
    )


def load_action_critic(weights: dict[str, Tensor], config: dict[str, Any], executed_dim: int) -> ActionCritics:
    """DSRL-NA's Q_A ensemble from its state_dict (as many members as it holds) and an agent config
    (checkpoints written before `critic_reduction` took the minimum)."""
    ensemble = len({name.split(".")[0] for name in weights})
    critic = make_noise_critic(config["obs_dim"], executed_dim, config["net_arch"], ensemble,
                               config.get("activation", "relu"), config.get("critic_reduction", "min"))
    critic.load_state_dict(weights)
    return critic.eval()


def build_noise_agent(checkpoint: AgentCheckpoint, num_envs: int) -> NoiseActorAgent:
    """The evaluation agent of a "dsrl" checkpoint (DSRL and DSRL-NA): the noise actor sampled, or its
    mean (`eval_noise` in agent.json; checkpoints written before the key evaluated the mean); with
    `eval_candidates` N > 1, the best of N of its noises under the saved action critics."""
    config = checkpoint.config
    noise_bound = config["noise_bound"]
    sb3_policy = make_sb3_policy(config["obs_dim"], int(np.prod(config["noise_shape"])), noise_bound,
                                 config["net_arch"], config["n_critics"], config.get("activation", "relu"))
    tensors = {name: value for name, value in checkpoint.tensors.items() if not name.startswith(ACTION_CRITIC)}
    sb3_policy.load_state_dict(tensors)
    device = checkpoint.base_policy.device
    sb3_policy = sb3_policy.to(device).eval()
    candidates = int(config.get("eval_candidates", 1))
    action_critic = None
    if candidates > 1:  # DSRL-NA's Q_A ensemble ranks the candidates (saved beside the SB3 policy)
        base = checkpoint.base_policy
        weights = {name.removeprefix(ACTION_CRITIC): value for name, value in checkpoint.tensors.items()
                   if name.startswith(ACTION_CRITIC)}
        action_critic = load_action_critic(weights, config, base.n_action_steps * base.action_dim).to(device)
    # checkpoints written before the noise actor read the policy's features have no obs_features
    return NoiseActorAgent(_ScaledActor(sb3_policy.actor, noise_bound), checkpoint.base_policy, num_envs, noise_bound,
                           deterministic=config.get("eval_noise", "mean") == "mean",
                           obs_features=bool(config.get("obs_features", False)),
                           action_critic=action_critic, candidates=candidates)
