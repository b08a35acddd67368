"""`embodied-rl eval` through the CLI: bad input exits 2 with one line and creates nothing;
end-to-end on `reach` with a saved, randomly initialised policy."""

from __future__ import annotations

import json
import re

import pytest

from embodied_rl.cli import main


@pytest.mark.parametrize(
    "overrides,message",
    [
        ([], "checkpoint=DIR is required"),
        (["checkpoint={missing}"], "does not exist"),
        (["checkpoint={existing}", "episodes=0"], "episodes must be an integer >= 1"),
        (["checkpoint={existing}", "episodes=2", "videos=3"], "videos must be in [0, episodes=2]"),
        (["checkpoint={existing}", "videos=-1"], "videos must be an integer >= 0"),
        (["checkpoint={existing}", "num_envs=0"], "num_envs must be an integer >= 1"),
        (["checkpoint={existing}", "episodes=many"], "bad value for 'episodes'"),
        (["checkpoint={existing}", "task=nope"], "unknown task 'nope'"),
    ],
)
def test_bad_input_exits_2_and_creates_nothing(tmp_path, capsys, overrides, message):
    existing = tmp_path / "ckpt"
    existing.mkdir()
    run_dir = tmp_path / "run"
    args = [o.format(missing=tmp_path / "nope", existing=existing) for o in overrides]
    assert main(["eval", *args, f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert not run_dir.exists()


def test_corrupt_checkpoint_exits_2(tmp_path, capsys):
    pytest.importorskip("embodied_rl.policies")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{not json")
    (checkpoint / "model.safetensors").write_bytes(b"garbage")
    run_dir = tmp_path / "run"
    assert main(["eval", "task=reach", f"checkpoint={checkpoint}", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert str(checkpoint) in err and len(err.strip().splitlines()) == 1
    assert not run_dir.exists()


# ---------------------------------------------------------------- end to end on `reach`


@pytest.fixture(scope="module")
def reach_checkpoint(tmp_path_factory):
    """A tiny randomly initialised flow policy for `reach`, saved as a checkpoint."""
    torch = pytest.importorskip("torch")
    envs = pytest.importorskip("embodied_rl.envs")
    policies = pytest.importorskip("embodied_rl.policies")
    task = envs.make_task("reach")
    torch.manual_seed(0)
    policy = policies.make_policy(
        "flow", obs_dim=task.obs_dim, action_dim=task.action_dim, horizon=4, n_obs_steps=1,
        n_action_steps=4, num_inference_steps=2, task="reach",
    )
    return policies.save_policy(policy, tmp_path_factory.mktemp("ckpt") / "policy")


def run_eval(tmp_path, name, *overrides):
    run_dir = tmp_path / name
    assert main(["eval", *overrides, f"run_dir={run_dir}"]) == 0
    return json.loads((run_dir / "eval_info.json").read_text()), run_dir


@pytest.mark.e2e
def test_eval_reach_end_to_end(tmp_path, reach_checkpoint, capsys):
    import imageio.v2 as imageio

    from embodied_rl.eval.video import DEFAULT_FPS, end_hold_frames

    info, run_dir = run_eval(
        tmp_path, "run", "task=reach", f"checkpoint={reach_checkpoint}", "episodes=4", "videos=1",
        "video_size=64",
    )
    out = capsys.readouterr().out
    assert re.search(r"^success: \d+\.\d% \[\d+\.\d, \d+\.\d\]$", out, re.M), out  # the one headline format
    assert "n_episodes: 4" in out and f"run_dir: {run_dir}" in out
    overall = info["overall"]
    assert info["task"] == "reach" and info["checkpoint"] == str(reach_checkpoint.resolve())
    import mujoco

    assert info["simulator"] == {"mujoco": mujoco.__version__}  # a simulator upgrade can change every number
    assert overall["n_episodes"] == 4 and overall["num_envs"] == 4  # min(num_envs=50, episodes)
    assert 0 <= overall["pc_success"] <= 100
    low, high = overall["success_ci95"]
    assert 0 <= low <= overall["success_rate"] <= high <= 1
    assert [e["episode"] for e in info["per_episode"]] == [0, 1, 2, 3]
    assert info["per_episode"][0]["video"] == "videos/episode_0.mp4"
    assert all(e["video"] is None for e in info["per_episode"][1:])
    assert [p.name for p in (run_dir / "videos").iterdir()] == ["episode_0.mp4"]
    frames = imageio.mimread(run_dir / "videos" / "episode_0.mp4", memtest=False)
    assert len(frames) == info["per_episode"][0]["length"] + end_hold_frames(DEFAULT_FPS)
    assert frames[0].shape == (64, 64, 3)
    assert info["config"]["episodes"] == 4


@pytest.mark.e2e
def test_eval_is_deterministic_videos_change_nothing_and_episodes_replay(tmp_path, reach_checkpoint):
    args = [f"checkpoint={reach_checkpoint}", "num_envs=3", "episodes=6", "seed=7"]
    first, run_dir = run_eval(tmp_path, "a", *args, "videos=0")  # task taken from the checkpoint
    second, _ = run_eval(tmp_path, "b", *args, "videos=2", "video_size=32")
    assert first["task"] == "reach" and "name: reach" in (run_dir / "config.yaml").read_text()
    outcome = lambda e: (e["seed"], e["env_index"], e["success"], e["return"], e["length"])  # noqa: E731
    assert [outcome(e) for e in first["per_episode"]] == [outcome(e) for e in second["per_episode"]]
    assert len(list((tmp_path / "b" / "videos").glob("*.mp4"))) == 2

    # docs/evaluation.md: episode k replays as env k % N of a one-round eval seeded with its seed
    target = first["per_episode"][4]
    replay, _ = run_eval(tmp_path, "replay", f"checkpoint={reach_checkpoint}", "num_envs=3",
                         "episodes=3", "videos=0", f"seed={target['seed']}")
    again = replay["per_episode"][target["env_index"]]
    assert (again["success"], again["return"], again["length"]) == (
        target["success"], target["return"], target["length"])


def test_eval_task_mismatch_exits_2(tmp_path, reach_checkpoint, capsys):
    run_dir = tmp_path / "run"
    code = main(["eval", "task=push_t", f"checkpoint={reach_checkpoint}", f"run_dir={run_dir}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "trained on task 'reach' but task=push_t" in err and len(err.strip().splitlines()) == 1
    assert not run_dir.exists()


@pytest.mark.e2e
def test_eval_reward_only_task(tmp_path, capsys):
    """hopper has no success test: success fields are null, the return interval stands in."""
    torch = pytest.importorskip("torch")
    envs = pytest.importorskip("embodied_rl.envs")
    policies = pytest.importorskip("embodied_rl.policies")
    task = envs.make_task("hopper")
    torch.manual_seed(0)
    policy = policies.make_policy(
        "flow", obs_dim=task.obs_dim, action_dim=task.action_dim, horizon=4, n_obs_steps=1,
        n_action_steps=4, num_inference_steps=2, task="hopper",
    )
    checkpoint = policies.save_policy(policy, tmp_path / "policy")
    info, run_dir = run_eval(tmp_path, "run", f"checkpoint={checkpoint}", "episodes=3", "videos=1",
                             "video_size=64")
    overall = info["overall"]
    assert info["task"] == "hopper" and overall["has_success"] is False
    assert overall["pc_success"] is None and overall["success_ci95"] is None
    assert all(e["success"] is None for e in info["per_episode"])
    low, high = overall["sum_reward_ci95"]
    assert low <= overall["avg_sum_reward"] <= high
    out = capsys.readouterr().out
    assert "success:" not in out and "sum_reward_ci95:" in out
    assert (run_dir / "videos" / "episode_0.mp4").is_file()
