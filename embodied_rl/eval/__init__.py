"""Evaluation: success rates with confidence intervals, per-episode records, videos, reports."""

from embodied_rl.eval.evaluate import evaluate, round_seed, run_round, success_text, summarize
from embodied_rl.eval.stats import mean_interval, wilson_interval

__all__ = [
    "evaluate",
    "mean_interval",
    "round_seed",
    "run_round",
    "success_text",
    "summarize",
    "wilson_interval",
]
