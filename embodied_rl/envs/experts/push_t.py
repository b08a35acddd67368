"""Scripted push_t expert: quasi-static pushing with a contact point chosen by feedback.

Each step, per env:
1. The desired block motion for the next step is a fraction of the pose error (translation and
   rotation, clamped).
2. Among candidate contact points on the T's faces (with their inward normals), pick the one
   whose push best produces that motion. The block slides on damped joints, so a push with force
   f along n at r gives (nearly) a twist proportional to (n, (r x n) / rho^2): least squares with
   f >= 0 scores each candidate. The current contact is kept unless another is clearly better
   (hysteresis stops dithering).
3. If the pusher sits in the approach corridor of that contact, push along the normal by the
   displacement the contact point should make; otherwise go to a pre-contact point a few cm out,
   straight if the path is clear of the block, else around the block on a circle.

Demonstrations are multimodal: when the way round is long (more than 120 degrees) each episode
goes round on its own randomly drawn side (left or right), and contact choices differ with the
initial pose. Quality < 1 slows the pushes, adds action noise and hesitations (the pusher holds
still).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embodied_rl.envs.experts import TargetExpert
from embodied_rl.envs.tasks.push_t import BAR, STEM, TARGET_XY, TARGET_YAW, wrap_angle

PUSHER_RADIUS = 0.015
RHO = 0.035  # radius of gyration implied by the block's joint damping (rotational / linear)
CIRCLE_RADIUS = 0.1  # clear of the T (its farthest corner is 6.7 cm from the centre) + pusher
MAX_STEP = 0.03  # metres of pusher travel per control step while repositioning


def contact_candidates() -> tuple[Tensor, Tensor]:
    """Points on the T's outer faces [K, 2] and inward normals [K, 2] (block frame)."""
    bar_x, bar_y, bar_hx, bar_hy = BAR
    stem_x, stem_y, stem_hx, stem_hy = STEM
    bar_top, bar_bottom = bar_y + bar_hy, bar_y - bar_hy
    stem_bottom = stem_y - stem_hy
    faces = [  # (fixed coordinate axis, fixed value, range on the other axis, inward normal)
        ("y", bar_top, (-bar_hx + 0.004, bar_hx - 0.004, 7), (0.0, -1.0)),
        ("y", bar_bottom, (-bar_hx + 0.003, -stem_hx - 0.019, 2), (0.0, 1.0)),
        ("y", bar_bottom, (stem_hx + 0.019, bar_hx - 0.003, 2), (0.0, 1.0)),
        ("x", -bar_hx, (bar_bottom + 0.006, bar_top - 0.006, 2), (1.0, 0.0)),
        ("x", bar_hx, (bar_bottom + 0.006, bar_top - 0.006, 2), (-1.0, 0.0)),
        ("x", -stem_hx, (stem_bottom + 0.004, bar_bottom - 0.02, 4), (1.0, 0.0)),
        ("x", stem_hx, (stem_bottom + 0.004, bar_bottom - 0.02, 4), (-1.0, 0.0)),
        ("y", stem_bottom, (-stem_hx + 0.004, stem_hx - 0.004, 2), (0.0, 1.0)),
    ]
    points, normals = [], []
    for axis, value, (low, high, count), normal in faces:
        along = torch.linspace(low, high, count)
        fixed = torch.full_like(along, value)
        points.append(torch.stack((fixed, along) if axis == "x" else (along, fixed), dim=1))
        normals.append(torch.tensor(normal).expand(count, 2))
    return torch.cat(points), torch.cat(normals)


def rotate(vectors: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate vectors [..., 2] by angles given as cos/sin (broadcastable to [...])."""
    x, y = vectors[..., 0], vectors[..., 1]
    return torch.stack((cos * x - sin * y, sin * x + cos * y), dim=-1)


def clamp_norm(vectors: Tensor, max_norm: float | Tensor) -> Tensor:
    norm = vectors.norm(dim=-1, keepdim=True).clamp(min=1e-9)
    if isinstance(max_norm, Tensor):
        max_norm = max_norm[..., None]
    return vectors * (max_norm / norm).clamp(max=1.0)


def inside_inflated_t(points: Tensor, margin: float) -> Tensor:
    """Whether block-frame points [..., 2] lie within `margin` of the T."""
    inside = torch.zeros(points.shape[:-1], dtype=torch.bool)
    for cx, cy, hx, hy in (BAR, STEM):
        inside |= ((points[..., 0] - cx).abs() < hx + margin) & (
            (points[..., 1] - cy).abs() < hy + margin
        )
    return inside


class Expert(TargetExpert):
    noise_scale = 0.06  # action units (1 = 25 cm): 1.5 cm of target noise at quality 0
    hesitate_steps = 4

    def __init__(self, env: Any, quality: float = 1.0, generator: torch.Generator | None = None,
                 mistakes: float = 0.0):
        super().__init__(env, quality, generator, mistakes)
        self.points, self.normals = contact_candidates()
        self.contact = torch.full((self.num_envs,), -1, dtype=torch.long)
        self.side = torch.ones(self.num_envs)
        self.reset()

    def reset(self, mask: Tensor | None = None) -> None:
        super().reset(mask)
        mask = self.reset_rows(mask)
        self.contact[mask] = -1
        sides = torch.where(torch.rand(self.num_envs, generator=self.generator) < 0.5, -1.0, 1.0)
        self.side = torch.where(mask, sides, self.side)

    def plan(self, obs: Any) -> Tensor:
        task = self.task
        pusher, block, yaw = (x.cpu() for x in task.poses(self.env.state))
        n = pusher.shape[0]
        cos, sin = torch.cos(yaw), torch.sin(yaw)

        # 1. desired block motion for the next step
        position_error = torch.tensor(TARGET_XY) - block
        angle_error = wrap_angle(TARGET_YAW - yaw)
        motion = clamp_norm(0.35 * position_error, 0.02 * self.speed)
        turn = (0.35 * angle_error).clamp(-0.25 * self.speed, 0.25 * self.speed)
        wanted = torch.cat((motion, (turn * RHO)[:, None]), dim=1)  # [N, 3]

        # 2. score every contact candidate: least squares twist fit with a non-negative force
        r = rotate(self.points.expand(n, -1, -1), cos[:, None], sin[:, None])  # [N, K, 2]
        normal = rotate(self.normals.expand(n, -1, -1), cos[:, None], sin[:, None])
        lever = r[..., 0] * normal[..., 1] - r[..., 1] * normal[..., 0]  # r x n
        basis = torch.cat((normal, (lever / RHO)[..., None]), dim=-1)  # [N, K, 3]
        force = ((basis * wanted[:, None]).sum(-1) / (basis * basis).sum(-1)).clamp(min=0.0)
        residual = (wanted[:, None] - force[..., None] * basis).norm(dim=-1) / wanted.norm(
            dim=1, keepdim=True
        ).clamp(min=1e-9)
        residual = torch.where(force > 0, residual, torch.full_like(residual, 10.0))
        best = residual.argmin(dim=1)
        rows = torch.arange(n)
        current = self.contact.clamp(min=0)
        keep = (self.contact >= 0) & (residual[rows, current] < residual[rows, best] + 0.15)
        keep &= force[rows, current] > 0
        self.contact = torch.where(keep, current, best)
        k = self.contact
        contact = block + r[rows, k]
        normal_k = normal[rows, k]

        # 3a. push: pusher in the corridor behind the contact point
        offset = pusher - contact
        outward = -(offset * normal_k).sum(1)
        lateral = (offset[:, 0] * normal_k[:, 1] - offset[:, 1] * normal_k[:, 0]).abs()
        in_corridor = (
            (lateral < 0.008) & (outward > PUSHER_RADIUS - 0.01) & (outward < PUSHER_RADIUS + 0.05)
        )
        contact_motion = motion + turn[:, None] * torch.stack(
            (-r[rows, k, 1], r[rows, k, 0]), dim=1
        )
        push = ((contact_motion * normal_k).sum(1)).clamp(0.002, 0.02 * self.speed)
        push_target = contact - normal_k * PUSHER_RADIUS + normal_k * (2.0 * push + 0.004)[:, None]

        # 3b. reposition: to the pre-contact point, straight or round the block
        pre_contact = contact - normal_k * (PUSHER_RADIUS + 0.03)
        fractions = torch.linspace(0.0, 0.9, 10)
        path = (
            pusher[:, None] + fractions[None, :, None] * (pre_contact - pusher)[:, None]
        )  # [N, 10, 2]
        path_local = rotate(path - block[:, None], cos[:, None], -sin[:, None])
        blocked = inside_inflated_t(path_local, PUSHER_RADIUS + 0.003).any(dim=1)
        straight_target = pusher + clamp_norm(pre_contact - pusher, MAX_STEP * self.speed)
        angle_pusher = torch.atan2(pusher[:, 1] - block[:, 1], pusher[:, 0] - block[:, 0])
        angle_goal = torch.atan2(pre_contact[:, 1] - block[:, 1], pre_contact[:, 0] - block[:, 0])
        gap = wrap_angle(angle_goal - angle_pusher)
        direction = torch.where(gap.abs() > 2.1, self.side, torch.sign(gap))
        step_angle = 0.3 * self.speed * direction
        around = torch.stack(
            (torch.cos(angle_pusher + step_angle), torch.sin(angle_pusher + step_angle)), dim=1
        )
        around_target = block + CIRCLE_RADIUS * around
        around_target = pusher + clamp_norm(around_target - pusher, MAX_STEP * self.speed)
        reposition = torch.where(blocked[:, None], around_target, straight_target)

        target = torch.where(in_corridor[:, None], push_target, reposition)
        self.hold = task.target_to_action(pusher)
        return task.target_to_action(target)
