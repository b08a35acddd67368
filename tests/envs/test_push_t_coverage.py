"""push_t's coverage success (task.success=coverage): the exact area coverage of the target T
against known values, a Monte-Carlo estimate and textbook polygon clipping; the option through
the Task, the task config and the CLI."""

import json
import math
import re

import pytest
import torch
import yaml

from embodied_rl.cli import main
from embodied_rl.envs.api import SimState
from embodied_rl.envs.registry import make, make_task, task_overrides
from embodied_rl.envs.tasks.push_t import TARGET_XY, TARGET_YAW, inside_t
from embodied_rl.errors import UserError
from embodied_rl.paths import config_dir

T_AREA = 0.1 * 0.025 + 0.025 * 0.075  # bar + stem (m^2)


@pytest.fixture(scope="module")
def task():
    task = make_task("push_t")
    task.bind(task.load_model())
    return task


def from_target_frame(offsets, turns):
    """Block poses (xy [N, 2], yaw [N]) at `offsets` [N, 2] (metres, in the target's frame) from
    the target and turned by `turns` [N] (radians) relative to it."""
    cos, sin = math.cos(TARGET_YAW), math.sin(TARGET_YAW)
    x = TARGET_XY[0] + cos * offsets[:, 0] - sin * offsets[:, 1]
    y = TARGET_XY[1] + sin * offsets[:, 0] + cos * offsets[:, 1]
    return torch.stack((x, y), dim=1), TARGET_YAW + turns


def coverage_at(task, offsets, turns):
    xy, yaw = from_target_frame(torch.as_tensor(offsets, dtype=torch.float32).reshape(-1, 2),
                                torch.as_tensor(turns, dtype=torch.float32).reshape(-1))
    return task.area_coverage(xy, yaw)


def random_relative_poses(n, seed):
    """Offsets within 4 cm and any turn: most overlap the target partly."""
    generator = torch.Generator().manual_seed(seed)
    offsets = (torch.rand(n, 2, generator=generator) * 2 - 1) * 0.04
    turns = (torch.rand(n, generator=generator) * 2 - 1) * math.pi
    return offsets, turns


def test_geometry_is_read_from_the_model(task):
    # bar 10 x 2.5 cm on a 7.5 x 2.5 cm stem, the same T for the block and the target
    assert torch.equal(task.block_rects, task.target_rects)
    assert task.target_area == pytest.approx(T_AREA, rel=1e-6)
    import mujoco

    model = task.load_model()
    target = model.body("target")
    assert tuple(target.pos[:2]) == pytest.approx(TARGET_XY)
    assert 2 * math.atan2(target.quat[3], target.quat[0]) == pytest.approx(TARGET_YAW)
    assert mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_GEOM, "block_bar") >= 0


def test_one_at_the_target_zero_far_away(task):
    coverage = coverage_at(task, [[0, 0], [0, 0], [0, 0], [0.2, 0.1], [-0.1, 0.0]],
                           [0, 2 * math.pi, -2 * math.pi, 0, 1.0])
    torch.testing.assert_close(coverage, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0]), atol=1e-6, rtol=0)


def test_translations_give_the_analytic_values(task):
    # Shifted by half the bar's 2.5 cm width along the bar (x): the bars share 8.75 x 2.5 cm and
    # the stems 1.25 x 7.5 cm; along the stem (y): the bars share 10 x 1.25, the stems
    # 2.5 x 6.25 and the block's stem enters the target's bar by 2.5 x 1.25. Both: 5/7.
    # Shifted by half the bar's length (5 cm) along it: only the bars, 5 x 2.5 cm: 2/7.
    # Shifted by the stem's length (7.5 cm) down the stem: the block's bar covers the end of the
    # target's stem, 2.5 x 2.5 cm: 1/7; by 10 cm, it only touches it: 0.
    coverage = coverage_at(task, [[0.0125, 0], [-0.0125, 0], [0, 0.0125], [0.05, 0], [0, -0.075],
                                  [0, -0.1]], [0, 0, 0, 0, 0, 0])
    expected = torch.tensor([5 / 7, 5 / 7, 5 / 7, 2 / 7, 1 / 7, 0.0])
    torch.testing.assert_close(coverage, expected, atol=1e-5, rtol=0)


def test_swapping_block_and_target_keeps_the_coverage(task):
    # Both shapes are the same T: seen from the block, the target sits at the inverse pose.
    offsets, turns = random_relative_poses(64, seed=1)
    cos, sin = torch.cos(turns), torch.sin(turns)
    inverse = -torch.stack((cos * offsets[:, 0] + sin * offsets[:, 1],
                            -sin * offsets[:, 0] + cos * offsets[:, 1]), dim=1)
    torch.testing.assert_close(coverage_at(task, offsets, turns), coverage_at(task, inverse, -turns),
                               atol=1e-5, rtol=0)


def test_matches_a_monte_carlo_estimate(task):
    offsets, turns = random_relative_poses(12, seed=2)
    offsets[0], turns[0] = torch.tensor([0.004, -0.003]), 0.05  # near the target too
    coverage = coverage_at(task, offsets, turns)
    # points uniform in the target T (its frame; the T spans 10 x 10 cm from (-5, -6.6071) cm):
    # the fraction inside the block's T (about 90,000 points: a standard error below 0.002)
    generator = torch.Generator().manual_seed(3)
    box = torch.rand(200_000, 2, generator=generator, dtype=torch.float64) * 0.1
    box -= torch.tensor([0.05, 0.066071], dtype=torch.float64)
    points = box[inside_t(box)]
    for i in range(len(offsets)):
        cos, sin = math.cos(turns[i]), math.sin(turns[i])
        shifted = points - offsets[i].double()
        in_block = torch.stack((cos * shifted[:, 0] + sin * shifted[:, 1],
                                -sin * shifted[:, 0] + cos * shifted[:, 1]), dim=1)
        estimate = inside_t(in_block).double().mean().item()
        assert coverage[i].item() == pytest.approx(estimate, abs=0.01), (offsets[i], turns[i])
    assert coverage.min() > 0.05 and coverage[0] > 0.8  # partial overlaps, not trivial cases


def clip_polygon(polygon, axis, side, bound):
    """One Sutherland-Hodgman step: the part of a convex polygon (a list of (x, y)) where
    side * (bound - p[axis]) >= 0, e.g. x <= x1 (axis 0, side 1) or y >= y0 (axis 1, side -1)."""
    out = []
    for i, start in enumerate(polygon):
        end = polygon[(i + 1) % len(polygon)]
        d_start, d_end = side * (bound - start[axis]), side * (bound - end[axis])
        if d_start >= 0:
            out.append(start)
        if (d_start >= 0) != (d_end >= 0):
            t = d_start / (d_start - d_end)
            out.append((start[0] + t * (end[0] - start[0]), start[1] + t * (end[1] - start[1])))
    return out


def shoelace(polygon):
    return 0.5 * abs(sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in zip(polygon, polygon[1:] + polygon[:1])))


def test_matches_sutherland_hodgman_clipping(task):
    """The textbook method, in float64 Python: clip each block rectangle by each target
    rectangle's four sides, then measure with the shoelace formula."""
    offsets, turns = random_relative_poses(40, seed=4)
    coverage = coverage_at(task, offsets, turns)
    rects = task.block_rects.double().tolist()
    for i in range(len(offsets)):
        cos, sin = math.cos(turns[i]), math.sin(turns[i])
        ox, oy = offsets[i].tolist()
        area = 0.0
        for cx, cy, hx, hy in rects:
            corners = [(cx - hx, cy - hy), (cx + hx, cy - hy), (cx + hx, cy + hy), (cx - hx, cy + hy)]
            block = [(ox + cos * x - sin * y, oy + sin * x + cos * y) for x, y in corners]
            for tx, ty, thx, thy in rects:
                polygon = block
                for axis, side, bound in ((0, 1, tx + thx), (0, -1, tx - thx),
                                          (1, 1, ty + thy), (1, -1, ty - thy)):
                    polygon = clip_polygon(polygon, axis, side, bound) if polygon else polygon
                area += shoelace(polygon) if len(polygon) >= 3 else 0.0
        assert coverage[i].item() == pytest.approx(area / T_AREA, abs=1e-5)


# ---------------------------------------------------------------- the option


def states_at(task, offsets, turns):
    """A SimState of one env per pose (sensors computed by mj_forward), pusher out of the way."""
    import mujoco

    model = task.load_model()
    data = mujoco.MjData(model)
    xy, yaw = from_target_frame(offsets, turns)
    rows = []
    for i in range(len(offsets)):
        data.qpos[:] = 0.0
        data.qpos[[task.block_x, task.block_y, task.block_yaw]] = (*xy[i].tolist(), yaw[i].item())
        data.qpos[[task.pusher_x, task.pusher_y]] = 0.2
        mujoco.mj_forward(model, data)
        rows.append([torch.from_numpy(a.copy()) for a in (data.qpos, data.qvel, data.sensordata, data.ctrl)])
    return SimState(*(torch.stack(column) for column in zip(*rows)))


def test_success_follows_the_option(task):
    coverage_task = make_task("push_t", success="coverage")
    coverage_task.bind(coverage_task.load_model())
    assert task.success == "pose" and coverage_task.coverage_threshold == 0.95
    # on target; the pose test's example, 1.4 cm and 7 degrees off (coverage ~0.6); 1 mm and
    # 1 degree off (coverage > 0.95); 3 cm off
    offsets = torch.tensor([[0.0, 0.0], [0.012, -0.008], [0.001, 0.0], [0.03, 0.0]])
    turns = torch.tensor([0.0, math.radians(7), math.radians(1), 0.0])
    state = states_at(task, offsets, turns)
    for t, expected in ((task, [True, True, True, False]), (coverage_task, [True, False, True, False])):
        reward, success, failure = t.evaluate(state, torch.zeros(4, 2))
        assert success.tolist() == expected and not failure.any()
        assert reward[0] == pytest.approx(1.0) and 0.5 < reward[1] < 0.7  # the reward is unchanged


def test_the_description_follows_the_option():
    cls = type(make_task("push_t"))
    assert cls.success_criterion == make_task("push_t").success_criterion
    assert "2 cm and 10 degrees" in cls.success_criterion
    covering = make_task("push_t", success="coverage", coverage_threshold=0.9)
    assert "covers at least 90% of the target T's area" in covering.success_criterion
    assert "1.5 cm" in make_task("push_t", position_tolerance=0.015).success_criterion


def test_task_config_option_and_description():
    config = yaml.safe_load((config_dir() / "task" / "push_t.yaml").read_text())
    assert task_overrides(config) == {}
    assert task_overrides({**config, "success": "coverage"}) == {"success": "coverage"}
    described = make_task("push_t", success="coverage").success_criterion
    assert task_overrides({**config, "success": "coverage", "success_criterion": described}) == {
        "success": "coverage"}
    with pytest.raises(UserError, match="task.success_criterion=.* contradicts task 'push_t'"):
        task_overrides({**config, "success": "coverage",
                        "success_criterion": type(make_task("push_t")).success_criterion})
    for key, value, message in (
        ("success", "area", "bad value for 'task.success': 'area' (choose from: pose, coverage)"),
        ("success", 1, "bad value for 'task.success'"),
        ("coverage_threshold", 1.5, "task.coverage_threshold must be in (0, 1]"),
    ):
        with pytest.raises(UserError, match=re.escape(message)):
            task_overrides({**config, key: value})
    with pytest.raises(UserError, match="task.success"):
        make("push_t", task_options={"success": "area"})


def test_coverage_success_on_the_warp_backend():
    """The same successes on MuJoCo Warp (float32 state) as on native MuJoCo, block on target."""
    pytest.importorskip("mujoco_warp")
    envs = [make("push_t", num_envs=2, backend=backend, seed=0, task_options={"success": "coverage"})
            for backend in ("mujoco_warp", "mujoco")]
    results = []
    for env in envs:
        env.reset(seed=0)
        qpos = env.state.qpos.clone()
        task = env.task
        qpos[0, task.block_x], qpos[0, task.block_y], qpos[0, task.block_yaw] = 0.0, 0.0, TARGET_YAW
        qpos[:, task.pusher_x], qpos[:, task.pusher_y] = 0.2, 0.2  # clear of the block
        env._write_state(torch.arange(2, device=qpos.device), qpos, torch.zeros_like(env.state.qvel))
        _, _, terminated, _, info = env.step(torch.full((2, 2), 0.8))
        results.append((info["success"].cpu().tolist(), terminated.cpu().tolist()))
    assert results[0] == results[1] == ([True, False], [True, False])


# ---------------------------------------------------------------- through the CLI


@pytest.mark.e2e
def test_collect_with_coverage_success(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["collect", "task=push_t", "task.success=coverage", "demos=2", "num_envs=2",
                 f"run_dir={run_dir}"]) == 0
    assert "expert_success_rate:" in capsys.readouterr().out
    info = json.loads((run_dir / "collect_info.json").read_text())
    assert info["episodes_written"] == 2 and info["expert_success_rate"] > 0
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["task"]["success"] == "coverage"


@pytest.mark.parametrize("override, message", [
    ("task.success=area", "bad value for 'task.success': 'area' (choose from: pose, coverage)"),
    ("task.coverage_threshold=0", "task.coverage_threshold must be in (0, 1]"),
])
def test_a_bad_option_exits_2_with_one_line(override, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["collect", "task=push_t", override, "demos=1", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0
    assert not run_dir.exists()
