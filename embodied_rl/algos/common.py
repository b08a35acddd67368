"""What every fine-tuning algorithm shares: the run's bookkeeping, so that each algorithm's own
loop reads top to bottom in its file (CleanRL style) and calls this at its boundaries.

    loop = FinetuneLoop(cfg, run, EnvEvaluation(cfg, run, make_eval_agent))
    saved = loop.resume(modules={"actor": actor}, optimizers={"optimizer": opt})  # None: fresh
    ...restore the algorithm's own loop state from `saved` (env state, obs, replay, ...)...
    loop.start()                               # evaluates the base policy at step 0 (fresh runs)
    while loop.env_steps < loop.total_env_steps:
        ...collect and update...
        loop.advance(n_env_steps, info)        # count env steps, record finished episodes
        loop.check_finite("train/loss", loss)  # divergence stops the run (exit code 3)
        loop.log(metrics)                      # one metrics row per logging window (log_every)
        loop.boundary(loop_state)              # evaluation (eval_every) and checkpoint
                                               # (checkpoint_every), each on its own schedule
    return loop.finish(loop_state)             # last checkpoint, final evaluation, headline

The language RL loop (lm/rl.py) runs on the same helper: it counts its iterations
(`FinetuneLoop(schedule, run, evaluation, counter="steps")`, `loop.step`, `loop.total`) and
supplies its own evaluation (held-out pass@1) and checkpoint files (the model and tokenizer).

- Config: `AlgoConfig`, the base of every algorithm's config dataclass (`from_cfg` refuses the
  first of its `checks()` that fails); `freeze_and_seed` starts a method that trains beside its
  frozen base policy.
- Reward: `reward_settings(cfg)` parses `reward`, `algo.reward` and `algo.bootstrap_truncation`
  once; `training_reward` is what every algorithm trains on (the learned reward of reward=model:PATH
  included: the env is then a rewards.LearnedRewardEnv).
- Checkpoints: checkpoints/<step>/ (agent files that `embodied_rl.actors.load_agent` reads, plus
  training_state/) and checkpoints/last, a symlink to the newest. A checkpoint directory is
  written under a temporary name and renamed into place; `training_state/counters.json` is its
  last file, so a directory holding it is complete. Resume takes the newest complete checkpoint,
  repairs what a kill left mid-swap and removes incomplete temporary directories; it never
  deletes a complete checkpoint.
- Best checkpoint: every periodic evaluation (step 0 and the final one included) that scores at
  least the best so far (ties go to the later one) writes its agent as checkpoints/best, a
  symlink swapped in one rename, with best.json (step, success rate and interval, return, and
  the episodes, envs and seed that scored it; a language run's pass@1, interval, problems and
  seed). It is not a numbered checkpoint, so pruning never deletes it; a resumed run reads
  best.json back and goes on comparing against it.
- Exact resume: a checkpoint holds the trainable modules and optimisers, every RNG, and the
  algorithm's loop state (env state, per-env histories and queues, replay buffer), so a resumed
  run continues as if never stopped. `save_replay=false` leaves the replay buffer out (smaller
  checkpoints; the resumed run refills it).
- What acts may be judged: an evaluation that decides what acts (wsrl.JudgedWeights: the last weights
  that won a paired evaluation; wsrl.JudgedEvaluation: the residual's reach that did) has a state the
  checkpoint keeps (`state_dict`), and one that `judges` is run at the start and the end even with
  eval_every=0.
- Divergence: weights and optimiser state are checked finite before every checkpoint write, and
  algorithms check their losses and gradient norms; a non-finite value logs its row and raises
  `Diverged`, which the CLI turns into one line and exit code 3. checkpoints/last stays the last
  finite state.
- Data-parallel runs (torchrun, embodied_rl/distributed.py): the counters are the job's (env
  steps and episodes summed over ranks), so every rank takes the same logging, evaluation and
  checkpoint decisions; each rank's finished episodes reach the metrics rows through a gather;
  rank 0 evaluates and writes; a checkpoint holds every rank's RNGs and loop state
  (training_state/rank_<r>.pt for r >= 1) and checks that the ranks' weights are equal.
The checkpoint layout and the `finetune(cfg, run, env, policy)` interface: docs/finetuning.md.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from omegaconf import OmegaConf
from safetensors import SafetensorError

from embodied_rl import distributed
from embodied_rl.errors import Diverged, UserError
from embodied_rl.runs import Run, atomic_write_json, progress

TRAINING_STATE = "training_state"
COUNTERS = "counters.json"
REPLAY = "replay.pt"
KEEP_CHECKPOINTS = 3
BEST = "best"  # checkpoints/best: the agent of the best periodic evaluation
BEST_RECORD = "best.json"


# ---------------------------------------------------------------------------------------------
# Reward settings, parsed once for every algorithm
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardSettings:
    """`sparse`: online steps train on 1 at the step that ends in the simulator's success, else
    on the env's reward (the simulator's, or with reward=model:PATH the reward model's: the env
    is then a rewards.LearnedRewardEnv); `demo_sparse`: demo transitions carry 1 at the end of
    a successful demo (their success label), else their recorded reward;
    `bootstrap_truncation`: bootstrap the value at a time limit."""

    sparse: bool
    bootstrap_truncation: bool
    demo_sparse: bool


def reward_settings(cfg: Any) -> RewardSettings:
    """`algo.reward`: `env` (the task's reward), `success` (1 on the step that succeeds), or
    `auto` = success where the task has a success signal. Why sparse by default: push_t's dense
    coverage reward keeps paying while the block sits near the target and success ends the
    episode, so a dense-reward agent earns more by hovering outside the success region than by
    finishing; the sparse reward with gamma < 1 rewards finishing, and soon.
    `reward=model:PATH` (docs/rewards.md): online steps train on the env's reward, which is the
    learned one, and demos on their success labels (what a demonstration is: a labelled
    success; their recorded rewards are the simulator's); algo.reward, which picks among the
    simulator's rewards, must stay auto.
    `algo.bootstrap_truncation`: `auto` = no bootstrap at the time limit with a success reward,
    the learned one included (running out of time is a failure: success must come before it),
    bootstrap otherwise (a dense simulator reward: hopper)."""
    from embodied_rl.rewards.env import learned_reward_path

    algo = cfg.algo
    mode = str(algo.reward)
    if mode not in ("env", "success", "auto"):
        raise UserError(f"algo.reward must be env, success or auto, got '{mode}'")
    learned = learned_reward_path(cfg.get("reward")) is not None
    if learned and mode != "auto":
        raise UserError(f"reward=model:PATH pays the learned reward; algo.reward={mode} picks one of the "
                        "simulator's: leave it at auto")
    has_success = bool(cfg.task.has_success)
    if mode == "success" and not has_success:
        raise UserError(f"algo.reward=success needs a task with a success signal; {cfg.task.name} has none")
    sparse = (mode == "success" or (mode == "auto" and has_success)) and not learned
    bootstrap = algo.get("bootstrap_truncation", "auto")
    if bootstrap not in ("auto", True, False):
        raise UserError(f"algo.bootstrap_truncation must be auto, true or false, got {bootstrap!r}")
    success_reward = sparse or learned
    return RewardSettings(sparse, (not success_reward) if bootstrap == "auto" else bool(bootstrap),
                          demo_sparse=success_reward)


Config = TypeVar("Config", bound="AlgoConfig")


class AlgoConfig:
    """Base of every algorithm's frozen config dataclass (configs/algo/<name>.yaml, the one home of
    its defaults): `from_cfg(cfg.algo)` makes one and refuses the first of its `checks()` that
    fails, in one line: `algo.<key> must be <expected>, got <value>`."""

    @classmethod
    def from_cfg(cls: type[Config], algo: Any) -> Config:
        return cls(**OmegaConf.to_container(algo, resolve=True)).checked()

    def checked(self: Config) -> Config:
        for key, ok, expected in self.checks():
            if not ok:
                raise UserError(f"algo.{key} must be {expected}, got {getattr(self, key)!r}")
        return self

    def checks(self) -> list[tuple[str, bool, str]]:
        """`(key, ok, expected)` for each key with a range."""
        return []


def freeze_and_seed(cfg: Any, policy: Any) -> tuple[int, torch.device]:
    """How a method that trains beside its frozen base policy starts: the policy in eval mode
    without gradients, torch's global generator seeded with cfg.seed. Returns (seed, device)."""
    seed = int(cfg.seed)
    torch.manual_seed(seed)
    policy.eval()
    policy.requires_grad_(False)
    return seed, torch.device(str(cfg.device))


def training_reward(reward: torch.Tensor, info: dict[str, Any], sparse: bool) -> torch.Tensor:
    """What RL maximises: the env reward (a learned reward's env: the model's), or (`sparse`) 1
    on a step that ends in the simulator's success."""
    return info["success"].float() if sparse else reward.float()


class PotentialShaping:
    """Potential-based shaping (Ng et al. 1999) with the env reward as the potential:
    r_t += coef * (gamma * phi_{t+1} - phi_t), where phi_{t+1} is the env reward of step t (for
    push_t: the coverage of the state reached). It leaves the optimal policy unchanged but pays
    progress at every step, and standing still costs (1 - gamma) * phi, so unlike the raw dense
    reward it never pays to hover near the goal. The first step of an episode gets no shaping
    (the potential of its initial state is unknown). Per-step actors only: PPO's residual and
    residual TD3/SAC (`algo.reward_shaping`), added to the sparse success reward."""

    def __init__(self, coef: float, gamma: float):
        self.coef, self.gamma = coef, gamma
        self.previous: torch.Tensor | None = None  # phi of the current state, per env
        self.fresh: torch.Tensor | None = None  # envs at the first step of an episode

    def __call__(self, env_reward: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        if self.previous is None:
            self.previous, self.fresh = env_reward.clone(), torch.ones_like(done)
        shaping = self.coef * (self.gamma * env_reward - self.previous)
        shaping = torch.where(self.fresh, torch.zeros_like(shaping), shaping)
        self.previous, self.fresh = env_reward.clone(), done.clone()
        return shaping

    def state(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What a checkpoint's loop state keeps (the potential and the fresh flags per env)."""
        return self.previous, self.fresh

    def load_state(self, state: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        self.previous, self.fresh = state


# ---------------------------------------------------------------------------------------------
# RNG state
# ---------------------------------------------------------------------------------------------


def env_snapshot(env: Any) -> dict[str, Any] | None:
    """The env's snapshot for a checkpoint's loop state, or None for a backend that cannot take
    one (EnvPool, gymnasium): a run resumed from it starts new episodes, the learner exact."""
    return env.get_state() if env.can_snapshot else None


def rng_state() -> dict[str, Any]:
    """Every RNG a run draws from, in a form `torch.save` + `torch.load(weights_only=True)` keep:
    on a GPU also the current CUDA device's generator (sampling noise drawn on the device)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": json.dumps(random.getstate()),
    }
    if distributed.cuda_in_use():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():  # a GPU run resumed on the CPU has no use for it
        torch.cuda.set_rng_state(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    version, internal, gauss = json.loads(state["python"])
    random.setstate((version, tuple(internal), gauss))


# ---------------------------------------------------------------------------------------------
# Checkpoint directories
# ---------------------------------------------------------------------------------------------


def checkpoint_step(path: Path) -> int | None:
    """The step of a complete checkpoint directory, else None."""
    try:
        return int(json.loads((path / TRAINING_STATE / COUNTERS).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _point_link(link: Path, target: Path) -> None:
    """Make `link` a symlink to `target` (a sibling), in one rename."""
    tmp = link.with_name(f".{link.name}.link.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(target.name, tmp)
    os.replace(tmp, link)


def _point_last(root: Path, target: Path) -> None:
    """Make checkpoints/last a symlink to `target`, in one rename."""
    last = root / "last"
    if last.is_dir() and not last.is_symlink():  # a directory `last` (older layout): keep it, numbered
        step = checkpoint_step(last)
        numbered = root / str(step)
        if step is not None and not numbered.exists():
            os.replace(last, numbered)
        else:  # incomplete, or a copy of the numbered checkpoint of its step (the older layout wrote both)
            shutil.rmtree(last)
    _point_link(last, target)


def find_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (a run's checkpoints/), or None.

    Repairs what a kill can leave: a complete checkpoint still under its temporary name (or the
    `last` directory of the older layout) is renamed into place and `last` pointed at it;
    incomplete temporary directories are removed. Never deletes a complete checkpoint."""
    root = Path(root)
    if not root.is_dir():
        return None
    candidates = []
    for child in root.iterdir():
        if child.is_symlink() or not child.is_dir() or child.name.endswith(".unreadable"):
            continue
        step = checkpoint_step(child)
        if step is not None:
            candidates.append((step, child.name == str(step), child))
        elif child.name.startswith(".") and child.name.endswith(".tmp"):
            shutil.rmtree(child, ignore_errors=True)  # a write the kill cut short
    if not candidates:
        return None
    step, in_place, best = max(candidates, key=lambda c: (c[0], c[1]))
    if not in_place:
        target = root / str(step)
        if not target.exists():
            os.replace(best, target)
            best = target
    _point_last(root, best)
    return best


# what reading a damaged checkpoint raises: torch.load (a truncated zip, bad pickle bytes),
# safetensors, json, a missing file; UserError from the loaders that name the file
UNREADABLE = (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError, SafetensorError)


def newest_readable_checkpoint(root: str | Path, read: Callable[[Path], Any]) -> tuple[Path, Any] | None:
    """(path, read(path)) for the newest complete checkpoint under `root` that `read` can read,
    or None when there is none. A checkpoint that cannot be read is set aside as
    `<step>.unreadable` (kept for a look, never resumed again) with one line saying so, and the
    one before it is tried; when checkpoints exist but none can be read, a UserError."""
    root = Path(root)
    set_aside = []
    while (path := find_checkpoint(root)) is not None:
        try:
            return path, read(path)
        except UNREADABLE as error:
            aside = path.with_name(f"{path.name}.unreadable")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(path, aside)
            set_aside.append(aside)
            reason = (str(error).strip().splitlines() or [""])[0][:200]
            print(f"warning: cannot resume from checkpoint '{path}' ({type(error).__name__}: {reason}); "
                  f"set it aside as {aside.name} and trying the one before", file=sys.stderr, flush=True)
    if set_aside:
        (root / "last").unlink(missing_ok=True)
        raise UserError(f"no checkpoint in '{root}' can be resumed (set aside: "
                        f"{', '.join(p.name for p in set_aside)}); choose a new run_dir")
    return None


def write_checkpoint(root: str | Path, step: int, fill: Callable[[Path], None]) -> Path:
    """checkpoints/<step>/, written by `fill(dir)` under a temporary name and renamed into place
    (`fill` writes training_state/counters.json last); then `last` points at it. Keeps the newest
    KEEP_CHECKPOINTS numbered checkpoints and the replay buffer of the newest only."""
    import tempfile

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{int(step)}.", suffix=".tmp"))
    try:
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    target = root / str(int(step))
    if target.exists():  # the same step saved again (a resumed run's end): the new one wins
        old = root / f".{int(step)}.replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
    _point_last(root, target)
    numbered = sorted((p for p in root.iterdir() if p.name.isdigit() and p.is_dir() and not p.is_symlink()),
                      key=lambda p: int(p.name))
    for old in numbered[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    for older in numbered[:-1]:
        (older / TRAINING_STATE / REPLAY).unlink(missing_ok=True)
    return target


SCORES = ("pass@1", "success_rate", "return")  # what best.json's score is, in order of preference


def score(record: dict[str, Any]) -> float:
    """What makes a checkpoint the best: its evaluation's pass@1 (language) or success rate, or
    its mean return on a task without a success signal."""
    return float(next(record[key] for key in SCORES if record.get(key) is not None))


def saved_env_step(path: str | Path) -> int | None:
    """The env step a fine-tuning run saved checkpoint `path` at (a numbered one, last or best),
    or None (a BC checkpoint)."""
    step = checkpoint_step(Path(path))
    if step is not None:
        return step
    try:
        return int(json.loads((Path(path) / BEST_RECORD).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_best(root: str | Path) -> dict[str, Any] | None:
    """The record of checkpoints/best under `root` (a run's checkpoints/), or None when there is none."""
    try:
        record = json.loads((Path(root) / BEST / BEST_RECORD).read_text())
    except (OSError, ValueError):
        return None
    scored = isinstance(record, dict) and any(record.get(key) is not None for key in SCORES)
    return record if scored and "step" in record else None


def write_best(root: str | Path, record: dict[str, Any], fill: Callable[[Path], None]) -> Path:
    """checkpoints/best: a symlink to a hidden directory `.best.<random>` that `fill(dir)` writes
    the agent files into, with `record` as best.json written last. The symlink is swapped in one
    rename and the directory it pointed to is removed after, so a kill at any moment leaves a
    whole checkpoints/best (and at worst a stray directory, removed at the next write). The
    directory is not a numbered checkpoint: pruning and resume never touch it."""
    import tempfile

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = Path(tempfile.mkdtemp(dir=root, prefix=".best."))
    try:
        fill(target)
        atomic_write_json(target / BEST_RECORD, record)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    _point_link(root / BEST, target)
    for old in root.glob(".best.*"):
        if old != target and old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    return root / BEST


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


class EnvEvaluation:
    """The robot runs' evaluation: `cfg.eval_episodes` episodes of `make_agent(num_envs)` on an
    eval env of its own (seed + 1, episodes seeded from seed + 12345), videos/step_<step>/
    holding `cfg.videos` of them.

    What FinetuneLoop asks of an evaluation (lm/rl.py has the language one):
    `evaluation(step) -> (eval_info, eval/* metrics)`, `record(eval_info)`: what best.json keeps
    of it (compared by `score`), `headline(eval_info)`: its numbers in the run's headline, `close()`.
    """

    def __init__(self, cfg: Any, run: Run, make_agent: Callable[[int], Any], env_options: dict[str, Any] | None = None):
        """`env_options`: envs.make keywords of the observations the agent reads (policy.env_options())."""
        self.cfg, self.run, self.make_agent = cfg, run, make_agent
        self.env_options = dict(env_options or {})
        self.env = None

    def _make_env(self):
        if self.env is None:
            from embodied_rl import envs

            num_envs = max(1, min(int(self.cfg.eval_episodes), int(self.cfg.num_envs)))
            self.env = envs.make(
                self.cfg.task.name, num_envs=num_envs, backend=self.cfg.backend,
                device=self.cfg.device, seed=int(self.cfg.seed) + 1, task_options=envs.task_overrides(self.cfg.task),
                **self.env_options,
            )
        return self.env

    def __call__(self, step: int, video_name: str | None = None) -> tuple[dict[str, Any], dict[str, float]]:
        """`video_name`: the folder under videos/ (default step_<step>)."""
        from embodied_rl.eval import evaluate

        env = self._make_env()
        videos = min(int(self.cfg.videos), int(self.cfg.eval_episodes))
        info = evaluate(
            env, self.make_agent(env.num_envs), episodes=int(self.cfg.eval_episodes),
            seed=int(self.cfg.seed) + 12345, videos=videos,
            video_dir=self.run.file("videos", video_name or f"step_{step}") if videos else None, progress=False,
        )
        overall = info["overall"]
        metrics = {"eval/return": overall["avg_sum_reward"], "eval/episode_length": overall["avg_episode_length"]}
        if overall.get("success_rate") is not None:
            low, high = overall["success_ci95"]
            metrics.update({"eval/success_rate": overall["success_rate"],
                            "eval/success_rate_low": low, "eval/success_rate_high": high})
        by_instruction = overall.get("success_by_instruction") or {}
        if len(by_instruction) > 1:  # a multi-task curve: each task's own, so a dip on one task shows
            metrics.update({f"eval/success_rate/{text}": group["success_rate"]
                            for text, group in by_instruction.items()})
        return info, metrics

    def record(self, info: dict[str, Any]) -> dict[str, Any]:
        overall = info["overall"]
        return {"success_rate": overall.get("success_rate"), "success_ci95": overall.get("success_ci95"),
                "return": overall["avg_sum_reward"],
                # what `embodied-rl eval` needs to score the same episodes again
                "episodes": overall["n_episodes"], "num_envs": overall["num_envs"], "seed": overall["seed"]}

    def headline(self, info: dict[str, Any]) -> dict[str, Any]:
        overall = info["overall"]
        headline: dict[str, Any] = {}
        if overall.get("success_rate") is not None:
            headline["success_rate"] = overall["success_rate"]
            headline["success_ci95"] = [round(x, 4) for x in overall["success_ci95"]]
        headline["return"] = overall["avg_sum_reward"]
        return headline

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


class Evaluator:
    """Runs the loop's evaluation every `every` steps of its counter (`maybe_evaluate(step)`: when
    `step` crossed the next multiple of `every`, or `force=True`), logs the evaluation's metrics
    at `step` and writes its eval_info (with "step") as eval_info.json; returns the eval_info
    (None when it did not run).
    Evaluation leaves the global RNGs as it found them, so when and how often a run evaluates
    never changes its training.
    It is also the run's clock. `eval/train_wall_s` is the training time to reach that point: the
    wall time since the evaluator was made minus the time spent evaluating, plus what earlier
    parts of a resumed run had trained (`clock()` goes into every checkpoint's counters, and a
    resumed run passes them back as `earlier`). The time between a part's last checkpoint and
    its end is lost with the steps redone after the resume, so every step is counted once.
    """

    def __init__(self, run: Run, evaluation: Any, every: int, step: int = 0, earlier: dict[str, Any] | None = None):
        """`step`: where the run starts (a resumed run's checkpoint); `earlier`: that checkpoint's counters."""
        earlier = earlier or {}
        self.run, self.evaluation = run, evaluation
        self.every = int(every)
        self.next_step = _next_multiple(step, self.every)
        self.last_info: dict[str, Any] | None = None
        self.last_step: int | None = None
        self.start_time = time.perf_counter()
        self.eval_seconds = 0.0
        self.earlier_wall_s = float(earlier.get("wall_s", 0.0))
        self.earlier_train_wall_s = float(earlier.get("train_wall_s", 0.0))

    def clock(self) -> dict[str, float]:
        """{"wall_s": the run's wall time, "train_wall_s": the same without evaluations}, over
        every part of a resumed run."""
        elapsed = time.perf_counter() - self.start_time
        return {"wall_s": self.earlier_wall_s + elapsed,
                "train_wall_s": self.earlier_train_wall_s + elapsed - self.eval_seconds}

    def recall(self, step: int) -> None:
        """Take the run's eval_info.json as the last evaluation when it scored `step` (a resumed
        run whose checkpoint was evaluated before the stop is not evaluated again)."""
        try:
            info = json.loads(self.run.file("eval_info.json").read_text())
        except (OSError, ValueError):
            return
        if isinstance(info, dict) and info.get("step") == step and "overall" in info:
            self.last_info, self.last_step = info, step

    def due(self, step: int) -> bool:
        return self.next_step is not None and step >= self.next_step

    def maybe_evaluate(self, step: int, force: bool = False) -> dict[str, Any] | None:
        if not (force or self.due(step)):
            return None
        train_wall_s = self.clock()["train_wall_s"]
        eval_start = time.perf_counter()
        global_rngs = rng_state()
        try:
            info, metrics = self.evaluation(step)
        finally:
            set_rng_state(global_rngs)
        self.run.log(step, {**metrics, "eval/train_wall_s": train_wall_s})
        atomic_write_json(self.run.file("eval_info.json"), {**info, "step": int(step)})
        if self.every > 0:
            self.next_step = _next_multiple(step, self.every)
        self.last_info = info
        self.last_step = int(step)
        self.eval_seconds += time.perf_counter() - eval_start
        return info

    def close(self) -> None:
        self.evaluation.close()


# ---------------------------------------------------------------------------------------------
# The run loop's bookkeeping
# ---------------------------------------------------------------------------------------------


# the mean over a logging window's finished episodes, by what each episode records: the
# simulator's return and success (the truth, whatever the learner is paid), and with
# reward=model:PATH the learned return and success the learner was paid (reward hacking shows as
# the learned success rising while the true one falls)
EPISODE_METRICS = {"returns": "rollout/return", "successes": "rollout/success_rate",
                   "learned_returns": "train/learned_return", "learned_successes": "train/learned_success_rate"}
# what else each finished episode records: its instruction id (a task with instructions), so that a
# multi-task window's success reads per instruction too (rollout/success_rate/<instruction>): the
# training curve of each task of a suite, beside eval's
EPISODE_RECORDS = (*EPISODE_METRICS, "instructions")
# reward=model:PATH: a logging window of at least this many training episodes whose learned success
# rate exceeds the simulator's by learned_reward.hacking_gap is flagged as reward hacking
HACKING_MIN_EPISODES = 20


def ended_instructions(info: dict[str, Any], ended: torch.Tensor) -> list[int] | None:
    """The instruction ids of the episodes `ended` marks (bool [N]), read from info["final_obs"];
    None for a task without instructions."""
    final = info.get("final_obs")
    if not isinstance(final, dict) or final.get("instruction") is None:
        return None
    return final["instruction"].cpu()[ended.cpu()].tolist()


def _next_multiple(step: int, every: int) -> int | None:
    return (step // every + 1) * every if every > 0 else None


def diverged(where: str, quantity: str, saved: str | None) -> Diverged:
    """The one-line error of a run that went non-finite at `where` ("step 40"), naming the
    quantity and what checkpoints/last holds (`saved`, e.g. "step 20"; None: nothing saved)."""
    kept = f"checkpoints/last holds {saved}" if saved is not None else "no checkpoint was written"
    return Diverged(f"training diverged at {where}: {quantity} is not finite ({kept})")


def refuse_non_finite(where: str, saved: str | None, **states: Any) -> None:
    """Raise `diverged` when a tensor in `states` (state dicts, nested) is not finite. Every
    checkpoint write calls it first, so checkpoints/last is always a finite state."""
    bad = first_non_finite(states)
    if bad is not None:
        raise diverged(where, bad, saved)


def refuse_non_finite_checkpoint(path: Any, *holders: Any) -> None:
    """A UserError when a network loaded from checkpoint `path` (an nn.Module among `holders`
    or their attributes: a policy, an agent) holds a non-finite weight: scoring or fine-tuning it
    would report nonsense. (This package never writes one: `refuse_non_finite`.)"""
    from torch import nn

    modules = {}
    for index, holder in enumerate(holders):
        found = [holder] if isinstance(holder, nn.Module) else [
            value for value in vars(holder).values() if isinstance(value, nn.Module)]
        modules.update({f"{index}.{i}": module.state_dict() for i, module in enumerate(found)})
    if first_non_finite(modules) is not None:
        raise UserError(f"checkpoint '{path}' holds non-finite weights; it cannot be used")


def first_non_finite(tensors: dict[str, Any]) -> str | None:
    """The name of the first floating tensor (nested dicts and lists searched) that is not finite."""
    stack = list(tensors.items())
    while stack:
        name, value = stack.pop()
        if isinstance(value, dict):
            stack += [(f"{name}.{k}", v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            stack += [(f"{name}.{i}", v) for i, v in enumerate(value)]
        elif isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return name
    return None


class FinetuneLoop:
    """The bookkeeping of one fine-tuning run (see the module docstring for the calling pattern).

    `settings` hold its schedule: `<counter>` (the total to reach), `log_every`, `eval_every`,
    `checkpoint_every` (in counts) and, for algorithms with a replay buffer, `save_replay`;
    a robot run passes its finetune config. `counter` names what the loop counts: `env_steps`
    (robot runs), `steps` (the language RL's iterations). `evaluation` is what an evaluation
    runs (`EnvEvaluation` for robot runs; its contract there).
    `counters` are the run's JSON counters (`counter`, `episodes` and whatever the algorithm
    adds, e.g. PPO's `iteration`); they go into every checkpoint and come back on resume.
    """

    def __init__(self, settings: Any, run: Run, evaluation: Any, counter: str = "env_steps"):
        self.run, self.evaluation, self.counter = run, evaluation, counter
        self.unit = counter.replace("_", " ").removesuffix("s")  # how messages name a count: "env step 40"
        self.total = int(settings[counter])
        self.eval_every = int(settings["eval_every"])
        self.checkpoint_every = int(settings["checkpoint_every"])
        self.log_every = int(settings["log_every"])
        self.save_replay = bool(settings.get("save_replay", True))
        learned = str(settings.get("reward") or "sim").startswith("model:")
        self.hacking_gap = float(settings["learned_reward"]["hacking_gap"]) if learned else None
        self.counters: dict[str, Any] = {counter: 0, "episodes": 0}
        self.modules: dict[str, Any] = {}
        self.optimizers: dict[str, Any] = {}
        self.write_agent: Callable[[Path], None] | None = None
        self.resumed_from: Path | None = None
        self.saved_step: int | None = None  # the step of the newest checkpoint this run holds
        # per finished episode (EPISODE_METRICS): this rank's since the last sync, and every
        # rank's of the current logging window
        self.episodes: dict[str, list[float]] = {key: [] for key in EPISODE_RECORDS}
        self.window: dict[str, list[float]] = {key: [] for key in EPISODE_RECORDS}
        self.instructions: list[str] = []  # the task's instructions (start): what instruction ids name
        self.evaluator: Evaluator | None = None
        self.best: dict[str, Any] | None = None  # the record of checkpoints/best (rank 0)
        self.bar = None
        self.evaluates_ends = self.eval_every > 0  # evaluate at step 0 and at the end (start() may add a reason)

    @property
    def step(self) -> int:
        """How far the run is, in its counter."""
        return int(self.counters[self.counter])

    @property
    def env_steps(self) -> int:  # the robot loops' name of `step`
        return self.step

    @property
    def total_env_steps(self) -> int:  # the robot loops' name of `total`
        return self.total

    # ---- start ----

    def resume(self, modules: dict[str, Any], optimizers: dict[str, Any],
               write_agent: Callable[[Path], None]) -> dict[str, Any] | None:
        """Register what checkpoints hold: `modules` (anything with state_dict/load_state_dict:
        the trainable networks, their targets), `optimizers`, and `write_agent(dir)`, which
        writes the files `load_agent` reads. When the run has a checkpoint, load it into them,
        restore the RNGs and counters, and return the algorithm's loop state saved with it
        (with "replay" when saved); None for a fresh run."""
        self.modules, self.optimizers, self.write_agent = modules, optimizers, write_agent

        def read(path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
            state_dir = path / TRAINING_STATE
            state = torch.load(state_dir / "state.pt", weights_only=True)
            if "modules" not in state:  # an older layout: refused below, never set aside as unreadable
                return state, None
            saved_optimizers = torch.load(state_dir / "optimizers.pt", weights_only=True)
            if distributed.rank() > 0:  # this rank's own RNGs, loop state and replay shard
                state.update(torch.load(state_dir / f"rank_{distributed.rank()}.pt", weights_only=True))
            return state, saved_optimizers

        # rank 0 finds (and repairs) the newest readable checkpoint; every rank then reads it
        found = newest_readable_checkpoint(self.run.file("checkpoints"), read) if distributed.is_main() else None
        path = distributed.broadcast_object(None if found is None else str(found[0]))
        path = None if path is None else Path(path)
        loop_state = None
        if path is not None:
            state, saved_optimizers = found[1] if distributed.is_main() else read(path)
            state_dir = path / TRAINING_STATE
            if "modules" not in state:
                raise UserError(f"checkpoint '{path}' was written by an older version and cannot be resumed "
                                "(it still loads with eval); choose a new run_dir")
            counters = json.loads((state_dir / COUNTERS).read_text())
            ranks = int(counters.get("ranks", 1))
            if ranks != distributed.world_size():
                raise UserError(f"checkpoint '{path}' was written by {ranks} rank(s); resume it with "
                                f"{ranks} (now {distributed.world_size()})")
            for name, module in modules.items():
                module.load_state_dict(state["modules"][name])
            for name, optimizer in optimizers.items():
                optimizer.load_state_dict(saved_optimizers[name])
            set_rng_state(state["rng"])
            if state.get("evaluation") is not None:  # rank 0's: the one that evaluates
                self.evaluation.load_state_dict(state["evaluation"])
            self.counters.update(counters)
            self.counters.pop("step", None)
            self.window = {key: state["window"][key].tolist() if key in state["window"] else []
                           for key in EPISODE_RECORDS}
            self.saved_step = self.step
            loop_state = dict(state["loop"])
            if state.get("replay") is not None:
                loop_state["replay"] = state["replay"]
            elif (state_dir / REPLAY).exists() and distributed.is_main():
                loop_state["replay"] = torch.load(state_dir / REPLAY, weights_only=True)
            self.resumed_from = path
        # the steps after the checkpoint are redone; a run stopped before its first checkpoint starts over
        self.run.forget_metrics_after(self.step if path is not None else -1)
        self.evaluator = Evaluator(self.run, self.evaluation, self.eval_every, self.step, self.counters)
        if path is not None and distributed.is_main():
            self.evaluator.recall(self.step)
        if distributed.is_main():
            self.best = read_best(self.run.file("checkpoints"))
        self.next_log = _next_multiple(self.step, self.log_every)
        self.next_checkpoint = _next_multiple(self.step, self.checkpoint_every)
        return loop_state

    def start(self, desc: str, evaluate_start: bool = False, instructions: Sequence[str] = ()) -> None:
        """Evaluate the starting model at step 0 (fresh runs; with `evaluate_start` even when
        eval_every is 0: a rule of the run needs it) and show the progress bar (rank 0). A
        resumed run whose checkpoint was evaluated before the stop weighs that evaluation for
        checkpoints/best (a kill may have come between the two writes). A run evaluated at its start
        is evaluated at its end too (finish). `instructions`: the training env's (env.instructions),
        what the instruction ids of its finished episodes name in the per-instruction success."""
        self.instructions = list(instructions)
        self.evaluates_ends = self.evaluator.every > 0 or evaluate_start or getattr(self.evaluation, "judges", False)
        if self.resumed_from is None and self.evaluates_ends and distributed.is_main():
            self.evaluate(0, force=True)
        elif self.evaluator.last_step == self.step and (self.best or {}).get("step") != self.step:
            # the checkpoint's evaluation ran before the stop, which may have come before its best was written
            self._keep_if_best(self.step, self.evaluator.last_info)
        self.bar = progress(total=self.total, desc=desc, show=distributed.is_main(),
                            initial=min(self.step, self.total))

    # ---- every step or iteration ----

    def advance(self, count: int, info: dict[str, Any] | None = None) -> None:
        """Count `count` more of this rank's steps (every rank steps as many: the job's count
        grows by world_size times that); record the episodes `info` reports finished."""
        count = int(count) * distributed.world_size()
        self.counters[self.counter] += count
        if info is not None and bool(info["_episode"].any()):
            ended, episode = info["_episode"], info["episode"]
            learned = "learned_success_once" in episode  # a learned reward's env (rewards.LearnedRewardEnv)
            self.record_episodes(episode["return"][ended].tolist(), episode["success_once"][ended].float().tolist(),
                                 episode["learned_return"][ended].tolist() if learned else None,
                                 episode["learned_success_once"][ended].float().tolist() if learned else None,
                                 ended_instructions(info, ended))
        self.bar.update(count)

    def record_episodes(self, returns: list[float], successes: list[float], learned_returns: list[float] | None = None,
                        learned_successes: list[float] | None = None, instructions: list[int] | None = None) -> None:
        """This rank's finished episodes (the simulator's return and success, with
        reward=model:PATH the learned ones, and on a task with instructions each one's instruction
        id); they count (counters["episodes"]) once synced."""
        finished = {"returns": returns, "successes": successes, "learned_returns": learned_returns,
                    "learned_successes": learned_successes, "instructions": instructions}
        for key, values in finished.items():
            self.episodes[key] += values or []

    def _sync_episodes(self) -> None:
        """Move every rank's newly finished episodes into the logging window (the same on every
        rank) and count them."""
        for episodes in distributed.all_gather_objects(self.episodes):
            for key, values in episodes.items():
                self.window[key] += values
            self.counters["episodes"] += len(episodes["returns"])
        self.episodes = {key: [] for key in EPISODE_RECORDS}

    def check_finite(self, quantity: str, value: Any, metrics: dict[str, Any] | None = None) -> None:
        """Stop the run (Diverged, exit code 3) when `value` is not finite; its row is logged."""
        value = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
        if not math.isfinite(value):
            self.run.log(self.step, {**(metrics or {}), quantity: value})
            raise diverged(f"{self.unit} {self.step}", quantity, self._saved())

    def _saved(self) -> str | None:
        return None if self.saved_step is None else f"{self.unit} {self.saved_step}"

    def log(self, metrics: dict[str, Any], force: bool = False) -> bool:
        """Write one metrics row (with the episodes finished since the last row) when the logging
        window (`log_every` counts) is full, or `force`. Returns whether it wrote."""
        if not force and self.next_log is not None and self.step < self.next_log:
            return False
        self._sync_episodes()
        row = dict(metrics)
        if self.window["returns"]:
            row.update({name: sum(self.window[key]) / len(self.window[key])
                        for key, name in EPISODE_METRICS.items() if self.window[key]})
            row["rollout/episodes"] = len(self.window["returns"])
            row.update(self._success_by_instruction())
            self._flag_reward_hacking(row)
            self.window = {key: [] for key in EPISODE_RECORDS}
        self.run.log(self.step, row)
        self.next_log = _next_multiple(self.step, self.log_every)
        return True

    def _success_by_instruction(self) -> dict[str, float]:
        """A multi-task window's success rate per instruction (`rollout/success_rate/<instruction>`,
        as eval names them) and its episodes (`rollout/episodes/<instruction>`, so windows add up)
        over the instructions its episodes had; {} on a single-instruction task or a window whose
        episodes are not all labelled (the first one after resuming an older run)."""
        ids, successes = self.window["instructions"], self.window["successes"]
        if len(self.instructions) < 2 or len(ids) != len(successes):
            return {}
        by_id: dict[int, list[float]] = {}
        for index, success in zip(ids, successes):
            by_id.setdefault(int(index), []).append(success)
        rows = {}
        for index, values in sorted(by_id.items()):
            rows[f"rollout/success_rate/{self.instructions[index]}"] = sum(values) / len(values)
            rows[f"rollout/episodes/{self.instructions[index]}"] = len(values)
        return rows

    def _flag_reward_hacking(self, row: dict[str, Any]) -> None:
        """reward=model:PATH: the learned success rate of the window's training episodes minus the
        simulator's (`train/reward_gap`); at least hacking_gap over HACKING_MIN_EPISODES episodes is
        flagged (`train/reward_hacking`, a warning the first time, the headline's `reward_hacking`)."""
        learned = self.window["learned_successes"]
        if self.hacking_gap is None or len(learned) < HACKING_MIN_EPISODES:
            return
        gap = row["train/learned_success_rate"] - row["rollout/success_rate"]
        row["train/reward_gap"] = gap
        if gap < self.hacking_gap:
            return
        row["train/reward_hacking"] = 1.0
        if not self.counters.get("hacking_windows"):
            self.counters["hacking_first_step"] = self.step
            if distributed.is_main():
                print(f"warning: reward hacking? at {self.unit} {self.step} the reward model paid a success in "
                      f"{row['train/learned_success_rate']:.0%} of {len(learned)} training episodes, the simulator "
                      f"saw {row['rollout/success_rate']:.0%} (train/reward_gap; report.md plots both)",
                      file=sys.stderr, flush=True)
        self.counters["hacking_windows"] = self.counters.get("hacking_windows", 0) + 1

    def boundary(self, loop_state: Callable[[], dict[str, Any]]) -> None:
        """Where the loop may stop and resume: evaluate when eval_every is due and checkpoint when
        checkpoint_every is due (`loop_state()` is called only then)."""
        if self.step < self.total and distributed.is_main():
            info = self.evaluate(self.step)
            if info is not None and info["overall"].get("success_rate") is not None:
                self.bar.set_postfix(success=f"{100 * info['overall']['success_rate']:.0f}%")
        if self.next_checkpoint is not None and self.step >= self.next_checkpoint:
            self.save(loop_state())

    def starts_high(self, high_start: float) -> bool:
        """Whether the step-0 evaluation (start(evaluate_start=True) of a fresh run) succeeded at
        least `high_start` of the time, the same answer on every rank; False on a task without a
        success signal. The run prints the verdict."""
        info = self.evaluator.last_info if distributed.is_main() and self.evaluator.last_step == 0 else None
        success = distributed.broadcast_object(info["overall"].get("success_rate") if info else None)
        high = success is not None and success >= high_start
        if distributed.is_main():
            print(f"[finetune] the first evaluation's success is {success}: {'a' if high else 'not a'} high start "
                  f"(algo.high_start={high_start})", flush=True)
        return high

    def evaluate(self, step: int, force: bool = False) -> dict[str, Any] | None:
        """Evaluate when eval_every is due at `step` (or `force`; rank 0 only) and keep the agent
        as checkpoints/best when it scores at least the best so far: ties go to the later
        evaluation, the one trained longer. Returns the eval_info, None when it did not run."""
        info = self.evaluator.maybe_evaluate(step, force=force)
        if info is not None:
            self._keep_if_best(step, info)
        return info

    def _keep_if_best(self, step: int, info: dict[str, Any]) -> None:
        record = {"step": int(step), **self.evaluation.record(info)}
        if self.best is None or score(record) >= score(self.best):
            modules = {name: module.state_dict() for name, module in self.modules.items()}
            refuse_non_finite(f"{self.unit} {step}", self._saved(), weights=modules)
            write_best(self.run.file("checkpoints"), record, self.write_agent)
            self.best = record

    def save(self, loop_state: dict[str, Any]) -> Path:
        """Write a checkpoint: agent files, modules, optimisers, RNGs, counters and `loop_state`
        (its "replay" entry into its own file, left out when save_replay=false). Refuses to
        write non-finite weights or optimiser state (Diverged). Under torchrun every rank calls
        it: the other ranks send rank 0 their RNGs, loop state and replay shard."""
        modules = {name: module.state_dict() for name, module in self.modules.items()}
        optimizers = {name: optimizer.state_dict() for name, optimizer in self.optimizers.items()}
        refuse_non_finite(f"{self.unit} {self.step}", self._saved(), weights=modules)
        refuse_non_finite(f"{self.unit} {self.step}", self._saved(), optimizer=optimizers)
        distributed.check_in_sync(self.modules)
        self._sync_episodes()
        loop_state = dict(loop_state)
        replay = loop_state.pop("replay", None)
        if not self.save_replay:
            replay = None
        other_ranks = distributed.gather_objects(
            None if distributed.is_main() else {"rng": rng_state(), "loop": loop_state, "replay": replay})
        self.saved_step = self.step
        self.next_checkpoint = _next_multiple(self.step, self.checkpoint_every)
        path = self.run.file("checkpoints", "last")
        if not distributed.is_main():
            return path
        counters = {**self.counters, **self.evaluator.clock(), "ranks": distributed.world_size(), "step": self.step}
        evaluation = self.evaluation.state_dict() if hasattr(self.evaluation, "state_dict") else None
        window = {key: torch.tensor(values, dtype=torch.float64) for key, values in self.window.items()}

        def fill(directory: Path) -> None:
            self.write_agent(directory)
            state_dir = directory / TRAINING_STATE
            state_dir.mkdir()
            torch.save(optimizers, state_dir / "optimizers.pt")
            torch.save({"rng": rng_state(), "modules": modules, "loop": loop_state, "window": window,
                        "evaluation": evaluation}, state_dir / "state.pt")
            if replay is not None:
                torch.save(replay, state_dir / REPLAY)
            for rank, rank_state in enumerate(other_ranks[1:], start=1):
                torch.save(rank_state, state_dir / f"rank_{rank}.pt")
            (state_dir / COUNTERS).write_text(json.dumps(counters) + "\n")  # last: marks it complete

        return write_checkpoint(self.run.file("checkpoints"), self.step, fill)

    # ---- end ----

    def finish(self, loop_state: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The final evaluation (unless one ran at this step), the last checkpoint (`loop_state()`
        is called after the evaluation) and the headline: the evaluation's numbers, the count,
        checkpoints/last and, when the run has one, the record of checkpoints/best (`best`, its
        path `best_checkpoint`)."""
        if self.bar is not None:
            self.bar.close()
        evaluator = self.evaluator
        info = evaluator.last_info
        # evaluate first, as boundary() does: an evaluation may set what the checkpoint acts with
        if self.evaluates_ends and evaluator.last_step != self.step and distributed.is_main():
            info = self.evaluate(self.step, force=True)
        if self.saved_step != self.step:
            self.save(loop_state())
        evaluator.close()
        self.run.log(self.step, {"train/wall_s": evaluator.clock()["wall_s"]})
        headline = self.evaluation.headline(info) if info is not None else {}
        headline[self.counter] = self.step
        headline["checkpoint"] = str(self.run.file("checkpoints", "last"))
        if self.best is not None:
            headline["best"] = self.best
            headline["best_checkpoint"] = str(self.run.file("checkpoints", BEST))
        if self.counters.get("hacking_windows"):
            headline["reward_hacking"] = (f"the learned success exceeded the simulator's by >= {self.hacking_gap:.0%} "
                                          f"in {self.counters['hacking_windows']} logging windows, first at "
                                          f"{self.unit} {self.counters['hacking_first_step']} (train/reward_gap)")
        return headline
