"""Actors: the importance ratio is exactly 1 before any update, shapes, DPPO's clip schedule,
the residual actor's zero start and per-env queue reset, save/load through load_agent."""

import math

import pytest
import torch

from embodied_rl.actors import ActorAgent, load_agent, make_actor
from embodied_rl.errors import UserError
from embodied_rl.policies import make_policy

OBS_DIM, ACTION_DIM = 3, 2


def tiny_policy(policy_type: str, steps: int = 4):
    torch.manual_seed(0)
    return make_policy(
        policy_type, obs_dim=OBS_DIM, action_dim=ACTION_DIM, n_obs_steps=2, horizon=6,
        n_action_steps=3, num_inference_steps=steps,
        backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8), task="reach",
    )


def obs_for(actor, n=5):
    return torch.randn(n, 2, OBS_DIM) if actor.chunked else torch.randn(n, OBS_DIM)


CASES = [
    ("residual", "diffusion", 4), ("dppo", "diffusion", 4), ("dppo", "diffusion", 1),
    ("flow_noise", "flow", 1), ("flow_noise", "flow", 4), ("flow_noise", "shortcut", 2),
    ("flow_sde", "flow", 4), ("flow_sde", "shortcut", 1), ("flow_sde", "diffusion", 3),
    ("residual_chunk", "flow", 2), ("latent_noise", "diffusion", 2), ("latent_noise", "flow", 2),
]


@pytest.mark.parametrize("kind,policy_type,steps", CASES)
def test_ratio_is_exactly_one_before_an_update(kind, policy_type, steps):
    actor = make_actor(kind, tiny_policy(policy_type, steps), num_envs=5)
    obs = obs_for(actor)
    out = actor.act(obs)
    logprob, entropy = actor.evaluate(obs, out.stash)
    assert torch.equal(logprob, out.logprob)
    assert torch.isfinite(logprob).all() and torch.isfinite(entropy).all()
    assert logprob.shape == (5, actor.num_logprob_positions) == entropy.shape
    expected = (5, 3, ACTION_DIM) if actor.chunked else (5, ACTION_DIM)
    assert out.actions.shape == expected and out.value.shape == (5,)
    assert out.actions.abs().max() <= 1.0
    # gradients reach the trainable parameters and never the frozen base policy
    logprob.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in actor.actor_parameters())
    assert all(p.grad is None for p in actor.policy.parameters())


def test_dppo_fine_tunes_only_the_last_steps_and_clip_schedule_is_safe_at_one_step():
    policy = tiny_policy("diffusion", 4)
    one = make_actor("dppo", policy, 1, ft_denoising_steps=1)
    assert one.clip_coefs(0.2) == [0.2]  # no 0/0 when a single step is fine-tuned
    assert all(math.isfinite(c) for c in one.clip_coefs(0.2))
    three = make_actor("dppo", policy, 1, ft_denoising_steps=3, clip_base=0.01, denoising_discount=0.5)
    coefs = three.clip_coefs(0.2)
    assert coefs[0] == pytest.approx(0.01) and coefs[-1] == pytest.approx(0.2) and coefs[0] < coefs[1] < coefs[2]
    assert three.advantage_weights().tolist() == [0.25, 0.5, 1.0]
    out = three.act(torch.randn(2, 2, OBS_DIM))
    assert out.stash["chain"].shape == (2, 4, 6, ACTION_DIM) and out.logprob.shape == (2, 3)
    with pytest.raises(ValueError, match="ft_denoising_steps"):
        make_actor("dppo", policy, 1, ft_denoising_steps=5)


def test_chain_actors_start_at_the_base_policy():
    policy = tiny_policy("flow", 4)
    obs = torch.randn(3, 2, OBS_DIM)
    for kind in ("dppo", "flow_noise", "flow_sde"):
        actor = make_actor(kind, policy, 3)
        out = actor.act(obs)
        assert torch.allclose(actor.base_kl(obs, out.stash), torch.zeros(3), atol=1e-6)
        torch.manual_seed(1)
        deterministic = actor.act(obs, deterministic=True).actions
        torch.manual_seed(1)
        base = policy.predict_chunk(obs)[:, 1:4]
        assert torch.allclose(deterministic, base, atol=1e-5)


def test_flow_noise_std_stays_in_its_bounds():
    actor = make_actor("flow_noise", tiny_policy("flow", 2), 1, min_std=0.05, max_std=0.2)
    with torch.no_grad():
        for p in actor.noise_net.parameters():
            p.mul_(100.0)
    x = torch.randn(7, 6, ACTION_DIM) * 10
    std = actor.noise_std(x, 0, actor.encode(torch.randn(7, 2, OBS_DIM)))
    assert std.min() >= 0.05 - 1e-6 and std.max() <= 0.2 + 1e-6


def test_flow_sde_noise_follows_pi_rls_schedule_and_sum_bounds_the_chunk():
    policy = tiny_policy("flow", 4)
    actor = make_actor("flow_sde", policy, 5, noise_level=0.5, logprob_reduce="mean")
    # sigma_i = a sqrt((1 - t_i) / t_i), t_0 read as dt (std sigma_0 sqrt(dt) = a), shrinking to the data
    assert actor.step_levels == pytest.approx([0.5 * 2, 0.5 * math.sqrt(3), 0.5, 0.5 * math.sqrt(1 / 3)])
    diffusion = make_actor("flow_sde", tiny_policy("diffusion", 3), 5, noise_level=0.5)
    assert diffusion.step_levels == [0.5, 0.5, 0.5]  # DDIM's eta schedules its own noise
    summed = make_actor("flow_sde", policy, 5, noise_level=0.5, logprob_reduce="sum")
    obs = torch.randn(5, 2, OBS_DIM)
    out = summed.act(obs)
    assert torch.equal(summed.evaluate(obs, out.stash)[0], out.logprob)  # ratio 1 before an update
    mean_logprob = actor.evaluate(obs, out.stash)[0]  # same weights: the mean over the 3 x 2 executed entries
    assert torch.allclose(out.logprob, mean_logprob * 3 * ACTION_DIM, atol=1e-5)
    with pytest.raises(ValueError, match="logprob_reduce"):
        make_actor("flow_sde", policy, 5, logprob_reduce="max")


@pytest.mark.parametrize("kind", ["flow_noise", "flow_sde"])
def test_logprob_reduce_sets_the_likelihood_columns_and_their_scale(kind):
    policy = tiny_policy("flow", 4)
    obs = torch.randn(5, 2, OBS_DIM)
    actors = {reduce: make_actor(kind, policy, 5, logprob_reduce=reduce) for reduce in ("mean", "sum", "none")}
    for actor in actors.values():  # one set of weights: copies of the same base policy
        actor.load_state_dict(actors["mean"].state_dict())
    out = actors["none"].act(obs)
    per_entry, entropy = actors["none"].evaluate(obs, out.stash)
    assert actors["none"].num_logprob_positions == 3 * ACTION_DIM  # Ta x A executed entries
    assert per_entry.shape == entropy.shape == (5, 3 * ACTION_DIM) and torch.equal(per_entry, out.logprob)
    assert torch.allclose(actors["sum"].evaluate(obs, out.stash)[0], per_entry.sum(-1, keepdim=True), atol=1e-5)
    assert torch.allclose(actors["mean"].evaluate(obs, out.stash)[0], per_entry.mean(-1, keepdim=True), atol=1e-6)


def test_residual_starts_as_the_base_and_resets_the_base_queue_per_env():
    actor = make_actor("residual", tiny_policy("diffusion", 2), num_envs=3, action_scale=0.1)
    obs = torch.randn(3, OBS_DIM)
    out = actor.act(obs, deterministic=True)
    assert torch.equal(out.actions, out.stash["base_action"].clamp(-1, 1))  # zero-initialised mean
    runner = actor.runner
    assert runner.next_index.tolist() == [1, 1, 1]
    actor.reset(torch.tensor([False, True, False]))
    assert runner.next_index.tolist() == [1, 3, 1]  # env 1 replans: no queue leaks across episodes
    actor.act(obs)
    assert runner.next_index.tolist() == [2, 1, 2]


def test_residual_chunk_critic_sees_the_queue_and_bootstraps_before_a_draw():
    actor = make_actor("residual", tiny_policy("flow", 2), num_envs=2, chunk_critic=True)  # chunks of 3 steps
    obs = torch.randn(2, OBS_DIM)
    out = actor.act(obs)
    assert torch.equal(actor.evaluate(obs, out.stash)[0], out.logprob)  # ratio 1 before an update
    queue = actor.runner.queue
    state = out.stash["chunk_state"]  # first step of a chunk: the whole chunk, position one-hot [1, 0, 0]
    assert torch.equal(state[:, :6], queue.flatten(1)) and state[:, 6:].tolist() == [[1, 0, 0]] * 2
    assert torch.allclose(out.value, actor.critic.with_chunk(obs, state))
    # mid-chunk, the next state's value sees what is still queued (current first, zero-padded)
    next_obs = torch.randn(2, OBS_DIM)
    ahead = torch.cat([queue[:, 1:], torch.zeros(2, 1, ACTION_DIM)], 1).flatten(1)
    expected = actor.critic.with_chunk(next_obs, torch.cat([ahead, torch.tensor([[0.0, 1, 0]] * 2)], -1))
    assert torch.allclose(actor.next_value(next_obs), expected)
    # env 1's episode ended: its next step draws a new chunk, so it bootstraps from V0(obs)
    actor.reset(torch.tensor([False, True]))
    value = actor.next_value(next_obs)
    assert torch.allclose(value[0], expected[0]) and torch.allclose(value[1], actor.critic(next_obs)[1])
    # value loss: V(o, q) on every state, V0 only on the states right after a draw
    second = actor.act(next_obs).stash  # env 0 at position 1, env 1 drew anew (position 0)
    returns, valid = torch.ones(2), torch.ones(2, dtype=torch.bool)
    for drawn, stash in ((True, out.stash), (False, {k: v[:1] for k, v in second.items()})):
        n = len(stash["chunk_state"])
        actor.zero_grad()
        actor.value_loss(obs[:n], stash, torch.zeros(n), returns[:n], valid[:n], None).backward()
        v0_grad = sum(float(p.grad.abs().sum()) for p in actor.critic.net.parameters() if p.grad is not None)
        assert (v0_grad > 0) == drawn
        assert all(p.grad.abs().sum() > 0 for p in actor.critic.chunk_net.parameters())


def test_residual_scale_per_action_dim():
    policy = tiny_policy("flow", 2)
    scale = [0.1] * (ACTION_DIM - 1) + [1.0]
    for kind, obs in (("residual", torch.randn(3, OBS_DIM)), ("residual_chunk", torch.randn(3, 2, OBS_DIM))):
        actor = make_actor(kind, policy, 3, action_scale=scale)
        out = actor.act(obs)
        step = (out.actions - out.stash["base_action"]).reshape(3, -1, ACTION_DIM)
        residual = out.stash["residual"].reshape(3, -1, ACTION_DIM)
        inside = out.actions.abs().reshape(3, -1, ACTION_DIM) < 1  # not clamped
        assert torch.allclose(step[inside], (residual * torch.tensor(scale))[inside], atol=1e-6)
        assert "action_scale" not in actor.state_dict()  # rebuilt from the config, not saved
    with pytest.raises(UserError, match="one per action dim"):
        make_actor("residual", policy, 3, action_scale=[0.1] * (ACTION_DIM + 1))


def test_residual_chunk_and_latent_noise_start_at_the_base_policy():
    policy = tiny_policy("flow", 2)
    obs = torch.randn(3, 2, OBS_DIM)
    residual = make_actor("residual_chunk", policy, 3)
    out = residual.act(obs, deterministic=True)
    assert torch.equal(out.actions, out.stash["base_action"].clamp(-1, 1))  # zero-initialised mean
    latent = make_actor("latent_noise", policy, 3)
    torch.manual_seed(1)
    actions = latent.act(obs).actions
    torch.manual_seed(1)
    base = policy.predict_chunk(obs)[:, 1:4]  # the same N(0, I) draw: the BC policy's own sample
    assert torch.allclose(actions, base, atol=1e-5)
    assert torch.allclose(latent.base_kl(obs, {}), torch.zeros(3), atol=1e-5)


@pytest.mark.parametrize("kind,policy_type", [("residual", "flow"), ("flow_noise", "flow"), ("dppo", "diffusion"),
                                              ("residual_chunk", "flow"), ("latent_noise", "flow")])
def test_save_and_load_agent_acts_like_the_actor(kind, policy_type, tmp_path):
    actor = make_actor(kind, tiny_policy(policy_type, 2), num_envs=2)
    with torch.no_grad():
        for p in actor.actor_parameters():
            p.add_(0.01)
    actor.save(tmp_path)
    agent = load_agent(tmp_path, num_envs=2)
    reference = ActorAgent(actor.for_eval(2), 2, deterministic=True)
    obs = torch.randn(2, OBS_DIM)
    for _ in range(4):
        torch.manual_seed(3)
        a = reference.act(obs)
        torch.manual_seed(3)
        b = agent.act(obs)
        assert torch.allclose(a, b, atol=1e-6)
        obs = obs + 0.1


def test_load_agent_of_a_bc_checkpoint_is_a_policy_runner(tmp_path):
    from embodied_rl.policies import PolicyRunner, save_policy

    save_policy(tiny_policy("flow", 2), tmp_path / "bc")
    assert isinstance(load_agent(tmp_path / "bc", num_envs=2), PolicyRunner)


def test_load_agent_rejects_a_foreign_loader(tmp_path):
    from embodied_rl.errors import UserError

    (tmp_path / "agent.json").write_text('{"loader": "os:system"}')
    with pytest.raises(UserError, match="loader"):
        load_agent(tmp_path, num_envs=1)


def test_residual_runtime_state_resumes_the_base_queue():
    policy = tiny_policy("flow", 2)
    actor = make_actor("residual", policy, num_envs=2)
    obs = torch.randn(5, 2, OBS_DIM)
    actor.act(obs[0], deterministic=True)
    state = actor.runtime_state()
    expected = [actor.act(o, deterministic=True).stash["base_action"] for o in obs[1:]]
    resumed = make_actor("residual", policy, num_envs=2)
    resumed.load_runtime_state(state)
    for o, base in zip(obs[1:], expected):
        assert torch.equal(resumed.act(o, deterministic=True).stash["base_action"], base)
