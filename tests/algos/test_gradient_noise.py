import math

import pytest
import torch

from embodied_rl.algos.gradient_noise import GradientNoiseScale


def feed(noise: GradientNoiseScale, gradients: list[torch.Tensor], rows: list[int]) -> dict[str, float]:
    parameter = torch.nn.Parameter(torch.zeros_like(gradients[0]))
    for gradient, count in zip(gradients, rows):
        parameter.grad = gradient.clone()
        noise.add([parameter], count)
    return noise.end_update()


def test_identical_minibatch_gradients_are_all_signal():
    expected = torch.tensor([3.0, 4.0])  # |G|^2 = 25
    metrics = feed(GradientNoiseScale(), [expected] * 4, [8, 8, 8, 8])
    assert metrics["train/gradient_signal_sq"] == pytest.approx(25.0)
    assert metrics["train/gradient_noise_trace"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["train/gradient_noise_scale"] == pytest.approx(0.0, abs=1e-9)


def test_estimates_are_unbiased_for_row_means_of_noisy_gradients():
    # each row's gradient is G + e, e ~ N(0, sigma^2 I): a minibatch mean of b rows has noise sigma^2 / b
    generator = torch.Generator().manual_seed(0)
    dim, sigma = 50, 2.0
    expected = torch.full((dim,), 0.1)  # |G|^2 = 0.5, tr(S) = 200: B_noise = 400 rows
    rows = [16, 16, 16, 8]  # unequal minibatches, as the last one of an epoch can be
    noise = GradientNoiseScale(decay=0.999)
    signals, traces = [], []
    for _ in range(3000):
        gradients = [expected + sigma * torch.randn(dim, generator=generator) / math.sqrt(b) for b in rows]
        metrics = feed(noise, gradients, rows)
        signals.append(metrics["train/gradient_signal_sq"])
        traces.append(metrics["train/gradient_noise_trace"])
    assert sum(signals) / len(signals) == pytest.approx(0.5, rel=0.1)
    assert sum(traces) / len(traces) == pytest.approx(200.0, rel=0.05)
    assert noise.scale() == pytest.approx(400.0, rel=0.15)


def test_one_minibatch_estimates_nothing_and_no_signal_reads_infinite():
    noise = GradientNoiseScale()
    assert feed(noise, [torch.ones(3)], [10]) == {}
    assert noise.scale() == math.inf
    restored = GradientNoiseScale()
    restored.load_state_dict(noise.state_dict())
    assert restored.scale() == math.inf
