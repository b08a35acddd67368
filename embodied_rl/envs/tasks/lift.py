"""lift: pick up a cube with a gantry gripper and raise it 5 cm.

Model (assets/lift.xml): a hand on x/y/z slides and a yaw hinge (position actuators, gravity
compensated) with two sliding box fingers; a 4 cm cube on a free joint. Control at 10 Hz
(20 x 5 ms physics).

Action (5): absolute hand target x, y (+-15 cm), z (2-25 cm above the table), yaw (+-90 deg),
and the gripper (-1 open ... +1 closed), each in [-1, 1].
Observation (13): hand xyz, hand yaw, finger opening (0 open .. 1 closed), cube xyz, cube yaw as
(sin 4*yaw, cos 4*yaw) (a cube looks the same every 90 deg), cube minus hand xyz.
Reward (dense, in [0, 1]): 0.5 * (1 - tanh(10 * hand-cube distance)) + 0.5 * lift progress.
Success (ends the episode): the cube's centre is at least 5 cm above its resting height (its
bottom 5 cm above the table) at that step. Initial state: cube at a random xy in +-10 cm with a
random yaw in +-45 deg; the open hand 10-16 cm above the table at a random xy in +-10 cm.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from embodied_rl.envs.api import (
    SimState,
    Task,
    actuator_index,
    joint_qpos_slice,
    scale_action,
    sensor_slice,
)

CUBE_HALF = 0.02
FINGER_TRAVEL = 0.045  # finger joint range: 0 open .. 0.045 fully closed (past the cube)
YAW_RANGE = math.pi / 2


def cube_yaw(quat: Tensor) -> Tensor:
    """Yaw of a (possibly tilted) body from its quaternion (w, x, y, z) [N, 4]: the heading of its
    x axis projected on the table."""
    w, x, y, z = quat.unbind(dim=1)
    axis_x = 1 - 2 * (y * y + z * z)
    axis_y = 2 * (x * y + w * z)
    return torch.atan2(axis_y, axis_x)


class LiftTask(Task):
    name = "lift"
    gym_id = "embodied_rl/Lift-v0"
    xml = "lift.xml"
    max_episode_steps = 60
    control_substeps = 20
    obs_dim = 13
    action_dim = 5
    camera = "front"
    effector_obs, gripper_obs = (0, 1, 2), 4  # hand xyz, finger opening
    has_success = True
    success_criterion = "the cube's centre is at least 5 cm above its resting height (ends the episode)"
    success_terminates = True
    lift_height = 0.05  # metres the cube must rise
    cube_range = 0.1
    hand_range = 0.1

    def bind(self, model: Any) -> None:
        self.nq, self.nv, self.nu = model.nq, model.nv, model.nu
        self.cube_joint = joint_qpos_slice(model, "cube")
        self.hand_joints = [
            joint_qpos_slice(model, f"hand_{axis}").start for axis in ("x", "y", "z", "yaw")
        ]
        self.fingers = [
            joint_qpos_slice(model, f"finger_{side}").start for side in ("left", "right")
        ]
        self.hand_actuators = [
            actuator_index(model, f"hand_{axis}") for axis in ("x", "y", "z", "yaw")
        ]
        self.finger_actuators = [
            actuator_index(model, f"finger_{side}") for side in ("left", "right")
        ]
        self.grip_pos = sensor_slice(model, "grip_pos")
        self.cube_pos = sensor_slice(model, "cube_pos")
        self.cube_quat = sensor_slice(model, "cube_quat")
        self.low = torch.tensor([-0.15, -0.15, 0.02, -YAW_RANGE])
        self.high = torch.tensor([0.15, 0.15, 0.25, YAW_RANGE])

    # ---- helpers shared with the expert ----
    def poses(self, state: SimState) -> dict[str, Tensor]:
        sensors = state.sensordata.float()
        qpos = state.qpos.float()
        return {
            "hand": sensors[:, self.grip_pos],
            "hand_yaw": qpos[:, self.hand_joints[3]],
            "closure": qpos[:, self.fingers].mean(dim=1) / FINGER_TRAVEL,
            "cube": sensors[:, self.cube_pos],
            "cube_yaw": cube_yaw(sensors[:, self.cube_quat]),
        }

    def target_to_action(self, target: Tensor, grip: Tensor) -> Tensor:
        """Hand target [N, 4] (x, y, z, yaw) and grip [N] in [-1, 1] -> action [N, 5]."""
        low, high = self.low.to(target.device), self.high.to(target.device)
        scaled = (target - low) / (high - low) * 2 - 1
        return torch.cat((scaled, grip[:, None]), dim=1).clamp(-1.0, 1.0)

    # ---- Task API ----
    def sample_init(
        self, n: int, generator: torch.Generator, device: torch.device | str
    ) -> tuple[Tensor, Tensor]:
        qpos = torch.zeros(n, self.nq)
        cube_xy = (torch.rand(n, 2, generator=generator) * 2 - 1) * self.cube_range
        yaw = (torch.rand(n, generator=generator) * 2 - 1) * (math.pi / 4)
        start = self.cube_joint.start
        qpos[:, start : start + 2] = cube_xy
        qpos[:, start + 2] = CUBE_HALF
        qpos[:, start + 3] = torch.cos(yaw / 2)
        qpos[:, start + 6] = torch.sin(yaw / 2)
        hand_xy = (torch.rand(n, 2, generator=generator) * 2 - 1) * self.hand_range
        hand_z = 0.10 + torch.rand(n, generator=generator) * 0.06
        qpos[:, self.hand_joints[0]], qpos[:, self.hand_joints[1]] = hand_xy[:, 0], hand_xy[:, 1]
        qpos[:, self.hand_joints[2]] = hand_z
        return qpos.to(device), torch.zeros(n, self.nv, device=device)

    def action_to_ctrl(self, action: Tensor) -> Tensor:
        ctrl = torch.zeros(action.shape[0], self.nu, device=action.device)
        hand = scale_action(action[:, :4], self.low.to(action.device), self.high.to(action.device))
        ctrl[:, self.hand_actuators] = hand
        grip = scale_action(action[:, 4:5], 0.0, FINGER_TRAVEL)
        ctrl[:, self.finger_actuators] = grip.expand(-1, 2)
        return ctrl

    def observe(self, state: SimState) -> Tensor:
        p = self.poses(state)
        yaw4 = 4 * p["cube_yaw"]
        return torch.cat(
            (
                p["hand"],
                p["hand_yaw"][:, None],
                p["closure"][:, None],
                p["cube"],
                torch.sin(yaw4)[:, None],
                torch.cos(yaw4)[:, None],
                p["cube"] - p["hand"],
            ),
            dim=1,
        )

    def evaluate(self, state: SimState, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        p = self.poses(state)
        distance = (p["cube"] - p["hand"]).norm(dim=1)
        lifted = p["cube"][:, 2] - CUBE_HALF
        reward = 0.5 * (1 - torch.tanh(10 * distance)) + 0.5 * (lifted / self.lift_height).clamp(
            0.0, 1.0
        )
        success = lifted >= self.lift_height
        return reward, success, torch.zeros_like(success)
