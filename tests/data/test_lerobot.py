"""LeRobotDataset v3 export and import (data/lerobot.py, import-demos, export-demos): round trips
of collected demos, a dataset laid out as lerobot's own writer lays it out, and bad input."""

import io
import json
import shutil

import numpy as np
import pytest

from embodied_rl.cli import main
from embodied_rl.data import DemoDataset, write_demos
from embodied_rl.errors import UserError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

INSTRUCTIONS = ["reach the red target", "reach the blue target"]
TINY = ["policy.mlp.hidden_dim=32", "policy.mlp.num_blocks=1", "policy.mlp.time_dim=16",
        "batch_size=16", "log_every=2"]


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """reach_choice demos with pixels and instructions, and their LeRobot export."""
    root = tmp_path_factory.mktemp("lerobot")
    assert main(["collect", "task=reach_choice", "demos=3", "num_envs=3", "seed=3", "pixels=true",
                 "image_size=16", f"run_dir={root / 'collect'}"]) == 0
    data = root / "collect" / "demos.zarr"
    assert main(["export-demos", "format=lerobot", f"data={data}", f"out={root / 'exported'}",
                 f"run_dir={root / 'export'}"]) == 0
    return {"root": root, "data": data, "exported": root / "exported"}


def test_export_writes_the_v3_layout(collected):
    out = collected["exported"]
    dataset = DemoDataset.load(collected["data"])
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 25  # reach: 0.01 s x 4 substeps
    assert info["total_episodes"] == dataset.num_episodes and info["total_frames"] == dataset.num_steps
    assert info["total_tasks"] == 2 and info["chunks_size"] == 1000
    assert info["splits"] == {"train": f"0:{dataset.num_episodes}"}
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    features = info["features"]
    assert features["observation.state"]["shape"] == [8] and features["action"]["shape"] == [2]
    assert features["observation.state"]["dtype"] == "float32" and len(features["action"]["names"]) == 2
    video = features["observation.images.top"]
    assert video["dtype"] == "video" and video["shape"] == [16, 16, 3]
    assert video["names"] == ["height", "width", "channels"] and video["info"]["video.fps"] == 25

    data = pq.read_table(out / "data" / "chunk-000" / "file-000.parquet")
    for column in ("observation.state", "action", "timestamp", "frame_index", "episode_index", "index", "task_index"):
        assert column in data.column_names
    assert data.num_rows == dataset.num_steps
    assert data.column("index").to_pylist() == list(range(dataset.num_steps))
    assert data.column("task_index").to_pylist() == dataset.instruction.tolist()

    tasks = pq.read_table(out / "meta" / "tasks.parquet")
    assert tasks.column("task").to_pylist() == INSTRUCTIONS and tasks.column("task_index").to_pylist() == [0, 1]
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]  # pandas' index

    episodes = pq.read_table(out / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pylist()
    starts = [0, *dataset.episode_ends[:-1].tolist()]
    assert [e["dataset_from_index"] for e in episodes] == starts
    assert [e["dataset_to_index"] for e in episodes] == dataset.episode_ends.tolist()
    assert [e["videos/observation.images.top/from_timestamp"] for e in episodes] == [s / 25 for s in starts]
    assert [e["tasks"] for e in episodes] == [[INSTRUCTIONS[dataset.instruction[s]]] for s in starts]

    stats = json.loads((out / "meta" / "stats.json").read_text())
    assert stats["action"]["count"] == [dataset.num_steps]
    assert np.allclose(stats["action"]["mean"], dataset.action.mean(axis=0))
    assert np.array(stats["observation.images.top"]["mean"]).shape == (3, 1, 1)
    assert (out / "videos" / "observation.images.top" / "chunk-000" / "file-000.mp4").stat().st_size > 0


def test_round_trip_keeps_episodes_values_instructions_and_pixels(collected, tmp_path, capsys):
    run_dir = tmp_path / "import"
    assert main(["import-demos", "format=lerobot", f"path={collected['exported']}", f"run_dir={run_dir}"]) == 0
    assert "episodes_written: 3" in capsys.readouterr().out
    before, after = DemoDataset.load(collected["data"]), DemoDataset.load(run_dir / "demos.zarr")
    assert np.array_equal(after.episode_ends, before.episode_ends)
    for key in ("obs", "action", "reward"):  # float32 all the way: exact
        assert np.array_equal(getattr(after, key), getattr(before, key)), key
    assert np.array_equal(after.episode_success, before.episode_success)
    assert after.instructions == before.instructions == INSTRUCTIONS
    assert np.array_equal(after.instruction, before.instruction)
    assert after.attrs["task"] == "reach_choice"  # from robot_type embodied_rl/reach_choice
    assert after.pixels.shape == before.pixels.shape
    assert np.abs(after.pixels.astype(int) - before.pixels.astype(int)).mean() < 8  # h264 compression

    # collect_info.json in collect's shape, plus where the data came from
    collect_info = json.loads((collected["root"] / "collect" / "collect_info.json").read_text())
    info = json.loads((run_dir / "collect_info.json").read_text())
    assert set(collect_info) - {"note"} <= set(info)
    assert info["dataset"] == str(run_dir / "demos.zarr") and info["episodes_written"] == 3
    assert info["pixels"] is True and info["expert_success_rate"] == 1.0
    assert info["source"]["format"] == "lerobot" and info["source"]["camera"] == "observation.images.top"
    assert info["source"]["not_carried"] == []


def test_image_size_resizes_and_instructions_drop(collected, tmp_path):
    out = tmp_path / "demos.zarr"
    assert main(["import-demos", f"path={collected['exported']}", "image_size=8", "instructions=drop",
                 f"out={out}", f"run_dir={tmp_path / 'run'}"]) == 0
    dataset = DemoDataset.load(out)
    assert dataset.pixels.shape[1:] == (8, 8, 3)
    assert dataset.instruction is None and dataset.instructions == []


@pytest.mark.e2e
def test_state_dataset_round_trip_then_pretrain(tmp_path, capsys):
    """A reach dataset without pixels or instructions: exported, imported, and trained on."""
    rng = np.random.default_rng(0)
    episodes = [{"obs": rng.uniform(-1, 1, (n, 8)).astype(np.float32),
                 "action": rng.uniform(-1, 1, (n, 2)).astype(np.float32),
                 "reward": rng.normal(size=n).astype(np.float32), "success": n > 15} for n in (12, 20, 17)]
    data = write_demos(tmp_path / "toy.zarr", episodes, {"task": "reach", "obs_dim": 8, "action_dim": 2})
    out = tmp_path / "lerobot"
    out.mkdir()  # an empty directory is fine
    assert main(["export-demos", f"data={data}", f"out={out}", "fps=10", f"run_dir={tmp_path / 'export'}"]) == 0
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["fps"] == 10 and info["video_path"] is None and info["robot_type"] == "embodied_rl/reach"
    assert pq.read_table(out / "meta" / "tasks.parquet").column("task").to_pylist() == ["reach"]
    assert not (out / "videos").exists()

    run_dir = tmp_path / "import"
    assert main(["import-demos", f"path={out}", f"run_dir={run_dir}"]) == 0
    imported = DemoDataset.load(run_dir / "demos.zarr")
    assert imported.attrs["task"] == "reach" and imported.instruction is None  # reach has no instructions
    assert np.array_equal(imported.obs, np.concatenate([e["obs"] for e in episodes]))
    assert np.array_equal(imported.reward, np.concatenate([e["reward"] for e in episodes]))
    assert imported.episode_success.tolist() == [False, True, True] and imported.pixels is None
    capsys.readouterr()

    pretrain_dir = tmp_path / "pretrain"
    assert main(["pretrain", "task=reach", "policy=flow", f"data={run_dir / 'demos.zarr'}", "steps=4",
                 "eval_episodes=0", f"run_dir={pretrain_dir}", *TINY]) == 0
    assert (pretrain_dir / "checkpoints" / "last").is_dir()


def _image_bytes(value: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((6, 6, 3), value, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_import_reads_lerobot_writer_layout(tmp_path):
    """What lerobot itself writes, not what our exporter writes: variable-length list columns of
    float64, the task text as pandas' unnamed index, episodes split over two data files and listed
    out of order, an image feature stored in the parquet, and a feature we do not carry."""
    root = tmp_path / "foreign"
    lengths, file_of_episode, task_of_episode = [4, 6, 3], [0, 0, 1], [1, 0, 1]
    rng = np.random.default_rng(1)
    state = rng.normal(size=(sum(lengths), 3))
    action = rng.normal(size=(sum(lengths), 1))
    starts = np.cumsum([0, *lengths[:-1]])
    for file_index in (0, 1):
        rows = [i for e, n in enumerate(lengths) if file_of_episode[e] == file_index
                for i in range(starts[e], starts[e] + n)]
        episode = np.repeat(np.arange(3), lengths)[rows]
        table = pa.table({
            "observation.state": pa.array(state[rows].tolist(), pa.list_(pa.float64())),
            "action": pa.array(action[rows, 0]),  # shape [1]: a scalar column
            "observation.images.wrist": pa.array([{"bytes": _image_bytes(i), "path": None} for i in rows]),
            "observation.velocity": pa.array([[0.0, 1.0]] * len(rows)),
            "timestamp": pa.array((np.array(rows) - starts[episode]) / 10.0, pa.float32()),
            "frame_index": pa.array(np.array(rows) - starts[episode]),
            "episode_index": pa.array(episode), "index": pa.array(rows, pa.int64()),
            "task_index": pa.array([task_of_episode[e] for e in episode], pa.int64()),
        })
        (root / "data" / "chunk-000").mkdir(parents=True, exist_ok=True)
        pq.write_table(table, root / "data" / "chunk-000" / f"file-{file_index:03d}.parquet")
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    pq.write_table(pa.table({"task_index": [0, 1], "__index_level_0__": ["open the door", "close the door"]}),
                   root / "meta" / "tasks.parquet")
    order = [2, 0, 1]
    pq.write_table(pa.table({
        "episode_index": order, "length": [lengths[e] for e in order],
        "dataset_from_index": [int(starts[e]) for e in order],
        "dataset_to_index": [int(starts[e] + lengths[e]) for e in order],
        "data/chunk_index": [0, 0, 0], "data/file_index": [file_of_episode[e] for e in order],
        "stats/action/mean": [[0.0]] * 3,
    }), root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    scalar = {"shape": [1], "names": None}
    (root / "meta" / "info.json").write_text(json.dumps({
        "codebase_version": "v3.0", "robot_type": "so100", "fps": 10, "total_episodes": 3,
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet", "video_path": None,
        "features": {
            "observation.state": {"dtype": "float64", "shape": [3], "names": None},
            "action": {"dtype": "float64", **scalar},
            "observation.images.wrist": {"dtype": "image", "shape": [6, 6, 3], "names": ["height", "width", "channels"]},
            "observation.velocity": {"dtype": "float64", "shape": [2], "names": None},
            **{key: {"dtype": "int64", **scalar} for key in ("frame_index", "episode_index", "index", "task_index")},
            "timestamp": {"dtype": "float32", **scalar},
        },
    }))

    run_dir = tmp_path / "import"
    assert main(["import-demos", f"path={root}", f"run_dir={run_dir}"]) == 0
    dataset = DemoDataset.load(run_dir / "demos.zarr")
    assert dataset.episode_ends.tolist() == np.cumsum(lengths).tolist()
    assert np.array_equal(dataset.obs, state.astype(np.float32))
    assert np.array_equal(dataset.action, action.astype(np.float32))
    assert dataset.instructions == ["open the door", "close the door"]  # two task strings: kept
    assert dataset.instruction.tolist() == np.repeat(task_of_episode, lengths).tolist()
    assert dataset.pixels.shape == (sum(lengths), 6, 6, 3)
    assert dataset.pixels[:, 0, 0, 0].tolist() == list(range(sum(lengths)))  # PNG: lossless
    assert "task" not in dataset.attrs and not dataset.reward.any()
    info = json.loads((run_dir / "collect_info.json").read_text())
    assert info["task"] is None and info["source"]["not_carried"] == ["observation.velocity"]
    assert info["demo_return_mean"] is None and info["expert_success_rate"] is None


def _break_info(path, change):
    info = json.loads((path / "meta" / "info.json").read_text())
    change(info)
    (path / "meta" / "info.json").write_text(json.dumps(info))


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / "meta" / "info.json").unlink(), "meta/info.json is missing"),
    (lambda p: _break_info(p, lambda info: info["features"].pop("action")), "feature 'action' is missing"),
    (lambda p: _break_info(p, lambda info: info["features"].pop("observation.state")),
     "feature 'observation.state' is missing"),
    (lambda p: _break_info(p, lambda info: info.update(codebase_version="v2.1")), "codebase_version is v2.1"),
    (lambda p: (p / "meta" / "tasks.parquet").unlink(), "meta/tasks.parquet is missing"),
    (lambda p: (p / "data" / "chunk-000" / "file-000.parquet").unlink(), "data/chunk-000/file-000.parquet is missing"),
    (lambda p: shutil.rmtree(p / "videos"), "videos/observation.images.top/chunk-000/file-000.mp4 is missing"),
    (lambda p: (p / "meta" / "info.json").write_text("{not json"), "meta/info.json is not valid JSON"),
])
def test_bad_dataset_is_one_line_exit_2(collected, tmp_path, capsys, damage, message):
    broken = tmp_path / "broken"
    shutil.copytree(collected["exported"], broken)
    damage(broken)
    run_dir = tmp_path / "run"
    assert main(["import-demos", f"path={broken}", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"lerobot dataset {broken}: {message}" in err and len(err.splitlines()) == 1
    assert not run_dir.exists()


def test_import_checks_the_task_and_refuses_an_existing_out(collected, tmp_path, capsys):
    assert main(["import-demos", f"path={collected['exported']}", "task=push_t", f"run_dir={tmp_path / 'a'}"]) == 2
    assert "task 'push_t' has" in capsys.readouterr().err
    out = tmp_path / "demos.zarr"
    out.mkdir()
    assert main(["import-demos", f"path={collected['exported']}", f"out={out}", f"run_dir={tmp_path / 'b'}"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_export_refuses_a_non_empty_out(collected, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert main(["export-demos", f"data={collected['data']}", f"out={out}", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious" and len(list(out.iterdir())) == 1
    assert main(["export-demos", "format=rlds", f"data={collected['data']}", f"out={tmp_path / 'x'}"]) == 2
    assert "unknown format 'rlds'" in capsys.readouterr().err


def test_missing_pyarrow_names_the_extra(monkeypatch):
    import sys

    from embodied_rl.data.lerobot import require_pyarrow

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(UserError, match=r"embodied-rl\[lerobot\]"):
        require_pyarrow()
