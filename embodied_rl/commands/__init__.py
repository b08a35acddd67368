"""One module per CLI command. Each has `main(cfg) -> (headline, run_dir)`: thin orchestration
over the library layers (envs, data, policies, actors, algos, eval)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from embodied_rl.runs import Run, default_run_dir


def start_run(cfg: DictConfig, command: str, allow_existing: bool = False) -> Run:
    """Create the run directory (run_dir=PATH or runs/<date>/<time>_<command>_<task>) and save
    the resolved config in it."""
    task = OmegaConf.select(cfg, "task.name", default=None)
    path = Path(cfg.run_dir) if cfg.get("run_dir") else default_run_dir(command, task)
    run = Run(path, command=command, allow_existing=allow_existing)
    run.write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    return run
