"""Residual off-policy RL (ResFiT): n-step returns, random-pair targets, queues, demos, the loop."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from embodied_rl import envs
from embodied_rl.actors import load_agent, load_agent_tensors
from embodied_rl.actors.checkpoint import with_prefix
from embodied_rl.actors.residual_offpolicy import ResidualAgent, ResidualPolicyNet
from embodied_rl.algos.offpolicy import demo_transitions, random_min
from embodied_rl.algos.residual_offpolicy import (
    ResidualOffPolicyConfig,
    ResidualOffPolicyLearner,
    finetune,
    nstep_returns,
)
from embodied_rl.config import compose
from embodied_rl.data.dataset import DemoDataset, write_demos
from embodied_rl.policies import PolicyRunner
from embodied_rl.runs import Run
from tests.algos.test_dsrl import CountingPolicy, tiny_policy

G = 0.9


def test_nstep_returns_truncation_and_termination():
    # 3 envs, n = 3. env 0: no episode end; env 1: truncated at step 1; env 2: terminated at step 0
    rewards = torch.tensor([[1.0, 1.0, 5.0], [2.0, 2.0, 7.0], [4.0, 4.0, 9.0]])
    terminated = torch.tensor([[False, False, True], [False, False, False], [False, False, False]])
    truncated = torch.tensor([[False, False, False], [False, True, False], [False, False, False]])
    ret, discount, last = nstep_returns(rewards, terminated, truncated, G)
    assert torch.allclose(ret, torch.tensor([1 + G * 2 + G * G * 4, 1 + G * 2, 5.0]))
    # truncation bootstraps (from final_obs of step 1) with gamma^2; termination does not bootstrap
    assert torch.allclose(discount, torch.tensor([G**3, G**2, 0.0]))
    assert last.tolist() == [2, 1, 0]


def test_nstep_returns_ignore_the_next_episode():
    # an episode ends at step 0; the rewards of the next episode (steps 1, 2) must not leak in
    rewards = torch.tensor([[1.0], [100.0], [100.0]])
    truncated = torch.tensor([[True], [False], [False]])
    ret, discount, last = nstep_returns(rewards, torch.zeros_like(truncated), truncated, G)
    assert ret.item() == pytest.approx(1.0) and discount.item() == pytest.approx(G) and last.item() == 0


def test_random_minimum_over_a_subset_of_critics():
    q = torch.stack([torch.full((5,), float(i)) for i in range(10)])  # critic i predicts i
    pair_values, single_values = set(), set()
    for seed in range(50):
        out = random_min(q, 2, torch.Generator().manual_seed(seed))
        value = out[0].item()
        assert torch.all(out == value)  # one pair for the whole batch
        pair_values.add(value)
        assert value < 9  # the min of two distinct critics is never the largest one
        single_values.add(random_min(q, 1, torch.Generator().manual_seed(seed))[0].item())
    assert len(pair_values) > 3  # the pair is random, not always the same two critics
    assert 9.0 in single_values and len(single_values) > 5  # size 1: any one critic, no minimum
    # with two critics and size 2 it is the plain minimum; all ten: the minimum of all
    two = torch.tensor([[1.0, 5.0], [3.0, 2.0]])
    assert torch.equal(random_min(two, 2), torch.tensor([1.0, 2.0]))
    assert torch.equal(random_min(q, 10), torch.zeros(5))


def test_residual_actor_starts_at_zero_and_is_bounded():
    actor = ResidualPolicyNet(8, 2, [16, 16], scale=0.3, stochastic=True)
    obs, base = torch.randn(64, 8), torch.randn(64, 2)
    assert torch.equal(actor(obs, base), torch.zeros(64, 2))
    with torch.no_grad():
        actor.trunk[-1].bias.fill_(50.0)
    sampled, log_prob = actor.sample(obs, base)
    assert sampled.abs().max() <= 0.3 + 1e-6 and torch.isfinite(log_prob).all()


def test_a_switched_off_dim_gets_no_residual_noise_or_entropy():
    obs, base = torch.randn(64, 8), torch.randn(64, 2)
    for stochastic in (True, False):
        actor = ResidualPolicyNet(8, 2, [16, 16], scale=0.3, stochastic=stochastic, dims=[1.0, 0.0])
        with torch.no_grad():
            actor.trunk[-1].bias[:2].fill_(1.0)
        sampled, log_prob = actor.sample(obs, base)
        assert (actor(obs, base)[:, 1] == 0).all() and (sampled[:, 1] == 0).all() and (sampled[:, 0] != 0).all()
        if stochastic:  # the log-likelihood is the live dim's alone
            both = ResidualPolicyNet(8, 2, [16, 16], scale=0.3, stochastic=True)
            both.load_state_dict(actor.state_dict())
            torch.manual_seed(0)
            _, one = actor.sample(obs, base)
            torch.manual_seed(0)
            _, two = both.sample(obs, base)
            assert not torch.allclose(one, two)
    with pytest.raises(ValueError, match="residual_dims"):
        ResidualPolicyNet(8, 2, [16], scale=0.3, dims=[1.0])


def test_the_residual_sees_the_base_policys_normalised_observation():
    policy = tiny_policy()
    with torch.no_grad():  # a normaliser that is not the identity, so the test can tell
        policy.normalizer.obs_scale.fill_(10.0)
        policy.normalizer.obs_offset.fill_(-1.0)
    actor = ResidualPolicyNet(8, 2, [16], scale=0.5, stochastic=False)
    seen = []
    actor.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    obs = torch.randn(3, 8)
    for normalize, expected in ((True, obs * 10 - 1), (False, obs)):
        agent = ResidualAgent(actor, policy, 3, normalize_obs=normalize)
        agent.reset(torch.ones(3, dtype=torch.bool))
        agent.act(obs)
        assert torch.allclose(seen[-1], expected)


def test_base_queue_resets_per_env_and_peeks_without_side_effects():
    counting = CountingPolicy(tiny_policy())  # n_action_steps = 2
    queue = PolicyRunner(counting, num_envs=3, seed=0)  # the base policy as residual SAC runs it
    obs = torch.randn(3, 8)
    queue.act(obs)
    assert counting.calls == 1
    queue.act(obs)  # second action of the chunk: no replan
    assert counting.calls == 1
    index = queue.next_index.clone()
    peeked = queue.peek(obs, torch.tensor([True, False, False]))  # queue empty -> one plan
    assert counting.calls == 2 and torch.equal(queue.next_index, index)
    assert peeked[1:].abs().sum() == 0
    queue.reset(torch.tensor([False, True, False]))
    queue.act(obs)  # every queue is empty now: one call plans all three envs
    assert counting.calls == 3
    queue.reset(torch.tensor([False, True, False]))
    queue.act(obs)  # only env 1 was reset mid-chunk: it replans alone
    assert counting.calls == 4 and queue.next_index.tolist() == [2, 1, 2]


def make_demos(path, episodes: int = 3, length: int = 12):
    rng = np.random.default_rng(0)
    eps = [{"obs": rng.standard_normal((length, 8)).astype(np.float32),
            "action": rng.uniform(-1, 1, (length, 2)).astype(np.float32),
            "reward": rng.standard_normal(length).astype(np.float32), "success": i == 0} for i in range(episodes)]
    return write_demos(path, eps, {"task": "reach", "obs_dim": 8, "action_dim": 2})


def test_demo_transitions_relabel_base_actions(tmp_path):
    dataset = DemoDataset.load(make_demos(tmp_path / "demos"))
    policy = tiny_policy()
    demos = demo_transitions(dataset, policy, G, success_terminates=True, device=torch.device("cpu"))
    # episode 0 succeeded (terminal last step kept), episodes 1 and 2 drop their last step
    assert len(demos["obs"]) == 12 + 11 + 11
    assert torch.equal(demos["action"][:12], torch.as_tensor(dataset.action[:12]))
    assert demos["discount"][11] == 0 and demos["discount"][10] == pytest.approx(G)
    assert torch.equal(demos["next_obs"][0], torch.as_tensor(dataset.obs[1]))
    # the base action at step t is the one the queue would execute (chunk replanned every 2 steps)
    history = torch.as_tensor(dataset.obs[[0, 0]])[None]  # t = 0: first obs repeated
    chunk = policy.predict_chunk(history, generator=torch.Generator().manual_seed(0))
    assert demos["base"][0].shape == (2,) and torch.isfinite(demos["base"]).all()
    assert torch.equal(demos["next_base"][0], demos["base"][1])
    assert chunk.shape == (1, 4, 2)


def test_demo_transitions_sparse_reward(tmp_path):
    dataset = DemoDataset.load(make_demos(tmp_path / "demos"))
    demos = demo_transitions(dataset, tiny_policy(), G, success_terminates=True, device=torch.device("cpu"), sparse=True)
    # only the terminal step of the successful episode 0 is rewarded
    assert demos["reward"][11] == 1 and demos["reward"].sum() == 1


def sac_cfg(tmp_path, **algo_overrides):
    """The shipped residual_offpolicy config at a tiny size, with `algo_overrides`."""
    algo = dict(
        residual_scale=0.2, actor_hidden_sizes=[16, 16], critic_hidden_sizes=[16, 16], ensemble=4, tau=0.01,
        actor_lr=1e-3, critic_lr=1e-3, batch_size=32, buffer_size=10_000, exploration_noise=0.1, target_noise=0.2,
        warmup_env_steps=40, critic_only_steps=40, learner="sac",
    )
    algo.update(algo_overrides)
    overrides = ["algo=residual_offpolicy", "task=reach", "env_steps=200", "num_envs=4", "eval_every=100",
                 "eval_episodes=4", "videos=0", "checkpoint_every=100", "log_every=40", f"run_dir={tmp_path / 'run'}"]
    overrides += [f"algo.{key}={json.dumps(value) if isinstance(value, list) else value}" for key, value in algo.items()]
    return compose("finetune", overrides)


def run_finetune(cfg):
    env = envs.make("reach", num_envs=int(cfg.num_envs), seed=int(cfg.seed))
    run = Run(cfg.run_dir, command="finetune", allow_existing=True)
    headline = finetune(cfg, run, env, tiny_policy())
    return headline, run


def last_layer(path):
    actor = with_prefix("actor.", load_agent_tensors(path))
    last = max(int(k.split(".")[1]) for k in actor if k.startswith("trunk."))
    return actor[f"trunk.{last}.weight"]


@pytest.mark.parametrize("actor", ["sac", "td3"])
@pytest.mark.e2e
def test_finetune_end_to_end_with_demos(tmp_path, actor):
    cfg = sac_cfg(tmp_path, learner=actor, demo_fraction=0.5, data=str(make_demos(tmp_path / "demos")),
                  warmup_env_steps=40, critic_only_steps=40)
    headline, run = run_finetune(cfg)
    assert headline["env_steps"] == 200 and 0.0 <= headline["success_rate"] <= 1.0
    path = run.file("checkpoints", "last")
    spec = json.loads((path / "agent.json").read_text())
    assert spec["kind"] == "residual_offpolicy" and spec["config"]["normalize_obs"] is True
    assert last_layer(path).abs().sum() > 0  # the actor did learn in the full phase
    agent = load_agent(path, num_envs=2)
    agent.reset(torch.ones(2, dtype=torch.bool))
    action = agent.act(torch.randn(2, 8))
    assert action.shape == (2, 2) and action.abs().max() <= 1.0
    phases = [row["train/phase"] for row in run.read_metrics() if "train/phase" in row]
    assert phases == sorted(phases) and phases[-1] == 2


@pytest.mark.e2e
def test_a_dim_switched_off_by_residual_dims_gets_no_residual(tmp_path):
    """demos: the dims every demo step holds at one value; a list: the dims it does not name."""
    demos = make_demos(tmp_path / "demos")
    import zarr

    zarr.open_group(str(demos), mode="r+")["data"]["action"][:, 1] = 0.5  # every demo step holds dim 1 at 0.5
    for name, dims, expected in (("demos", "demos", [1.0, 0.0]), ("all", "all", [1.0, 1.0]), ("list", [0], [1.0, 0.0])):
        cfg = sac_cfg(tmp_path / name, learner="td3", data=str(demos), residual_dims=dims, warmup_env_steps=40,
                      critic_only_steps=0)
        _, run = run_finetune(cfg)
        path = run.file("checkpoints", "last")
        assert json.loads((path / "agent.json").read_text())["config"]["residual_dims"] == expected
        agent = load_agent(path, num_envs=64)
        residual = agent.net(torch.randn(64, agent.net.trunk[0].in_features - 2), torch.randn(64, 2))
        assert (residual[:, 1] == 0).all() == (dims != "all") and (residual[:, 0] != 0).any()


def test_wsrl_stages_actor_unchanged_before_full_phase(tmp_path):
    cfg = sac_cfg(tmp_path, warmup_env_steps=80, critic_only_steps=200)  # run ends in critic-only
    _, run = run_finetune(cfg)
    path = run.file("checkpoints", "last")
    assert last_layer(path).abs().sum() == 0  # zero-initialised layer never stepped: no actor update
    rows = [row for row in run.read_metrics() if "train/phase" in row]
    assert any("train/critic_loss" in row for row in rows)
    assert not any("train/actor_loss" in row for row in rows)


@pytest.mark.e2e
def test_resume_continues_from_last_checkpoint(tmp_path):
    cfg = sac_cfg(tmp_path, warmup_env_steps=8, critic_only_steps=8)
    cfg.env_steps = 120
    run_finetune(cfg)
    cfg.env_steps = 200
    headline, run = run_finetune(cfg)
    assert headline["env_steps"] == 200
    counters = json.loads(run.file("checkpoints", "last", "training_state", "counters.json").read_text())
    assert counters["env_steps"] == 200


@pytest.mark.parametrize("actor", ["sac", "td3"])
def test_residual_penalty_keeps_the_residual_small(tmp_path, actor):

    def mean_residual(penalty: float) -> float:
        torch.manual_seed(0)
        algo = sac_cfg(tmp_path, learner=actor, residual_penalty=penalty, policy_delay=1).algo
        learner = ResidualOffPolicyLearner(ResidualOffPolicyConfig.from_cfg(algo), obs_dim=8, action_dim=2, device=torch.device("cpu"), seed=0)
        gen = torch.Generator().manual_seed(0)
        batch = {"obs": torch.randn(32, 8, generator=gen), "base": torch.rand(32, 2, generator=gen) - 0.5,
                 "action": torch.rand(32, 2, generator=gen) - 0.5, "reward": torch.rand(32, generator=gen),
                 "discount": torch.full((32,), 0.9), "next_obs": torch.randn(32, 8, generator=gen),
                 "next_base": torch.rand(32, 2, generator=gen) - 0.5}
        batch["reward"] = batch["action"][:, 0] * 5  # a clear slope: larger first action, more reward
        for _ in range(60):
            learner.update(batch, update_actor=True)
        with torch.no_grad():
            return float(learner.actor(batch["obs"], batch["base"]).abs().mean())

    free, penalised = mean_residual(0.0), mean_residual(100.0)
    assert penalised < 0.5 * free


def test_reward_shaping_adds_potential_based_shaping_and_resumes(tmp_path):
    """algo.reward_shaping: the replay's n-step returns carry the shaping (negative where the
    env reward fell, which a 0/1 success reward never is) and its per-env state is checkpointed."""
    cfg = sac_cfg(tmp_path, learner="td3", reward_shaping=1.0, warmup_env_steps=8, critic_only_steps=8)
    cfg.env_steps = 120
    run_finetune(cfg)
    state_dir = tmp_path / "run" / "checkpoints" / "last" / "training_state"
    loop_state = torch.load(state_dir / "state.pt", weights_only=True)["loop"]
    previous, fresh = loop_state["shaping"]
    assert previous.shape == (4,) and fresh.dtype == torch.bool
    rewards = torch.load(state_dir / "replay.pt", weights_only=True)["online"]["data"]["reward"]
    assert (rewards < 0).any()
    cfg.env_steps = 200
    headline, _ = run_finetune(cfg)
    assert headline["env_steps"] == 200


def test_reward_shaping_needs_the_success_reward(tmp_path):
    from embodied_rl.algos.residual_offpolicy import validate_config
    from embodied_rl.errors import UserError

    with pytest.raises(UserError, match="reward_shaping"):
        validate_config(sac_cfg(tmp_path, reward_shaping=0.1, reward="env"))


def test_a_bad_reward_mode_is_refused_before_any_work(tmp_path):
    from embodied_rl.algos.residual_offpolicy import validate_config
    from embodied_rl.errors import UserError

    with pytest.raises(UserError, match="algo.reward must be env, success or auto"):
        validate_config(sac_cfg(tmp_path, reward="dense"))


def test_actor_q_min_is_the_ensembles_minimum_and_reaches_only_the_actions(tmp_path):
    from embodied_rl.algos.offpolicy import QEnsemble, actor_q
    from embodied_rl.algos.residual_offpolicy import validate_config
    from embodied_rl.errors import UserError

    torch.manual_seed(0)
    critic = QEnsemble(input_dim=5, hidden_sizes=[16], ensemble=3)
    obs, action = torch.randn(7, 3), torch.randn(7, 2, requires_grad=True)
    every = critic(obs, action)
    assert torch.equal(actor_q(critic, obs, action, reduce="min"), every.min(0).values)
    assert torch.allclose(actor_q(critic, obs, action), every.mean(0))
    actor_q(critic, obs, action, reduce="min").sum().backward()
    assert action.grad is not None and action.grad.abs().sum() > 0
    assert all(p.grad is None for p in critic.parameters()) and all(p.requires_grad for p in critic.parameters())

    with pytest.raises(UserError, match="actor_q"):
        validate_config(sac_cfg(tmp_path, actor_q="max"))


@pytest.mark.parametrize("target_min_of", [1, 2])
def test_the_td_target_is_the_minimum_over_target_min_of_critics(tmp_path, monkeypatch, target_min_of):
    from embodied_rl.algos import residual_offpolicy

    algo = ResidualOffPolicyConfig.from_cfg(sac_cfg(tmp_path, learner="td3", target_min_of=target_min_of).algo)
    learner = ResidualOffPolicyLearner(algo, obs_dim=3, action_dim=2, device=torch.device("cpu"), seed=0)

    def constant_targets():  # target critic i predicts i everywhere (again after each update's Polyak step)
        with torch.no_grad():
            for i, q in enumerate(learner.critic_target.critics):
                q[-1].weight.zero_()
                q[-1].bias.fill_(float(i))

    targets = []

    def spy(critic, optimizer, target, *inputs):
        targets.append(target[0].item())
        return critic_step(critic, optimizer, target, *inputs)

    critic_step = residual_offpolicy.critic_step
    monkeypatch.setattr(residual_offpolicy, "critic_step", spy)
    batch = {"obs": torch.randn(8, 3), "base": torch.zeros(8, 2), "action": torch.zeros(8, 2), "reward": torch.zeros(8),
             "discount": torch.ones(8), "next_obs": torch.randn(8, 3), "next_base": torch.zeros(8, 2)}
    for _ in range(40):
        constant_targets()
        learner.update(batch, update_actor=False)
    # ensemble 4: the min of a random pair is never the largest critic (3); one random critic is each of them
    expected = {0.0, 1.0, 2.0, 3.0} if target_min_of == 1 else {0.0, 1.0, 2.0}
    assert {round(t, 4) for t in targets} == expected


def test_target_min_of_beyond_the_ensemble_is_refused(tmp_path):
    from embodied_rl.algos.residual_offpolicy import validate_config
    from embodied_rl.errors import UserError

    with pytest.raises(UserError, match="target_min_of"):
        validate_config(sac_cfg(tmp_path, target_min_of=5))
