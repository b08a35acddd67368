"""Offscreen rendering with mujoco.Renderer, shared by the MuJoCo backends.

Headless machines need MUJOCO_GL=egl (or osmesa). Shadows, reflections and multisampling are off:
on software GL that is 14-30x faster, and a fixed task camera needs none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def make_renderer(model: Any, size: int) -> Any:
    """A size x size offscreen renderer for `model` (grows the model's offscreen buffer if needed)."""
    import mujoco

    model.vis.quality.offsamples = 0
    model.vis.global_.offwidth = max(int(model.vis.global_.offwidth), size)
    model.vis.global_.offheight = max(int(model.vis.global_.offheight), size)
    renderer = mujoco.Renderer(model, height=size, width=size)
    renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = False
    renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = False
    return renderer


def render_datas(renderer: Any, datas: Sequence[Any], camera: str) -> np.ndarray:
    """Frames uint8 [k, H, W, 3] of `camera`, one per MjData (kinematics must be current)."""
    frames = np.empty((len(datas), renderer.height, renderer.width, 3), dtype=np.uint8)
    for row, data in enumerate(datas):
        renderer.update_scene(data, camera=camera)
        frames[row] = renderer.render()
    return frames
