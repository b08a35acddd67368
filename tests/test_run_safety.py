"""What a run promises when the machine is busy, the output is redirected, the run is stopped
half-way or its input is bad: torch threads, progress lines, rows redone after a resume,
unreadable training state, refused runs that leave nothing, an unwritable run_dir, a full disk,
divergence and a growing loss."""

import errno
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from embodied_rl.cli import main
from embodied_rl.runs import Run, progress, read_metrics
from tests.test_finetune_cli import TINY, checkpoints  # noqa: F401  (a module fixture)
from tests.test_pretrain import TINY as BC_TINY
from tests.test_pretrain import toy_data  # noqa: F401  (a module fixture)

RESIDUAL = ["algo=residual_ppo", "algo.num_steps=8", "algo.actor_kwargs.hidden=16"]  # 32 env steps an iteration


def finetune(checkpoints, run_dir, *extra):  # noqa: F811
    return ["finetune", f"checkpoint={checkpoints / 'flow'}", f"run_dir={run_dir}", *TINY, *RESIDUAL, *extra]


def one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1


def test_torch_uses_one_thread_unless_told_otherwise(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        assert main(["tasks"]) == 0
        assert torch.get_num_threads() == 1
        assert main(["eval", "threads=2"]) == 2  # refused for its missing checkpoint, after setting threads
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert main(["eval"]) == 2
        assert torch.get_num_threads() == 3
        capsys.readouterr()
        assert main(["eval", "threads=0"]) == 2
        assert "threads must be an integer >= 1" in capsys.readouterr().err
    finally:
        torch.set_num_threads(1)


def test_progress_prints_lines_when_stderr_is_not_a_terminal(capsys):
    for _ in progress(range(4), total=4, desc="work", every_s=0):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("[work] 1/4 (25%) | ") and " it/s | ETA " in lines[0]
    assert lines[-1].startswith("[work] 4/4 (100%) | ") and " | took " in lines[-1]
    bar = progress(total=10, desc="resumed", initial=6, every_s=0)
    bar.set_postfix(loss="0.12")
    bar.update(2)
    assert capsys.readouterr().err.startswith("[resumed] 8/10 (80%) loss=0.12 | ")
    bar = progress(total=10, desc="quiet", show=False, every_s=0)
    bar.update(10)
    bar.close()
    assert capsys.readouterr().err == ""


@pytest.mark.e2e
def test_a_resume_redoes_rows_once_and_skips_unreadable_training_state(checkpoints, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "run"
    args = finetune(checkpoints, run_dir, "env_steps=96", "checkpoint_every=32", "eval_every=32")
    assert main(args) == 0
    assert (run_dir / "done.json").exists()
    # stopped after logging step 96 but before its checkpoint was complete; step 64's state damaged
    shutil.rmtree(run_dir / "checkpoints" / "96")
    (run_dir / "done.json").unlink()
    (run_dir / "checkpoints" / "64" / "training_state" / "state.pt").write_bytes(b"not a torch file")
    capsys.readouterr()
    assert main(args) == 0
    captured = capsys.readouterr()
    warning = [line for line in captured.err.splitlines() if "cannot resume" in line]
    assert len(warning) == 1 and "checkpoints/64'" in warning[0] and "64.unreadable" in warning[0]
    assert (run_dir / "checkpoints" / "64.unreadable").is_dir()  # kept for a look
    assert os.readlink(run_dir / "checkpoints" / "last") == "96" and (run_dir / "done.json").exists()
    rows = read_metrics(run_dir)
    for key in ("train/iteration", "eval/success_rate"):
        steps = [row["step"] for row in rows if key in row]
        assert steps == sorted(set(steps)), key  # one curve: the redone rows replaced the old ones
    assert [row["step"] for row in rows if "eval/success_rate" in row] == [0, 32, 64, 96]


def test_refused_runs_leave_nothing_behind(checkpoints, tmp_path, capsys, monkeypatch):  # noqa: F811
    run_dir = tmp_path / "run"
    assert main(finetune(checkpoints, run_dir, "env_steps=32", "algo.actor=nope")) == 2
    err = capsys.readouterr().err
    assert "unknown algo.actor 'nope'" in err and one_line(err) and not run_dir.exists()

    off_policy = ["finetune", "algo=residual_offpolicy", f"checkpoint={checkpoints / 'flow'}", *TINY[:-1]]
    assert main([*off_policy, "env_steps=10000", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "env_steps=10000 ends before the actor's first update" in err and one_line(err)
    assert not run_dir.exists()

    # a demo dataset found damaged only when the algorithm reads it: the new run_dir is removed again
    from embodied_rl.data.dataset import write_demos

    rng = np.random.default_rng(0)
    episodes = [{"obs": rng.standard_normal((10, 8)).astype(np.float32),
                 "action": rng.uniform(-1, 1, (10, 2)).astype(np.float32),
                 "reward": np.zeros(10, np.float32), "success": True} for _ in range(2)]
    data = write_demos(tmp_path / "demos.zarr", episodes, {"task": "reach", "obs_dim": 8, "action_dim": 2})
    chunk = next(p for p in (data / "data" / "action").rglob("*") if p.is_file() and p.name != "zarr.json")
    chunk.unlink()
    bad_data = ["finetune", "algo=rlpd", f"checkpoint={checkpoints / 'flow'}", *TINY[:-1], "env_steps=64",
                "algo.ensemble=2", f"algo.data={data}"]
    monkeypatch.chdir(tmp_path)  # the default run_dir, under runs/
    assert main(bad_data) == 2
    err = capsys.readouterr().err
    assert "data/action is missing 1 of its" in err and one_line(err)
    assert not list(tmp_path.glob("runs/*/*"))
    assert main([*bad_data, f"run_dir={run_dir}"]) == 2 and not run_dir.exists()
    capsys.readouterr()
    assert main(finetune(checkpoints, run_dir, "env_steps=32", "eval_every=0")) == 0  # the same run_dir, fixed


def test_a_run_dir_that_cannot_be_written_is_one_line(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    for run_dir in (tmp_path / "a_file" / "run", "/proc/embodied_rl/run"):
        assert main(["collect", "task=reach", "demos=1", "num_envs=1", f"run_dir={run_dir}"]) == 2
        err = capsys.readouterr().err
        assert f"cannot write run_dir '{run_dir}'" in err and one_line(err)


@pytest.mark.e2e
def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(checkpoints, tmp_path, capsys, monkeypatch):  # noqa: F811
    save = torch.save

    def save_until_the_disk_fills(obj, path, *args, **kwargs):
        if "/checkpoints/.64." in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_the_disk_fills)
    run_dir = tmp_path / "run"
    assert main(finetune(checkpoints, run_dir, "env_steps=96", "checkpoint_every=32", "eval_every=0")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: No space left on device writing ") and one_line(err)
    assert os.readlink(run_dir / "checkpoints" / "last") == "32"
    best = (run_dir / "checkpoints" / "best").resolve()  # the first evaluation's (residual PPO evaluates step 0)
    assert [path for path in (run_dir / "checkpoints").glob(".*") if path != best] == []  # the cut-short write is gone
    assert not (run_dir / "done.json").exists()


@pytest.mark.e2e
def test_bc_divergence_exits_3_and_checkpoints_last_stays_finite(toy_data, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "run"
    assert main(["pretrain", "task=reach", f"data={toy_data}", "steps=10", "eval_every=1", "eval_episodes=0",
                 "policy.lr=1e30", f"run_dir={run_dir}", *BC_TINY]) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: training diverged at step ") and " is not finite (" in err and one_line(err)
    last = run_dir / "checkpoints" / "last"
    if last.exists():
        assert all(torch.isfinite(t).all() for t in load_file(last / "model.safetensors").values())
    else:
        assert "no checkpoint was written" in err


def test_a_loss_growing_by_orders_of_magnitude_warns_once(tmp_path, capsys):
    run = Run(tmp_path / "run")
    for step, loss in enumerate([0.5, 2.0, 3e4, 1e6]):
        run.log(step, {"train/value_loss": loss})
    run.close()
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "train/value_loss is 3e+04 at step 2 (first logged: 0.5)" in err
    run = Run(tmp_path / "exploded_at_once")  # a learning rate so high that the first row is already huge
    run.log(1, {"train/value_loss": 1.5e13})
    run.close()
    assert "train/value_loss is 1.5e+13 at step 1" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["collect", "pretrain"])
@pytest.mark.e2e
def test_done_json_marks_a_finished_command(command, toy_data, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "run"
    args = (["collect", "task=reach", "demos=1", "num_envs=1"] if command == "collect" else
            ["pretrain", "task=reach", f"data={toy_data}", "steps=2", "eval_episodes=0", *BC_TINY])
    assert main([*args, f"run_dir={run_dir}"]) == 0
    assert (run_dir / "done.json").exists()


@pytest.mark.e2e
def test_finetune_and_eval_write_a_report(checkpoints, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "ft"
    tiny = [arg for arg in TINY if not arg.startswith("videos=")]
    assert main(["finetune", f"checkpoint={checkpoints / 'flow'}", f"run_dir={run_dir}", *tiny, *RESIDUAL,
                 "env_steps=64", "eval_every=32", "videos=1"]) == 0
    assert f"report: {run_dir / 'report.md'}" in capsys.readouterr().out
    report = (run_dir / "report.md").read_text()
    assert report.startswith("# Fine-tuning: reach with residual_ppo")
    assert "| start (step 0) |" in report and "| fine-tuned (step 64) |" in report
    assert "](plots/learning_curve.png)" in report and (run_dir / "plots" / "learning_curve.png").is_file()
    # what acts is judged (algo.deploy): 4 paired episodes never resolve a win, so the deployed weights' videos
    assert "](videos/step_64_deployed/episode_0.mp4)" in report and "tensorboard --logdir" in report
    assert "- wall s: " in report

    assert main(["eval", "task=reach", f"checkpoint={run_dir}", "episodes=2", "num_envs=2", "videos=1",
                 f"run_dir={tmp_path / 'eval'}"]) == 0
    report = (tmp_path / "eval" / "report.md").read_text()
    assert report.startswith("# Evaluation: reach") and "](videos/episode_0.mp4)" in report and "- eval s: " in report


def test_collect_and_eval_print_progress_lines_with_their_success(tmp_path, capsys):
    assert main(["collect", "task=reach", "demos=2", "num_envs=2", f"run_dir={tmp_path / 'collect'}"]) == 0
    assert "[collect] 2/2 (100%) success=" in capsys.readouterr().err  # stderr is no terminal here


def test_a_checkpoint_with_non_finite_weights_is_refused(checkpoints, tmp_path, capsys):  # noqa: F811
    from safetensors.torch import save_file

    broken = tmp_path / "nan"
    shutil.copytree(checkpoints / "flow", broken)
    weights = load_file(broken / "model.safetensors")
    name = next(iter(weights))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, broken / "model.safetensors")
    for command in (["eval", "episodes=2"], ["finetune", *RESIDUAL, "env_steps=32"]):
        assert main([*command, "task=reach", f"checkpoint={broken}", f"run_dir={tmp_path / command[0]}"]) == 2
        err = capsys.readouterr().err
        assert f"checkpoint '{broken}' holds non-finite weights" in err and one_line(err)
        assert not (tmp_path / command[0]).exists()


def test_a_run_stopped_before_its_first_checkpoint_starts_its_curve_over(toy_data, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    args = ["pretrain", "task=reach", f"data={toy_data}", "steps=10", "eval_episodes=0", f"run_dir={run_dir}", *BC_TINY]
    assert main(args) == 0
    shutil.rmtree(run_dir / "checkpoints")  # as if killed after logging, before the first checkpoint
    (run_dir / "done.json").unlink()
    assert main(args) == 0
    assert [row["step"] for row in read_metrics(run_dir) if "train/loss" in row] == [5, 10]


def test_a_run_resumes_across_settings_added_since_it_was_written(tmp_path, capsys):
    """A key missing from an earlier run's config.yaml is a setting the toolkit gained since:
    the run resumes with it, stated; a key whose value differs is refused."""
    from omegaconf import OmegaConf

    from embodied_rl.errors import UserError
    from embodied_rl.runs import check_previous_run

    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml({"algo": {"lr": 0.1}, "env_steps": 10}))
    now = OmegaConf.create({"algo": {"lr": 0.1, "ramp": 0}, "env_steps": 20, "run_dir": str(tmp_path)})
    check_previous_run(now, "finetune", ("env_steps",))
    assert "written before these settings existed: algo.ramp=0" in capsys.readouterr().out
    now.algo.lr = 0.2
    with pytest.raises(UserError, match=r"other settings \(algo.lr=0.1 -> 0.2\)"):
        check_previous_run(now, "finetune", ("env_steps",))
