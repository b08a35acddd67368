"""The reach task, its scripted expert and its gymnasium registration."""

import os
import subprocess
import sys
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

import embodied_rl
from embodied_rl.envs import make, make_expert

os.environ.setdefault("MUJOCO_GL", "egl")


def expert_success_rate(quality: float, num_envs: int = 32, episodes: int = 64) -> tuple[float, float]:
    env = make("reach", num_envs=num_envs, seed=0, threads=1)
    expert = make_expert("reach", env, quality=quality, generator=torch.Generator().manual_seed(0))
    obs, _ = env.reset(seed=0)
    successes, lengths = [], []
    while len(successes) < episodes:
        obs, _, _, _, info = env.step(expert.act(obs))
        expert.reset(info["_final"])
        done = info["_episode"]
        successes += info["episode"]["success_once"][done].tolist()
        lengths += info["episode"]["length"][done].tolist()
    env.close()
    return float(np.mean(successes)), float(np.mean(lengths))


def test_expert_succeeds_and_quality_degrades_it():
    rate, length = expert_success_rate(1.0)
    assert rate >= 0.95
    low_rate, low_length = expert_success_rate(0.0)
    assert low_length > length  # a low-quality expert is slower (and sometimes fails)
    assert low_rate <= rate


def test_expert_actions_in_range():
    env = make("reach", num_envs=4, threads=1)
    expert = make_expert("reach", env, quality=0.3)
    obs, _ = env.reset(seed=0)
    actions = expert.act(obs)
    assert actions.shape == (4, 2) and actions.dtype == torch.float32
    assert actions.abs().max() <= 1.0


def test_gymnasium_make_and_check_env():
    env = gymnasium.make("embodied_rl/Reach-v0")
    check_env(env.unwrapped, skip_render_check=True)
    obs, info = env.reset(seed=0)
    assert obs.shape == (8,) and obs.dtype == np.float32
    done = False
    steps = 0
    while not done:
        obs, reward, terminated, truncated, info = env.step(np.ones(2, dtype=np.float32))
        steps += 1
        done = terminated or truncated
    assert truncated and steps == 50 and info["is_success"] is False
    env.close()


def test_gymnasium_render():
    env = gymnasium.make("embodied_rl/Reach-v0", render_mode="rgb_array", render_size=32)
    env.reset(seed=0)
    frame = env.render()
    assert frame.shape == (32, 32, 3) and frame.dtype == np.uint8
    env.close()


@pytest.mark.slow
def test_gymnasium_make_without_importing_first():
    code = (
        "import gymnasium; env = gymnasium.make('embodied_rl.envs:embodied_rl/Reach-v0'); "
        "print(env.reset(seed=0)[0].shape)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(embodied_rl.__file__).parents[1])})
    assert result.returncode == 0, result.stderr
    assert "(8,)" in result.stdout
