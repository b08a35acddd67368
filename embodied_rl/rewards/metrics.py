"""How good a reward model is, on held-out episodes: pure numpy functions.

- `roc_auc(scores, labels)`: the probability that a success state scores above a non-success
  one (ties count half): the Mann-Whitney U statistic over average ranks.
- `roc_curve(scores, labels)`: the (false positive rate, true positive rate) points of that curve.
- `precision_recall_at(scores, labels, threshold)`: at the operating threshold (finetune's
  learned success fires where the probability is >= it), the share of fired states that are
  true successes (what keeps a learner from being paid for failures) and of true successes that
  fire.
- `spearman(x, y)`: Pearson's correlation of the average ranks.
- `value_order_correlation(progress, time, episode)` (VOC, as in GVL): the mean over episodes of
  the Spearman correlation between predicted progress and time; train-reward reports it over
  the successful held-out episodes up to their success, along which the true progress rises
  with time.
"""

from __future__ import annotations

import numpy as np


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n of `values`, tied values sharing the mean of their ranks."""
    values = np.asarray(values, dtype=np.float64)
    ranks = np.empty(len(values))
    ranks[np.argsort(values, kind="mergesort")] = np.arange(1, len(values) + 1)
    _, tie_group, tie_count = np.unique(values, return_inverse=True, return_counts=True)
    return (np.bincount(tie_group, weights=ranks) / tie_count)[tie_group]


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """ROC-AUC of `scores` for the boolean `labels`; None without both classes."""
    labels = np.asarray(labels, dtype=bool)
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return None
    rank_sum = average_ranks(scores)[labels].sum()
    return float((rank_sum - positives * (positives + 1) / 2) / (positives * negatives))


def roc_curve(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(false positive rates, true positive rates) from the highest threshold down, from (0, 0)."""
    labels = np.asarray(labels, dtype=bool)
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="mergesort")
    distinct = np.r_[np.flatnonzero(np.diff(np.asarray(scores)[order])), len(order) - 1]  # last of each tie
    true_positives = np.cumsum(labels[order])[distinct]
    false_positives = (distinct + 1) - true_positives
    return (np.r_[0.0, false_positives / max(1, int((~labels).sum()))],
            np.r_[0.0, true_positives / max(1, int(labels.sum()))])


def precision_recall_at(scores: np.ndarray, labels: np.ndarray, threshold: float) -> tuple[float | None, float | None]:
    """(precision, recall) of `scores >= threshold`; None where the denominator is 0."""
    labels = np.asarray(labels, dtype=bool)
    fired = np.asarray(scores) >= threshold
    hits = int((fired & labels).sum())
    precision = hits / int(fired.sum()) if fired.any() else None
    recall = hits / int(labels.sum()) if labels.any() else None
    return precision, recall


def spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    """Spearman's rank correlation; None when either side is constant or has < 2 values."""
    if len(x) < 2:
        return None
    rx, ry = average_ranks(x), average_ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def value_order_correlation(progress: np.ndarray, time: np.ndarray, episode: np.ndarray) -> float | None:
    """Mean over episodes of spearman(progress, time); None when no episode gives one."""
    values = [spearman(progress[episode == e], time[episode == e]) for e in np.unique(episode)]
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None
