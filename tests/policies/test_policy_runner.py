"""PolicyRunner (the ChunkExecutor over a ChunkPolicy): obs history, action queue, replanning only
where needed, partial resets, dict observations, state_dict for an exact resume."""

import pytest
import torch

from embodied_rl.errors import UserError
from embodied_rl.policies import PolicyRunner
from embodied_rl.policies.base import ChunkPolicy


class EchoPolicy(ChunkPolicy):
    """chunk[n, h] = 100 * (latest obs of env n) + h; records the histories it was called with."""

    def __init__(self):
        super().__init__(obs_dim=1, action_dim=1, n_obs_steps=2, horizon=6, n_action_steps=3,
                         backbone_kwargs={"hidden_dim": 8, "num_blocks": 1, "time_dim": 8})
        self.calls = []

    def predict_chunk(self, obs, noise=None, generator=None):
        self.calls.append(obs.clone())
        h = torch.arange(self.horizon, dtype=torch.float32)
        return (100 * obs[:, -1, :1] + h)[:, :, None]


def obs_of(values):
    return torch.tensor(values, dtype=torch.float32)[:, None]


def test_history_queue_and_chunk_offset():
    policy = EchoPolicy()
    runner = PolicyRunner(policy, num_envs=2)
    runner.reset()
    a0 = runner.act(obs_of([1, 2]))
    # history filled with the first obs; executed actions start at chunk index To-1 = 1
    assert policy.calls[0][:, :, 0].tolist() == [[1, 1], [2, 2]]
    assert a0[:, 0].tolist() == [101, 201]
    assert runner.act(obs_of([3, 4]))[:, 0].tolist() == [102, 202]
    assert runner.act(obs_of([5, 6]))[:, 0].tolist() == [103, 203]
    assert len(policy.calls) == 1  # n_action_steps=3 actions from one plan
    a3 = runner.act(obs_of([7, 8]))
    assert len(policy.calls) == 2 and policy.calls[1][:, :, 0].tolist() == [[5, 7], [6, 8]]
    assert a3[:, 0].tolist() == [701, 801]


def test_partial_reset_replans_only_that_env():
    policy = EchoPolicy()
    runner = PolicyRunner(policy, num_envs=3)
    runner.reset(torch.ones(3, dtype=torch.bool))
    runner.act(obs_of([1, 2, 3]))
    runner.reset(torch.tensor([False, True, False]))  # env 1's episode ended
    actions = runner.act(obs_of([4, 50, 6]))
    assert len(policy.calls) == 2
    assert policy.calls[1].shape == (1, 2, 1)            # only env 1 was planned for
    assert policy.calls[1][0, :, 0].tolist() == [50, 50]  # its history restarted at the new obs
    assert actions[:, 0].tolist() == [102, 5001, 302]     # others keep their queues
    runner.act(obs_of([7, 51, 9]))
    actions = runner.act(obs_of([10, 52, 12]))             # envs 0 and 2 run out first
    assert policy.calls[2].shape == (2, 2, 1)
    assert policy.calls[2][:, :, 0].tolist() == [[7, 10], [9, 12]]
    assert actions[:, 0].tolist() == [1001, 5003, 1201]
    assert runner.num_replans == 3 + 1 + 2


def test_reset_clears_queue_between_episodes():
    policy = EchoPolicy()
    runner = PolicyRunner(policy, num_envs=1)
    runner.reset()
    runner.act(obs_of([1]))
    runner.reset()  # a new episode must not execute the old plan
    assert runner.act(obs_of([9]))[0, 0].item() == 901
    assert len(policy.calls) == 2


def test_runner_with_real_policy_is_seeded():
    from test_chunk_policies import tiny_policy

    policy = tiny_policy("flow").eval()
    runner = PolicyRunner(policy, num_envs=4, seed=0)
    runner.reset()
    actions = [runner.act(torch.randn(4, 3)) for _ in range(6)]
    assert all(a.shape == (4, 2) for a in actions)
    runner_again = PolicyRunner(policy, num_envs=4, seed=0)
    torch.manual_seed(1)
    obs = torch.randn(4, 3)
    assert torch.equal(PolicyRunner(policy, 4, seed=3).act(obs), PolicyRunner(policy, 4, seed=3).act(obs))
    assert runner_again.act(obs).shape == (4, 2)


class DictEchoPolicy(EchoPolicy):
    """chunk[n, h] = 100 * latest state + latest pixel value + h, for {"state", "pixels"} obs."""

    def predict_chunk(self, obs, noise=None, generator=None):
        self.calls.append({k: v.clone() for k, v in obs.items()})
        h = torch.arange(self.horizon, dtype=torch.float32)
        latest = 100 * obs["state"][:, -1, :1] + obs["pixels"][:, -1, :1, 0, 0]
        return (latest + h)[:, :, None]


def dict_obs(states, pixel):
    n = len(states)
    return {"state": obs_of(states), "pixels": torch.full((n, 2, 2, 3), float(pixel))}


def test_dict_observations_keep_one_history_per_entry():
    policy = DictEchoPolicy()
    runner = PolicyRunner(policy, num_envs=2)
    runner.reset()
    assert runner.act(dict_obs([1, 2], 5))[:, 0].tolist() == [106, 206]
    runner.reset(torch.tensor([True, False]))
    runner.act(dict_obs([3, 4], 7))  # env 0 replans from a restarted history
    call = policy.calls[1]
    assert call["state"][:, :, 0].tolist() == [[3, 3]] and call["pixels"].shape == (1, 2, 2, 2, 3)
    assert runner.history.buffer["pixels"][1, :, 0, 0, 0].tolist() == [5, 7]  # env 1 kept its history
    state = runner.state_dict()
    assert {"history.obs.state", "history.obs.pixels", "queue", "next_index", "fresh", "generator"} == set(state)
    again = PolicyRunner(policy, num_envs=2)
    again.load_state_dict(state)
    assert torch.equal(again.act(dict_obs([8, 9], 1)), runner.act(dict_obs([8, 9], 1)))


def test_state_dict_resumes_exactly():
    from test_chunk_policies import tiny_policy

    policy = tiny_policy("flow").eval()
    obs = torch.randn(12, 4, 3, generator=torch.Generator().manual_seed(0))
    runner = PolicyRunner(policy, num_envs=4, seed=0)
    runner.reset()
    for t in range(5):
        runner.act(obs[t])
    runner.reset(torch.tensor([False, True, False, False]))  # a partial reset before the save
    state = runner.state_dict()
    expected = [runner.act(obs[t]) for t in range(5, 12)]
    resumed = PolicyRunner(policy, num_envs=4, seed=123)  # the generator comes from the state
    resumed.load_state_dict(state)
    assert all(torch.equal(resumed.act(obs[t]), a) for t, a in zip(range(5, 12), expected))


def test_load_state_dict_refuses_a_mismatched_state():
    runner = PolicyRunner(EchoPolicy(), num_envs=2)
    runner.act(obs_of([1, 2]))
    with pytest.raises(UserError, match="queue of shape"):
        PolicyRunner(EchoPolicy(), num_envs=3).load_state_dict(runner.state_dict())
    with pytest.raises(UserError, match="lacks 'generator'"):
        runner.load_state_dict({k: v for k, v in runner.state_dict().items() if k != "generator"})
