"""Helpers shared by every fine-tuning algorithm (on- and off-policy).

- `Evaluator`: periodic evaluation with the eval machinery, logged to metrics.jsonl.
- `save_checkpoint` / `load_training_state`: atomic checkpoints with `training_state/`
  (optimisers, RNG states, step counters) into checkpoints/<step>/ and checkpoints/last/.
- `rng_state` / `set_rng_state`: torch, numpy and python RNG states, for resume.
- `headline_from_eval`: the headline dict the CLI prints.
The checkpoint layout and the `finetune(cfg, run, env, policy)` interface: docs/finetuning.md.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embodied_rl.runs import Run, atomic_dir, atomic_write_json

TRAINING_STATE = "training_state"


# ---------------------------------------------------------------------------------------------
# RNG state
# ---------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Every RNG a run draws from, in a form `torch.save` + `torch.load(weights_only=True)` keep."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": json.dumps(random.getstate()),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    version, internal, gauss = json.loads(state["python"])
    random.setstate((version, tuple(internal), gauss))


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def last_checkpoint(run: Run) -> Path | None:
    path = run.file("checkpoints", "last")
    return path if (path / TRAINING_STATE / "counters.json").exists() else None


def save_checkpoint(
    run: Run,
    step: int,
    write_agent: Callable[[Path], None],
    optimizers: dict[str, Any],
    counters: dict[str, Any],
    extra_state: dict[str, Any] | None = None,
    keep: int = 3,
) -> Path:
    """Write checkpoints/<step>/ and checkpoints/last/, each atomically.

    `write_agent(dir)` writes what `embodied_rl.actors.load_agent` reads (agent.json, weights);
    `optimizers` maps names to objects with `state_dict()`; `counters` are JSON numbers (env
    steps, iterations); `extra_state` any other tensors to restore (torch.save'd). Only the
    newest `keep` numbered checkpoints stay on disk; `last` always does.
    """
    root = run.file("checkpoints")
    for name in (str(int(step)), "last"):
        with atomic_dir(root / name) as tmp:
            write_agent(tmp)
            state_dir = tmp / TRAINING_STATE
            state_dir.mkdir()
            torch.save({k: o.state_dict() for k, o in optimizers.items()}, state_dir / "optimizers.pt")
            torch.save({"rng": rng_state(), **(extra_state or {})}, state_dir / "state.pt")
            (state_dir / "counters.json").write_text(json.dumps({**counters, "step": int(step)}) + "\n")
    numbered = sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    for old in numbered[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return root / "last"


def load_training_state(run: Run) -> dict[str, Any] | None:
    """{"path", "counters", "optimizers", "state"} of checkpoints/last, or None for a fresh run."""
    path = last_checkpoint(run)
    if path is None:
        return None
    state_dir = path / TRAINING_STATE
    return {
        "path": path,
        "counters": json.loads((state_dir / "counters.json").read_text()),
        "optimizers": torch.load(state_dir / "optimizers.pt", weights_only=True),
        "state": torch.load(state_dir / "state.pt", weights_only=True),
    }


def restore(training_state: dict[str, Any], optimizers: dict[str, Any]) -> dict[str, Any]:
    """Load optimiser and RNG states; return the counters."""
    for name, optimizer in optimizers.items():
        optimizer.load_state_dict(training_state["optimizers"][name])
    set_rng_state(training_state["state"]["rng"])
    return training_state["counters"]


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


class Evaluator:
    """Evaluates an agent every `cfg.eval_every` env steps on a separate eval env.

    `maybe_evaluate(step, make_agent)` runs when `step` crossed the next multiple of
    eval_every (or `force=True`), logs eval/* scalars at `step` and returns the eval_info
    (None when it did not run). Videos go to videos/step_<step>/ (cfg.videos of them).
    It is also the run's clock. `eval/train_wall_s` is the training time to reach that point: the
    wall time since the evaluator was made minus the time spent evaluating, plus what earlier
    parts of a resumed run had trained (`clock()` goes into every checkpoint's counters, and a
    resumed run passes them back as `counters`). The time between a part's last checkpoint and
    its end is lost with the steps redone after the resume, so every step is counted once.
    """

    def __init__(self, cfg: Any, run: Run, counters: dict[str, Any] | None = None):
        """`counters`: a resumed run's checkpoint counters (env steps done, the clock so far)."""
        counters = counters or {}
        last_step = int(counters.get("env_steps", 0))
        self.cfg = cfg
        self.run = run
        self.every = int(cfg.eval_every)
        self.next_step = (last_step // self.every + 1) * self.every if self.every > 0 else None
        self.env = None
        self.last_info: dict[str, Any] | None = None
        self.last_step: int | None = None
        self.start_time = time.perf_counter()
        self.eval_seconds = 0.0
        self.earlier_wall_s = float(counters.get("wall_s", 0.0))
        self.earlier_train_wall_s = float(counters.get("train_wall_s", 0.0))

    def clock(self) -> dict[str, float]:
        """{"wall_s": the run's wall time, "train_wall_s": the same without evaluations}, over
        every part of a resumed run."""
        elapsed = time.perf_counter() - self.start_time
        return {"wall_s": self.earlier_wall_s + elapsed,
                "train_wall_s": self.earlier_train_wall_s + elapsed - self.eval_seconds}

    def _make_env(self):
        if self.env is None:
            from embodied_rl import envs

            num_envs = max(1, min(int(self.cfg.eval_episodes), int(self.cfg.num_envs)))
            self.env = envs.make(
                self.cfg.task.name, num_envs=num_envs, backend=self.cfg.backend,
                device=self.cfg.device, seed=int(self.cfg.seed) + 1,
            )
        return self.env

    def due(self, step: int) -> bool:
        return self.next_step is not None and step >= self.next_step

    def maybe_evaluate(self, step: int, make_agent: Callable[[int], Any], force: bool = False):
        if not (force or self.due(step)):
            return None
        from embodied_rl.eval import evaluate

        train_wall_s = self.clock()["train_wall_s"]
        eval_start = time.perf_counter()
        env = self._make_env()
        videos = min(int(self.cfg.videos), int(self.cfg.eval_episodes))
        info = evaluate(
            env, make_agent(env.num_envs), episodes=int(self.cfg.eval_episodes),
            seed=int(self.cfg.seed) + 12345, videos=videos,
            video_dir=self.run.file("videos", f"step_{step}") if videos else None, progress=False,
        )
        overall = info["overall"]
        metrics = {"eval/return": overall["avg_sum_reward"], "eval/episode_length": overall["avg_episode_length"],
                   "eval/train_wall_s": train_wall_s}
        if overall.get("success_rate") is not None:
            low, high = overall["success_ci95"]
            metrics.update({"eval/success_rate": overall["success_rate"],
                            "eval/success_rate_low": low, "eval/success_rate_high": high})
        self.run.log(step, metrics)
        atomic_write_json(self.run.file("eval_info.json"), {**info, "step": int(step)})
        if self.every > 0:
            self.next_step = (step // self.every + 1) * self.every
        self.last_info = info
        self.last_step = int(step)
        self.eval_seconds += time.perf_counter() - eval_start
        return info

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


def headline_from_eval(info: dict[str, Any] | None, env_steps: int, run: Run) -> dict[str, Any]:
    headline: dict[str, Any] = {}
    if info is not None:
        overall = info["overall"]
        if overall.get("success_rate") is not None:
            headline["success_rate"] = overall["success_rate"]
            headline["success_ci95"] = [round(x, 4) for x in overall["success_ci95"]]
        headline["return"] = overall["avg_sum_reward"]
    headline["env_steps"] = int(env_steps)
    headline["checkpoint"] = str(run.file("checkpoints", "last"))
    return headline
