"""Warm start (WSRL) shared by every off-policy method: a staged schedule over env steps.

    env steps [0, warmup_env_steps)                          "warmup": the base policy acts
        (DSRL: noise ~ N(0, I), the sampler's own prior; residual: zero residual); data goes
        into the replay buffer; no gradient updates at all.
    [warmup_env_steps, warmup_env_steps + critic_only_steps)  "critic": rollouts with the
        (still untouched) actor; only the critics are updated, so the actor starts from a
        critic that has already seen on-policy data of the base policy.
    afterwards                                                "full": critic and actor updates.

Both lengths are in simulator env steps summed over all envs (the same clock as
`cfg.env_steps`). WSRL (Zhou et al., 2024) showed that this keeps a pretrained policy from
collapsing in the first online updates; ResFiT and DSRL use the same idea.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embodied_rl.errors import UserError

WARMUP, CRITIC, FULL = "warmup", "critic", "full"


@dataclass
class WarmStart:
    warmup_env_steps: int = 0
    critic_only_steps: int = 0

    def __post_init__(self) -> None:
        if self.warmup_env_steps < 0 or self.critic_only_steps < 0:
            raise UserError("warmup_env_steps and critic_only_steps must be >= 0")

    @classmethod
    def from_config(cls, algo_cfg: Any) -> WarmStart:
        return cls(int(algo_cfg.get("warmup_env_steps", 0)), int(algo_cfg.get("critic_only_steps", 0)))

    def phase(self, env_steps: int) -> str:
        if env_steps < self.warmup_env_steps:
            return WARMUP
        if env_steps < self.warmup_env_steps + self.critic_only_steps:
            return CRITIC
        return FULL

    def updates_critic(self, env_steps: int) -> bool:
        return self.phase(env_steps) != WARMUP

    def updates_actor(self, env_steps: int) -> bool:
        return self.phase(env_steps) == FULL


def sparse_reward(cfg: Any) -> bool:
    """Whether an off-policy run trains on the sparse success reward (`algo.reward`), as PPO does.

    `env`: the task's own reward; `success`: 1 on a step (or chunk) that ends in success, else 0;
    `auto` (default): `success` on tasks with a success signal. Why: push_t's dense coverage
    reward keeps paying while the block sits near the target and success ends the episode, so a
    dense-reward critic values hovering just outside the success region above finishing.
    """
    mode = str(cfg.algo.get("reward", "auto"))
    if mode not in ("env", "success", "auto"):
        raise UserError(f"algo.reward must be env, success or auto, got '{mode}'")
    has_success = bool(cfg.task.get("has_success", True))
    if mode == "success" and not has_success:
        raise UserError(f"algo.reward=success needs a task with a success signal; {cfg.task.name} has none")
    return mode == "success" or (mode == "auto" and has_success)
