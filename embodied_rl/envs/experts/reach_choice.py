"""Scripted expert for reach_choice: command the fingertip to the target obs["instruction"] names.

It reads only the observation: the instruction id picks the red (state[2:4]) or the blue
(state[4:6]) target, the fingertip is state[0:2]. At quality q < 1 it moves in smaller
increments (slower), adds action noise and hesitates by holding its current position
(ScriptedExpert's degradation)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embodied_rl.envs.experts.reach import Expert as ReachExpert
from embodied_rl.envs.tasks.reach_choice import RED


class Expert(ReachExpert):
    """reach's expert, aimed at the target the instruction names (read from the observation)."""

    def finger_and_target(self, obs: Any) -> tuple[Tensor, Tensor]:
        state = obs["state"].cpu()
        instruction = obs["instruction"].cpu()
        target = torch.where((instruction == RED)[:, None], state[:, 2:4], state[:, 4:6])
        return state[:, 0:2], target
