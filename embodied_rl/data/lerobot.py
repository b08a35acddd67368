"""LeRobotDataset v3.0 directories, read and written without the lerobot package.

A v3.0 dataset is a directory:

    meta/info.json         codebase_version ("v3.0"), fps, features {key: {dtype, shape, names,
                           info}}, total_episodes, total_frames, total_tasks, chunks_size, splits,
                           and the file templates data_path and video_path
    meta/stats.json        per feature: min, max, mean, std, count, q01, q10, q50, q90, q99
    meta/tasks.parquet     one row per task string: task (pandas keeps it as the index), task_index
    meta/episodes/chunk-XXX/file-XXX.parquet
                           one row per episode: episode_index, tasks, length, dataset_from_index
                           and dataset_to_index (its rows, in the data's global `index`),
                           data/chunk_index, data/file_index, and for each video key
                           videos/<key>/{chunk_index, file_index, from_timestamp, to_timestamp}
    data/chunk-XXX/file-XXX.parquet
                           one row per frame: every feature that is not a video, plus
                           timestamp, frame_index, episode_index, index and task_index
    videos/<key>/chunk-XXX/file-XXX.mp4
                           many episodes per file: an episode's frame at `timestamp` is the
                           file's frame at from_timestamp + timestamp

A feature of shape [1] is a scalar column; a longer vector is a list column (fixed-size when
lerobot writes it). An "image" feature is a struct column {bytes, path} of encoded images.

What maps to the demo format (data/dataset.py):

    observation.state            <-> data/obs
    action                       <-> data/action
    next.reward                  <-> data/reward (zeros when the dataset has none)
    next.success                 <-> meta/episode_success (set if any frame of the episode is)
    observation.images.<camera>  <-> data/pixels (one camera, a video or image feature)
    task_index, meta/tasks.parquet <-> per-step task ids and their texts (the commands turn them
                                   into data/instruction and attrs["instructions"])

Everything else (other cameras, other features, per-episode stats) is not carried; `read_lerobot`
lists it in `not_carried`. pyarrow is imported only here, lazily (extra `lerobot`).
"""

from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embodied_rl.errors import UserError
from embodied_rl.runs import atomic_dir

CODEBASE_VERSION = "v3.0"
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_DIR = "meta/episodes"
CHUNK_FILE = "chunk-{chunk_index:03d}/file-{file_index:03d}"
DATA_PATH = "data/" + CHUNK_FILE + ".parquet"
VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE + ".mp4"
EPISODES_PATH = EPISODES_DIR + "/" + CHUNK_FILE + ".parquet"
# lerobot's defaults: files per chunk directory, and the sizes at which it starts a new file
CHUNKS_SIZE = 1000
DATA_FILES_SIZE_IN_MB = 100
VIDEO_FILES_SIZE_IN_MB = 500

STATE = "observation.state"
ACTION = "action"
REWARD = "next.reward"
SUCCESS = "next.success"
DONE = "next.done"
IMAGE_PREFIX = "observation.images."
# columns every v3.0 frame has; they describe where a frame sits, not what was observed
FRAME_KEYS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
# image stats are estimated from at most this many frames
STATS_MAX_FRAMES = 256
VIDEO_CODEC = "libx264"  # ships with imageio-ffmpeg's ffmpeg; lerobot decodes h264
VIDEO_CRF = "18"  # near-lossless for small renders
# A keyframe every 2 frames, as lerobot encodes: its loaders seek to single frames at random.
VIDEO_GOP = "2"


def require_pyarrow() -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet), or a UserError naming the extra that installs them."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("LeRobot datasets need pyarrow: pip install 'embodied-rl[lerobot]'") from None
    return pa, pq


@dataclass
class LeRobotDemos:
    """A LeRobot dataset read into memory, in the pieces the demo format needs."""

    episodes: list[dict[str, np.ndarray]]  # obs, action, reward, task_index, pixels?, success
    tasks: list[str]  # task texts; an episode's task_index indexes this list
    fps: float
    codebase_version: str
    robot_type: str | None = None
    camera: str | None = None  # the feature read into pixels
    has_reward: bool = False  # whether the source has next.reward (else rewards are zeros)
    has_success: bool = False  # whether the source has next.success (else no episode succeeded)
    not_carried: list[str] = field(default_factory=list)

    @property
    def num_frames(self) -> int:
        return sum(len(episode["action"]) for episode in self.episodes)


class _Reader:
    """Reads one dataset directory; every problem is a one-line UserError naming the part."""

    def __init__(self, root: Path):
        self.root = root
        self.pa, self.pq = require_pyarrow()

    def fail(self, message: str) -> UserError:
        return UserError(f"lerobot dataset {self.root}: {message}")

    def file(self, relative: str) -> Path:
        path = self.root / relative
        if not path.is_file():
            raise self.fail(f"{relative} is missing")
        return path

    def read_table(self, relative: str, columns: list[str] | None = None) -> Any:
        """The parquet file's columns that exist among `columns` (all of them for None)."""
        path = self.file(relative)
        try:
            if columns is not None:
                names = set(self.pq.read_schema(path).names)
                columns = [name for name in columns if name in names]
            return self.pq.read_table(path, columns=columns)
        except (OSError, self.pa.ArrowException) as error:
            raise self.fail(f"{relative} is not a readable parquet file ({error})") from None

    def column(self, table: Any, name: str, where: str) -> Any:
        if name not in table.column_names:
            raise self.fail(f"{where} has no column '{name}'")
        column = table.column(name).combine_chunks()
        if column.null_count:
            raise self.fail(f"{where}: column '{name}' has missing values")
        return column

    def integers(self, table: Any, name: str, where: str) -> np.ndarray:
        values = np.asarray(self.column(table, name, where).to_numpy(zero_copy_only=False))
        if not np.issubdtype(values.dtype, np.integer):
            raise self.fail(f"{where}: column '{name}' must hold integers, not {values.dtype}")
        return values.astype(np.int64)

    def numbers(self, table: Any, name: str, where: str, width: int) -> np.ndarray:
        """A numeric feature column as float64 [N, width]: scalar, list or nested list."""
        column = self.column(table, name, where)
        rows = len(column)
        while self.pa.types.is_list(column.type) or self.pa.types.is_large_list(column.type) or \
                self.pa.types.is_fixed_size_list(column.type):
            column = column.flatten()
        try:
            values = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)
        except (TypeError, ValueError, self.pa.ArrowException):
            raise self.fail(f"{where}: column '{name}' is not numeric ({column.type})") from None
        if values.size != rows * width:
            raise self.fail(f"{where}: column '{name}' holds {values.size} values for {rows} frames, "
                            f"its feature shape says {width} per frame")
        return values.reshape(rows, width)


def _feature_width(reader: _Reader, features: dict[str, Any], key: str) -> int:
    """The number of values per frame of a numeric feature; a UserError if it is not one."""
    feature = features.get(key)
    if not isinstance(feature, dict):
        raise reader.fail(f"feature '{key}' is missing from {INFO_PATH}")
    shape, dtype = feature.get("shape"), feature.get("dtype")
    if not isinstance(shape, list) or not shape or not all(isinstance(n, int) and n >= 1 for n in shape):
        raise reader.fail(f"feature '{key}' has no valid shape in {INFO_PATH} (got {shape!r})")
    if dtype in ("video", "image", "string") or not isinstance(dtype, str):
        raise reader.fail(f"feature '{key}' must be numeric, its dtype is {dtype!r}")
    return math.prod(shape)


def _camera_key(reader: _Reader, features: dict[str, Any], camera: str | None) -> str | None:
    """The image or video feature to read as pixels: `camera` (a key or the name after
    observation.images.), or the first one in info.json; None when the dataset has none."""
    keys = [key for key, ft in features.items() if isinstance(ft, dict) and ft.get("dtype") in ("video", "image")]
    if camera is None:
        return keys[0] if keys else None
    for key in (camera, IMAGE_PREFIX + camera):
        if key in keys:
            return key
    raise reader.fail(f"camera '{camera}' is not one of its image features "
                      f"({', '.join(keys) if keys else 'it has none'})")


def _read_tasks(reader: _Reader) -> dict[int, str]:
    """task_index -> task text. The text is the column `task`, or the pandas index column that
    lerobot's DataFrame.to_parquet writes."""
    table = reader.read_table(TASKS_PATH)
    ids = reader.integers(table, "task_index", TASKS_PATH)
    text_column = next((name for name in ("task", "__index_level_0__") if name in table.column_names), None)
    if text_column is None:
        raise reader.fail(f"{TASKS_PATH} has no column 'task' with the task texts")
    texts = reader.column(table, text_column, TASKS_PATH).to_pylist()
    if not all(isinstance(text, str) for text in texts):
        raise reader.fail(f"{TASKS_PATH}: column '{text_column}' must hold strings")
    if len(set(ids.tolist())) != len(ids):
        raise reader.fail(f"{TASKS_PATH} lists a task_index twice")
    return dict(zip(ids.tolist(), texts))


def _read_episode_rows(reader: _Reader, video_key: str | None) -> dict[str, np.ndarray]:
    """Columns of meta/episodes/*/*.parquet, sorted by episode_index."""
    files = sorted((reader.root / EPISODES_DIR).glob("*/*.parquet"))
    if not files:
        raise reader.fail(f"{EPISODES_PATH.format(chunk_index=0, file_index=0)} is missing "
                          f"(no parquet file under {EPISODES_DIR})")
    integers = ["episode_index", "dataset_from_index", "dataset_to_index", "data/chunk_index", "data/file_index"]
    seconds = []
    if video_key is not None:
        integers += [f"videos/{video_key}/chunk_index", f"videos/{video_key}/file_index"]
        seconds = [f"videos/{video_key}/from_timestamp"]
    parts: dict[str, list[np.ndarray]] = {name: [] for name in integers + seconds}
    for path in files:
        relative = path.relative_to(reader.root).as_posix()
        table = reader.read_table(relative, integers + seconds)
        for name in integers:
            parts[name].append(reader.integers(table, name, relative))
        for name in seconds:
            parts[name].append(reader.numbers(table, name, relative, 1)[:, 0])
    rows = {name: np.concatenate(values) for name, values in parts.items()}
    order = np.argsort(rows["episode_index"], kind="stable")
    rows = {name: values[order] for name, values in rows.items()}
    if len(np.unique(rows["episode_index"])) != len(order):
        raise reader.fail(f"{EPISODES_DIR} lists an episode_index twice")
    lengths = rows["dataset_to_index"] - rows["dataset_from_index"]
    if (lengths < 1).any():
        episode = int(rows["episode_index"][np.argmax(lengths < 1)])
        raise reader.fail(f"{EPISODES_DIR}: episode {episode} has no frames "
                          "(dataset_to_index <= dataset_from_index)")
    return rows


def _decode_video(reader: _Reader, relative: str, frame_numbers: np.ndarray,
                  image_size: int | None) -> np.ndarray:
    """The file's frames at `frame_numbers` (in that order) as uint8 [n, H, W, 3], resized to
    image_size x image_size when given and different. Frames are streamed, so memory holds only
    the frames kept."""
    import imageio_ffmpeg

    path = reader.file(relative)
    order = np.argsort(frame_numbers, kind="stable")
    kept = 0  # frames of `order` filled so far
    decoded = 0  # frames the file gave so far
    # passthrough: every decoded frame comes out once (none dropped or repeated to fit a rate)
    frames = imageio_ffmpeg.read_frames(str(path), output_params=["-fps_mode", "passthrough"])
    try:
        width, height = next(frames)["size"]
        out_h, out_w = (image_size, image_size) if image_size else (height, width)
        out = np.empty((len(frame_numbers), out_h, out_w, 3), np.uint8)
        for raw in frames:
            number, decoded = decoded, decoded + 1
            if kept < len(order) and frame_numbers[order[kept]] == number:
                frame = _resize(np.frombuffer(raw, np.uint8).reshape(height, width, 3), out_h, out_w)
                while kept < len(order) and frame_numbers[order[kept]] == number:
                    out[order[kept]] = frame
                    kept += 1
            if kept == len(order):
                break
    except (OSError, RuntimeError) as error:  # ffmpeg could not read the file
        raise reader.fail(f"{relative} cannot be decoded ({str(error).strip().splitlines()[0]})") from None
    finally:
        frames.close()
    if kept < len(order):
        raise reader.fail(f"{relative} has {decoded} frames, an episode needs frame "
                          f"{int(frame_numbers[order[kept]])}")
    return out


def _resize(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    if frame.shape[:2] == (height, width):
        return frame
    from PIL import Image

    return np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.BILINEAR))


def _decode_images(reader: _Reader, table: Any, key: str, where: str, image_size: int | None) -> np.ndarray:
    """An "image" feature's struct column {bytes, path} as uint8 [n, H, W, 3]."""
    from PIL import Image

    frames = []
    for item in reader.column(table, key, where).to_pylist():
        data = item.get("bytes") if isinstance(item, dict) else None
        if not data:
            raise reader.fail(f"{where}: an image of '{key}' holds no encoded bytes")
        frame = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        if image_size:
            frame = _resize(frame, image_size, image_size)
        elif frames and frame.shape != frames[0].shape:
            raise reader.fail(f"{where}: images of different sizes; pass image_size=N to resize them")
        frames.append(frame)
    return np.stack(frames)


def _read_frames(reader: _Reader, episodes: dict[str, np.ndarray], data_path: str, state_width: int,
                 action_width: int, image_key: str | None, image_size: int | None) -> dict[str, np.ndarray]:
    """The frame columns of every data file an episode points to (each file read once), sorted
    by the global `index`. `image_key`: an "image" feature to decode as well."""
    columns = [STATE, ACTION, REWARD, SUCCESS, *FRAME_KEYS] + ([image_key] if image_key else [])
    files = sorted(set(zip(episodes["data/chunk_index"].tolist(), episodes["data/file_index"].tolist())))
    parts: dict[str, list[np.ndarray]] = {}
    for chunk_index, file_index in files:
        relative = data_path.format(chunk_index=chunk_index, file_index=file_index)
        table = reader.read_table(relative, columns)
        parts.setdefault("index", []).append(reader.integers(table, "index", relative))
        parts.setdefault("task_index", []).append(reader.integers(table, "task_index", relative))
        parts.setdefault(STATE, []).append(reader.numbers(table, STATE, relative, state_width))
        parts.setdefault(ACTION, []).append(reader.numbers(table, ACTION, relative, action_width))
        for name in (REWARD, SUCCESS, "timestamp"):
            if name in table.column_names:
                parts.setdefault(name, []).append(reader.numbers(table, name, relative, 1)[:, 0])
        if image_key:
            parts.setdefault(image_key, []).append(_decode_images(reader, table, image_key, relative, image_size))
    if image_key and len({images.shape[1:] for images in parts[image_key]}) > 1:
        raise reader.fail(f"'{image_key}' holds images of different sizes; pass image_size=N to resize them")
    frames = {name: np.concatenate(values) for name, values in parts.items()
              if len(values) == len(files)}  # a column that only some files have is not read
    order = np.argsort(frames["index"], kind="stable")
    frames = {name: values[order] for name, values in frames.items()}
    if len(np.unique(frames["index"])) != len(order):
        raise reader.fail("its data files hold a frame index twice")
    return frames


def read_lerobot(root: str | Path, camera: str | None = None, image_size: int | None = None) -> LeRobotDemos:
    """Read a LeRobotDataset v3.0 directory: state, actions, rewards, per-step task ids, and one
    camera as pixels (decoded from its mp4 files; resized to image_size x image_size only when
    image_size is given and differs). Anything missing or inconsistent is a UserError naming it."""
    root = Path(root)
    reader = _Reader(root)
    if not root.is_dir():
        raise reader.fail("not a directory")
    try:
        info = json.loads(reader.file(INFO_PATH).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise reader.fail(f"{INFO_PATH} is not valid JSON ({error})") from None
    if not isinstance(info, dict):
        raise reader.fail(f"{INFO_PATH} is not a JSON object")
    version = str(info.get("codebase_version", ""))
    if not version.startswith("v3."):
        raise reader.fail(f"codebase_version is {version or 'missing'}; only v3.x datasets are read "
                          "(lerobot's convert_dataset_v21_to_v30 converts older ones)")
    features = info.get("features")
    if not isinstance(features, dict):
        raise reader.fail(f"{INFO_PATH} has no 'features'")
    fps = info.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise reader.fail(f"{INFO_PATH} has no valid 'fps' (got {fps!r})")
    state_width = _feature_width(reader, features, STATE)
    action_width = _feature_width(reader, features, ACTION)
    camera_key = _camera_key(reader, features, camera)
    is_video = camera_key is not None and features[camera_key]["dtype"] == "video"
    data_path = info.get("data_path") or DATA_PATH
    video_path = info.get("video_path") or VIDEO_PATH
    tasks = _read_tasks(reader)
    episodes = _read_episode_rows(reader, camera_key if is_video else None)

    frames = _read_frames(reader, episodes, data_path, state_width, action_width,
                          camera_key if not is_video else None, image_size)
    index = frames["index"]
    for name in (STATE, ACTION):
        if not np.isfinite(frames[name]).all():
            raise reader.fail(f"feature '{name}' holds non-finite values")
    unknown = sorted(set(np.unique(frames["task_index"]).tolist()) - set(tasks))
    if unknown:
        raise reader.fail(f"frames have task_index {unknown[0]}, which {TASKS_PATH} does not list")

    # rows of each episode in the sorted frames
    starts = np.searchsorted(index, episodes["dataset_from_index"])
    ends = np.searchsorted(index, episodes["dataset_to_index"])
    expected = episodes["dataset_to_index"] - episodes["dataset_from_index"]
    short = np.nonzero(ends - starts != expected)[0]
    if len(short):
        e = short[0]
        raise reader.fail(f"episode {int(episodes['episode_index'][e])} should have {int(expected[e])} "
                          f"frames (index {int(episodes['dataset_from_index'][e])} to "
                          f"{int(episodes['dataset_to_index'][e])}), its data file has {int(ends[e] - starts[e])}")

    # task ids as positions in the sorted list of task indices
    task_ids = sorted(tasks)
    position = {task_index: i for i, task_index in enumerate(task_ids)}
    step_task = np.array([position[t] for t in frames["task_index"].tolist()], np.int64)
    pixels = frames.get(camera_key) if camera_key is not None and not is_video else None
    if is_video:
        pixels = _read_video_frames(reader, episodes, frames, starts, ends, camera_key, video_path,
                                    float((features[camera_key].get("info") or {}).get("video.fps", fps)),
                                    float(fps), image_size)

    result = []
    for e in range(len(starts)):
        rows = slice(int(starts[e]), int(ends[e]))
        episode = {
            "obs": frames[STATE][rows].astype(np.float32),
            "action": frames[ACTION][rows].astype(np.float32),
            "reward": frames[REWARD][rows].astype(np.float32) if REWARD in frames
            else np.zeros(int(expected[e]), np.float32),
            "task_index": step_task[rows],
            "success": bool(frames[SUCCESS][rows].any()) if SUCCESS in frames else False,
        }
        if pixels is not None:
            episode["pixels"] = pixels[rows]
        result.append(episode)

    carried = {STATE, ACTION, REWARD, SUCCESS, DONE, camera_key, *FRAME_KEYS}
    return LeRobotDemos(
        episodes=result, tasks=[tasks[t] for t in task_ids], fps=float(fps), codebase_version=version,
        robot_type=info.get("robot_type"), camera=camera_key,
        has_reward=REWARD in frames, has_success=SUCCESS in frames,
        not_carried=[key for key in features if key not in carried],
    )


def _read_video_frames(reader: _Reader, episodes: dict[str, np.ndarray], frames: dict[str, np.ndarray],
                       starts: np.ndarray, ends: np.ndarray, key: str, video_path: str,
                       video_fps: float, fps: float, image_size: int | None) -> np.ndarray:
    """Pixels of every frame (in the sorted frame order) from the camera's mp4 files."""
    timestamps = frames["timestamp"] if "timestamp" in frames else None
    total = len(frames["index"])
    wanted: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}  # file -> (rows, frame numbers)
    for e in range(len(starts)):
        rows = np.arange(starts[e], ends[e])
        if timestamps is not None:
            seconds = timestamps[rows]
        else:  # no timestamps: frames are 1/fps apart from the episode's start
            seconds = np.arange(len(rows)) / fps
        from_timestamp = episodes[f"videos/{key}/from_timestamp"][e]
        numbers = np.rint((from_timestamp + seconds) * video_fps).astype(np.int64)
        relative = video_path.format(video_key=key, chunk_index=int(episodes[f"videos/{key}/chunk_index"][e]),
                                     file_index=int(episodes[f"videos/{key}/file_index"][e]))
        wanted.setdefault(relative, ([], []))
        wanted[relative][0].append(rows)
        wanted[relative][1].append(numbers)
    pixels = None
    for relative, (rows, numbers) in wanted.items():
        decoded = _decode_video(reader, relative, np.concatenate(numbers), image_size)
        if pixels is None:
            pixels = np.empty((total, *decoded.shape[1:]), np.uint8)
        elif decoded.shape[1:] != pixels.shape[1:]:
            raise reader.fail(f"{relative} has frames of {decoded.shape[2]}x{decoded.shape[1]}, other "
                              f"files of {pixels.shape[2]}x{pixels.shape[1]}; pass image_size=N to resize them")
        pixels[np.concatenate(rows)] = decoded
    return pixels


# ---------------------------------------------------------------- writing


def _stats(values: np.ndarray) -> dict[str, Any]:
    """lerobot's per-feature statistics over the frame axis."""
    values = values.astype(np.float64)
    stats = {
        "min": values.min(axis=0), "max": values.max(axis=0),
        "mean": values.mean(axis=0), "std": values.std(axis=0), "count": [len(values)],
    }
    for name, q in QUANTILES.items():
        stats[name] = np.quantile(values, q, axis=0)
    return {name: np.asarray(value).tolist() for name, value in stats.items()}


def _image_stats(pixels: np.ndarray) -> dict[str, Any]:
    """Per-channel statistics of frames scaled to [0, 1], each of shape [3, 1, 1] (lerobot's)."""
    frames = pixels[::max(1, len(pixels) // STATS_MAX_FRAMES)]
    stats = _stats(frames.reshape(-1, 3) / 255.0)
    stats = {name: [[[value]] for value in values] for name, values in stats.items()}
    stats["count"] = [len(frames)]  # frames, not pixels, as lerobot counts
    return stats


def _vector_column(pa: Any, values: np.ndarray) -> Any:
    """A [N, D] array as lerobot stores a feature: a scalar column for D == 1, else fixed-size lists."""
    if values.shape[1] == 1:
        return pa.array(values[:, 0])
    item = pa.from_numpy_dtype(values.dtype)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), type=pa.list_(item, values.shape[1]))


def _tasks_table(pa: Any, tasks: list[str]) -> Any:
    """meta/tasks.parquet as pandas writes a DataFrame indexed by `task`: the schema's pandas
    metadata makes pandas.read_parquet (which lerobot calls) restore `task` as the index."""
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode",
                            "numpy_type": "object", "metadata": {"encoding": "UTF-8"}}],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
             "numpy_type": "int64", "metadata": None},
            {"name": "task", "field_name": "task", "pandas_type": "unicode",
             "numpy_type": "object", "metadata": None},
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.0",
    }
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()),
                      "task": pa.array(tasks, pa.string())})
    return table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)})


def _write_video(path: Path, pixels: np.ndarray, fps: int) -> str:
    """Encode uint8 [T, H, W, 3] frames as one mp4; returns the pixel format used."""
    import imageio_ffmpeg

    height, width = pixels.shape[1:3]
    # yuv420p (what players and lerobot expect) halves the chroma planes, so it needs even sides
    pix_fmt = "yuv420p" if height % 2 == 0 and width % 2 == 0 else "yuv444p"
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = imageio_ffmpeg.write_frames(
        str(path), (width, height), fps=fps, codec=VIDEO_CODEC, pix_fmt_out=pix_fmt, quality=None,
        macro_block_size=1, output_params=["-crf", VIDEO_CRF, "-g", VIDEO_GOP],
    )
    writer.send(None)  # start ffmpeg
    for frame in pixels:
        writer.send(np.ascontiguousarray(frame))
    writer.close()
    return pix_fmt


def write_lerobot(out: str | Path, dataset: Any, fps: int, tasks: list[str], task_index: np.ndarray,
                  camera: str = "image", robot_type: str | None = None) -> dict[str, Any]:
    """Write a DemoDataset as a LeRobotDataset v3.0 directory at `out` (absent or empty; the
    directory appears whole or not at all). `tasks` are the task texts and `task_index` int [T]
    each step's index into them. Pixels become videos/observation.images.<camera>/...mp4.
    Returns a summary: episodes, frames, features written, and what was not carried."""
    pa, pq = require_pyarrow()
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"out '{out}' exists and is not an empty directory; nothing was overwritten")
    if not isinstance(fps, int) or isinstance(fps, bool) or fps < 1:
        raise UserError(f"fps must be an integer >= 1, got {fps!r}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", camera):
        raise UserError(f"camera must be a plain name (letters, digits, _ . -), got {camera!r}")
    steps, episodes = dataset.num_steps, dataset.num_episodes
    task_index = np.asarray(task_index, np.int64)
    if task_index.shape != (steps,) or task_index.min() < 0 or task_index.max() >= len(tasks):
        raise ValueError("task_index must hold one index into `tasks` per step")

    ends = dataset.episode_ends.astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    lengths = ends - starts
    episode_index = np.repeat(np.arange(episodes), lengths)
    frame_index = np.arange(steps) - np.repeat(starts, lengths)
    timestamp = (frame_index / fps).astype(np.float32)
    last_frame = np.zeros(steps, bool)
    last_frame[ends - 1] = True
    success = last_frame & np.repeat(dataset.episode_success.astype(bool), lengths)

    obs, action = dataset.obs.astype(np.float32), dataset.action.astype(np.float32)
    reward = dataset.reward.astype(np.float32)
    scalar = {"shape": [1], "names": None}
    features: dict[str, dict[str, Any]] = {
        STATE: {"dtype": "float32", "shape": [obs.shape[1]], "names": [f"state_{i}" for i in range(obs.shape[1])]},
        ACTION: {"dtype": "float32", "shape": [action.shape[1]],
                 "names": [f"action_{i}" for i in range(action.shape[1])]},
    }
    video_key = None
    if dataset.pixels is not None:
        video_key = IMAGE_PREFIX + camera
        height, width = dataset.pixels.shape[1:3]
        features[video_key] = {"dtype": "video", "shape": [height, width, 3],
                               "names": ["height", "width", "channels"], "info": None}
    features |= {
        REWARD: {"dtype": "float32", **scalar}, SUCCESS: {"dtype": "bool", **scalar},
        DONE: {"dtype": "bool", **scalar}, "timestamp": {"dtype": "float32", **scalar},
        "frame_index": {"dtype": "int64", **scalar}, "episode_index": {"dtype": "int64", **scalar},
        "index": {"dtype": "int64", **scalar}, "task_index": {"dtype": "int64", **scalar},
    }
    data = pa.table({
        STATE: _vector_column(pa, obs), ACTION: _vector_column(pa, action),
        REWARD: pa.array(reward), SUCCESS: pa.array(success), DONE: pa.array(last_frame),
        "timestamp": pa.array(timestamp), "frame_index": pa.array(frame_index, pa.int64()),
        "episode_index": pa.array(episode_index, pa.int64()), "index": pa.array(np.arange(steps), pa.int64()),
        "task_index": pa.array(task_index, pa.int64()),
    })
    episode_columns: dict[str, Any] = {
        "episode_index": pa.array(np.arange(episodes), pa.int64()),
        "tasks": pa.array([[tasks[i] for i in np.unique(task_index[s:e]).tolist()]
                           for s, e in zip(starts.tolist(), ends.tolist())], pa.list_(pa.string())),
        "length": pa.array(lengths, pa.int64()),
        "data/chunk_index": pa.array(np.zeros(episodes), pa.int64()),
        "data/file_index": pa.array(np.zeros(episodes), pa.int64()),
        "dataset_from_index": pa.array(starts, pa.int64()),
        "dataset_to_index": pa.array(ends, pa.int64()),
    }
    if video_key is not None:
        episode_columns |= {
            f"videos/{video_key}/chunk_index": pa.array(np.zeros(episodes), pa.int64()),
            f"videos/{video_key}/file_index": pa.array(np.zeros(episodes), pa.int64()),
            # one video file holds every episode back to back
            f"videos/{video_key}/from_timestamp": pa.array(starts / fps, pa.float64()),
            f"videos/{video_key}/to_timestamp": pa.array(ends / fps, pa.float64()),
        }
    episode_columns |= {"meta/episodes/chunk_index": pa.array(np.zeros(episodes), pa.int64()),
                        "meta/episodes/file_index": pa.array(np.zeros(episodes), pa.int64())}

    stats = {STATE: _stats(obs), ACTION: _stats(action), REWARD: _stats(reward[:, None]),
             SUCCESS: _stats(success[:, None]), DONE: _stats(last_frame[:, None]),
             "timestamp": _stats(timestamp[:, None]), "frame_index": _stats(frame_index[:, None]),
             "episode_index": _stats(episode_index[:, None]), "index": _stats(np.arange(steps)[:, None]),
             "task_index": _stats(task_index[:, None])}

    info = {
        "codebase_version": CODEBASE_VERSION, "robot_type": robot_type,
        "total_episodes": episodes, "total_frames": steps, "total_tasks": len(tasks),
        "chunks_size": CHUNKS_SIZE, "data_files_size_in_mb": DATA_FILES_SIZE_IN_MB,
        "video_files_size_in_mb": VIDEO_FILES_SIZE_IN_MB, "fps": fps,
        "splits": {"train": f"0:{episodes}"},
        "data_path": DATA_PATH, "video_path": VIDEO_PATH if video_key is not None else None,
        "features": features,
    }
    first = {"chunk_index": 0, "file_index": 0}
    with atomic_dir(out) as tmp:
        (tmp / "meta").mkdir()
        (tmp / DATA_PATH.format(**first)).parent.mkdir(parents=True)
        pq.write_table(data, tmp / DATA_PATH.format(**first))
        (tmp / EPISODES_PATH.format(**first)).parent.mkdir(parents=True)
        pq.write_table(pa.table(episode_columns), tmp / EPISODES_PATH.format(**first))
        pq.write_table(_tasks_table(pa, tasks), tmp / TASKS_PATH)
        if video_key is not None:
            pix_fmt = _write_video(tmp / VIDEO_PATH.format(video_key=video_key, **first), dataset.pixels, fps)
            features[video_key]["info"] = {
                "video.height": int(dataset.pixels.shape[1]), "video.width": int(dataset.pixels.shape[2]),
                "video.codec": "h264", "video.pix_fmt": pix_fmt, "video.is_depth_map": False,
                "video.fps": fps, "video.channels": 3, "has_audio": False,
            }
            stats[video_key] = _image_stats(dataset.pixels)
        (tmp / INFO_PATH).write_text(json.dumps(info, indent=4) + "\n")
        (tmp / STATS_PATH).write_text(json.dumps(stats, indent=4) + "\n")
    return {
        "out": str(out), "format": f"lerobot {CODEBASE_VERSION}", "episodes": episodes, "frames": steps,
        "fps": fps, "tasks": list(tasks), "features": list(features), "video": video_key,
    }
