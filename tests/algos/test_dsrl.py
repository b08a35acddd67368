"""DSRL / DSRL-NA: the noise VecEnv, sampler calls per step, the noise bound, frozen base weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodied_rl import envs
from embodied_rl.actors.latent_noise import LatentNoiseVecEnv, LayerNormSACPolicy, NoiseActorAgent
from embodied_rl.algos.dsrl import DSRL, make_dsrl
from embodied_rl.data.normalizer import Normalizer
from embodied_rl.policies import make_policy
from tests.algos.test_finetune_loop import DSRL as TINY_DSRL
from tests.test_finetune_cli import TINY, checkpoints  # noqa: F401  (a module fixture)


def tiny_policy(obs_dim: int = 8, action_dim: int = 2, seed: int = 0, task: str | None = None):
    torch.manual_seed(seed)
    normalizer = Normalizer.empty_like({"obs": obs_dim, "action": action_dim})
    policy = make_policy(
        "flow", obs_dim=obs_dim, action_dim=action_dim, normalizer=normalizer, n_obs_steps=2,
        horizon=4, n_action_steps=2, num_inference_steps=2, backbone_kwargs={"hidden_dim": 16, "num_blocks": 1},
        task=task,
    )
    return policy.eval().requires_grad_(False)


class CountingPolicy:
    """Wraps a ChunkPolicy and counts runs of its sampler (`sample`, which predict_chunk runs) and
    the noises it saw."""

    def __init__(self, policy):
        self.policy = policy
        self.calls = 0
        self.max_abs_noise = 0.0

    def sample(self, cond, noise):
        self.calls += 1
        self.max_abs_noise = max(self.max_abs_noise, float(noise.detach().abs().max()))
        return self.policy.sample(cond, noise)

    def predict_chunk(self, obs, noise=None, generator=None):
        if noise is None:
            noise = self.policy.initial_noise(len(self.policy.encode_obs(obs)), generator)
        return self.policy.unnormalize_action(self.sample(self.policy.encode_obs(obs), noise))

    def __getattr__(self, name):
        return getattr(self.policy, name)


def algo_cfg(name: str = "dsrl", **overrides):
    """The shipped dsrl / dsrl_na config at a tiny size, with `overrides`."""
    from embodied_rl.algos.dsrl import DSRLConfig
    from embodied_rl.config import compose

    values = dict(lr=1e-3, buffer_size=10_000, batch_size=32, tau=0.01, utd_ratio=0.5, ent_coef="auto",
                  target_entropy="auto", hidden_sizes="[16,16]", warmup_env_steps=0, critic_only_steps=0)
    values.update(overrides)
    cfg = compose("finetune", [f"algo={name}", *(f"algo.{key}={value}" for key, value in values.items())])
    return DSRLConfig.from_cfg(cfg.algo)


def make_vec_env(policy, num_envs: int = 4, noise_bound: float = 1.5):
    env = envs.make("reach", num_envs=num_envs, seed=0)
    return LatentNoiseVecEnv(env, policy, noise_bound=noise_bound, seed=0)


def test_vec_env_spaces_and_sb3_semantics():
    policy = tiny_policy()
    vec_env = make_vec_env(policy, noise_bound=1.2)
    assert vec_env.action_space.shape == (4 * 2,)
    assert np.allclose(vec_env.action_space.high, 1.2)
    obs = vec_env.reset()
    assert obs.shape == (4, 8) and obs.dtype == np.float32
    saw_done = False
    for _ in range(40):  # reach: 50 steps per episode, 2 executed actions per VecEnv step
        obs, reward, done, infos = vec_env.step(np.zeros((4, 8), np.float32))
        assert reward.shape == (4,) and done.shape == (4,)
        for i in np.flatnonzero(done):
            saw_done = True
            assert infos[i]["terminal_observation"].shape == (8,)
            assert "TimeLimit.truncated" in infos[i]
    assert saw_done
    assert vec_env.env_steps == 40 * 2 * 4 or vec_env.env_steps < 40 * 2 * 4  # chunks cut short at episode ends


@pytest.mark.parametrize("bootstrap", [True, False])
def test_time_limit_is_a_truncation_only_with_bootstrap(bootstrap):
    env = envs.make("reach", num_envs=4, seed=0)
    vec_env = LatentNoiseVecEnv(env, tiny_policy(), noise_bound=1.5, seed=0, bootstrap_truncation=bootstrap)
    vec_env.reset()
    timeouts = 0
    for _ in range(30):  # reach: 50 steps per episode, 2 executed actions per VecEnv step
        _, _, done, infos = vec_env.step(np.zeros((4, 8), np.float32))
        for i in np.flatnonzero(done):
            if not infos[i]["success"]:  # reach ends early only on success: this one ran out of time
                timeouts += 1
                assert infos[i]["TimeLimit.truncated"] is bootstrap
    assert timeouts > 0


@pytest.mark.parametrize("eval_noise", ["sample", "mean"])
def test_evaluation_agent_samples_or_takes_the_mean_of_the_noise_actor(eval_noise):
    from embodied_rl.algos.dsrl import noise_agent_factory

    policy = tiny_policy()
    model = make_dsrl(algo_cfg(eval_noise=eval_noise), make_vec_env(policy), seed=0)
    agent = noise_agent_factory(model, policy, algo_cfg(eval_noise=eval_noise))(4)
    obs = torch.randn(4, 8)
    first, second = agent.noise(obs), agent.noise(obs)
    assert first.shape == (4, 4, 2) and float(first.abs().max()) <= 1.5
    assert torch.equal(first, second) == (eval_noise == "mean")


def test_sparse_reward_is_the_chunk_success():
    env = envs.make("reach", num_envs=4, seed=0)
    vec_env = LatentNoiseVecEnv(env, tiny_policy(), noise_bound=1.5, seed=0, sparse_reward=True)
    vec_env.reset()
    for _ in range(30):
        _, reward, _, infos = vec_env.step(np.zeros((4, 8), np.float32))
        assert np.array_equal(reward, np.array([float(info["success"]) for info in infos], np.float32))


def test_each_env_step_denoises_exactly_once():
    counting = CountingPolicy(tiny_policy())
    vec_env = make_vec_env(counting)
    model = make_dsrl(algo_cfg(warmup_env_steps=16), vec_env, seed=0)
    model.learn(total_timesteps=4 * 12)  # 12 VecEnv steps: warm-up, then full SAC updates
    assert model.noise_env.sampler_calls == 12
    assert counting.calls == 12  # SB3's SAC update never runs the sampler: one call per step


@pytest.mark.parametrize("variant, extra", [("dsrl", {}), ("dsrl_na", {}),
                                            ("dsrl_na", {"actor_q": "noise_critic", "value_expectile": "null"})])
def test_noise_bound_honoured_and_base_weights_frozen(variant, extra):
    base = tiny_policy()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    counting = CountingPolicy(base)
    vec_env = make_vec_env(counting, noise_bound=0.5)
    model = make_dsrl(algo_cfg(variant, noise_bound=0.5, warmup_env_steps=8, critic_only_steps=8, **extra), vec_env,
                      seed=0)
    model.learn(total_timesteps=4 * 10)
    assert counting.max_abs_noise <= 0.5 + 1e-6
    assert model.replay_buffer.actions.max() <= 1.0 + 1e-6  # SB3 stores actions scaled by the bound
    for key, value in base.state_dict().items():
        assert torch.equal(value, before[key]), key
    if variant == "dsrl_na":
        assert counting.calls > model.noise_env.sampler_calls  # NA re-runs the sampler in its update
        assert ("train/noise_critic_loss" in model.stats) == (extra.get("actor_q") == "noise_critic")


def test_dsrl_na_actor_on_action_critic_through_the_base_sampler():
    """actor_q=action_critic: the noise actor ascends Q_A of the chunk the frozen base makes of its noise;
    Q_W is never trained, the base stays frozen, and the actor's gradient reaches it only through the sampler."""
    base = tiny_policy()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    vec_env = make_vec_env(base)
    model = make_dsrl(algo_cfg("dsrl_na", actor_q="action_critic"), vec_env, seed=0)
    noise_critic = [p.clone() for p in model.critic.parameters()]
    actor = [p.clone() for p in model.actor.parameters()]
    model.learn(total_timesteps=4 * 6)
    assert all(torch.equal(a, b) for a, b in zip(noise_critic, model.critic.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(actor, model.actor.parameters()))
    assert "train/noise_critic_loss" not in model.stats and "train/actor_loss" in model.stats
    for key, value in base.state_dict().items():
        assert torch.equal(value, before[key]), key
    # the gradient of Q_A(s, pi_base(s, w)) with respect to the noise w is not zero: the sampler is differentiable
    data, extra = model.replay_buffer.sample_with_extras(8)
    noise = torch.zeros_like(data.actions, requires_grad=True)
    q = model.action_critic.members(data.observations, model._base_chunk(extra["cond"], noise)).sum()
    q.backward()
    assert noise.grad.abs().sum() > 0


def test_dsrl_na_policy_delay_steps_the_actor_once_per_that_many_critic_steps():
    """policy_delay=k: the action critics take every gradient step, the noise actor (and the entropy
    coefficient) one in k, counted across train() calls."""
    model = make_dsrl(algo_cfg("dsrl_na", utd_ratio=1, policy_delay=3), make_vec_env(tiny_policy()), seed=0)
    model.learn(total_timesteps=4 * 2)  # fills the replay
    actor_steps = 0
    step_actor = model.actor.optimizer.step

    def counting_step(*args, **kwargs):
        nonlocal actor_steps
        actor_steps += 1
        return step_actor(*args, **kwargs)

    model.actor.optimizer.step = counting_step
    critic_before = [p.clone() for p in model.action_critic.parameters()]
    start = model._n_updates
    for _ in range(3):
        model.train(gradient_steps=4, batch_size=8)
    assert model._n_updates == start + 12
    assert actor_steps == len([s for s in range(start, start + 12) if s % 3 == 0])
    assert not all(torch.equal(a, b) for a, b in zip(critic_before, model.action_critic.parameters()))


@pytest.mark.parametrize("reduction", ["min", "mean"])
def test_dsrl_na_critic_reduction_is_the_value_targets_and_best_of_n_read(tmp_path, reduction):
    """critic_reduction: the Q_A ensemble's one value is its members' min or mean, in the model, its
    target copy, and the evaluation agent an agent checkpoint rebuilds."""
    from embodied_rl.actors import load_agent, save_agent
    from embodied_rl.actors.latent_noise import AGENT_KIND
    from embodied_rl.algos.dsrl import _agent_config, _agent_tensors

    policy = tiny_policy()
    algo = algo_cfg("dsrl_na", action_critics=3, critic_reduction=reduction, eval_candidates=2)
    vec_env = make_vec_env(policy)
    model = make_dsrl(algo, vec_env, seed=0)
    obs, executed = torch.randn(5, 8), torch.randn(5, policy.n_action_steps * policy.action_dim)
    members = model.action_critic.members(obs, executed)
    assert members.shape == (5, 3) and members.std(1).min() > 0  # the members differ
    expected = members.min(1, keepdim=True)[0] if reduction == "min" else members.mean(1, keepdim=True)
    assert torch.allclose(model.action_critic.value(obs, executed), expected)
    assert model.action_critic_target.reduction == reduction
    save_agent(tmp_path / "agent", AGENT_KIND, _agent_config(algo, vec_env), _agent_tensors(model, algo), policy)
    agent = load_agent(tmp_path / "agent", num_envs=4)
    assert torch.allclose(agent.action_critic.value(obs, executed), expected, atol=1e-6)


@pytest.mark.parametrize("variant", ["dsrl", "dsrl_na"])
def test_actor_lr_is_the_noise_actors_rate_through_training(variant):
    """actor_lr: the noise actor's optimizer runs at it, the critics at lr, also after SB3's SAC.train
    (plain DSRL), which resets every optimizer to its one schedule."""
    model = make_dsrl(algo_cfg(variant, lr=3e-4, actor_lr=1e-4), make_vec_env(tiny_policy()), seed=0)
    model.learn(total_timesteps=4 * 3)
    model.train(gradient_steps=2, batch_size=8)
    assert [g["lr"] for g in model.actor.optimizer.param_groups] == [1e-4]
    critic = model.action_critic_optimizer if variant == "dsrl_na" else model.critic.optimizer
    assert [g["lr"] for g in critic.param_groups] == [3e-4]


def test_dsrl_na_rollout_candidates_execute_the_noise_its_action_critics_value_most():
    """rollout_candidates=N: after the warm-up each env executes, of N noises the actor samples, the
    one whose chunk (the base policy on the env's history) the Q_A ensemble's minimum values most."""
    policy = tiny_policy()
    vec_env = make_vec_env(policy, num_envs=3)
    model = make_dsrl(algo_cfg("dsrl_na", rollout_candidates=5), vec_env, seed=0)
    model._last_obs = vec_env.reset()
    candidates = torch.rand(3 * 5, model.action_space.shape[0]) * 2 - 1  # 5 per env, env after env
    model.actor.forward = lambda obs, deterministic=False: candidates
    env_noise, buffer_noise = model._sample_action(0, None, 3)
    obs = torch.as_tensor(model._last_obs).repeat_interleave(5, dim=0)
    cond = policy.encode_obs(vec_env.history.get()).repeat_interleave(5, dim=0)
    with torch.no_grad():
        q = model.action_critic.value(obs, model._base_chunk(cond, candidates)).reshape(3, 5)
    assert len(set(q.argmax(1).tolist())) > 1 or q.std() > 0  # the critics tell the candidates apart
    best = candidates.reshape(3, 5, -1)[torch.arange(3), q.argmax(1)].numpy()
    assert np.allclose(buffer_noise, best) and np.allclose(env_noise, best * 1.5)  # the env's box is [-1.5, 1.5]
    # the warm-up still acts with the base policy's own noise
    model = make_dsrl(algo_cfg("dsrl_na", rollout_candidates=5, warmup_env_steps=100), vec_env, seed=0)
    model.actor.forward = lambda obs, deterministic=False: candidates
    env_noise, _ = model._sample_action(0, None, 3)
    assert not any(np.allclose(row, c * 1.5) for row in env_noise for c in candidates.numpy())


def test_dsrl_na_value_expectile_is_the_expectile_of_the_replayed_chunks():
    """value_expectile: V(s) converges to the expectile of the replayed chunks' Q_A, and Q_A's target
    reads V(s'), clamped to [0, 1] under the success reward; V is in the learner's state."""
    from embodied_rl.algos.dsrl import _Learner

    vec_env = LatentNoiseVecEnv(envs.make("reach", num_envs=4, seed=0), tiny_policy(), seed=0, sparse_reward=True)
    model = make_dsrl(algo_cfg("dsrl_na", value_expectile=0.9, actor_q="action_critic"), vec_env, seed=0)
    model.learn(total_timesteps=4 * 6)
    assert "train/value_loss" in model.stats
    data, extra = model.replay_buffer.sample_with_extras(4)
    obs = data.observations[:1].repeat(64, 1)
    q = torch.linspace(0.0, 1.0, 64)
    model.action_critic_target.value = lambda o, a: q.reshape(-1, 1)  # Q_A of the 64 "replayed chunks" of one state
    model.value_optimizer = torch.optim.Adam(model.value_net.parameters(), lr=1e-2)
    for _ in range(1500):
        model._train_value(type(data)(obs, *data[1:]), extra)
    expected = 0.9 ** 0.5 / (0.9 ** 0.5 + 0.1 ** 0.5)  # the tau-expectile of U[0, 1]: 0.75 at tau 0.9
    value = model.value_net(obs[:1]).item()
    assert q.mean().item() + 0.1 < value and abs(value - expected) < 0.06
    state = _Learner(model).state_dict()
    assert "value_net" in state


def test_layer_norm_policy_has_layer_norms():
    policy = tiny_policy()
    vec_env = make_vec_env(policy)
    model = make_dsrl(algo_cfg(), vec_env, seed=0)
    assert isinstance(model, DSRL) and isinstance(model.policy, LayerNormSACPolicy)
    actor_norms = [m for m in model.actor.latent_pi if isinstance(m, torch.nn.LayerNorm)]
    critic_norms = [m for m in model.critic.qf0 if isinstance(m, torch.nn.LayerNorm)]
    assert len(actor_norms) == 2 and len(critic_norms) == 2
    assert len(list(model.critic.parameters())) == len(list(model.critic_target.parameters()))


def test_wsrl_stages_keep_actor_fixed_until_full_phase():
    policy = tiny_policy()
    vec_env = make_vec_env(policy)
    model = make_dsrl(algo_cfg(warmup_env_steps=24, critic_only_steps=24), vec_env, seed=0)
    actor_before = [p.clone() for p in model.actor.parameters()]
    critic_before = [p.clone() for p in model.critic.parameters()]
    model.learn(total_timesteps=4 * 5)  # 5 steps x 4 envs x 2 actions = 40 env steps < 48
    assert vec_env.env_steps <= 48
    assert all(torch.equal(a, b) for a, b in zip(actor_before, model.actor.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(critic_before, model.critic.parameters()))
    model.learn(total_timesteps=4 * 4, reset_num_timesteps=False)
    assert not all(torch.equal(a, b) for a, b in zip(actor_before, model.actor.parameters()))


def test_noise_actor_agent_replans_per_env():
    counting = CountingPolicy(tiny_policy())
    vec_env = make_vec_env(counting)
    model = make_dsrl(algo_cfg(), vec_env, seed=0)
    from embodied_rl.algos.dsrl import noise_agent_factory

    agent = noise_agent_factory(model, counting, algo_cfg())(4)
    assert isinstance(agent, NoiseActorAgent)
    obs = torch.randn(4, 8)
    agent.reset(torch.ones(4, dtype=torch.bool))
    a1 = agent.act(obs)
    a2 = agent.act(obs)
    assert a1.shape == (4, 2) and counting.calls == 1  # one chunk serves n_action_steps=2 steps
    agent.act(obs)
    assert counting.calls == 2
    agent.reset(torch.tensor([True, False, False, False]))
    agent.act(obs)  # env 0 replans on its own (others still hold one queued action)
    assert counting.calls == 3
    assert torch.isfinite(a2).all()


def test_vec_env_state_dict_continues_exactly():
    policy = tiny_policy()
    noises = torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(0)).numpy()
    vec_env = make_vec_env(policy)
    vec_env.reset()
    for noise in noises[:3]:
        vec_env.step(noise)
    env_state, state = vec_env.env.get_state(), vec_env.state_dict()
    expected = [vec_env.step(noise) for noise in noises[3:]]
    resumed = make_vec_env(policy)
    resumed.env.set_state(env_state)
    resumed.load_state_dict(state)
    for noise, (obs, reward, done, infos) in zip(noises[3:], expected):
        obs2, reward2, done2, infos2 = resumed.step(noise)
        assert np.array_equal(obs, obs2) and np.array_equal(reward, reward2) and np.array_equal(done, done2)
        assert all(np.array_equal(a["base_cond"], b["base_cond"]) for a, b in zip(infos, infos2))
    assert resumed.env_steps == vec_env.env_steps and resumed.sampler_calls == vec_env.sampler_calls


def test_saved_agent_keeps_its_activation_and_evaluation_noise(tmp_path):
    """agent.json carries `activation` and `eval_noise`; `load_agent` rebuilds the same noise actor and
    evaluates as the run did (checkpoints without the keys: ReLU and the mean, tests/fixtures)."""
    from embodied_rl.actors import load_agent, save_agent
    from embodied_rl.actors.base import head_input
    from embodied_rl.actors.latent_noise import AGENT_KIND
    from embodied_rl.algos.dsrl import _agent_config

    policy = tiny_policy()
    algo = algo_cfg(activation="tanh", eval_noise="sample")
    vec_env = make_vec_env(policy)
    model = make_dsrl(algo, vec_env, seed=0)
    save_agent(tmp_path / "agent", AGENT_KIND, _agent_config(algo, vec_env), model.policy.state_dict(), policy)
    agent = load_agent(tmp_path / "agent", num_envs=4)
    assert not agent.deterministic
    assert any(isinstance(m, torch.nn.Tanh) for m in agent.actor.modules())
    assert not any(isinstance(m, torch.nn.ReLU) for m in agent.actor.modules())
    features = head_input(policy, torch.randn(4, 8))
    expected = model.actor(features, deterministic=True)
    assert torch.allclose(agent.actor(features, deterministic=True) / 1.5, expected, atol=1e-6)


@pytest.mark.parametrize("variant", ["dsrl", "dsrl_na"])
@pytest.mark.parametrize("clip", ["auto", False])
def test_bootstrapped_q_stays_in_the_success_rewards_range(variant, clip):
    """Under the success reward no return leaves [0, 1]: the target critics' outputs (what every TD
    target bootstraps from) are clamped there, the critics themselves are not."""
    env = envs.make("reach", num_envs=4, seed=0)
    vec_env = LatentNoiseVecEnv(env, tiny_policy(), noise_bound=1.5, seed=0, sparse_reward=True)
    model = make_dsrl(algo_cfg(variant, clip_target_q=clip), vec_env, seed=0)
    obs = torch.randn(16, 8)
    noise = torch.rand(16, 8) * 2 - 1
    with torch.no_grad():
        for q in [*model.critic_target.q_networks, *getattr(model, "action_critic_target", [])]:
            q[-1].bias.fill_(5.0)  # a target network that overestimates
        targets = torch.cat(model.critic_target(obs, noise), dim=1)
    assert (targets == 1.0).all() if clip == "auto" else (targets > 1.0).all()
    if variant == "dsrl_na":
        action_q = model.action_critic_target.members(obs, torch.randn(16, 4))
        assert (action_q == 1.0).all() if clip == "auto" else (action_q > 1.0).all()


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("warm_up", [[], ["algo.warmup_env_steps=0", "algo.critic_only_steps=0"]], ids=["warm-up", "none"])
def test_a_pipelined_learner_trains_on_the_replay_so_far_while_the_envs_step_in_a_thread(
        pipeline, warm_up, checkpoints, tmp_path, monkeypatch):  # noqa: F811
    """algo.pipeline: the update made while the k+1-th chunk is in flight (stepped in the envs' thread)
    has seen k transitions and its phase counts their env steps, so none is made during the first;
    serially the update after the k-th chunk has seen k, stepped in the main thread."""
    import threading

    from embodied_rl.cli import main

    seen, stepped_in = [], []
    train, step_wait = DSRL.train, LatentNoiseVecEnv.step_wait

    def recording_train(self, gradient_steps, batch_size=64, env_steps=None):
        seen.append((self.replay_buffer.pos, self.noise_env.env_steps if env_steps is None else env_steps))
        return train(self, gradient_steps, batch_size, env_steps)

    def recording_step_wait(self):
        stepped_in.append(threading.current_thread().name.split("_")[0])
        return step_wait(self)

    monkeypatch.setattr(DSRL, "train", recording_train)
    monkeypatch.setattr(LatentNoiseVecEnv, "step_wait", recording_step_wait)
    assert main(["finetune", "algo=dsrl_na", f"checkpoint={checkpoints / 'flow'}", "env_steps=64", "eval_every=0",
                 f"run_dir={tmp_path / 'run'}", f"algo.pipeline={str(pipeline).lower()}", *TINY_DSRL, *TINY[:-1],
                 *warm_up]) == 0
    chunks = len(stepped_in)
    per_chunk = 64 // chunks  # env steps per VecEnv step (every env runs the whole chunk)
    updates = chunks - 1 if pipeline else chunks
    assert chunks >= 4 and seen == [(k, k * per_chunk) for k in range(1, updates + 1)]
    assert set(stepped_in) == ({"dsrl-envs"} if pipeline else {"MainThread"})
