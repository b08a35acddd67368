"""Native MuJoCo backend: threads, zero-copy state views, instability handling, rendering."""

import os

import pytest
import torch

from embodied_rl.envs import make
from embodied_rl.envs.backends.mujoco_cpu import MujocoCpuEnv
from embodied_rl.envs.tasks.reach import ReachTask

os.environ.setdefault("MUJOCO_GL", "egl")


def test_threads_match_single_thread():
    def run(threads):
        env = make("reach", num_envs=5, seed=3, threads=threads)
        obs, _ = env.reset(seed=3)
        out = [obs]
        for t in range(30):
            obs, *_ = env.step(torch.sin(torch.arange(10.0).reshape(5, 2) + t))
            out.append(obs)
        env.close()
        return torch.stack(out)

    assert torch.equal(run(1), run(3))
    assert torch.equal(run(1), run(2))


def test_state_is_a_view_updated_in_place():
    env = make("reach", num_envs=2, threads=1)
    env.reset(seed=0)
    state = env.state
    pointer = state.qpos.data_ptr()
    before = state.qpos.clone()
    env.step(torch.ones(2, 2))
    assert env.state.qpos.data_ptr() == pointer
    assert not torch.equal(state.qpos, before)  # the same tensor object saw the new state
    assert state.qpos.dtype == torch.float64


@pytest.mark.parametrize("poison", ["huge_qvel", "nan_qpos"])
def test_unstable_env_is_reset_and_counted(poison):
    env = make("reach", num_envs=3, threads=1)
    obs, _ = env.reset(seed=0)
    for _ in range(3):
        obs, *_ = env.step(torch.zeros(3, 2))
    last_obs = obs.clone()
    data = env.datas[1]
    if poison == "huge_qvel":
        data.qvel[0] = 1e12
    else:
        data.qpos[0] = float("nan")
    obs, reward, terminated, truncated, info = env.step(torch.zeros(3, 2))
    assert info["unstable"].tolist() == [False, True, False]
    assert env.unstable_resets == 1
    assert truncated.tolist() == [False, True, False] and not terminated.any()
    assert reward[1] == 0 and info["_final"][1] and info["_episode"][1]
    assert torch.equal(info["final_obs"][1], last_obs[1])  # the last finite observation
    assert torch.isfinite(obs).all() and torch.isfinite(env.state.qvel).all()
    assert env.elapsed.tolist() == [4, 0, 4]  # the others go on
    obs, _, _, _, info = env.step(torch.zeros(3, 2))
    assert not info["unstable"].any() and env.unstable_resets == 1


class PoisonedReach(ReachTask):
    """reach whose first initial states are broken: env 0 a huge qvel, env 1 a NaN qpos (MuJoCo
    resets such a state itself when it is written, so nothing non-finite is left to see)."""

    calls = 0

    def sample_init(self, n, generator, device):
        qpos, qvel = super().sample_init(n, generator, device)
        self.calls += 1
        if self.calls == 1:
            qvel[0, 0] = 1e12
            qpos[1, 0] = float("nan")
        return qpos, qvel


def test_a_state_broken_at_reset_is_unstable_on_the_first_step():
    env = MujocoCpuEnv(PoisonedReach(), num_envs=3, threads=1)
    obs, _ = env.reset(seed=0)
    assert torch.isfinite(obs).all()  # MuJoCo put the broken envs back to the model's qpos0
    obs, reward, terminated, truncated, info = env.step(torch.zeros(3, 2))
    assert info["unstable"].tolist() == [True, True, False]
    assert reward[:2].tolist() == [0.0, 0.0] and truncated.tolist() == [True, True, False]
    assert not terminated.any() and env.unstable_resets == 2
    assert env.elapsed.tolist() == [0, 0, 1]  # reset again, from a good state this time
    _, _, _, _, info = env.step(torch.zeros(3, 2))
    assert not info["unstable"].any() and env.unstable_resets == 2


def test_render_and_pixel_observations():
    env = make("reach", num_envs=3, threads=1, obs_mode="pixels", image_size=32, render_size=48)
    obs, _ = env.reset(seed=0)
    assert obs["state"].shape == (3, 8) and obs["state"].dtype == torch.float32
    assert obs["pixels"].shape == (3, 32, 32, 3) and obs["pixels"].dtype == torch.uint8
    assert env.single_observation_space["pixels"].shape == (32, 32, 3)
    obs, _, _, _, info = env.step(torch.zeros(3, 2))
    assert obs["pixels"].shape == (3, 32, 32, 3) and info["final_obs"]["pixels"].shape == (3, 32, 32, 3)
    frames = env.render(torch.tensor([0, 2]))
    assert frames.shape == (2, 48, 48, 3) and frames.dtype == torch.uint8
    assert frames.float().std() > 0  # not a blank image
    assert env.render().shape == (3, 48, 48, 3)
    # different target positions give different images
    assert not torch.equal(frames[0], frames[1])
    env.close()
