"""Backend `gymnasium`: any gymnasium env id as a BatchedEnv.

This backend runs envs that are not written as a Task (gymnasium's own MuJoCo envs, Meta-World,
gymnasium-robotics, your own) behind the same contract as the MuJoCo backends: torch tensors with a
leading N, float32 observations, actions in [-1, 1], same-step auto-reset with `final_obs`, and a
`success` flag read from the wrapped envs' info.

The copies run in gymnasium's own vector envs (`SyncVectorEnv`, or `AsyncVectorEnv` with one
process per copy) in `AutoresetMode.SAME_STEP`, so a finished env returns the first observation of
its next episode and gymnasium hands back the true last one in `info["final_obs"]`.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from embodied_rl.envs.api import BatchedEnv, EpisodeStats
from embodied_rl.errors import UserError

# Info keys that wrapped envs use for task success: gymnasium-robotics says `is_success`,
# Meta-World says `success`. The first one present wins.
SUCCESS_KEYS = ("is_success", "success")


def _make_one(env_id: str, render_mode: str | None, max_episode_steps: int | None,
              flatten_obs: bool, env_kwargs: dict[str, Any]):
    # Module level (not a lambda) so that AsyncVectorEnv can pickle it into its workers.
    import gymnasium as gym

    env = gym.make(env_id, render_mode=render_mode, max_episode_steps=max_episode_steps,
                   **env_kwargs)
    if flatten_obs:
        env = gym.wrappers.FlattenObservation(env)
    return env


def _success_from(infos: dict[str, Any], num_envs: int) -> np.ndarray:
    """bool[N] from a vector info dict: the first success key present, False where absent."""
    success = np.zeros(num_envs, dtype=bool)
    for key in SUCCESS_KEYS:
        if key in infos:
            has_key = infos.get("_" + key, np.ones(num_envs, dtype=bool))
            success = np.where(has_key, np.asarray(infos[key]).astype(bool), False)
            break
    return success


class HostVectorEnv(BatchedEnv):
    """What the gymnasium and process backends share on this side: N copies of an env stepped
    as numpy arrays (in gymnasium's vector envs, or in worker processes), actions in [-1, 1]
    rescaled to the copies' Box, gymnasium's seed convention, and the contract's info built from
    the numpy results. A subclass calls `_setup` once it knows the action space."""

    def _setup(self, num_envs: int, seed: int, device: str | torch.device, act_low: np.ndarray,
               act_high: np.ndarray, act_dtype: Any) -> None:
        self.num_envs = num_envs
        self.device = torch.device(device)
        self._seed = seed
        self._seeded = False
        # bounds flattened like the actions [N, A]; the copies take their own shape and dtype
        self._act_shape = tuple(np.shape(act_low))
        self._act_low = np.asarray(act_low, dtype=np.float64).reshape(-1)
        self._act_high = np.asarray(act_high, dtype=np.float64).reshape(-1)
        self._act_dtype = act_dtype
        self.single_action_space = gym_box(-1.0, 1.0, int(self._act_low.size))
        # Per-env episode statistics, kept here because gymnasium's RecordEpisodeStatistics
        # knows nothing of success.
        self.stats = EpisodeStats(num_envs, torch.device("cpu"))
        # Draws the seeds of grouped resets that are given no seed.
        self.generator = torch.Generator()
        self.generator.manual_seed(int(seed))

    def _reset_seeds(self, seed: int | None, env_ids: torch.Tensor | None, group_size: int | None
                     ) -> tuple[np.ndarray, list[int | None]]:
        """The envs a reset resets and each env's seed (None: it continues its own stream).

        With a seed, env i gets seed + i; without one, the first reset uses the constructor's
        seed. `group_size=G` gives consecutive groups of G reset envs one seed each."""
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if seed is None and not self._seeded:
            seed = self._seed
        if not self._seeded:
            env_ids = None  # the first reset must set every env
        self._seeded = True
        ids = self._env_ids(env_ids).numpy()
        seeds: list[int | None] = [None] * self.num_envs
        if group_size is not None and group_size > 1:
            if len(ids) % group_size:
                raise ValueError(f"group_size {group_size} must divide the number of envs reset "
                                 f"({len(ids)})")
            if seed is not None:
                self.generator.manual_seed(int(seed))
            group_seeds = torch.randint(0, 2**31 - 1, (len(ids) // group_size,),
                                        generator=self.generator)
            for k, i in enumerate(ids):
                seeds[i] = int(group_seeds[k // group_size])
        elif seed is not None:
            for i in ids:
                seeds[i] = int(seed) + int(i)
        self.stats.clear(torch.from_numpy(ids))
        return ids, seeds

    def _env_action(self, action: torch.Tensor) -> np.ndarray:
        """Validated actions in [-1, 1], rescaled linearly to the copies' Box: float64 [N, A]."""
        if not self._seeded:
            raise RuntimeError("call reset() before step()")
        action = self.check_action(action).cpu().double().numpy()
        return self._act_low + (action + 1.0) / 2.0 * (self._act_high - self._act_low)

    def _step_result(self, obs: Any, reward: np.ndarray, terminated: np.ndarray,
                     truncated: np.ndarray, success: np.ndarray, final_mask: np.ndarray,
                     final_obs: Any) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """The contract's step tuple from a step's numpy results; `obs` and `final_obs` are
        already CPU tensors (or dicts of them)."""
        reward_t = torch.as_tensor(np.asarray(reward, dtype=np.float32))
        terminated_t = torch.as_tensor(np.asarray(terminated, dtype=bool))
        # gymnasium's TimeLimit flags both when an env terminates on its last step; the
        # contract (as in the MuJoCo backends) is truncated = time limit and not terminated.
        truncated_t = torch.as_tensor(np.asarray(truncated, dtype=bool)) & ~terminated_t
        done = terminated_t | truncated_t
        success_t = torch.as_tensor(np.asarray(success, dtype=bool))
        self.stats.update(reward_t, success_t)
        info: dict[str, Any] = {
            "success": success_t,
            "unstable": torch.zeros(self.num_envs, dtype=torch.bool),  # not detected here
            "_final": torch.as_tensor(np.asarray(final_mask, dtype=bool)),
            "final_obs": final_obs,
            "_episode": done,
            "episode": self.stats.snapshot(),
        }
        self.stats.clear(torch.nonzero(done).flatten())
        to = self.device
        info = {key: ({k: v.to(to) for k, v in value.items()} if isinstance(value, dict)
                      else value.to(to)) for key, value in info.items()}
        obs = {k: v.to(to) for k, v in obs.items()} if isinstance(obs, dict) else obs.to(to)
        return obs, reward_t.to(to), terminated_t.to(to), truncated_t.to(to), info

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def gym_box(low: float, high: float, size: int):
    import gymnasium as gym

    return gym.spaces.Box(low, high, (size,), np.float32)


class GymnasiumEnv(HostVectorEnv):
    """N copies of a gymnasium env, stepped as one batch of torch tensors.

    Args:
        env_id: a registered gymnasium id, e.g. "Hopper-v5". gymnasium's "module:EnvId" form
            imports the module that registers it first (e.g. "gymnasium_robotics:...").
        num_envs: N, the number of copies.
        seed: the seed of the first `reset()`; copy i gets seed + i.
        device: torch device of the returned tensors (the envs themselves run on the CPU).
        vector: "sync" (all copies in this process, the default) or "async" (one process each;
            pays off only when one env step costs far more than a pipe round trip).
        max_episode_steps: overrides the env's registered time limit.
        render_mode: passed to every copy; "rgb_array" lets `render()` return frames.
        flatten_obs: flatten a Dict/Tuple observation space into one Box
            (gymnasium.wrappers.FlattenObservation); without it such envs are refused.
        env_kwargs: passed to `gymnasium.make` for every copy.
    """

    def __init__(
        self,
        env_id: str,
        num_envs: int = 1,
        seed: int = 0,
        device: str | torch.device = "cpu",
        vector: str = "sync",
        max_episode_steps: int | None = None,
        render_mode: str | None = "rgb_array",
        flatten_obs: bool = False,
        env_kwargs: dict[str, Any] | None = None,
    ) -> None:
        import gymnasium as gym
        from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

        if num_envs < 1:
            raise UserError(f"num_envs must be >= 1, got {num_envs}")
        if vector not in ("sync", "async"):
            raise UserError(f"vector must be 'sync' or 'async', got {vector!r}")
        self.env_id = env_id
        self.vector = vector

        make_one = functools.partial(_make_one, env_id, render_mode, max_episode_steps,
                                     flatten_obs, dict(env_kwargs or {}))
        # Check the id and the spaces on one env in this process first: a bad id or a Dict space
        # then fails with one line instead of N worker tracebacks.
        try:
            probe = make_one()
        except gym.error.Error as error:
            raise UserError(f"gymnasium could not make {env_id!r}: {error}") from error
        except ModuleNotFoundError as error:
            raise UserError(f"making {env_id!r} needs the package {error.name!r}; install it "
                            "(e.g. pip install 'embodied-rl[metaworld]', see docs/backends.md)"
                            ) from error
        obs_space, act_space = probe.observation_space, probe.action_space
        self.max_episode_steps = probe.spec.max_episode_steps if probe.spec else max_episode_steps
        probe.close()
        if not isinstance(obs_space, gym.spaces.Box):
            raise UserError(
                f"{env_id!r} has a {type(obs_space).__name__} observation space; the gymnasium "
                "backend takes Box observations only (pass flatten_obs=True to flatten it)")
        if not isinstance(act_space, gym.spaces.Box):
            raise UserError(f"{env_id!r} has a {type(act_space).__name__} action space; the "
                            "gymnasium backend takes Box (continuous) actions only")
        if not (np.all(np.isfinite(act_space.low)) and np.all(np.isfinite(act_space.high))):
            raise UserError(f"{env_id!r} has unbounded actions; actions in [-1, 1] cannot be "
                            "rescaled to them")

        self._setup(num_envs, seed, device, act_space.low, act_space.high, act_space.dtype)
        # Both are flattened to one dimension: obs [N, D], actions [N, A].
        self.obs_dim = int(np.prod(obs_space.shape))
        self.single_observation_space = gym_box(-np.inf, np.inf, self.obs_dim)

        env_fns = [make_one] * num_envs
        if vector == "sync":
            self._vec = SyncVectorEnv(env_fns, autoreset_mode=AutoresetMode.SAME_STEP)
        else:
            self._vec = AsyncVectorEnv(env_fns, autoreset_mode=AutoresetMode.SAME_STEP)

    # ---------------------------------------------------------------- reset / step

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None,
              group_size: int | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """Reset all envs, or only `env_ids` (indices or a bool[N] mask); return obs of all N.

        With a seed, env i is reset with seed + i (gymnasium's convention). Without one, the first
        reset uses the constructor's seed and later ones continue each env's own random stream.
        `group_size=G` resets consecutive groups of G reset envs with one seed per group, so they
        start from the same state (for envs whose reset depends only on the seed, as gymnasium's
        own envs do).
        """
        ids, seeds = self._reset_seeds(seed, env_ids, group_size)
        if len(ids) == 0:
            return self._to_obs(self._last_obs), {}
        reset_mask = np.zeros(self.num_envs, dtype=bool)
        reset_mask[ids] = True
        if reset_mask.all():
            obs, _ = self._vec.reset(seed=seeds)
        else:
            obs, _ = self._vec.reset(seed=seeds, options={"reset_mask": reset_mask})
        self._last_obs = np.array(obs)
        return self._to_obs(obs), {}

    def step(self, action: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        env_action = self._env_action(action).astype(self._act_dtype).reshape(
            (self.num_envs, *self._act_shape))
        obs, reward, terminated, truncated, infos = self._vec.step(env_action)
        self._last_obs = np.array(obs)
        obs_t = self._to_obs(obs, device="cpu")

        # For the envs that finished, gymnasium put the step's info under final_info and the
        # info of the reset that followed at the top level: their success comes from the former.
        success = _success_from(infos, self.num_envs)
        final_mask = np.asarray(infos.get("_final_obs", np.zeros(self.num_envs, dtype=bool)))
        final_obs = obs_t.clone()
        if final_mask.any():
            final_success = _success_from(infos["final_info"], self.num_envs)
            success = np.where(final_mask, final_success, success)
            for i in np.flatnonzero(final_mask):
                final_obs[i] = torch.as_tensor(
                    np.asarray(infos["final_obs"][i], dtype=np.float32).reshape(-1))
        return self._step_result(obs_t, reward, terminated, truncated, success, final_mask,
                                 final_obs)

    # ---------------------------------------------------------------- render / misc

    def render(self, env_ids: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """uint8 Tensor[k, H, W, 3] of the envs `env_ids` (all envs when None)."""
        ids = self._env_ids(env_ids).tolist()
        if self.vector == "sync":
            frames = [self._vec.envs[i].render() for i in ids]
        else:
            # AsyncVectorEnv can only call a method on every worker.
            all_frames = self._vec.call("render")
            frames = [all_frames[i] for i in ids]
        if any(frame is None for frame in frames):
            raise UserError(f"{self.env_id!r} returned no frame: make the env with "
                            "render_mode='rgb_array'")
        frames = [np.asarray(frame, dtype=np.uint8)[..., :3] for frame in frames]
        return torch.from_numpy(np.stack(frames)) if frames else torch.zeros(
            0, 0, 0, 3, dtype=torch.uint8)

    def close(self) -> None:
        self._vec.close()

    def _to_obs(self, obs: np.ndarray, device: torch.device | str | None = None
                ) -> torch.Tensor:
        obs = np.array(obs, dtype=np.float32).reshape(self.num_envs, self.obs_dim)  # a copy
        return torch.from_numpy(obs).to(device or self.device)


def make_env(task: str, num_envs: int, device: str | torch.device = "cpu", seed: int = 0, *,
             obs_mode: str = "state", image_size: int = 96, render_size: int = 256,
             **options: Any) -> GymnasiumEnv:
    """The registry's entry point: `task` is a gymnasium id, or a task name of this package
    (reach, push_t, ...), which runs its gymnasium registration (embodied_rl/PushT-v0, ...).

    `options` are GymnasiumEnv's keyword arguments (vector, max_episode_steps, render_mode,
    flatten_obs, env_kwargs). Frames have the wrapped env's own size: image_size and render_size
    do not apply here.
    """
    from embodied_rl.envs import registry

    if obs_mode != "state":
        raise UserError("the gymnasium backend supports obs_mode='state' only")
    allowed = {"vector", "max_episode_steps", "render_mode", "flatten_obs", "env_kwargs"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise UserError(f"unknown option(s) {unknown} for the gymnasium backend "
                        f"(choose from: {', '.join(sorted(allowed))})")
    if task in registry.GYM_NAMES:
        import embodied_rl.envs.gym_env  # noqa: F401  (registers embodied_rl/<Name>-v0)

        task = registry.gym_id(task)
    return GymnasiumEnv(task, num_envs=num_envs, seed=seed, device=device, **options)
