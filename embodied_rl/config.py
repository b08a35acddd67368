"""Composing a command's config: configs/<command>.yaml plus the groups task/, policy/ and algo/,
with Hydra, every value overridden on the command line type-checked against its default. A leaf
every layer may import (the CLI, quickstart's stages, the language RL's reference algo config)."""

from __future__ import annotations

import re
from typing import Any

from embodied_rl.errors import UserError
from embodied_rl.paths import config_dir


def config_groups() -> list[str]:
    return sorted(p.name for p in config_dir().iterdir() if p.is_dir() and not p.name.startswith("_"))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml") if not p.stem.startswith("_"))


def _hydra_error_line(command: str, error: Exception) -> str:
    text = str(error)
    match = re.search(r"Could not override '([^']+)'", text)
    if match:
        return f"unknown config key '{match.group(1)}' for '{command}'"
    match = re.search(r"Could not (?:find|load) '([^'/]+)/([^']+)'", text)
    if match:
        group, option = match.groups()
        if not (config_dir() / group).is_dir():
            return f"unknown {group} '{option}'"
        # within a family (task=libero/libero_spatial/12), the choices of the deepest folder it names
        folder, prefix = config_dir() / group, ""
        for part in option.split("/")[:-1]:
            if not (folder / part).is_dir():
                break
            folder, prefix = folder / part, f"{prefix}{part}/"
        if prefix:
            choices = [prefix + p.stem for p in sorted(folder.glob("*.yaml"))]
            choices += [f"{prefix}{p.name}/<{group}>" for p in sorted(folder.iterdir()) if p.is_dir()]
            return f"unknown {group} '{option}' (choose from: {', '.join(choices)})"
        # a group's sub-folders are families of options (task=metaworld/<task>, task=lm/<task>)
        families = sorted(f"{p.name}/<{group}>" for p in (config_dir() / group).iterdir() if p.is_dir())
        more = "; `embodied-rl tasks` lists every task" if group == "task" else ""
        return f"unknown {group} '{option}' (choose from: {', '.join([*group_options(group), *families])}{more})"
    match = re.search(r"Key '([^']+)' is not in struct", text)
    if match:
        return f"unknown config key '{match.group(1)}' for '{command}'"
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return type(value).__name__


# numbers that may also be given per action dimension, as a list (the actor checks the length)
PER_DIM_KEYS = {"algo.actor_kwargs.action_scale"}
# numbers that may also be "auto" (the algorithm's config checks the value)
AUTO_OR_NUMBER_KEYS = {"algo.target_entropy", "algo.ent_coef"}
# names that may also be a list (the algorithm's config checks the value)
NAME_OR_LIST_KEYS = {"algo.residual_dims"}
# switches that may also be "auto" (the algorithm decides from the task)
AUTO_OR_BOOL_KEYS = {"algo.bootstrap_truncation", "algo.clip_target_q", "use_state"}


def _check_types(reference: Any, composed: Any, overrides: list[str]) -> None:
    """A value overridden on the command line must have the type of its default."""
    from omegaconf import ListConfig, OmegaConf

    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if "=" not in override or key in config_groups():
            continue
        default = OmegaConf.select(reference, key, throw_on_missing=False)
        value = OmegaConf.select(composed, key, throw_on_missing=False)
        if default is None or value is None:
            continue
        if key in AUTO_OR_NUMBER_KEYS:
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
                isinstance(value, str) and value.startswith("auto"))
        elif key in AUTO_OR_BOOL_KEYS:
            ok = isinstance(value, bool) or value == "auto"
        elif key in NAME_OR_LIST_KEYS:
            ok = isinstance(value, (str, ListConfig))
        elif isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, float) and key in PER_DIM_KEYS and isinstance(value, ListConfig):
            ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif isinstance(default, str):
            ok = isinstance(value, (str, int, float)) and not isinstance(value, bool)
        else:
            ok = type(value) is type(default)
        if not ok:
            expected = "auto, true or false" if key in AUTO_OR_BOOL_KEYS else _describe(default)
            raise UserError(f"bad value for '{key}': expected {expected}, got {override.split('=', 1)[1]!r}")


def compose(command: str, overrides: list[str]):
    """Compose and type-check the config of `command`; raises UserError on bad input."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    groups = set(config_groups())
    group_overrides = [o for o in overrides if o.split("=", 1)[0] in groups]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        try:
            reference = hydra_compose(config_name=command, overrides=group_overrides)
            cfg = hydra_compose(config_name=command, overrides=overrides)
        except Exception as error:  # Hydra's own override / composition errors
            if type(error).__module__.startswith(("hydra", "omegaconf")):
                raise UserError(_hydra_error_line(command, error)) from None
            raise
    _check_types(reference, cfg, overrides)
    OmegaConf.set_struct(cfg, True)
    return cfg
