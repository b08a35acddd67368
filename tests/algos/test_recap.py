"""RECAP: n-step advantages, episode cutting, guided sampling, and `embodied-rl finetune algo=recap`
end to end (then eval of its checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch

from embodied_rl.actors.recap import IndicatorEmbedding, RecapAgent, guided_sample
from embodied_rl.algos.recap import (
    RolloutEpisodes,
    discounted_returns,
    draw_windows,
    nstep_advantages,
    positive_indicator,
)
from embodied_rl.cli import main
from embodied_rl.policies import make_policy
from tests.test_finetune_cli import TINY, checkpoints  # noqa: F401  (a module fixture)


def test_discounted_returns_with_a_tail():
    returns = discounted_returns(torch.tensor([1.0, 0.0, 2.0]), 0.5, tail=4.0)
    assert torch.allclose(returns, torch.tensor([1 + 0.5 * (0 + 0.5 * (2 + 0.5 * 4)), 0.5 * (2 + 0.5 * 4), 2 + 0.5 * 4]))


def test_nstep_advantages_by_hand():
    reward, value, gamma = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.5, 1.0, 1.5, 2.0]), 0.9
    # n = 2: A_t = r_t + g r_{t+1} + g^2 V_{t+2} - V_t, the window cut at the end (tail 7)
    expected = torch.tensor([1 + 0.9 * 2 + 0.81 * 1.5 - 0.5, 2 + 0.9 * 3 + 0.81 * 2.0 - 1.0,
                             3 + 0.9 * 4 + 0.81 * 7.0 - 1.5, 4 + 0.9 * 7.0 - 2.0])
    assert torch.allclose(nstep_advantages(reward, value, gamma, 2, tail=7.0), expected)
    # n = 1 is the TD error; n = 0 is Monte-Carlo: the discounted return minus V
    td = reward + gamma * torch.cat([value[1:], torch.tensor([7.0])]) - value
    assert torch.allclose(nstep_advantages(reward, value, gamma, 1, tail=7.0), td)
    mc = discounted_returns(reward, gamma, tail=7.0) - value
    assert torch.allclose(nstep_advantages(reward, value, gamma, 0, tail=7.0), mc)
    assert torch.allclose(nstep_advantages(reward, value, gamma, 10, tail=7.0), mc)


def test_the_positive_indicator_takes_the_top_share_but_never_a_step_below_v():
    # half the steps beat V: the top 30% are positive
    advantages = torch.linspace(-1.0, 1.0, 101)
    positive, threshold = positive_indicator(advantages, 0.3)
    assert threshold == pytest.approx(0.4) and int(positive.sum()) == 30
    # one successful episode (2 steps above V) among failed ones (A = -V = 0 with V clamped to the
    # returns' range [0, 1]): the quota of 30% is not filled with failed steps
    success = nstep_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.6]), 0.9, 0)
    failed = nstep_advantages(torch.zeros(8), torch.tensor([-0.02] * 8).clamp(0.0, 1.0), 0.9, 0)
    positive, threshold = positive_indicator(torch.cat([success, failed]), 0.3)
    assert threshold == 0.0 and positive.tolist() == [True, True] + [False] * 8


def test_negative_windows_are_drawn_by_their_weight():
    positive = torch.tensor([True, False, False, False])
    generator = torch.Generator().manual_seed(0)
    assert set(draw_windows(positive, 200, 0.0, generator).tolist()) == {0}  # filtered BC
    uniform = draw_windows(positive, 4000, 1.0, generator)
    assert abs(float((uniform == 0).float().mean()) - 0.25) < 0.03
    weighted = draw_windows(positive, 4000, 0.5, generator)  # 1 : 3 x 0.5 -> 40% positive
    assert abs(float((weighted == 0).float().mean()) - 0.4) < 0.03


def test_rollout_episodes_are_cut_per_env_across_calls():
    recorder = RolloutEpisodes(2)
    dones = [[False, True], [False, False], [True, False], [False, True]]
    for t, done in enumerate(dones):
        obs = torch.tensor([[10.0 * t], [10.0 * t + 1]])
        recorder.add(obs, torch.zeros(2, 1), torch.tensor([t, -t], dtype=torch.float32), torch.tensor(done),
                     torch.tensor([False, False]), obs + 100)
    episodes = recorder.take_finished()
    assert [e["obs"][:, 0].tolist() for e in episodes] == [[1.0], [0.0, 10.0, 20.0], [11.0, 21.0, 31.0]]
    assert [e["reward"].tolist() for e in episodes] == [[0.0], [0.0, 1.0, 2.0], [-1.0, -2.0, -3.0]]
    assert episodes[1]["final"].tolist() == [120.0]
    assert len(recorder.rows) == 1  # only env 0's running episode (from step 3) is kept


@pytest.fixture
def flow_policy():
    torch.manual_seed(0)
    return make_policy("flow", obs_dim=3, action_dim=2, n_obs_steps=1, horizon=4, n_action_steps=2,
                       num_inference_steps=3, backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8)).eval()


def test_guided_sampling_is_the_bc_policy_before_training_and_mixes_velocities(flow_policy):
    policy = flow_policy
    obs = torch.randn(5, 1, 3)
    cond, noise = policy.encode_obs(obs), torch.randn(5, 4, 2)
    indicator = IndicatorEmbedding(policy.cond_dim)
    offset = indicator(torch.ones(5, dtype=torch.bool))
    with torch.no_grad():
        assert torch.equal(guided_sample(policy, cond, offset, noise, 1.0), policy.sample(cond, noise))
        offset = torch.randn_like(cond)
        assert torch.allclose(guided_sample(policy, cond, offset, noise, 1.0), policy.sample(cond + offset, noise))
        # guidance w: x + dt (v_u + w (v_c - v_u)) at every step
        x, w = noise, 2.5
        for i in range(policy.num_inference_steps):
            t = float(policy.timesteps()[i])
            v_u, v_c = policy.velocity(x, t, cond), policy.velocity(x, t, cond + offset)
            x = x + policy.dt * (v_u + w * (v_c - v_u))
        assert torch.allclose(guided_sample(policy, cond, offset, noise, w), x, atol=1e-6)


def test_a_zero_offset_leaves_the_bc_loss_unchanged(flow_policy):
    batch = {"obs": torch.randn(6, 1, 3), "action": torch.rand(6, 4, 2) * 2 - 1}
    torch.manual_seed(1)
    plain = flow_policy.bc_loss(batch)
    torch.manual_seed(1)
    assert torch.equal(flow_policy.bc_loss({**batch, "cond_offset": torch.zeros(6, flow_policy.cond_dim)}), plain)
    torch.manual_seed(1)
    assert not torch.equal(flow_policy.bc_loss({**batch, "cond_offset": torch.ones(6, flow_policy.cond_dim)}), plain)


def test_the_agent_acts_like_the_bc_runner_before_training(flow_policy):
    from embodied_rl.policies import PolicyRunner

    agent = RecapAgent(flow_policy, IndicatorEmbedding(flow_policy.cond_dim), 3, guidance=1.0, seed=7)
    runner = PolicyRunner(flow_policy, 3, seed=7)
    obs = torch.randn(3, 3)
    assert torch.equal(agent.act(obs), runner.act(obs))


RECAP = ["algo=recap", "algo.rollout_steps=16", "algo.policy_updates=4", "algo.value_updates=4", "algo.batch_size=16"]


@pytest.mark.e2e
def test_finetune_recap_then_eval(checkpoints, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "ft"
    assert main(["finetune", f"checkpoint={checkpoints / 'flow'}", f"run_dir={run_dir}", "env_steps=128",
                 "eval_every=64", *TINY[:-1], *RECAP]) == 0, capsys.readouterr().err
    last = run_dir / "checkpoints" / "last"
    assert json.loads((last / "agent.json").read_text())["kind"] == "recap"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "train/bc_loss" in row]
    assert len(trained) == 2 and all(0 < row["train/positive_fraction"] < 1 for row in trained)
    capsys.readouterr()
    assert main(["eval", "task=reach", f"checkpoint={last}", f"run_dir={tmp_path / 'eval'}", "episodes=4",
                 "num_envs=4", "videos=0"]) == 0
    assert "n_episodes: 4" in capsys.readouterr().out


def test_recap_without_demos_is_refused(tmp_path, capsys):
    from embodied_rl.policies import save_policy

    policy = make_policy("flow", obs_dim=8, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                         num_inference_steps=2, task="reach", backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
    save_policy(policy, tmp_path / "bc")
    assert main(["finetune", f"checkpoint={tmp_path / 'bc'}", f"run_dir={tmp_path / 'ft'}", *TINY[:-1], *RECAP]) == 2
    assert "algo=recap trains on the demonstrations" in capsys.readouterr().err
    assert not (tmp_path / "ft").exists()
    assert main(["finetune", f"checkpoint={tmp_path / 'bc'}", f"run_dir={tmp_path / 'ft'}", *TINY[:-1], *RECAP,
                 "algo.positive_fraction=1.5"]) == 2
    assert "algo.positive_fraction" in capsys.readouterr().err
