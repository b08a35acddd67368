"""push_t: push a T-shaped block to a fixed target pose with a planar pusher (like PushT).

Model (assets/push_t.xml): a sphere pusher on two position-controlled slide joints and a T block
(10 cm bar + 7.5 cm stem, 2.5 cm wide) on planar joints whose damping and frictionloss stand in
for table friction; the only contacts are pusher-block. Control at 10 Hz (10 x 10 ms physics).

Action (2): absolute pusher target (x, y) in [-1, 1], mapped to the +-25 cm workspace.
Observation (6): pusher xy, block xy (metres), block yaw as (sin, cos).
Reward: coverage of the target T by the block, in [0, 1] (PushT's reward; measured on a fixed
grid of points of the T). Success (ends the episode), chosen with the `success` option:
- "pose" (default): position error < 2 cm and orientation error < 10 degrees (see docs/tasks.md
  for why);
- "coverage": the block covers at least `coverage_threshold` (0.95) of the target T's area, as
  in Diffusion Policy's Push-T; the shared area is exact (`t_overlap_area`), not a grid count.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from embodied_rl.envs.api import (
    SimState,
    Task,
    actuator_index,
    joint_qpos_slice,
    scale_action,
    sensor_slice,
)
from embodied_rl.errors import UserError

# T geometry in the block frame (origin at the centre of area): (centre x, centre y, half x, half y)
BAR = (0.0, 0.021429, 0.05, 0.0125)
STEM = (0.0, -0.028571, 0.0125, 0.0375)
# the target body's pose in assets/push_t.xml
TARGET_XY = (0.0, 0.0)
TARGET_YAW = math.pi / 4
WORKSPACE = 0.25  # pusher targets span [-WORKSPACE, WORKSPACE] on x and y


def quat_yaw(quat: Tensor) -> Tensor:
    """Yaw of quaternions (w, x, y, z) [N, 4] that rotate about z only."""
    return 2.0 * torch.atan2(quat[:, 3], quat[:, 0])


def wrap_angle(angle: Tensor) -> Tensor:
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


def t_points(spacing: float = 0.005) -> Tensor:
    """A grid of points covering the T (block frame) [K, 2], for the coverage reward."""
    points = []
    for cx, cy, hx, hy in (BAR, STEM):
        xs = torch.arange(-hx + spacing / 2, hx, spacing) + cx
        ys = torch.arange(-hy + spacing / 2, hy, spacing) + cy
        grid = torch.stack(torch.meshgrid(xs, ys, indexing="ij"), dim=-1).reshape(-1, 2)
        points.append(grid)
    return torch.cat(points).float()


def inside_t(points: Tensor) -> Tensor:
    """Whether points [..., 2] (block frame) lie in the T."""
    inside = torch.zeros(points.shape[:-1], dtype=torch.bool, device=points.device)
    for cx, cy, hx, hy in (BAR, STEM):
        inside |= ((points[..., 0] - cx).abs() <= hx + 1e-6) & (
            (points[..., 1] - cy).abs() <= hy + 1e-6
        )
    return inside


# ---- exact coverage: the area shared by two T's, each a union of two disjoint rectangles ----


def body_rectangles(model: Any, body: str) -> Tensor:
    """The box geoms of `body` as rectangles in the body frame [R, 4]: (centre x, centre y,
    half x, half y), read from the model (the T's bar and stem)."""
    import mujoco

    body_id = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, body)
    if body_id < 0:
        raise ValueError(f"the model has no body named '{body}'")
    rects = []
    for geom in range(model.ngeom):
        if model.geom_bodyid[geom] != body_id or model.geom_type[geom] != mujoco.mjtGeom.mjGEOM_BOX:
            continue
        if tuple(model.geom_quat[geom]) != (1.0, 0.0, 0.0, 0.0):
            raise ValueError(f"body '{body}': a rotated box is not an axis-aligned rectangle")
        rects.append((*model.geom_pos[geom][:2], *model.geom_size[geom][:2]))
    return torch.tensor(rects, dtype=torch.float32)


def _nonzero(values: Tensor) -> Tensor:
    """`values` with exact and near zeros replaced by 1e-12, for use as a divisor."""
    return torch.where(values.abs() > 1e-12, values, 1e-12)


def box_overlap_area(
    xs: Tensor, ys: Tensor, x0: Tensor, x1: Tensor, y0: Tensor, y1: Tensor
) -> Tensor:
    """Area of convex polygons intersected with axis-aligned boxes [x0, x1] x [y0, y1], exactly.

    `xs`, `ys` [..., K]: the polygons' vertices, counter-clockwise; the bounds broadcast against
    [...]. The intersection is not built: for a counter-clockwise convex polygon P, Green's
    theorem with both coordinates clamped to the box gives

        area(P & box) = -(sum over P's edges of the integral of clamp(y, y0, y1) d clamp(x, x0, x1))

    (P's upper boundary runs right to left and its lower one left to right, so the sum
    integrates clamp(y_upper) - clamp(y_lower), the cross-section inside the box, over x in
    [x0, x1]). On the part of an edge whose x lies in [x0, x1], clamp(y) is linear between the
    points where y crosses y0 and y1, so each edge's integral is three exact midpoint rules.
    A fixed number of tensor operations, whatever the overlap: fast for many envs at once
    (Sutherland-Hodgman clipping gives the same areas with several times more operations).
    """
    x0, x1, y0, y1 = (bound[..., None] for bound in (x0, x1, y0, y1))  # against the vertex dim
    dx, dy = xs.roll(-1, dims=-1) - xs, ys.roll(-1, dims=-1) - ys  # edge i: vertex i -> i + 1
    # the stretch t in [t_in, t_out] of each edge (t in [0, 1]) whose x lies in [x0, x1]; an edge
    # with dx ~ 0 adds nothing whatever its stretch, as its integral is multiplied by dx
    t_x0, t_x1 = (x0 - xs) / _nonzero(dx), (x1 - xs) / _nonzero(dx)
    t_in = torch.minimum(t_x0, t_x1).clamp(0.0, 1.0)
    t_out = torch.maximum(t_x0, t_x1).clamp(0.0, 1.0)
    # where y crosses y0 and y1, within that stretch
    t_y0, t_y1 = (y0 - ys) / _nonzero(dy), (y1 - ys) / _nonzero(dy)
    t_low = torch.clamp(torch.minimum(t_y0, t_y1), t_in, t_out)
    t_high = torch.clamp(torch.maximum(t_y0, t_y1), t_in, t_out)

    def clamped_y(t: Tensor) -> Tensor:
        return torch.clamp(ys + t * dy, y0, y1)

    integral = (
        (t_low - t_in) * clamped_y((t_in + t_low) / 2)
        + (t_high - t_low) * clamped_y((t_low + t_high) / 2)
        + (t_out - t_high) * clamped_y((t_high + t_out) / 2)
    )
    return -(dx * integral).sum(-1)


def t_overlap_area(
    block_xy: Tensor, block_yaw: Tensor, block_rects: Tensor,
    target_xy: tuple[float, float], target_yaw: float, target_rects: Tensor,
) -> Tensor:
    """Area [N] shared by the block (pose block_xy [N, 2], block_yaw [N]; rectangles in its frame
    [R, 4]) and the target (a fixed pose; rectangles [S, 4]).

    Each shape's rectangles do not overlap, so the area of the intersection of the two unions is
    the sum over the R x S rectangle pairs of their convex intersections. Each pair is measured in
    the target frame, where the target rectangle is an axis-aligned box and the block rectangle a
    rotated quadrilateral (`box_overlap_area`).
    """
    device = block_xy.device
    block_rects = block_rects.to(device=device, dtype=torch.float32)
    target_rects = target_rects.to(device=device, dtype=torch.float32)
    # the block's pose in the target frame
    cos_t, sin_t = math.cos(target_yaw), math.sin(target_yaw)
    dx, dy = block_xy[:, 0] - target_xy[0], block_xy[:, 1] - target_xy[1]
    rel_x, rel_y = cos_t * dx + sin_t * dy, -sin_t * dx + cos_t * dy
    rel_yaw = block_yaw - target_yaw
    cos, sin = torch.cos(rel_yaw)[:, None, None], torch.sin(rel_yaw)[:, None, None]
    # the block rectangles' corners, counter-clockwise, in the target frame [N, R, 1, 4]
    cx, cy, hx, hy = block_rects.unbind(-1)
    local_x = torch.stack((cx - hx, cx + hx, cx + hx, cx - hx), dim=-1)  # [R, 4]
    local_y = torch.stack((cy - hy, cy - hy, cy + hy, cy + hy), dim=-1)
    xs = (rel_x[:, None, None] + cos * local_x - sin * local_y)[:, :, None]
    ys = (rel_y[:, None, None] + sin * local_x + cos * local_y)[:, :, None]
    # each against every target box [S]: areas [N, R, S]
    tx, ty, thx, thy = target_rects.unbind(-1)
    return box_overlap_area(xs, ys, tx - thx, tx + thx, ty - thy, ty + thy).sum((1, 2))


def describe_success(
    success: str, position_tolerance: float, angle_tolerance: float, coverage_threshold: float
) -> str:
    """The one-sentence success criterion (`Task.success_criterion`) of these options."""
    if success == "coverage":
        return (
            f"the T block covers at least {coverage_threshold * 100:g}% of the target T's area "
            "(Push-T's criterion; ends the episode)"
        )
    return (
        f"the T block is within {position_tolerance * 100:g} cm and "
        f"{math.degrees(angle_tolerance):g} degrees of the target pose (ends the episode)"
    )


SUCCESS_CHOICES = ("pose", "coverage")


class PushTTask(Task):
    name = "push_t"
    gym_id = "embodied_rl/PushT-v0"
    xml = "push_t.xml"
    max_episode_steps = 200
    control_substeps = 10
    obs_dim = 6
    action_dim = 2
    camera = "top"
    effector_obs = (0, 1)  # pusher xy
    has_success = True
    success_terminates = True
    success = "pose"  # "pose": the tolerances below; "coverage": coverage >= coverage_threshold
    position_tolerance = 0.02  # metres
    angle_tolerance = math.radians(10.0)
    coverage_threshold = 0.95  # fraction of the target T's area (Diffusion Policy's Push-T)
    # The default's description (`embodied-rl tasks`); an instance describes its own options.
    success_criterion = describe_success(
        success, position_tolerance, angle_tolerance, coverage_threshold
    )
    init_range = 0.15  # initial block centre in [-init_range, init_range]^2
    min_init_distance = 0.05  # the block starts at least this far from the target

    def __init__(self, **overrides: Any):
        super().__init__(**overrides)
        if self.success not in SUCCESS_CHOICES:
            choices = ", ".join(SUCCESS_CHOICES)
            raise UserError(
                f"bad value for 'task.success': {self.success!r} (choose from: {choices})"
            )
        if not 0.0 < self.coverage_threshold <= 1.0:
            raise UserError(
                f"task.coverage_threshold must be in (0, 1], got {self.coverage_threshold}"
            )
        self.success_criterion = describe_success(
            self.success, self.position_tolerance, self.angle_tolerance, self.coverage_threshold
        )

    def bind(self, model: Any) -> None:
        self.nq, self.nv, self.nu = model.nq, model.nv, model.nu
        self.block_x = joint_qpos_slice(model, "block_x").start
        self.block_y = joint_qpos_slice(model, "block_y").start
        self.block_yaw = joint_qpos_slice(model, "block_yaw").start
        self.pusher_x = joint_qpos_slice(model, "pusher_x").start
        self.pusher_y = joint_qpos_slice(model, "pusher_y").start
        self.act_x = actuator_index(model, "pusher_x")
        self.act_y = actuator_index(model, "pusher_y")
        self.pusher_pos = sensor_slice(model, "pusher_pos")
        self.block_pos = sensor_slice(model, "block_pos")
        self.block_quat = sensor_slice(model, "block_quat")
        self.points = t_points()
        self.block_rects = body_rectangles(model, "block")
        self.target_rects = body_rectangles(model, "target")
        self.target_area = float((4.0 * self.target_rects[:, 2] * self.target_rects[:, 3]).sum())

    # ---- helpers shared with the expert ----
    def poses(self, state: SimState) -> tuple[Tensor, Tensor, Tensor]:
        """(pusher xy [N, 2], block xy [N, 2], block yaw [N]) as float32."""
        sensors = state.sensordata.float()
        pusher = sensors[:, self.pusher_pos][:, :2]
        block = sensors[:, self.block_pos][:, :2]
        yaw = quat_yaw(sensors[:, self.block_quat])
        return pusher, block, yaw

    def pose_errors(self, block: Tensor, yaw: Tensor) -> tuple[Tensor, Tensor]:
        target = torch.tensor(TARGET_XY, device=block.device)
        return (block - target).norm(dim=1), wrap_angle(yaw - TARGET_YAW).abs()

    def coverage(self, block: Tensor, yaw: Tensor) -> Tensor:
        """Fraction of the target T covered by the block [N] (the T's grid points, moved by the
        block pose, that land inside the target T)."""
        points = self.points.to(block.device)
        cos, sin = torch.cos(yaw)[:, None], torch.sin(yaw)[:, None]
        world_x = block[:, :1] + cos * points[:, 0] - sin * points[:, 1]
        world_y = block[:, 1:] + sin * points[:, 0] + cos * points[:, 1]
        # into the target frame
        dx, dy = world_x - TARGET_XY[0], world_y - TARGET_XY[1]
        tc, ts = math.cos(TARGET_YAW), math.sin(TARGET_YAW)
        local = torch.stack((tc * dx + ts * dy, -ts * dx + tc * dy), dim=-1)
        return inside_t(local).float().mean(dim=1)

    def area_coverage(self, block: Tensor, yaw: Tensor) -> Tensor:
        """Fraction of the target T's area covered by the block [N], exact (the success test of
        success="coverage"; the reward keeps the grid estimate of `coverage`)."""
        overlap = t_overlap_area(
            block, yaw, self.block_rects, TARGET_XY, TARGET_YAW, self.target_rects
        )
        return overlap / self.target_area

    # ---- Task API ----
    def sample_init(
        self, n: int, generator: torch.Generator, device: torch.device | str
    ) -> tuple[Tensor, Tensor]:
        block = torch.empty(n, 2)
        pusher = torch.empty(n, 2)
        todo = torch.ones(n, dtype=torch.bool)
        target = torch.tensor(TARGET_XY)
        for _ in range(100):  # rejection sampling: block away from the target, pusher off the block
            k = int(todo.sum())
            if k == 0:
                break
            block_try = (torch.rand(k, 2, generator=generator) * 2 - 1) * self.init_range
            pusher_try = (torch.rand(k, 2, generator=generator) * 2 - 1) * (WORKSPACE - 0.03)
            ok = ((block_try - target).norm(dim=1) > self.min_init_distance) & (
                (pusher_try - block_try).norm(dim=1) > 0.1
            )
            ids = torch.nonzero(todo).flatten()[ok]
            block[ids], pusher[ids] = block_try[ok], pusher_try[ok]
            todo[ids] = False
        yaw = (torch.rand(n, generator=generator) * 2 - 1) * math.pi
        qpos = torch.zeros(n, self.nq)
        qpos[:, self.block_x], qpos[:, self.block_y], qpos[:, self.block_yaw] = (
            block[:, 0],
            block[:, 1],
            yaw,
        )
        qpos[:, self.pusher_x], qpos[:, self.pusher_y] = pusher[:, 0], pusher[:, 1]
        return qpos.to(device), torch.zeros(n, self.nv, device=device)

    def action_to_ctrl(self, action: Tensor) -> Tensor:
        ctrl = torch.zeros(action.shape[0], self.nu, device=action.device)
        target = scale_action(action, -WORKSPACE, WORKSPACE)
        ctrl[:, self.act_x], ctrl[:, self.act_y] = target[:, 0], target[:, 1]
        return ctrl

    def target_to_action(self, target_xy: Tensor) -> Tensor:
        """Inverse of action_to_ctrl: pusher target (x, y) in metres -> action in [-1, 1]."""
        return (target_xy / WORKSPACE).clamp(-1.0, 1.0)

    def observe(self, state: SimState) -> Tensor:
        pusher, block, yaw = self.poses(state)
        return torch.cat((pusher, block, torch.sin(yaw)[:, None], torch.cos(yaw)[:, None]), dim=1)

    def evaluate(self, state: SimState, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        _, block, yaw = self.poses(state)
        reward = self.coverage(block, yaw)
        if self.success == "coverage":
            success = self.area_coverage(block, yaw) >= self.coverage_threshold
        else:
            position_error, angle_error = self.pose_errors(block, yaw)
            success = (position_error < self.position_tolerance) & (
                angle_error < self.angle_tolerance
            )
        failure = torch.zeros_like(success)
        return reward, success, failure
