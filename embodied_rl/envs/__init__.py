"""Batched simulation: N copies of a task stepped at once, as torch tensors.

    env = embodied_rl.envs.make("reach", num_envs=64, backend="mujoco", device="cpu", seed=0)
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(action)   # action [N, A] in [-1, 1]

Importing this package registers every task with gymnasium as `embodied_rl/<Name>-v0`.
"""

import os

# Offscreen rendering without a display: EGL unless the user chose another backend. MuJoCo reads
# this when it is first imported, so it is set before anything imports mujoco.
os.environ.setdefault("MUJOCO_GL", "egl")

from embodied_rl.envs.api import BatchedEnv, SimBatchedEnv, SimState, Task, step_chunk
from embodied_rl.envs.experts import make_expert
from embodied_rl.envs.gym_env import register_all as _register_gym_envs
from embodied_rl.envs.registry import (
    BACKENDS,
    TASKS,
    has_expert,
    make,
    make_task,
    resolve_backend,
    task_names,
    task_overrides,
)

_register_gym_envs()

__all__ = [
    "BACKENDS",
    "TASKS",
    "BatchedEnv",
    "SimBatchedEnv",
    "SimState",
    "Task",
    "has_expert",
    "make",
    "make_expert",
    "make_task",
    "resolve_backend",
    "task_names",
    "step_chunk",
    "task_overrides",
]
