"""Warm start (WSRL) shared by every off-policy method: a staged schedule over env steps.

    env steps [0, warmup_env_steps)                          "warmup": the base policy acts
        (DSRL: noise ~ N(0, I), the sampler's own prior; residual: zero residual); data goes
        into the replay buffer; no gradient updates at all.
    [warmup_env_steps, warmup_env_steps + critic_only_steps)  "critic": rollouts with the
        (still untouched) actor; only the critics are updated, so the actor starts from a
        critic that has already seen on-policy data of the base policy.
    afterwards                                                "full": critic and actor updates.

A residual learner may also ramp its reach (`reach`): the residual's bound grows linearly from
5% to 100% of its scale over the first `reach_ramp_steps` env steps of the full phase, so an
actor that still follows an immature critic can move the policy only a little (the dip below
BC that a full-reach start shows on tasks BC already solves).

Both lengths are in simulator env steps summed over all envs (the same clock as
`cfg.env_steps`). WSRL (Zhou et al., 2024) showed that this keeps a pretrained policy from
collapsing in the first online updates; ResFiT and DSRL use the same idea.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embodied_rl.errors import UserError

WARMUP, CRITIC, FULL = "warmup", "critic", "full"


# the reach at the start of the ramp: the residual explores (and its actor gets a gradient) from
# the first update, within a bound small enough to leave the base policy's behaviour intact
FIRST_REACH = 0.05


@dataclass
class WarmStart:
    warmup_env_steps: int = 0
    critic_only_steps: int = 0
    reach_ramp_steps: int = 0

    def __post_init__(self) -> None:
        if self.warmup_env_steps < 0 or self.critic_only_steps < 0 or self.reach_ramp_steps < 0:
            raise UserError("warmup_env_steps, critic_only_steps and reach_ramp_steps must be >= 0")

    def phase(self, env_steps: int) -> str:
        if env_steps < self.warmup_env_steps:
            return WARMUP
        if env_steps < self.warmup_env_steps + self.critic_only_steps:
            return CRITIC
        return FULL

    def reach(self, env_steps: int) -> float:
        """The fraction of the residual's scale it may use at `env_steps` (1 without a ramp)."""
        if self.reach_ramp_steps == 0:
            return 1.0
        into_full = env_steps - self.warmup_env_steps - self.critic_only_steps
        return min(1.0, max(FIRST_REACH, into_full / self.reach_ramp_steps))

    def updates_critic(self, env_steps: int) -> bool:
        return self.phase(env_steps) != WARMUP

    def updates_actor(self, env_steps: int) -> bool:
        return self.phase(env_steps) == FULL


def check_actor_trains(cfg: Any) -> None:
    """Refuse a run whose env_steps end before the actor's first update (warm-up plus
    critic-only phase, where the algo has them): it would save its base policy, untouched, as
    fine-tuned."""
    algo = cfg.algo
    phases = [(key, int(algo[key])) for key in ("warmup_env_steps", "critic_only_steps") if algo.get(key) is not None]
    first_update = sum(steps for _, steps in phases)
    if phases and int(cfg.env_steps) <= first_update:
        spelled = " + ".join(f"algo.{key}={steps}" for key, steps in phases)
        raise UserError(f"env_steps={cfg.env_steps} ends before the actor's first update ({spelled} env steps "
                        f"first train only the critic); set env_steps above {first_update} or shorten those phases")

