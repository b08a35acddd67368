"""Training windows (padding at episode edges) and the normaliser."""

import numpy as np
import pytest
import torch

from embodied_rl.data import ChunkWindows, DemoDataset, Normalizer, fit_normalizer, window_indices
from embodied_rl.errors import UserError


def make_dataset(lengths=(3, 4), obs_dim=2, action_dim=1, pixels=False) -> DemoDataset:
    steps = sum(lengths)
    obs = np.stack([np.arange(steps), -np.arange(steps)], 1)[:, :obs_dim].astype(np.float32)
    action = (np.arange(steps, dtype=np.float32) * 10)[:, None].repeat(action_dim, 1)
    ends = np.cumsum(lengths)
    pix = np.arange(steps, dtype=np.uint8)[:, None, None, None].repeat(4, 1).repeat(4, 2).repeat(3, 3) if pixels else None
    return DemoDataset("mem", obs, action, np.zeros(steps, np.float32), ends, np.ones(len(ends), bool), pix)


def test_window_indices_pad_at_episode_edges():
    obs_index, action_index = window_indices(np.array([3, 7]), n_obs_steps=2, horizon=4)
    assert obs_index.shape == (7, 2) and action_index.shape == (7, 4)
    # first step of episode 0: history and chunk start repeat step 0
    assert obs_index[0].tolist() == [0, 0] and action_index[0].tolist() == [0, 0, 1, 2]
    # last step of episode 0: the chunk repeats the last step, never crosses into episode 1
    assert obs_index[2].tolist() == [1, 2] and action_index[2].tolist() == [1, 2, 2, 2]
    # first step of episode 1 repeats its own first step
    assert obs_index[3].tolist() == [3, 3] and action_index[3].tolist() == [3, 3, 4, 5]
    assert action_index[6].tolist() == [5, 6, 6, 6]
    # executed part (index To-1) of every chunk is the anchor step itself: inside the episode
    assert action_index[:, 1].tolist() == list(range(7))


def test_window_indices_rejects_bad_sizes():
    with pytest.raises(ValueError):
        window_indices(np.array([5]), n_obs_steps=3, horizon=2)


def test_chunk_windows_batches():
    windows = ChunkWindows(make_dataset(pixels=True), n_obs_steps=2, horizon=4, obs_mode="pixels")
    assert len(windows) == 7
    batch = windows.batch(torch.tensor([0, 6]))
    assert batch["obs"].shape == (2, 2, 2) and batch["action"].shape == (2, 4, 1)
    assert batch["obs"][0, :, 0].tolist() == [0, 0]
    assert batch["action"][1, :, 0].tolist() == [50, 60, 60, 60]
    assert batch["pixels"].dtype == torch.uint8 and batch["pixels"].shape == (2, 2, 4, 4, 3)
    assert batch["pixels"][1, :, 0, 0, 0].tolist() == [5, 6]
    sample = windows.sample(5, torch.Generator().manual_seed(0))
    assert sample["obs"].shape == (5, 2, 2)


def test_pixels_mode_needs_pixels():
    with pytest.raises(UserError, match="no pixels"):
        ChunkWindows(make_dataset(), 2, 4, obs_mode="pixels")


@pytest.mark.parametrize("mode", ["minmax", "meanstd"])
def test_normalizer_round_trip_and_constant_dim(mode):
    rng = np.random.default_rng(0)
    data = rng.normal(size=(100, 3)).astype(np.float32) * [1, 5, 0] + [0, 2, 7]  # dim 2 constant
    normalizer = Normalizer.fit({"obs": data}, mode)
    x = torch.from_numpy(data.astype(np.float32))
    y = normalizer.normalize("obs", x)
    assert torch.isfinite(y).all()
    assert torch.allclose(normalizer.unnormalize("obs", y), x, atol=1e-4)
    assert torch.allclose(y[:, 2], torch.zeros(100), atol=1e-6)
    if mode == "minmax":
        assert y[:, :2].min() >= -1 - 1e-5 and y[:, :2].max() <= 1 + 1e-5
        assert torch.allclose(y[:, :2].min(0).values, -torch.ones(2), atol=1e-5)
    else:
        assert torch.allclose(y[:, :2].mean(0), torch.zeros(2), atol=1e-4)


def test_normalizer_missing_key_is_an_error():
    normalizer = fit_normalizer(make_dataset())
    with pytest.raises(UserError, match="'pixels'"):
        normalizer.normalize("pixels", torch.zeros(2, 3))
    with pytest.raises(UserError, match="unknown normalizer mode"):
        Normalizer("zscore")
