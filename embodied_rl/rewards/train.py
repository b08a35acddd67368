"""Training a reward model on labelled reached states (rewards/data.py), and scoring it on
held-out episodes (rewards/metrics.py).

    train, held_out = split_episodes(samples, val_fraction, seed)
    scores = train_reward_model(model, train, held_out, config, run)   # logs train/* and val/*

One network learns both outputs: binary cross-entropy of the success logit against the
simulator's success, plus `progress_weight` x the squared error of the progress head where a
progress label exists. Success states are rare (one per successful episode when success ends
it), so `positive_fraction` of every batch is drawn from them and the rest uniformly; the
held-out scores are measured on the episodes as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from embodied_rl.errors import Diverged, UserError
from embodied_rl.rewards.data import RewardSamples
from embodied_rl.rewards.metrics import (
    precision_recall_at,
    roc_auc,
    spearman,
    value_order_correlation,
)
from embodied_rl.runs import progress as progress_bar


@dataclass(frozen=True)
class RewardTrainConfig:
    steps: int
    batch_size: int
    lr: float
    weight_decay: float
    positive_fraction: float
    progress_weight: float
    threshold: float  # the operating threshold the held-out precision and recall are measured at
    log_every: int
    eval_every: int | None  # None: at the end only
    seed: int


def split_episodes(samples: RewardSamples, val_fraction: float, seed: int) -> tuple[RewardSamples, RewardSamples]:
    """(train, held out) by whole episodes, `val_fraction` of the successful and of the failed
    ones each (at least one of a kind that has two or more), so both splits see both outcomes."""
    rng = np.random.default_rng(seed)
    episodes = np.unique(samples.episode)
    succeeded = np.isin(episodes, np.unique(samples.episode[samples.success]))
    held_out = []
    for group in (episodes[succeeded], episodes[~succeeded]):
        count = round(val_fraction * len(group))
        count = max(count, 1) if len(group) >= 2 else 0
        held_out.extend(rng.permutation(group)[:count].tolist())
    in_held_out = np.isin(samples.episode, held_out)
    return samples.subset(np.flatnonzero(~in_held_out)), samples.subset(np.flatnonzero(in_held_out))


def _batch(samples: RewardSamples, rows: np.ndarray, device: torch.device) -> tuple[torch.Tensor, ...]:
    instruction = None if samples.instruction is None else torch.from_numpy(samples.instruction[rows]).to(device)
    return (torch.from_numpy(samples.frames[rows]).to(device), torch.from_numpy(samples.state[rows]).to(device),
            instruction)


@torch.no_grad()
def predict(model: Any, samples: RewardSamples, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """(success probability [S], progress [S]) of every sample, in eval mode."""
    device = model.state_mean.device
    probs, progress = [], []
    for start in range(0, len(samples), batch_size):
        judged = model.judge(*_batch(samples, np.arange(start, min(start + batch_size, len(samples))), device))
        probs.append(judged.success_prob.cpu().numpy())
        progress.append(judged.progress.cpu().numpy())
    return np.concatenate(probs), np.concatenate(progress)


def fires(success_prob: np.ndarray, threshold: float, hold_steps: int = 1) -> bool:
    """Does the learned success fire in this episode (success_prob in step order): at or above
    `threshold` on `hold_steps` consecutive steps (finetune's learned_reward keys)?"""
    above = (success_prob >= threshold).astype(int)
    return bool((np.convolve(above, np.ones(hold_steps, dtype=int), "valid") >= hold_steps).any())


def episode_firing(success_prob: np.ndarray, samples: RewardSamples, threshold: float,
                   hold_steps: tuple[int, ...]) -> dict[str, tuple[float | None, float | None]]:
    """Per hold k (1 always included): (share of successful episodes in which the learned success
    fires, share of failed ones). An episode's rows are in step order (as reward_samples gives them)."""
    episodes = np.unique(samples.episode)
    succeeded = np.isin(episodes, np.unique(samples.episode[samples.success]))
    probs = [success_prob[samples.episode == e] for e in episodes]
    rates = {}
    for hold in sorted({1, *hold_steps}):
        fired = np.array([fires(p, threshold, hold) for p in probs])
        rates[str(hold)] = (float(fired[succeeded].mean()) if succeeded.any() else None,
                            float(fired[~succeeded].mean()) if (~succeeded).any() else None)
    return rates


def score_reward_model(model: Any, samples: RewardSamples, threshold: float,
                       hold_steps: tuple[int, ...] = (1, 2, 3)) -> dict[str, Any]:
    """Held-out scores: ROC-AUC of the success probability, precision and recall at `threshold`
    per state, and per episode the share of successful ones in which it fires (episode_recall)
    and of failed ones (episode_false_positive_rate: a learner would be paid for those), also for
    each of `hold_steps` consecutive steps ("..._by_hold"); VOC of the predicted progress along
    the successful episodes up to their success, and the Spearman correlation of predicted and
    labelled progress."""
    success_prob, progress = predict(model, samples)
    precision, recall = precision_recall_at(success_prob, samples.success, threshold)
    # the successful episodes, up to and including their first success
    first = {e: samples.time[(samples.episode == e) & samples.success].min()
             for e in np.unique(samples.episode[samples.success])}
    along = np.array([e in first and t <= first[e] for e, t in zip(samples.episode, samples.time)], dtype=bool)
    labelled = np.isfinite(samples.progress)
    # what a learner meets: does the learned success fire somewhere in an episode (it ends there)?
    by_hold = episode_firing(success_prob, samples, threshold, hold_steps)
    return {
        "roc_auc": roc_auc(success_prob, samples.success),
        "precision_at_threshold": precision,
        "recall_at_threshold": recall,
        "episode_recall": by_hold["1"][0],
        "episode_false_positive_rate": by_hold["1"][1],
        "episode_recall_by_hold": {hold: rates[0] for hold, rates in by_hold.items()},
        "episode_false_positive_rate_by_hold": {hold: rates[1] for hold, rates in by_hold.items()},
        "threshold": threshold,
        "voc": value_order_correlation(progress[along], samples.time[along], samples.episode[along]),
        "progress_spearman": spearman(progress[labelled], samples.progress[labelled]) if labelled.any() else None,
        "states": len(samples),
        "success_states": int(samples.success.sum()),
        "episodes": int(len(np.unique(samples.episode))),
        "successful_episodes": len(first),
    }


def train_reward_model(model: Any, train: RewardSamples, held_out: RewardSamples, config: RewardTrainConfig,
                       run: Any) -> dict[str, Any]:
    """Train `model` on `train`; log train/* every log_every steps and the held-out scores
    (val/*) every eval_every steps and at the end; return the final held-out scores."""
    positives = np.flatnonzero(train.success)
    if len(positives) == 0:
        raise UserError("the training episodes never reach success: a success classifier needs success states "
                        "(collect more episodes, or from a better checkpoint)")
    rng = np.random.default_rng(config.seed)
    torch.manual_seed(config.seed)
    device = model.state_mean.device
    if model.use_state:  # the state enters the head normalised by the training data's statistics
        model.state_mean.copy_(torch.from_numpy(train.state.mean(axis=0)))
        model.state_std.copy_(torch.from_numpy(train.state.std(axis=0)).clamp_min(1e-3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    labels = torch.from_numpy(train.success.astype(np.float32))
    targets = torch.from_numpy(train.progress)
    num_positive = max(1, round(config.positive_fraction * config.batch_size))
    bar = progress_bar(total=config.steps, desc="train-reward")
    scores: dict[str, Any] = {}
    model.train()
    for step in range(1, config.steps + 1):
        rows = np.concatenate([rng.choice(positives, num_positive),
                               rng.integers(len(train), size=config.batch_size - num_positive)])
        success_logit, progress = model(*_batch(train, rows, device))
        success_loss = F.binary_cross_entropy_with_logits(success_logit, labels[rows].to(device))
        target = targets[rows].to(device)
        labelled = torch.isfinite(target)
        progress_loss = ((progress - target)[labelled] ** 2).mean() if bool(labelled.any()) else progress.sum() * 0
        loss = success_loss + config.progress_weight * progress_loss
        if not math.isfinite(float(loss.detach())):
            run.log(step, {"train/loss": loss})
            raise Diverged(f"training diverged at step {step}: train/loss is not finite (no reward model was written)")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        bar.update(1)
        if step % config.log_every == 0 or step == config.steps:
            run.log(step, {"train/loss": loss, "train/success_loss": success_loss, "train/progress_loss": progress_loss})
            bar.set_postfix(loss=f"{loss.item():.4f}")
        if step == config.steps or (config.eval_every and step % config.eval_every == 0):
            scores = score_reward_model(model, held_out, config.threshold)
            run.log(step, {f"val/{key}": value for key, value in scores.items() if key != "threshold"})
            model.train()
    bar.close()
    model.eval()
    return scores
