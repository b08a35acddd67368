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

What evaluations and checkpoints act with is judged on paired evaluations: for residual TD3/SAC
the residual scaled down to a floor until the training reach is ahead (`JudgedReach`); for every
other method the last weights that beat the deployed ones (`JudgedWeights`). Residual PPO's anchor to the
base policy is released only as far as training success earns (`EarnedReach`).

Both lengths are in simulator env steps summed over all envs (the same clock as
`cfg.env_steps`). WSRL (Zhou et al., 2024) showed that this keeps a pretrained policy from
collapsing in the first online updates; ResFiT and DSRL use the same idea.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
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
    """A cap in [FIRST_REACH, 1] moved by the success of the training episodes (residual PPO's
    anchor release at a high start: algos/ppo.py).

    The critic-only phase measures the baseline: the success of training episodes with the actor
    still untouched. In the full phase, episodes are grouped into cohorts by when they START: a
    cohort takes the episodes that start until `window` of them have started (summed over ranks),
    and once every one of them has ended it gives a verdict against the baseline, with a margin of
    two standard errors of the difference (at least one episode in the cohort):
        success above baseline + margin -> the cap grows by REACH_STEP (up to 1),
        success below baseline - margin -> the cap shrinks by REACH_STEP (down to FIRST_REACH),
        else it stays.
    A cap that moves drops the cohorts still under way: they started under the old cap.
    Why by start: where success ends an episode, successes are short, so the first `window`
    episodes to END after any moment are mostly successes; a verdict on them finds gains that are
    not there (64 envs, a window of 50, the same success before and after: the cap climbed to 1 on
    most seeds). Which episodes START in a cohort does not depend on how they end.
    The cap starts at `free_reach` (1.0: no cap, nothing recorded).
    Counts are summed over ranks, so every rank holds the same cap and the same cohorts.
    """

    free_reach: float = 1.0
    window: int = 50

    IGNORED, BASELINE = -1, 0  # tags: warm-up episodes count for nothing; critic-only ones are the baseline

    def __post_init__(self) -> None:
        if not 0 < self.free_reach <= 1 or self.window < 1:
            raise UserError("EarnedReach: free_reach must be in (0, 1] and window >= 1")
        self.cap = self.free_reach
        self.baseline_counts = [0.0, 0.0]  # [successes, episodes]
        self.open_cohort = 1  # the tag of full-phase episodes that start now (cohort tags count up from 1)
        self.cohorts: dict[int, list[float]] = {1: [0.0, 0.0, 0.0]}  # tag -> [successes, ended, started]
        self.started_here = 0  # this rank's starts in the open cohort since the last record()

    @property
    def baseline(self) -> float | None:
        successes, episodes = self.baseline_counts
        return successes / episodes if episodes else None

    def start(self, phase: str, episodes: int) -> int:
        """The tag of `episodes` episodes that start now on this rank."""
        if self.free_reach == 1.0 or phase == WARMUP:
            return self.IGNORED
        if phase == CRITIC:
            return self.BASELINE
        self.started_here += episodes
        return self.open_cohort

    def record(self, tags: Tensor, successes: Tensor) -> None:
        """Episodes that ended on this rank (their tags and successes); complete cohorts move the cap.
        Called at every env step on every rank (the counts are summed over ranks)."""
        if self.free_reach == 1.0:
            return
        successes = successes.float()
        rows = [[successes[tags == self.BASELINE].sum(), (tags == self.BASELINE).sum()]]
        rows += [[successes[tags == tag].sum(), (tags == tag).sum()] for tag in self.cohorts]
        counts = torch.tensor([[float(value) for value in row] for row in rows] + [[float(self.started_here), 0.0]])
        counts = distributed.all_sum(counts).tolist()
        self.started_here = 0
        self.baseline_counts = [a + b for a, b in zip(self.baseline_counts, counts[0])]
        for (done_successes, ended), cohort in zip(counts[1:-1], self.cohorts.values()):
            cohort[0] += done_successes
            cohort[1] += ended
        self.cohorts[self.open_cohort][2] += counts[-1][0]
        if self.cohorts[self.open_cohort][2] >= self.window:  # full: the next episodes open a new cohort
            self.open_cohort += 1
            self.cohorts[self.open_cohort] = [0.0, 0.0, 0.0]
        oldest = min(self.cohorts)
        while oldest != self.open_cohort and self.cohorts[oldest][1] >= self.cohorts[oldest][2]:
            done_successes, ended, _ = self.cohorts.pop(oldest)
            self._verdict(done_successes / ended, ended)
            oldest = min(self.cohorts)

    def _verdict(self, rate: float, n: float) -> None:
        if self.baseline is None:  # no critic-only phase: the first cohort is the baseline
            self.baseline_counts = [rate * n, n]
            return
        base = self.baseline
        margin = _margin(base, self.baseline_counts[1], rate, n)
        cap = self.cap
        if rate > base + margin:
            self.cap = min(1.0, self.cap + REACH_STEP)
        elif rate < base - margin:
            self.cap = max(FIRST_REACH, self.cap - REACH_STEP)
        if self.cap != cap:  # the cohorts under way started under the old cap: they count for nothing
            self.drop_under_way()

    def drop_under_way(self) -> None:
        """The cohorts under way count for nothing; the episodes that start next open a new one. Also
        for a run resumed on a backend that cannot snapshot its envs: the episodes in progress are
        gone, so their cohorts would never complete (and never give a verdict again), and judging a
        cohort on its ended episodes alone would favour the short ones, the successes."""
        self.open_cohort = max(self.cohorts) + 1
        self.cohorts = {self.open_cohort: [0.0, 0.0, 0.0]}
        self.started_here = 0

    def state_dict(self) -> dict[str, Any]:
        return {"cap": self.cap, "baseline": list(self.baseline_counts), "open_cohort": self.open_cohort,
                "cohorts": {tag: list(counts) for tag, counts in self.cohorts.items()}, "started_here": self.started_here}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cap = float(state["cap"])
        if "cohorts" not in state:  # written before cohorts: its full-phase episodes under way count for nothing
            self.baseline_counts = list(state["counts"]["baseline"])
            self.open_cohort = int(state["full_regime"]) + 1
            self.cohorts, self.started_here = {self.open_cohort: [0.0, 0.0, 0.0]}, 0
            return
        self.baseline_counts = list(state["baseline"])
        self.open_cohort = int(state["open_cohort"])
        self.cohorts = {int(tag): list(counts) for tag, counts in state["cohorts"].items()}
        self.started_here = int(state["started_here"])


@dataclass
class JudgedReach:
    """What evaluations and checkpoints act with, while the actor trains at the ramp's reach.

    Every training env acts at the ramp's reach (no cap: the actor learns from data at the reach it
    is trained for), and every periodic evaluation scores the actor twice on the same episodes: at
    `floor` (its residual scaled down to that fraction of the scale) and at the training reach. The
    deployed reach (what the evaluation reports, what the checkpoint of that step and every agent
    file act with) is the floor until the training reach wins a paired sign test: among the
    episodes where exactly one of the two succeeded, the training reach's wins are too many for a
    fair coin (one-sided p < `alpha`); it falls back to the floor when the floor wins the same test.
    Why judged: on a task the base policy nearly solves, the full reach can follow the critic's slope
    into misses it cannot see (Meta-World peg-insert-side: .92 at the floor, .45 at the full reach
    on the same episodes), while a task far from solved needs the full reach (tabletop peg_insert).
    Evaluations tell which, per task and per moment; training success does not resolve a gain of a
    few points. Why paired: two independent samples of 100 episodes cannot resolve .88 vs .96 (two
    standard errors: 7.7 points), while on the same initial states only the episodes the reach
    changes count (Meta-World door-open at 50k: 5 of 5 such episodes won by the full reach,
    p = .031). Why every env at the ramp's reach: an actor trained at a reach only part of the envs
    act with does not learn there (door-open: .84 at the full reach with half the envs at it, .96
    with all). The evaluation reported is the deployed one's, chosen after both ran: the checkpoint
    of that step acts with it, so the number and the checkpoint agree."""

    floor: float
    alpha: float = 0.05
    promoted: bool = False

    def reach(self, train_reach: float) -> float:
        """The deployed reach, given the reach the actor trains at."""
        return train_reach if self.promoted else min(train_reach, self.floor)

    def judge(self, floor_successes: list[bool], train_successes: list[bool]) -> None:
        """One evaluation's paired episodes (the same initial states, in order) move the deployed reach."""
        train_wins, floor_wins = paired_wins(train_successes, floor_successes)
        if not self.promoted and sign_test(train_wins, floor_wins) < self.alpha:
            self.promoted = True
        elif self.promoted and sign_test(floor_wins, train_wins) < self.alpha:
            self.promoted = False

    def state_dict(self) -> dict[str, Any]:
        return {"floor": self.floor, "alpha": self.alpha, "promoted": self.promoted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.floor, self.alpha, self.promoted = float(state["floor"]), float(state["alpha"]), bool(state["promoted"])


class WrappedEvaluation:
    """An evaluation around the run's EnvEvaluation (`evaluation`): what the loop asks of it besides a
    call (the best checkpoint's record, the headline, closing) is the wrapped one's."""

    def __init__(self, evaluation: Any):
        self.evaluation = evaluation

    def record(self, info: dict[str, Any]) -> dict[str, Any]:
        return self.evaluation.record(info)

    def headline(self, info: dict[str, Any]) -> dict[str, Any]:
        return self.evaluation.headline(info)

    def close(self) -> None:
        self.evaluation.close()


class JudgedEvaluation(WrappedEvaluation):
    """The run's evaluation under JudgedReach(`floor`): the residual is scored on the same episodes at
    the floor and at the training reach (`train_reach`, which the loop keeps), the verdict sets the
    deployed reach, and the deployed one's evaluation is the run's (videos of both, under
    videos/step_<step>_reach_<r>). Without a verdict to give (`floor` None: algo.floor_reach null;
    or the training reach still below the floor) it is the plain evaluation at the learner's reach.
    `evaluation(step, video_name)` is the run's EnvEvaluation; `learner.set_reach(fraction)` scales
    what the evaluation's agent (and a checkpoint written next) acts with (residual TD3/SAC's learner).
    As with JudgedWeights, the loop keeps the verdict in its checkpoints (`state_dict`) and, when
    there is one to give, evaluates the start and the end of a run even with eval_every=0 (`judges`)."""

    def __init__(self, evaluation: Any, learner: Any, floor: float | None):
        super().__init__(evaluation)
        self.learner = learner
        self.judged = JudgedReach(floor) if floor is not None else None
        self.train_reach = 0.0  # the loop sets it before every evaluation but the first: the start is unjudged

    @property
    def judges(self) -> bool:
        return self.judged is not None

    def deployed_reach(self, train_reach: float) -> float:
        """What an evaluation or a checkpoint acts with while the actor trains at `train_reach`."""
        return self.judged.reach(train_reach) if self.judged is not None else train_reach

    def __call__(self, step: int) -> tuple[dict[str, Any], dict[str, float]]:
        train = self.train_reach
        if self.judged is None or train <= self.judged.floor:
            return self.evaluation(step)
        runs = {}
        for name, reach in (("floor", self.judged.floor), ("train_reach", train)):
            self.learner.set_reach(reach)
            runs[name] = self.evaluation(step, f"step_{step}_reach_{reach:.2f}")
        floor, trained = (_episode_successes(runs[name][0]) for name in ("floor", "train_reach"))
        self.judged.judge(floor, trained)
        deployed = self.judged.reach(train)
        self.learner.set_reach(deployed)  # what the checkpoint of this step acts with
        info, metrics = runs["train_reach" if self.judged.promoted else "floor"]
        return info, {**metrics, "eval/floor_success_rate": sum(floor) / len(floor),
                      "eval/train_reach_success_rate": sum(trained) / len(trained), "eval/deployed_reach": deployed}

    def state_dict(self) -> dict[str, Any] | None:
        return self.judged.state_dict() if self.judged is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.judged.load_state_dict(state)


class JudgedWeights(WrappedEvaluation):
    """The run's evaluation for a method that trains what acts (the PPO family, SAC Flow, QC-FQL,
    RECAP, DSRL; `algo.deploy: judged`): what evaluations and checkpoints act with is the last weights
    that won a paired evaluation, the pretrained policy's until the first win.

    Every evaluation after training moved the weights scores two sets of weights on the same episodes:
    the deployed ones and the current ones. The current ones become the deployed ones (a copy) when they
    win a paired sign test: among the episodes where exactly one of the two succeeded, the current
    weights' wins are too many for a fair coin (one-sided p < `alpha`). Otherwise the deployed weights
    stay, wherever training walks; they never change but to weights that beat them. The evaluation
    reported is the deployed weights' after the verdict (the current ones' on a win), and every agent
    file a checkpoint writes acts with them (`write_agent`), so the number and the checkpoint agree;
    the training state in the checkpoint is the current weights, which a resume goes on training.
    Why a copy and not a residual scaled to a floor (JudgedReach, residual TD3's rule): PPO's Gaussian
    mean is unbounded, so a fixed fraction of it walks with training (Meta-World peg-insert-side: 0.2
    of the residual fell from .91 to .67 by 250k env steps while the full residual read .14-.18); and
    the methods that train the policy's own weights have no residual to scale.
    `acting` is the module (an nn.ModuleList for several) whose weights decide what the evaluation's
    agent and `write_agent(dir)` act with; what is copied: its trainable parameters and every buffer
    (a frozen base policy's weights never change). The loop keeps `state_dict()` in its checkpoints
    and evaluates the start and the end of a run even with eval_every=0 (`judges`)."""

    judges = True

    def __init__(self, evaluation: Any, acting: torch.nn.Module, write_agent: Any, alpha: float = 0.05):
        super().__init__(evaluation)
        self.acting, self.alpha = acting, alpha
        self._write_agent = write_agent
        self.deployed = _trained_state(acting)  # the deployed weights: the pretrained policy's at the start
        self.deployed_step = 0  # the step they were trained to: while the current ones are that step's, they are the same

    def __call__(self, step: int) -> tuple[dict[str, Any], dict[str, float]]:
        if step == self.deployed_step:  # nothing trained since the start (or any offline pre-training) or the last win
            self.deployed = _trained_state(self.acting)
            return self.evaluation(step)
        with self.acting_deployed():
            deployed_run = self.evaluation(step, f"step_{step}_deployed")
        current_run = self.evaluation(step, f"step_{step}_current")
        deployed, current = (_episode_successes(run[0]) for run in (deployed_run, current_run))
        current_wins, deployed_wins = paired_wins(current, deployed)
        if sign_test(current_wins, deployed_wins) < self.alpha:
            self.deployed, self.deployed_step = _trained_state(self.acting), step
        info, metrics = current_run if self.deployed_step == step else deployed_run
        return info, {**metrics, "eval/deployed_success_rate": sum(deployed) / len(deployed),
                      "eval/current_success_rate": sum(current) / len(current),
                      "eval/deployed_step": float(self.deployed_step)}

    @contextlib.contextmanager
    def acting_deployed(self) -> Iterator[None]:
        """The deployed weights inside the block, the current ones again after it."""
        current = _trained_state(self.acting)
        _load_trained_state(self.acting, self.deployed)
        try:
            yield
        finally:
            _load_trained_state(self.acting, current)

    def write_agent(self, directory: Any) -> None:
        """A checkpoint's agent files: the deployed weights."""
        with self.acting_deployed():
            self._write_agent(directory)

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.deployed, "step": self.deployed_step, "alpha": self.alpha}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.deployed, self.deployed_step, self.alpha = state["weights"], int(state["step"]), float(state["alpha"])


def judged_deployment(deploy: str, evaluation: Any, acting: torch.nn.Module, write_agent: Any) -> tuple[Any, Any]:
    """The run's (evaluation, write_agent) under `algo.deploy`: judged, JudgedWeights over `acting`;
    latest, the plain ones (the weights of the moment act)."""
    if deploy == "latest":
        return evaluation, write_agent
    judged = JudgedWeights(evaluation, acting, write_agent)
    return judged, judged.write_agent


def deploy_check(deploy: str) -> tuple[str, bool, str]:
    """The check of `algo.deploy` in every config that has it (AlgoConfig.checks)."""
    return "deploy", deploy in ("judged", "latest"), "judged or latest"


def _trained_state(module: torch.nn.Module) -> dict[str, Tensor]:
    """Copies of what training can change: the trainable parameters and every buffer."""
    state = {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}
    state.update({name: b.detach().clone() for name, b in module.named_buffers()})
    return state


@torch.no_grad()
def _load_trained_state(module: torch.nn.Module, state: dict[str, Tensor]) -> None:
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    for name, value in state.items():
        tensors[name].copy_(value)

def _episode_successes(info: dict[str, Any]) -> list[bool]:
    """Per episode, in episode order (the same initial states at the same index across evaluations)."""
    return [bool(e["success"]) for e in sorted(info["per_episode"], key=lambda e: e["episode"])]


def paired_wins(a: list[bool], b: list[bool]) -> tuple[int, int]:
    """Over paired episodes: how many only `a` succeeded on, how many only `b`."""
    return sum(1 for x, y in zip(a, b) if x and not y), sum(1 for x, y in zip(a, b) if y and not x)


def sign_test(wins: int, losses: int) -> float:
    """One-sided p-value of `wins` or more among wins + losses fair coin flips (1 with none)."""
    flips = wins + losses
    return sum(math.comb(flips, k) for k in range(wins, flips + 1)) / 2 ** flips


def _margin(rate_a: float, n_a: float, rate_b: float, n_b: float) -> float:
    """Two standard errors of the difference of two success rates (at least one episode of b)."""
    return max(2.0 * (rate_a * (1 - rate_a) / n_a + rate_b * (1 - rate_b) / n_b) ** 0.5, 1.0 / n_b)


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

