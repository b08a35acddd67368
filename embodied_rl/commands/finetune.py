"""`embodied-rl finetune task=T checkpoint=DIR algo=NAME env_steps=N ...`

Validates the config, creates the run directory or resumes it (a run_dir holding
checkpoints/last continues from there), loads the base policy, makes the training env and hands
them to the algorithm: `ALGOS[algo.name]` is a module with
`finetune(cfg, run, env, policy) -> headline dict` (docs/finetuning.md).

`reward=model:PATH` pays the learner a reward model's judgement instead of the simulator's
reward: the training env becomes a rewards.LearnedRewardEnv (docs/rewards.md), whatever the
algorithm; evaluation still scores the simulator's success.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from embodied_rl.algos.wsrl import check_actor_trains
from embodied_rl.errors import UserError

ALGOS: dict[str, str] = {
    "residual_ppo": "embodied_rl.algos.ppo",
    "residual_remix": "embodied_rl.algos.ppo",
    "dppo": "embodied_rl.algos.ppo",
    "reinflow": "embodied_rl.algos.ppo",
    "flow_sde": "embodied_rl.algos.ppo",
    "grpo": "embodied_rl.algos.ppo",
    "dsrl_ppo": "embodied_rl.algos.ppo",
    "fpo": "embodied_rl.algos.ppo",
    "dsrl": "embodied_rl.algos.dsrl",
    "dsrl_na": "embodied_rl.algos.dsrl",
    "residual_offpolicy": "embodied_rl.algos.residual_offpolicy",
    "residual_sac": "embodied_rl.algos.residual_offpolicy",  # the former name of residual_offpolicy, kept as an alias
    "rlpd": "embodied_rl.algos.residual_offpolicy",
    "recap": "embodied_rl.algos.recap",
    "qc_fql": "embodied_rl.algos.qc_fql",
    "sac_flow": "embodied_rl.algos.sac_flow",
}


def validate(cfg: DictConfig) -> Path:
    """Check the config before any work; return the base checkpoint directory."""
    from embodied_rl.actors import resolve_checkpoint
    from embodied_rl.commands import validate_common

    validate_common(cfg)
    if cfg.algo.name not in ALGOS:
        raise UserError(f"unknown algo '{cfg.algo.name}' (choose from: {', '.join(ALGOS)})")
    if cfg.get("checkpoint") in (None, ""):
        raise UserError("checkpoint=DIR is required (a BC policy checkpoint directory)")
    for key in ("env_steps", "num_envs", "eval_episodes"):
        if int(cfg[key]) < 1:
            raise UserError(f"{key} must be >= 1, got {cfg[key]}")
    if int(cfg.eval_every) < 0:
        raise UserError(f"eval_every must be >= 0, got {cfg.eval_every}")
    steps = cfg.get("sampler_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise UserError(f"sampler_steps must be null or an integer >= 1, got {steps!r}")
    for key in ("checkpoint_every", "log_every"):
        if int(cfg[key]) < 0:
            raise UserError(f"{key} must be >= 0, got {cfg[key]}")
    importlib.import_module(ALGOS[cfg.algo.name]).validate_config(cfg)  # the algo's own keys
    check_actor_trains(cfg)
    actor = OmegaConf.select(cfg, "algo.actor")
    if isinstance(actor, str):  # the PPO family names its actor
        from embodied_rl.actors import ACTORS, check_actor_kwargs

        if actor not in ACTORS:
            raise UserError(f"unknown algo.actor '{actor}' (choose from: {', '.join(ACTORS)})")
        check_actor_kwargs(actor, dict(OmegaConf.select(cfg, "algo.actor_kwargs") or {}))
    if not 0 <= int(cfg.videos) <= int(cfg.eval_episodes):
        raise UserError(f"videos must be in [0, eval_episodes={cfg.eval_episodes}], got {cfg.videos}")
    check_task_weights(cfg)
    return resolve_checkpoint(Path(str(cfg.checkpoint)).expanduser())


def check_task_weights(cfg: DictConfig) -> list[float] | None:
    """task_weights: how the training envs split across a LIBERO suite's tasks, one weight per
    task in the suite's order (envs/tasks/libero.py's envs_per_task), so that the tasks the policy
    fails get more of the episodes; the evaluations keep the even split. None: the even split."""
    weights = cfg.get("task_weights")
    if weights is None:
        return None
    from embodied_rl.envs.tasks import libero

    name = str(cfg.task.name)
    if not libero.is_task(name) or len(libero.task_class(name).suite_tasks) < 2:
        raise UserError(f"task_weights splits the training envs of a LIBERO suite (task=libero/<suite>), not of "
                        f"task '{name}'")
    count = len(libero.task_class(name).suite_tasks)
    weights = OmegaConf.to_container(weights) if OmegaConf.is_config(weights) else weights
    numbers = isinstance(weights, list) and all(isinstance(w, int | float) and not isinstance(w, bool) for w in weights)
    if not numbers or len(weights) != count or min(weights) < 0 or sum(weights) <= 0:
        raise UserError(f"task_weights must be {count} numbers >= 0, one per task of '{name}' in its order, not all 0; "
                        f"got {weights!r}")
    return [float(weight) for weight in weights]


def load_base_policy(path: Path, device: str, sampler_steps: int | None = None):
    """The BC policy to fine-tune; a fine-tuned checkpoint continues from its base policy. With
    `sampler_steps` its sampler runs that many denoising steps (its checkpoints record them)."""
    from embodied_rl.actors import BASE_POLICY
    from embodied_rl.policies import load_policy

    if (path / BASE_POLICY).is_dir():
        path = path / BASE_POLICY
    policy = load_policy(path, device=device)
    if sampler_steps is not None:
        try:
            policy.set_num_inference_steps(sampler_steps)
        except ValueError as error:  # a shortcut policy takes powers of two up to its finest step
            raise UserError(f"sampler_steps={sampler_steps}: {error}") from None
    return policy


# Keys a resumed run may change: how long it runs and what it records, how its training envs are spread over
# a suite's tasks and whether DSRL's envs step while it learns; not what it trains.
RESUME_MAY_CHANGE = ("env_steps", "eval_every", "eval_episodes", "videos", "checkpoint_every", "log_every",
                     "save_replay", "task_weights", "algo.pipeline")


def main(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    from embodied_rl.lm import is_lm_task, refuse_lm_checkpoint

    if is_lm_task(cfg):  # task=lm/<name>: RL on a language model (embodied_rl/lm)
        from embodied_rl.lm import rl

        if str(cfg.reward) != "sim":
            raise UserError("reward=model:PATH is for robot tasks; a language task is scored by its verifier")
        if cfg.get("sampler_steps") is not None:
            raise UserError("sampler_steps is for denoising robot policies; a language model has no denoising steps")
        return rl.main(cfg)
    refuse_lm_checkpoint(cfg)
    checkpoint = validate(cfg)
    policy = load_base_policy(checkpoint, str(cfg.device), cfg.get("sampler_steps"))
    from embodied_rl.algos.common import refuse_non_finite_checkpoint

    refuse_non_finite_checkpoint(checkpoint, policy)
    from embodied_rl.commands import checkpoint_task
    from embodied_rl.runs import check_previous_run, start_run

    checkpoint_task(policy, checkpoint, cfg.task.name)
    from embodied_rl.rewards import LearnedReward

    learned = LearnedReward.from_cfg(cfg, policy)  # None: the simulator's reward

    import embodied_rl.envs as envs
    from embodied_rl import distributed

    module = importlib.import_module(ALGOS[cfg.algo.name])
    if distributed.active() and not getattr(module, "DATA_PARALLEL", False):
        raise UserError(f"algo={cfg.algo.name} runs in one process; under torchrun use a PPO-family algo or "
                        "residual_offpolicy")
    options, task_options = policy.env_options(), envs.task_overrides(cfg.task)  # what the policy reads
    if learned is not None:  # and the frames the reward model reads
        options, task_options = learned.env_options(options, task_options)
    task_weights = check_task_weights(cfg)
    if task_weights is not None:  # the training env's split; the evaluation's stays even
        options["task_weights"] = task_weights
    # under torchrun each rank steps its own shard of the envs with its own seeds
    env = envs.make(cfg.task.name, num_envs=distributed.shard(int(cfg.num_envs)), backend=cfg.backend,
                    device=cfg.device, seed=distributed.rank_seed(int(cfg.seed)), task_options=task_options,
                    **options)
    if task_weights is not None and distributed.is_main():
        from embodied_rl.envs.tasks.libero import envs_per_task

        print(f"training envs per task: {envs_per_task(env.num_envs, task_weights)}", flush=True)
    if learned is not None:
        env = learned.wrap(env, policy.env_options()["image_size"] if policy.obs_mode == "pixels" else None)
    if env.action_dim != policy.action_dim:
        raise UserError(f"checkpoint '{checkpoint}' acts in {policy.action_dim} dims, task {cfg.task.name} in {env.action_dim}")
    from embodied_rl.algos.common import find_checkpoint

    distributed.check_on_main(lambda: check_previous_run(cfg, "finetune", RESUME_MAY_CHANGE))
    run = start_run(cfg, "finetune", allow_existing=True)
    # rank 0 finds (and repairs) the newest checkpoint
    resumed = find_checkpoint(run.file("checkpoints")) is not None if distributed.is_main() else None
    run.resumed = distributed.broadcast_object(resumed)
    if run.resumed and distributed.is_main():
        print(f"resuming from {run.file('checkpoints', 'last')}")
        if not env.can_snapshot:
            print("this backend cannot snapshot its envs: the episodes in progress restart, the learner resumes exactly")
    try:
        headline = module.finetune(cfg, run, env, policy)
        if distributed.is_main():
            headline["report"] = str(write_finetune_report(cfg, run))
    finally:
        env.close()
        run.close()
    return {"task": cfg.task.name, "algo": cfg.algo.name, **success_before_after(headline, run)}, run.path


def write_finetune_report(cfg: DictConfig, run: Any) -> Path:
    """report.md: the starting and the fine-tuned policy's evaluations, the learning curve, the
    final evaluation's videos and how the run was made."""
    import json

    from embodied_rl.algos.common import read_best
    from embodied_rl.eval.report import (
        instruction_table,
        learned_reward_curve,
        learning_curve,
        run_section,
        success_table,
        training_windows,
        video_links,
        write_report,
    )

    def overall(row: dict[str, Any]) -> dict[str, Any]:  # an evaluation's metrics row as success_table reads it
        has_success = "eval/success_rate" in row
        return {"success_rate": row.get("eval/success_rate"), "n_episodes": int(cfg.eval_episodes),
                "success_ci95": [row["eval/success_rate_low"], row["eval/success_rate_high"]] if has_success else None,
                "avg_sum_reward": row["eval/return"], "avg_episode_length": row["eval/episode_length"]}

    rows = run.read_metrics()
    evaluations = [row for row in rows if "eval/return" in row]
    labelled = {}
    if evaluations and evaluations[0]["step"] == 0:
        labelled["start (step 0)"] = evaluations[0]
    if evaluations and evaluations[-1]["step"] > 0:
        labelled[f"fine-tuned (step {evaluations[-1]['step']})"] = evaluations[-1]
    results = {label: overall(row) for label, row in labelled.items()}
    # a multi-task run's evaluations per task (eval/success_rate/<instruction>): which tasks moved
    prefix = "eval/success_rate/"
    by_instruction = {label: {key.removeprefix(prefix): value for key, value in row.items() if key.startswith(prefix)}
                      for label, row in labelled.items()}
    best = read_best(run.file("checkpoints"))
    best_rows = [row for row in evaluations if best is not None and row["step"] == best["step"]]
    if best_rows and best_rows[-1] is not evaluations[-1]:
        results[f"best: checkpoints/best (step {best['step']})"] = overall(best_rows[-1])
    wall = [row["train/wall_s"] for row in rows if "train/wall_s" in row]
    train_wall = [row["eval/train_wall_s"] for row in evaluations if "eval/train_wall_s" in row]
    try:
        final = json.loads(run.file("eval_info.json").read_text())
    except (OSError, ValueError):
        final = {}
    training = training_windows(rows)  # a multi-task run's rollouts per instruction, by spans of env steps
    sections = [
        ("Result", success_table(results) if results else "_no evaluation was logged (eval_every=0)_"),
        *([("Success per instruction", instruction_table(by_instruction))]
          if any(by_instruction.values()) else []),
        *([("Training episodes per instruction", instruction_table(training) + "\n\nThe training rollouts' "
             "success (exploration on) per span of env steps; (all): every instruction's episodes together.")]
          if training else []),
        ("Learning curve", learning_curve(rows, run.file("plots", "learning_curve.png"), run.path,
                                          f"{cfg.task.name}: {cfg.algo.name} fine-tuning")),
        *([("Learned vs true success", learned_reward_curve(rows, run.file("plots", "learned_reward.png"), run.path))]
          if any("train/learned_success_rate" in row for row in rows) else []),  # reward=model:PATH
        ("Videos of the last evaluation", video_links(final, run.path)),
        ("Run", run_section(tensorboard=True, wall_s=wall[-1] if wall else None,
                            training_wall_s=train_wall[-1] if train_wall else None)),
    ]
    return write_report(run.path, f"Fine-tuning: {cfg.task.name} with {cfg.algo.name}", sections)


def success_before_after(headline: dict[str, Any], run: Any) -> dict[str, Any]:
    """The algorithm's headline with its success rate as every command prints it, after the
    base policy's (the step-0 evaluation): 'success: 36.0% [27.3, 45.8] -> 99.0% [94.6, 99.8]',
    then checkpoints/best's evaluation in the same style: 'best: 99.0% [94.6, 99.8] at env step 4000'."""
    from embodied_rl.eval.stats import before_after, rate_with_interval, start_rate

    headline = dict(headline)
    rate, interval = headline.pop("success_rate", None), headline.pop("success_ci95", None)
    best = headline.pop("best", None)
    lines = {}
    if rate is not None:
        before = start_rate(run.read_metrics(), "eval/success_rate")
        lines["success"] = before_after(rate_with_interval(rate, interval), before)
    if best is not None:
        score = (f"return {best['return']:.4g}" if best["success_rate"] is None
                 else rate_with_interval(best["success_rate"], best["success_ci95"]))
        lines["best"] = f"{score} at env step {best['step']}"
    return {**lines, **headline}
