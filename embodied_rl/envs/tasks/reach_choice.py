"""reach_choice: the reach gantry with a red and a blue target; an instruction names the one to reach.

The smallest language-conditioned task: the same fingertip as reach, two randomised targets, and
per episode one of two instructions (drawn by the env, read from `SimState.instruction`).
- Instructions: "reach the red target" (id 0), "reach the blue target" (id 1); uniform per episode.
- Actions (2): target x/y positions of the two position actuators, [-1, 1] -> [-0.2, 0.2] m.
- Observation (8): fingertip xy, red target xy, blue target xy, fingertip velocity xy; the env
  adds obs["instruction"].
- Reward: -10 * distance (m) to the instructed target per step, +1 on the step that succeeds.
- Success: fingertip within `success_radius` (2 cm) of the instructed target in the xy plane
  (the other target does not count); it ends the episode (terminated). No failure. Time limit
  50 steps (2 s: 4 substeps of 10 ms).
- Initial state: fingertip and both targets uniform in [-0.15, 0.15]^2, each at least 5 cm from
  the other two.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embodied_rl.envs.api import SimState, joint_qpos_slice, sensor_slice
from embodied_rl.envs.tasks.reach import ReachTask

RED, BLUE = 0, 1  # instruction ids


class ReachChoiceTask(ReachTask):
    """ReachTask's gantry and controls (bind_gantry, action_to_ctrl) with two targets."""

    name = "reach_choice"
    gym_id = "embodied_rl/ReachChoice-v0"
    xml = "reach_choice.xml"
    # timing, sizes, camera, success radius and initial ranges: as reach
    success_criterion = ("the fingertip is within 2 cm of the instructed target (red or blue) in the x/y "
                         "plane (ends the episode)")
    instructions = ("reach the red target", "reach the blue target")

    def bind(self, model: Any) -> None:
        self.bind_gantry(model)
        self.red_qpos = [joint_qpos_slice(model, j).start for j in ("red_x", "red_y")]
        self.blue_qpos = [joint_qpos_slice(model, j).start for j in ("blue_x", "blue_y")]
        self.red = sensor_slice(model, "red_pos")
        self.blue = sensor_slice(model, "blue_pos")

    def _uniform(self, n: int, generator: torch.Generator) -> Tensor:
        return (torch.rand(n, 2, generator=generator) * 2 - 1) * self.init_range

    def sample_init(self, n: int, generator: torch.Generator, device: torch.device | str) -> tuple[Tensor, Tensor]:
        finger = self._uniform(n, generator)
        red = self._uniform(n, generator)
        blue = self._uniform(n, generator)
        near = self.min_init_distance
        for _ in range(20):  # redraw targets that start too close (a fixed number of draws)
            close = (red - finger).norm(dim=1) < near
            red = torch.where(close[:, None], self._uniform(n, generator), red)
        for _ in range(20):
            close = ((blue - finger).norm(dim=1) < near) | ((blue - red).norm(dim=1) < near)
            blue = torch.where(close[:, None], self._uniform(n, generator), blue)
        qpos = torch.zeros(n, self.nq)
        qpos[:, self.finger_qpos] = finger
        qpos[:, self.red_qpos] = red
        qpos[:, self.blue_qpos] = blue
        return qpos.to(device), torch.zeros(n, self.nv, device=device)

    def positions(self, state: SimState) -> tuple[Tensor, Tensor, Tensor]:
        """(fingertip xy, red target xy, blue target xy) [N, 2] float32."""
        sensors = state.sensordata.float()
        return sensors[:, self.fingertip][:, :2], sensors[:, self.red][:, :2], sensors[:, self.blue][:, :2]

    def instructed_target(self, state: SimState) -> Tensor:
        """xy [N, 2] of the target each env's instruction names."""
        if state.instruction is None:
            raise ValueError("reach_choice needs SimState.instruction (the env's instruction ids)")
        _, red, blue = self.positions(state)
        return torch.where((state.instruction == RED).to(red.device)[:, None], red, blue)

    def observe(self, state: SimState) -> Tensor:
        finger, red, blue = self.positions(state)
        velocity = state.sensordata[:, self.fingertip_vel][:, :2].float()
        return torch.cat([finger, red, blue, velocity], dim=1)

    def evaluate(self, state: SimState, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        finger, _, _ = self.positions(state)
        distance = (self.instructed_target(state) - finger).norm(dim=1)
        success = distance < self.success_radius
        reward = -10.0 * distance + success.float()
        return reward, success, torch.zeros_like(success)
