"""`embodied-rl finetune algo=dsrl|dsrl_na|residual_sac` end to end on reach, then `embodied-rl eval`
of the fine-tuned checkpoint, resume, and bad input."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from embodied_rl.cli import main
from embodied_rl.data.dataset import write_demos
from embodied_rl.policies import save_policy
from tests.algos.test_dsrl import tiny_policy

TINY = {
    "dsrl": ["algo.hidden_sizes=[16,16]", "algo.batch_size=32", "algo.utd_ratio=0.25"],
    "dsrl_na": ["algo.hidden_sizes=[16,16]", "algo.batch_size=32", "algo.utd_ratio=0.25"],
    "residual_sac": ["algo.actor_hidden_sizes=[16,16]", "algo.critic_hidden_sizes=[16,16]", "algo.ensemble=4",
                     "algo.batch_size=32", "algo.utd_ratio=0.25"],
}


@pytest.fixture(scope="module")
def bc_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("bc")
    rng = np.random.default_rng(0)
    episodes = [{"obs": rng.standard_normal((10, 8)).astype(np.float32),
                 "action": rng.uniform(-1, 1, (10, 2)).astype(np.float32),
                 "reward": np.zeros(10, np.float32), "success": False} for _ in range(2)]
    data = write_demos(root / "demos", episodes, {"task": "reach", "obs_dim": 8, "action_dim": 2})
    return save_policy(tiny_policy(task="reach"), root / "policy", extra={"dataset": str(data)})


def finetune_args(algo, checkpoint, run_dir, env_steps=240):
    return ["finetune", "task=reach", f"algo={algo}", f"checkpoint={checkpoint}", f"run_dir={run_dir}",
            "num_envs=4", f"env_steps={env_steps}", "eval_every=120", "eval_episodes=4", "videos=0",
            "algo.warmup_env_steps=40", "algo.critic_only_steps=40", *TINY[algo]]


@pytest.mark.parametrize("algo", ["dsrl", "dsrl_na", "residual_sac"])
@pytest.mark.e2e
def test_finetune_then_eval_end_to_end(tmp_path, capsys, bc_checkpoint, algo):
    run_dir = tmp_path / "ft"
    assert main(finetune_args(algo, bc_checkpoint, run_dir)) == 0
    out = capsys.readouterr().out
    assert re.search(r"^success: [\d.]+% \[[\d.]+, [\d.]+\] -> [\d.]+% \[[\d.]+, [\d.]+\]$", out, re.M), out
    assert f"run_dir: {run_dir}" in out
    last = run_dir / "checkpoints" / "last"
    agent = json.loads((last / "agent.json").read_text())
    assert agent["kind"] == ("residual_offpolicy" if algo == "residual_sac" else "dsrl")
    assert (last / "base_policy" / "model.safetensors").exists()
    assert not list(last.rglob("*.zip")) and not list(last.rglob("*.pkl"))  # no SB3 zips / pickles
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [row["step"] for row in metrics if "eval/success_rate" in row]
    assert evals[0] == 0 and evals[-1] >= 240
    eval_info = json.loads((run_dir / "eval_info.json").read_text())
    assert len(eval_info["per_episode"]) == 4

    eval_dir = tmp_path / "eval"
    code = main(["eval", "task=reach", f"checkpoint={last}", f"run_dir={eval_dir}", "episodes=4",
                 "num_envs=4", "videos=0"])
    assert code == 0
    assert json.loads((eval_dir / "eval_info.json").read_text())["overall"]["n_episodes"] == 4


@pytest.mark.parametrize("algo", ["dsrl", "residual_sac"])
@pytest.mark.e2e
def test_resume_continues_the_run(tmp_path, bc_checkpoint, algo):
    run_dir = tmp_path / "ft"
    assert main(finetune_args(algo, bc_checkpoint, run_dir, env_steps=120)) == 0
    assert main(finetune_args(algo, bc_checkpoint, run_dir, env_steps=240)) == 0
    counters = json.loads((run_dir / "checkpoints" / "last" / "training_state" / "counters.json").read_text())
    assert counters["env_steps"] >= 240
    evals0 = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(1 for row in evals0 if row["step"] == 0 and "eval/success_rate" in row) == 1


@pytest.mark.e2e
@pytest.mark.parametrize("floor_reach", [0.2, None])
def test_judging_evaluates_the_start_and_judges_the_end_even_without_periodic_evaluations(
        tmp_path, bc_checkpoint, floor_reach):
    """eval_every=0: with judging (algo.floor_reach, the default) step 0 and the end are evaluated and
    the end judged (else its checkpoint would act at the floor unjudged); without it nothing is evaluated and the
    checkpoint acts at the training reach. Training follows the ramp either way."""
    run_dir = tmp_path / "ft"
    rule = ["eval_every=0", "log_every=8", "algo.reach_ramp_steps=40", f"algo.floor_reach={floor_reach or 'null'}"]
    assert main([*finetune_args("residual_sac", bc_checkpoint, run_dir, env_steps=160), *rule]) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [row["step"] for row in metrics if "eval/success_rate" in row]
    judged = [row["step"] for row in metrics if "eval/deployed_reach" in row]
    assert max(row["train/reach"] for row in metrics if "train/reach" in row) == 1.0
    agent = json.loads((run_dir / "checkpoints" / "last" / "agent.json").read_text())
    if floor_reach is None:
        assert evaluated == judged == [] and agent["config"]["residual_scale"] == pytest.approx(0.5)
    else:  # 4 paired episodes never resolve a win (4 of 4: p .0625): the floor is deployed
        assert evaluated == [0, 160] and judged == [160]
        assert agent["config"]["residual_scale"] == pytest.approx(0.2 * 0.5)


@pytest.mark.e2e
def test_training_follows_the_ramp_and_the_floor_is_deployed_until_evaluations_say_otherwise(tmp_path, bc_checkpoint):
    """The default rule: no cap on training (every env at the ramp's reach), and from the evaluation where the
    ramp passes the floor on, two evaluations per step; 4 paired episodes can never resolve a win (4 of 4: p .0625),
    so every evaluation and checkpoint acts with the floor, also after a resume."""
    run_dir = tmp_path / "ft"
    rule = ["log_every=8", "algo.reach_ramp_steps=40", "algo.floor_reach=0.2", "eval_every=60"]
    assert main([*finetune_args("residual_sac", bc_checkpoint, run_dir, env_steps=120), *rule]) == 0
    assert main([*finetune_args("residual_sac", bc_checkpoint, run_dir, env_steps=240), *rule]) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reaches = [row["train/reach"] for row in metrics if "train/reach" in row and row["step"] > 80]
    assert reaches == sorted(reaches) and reaches[-1] == 1.0
    judged = [row for row in metrics if "eval/deployed_reach" in row]
    assert [row["step"] for row in judged] == [120, 180, 240]  # the ramp passes 0.2 of the scale at 88 env steps
    assert all(row["eval/deployed_reach"] == 0.2 for row in judged)
    for checkpoint in ("last", "best"):
        agent = json.loads((run_dir / "checkpoints" / checkpoint / "agent.json").read_text())
        assert agent["config"]["residual_scale"] == pytest.approx(0.2 * 0.5)


@pytest.mark.parametrize("override, message", [
    ("algo.utd_ratio=0", "utd_ratio"),
    ("algo.noise_bound=0", "noise_bound"),
    ("algo.target_entropy=lots", "target_entropy"),
    ("algo.reward=dense", "algo.reward"),
    ("algo.eval_noise=median", "algo.eval_noise must be sample or mean"),
    ("algo.eval_candidates=4", "algo.eval_candidates must be 1, or > 1 with algo=dsrl_na"),
    ("algo.rollout_candidates=4", "algo.rollout_candidates must be 1, or > 1 with algo=dsrl_na"),
    ("algo.activation=gelu", "algo.activation must be relu or tanh"),
    ("algo.policy_delay=2", "algo.policy_delay must be 1, or > 1 with algo=dsrl_na"),
    ("algo.actor_lr=0", "algo.actor_lr must be null or > 0"),
    ("algo.bootstrap_truncation=sometimes", "'algo.bootstrap_truncation': expected auto, true or false"),
    ("algo.clip_target_q=maybe", "'algo.clip_target_q': expected auto, true or false"),
    ("algo.clip_target_q=true", "algo.clip_target_q must be auto or false, got True"),
])
def test_bad_dsrl_config_exits_2(tmp_path, capsys, bc_checkpoint, override, message):
    args = finetune_args("dsrl", bc_checkpoint, tmp_path / "ft") + [override]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_bad_dsrl_na_actor_q_exits_2(tmp_path, capsys, bc_checkpoint):
    args = finetune_args("dsrl_na", bc_checkpoint, tmp_path / "ft") + ["algo.actor_q=value"]
    assert main(args) == 2
    assert "algo.actor_q must be noise_critic or action_critic" in capsys.readouterr().err
    assert not (tmp_path / "ft").exists()
    args = finetune_args("dsrl", bc_checkpoint, tmp_path / "ft2") + ["algo.actor_q=action_critic"]
    assert main(args) == 2  # the key is DSRL-NA's: plain DSRL has no action critic
    assert not (tmp_path / "ft2").exists()
    args = finetune_args("dsrl_na", bc_checkpoint, tmp_path / "ft3") + ["algo.eval_candidates=4", "algo.eval_noise=mean"]
    assert main(args) == 2  # the actor's mean is one noise: N candidates of it are one candidate
    assert "algo.eval_candidates must be 1, or > 1 with algo=dsrl_na and eval_noise=sample" in capsys.readouterr().err
    assert not (tmp_path / "ft3").exists()
    args = finetune_args("dsrl_na", bc_checkpoint, tmp_path / "ft4") + ["algo.critic_reduction=median"]
    assert main(args) == 2
    assert "algo.critic_reduction must be min or mean" in capsys.readouterr().err
    assert not (tmp_path / "ft4").exists()


def test_bad_residual_config_exits_2(tmp_path, capsys, bc_checkpoint):
    args = finetune_args("residual_sac", bc_checkpoint, tmp_path / "ft") + ["algo.actor=ppo"]
    assert main(args) == 2
    assert "algo.actor" in capsys.readouterr().err
    args = finetune_args("residual_sac", bc_checkpoint, tmp_path / "ft2") + [f"algo.data={tmp_path / 'missing'}"]
    assert main(args) == 2
    assert "algo.data" in capsys.readouterr().err


@pytest.mark.parametrize("algo, override, message", [
    ("residual_sac", "algo.floor_reach=1", "algo.floor_reach must be in (0, 1) or null"),
    ("residual_sac", "algo.floor_reach=0", "algo.floor_reach must be in (0, 1) or null"),
    ("residual_sac", "algo.high_start=0.8", "high_start"),  # the former rule's keys are refused, not ignored
    ("residual_sac", "algo.residual_dims=[0,0]", "algo.residual_dims must be all, demos or a list of distinct action dims"),
    ("residual_sac", "algo.residual_dims=some", "algo.residual_dims must be all, demos or a list of distinct action dims"),
    ("residual_sac", "algo.residual_dims=[0,2]", "algo.residual_dims names action dim 2; task reach acts in 2 (0 to 1)"),
])
def test_a_bad_floor_reach_exits_2(tmp_path, capsys, bc_checkpoint, algo, override, message):
    assert main(finetune_args(algo, bc_checkpoint, tmp_path / "ft") + [override]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ft").exists()


@pytest.mark.e2e
def test_dsrl_na_with_eval_candidates_deploys_best_of_n_under_its_action_critics(tmp_path, bc_checkpoint):
    """algo.eval_candidates=N: the checkpoint holds the action critics beside the noise actor, and the agent
    `eval` rebuilds from it draws N noises per decision and executes the best under them (the training
    rollouts too, with algo.rollout_candidates)."""
    from embodied_rl.actors import load_agent, load_agent_tensors

    run_dir = tmp_path / "ft"
    assert main(finetune_args("dsrl_na", bc_checkpoint, run_dir, env_steps=120)
                + ["algo.eval_candidates=4", "algo.rollout_candidates=3"]) == 0
    last = run_dir / "checkpoints" / "last"
    assert json.loads((last / "agent.json").read_text())["config"]["eval_candidates"] == 4
    assert any(name.startswith("action_critic.") for name in load_agent_tensors(last))
    agent = load_agent(last, num_envs=4)
    assert agent.candidates == 4 and len(agent.action_critic) == 2
    code = main(["eval", "task=reach", f"checkpoint={last}", f"run_dir={tmp_path / 'eval'}", "episodes=4",
                 "num_envs=4", "videos=0"])
    assert code == 0
