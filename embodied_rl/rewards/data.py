"""Reward-model training data: every step of a dataset from `collect` (a checkpoint's rollouts,
or demos) as the state that step reached, labelled with the simulator's success there and a
progress pseudo-label.

Why the reached state: the success a step reports (data/step_success) describes the state its
action led to, and an episode that ends in success ends *at* that state, which a dataset's rows
(observations before each action) never show; the reached state of step t is row t+1's
observation, or meta/final_obs for the episode's last step.

Progress pseudo-labels in [0, 1], per episode:
- `time` (time to success): along a successful episode, (t + 1) / (t_s + 1) up to its first
  success step t_s, 1 after it; failed episodes are left unlabelled (NaN), since nothing says
  how far they got.
- `milestones` (VLA-RL's recipe): the steps where the gripper opens or closes and where the end
  effector pauses (speed below `pause_speed` for `pause_steps` steps after it has moved) split
  an episode into segments. A successful episode with k milestones before its success climbs
  1/(k+1) per segment, linearly within each, to 1 at the success; a failed one climbs 1/(K+1)
  per milestone, K the successful episodes' median count, and stays below K/(K+1), never 1.
  The task names its end effector and gripper in the state (Task.effector_obs, gripper_obs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embodied_rl.errors import UserError

PROGRESS_LABELS = ("milestones", "time", "none")
AFTER_SUCCESS = ("keep", "first_run")


@dataclass
class RewardSamples:
    """One row per dataset step: the state the step reached and its labels."""

    frames: np.ndarray  # uint8 [S, H, W, 3]
    state: np.ndarray  # float32 [S, D]
    instruction: np.ndarray | None  # int64 [S]
    success: np.ndarray  # bool [S]: the simulator's success at that state
    progress: np.ndarray  # float32 [S] in [0, 1]; NaN where unlabelled
    episode: np.ndarray  # int64 [S]: the episode's index in the dataset
    time: np.ndarray  # int64 [S]: the step's index within its episode

    def __len__(self) -> int:
        return len(self.success)

    def subset(self, rows: np.ndarray) -> RewardSamples:
        return RewardSamples(self.frames[rows], self.state[rows],
                             None if self.instruction is None else self.instruction[rows],
                             self.success[rows], self.progress[rows], self.episode[rows], self.time[rows])


def reward_samples(dataset, progress: str, effector_obs: tuple[int, ...] = (), gripper_obs: int | None = None,
                   pause_speed: float = 0.003, pause_steps: int = 3) -> RewardSamples:
    """The reached states of `dataset` (a DemoDataset with pixels, step_success and final
    observations, as `collect pixels=true` writes them) with their labels."""
    path = dataset.path
    if dataset.pixels is None or dataset.final_pixels is None:
        raise UserError(f"dataset '{path}' has no frames of the states each episode reached; collect it with "
                        "pixels=true (and image_size=N, the reward model's size)")
    if dataset.step_success is None or dataset.final_obs is None:
        raise UserError(f"dataset '{path}' has no per-step success labels (collected before they were recorded); "
                        "collect it again")
    ends = dataset.episode_ends
    frames = np.empty_like(dataset.pixels)
    frames[:-1], frames[ends - 1] = dataset.pixels[1:], dataset.final_pixels  # row t+1, or the final frame
    state = np.empty_like(dataset.obs)
    state[:-1], state[ends - 1] = dataset.obs[1:], dataset.final_obs
    starts = np.concatenate([[0], ends[:-1]])
    episode = np.repeat(np.arange(len(ends)), ends - starts)
    time = np.arange(len(episode)) - starts[episode]
    success = dataset.step_success.astype(bool)
    if progress == "time":
        labels = _per_episode(starts, ends, lambda s, e: time_progress(success[s:e]))
    elif progress == "milestones":
        if not effector_obs:
            raise UserError("progress=milestones needs the end effector's place in the state (Task.effector_obs); "
                            "this task names none: use progress=time")
        # each episode's states: before its first step (its first row), then after every step
        marks = [milestones(np.concatenate([dataset.obs[s:s + 1], state[s:t]]), effector_obs, gripper_obs,
                            pause_speed, pause_steps) for s, t in zip(starts, ends)]
        first_success = [_first(success[s:t]) for s, t in zip(starts, ends)]
        counts = [int(np.sum(np.asarray(m) < f)) for m, f in zip(marks, first_success) if f is not None]
        typical = int(np.median(counts)) if counts else 1
        labels = np.concatenate([milestone_progress(t - s, m, f, typical)
                                 for s, t, m, f in zip(starts, ends, marks, first_success)])
    elif progress == "none":
        labels = np.full(len(episode), np.nan, dtype=np.float32)
    else:
        raise UserError(f"progress must be one of {', '.join(PROGRESS_LABELS)}, got {progress!r}")
    return RewardSamples(frames, state, dataset.instruction, success, labels.astype(np.float32), episode, time)


def through_first_success_run(samples: RewardSamples) -> RewardSamples:
    """`samples` without the rows of each successful episode that come after its first run of
    success states has ended (train-reward's after_success=first_run).

    Why: the learned success ends a learner's episode where it first fires, so what a policy
    does after its first success is never judged in fine-tuning; a BC policy run on past success
    is outside its demos and often undoes it in ways that look like success (tabletop's VLA
    closes its fingers on the cube it has just placed: the cube is still on the pad, the
    success gone). Those states taught the classifier to doubt real successes."""
    keep = np.ones(len(samples), dtype=bool)
    for episode in np.unique(samples.episode[samples.success]):
        rows = np.flatnonzero(samples.episode == episode)
        rows = rows[np.argsort(samples.time[rows], kind="stable")]
        success = samples.success[rows]
        first = int(np.argmax(success))
        ended = np.flatnonzero(~success[first:])
        if len(ended):
            keep[rows[first + int(ended[0]):]] = False
    return samples.subset(np.flatnonzero(keep))


def concatenate_samples(parts: list[RewardSamples]) -> RewardSamples:
    """The rows of every part, each part's episodes numbered after the previous part's."""
    offsets = np.cumsum([0] + [int(part.episode.max()) + 1 for part in parts[:-1]])
    instructions = [part.instruction for part in parts]
    return RewardSamples(
        np.concatenate([part.frames for part in parts]), np.concatenate([part.state for part in parts]),
        None if any(i is None for i in instructions) else np.concatenate(instructions),
        np.concatenate([part.success for part in parts]), np.concatenate([part.progress for part in parts]),
        np.concatenate([part.episode + offset for part, offset in zip(parts, offsets)]),
        np.concatenate([part.time for part in parts]))


def _per_episode(starts: np.ndarray, ends: np.ndarray, label) -> np.ndarray:
    return np.concatenate([label(s, e) for s, e in zip(starts, ends)])


def _first(success: np.ndarray) -> int | None:
    hits = np.flatnonzero(success)
    return int(hits[0]) if len(hits) else None


def time_progress(success: np.ndarray) -> np.ndarray:
    """[L]: (t + 1) / (t_s + 1) up to the first success step t_s, then 1; NaN without success."""
    first = _first(success)
    if first is None:
        return np.full(len(success), np.nan, dtype=np.float32)
    return np.minimum((np.arange(len(success)) + 1) / (first + 1), 1.0).astype(np.float32)


def milestones(states: np.ndarray, effector_obs: tuple[int, ...], gripper_obs: int | None,
               pause_speed: float, pause_steps: int) -> list[int]:
    """The milestone steps of one episode, from its states [L + 1, D] (before the first step,
    then after each): steps where the gripper crosses half open, and the first step of each
    pause of the end effector (speed below `pause_speed` per step for `pause_steps` steps) once
    it has moved. Milestones closer than `pause_steps` to the previous one are one milestone."""
    steps = len(states) - 1
    found = set()
    if gripper_obs is not None:
        closed = states[:, gripper_obs] > 0.5
        found.update(np.flatnonzero(closed[1:] != closed[:-1]).tolist())
    effector = states[:, list(effector_obs)]
    slow = np.linalg.norm(np.diff(effector, axis=0), axis=1) < pause_speed  # [L]: step t moved little
    moved = False
    for t in range(steps):
        if not slow[t]:
            moved = True
        elif moved and t + pause_steps <= steps and slow[t:t + pause_steps].all() and (t == 0 or not slow[t - 1]):
            found.add(t)
    kept: list[int] = []
    for t in sorted(found):
        if not kept or t - kept[-1] >= pause_steps:
            kept.append(t)
    return kept


def milestone_progress(length: int, marks: list[int], first_success: int | None, typical: int) -> np.ndarray:
    """[length] progress through the milestone segments (the module docstring)."""
    if first_success is not None:
        before = [m for m in marks if m < first_success]
        knots_t = [-1, *before, first_success]  # -1: the state before the first step (progress 0)
        knots_p = np.arange(len(knots_t)) / (len(knots_t) - 1)
        return np.interp(np.arange(length), knots_t, knots_p).astype(np.float32)
    reached = marks[:typical]
    knots_t = [-1, *reached]
    knots_p = np.arange(len(knots_t)) / (typical + 1)
    return np.interp(np.arange(length), knots_t, knots_p).astype(np.float32)
