"""`embodied-rl train-reward task=T data=DATASET [demos=DATASET] [kind=cnn|cnn_film] [progress=milestones|time|none] ...`

Trains a reward model (docs/rewards.md) on a dataset that `collect pixels=true` wrote (a
checkpoint's rollouts with `checkpoint=PATH`: successes and failures, the true success per step)
and scores it on held-out episodes. The run directory holds:
    reward_model/      config.json + model.safetensors: `finetune reward=model:<run_dir>` reads it
    reward_info.json   the held-out scores (rewards/train.py: score_reward_model): ROC-AUC of
                       the success probability, precision and recall at the operating
                       threshold per state and per episode, VOC (value-order correlation of the
                       predicted progress with time along successful episodes), the progress
                       labels' Spearman correlation; the dataset and the episodes held out
    plots/reward_model.png   ROC curve, success probability and progress along held-out episodes
    metrics.jsonl, tb/  train/* losses every log_every steps, val/* scores every eval_every
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from embodied_rl.errors import UserError


def _number(cfg: DictConfig, key: str, low: float, high: float | None = None, low_open: bool = False) -> float:
    value = cfg[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UserError(f"{key} must be a number, got {value!r}")
    if value < low or (low_open and value == low) or (high is not None and value >= high):
        bounds = f"{'(' if low_open else '['}{low:g}, {'1)' if high is not None else 'inf)'}"
        raise UserError(f"{key} must be in {bounds}, got {value}")
    return float(value)


def validate(cfg: DictConfig) -> None:
    """Check the config before any work."""
    from embodied_rl.commands import _integer, validate_common
    from embodied_rl.policies.text import check_text_encoder
    from embodied_rl.rewards import REWARD_MODELS
    from embodied_rl.rewards.data import AFTER_SUCCESS, PROGRESS_LABELS

    if cfg.get("data") in (None, ""):
        raise UserError("data=PATH is required (a dataset from `embodied-rl collect pixels=true`)")
    validate_common(cfg)
    if not Path(str(cfg.data)).expanduser().exists():
        raise UserError(f"dataset '{cfg.data}' does not exist")
    if cfg.demos is not None and not Path(str(cfg.demos)).expanduser().exists():
        raise UserError(f"demos dataset '{cfg.demos}' does not exist")
    for key in ("steps", "batch_size", "log_every", "pause_steps", "feature_dim", "hidden_dim"):
        _integer(cfg, key, 1)
    if cfg.eval_every is not None:
        _integer(cfg, "eval_every", 1)
    if not cfg.channels or not all(isinstance(c, int) and c >= 8 and c % 8 == 0 for c in cfg.channels):
        raise UserError(f"channels must be a list of multiples of 8 (GroupNorm groups), got {list(cfg.channels)}")
    _number(cfg, "lr", 0.0, low_open=True)
    _number(cfg, "weight_decay", 0.0)
    _number(cfg, "progress_weight", 0.0)
    _number(cfg, "pause_speed", 0.0, low_open=True)
    for key in ("positive_fraction", "val_fraction", "threshold"):
        _number(cfg, key, 0.0, 1.0, low_open=True)
    if cfg.kind != "auto" and cfg.kind not in REWARD_MODELS:
        raise UserError(f"kind must be auto or one of {', '.join(REWARD_MODELS)}, got '{cfg.kind}'")
    if cfg.progress != "auto" and cfg.progress not in PROGRESS_LABELS:
        raise UserError(f"progress must be auto or one of {', '.join(PROGRESS_LABELS)}, got '{cfg.progress}'")
    if cfg.after_success not in AFTER_SUCCESS:
        raise UserError(f"after_success must be one of {', '.join(AFTER_SUCCESS)}, got {cfg.after_success!r}")
    if not isinstance(cfg.use_state, bool) and cfg.use_state != "auto":
        raise UserError(f"use_state must be auto, true or false, got {cfg.use_state!r}")
    check_text_encoder(cfg.text_encoder)


def main(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    validate(cfg)
    import torch

    from embodied_rl.data import DemoDataset
    from embodied_rl.envs.registry import task_class
    from embodied_rl.rewards import make_reward_model, save_reward_model
    from embodied_rl.rewards.data import (
        concatenate_samples,
        reward_samples,
        through_first_success_run,
    )
    from embodied_rl.rewards.model import CHECKPOINT_DIR
    from embodied_rl.rewards.plots import plot_held_out
    from embodied_rl.rewards.train import (
        RewardTrainConfig,
        predict,
        split_episodes,
        train_reward_model,
    )
    from embodied_rl.runs import start_run

    dataset = DemoDataset.load(Path(str(cfg.data)).expanduser())
    task_name = cfg.task.name
    if dataset.attrs.get("task") != task_name:
        raise UserError(f"dataset '{cfg.data}' was collected on task '{dataset.attrs.get('task')}' but "
                        f"task={task_name}; pass task={dataset.attrs.get('task')}")
    task = task_class(task_name)
    camera = dataset.attrs.get("camera") or task.camera  # datasets from before collect recorded it: the task's
    kind = cfg.kind if cfg.kind != "auto" else ("cnn_film" if dataset.instructions else "cnn")
    progress = cfg.progress if cfg.progress != "auto" else ("milestones" if task.effector_obs else "time")
    use_state = cfg.use_state if cfg.use_state != "auto" else task.proprioceptive_state

    def labelled(data: DemoDataset):
        return reward_samples(data, progress, task.effector_obs, task.gripper_obs, float(cfg.pause_speed),
                              int(cfg.pause_steps))

    samples = labelled(dataset)
    if not samples.success.any() or samples.success.all():
        raise UserError(f"dataset '{cfg.data}' has {'no' if not samples.success.any() else 'only'} success states; "
                        "a success classifier needs both (record a checkpoint's rollouts: collect checkpoint=PATH)")
    train, held_out = split_episodes(samples, float(cfg.val_fraction), int(cfg.seed))
    if len(held_out) == 0:
        raise UserError(f"dataset '{cfg.data}' has too few episodes to hold some out ({dataset.num_episodes})")
    if cfg.demos is not None:
        demos = DemoDataset.load(Path(str(cfg.demos)).expanduser())
        if demos.attrs.get("task") != task_name:
            raise UserError(f"demos dataset '{cfg.demos}' was collected on task '{demos.attrs.get('task')}', "
                            f"data= on '{task_name}'")
        if demos.instructions != dataset.instructions:
            raise UserError(f"demos dataset '{cfg.demos}' has other instructions than data=")
        if (demos.attrs.get("camera") or task.camera) != camera:
            raise UserError(f"demos dataset '{cfg.demos}' holds frames of camera '{demos.attrs.get('camera') or task.camera}', "
                            f"data= of '{camera}': collect both with one camera=")
        demo_samples = labelled(demos)
        if demo_samples.frames.shape[1:] != samples.frames.shape[1:]:
            raise UserError(f"demos dataset '{cfg.demos}' has {demo_samples.frames.shape[1]}x"
                            f"{demo_samples.frames.shape[2]} frames, data= {samples.frames.shape[1]}x"
                            f"{samples.frames.shape[2]}: collect both at one image_size")
        train = concatenate_samples([train, demo_samples])  # training only: the scores stay on data='s episodes
    if cfg.after_success == "first_run":  # training only: the held-out scores see the episodes as they are
        train = through_first_success_run(train)
    torch.manual_seed(int(cfg.seed))
    model = make_reward_model(
        kind, task=task_name, image_size=int(samples.frames.shape[1]), obs_dim=int(samples.state.shape[1]),
        camera=camera, instructions=dataset.instructions or None, text_encoder=cfg.text_encoder, use_state=use_state,
        channels=list(cfg.channels), feature_dim=int(cfg.feature_dim), hidden_dim=int(cfg.hidden_dim),
        progress_labels=progress,
    ).to(cfg.device)
    config = RewardTrainConfig(
        steps=int(cfg.steps), batch_size=int(cfg.batch_size), lr=float(cfg.lr), weight_decay=float(cfg.weight_decay),
        positive_fraction=float(cfg.positive_fraction), progress_weight=float(cfg.progress_weight),
        threshold=float(cfg.threshold), log_every=int(cfg.log_every),
        eval_every=None if cfg.eval_every is None else int(cfg.eval_every), seed=int(cfg.seed),
    )

    run = start_run(cfg, "train-reward")
    try:
        scores = train_reward_model(model, train, held_out, config, run)
        info = {"task": task_name, "camera": camera, "dataset": str(dataset.path), "kind": kind,
                "progress_labels": progress,
                "use_state": use_state,
                "held_out": scores, "held_out_episodes": sorted(set(held_out.episode.tolist())),
                "demos": None if cfg.demos is None else str(cfg.demos),
                "after_success": str(cfg.after_success),
                "train": {"states": len(train), "success_states": int(train.success.sum())},
                "config": OmegaConf.to_container(cfg, resolve=True)}
        checkpoint = save_reward_model(model, run.file(CHECKPOINT_DIR),
                                       extra={"dataset": str(dataset.path), "held_out": scores})
        run.write_json("reward_info.json", info)
        plot_held_out(held_out, *predict(model, held_out), config.threshold, run.file("plots", "reward_model.png"))
    finally:
        run.close()
    headline: dict[str, Any] = {"task": task_name, "camera": camera, "kind": kind, "progress_labels": progress, "use_state": use_state}
    for key in ("roc_auc", "precision_at_threshold", "recall_at_threshold", "episode_recall",
                "episode_false_positive_rate", "voc"):
        headline[f"held_out_{key}"] = scores[key] if scores[key] is not None else "n/a"
    headline["reward_model"] = str(checkpoint)
    return headline, run.path
