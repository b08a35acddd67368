"""RLPD and expert interventions (algos/residual_offpolicy.py, algos/interventions.py): the preset, the triggers,
the intervened steps in the replay and the demo pool, and the CLI end to end."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from embodied_rl import envs
from embodied_rl.algos.interventions import InterventionSchedule
from embodied_rl.algos.residual_offpolicy import ResidualOffPolicyConfig, finetune, validate_config
from embodied_rl.cli import main
from embodied_rl.config import compose
from embodied_rl.errors import UserError
from embodied_rl.runs import Run
from tests.algos.test_dsrl import tiny_policy
from tests.test_finetune_cli import checkpoints  # noqa: F401  (the fast BC checkpoint fixture)

# ---------------------------------------------------------------------------------------------
# The preset and its keys
# ---------------------------------------------------------------------------------------------


def test_the_preset_holds_rlpd_settings():
    algo = ResidualOffPolicyConfig.from_cfg(compose("finetune", ["algo=rlpd", "task=reach"]).algo)
    assert (algo.name, algo.learner, algo.ensemble, algo.demo_fraction) == ("rlpd", "sac", 10, 0.5)
    assert algo.warmup_env_steps == 0 and algo.critic_only_steps == 0  # online from the first step
    assert algo.interventions == "none"
    # the other settings are residual_offpolicy's
    base = ResidualOffPolicyConfig.from_cfg(compose("finetune", ["algo=residual_offpolicy", "task=reach"]).algo)
    assert (algo.utd_ratio, algo.n_step, algo.residual_scale) == (base.utd_ratio, base.n_step, base.residual_scale)
    assert base.interventions == "none"


@pytest.mark.parametrize("override,key", [("algo.interventions=human", "algo.interventions"),
                                          ("algo.intervention_trigger=often", "algo.intervention_trigger"),
                                          ("algo.stall_steps=0", "algo.stall_steps"),
                                          ("algo.intervention_prob=1.5", "algo.intervention_prob"),
                                          ("algo.intervention_steps=0", "algo.intervention_steps")])
def test_bad_intervention_values_are_refused(override, key, checkpoints, tmp_path, capsys):  # noqa: F811
    code = main(["finetune", "algo=rlpd", "task=reach", f"checkpoint={checkpoints / 'flow'}",
                 f"run_dir={tmp_path / 'run'}", override])
    err = capsys.readouterr().err
    assert code == 2 and key in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_task_without_an_expert_is_refused():
    cfg = compose("finetune", ["algo=rlpd", "task=reach", "algo.interventions=expert"])
    validate_config(cfg)
    with pytest.raises(UserError, match="algo.interventions=expert needs a scripted expert"):
        validate_config(OmegaConf.merge(cfg, {"task": {"expert": False}}))
    validate_config(OmegaConf.merge(cfg, {"task": {"expert": False}, "algo": {"interventions": "none"}}))


# ---------------------------------------------------------------------------------------------
# The trigger
# ---------------------------------------------------------------------------------------------


def step(schedule, reward, done=None):
    """One env step: (the envs the expert drives, the envs whose intervention starts now)."""
    driven, started = schedule.begin()
    done = torch.zeros(len(reward), dtype=torch.bool) if done is None else torch.tensor(done)
    schedule.after_step(torch.tensor(reward, dtype=torch.float32), done)
    return driven.tolist(), started.tolist()


def test_stall_fires_after_k_steps_without_a_new_best_and_releases_after_m():
    schedule = InterventionSchedule(2, "stall", stall_steps=3, prob=0.0, steps=2, seed=0)
    # env 0 sets a new best every step; env 1 never beats its first reward
    assert [step(schedule, (float(t), 1.0 if t == 0 else 0.5))[0] for t in range(4)] == [[False, False]] * 4
    assert step(schedule, (4.0, 1.0)) == ([False, True], [False, True])  # 3 steps without a new best
    assert step(schedule, (5.0, 1.0)) == ([False, True], [False, False])  # m = 2 steps of control
    driven = [step(schedule, (6.0 + t, 1.0))[0][1] for t in range(4)]
    # released: the expert's steps did not count, the policy has 3 steps of its own to beat the best
    assert driven == [False, False, False, True]


def test_an_episode_end_clears_the_counters_and_the_intervention():
    schedule = InterventionSchedule(1, "stall", stall_steps=2, prob=0.0, steps=5, seed=0)
    step(schedule, (1.0,))
    step(schedule, (0.0,), done=(True,))  # the episode ends: its best and count are forgotten
    assert step(schedule, (-3.0,))[0] == [False]  # a new episode's first reward is its best
    assert [step(schedule, (-3.0,))[0] for _ in range(2)] == [[False]] * 2  # 2 steps without a new best
    assert step(schedule, (-3.0,), done=(True,))[0] == [True]  # ... fire; the episode end also ends it
    assert step(schedule, (0.0,))[0] == [False]


def test_the_random_trigger():
    never = InterventionSchedule(64, "random", stall_steps=1, prob=0.0, steps=3, seed=0)
    assert not any(any(step(never, [0.0] * 64)[0]) for _ in range(50))
    always = InterventionSchedule(4, "random", stall_steps=1, prob=1.0, steps=3, seed=0)
    assert step(always, [0.0] * 4) == ([True] * 4, [True] * 4)
    assert step(always, [0.0] * 4) == ([True] * 4, [False] * 4)  # a driven env does not start again
    some = InterventionSchedule(1000, "random", stall_steps=1, prob=0.1, steps=1, seed=0)
    assert 50 < sum(step(some, [0.0] * 1000)[1]) < 150


def test_the_schedule_resumes_exactly():
    a = InterventionSchedule(8, "random", stall_steps=1, prob=0.3, steps=4, seed=1)
    for _ in range(5):
        step(a, [0.0] * 8)
    b = InterventionSchedule(8, "random", stall_steps=1, prob=0.3, steps=4, seed=99)
    b.load_state_dict(a.state_dict())
    assert [step(a, [0.0] * 8) for _ in range(10)] == [step(b, [0.0] * 8) for _ in range(10)]


# ---------------------------------------------------------------------------------------------
# The loop: intervened steps join the demo pool with the expert's action
# ---------------------------------------------------------------------------------------------


def run_rlpd(tmp_path, *overrides):
    # normalize_obs=false: the replay holds the raw reach observation, whose target the expert commands
    cfg = compose("finetune", ["algo=rlpd", "task=reach", "env_steps=96", "num_envs=4", "eval_every=0",
                               "videos=0", "log_every=32", f"run_dir={tmp_path / 'run'}", "algo.batch_size=16",
                               "algo.actor_hidden_sizes=[16,16]", "algo.critic_hidden_sizes=[16,16]",
                               "algo.ensemble=2", "algo.normalize_obs=false", "algo.interventions=expert",
                               "algo.intervention_trigger=random", *overrides])
    env = envs.make("reach", num_envs=4, seed=0)
    run = Run(cfg.run_dir, command="finetune", allow_existing=True)
    finetune(cfg, run, env, tiny_policy())
    replay = torch.load(run.file("checkpoints", "last", "training_state", "replay.pt"), weights_only=True)
    return env, run, replay["online"], replay["intervened"]


def test_intervened_steps_enter_the_demo_pool_with_the_experts_action(tmp_path):
    env, run, online, intervened = run_rlpd(tmp_path, "algo.intervention_prob=0.1", "algo.intervention_steps=4")
    n = int(intervened["size"])
    assert 0 < n < int(online["size"])
    # the reach expert commands the target position: its action is the target (obs[2:4]) in action units
    task = env.task
    obs, action = intervened["data"]["obs"], intervened["data"]["action"]
    expert = ((obs[:, 2:4] - task.ctrl_low) / (task.ctrl_high - task.ctrl_low) * 2 - 1).clamp(-1, 1)
    assert torch.allclose(action, expert, atol=1e-5)
    # ... which is not what base + residual does in the other steps
    online_obs, online_action = online["data"]["obs"], online["data"]["action"]
    by_policy = ((online_obs[:, 2:4] - task.ctrl_low) / (task.ctrl_high - task.ctrl_low) * 2 - 1).clamp(-1, 1)
    assert (online_action - by_policy).abs().max(1).values.gt(1e-3).sum() >= int(online["size"]) - n
    # every intervened transition is also in the online replay (the online share samples it too)
    rows = {tuple(r) for r in torch.cat([online_obs, online_action], 1).tolist()}
    assert all(tuple(r) in rows for r in torch.cat([obs, action], 1).tolist())
    rates = [row["train/intervention_rate"] for row in run.read_metrics() if "train/intervention_rate" in row]
    assert len(rates) == 3 and all(0 < rate < 1 for rate in rates)


def test_without_interventions_the_demo_pool_gets_nothing(tmp_path):
    _, run, online, intervened = run_rlpd(tmp_path, "algo.intervention_prob=0.0")
    assert int(intervened["size"]) == 0 and int(online["size"]) > 0
    rows = [row for row in run.read_metrics() if "train/intervention_rate" in row]
    assert rows and all(row["train/intervention_rate"] == 0 for row in rows)
    # no episode was assisted: the unassisted success rate is the success rate
    both = [row for row in rows if "rollout/success_rate" in row]
    assert all(row["rollout/success_rate_unassisted"] == row["rollout/success_rate"] for row in both)


# ---------------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_cli_rlpd_with_expert_interventions_then_eval(checkpoints, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "run"
    assert main(["finetune", "algo=rlpd", "task=reach", f"checkpoint={checkpoints / 'flow'}", f"run_dir={run_dir}",
                 "env_steps=64", "num_envs=4", "eval_every=64", "eval_episodes=4", "videos=0", "log_every=16",
                 "algo.batch_size=16", "algo.actor_hidden_sizes=[16,16]", "algo.critic_hidden_sizes=[16,16]",
                 "algo.interventions=expert", "algo.stall_steps=4", "algo.intervention_steps=4"]) == 0, \
        capsys.readouterr().err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [row["train/intervention_rate"] for row in rows if "train/intervention_rate" in row]
    assert rates and max(rates) > 0  # the untrained policy stalls on reach: the expert takes over
    assert any("train/actor_loss" in row for row in rows)  # no warm start: the actor trains at once
    capsys.readouterr()
    assert main(["eval", "task=reach", f"checkpoint={run_dir / 'checkpoints' / 'last'}", "episodes=4",
                 "num_envs=4", "videos=0", f"run_dir={tmp_path / 'eval'}"]) == 0, capsys.readouterr().err
