"""push_t: push a T-shaped block to a fixed target pose with a planar pusher (like PushT).

Model (assets/push_t.xml): a sphere pusher on two position-controlled slide joints and a T block
(10 cm bar + 7.5 cm stem, 2.5 cm wide) on planar joints whose damping and frictionloss stand in
for table friction; the only contacts are pusher-block. Control at 10 Hz (10 x 10 ms physics).

Action (2): absolute pusher target (x, y) in [-1, 1], mapped to the +-25 cm workspace.
Observation (6): pusher xy, block xy (metres), block yaw as (sin, cos).
Reward: coverage of the target T by the block, in [0, 1] (PushT's reward; measured on a fixed
grid of points of the T). Success (ends the episode): position error < 2 cm and orientation
error < 10 degrees (see docs/tasks.md for why).
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

# T geometry in the block frame (origin at the centre of area): (centre x, centre y, half x, half y)
BAR = (0.0, 0.021429, 0.05, 0.0125)
STEM = (0.0, -0.028571, 0.0125, 0.0375)
TARGET_XY = (0.0, 0.0)
TARGET_YAW = math.pi / 4
WORKSPACE = 0.25  # pusher targets span [-WORKSPACE, WORKSPACE] on x and y


def quat_yaw(quat: Tensor) -> Tensor:
    """Yaw of quaternions (w, x, y, z) [N, 4] that rotate about z only."""
    return 2.0 * torch.atan2(quat[:, 3], quat[:, 0])


def wrap_angle(angle: Tensor) -> Tensor:
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


def t_points(spacing: float = 0.005) -> Tensor:
    """A grid of points covering the T (block frame) [K, 2], for the coverage reward."""
    points = []
    for cx, cy, hx, hy in (BAR, STEM):
        xs = torch.arange(-hx + spacing / 2, hx, spacing) + cx
        ys = torch.arange(-hy + spacing / 2, hy, spacing) + cy
        grid = torch.stack(torch.meshgrid(xs, ys, indexing="ij"), dim=-1).reshape(-1, 2)
        points.append(grid)
    return torch.cat(points).float()


def inside_t(points: Tensor) -> Tensor:
    """Whether points [..., 2] (block frame) lie in the T."""
    inside = torch.zeros(points.shape[:-1], dtype=torch.bool, device=points.device)
    for cx, cy, hx, hy in (BAR, STEM):
        inside |= ((points[..., 0] - cx).abs() <= hx + 1e-6) & (
            (points[..., 1] - cy).abs() <= hy + 1e-6
        )
    return inside


class PushTTask(Task):
    name = "push_t"
    gym_id = "embodied_rl/PushT-v0"
    xml = "push_t.xml"
    max_episode_steps = 200
    control_substeps = 10
    obs_dim = 6
    action_dim = 2
    camera = "top"
    has_success = True
    success_criterion = "the T block is within 2 cm and 10 degrees of the target pose (ends the episode)"
    success_terminates = True
    position_tolerance = 0.02  # metres
    angle_tolerance = math.radians(10.0)
    init_range = 0.15  # initial block centre in [-init_range, init_range]^2
    min_init_distance = 0.05  # the block starts at least this far from the target

    def bind(self, model: Any) -> None:
        self.nq, self.nv, self.nu = model.nq, model.nv, model.nu
        self.block_x = joint_qpos_slice(model, "block_x").start
        self.block_y = joint_qpos_slice(model, "block_y").start
        self.block_yaw = joint_qpos_slice(model, "block_yaw").start
        self.pusher_x = joint_qpos_slice(model, "pusher_x").start
        self.pusher_y = joint_qpos_slice(model, "pusher_y").start
        self.act_x = actuator_index(model, "pusher_x")
        self.act_y = actuator_index(model, "pusher_y")
        self.pusher_pos = sensor_slice(model, "pusher_pos")
        self.block_pos = sensor_slice(model, "block_pos")
        self.block_quat = sensor_slice(model, "block_quat")
        self.points = t_points()

    # ---- helpers shared with the expert ----
    def poses(self, state: SimState) -> tuple[Tensor, Tensor, Tensor]:
        """(pusher xy [N, 2], block xy [N, 2], block yaw [N]) as float32."""
        sensors = state.sensordata.float()
        pusher = sensors[:, self.pusher_pos][:, :2]
        block = sensors[:, self.block_pos][:, :2]
        yaw = quat_yaw(sensors[:, self.block_quat])
        return pusher, block, yaw

    def pose_errors(self, block: Tensor, yaw: Tensor) -> tuple[Tensor, Tensor]:
        target = torch.tensor(TARGET_XY, device=block.device)
        return (block - target).norm(dim=1), wrap_angle(yaw - TARGET_YAW).abs()

    def coverage(self, block: Tensor, yaw: Tensor) -> Tensor:
        """Fraction of the target T covered by the block [N] (the T's grid points, moved by the
        block pose, that land inside the target T)."""
        points = self.points.to(block.device)
        cos, sin = torch.cos(yaw)[:, None], torch.sin(yaw)[:, None]
        world_x = block[:, :1] + cos * points[:, 0] - sin * points[:, 1]
        world_y = block[:, 1:] + sin * points[:, 0] + cos * points[:, 1]
        # into the target frame
        dx, dy = world_x - TARGET_XY[0], world_y - TARGET_XY[1]
        tc, ts = math.cos(TARGET_YAW), math.sin(TARGET_YAW)
        local = torch.stack((tc * dx + ts * dy, -ts * dx + tc * dy), dim=-1)
        return inside_t(local).float().mean(dim=1)

    # ---- Task API ----
    def sample_init(
        self, n: int, generator: torch.Generator, device: torch.device | str
    ) -> tuple[Tensor, Tensor]:
        block = torch.empty(n, 2)
        pusher = torch.empty(n, 2)
        todo = torch.ones(n, dtype=torch.bool)
        target = torch.tensor(TARGET_XY)
        for _ in range(100):  # rejection sampling: block away from the target, pusher off the block
            k = int(todo.sum())
            if k == 0:
                break
            block_try = (torch.rand(k, 2, generator=generator) * 2 - 1) * self.init_range
            pusher_try = (torch.rand(k, 2, generator=generator) * 2 - 1) * (WORKSPACE - 0.03)
            ok = ((block_try - target).norm(dim=1) > self.min_init_distance) & (
                (pusher_try - block_try).norm(dim=1) > 0.1
            )
            ids = torch.nonzero(todo).flatten()[ok]
            block[ids], pusher[ids] = block_try[ok], pusher_try[ok]
            todo[ids] = False
        yaw = (torch.rand(n, generator=generator) * 2 - 1) * math.pi
        qpos = torch.zeros(n, self.nq)
        qpos[:, self.block_x], qpos[:, self.block_y], qpos[:, self.block_yaw] = (
            block[:, 0],
            block[:, 1],
            yaw,
        )
        qpos[:, self.pusher_x], qpos[:, self.pusher_y] = pusher[:, 0], pusher[:, 1]
        return qpos.to(device), torch.zeros(n, self.nv, device=device)

    def action_to_ctrl(self, action: Tensor) -> Tensor:
        ctrl = torch.zeros(action.shape[0], self.nu, device=action.device)
        target = scale_action(action, -WORKSPACE, WORKSPACE)
        ctrl[:, self.act_x], ctrl[:, self.act_y] = target[:, 0], target[:, 1]
        return ctrl

    def target_to_action(self, target_xy: Tensor) -> Tensor:
        """Inverse of action_to_ctrl: pusher target (x, y) in metres -> action in [-1, 1]."""
        return (target_xy / WORKSPACE).clamp(-1.0, 1.0)

    def observe(self, state: SimState) -> Tensor:
        pusher, block, yaw = self.poses(state)
        return torch.cat((pusher, block, torch.sin(yaw)[:, None], torch.cos(yaw)[:, None]), dim=1)

    def evaluate(self, state: SimState, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        _, block, yaw = self.poses(state)
        position_error, angle_error = self.pose_errors(block, yaw)
        reward = self.coverage(block, yaw)
        success = (position_error < self.position_tolerance) & (angle_error < self.angle_tolerance)
        failure = torch.zeros_like(success)
        return reward, success, failure
