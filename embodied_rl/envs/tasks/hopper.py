"""hopper: gymnasium's Hopper-v5 (one-legged hopping forward) as a batched torch task.

Model: gymnasium's hopper.xml unchanged (assets/hopper.xml; RK4, 2 ms physics, 4 substeps: 125 Hz
control, like Hopper-v5's frame_skip=4). Reward-based, no success notion (has_success = False);
its expert is a shipped PPO actor (embodied_rl/envs/experts/hopper.py).

Action (3): torques of the thigh, leg and foot motors in [-1, 1] (gear 200).
Observation (11): qpos without the x position (5) and qvel clipped to [-10, 10] (6), as in v5.
Reward: forward velocity + 1 (healthy bonus) - 1e-3 * |action|^2. Hopper-v5 measures the forward
velocity as the x displacement over the control step; a batched task sees only the state after
the step, so this uses the root's x velocity at the end of the step (the same on average).
Termination (failure) when unhealthy as in v5: torso height <= 0.7, |torso angle| >= 0.2 rad, or
any of qpos[2:], qvel outside (-100, 100). Time limit 1000 steps. Initial state: the model's
reference pose plus uniform noise in +-0.005 on every qpos and qvel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embodied_rl.envs.api import SimState, Task, joint_qpos_slice, joint_qvel_slice


class HopperTask(Task):
    name = "hopper"
    gym_id = "embodied_rl/Hopper-v0"
    xml = "hopper.xml"
    max_episode_steps = 1000
    control_substeps = 4
    obs_dim = 11
    action_dim = 3
    camera = "track"
    has_success = False
    success_criterion = "none: reward-based (hop forward); the episode ends when the hopper falls"
    success_terminates = False
    forward_reward_weight = 1.0
    healthy_reward = 1.0
    ctrl_cost_weight = 1e-3
    reset_noise_scale = 5e-3

    def bind(self, model: Any) -> None:
        self.nq, self.nv, self.nu = model.nq, model.nv, model.nu
        self.root_x = joint_qpos_slice(model, "rootx").start
        self.root_z = joint_qpos_slice(model, "rootz").start
        self.root_angle = joint_qpos_slice(model, "rooty").start
        self.root_x_velocity = joint_qvel_slice(model, "rootx").start
        self.observed_qpos = [i for i in range(self.nq) if i != self.root_x]
        self.qpos0 = torch.as_tensor(model.qpos0, dtype=torch.float32)
        # the "state" checked for health: qpos after x, z (v5's state_vector()[2:]) and all of qvel
        self.checked_qpos = [i for i in range(self.nq) if i not in (self.root_x, self.root_z)]

    def sample_init(
        self, n: int, generator: torch.Generator, device: torch.device | str
    ) -> tuple[Tensor, Tensor]:
        scale = self.reset_noise_scale
        qpos = self.qpos0 + (torch.rand(n, self.nq, generator=generator) * 2 - 1) * scale
        qvel = (torch.rand(n, self.nv, generator=generator) * 2 - 1) * scale
        return qpos.to(device), qvel.to(device)

    def action_to_ctrl(self, action: Tensor) -> Tensor:
        return action.clamp(-1.0, 1.0).to(torch.float32)  # ctrlrange is [-1, 1] for every motor

    def observe(self, state: SimState) -> Tensor:
        qpos = state.qpos[:, self.observed_qpos].float()
        qvel = state.qvel.float().clamp(-10.0, 10.0)
        return torch.cat((qpos, qvel), dim=1)

    def healthy(self, state: SimState) -> Tensor:
        qpos, qvel = state.qpos.float(), state.qvel.float()
        checked = torch.cat((qpos[:, self.checked_qpos], qvel), dim=1)
        healthy_state = ((checked > -100.0) & (checked < 100.0)).all(dim=1)
        healthy_z = qpos[:, self.root_z] > 0.7
        angle = qpos[:, self.root_angle]
        healthy_angle = (angle > -0.2) & (angle < 0.2)
        return healthy_state & healthy_z & healthy_angle

    def evaluate(self, state: SimState, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        forward = self.forward_reward_weight * state.qvel[:, self.root_x_velocity].float()
        ctrl_cost = self.ctrl_cost_weight * action.float().pow(2).sum(dim=1)
        reward = forward + self.healthy_reward - ctrl_cost
        failure = ~self.healthy(state)
        return reward, torch.zeros_like(failure), failure
