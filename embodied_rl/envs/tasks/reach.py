"""reach: a point-mass fingertip on an x/y gantry moves onto a randomised target.

The smallest, fastest task, used by tests and smoke runs.
- Actions (2): target x/y positions of the two position actuators, [-1, 1] -> [-0.2, 0.2] m.
- Observation (8): fingertip xy, target xy, target - fingertip xy, fingertip velocity xy.
- Reward: -10 * distance (m) per step, +1 on the step that succeeds.
- Success: fingertip within `success_radius` (2 cm) of the target in the xy plane; it ends the
  episode (terminated). No failure. Time limit 50 steps (2 s: 4 substeps of 10 ms).
- Initial state: fingertip and target uniform in [-0.15, 0.15]^2, at least 5 cm apart.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embodied_rl.envs.api import (
    SimState,
    Task,
    actuator_index,
    joint_qpos_slice,
    joint_qvel_slice,
    scale_action,
    sensor_slice,
)


class ReachTask(Task):
    name = "reach"
    gym_id = "embodied_rl/Reach-v0"
    xml = "reach.xml"
    max_episode_steps = 50
    control_substeps = 4
    obs_dim = 8
    action_dim = 2
    camera = "top"
    effector_obs = (0, 1)  # fingertip xy
    has_success = True
    success_criterion = "the fingertip is within 2 cm of the target in the x/y plane (ends the episode)"
    success_terminates = True
    success_radius = 0.02
    init_range = 0.15
    min_init_distance = 0.05

    def bind(self, model: Any) -> None:
        self.bind_gantry(model)
        self.target_qpos = [joint_qpos_slice(model, j).start for j in ("target_x", "target_y")]
        self.target = sensor_slice(model, "target_pos")

    def bind_gantry(self, model: Any) -> None:
        """The fingertip's joints, sensors and actuators (shared with reach_choice)."""
        self.nq, self.nv = int(model.nq), int(model.nv)
        self.finger_qpos = [joint_qpos_slice(model, j).start for j in ("finger_x", "finger_y")]
        self.finger_qvel = [joint_qvel_slice(model, j).start for j in ("finger_x", "finger_y")]
        self.fingertip = sensor_slice(model, "fingertip_pos")
        self.fingertip_vel = sensor_slice(model, "fingertip_vel")
        actuators = [actuator_index(model, a) for a in ("x", "y")]
        ranges = torch.as_tensor(model.actuator_ctrlrange[actuators], dtype=torch.float32)
        self.ctrl_low, self.ctrl_high = ranges[:, 0], ranges[:, 1]
        self.actuators = actuators
        self.nu = int(model.nu)

    def sample_init(self, n: int, generator: torch.Generator, device: torch.device | str) -> tuple[Tensor, Tensor]:
        r = self.init_range
        finger = (torch.rand(n, 2, generator=generator) * 2 - 1) * r
        target = (torch.rand(n, 2, generator=generator) * 2 - 1) * r
        for _ in range(20):  # redraw targets that start too close (a fixed number of draws)
            close = (finger - target).norm(dim=1) < self.min_init_distance
            redraw = (torch.rand(n, 2, generator=generator) * 2 - 1) * r
            target = torch.where(close[:, None], redraw, target)
        qpos = torch.zeros(n, self.nq)
        qpos[:, self.finger_qpos] = finger
        qpos[:, self.target_qpos] = target
        return qpos.to(device), torch.zeros(n, self.nv, device=device)

    def action_to_ctrl(self, action: Tensor) -> Tensor:
        ctrl = torch.zeros(action.shape[0], self.nu, dtype=action.dtype, device=action.device)
        low, high = self.ctrl_low.to(action.device), self.ctrl_high.to(action.device)
        ctrl[:, self.actuators] = scale_action(action, low, high).to(action.dtype)
        return ctrl

    def positions(self, state: SimState) -> tuple[Tensor, Tensor]:
        """(fingertip xy, target xy) [N, 2] float32."""
        sensors = state.sensordata.float()
        return sensors[:, self.fingertip][:, :2], sensors[:, self.target][:, :2]

    def observe(self, state: SimState) -> Tensor:
        finger, target = self.positions(state)
        velocity = state.sensordata[:, self.fingertip_vel][:, :2].float()
        return torch.cat([finger, target, target - finger, velocity], dim=1)

    def evaluate(self, state: SimState, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        finger, target = self.positions(state)
        distance = (target - finger).norm(dim=1)
        success = distance < self.success_radius
        reward = -10.0 * distance + success.float()
        return reward, success, torch.zeros_like(success)
