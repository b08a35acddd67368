"""Names -> Task classes and backend modules, imported lazily.

Tasks: `TASKS[name] = (module, class)`; the module `embodied_rl.envs.tasks.<name>` defines the
Task subclass. Backends: `BACKENDS[name] = module`; the module exposes
`make_env(task, num_envs, device, seed, **options) -> BatchedEnv`, where `task` is a Task
instance for the MuJoCo backends and a gymnasium env id (str) for backend="gymnasium".
"""

from __future__ import annotations

import importlib
from typing import Any

from embodied_rl.envs.api import BatchedEnv, Task
from embodied_rl.errors import UserError

TASKS: dict[str, tuple[str, str]] = {
    "reach": ("embodied_rl.envs.tasks.reach", "ReachTask"),
    "push_t": ("embodied_rl.envs.tasks.push_t", "PushTTask"),
    "lift": ("embodied_rl.envs.tasks.lift", "LiftTask"),
    "peg_insert": ("embodied_rl.envs.tasks.peg_insert", "PegInsertTask"),
    "hopper": ("embodied_rl.envs.tasks.hopper", "HopperTask"),
}

# gymnasium ids: embodied_rl/<GymName>-v0
GYM_NAMES: dict[str, str] = {
    "reach": "Reach",
    "push_t": "PushT",
    "lift": "Lift",
    "peg_insert": "PegInsert",
    "hopper": "Hopper",
}

BACKENDS: dict[str, str] = {
    "mujoco": "embodied_rl.envs.backends.mujoco_cpu",
    "mujoco_warp": "embodied_rl.envs.backends.mujoco_warp",
    "gymnasium": "embodied_rl.envs.backends.gymnasium",
}


def gym_id(task_name: str) -> str:
    return f"embodied_rl/{GYM_NAMES[task_name]}-v0"


def task_class(name: str) -> type[Task]:
    if name not in TASKS:
        raise UserError(f"unknown task '{name}' (choose from: {', '.join(TASKS)})")
    module_name, class_name = TASKS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            raise UserError(f"task '{name}' is not available in this installation ({module_name} is missing)") from None
        raise
    return getattr(module, class_name)


def make_task(name: str, **options: Any) -> Task:
    return task_class(name)(**options)


def backend_module(backend: str):
    if backend not in BACKENDS:
        raise UserError(f"unknown backend '{backend}' (choose from: {', '.join(BACKENDS)})")
    module_name = BACKENDS[backend]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            raise UserError(f"backend '{backend}' is not available ({module_name} is missing)") from None
        if backend == "mujoco_warp" and error.name and error.name.split(".")[0] in ("mujoco_warp", "warp"):
            raise UserError("backend 'mujoco_warp' needs MuJoCo Warp: pip install 'embodied-rl[warp]'") from None
        raise


def make(
    name: str,
    num_envs: int = 1,
    backend: str = "mujoco",
    device: str = "cpu",
    seed: int = 0,
    *,
    obs_mode: str = "state",
    image_size: int = 96,
    render_size: int = 256,
    task_options: dict[str, Any] | None = None,
    **backend_options: Any,
) -> BatchedEnv:
    """Make N copies of a task on a backend.

    `name` is a registered task (reach, push_t, lift, peg_insert, hopper), or for
    backend="gymnasium" a gymnasium env id. `obs_mode="pixels"` returns obs dicts
    {"state": f32 [N, D], "pixels": u8 [N, image_size, image_size, 3]}. `task_options` override
    Task class attributes (e.g. {"max_episode_steps": 100}); `backend_options` go to the backend.
    """
    if int(num_envs) < 1:
        raise UserError(f"num_envs must be >= 1, got {num_envs}")
    module = backend_module(backend)
    options = dict(obs_mode=obs_mode, image_size=image_size, render_size=render_size, **backend_options)
    if backend == "gymnasium":
        if task_options:
            options.update(task_options)
        return module.make_env(name, int(num_envs), device, seed, **options)
    task = make_task(name, **(task_options or {}))
    return module.make_env(task, int(num_envs), device, seed, **options)
