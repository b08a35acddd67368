"""Policy, value and KL losses, and the aggregation that turns a loss matrix into a scalar.

Every loss takes a `mask` (1 on positions that count, bool or float) of the same shape as its
inputs: [B, L] for token sequences, [T, N] or a flat minibatch [M] for env rollouts.
Semantics follow verl's `core_algos` (see docs/core.md).
"""

from __future__ import annotations

import torch

from .advantages import _check_same_shape

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KL_KINDS = ("k1", "k2", "k3", "abs", "k1+", "k3+")

# exp() of a log-ratio beyond +-20 overflows float16 and is meaningless anyway (verl's bound).
LOG_RATIO_CLAMP = 20.0
# The k3 estimator is bounded to keep one wild token from dominating the penalty (verl's bound).
K3_CLAMP = 10.0


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a loss matrix to a scalar over the positions where `mask` is set.

    - "token-mean": sum over valid positions / number of valid positions.
    - "token-sum": sum over valid positions.
    - "seq-mean-token-sum": per row, sum over its valid positions; mean over rows.
    - "seq-mean-token-mean": per row, mean over its valid positions; mean over rows.
    - "seq-mean-token-sum-norm": per row, sum / loss_scale_factor (default: the padded length
      L, the last dim); mean over rows (Dr.GRPO). `loss_scale_factor` is ignored by the
      other modes.
    Sequence modes treat the last dim as the sequence and count only rows with at least one
    valid position. A mask with no valid position gives 0, not NaN.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"agg_loss: unknown mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    _check_same_shape("agg_loss", loss_mat=loss_mat, mask=mask)
    valid = mask.bool()
    # torch.where (not loss * mask) so that inf/NaN in padding cannot reach the sum.
    masked_loss = torch.where(valid, loss_mat, torch.zeros_like(loss_mat))

    if mode == "token-mean":
        return masked_loss.sum() / valid.sum().clamp(min=1)
    if mode == "token-sum":
        return masked_loss.sum()

    if loss_mat.dim() < 2:
        raise ValueError(
            f"agg_loss: mode {mode!r} needs rows of positions [B, L], got {list(loss_mat.shape)}"
        )
    row_sums = masked_loss.sum(dim=-1)
    row_counts = valid.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        row_losses = row_sums
    elif mode == "seq-mean-token-mean":
        row_losses = row_sums / row_counts.clamp(min=1)
    else:  # seq-mean-token-sum-norm
        scale = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
        row_losses = row_sums / scale
    # Rows without a valid position have a loss of 0 and do not count in the mean.
    rows_with_tokens = (row_counts > 0).sum().clamp(min=1)
    return row_losses.sum() / rows_with_tokens


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    precedent_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric bounds and dual clip (verl's "vanilla" loss).

    ratio = exp(clamp(logp - old_logp, -20, 20)), clipped to [1 - clip_low, 1 + clip_high].
    Per position: max(-A * ratio, -A * clipped_ratio); where A < 0 it is further capped at
    -A * dual_clip (dual-clip PPO, Ye et al. 2020); `dual_clip=None` turns that off.

    `precedent_logp` (ReMix's mix-policy proximal policy gradient, the clipped objective of
    GePPO, Queeney et al. 2021): the rows were sampled by an earlier policy whose log-probs are
    `old_logp`, and the update starts from the precedent policy (`precedent_logp`, the weights
    before this update). The trust region is then centred on the precedent's ratio
    c = exp(precedent_logp - old_logp): the ratio is clipped to [c - clip_low, c + clip_high]
    and the dual clip is c * dual_clip. Rows the precedent sampled itself have c = 1: the
    plain loss.

    Metrics (detached scalars): `clipfrac` (share of valid positions where the clipped term
    is the larger one), `clipfrac_lower` (share where the dual clip binds), `approx_kl`
    (masked mean of old_logp - logp, using the clamped log-ratio; with precedent_logp, of
    precedent_logp - logp: the step from the precedent).
    """
    _check_same_shape("policy_loss", logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    if precedent_logp is not None:
        _check_same_shape("policy_loss", logp=logp, precedent_logp=precedent_logp)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"policy_loss: clip_low={clip_low} and clip_high={clip_high} must be >= 0")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(
            f"policy_loss: dual_clip must be > 1 (or None to disable), got {dual_clip}"
        )

    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    centre: torch.Tensor | float = 1.0
    if precedent_logp is not None:
        centre = torch.exp((precedent_logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, centre - clip_low, centre + clip_high)
    pessimistic = torch.maximum(unclipped, clipped)
    clip_binds = clipped > unclipped

    if dual_clip is not None:
        # For A < 0 a huge ratio makes max(...) unbounded; cap the loss at -A * dual_clip.
        dual_bound = -advantages * (centre * dual_clip)
        negative = advantages < 0
        per_position = torch.where(negative, torch.minimum(pessimistic, dual_bound), pessimistic)
        dual_binds = negative & (pessimistic > dual_bound)
    else:
        per_position = pessimistic
        dual_binds = torch.zeros_like(clip_binds)

    loss = agg_loss(per_position, mask, agg)
    metrics = {
        "clipfrac": agg_loss(clip_binds.to(logp.dtype), mask, "token-mean").detach(),
        "clipfrac_lower": agg_loss(dual_binds.to(logp.dtype), mask, "token-mean").detach(),
        "approx_kl": agg_loss(-log_ratio if precedent_logp is None else precedent_logp - logp, mask,
                              "token-mean").detach(),
    }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = None,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Squared-error value loss, optionally clipped around the rollout values (PPO).

    Without clip: 0.5 * agg((v - R)^2). With clip:
    0.5 * agg(max((v - R)^2, (clamp(v, v_old - clip, v_old + clip) - R)^2)).
    Metric `clipfrac`: share of valid positions where the clipped term is the larger one.
    """
    _check_same_shape(
        "value_loss", values=values, old_values=old_values, returns=returns, mask=mask
    )
    squared_error = (values - returns) ** 2
    if clip is None:
        per_position = squared_error
        clip_binds = torch.zeros_like(squared_error, dtype=torch.bool)
    else:
        if clip < 0:
            raise ValueError(f"value_loss: clip must be >= 0 (or None), got {clip}")
        values_clipped = old_values + (values - old_values).clamp(-clip, clip)
        squared_error_clipped = (values_clipped - returns) ** 2
        per_position = torch.maximum(squared_error, squared_error_clipped)
        clip_binds = squared_error_clipped > squared_error

    loss = 0.5 * agg_loss(per_position, mask, agg)
    clipfrac = agg_loss(clip_binds.to(values.dtype), mask, "token-mean").detach()
    return loss, {"clipfrac": clipfrac}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-position estimate of KL(policy || reference) from sampled-token log-probs.

    Schulman's estimators (http://joschu.net/blog/kl-approx.html), with k1 = logp - ref_logp:
    - "k1": k1;  "abs": |k1|;  "k2": 0.5 * k1^2
    - "k3": with kl = clamp(ref_logp - logp, -20, 20): exp(kl) - kl - 1, clamped to [-10, 10]
    - "k1+", "k3+": straight-through: the value of k1 / k3 with the gradient of k2, whose
      gradient is the unbiased one for the KL (value = k2 + (k - k2).detach()).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kl_penalty: unknown kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
    _check_same_shape("kl_penalty", logp=logp, ref_logp=ref_logp)

    k1 = logp - ref_logp
    k2 = 0.5 * k1.square()
    if kind == "k1":
        return k1
    if kind == "abs":
        return k1.abs()
    if kind == "k2":
        return k2

    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = (torch.exp(log_ratio) - log_ratio - 1).clamp(-K3_CLAMP, K3_CLAMP)
    if kind == "k3":
        return k3
    forward_value = k1 if kind == "k1+" else k3
    return k2 + (forward_value - k2).detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum(softmax(z) * z)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
