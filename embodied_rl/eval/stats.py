"""Confidence intervals for evaluation numbers: success rates and mean returns.

Pure Python (no scipy): a success rate gets the Wilson score interval, a mean gets a Student-t
interval. Both are what a reader expects next to "62% success over 50 episodes".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% for z=1.96).

    Unlike the normal ("Wald") interval it stays inside [0, 1] and is not empty at 0/n or n/n:
    0/10 successes gives [0, 0.278], not [0, 0].
    """
    if n <= 0:
        raise ValueError(f"wilson_interval needs n >= 1 trials, got n={n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n={n}], got {successes}")
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half_width = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # Clamp rounding noise at the ends (0/n must give exactly 0, n/n exactly 1).
    low = 0.0 if successes == 0 else max(0.0, center - half_width)
    high = 1.0 if successes == n else min(1.0, center + half_width)
    return low, high


def t_quantile(p: float, df: int) -> float:
    """Quantile of Student's t distribution with `df` degrees of freedom.

    Exact for df = 1 and 2; for df >= 3 the Cornish-Fisher expansion around the normal quantile
    (Abramowitz & Stegun 26.7.5), which is within 0.01 of the table value at the 97.5% point.
    """
    if df < 1:
        raise ValueError(f"t_quantile needs df >= 1, got {df}")
    if not 0 < p < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1, got {p}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> dict[str, float | None]:
    """Mean, sample standard deviation and the Student-t confidence interval of the mean.

    Returns {"mean", "std", "ci_low", "ci_high"}; with one value the std and interval are None
    (undefined), never NaN, so the result is valid JSON.
    """
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval needs at least one value")
    mean = math.fsum(values) / n
    if n == 1:
        return {"mean": mean, "std": None, "ci_low": None, "ci_high": None}
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half_width = t_quantile(0.5 + confidence / 2, n - 1) * std / math.sqrt(n)
    return {"mean": mean, "std": std, "ci_low": mean - half_width, "ci_high": mean + half_width}


def rate_with_interval(rate: float, interval: Sequence[float]) -> str:
    """A rate as every command's headline prints it: '36.0% [27.3, 45.8]' (percent, then its
    95% interval in percent)."""
    low, high = interval
    return f"{100 * rate:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"


def before_after(after: str, before: str | None = None) -> str:
    """'36.0% [27.3, 45.8] -> 99.0% [94.6, 99.8]' where there is a before, else `after` alone."""
    return after if before is None else f"{before} -> {after}"


def start_rate(rows: Sequence[dict], key: str) -> str | None:
    """The rate a run's metrics rows logged at step 0 (the starting policy's evaluation) under
    `key`, with its interval (`key`_low, `key`_high), as headlines print it; None if not logged."""
    for row in rows:
        if row.get("step") == 0 and all(k in row for k in (key, f"{key}_low", f"{key}_high")):
            return rate_with_interval(row[key], (row[f"{key}_low"], row[f"{key}_high"]))
    return None

