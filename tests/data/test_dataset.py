"""The demo dataset on disk: every chunk written, and an array with a missing chunk refused."""

import numpy as np
import pytest
import zarr

from embodied_rl.data.dataset import DemoDataset, write_demos
from embodied_rl.errors import UserError


def failed_episodes():
    """Episodes whose rewards are all zero and that all failed: zarr skips such chunks by default."""
    rng = np.random.default_rng(0)
    return [{"obs": rng.standard_normal((5, 3)).astype(np.float32),
             "action": rng.uniform(-1, 1, (5, 2)).astype(np.float32),
             "reward": np.zeros(5, np.float32), "success": False} for _ in range(2)]


def test_all_zero_chunks_are_written_and_a_deleted_one_is_refused(tmp_path):
    path = write_demos(tmp_path / "demos.zarr", failed_episodes(), {"task": "reach"})
    dataset = DemoDataset.load(path)
    assert not dataset.reward.any() and not dataset.episode_success.any()
    (path / "meta" / "episode_success" / "c" / "0").unlink()
    with pytest.raises(UserError, match="meta/episode_success is missing 1 of its 1 chunk files"):
        DemoDataset.load(path)


def test_an_older_dataset_may_skip_zero_chunks_but_not_obs_or_actions(tmp_path):
    path = write_demos(tmp_path / "demos.zarr", failed_episodes(), {"task": "reach"})
    root = zarr.open_group(str(path), mode="r+")
    del root.attrs["all_chunks_written"]  # as written before every chunk was
    (path / "data" / "reward" / "c" / "0").unlink()
    assert not DemoDataset.load(path).reward.any()
    (path / "data" / "obs" / "c" / "0" / "0").unlink()
    with pytest.raises(UserError, match="data/obs is missing"):
        DemoDataset.load(path)
