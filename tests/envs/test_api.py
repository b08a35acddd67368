"""BatchedEnv contract tests on the reach task, native MuJoCo backend."""

import re

import gymnasium
import pytest
import torch

import embodied_rl.envs as envs
from embodied_rl.envs import make, make_expert, step_chunk
from embodied_rl.errors import UserError

N = 4
FAR = torch.ones(N, 2)  # fingertip parked in the corner: never reaches a target (always truncated)


@pytest.fixture
def env():
    env = make("reach", num_envs=N, seed=0, threads=2)
    yield env
    env.close()


def test_shapes_dtypes_spaces(env):
    obs, info = env.reset(seed=0)
    assert obs.shape == (N, 8) and obs.dtype == torch.float32
    assert isinstance(env.single_action_space, gymnasium.spaces.Box)
    assert env.single_action_space.shape == (2,)
    assert float(env.single_action_space.low.min()) == -1.0 and float(env.single_action_space.high.max()) == 1.0
    assert env.single_observation_space.shape == (8,)
    assert env.num_envs == N and env.device == torch.device("cpu") and env.task.name == "reach"
    obs, reward, terminated, truncated, info = env.step(torch.zeros(N, 2))
    assert reward.shape == (N,) and reward.dtype == torch.float32
    assert terminated.dtype == torch.bool and truncated.dtype == torch.bool
    for key in ("success", "unstable", "_final", "_episode"):
        assert info[key].shape == (N,) and info[key].dtype == torch.bool
    assert info["final_obs"].shape == (N, 8)
    assert set(info["episode"]) == {"return", "length", "success_once"}


def test_truncation_auto_reset_and_final_obs(env):
    obs, _ = env.reset(seed=1)
    total = torch.zeros(N)
    for t in range(env.task.max_episode_steps):
        obs, reward, terminated, truncated, info = env.step(FAR)
        total += reward
        assert not terminated.any()
        if t < env.task.max_episode_steps - 1:
            assert not truncated.any() and not info["_final"].any()
    assert truncated.all() and info["_final"].all() and info["_episode"].all()
    # the true last obs: fingertip near the commanded corner; the returned obs: a fresh episode
    assert torch.allclose(info["final_obs"][:, :2], torch.full((N, 2), 0.2), atol=0.01)
    assert (obs[:, :2].abs() <= 0.15 + 1e-6).all()
    assert torch.equal(info["episode"]["length"], torch.full((N,), 50))
    assert torch.allclose(info["episode"]["return"], total)
    assert not info["episode"]["success_once"].any()
    # the next step continues the new episode
    _, _, _, truncated, info = env.step(FAR)
    assert not truncated.any() and not info["_episode"].any()


def test_success_terminates_not_truncates(env):
    obs, _ = env.reset(seed=2)
    expert = make_expert("reach", env, quality=1.0)
    seen = False
    for _ in range(40):
        obs, reward, terminated, truncated, info = env.step(expert.act(obs))
        expert.reset(info["_final"])
        assert not (terminated & truncated).any()
        assert torch.equal(terminated, info["success"])
        if terminated.any():
            seen = True
            assert info["episode"]["success_once"][terminated].all()
            finger, target = info["final_obs"][terminated, :2], info["final_obs"][terminated, 2:4]
            assert ((finger - target).norm(dim=1) < 0.02).all()
    assert seen


def test_same_seed_same_episodes():
    def rollout(seed):
        env = make("reach", num_envs=N, seed=123, threads=1)
        obs, _ = env.reset(seed=seed)
        observations = [obs]
        actions = torch.linspace(-1, 1, 60 * N * 2).reshape(60, N, 2)
        for a in actions:
            obs, *_ = env.step(a)
            observations.append(obs)
        env.close()
        return torch.stack(observations)

    first, second, other = rollout(7), rollout(7), rollout(8)
    assert torch.equal(first, second)
    assert not torch.equal(first[0], other[0])


def test_partial_reset(env):
    obs, _ = env.reset(seed=3)
    for _ in range(5):
        obs, *_ = env.step(FAR)
    before = obs.clone()
    obs, _ = env.reset(env_ids=torch.tensor([1, 3]))
    assert torch.equal(obs[[0, 2]], before[[0, 2]])
    assert not torch.equal(obs[[1, 3]], before[[1, 3]])
    mask = torch.tensor([True, False, False, False])
    obs2, _ = env.reset(env_ids=mask)
    assert torch.equal(obs2[1:], obs[1:]) and not torch.equal(obs2[0], obs[0])
    # the reset envs restart their episode clock: env 2 (never reset) truncates 5 steps earlier
    for _ in range(45):
        _, _, _, truncated, _ = env.step(FAR)
    assert truncated.tolist() == [False, False, True, False]


def test_group_size_reset():
    env = make("reach", num_envs=6, seed=0, threads=1)
    obs, _ = env.reset(seed=5, group_size=3)
    assert torch.equal(obs[0], obs[1]) and torch.equal(obs[1], obs[2])
    assert torch.equal(obs[3], obs[5]) and not torch.equal(obs[0], obs[3])
    with pytest.raises(ValueError, match="group_size"):
        env.reset(group_size=4)


def test_bad_actions_raise(env):
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"\(4, 2\)"):
        env.step(torch.zeros(N, 3))
    with pytest.raises(ValueError, match=r"\(4, 2\)"):
        env.step(torch.zeros(2))
    with pytest.raises(ValueError, match="floating"):
        env.step(torch.zeros(N, 2, dtype=torch.long))
    bad = torch.zeros(N, 2)
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        env.step(bad)
    bad[2, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        env.step(bad)


def test_step_before_reset_raises():
    env = make("reach", num_envs=1, threads=1)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(torch.zeros(1, 2))


def test_unknown_names_list_choices():
    with pytest.raises(UserError, match="choose from: reach"):
        make("nope", num_envs=1)
    with pytest.raises(UserError, match="mujoco, mujoco_warp, gymnasium"):
        make("reach", num_envs=1, backend="bullet")
    with pytest.raises(UserError, match="num_envs"):
        make("reach", num_envs=0)
    with pytest.raises(UserError, match="unknown option 'colour'"):
        make("reach", num_envs=1, task_options={"colour": 1})


def test_task_options_override_time_limit():
    env = make("reach", num_envs=2, threads=1, task_options={"max_episode_steps": 3})
    env.reset(seed=0)
    for _ in range(3):
        _, _, _, truncated, _ = env.step(torch.ones(2, 2))
    assert truncated.all()


def _env_before_chunk():
    """Two envs with a 10-step limit: env 1 has taken 7 steps, env 0 has taken 3, so inside an
    8-step chunk env 1 finishes at step 2 and env 0 at step 6."""
    env = make("reach", num_envs=2, seed=0, threads=1, task_options={"max_episode_steps": 10})
    env.reset(seed=11)
    for _ in range(4):
        env.step(torch.ones(2, 2))
    env.reset(env_ids=torch.tensor([0]))
    for _ in range(3):
        env.step(torch.ones(2, 2))
    return env


def test_step_chunk_mid_chunk_finish():
    horizon = 8
    actions = torch.ones(2, horizon, 2)
    rewards = []
    ref = _env_before_chunk()  # reference: step the same chunk on an identical env by hand
    finals = []
    for h in range(horizon):
        _, r, _, trunc, info = ref.step(actions[:, h])
        rewards.append(r)
        finals.append((trunc.clone(), info["final_obs"].clone(), info["episode"]["return"].clone()))
    rewards = torch.stack(rewards)  # [H, N]

    env = _env_before_chunk()
    obs, reward_sum, terminated, truncated, info = step_chunk(env, actions)
    assert truncated.tolist() == [True, True] and not terminated.any()
    assert finals[6][0].tolist() == [True, False] and finals[2][0].tolist() == [False, True]
    assert torch.allclose(reward_sum[0], rewards[:7, 0].sum())
    assert torch.allclose(reward_sum[1], rewards[:3, 1].sum())
    assert info["steps"].tolist() == [7, 3]
    assert torch.allclose(info["final_obs"][0], finals[6][1][0])
    assert torch.allclose(info["final_obs"][1], finals[2][1][1])
    assert torch.allclose(info["episode"]["return"], torch.stack([finals[6][2][0], finals[2][2][1]]))
    assert info["_final"].all() and info["_episode"].all()
    # both envs stepped past their end: reset again, so both start a fresh episode
    assert (env.elapsed == 0).all()
    assert (obs[:, :2].abs() <= 0.15 + 1e-6).all()


def test_step_chunk_without_finish_sums_rewards(env):
    env.reset(seed=4)
    obs, reward_sum, terminated, truncated, info = step_chunk(env, torch.ones(N, 5, 2))
    assert info["steps"].tolist() == [5] * N and not info["_final"].any()
    assert (env.elapsed == 5).all()
    with pytest.raises(ValueError, match="H"):
        step_chunk(env, torch.ones(N, 2))


def test_gym_ids_registered():
    import gymnasium

    for gym_name in ("Reach", "PushT", "Lift", "PegInsert", "Hopper"):
        assert f"embodied_rl/{gym_name}-v0" in gymnasium.registry
    assert envs.TASKS.keys() >= {"reach", "push_t", "lift", "peg_insert", "hopper"}


def test_a_reward_camera_renders_its_frames_beside_the_policys():
    """reward_camera="top": obs["reward_pixels"] holds the frames the same env would show as its own
    pixels were "top" its camera, in every observation, final ones and snapshots included."""
    common = dict(num_envs=2, obs_mode="pixels", image_size=16, seed=4)
    env = make("tabletop", reward_camera="top", **common)
    top = make("tabletop", task_options={"camera": "top"}, **common)
    obs, _ = env.reset(seed=4)
    reference, _ = top.reset(seed=4)
    assert env.single_observation_space["reward_pixels"].shape == (16, 16, 3)
    assert torch.equal(obs["reward_pixels"], reference["pixels"]) and not torch.equal(obs["pixels"], obs["reward_pixels"])
    action = torch.zeros(2, env.task.action_dim)
    for _ in range(env.max_episode_steps):  # through an auto-reset
        obs, _, _, _, info = env.step(action)
        reference, _, _, _, reference_info = top.step(action)
    assert torch.equal(info["final_obs"]["reward_pixels"], reference_info["final_obs"]["pixels"])
    assert torch.equal(obs["reward_pixels"], reference["pixels"])
    assert "obs/reward_pixels" in env.get_state()
    env.close()
    top.close()


@pytest.mark.parametrize("options, message", [
    ({"obs_mode": "pixels", "reward_camera": "side"}, "task 'tabletop' has no camera named 'side' (its cameras: front, top)"),
    ({"reward_camera": "top"}, "it needs obs_mode='pixels'"),
    ({"obs_mode": "pixels", "reward_camera": "top", "backend": "gymnasium"}, "mujoco and mujoco_warp backends only"),
])
def test_bad_reward_cameras_are_refused(options, message):
    with pytest.raises(UserError, match=re.escape(message)):
        make("tabletop", num_envs=1, **options)
