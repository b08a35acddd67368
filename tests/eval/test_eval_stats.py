"""Confidence intervals against hand-computed and table values."""

import math

import pytest

from embodied_rl.eval.stats import mean_interval, t_quantile, wilson_interval


@pytest.mark.parametrize(
    "successes,n,low,high",
    [
        # z = 1.96, z^2/n = 0.38416: center = (p + 0.19208) / 1.38416,
        # half = 1.96 * sqrt(p(1-p)/10 + 0.009604) / 1.38416
        (0, 10, 0.0, 0.27754),
        (10, 10, 0.72246, 1.0),
        (5, 10, 0.23659, 0.76341),
        (1, 1, 0.20654, 1.0),
    ],
)
def test_wilson_hand_computed(successes, n, low, high):
    got_low, got_high = wilson_interval(successes, n)
    assert got_low == pytest.approx(low, abs=1e-5)
    assert got_high == pytest.approx(high, abs=1e-5)


def test_wilson_is_symmetric_and_narrows_with_n():
    low, high = wilson_interval(3, 10)
    mirror_low, mirror_high = wilson_interval(7, 10)
    assert low == pytest.approx(1 - mirror_high) and high == pytest.approx(1 - mirror_low)
    assert (wilson_interval(50, 100)[1] - wilson_interval(50, 100)[0]) < (high - low)


@pytest.mark.parametrize("successes,n", [(1, 0), (-1, 10), (11, 10)])
def test_wilson_rejects_bad_counts(successes, n):
    with pytest.raises(ValueError):
        wilson_interval(successes, n)


@pytest.mark.parametrize(
    "df,value", [(1, 12.706), (2, 4.303), (3, 3.182), (5, 2.571), (9, 2.262), (29, 2.045), (1000, 1.962)]
)
def test_t_quantile_matches_tables(df, value):
    assert t_quantile(0.975, df) == pytest.approx(value, abs=5e-3)


def test_mean_interval_hand_computed():
    stats = mean_interval([1.0, 2.0, 3.0])
    assert stats["mean"] == 2.0
    assert stats["std"] == pytest.approx(1.0)
    half = 4.303 / math.sqrt(3)  # t(0.975, 2) * std / sqrt(n)
    assert stats["ci_low"] == pytest.approx(2.0 - half, abs=1e-3)
    assert stats["ci_high"] == pytest.approx(2.0 + half, abs=1e-3)


def test_mean_interval_edge_cases():
    assert mean_interval([4.0]) == {"mean": 4.0, "std": None, "ci_low": None, "ci_high": None}
    constant = mean_interval([2.0, 2.0, 2.0])
    assert constant["ci_low"] == constant["ci_high"] == 2.0
    with pytest.raises(ValueError):
        mean_interval([])
