"""Backend `mujoco_warp` on Warp's CPU device: the same tasks as the CPU backend, same numbers.

Warp compiles its kernels on first use (cached in ~/.cache/warp), so the first test of a cold
machine takes longer; the envs stay tiny (N <= 3, a few steps).
"""

import math

import pytest
import torch

pytest.importorskip("mujoco_warp")

from embodied_rl.envs.registry import make  # noqa: E402
from embodied_rl.errors import UserError  # noqa: E402


def _pair(task, n, seed=0):
    return (make(task, num_envs=n, backend="mujoco_warp", device="cpu", seed=seed),
            make(task, num_envs=n, backend="mujoco", device="cpu", seed=seed))


def test_reach_matches_the_cpu_backend():
    # No contacts: the two differ by float32 rounding only. Positions are ~0.1 m and float32's
    # relative precision is 6e-8, so one step's rounding is ~1e-8; 1e-5 leaves room for the
    # 40 substeps of growth while still catching any real difference (a wrong sensor, a missed
    # substep or a stale ctrl moves the fingertip by millimetres).
    warp_env, cpu_env = _pair("reach", 3)
    obs_w, _ = warp_env.reset(seed=0)
    obs_c, _ = cpu_env.reset(seed=0)
    assert torch.equal(obs_w, obs_c)  # initial sensors from float32-exact sampled states
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        action = torch.rand(3, 2, generator=generator) * 2 - 1
        obs_w, reward_w, term_w, trunc_w, info_w = warp_env.step(action)
        obs_c, reward_c, term_c, trunc_c, info_c = cpu_env.step(action)
        assert obs_w.dtype == torch.float32
        torch.testing.assert_close(obs_w, obs_c, atol=1e-5, rtol=0)
        torch.testing.assert_close(reward_w, reward_c, atol=1e-4, rtol=0)  # 10 x distance
        assert torch.equal(term_w, term_c) and torch.equal(trunc_w, trunc_c)
        assert torch.equal(info_w["success"], info_c["success"])
    cpu_env.close()


@pytest.mark.slow
def test_push_t_matches_the_cpu_backend_through_contacts():
    # The pusher drives into the block: contact solving (iterative, float32 in Warp, float64 in
    # MuJoCo) amplifies rounding, measured at ~4e-4 after 10 steps (100 substeps). 2e-3 (2 mm,
    # a tenth of the success tolerance) still fails for a missing contact or a wrong substep count.
    warp_env, cpu_env = _pair("push_t", 2)
    obs_w, _ = warp_env.reset(seed=0)
    obs_c, _ = cpu_env.reset(seed=0)
    torch.testing.assert_close(obs_w, obs_c, atol=1e-6, rtol=0)
    start_block = obs_c[:, 2:4].clone()
    for _ in range(10):
        # aim through the block centre so that the pusher hits it within a few steps
        action = cpu_env.task.target_to_action(2 * obs_c[:, 2:4] - obs_c[:, :2])
        obs_w, reward_w, term_w, trunc_w, _ = warp_env.step(action)
        obs_c, reward_c, term_c, trunc_c, _ = cpu_env.step(action)
        torch.testing.assert_close(obs_w, obs_c, atol=2e-3, rtol=0)
        torch.testing.assert_close(reward_w, reward_c, atol=0.05, rtol=0)  # coverage on a grid
        assert torch.equal(term_w, term_c) and torch.equal(trunc_w, trunc_c)
    assert (obs_c[:, 2:4] - start_block).norm(dim=1).min() > 0.01  # the block was pushed
    cpu_env.close()


def test_state_views_share_memory_and_resets_are_masked_and_seeded():
    env = make("reach", num_envs=3, backend="mujoco_warp", device="cpu", seed=4)
    state = env.state
    for view in (state.qpos, state.qvel, state.sensordata, state.ctrl):
        assert view.dtype == torch.float32 and view.shape[0] == 3
    state.qvel[2, 0] = 0.125  # zero-copy: a torch write is a Warp write
    assert env.wp_data.qvel.numpy()[2, 0] == 0.125

    first, _ = env.reset(seed=4)
    action = torch.full((3, 2), 0.5)
    env.step(action)
    after_step, *_ = env.step(action)
    obs, _ = env.reset(env_ids=torch.tensor([1]))
    assert torch.equal(obs[[0, 2]], after_step[[0, 2]])  # only env 1 was reset
    assert not torch.equal(obs[1], after_step[1])
    assert state.ctrl[1].abs().sum() == 0  # reset clears ctrl

    again, _ = env.reset(seed=4)  # the same seed gives the same episodes
    assert torch.equal(again, first)
    # resetting env 1 recomputes every world (forward): env 0's trajectory must not notice
    plain = [env.step(action)[0][0] for _ in range(3)]
    env.reset(seed=4)
    env.step(action)
    env.reset(env_ids=torch.tensor([1]))
    with_reset = [env.step(action)[0][0] for _ in range(2)]
    torch.testing.assert_close(with_reset, plain[1:], atol=1e-6, rtol=0)
    grouped, _ = env.reset(env_ids=torch.tensor([0, 1]), group_size=2)
    assert torch.equal(grouped[0], grouped[1])


def test_non_finite_state_resets_that_env_only():
    env = make("reach", num_envs=2, backend="mujoco_warp", device="cpu", seed=0)
    env.reset(seed=0)
    before, *_ = env.step(torch.zeros(2, 2))
    env.state.qvel[1, 0] = math.nan
    obs, reward, terminated, truncated, info = env.step(torch.zeros(2, 2))
    assert info["unstable"].tolist() == [False, True]
    assert truncated.tolist() == [False, True] and not terminated.any()
    assert env.unstable_resets == 1
    assert torch.isfinite(obs).all() and torch.isfinite(env.state.qpos).all()
    assert torch.equal(info["final_obs"][1], before[1])  # the last finite observation
    assert reward[1] == 0


def test_a_non_finite_initial_state_is_unstable_on_the_first_step():
    from embodied_rl.envs.backends.mujoco_warp import MujocoWarpEnv
    from embodied_rl.envs.tasks.reach import ReachTask

    class NanReach(ReachTask):
        def sample_init(self, n, generator, device):
            qpos, qvel = super().sample_init(n, generator, device)
            qpos[0, 0] = math.nan  # the first reset env of every reset
            return qpos, qvel

    env = MujocoWarpEnv(NanReach(), num_envs=2, device="cpu")
    obs, _ = env.reset(seed=0)
    assert torch.isfinite(obs).all()  # put back to the reference pose, at rest
    _, reward, terminated, truncated, info = env.step(torch.zeros(2, 2))
    assert info["unstable"].tolist() == [True, False] and env.unstable_resets == 1
    assert reward[0] == 0 and truncated.tolist() == [True, False] and not terminated.any()


def test_render_matches_the_cpu_backend_and_options_are_checked():
    warp_env, cpu_env = _pair("reach", 2, seed=3)
    warp_env.reset(seed=3)
    cpu_env.reset(seed=3)
    frames_w = warp_env.render(torch.tensor([1]))
    frames_c = cpu_env.render(torch.tensor([1]))
    assert frames_w.shape == (1, 256, 256, 3) and frames_w.dtype == torch.uint8
    assert frames_w.float().std() > 0
    # same state up to float32 rounding: at most a few edge pixels differ
    assert (frames_w.float() - frames_c.float()).abs().mean() < 1.0
    cpu_env.close()
    warp_env.close()
    with pytest.raises(UserError, match="cuda_graph"):
        make("reach", num_envs=1, backend="mujoco_warp", device="cpu", cuda_graph=True)
