"""Training windows: an observation history of To steps and an action chunk of H steps.

A window is anchored at a "current" step t of an episode [start, end):

    obs     = steps t-To+1 .. t            (To steps, the history the policy sees)
    action  = steps t-To+1 .. t-To+H       (H steps; index To-1 of the chunk is the action at t)

Indices before the episode start repeat the first step and indices past the end repeat the last
one, as diffusion_policy pads its sequences. Every step of every episode is an anchor, so each
executed part of a chunk (from index To-1 on) starts inside the episode. All index arrays are
built once with numpy broadcasting; a training batch is one gather, with no per-sample Python.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from embodied_rl.data.dataset import DemoDataset
from embodied_rl.data.normalizer import Normalizer
from embodied_rl.errors import UserError


def window_indices(
    episode_ends: np.ndarray, n_obs_steps: int, horizon: int
) -> tuple[np.ndarray, np.ndarray]:
    """(obs_index [M, To], action_index [M, H]) into the step axis, one row per window."""
    if n_obs_steps < 1 or horizon < n_obs_steps:
        raise ValueError(f"need 1 <= n_obs_steps <= horizon, got To={n_obs_steps}, H={horizon}")
    ends = np.asarray(episode_ends, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    lengths = ends - starts
    anchor = np.arange(ends[-1], dtype=np.int64)  # every step is a window's current step
    episode_start = np.repeat(starts, lengths)[:, None]
    episode_last = np.repeat(ends - 1, lengths)[:, None]
    first = anchor[:, None] - (n_obs_steps - 1)
    obs_index = np.clip(first + np.arange(n_obs_steps), episode_start, episode_last)
    action_index = np.clip(first + np.arange(horizon), episode_start, episode_last)
    return obs_index, action_index


class ChunkWindows:
    """All windows of a demo dataset, served as torch batches in environment units.

    batch keys: "obs" f32 [B, To, D] and "action" f32 [B, H, A], plus "pixels" u8
    [B, To, h, w, 3] when obs_mode == "pixels" and "instruction" int64 [B, To] (ids into
    `instructions`, at the steps of "obs") when the dataset has instructions. The policy
    normalises obs and actions with the Normalizer it carries (fit with `fit_normalizer`) and its
    image encoder scales pixels to [0, 1].
    """

    def __init__(
        self,
        dataset: DemoDataset,
        n_obs_steps: int,
        horizon: int,
        obs_mode: str = "state",
        device: str | torch.device = "cpu",
    ):
        if obs_mode not in ("state", "pixels"):
            raise UserError(f"unknown obs_mode '{obs_mode}' (choose from: state, pixels)")
        if obs_mode == "pixels" and dataset.pixels is None:
            raise UserError(
                f"obs_mode=pixels but dataset '{dataset.path}' has no pixels "
                "(collect it with pixels=true)"
            )
        obs_index, action_index = window_indices(dataset.episode_ends, n_obs_steps, horizon)
        self.obs_index = torch.from_numpy(obs_index).to(device)
        self.action_index = torch.from_numpy(action_index).to(device)
        self.obs = torch.as_tensor(dataset.obs, dtype=torch.float32).to(device)
        self.action = torch.as_tensor(dataset.action, dtype=torch.float32).to(device)
        self.pixels = torch.from_numpy(dataset.pixels).to(device) if obs_mode == "pixels" else None
        self.instructions = list(dataset.instructions)
        self.instruction = (torch.as_tensor(dataset.instruction, dtype=torch.long).to(device)
                            if dataset.instruction is not None else None)
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.obs_index)

    def batch(self, indices: Tensor) -> dict[str, Tensor]:
        indices = indices.to(self.device)
        out = {"obs": self.obs[self.obs_index[indices]], "action": self.action[self.action_index[indices]]}
        if self.pixels is not None:
            out["pixels"] = self.pixels[self.obs_index[indices]]
        if self.instruction is not None:
            out["instruction"] = self.instruction[self.obs_index[indices]]
        return out

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        indices = torch.randint(len(self), (batch_size,), generator=generator)
        return self.batch(indices)


def fit_normalizer(dataset: DemoDataset, mode: str = "minmax") -> Normalizer:
    """Statistics of a dataset's obs and actions (pixels are scaled by the image encoder)."""
    return Normalizer.fit({"obs": dataset.obs, "action": dataset.action}, mode)
