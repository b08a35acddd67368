"""`embodied-rl export-demos format=lerobot data=PATH out=DIR [fps=N] [camera=NAME]`

Writes a demo dataset (from `collect` or `import-demos`) as a LeRobotDataset v3 directory at
`out` (data/lerobot.py), which must be new or empty. Its frame rate is fps=N, else the rate of
the LeRobot dataset it was imported from, else the control rate of its task (1 / (MuJoCo
timestep x control_substeps)). Pixels become videos/observation.images.<camera>/chunk-000/
file-000.mp4 (camera=NAME, else the imported camera's name, else the task's camera, else
"image"). Instructions become the task strings; a dataset without them gets its task's name as
its one task string. The run directory holds config.yaml and export_info.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from embodied_rl.commands.import_demos import FORMATS, ROBOT_TYPE_PREFIX
from embodied_rl.errors import UserError

# dataset attrs that the export carries (task as robot_type, instructions as tasks) or that
# describe the zarr store or an import; any other attr (quality, seed, ...) has no place in LeRobot
CARRIED_ATTRS = ("format", "task", "obs_dim", "action_dim", "instructions", "all_chunks_written", "source")


def validate(cfg: DictConfig) -> None:
    """Check the config before any work."""
    if cfg.format not in FORMATS:
        raise UserError(f"unknown format {cfg.format!r} (choose from: {', '.join(FORMATS)})")
    if cfg.get("data") in (None, ""):
        raise UserError("data=PATH is required (a demo dataset from `embodied-rl collect` or `import-demos`)")
    if cfg.get("out") in (None, ""):
        raise UserError("out=DIR is required (a new or empty directory)")
    out = Path(str(cfg.out)).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"out '{cfg.out}' exists and is not an empty directory; nothing was overwritten")
    if cfg.fps is not None and (not isinstance(cfg.fps, int) or isinstance(cfg.fps, bool) or cfg.fps < 1):
        raise UserError(f"fps must be null or an integer >= 1, got {cfg.fps!r}")
    if cfg.camera is not None and not isinstance(cfg.camera, str):
        raise UserError(f"camera must be a name, got {cfg.camera!r}")


def control_rate(task: str | None) -> int:
    """The task's env steps per second, for fps; a UserError when the task cannot tell."""
    from embodied_rl.envs.registry import is_task, make_task

    if task is None or not is_task(task):
        raise UserError(f"fps=N is required: the dataset's task ({task or 'none recorded'}) is not a known "
                        "task whose control rate could be used")
    spec = make_task(task)
    if spec.control_rate_hz is not None:  # a task run by another engine (Meta-World) states it
        return max(1, round(spec.control_rate_hz))
    try:
        seconds = spec.load_model().opt.timestep * spec.control_substeps
    except Exception as error:  # a suite task whose model lives in another engine (Meta-World)
        raise UserError(f"fps=N is required: task '{task}' has no MuJoCo model here to take its "
                        f"control rate from ({type(error).__name__})") from None
    return max(1, round(1.0 / seconds))


def main(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    from embodied_rl.data import DemoDataset
    from embodied_rl.data.lerobot import IMAGE_PREFIX, require_pyarrow, write_lerobot
    from embodied_rl.envs.registry import is_task, task_class
    from embodied_rl.runs import start_run

    validate(cfg)
    require_pyarrow()
    dataset = DemoDataset.load(Path(str(cfg.data)).expanduser())
    task = dataset.attrs.get("task")
    task = task if isinstance(task, str) and task else None
    # a dataset imported from LeRobot keeps its frame rate and camera name (attrs["source"])
    source = dataset.attrs.get("source") if isinstance(dataset.attrs.get("source"), dict) else {}
    source_fps = source.get("fps")
    source_camera = str(source.get("camera") or "").removeprefix(IMAGE_PREFIX)
    if cfg.fps is not None:
        fps = cfg.fps
    elif isinstance(source_fps, (int, float)) and source_fps >= 1 and float(source_fps).is_integer():
        fps = int(source_fps)
    else:
        fps = control_rate(task)
    camera = cfg.camera or source_camera or (task_class(task).camera if task and is_task(task) else "") or "image"
    if dataset.instruction is not None:
        tasks, task_index = dataset.instructions, dataset.instruction
    else:
        tasks, task_index = [task or "demonstration"], np.zeros(dataset.num_steps, np.int64)

    run = start_run(cfg, "export-demos")
    try:
        summary = write_lerobot(Path(str(cfg.out)).expanduser(), dataset, fps, tasks, task_index,
                                camera=camera, robot_type=ROBOT_TYPE_PREFIX + task if task else None)
        # the demo format's parts that LeRobot has no place for
        summary["not_carried"] = [key for key in dataset.attrs if key not in CARRIED_ATTRS]
        summary["dataset"] = str(dataset.path)
        run.write_json("export_info.json", summary)
    finally:
        run.close()
    headline = {"out": summary["out"], "episodes": summary["episodes"], "frames": summary["frames"], "fps": fps}
    if summary["video"] is not None:
        headline["video"] = summary["video"]
    return headline, run.path
