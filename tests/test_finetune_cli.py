"""`embodied-rl finetune` end to end on the tiny `reach` task: every on-policy algorithm, resume,
evaluation of the fine-tuned checkpoint, bad input."""

import json

import numpy as np
import pytest
import torch

from embodied_rl.cli import main


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from embodied_rl.data.dataset import write_demos
    from embodied_rl.policies import make_policy, save_policy

    root = tmp_path_factory.mktemp("bc")
    torch.manual_seed(0)
    rng = np.random.default_rng(0)  # the demos the policies "were trained on" (algorithms that read demos)
    episodes = [{"obs": rng.standard_normal((10, 8)).astype(np.float32),
                 "action": rng.uniform(-1, 1, (10, 2)).astype(np.float32),
                 "reward": np.zeros(10, np.float32), "success": bool(e % 2)} for e in range(4)]
    data = write_demos(root / "demos", episodes, {"task": "reach", "obs_dim": 8, "action_dim": 2})
    for policy_type, steps in (("diffusion", 3), ("flow", 2)):
        policy = make_policy(policy_type, obs_dim=8, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                             num_inference_steps=steps, task="reach",
                             backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
        save_policy(policy, root / policy_type, extra={"dataset": str(data)})
    return root


TINY = ["task=reach", "num_envs=4", "eval_episodes=4", "videos=0", "log_every=1", "algo.actor_kwargs.critic_hidden=16"]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo,policy,extra", [
    ("residual_ppo", "flow", ["algo.num_steps=25", "algo.actor_kwargs.hidden=16",
                              "algo.actor_kwargs.action_scale=[0.1,0.5]"]),  # a scale per action dim
    ("residual_ppo", "flow", ["algo.num_steps=25", "algo.actor_kwargs.hidden=16", "algo.anneal_lr=true",
                              "algo.actor_kwargs.chunk_critic=false", "algo.actor_kwargs.learn_std=true"]),  # obs critic
    ("dppo", "diffusion", ["algo.num_steps=8", "algo.actor_kwargs.ft_denoising_steps=1"]),
    ("reinflow", "flow", ["algo.num_steps=8"]),
    ("flow_sde", "flow", ["algo.num_steps=8"]),
    ("grpo", "flow", ["algo.group_size=2"]),
])
@pytest.mark.e2e
def test_every_on_policy_algorithm_runs_end_to_end(algo, policy, extra, checkpoints, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["finetune", f"algo={algo}", f"checkpoint={checkpoints / policy}", "env_steps=200",
                 "eval_every=100", f"run_dir={run_dir}", *TINY, *extra])
    assert code == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "success: " in out and " -> " in out and str(run_dir) in out  # before -> after
    rows = metrics(run_dir)
    train = [r for r in rows if "train/iteration" in r]
    assert train and all(r["train/first_minibatch_ratio_dev"] < 1e-5 for r in train if "train/first_minibatch_ratio_dev" in r)
    updates = [r for r in train if "train/policy_loss" in r]  # the actor's gradient noise scale, per update
    assert all(float(r["train/gradient_noise_trace"]) >= 0 and float(r["train/gradient_noise_scale"]) >= 0
               for r in updates)  # "inf" while no signal is resolved
    assert updates or algo in ("residual_ppo", "grpo")  # their 200 steps are the critic warm-up / one group
    if algo != "grpo":  # the critic's fit is logged (reach's success reward varies within 200 steps)
        fits = [r["train/explained_variance"] for r in train if "train/explained_variance" in r]
        assert fits and all(fit <= 1 for fit in fits)
    assert [r["step"] for r in rows if "eval/success_rate" in r][0] == 0  # the base policy is step 0
    if "algo.anneal_lr=true" in extra:  # linear decay: lr * (1 - iteration / iterations) before each update
        iterations = len(train)
        assert [r["train/lr"] for r in train] == pytest.approx([1e-3 * (1 - i / iterations) for i in range(iterations)])
    assert (run_dir / "checkpoints" / "last" / "agent.json").exists()
    optimizer = torch.load(run_dir / "checkpoints" / "last" / "training_state" / "optimizers.pt", weights_only=True)
    assert optimizer["optimizer"]["param_groups"][0]["eps"] == (1e-8 if algo in ("reinflow", "flow_sde") else 1e-5)
    assert (run_dir / "eval_info.json").exists()
    # the fine-tuned checkpoint evaluates with `embodied-rl eval`
    code = main(["eval", "task=reach", f"checkpoint={run_dir / 'checkpoints' / 'last'}", "episodes=2",
                 "num_envs=2", "videos=0", f"run_dir={tmp_path / 'eval'}"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.e2e
def test_a_stopped_run_resumes_and_its_step_counter_continues(checkpoints, tmp_path, capsys):
    run_dir = tmp_path / "run"
    common = ["algo=reinflow", f"checkpoint={checkpoints / 'flow'}", "eval_every=0", f"run_dir={run_dir}",
              "algo.num_steps=4", "checkpoint_every=32", *TINY]
    assert main(["finetune", "env_steps=64", *common]) == 0  # stops after 2 iterations of 32 steps
    state = json.loads((run_dir / "checkpoints/last/training_state/counters.json").read_text())
    assert state["iteration"] == 2 and state["env_steps"] == 64
    assert main(["finetune", "env_steps=128", *common]) == 0
    assert "resuming" in capsys.readouterr().out
    steps = [r["step"] for r in metrics(run_dir) if "train/iteration" in r]
    assert steps == [32, 64, 96, 128]
    iterations = [r["train/iteration"] for r in metrics(run_dir) if "train/iteration" in r]
    assert iterations == [1, 2, 3, 4]


@pytest.mark.e2e
def test_sampler_steps_sets_the_base_policy_s_denoising_steps_in_training_and_in_the_checkpoint(checkpoints, tmp_path):
    from embodied_rl.actors import BASE_POLICY, load_agent

    run_dir = tmp_path / "run"
    assert main(["finetune", "algo=reinflow", f"checkpoint={checkpoints / 'flow'}", "env_steps=32", "eval_every=0",
                 f"run_dir={run_dir}", "algo.num_steps=4", "sampler_steps=5", *TINY]) == 0  # trained at 2
    last = run_dir / "checkpoints" / "last"
    assert json.loads((last / BASE_POLICY / "config.json").read_text())["policy"]["num_inference_steps"] == 5
    agent = load_agent(last, num_envs=1)
    assert agent.actor.num_steps == 5 and agent.actor.ft.num_inference_steps == 5
    chain = agent.actor.act(torch.zeros(1, 2, 8)).stash["chain"]
    assert chain.shape[1] == 6  # the noise and one state per denoising step
    # a value the policy cannot take: one line, exit 2, no run_dir
    shortcut = tmp_path / "shortcut"
    from embodied_rl.policies import make_policy, save_policy

    save_policy(make_policy("shortcut", obs_dim=8, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                            task="reach", backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8)), shortcut)
    for checkpoint, steps in ((checkpoints / "flow", 0), (checkpoints / "flow", "many"), (shortcut, 3)):
        bad = tmp_path / f"bad_{steps}"
        assert main(["finetune", "algo=reinflow", f"checkpoint={checkpoint}", f"sampler_steps={steps}",
                     f"run_dir={bad}", *TINY]) == 2
        assert not bad.exists()


def test_bad_input_is_one_line(checkpoints, tmp_path, capsys):
    assert main(["finetune", "task=reach"]) == 2
    assert "checkpoint" in capsys.readouterr().err
    assert main(["finetune", "task=reach", f"checkpoint={tmp_path / 'nope'}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["finetune", "task=push_t", f"checkpoint={checkpoints / 'flow'}", f"run_dir={tmp_path / 'r'}"]) == 2
    assert "reach" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("keep me")
    assert main(["finetune", "task=reach", f"checkpoint={checkpoints / 'flow'}", f"run_dir={tmp_path / 'other'}"]) == 2
    assert "run_dir" in capsys.readouterr().err
    assert (tmp_path / "other" / "precious.txt").read_text() == "keep me"
    assert main(["finetune", "task=reach", "algo=grpo", "num_envs=3", f"checkpoint={checkpoints / 'flow'}",
                 f"run_dir={tmp_path / 'g'}"]) == 2
    assert "group_size" in capsys.readouterr().err
    # a preset's actor_kwargs belong to its actor: switching the actor alone keeps Flow-Noise's max_std
    assert main(["finetune", "task=reach", "algo=grpo", "algo.actor=flow_sde", f"checkpoint={checkpoints / 'flow'}",
                 f"run_dir={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "actor 'flow_sde' takes no 'max_std', 'noise_hidden' in algo.actor_kwargs" in err and "\n" not in err, err
    assert not (tmp_path / "a").exists()
    scale = ["task=reach", f"checkpoint={checkpoints / 'flow'}", f"run_dir={tmp_path / 's'}"]
    assert main(["finetune", *scale, "algo.actor_kwargs.action_scale=[0.1,0.1,0.1]"]) == 2  # reach: 2 dims
    assert "one per action dim" in capsys.readouterr().err
    assert main(["finetune", *scale, "algo.actor_kwargs.action_scale=[0.1,big]"]) == 2
    assert "bad value for 'algo.actor_kwargs.action_scale'" in capsys.readouterr().err
