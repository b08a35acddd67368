"""`embodied-rl tasks`: one line per registered task, as a plain aligned table.

Columns: name, gymnasium id, backends, observation modes, max episode steps, scripted expert,
number of instructions ("-" for a task without them), success criterion (last, as it is a
sentence). The instruction texts of language-conditioned tasks follow the table, then the
language tasks (task=lm/<name>, docs/language.md). Writes no run directory.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

HEADER = ("task", "gymnasium id", "backends", "obs modes", "max steps", "expert", "instructions",
          "success criterion")


def task_rows() -> list[tuple[str, ...]]:
    """One row of HEADER's columns per registered task."""
    from embodied_rl.envs import registry

    rows = []
    for name in registry.task_names():
        task = registry.task_class(name)
        # This package's tasks run natively on the MuJoCo backends, and on gymnasium and process
        # through their gymnasium registration. The gymnasium backend takes Box observations only,
        # so a task with instructions (dict observations) is not listed there; process passes them on.
        backends = ", ".join(b for b in task.backends if not (task.instructions and b == "gymnasium"))
        obs_modes = "state, pixels" if task.camera else "state"
        gym_id = registry.gym_id(name) if name in registry.GYM_NAMES else "-"
        rows.append((
            name, gym_id, backends, obs_modes, str(task.max_episode_steps),
            "yes" if registry.has_expert(name) else "no", str(len(task.instructions)) if task.instructions else "-",
            task.success_criterion or "-",
        ))
    return rows


def instruction_lines() -> list[str]:
    """One line per language-conditioned task: its instructions, by id."""
    from embodied_rl.envs import registry

    lines = []
    for name in registry.TASKS:  # Meta-World's: configs/task/metaworld/<task>.yaml
        instructions = registry.task_class(name).instructions
        if instructions:
            lines.append(f"{name} instructions: " + "; ".join(f"{i}: {text!r}" for i, text in enumerate(instructions)))
    return lines


def language_rows() -> list[tuple[str, str]]:
    """(name, what a problem is) per language task."""
    from embodied_rl.lm.tasks import TASKS

    return [(name, (task.__doc__ or "").strip().splitlines()[0]) for name, task in TASKS.items()]


def format_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in (header, *rows)]
    return "\n".join(lines)


def main(cfg: DictConfig) -> tuple[dict[str, Any], None]:
    print(format_table(HEADER, task_rows()))
    lines = instruction_lines()
    if lines:
        print("\n" + "\n".join(lines))
    print("\ngymnasium supports the state observation mode only; "
          "override a task's episode length with task.max_episode_steps=N.")
    print("\nlanguage tasks (pretrain, eval and finetune with task=lm/<name>; docs/language.md):\n"
          + format_table(("task", "problem"), language_rows()))
    return {}, None
