"""Every fine-tuning algorithm runs end to end through the CLI on every manipulation task (tiny
scale: a few iterations with a tiny untrained policy; the shapes, resets and checkpoints are what
is under test, not learning)."""

import json

import pytest
import torch

from embodied_rl.cli import main

pytestmark = pytest.mark.e2e

TASKS = ["push_t", "lift", "peg_insert"]
ON_POLICY = {
    "residual_ppo": ["algo.num_steps=4", "algo.actor_kwargs.hidden=16"],
    "dppo": ["algo.num_steps=2"],
    "reinflow": ["algo.num_steps=2", "algo.actor_kwargs.noise_hidden=16"],
    "flow_sde": ["algo.num_steps=2"],
    "grpo": ["algo.num_steps=2", "algo.group_size=2"],
    "fpo": ["algo.num_steps=2", "algo.actor_kwargs.num_samples=2"],
}
OFF_POLICY = {
    "dsrl": ["algo.hidden_sizes=[16,16]", "algo.batch_size=16"],
    "dsrl_na": ["algo.hidden_sizes=[16,16]", "algo.batch_size=16"],
    "residual_offpolicy": ["algo.actor_hidden_sizes=[16,16]", "algo.critic_hidden_sizes=[16,16]", "algo.ensemble=2",
                     "algo.batch_size=16"],
    "rlpd": ["algo.actor_hidden_sizes=[16,16]", "algo.critic_hidden_sizes=[16,16]", "algo.ensemble=2",
             "algo.batch_size=16", "algo.interventions=expert", "algo.stall_steps=2"],
}
# chunk-level off-policy methods (no WSRL stages); sac_flow's checkpoint is the fine-tuned policy itself
CHUNK_OFF_POLICY = {
    "qc_fql": (["algo.hidden_sizes=[16,16]", "algo.batch_size=16", "algo.offline_updates=2", "algo.buffer_size=1000"],
               "agent.json"),
    "sac_flow": (["algo.critic_hidden_sizes=[16,16]", "algo.batch_size=16", "algo.critic_only_steps=8",
                  "algo.buffer_size=1000"], "config.json"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import numpy as np

    from embodied_rl import envs
    from embodied_rl.data.dataset import write_demos
    from embodied_rl.policies import make_policy, save_policy

    root = tmp_path_factory.mktemp("bc")
    rng = np.random.default_rng(0)
    for task in TASKS:
        env = envs.make(task, num_envs=1)
        obs_dim, action_dim = env.task.obs_dim, env.action_dim
        env.close()
        episodes = [{"obs": rng.standard_normal((6, obs_dim)).astype(np.float32),
                     "action": rng.uniform(-1, 1, (6, action_dim)).astype(np.float32),
                     "reward": np.zeros(6, np.float32), "success": bool(e % 2)} for e in range(2)]
        demos = write_demos(root / f"{task}_demos", episodes, {"task": task, "obs_dim": obs_dim, "action_dim": action_dim})
        torch.manual_seed(0)
        policy = make_policy("flow", obs_dim=obs_dim, action_dim=action_dim, n_obs_steps=2, horizon=4,
                             n_action_steps=2, num_inference_steps=2, task=task,
                             backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
        save_policy(policy, root / task, extra={"dataset": str(demos)})
    return root


@pytest.mark.parametrize("task", TASKS)
def test_every_algorithm_fine_tunes_and_checkpoints_on_every_manipulation_task(task, checkpoints, tmp_path, capsys):
    # eval_episodes=4: the residual learners evaluate their start and end even at eval_every=0 (algo.floor_reach: the end is judged)
    common = [f"task={task}", f"checkpoint={checkpoints / task}", "num_envs=4", "eval_every=0", "eval_episodes=4",
              "videos=0", "algo.actor_kwargs.critic_hidden=16"]
    for algo, extra in ON_POLICY.items():
        run_dir = tmp_path / algo
        assert main(["finetune", f"algo={algo}", "env_steps=16", f"run_dir={run_dir}", *common, *extra]) == 0, \
            capsys.readouterr().err
        assert (run_dir / "checkpoints" / "last" / "agent.json").exists()
    common = [entry for entry in common if "critic_hidden" not in entry]
    for algo, extra in OFF_POLICY.items():
        run_dir = tmp_path / algo
        assert main(["finetune", f"algo={algo}", "env_steps=48", f"run_dir={run_dir}", "algo.warmup_env_steps=16",
                     "algo.critic_only_steps=16", "algo.utd_ratio=0.25", *common, *extra]) == 0, \
            capsys.readouterr().err
        assert (run_dir / "checkpoints" / "last" / "agent.json").exists()
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
        assert max(steps) >= 48
    for algo, (extra, checkpoint_file) in CHUNK_OFF_POLICY.items():
        run_dir = tmp_path / algo
        assert main(["finetune", f"algo={algo}", "env_steps=32", f"run_dir={run_dir}", *common, *extra]) == 0, \
            capsys.readouterr().err
        assert (run_dir / "checkpoints" / "last" / checkpoint_file).exists()
    # RECAP, with episodes short enough that its rollouts are labelled and trained on
    run_dir = tmp_path / "recap"
    assert main(["finetune", "algo=recap", "env_steps=32", f"run_dir={run_dir}", "task.max_episode_steps=3", "log_every=1", *common,
                 "algo.rollout_steps=4", "algo.policy_updates=2", "algo.value_updates=2", "algo.batch_size=8"]) == 0, \
        capsys.readouterr().err
    assert (run_dir / "checkpoints" / "last" / "agent.json").exists()
    trained = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert any(row.get("train/rollout_episodes", 0) > 0 for row in trained)
