"""Language tasks on the shared core: causal LMs trained with SFT (`pretrain`), evaluated
(`eval`) and fine-tuned with RL (`finetune`) on verifiable tasks (docs/language.md).

The commands hand a config whose task is `lm/<name>` to this package (`is_lm_task`); the task
config (configs/task/lm/<name>.yaml) adds the language keys `model` and `lm.*`. Keys of the
robot commands that mean nothing here (data, backend, videos, ...) are refused when set.
"""

from __future__ import annotations

from typing import Any

from embodied_rl.errors import UserError


def is_lm_task(cfg: Any) -> bool:
    from omegaconf import OmegaConf

    name = OmegaConf.select(cfg, "task.name", default=None)
    return isinstance(name, str) and name.startswith("lm/")


def refuse_robot_keys(cfg: Any, command: str, used: tuple[str, ...]) -> None:
    """A key of configs/<command>.yaml that the language path does not use must keep its default
    (it cannot be honoured); a changed one is a UserError naming it."""
    from omegaconf import OmegaConf

    from embodied_rl.paths import config_dir

    defaults = OmegaConf.load(config_dir() / f"{command}.yaml")
    groups = {}
    for entry in defaults.get("defaults", []):
        if OmegaConf.is_dict(entry):
            groups.update(OmegaConf.to_container(entry))
    for key, default in groups.items():
        if key in used or key == "task" or key not in cfg:
            continue
        if OmegaConf.select(cfg, f"{key}.name", default=default) != default:
            raise UserError(f"{key}= does not apply to language tasks ({cfg.task.name})")
    for key in defaults:
        if key in ("defaults", *used) or key not in cfg:
            continue
        if cfg[key] != defaults[key]:
            raise UserError(f"{key}= does not apply to language tasks ({cfg.task.name})")


def refuse_lm_checkpoint(cfg: Any) -> None:
    """A language model checkpoint given to a robot command (task= missing or not lm/<name>):
    one line that names the task to pass."""
    from pathlib import Path

    from embodied_rl.lm.model import recorded_task

    checkpoint = cfg.get("checkpoint")
    if checkpoint in (None, ""):
        return
    path = Path(str(checkpoint)).expanduser()
    for candidate in (path, path / "checkpoints" / "last"):
        task = recorded_task(candidate)
        if task is not None:
            raise UserError(f"checkpoint '{path}' is a language model trained on {task.get('name')}; "
                            f"pass task={task.get('name')}")
