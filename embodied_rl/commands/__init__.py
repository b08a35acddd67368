"""One module per CLI command. Each has `main(cfg) -> (headline, run_dir)`: thin orchestration
over the library layers (envs, data, policies, actors, algos, eval); run_dir is None for a
command that writes none (tasks). The checks commands share live here: `validate_common` (seed,
sizes, device, backend, ...) and `checkpoint_task` (a checkpoint's task)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from embodied_rl.errors import UserError
from embodied_rl.runs import DONE_FILE, LOCK_FILE, Run, atomic_write_json

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


def _integer(cfg: DictConfig, key: str, low: int) -> int:
    value = cfg[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise UserError(f"{key} must be an integer >= {low}, got {value!r}")
    return value


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
        from embodied_rl.distributed import check_device

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


def checkpoint_task(policy: Any, path: Path, requested: str | None, member: bool = False) -> str:
    """The task to run a policy checkpoint on: the one it records, which must be a known task,
    agree with task= when that is given, and match the policy's observation and action sizes and,
    for a language-conditioned policy, the task's instruction list (its ids index that list).
    With `member` (eval), task= may also name a task of the suite it was trained on: the same
    sizes, every instruction one the policy was trained on (libero/libero_spatial/4 for a
    libero/libero_spatial checkpoint); its ids are then not the policy's (`instruction_ids`).
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
        if member and is_task(requested) and suite_member(policy, task_class(requested)):
            return requested
        suite = " or a task of it whose instructions it was trained on" if member else ""
        raise UserError(f"checkpoint '{path}' was trained on task '{trained_on}' but task={requested}; "
                        f"pass task={trained_on}{suite}")
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


def suite_member(policy: Any, task: Any) -> bool:
    """Whether `policy` (a language-conditioned one) can run `task`, a task of the suite it was
    trained on: the same observation and action sizes, and instructions all among its own."""
    instructions = list(getattr(policy, "instructions", None) or [])
    sizes = (getattr(policy, "obs_dim", None), getattr(policy, "action_dim", None))
    return (bool(instructions) and bool(task.instructions) and sizes == (task.obs_dim, task.action_dim)
            and set(task.instructions) <= set(instructions))


def instruction_ids(policy: Any, task: str) -> list[int] | None:
    """The policy's id of each of `task`'s instructions (env id i reads policy id ids[i]); None when
    they are the same list (the task the policy was trained on)."""
    from embodied_rl.envs.registry import task_class

    own = list(getattr(policy, "instructions", None) or [])
    instructions = list(task_class(task).instructions)
    return None if not own or instructions == own else [own.index(text) for text in instructions]


def load_checkpoint_agent(path: str | Path, num_envs: int, device: str, task: str | None,
                          member: bool = False) -> tuple[Path, Any, Any, str]:
    """(checkpoint, policy, agent, task) of a BC or fine-tuned checkpoint (a run directory stands
    for its checkpoints/last): its policy (a fine-tuned one's base policy: what the env must
    show it), the agent that acts with it (`reset(mask)`, `act(obs)`) and the task it runs on
    (`checkpoint_task`, `member` passed on). A corrupt checkpoint or one with non-finite weights
    is a UserError."""
    from embodied_rl.actors import AGENT_FILE, BASE_POLICY, load_agent, resolve_checkpoint
    from embodied_rl.algos.common import refuse_non_finite_checkpoint
    from embodied_rl.policies import PolicyRunner

    checkpoint = resolve_checkpoint(Path(str(path)).expanduser())
    finetuned = (checkpoint / AGENT_FILE).is_file()  # an RL checkpoint: its actor acts
    policy = load_checkpoint(checkpoint / BASE_POLICY if finetuned else checkpoint, device)
    task = checkpoint_task(policy, checkpoint, task, member)
    agent = load_agent(checkpoint, num_envs, device) if finetuned else PolicyRunner(policy, num_envs)
    refuse_non_finite_checkpoint(checkpoint, policy, agent)
    return checkpoint, policy, agent, task


def load_checkpoint(path: Path, device: str = "cpu") -> Any:
    """`load_policy(path, device)`, with a corrupt or unreadable checkpoint turned into one UserError."""
    from embodied_rl.policies import load_policy

    try:
        return load_policy(path, device=device)
    except UserError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, json.JSONDecodeError) as error:
        # safetensors, json and torch report corrupt files with these; name the checkpoint.
        raise UserError(f"cannot load checkpoint '{path}': {type(error).__name__}: {error}") from None
