"""Instructions through the data layer: collect records them, the dataset loads and checks them,
ChunkWindows serves them next to the observations."""

import numpy as np
import pytest
import torch
import zarr

from embodied_rl.cli import main
from embodied_rl.data import ChunkWindows, DemoDataset, write_demos
from embodied_rl.errors import UserError

INSTRUCTIONS = ["reach the red target", "reach the blue target"]


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    root = tmp_path_factory.mktemp("collect")
    out = root / "demos.zarr"
    code = main(["collect", "task=reach_choice", "demos=6", "num_envs=4", "seed=2", "pixels=true",
                 "image_size=16", f"out={out}", f"run_dir={root / 'run'}"])
    assert code == 0
    return DemoDataset.load(out)


def test_collect_records_each_steps_instruction(collected):
    dataset = collected
    assert dataset.instructions == INSTRUCTIONS and dataset.attrs["instructions"] == INSTRUCTIONS
    assert dataset.instruction.dtype == np.int64 and dataset.instruction.shape == (dataset.num_steps,)
    assert dataset.pixels.shape == (dataset.num_steps, 16, 16, 3)
    assert dataset.episode_success.all()
    seen = set()
    for episode in range(dataset.num_episodes):
        start, end = dataset.episode_bounds(episode)
        ids = dataset.instruction[start:end]
        assert (ids == ids[0]).all()  # one instruction per episode
        seen.add(int(ids[0]))
        # the expert went to the instructed target: the last fingertip is next to it
        target = dataset.obs[end - 1, 2:4] if ids[0] == 0 else dataset.obs[end - 1, 4:6]
        assert np.linalg.norm(dataset.obs[end - 1, 0:2] - target) < 0.05
    assert seen == {0, 1}
    first = dataset.first_episodes(2)
    assert len(first.instruction) == first.num_steps and first.instructions == INSTRUCTIONS


def test_chunk_windows_carry_the_instruction(collected):
    for obs_mode in ("state", "pixels"):
        windows = ChunkWindows(collected, n_obs_steps=2, horizon=4, obs_mode=obs_mode)
        assert windows.instructions == INSTRUCTIONS
        indices = torch.arange(0, len(windows), 7)
        batch = windows.batch(indices)
        assert batch["instruction"].shape == (len(indices), 2) and batch["instruction"].dtype == torch.int64
        expected = torch.from_numpy(collected.instruction[windows.obs_index[indices].numpy()])
        assert torch.equal(batch["instruction"], expected)
        assert torch.equal(batch["obs"], torch.from_numpy(collected.obs[windows.obs_index[indices].numpy()]))
        assert ("pixels" in batch) == (obs_mode == "pixels")
    assert windows.sample(5, torch.Generator().manual_seed(0))["instruction"].shape == (5, 2)


def episodes(instruction=None):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(2):
        episode = {"obs": rng.standard_normal((4, 3)).astype(np.float32),
                   "action": rng.uniform(-1, 1, (4, 2)).astype(np.float32),
                   "reward": np.zeros(4, np.float32), "success": True}
        if instruction is not None:
            episode["instruction"] = np.full(4, instruction)
        out.append(episode)
    return out


def test_a_dataset_without_instructions_still_loads(tmp_path):
    dataset = DemoDataset.load(write_demos(tmp_path / "plain.zarr", episodes(), {"task": "reach"}))
    assert dataset.instruction is None and dataset.instructions == []
    windows = ChunkWindows(dataset, n_obs_steps=2, horizon=2)
    assert "instruction" not in windows.batch(torch.tensor([0, 1]))


def test_load_checks_the_instructions(tmp_path):
    attrs = {"task": "reach_choice", "instructions": INSTRUCTIONS}
    good = DemoDataset.load(write_demos(tmp_path / "good.zarr", episodes(1), attrs))
    assert good.instruction.tolist() == [1] * 8
    with pytest.raises(ValueError, match="instructions"):  # ids without their texts
        write_demos(tmp_path / "no_texts.zarr", episodes(1), {"task": "reach_choice"})

    path = write_demos(tmp_path / "out_of_range.zarr", episodes(2), attrs)
    with pytest.raises(UserError, match=r"ids outside \[0, 2\)"):
        DemoDataset.load(path)

    path = write_demos(tmp_path / "texts_gone.zarr", episodes(0), attrs)
    root = zarr.open_group(str(path), mode="r+")
    del root.attrs["instructions"]
    with pytest.raises(UserError, match="needs attrs\\['instructions'\\]"):
        DemoDataset.load(path)

    path = write_demos(tmp_path / "short.zarr", episodes(0), attrs)
    root = zarr.open_group(str(path), mode="r+")
    del root["data"]["instruction"]
    root["data"].create_array("instruction", data=np.ones(3, np.int64))
    with pytest.raises(UserError, match="different lengths"):
        DemoDataset.load(path)

    path = write_demos(tmp_path / "array_gone.zarr", episodes(0), attrs)
    root = zarr.open_group(str(path), mode="r+")
    del root["data"]["instruction"]
    with pytest.raises(UserError, match="data/instruction is missing"):
        DemoDataset.load(path)
