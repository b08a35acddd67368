"""The run bookkeeping every fine-tuning algorithm shares (algos/common.py): the crash-safe
checkpoint swap, the run_dir lock, divergence, resume refusals and exact resume."""

import json
import math
import os

import pytest
import torch
from omegaconf import OmegaConf

from embodied_rl.algos.common import FinetuneLoop, find_checkpoint, read_best, write_checkpoint
from embodied_rl.cli import main
from embodied_rl.commands.finetune import ALGOS
from embodied_rl.errors import Diverged, UserError
from embodied_rl.runs import Run, read_metrics
from tests.test_finetune_cli import TINY, checkpoints  # noqa: F401  (a module fixture)


def fill_with(step):
    def fill(directory):
        state = directory / "training_state"
        state.mkdir()
        (state / "counters.json").write_text(json.dumps({"step": step}))

    return fill


def test_last_points_at_the_newest_and_old_checkpoints_are_pruned(tmp_path):
    for step in (10, 20, 30, 40):
        write_checkpoint(tmp_path, step, fill_with(step))
    assert (tmp_path / "last").is_symlink() and os.readlink(tmp_path / "last") == "40"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["20", "30", "40", "last"]
    assert find_checkpoint(tmp_path) == tmp_path / "40"


def test_resume_repairs_what_a_kill_left_and_never_deletes_a_complete_checkpoint(tmp_path):
    write_checkpoint(tmp_path, 10, fill_with(10))
    # killed after writing step 20 completely but before renaming it into place
    complete = tmp_path / ".20.abc.tmp"
    complete.mkdir()
    fill_with(20)(complete)
    # killed while writing step 30: no counters.json yet
    (tmp_path / ".30.def.tmp" / "training_state").mkdir(parents=True)
    # the older layout's swap: `last` moved aside, the new one not yet in place
    old_layout = tmp_path / ".last.old"
    old_layout.mkdir()
    fill_with(15)(old_layout)
    assert find_checkpoint(tmp_path) == tmp_path / "20"
    assert os.readlink(tmp_path / "last") == "20"
    assert not (tmp_path / ".30.def.tmp").exists()  # the incomplete write is gone
    assert (tmp_path / "10").is_dir() and old_layout.is_dir()  # complete checkpoints stay


def test_no_last_directory_of_the_older_layout_is_lost(tmp_path):
    last = tmp_path / "last"
    last.mkdir()
    fill_with(50)(last)
    write_checkpoint(tmp_path, 10, fill_with(10))  # an older step does not win
    assert find_checkpoint(tmp_path) == tmp_path / "50"


def test_one_process_per_run_dir(tmp_path):
    first = Run(tmp_path / "run")
    with pytest.raises(UserError, match="in use by process"):
        Run(tmp_path / "run", allow_existing=True)
    first.close()
    Run(tmp_path / "run", allow_existing=True).close()  # a released (or dead process's) lock is taken over


def test_metrics_record_non_finite_values(tmp_path):
    run = Run(tmp_path / "run")
    run.log(1, {"a": float("nan"), "b": float("inf"), "c": 2.0})
    run.close()
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert line == {"step": 1, "a": "nan", "b": "inf", "c": 2.0}
    row = read_metrics(tmp_path / "run")[0]
    assert math.isnan(row["a"]) and row["b"] == math.inf


RESIDUAL = ["algo=residual_ppo", "algo.num_steps=8", "algo.actor_kwargs.hidden=16"]


def test_divergence_stops_with_exit_3_and_one_line(checkpoints, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "run"
    code = main(["finetune", f"checkpoint={checkpoints / 'flow'}", "env_steps=320", "eval_every=0",
                 "algo.critic_lr=1e30", f"run_dir={run_dir}", *TINY, *RESIDUAL])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "diverged at env step 32: train/loss is not finite" in err and len(err.strip().splitlines()) == 1
    # nothing non-finite was written: no checkpoint past step 0 (the first evaluation's best is the untouched start)
    assert not (run_dir / "checkpoints" / "last").exists()
    assert json.loads((run_dir / "checkpoints" / "best" / "best.json").read_text())["step"] == 0
    assert read_metrics(run_dir)[-1]["train/value_loss"] == math.inf  # recorded as such


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    cfg = OmegaConf.create({"env_steps": 100, "checkpoint_every": 10, "log_every": 10, "save_replay": True,
                            "eval_every": 0})
    net = torch.nn.Linear(2, 2)
    run = Run(tmp_path / "run")
    loop = FinetuneLoop(cfg, run, evaluation=None)  # eval_every=0: never evaluates
    loop.resume({"net": net}, {}, write_agent=lambda directory: None)
    loop.counters["env_steps"] = 10
    loop.save({})
    with torch.no_grad():
        net.weight[0, 0] = float("nan")
    loop.counters["env_steps"] = 20
    with pytest.raises(Diverged, match="weights.net.weight is not finite .checkpoints/last holds env step 10"):
        loop.save({})
    last = torch.load(run.file("checkpoints", "last", "training_state", "state.pt"), weights_only=True)
    assert torch.isfinite(last["modules"]["net"]["weight"]).all()
    run.close()


def test_a_loop_counts_what_its_caller_names(tmp_path):
    """The language RL loop counts iterations (`steps`), not env steps: in its schedule, its
    counters and its messages."""
    settings = {"steps": 6, "checkpoint_every": 2, "log_every": 1, "eval_every": 0}
    run = Run(tmp_path / "run")
    loop = FinetuneLoop(settings, run, evaluation=None, counter="steps")
    loop.resume({"net": torch.nn.Linear(2, 2)}, {}, write_agent=lambda directory: None)
    loop.start("test")
    for _ in range(3):
        loop.advance(1)
        loop.boundary(dict)
    counters = json.loads(run.file("checkpoints", "last", "training_state", "counters.json").read_text())
    assert (loop.step, loop.total, counters["steps"]) == (3, 6, 2) and "env_steps" not in counters
    with pytest.raises(Diverged, match=r"at step 3: train/loss is not finite \(checkpoints/last holds step 2\)"):
        loop.check_finite("train/loss", float("nan"))
    run.close()


def test_resuming_with_other_settings_is_refused(checkpoints, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "run"
    common = [f"checkpoint={checkpoints / 'flow'}", "eval_every=0", f"run_dir={run_dir}", *TINY, *RESIDUAL]
    assert main(["finetune", "env_steps=64", *common]) == 0
    config = (run_dir / "config.yaml").read_text()
    assert main(["finetune", "env_steps=64", "algo.lr=0.5", *common]) == 2
    err = capsys.readouterr().err
    assert "algo.lr=0.001 -> 0.5" in err
    assert (run_dir / "config.yaml").read_text() == config  # nothing changed
    assert main(["finetune", "env_steps=96", *common]) == 0  # a longer run is a safe change
    assert "env_steps: 96" in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize("bad,expected", [
    ("algo.gamma=2.5", "algo.gamma must be in [0, 1]"),
    ("algo.num_minibatches=0", "algo.num_minibatches must be >= 1"),
    ("algo.adam_eps=0", "algo.adam_eps must be > 0"),
    ("checkpoint_every=-1", "checkpoint_every must be >= 0"),
])
def test_bad_values_are_refused_before_any_run_dir(bad, expected, checkpoints, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "run"
    assert main(["finetune", f"checkpoint={checkpoints / 'flow'}", f"run_dir={run_dir}", bad, *TINY]) == 2
    assert expected in capsys.readouterr().err
    assert not run_dir.exists()


def test_off_policy_values_are_refused(checkpoints, tmp_path, capsys):  # noqa: F811
    for bad in ("algo.batch_size=0", "algo.learner=ddpg", "algo.tau=0"):
        assert main(["finetune", "algo=residual_offpolicy", f"checkpoint={checkpoints / 'flow'}",
                     f"run_dir={tmp_path / 'r'}", bad, *TINY[:-1]]) == 2
        assert bad.split("=")[0] in capsys.readouterr().err


def train_rows(run_dir):
    """Training rows by step (the last one where a resumed run redid a step), timings dropped."""
    rows = {}
    for row in read_metrics(run_dir):
        if any(k.startswith(("train/", "rollout/")) for k in row) and "train/wall_s" not in row:
            rows[row["step"]] = {k: v for k, v in row.items() if not k.endswith(("_s", "sps"))}
    return rows


OFF_POLICY = ["algo.warmup_env_steps=16", "algo.critic_only_steps=16", "algo.batch_size=16"]
RESIDUAL_OFF_POLICY = [*OFF_POLICY, "algo.actor_hidden_sizes=[16,16]", "algo.critic_hidden_sizes=[16,16]"]
DSRL = [*OFF_POLICY, "algo.hidden_sizes=[16,16]"]


def case(algo, policy, *extra, id=None):
    """An exact-resume case: an algo preset, the BC policy it fine-tunes and overrides after TINY."""
    return pytest.param(algo, policy, list(extra), id=id or algo)


RESUME_CASES = [
    case("residual_ppo", "flow", *RESIDUAL[1:]),
    case("residual_remix", "flow", *RESIDUAL[1:]),  # ReMix's preset: three rollouts replayed across the resume
    # the chunk-level residual (an actor, not a preset): no chunk_critic switch, no per-step shaping
    case("residual_ppo", "flow", "algo.actor=residual_chunk", "~algo.actor_kwargs.chunk_critic",
         "algo.reward_shaping=0", "algo.num_steps=4", "algo.actor_kwargs.hidden=16", id="residual_chunk"),
    case("dppo", "diffusion", "algo.num_steps=4"),
    case("reinflow", "flow", "algo.num_steps=4", "algo.actor_kwargs.noise_hidden=16"),
    # ReMix: the replayed rollouts, the KL-convex regulariser and the reincarnated anchor (at 96 env
    # steps: after the resume point) are part of the checkpoint
    case("reinflow", "flow", "algo.num_steps=4", "algo.actor_kwargs.noise_hidden=16", "algo.reuse_iterations=3",
         "algo.base_reg_coef=0.1", "algo.kl_convex=0.5", "algo.reincarnate_at=96", id="reinflow-remix"),
    case("flow_sde", "flow", "algo.num_steps=4"),
    case("fpo", "flow", "algo.num_steps=4", "algo.actor_kwargs.num_samples=2"),
    case("dsrl_ppo", "flow", "algo.num_steps=4", "algo.actor_kwargs.hidden=16"),
    # one GRPO iteration = every env runs one 8-step episode (4 chunks): 32 env steps; the dense env
    # reward makes the groups informative (no reach episode succeeds in 8 steps)
    case("grpo", "flow", "algo.group_size=2", "task.max_episode_steps=8", "algo.reward=env",
         "algo.actor_kwargs.noise_hidden=16"),
    case("residual_offpolicy", "flow", *RESIDUAL_OFF_POLICY),
    # the former name, with the SAC learner (the preset's default is TD3)
    case("residual_sac", "flow", *RESIDUAL_OFF_POLICY, "algo.learner=sac", id="residual_sac-sac"),
    # RLPD with expert takeovers that span the checkpoints (the expert's state and the trigger's resume)
    case("rlpd", "flow", *RESIDUAL_OFF_POLICY, "algo.interventions=expert", "algo.intervention_trigger=random",
         "algo.intervention_prob=0.2", "algo.intervention_steps=5"),
    case("dsrl", "flow", *DSRL),
    case("dsrl_na", "flow", *DSRL),
    # the envs step in a thread while the learner trains: the run stays deterministic
    case("dsrl_na", "flow", *DSRL, "algo.pipeline=true", id="dsrl_na-pipeline"),
    case("recap", "flow", "algo.rollout_steps=8", "algo.policy_updates=2", "algo.value_updates=2",
         "algo.batch_size=16"),
    case("qc_fql", "flow", "algo.offline_updates=3", "algo.batch_size=16", "algo.hidden_sizes=[16,16]"),
    case("sac_flow", "flow", "algo.batch_size=16", "algo.critic_only_steps=32", "algo.critic_hidden_sizes=[16,16]"),
]


def test_every_algo_has_an_exact_resume_case():
    assert set(ALGOS) <= {case.values[0] for case in RESUME_CASES}


@pytest.mark.parametrize("algo,policy,extra", RESUME_CASES)
@pytest.mark.e2e
def test_a_resumed_run_continues_exactly_as_if_never_stopped(algo, policy, extra, checkpoints, tmp_path, capsys):  # noqa: F811
    on_policy = ALGOS[algo] == "embodied_rl.algos.ppo"
    tiny = TINY if on_policy else TINY[:-1]  # the off-policy presets have no actor_kwargs
    common = [f"algo={algo}", f"checkpoint={checkpoints / policy}", "eval_every=64", "checkpoint_every=64",
              *tiny, *extra]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(["finetune", "env_steps=192", f"run_dir={whole}", *common]) == 0, capsys.readouterr().err
    assert main(["finetune", "env_steps=64", f"run_dir={parts}", *common]) == 0, capsys.readouterr().err
    assert main(["finetune", "env_steps=192", f"run_dir={parts}", *common]) == 0, capsys.readouterr().err
    expected, resumed = train_rows(whole), train_rows(parts)
    assert len(expected) >= 4 and resumed == expected
    trained = {key for step, row in expected.items() if step > 64 for key in row}
    assert trained & {"train/policy_loss", "train/actor_loss", "train/bc_loss"}  # the policy trains after the resume
    assert read_best(parts / "checkpoints") == read_best(whole / "checkpoints") is not None  # it knows its best
    # what acts is judged on paired evaluations (algo.deploy; residual TD3's own rule: algo.floor_reach), and the
    # verdicts survive the resume: the same evaluation rows
    assert eval_rows(parts) == eval_rows(whole)
    judges_weights = ALGOS[algo] != "embodied_rl.algos.residual_offpolicy"
    evaluations = eval_rows(whole)
    assert len(evaluations) >= 3 and [step for step, row in evaluations.items() if "eval/deployed_step" in row] == (
        [step for step in evaluations if step > 0] if judges_weights else [])


def eval_rows(run_dir):
    """Evaluation rows by step, timings dropped."""
    return {row["step"]: {k: v for k, v in row.items() if k.startswith("eval/") and not k.endswith("_s")}
            for row in read_metrics(run_dir) if "eval/success_rate" in row}


def test_a_gpu_runs_rng_state_holds_its_cuda_generator(monkeypatch, tmp_path):
    """On a GPU the sampling noise comes from the CUDA generator: a checkpoint's RNG state keeps it
    and a resume restores it (without it a resumed run on an H200 diverged from the uninterrupted
    one at its first update after the resume). No GPU here: torch.cuda's generator is stood in for."""
    from embodied_rl.algos import common

    generator = {"state": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": generator["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": generator.update(state=state))
    torch.save(common.rng_state(), tmp_path / "rng.pt")
    generator["state"] = torch.tensor([9, 9, 9], dtype=torch.uint8)  # the run drew on after the checkpoint
    common.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert generator["state"].tolist() == [1, 2, 3]
    # a process that never used the GPU saves no CUDA state, and restoring its state leaves the generator alone
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    state = common.rng_state()
    assert "cuda" not in state
    common.set_rng_state(state)
    assert generator["state"].tolist() == [1, 2, 3]


@pytest.mark.e2e
def test_remix_replays_recent_rollouts_until_its_reincarnation(checkpoints, tmp_path):  # noqa: F811
    """Iterations of 16 rows (32 env steps): up to two earlier rollouts replayed, none from the
    rollout that starts at reincarnate_at=96 env steps on; the ratio to the weights before each
    update is 1 on its first minibatch, replayed rows or not."""
    assert main(["finetune", "algo=reinflow", f"checkpoint={checkpoints / 'flow'}", "env_steps=192", "eval_every=0",
                 f"run_dir={tmp_path}", *TINY, "algo.num_steps=4", "algo.actor_kwargs.noise_hidden=16",
                 "algo.reuse_iterations=3", "algo.base_reg_coef=0.1", "algo.kl_convex=0.5",
                 "algo.reincarnate_at=96", "algo.critic_warmup_iters=0"]) == 0
    rows = [row for row in read_metrics(tmp_path) if "train/replayed_rows" in row]
    assert [row["train/replayed_rows"] for row in rows] == [0, 16, 32, 0, 0, 0]
    assert all(row["train/first_minibatch_ratio_dev"] == 0 for row in rows)
    # at the reincarnation the anchor is the precedent: the two KLs of the regulariser agree
    assert rows[3]["train/base_kl"] == pytest.approx(rows[3]["train/kl_precedent"])


def test_remix_kl_convex_needs_the_base_regulariser(checkpoints, tmp_path, capsys):  # noqa: F811
    assert main(["finetune", "algo=reinflow", f"checkpoint={checkpoints / 'flow'}", f"run_dir={tmp_path / 'r'}",
                 *TINY, "algo.kl_convex=0.5"]) == 2
    assert "algo.kl_convex must be 1 unless algo.base_reg_coef > 0" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.e2e
def test_a_decaying_anchor_falls_linearly_to_zero(checkpoints, tmp_path):  # noqa: F811
    """base_reg_decay_steps: the regulariser's weight at each update is base_reg_coef times the share
    of the decay left at the rollout's start (32 env steps per iteration here), then 0."""
    assert main(["finetune", f"checkpoint={checkpoints / 'flow'}", "env_steps=128", "eval_every=0",
                 f"run_dir={tmp_path}", *TINY, *RESIDUAL, "algo.base_reg_coef=0.5", "algo.base_reg_decay_steps=64",
                 "algo.critic_warmup_iters=0", "algo.base_reg_window=null"]) == 0
    rows = [row for row in read_metrics(tmp_path) if "train/base_reg_coef" in row]
    assert [row["train/base_reg_coef"] for row in rows] == [0.5, 0.25, 0.0, 0.0]
    assert rows[1]["train/base_kl"] > 0  # the residual actor's KL to its base (a zero residual), while it weighs
    assert "train/base_kl" not in rows[2]


@pytest.mark.e2e
def test_an_earned_anchor_keeps_its_weight_until_training_success_releases_it(checkpoints, tmp_path):  # noqa: F811
    """base_reg_window: after the schedule the weight is base_reg_coef * (1 - release), the release
    starting at 0.05 and moved by windows of training episodes against the critic warm-up's."""
    assert main(["finetune", f"checkpoint={checkpoints / 'flow'}", "env_steps=320", "eval_every=0",
                 f"run_dir={tmp_path}", *TINY, *RESIDUAL, "algo.base_reg_coef=0.5", "algo.base_reg_decay_steps=64",
                 "algo.critic_warmup_iters=1", "algo.base_reg_window=1", "algo.high_start=null"]) == 0
    rows = [row for row in read_metrics(tmp_path) if "train/base_reg_coef" in row]
    schedule = [0.5 * max(0.0, 1 - 32 * i / 64) for i in range(len(rows))]
    releases = [row["train/anchor_release"] for row in rows]
    assert all(0.05 <= release <= 1 for release in releases) and releases[0] == 0.05
    assert [row["train/base_reg_coef"] for row in rows] == pytest.approx(
        [max(s, 0.5 * (1 - r)) for s, r in zip(schedule, releases)])
    assert rows[-1]["train/base_reg_coef"] > 0  # past the schedule the anchor still holds what is not earned


@pytest.mark.e2e
@pytest.mark.parametrize("high_start", [0.0, 1.0])
def test_the_anchor_is_earned_only_at_a_high_start(checkpoints, tmp_path, high_start):  # noqa: F811
    """high_start: the earned release holds the anchor only where the step-0 evaluation
    succeeds at least that often (the untrained tiny policy's success is below 1, at least 0); else
    the weight is the schedule's alone. The rule evaluates step 0 (and so the end) even at eval_every=0."""
    assert main(["finetune", f"checkpoint={checkpoints / 'flow'}", "env_steps=256", "eval_every=0",
                 f"run_dir={tmp_path}", *TINY, *RESIDUAL, "algo.base_reg_coef=0.5", "algo.base_reg_decay_steps=64",
                 "algo.critic_warmup_iters=1", "algo.base_reg_window=1",
                 f"algo.high_start={high_start}"]) == 0
    metrics = read_metrics(tmp_path)
    evaluated = [row["step"] for row in metrics if "eval/success_rate" in row]
    assert evaluated[0] == 0 and evaluated[-1] == 256 and metrics[0]["eval/success_rate"] < 1
    rows = [row for row in metrics if "train/base_reg_coef" in row]
    schedule = [0.5 * max(0.0, 1 - 32 * i / 64) for i in range(len(rows))]
    earned = high_start == 0.0
    assert {row["train/anchor_earned"] for row in rows} == {float(earned)}
    assert [row["train/base_reg_coef"] for row in rows] == pytest.approx(
        [max(s, 0.5 * (1 - row["train/anchor_release"])) if earned else s for s, row in zip(schedule, rows)])
    assert (rows[-1]["train/base_reg_coef"] > 0) == earned


@pytest.mark.e2e
def test_a_resumed_run_keeps_its_first_part_s_high_start_verdict(checkpoints, tmp_path, capsys):  # noqa: F811
    """The verdict is the first part's, kept in its checkpoint: the resumed part neither evaluates step 0
    again nor judges the start (its first training rows come before any evaluation it runs)."""
    args = ["finetune", f"checkpoint={checkpoints / 'flow'}", "eval_every=0", f"run_dir={tmp_path}", *TINY, *RESIDUAL,
            "algo.base_reg_coef=0.5", "algo.base_reg_decay_steps=64", "algo.critic_warmup_iters=1",
            "algo.base_reg_window=1", "algo.high_start=0.0"]
    assert main([*args, "env_steps=128"]) == 0
    assert "a high start (algo.high_start=0.0)" in capsys.readouterr().out
    assert main([*args, "env_steps=256"]) == 0
    assert "high start" not in capsys.readouterr().out
    metrics = read_metrics(tmp_path)
    assert [row["step"] for row in metrics if "eval/success_rate" in row] == [0, 128, 256]
    rows = [row for row in metrics if "train/anchor_earned" in row]
    assert rows[-1]["step"] == 256 and {row["train/anchor_earned"] for row in rows} == {1.0}


@pytest.mark.e2e
def test_judged_ppo_keeps_the_pretrained_weights_deployed_until_current_ones_win_and_trains_as_without(
        checkpoints, tmp_path):  # noqa: F811
    """algo.deploy=judged (the default): two evaluations on the same episodes at every evaluation after the start
    (4 paired episodes never resolve a win: p >= 1/16), so the agent files of every checkpoint stay the pretrained
    weights (those of a run stopped at 128 and resumed to 256 are those of one stopped at 128), while training goes
    on from the current weights: the same training rows as algo.deploy=latest, whose agent moves."""
    args = ["finetune", f"checkpoint={checkpoints / 'flow'}", "eval_every=128", "eval_episodes=4", *TINY, *RESIDUAL,
            "algo.base_reg_coef=0", "algo.base_reg_decay_steps=null", "algo.base_reg_window=null", "algo.high_start=null"]
    for env_steps in (128, 256):  # stopped and resumed: the deployed weights are kept in the checkpoint
        assert main([*args, f"env_steps={env_steps}", f"run_dir={tmp_path / 'judged'}"]) == 0
        (tmp_path / f"agent_{env_steps}").write_bytes(
            (tmp_path / "judged" / "checkpoints" / "last" / "agent.safetensors").read_bytes())
    assert main([*args, "env_steps=256", f"run_dir={tmp_path / 'latest'}", "algo.deploy=latest"]) == 0
    judged, latest = read_metrics(tmp_path / "judged"), read_metrics(tmp_path / "latest")
    assert [(row["step"], row["eval/deployed_step"]) for row in judged if "eval/deployed_step" in row] == [(128, 0), (256, 0)]
    assert not any("eval/deployed_step" in row for row in latest)
    evaluations = [row["eval/success_rate"] for row in judged if "eval/success_rate" in row]
    assert len(evaluations) == 3 and len(set(evaluations)) == 1  # the same weights on the same episodes
    training = [[row.get("train/approx_kl") for row in rows if "train/approx_kl" in row] for rows in (judged, latest)]
    assert training[0] == training[1] and training[0]  # the rollouts act with the current weights either way
    assert (tmp_path / "agent_128").read_bytes() == (tmp_path / "agent_256").read_bytes()
    state = torch.load(tmp_path / "judged" / "checkpoints" / "last" / "training_state" / "state.pt", weights_only=True)
    assert state["evaluation"]["step"] == 0
    moved = (tmp_path / "latest" / "checkpoints" / "last" / "agent.safetensors").read_bytes()
    assert moved != (tmp_path / "agent_256").read_bytes()


def test_a_bad_deploy_exits_2(checkpoints, tmp_path, capsys):  # noqa: F811
    assert main(["finetune", f"checkpoint={checkpoints / 'flow'}", f"run_dir={tmp_path / 'r'}", *TINY,
                 *RESIDUAL, "algo.deploy=best"]) == 2
    assert "algo.deploy must be judged or latest" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_high_start_out_of_range_exits_2(checkpoints, tmp_path, capsys):  # noqa: F811
    assert main(["finetune", f"checkpoint={checkpoints / 'flow'}", f"run_dir={tmp_path / 'r'}", *TINY,
                 *RESIDUAL, "algo.high_start=-0.1"]) == 2
    assert "algo.high_start must be in [0, 1] or null" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_an_earned_anchor_needs_ppo_and_the_regulariser(checkpoints, tmp_path, capsys):  # noqa: F811
    assert main(["finetune", f"checkpoint={checkpoints / 'flow'}", f"run_dir={tmp_path / 'r'}", *TINY,
                 *RESIDUAL, "algo.base_reg_coef=0", "algo.base_reg_decay_steps=null", "algo.base_reg_window=50"]) == 2
    assert "algo.base_reg_window must be null unless algo.base_reg_coef > 0" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_decay_needs_the_regulariser_it_schedules(checkpoints, tmp_path, capsys):  # noqa: F811
    assert main(["finetune", f"checkpoint={checkpoints / 'flow'}", f"run_dir={tmp_path / 'r'}", *TINY,
                 "algo.base_reg_coef=0", "algo.base_reg_decay_steps=1000"]) == 2
    assert "algo.base_reg_decay_steps must be null unless algo.base_reg_coef > 0" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_multi_task_window_logs_each_instructions_training_success(tmp_path):
    """Finished episodes carry their instruction id (final_obs["instruction"]); a window's row adds
    rollout/success_rate/<instruction> and rollout/episodes/<instruction> per instruction its
    episodes had, and the window survives a checkpoint. A window whose episodes are not all
    labelled (one a pre-instruction checkpoint left) logs none rather than misattribute them."""
    settings = {"env_steps": 100, "checkpoint_every": 10, "log_every": 10, "eval_every": 0}
    texts = ["push the red block", "stack the cubes", "open the drawer"]

    def finished(instructions, successes):
        ended = torch.tensor([True] * len(successes) + [False])  # a last env still running
        return {"_episode": ended, "final_obs": {"state": torch.zeros(len(ended), 2),
                                                 "instruction": torch.tensor([*instructions, 1])},
                "episode": {"return": torch.tensor([*successes, 0.0]),
                            "success_once": torch.tensor([*successes, 0.0]) > 0}}

    run = Run(tmp_path / "run")
    loop = FinetuneLoop(settings, run, evaluation=None)
    loop.resume({"net": torch.nn.Linear(2, 2)}, {}, write_agent=lambda directory: None)
    loop.start("test", instructions=texts)
    loop.advance(5, finished([0, 2, 0, 2], [1.0, 0.0, 1.0, 1.0]))
    loop.save({})  # mid-window: the window's episodes and their instructions are in the checkpoint
    resumed = FinetuneLoop(settings, run, evaluation=None)
    resumed.resume({"net": torch.nn.Linear(2, 2)}, {}, write_agent=lambda directory: None)
    resumed.start("test", instructions=texts)
    resumed.advance(5, finished([2], [0.0]))
    assert resumed.log({})
    row = read_metrics(tmp_path / "run")[-1]
    assert row["rollout/success_rate"] == 0.6 and row["rollout/episodes"] == 5
    by_instruction = {key: value for key, value in row.items() if key.startswith("rollout/success_rate/")}
    assert by_instruction == {"rollout/success_rate/push the red block": 1.0,
                              "rollout/success_rate/open the drawer": pytest.approx(1 / 3)}
    assert row["rollout/episodes/push the red block"] == 2 and row["rollout/episodes/open the drawer"] == 3
    # a window holding episodes without an id (recorded before ids were) names no instruction
    resumed.record_episodes([1.0], [1.0])
    resumed.advance(10, finished([1], [1.0]))
    assert resumed.log({}) and not any(key.startswith("rollout/success_rate/") for key in read_metrics(tmp_path / "run")[-1])
    # a single-instruction task has only its overall rate
    single_run = Run(tmp_path / "single")
    single = FinetuneLoop(settings, single_run, evaluation=None)
    single.resume({"net": torch.nn.Linear(2, 2)}, {}, write_agent=lambda directory: None)
    single.start("test", instructions=texts[:1])
    single.advance(10, finished([0, 0], [1.0, 0.0]))
    assert single.log({}) and [key for key in read_metrics(tmp_path / "single")[-1] if key.startswith("rollout/")] == [
        "rollout/return", "rollout/success_rate", "rollout/episodes"]
    run.close()
    single_run.close()
