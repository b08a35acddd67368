"""Batched offscreen rendering, shared by the MuJoCo backends.

Headless machines need MUJOCO_GL=egl (or osmesa). Shadows, reflections and multisampling are off:
on software GL that is 14-30x faster, and a fixed task camera needs none of them.

`BatchRenderer` draws many frames of one model as tiles of one offscreen framebuffer: one GL
context, one MjrContext and one MjvScene per env object; per frame `mjv_updateScene` and
`mjr_render` into the frame's tile, then one `mjr_readPixels` for the whole batch. On software GL
(Mesa llvmpipe) a readback waits for the rasteriser to finish everything queued, so one readback
per batch instead of one per frame lets it work on all frames at once. The frames are the same
as one mujoco.Renderer per frame draws (tests/envs/test_tabletop.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

MIN_SIDE = 1024  # framebuffer side: 256 frames of 64 x 64, or 16 of 256 x 256, per readback


def camera_names(model: Any) -> list[str]:
    """The names of a MuJoCo model's cameras."""
    import mujoco

    return [mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(model.ncam)]


class BatchRenderer:
    """Frames of `camera` (a camera name; "" for MuJoCo's default free camera) of `model`."""

    def __init__(self, model: Any, camera: str):
        import mujoco

        self._mujoco = mujoco
        self.model = model
        self.camera = mujoco.MjvCamera()
        if camera:
            camera_id = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, camera)
            if camera_id < 0:
                raise ValueError(f"the model has no camera named '{camera}'")
            self.camera.type = mujoco.mjtCamera.mjCAMERA_FIXED
            self.camera.fixedcamid = camera_id
        else:
            mujoco.mjv_defaultFreeCamera(model, self.camera)
        self.option = mujoco.MjvOption()
        self.scene = mujoco.MjvScene(model, maxgeom=max(100, 2 * model.ngeom + 20))
        self.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = False
        self.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = False
        self.side = 0  # framebuffer side in pixels; the context is made on first use
        self._gl = None
        self._context = None

    def _make_context(self, side: int) -> None:
        """One GL context and MjrContext whose offscreen framebuffer is side x side."""
        mujoco = self._mujoco
        from mujoco import gl_context

        self.close()
        model = self.model
        model.vis.quality.offsamples = 0
        model.vis.global_.offwidth = max(int(model.vis.global_.offwidth), side)
        model.vis.global_.offheight = max(int(model.vis.global_.offheight), side)
        if gl_context.GLContext is not None:
            self._gl = gl_context.GLContext(side, side)
            self._gl.make_current()
        self._context = mujoco.MjrContext(model, mujoco.mjtFontScale.mjFONTSCALE_100.value)
        mujoco.mjr_setBuffer(mujoco.mjtFramebuffer.mjFB_OFFSCREEN.value, self._context)
        self.side = side

    def render(self, datas: Iterable[Any], count: int, size: int) -> np.ndarray:
        """uint8 [count, size, size, 3]: one frame per MjData that `datas` yields (kinematics
        current). Each MjData is read before the next is asked for, so a generator may refill
        one MjData for every frame."""
        mujoco = self._mujoco
        if size > self.side:
            self._make_context(max(MIN_SIDE, size))
        if self._gl is not None:
            self._gl.make_current()
        frames = np.empty((count, size, size, 3), dtype=np.uint8)
        columns = self.side // size
        per_pass = columns * columns
        datas = iter(datas)
        for start in range(0, count, per_pass):
            k = min(per_pass, count - start)
            rows = -(-k // columns)
            cols = min(k, columns)
            for tile in range(k):
                mujoco.mjv_updateScene(self.model, next(datas), self.option, None, self.camera,
                                       mujoco.mjtCatBit.mjCAT_ALL.value, self.scene)
                row, col = divmod(tile, columns)
                mujoco.mjr_render(mujoco.MjrRect(col * size, row * size, size, size), self.scene, self._context)
            pixels = np.empty((rows * size, cols * size, 3), dtype=np.uint8)
            mujoco.mjr_readPixels(pixels, None, mujoco.MjrRect(0, 0, cols * size, rows * size), self._context)
            # tile (row, col) -> frame row * columns + col; GL rows run bottom-up within a tile
            tiles = pixels.reshape(rows, size, cols, size, 3).transpose(0, 2, 1, 3, 4).reshape(-1, size, size, 3)
            frames[start : start + k] = tiles[:k, ::-1]
        return frames

    def close(self) -> None:
        if self._context is not None:
            if self._gl is not None:
                self._gl.make_current()
            self._context.free()
            self._context = None
        if self._gl is not None:
            self._gl.free()
            self._gl = None
        self.side = 0


def pool_frames(pixels: Any, size: int) -> Any:
    """u8 frames [N, H, H, C] mean-pooled to [N, size, size, C], H a multiple of size (the same
    frames when H == size). Why: a camera rendered finer than a pixel policy reads (a reward model
    that needs 2 cm of detail beside a 64x64 policy) still shows the policy its own size; pooling
    a 128x128 render to 64x64 left the tabletop VLA's success within its interval (77.5% vs 76.5%
    rendered at 64, the same 200 episodes)."""
    side = int(pixels.shape[1])
    if side == size:
        return pixels
    if side % size or pixels.shape[2] != side:
        raise ValueError(f"cannot pool {side}x{pixels.shape[2]} frames to {size}x{size}: not a square multiple")
    factor = side // size
    n, channels = pixels.shape[0], pixels.shape[3]
    pooled = pixels.float().reshape(n, size, factor, size, factor, channels).mean(dim=(2, 4))
    return pooled.round().to(pixels.dtype)
