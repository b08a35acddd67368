"""SAC Flow (algos/sac_flow.py): the chain's log-likelihood against the Gaussian steps it is made
of and a Monte-Carlo estimate, reparameterised gradients, and the CLI end to end."""

import math

import pytest
import torch

from embodied_rl.actors.base import gaussian_logprob
from embodied_rl.algos.sac_flow import FlowChain
from embodied_rl.cli import main
from embodied_rl.policies import load_policy, make_policy
from tests.algos.test_qc_fql import checkpoints  # noqa: F401  (the fixture: flow, no_demos, diffusion)


def tiny_flow(steps=2):
    torch.manual_seed(0)
    return make_policy("flow", obs_dim=3, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                       num_inference_steps=steps, backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))


def test_the_log_likelihood_is_the_sum_of_the_gaussian_steps():
    policy = tiny_flow()
    chain = FlowChain(policy, noise_level=0.5)
    cond = policy.encode_obs(torch.randn(3, 2, 3))
    noise, steps = torch.randn(3, 4, 2), torch.randn(3, 2, 4, 2)
    chunk, logprob = chain(cond, noise, steps)
    x, expected = noise, torch.zeros(3)
    for i in range(2):
        mean, std = policy.step_mean_std(x, i, cond, 0.5)
        x = mean + std * steps[:, i]
        expected += gaussian_logprob(x, mean, std)[:, 1:3].flatten(1).mean(-1)  # the executed entries
    assert torch.allclose(chunk, x, atol=1e-6) and torch.allclose(logprob, expected, atol=1e-5)


def test_the_log_likelihood_matches_a_monte_carlo_estimate():
    """One step from a fixed start: the samples' density (a histogram of 200k draws) at the drawn
    points matches exp(log-likelihood), and the mean log-likelihood is minus the Gaussian entropy."""
    policy = tiny_flow(steps=1)
    chain = FlowChain(policy, noise_level=0.8)
    cond = policy.encode_obs(torch.randn(1, 2, 3)).expand(200_000, -1)
    noise = torch.randn(1, 4, 2).expand(200_000, -1, -1)
    with torch.no_grad():
        chunk, logprob = chain(cond, noise, torch.randn(200_000, 1, 4, 2))
        mean, std = policy.step_mean_std(noise[:1], 0, cond[:1], 0.8)
    entry = chunk[:, 1, 0]  # one executed entry: a 1-D Gaussian
    counts, edges = torch.histogram(entry, bins=60)
    density = counts / (len(entry) * (edges[1] - edges[0]))
    centres = (edges[1:] + edges[:-1]) / 2
    analytic = gaussian_logprob(centres, mean[0, 1, 0], std[0, 1, 0]).exp()
    busy = density > 0.2 * density.max()
    assert torch.allclose(density[busy], analytic[busy], rtol=0.05)
    entropy = (0.5 * torch.log(2 * math.pi * math.e * std[0, 1:3] ** 2)).mean()
    assert float(logprob.mean()) == pytest.approx(-float(entropy), abs=0.01)


def test_the_chain_is_reparameterised_through_the_velocity_network_only():
    policy = tiny_flow()
    chain = FlowChain(policy, noise_level=0.5)
    chunk, logprob = chain.draw(policy.encode_obs(torch.randn(4, 2, 3)))
    (chunk.sum() + logprob.sum()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in chain.ft.net.parameters())
    assert all(p.grad is None for p in policy.parameters())


def test_the_actor_climbs_the_critic_but_stays_in_the_action_range():
    """A critic that grows without bound in every action entry: the actor pushes the chunk up to
    the edge of [-1, 1], where the clipped critic gives no more and the penalty holds it (an
    unclipped critic would drive it on, as it drove lift's chain to 6)."""
    algo = fixed_critic_config(action_reg=0.0)
    executed = train_against_a_fixed_critic(algo, slope=10.0, stored=0.0)
    assert executed.mean() > 0.8  # climbed the critic
    assert executed.mean() < 1.2 and executed.max() < 1.6  # and stayed at the edge of the range (+ noise)


@pytest.mark.slow
def test_action_reg_holds_the_chunk_near_the_base_policy():
    """The regulariser anchors the chain to the frozen base policy's chunk from the same noise:
    against a flat critic the fine-tuned chain stays on it; against a rising critic it climbs, the
    less the larger action_reg is."""
    base = base_chunk_mean()
    flat = train_against_a_fixed_critic(fixed_critic_config(action_reg=1.0), slope=0.0, stored=-0.5)
    assert abs(flat.mean() - base) < 0.05  # the stored chunk (-0.5) does not pull it
    held = train_against_a_fixed_critic(fixed_critic_config(action_reg=10.0), slope=10.0, stored=-0.5)
    loose = train_against_a_fixed_critic(fixed_critic_config(action_reg=0.3), slope=10.0, stored=-0.5)
    assert abs(held.mean() - base) < 0.1  # held near the base (the range penalty also pulls in its outliers)
    assert loose.mean() > base + 0.3  # climbed (without action_reg it reaches the edge: the test above)


def base_chunk_mean() -> float:
    """The mean executed entry of the untrained tiny policy's chain, drawn as the trained one is."""
    from embodied_rl.algos.sac_flow import FlowChain

    torch.manual_seed(0)
    policy = tiny_flow()
    cond = policy.encode_obs(torch.randn(16, 2, 3))
    with torch.no_grad():
        chunk, _ = FlowChain(policy, 0.1).draw(cond, torch.Generator().manual_seed(1))
    return float(chunk[:, 1:3].mean())


def fixed_critic_config(action_reg: float):
    """SAC Flow settings for actor updates against a fixed critic: a fast actor, no critic step, no
    entropy pull."""
    from embodied_rl.algos.sac_flow import SACFlowConfig

    return SACFlowConfig(name="sac_flow", noise_level=0.1, critic_hidden_sizes=[8], ensemble=2, gamma=0.99,
                         tau=0.005, actor_lr=1e-2, critic_lr=0.0, alpha=1e-6, target_entropy=None, batch_size=16,
                         buffer_size=16, utd_ratio=1.0, demo_fraction=0.0, critic_only_steps=0,
                         action_reg=action_reg, reward="success", bootstrap_truncation=False, data=None, deploy="latest")


def train_against_a_fixed_critic(algo, slope: float, stored: float) -> torch.Tensor:
    """300 actor updates of a tiny flow policy against Q = slope x the sum of the executed entries
    (every critic), on one batch whose stored chunks are all `stored`; the executed chunk after."""
    from embodied_rl.algos.sac_flow import SACFlow

    policy = tiny_flow()
    learner = SACFlow(algo, policy, torch.device("cpu"), seed=0)

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.offset = torch.nn.Parameter(torch.zeros(()))  # a critic loss to step (by lr 0)

        def forward(self, cond, chunk):
            return slope * chunk.flatten(1).sum(-1).expand(2, -1) + self.offset

    learner.critic, learner.critic_target = Linear(), Linear()
    learner.critic_optimizer = torch.optim.SGD(learner.critic.parameters(), lr=0.0)
    cond = policy.encode_obs(torch.randn(16, 2, 3))
    batch = {"cond": cond, "next_cond": cond, "chunk": torch.full((16, 2, 2), stored), "reward": torch.zeros(16),
             "discount": torch.zeros(16)}
    for _ in range(300):
        learner.update(batch, update_actor=True)
    with torch.no_grad():
        chunk, _ = learner.chain.draw(cond, torch.Generator().manual_seed(1))
    return chunk[:, 1:3]


@pytest.mark.e2e
@pytest.mark.parametrize("deploy", ["latest", "judged"])
def test_finetune_then_eval_through_the_cli(deploy, checkpoints, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "run"
    code = main(["finetune", "algo=sac_flow", f"checkpoint={checkpoints / 'flow'}", "task=reach", "num_envs=4",
                 "eval_episodes=4", "videos=0", "log_every=1", "env_steps=96", "eval_every=48", "algo.batch_size=16",
                 "algo.critic_only_steps=32", "algo.critic_hidden_sizes=[16,16]", "algo.target_entropy=-1.0",
                 f"algo.deploy={deploy}", f"run_dir={run_dir}"])
    assert code == 0, capsys.readouterr().err
    # the checkpoint is the flow policy itself, recording the demos it read: the fine-tuned one (latest), or
    # under judging the pretrained one until fine-tuned weights win a paired evaluation (4 episodes never do)
    finetuned = load_policy(run_dir / "checkpoints" / "last")
    base = load_policy(checkpoints / "flow")
    moved = any(not torch.equal(a, b) for a, b in zip(finetuned.net.parameters(), base.net.parameters()))
    assert moved == (deploy == "latest")
    assert main(["eval", "task=reach", f"checkpoint={run_dir}", "episodes=2", "num_envs=2", "videos=0",
                 f"run_dir={tmp_path / 'eval'}"]) == 0


@pytest.mark.parametrize("policy,expected", [("no_demos", "needs demonstrations"), ("diffusion", "fine-tunes a flow policy")])
def test_refusals(policy, expected, checkpoints, tmp_path, capsys):  # noqa: F811
    code = main(["finetune", "algo=sac_flow", f"checkpoint={checkpoints / policy}", "task=reach", "env_steps=32",
                 "algo.critic_only_steps=8", "num_envs=4", f"run_dir={tmp_path / 'run'}"])
    assert code == 2 and expected in capsys.readouterr().err
