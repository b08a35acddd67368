"""Backend `gymnasium`: the BatchedEnv contract over gymnasium vector envs."""

import gymnasium as gym
import numpy as np
import pytest
import torch
import toy_envs  # noqa: F401  (registers TestCount-v0 and TestDictObs-v0: tests/envs/toy_envs.py)

from embodied_rl.envs.backends.gymnasium import GymnasiumEnv
from embodied_rl.errors import UserError


def _act(n, value):
    return torch.full((n, 1), float(value))


def test_contract_on_inverted_pendulum():
    with GymnasiumEnv("InvertedPendulum-v5", num_envs=3, seed=0) as env:
        assert env.single_observation_space.shape == (4,)
        assert env.single_action_space.shape == (1,)
        assert env.single_action_space.dtype == np.float32
        obs, info = env.reset()
        assert obs.shape == (3, 4) and obs.dtype == torch.float32
        obs, reward, terminated, truncated, info = env.step(torch.zeros(3, 1))
        assert obs.shape == (3, 4) and obs.dtype == torch.float32
        assert reward.shape == (3,) and reward.dtype == torch.float32
        assert terminated.dtype == torch.bool and truncated.dtype == torch.bool
        for key in ("success", "unstable", "_final", "_episode"):
            assert info[key].shape == (3,) and info[key].dtype == torch.bool, key
        assert not info["success"].any()  # InvertedPendulum has no success key
        assert info["final_obs"].shape == (3, 4)
        assert set(info["episode"]) == {"return", "length", "success_once"}


def test_actions_rescale_to_the_box_and_are_validated():
    with GymnasiumEnv("TestCount-v0", num_envs=3) as env:
        env.reset(seed=0)
        obs, *_ = env.step(torch.tensor([[-1.0], [0.0], [0.5]]))
        assert obs[:, 1].tolist() == pytest.approx([-2.0, 1.0, 2.5])  # [-1, 1] -> [-2, 4]
        obs, *_ = env.step(torch.tensor([[-7.0], [0.0], [0.0]]))  # clipped to -1
        assert obs[0, 1].item() == pytest.approx(-2.0)
        with pytest.raises(ValueError, match="shape"):
            env.step(torch.zeros(2, 1))
        with pytest.raises(ValueError, match="NaN"):
            env.step(torch.tensor([[float("nan")], [0.0], [0.0]]))


def test_truncation_final_obs_success_and_episode_stats():
    with GymnasiumEnv("TestCount-v0", num_envs=2) as env:
        obs, _ = env.reset(seed=3)
        start = obs[:, 2].clone()
        for t in range(1, 4):
            obs, reward, terminated, truncated, info = env.step(_act(2, 0.0))
            assert not (terminated | truncated).any()
            assert info["success"].tolist() == [t >= 2] * 2
        obs, reward, terminated, truncated, info = env.step(_act(2, 0.0))  # step 4: time limit
        assert truncated.all() and not terminated.any()
        assert info["_final"].all() and info["_episode"].all()
        # final_obs is the true last observation; obs is the first of the next episode
        assert info["final_obs"][:, 0].tolist() == [4.0, 4.0]
        assert torch.equal(info["final_obs"][:, 2], start)
        assert obs[:, 0].tolist() == [0.0, 0.0]
        assert not torch.equal(obs[:, 2], start)  # a new start value was drawn
        # success came from the finishing step (the reset's info has none)
        assert info["success"].all()
        assert info["episode"]["return"].tolist() == [4.0, 4.0]
        assert info["episode"]["length"].tolist() == [4, 4]
        assert info["episode"]["success_once"].all()
        _, _, _, _, info = env.step(_act(2, 0.0))  # statistics restart with the new episode
        assert not info["_episode"].any() and not info["_final"].any()
        assert info["episode"]["length"].tolist() == [1, 1]


def test_terminated_and_truncated_stay_apart():
    with GymnasiumEnv("TestCount-v0", num_envs=2) as env:
        env.reset(seed=0)
        obs, reward, terminated, truncated, info = env.step(torch.tensor([[1.0], [0.0]]))
        assert terminated.tolist() == [True, False] and not truncated.any()
        assert info["_final"].tolist() == [True, False]
        assert info["final_obs"][0, 0].item() == 1.0 and obs[0, 0].item() == 0.0
        assert info["final_obs"][1].tolist() == obs[1].tolist()  # other rows: the returned obs
        assert not info["success"][0]  # failed on its first step: not a success
        env.step(_act(2, 0.0))
        env.step(_act(2, 0.0))
        _, _, terminated, truncated, _ = env.step(torch.tensor([[0.0], [1.0]]))  # env 1: step 4
        assert terminated.tolist() == [False, True] and not truncated.any()  # not both


def test_final_obs_matches_a_plain_gymnasium_env_at_truncation():
    steps = 3
    with GymnasiumEnv("InvertedPendulum-v5", num_envs=2, max_episode_steps=steps) as env:
        env.reset(seed=7)
        actions = torch.tensor([[0.1], [-0.1]])
        for _ in range(steps):
            obs, _, terminated, truncated, info = env.step(actions)
        assert truncated.all() and not terminated.any() and info["_final"].all()
    for i in range(2):  # the same episode in a plain env: copy i was seeded with 7 + i
        single = gym.make("InvertedPendulum-v5", max_episode_steps=steps)
        single.reset(seed=7 + i)
        for _ in range(steps):
            last, *_ = single.step(np.array([3.0 * actions[i, 0].item()], dtype=np.float32))
        first_of_next, _ = single.reset()
        np.testing.assert_allclose(info["final_obs"][i].numpy(), last, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(obs[i].numpy(), first_of_next, rtol=1e-6, atol=1e-6)
        single.close()


def test_same_seed_same_episodes_on_hopper():
    def rollout(seed):
        torch.manual_seed(123)
        actions = torch.rand(6, 2, 3) * 2 - 1
        with GymnasiumEnv("Hopper-v5", num_envs=2, seed=seed, max_episode_steps=4) as env:
            trajectory = [env.reset()[0]]
            for action in actions:
                obs, reward, _, _, info = env.step(action)
                trajectory += [obs, reward, info["final_obs"]]
        return trajectory

    first, again, other = rollout(1), rollout(1), rollout(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])


def test_partial_and_grouped_reset():
    with GymnasiumEnv("TestCount-v0", num_envs=4) as env:
        env.reset(seed=0)
        env.step(_act(4, 0.0))
        obs, _ = env.reset(env_ids=torch.tensor([1, 3]))
        assert obs[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]  # only envs 1 and 3 restarted
        obs, _, _, _, info = env.step(_act(4, 0.0))
        assert info["episode"]["length"].tolist() == [2, 1, 2, 1]
        obs, _ = env.reset(group_size=2)
        assert obs[0, 2] == obs[1, 2] and obs[2, 2] == obs[3, 2] and obs[0, 2] != obs[2, 2]
        with pytest.raises(ValueError, match="group_size"):
            env.reset(env_ids=torch.tensor([0, 1, 2]), group_size=2)


def test_bad_spaces_and_ids_are_user_errors():
    with pytest.raises(UserError, match="Dict observation space.*flatten_obs"):
        GymnasiumEnv("TestDictObs-v0", num_envs=1)
    with pytest.raises(UserError, match="could not make"):
        GymnasiumEnv("NoSuchEnv-v9", num_envs=1)
    with pytest.raises(UserError, match="vector"):
        GymnasiumEnv("TestCount-v0", vector="threads")
    with GymnasiumEnv("TestDictObs-v0", num_envs=2, flatten_obs=True) as env:
        obs, _ = env.reset()
        assert obs.shape == (2, 3)


def test_async_vector_env_gives_the_same_numbers_as_sync():
    def rollout(vector):
        with GymnasiumEnv("TestCount-v0", num_envs=2, seed=5, vector=vector) as env:
            out = [env.reset()[0]]
            for value in (0.0, 1.0, 0.0, 0.0, 0.0):
                obs, reward, terminated, truncated, info = env.step(_act(2, value))
                out += [obs, terminated, truncated, info["final_obs"], info["success"]]
            out.append(env.reset(env_ids=torch.tensor([1]))[0])
        return out

    assert all(torch.equal(a, b) for a, b in zip(rollout("sync"), rollout("async")))


def test_render_and_make_through_the_registry():
    import embodied_rl.envs as envs

    make = getattr(envs, "make", None)
    if make is None:
        from embodied_rl.envs.registry import make
    env = make("InvertedPendulum-v5", num_envs=2, backend="gymnasium", seed=0,
               env_kwargs={"width": 48, "height": 32})
    try:
        env.reset()
        frames = env.render(torch.tensor([1]))
        assert frames.shape == (1, 32, 48, 3) and frames.dtype == torch.uint8
        assert frames.float().std() > 0  # not a blank image
    finally:
        env.close()
    with pytest.raises(UserError, match="unknown option"):
        make("InvertedPendulum-v5", backend="gymnasium", colour="red")


def test_a_package_task_runs_through_its_gymnasium_registration():
    from embodied_rl.envs.registry import make

    env = make("reach", num_envs=2, backend="gymnasium", seed=0, max_episode_steps=3)
    try:
        assert env.env_id == "embodied_rl/Reach-v0"
        obs, _ = env.reset()
        assert obs.shape == (2, 8)
        for _ in range(3):
            obs, _, terminated, truncated, info = env.step(torch.zeros(2, 2))
        assert (terminated | truncated).all() and info["_final"].all()
    finally:
        env.close()
