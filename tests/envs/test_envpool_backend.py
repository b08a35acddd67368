"""backend=envpool: the BatchedEnv contract over EnvPool, checked against EnvPool called directly,
and the Meta-World tasks, suites and experts on it."""

from __future__ import annotations

import mujoco  # noqa: F401  (EnvPool's renderer needs mujoco imported before envpool)
import numpy as np
import pytest
import torch

import embodied_rl.envs as envs
from embodied_rl.errors import UserError
from embodied_rl.paths import config_dir

pytest.importorskip("envpool")


def direct_pool(env_id: str, seeds: list[int], **config):
    import envpool

    return envpool.make(env_id, env_type="gymnasium", num_envs=len(seeds), batch_size=len(seeds),
                        seed=seeds[0], env_seed=seeds, **config)


def test_hopper_matches_envpool_called_directly():
    env = envs.make("Hopper-v5", num_envs=3, backend="envpool", seed=7)
    pool = direct_pool("Hopper-v5", [7, 8, 9])
    obs, _ = env.reset()
    expected, _ = pool.reset()
    assert obs.dtype == torch.float32 and obs.shape == (3, 11)
    torch.testing.assert_close(obs, torch.from_numpy(expected).float())
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):  # before any episode ends, the two step the same envs with the same actions
        action = torch.rand(3, 3, generator=generator) * 2 - 1
        obs, reward, terminated, truncated, _ = env.step(action)
        expected, expected_reward, *_ = pool.step(action.double().numpy())
        torch.testing.assert_close(obs, torch.from_numpy(expected).float())
        torch.testing.assert_close(reward, torch.from_numpy(expected_reward).float())
    env.close()
    pool.close()


def test_same_step_auto_reset_and_time_limit():
    env = envs.make("Hopper-v5", num_envs=2, backend="envpool", seed=0, task_options={"max_episode_steps": 4})
    obs, _ = env.reset()
    for _ in range(4):
        before = obs.clone()
        obs, reward, terminated, truncated, info = env.step(torch.zeros(2, 3))
    assert truncated.all() and not terminated.any()  # the time limit, apart from termination
    assert info["_final"].all() and info["_episode"].all()
    assert (info["episode"]["length"] == 4).all()
    # final_obs is the last observation of the finished episode, obs the first of the next one
    assert not torch.equal(info["final_obs"], obs)
    assert torch.allclose(info["final_obs"], before, atol=0.1)
    obs, reward, terminated, truncated, info = env.step(torch.zeros(2, 3))
    assert not (terminated | truncated).any() and reward.abs().sum() > 0  # a real step, not a reset step
    env.close()


@pytest.mark.slow
def test_seeds_partial_and_grouped_resets():
    env = envs.make("metaworld/reach", num_envs=4, seed=3)
    first, _ = env.reset(seed=11)
    again, _ = env.reset(seed=11)
    assert torch.equal(first["state"], again["state"])  # a seed fixes every env's start
    goals = first["state"][:, -3:]
    assert len({tuple(g.tolist()) for g in goals}) == 4  # each env its own seed
    env.step(torch.zeros(4, 4))
    moved, _ = env.reset(env_ids=torch.tensor([1]))  # only env 1 starts a new episode
    assert not torch.equal(moved["state"][1, -3:], goals[1])
    torch.testing.assert_close(moved["state"][[0, 2, 3], -3:], goals[[0, 2, 3]])
    grouped, _ = env.reset(group_size=2)
    assert torch.equal(grouped["state"][0], grouped["state"][1])
    assert torch.equal(grouped["state"][2], grouped["state"][3])
    assert not torch.equal(grouped["state"][0], grouped["state"][2])
    with pytest.raises(ValueError, match="take no env_ids"):
        env.reset(seed=1, env_ids=torch.tensor([0]))
    frames = env.render([0, 3])
    assert frames.shape == (2, 256, 256, 3) and frames.dtype == torch.uint8 and frames.float().std() > 0
    env.close()


def test_grouped_resets_keep_the_pools_and_draw_each_groups_next_state():
    # GRPO resets in groups every iteration; remaking the pools each time leaked memory (MT50).
    env = envs.make("metaworld/reach", num_envs=4, seed=3)
    first, _ = env.reset(group_size=2)
    pools = list(env._pools)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        env.step(torch.rand(4, 4, generator=generator) * 2 - 1)
    env.reset(env_ids=torch.tensor([0, 0, 3]).unique())  # envs 0 and 3 ended early: they are a draw ahead
    env.step(torch.rand(4, 4, generator=generator) * 2 - 1)
    second, _ = env.reset(group_size=2)
    assert all(a is b for a, b in zip(env._pools, pools))  # no remake
    state = second["state"]
    assert torch.equal(state[0], state[1]) and torch.equal(state[2], state[3])
    assert not torch.equal(state[:, -3:], first["state"][:, -3:])  # each group's next draw
    # the same state a fresh pool seeded with the group's seed gives at that draw (its third: 0 and 3 drew twice)
    seed = int(env.generator.initial_seed())
    groups = torch.randint(0, 2**31 - 1, (2,), generator=torch.Generator().manual_seed(seed)).tolist()
    pool = direct_pool("MetaWorld/Reach-v3", [groups[0]], partially_observable=False)
    for _ in range(3):
        expected, _ = pool.reset()
    torch.testing.assert_close(state[0], torch.from_numpy(expected[0]).float())
    pool.close()
    reseeded, _ = env.reset(group_size=2, seed=5)  # a seed still remakes them
    assert not any(a is b for a, b in zip(env._pools, pools))
    assert torch.equal(reseeded["state"][0], reseeded["state"][1])
    env.close()


def test_metaworld_expert_success_ends_the_episode():
    env = envs.make("metaworld/reach", num_envs=2, seed=0)
    expert = envs.make_expert("metaworld/reach", env)
    obs, _ = env.reset()
    assert env.instructions == ["reach the goal position with the gripper"]
    assert obs["instruction"].tolist() == [0, 0]
    done = torch.zeros(2, dtype=torch.bool)
    for _ in range(200):
        obs, reward, terminated, truncated, info = env.step(expert.act(obs))
        assert torch.equal(terminated, info["success"])  # Meta-World's flag ends the episode here
        done |= info["_episode"] & info["episode"]["success_once"]
        if done.all():
            break
    assert done.all()
    env.close()


def test_mt10_splits_envs_across_its_tasks():
    env = envs.make("metaworld/MT10", num_envs=20, seed=0)
    obs, _ = env.reset()
    assert len(env.instructions) == 10 and env.instructions[2] == "pick up the puck and place it at the goal"
    assert obs["instruction"].tolist() == [k // 2 for k in range(20)]  # env i runs task i // 2
    obs, *_ = env.step(torch.zeros(20, 4))
    assert obs["state"].shape == (20, 39)
    env.close()
    with pytest.raises(UserError, match="multiple of the 10 tasks"):
        envs.make("metaworld/MT10", num_envs=15)


@pytest.mark.parametrize("call, message", [
    (lambda: envs.make("metaworld/reach", backend="mujoco"), "runs on backend envpool"),
    (lambda: envs.make("push_t", backend="envpool"), "runs on backend mujoco"),
    (lambda: envs.make("metaworld/no-such-task"), "unknown task 'metaworld/no-such-task'"),
    (lambda: envs.make("NoSuchEnv-v0", backend="envpool"), "EnvPool has no env"),
    (lambda: envs.make("metaworld/reach", obs_mode="pixels"), "obs_mode='state' only"),
    (lambda: envs.make("metaworld/reach", num_threads=-1), "num_threads"),
])
def test_bad_requests_are_one_line_errors(call, message):
    with pytest.raises(UserError, match=message):
        call()


def test_task_config_keys_are_checked():
    from omegaconf import OmegaConf

    config = OmegaConf.load(config_dir() / "task" / "metaworld" / "pick-place.yaml")
    assert envs.task_overrides(config) == {}
    config.instructions = ["something else"]
    with pytest.raises(UserError, match="task.instructions"):
        envs.task_overrides(config)
    config = OmegaConf.load(config_dir() / "task" / "metaworld" / "pick-place.yaml")
    config.max_episode_steps = 50
    assert envs.task_overrides(config) == {"max_episode_steps": 50}
    env = envs.make("metaworld/pick-place", num_envs=1, task_options={"max_episode_steps": 50})
    assert env.max_episode_steps == 50
    env.close()
    assert np.isfinite(envs.registry.task_class("metaworld/MT50").obs_dim)


def test_a_group_may_not_straddle_two_suite_tasks():
    env = envs.make("metaworld/MT10", num_envs=20, seed=0)  # two envs per task
    with pytest.raises(UserError, match="group_size=4 must divide the envs per task: 20 envs over 10 tasks give 2 "
                                        r"each \(choose num_envs a multiple of 40\)"):
        env.reset(group_size=4)
    grouped, _ = env.reset(group_size=2)
    assert torch.equal(grouped["state"][0], grouped["state"][1])
    env.close()
