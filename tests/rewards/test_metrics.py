"""The held-out scores of a reward model: ROC-AUC, precision/recall at a threshold, Spearman, VOC."""

import numpy as np
import pytest

from embodied_rl.rewards.metrics import (
    average_ranks,
    precision_recall_at,
    roc_auc,
    roc_curve,
    spearman,
    value_order_correlation,
)


def test_average_ranks_share_ties():
    assert average_ranks(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]


def test_roc_auc_counts_pairs_ranked_right_ties_half():
    labels = np.array([True, True, False, False])
    assert roc_auc(np.array([0.9, 0.8, 0.1, 0.2]), labels) == 1.0
    assert roc_auc(np.array([0.1, 0.2, 0.9, 0.8]), labels) == 0.0
    assert roc_auc(np.array([0.5, 0.5, 0.5, 0.5]), labels) == 0.5
    # positives 0.9 and 0.3 against negatives 0.5 and 0.1: 3 of 4 pairs right
    assert roc_auc(np.array([0.9, 0.3, 0.5, 0.1]), labels) == 0.75
    assert roc_auc(np.array([0.9, 0.3]), np.array([True, True])) is None  # one class only


def test_roc_auc_matches_the_area_under_roc_curve():
    rng = np.random.default_rng(0)
    labels = rng.random(200) < 0.3
    scores = np.round(rng.random(200) + labels * 0.5, 1)  # rounded: many ties
    fpr, tpr = roc_curve(scores, labels)
    assert (fpr[0], tpr[0]) == (0.0, 0.0) and (fpr[-1], tpr[-1]) == (1.0, 1.0)
    assert np.trapezoid(tpr, fpr) == pytest.approx(roc_auc(scores, labels))


def test_precision_and_recall_at_the_threshold():
    scores = np.array([0.99, 0.96, 0.95, 0.5, 0.97])
    labels = np.array([True, False, True, True, False])
    precision, recall = precision_recall_at(scores, labels, 0.95)  # fires on 0, 1, 2, 4
    assert precision == pytest.approx(2 / 4) and recall == pytest.approx(2 / 3)
    assert precision_recall_at(scores, labels, 0.999) == (None, 0.0)  # nothing fires


def test_spearman_and_value_order_correlation():
    time = np.arange(5)
    assert spearman(np.array([0.1, 0.2, 0.25, 0.9, 1.0]), time) == pytest.approx(1.0)
    assert spearman(np.array([1.0, 0.8, 0.5, 0.2, 0.0]), time) == pytest.approx(-1.0)
    assert spearman(np.ones(5), time) is None
    # two episodes: one in order (1.0), one reversed (-1.0); a one-step episode gives none
    progress = np.array([0.1, 0.5, 0.9, 0.9, 0.5, 0.1, 0.3])
    times = np.array([0, 1, 2, 0, 1, 2, 0])
    episodes = np.array([0, 0, 0, 1, 1, 1, 2])
    assert value_order_correlation(progress, times, episodes) == pytest.approx(0.0)
    assert value_order_correlation(progress[:3], times[:3], episodes[:3]) == pytest.approx(1.0)
