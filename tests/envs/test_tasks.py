"""Every registered task beyond reach (tests/envs/test_reach.py), on the native MuJoCo backend.

Each task: make/reset/step with random actions (shapes, finite values), seeding, its config
against its class; and success (or failure, for hopper) on hand-constructed states through the
task's own evaluate(). A task added to the registry is picked up here; a task with instructions
gives dict observations, whose "state" is checked here (tests/envs/test_instructions.py covers
the rest).
"""

import math
import re

import mujoco
import pytest
import torch
import yaml

from embodied_rl.envs.api import SimState
from embodied_rl.envs.registry import TASKS as REGISTERED_TASKS
from embodied_rl.envs.registry import make, make_task, task_overrides
from embodied_rl.errors import UserError
from embodied_rl.paths import config_dir

TASKS = [name for name in REGISTERED_TASKS if name != "reach"]


def state_obs(obs):
    """The state part of an observation (a task with instructions gives a dict)."""
    return obs["state"] if isinstance(obs, dict) else obs


def check_instruction(obs, task, n):
    if task.instructions:
        assert set(obs) == {"state", "instruction"}
        assert obs["instruction"].shape == (n,) and obs["instruction"].dtype == torch.int64
        assert ((obs["instruction"] >= 0) & (obs["instruction"] < len(task.instructions))).all()
    else:
        assert isinstance(obs, torch.Tensor)


def state_from_qpos(task, qpos: torch.Tensor) -> SimState:
    """A one-env SimState of the task's model at `qpos` (sensors computed by mj_forward)."""
    model = task.load_model()
    task.bind(model)
    data = mujoco.MjData(model)
    data.qpos[:] = qpos.double().numpy()
    mujoco.mj_forward(model, data)

    def row(array):
        return torch.from_numpy(array.copy())[None]

    return SimState(row(data.qpos), row(data.qvel), row(data.sensordata), row(data.ctrl))


def initial_state(task, seed: int = 0) -> SimState:
    model = task.load_model()
    task.bind(model)
    qpos, _ = task.sample_init(1, torch.Generator().manual_seed(seed), "cpu")
    return state_from_qpos(task, qpos[0])


@pytest.mark.parametrize("name", TASKS)
def test_make_reset_step_random_actions(name):
    env = make(name, num_envs=3, seed=0, threads=1)
    task = env.task
    obs, _ = env.reset(seed=0)
    check_instruction(obs, task, 3)
    obs = state_obs(obs)
    assert obs.shape == (3, task.obs_dim) and obs.dtype == torch.float32
    assert env.single_action_space.shape == (task.action_dim,)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        action = torch.rand(3, task.action_dim, generator=generator) * 2 - 1
        obs, reward, terminated, truncated, info = env.step(action)
        check_instruction(obs, task, 3)
        obs = state_obs(obs)
        assert obs.shape == (3, task.obs_dim) and torch.isfinite(obs).all()
        assert (
            reward.shape == (3,) and reward.dtype == torch.float32 and torch.isfinite(reward).all()
        )
        assert terminated.dtype == torch.bool and truncated.dtype == torch.bool
        assert info["success"].shape == (3,)
    assert env.unstable_resets == 0


@pytest.mark.parametrize("name", TASKS)
def test_same_seed_same_initial_states(name):
    first, _ = make(name, num_envs=4, seed=0, threads=1).reset(seed=7)
    again, _ = make(name, num_envs=4, seed=1, threads=1).reset(seed=7)
    other, _ = make(name, num_envs=4, seed=0, threads=1).reset(seed=8)
    if isinstance(first, dict):  # instructions too
        assert torch.equal(first["instruction"], again["instruction"])
        first, again, other = first["state"], again["state"], other["state"]
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    assert not torch.allclose(first[0], first[1])  # envs differ from each other


@pytest.mark.parametrize("name", ["reach", *TASKS])
def test_task_config_matches_task(name):
    config = yaml.safe_load((config_dir() / "task" / f"{name}.yaml").read_text())
    task = make_task(name)
    assert config["name"] == name
    assert config["max_episode_steps"] == task.max_episode_steps
    assert config["has_success"] == task.has_success
    assert task_overrides(config) == {}  # the shipped config changes nothing


def test_task_overrides_pass_attributes_and_refuse_contradictions():
    config = yaml.safe_load((config_dir() / "task" / "hopper.yaml").read_text())
    assert task_overrides({**config, "max_episode_steps": 7, "reset_noise_scale": 0.01}) == {
        "max_episode_steps": 7, "reset_noise_scale": 0.01}
    for key, value, message in (
        ("has_success", True, "task.has_success=True contradicts task 'hopper'"),
        ("expert", False, "task.expert=False contradicts"),
        ("obs_dim", 3, "task.obs_dim=3 contradicts"),
        ("max_episode_steps", 0, "task.max_episode_steps must be >= 1"),
        ("max_episode_steps", 2.5, "bad value for 'task.max_episode_steps'"),
        ("no_such_key", 1, "unknown key 'task.no_such_key' for task 'hopper'"),
    ):
        with pytest.raises(UserError, match=re.escape(message)):
            task_overrides({**config, key: value})


def test_push_t_success_only_at_the_target_pose():
    task = make_task("push_t")
    start = initial_state(task)
    _, success, _ = task.evaluate(start, torch.zeros(1, 2))
    assert not success.any()
    solved = torch.zeros(task.nq)
    solved[task.block_x], solved[task.block_y] = 0.012, -0.008  # 1.4 cm off
    solved[task.block_yaw] = math.pi / 4 + math.radians(7)
    solved[task.pusher_x], solved[task.pusher_y] = 0.2, 0.2
    reward, success, failure = task.evaluate(state_from_qpos(task, solved), torch.zeros(1, 2))
    assert success.all() and not failure.any()
    assert 0.5 < reward.item() < 1.0  # coverage: most of the target T
    solved[task.block_x], solved[task.block_y] = 0.0, 0.0
    solved[task.block_yaw] = math.pi / 4
    reward, success, _ = task.evaluate(state_from_qpos(task, solved), torch.zeros(1, 2))
    assert success.all() and reward.item() == pytest.approx(1.0)
    solved[task.block_yaw] = math.pi / 4 + math.radians(15)  # right place, turned too far
    _, success, _ = task.evaluate(state_from_qpos(task, solved), torch.zeros(1, 2))
    assert not success.any()
    solved[task.block_yaw] = math.pi / 4 - 2 * math.pi  # the same pose, one turn apart
    _, success, _ = task.evaluate(state_from_qpos(task, solved), torch.zeros(1, 2))
    assert success.all()


def test_lift_success_only_when_the_cube_is_raised():
    task = make_task("lift")
    start = initial_state(task)
    reward_start, success, _ = task.evaluate(start, torch.zeros(1, 5))
    assert not success.any()
    qpos = start.qpos[0].clone()
    cube = task.cube_joint.start
    qpos[cube + 2] = 0.02 + 0.03  # 3 cm up: not yet
    _, success, _ = task.evaluate(state_from_qpos(task, qpos), torch.zeros(1, 5))
    assert not success.any()
    qpos[cube + 2] = 0.02 + 0.055
    qpos[task.hand_joints[0]], qpos[task.hand_joints[1]] = qpos[cube], qpos[cube + 1]
    qpos[task.hand_joints[2]] = qpos[cube + 2]
    reward, success, failure = task.evaluate(state_from_qpos(task, qpos), torch.zeros(1, 5))
    assert success.all() and not failure.any()
    assert reward.item() == pytest.approx(1.0, abs=1e-3) and reward.item() > reward_start.item()


def test_peg_insert_success_only_inside_the_hole():
    task = make_task("peg_insert")
    start = initial_state(task)
    _, success, _ = task.evaluate(start, torch.zeros(1, 3))
    assert not success.any()
    qpos = torch.zeros(task.nq)
    qpos[task.hole_joints[0]], qpos[task.hole_joints[1]] = 0.05, -0.03
    qpos[task.peg_joints[0]], qpos[task.peg_joints[1]] = 0.051, -0.03
    qpos[task.peg_joints[2]] = 0.05 - 0.03  # tip 3 cm below the rim (rim at 5 cm)
    reward, success, failure = task.evaluate(state_from_qpos(task, qpos), torch.zeros(1, 3))
    assert success.all() and not failure.any() and reward.item() > 0.9
    qpos[task.peg_joints[2]] = 0.05 - 0.015  # only 1.5 cm in
    _, success, _ = task.evaluate(state_from_qpos(task, qpos), torch.zeros(1, 3))
    assert not success.any()
    qpos[task.peg_joints[0]] = 0.05 + 0.04  # deep enough but beside the block
    qpos[task.peg_joints[2]] = 0.01
    _, success, _ = task.evaluate(state_from_qpos(task, qpos), torch.zeros(1, 3))
    assert not success.any()


def test_hopper_is_reward_based_and_fails_when_fallen():
    task = make_task("hopper")
    assert not task.has_success
    start = initial_state(task)
    reward, success, failure = task.evaluate(start, torch.zeros(1, 3))
    assert not success.any() and not failure.any()
    assert reward.item() == pytest.approx(1.0, abs=0.05)  # healthy bonus, ~no velocity
    fallen = start.qpos[0].clone()
    fallen[task.root_z] = 0.5
    _, _, failure = task.evaluate(state_from_qpos(task, fallen), torch.zeros(1, 3))
    assert failure.all()
    tilted = start.qpos[0].clone()
    tilted[task.root_angle] = 0.3
    _, _, failure = task.evaluate(state_from_qpos(task, tilted), torch.zeros(1, 3))
    assert failure.all()


def test_hopper_matches_gymnasium_hopper_v5_observation():
    gymnasium = pytest.importorskip("gymnasium")
    env = make("hopper", num_envs=1, seed=0, threads=1)
    obs, _ = env.reset(seed=0)
    reference = gymnasium.make("Hopper-v5").unwrapped
    reference.reset(seed=0)
    reference.set_state(env.state.qpos[0].numpy().copy(), env.state.qvel[0].numpy().copy())
    expected = torch.as_tensor(reference._get_obs(), dtype=torch.float32)
    torch.testing.assert_close(obs[0], expected, atol=1e-6, rtol=0)
