"""Native MuJoCo on the CPU: one persistent MjData per env, stepped from a thread pool.

mj_step releases the GIL, so each worker thread steps a contiguous slice of envs. After a step a
worker copies its envs' qpos/qvel/sensordata/ctrl into batched numpy buffers; `state` exposes
those buffers to torch as views (torch.from_numpy, no copies). MjData stays the simulator's own
state; the SimState views are read-only by convention.

Sensors are computed at the start of mj_step, so after a plain mj_step `sensordata` describes the
state before the last integration. Each control step therefore runs
`mj_step2, mj_step x (substeps - 1), mj_step1`: the same physics as `substeps` mj_steps, with
position and velocity sensors (and kinematics, for rendering) of the state actually reached.

`mujoco.rollout` was measured as the alternative (docs/BENCHMARKS.md); it cannot report
per-env warnings nor keep sensors in step with the state, and was not faster at N=64.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor

from embodied_rl.envs.api import SimBatchedEnv, SimState, Task
from embodied_rl.envs.render import make_renderer, render_datas

# Warnings after which MuJoCo has reset the data itself: the physics went unstable.
_UNSTABLE_WARNINGS = ("mjWARN_BADQPOS", "mjWARN_BADQVEL", "mjWARN_BADQACC", "mjWARN_BADCTRL")


def default_threads(num_envs: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, num_envs))


class MujocoCpuEnv(SimBatchedEnv):
    """BatchedEnv on native MuJoCo (float64 inside, float32 outside)."""

    def __init__(
        self,
        task: Task,
        num_envs: int,
        device: str | torch.device = "cpu",
        seed: int = 0,
        obs_mode: str = "state",
        image_size: int = 96,
        render_size: int = 256,
        threads: int | None = None,
    ):
        import mujoco

        self._mujoco = mujoco
        model = task.load_model()
        super().__init__(task, model, num_envs, device, seed, obs_mode, image_size, render_size)
        n = self.num_envs
        self.datas = [mujoco.MjData(model) for _ in range(n)]
        self._qpos = np.zeros((n, model.nq))
        self._qvel = np.zeros((n, model.nv))
        self._sensordata = np.zeros((n, model.nsensordata))
        self._ctrl = np.zeros((n, model.nu))
        self._unstable = np.zeros(n, dtype=bool)
        self._state = SimState(
            qpos=torch.from_numpy(self._qpos),
            qvel=torch.from_numpy(self._qvel),
            sensordata=torch.from_numpy(self._sensordata),
            ctrl=torch.from_numpy(self._ctrl),
        )
        self._warning_ids = np.array([int(getattr(mujoco.mjtWarning, name)) for name in _UNSTABLE_WARNINGS])
        self.substeps = int(task.control_substeps)
        self.threads = default_threads(n) if threads is None else max(1, min(int(threads), n))
        bounds = np.linspace(0, n, self.threads + 1).round().astype(int)
        self._slices = [range(bounds[i], bounds[i + 1]) for i in range(self.threads)]
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self._renderers: dict[int, Any] = {}

    # ---- physics primitives ----
    @property
    def state(self) -> SimState:
        return self._state

    def _copy_out(self, i: int, data: Any) -> None:
        self._qpos[i] = data.qpos
        self._qvel[i] = data.qvel
        self._sensordata[i] = data.sensordata
        self._ctrl[i] = data.ctrl

    def _write_state(self, env_ids: Tensor, qpos: Tensor, qvel: Tensor) -> None:
        mujoco = self._mujoco
        qpos = qpos.detach().cpu().double().numpy()
        qvel = qvel.detach().cpu().double().numpy()
        for row, i in enumerate(env_ids.tolist()):
            data = self.datas[i]
            mujoco.mj_resetData(self.model, data)  # zero ctrl, time, warmstart, warnings
            data.qpos[:] = qpos[row]
            data.qvel[:] = qvel[row]
            mujoco.mj_forward(self.model, data)
            self._copy_out(i, data)

    def _step_slice(self, envs: range, ctrl: np.ndarray) -> None:
        mujoco, model, warnings = self._mujoco, self.model, self._warning_ids
        qpos, qvel, sensordata = self._qpos, self._qvel, self._sensordata
        for i in envs:
            data = self.datas[i]
            data.ctrl[:] = ctrl[i]
            mujoco.mj_step2(model, data)
            if self.substeps > 1:
                mujoco.mj_step(model, data, self.substeps - 1)
            mujoco.mj_step1(model, data)
            # MuJoCo resets an env's data itself on these warnings; SimBatchedEnv then resets
            # the env properly (mj_resetData in _write_state clears the counters)
            self._unstable[i] = data.warning.number[warnings].any()
            qpos[i] = data.qpos
            qvel[i] = data.qvel
            sensordata[i] = data.sensordata

    def _step_physics(self, ctrl: Tensor) -> Tensor:
        ctrl_np = ctrl.detach().cpu().double().numpy()
        self._ctrl[:] = ctrl_np
        if self._pool is None:
            self._step_slice(range(self.num_envs), ctrl_np)
        else:
            for future in [self._pool.submit(self._step_slice, s, ctrl_np) for s in self._slices]:
                future.result()
        return torch.from_numpy(self._unstable.copy())

    def _render_frames(self, env_ids: Tensor, size: int) -> Tensor:
        datas = [self.datas[i] for i in env_ids.tolist()]
        return torch.from_numpy(render_datas(self._renderer(size), datas, self.task.camera))

    def _renderer(self, size: int) -> Any:
        """One offscreen renderer per image size, created on first use."""
        if size not in self._renderers:
            self._renderers[size] = make_renderer(self.model, size)
        return self._renderers[size]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for renderer in self._renderers.values():
            renderer.close()
        self._renderers.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def make_env(task: Task, num_envs: int, device: str = "cpu", seed: int = 0, **options: Any) -> MujocoCpuEnv:
    return MujocoCpuEnv(task, num_envs, device, seed, **options)
