"""Evaluation: success rates with confidence intervals, per-episode records, videos, reports."""

from embodied_rl.eval.evaluate import evaluate, format_headline, round_seed, run_round, summarize
from embodied_rl.eval.stats import mean_interval, wilson_interval

__all__ = [
    "evaluate",
    "format_headline",
    "mean_interval",
    "round_seed",
    "run_round",
    "summarize",
    "wilson_interval",
]
