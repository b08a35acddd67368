"""The hopper task reproduces gymnasium's Hopper-v5 physics step for step (RK4 is not split)."""

import gymnasium as gym
import numpy as np
import torch

import embodied_rl.envs as envs


def test_hopper_matches_gymnasium_hopper_v5():
    env = envs.make("hopper", num_envs=1, seed=0)
    env.reset(seed=0)
    reference = gym.make("Hopper-v5")
    reference.reset(seed=0)
    reference.unwrapped.set_state(env.state.qpos[0].double().numpy(), env.state.qvel[0].double().numpy())
    rng = np.random.default_rng(0)
    for _ in range(10):
        action = rng.uniform(-1, 1, size=3).astype(np.float32)
        env.step(torch.from_numpy(action)[None])
        reference.step(action)
        np.testing.assert_allclose(env.state.qpos[0].double().numpy(), reference.unwrapped.data.qpos, atol=1e-6)
        np.testing.assert_allclose(env.state.qvel[0].double().numpy(), reference.unwrapped.data.qvel, atol=1e-5)
