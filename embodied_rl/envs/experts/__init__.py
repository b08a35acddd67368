"""Scripted experts: one module per task, `embodied_rl.envs.experts.<task>`, exposing `Expert`.

An expert follows the agent protocol (docs/architecture.md) so collectors and evaluators can run
it like any policy:

    expert = make_expert("reach", env, quality=1.0, generator=torch.Generator().manual_seed(0))
    expert.reset(mask)          # bool[N]: forget per-env state where set (call after env resets)
    actions = expert.act(obs)   # Tensor[N, A] in [-1, 1]

Experts may read privileged state (`env.state`, a SimState, and `env.task`'s bound indices).
`quality` in [0, 1] degrades the expert: 1 is the best expert; lower adds action noise, random
hesitation (zero actions held for a few steps) and slower motion. `ScriptedExpert` implements
that degradation once; a task's expert implements `plan(obs) -> clean actions [N, A]`.
`mistakes` in [0, 1] is the share of episodes in which the expert makes a deliberate mistake and
recovers from it (experts with `makes_mistakes`: LIBERO's first grasp off target, then a regrasp),
so demos hold the states and actions of a recovery, which clean demos never visit.
`TargetExpert` is the base of the experts whose actions are position targets.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embodied_rl.errors import UserError


def no_mistakes(task_name: str) -> UserError:
    """The error for mistakes > 0 with an expert that makes none."""
    return UserError(f"task '{task_name}''s expert makes no deliberate mistakes (mistakes=: LIBERO's experts); "
                     "set mistakes=0")


class ScriptedExpert:
    """Base class: `act` = `plan` degraded according to `quality`.

    Degradation at quality q (bad = 1 - q):
      - slower: actions scaled by (1 - slow_scale * bad) (only for tasks where a smaller action
        means slower motion, i.e. velocity-like actions; set slow_scale = 0 otherwise);
      - noise: Gaussian noise with std noise_scale * bad, clamped to [-1, 1];
      - hesitation: with probability hesitate_prob * bad per step an env starts holding a
        `hold_action` (default: zeros) for hesitate_steps steps.
    """

    noise_scale: float = 0.6
    slow_scale: float = 0.5
    hesitate_prob: float = 0.08
    hesitate_steps: int = 5
    makes_mistakes: bool = False  # whether plan() honours `mistakes`

    def __init__(self, env: Any, quality: float = 1.0, generator: torch.Generator | None = None,
                 mistakes: float = 0.0):
        if not 0.0 <= float(quality) <= 1.0:
            raise UserError(f"quality must be in [0, 1], got {quality}")
        if not 0.0 <= float(mistakes) <= 1.0:
            raise UserError(f"mistakes must be in [0, 1], got {mistakes}")
        if mistakes > 0 and not self.makes_mistakes:
            raise no_mistakes(env.task.name)
        self.mistakes = float(mistakes)
        self.env = env
        self.task = env.task
        self.quality = float(quality)
        self.num_envs = env.num_envs
        self.device = env.device
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.hesitating = torch.zeros(self.num_envs, dtype=torch.long)

    def plan(self, obs: Any) -> Tensor:
        """Clean expert actions [N, A] in [-1, 1]."""
        raise NotImplementedError

    def hold_action(self, actions: Tensor) -> Tensor:
        """What a hesitating env does (default: zero action)."""
        return torch.zeros_like(actions)

    def reset(self, mask: Tensor | None = None) -> None:
        self.hesitating[self.reset_rows(mask)] = 0

    def reset_rows(self, mask: Tensor | None) -> Tensor:
        """`reset`'s mask as a CPU bool [N]; None: every env."""
        return torch.ones(self.num_envs, dtype=torch.bool) if mask is None else mask.cpu().bool()

    def act(self, obs: Any) -> Tensor:
        actions = self.plan(obs).to(device="cpu", dtype=torch.float32)
        bad = 1.0 - self.quality
        if bad > 0:
            actions = actions * (1.0 - self.slow_scale * bad)
            noise = torch.randn(actions.shape, generator=self.generator) * (self.noise_scale * bad)
            actions = actions + noise
            start = torch.rand(self.num_envs, generator=self.generator) < self.hesitate_prob * bad
            self.hesitating[start & (self.hesitating == 0)] = self.hesitate_steps
            holding = self.hesitating > 0
            actions = torch.where(holding[:, None], self.hold_action(actions), actions)
            self.hesitating = (self.hesitating - 1).clamp(min=0)
        return actions.clamp(-1.0, 1.0).to(self.device)


class TargetExpert(ScriptedExpert):
    """An expert whose actions are absolute position targets (push_t, lift, peg_insert, tabletop):
    a smaller target is not a slower motion, so a worse expert moves less per step in `plan`
    (each step scaled by `speed`), and a hesitating env holds where it is: `hold`, which `plan`
    sets to the target of the effector's current position."""

    slow_scale = 0.0  # absolute targets: slowness is applied in plan() instead
    hesitate_prob = 0.05
    hesitate_steps = 3

    def __init__(self, env: Any, quality: float = 1.0, generator: torch.Generator | None = None,
                 mistakes: float = 0.0):
        super().__init__(env, quality, generator, mistakes)
        self.speed = 0.5 + 0.5 * self.quality  # the share of a full step that plan() moves
        self.hold = torch.zeros(self.num_envs, self.task.action_dim)

    def hold_action(self, actions: Tensor) -> Tensor:
        return self.hold


def make_expert(task_name: str, env: Any, quality: float = 1.0, generator: torch.Generator | None = None,
                mistakes: float = 0.0):
    """The scripted expert of `task_name` for `env` (a BatchedEnv of that task)."""
    from embodied_rl.envs.registry import expert_module, import_module

    module = import_module(expert_module(task_name), f"task '{task_name}' has no scripted expert")
    return module.Expert(env, quality=quality, generator=generator, mistakes=mistakes)
