"""Shared test set-up: headless rendering and small, deterministic torch."""

import os

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

import torch  # noqa: E402

# Two cores on CI: one torch thread per process keeps tests fast and reproducible.
torch.set_num_threads(1)
