"""Every task as a plain single-env gymnasium.Env, for Stable-Baselines3 and other libraries.

`import embodied_rl.envs` registers `embodied_rl/<Name>-v0` (Reach, ReachChoice, PushT, Lift, Tabletop,
PegInsert, Hopper). Without that import, `gymnasium.make("embodied_rl.envs:embodied_rl/Reach-v0")`
imports the module first (gymnasium's "module:id" syntax; gymnasium 1.x has no plugin entry
points).
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
import torch

from embodied_rl.envs.registry import GYM_NAMES, TASKS, gym_id


class GymEnv(gymnasium.Env):
    """One env of a BatchedEnv(num_envs=1): numpy float32 obs and actions, info["is_success"].

    A task with instructions (or obs_mode="pixels") gives dict observations: "state" float32,
    "instruction" np.int64 (an index into `instructions`), "pixels" uint8.

    The episode ends with the task's own terminated/truncated flags (its max_episode_steps).
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 25}

    def __init__(self, task: str, render_mode: str | None = None, backend: str = "mujoco", **make_options: Any):
        from embodied_rl.envs.registry import make

        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}, got {render_mode!r}")
        self.render_mode = render_mode
        self.batched = make(task, num_envs=1, backend=backend, **make_options)
        self.observation_space = self.batched.single_observation_space
        self.action_space = self.batched.single_action_space
        self.instructions = self.batched.instructions
        self.max_episode_steps = self.batched.max_episode_steps  # its own limit (no TimeLimit wrapper)
        self._seeded = False

    @staticmethod
    def _numpy(obs: Any) -> Any:
        if isinstance(obs, dict):  # "instruction" (a language-conditioned task) as an np.int64
            return {key: np.int64(value[0].item()) if key == "instruction" else value[0].cpu().numpy()
                    for key, value in obs.items()}
        return obs[0].cpu().numpy()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is None and not self._seeded:
            seed = int(self.np_random.integers(2**31 - 1))
        self._seeded = True
        obs, _ = self.batched.reset(seed=seed)
        return self._numpy(obs), {}

    def step(self, action: Any):
        action = np.asarray(action)
        if action.shape != self.action_space.shape:
            raise ValueError(f"action must have shape {self.action_space.shape}, got {action.shape}")
        batch = torch.as_tensor(action, dtype=torch.float32).reshape(1, -1)
        obs, reward, terminated, truncated, info = self.batched.step(batch)
        if bool(info["_final"][0]):
            obs = info["final_obs"]
        step_info = {"is_success": bool(info["success"][0]), "unstable": bool(info["unstable"][0])}
        return self._numpy(obs), float(reward[0]), bool(terminated[0]), bool(truncated[0]), step_info

    def get_state(self) -> dict[str, np.ndarray]:
        """Everything this env continues from, as numpy arrays: its BatchedEnv's snapshot (the
        process backend's workers take snapshots through this)."""
        state = {key: value.cpu().numpy() for key, value in self.batched.get_state().items()}
        return {**state, "gym_env/seeded": np.array(self._seeded)}

    def set_state(self, state: dict[str, np.ndarray]) -> None:
        self._seeded = bool(state["gym_env/seeded"])
        self.batched.set_state({key: torch.from_numpy(np.array(value)) for key, value in state.items()
                                if key != "gym_env/seeded"})

    def render(self):
        if self.render_mode == "rgb_array":
            return self.batched.render()[0].cpu().numpy()
        return None

    def close(self) -> None:
        self.batched.close()


def register_all() -> None:
    """Register embodied_rl/<Name>-v0 for every task (idempotent)."""
    for name in TASKS:
        env_id = gym_id(name)
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point="embodied_rl.envs.gym_env:GymEnv", kwargs={"task": name})


__all__ = ["GymEnv", "register_all", "GYM_NAMES"]
