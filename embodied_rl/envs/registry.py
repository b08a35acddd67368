"""Names -> Task classes and backend modules, imported lazily.

Tasks: `TASKS[name] = (module, class)`; the module `embodied_rl.envs.tasks.<name>` defines the
Task subclass. External suites are named with a prefix: `metaworld/<task>` and `metaworld/MT10`
are MetaWorldTask classes built from their configs (embodied_rl.envs.tasks.metaworld),
`libero/<suite>` and `libero/<suite>/<task id>` LiberoTask classes (embodied_rl.envs.tasks.libero).
Backends: `BACKENDS[name] = module`; the module exposes
`make_env(task, num_envs, device, seed, **options) -> BatchedEnv`, where `task` is a Task
instance, or for backend="gymnasium" / "envpool" / "process" an env id (str) of that engine
(the process backend and the gymnasium one get this package's task names as names too).
A task runs on the backends in its `backends` attribute; the first is its default.
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
    "tabletop": ("embodied_rl.envs.tasks.tabletop", "TabletopTask"),
}

# gymnasium ids: embodied_rl/<GymName>-v0
GYM_NAMES: dict[str, str] = {
    "reach": "Reach",
    "reach_choice": "ReachChoice",
    "push_t": "PushT",
    "lift": "Lift",
    "peg_insert": "PegInsert",
    "hopper": "Hopper",
    "tabletop": "Tabletop",
}

BACKENDS: dict[str, str] = {
    "mujoco": "embodied_rl.envs.backends.mujoco_cpu",
    "mujoco_warp": "embodied_rl.envs.backends.mujoco_warp",
    "gymnasium": "embodied_rl.envs.backends.gymnasium",
    "envpool": "embodied_rl.envs.backends.envpool",
    "process": "embodied_rl.envs.backends.process",
}

# Backends that also take an env id of their own engine for a name that is not a task here.
ENGINE_BACKENDS = ("gymnasium", "envpool", "process")


def gym_id(task_name: str) -> str:
    return f"embodied_rl/{GYM_NAMES[task_name]}-v0"


# External suites, named <prefix>/...: the module that describes their tasks, with task_names(),
# is_task(name), task_class(name) and optionally has_expert(name).
SUITES: dict[str, str] = {
    "metaworld": "embodied_rl.envs.tasks.metaworld",
    "libero": "embodied_rl.envs.tasks.libero",
}


def is_suite_task(name: str) -> bool:
    """Whether `name` names a task of an external suite (metaworld/<task>, libero/<suite>/...)."""
    return name.split("/", 1)[0] in SUITES and "/" in name


def suite_module(name: str):
    return importlib.import_module(SUITES[name.split("/", 1)[0]])


def task_names() -> list[str]:
    """Every task name: this package's tasks, then the external suites' (metaworld/..., libero/...)."""
    return [*TASKS, *(name for module in SUITES.values() for name in importlib.import_module(module).task_names())]


def is_task(name: str) -> bool:
    if name in TASKS:
        return True
    return is_suite_task(name) and suite_module(name).is_task(name)


def import_module(module_name: str, missing: str):
    """The module `module_name`; where the module itself is not there, a UserError saying `missing`
    (a module it imports that is missing stays a ModuleNotFoundError: a broken installation)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            raise UserError(missing) from None
        raise


def task_class(name: str) -> type[Task]:
    if is_suite_task(name):
        return suite_module(name).task_class(name)
    if name not in TASKS:
        raise UserError(f"unknown task '{name}' (choose from: {', '.join(TASKS)}, or metaworld/<task>, "
                        "libero/<suite>[/<task id>]; `embodied-rl tasks` lists them all)")
    module_name, class_name = TASKS[name]
    module = import_module(module_name, f"task '{name}' is not available in this installation ({module_name} is missing)")
    return getattr(module, class_name)


def make_task(name: str, **options: Any) -> Task:
    return task_class(name)(**options)


def expert_module(name: str) -> str:
    """The module of a task's scripted expert: embodied_rl.envs.experts.<name>, or for a suite's
    task (metaworld/<task>) the suite's module, embodied_rl.envs.experts.metaworld."""
    return "embodied_rl.envs.experts." + name.split("/", 1)[0]


def has_expert(name: str) -> bool:
    """Whether the task has a scripted expert (a module embodied_rl.envs.experts.<name>; a suite
    whose experts cover only some tasks says which)."""
    if is_suite_task(name) and hasattr(suite_module(name), "has_expert"):
        return suite_module(name).has_expert(name)
    return importlib.util.find_spec(expert_module(name)) is not None


def check_simulator(name: str, task_options: Mapping[str, Any] | None = None) -> None:
    """Refuse, in one line, a task whose simulator is not set up (LIBERO without its venv), so a
    command stops before its run directory exists even where it makes its env late (pretrain)."""
    cls = task_class(name)
    if hasattr(cls, "worker_python"):
        cls().worker_python(((task_options or {}).get("process") or {}).get("python"))


# Keys of configs/task/<name>.yaml that commands read (collect, pretrain), not the Task.
COMMAND_KEYS = ("name", "demos", "quality", "pretrain_steps", "image_size")
# Keys that say what a task is: a config may state them, but only as the task has them.
DESCRIPTIVE_KEYS = ("gym_id", "xml", "obs_dim", "action_dim", "camera", "has_success",
                    "success_criterion", "expert", "instructions", "suite_tasks")
POSITIVE_KEYS = ("max_episode_steps", "control_substeps")
# task.process.<key>: the process backend's options (configs/task/<name>.yaml: process), passed
# to it as task_options["process"]; null keeps the backend's default.
PROCESS_KEYS = ("python", "workers", "timeout")


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
    keys (has_success, expert, obs_dim, ...) must match the task made with the other keys; every
    other key overrides the Task class attribute of that name (max_episode_steps, ...). Returns
    only the values that differ from the class. A contradiction, an unknown key or a bad value is
    a UserError naming the key.
    """
    name = task_cfg["name"]
    cls = task_class(name)
    overrides: dict[str, Any] = {}
    process_options: dict[str, Any] = {}
    descriptive: dict[str, Any] = {}
    for key in task_cfg:
        value = task_cfg[key]
        if key in COMMAND_KEYS:
            continue
        if key == "process":
            process = {k: v for k, v in dict(value or {}).items() if v is not None}
            unknown = sorted(set(process) - set(PROCESS_KEYS))
            if unknown:
                raise UserError(f"unknown key 'task.process.{unknown[0]}' (choose from: {', '.join(PROCESS_KEYS)})")
            if process:
                process_options = process
            continue
        if key in DESCRIPTIVE_KEYS:
            descriptive[key] = value
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
    # Descriptive keys are checked against the task made with these options: a description may
    # follow an option (push_t's success_criterion follows task.success). Making it also runs
    # the task's own checks of its option values.
    task = cls(**overrides)
    for key, value in descriptive.items():
        actual = has_expert(name) if key == "expert" else getattr(task, key)
        if isinstance(actual, tuple):  # instructions, suite_tasks: a list in the config
            actual, value = list(actual), list(value)
        if value != actual:
            raise UserError(f"task.{key}={value} contradicts task '{name}', whose {key} is {actual!r}")
    if process_options:
        overrides["process"] = process_options
    return overrides


def resolve_backend(name: str, backend: str | None) -> str:
    """The backend to run `name` on: `backend`, or the task's default when None. A task that does
    not run on the backend asked for is a UserError naming the ones it runs on."""
    if backend is not None and backend not in BACKENDS:
        raise UserError(f"unknown backend '{backend}' (choose from: {', '.join(BACKENDS)})")
    if not is_task(name):
        if backend in ENGINE_BACKENDS:
            return backend
        if is_suite_task(name) or backend is None:
            task_class(name)  # raises: unknown task
        raise UserError(f"unknown task '{name}' for backend '{backend}' (an env id of another engine needs "
                        f"backend={' or backend='.join(ENGINE_BACKENDS)})")
    backends = task_class(name).backends
    if backend is None:
        return backends[0]
    if backend not in backends:
        raise UserError(f"task '{name}' runs on backend {', '.join(backends)}, not '{backend}'")
    return backend


def backend_module(backend: str):
    if backend not in BACKENDS:
        raise UserError(f"unknown backend '{backend}' (choose from: {', '.join(BACKENDS)})")
    module_name = BACKENDS[backend]
    try:
        return import_module(module_name, f"backend '{backend}' is not available ({module_name} is missing)")
    except ModuleNotFoundError as error:  # a package the backend needs: say how to install it
        if backend == "mujoco_warp" and error.name and error.name.split(".")[0] in ("mujoco_warp", "warp"):
            raise UserError("backend 'mujoco_warp' needs MuJoCo Warp: pip install 'embodied-rl[warp]'") from None
        if backend == "envpool" and error.name and error.name.split(".")[0] == "envpool":
            raise UserError("backend 'envpool' needs EnvPool: pip install 'embodied-rl[envpool]'") from None
        raise


def make(
    name: str,
    num_envs: int = 1,
    backend: str | None = None,
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

    `name` is a registered task (reach, reach_choice, push_t, lift, peg_insert, hopper, tabletop,
    metaworld/<task>, metaworld/MT10, libero/<suite>[/<task id>], ...), or for backend="gymnasium" /
    "envpool" / "process" an env id of that engine. `backend=None` takes the task's default
    (`Task.backends[0]`: mujoco for this package's tasks, envpool for Meta-World, process for LIBERO). `obs_mode="pixels"` returns obs dicts
    {"state": f32 [N, D], "pixels": u8 [N, image_size, image_size, 3]}, and with
    `reward_camera="<camera>"` (mujoco backends) also that camera's frames as "reward_pixels". `task_options` override
    Task class attributes (e.g. {"max_episode_steps": 100}); their entry "process" (task.process
    in a task config) holds options of the process backend; `backend_options` go to the backend.
    """
    if int(num_envs) < 1:
        raise UserError(f"num_envs must be >= 1, got {num_envs}")
    backend = resolve_backend(name, backend)
    task_options = dict(task_options or {})
    process_options = task_options.pop("process", None) or {}
    if process_options and backend != "process":
        raise UserError(f"task.process.{next(iter(process_options))} applies to backend=process only, "
                        f"not backend={backend}")
    if backend_options.get("reward_camera") and backend not in ("mujoco", "mujoco_warp"):
        raise UserError(f"a reward camera (reward_camera) renders on the mujoco and mujoco_warp backends only, "
                        f"not backend={backend}")
    module = backend_module(backend)
    options = dict(obs_mode=obs_mode, image_size=image_size, render_size=render_size,
                   **{**process_options, **backend_options})
    if backend == "envpool" and not is_task(name):  # an EnvPool id, e.g. Hopper-v5
        options.update(task_options or {})
        return module.make_env(name, int(num_envs), device, seed, **options)
    # a task that describes its own workers (LIBERO's process_spec) is made below, as a Task
    describes_workers = is_task(name) and hasattr(task_class(name), "process_spec")
    if backend in ("gymnasium", "process") and not describes_workers:
        if task_options and name in TASKS:  # this package's task, made inside each gymnasium env
            env_kwargs = dict(options.pop("env_kwargs", None) or {})
            options["env_kwargs"] = {**env_kwargs, "task_options": dict(task_options)}
        elif task_options:  # a gymnasium id: its options (max_episode_steps, ...)
            options.update(task_options)
        return module.make_env(name, int(num_envs), device, seed, **options)
    task = make_task(name, **task_options)
    return module.make_env(task, int(num_envs), device, seed, **options)
