"""One module per CLI command. Each has `main(cfg) -> (headline, run_dir)`: thin orchestration
over the library layers (envs, data, policies, actors, algos, eval); run_dir is None for a
command that writes none (tasks). The checks commands share live here: `validate_common` (seed,
sizes, device, backend, ...) and `checkpoint_task` (a checkpoint's task)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from embodied_rl.errors import UserError
from embodied_rl.runs import DONE_FILE, LOCK_FILE, Run, atomic_write_json, default_run_dir

OBS_MODES = ("state", "pixels")


def run_command(module: Any, cfg: DictConfig) -> tuple[dict[str, Any], Path | None]:
    """Run a command module's `main(cfg)` (the CLI and quickstart's stages both come here).

    A run directory that this call created and that a refused command (UserError) left holding
    nothing but its config is removed, so the corrected command may use the same run_dir and
    refused runs do not litter runs/. A command that ran to its end writes done.json in its run
    directory, last: the one sign that the run finished (eval_info.json and checkpoints are also
    written part-way)."""
    from embodied_rl import distributed

    created = len(Run.created)
    try:
        headline, run_dir = module.main(cfg)
    except UserError:
        for path in Run.created[created:]:
            _remove_if_unused(path)
        raise
    if run_dir is not None and distributed.is_main():
        atomic_write_json(Path(run_dir) / DONE_FILE, {"headline": headline})
    return headline, run_dir


def _remove_if_unused(path: Path) -> None:
    """Remove a run directory holding only config.yaml and its lock (and the empty date folder
    of a default run_dir)."""
    if not path.is_dir() or any(p.name not in ("config.yaml", LOCK_FILE) for p in path.iterdir()):
        return
    for name in ("config.yaml", LOCK_FILE):
        (path / name).unlink(missing_ok=True)
    path.rmdir()
    if path.parent.parent.name == "runs" and not any(path.parent.iterdir()):
        path.parent.rmdir()


def start_run(cfg: DictConfig, command: str, allow_existing: bool = False) -> Run:
    """Create the run directory (run_dir=PATH or runs/<date>/<time>_<command>_<task>) and save
    the resolved config in it. Under torchrun rank 0 does that, and the other ranks get a
    follower Run of the same directory, which writes nothing."""
    from embodied_rl import distributed

    if not distributed.is_main():
        return Run.follower(distributed.broadcast_object(None), command=command)
    task = OmegaConf.select(cfg, "task.name", default=None)
    path = Path(cfg.run_dir) if cfg.get("run_dir") else default_run_dir(command, task)
    run = Run(path, command=command, allow_existing=allow_existing)
    run.file(DONE_FILE).unlink(missing_ok=True)  # a finished run given more work is running again
    run.write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    distributed.broadcast_object(str(run.path))
    return run


def _flat_items(cfg: DictConfig) -> dict[str, Any]:
    def walk(node: Any, prefix: str) -> dict[str, Any]:
        if isinstance(node, dict):
            out: dict[str, Any] = {}
            for key, value in node.items():
                out.update(walk(value, f"{prefix}{key}."))
            return out
        return {prefix[:-1]: node}

    return walk(OmegaConf.to_container(cfg, resolve=True), "")


def check_previous_run(cfg: DictConfig, command: str, may_change: tuple[str, ...]) -> None:
    """A non-empty run_dir must hold an earlier `command` run with the same settings, except the
    keys in `may_change` (how long it runs and what it records, not what it trains), so the run
    resumes; its config.yaml is then rewritten, so it always tells what ran."""
    if not cfg.get("run_dir"):
        return
    path = Path(str(cfg.run_dir))
    if not path.is_dir() or not any(p.name != LOCK_FILE for p in path.iterdir()):
        return
    previous = path / "config.yaml"
    if not previous.is_file():
        raise UserError(f"run_dir '{path}' holds files but no {command} run; choose a new run_dir (nothing was overwritten)")
    before, now = _flat_items(OmegaConf.load(previous)), _flat_items(cfg)
    changed = sorted(key for key in before.keys() | now.keys()
                     if before.get(key) != now.get(key) and key not in (*may_change, "threads", "run_dir"))
    if changed:
        shown = ", ".join(f"{key}={before.get(key)} -> {now.get(key)}" for key in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise UserError(f"run_dir '{path}' holds a run with other settings ({shown}{more}); resume it with "
                        f"the same settings (only {', '.join(may_change)} may change) or choose a new run_dir")


def _integer(cfg: DictConfig, key: str, low: int) -> int:
    value = cfg[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise UserError(f"{key} must be an integer >= {low}, got {value!r}")
    return value


def check_device(device: Any) -> None:
    """cpu, cuda or cuda:N, and CUDA only where torch can use it."""
    device = str(device)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UserError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UserError(f"device={device} but torch cannot use CUDA here (no GPU or a CPU-only torch); "
                            "use device=cpu")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise UserError(f"device={device} but this machine has {torch.cuda.device_count()} CUDA device(s)")


def validate_common(cfg: DictConfig, min_eval_episodes: int = 1) -> None:
    """Check the keys commands share (each where the command has it) before any work, so that a
    bad value stops the command with one line and leaves no run directory.

    `min_eval_episodes`: 0 where eval_episodes=0 means "no evaluation" (pretrain).
    """
    from embodied_rl.envs import BACKENDS

    if "seed" in cfg:
        _integer(cfg, "seed", 0)
    if "num_envs" in cfg:
        _integer(cfg, "num_envs", 1)
    episodes = None
    if "episodes" in cfg:
        episodes = ("episodes", _integer(cfg, "episodes", 1))
    elif "eval_episodes" in cfg:
        episodes = ("eval_episodes", _integer(cfg, "eval_episodes", min_eval_episodes))
    if cfg.get("videos") is not None:
        videos = _integer(cfg, "videos", 0)
        if episodes is not None and episodes[1] > 0 and videos > episodes[1]:
            raise UserError(f"videos must be in [0, {episodes[0]}={episodes[1]}], got {videos}")
    if "device" in cfg:
        check_device(cfg.device)
    if "backend" in cfg and cfg.backend is not None and cfg.backend not in BACKENDS:
        raise UserError(f"unknown backend {cfg.backend!r} (choose from: {', '.join(BACKENDS)})")
    if cfg.get("obs") is not None and cfg.obs not in OBS_MODES:
        raise UserError(f"obs must be one of {', '.join(OBS_MODES)}, got {cfg.obs!r}")
    for key, low in (("image_size", 8), ("video_size", 16)):  # the smallest frames worth rendering
        if key in cfg:
            _integer(cfg, key, low)


def recorded_task(policy: Any, path: Path) -> str | None:
    """The task a policy checkpoint records (config.json "task", or its policy or extra
    section), if any."""
    for source in (policy, getattr(policy, "config", None)):
        if source is None:
            continue
        value = source.get("task") if isinstance(source, dict) else getattr(source, "task", None)
        if isinstance(value, str) and value:
            return value
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    extra = config.get("extra") if isinstance(config.get("extra"), dict) else {}
    for value in (config.get("task"), extra.get("task")):
        if isinstance(value, str) and value:
            return value
    return None


def checkpoint_task(policy: Any, path: Path, requested: str | None) -> str:
    """The task to run a policy checkpoint on: the one it records, which must be a known task,
    agree with task= when that is given, and match the policy's observation and action sizes and,
    for a language-conditioned policy, the task's instruction list (its ids index that list).
    Anything else is a UserError (eval and finetune refuse the same checkpoints)."""
    from embodied_rl.envs.registry import TASKS, is_task, task_class

    trained_on = recorded_task(policy, path)
    if trained_on is None:
        raise UserError(f"checkpoint '{path}' does not record the task it was trained on "
                        "(config.json 'task'), so it cannot be checked against one")
    if not is_task(trained_on):
        raise UserError(f"checkpoint '{path}' was trained on task '{trained_on}', which is not a known task "
                        f"(known: {', '.join(TASKS)}, metaworld/<task>)")
    if requested is not None and requested != trained_on:
        raise UserError(f"checkpoint '{path}' was trained on task '{trained_on}' but task={requested}; "
                        f"pass task={trained_on}")
    task = task_class(trained_on)
    sizes = (getattr(policy, "obs_dim", None), getattr(policy, "action_dim", None))
    if sizes != (task.obs_dim, task.action_dim):
        raise UserError(f"checkpoint '{path}' has observation and action sizes {sizes}, but task '{trained_on}' "
                        f"has {(task.obs_dim, task.action_dim)}")
    instructions = list(getattr(policy, "instructions", None) or [])
    if instructions and instructions != list(task.instructions):
        raise UserError(f"checkpoint '{path}' was trained on the instructions {instructions}, but task '{trained_on}' "
                        f"has {list(task.instructions)}")
    return trained_on
