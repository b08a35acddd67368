"""`embodied-rl tasks`: one line per registered task, as a plain aligned table.

Columns: name, gymnasium id, backends, observation modes, max episode steps, scripted expert,
success criterion (last, as it is a sentence). Writes no run directory.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

HEADER = ("task", "gymnasium id", "backends", "obs modes", "max steps", "expert", "success criterion")


def task_rows() -> list[tuple[str, ...]]:
    """One row of HEADER's columns per registered task."""
    from embodied_rl.envs import registry

    rows = []
    for name in registry.TASKS:
        task = registry.task_class(name)
        # Every Task runs on every backend: natively on the MuJoCo ones, and on gymnasium through
        # its gymnasium registration (state observations only there).
        backends = ", ".join(registry.BACKENDS)
        obs_modes = "state, pixels" if task.camera else "state"
        rows.append((
            name, registry.gym_id(name), backends, obs_modes, str(task.max_episode_steps),
            "yes" if registry.has_expert(name) else "no", task.success_criterion or "-",
        ))
    return rows


def format_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in (header, *rows)]
    return "\n".join(lines)


def main(cfg: DictConfig) -> tuple[dict[str, Any], None]:
    print(format_table(HEADER, task_rows()))
    print("\ngymnasium supports the state observation mode only; "
          "override a task's episode length with task.max_episode_steps=N.")
    return {}, None
