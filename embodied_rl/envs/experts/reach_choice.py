"""Scripted expert for reach_choice: command the fingertip to the target obs["instruction"] names.

It reads only the observation: the instruction id picks the red (state[2:4]) or the blue
(state[4:6]) target, the fingertip is state[0:2]. At quality q < 1 it moves in smaller
increments (slower), adds action noise and hesitates by holding its current position
(ScriptedExpert's degradation)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embodied_rl.envs.experts import ScriptedExpert
from embodied_rl.envs.tasks.reach_choice import RED


class Expert(ScriptedExpert):
    noise_scale = 0.3
    slow_scale = 0.0  # slowness is done in plan(): actions are positions, not velocities

    def _to_action(self, xy: Tensor) -> Tensor:
        low, high = self.task.ctrl_low, self.task.ctrl_high
        return ((xy - low) / (high - low) * 2 - 1).clamp(-1, 1)

    def plan(self, obs: Any) -> Tensor:
        state = obs["state"].cpu()
        instruction = obs["instruction"].cpu()
        finger = state[:, 0:2]
        target = torch.where((instruction == RED)[:, None], state[:, 2:4], state[:, 4:6])
        # quality 1 commands the target itself; lower quality steps only part of the way
        fraction = 1.0 - 0.8 * (1.0 - self.quality)
        goal = finger + fraction * (target - finger)
        self._hold = self._to_action(finger)
        return self._to_action(goal)

    def hold_action(self, actions: Tensor) -> Tensor:
        return self._hold
