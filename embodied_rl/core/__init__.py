"""Advantage estimators and RL losses: pure torch functions on masked tensors.

One call serves env rollouts ([T, N], time-major) and token sequences ([B, L], right-padded).
Semantics follow verl's core_algos; docs/core.md lists every function, constant and convention.
"""

from .advantages import discounted_returns, gae, group_advantages, masked_gae, masked_whiten
from .losses import agg_loss, entropy_from_logits, kl_penalty, policy_loss, value_loss

__all__ = [
    "agg_loss",
    "discounted_returns",
    "entropy_from_logits",
    "gae",
    "group_advantages",
    "kl_penalty",
    "masked_gae",
    "masked_whiten",
    "policy_loss",
    "value_loss",
]
