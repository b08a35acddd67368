"""`embodied-rl quickstart`: the whole journey on the default task, in one run directory.

    <run_dir>/1_collect/             scripted expert demos            (commands/collect.py)
              2_pretrain/            BC policy                        (commands/pretrain.py)
              3_eval_pretrained/     success rate before RL           (commands/evaluate.py)
              4_finetune/            RL fine-tuning                   (commands/finetune.py)
              5_eval_finetuned/      success rate after RL            (commands/evaluate.py)
              report.md  plots/learning_curve.png

Each stage is the command's own `main(cfg)` with a composed config, so it writes exactly what
the command would. A stage is finished when its done.json exists (written last, see
`commands.run_command`): re-running a killed quickstart with the same run_dir skips the
finished stages, says how far it had got, resumes pretraining and fine-tuning from their
checkpoints and starts an unfinished collect or eval stage again.
"""

from __future__ import annotations

import importlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from embodied_rl.errors import UserError
from embodied_rl.runs import is_done

PRETRAIN_CHECKPOINT_EVERY = 500  # gradient steps (push_t's 3000 take about 2.5 minutes on one thread)


def run_stage(command: str, module: str, overrides: list[str], run_dir: Path, resumable: bool = False) -> Path:
    """Compose `command`'s config with `overrides` and run it in `run_dir`, unless its
    done.json shows it finished. An unfinished stage starts over (`resumable`: pretrain and
    finetune continue from their own checkpoints instead)."""
    from embodied_rl.commands import run_command
    from embodied_rl.config import compose

    if is_done(run_dir):
        print(f"[quickstart] {command}: done already ({run_dir})")
        return run_dir
    if run_dir.exists() and not resumable:
        print(f"[quickstart] {command}: stopped before its end last time; starting it again", flush=True)
        shutil.rmtree(run_dir)  # its partial output is worthless
    print(f"[quickstart] {command} -> {run_dir}", flush=True)
    cfg = compose(command, [*overrides, f"run_dir={run_dir}"])
    run_command(importlib.import_module(module), cfg)
    return run_dir


def describe_progress(root: Path) -> str | None:
    """How far an earlier quickstart in `root` had got, in one line (None for a fresh one)."""
    from embodied_rl.algos.common import checkpoint_step

    def saved_step(stage: Path) -> int | None:  # finetune's counters.json, else pretrain's state.json
        last = stage / "checkpoints" / "last"
        if checkpoint_step(last) is not None:
            return checkpoint_step(last)
        try:
            return int(json.loads((last / "training_state" / "state.json").read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    stages = sorted(d for d in root.iterdir() if d.is_dir() and d.name[:1].isdigit()) if root.is_dir() else []
    if not stages:
        return None
    parts = []
    for stage in stages:
        if is_done(stage):
            parts.append(f"{stage.name} done")
            continue
        step = saved_step(stage)
        parts.append(f"{stage.name} stopped" + (f" at its checkpoint of step {step}" if step is not None else ""))
    return "[quickstart] resuming this run_dir: " + ", ".join(parts)


def stage_task_overrides(task_cfg: DictConfig) -> list[str]:
    """The task's keys as quickstart got them, as overrides for every stage
    (task.max_episode_steps=N, task.process.python=..., a mapping's keys one by one); lists
    (instructions, suite_tasks) only describe the task and stay as its config has them."""
    def text(value: Any) -> str:
        if value is None or isinstance(value, bool):
            return str(value).lower().replace("none", "null")
        if isinstance(value, str) and any(c.isspace() for c in value):  # a command: one quoted value
            return "'" + value.replace("'", "\\'") + "'"
        return str(value)

    overrides = []
    for key, value in task_cfg.items():
        if key == "name" or OmegaConf.is_list(value):
            continue
        items = value.items() if OmegaConf.is_dict(value) else [(None, value)]
        overrides += [f"task.{key}{'' if sub is None else '.' + sub}={text(item)}" for sub, item in items]
    return overrides


def main(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    from embodied_rl.commands import validate_common
    from embodied_rl.runs import start_run

    validate_common(cfg)
    for key in ("demos", "finetune_env_steps", "finetune_num_envs", "eval_episodes", "finetune_eval_episodes"):
        if int(cfg[key]) < 1:
            raise UserError(f"{key} must be >= 1, got {cfg[key]}")

    task = cfg.task.name
    backend = "null" if cfg.backend is None else cfg.backend
    sim = [f"task={task}", f"seed={cfg.seed}", f"backend={backend}", f"device={cfg.device}"]
    sim += stage_task_overrides(cfg.task)
    finetune = [*sim, f"algo={cfg.finetune_algo}", f"env_steps={cfg.finetune_env_steps}",
                f"num_envs={cfg.finetune_num_envs}", f"eval_every={cfg.finetune_eval_every}",
                f"eval_episodes={cfg.finetune_eval_episodes}", "videos=0",
                *cfg.finetune_overrides.get(cfg.finetune_algo, [])]
    from embodied_rl.algos.wsrl import check_actor_trains
    from embodied_rl.config import compose

    check_actor_trains(compose("finetune", finetune))  # refused now, not after pretraining

    earlier = describe_progress(Path(str(cfg.run_dir))) if cfg.run_dir else None
    run = start_run(cfg, "quickstart", allow_existing=bool(cfg.run_dir))
    root = run.path
    if earlier:
        print(earlier, flush=True)
    started = time.perf_counter()

    collect_dir = run_stage("collect", "embodied_rl.commands.collect", [*sim, f"demos={cfg.demos}"],
                            root / "1_collect")
    # a checkpoint every PRETRAIN_CHECKPOINT_EVERY steps, so a stopped quickstart resumes pretraining there
    pretrain = [*sim, f"policy={cfg.bc_policy}", f"data={collect_dir / 'demos.zarr'}", "eval_episodes=0", "videos=0",
                f"eval_every={PRETRAIN_CHECKPOINT_EVERY}"]
    if cfg.pretrain_steps is not None:
        pretrain.append(f"steps={int(cfg.pretrain_steps)}")
    pretrain_dir = run_stage("pretrain", "embodied_rl.commands.pretrain", pretrain,
                             root / "2_pretrain", resumable=True)
    bc_checkpoint = pretrain_dir / "checkpoints" / "last"
    evaluation = [*sim, f"episodes={cfg.eval_episodes}", f"videos={min(cfg.videos, cfg.eval_episodes)}"]
    before_dir = run_stage("eval", "embodied_rl.commands.evaluate", [*evaluation, f"checkpoint={bc_checkpoint}"],
                           root / "3_eval_pretrained")
    finetune_dir = run_stage("finetune", "embodied_rl.commands.finetune", [*finetune, f"checkpoint={bc_checkpoint}"],
                             root / "4_finetune", resumable=True)
    after_dir = run_stage("eval", "embodied_rl.commands.evaluate",
                          [*evaluation, f"checkpoint={finetune_dir / 'checkpoints' / 'last'}"],
                          root / "5_eval_finetuned")

    before = json.loads((before_dir / "eval_info.json").read_text())
    after = json.loads((after_dir / "eval_info.json").read_text())
    report = write_quickstart_report(root, task, cfg, before, after, finetune_dir, before_dir, after_dir)
    wall_s = time.perf_counter() - started
    run.write_json("quickstart_info.json", {"task": task, "before": before["overall"], "after": after["overall"],
                                            "wall_s": wall_s})
    run.close()
    from embodied_rl.eval.evaluate import success_text
    from embodied_rl.eval.stats import before_after

    headline: dict[str, Any] = {"task": task}
    if before["overall"].get("success_rate") is not None:
        headline["success"] = before_after(success_text(after["overall"]), success_text(before["overall"]))
    headline["return"] = before_after(f"{after['overall']['avg_sum_reward']:.4g}", f"{before['overall']['avg_sum_reward']:.4g}")
    headline["report"] = str(report)
    headline["wall_s"] = wall_s
    return headline, root


def write_quickstart_report(root: Path, task: str, cfg: DictConfig, before: dict, after: dict,
                            finetune_dir: Path, before_dir: Path, after_dir: Path) -> Path:
    from embodied_rl.eval.report import learning_curve, success_table, video_links, write_report
    from embodied_rl.runs import read_metrics

    curve = learning_curve(read_metrics(finetune_dir), root / "plots" / "learning_curve.png", root,
                           f"{task}: {cfg.finetune_algo} fine-tuning (eval every {cfg.finetune_eval_every} env steps)")
    sections = [
        ("Result", success_table({f"pretrained ({cfg.bc_policy} BC)": before["overall"],
                                  f"fine-tuned ({cfg.finetune_algo})": after["overall"]})),
        ("Learning curve", curve),
        ("Videos: pretrained", video_links(before, root, before_dir)),
        ("Videos: fine-tuned", video_links(after, root, after_dir)),
        ("Stages", "\n".join(f"- `{d.name}/`" for d in sorted(root.iterdir()) if d.is_dir() and d.name[0].isdigit())),
    ]
    return write_report(root, f"Quickstart: {task}", sections)
