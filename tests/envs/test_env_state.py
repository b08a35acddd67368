"""BatchedEnv.get_state / set_state: a snapshot restored into a fresh env continues bit for bit."""

import io

import pytest
import torch

from embodied_rl.envs import make
from embodied_rl.errors import UserError


def saved_and_loaded(state):
    """The snapshot as a checkpoint holds it: torch.save, then torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def rollout(env, actions):
    """Every tensor a step returns, flattened into one list."""
    def tensors(obs):
        return list(obs.values()) if isinstance(obs, dict) else [obs]

    out = []
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        out += [*tensors(obs), reward, terminated, truncated, *tensors(info["final_obs"]), info["success"],
                info["unstable"], info["_final"], *info["episode"].values()]
    return out


def check_continues_exactly(make_env, k, m=12, seed=0):
    """Env A runs k random steps, is snapshotted and runs m more; a fresh env B restored from the
    snapshot runs the same m actions: every returned tensor is equal."""
    env_a = make_env()
    env_a.reset(seed=seed)
    generator = torch.Generator().manual_seed(seed)
    actions = [torch.rand(env_a.num_envs, env_a.action_dim, generator=generator) * 2 - 1 for _ in range(k + m)]
    rollout(env_a, actions[:k])
    state = saved_and_loaded(env_a.get_state())
    assert all(isinstance(value, torch.Tensor) for value in state.values())
    expected = rollout(env_a, actions[k:])

    env_b = make_env()
    env_b.set_state(state)
    got = rollout(env_b, actions[k:])
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    assert env_a.unstable_resets == env_b.unstable_resets
    assert torch.equal(env_a.elapsed, env_b.elapsed)
    assert torch.equal(env_a.generator.get_state(), env_b.generator.get_state())
    env_a.close()
    env_b.close()


# short episodes, so that the continuation auto-resets envs (the generator's state matters);
# k=5 snapshots right after every env was reset, k=7 in the middle of episodes
@pytest.mark.parametrize("k", [5, 7])
@pytest.mark.parametrize("task", ["reach", "push_t", "hopper"])  # contacts; RK4 (hopper)
def test_snapshot_continues_bit_for_bit(task, k):
    check_continues_exactly(lambda: make(task, num_envs=3, threads=1, task_options={"max_episode_steps": 5}), k)


def test_snapshot_of_pixel_observations():
    check_continues_exactly(lambda: make("reach", num_envs=2, threads=1, obs_mode="pixels", image_size=16,
                                         task_options={"max_episode_steps": 4}), k=3, m=5)


def test_snapshot_keeps_an_unstable_env_pending():
    from embodied_rl.envs.backends.mujoco_cpu import MujocoCpuEnv
    from tests.envs.test_mujoco_cpu import PoisonedReach

    env_a = MujocoCpuEnv(PoisonedReach(), num_envs=3, threads=1)
    env_a.reset(seed=0)  # envs 0 and 1 were written broken: their next step is unstable
    state = saved_and_loaded(env_a.get_state())
    env_b = MujocoCpuEnv(PoisonedReach(calls=1), num_envs=3, threads=1)
    env_b.set_state(state)
    actions = [torch.zeros(3, 2)] * 3
    for a, b in zip(rollout(env_a, actions), rollout(env_b, actions)):
        assert torch.equal(a, b)
    assert env_b.unstable_resets == 2


def test_set_state_refuses_another_env():
    env = make("reach", num_envs=2, threads=1)
    env.reset(seed=0)
    state = env.get_state()
    with pytest.raises(UserError, match="holds 2 envs, this env has 3"):
        make("reach", num_envs=3, threads=1).set_state(state)
    with pytest.raises(UserError, match="sim/integration"):
        make("push_t", num_envs=2, threads=1).set_state(state)
    with pytest.raises(UserError, match="missing 'generator'"):
        env.set_state({key: value for key, value in state.items() if key != "generator"})


def test_gymnasium_backend_cannot_snapshot():
    env = make("InvertedPendulum-v5", num_envs=1, backend="gymnasium")
    env.reset(seed=0)
    with pytest.raises(UserError, match="cannot snapshot"):
        env.get_state()
    env.close()


@pytest.mark.slow
def test_warp_snapshot_continues_bit_for_bit():
    pytest.importorskip("mujoco_warp")
    check_continues_exactly(lambda: make("reach", num_envs=3, backend="mujoco_warp", device="cpu",
                                         task_options={"max_episode_steps": 5}), k=7)
