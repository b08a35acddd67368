"""Native MuJoCo on the CPU: one persistent MjData per env, stepped from a thread pool.

mj_step releases the GIL, so threads step envs in parallel. Each thread (the calling one and
`threads - 1` pool workers) makes one Python call per control step: a loop that takes env indices
from a shared iterator (so a thread the OS leaves waiting on a busy machine holds nobody back)
and, per env, writes ctrl, steps, and copies qpos/qvel/sensordata into batched numpy buffers
through numpy views made once at construction; `state` exposes those buffers to torch as views
(torch.from_numpy, no copies). MjData stays the simulator's own state; the SimState views are
read-only by convention.

Sensors are computed at the start of mj_step, so after a plain mj_step `sensordata` describes the
state before the last integration. Each control step therefore runs
`mj_step2, mj_step x (substeps - 1), mj_step1`: the same physics as `substeps` mj_steps, with
position and velocity sensors (and kinematics, for rendering) of the state actually reached.
MuJoCo cannot split an RK4 step (mj_step2 falls back to Euler), so RK4 models run
`mj_step x substeps, mj_step1` instead: one extra position/velocity pass per control step, for
the sensors. An RK4 model without sensors (hopper: the task reads qpos and qvel only) skips that
pass (every RK4 mj_step starts with a full mj_forward, so the physics is the same), and rendering
runs mj_fwdPosition on the frames it draws instead.

Instability: on a bad qpos/qvel/qacc MuJoCo resets the data itself, which puts `time` back to 0,
so an env whose clock did not advance by `substeps` timesteps is reported unstable (one numpy
comparison instead of reading warning counters per env); non-finite state is caught by one
numpy reduction over the batched buffers. The clock cannot tell on the first step after a write
(it starts from 0 either way), so there MuJoCo's warning counters are read, for those envs only;
a written state runs MuJoCo's own checks (mj_checkPos/Vel/Acc, as mj_step does), and one it
refuses is reported to SimBatchedEnv, which counts the env unstable on its next step.

Snapshots (`get_state`): mj_getState(mjSTATE_INTEGRATION) per env (time, qpos, qvel, act,
warmstart, ctrl, applied forces, mocap, ...) plus the batched buffers as they are (sensordata of
acceleration sensors is only refreshed by the next step); restoring runs mj_step1, which
recomputes what the last control step's mj_step1 left for the next mj_step2.

`mujoco.rollout` was measured as the alternative (benchmarks/mujoco_cpu_steps.py): it needs no
GIL at all, but zeroes the solver warmstart at every call, stops an env's rollout at any
warning, and its sensordata lags one substep (fixing that costs an extra substep per control
step); the thread pool stays.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor

from embodied_rl.envs.api import SimBatchedEnv, SimState, Task
from embodied_rl.envs.render import BatchRenderer
from embodied_rl.errors import UserError


def default_threads(num_envs: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, num_envs))


class MujocoCpuEnv(SimBatchedEnv):
    """BatchedEnv on native MuJoCo (float64 inside, float32 outside).

    Args beyond SimBatchedEnv's (`options`: device, seed, obs_mode, image_size, render_size):
        threads: the threads that step the envs (None: one per core, at most one per env).
    """

    def __init__(self, task: Task, num_envs: int, threads: int | None = None, **options: Any):
        import mujoco

        self._mujoco = mujoco
        model = task.load_model()
        super().__init__(task, model, num_envs, **options)
        n, nq, nv = self.num_envs, model.nq, model.nv
        self.datas = [mujoco.MjData(model) for _ in range(n)]
        # One row per env holding [qpos | qvel | sensordata]: one numpy call checks finiteness.
        self._buffer = np.zeros((n, nq + nv + model.nsensordata))
        self._qpos = self._buffer[:, :nq]
        self._qvel = self._buffer[:, nq : nq + nv]
        self._sensordata = self._buffer[:, nq + nv :]
        self._ctrl = np.zeros((n, model.nu))
        self._time = np.zeros(n)  # data.time after the last step (or 0 after a reset)
        self._bad_warnings = [int(w) for w in (mujoco.mjtWarning.mjWARN_BADQPOS,
                                               mujoco.mjtWarning.mjWARN_BADQVEL,
                                               mujoco.mjtWarning.mjWARN_BADQACC)]
        self._all_finite = torch.ones(n, dtype=torch.bool)
        self._state = self._sim_state(torch.from_numpy(self._qpos), torch.from_numpy(self._qvel),
                                      torch.from_numpy(self._sensordata), torch.from_numpy(self._ctrl))
        # Per env, the numpy views a step touches, made once: (data, data.ctrl, batched ctrl row,
        # (source, destination) pairs copied out after a step). Building them costs microseconds
        # per env, which every step would otherwise pay again.
        self._env_views = [
            (
                data,
                data.ctrl,
                self._ctrl[i],
                tuple(pair for pair in ((data.qpos, self._qpos[i]), (data.qvel, self._qvel[i]),
                                        (data.sensordata, self._sensordata[i])) if pair[0].size),  # no empty copies
            )
            for i, data in enumerate(self.datas)
        ]
        self.substeps = int(task.control_substeps)
        rk4 = model.opt.integrator == mujoco.mjtIntegrator.mjINT_RK4
        # see the module docstring: the closing mj_step1 only refreshes sensors (and kinematics)
        self._closing_step1 = not rk4 or model.nsensordata > 0
        self.threads = default_threads(n) if threads is None else max(1, min(int(threads), n))
        self._pool = ThreadPoolExecutor(self.threads - 1) if self.threads > 1 else None
        self._renderers: dict[str, BatchRenderer] = {}  # per camera, made on first use

    # ---- physics primitives ----
    @property
    def state(self) -> SimState:
        return self._state

    def _refused(self, data: Any) -> bool:
        """Whether MuJoCo reset `data` for a bad qpos, qvel or qacc since its last mj_resetData."""
        return bool(data.warning.number[self._bad_warnings].any())

    def _write_state(self, env_ids: Tensor, qpos: Tensor, qvel: Tensor) -> Tensor:
        mujoco, model = self._mujoco, self.model
        qpos = qpos.detach().cpu().double().numpy()
        qvel = qvel.detach().cpu().double().numpy()
        refused = torch.zeros(len(env_ids), dtype=torch.bool)
        for row, i in enumerate(env_ids.tolist()):
            data, _, _, copies = self._env_views[i]
            mujoco.mj_resetData(model, data)  # zero ctrl, time, warmstart, warnings
            data.qpos[:] = qpos[row]
            data.qvel[:] = qvel[row]
            # mj_step's own checks: a bad state is reset to the reference pose, with a warning
            mujoco.mj_checkPos(model, data)
            mujoco.mj_checkVel(model, data)
            mujoco.mj_forward(model, data)
            mujoco.mj_checkAcc(model, data)
            refused[row] = self._refused(data)
            for source, destination in copies:
                destination[:] = source
            self._ctrl[i] = 0.0
            self._time[i] = 0.0
        return refused

    def _step_envs(self, env_ids: Iterator[int]) -> None:
        """Advance envs by one control step, taking env indices from a shared iterator until it
        runs out. Every thread runs this loop over the same iterator (next() on it is atomic
        under the GIL), so a thread the OS leaves waiting on a busy machine does not hold the
        others back: the threads that run take over its envs."""
        mujoco, model, substeps = self._mujoco, self.model, self.substeps
        step1, step2, times = mujoco.mj_step1, mujoco.mj_step2, self._time
        split = model.opt.integrator != mujoco.mjtIntegrator.mjINT_RK4
        closing_step1 = self._closing_step1
        for i in env_ids:
            data, data_ctrl, ctrl, copies = self._env_views[i]
            data_ctrl[:] = ctrl
            if split:
                step2(model, data)
                if substeps > 1:
                    mujoco.mj_step(model, data, substeps - 1)
            else:
                mujoco.mj_step(model, data, substeps)
            if closing_step1:
                step1(model, data)
            for source, destination in copies:
                destination[:] = source
            times[i] = data.time

    def _step_physics(self, ctrl: Tensor) -> Tensor:
        self._state.ctrl.copy_(ctrl)  # into the batched ctrl rows the workers read
        time_before = self._time.copy()
        env_ids = iter(range(self.num_envs))
        futures = [self._pool.submit(self._step_envs, env_ids) for _ in range(self.threads - 1)]
        self._step_envs(env_ids)  # the calling thread works too
        for future in futures:
            future.result()
        # On a bad qpos, qvel or qacc (mjWARN_BADQPOS/BADQVEL/BADQACC) MuJoCo resets the data
        # itself (mj_resetData), which sets time back to 0: an env whose clock did not advance by
        # `substeps` timesteps went unstable. Cheaper than reading the warning counters per env.
        expected = time_before + (self.substeps - 0.5) * self.model.opt.timestep
        unstable = self._time < expected
        # An env written since its last step starts from time 0, so a reset inside its first
        # substep leaves the clock where a good step would: its warning counters tell.
        for i in np.flatnonzero(time_before == 0.0):
            unstable[i] |= self._refused(self.datas[i])
        return torch.from_numpy(unstable)

    def _get_sim_state(self) -> dict[str, Tensor]:
        mujoco, model = self._mujoco, self.model
        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        integration = np.empty((self.num_envs, mujoco.mj_stateSize(model, spec)))
        for i, data in enumerate(self.datas):
            mujoco.mj_getState(model, data, integration[i], spec)
        # the buffers as the tasks see them, and the warning counters the next step may read
        warnings = np.stack([data.warning.number for data in self.datas])
        return {"integration": torch.from_numpy(integration), "buffer": torch.from_numpy(self._buffer.copy()),
                "warnings": torch.from_numpy(warnings.copy())}

    def _set_sim_state(self, state: dict[str, Tensor]) -> None:
        mujoco, model = self._mujoco, self.model
        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        expected = {"integration": (self.num_envs, mujoco.mj_stateSize(model, spec)),
                    "buffer": self._buffer.shape, "warnings": (self.num_envs, len(self.datas[0].warning))}
        for key, shape in expected.items():
            if key not in state:
                raise UserError(f"env state is missing 'sim/{key}'")
            if tuple(state[key].shape) != tuple(shape):
                raise UserError(f"env state 'sim/{key}' has shape {tuple(state[key].shape)}, "
                                f"this env needs {tuple(shape)} (another task or num_envs?)")
        integration = state["integration"].double().numpy()
        warnings = state["warnings"].numpy()
        for i, data in enumerate(self.datas):
            mujoco.mj_resetData(model, data)
            mujoco.mj_setState(model, data, integration[i], spec)
            # what the last control step's mj_step1 computed, for the next mj_step2
            mujoco.mj_step1(model, data)
            data.warning.number[:] = warnings[i]
            self._time[i] = data.time
            self._ctrl[i] = data.ctrl
        self._buffer[:] = state["buffer"].double().numpy()

    def _state_is_finite(self) -> Tensor:
        if np.isfinite(self._buffer.sum()):  # the usual case, in one reduction
            return self._all_finite
        return torch.from_numpy(np.isfinite(self._buffer).all(axis=1))

    def _render_frames(self, env_ids: Tensor, size: int, camera: str) -> Tensor:
        if camera not in self._renderers:
            self._renderers[camera] = BatchRenderer(self.model, camera)
        ids = env_ids.tolist()
        if not self._closing_step1:  # the kinematics of the state reached (see the module docstring)
            for i in ids:
                self._mujoco.mj_fwdPosition(self.model, self.datas[i])
        return torch.from_numpy(self._renderers[camera].render((self.datas[i] for i in ids), len(ids), size))

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
    return MujocoCpuEnv(task, num_envs, device=device, seed=seed, **options)
