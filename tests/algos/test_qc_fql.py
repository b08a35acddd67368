"""QC-FQL (algos/qc_fql.py): chunk-level transitions and their targets, the distillation toward
the flow policy, and `embodied-rl finetune algo=qc_fql` end to end."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from embodied_rl.algos.offpolicy import demo_chunk_transitions
from embodied_rl.algos.qc_fql import QCFQL, QCFQLConfig
from embodied_rl.cli import main
from embodied_rl.config import compose
from embodied_rl.data.dataset import DemoDataset, write_demos
from embodied_rl.policies import make_policy, save_policy

GAMMA = 0.9


def tiny_flow(n_action_steps=2, horizon=4):
    torch.manual_seed(0)
    return make_policy("flow", obs_dim=3, action_dim=1, n_obs_steps=2, horizon=horizon, n_action_steps=n_action_steps,
                       num_inference_steps=2, task="reach", backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))


def dataset(tmp_path):
    """Episode 0: 5 steps, successful; episode 1: 4 steps, failed. obs = step index."""
    episodes = []
    for length, success in ((5, True), (4, False)):
        t = np.arange(length, dtype=np.float32)
        episodes.append({"obs": np.stack([t, t, t], 1), "action": (t[:, None] / 10).astype(np.float32),
                         "reward": (t + 1).astype(np.float32), "success": success})
    return DemoDataset.load(write_demos(tmp_path / "demos", episodes, {"task": "reach", "obs_dim": 3, "action_dim": 1}))


def test_demo_chunks_sum_rewards_and_discount_by_the_chunk(tmp_path):
    policy = tiny_flow(n_action_steps=2)
    out = demo_chunk_transitions(dataset(tmp_path), policy, GAMMA, success_terminates=True, sparse=False,
                                 device=torch.device("cpu"))
    # the successful episode has a chunk at every step (the last ones end at its terminal step);
    # the failed one only where two more actions exist: t = 0, 1
    assert len(out["reward"]) == 5 + 2
    # rewards r_t = t + 1: sums of the chunk's steps inside the episode
    assert out["reward"].tolist() == [1 + 2, 2 + 3, 3 + 4, 4 + 5, 5, 1 + 2, 2 + 3]
    # gamma ** h after a whole chunk, 0 where the chunk reaches the terminal step (t = 3: steps 3, 4)
    assert out["discount"].tolist() == pytest.approx([GAMMA**2, GAMMA**2, GAMMA**2, 0, 0, GAMMA**2, GAMMA**2])
    # the chunk past the end repeats the last action; chunks are in the normalised action space
    expected = policy.normalize_action(torch.tensor([[[0.4], [0.4]]])).clamp(-1, 1)
    assert torch.allclose(out["chunk"][4], expected[0])
    # the next conditioning is the history h steps on (t = 0 -> the history ending at step 2)
    history = torch.tensor([[[1.0, 1, 1], [2, 2, 2]]])
    assert torch.allclose(out["next_cond"][0], policy.encode_obs(history)[0])


def test_sparse_demo_chunks_pay_one_where_the_success_is(tmp_path):
    out = demo_chunk_transitions(dataset(tmp_path), tiny_flow(), GAMMA, success_terminates=True, sparse=True,
                                 device=torch.device("cpu"))
    assert out["reward"].tolist() == [0, 0, 0, 1, 1, 0, 0]


def learner(alpha: float, one_step: str = "flow"):
    cfg = compose("finetune", ["algo=qc_fql", "algo.hidden_sizes=[32,32]", f"algo.alpha={alpha}",
                               f"algo.one_step={one_step}"])
    return QCFQL(QCFQLConfig.from_cfg(cfg.algo), tiny_flow(), torch.device("cpu"), seed=0)


def test_the_td_target_is_reward_plus_discounted_next_q():
    qc = learner(alpha=1.0)
    for p in qc.critic_target.parameters():  # Qbar = its last layer's bias: 2.0 everywhere
        torch.nn.init.zeros_(p)
    for critic in qc.critic_target.critics:
        torch.nn.init.constant_(critic[-1].bias, 2.0)
    for p in qc.critic.parameters():
        torch.nn.init.zeros_(p)
    batch = {"cond": torch.zeros(3, qc.policy.cond_dim), "next_cond": torch.zeros(3, qc.policy.cond_dim),
             "chunk": torch.zeros(3, 2, 1), "reward": torch.tensor([1.0, 0.0, 3.0]),
             "discount": torch.tensor([GAMMA**2, 0.0, 0.5])}
    stats = qc.update(batch)
    targets = torch.tensor([1 + GAMMA**2 * 2, 0.0, 3 + 0.5 * 2])
    # Q = 0 before the update: the critic loss is the ensemble's summed mean squared target
    assert stats["train/critic_loss"] == pytest.approx(float(2 * targets.pow(2).mean()), rel=1e-5)


def test_the_flow_one_step_policy_starts_as_the_flow_sampled_in_one_step():
    qc = learner(alpha=1.0)
    cond, z = torch.randn(8, qc.policy.cond_dim), torch.randn(8, 4, 1)
    with torch.no_grad():
        expected = z + qc.policy.velocity(z, 0.0, cond)  # one Euler step of the BC velocity field
        assert torch.allclose(qc.actor(cond, z), expected, atol=1e-6)
    assert qc.policy.num_inference_steps == 2  # the base policy keeps its own K
    trained = {id(p) for group in qc.actor_optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in qc.actor.flow.net.parameters()}  # the copy's encoder stays frozen


@pytest.mark.parametrize("one_step", ["flow", "mlp"])
def test_distillation_pulls_the_one_step_policy_onto_the_flow_policy(one_step):
    qc = learner(alpha=1000.0, one_step=one_step)
    batch = {"cond": torch.randn(64, qc.policy.cond_dim), "next_cond": torch.randn(64, qc.policy.cond_dim),
             "chunk": torch.zeros(64, 2, 1), "reward": torch.zeros(64), "discount": torch.zeros(64)}
    first = qc.update(batch)["train/distill_loss"]
    for _ in range(200):
        last = qc.update(batch)["train/distill_loss"]
    # fresh noise every update: mu learns the map z -> flow(s, z) (the one-step copy of the tiny
    # velocity network has less room to bend than the MLP)
    assert last < (0.5 if one_step == "flow" else 0.3) * first


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bc")
    rng = np.random.default_rng(0)
    episodes = [{"obs": rng.standard_normal((12, 8)).astype(np.float32),
                 "action": rng.uniform(-1, 1, (12, 2)).astype(np.float32),
                 "reward": np.zeros(12, np.float32), "success": bool(e % 2)} for e in range(4)]
    data = write_demos(root / "demos", episodes, {"task": "reach", "obs_dim": 8, "action_dim": 2})
    torch.manual_seed(0)
    kwargs = dict(obs_dim=8, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2, num_inference_steps=2,
                  task="reach", backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
    save_policy(make_policy("flow", **kwargs), root / "flow", extra={"dataset": str(data)})
    save_policy(make_policy("flow", **kwargs), root / "no_demos")
    save_policy(make_policy("diffusion", **kwargs), root / "diffusion", extra={"dataset": str(data)})
    return root


TINY = ["task=reach", "num_envs=4", "eval_episodes=4", "videos=0", "log_every=1", "algo.offline_updates=5",
        "algo.batch_size=16", "algo.hidden_sizes=[16,16]"]


@pytest.mark.e2e
def test_finetune_then_eval_through_the_cli(checkpoints, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["finetune", "algo=qc_fql", f"checkpoint={checkpoints / 'flow'}", "env_steps=96", "eval_every=48",
                 "algo.reward=env", f"run_dir={run_dir}", *TINY])
    assert code == 0, capsys.readouterr().err
    rows = [OmegaConf.create(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("offline/critic_loss" in r for r in rows) and any("train/distill_loss" in r for r in rows)
    # the online chunks in the replay: reach's dense reward bootstraps a chunk with gamma ** h; a chunk
    # that reaches the target ends its episode (0)
    replay = torch.load(run_dir / "checkpoints" / "last" / "training_state" / "replay.pt", weights_only=True)
    discounts = replay["data"]["discount"]
    assert len(discounts) == 96 // 2 and all(d == 0 or abs(d - 0.99**2) < 1e-6 for d in discounts.tolist())
    assert (discounts > 0).float().mean() > 0.5
    assert main(["eval", "task=reach", f"checkpoint={run_dir}", "episodes=2", "num_envs=2", "videos=0",
                 f"run_dir={tmp_path / 'eval'}"]) == 0
    # the saved one-step policy is the trained copy of the velocity network, not the base policy's
    from embodied_rl.actors import load_agent

    agent = load_agent(run_dir / "checkpoints" / "last", num_envs=1)
    trained = agent.actor.flow.net.state_dict()
    base = agent.policy.net.state_dict()
    assert any(not torch.equal(trained[k], base[k]) for k in trained)


@pytest.mark.e2e
def test_the_mlp_one_step_policy_runs_and_reloads(checkpoints, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["finetune", "algo=qc_fql", "algo.one_step=mlp", f"checkpoint={checkpoints / 'flow'}",
                 "env_steps=32", "eval_every=0", f"run_dir={run_dir}", *TINY])
    assert code == 0, capsys.readouterr().err
    assert main(["eval", "task=reach", f"checkpoint={run_dir}", "episodes=2", "num_envs=2", "videos=0",
                 f"run_dir={tmp_path / 'eval'}"]) == 0


@pytest.mark.parametrize("policy,extra,expected", [("no_demos", [], "needs demonstrations"),
                                                   ("diffusion", [], "distils a flow policy"),
                                                   ("flow", ["algo.one_step=ode"], "algo.one_step must be one of")])
def test_refusals(policy, extra, expected, checkpoints, tmp_path, capsys):
    code = main(["finetune", "algo=qc_fql", f"checkpoint={checkpoints / policy}", "env_steps=32",
                 f"run_dir={tmp_path / 'run'}", *TINY, *extra])
    assert code == 2 and expected in capsys.readouterr().err
