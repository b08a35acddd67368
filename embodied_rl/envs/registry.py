"""Names -> Task classes and backend modules, imported lazily.

Tasks: `TASKS[name] = (module, class)`; the module `embodied_rl.envs.tasks.<name>` defines the
Task subclass. Backends: `BACKENDS[name] = module`; the module exposes
`make_env(task, num_envs, device, seed, **options) -> BatchedEnv`, where `task` is a Task
instance for the MuJoCo backends and a gymnasium env id (str) for backend="gymnasium".
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from typing import Any

from embodied_rl.envs.api import BatchedEnv, Task
from embodied_rl.errors import UserError

TASKS: dict[str, tuple[str, str]] = {
    "reach": ("embodied_rl.envs.tasks.reach", "ReachTask"),
    "reach_choice": ("embodied_rl.envs.tasks.reach_choice", "ReachChoiceTask"),
    "push_t": ("embodied_rl.envs.tasks.push_t", "PushTTask"),
    "lift": ("embodied_rl.envs.tasks.lift", "LiftTask"),
    "peg_insert": ("embodied_rl.envs.tasks.peg_insert", "PegInsertTask"),
    "hopper": ("embodied_rl.envs.tasks.hopper", "HopperTask"),
}

# gymnasium ids: embodied_rl/<GymName>-v0
GYM_NAMES: dict[str, str] = {
    "reach": "Reach",
    "reach_choice": "ReachChoice",
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


def has_expert(name: str) -> bool:
    """Whether the task has a scripted expert (a module embodied_rl.envs.experts.<name>)."""
    return importlib.util.find_spec(f"embodied_rl.envs.experts.{name}") is not None


# Keys of configs/task/<name>.yaml that commands read (collect, pretrain), not the Task.
COMMAND_KEYS = ("name", "demos", "quality", "pretrain_steps")
# Keys that say what a task is: a config may state them, but only as the task has them.
DESCRIPTIVE_KEYS = ("gym_id", "xml", "obs_dim", "action_dim", "camera", "has_success",
                    "success_criterion", "expert")
POSITIVE_KEYS = ("max_episode_steps", "control_substeps")


def _same_type(value: Any, default: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, int):
        return isinstance(value, int)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, str):
        return isinstance(value, str)
    return True


def task_overrides(task_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The Task options a task config asks for: `make(..., task_options=task_overrides(cfg.task))`.

    `task_cfg` is configs/task/<name>.yaml with the command line's overrides (a dict or
    DictConfig). Keys that commands read (demos, quality, pretrain_steps) are skipped; descriptive
    keys (has_success, expert, obs_dim, ...) must match the task; every other key overrides the
    Task class attribute of that name (max_episode_steps, ...). Returns only the values that
    differ from the class. A contradiction, an unknown key or a bad value is a UserError naming
    the key.
    """
    name = task_cfg["name"]
    cls = task_class(name)
    overrides: dict[str, Any] = {}
    for key in task_cfg:
        value = task_cfg[key]
        if key in COMMAND_KEYS:
            continue
        if key in DESCRIPTIVE_KEYS:
            actual = has_expert(name) if key == "expert" else getattr(cls, key)
            if value != actual:
                raise UserError(f"task.{key}={value} contradicts task '{name}', whose {key} is {actual!r}")
            continue
        if key.startswith("_") or not hasattr(cls, key) or callable(getattr(cls, key)):
            raise UserError(f"unknown key 'task.{key}' for task '{name}'")
        default = getattr(cls, key)
        if not _same_type(value, default):
            raise UserError(f"bad value for 'task.{key}': expected {type(default).__name__}, got {value!r}")
        if key in POSITIVE_KEYS and value < 1:
            raise UserError(f"task.{key} must be >= 1, got {value}")
        if value != default:
            overrides[key] = value
    return overrides


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

    `name` is a registered task (reach, reach_choice, push_t, lift, peg_insert, hopper), or for
    backend="gymnasium" a gymnasium env id. `obs_mode="pixels"` returns obs dicts
    {"state": f32 [N, D], "pixels": u8 [N, image_size, image_size, 3]}. `task_options` override
    Task class attributes (e.g. {"max_episode_steps": 100}); `backend_options` go to the backend.
    """
    if int(num_envs) < 1:
        raise UserError(f"num_envs must be >= 1, got {num_envs}")
    module = backend_module(backend)
    options = dict(obs_mode=obs_mode, image_size=image_size, render_size=render_size, **backend_options)
    if backend == "gymnasium":
        if task_options and name in TASKS:  # this package's task, made inside each gymnasium env
            env_kwargs = dict(options.pop("env_kwargs", None) or {})
            options["env_kwargs"] = {**env_kwargs, "task_options": dict(task_options)}
        elif task_options:  # a gymnasium id: its options (max_episode_steps, ...)
            options.update(task_options)
        return module.make_env(name, int(num_envs), device, seed, **options)
    task = make_task(name, **(task_options or {}))
    return module.make_env(task, int(num_envs), device, seed, **options)
