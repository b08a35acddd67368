"""The gradient noise scale of a policy-gradient update: how many samples a batch needs before its
gradient's direction is mostly signal (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training").

A minibatch of b rows whose loss is a mean over its rows estimates the expected gradient G with
noise of covariance S / b, so E|g_b|^2 = |G|^2 + tr(S) / b. One update epoch sees k minibatches of
b_i rows and, through their row-weighted mean, the whole batch of B = sum b_i rows. The two
squared norms give unbiased estimates of |G|^2 and tr(S), and their ratio

    B_noise = tr(S) / |G|^2

is the batch size at which half of a gradient's squared norm is signal. Far below it (B << B_noise)
an update's direction is mostly noise: the best step per batch shrinks in proportion to B / B_noise
and the progress per sample is capped whatever the learning rate, so a larger learning rate, or
more epochs on the same batch, walks the policy along the noise (docs/finetuning.md, "When an
on-policy method does not learn"). Each update's estimates are noisy (|G|^2's can be negative);
the ratio of their exponential averages is readable over tens of updates. The minibatches of one
epoch are taken at slightly different weights (each follows an optimiser step); at the small steps
where the diagnosis matters that difference is negligible. The rows of one rollout are not
independent (an episode's rows share its outcome), so a batch's shared noise counts as signal here:
the value is a lower bound (benchmarks/gradient_signal.py compares independent batches).

    noise = GradientNoiseScale()
    for each minibatch of the update's first epoch, after backward():
        noise.add(actor_parameters, rows)
    metrics = noise.end_update()   # {} with fewer than two minibatches
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class GradientNoiseScale:
    """Accumulates one update's minibatch gradients; `end_update` returns the estimates."""

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.signal_average = 0.0
        self.noise_average = 0.0
        self._clear()

    def _clear(self) -> None:
        self._weighted_sum: torch.Tensor | None = None  # sum_i b_i g_i
        self._squared_norms: list[float] = []  # |g_i|^2
        self._rows: list[int] = []  # b_i

    def add(self, parameters: Iterable[torch.nn.Parameter], rows: int) -> None:
        """Record the current gradients of `parameters` as one minibatch's of `rows` rows."""
        grads = [p.grad.detach().flatten() for p in parameters if p.grad is not None]
        if not grads or rows < 1:
            return
        grad = torch.cat(grads).double()
        self._squared_norms.append(float(grad.square().sum()))
        self._rows.append(rows)
        self._weighted_sum = grad * rows if self._weighted_sum is None else self._weighted_sum.add_(grad * rows)

    def end_update(self) -> dict[str, float]:
        """The update's unbiased estimates of |G|^2 and tr(S) (per row) and the averaged noise scale
        in rows; {} when the update had fewer than two minibatches (nothing to tell apart)."""
        if len(self._rows) < 2:
            self._clear()
            return {}
        batch_rows = sum(self._rows)
        batch_squared_norm = float((self._weighted_sum / batch_rows).square().sum())
        minibatch_squared_norm = sum(self._squared_norms) / len(self._squared_norms)
        inverse_rows = sum(1.0 / rows for rows in self._rows) / len(self._rows)
        self._clear()
        noise = (minibatch_squared_norm - batch_squared_norm) / (inverse_rows - 1.0 / batch_rows)
        signal = batch_squared_norm - noise / batch_rows
        self.signal_average = self.decay * self.signal_average + (1 - self.decay) * signal
        self.noise_average = self.decay * self.noise_average + (1 - self.decay) * noise
        return {"train/gradient_signal_sq": signal, "train/gradient_noise_trace": noise,
                "train/gradient_noise_scale": self.scale()}

    def scale(self) -> float:
        """B_noise from the averages: inf while the averaged signal is not above zero."""
        if self.signal_average <= 0:
            return math.inf
        return self.noise_average / self.signal_average

    def state_dict(self) -> dict[str, float]:
        return {"signal_average": self.signal_average, "noise_average": self.noise_average}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.signal_average = float(state["signal_average"])
        self.noise_average = float(state["noise_average"])
