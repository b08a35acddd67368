"""Scripted lift expert: align above the cube, descend, close, lift.

Phases per env (kept between steps, reset with the env):
0 align: move over the cube at hover height, turn the hand to a grasp yaw, gripper open;
1 descend: go down to grasp height once aligned;
2 close: close the gripper and wait a few steps;
3 lift: raise the hand; if the cube slips out, start again from 0.
A cube looks the same every 90 degrees, so the hand can grasp either pair of faces: each episode
draws one (multimodal demonstrations); its hover height also varies per episode. Quality < 1
moves less per step, adds noise and hesitations (the hand holds its position).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from embodied_rl.envs.experts import TargetExpert
from embodied_rl.envs.experts.push_t import clamp_norm
from embodied_rl.envs.tasks.lift import CUBE_HALF, YAW_RANGE
from embodied_rl.envs.tasks.push_t import wrap_angle

GRASP_HEIGHT = CUBE_HALF + 0.007  # hand origin above the table when grasping (fingertips clear it)
LIFT_TARGET = 0.15
CLOSE_STEPS = 3


class Expert(TargetExpert):
    noise_scale = 0.04

    def __init__(self, env: Any, quality: float = 1.0, generator: torch.Generator | None = None,
                 mistakes: float = 0.0):
        super().__init__(env, quality, generator, mistakes)
        self.phase = torch.zeros(self.num_envs, dtype=torch.long)
        self.timer = torch.zeros(self.num_envs, dtype=torch.long)
        self.other_faces = torch.zeros(self.num_envs, dtype=torch.bool)
        self.hover = torch.full((self.num_envs,), 0.08)
        self.reset()

    def reset(self, mask: Tensor | None = None) -> None:
        super().reset(mask)
        mask = self.reset_rows(mask)
        self.phase[mask] = 0
        self.timer[mask] = 0
        coin = torch.rand(self.num_envs, generator=self.generator) < 0.5
        self.other_faces = torch.where(mask, coin, self.other_faces)
        hover = 0.06 + 0.04 * torch.rand(self.num_envs, generator=self.generator)
        self.hover = torch.where(mask, hover, self.hover)

    def plan(self, obs: Any) -> Tensor:
        task = self.task
        p = {key: value.cpu() for key, value in task.poses(self.env.state).items()}
        hand, cube = p["hand"], p["cube"]

        # grasp yaw: the cube's yaw folded into [-45, 45] deg, or turned 90 deg to the other faces
        yaw = torch.remainder(p["cube_yaw"] + math.pi / 4, math.pi / 2) - math.pi / 4
        turned = yaw - torch.where(yaw >= 0, 1.0, -1.0) * (math.pi / 2)
        yaw = torch.where(self.other_faces, turned, yaw).clamp(-YAW_RANGE, YAW_RANGE)
        yaw_error = wrap_angle(yaw - p["hand_yaw"]).abs()

        xy_error = (cube[:, :2] - hand[:, :2]).norm(dim=1)
        cube_lifted = cube[:, 2] > CUBE_HALF + 0.01
        phase = self.phase
        # transitions
        aligned = (xy_error < 0.006) & (yaw_error < 0.06)
        phase = torch.where((phase == 0) & aligned, 1, phase)
        phase = torch.where((phase == 1) & (xy_error > 0.015), 0, phase)
        down = hand[:, 2] < GRASP_HEIGHT + 0.006
        phase = torch.where((phase == 1) & down, 2, phase)
        self.timer = torch.where(phase == 2, self.timer + 1, torch.zeros_like(self.timer))
        phase = torch.where((phase == 2) & (self.timer > CLOSE_STEPS), 3, phase)
        dropped = (phase == 3) & ~cube_lifted & (hand[:, 2] > GRASP_HEIGHT + 0.04)
        phase = torch.where(dropped, 0, phase)
        self.phase = phase

        target = torch.zeros(hand.shape[0], 3)
        target[:, :2] = cube[:, :2]
        target[:, 2] = torch.where(phase == 0, self.hover, GRASP_HEIGHT)
        target[:, 2] = torch.where(
            phase == 3, torch.full_like(target[:, 2], LIFT_TARGET), target[:, 2]
        )
        target[:, :2] = torch.where((phase == 3)[:, None], hand[:, :2], target[:, :2])
        step = torch.where(phase == 3, 0.04, 0.03) * self.speed
        move = clamp_norm(target - hand, step)
        goal = hand + move
        grip = torch.where(phase >= 2, 1.0, -1.0)
        self.hold = task.target_to_action(torch.cat((hand, p["hand_yaw"][:, None]), dim=1), grip)
        return task.target_to_action(torch.cat((goal, yaw[:, None]), dim=1), grip)
