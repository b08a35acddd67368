"""Expert interventions (HIL-SERL / ConRFT style, with the task's scripted expert as the human):
when a trigger fires in an env, the expert drives that env for `steps` env steps, and the
off-policy learner stores those steps as demonstrations.

Triggers (`algo.intervention_trigger`):
- `stall`: the env's reward (the task's dense env reward, whatever the training reward) has not
  risen above its best of the episode for `stall_steps` steps of the policy's own control: the
  policy is stuck (the steps the expert drives do not count, so after a takeover the policy gets
  `stall_steps` steps to beat the best the expert reached);
- `random`: each step, an env not already driven starts an intervention with probability `prob`.
The counters restart with every episode. `state_dict()` holds every counter and the random
trigger's generator, so a resumed run triggers exactly as the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

TRIGGERS = ("stall", "random")


class InterventionSchedule:
    def __init__(self, num_envs: int, trigger: str, stall_steps: int, prob: float, steps: int, seed: int):
        if trigger not in TRIGGERS:
            raise ValueError(f"unknown trigger {trigger!r} (choose from: {', '.join(TRIGGERS)})")
        self.trigger, self.stall_steps, self.prob, self.steps = trigger, int(stall_steps), float(prob), int(steps)
        self.remaining = torch.zeros(num_envs, dtype=torch.long)   # steps of expert control left
        self.best = torch.full((num_envs,), -torch.inf)           # the episode's best reward so far
        self.stalled = torch.zeros(num_envs, dtype=torch.long)     # steps since the best last rose
        self.generator = torch.Generator().manual_seed(int(seed))

    def begin(self) -> tuple[Tensor, Tensor]:
        """Before acting: start interventions where the trigger fires. Returns (the envs the
        expert drives this step, the envs whose intervention starts now), bool [N]."""
        free = self.remaining == 0
        if self.trigger == "stall":
            fire = free & (self.stalled >= self.stall_steps)
        else:
            fire = free & (torch.rand(len(free), generator=self.generator) < self.prob)
        self.remaining[fire] = self.steps
        self.stalled[fire] = 0
        return self.remaining > 0, fire

    def after_step(self, reward: Tensor, done: Tensor) -> None:
        """After the env step: count one step of control and of progress; an ended episode
        clears its env's counters."""
        reward, done = reward.detach().float().cpu(), done.cpu()
        improved = reward > self.best
        self.best = torch.where(improved, reward, self.best)
        # only the policy's own steps count towards a stall: once the expert lets go, the policy
        # has stall_steps steps to improve on the best the expert reached
        driven = self.remaining > 0
        self.stalled = torch.where(improved | driven, torch.zeros_like(self.stalled), self.stalled + 1)
        self.remaining = (self.remaining - 1).clamp(min=0)
        self.best[done] = -torch.inf
        self.stalled[done] = 0
        self.remaining[done] = 0

    def state_dict(self) -> dict[str, Any]:
        return {"remaining": self.remaining.clone(), "best": self.best.clone(), "stalled": self.stalled.clone(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.remaining, self.best, self.stalled = state["remaining"].clone(), state["best"].clone(), state["stalled"].clone()
        self.generator.set_state(state["generator"])


def expert_state(expert: Any) -> dict[str, Any]:
    """A scripted expert's per-env state (its tensor attributes: phases, timers, waypoints) and
    its generator, for a checkpoint: a resume in the middle of an intervention continues it."""
    tensors = {name: value.clone() for name, value in vars(expert).items() if isinstance(value, Tensor)}
    return {"tensors": tensors, "generator": expert.generator.get_state()}


def load_expert_state(expert: Any, state: dict[str, Any]) -> None:
    for name, value in state["tensors"].items():
        setattr(expert, name, value.clone())
    expert.generator.set_state(state["generator"])
