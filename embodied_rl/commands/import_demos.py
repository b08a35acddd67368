"""`embodied-rl import-demos format=lerobot path=DIR [task=T] [run_dir=R]`

Reads a LeRobotDataset v3 directory (data/lerobot.py) and writes it as a demo dataset,
<run_dir>/demos.zarr (or out=PATH), with a collect_info.json in the shape `collect` writes, so
`embodied-rl pretrain data=<run_dir>/demos.zarr` takes it as it takes collected demos.

The dataset's task is task=T, or the one its robot_type names when `export-demos` wrote it
("embodied_rl/<task>"); with a task, the state and action sizes must be the task's. Task
strings become instructions (data/instruction + attrs["instructions"]) by `instructions=`:
  auto  a task with instructions: its list (every task string must be one of them); a task
        without: none; no task: kept when the dataset has two or more task strings
  keep  always (in the task's order when the task has instructions)
  drop  never
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from embodied_rl.errors import UserError

FORMATS = ("lerobot",)
INSTRUCTION_MODES = ("auto", "keep", "drop")
# robot_type that export-demos writes: it names the task the demos were collected on
ROBOT_TYPE_PREFIX = "embodied_rl/"


def validate(cfg: DictConfig) -> None:
    """Check the config before any work."""
    if cfg.format not in FORMATS:
        raise UserError(f"unknown format {cfg.format!r} (choose from: {', '.join(FORMATS)})")
    if cfg.get("path") in (None, ""):
        raise UserError("path=DIR is required (a LeRobotDataset v3 directory)")
    if not Path(str(cfg.path)).expanduser().is_dir():
        raise UserError(f"lerobot dataset {cfg.path}: not a directory")
    if cfg.image_size is not None and (not isinstance(cfg.image_size, int) or isinstance(cfg.image_size, bool)
                                       or cfg.image_size < 8):
        raise UserError(f"image_size must be null or an integer >= 8, got {cfg.image_size!r}")
    if cfg.camera is not None and not isinstance(cfg.camera, str):
        raise UserError(f"camera must be a feature name, got {cfg.camera!r}")
    if cfg.instructions not in INSTRUCTION_MODES:
        raise UserError(f"instructions must be one of {', '.join(INSTRUCTION_MODES)}, got {cfg.instructions!r}")
    if cfg.out is not None and Path(cfg.out).exists():
        raise UserError(f"out '{cfg.out}' already exists; choose a new path (nothing was overwritten)")


def dataset_task(requested: str | None, robot_type: str | None) -> str | None:
    """task= when given, else the task that an exported dataset's robot_type names (if known)."""
    from embodied_rl.envs.registry import is_task

    if requested is not None:
        return requested
    if isinstance(robot_type, str) and robot_type.startswith(ROBOT_TYPE_PREFIX):
        name = robot_type[len(ROBOT_TYPE_PREFIX):]
        if is_task(name):
            return name
    return None


def choose_instructions(mode: str, texts: list[str], task_instructions: list[str] | None,
                        where: str) -> list[str] | None:
    """The instruction list to write (ids then index it), or None for no instruction data.
    `task_instructions`: the task's list ([] for a task without), None without a task."""
    keep = {"keep": True, "drop": False}.get(mode)
    if keep is None:  # auto
        keep = bool(task_instructions) if task_instructions is not None else len(texts) >= 2
    if not keep:
        return None
    if task_instructions:
        unknown = [text for text in texts if text not in task_instructions]
        if unknown:
            raise UserError(f"{where}: task string {unknown[0]!r} is not one of the task's instructions "
                            f"{task_instructions}")
        return list(task_instructions)
    return list(texts)


def main(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    from embodied_rl.data import write_demos
    from embodied_rl.data.lerobot import read_lerobot
    from embodied_rl.envs.registry import task_class
    from embodied_rl.runs import start_run

    validate(cfg)
    started = time.perf_counter()
    source = Path(str(cfg.path)).expanduser()
    demos = read_lerobot(source, camera=cfg.camera, image_size=cfg.image_size)
    where = f"lerobot dataset {source}"
    task = dataset_task(OmegaConf.select(cfg, "task.name", default=None), demos.robot_type)
    obs_dim, action_dim = demos.episodes[0]["obs"].shape[1], demos.episodes[0]["action"].shape[1]
    task_instructions = None
    if task is not None:
        cls = task_class(task)
        if (obs_dim, action_dim) != (cls.obs_dim, cls.action_dim):
            raise UserError(f"{where}: observation.state and action have {obs_dim} and {action_dim} values, "
                            f"task '{task}' has {cls.obs_dim} and {cls.action_dim}")
        task_instructions = list(cls.instructions)
    instructions = choose_instructions(cfg.instructions, demos.tasks, task_instructions, where)

    episodes = []
    for episode in demos.episodes:
        episode = dict(episode)
        task_index = episode.pop("task_index")
        if instructions is not None:  # ids in the written list's order
            episode["instruction"] = np.array([instructions.index(demos.tasks[i]) for i in task_index.tolist()],
                                              np.int64)
        episodes.append(episode)

    run = start_run(cfg, "import-demos")
    out = Path(cfg.out) if cfg.out is not None else run.file("demos.zarr")
    source_info = {
        "format": cfg.format, "path": str(source), "codebase_version": demos.codebase_version,
        "fps": demos.fps, "robot_type": demos.robot_type, "camera": demos.camera,
        "tasks": demos.tasks, "not_carried": demos.not_carried,
    }
    attrs: dict[str, Any] = {"obs_dim": obs_dim, "action_dim": action_dim, "source": source_info}
    if task is not None:
        attrs["task"] = task
    if instructions is not None:
        attrs["instructions"] = instructions
    write_demos(out, episodes, attrs)
    info = {
        "task": task,
        "dataset": str(out),
        "episodes_written": len(episodes),
        "episodes_attempted": len(episodes),
        # the success rate of the demos, where the source marks success (next.success)
        "expert_success_rate": float(np.mean([e["success"] for e in episodes])) if demos.has_success else None,
        "demo_return_mean": float(np.mean([e["reward"].sum() for e in episodes])) if demos.has_reward else None,
        "quality": None,
        "mistakes": None,
        "per_instruction": None,
        "seed": None,
        "pixels": demos.camera is not None,
        "wall_time_s": time.perf_counter() - started,
        "source": source_info,
    }
    if demos.not_carried:
        info["note"] = f"features not carried: {', '.join(demos.not_carried)}"
    run.write_json("collect_info.json", info)
    run.close()
    headline: dict[str, Any] = {"dataset": str(out), "episodes_written": len(episodes),
                                "frames": demos.num_frames, "pixels": demos.camera is not None}
    if instructions is not None:
        headline["instructions"] = len(instructions)
    if "note" in info:
        headline["note"] = info["note"]
    return headline, run.path
