"""Meta-World v3 tasks and suites by name: `metaworld/<task>` (e.g. metaworld/pick-place) and the
multi-task suites `metaworld/MT10` and `metaworld/MT50`.

They are not simulated by this package's MuJoCo backends: EnvPool's C++ port of Meta-World v3 runs
them (backend=envpool, embodied_rl/envs/backends/envpool.py), so a MetaWorldTask only describes
the task: sizes, episode length, success and instructions. Its config, configs/task/metaworld/
<name>.yaml, is the one place where a task's English instruction (`instructions`) or a suite's
member tasks (`suite_tasks`) are written; this module reads them from there.

Every Meta-World task is language-conditioned: obs["instruction"] is the index of the env's task
in `suite_tasks` (one task, index 0, for a single task), and `instructions` holds the tasks'
sentences in that order. In a suite the N envs are split evenly across the tasks, in order.
"""

from __future__ import annotations

import functools
from typing import Any

import yaml

from embodied_rl.envs.api import Task
from embodied_rl.errors import UserError
from embodied_rl.paths import config_dir

PREFIX = "metaworld/"
SUITES = ("MT10", "MT50")


def camel_case(name: str) -> str:
    """pick-place -> PickPlace."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("-"))


def envpool_id(task: str) -> str:
    """EnvPool's id of a Meta-World task name: pick-place -> MetaWorld/PickPlace-v3."""
    return f"MetaWorld/{camel_case(task)}-v3"


def config_path(short_name: str):
    return config_dir() / "task" / "metaworld" / f"{short_name}.yaml"


def task_names() -> list[str]:
    """Every `metaworld/<name>` with a config: the suites first, then the 50 tasks."""
    names = sorted(path.stem for path in (config_dir() / "task" / "metaworld").glob("*.yaml"))
    return [PREFIX + name for name in SUITES if name in names] + [
        PREFIX + name for name in names if name not in SUITES]


def is_task(name: str) -> bool:
    return config_path(name[len(PREFIX):]).is_file()


@functools.cache
def _config(short_name: str) -> dict[str, Any]:
    path = config_path(short_name)
    if not path.is_file():
        raise UserError(f"unknown task '{PREFIX}{short_name}' (no {path.name} in configs/task/metaworld; "
                        "`embodied-rl tasks` lists them)")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


class MetaWorldTask(Task):
    """A Meta-World v3 task or suite, run by EnvPool (the class attributes describe it)."""

    backends = ("envpool",)
    obs_dim = 39  # hand xyz, gripper, two objects' pose, the previous frame of those, goal xyz
    action_dim = 4  # hand xyz motion, gripper
    max_episode_steps = 500  # Meta-World's max_path_length
    has_success = True
    # Meta-World's own evaluation counts an episode as a success if the flag is ever set; ending
    # the episode there spends no steps after it and changes no success rate.
    success_terminates = True
    success_criterion = "Meta-World's own success flag (info['success']); the episode ends at the first success"
    control_rate_hz = 80.0  # Meta-World's frame_skip 5 x timestep 0.0025 s (its render_fps)
    camera = ""  # EnvPool renders videos itself; no pixel observations (docs/backends.md)
    suite_tasks: tuple[str, ...] = ()  # Meta-World task names; env i runs suite_tasks[i // (N / K)]

    @property
    def envpool_ids(self) -> list[str]:
        return [envpool_id(task) for task in self.suite_tasks]


@functools.cache
def task_class(name: str) -> type[MetaWorldTask]:
    """The MetaWorldTask subclass of `metaworld/<task>` or `metaworld/<suite>`."""
    short_name = name[len(PREFIX):] if name.startswith(PREFIX) else name
    config = _config(short_name)
    if "suite_tasks" in config:
        suite_tasks = tuple(config["suite_tasks"])
        instructions = tuple(_config(task)["instructions"][0] for task in suite_tasks)
    else:
        suite_tasks = (short_name,)
        instructions = tuple(config["instructions"])
    return type(f"MetaWorld{camel_case(short_name)}Task", (MetaWorldTask,), {
        "name": PREFIX + short_name, "suite_tasks": suite_tasks, "instructions": instructions,
        "__doc__": f"Meta-World v3 {short_name} ({len(suite_tasks)} task(s)), run by EnvPool.",
    })
