"""embodied-rl collect, end to end through the CLI."""

import json
import os

import numpy as np
import pytest

from embodied_rl.cli import main
from embodied_rl.data import DemoDataset

os.environ.setdefault("MUJOCO_GL", "egl")


def test_collect_reach_end_to_end(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["collect", "task=reach", "demos=5", "num_envs=4", "seed=1", f"run_dir={run_dir}"])
    assert code == 0
    out = capsys.readouterr().out
    assert "dataset:" in out and "expert_success_rate:" in out
    dataset = DemoDataset.load(run_dir / "demos.zarr")
    assert dataset.num_episodes == 5 and dataset.episode_success.all()
    assert dataset.obs.shape == (dataset.num_steps, 8) and dataset.action.shape == (dataset.num_steps, 2)
    assert dataset.pixels is None and dataset.attrs["task"] == "reach"
    assert np.abs(dataset.action).max() <= 1.0
    info = json.loads((run_dir / "collect_info.json").read_text())
    assert info["episodes_written"] == 5 and info["episodes_attempted"] >= 5
    assert info["expert_success_rate"] >= 0.95 and info["dataset"] == str(run_dir / "demos.zarr")
    for key in ("task", "quality", "seed", "wall_time_s"):
        assert key in info
    # the first obs of an episode is a reset obs; the last step reaches the target
    start, end = dataset.episode_bounds(0)
    assert np.linalg.norm(dataset.obs[start, 4:6]) >= 0.05


def test_collect_pixels_and_failures_kept(tmp_path):
    out = tmp_path / "px.zarr"
    code = main(["collect", "task=reach", "demos=2", "num_envs=2", "pixels=true", "image_size=16",
                 "quality=0.0", "only_success=false", f"out={out}", f"run_dir={tmp_path / 'run'}"])
    assert code == 0
    dataset = DemoDataset.load(out)
    assert dataset.pixels.shape == (dataset.num_steps, 16, 16, 3) and dataset.pixels.dtype == np.uint8


@pytest.mark.parametrize("override, message", [
    ("demos=0", "demos must be >= 1"),
    ("quality=1.5", "quality must be in [0, 1]"),
    ("mistakes=1.5", "mistakes must be a number in [0, 1]"),
    ("mistakes=0.5", "task 'reach''s expert makes no deliberate mistakes"),
    ("num_envs=0", "num_envs must be an integer >= 1"),
    ("task=nope", "unknown task 'nope'"),
    ("backend=bullet", "unknown backend 'bullet'"),
])
def test_collect_bad_input_exits_2(tmp_path, capsys, override, message):
    code = main(["collect", "task=reach", override, f"run_dir={tmp_path / 'run'}"])
    assert code == 2
    assert message in capsys.readouterr().err


def test_collect_refuses_existing_out(tmp_path, capsys):
    out = tmp_path / "demos.zarr"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code = main(["collect", "task=reach", "demos=1", f"out={out}", f"run_dir={tmp_path / 'run'}"])
    assert code == 2
    assert "already exists" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("task", ["reach", "push_t", "lift", "peg_insert", "hopper"])
def test_bc_defaults_come_from_the_task_config(task):
    import yaml

    from embodied_rl.config import compose
    from embodied_rl.paths import config_dir

    defaults = yaml.safe_load((config_dir() / "task" / f"{task}.yaml").read_text())
    collect_cfg = compose("collect", [f"task={task}"])
    assert collect_cfg.demos == defaults["demos"] >= 1
    assert collect_cfg.quality == defaults["quality"]
    assert compose("pretrain", [f"task={task}"]).steps == defaults["pretrain_steps"] >= 1
    assert compose("collect", [f"task={task}", "demos=3"]).demos == 3


def test_collect_task_without_success_keeps_every_stable_episode(tmp_path, capsys):
    """hopper has no success test: only_success (the default) must not drop its episodes."""
    run_dir = tmp_path / "run"
    code = main(["collect", "task=hopper", "demos=2", "num_envs=2", "quality=0.5", f"run_dir={run_dir}"])
    assert code == 0
    assert "demo_return_mean:" in capsys.readouterr().out
    dataset = DemoDataset.load(run_dir / "demos.zarr")
    assert dataset.num_episodes == 2 and not dataset.episode_success.any()
    info = json.loads((run_dir / "collect_info.json").read_text())
    assert info["episodes_attempted"] == 2 and info["expert_success_rate"] is None
    assert info["demo_return_mean"] > 0
