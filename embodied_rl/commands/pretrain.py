"""`embodied-rl pretrain task=T policy=diffusion|flow|shortcut data=DIR steps=N`

Behaviour-clones a chunk policy from a demo dataset (algos/bc.py), evaluates the EMA policy in
the env every `eval_every` steps and at the end, and writes into the run directory:
metrics.jsonl + tb/ (loss, lr, eval), checkpoints/<step>/ and checkpoints/last/ (load with
`embodied_rl.policies.load_policy`), eval_info.json and videos/ of the final evaluation.
`obs=pixels` (or policy.obs_mode=pixels) trains from camera frames when the dataset has them.

A run_dir holding an earlier pretrain run with the same settings (except RESUME_MAY_CHANGE)
resumes from its newest readable checkpoint and continues exactly as the run that never
stopped (weights, EMA, optimiser, learning-rate schedule, every RNG).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from embodied_rl.errors import UserError

# Keys a resumed run may change: what it records, not what it trains (steps shapes the schedule).
RESUME_MAY_CHANGE = ("eval_every", "eval_episodes", "num_envs", "videos", "log_every")
POLICY_SPECIFIC_KEYS = ("num_train_timesteps", "prediction_type", "time_sampling", "max_steps", "shortcut_fraction")


def _positive(cfg: DictConfig, key: str, allow_none: bool = False, allow_zero: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    if value is None and allow_none:
        return
    low = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise UserError(f"{key} must be an integer >= {low}, got {value!r}")


def validate(cfg: DictConfig) -> None:
    """Check the config before any work."""
    from embodied_rl.commands import validate_common

    if cfg.get("data") in (None, ""):
        raise UserError("data=PATH is required (a demo dataset from `embodied-rl collect`)")
    validate_common(cfg, min_eval_episodes=0)
    if not Path(str(cfg.data)).expanduser().exists():
        raise UserError(f"dataset '{cfg.data}' does not exist")
    if OmegaConf.select(cfg, "steps") is None:  # steps defaults to the task's pretrain_steps
        raise UserError(f"steps=N is required: task '{OmegaConf.select(cfg, 'task.name')}' sets no pretrain_steps")
    _positive(cfg, "steps")
    for key in ("eval_every", "max_demos"):
        _positive(cfg, key, allow_none=True)
    for key in ("batch_size", "log_every", "num_envs"):
        _positive(cfg, key)
    for key in ("eval_episodes", "videos"):
        _positive(cfg, key, allow_zero=True)
    if cfg.eval_episodes and cfg.videos > cfg.eval_episodes:
        raise UserError(f"videos must be in [0, eval_episodes={cfg.eval_episodes}], got {cfg.videos}")
    policy = cfg.policy
    from embodied_rl.policies import POLICIES

    if policy.name not in POLICIES:
        raise UserError(f"unknown policy '{policy.name}' (choose from: {', '.join(POLICIES)})")
    obs_mode = cfg.obs if cfg.get("obs") is not None else policy.obs_mode
    if obs_mode not in ("state", "pixels"):
        raise UserError(f"obs must be 'state' or 'pixels', got {obs_mode!r}")
    if policy.backbone not in ("mlp", "unet"):
        raise UserError(f"policy.backbone must be 'mlp' or 'unet', got {policy.backbone!r}")
    if policy.normalizer not in ("minmax", "meanstd"):
        raise UserError(f"policy.normalizer must be 'minmax' or 'meanstd', got {policy.normalizer!r}")
    from embodied_rl.policies.text import check_text_encoder

    check_text_encoder(policy.text_encoder)
    for key in ("n_obs_steps", "horizon", "n_action_steps", "num_inference_steps", "warmup_steps"):
        _positive(cfg, f"policy.{key}", allow_zero=key == "warmup_steps")
    if not float(policy.lr) > 0:
        raise UserError(f"policy.lr must be > 0, got {policy.lr}")


def build_policy(cfg: DictConfig, dataset: Any, obs_mode: str, task: str | None) -> Any:
    """The policy of cfg.policy with its normaliser fit on `dataset`."""
    from embodied_rl.data import fit_normalizer
    from embodied_rl.policies import make_policy

    p = cfg.policy
    specific = {k: OmegaConf.to_object(p[k]) if OmegaConf.is_config(p[k]) else p[k]
                for k in POLICY_SPECIFIC_KEYS if k in p}
    image_shape = list(dataset.pixels.shape[1:3]) if obs_mode == "pixels" else None
    try:
        return make_policy(
            p.name, obs_dim=dataset.obs.shape[1], action_dim=dataset.action.shape[1],
            normalizer=fit_normalizer(dataset, p.normalizer), n_obs_steps=p.n_obs_steps,
            horizon=p.horizon, n_action_steps=p.n_action_steps,
            num_inference_steps=p.num_inference_steps, backbone=p.backbone,
            backbone_kwargs=OmegaConf.to_container(p[p.backbone], resolve=True),
            obs_mode=obs_mode, image_shape=image_shape,
            vision_kwargs=OmegaConf.to_container(p.vision, resolve=True),
            normalizer_mode=p.normalizer, task=task,
            instructions=list(dataset.instructions) or None, text_encoder=p.text_encoder, **specific,
        )
    except ValueError as error:  # a bad combination of sizes, e.g. n_action_steps > horizon
        if isinstance(error, UserError):
            raise
        raise UserError(f"bad policy config: {error}") from None


def _headline_metrics(overall: dict[str, Any]) -> dict[str, Any]:
    metrics = {"avg_sum_reward": overall.get("avg_sum_reward")}
    if overall.get("success_rate") is not None:
        metrics["success_rate"] = overall["success_rate"]
    return metrics


def newest_resumable(root: Path) -> dict[str, Any] | None:
    """`read_training_state` of the newest checkpoint under `root` (checkpoints/last, then the
    numbered ones, newest first) that can be read; one that cannot is passed over with one line."""
    import sys

    from embodied_rl.algos.bc import read_training_state
    from embodied_rl.algos.common import UNREADABLE

    numbered = sorted((p for p in root.glob("*") if p.name.isdigit()), key=lambda p: -int(p.name))
    for path in [root / "last", *numbered]:
        if not (path / "training_state" / "state.json").is_file():
            continue
        try:
            return read_training_state(path)
        except UNREADABLE as error:
            reason = (str(error).strip().splitlines() or [""])[0][:200]
            print(f"warning: cannot resume from checkpoint '{path}' ({type(error).__name__}: {reason}); "
                  "trying the one before", file=sys.stderr, flush=True)
    return None


def main(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    from embodied_rl.lm import is_lm_task

    if is_lm_task(cfg):  # task=lm/<name>: a language model (embodied_rl/lm)
        from embodied_rl.lm import sft

        return sft.main(cfg)
    validate(cfg)
    import torch

    from embodied_rl.algos.bc import BCConfig, save_checkpoint, train_bc
    from embodied_rl.data import ChunkWindows, DemoDataset
    from embodied_rl.envs import task_overrides
    from embodied_rl.envs.registry import check_simulator, resolve_backend, task_class
    from embodied_rl.runs import start_run

    task = OmegaConf.select(cfg, "task.name", default=None)
    task_options = task_overrides(cfg.task)  # for the evaluation env
    if cfg.eval_episodes > 0:  # the evaluation env is made after training: its simulator is checked now
        check_simulator(task, task_options)
    dataset = DemoDataset.load(Path(str(cfg.data)).expanduser(), max_episodes=cfg.max_demos)
    data_task = dataset.attrs.get("task")
    if task and data_task and data_task != task:
        raise UserError(f"dataset '{cfg.data}' was collected on task '{data_task}' but task={task}; pass task={data_task}")
    obs_mode = cfg.obs if cfg.get("obs") is not None else cfg.policy.obs_mode
    if obs_mode == "pixels" and dataset.pixels is None:
        raise UserError(f"obs=pixels but dataset '{cfg.data}' has no pixels (collect it with pixels=true)")
    camera = dataset.attrs.get("camera")
    if obs_mode == "pixels" and task and camera and camera != task_class(task).camera:
        raise UserError(f"dataset '{cfg.data}' holds frames of camera '{camera}', not task {task}'s "
                        f"('{task_class(task).camera}'): a pixel policy learns from the camera it acts with")
    torch.manual_seed(int(cfg.seed))
    policy = build_policy(cfg, dataset, obs_mode, task)
    windows = ChunkWindows(dataset, policy.n_obs_steps, policy.horizon, obs_mode=obs_mode)
    steps = int(cfg.steps)
    bc_config = BCConfig(
        steps=steps, batch_size=cfg.batch_size, lr=float(cfg.policy.lr),
        weight_decay=float(cfg.policy.weight_decay), warmup_steps=min(cfg.policy.warmup_steps, steps),
        ema_power=float(cfg.policy.ema_power), log_every=cfg.log_every, eval_every=cfg.eval_every,
        seed=int(cfg.seed),
    )
    from embodied_rl import distributed
    from embodied_rl.runs import check_previous_run

    distributed.check_on_main(lambda: check_previous_run(cfg, "pretrain", RESUME_MAY_CHANGE))
    run = start_run(cfg, "pretrain", allow_existing=True)
    resume = newest_resumable(run.file("checkpoints"))
    if resume is not None and distributed.is_main():
        print(f"resuming from step {resume['step']} of {steps}")
    # the steps after the checkpoint are redone; a run stopped before its first checkpoint starts over
    run.forget_metrics_after(resume["step"] if resume is not None else -1)

    env = None
    final_eval: dict[str, Any] = {}

    def evaluate_fn(ema_policy: Any, step: int) -> dict[str, Any]:
        nonlocal env, final_eval
        if cfg.eval_episodes == 0:
            return {}
        import embodied_rl.envs as envs
        from embodied_rl.eval.evaluate import evaluate
        from embodied_rl.policies import PolicyRunner

        num_envs = min(cfg.num_envs, cfg.eval_episodes)
        if env is None:
            options = {"obs_mode": obs_mode}
            if obs_mode == "pixels":
                options["image_size"] = int(dataset.pixels.shape[1])
            env = envs.make(task, num_envs=num_envs, backend=cfg.backend, device=cfg.device,
                            seed=int(cfg.seed), task_options=task_options, **options)
        last = step == steps
        videos = cfg.videos if last else 0
        info = evaluate(env, PolicyRunner(ema_policy, num_envs, seed=int(cfg.seed)),
                        cfg.eval_episodes, seed=int(cfg.seed), videos=videos,
                        video_dir=run.file("videos") if videos else None)
        if last:
            final_eval = info
        return _headline_metrics(info["overall"])

    def checkpoint_fn(ema_policy: Any, raw_policy: Any, optimizer: Any, step: int, rng: dict[str, Any]) -> None:
        extra = {"dataset": str(dataset.path), "steps": steps}
        save_checkpoint(run.file("checkpoints", str(step)), ema_policy, raw_policy, optimizer, step, extra, rng)
        save_checkpoint(run.file("checkpoints", "last"), ema_policy, raw_policy, optimizer, step, extra, rng)

    try:
        result = train_bc(policy, windows, bc_config, run=run, evaluate_fn=evaluate_fn,
                          checkpoint_fn=checkpoint_fn, resume=resume)
    finally:
        if env is not None:
            env.close()
        run.close()

    headline: dict[str, Any] = {"task": task, "policy": cfg.policy.name, "steps": steps,
                                "final_loss": result["final_loss"], "train_s": result["train_s"]}
    if final_eval:
        for episode in final_eval["per_episode"]:
            if episode.get("video"):
                episode["video"] = Path(episode["video"]).relative_to(run.path).as_posix()
        checkpoint = run.file("checkpoints", "last")
        run.write_json("eval_info.json", {
            "task": task, "checkpoint": str(checkpoint.resolve()), "seed": int(cfg.seed),
            "backend": resolve_backend(task, cfg.backend), "device": str(cfg.device), "step": steps, **final_eval,
            "config": OmegaConf.to_container(cfg, resolve=True),
        })
        from embodied_rl.eval.evaluate import success_text

        overall = final_eval["overall"]
        if overall.get("success_rate") is not None:
            headline["success"] = success_text(overall)
        headline["avg_sum_reward"] = overall["avg_sum_reward"]
    headline["checkpoint"] = str(run.file("checkpoints", "last"))
    return headline, run.path
