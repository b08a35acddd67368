"""Scripted expert for reach: command the fingertip to the target (privileged: reads SimState).

At quality q < 1 it moves in smaller increments towards the target (slower), adds action noise
and hesitates by holding its current position (ScriptedExpert's degradation)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from embodied_rl.envs.experts import ScriptedExpert


class Expert(ScriptedExpert):
    noise_scale = 0.3
    slow_scale = 0.0  # slowness is done in plan(): actions are positions, not velocities

    def _to_action(self, xy: Tensor) -> Tensor:
        low, high = self.task.ctrl_low, self.task.ctrl_high
        return ((xy - low) / (high - low) * 2 - 1).clamp(-1, 1)

    def finger_and_target(self, obs: Any) -> tuple[Tensor, Tensor]:
        """(fingertip xy, target xy) [N, 2] on the CPU."""
        finger, target = self.task.positions(self.env.state)
        return finger.cpu(), target.cpu()

    def plan(self, obs: Any) -> Tensor:
        finger, target = self.finger_and_target(obs)
        # quality 1 commands the target itself; lower quality steps only part of the way
        fraction = 1.0 - 0.8 * (1.0 - self.quality)
        goal = finger + fraction * (target - finger)
        self._hold = self._to_action(finger)
        return self._to_action(goal)

    def hold_action(self, actions: Tensor) -> Tensor:
        return self._hold
