"""FPO (actors/fpo.py): the ratio from conditional flow-matching losses is exactly 1 before an
update, moves the right way, and `embodied-rl finetune algo=fpo` runs and evaluates."""

import json

import numpy as np
import pytest
import torch

from embodied_rl.actors.fpo import FPOActor
from embodied_rl.cli import main
from embodied_rl.errors import UserError
from embodied_rl.policies import make_policy, save_policy


def tiny(policy_type="flow"):
    torch.manual_seed(0)
    return make_policy(policy_type, obs_dim=3, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                       num_inference_steps=2, backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))


def test_the_ratio_is_one_before_an_update():
    actor = FPOActor(tiny(), num_samples=4, ratio="chunk", action_noise=0.0)
    obs = torch.randn(6, 2, 3)
    out = actor.act(obs)
    assert out.actions.shape == (6, 2, 2) and out.logprob.shape == (6, 1)
    logprob, entropy = actor.evaluate(obs, out.stash)
    assert torch.equal(logprob, out.logprob) and not entropy.any()
    # the minibatch the PPO loop evaluates is a subset: the same values row by row
    rows = torch.tensor([4, 1])
    sub, _ = actor.evaluate(obs[rows], {k: v[rows] for k, v in out.stash.items()})
    assert torch.allclose(sub, out.logprob[rows], atol=1e-6)


def test_the_loss_is_the_flow_matching_error_of_the_executed_steps():
    actor = FPOActor(tiny(), num_samples=3, ratio="chunk", action_noise=0.0)
    obs = torch.randn(2, 2, 3)
    stash = actor.act(obs).stash
    cond = actor.encode(obs)
    losses = actor.cfm_losses(cond, stash)
    # by hand for sample 1, pair 2: x_t = (1 - t) eps + t a, target a - eps, executed steps 1..2
    a, t, eps = stash["chunk"][1], stash["t"][1, 2], stash["eps"][1, 2]
    v = actor.ft.velocity(((1 - t) * eps + t * a)[None], t[None], cond[1:2])[0]
    expected = ((v - (a - eps)) ** 2)[1:3].sum(-1).mean()
    assert losses.shape == (2, 3) and torch.allclose(losses[1, 2], expected, atol=1e-6)


def test_a_step_on_the_surrogate_raises_the_ratio_of_a_positive_advantage():
    actor = FPOActor(tiny(), num_samples=8, ratio="chunk", action_noise=0.0)
    obs = torch.randn(16, 2, 3)
    out = actor.act(obs)
    optimizer = torch.optim.SGD(actor.actor_parameters(), lr=0.05)
    advantage = torch.ones(16)
    logprob, _ = actor.evaluate(obs, out.stash)
    (-(logprob[:, 0] - out.logprob[:, 0]).exp() * advantage).mean().backward()
    optimizer.step()
    with torch.no_grad():
        new, _ = actor.evaluate(obs, out.stash)
    assert float((new - out.logprob).exp().mean()) > 1.0  # lower flow-matching loss on these chunks


def test_extra_action_noise_is_stored_and_keeps_the_ratio_at_one():
    obs = torch.randn(5, 2, 3)
    plain = FPOActor(tiny(), num_samples=2, ratio="chunk", action_noise=0.0).act(obs)  # tiny() seeds: both actors draw the same initial noise
    actor = FPOActor(tiny(), num_samples=2, ratio="chunk", action_noise=0.3)
    noisy = actor.act(obs)
    assert not torch.allclose(noisy.stash["chunk"], plain.stash["chunk"])
    assert noisy.stash["chunk"].abs().max() <= 1.0
    assert torch.equal(actor.evaluate(obs, noisy.stash)[0], noisy.logprob)


def test_per_sample_ratios_are_one_column_per_pair_and_average_to_the_chunk_surrogate():
    obs = torch.randn(6, 2, 3)
    actor = FPOActor(tiny(), num_samples=4, ratio="per_sample", action_noise=0.0)
    out = actor.act(obs)
    assert out.logprob.shape == (6, 4) and actor.num_logprob_positions == 4
    assert torch.equal(actor.evaluate(obs, out.stash)[0], out.logprob)  # every ratio is 1 before an update
    # the columns are -l(a; t_k, eps_k); their mean is the chunk ratio's log-prob on the same stash
    chunk_actor = FPOActor(tiny(), num_samples=4, ratio="chunk", action_noise=0.0)
    assert torch.allclose(chunk_actor.evaluate(obs, out.stash)[0], out.logprob.mean(1, keepdim=True), atol=1e-6)
    assert actor.clip_coefs(0.05) == [0.05] * 4 and torch.equal(actor.advantage_weights(), torch.ones(4))
    assert actor.act(obs, deterministic=True).logprob.shape == (6, 4)
    with pytest.raises(UserError, match="ratio must be one of chunk, per_sample"):
        FPOActor(tiny(), ratio="token")


@pytest.mark.parametrize("policy_type", ["diffusion", "shortcut"])
def test_fpo_needs_a_flow_policy(policy_type):
    with pytest.raises(UserError, match=f"needs a flow policy .* got {policy_type}"):
        FPOActor(tiny(policy_type))
    with pytest.raises(UserError, match="action_noise"):
        FPOActor(tiny(), action_noise=-0.1)


@pytest.mark.parametrize("ratio", ["chunk", "per_sample"])
@pytest.mark.e2e
def test_finetune_then_eval_through_the_cli(tmp_path, capsys, ratio):
    policy = make_policy("flow", obs_dim=8, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                         num_inference_steps=2, task="reach", backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
    save_policy(policy, tmp_path / "bc")
    run_dir = tmp_path / "run"
    code = main(["finetune", "algo=fpo", f"checkpoint={tmp_path / 'bc'}", "task=reach", "num_envs=4", "eval_episodes=4",
                 "videos=0", "log_every=1", "env_steps=192", "eval_every=96", "algo.num_steps=8",
                 "algo.critic_warmup_iters=0", "algo.actor_kwargs.critic_hidden=16", f"algo.actor_kwargs.ratio={ratio}",
                 f"run_dir={run_dir}"])
    assert code == 0, capsys.readouterr().err
    train = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "train/policy_loss" in r]
    assert train and all(r["train/first_minibatch_ratio_dev"] < 1e-5 for r in train)
    assert np.isfinite([r["train/approx_kl"] for r in train]).all()
    assert main(["eval", "task=reach", f"checkpoint={run_dir}", "episodes=2", "num_envs=2", "videos=0",
                 f"run_dir={tmp_path / 'eval'}"]) == 0
