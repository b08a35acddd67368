"""`embodied-rl finetune task=T checkpoint=DIR algo=NAME env_steps=N ...`

Validates the config, creates the run directory or resumes it (a run_dir holding
checkpoints/last continues from there), loads the base policy, makes the training env and hands
them to the algorithm: `ALGOS[algo.name]` is a module with
`finetune(cfg, run, env, policy) -> headline dict` (docs/finetuning.md).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from embodied_rl.errors import UserError

ALGOS: dict[str, str] = {
    "residual_ppo": "embodied_rl.algos.ppo",
    "dppo": "embodied_rl.algos.ppo",
    "reinflow": "embodied_rl.algos.ppo",
    "flow_sde": "embodied_rl.algos.ppo",
    "grpo": "embodied_rl.algos.ppo",
    "dsrl_ppo": "embodied_rl.algos.ppo",
    "dsrl": "embodied_rl.algos.dsrl",
    "dsrl_na": "embodied_rl.algos.dsrl",
    "residual_sac": "embodied_rl.algos.sac",
}


def validate(cfg: DictConfig) -> Path:
    """Check the config before any work; return the base checkpoint directory."""
    from embodied_rl.actors import resolve_checkpoint

    if cfg.algo.name not in ALGOS:
        raise UserError(f"unknown algo '{cfg.algo.name}' (choose from: {', '.join(ALGOS)})")
    if cfg.get("checkpoint") in (None, ""):
        raise UserError("checkpoint=DIR is required (a BC policy checkpoint directory)")
    for key in ("env_steps", "num_envs", "eval_episodes"):
        if int(cfg[key]) < 1:
            raise UserError(f"{key} must be >= 1, got {cfg[key]}")
    if int(cfg.eval_every) < 0:
        raise UserError(f"eval_every must be >= 0, got {cfg.eval_every}")
    group_size = int(cfg.algo.get("group_size", 0) or 0)
    if group_size > 1 and int(cfg.num_envs) % group_size:
        raise UserError(f"num_envs={cfg.num_envs} must be a multiple of algo.group_size={group_size}")
    if not 0 <= int(cfg.videos) <= int(cfg.eval_episodes):
        raise UserError(f"videos must be in [0, eval_episodes={cfg.eval_episodes}], got {cfg.videos}")
    return resolve_checkpoint(Path(str(cfg.checkpoint)).expanduser())


def load_base_policy(path: Path, device: str):
    """The BC policy to fine-tune; a fine-tuned checkpoint continues from its base policy."""
    from embodied_rl.actors import BASE_POLICY
    from embodied_rl.policies import load_policy

    if (path / BASE_POLICY).is_dir():
        path = path / BASE_POLICY
    return load_policy(path, device=device)


def check_previous_run(cfg: DictConfig) -> None:
    """A non-empty run_dir must be an earlier finetune run of the same task and algo."""
    if not cfg.get("run_dir"):
        return
    path = Path(str(cfg.run_dir))
    if not path.is_dir() or not any(path.iterdir()):
        return
    previous = path / "config.yaml"
    if not previous.is_file():
        raise UserError(f"run_dir '{path}' holds files but no finetune run; choose a new run_dir (nothing was overwritten)")
    old = OmegaConf.load(previous)
    for key in ("task.name", "algo.name", "checkpoint"):
        before, now = OmegaConf.select(old, key), OmegaConf.select(cfg, key)
        if before != now:
            raise UserError(f"run_dir '{path}' holds a run with {key}={before}, not {now}; choose a new run_dir")


def main(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    checkpoint = validate(cfg)
    policy = load_base_policy(checkpoint, str(cfg.device))
    trained_on = getattr(policy, "task", None)
    if trained_on and trained_on != cfg.task.name:
        raise UserError(f"checkpoint '{checkpoint}' was trained on task '{trained_on}' but task={cfg.task.name}")

    import embodied_rl.envs as envs
    from embodied_rl.commands import start_run

    module = importlib.import_module(ALGOS[cfg.algo.name])
    env = envs.make(cfg.task.name, num_envs=int(cfg.num_envs), backend=cfg.backend,
                    device=cfg.device, seed=int(cfg.seed))
    if env.action_dim != policy.action_dim:
        raise UserError(f"checkpoint '{checkpoint}' acts in {policy.action_dim} dims, task {cfg.task.name} in {env.action_dim}")
    check_previous_run(cfg)
    run = start_run(cfg, "finetune", allow_existing=True)
    run.resumed = run.file("checkpoints", "last", "training_state").is_dir()
    if run.resumed:
        print(f"resuming from {run.file('checkpoints', 'last')}")
    try:
        headline = module.finetune(cfg, run, env, policy)
    finally:
        env.close()
        run.close()
    return {"task": cfg.task.name, "algo": cfg.algo.name, **headline}, run.path
