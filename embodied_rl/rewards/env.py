"""`finetune reward=model:PATH`: the training env's reward comes from a reward model.

    learned = LearnedReward.from_cfg(cfg, policy)        # None for reward=sim
    env = envs.make(..., **learned.env_options(...))     # frames at the model's size; the task's
                                                         # own success ends no episode
    env = learned.wrap(env, policy_image_size)           # a LearnedRewardEnv

A reward model with a camera of its own (tabletop's `top`: collect camera=top) reads that camera's
frames (the env renders them beside the policy's, obs["reward_pixels"]); the policy still reads
the task's camera.

A LearnedRewardEnv is a BatchedEnv like any other, so every fine-tuning method trains on it
unchanged. At every step it shows the reward model the frame of the state each env reached and
returns the learned reward in place of the simulator's (which never leaves `step`):
- kind `success` (default): 1 where the success probability is >= `threshold` (0.95, as
  HIL-SERL and LeRobot) on `hold_steps` consecutive steps of the episode (1: on this step), else 0.
  Why a hold: a classifier's false positives are mostly single frames (the tabletop VLA's failed
  episodes: 8 of 54 fire at k = 1, 2 at k = 3 consecutive), and a learner finds and repeats them. That learned success also ends the episode (terminated), as a
  HIL-SERL classifier does on a real robot, while the simulator's success does not (the env is
  made with success_terminates=False): the learner learns nothing from the true success.
- kind `success_progress`: the same plus `progress_gain` x the learned progress at every step,
  at most `progress_cap` per episode in all. Why a cap: a dense progress reward that keeps paying
  while the robot hovers near the goal pays more over a long episode than finishing does (as
  push_t's coverage reward, docs/finetuning.md); capped below the success reward of 1, finishing
  always pays more.
The simulator still ends episodes that fail and those that reach the time limit, and its true
success is kept where evaluation and the logs read it: info["success"] and
info["episode"]["success_once"] (rollout/success_rate), beside info["learned_success"] and
info["episode"]["learned_success_once"] / ["learned_return"] (train/learned_success_rate): a
learner that games the model shows as learned success rising while true success falls.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
from torch import Tensor

from embodied_rl.envs.api import BatchedEnv
from embodied_rl.envs.render import pool_frames
from embodied_rl.errors import UserError

KINDS = ("success", "success_progress")


def learned_reward_path(reward: Any) -> Path | None:
    """`reward=`: None for `sim` (the simulator's reward), the path of `model:PATH`."""
    value = "sim" if reward is None else str(reward)
    if value == "sim":
        return None
    if value.startswith("model:") and len(value) > len("model:"):
        return Path(value[len("model:"):]).expanduser()
    raise UserError(f"reward must be sim or model:PATH (a train-reward run or its reward_model/), got '{value}'")


@dataclass
class LearnedReward:
    """A reward model and how its judgement becomes the training reward (finetune's
    `learned_reward` keys)."""

    path: Path
    model: Any  # a rewards.model reward model
    kind: str
    threshold: float
    progress_gain: float
    progress_cap: float
    hold_steps: int = 1
    camera: str = ""  # the camera the model reads where it is not the task's ("": the task's)

    @classmethod
    def from_cfg(cls, cfg: Any, policy: Any) -> LearnedReward | None:
        """The learned reward of a finetune config (None with reward=sim): its keys checked, the
        model loaded and checked against the task and the policy's frames (UserError)."""
        from embodied_rl.envs.registry import task_class
        from embodied_rl.rewards.model import load_reward_model

        path = learned_reward_path(cfg.get("reward"))
        if path is None:
            return None
        options = cfg.learned_reward
        kind, threshold = str(options.kind), float(options.threshold)
        gain, cap = float(options.progress_gain), float(options.progress_cap)
        if kind not in KINDS:
            raise UserError(f"learned_reward.kind must be one of {', '.join(KINDS)}, got '{kind}'")
        if not 0.0 < threshold < 1.0:
            raise UserError(f"learned_reward.threshold must be in (0, 1), got {threshold}")
        if gain < 0.0 or not 0.0 <= cap < 1.0:
            raise UserError(f"learned_reward.progress_gain must be >= 0 and progress_cap in [0, 1), got {gain}, {cap}")
        hold_steps = options.hold_steps
        if isinstance(hold_steps, bool) or not isinstance(hold_steps, int) or hold_steps < 1:
            raise UserError(f"learned_reward.hold_steps must be an integer >= 1, got {hold_steps}")
        if not 0.0 < float(options.hacking_gap) <= 1.0:
            raise UserError(f"learned_reward.hacking_gap must be in (0, 1], got {options.hacking_gap}")
        task = task_class(cfg.task.name)
        if not task.camera:
            raise UserError(f"task '{cfg.task.name}' renders no camera frames, so a reward model cannot judge it")
        model = load_reward_model(path, device=str(cfg.device))
        if model.task != cfg.task.name:
            raise UserError(f"reward model '{path}' was trained on task '{model.task}', not {cfg.task.name}")
        if model.instructions and model.instructions != list(task.instructions):
            raise UserError(f"reward model '{path}' was trained on other instructions than task {cfg.task.name}'s")
        if policy.obs_mode == "pixels" and model.image_size % policy.env_options()["image_size"]:
            size = policy.env_options()["image_size"]
            raise UserError(f"reward model '{path}' reads {model.image_size}x{model.image_size} frames, the policy "
                            f"{size}x{size}: train the reward model on frames of the policy's size or a multiple of it "
                            "(collect image_size=)")
        if kind == "success_progress" and model.config["progress_labels"] == "none":
            raise UserError(f"reward model '{path}' was trained without progress labels (progress=none); "
                            "learned_reward.kind=success_progress needs them")
        camera = model.camera if model.camera != task.camera else ""  # one the task lacks: envs.make refuses it
        return cls(path, model, kind, threshold, gain, cap, hold_steps, camera)

    def env_options(self, policy_options: dict[str, Any], task_options: dict[str, Any]) -> tuple[dict, dict]:
        """(envs.make keywords, task options) of the training env: the policy's observations with
        frames at the model's size (and the model's own camera's), and the task's success ending
        no episode."""
        options = {**policy_options, "obs_mode": "pixels", "image_size": self.model.image_size}
        if self.camera:
            options["reward_camera"] = self.camera
        return options, {**task_options, "success_terminates": False}

    def wrap(self, env: BatchedEnv, policy_image_size: int | None) -> LearnedRewardEnv:
        return LearnedRewardEnv(env, self, policy_image_size)


class LearnedRewardEnv(BatchedEnv):
    """The env the learner trains in with reward=model:PATH (the module docstring). `env` renders
    pixels at the model's size; the policy sees them pooled to `policy_image_size`
    (envs.render.pool_frames), or not at all where it reads none (None)."""

    STATE_KEYS = ("progress_paid", "learned_return", "learned_success_once", "steps_above")

    def __init__(self, env: BatchedEnv, learned: LearnedReward, policy_image_size: int | None):
        self.env, self.learned, self.policy_image_size = env, learned, policy_image_size
        self.num_envs, self.device, self.max_episode_steps = env.num_envs, env.device, env.max_episode_steps
        # the task as the learner sees it: success (the learned one) ends its episodes, so demo
        # transitions that end in success are terminal as online ones are
        self.task = copy.copy(env.task)
        self.task.success_terminates = True
        spaces = dict(env.single_observation_space.spaces)
        spaces.pop("reward_pixels", None)
        if policy_image_size is None:
            spaces.pop("pixels")
        else:
            spaces["pixels"] = gymnasium.spaces.Box(0, 255, (policy_image_size, policy_image_size, 3), np.uint8)
        self.single_observation_space = gymnasium.spaces.Dict(spaces) if len(spaces) > 1 else spaces["state"]
        self.single_action_space = env.single_action_space
        self.progress_paid = torch.zeros(self.num_envs, device=self.device)  # this episode's progress reward
        self.learned_return = torch.zeros(self.num_envs, device=self.device)
        self.learned_success_once = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        self.steps_above = torch.zeros(self.num_envs, dtype=torch.long, device=self.device)  # consecutive, this episode

    @property
    def can_snapshot(self) -> bool:
        return self.env.can_snapshot

    @property
    def unstable_resets(self) -> int:
        return self.env.unstable_resets

    def _policy_obs(self, obs: dict[str, Tensor]) -> Any:
        """What the policy reads: the frames at its size, or none where it reads none (a state
        policy on a task without instructions gets the plain state tensor, as from an env without
        pixels)."""
        obs = {key: value for key, value in obs.items() if key != "reward_pixels"}
        if self.policy_image_size is not None:
            return {**obs, "pixels": pool_frames(obs["pixels"], self.policy_image_size)}
        obs = {key: value for key, value in obs.items() if key != "pixels"}
        return obs if len(obs) > 1 else obs["state"]

    def _forget(self, env_ids: Tensor) -> None:
        """Start the per-episode sums of `env_ids` (indices) afresh."""
        ids = env_ids.to(self.device)
        self.progress_paid[ids] = 0.0
        self.learned_return[ids] = 0.0
        self.learned_success_once[ids] = False
        self.steps_above[ids] = 0

    def reset(self, seed: int | None = None, env_ids: Tensor | None = None, group_size: int | None = None):
        obs, info = self.env.reset(seed=seed, env_ids=env_ids, group_size=group_size)
        self._forget(self._env_ids(env_ids))
        return self._policy_obs(obs), info

    @torch.no_grad()
    def step(self, action: Tensor):
        obs, _, terminated, truncated, info = self.env.step(action)  # the simulator's reward stops here
        reached = info["final_obs"]  # the state each env's action led to, before any auto-reset
        frames = reached["reward_pixels"] if self.learned.camera else reached["pixels"]
        judged = self.learned.model.judge(frames, reached["state"], reached.get("instruction"))
        success_prob, progress = judged.success_prob.to(self.device), judged.progress.to(self.device)
        # an unstable step pays nothing, as the simulator's does
        above = (success_prob >= self.learned.threshold) & ~info["unstable"]
        self.steps_above = torch.where(above, self.steps_above + 1, 0)
        learned_success = self.steps_above >= self.learned.hold_steps
        reward = learned_success.float()
        if self.learned.kind == "success_progress":
            bonus = torch.minimum(self.learned.progress_gain * progress, self.learned.progress_cap - self.progress_paid)
            bonus = bonus.masked_fill(info["unstable"], 0.0)
            self.progress_paid += bonus
            reward = reward + bonus
        # the learned success ends the episode; the env itself ended failures and time limits
        ended_here = learned_success & ~(terminated | truncated)
        terminated = terminated | learned_success
        truncated = truncated & ~terminated
        done = terminated | truncated
        self.learned_return += reward
        self.learned_success_once |= learned_success
        episode = {key: value.clone() for key, value in info["episode"].items()}  # before the resets below
        episode.update(learned_return=self.learned_return.clone(), learned_success_once=self.learned_success_once.clone())
        info.update(_final=done, _episode=done.clone(), episode=episode, final_obs=self._policy_obs(reached),
                    learned_success=learned_success, success_prob=success_prob, progress=progress)
        if bool(ended_here.any()):
            obs, _ = self.env.reset(env_ids=torch.nonzero(ended_here).flatten().cpu())
        self._forget(torch.nonzero(done).flatten())
        return self._policy_obs(obs), reward, terminated, truncated, info

    def render(self, env_ids: Tensor | None = None) -> Tensor:
        return self.env.render(env_ids)

    def get_state(self) -> dict[str, Tensor]:
        state = self.env.get_state()
        state.update({f"learned_reward/{key}": getattr(self, key).cpu().clone() for key in self.STATE_KEYS})
        return state

    def set_state(self, state: dict[str, Tensor]) -> None:
        ours = {key: state.get(f"learned_reward/{key}") for key in self.STATE_KEYS}
        if ours["steps_above"] is None:  # saved before hold_steps existed: every run then held for one step
            ours["steps_above"] = torch.zeros(self.num_envs, dtype=torch.long)
        if any(value is None for value in ours.values()):
            raise UserError("env state holds no learned-reward sums (saved by a run with reward=sim?)")
        self.env.set_state({key: value for key, value in state.items() if not key.startswith("learned_reward/")})
        for key, value in ours.items():
            setattr(self, key, value.to(self.device).clone())

    def close(self) -> None:
        self.env.close()
