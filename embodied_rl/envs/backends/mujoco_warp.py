"""Backend `mujoco_warp`: the same Task classes on MuJoCo Warp, all N envs in one batched Data.

MuJoCo Warp keeps every world's state in float32 device arrays (`nworld = N`). `wp.to_torch` gives
zero-copy torch views of qpos/qvel/sensordata/ctrl: they are the SimState the tasks read, and
resets write the sampled initial states through them. Nothing is copied between steps, so on a
GPU the whole env step stays on the device.

A control step runs `step2, step x (substeps - 1), step1`, exactly like the CPU backend: the same
physics as `substeps` mj_steps, with sensors (and kinematics) of the state actually reached. On a
CUDA device that sequence is captured once into a CUDA graph (wp.ScopedCapture) and replayed;
on Warp's CPU device it is a plain loop. Warp compiles its kernels on first use (tens of seconds
per model on the CPU; cached under ~/.cache/warp afterwards).

Rendering copies the requested envs' qpos into one CPU MjData, frame by frame, and draws them with
the batched renderer of envs/render.py. Physics that goes non-finite is reset by SimBatchedEnv, as
on the CPU backend; MuJoCo Warp raises no per-world warnings, so NaN/inf rows are the only instability signal.

Snapshots (`get_state`) copy SNAPSHOT_FIELDS, MuJoCo's integration state plus sensordata (whose
acceleration sensors only the next step refreshes); restoring writes them back and runs forward
for the derived quantities the next step reads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embodied_rl.envs.api import SimBatchedEnv, SimState, Task
from embodied_rl.envs.render import BatchRenderer
from embodied_rl.errors import UserError

# What a step reads that earlier steps left behind: mjSTATE_INTEGRATION's arrays, and sensordata.
SNAPSHOT_FIELDS = ("time", "qpos", "qvel", "act", "history", "plastic", "qacc_warmstart", "ctrl",
                   "qfrc_applied", "xfrc_applied", "eq_active", "mocap_pos", "mocap_quat", "userdata",
                   "sensordata")


class MujocoWarpEnv(SimBatchedEnv):
    """BatchedEnv on MuJoCo Warp (float32 inside and outside).

    Args beyond SimBatchedEnv's (`options`: seed, obs_mode, image_size, render_size):
        device: "cpu" (Warp's CPU device: slow, for tests) or "cuda" / "cuda:K".
        cuda_graph: capture the substep loop in a CUDA graph (default: on for CUDA devices).
        nconmax, njmax: contact and constraint capacity per world, passed to
            mujoco_warp.put_data (None: MuJoCo Warp's own guess from the model).
    """

    def __init__(
        self,
        task: Task,
        num_envs: int,
        device: str | torch.device = "cpu",
        cuda_graph: bool | None = None,
        nconmax: int | None = None,
        njmax: int | None = None,
        **options: Any,
    ):
        import mujoco
        import mujoco_warp as mjw
        import warp as wp

        self._mujoco, self._mjw, self._wp = mujoco, mjw, wp
        # Warp logs a line per compiled or loaded kernel module (dozens): keep the CLI readable.
        wp.config.log_level = max(wp.config.log_level, wp.LOG_WARNING)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        if device.type not in ("cpu", "cuda"):
            raise UserError(f"backend 'mujoco_warp' runs on 'cpu' or 'cuda', got device '{device}'")
        try:
            self.wp_device = wp.get_device(str(device))
        except Exception as error:  # warp raises RuntimeError/ValueError for an absent device
            raise UserError(f"Warp cannot use device '{device}': {error}") from None
        self.sim_device = device
        use_graph = self.wp_device.is_cuda if cuda_graph is None else bool(cuda_graph)
        if use_graph and not self.wp_device.is_cuda:
            raise UserError("cuda_graph=True needs a CUDA device")

        model = task.load_model()
        super().__init__(task, model, num_envs, device, **options)
        n = self.num_envs
        self.substeps = int(task.control_substeps)

        data = mujoco.MjData(model)
        mujoco.mj_forward(model, data)
        with wp.ScopedDevice(self.wp_device):
            self.wp_model = mjw.put_model(model)
            self.wp_data = mjw.put_data(model, data, nworld=n, nconmax=nconmax, njmax=njmax)
            self._reset_mask = wp.zeros(n, dtype=bool)
        d = self.wp_data
        self._state = self._sim_state(wp.to_torch(d.qpos), wp.to_torch(d.qvel), wp.to_torch(d.sensordata),
                                      wp.to_torch(d.ctrl))
        self._reset_mask_torch = wp.to_torch(self._reset_mask)

        # Kernels compile on this first run, which a CUDA graph capture requires anyway. The state
        # it leaves behind does not matter: the first reset sets every env.
        self._graph = None
        with wp.ScopedDevice(self.wp_device):
            self._substep_loop()
            if use_graph:
                with wp.ScopedCapture() as capture:
                    self._substep_loop()
                self._graph = capture.graph

        self._render_data = mujoco.MjData(model)
        self._renderers: dict[str, BatchRenderer] = {}  # per camera, made on first use

    # ---- physics primitives ----
    @property
    def state(self) -> SimState:
        return self._state

    def _substep_loop(self) -> None:
        mjw, m, d = self._mjw, self.wp_model, self.wp_data
        if self.model.opt.integrator == self._mujoco.mjtIntegrator.mjINT_RK4:
            for _ in range(self.substeps):  # an RK4 step cannot be split into step2/step1
                mjw.step(m, d)
        else:
            mjw.step2(m, d)
            for _ in range(self.substeps - 1):
                mjw.step(m, d)
        mjw.step1(m, d)

    def _torch_done(self) -> None:
        """Make torch's pending writes to the shared buffers visible to Warp (CUDA: torch and
        Warp run on different streams; a host sync keeps it simple and correct)."""
        if self.sim_device.type == "cuda":
            torch.cuda.current_stream(self.sim_device).synchronize()

    def _warp_done(self) -> None:
        """Make Warp's results visible to torch."""
        if self.sim_device.type == "cuda":
            self._wp.synchronize_device(self.wp_device)

    def _write_state(self, env_ids: Tensor, qpos: Tensor, qvel: Tensor) -> None:
        ids = env_ids.to(self.sim_device)
        wp, mjw = self._wp, self._mjw
        # reset_data clears everything of those worlds (ctrl, act, time, warmstart, applied
        # forces, mocap); then the sampled state goes in through the torch views.
        self._reset_mask_torch.zero_()
        self._reset_mask_torch[ids] = True
        self._torch_done()
        with wp.ScopedDevice(self.wp_device):
            mjw.reset_data(self.wp_model, self.wp_data, reset=self._reset_mask)
        self._warp_done()
        self._state.qpos[ids] = qpos.to(self.sim_device, torch.float32)
        self._state.qvel[ids] = qvel.to(self.sim_device, torch.float32)
        self._torch_done()
        # forward recomputes the derived quantities (sensordata) of every world; the others'
        # states are unchanged, so their values come out the same.
        with wp.ScopedDevice(self.wp_device):
            mjw.forward(self.wp_model, self.wp_data)
        self._warp_done()

    def _step_physics(self, ctrl: Tensor) -> Tensor:
        self._state.ctrl.copy_(ctrl.to(self.sim_device, torch.float32))
        self._torch_done()
        with self._wp.ScopedDevice(self.wp_device):
            if self._graph is not None:
                self._wp.capture_launch(self._graph)
            else:
                self._substep_loop()
        self._warp_done()
        # no per-world warnings in MuJoCo Warp: SimBatchedEnv's NaN/inf check does the work
        return torch.zeros(self.num_envs, dtype=torch.bool, device=self.sim_device)

    def _snapshot_views(self) -> dict[str, Tensor]:
        """Torch views of the SNAPSHOT_FIELDS this version of MuJoCo Warp has."""
        data = self.wp_data
        return {name: self._wp.to_torch(getattr(data, name)) for name in SNAPSHOT_FIELDS
                if getattr(data, name, None) is not None}

    def _get_sim_state(self) -> dict[str, Tensor]:
        self._warp_done()
        return {name: view.clone() for name, view in self._snapshot_views().items()}

    def _set_sim_state(self, state: dict[str, Tensor]) -> None:
        views = self._snapshot_views()
        for name, view in views.items():
            if name not in state:
                raise UserError(f"env state is missing 'sim/{name}'")
            if tuple(state[name].shape) != tuple(view.shape):
                raise UserError(f"env state 'sim/{name}' has shape {tuple(state[name].shape)}, "
                                f"this env needs {tuple(view.shape)} (another task or num_envs?)")
        self._warp_done()
        for name, view in views.items():
            view.copy_(state[name].to(view.device, view.dtype))
        self._torch_done()
        with self._wp.ScopedDevice(self.wp_device):
            self._mjw.forward(self.wp_model, self.wp_data)
        self._warp_done()
        views["sensordata"].copy_(state["sensordata"].to(self.sim_device))  # as the last step left it
        self._torch_done()

    def _render_frames(self, env_ids: Tensor, size: int, camera: str) -> Tensor:
        """The CPU backend's batched renderer (same look), over one MjData refilled per frame
        with an env's qpos and its kinematics."""
        ids = env_ids.to(self.sim_device)
        self._warp_done()
        qpos = self._state.qpos[ids].double().cpu().numpy()
        if camera not in self._renderers:
            self._renderers[camera] = BatchRenderer(self.model, camera)

        def datas():
            mujoco, data = self._mujoco, self._render_data
            for row in range(len(qpos)):
                data.qpos[:] = qpos[row]
                for stage in (mujoco.mj_kinematics, mujoco.mj_comPos, mujoco.mj_camlight):
                    stage(self.model, data)  # poses, then the cameras (tracking ones included)
                yield data

        return torch.from_numpy(self._renderers[camera].render(datas(), len(qpos), size))

    @property
    def simulator(self) -> dict[str, str]:
        from importlib.metadata import version

        return {**super().simulator, "mujoco_warp": version("mujoco-warp"), "warp": self._wp.__version__}

    def close(self) -> None:
        for renderer in self._renderers.values():
            renderer.close()
        self._renderers.clear()


def make_env(task: Task, num_envs: int, device: str = "cpu", seed: int = 0, **options: Any) -> MujocoWarpEnv:
    return MujocoWarpEnv(task, num_envs, device, seed=seed, **options)
