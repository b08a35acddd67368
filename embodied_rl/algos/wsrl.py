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

Beyond `free_reach`, the reach is earned (`EarnedReach`): the ramp may take the residual past
that fraction of its scale only as far as the training episodes have shown it to help, and a
window that shows harm takes reach back.

Both lengths are in simulator env steps summed over all envs (the same clock as
`cfg.env_steps`). WSRL (Zhou et al., 2024) showed that this keeps a pretrained policy from
collapsing in the first online updates; ResFiT and DSRL use the same idea.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from embodied_rl import distributed
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


# how much reach one window's verdict gives or takes, as a fraction of the residual's scale
REACH_STEP = 0.2


@dataclass
class EarnedReach:
    """A cap on the ramp's reach, moved by the success of the training episodes.

    The critic-only phase measures the baseline: the success of training episodes with the actor
    still untouched (the base policy, the first reach and the exploration noise). In the full
    phase, every `window` finished episodes give a verdict against it, with a margin of two
    standard errors of the difference (at least one episode in the window):
        success above baseline + margin -> the cap grows by REACH_STEP (up to 1),
        success below baseline - margin -> the cap shrinks by REACH_STEP (down to FIRST_REACH),
        else it stays.
    The cap starts at `free_reach`: up to there the ramp alone sets the reach (1.0: no cap).
    Each episode counts for the regime it started in (`regime`: the critic-only phase, or the
    full phase under the cap of its start), once it ends: counting episodes by when they end
    would favour the short, successful ones at the start of a regime and the long failures after it.
    Why: on a task BC already solves, a residual at full reach follows the critic's slope into
    misses the critic cannot see (Meta-World peg-insert-side, .96 -> .46 at scale 0.5; .96 held at
    0.2), while a task far from solved needs the full reach (tabletop peg_insert: 0.5). Success,
    not the critic, decides which of the two a task is (docs/finetuning.md, "Do no harm").
    Episode counts are summed over ranks, so every rank holds the same cap.
    """

    free_reach: float = 1.0
    window: int = 50

    IGNORED, BASELINE = -1, 0  # regimes: warm-up episodes count for nothing; critic-only ones are the baseline

    def __post_init__(self) -> None:
        if not 0 < self.free_reach <= 1 or self.window < 1:
            raise UserError("free_reach must be in (0, 1] and reach_window >= 1")
        self.cap = self.free_reach
        self.full_regime = 1  # the regime of full-phase episodes started under the present cap
        self.counts = {"baseline": [0.0, 0.0], "window": [0.0, 0.0]}  # [successes, episodes]

    @property
    def baseline(self) -> float | None:
        successes, episodes = self.counts["baseline"]
        return successes / episodes if episodes else None

    def regime(self, phase: str) -> int:
        """The regime an episode starting now belongs to."""
        if self.free_reach == 1.0 or phase == WARMUP:
            return self.IGNORED
        return self.BASELINE if phase == CRITIC else self.full_regime

    def record(self, regimes: Tensor, successes: Tensor) -> None:
        """Episodes that ended (their regimes and successes, this rank's); a full window moves the cap."""
        if self.free_reach == 1.0:
            return
        counts = torch.stack([successes[regimes == self.BASELINE].float().sum(), (regimes == self.BASELINE).float().sum(),
                              successes[regimes == self.full_regime].float().sum(),
                              (regimes == self.full_regime).float().sum()])
        baseline_successes, baseline_episodes, successes_now, episodes_now = distributed.all_sum(counts).tolist()
        self.counts["baseline"][0] += baseline_successes
        self.counts["baseline"][1] += baseline_episodes
        window = self.counts["window"]
        window[0] += successes_now
        window[1] += episodes_now
        if window[1] < self.window:
            return
        rate, n = window[0] / window[1], window[1]
        if self.baseline is None:  # no critic-only phase: the first full window is the baseline
            self.counts["baseline"] = list(window)
        else:
            base, m = self.baseline, self.counts["baseline"][1]
            margin = max(2.0 * (base * (1 - base) / m + rate * (1 - rate) / n) ** 0.5, 1.0 / n)
            cap = self.cap
            if rate > base + margin:
                self.cap = min(1.0, self.cap + REACH_STEP)
            elif rate < base - margin:
                self.cap = max(FIRST_REACH, self.cap - REACH_STEP)
            if self.cap != cap:  # episodes under way started under the old cap: they count for nothing
                self.full_regime += 1
        self.counts["window"] = [0.0, 0.0]

    def state_dict(self) -> dict[str, Any]:
        return {"cap": self.cap, "full_regime": self.full_regime,
                "counts": {key: list(value) for key, value in self.counts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cap, self.full_regime = float(state["cap"]), int(state["full_regime"])
        self.counts = {key: list(value) for key, value in state["counts"].items()}


def visible_success(info: dict[str, Any]) -> Tensor:
    """Per env, the success of the episode that ended at this step as the learner may see it (the
    learned one under reward=model:PATH); read where info["_episode"] is set."""
    episode = info["episode"]
    return episode.get("learned_success_once", episode["success_once"]).cpu()


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

