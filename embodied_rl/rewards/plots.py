"""train-reward's figure: what the reward model says about the held-out episodes."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from embodied_rl.rewards.data import RewardSamples
from embodied_rl.rewards.metrics import roc_curve
from embodied_rl.runs import atomic_write_bytes

EPISODES_SHOWN = 12


def plot_held_out(samples: RewardSamples, success_prob: np.ndarray, progress: np.ndarray, threshold: float,
                  path: str | Path) -> Path:
    """Three panels: the ROC curve of the success probability; the success probability along up
    to 12 held-out episodes (green: the episode succeeded; the dashed line is the threshold); the
    predicted progress along successful ones (dashed: their labels) against the share of the
    episode done."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (roc, along, climb) = plt.subplots(1, 3, figsize=(15, 4), dpi=100)
    fpr, tpr = roc_curve(success_prob, samples.success)
    roc.plot(fpr, tpr)
    roc.plot([0, 1], [0, 1], color="grey", linestyle=":")
    roc.set(xlabel="false positive rate", ylabel="true positive rate", title="held-out ROC (success)")
    episodes = np.unique(samples.episode)[:EPISODES_SHOWN]
    for episode in episodes:
        rows = samples.episode == episode
        succeeded = bool(samples.success[rows].any())
        along.plot(samples.time[rows], success_prob[rows], color="tab:green" if succeeded else "tab:red", alpha=0.7)
        if succeeded:
            share = (samples.time[rows] + 1) / rows.sum()
            line, = climb.plot(share, progress[rows], alpha=0.8)
            climb.plot(share, samples.progress[rows], color=line.get_color(), linestyle="--", alpha=0.5)
    along.axhline(threshold, color="grey", linestyle="--")
    along.set(xlabel="step", ylabel="success probability", ylim=(-0.02, 1.02),
              title="success probability (green: successful episode)")
    climb.set(xlabel="share of the episode", ylabel="progress", ylim=(-0.02, 1.02),
              title="progress of successful episodes (dashed: label)")
    for axes in (roc, along, climb):
        axes.grid(alpha=0.3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    path = Path(path)
    atomic_write_bytes(path, buffer.getvalue())
    return path
