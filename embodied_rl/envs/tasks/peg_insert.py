"""peg_insert: insert a square peg into a square hole with 2 mm clearance per side.

Model (assets/peg_insert.xml): a 2 cm square peg welded to an x/y/z gantry (position actuators,
gravity compensated) above a block with a 2.4 cm square, 4 cm deep hole made of four box walls.
Control at 10 Hz (25 x 4 ms physics).

Action (3): absolute target of the peg tip, x and y in +-15 cm, z in 0-20 cm above the table,
each in [-1, 1] (2 mm of clearance is 0.013 action units: precision matters).
Observation (9): peg tip xyz, hole rim centre xyz, peg tip minus hole rim centre.
Reward (dense, in [0, 1]): 0.5 * (1 - tanh(20 * xy error)) + 0.5 * insertion depth progress
(counted only while the peg is over the hole, xy error < 4 mm).
Success (ends the episode): the peg tip is >= 2.5 cm below the rim, within 4 mm of the hole axis
(possible only inside the hole). Initial state: hole centre at a random xy in +-10 cm, peg tip
at a random xy in +-10 cm, 12-16 cm above the table.
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
    scale_action,
    sensor_slice,
)


class PegInsertTask(Task):
    name = "peg_insert"
    gym_id = "embodied_rl/PegInsert-v0"
    xml = "peg_insert.xml"
    max_episode_steps = 60
    control_substeps = 25
    obs_dim = 9
    action_dim = 3
    camera = "front"
    effector_obs = (0, 1, 2)  # peg tip xyz
    has_success = True
    success_criterion = "the peg tip is at least 2.5 cm below the rim, within 4 mm of the hole axis (ends the episode)"
    success_terminates = True
    insert_depth = 0.025  # metres below the rim
    axis_tolerance = 0.004
    hole_range = 0.1
    peg_range = 0.1

    def bind(self, model: Any) -> None:
        self.nq, self.nv, self.nu = model.nq, model.nv, model.nu
        self.hole_joints = [joint_qpos_slice(model, f"hole_{axis}").start for axis in ("x", "y")]
        self.peg_joints = [joint_qpos_slice(model, f"peg_{axis}").start for axis in ("x", "y", "z")]
        self.actuators = [actuator_index(model, f"peg_{axis}") for axis in ("x", "y", "z")]
        self.tip_pos = sensor_slice(model, "peg_tip_pos")
        self.hole_pos = sensor_slice(model, "hole_pos")
        self.low = torch.tensor([-0.15, -0.15, 0.0])
        self.high = torch.tensor([0.15, 0.15, 0.2])

    # ---- helpers shared with the expert ----
    def poses(self, state: SimState) -> tuple[Tensor, Tensor]:
        """(peg tip xyz [N, 3], hole rim centre xyz [N, 3]) as float32."""
        sensors = state.sensordata.float()
        return sensors[:, self.tip_pos], sensors[:, self.hole_pos]

    def target_to_action(self, target: Tensor) -> Tensor:
        low, high = self.low.to(target.device), self.high.to(target.device)
        return ((target - low) / (high - low) * 2 - 1).clamp(-1.0, 1.0)

    # ---- Task API ----
    def sample_init(
        self, n: int, generator: torch.Generator, device: torch.device | str
    ) -> tuple[Tensor, Tensor]:
        qpos = torch.zeros(n, self.nq)
        hole = (torch.rand(n, 2, generator=generator) * 2 - 1) * self.hole_range
        peg = (torch.rand(n, 2, generator=generator) * 2 - 1) * self.peg_range
        height = 0.12 + torch.rand(n, generator=generator) * 0.04
        qpos[:, self.hole_joints] = hole
        qpos[:, self.peg_joints[:2]] = peg
        qpos[:, self.peg_joints[2]] = height
        return qpos.to(device), torch.zeros(n, self.nv, device=device)

    def action_to_ctrl(self, action: Tensor) -> Tensor:
        ctrl = torch.zeros(action.shape[0], self.nu, device=action.device)
        ctrl[:, self.actuators] = scale_action(
            action, self.low.to(action.device), self.high.to(action.device)
        )
        return ctrl

    def observe(self, state: SimState) -> Tensor:
        tip, hole = self.poses(state)
        return torch.cat((tip, hole, tip - hole), dim=1)

    def evaluate(self, state: SimState, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        tip, hole = self.poses(state)
        xy_error = (tip[:, :2] - hole[:, :2]).norm(dim=1)
        depth = hole[:, 2] - tip[:, 2]
        over_hole = xy_error < self.axis_tolerance
        progress = torch.where(
            over_hole, (depth / self.insert_depth).clamp(0.0, 1.0), torch.zeros_like(depth)
        )
        reward = 0.5 * (1 - torch.tanh(20 * xy_error)) + 0.5 * progress
        success = over_hole & (depth >= self.insert_depth)
        return reward, success, torch.zeros_like(success)
