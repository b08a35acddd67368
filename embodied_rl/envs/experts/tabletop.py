"""Scripted tabletop expert: one plan per template, chosen by each env's instruction.

Phases per env (kept between steps, reset with the env):
  pick / put: 0 over the named cube at a hover height, gripper open; 1 down to grasp height;
              2 close for a few steps; 3 up to carry height (pick ends here: the cube is lifted);
              put goes on: 4 over the named pad at carry height; 5 down until the cube rests on
              the pad; 6 open (put ends here).
              If the cube slips out while carried, it starts again from 0.
  touch:      0 over the named pad at a hover height; 1 down onto it (ends here).
It reads privileged state (the task's poses). Multimodal: the hover and carry heights and the
point aimed at on the pad vary per episode. Quality < 1 moves less per step, adds action noise and
hesitations (the hand holds its position).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embodied_rl.envs.experts import TargetExpert
from embodied_rl.envs.experts.push_t import clamp_norm
from embodied_rl.envs.tasks.tabletop import CUBE_HALF, HAND_LOW_Z

GRASP_HEIGHT = HAND_LOW_Z  # fingertips 2 mm above the table, the cube's centre between the pads
PLACE_HEIGHT = HAND_LOW_Z + 0.004  # a carried cube touches the table just below this
CLOSE_STEPS = 2
OPEN_STEPS = 2
PICK, PUT, TOUCH = 0, 1, 2


class Expert(TargetExpert):
    noise_scale = 0.04

    def __init__(self, env: Any, quality: float = 1.0, generator: torch.Generator | None = None,
                 mistakes: float = 0.0):
        super().__init__(env, quality, generator, mistakes)
        n = self.num_envs
        self.phase = torch.zeros(n, dtype=torch.long)
        self.timer = torch.zeros(n, dtype=torch.long)
        self.hover = torch.full((n,), 0.09)
        self.carry = torch.full((n,), 0.12)
        self.aim = torch.zeros(n, 2)  # offset from the pad's centre where a cube or the hand goes
        self.reset()

    def reset(self, mask: Tensor | None = None) -> None:
        super().reset(mask)
        mask = self.reset_rows(mask)
        n = self.num_envs
        self.phase[mask] = 0
        self.timer[mask] = 0
        hover = 0.08 + 0.03 * torch.rand(n, generator=self.generator)  # fingertips clear the cubes
        carry = 0.09 + 0.05 * torch.rand(n, generator=self.generator)
        aim = (torch.rand(n, 2, generator=self.generator) * 2 - 1) * 0.006
        self.hover = torch.where(mask, hover, self.hover)
        self.carry = torch.where(mask, carry, self.carry)
        self.aim = torch.where(mask[:, None], aim, self.aim)

    def plan(self, obs: Any) -> Tensor:
        task, state = self.task, self.env.state
        p = {key: value.cpu() for key, value in task.poses(state).items()}
        kind, cube, pad = (value.cpu() for value in task.targets(state))
        hand = p["hand"]
        phase, timer = self.phase, self.timer
        touching = kind == TOUCH

        # transitions (one per step at most, in phase order)
        goal_xy = torch.where(touching[:, None], pad[:, :2] + self.aim, cube[:, :2])
        xy_error = (goal_xy - hand[:, :2]).norm(dim=1)
        lifted = cube[:, 2] > CUBE_HALF + 0.01
        at = hand[:, 2]
        new = phase.clone()
        new = torch.where((phase == 0) & (xy_error < 0.006), 1, new)
        new = torch.where((phase == 1) & (xy_error > 0.015), 0, new)
        new = torch.where((phase == 1) & ~touching & (at < GRASP_HEIGHT + 0.004), 2, new)
        new = torch.where((phase == 2) & (timer >= CLOSE_STEPS), 3, new)
        carried = (phase >= 3) & (phase <= 5)
        new = torch.where(carried & ~lifted & (at > GRASP_HEIGHT + 0.03), 0, new)  # slipped out
        over_pad = (cube[:, :2] - (pad[:, :2] + self.aim)).norm(dim=1) < 0.006
        new = torch.where((phase == 3) & (kind == PUT) & (at > self.carry - 0.01), 4, new)
        new = torch.where((phase == 4) & over_pad, 5, new)
        new = torch.where((phase == 5) & (at < PLACE_HEIGHT + 0.004), 6, new)
        self.timer = torch.where(new == phase, timer + 1, torch.zeros_like(timer))
        self.phase = phase = new

        target = hand.clone()
        target[:, :2] = goal_xy
        target[:, 2] = torch.where(phase == 0, self.hover, GRASP_HEIGHT)
        target[:, 2] = torch.where(touching & (phase == 0), self.hover, target[:, 2])
        # carrying: up first, then across at carry height, then down onto the pad
        up = phase == 3
        target[up] = torch.cat((hand[up, :2], self.carry[up, None]), dim=1)
        across = phase == 4
        # move the hand so that the cube (offset from the hand) goes over the pad
        offset = cube[:, :2] - hand[:, :2]
        place_xy = pad[:, :2] + self.aim - offset
        target[across] = torch.cat((place_xy[across], self.carry[across, None]), dim=1)
        down = phase >= 5
        target[down] = torch.cat((place_xy[down], torch.full_like(self.carry[down, None], PLACE_HEIGHT)), dim=1)
        step = torch.where(up | across, 0.05, 0.035) * self.speed
        goal = hand + clamp_norm(target - hand, step)
        grip = torch.where((phase >= 2) & (phase <= 5), 1.0, -1.0)
        self.hold = task.target_to_action(hand, grip)
        return task.target_to_action(goal, grip)
