"""The on-disk demo format: a zarr group with episode ends, as in diffusion_policy.

    <name>.zarr/
      data/obs             float32 [T, D]   state observation at each step
      data/action          float32 [T, A]   action taken at that step, in [-1, 1]
      data/reward          float32 [T]
      data/pixels          uint8 [T, H, W, 3]   only when collected with pixels=true
      data/instruction     int64 [T]        only for a task with instructions: the step's
                                            instruction id, an index into attrs["instructions"]
      data/step_success    bool [T]         the simulator's success at the state the step
                                            reached (info["success"]; datasets from collect)
      meta/final_obs       float32 [E, D]   the state observation each episode ended in (the
                                            state its last step reached; datasets from collect)
      meta/final_pixels    uint8 [E, H, W, 3]   its frame, with data/pixels
      meta/episode_ends    int64 [E]        exclusive end index of each episode in the step axis
      meta/episode_success bool [E]
      attrs: format, task, obs_dim, action_dim, instructions (list of str, with data/instruction),
        plus whatever the collector records

Episode e covers steps [episode_ends[e-1], episode_ends[e]) (0 for the first episode).
Row t holds the observation *before* step t's action; the state that action reached is row t+1's
observation, or meta/final_obs for an episode's last step. step_success and the final
observations are what the reward models of train-reward learn from (embodied_rl/rewards).
Writes go to a temporary sibling and are renamed into place, so a dataset is whole or absent.
Every chunk is written, even one that holds only zeros (zarr skips those by default, and a
missing chunk reads as zeros): `load` refuses an array with a missing chunk file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embodied_rl.errors import UserError
from embodied_rl.runs import atomic_dir

FORMAT = "embodied_rl.demos/v1"
STEP_KEYS = ("obs", "action", "reward")
OPTIONAL_KEYS = ("pixels", "instruction", "step_success")  # per-step arrays some datasets have
FINAL_KEYS = ("final_obs", "final_pixels")  # per-episode arrays some datasets have (meta/)
# attrs flag of datasets whose every chunk was written (write_empty_chunks); in older ones a chunk
# of all-zero rewards or all-False successes may be absent on purpose
ALL_CHUNKS = "all_chunks_written"
# arrays that never hold a whole chunk of zeros, so a missing chunk is damage in any dataset
NEVER_ZERO = ("data/obs", "data/action", "data/pixels", "meta/episode_ends", "meta/final_pixels")
WRITE_EVERY_CHUNK = {"write_empty_chunks": True}


def write_demos(path: str | Path, episodes: list[dict[str, np.ndarray]], attrs: dict[str, Any]) -> Path:
    """Write episodes (dicts of per-step arrays: obs, action, reward, optional pixels,
    instruction and step_success, a scalar `success`, and optionally the episode's `final_obs`
    [D] and `final_pixels` [H, W, 3]) as one zarr dataset at `path`; episodes with an
    instruction need attrs["instructions"]. Refuses to overwrite an existing path."""
    import zarr

    path = Path(path)
    if path.exists():
        raise UserError(f"dataset path '{path}' already exists; nothing was overwritten")
    if not episodes:
        raise UserError("no episodes to write")
    keys = list(STEP_KEYS) + [key for key in OPTIONAL_KEYS if key in episodes[0]]
    if "instruction" in keys and not attrs.get("instructions"):
        raise ValueError("episodes with an instruction need attrs['instructions'] (the instruction texts)")
    lengths = [len(ep["action"]) for ep in episodes]
    with atomic_dir(path) as tmp:
        root = zarr.open_group(str(tmp), mode="w")
        data = root.create_group("data")
        for key in keys:
            array = np.concatenate([np.asarray(ep[key]) for ep in episodes], axis=0)
            if key == "instruction":
                array = array.astype(np.int64)
            elif key == "step_success":
                array = array.astype(bool)
            elif key != "pixels":
                array = array.astype(np.float32)
            chunks = (min(len(array), 1024 if key != "pixels" else 64),) + array.shape[1:]
            data.create_array(key, data=array, chunks=chunks, config=WRITE_EVERY_CHUNK)
        meta = root.create_group("meta")
        meta.create_array("episode_ends", data=np.cumsum(lengths).astype(np.int64), config=WRITE_EVERY_CHUNK)
        success = np.array([bool(ep.get("success", False)) for ep in episodes])
        meta.create_array("episode_success", data=success, config=WRITE_EVERY_CHUNK)
        for key in FINAL_KEYS:
            if key in episodes[0]:
                array = np.stack([np.asarray(ep[key]) for ep in episodes])
                array = array if key == "final_pixels" else array.astype(np.float32)
                meta.create_array(key, data=array, chunks=(min(len(array), 64),) + array.shape[1:],
                                  config=WRITE_EVERY_CHUNK)
        root.attrs.update({"format": FORMAT, **attrs, ALL_CHUNKS: True})
    return path


def _check_every_chunk(root: Any, path: Path, strict: bool) -> None:
    """Refuse an array whose chunk files are not all there: zarr would read them as zeros."""
    for group in ("data", "meta"):
        for name, array in root[group].arrays():
            key = f"{group}/{name}"
            if (strict or key in NEVER_ZERO) and array.nchunks_initialized < array.nchunks:
                missing = array.nchunks - array.nchunks_initialized
                raise UserError(f"dataset '{path}' is incomplete: {key} is missing {missing} of its "
                                f"{array.nchunks} chunk files")


def _check_instructions(path: Path, instruction: np.ndarray | None, texts: Any) -> list[str]:
    """The dataset's instruction texts ([] when it has none); refuses a step array without its
    texts (or the reverse), non-integer ids and ids outside the list."""
    if instruction is None and not texts:
        return []
    if instruction is None:
        raise UserError(f"dataset '{path}' is corrupt: attrs list instructions but data/instruction is missing")
    if not texts or not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
        raise UserError(f"dataset '{path}' is corrupt: data/instruction needs attrs['instructions'], "
                        "a list of instruction texts")
    if instruction.ndim != 1 or not np.issubdtype(instruction.dtype, np.integer):
        raise UserError(f"dataset '{path}' is corrupt: data/instruction must be integer ids [T], "
                        f"got {instruction.dtype} {instruction.shape}")
    if len(instruction) and (instruction.min() < 0 or instruction.max() >= len(texts)):
        raise UserError(f"dataset '{path}' is corrupt: data/instruction holds ids outside "
                        f"[0, {len(texts)}) (attrs['instructions'] has {len(texts)})")
    return list(texts)


def read_actions(path: str | Path) -> np.ndarray:
    """Only the actions [T, A] of a demo dataset (a pixel dataset's frames stay on disk)."""
    import zarr

    try:
        root = zarr.open_group(str(path), mode="r")
        if root.attrs.get("format") != FORMAT:
            raise UserError(f"dataset '{path}' has format {root.attrs.get('format')!r}, expected {FORMAT!r}")
        return np.asarray(root["data"]["action"][:], dtype=np.float32)
    except UserError:
        raise
    except Exception as error:  # zarr raises many types for a corrupt store
        raise UserError(f"dataset '{path}' is corrupt or not a demo dataset ({type(error).__name__}: {error})") from None


@dataclass
class DemoDataset:
    """A demo dataset loaded into memory (the built-in tasks' datasets are small)."""

    path: Path
    obs: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    episode_ends: np.ndarray
    episode_success: np.ndarray
    pixels: np.ndarray | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    instruction: np.ndarray | None = None  # int64 [T]: index into `instructions`, per step
    instructions: list[str] = field(default_factory=list)  # the task's instructions ([]: none)
    step_success: np.ndarray | None = None  # bool [T]: success at the state step t reached
    final_obs: np.ndarray | None = None  # float32 [E, D]: the state each episode ended in
    final_pixels: np.ndarray | None = None  # uint8 [E, H, W, 3]: its frame

    @property
    def num_episodes(self) -> int:
        return len(self.episode_ends)

    @property
    def num_steps(self) -> int:
        return len(self.action)

    def episode_bounds(self, episode: int) -> tuple[int, int]:
        start = 0 if episode == 0 else int(self.episode_ends[episode - 1])
        return start, int(self.episode_ends[episode])

    @classmethod
    def load(cls, path: str | Path, max_episodes: int | None = None) -> DemoDataset:
        """Load a dataset; any missing or inconsistent part is a UserError naming it."""
        import zarr

        path = Path(path)
        if not path.exists():
            raise UserError(f"dataset '{path}' does not exist")
        try:
            root = zarr.open_group(str(path), mode="r")
            attrs = dict(root.attrs)
            _check_every_chunk(root, path, strict=bool(attrs.get(ALL_CHUNKS)))
            arrays = {key: root["data"][key][:] for key in STEP_KEYS}
            pixels = root["data"]["pixels"][:] if "pixels" in root["data"] else None
            instruction = root["data"]["instruction"][:] if "instruction" in root["data"] else None
            step_success = root["data"]["step_success"][:].astype(bool) if "step_success" in root["data"] else None
            finals = {key: root["meta"][key][:] for key in FINAL_KEYS if key in root["meta"]}
            ends = root["meta"]["episode_ends"][:].astype(np.int64)
            success = root["meta"]["episode_success"][:].astype(bool)
        except UserError:
            raise
        except Exception as error:  # zarr raises many types for a corrupt store
            raise UserError(f"dataset '{path}' is corrupt or not a demo dataset ({type(error).__name__}: {error})") from None
        if attrs.get("format") != FORMAT:
            raise UserError(f"dataset '{path}' has format {attrs.get('format')!r}, expected {FORMAT!r}")
        steps = len(arrays["action"])
        lengths = {key: len(value) for key, value in arrays.items()}
        if pixels is not None:
            lengths["pixels"] = len(pixels)
        if instruction is not None:
            lengths["instruction"] = len(instruction)
        if step_success is not None:
            lengths["step_success"] = len(step_success)
        if len(set(lengths.values())) != 1:
            raise UserError(f"dataset '{path}' is corrupt: step arrays have different lengths {lengths}")
        if len(ends) == 0 or ends[-1] != steps or np.any(np.diff(ends) <= 0) or len(success) != len(ends):
            raise UserError(f"dataset '{path}' is corrupt: meta/episode_ends does not match {steps} steps")
        for key, value in finals.items():
            if len(value) != len(ends):
                raise UserError(f"dataset '{path}' is corrupt: meta/{key} holds {len(value)} episodes, "
                                f"meta/episode_ends {len(ends)}")
        if not (np.isfinite(arrays["obs"]).all() and np.isfinite(arrays["action"]).all()):
            raise UserError(f"dataset '{path}' is corrupt: non-finite values in obs or action")
        instructions = _check_instructions(path, instruction, attrs.get("instructions"))
        if instruction is not None:
            instruction = instruction.astype(np.int64)
        dataset = cls(path, arrays["obs"], arrays["action"], arrays["reward"], ends, success, pixels, attrs,
                      instruction, instructions, step_success, finals.get("final_obs"), finals.get("final_pixels"))
        if max_episodes is not None and max_episodes < dataset.num_episodes:
            dataset = dataset.first_episodes(max_episodes)
        return dataset

    def first_episodes(self, count: int) -> DemoDataset:
        end = int(self.episode_ends[count - 1])
        return DemoDataset(
            self.path, self.obs[:end], self.action[:end], self.reward[:end],
            self.episode_ends[:count], self.episode_success[:count],
            None if self.pixels is None else self.pixels[:end], dict(self.attrs),
            None if self.instruction is None else self.instruction[:end], list(self.instructions),
            None if self.step_success is None else self.step_success[:end],
            None if self.final_obs is None else self.final_obs[:count],
            None if self.final_pixels is None else self.final_pixels[:count],
        )
