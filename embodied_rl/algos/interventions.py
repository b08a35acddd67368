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

`ExpertTakeover` is what a training loop calls: `act` (the expert's action where it drives),
`after_step`, `metrics` for the logging window and `state_dict` for the checkpoint. Built without
an expert (`algo.interventions=none`) it never takes over and logs nothing.
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


class ExpertTakeover:
    """The task's scripted expert taking over envs where the schedule fires, and the logging
    window's `train/intervention_rate` (the share of env steps the expert drove) and
    `rollout/success_rate_unassisted` (the successes of episodes it never touched)."""

    def __init__(self, num_envs: int, schedule: InterventionSchedule | None = None, expert: Any = None):
        self.schedule, self.expert = schedule, expert
        self.driven = torch.zeros(num_envs, dtype=torch.bool)    # the envs the expert drives this step
        self.assisted = torch.zeros(num_envs, dtype=torch.bool)  # episodes it drove at least one step of
        self.driven_steps = self.window_steps = 0
        self.unassisted: list[float] = []  # successes of episodes without interventions, this window

    def act(self, obs: Any, action: Tensor) -> Tensor:
        """Before the env step: `action` with the expert's where it drives (`self.driven`)."""
        self.window_steps += len(action)
        if self.schedule is None:
            return action
        self.driven, starting = self.schedule.begin()
        if bool(starting.any()):  # a takeover plans afresh from the env's current state
            self.expert.reset(starting)
        if bool(self.driven.any()):
            action = torch.where(self.driven[:, None].to(action.device), self.expert.act(obs).to(action), action)
        self.assisted |= self.driven
        self.driven_steps += int(self.driven.sum())
        return action

    def after_step(self, reward: Tensor, done: Tensor, info: dict[str, Any]) -> None:
        if self.schedule is None:
            return
        self.schedule.after_step(reward, done)
        ended = info["_episode"].cpu()
        self.unassisted += info["episode"]["success_once"].cpu()[ended & ~self.assisted].float().tolist()
        self.assisted &= ~done.cpu()

    def metrics(self) -> dict[str, float]:
        if self.schedule is None:
            return {}
        row = {"train/intervention_rate": self.driven_steps / max(1, self.window_steps)}
        if self.unassisted:
            row["rollout/success_rate_unassisted"] = sum(self.unassisted) / len(self.unassisted)
        return row

    def window_logged(self) -> None:
        """A metrics row was written: the next logging window starts."""
        self.driven_steps = self.window_steps = 0
        self.unassisted = []

    def state_dict(self) -> dict[str, Any]:
        if self.schedule is None:
            return {}
        return {"interventions": self.schedule.state_dict(), "expert": expert_state(self.expert),
                "assisted": self.assisted, "unassisted": torch.tensor(self.unassisted, dtype=torch.float64),
                "intervention_window": torch.tensor([self.driven_steps, self.window_steps])}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if self.schedule is None:
            return
        self.schedule.load_state_dict(saved["interventions"])
        load_expert_state(self.expert, saved["expert"])
        self.assisted, self.unassisted = saved["assisted"], saved["unassisted"].tolist()
        self.driven_steps, self.window_steps = (int(x) for x in saved["intervention_window"])


def expert_state(expert: Any) -> dict[str, Any]:
    """A scripted expert's per-env state (its tensor attributes: phases, timers, waypoints) and
    its generator, for a checkpoint: a resume in the middle of an intervention continues it."""
    tensors = {name: value.clone() for name, value in vars(expert).items() if isinstance(value, Tensor)}
    return {"tensors": tensors, "generator": expert.generator.get_state()}


def load_expert_state(expert: Any, state: dict[str, Any]) -> None:
    for name, value in state["tensors"].items():
        setattr(expert, name, value.clone())
    expert.generator.set_state(state["generator"])
