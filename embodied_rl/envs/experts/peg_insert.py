"""Scripted peg_insert expert: go above the hole, align precisely, push down.

Per env and step (stateless apart from the approach style):
- peg tip below the rim but off the hole axis (stuck on a wall or beside the block): rise first;
- off the axis: move to the pre-insert point above the hole. Each episode draws an approach
  style (multimodal demonstrations): "high" goes over at travel height, then descends; "direct"
  heads straight for the pre-insert point, whose height also varies per episode;
- on the axis (within 1.5 mm, 2.5 mm once inside): descend to the hole floor, at most 2 cm per step.
Quality < 1 moves less per step, adds noise and hesitations (the peg holds its position).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embodied_rl.envs.experts import TargetExpert
from embodied_rl.envs.experts.push_t import clamp_norm

TRAVEL_HEIGHT = 0.1  # metres above the rim


class Expert(TargetExpert):
    noise_scale = 0.02  # action units (1 = 15 cm): 3 mm of noise at quality 0

    def __init__(self, env: Any, quality: float = 1.0, generator: torch.Generator | None = None,
                 mistakes: float = 0.0):
        super().__init__(env, quality, generator, mistakes)
        self.direct = torch.zeros(self.num_envs, dtype=torch.bool)
        self.pre_insert = torch.full((self.num_envs,), 0.02)
        self.reset()

    def reset(self, mask: Tensor | None = None) -> None:
        super().reset(mask)
        mask = self.reset_rows(mask)
        coin = torch.rand(self.num_envs, generator=self.generator) < 0.5
        self.direct = torch.where(mask, coin, self.direct)
        height = 0.01 + 0.03 * torch.rand(self.num_envs, generator=self.generator)
        self.pre_insert = torch.where(mask, height, self.pre_insert)

    def plan(self, obs: Any) -> Tensor:
        task = self.task
        tip, hole = (x.cpu() for x in task.poses(self.env.state))
        xy_error = (hole[:, :2] - tip[:, :2]).norm(dim=1)
        below_rim = tip[:, 2] < hole[:, 2] + 0.003
        on_axis = (xy_error < 0.0015) | (below_rim & (xy_error < 0.0025))

        # off the axis: the pre-insert point above the hole, over travel height unless direct
        pre_insert = torch.cat((hole[:, :2], (hole[:, 2] + self.pre_insert)[:, None]), dim=1)
        far = xy_error > 0.01
        travel = hole[:, 2] + TRAVEL_HEIGHT
        over = torch.cat((hole[:, :2], travel[:, None]), dim=1)  # travel height above the hole
        climb = torch.cat((tip[:, :2], travel[:, None]), dim=1)  # straight up to travel height
        high_route = torch.where((tip[:, 2] < travel - 0.01)[:, None], climb, over)
        approach = torch.where((~self.direct & far)[:, None], high_route, pre_insert)
        # stuck below the rim off the axis: straight up
        rise = tip.clone()
        rise[:, 2] = hole[:, 2] + 0.01
        # on the axis: down to the floor (4 cm below the rim)
        insert = torch.cat((hole[:, :2], (hole[:, 2] - 0.045)[:, None]), dim=1)

        goal = torch.where(
            on_axis[:, None], insert, torch.where(below_rim[:, None], rise, approach)
        )
        # big moves are clamped per step; the final xy alignment is exact (position control)
        step = torch.where(on_axis, 0.02, 0.04) * self.speed
        target = tip + clamp_norm(goal - tip, step)
        target[:, :2] = torch.where((xy_error < 0.01)[:, None], goal[:, :2], target[:, :2])
        self.hold = task.target_to_action(tip)
        return task.target_to_action(target)
