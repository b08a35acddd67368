"""`embodied-rl pretrain` end to end through the CLI."""

import json
import shutil

import numpy as np
import pytest
import torch

from embodied_rl.cli import main
from embodied_rl.data import write_demos
from embodied_rl.policies import load_policy

TINY = ["policy.mlp.hidden_dim=32", "policy.mlp.num_blocks=1", "policy.mlp.time_dim=16",
        "batch_size=32", "log_every=5"]


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    rng = np.random.default_rng(0)
    episodes = []
    for _ in range(4):
        obs = rng.uniform(-1, 1, size=(20, 8)).astype(np.float32)
        episodes.append({"obs": obs, "action": np.tanh(obs[:, :2]), "reward": np.zeros(20, np.float32),
                         "success": True})
    path = tmp_path_factory.mktemp("data") / "demos.zarr"
    return write_demos(path, episodes, {"task": "reach", "obs_dim": 8, "action_dim": 2})


@pytest.mark.parametrize("policy", ["diffusion", "shortcut"])
@pytest.mark.e2e
def test_pretrain_without_eval(toy_data, tmp_path, policy):
    run_dir = tmp_path / "run"
    code = main(["pretrain", "task=reach", f"policy={policy}", f"data={toy_data}", "steps=10",
                 "eval_every=5", "eval_episodes=0", f"run_dir={run_dir}", *TINY])
    assert code == 0
    assert {p.name for p in (run_dir / "checkpoints").iterdir()} == {"5", "10", "last"}
    assert (run_dir / "checkpoints" / "last" / "training_state" / "optimizer.safetensors").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [5, 10]
    assert all(np.isfinite(r["train/loss"]) and r["train/lr"] >= 0 for r in rows if "train/loss" in r)
    assert (run_dir / "tb").is_dir()
    loaded = load_policy(run_dir / "checkpoints" / "last")
    assert loaded.policy_type == policy and loaded.task == "reach" and loaded.obs_dim == 8
    chunk = loaded.predict_chunk(torch.zeros(1, 2, 8))
    assert chunk.shape == (1, 16, 2)


@pytest.mark.parametrize(
    "override, message",
    [("data=/does/not/exist", "does not exist"), ("steps=0", "steps must be"),
     ("policy.n_action_steps=20", "bad policy config"), ("obs=depth", "obs must be"),
     ("task=push_t", "collected on task 'reach'"), ("obs=pixels", "no pixels")],
)
def test_pretrain_bad_config_exits_2(toy_data, tmp_path, capsys, override, message):
    run_dir = tmp_path / "run"
    code = main(["pretrain", "task=reach", f"data={toy_data}", "steps=3", "eval_episodes=0",
                 f"run_dir={run_dir}", *TINY, override])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (run_dir / "checkpoints").exists()


def test_pretrain_requires_data(capsys):
    assert main(["pretrain", "task=reach", "eval_episodes=0"]) == 2
    assert "data=PATH is required" in capsys.readouterr().err


@pytest.mark.e2e
def test_pretrain_on_reach_with_eval(tmp_path, capsys):
    pytest.importorskip("embodied_rl.envs")
    pytest.importorskip("embodied_rl.eval.evaluate")
    data = tmp_path / "demos.zarr"
    assert main(["collect", "task=reach", "demos=4", "num_envs=4", f"out={data}",
                 f"run_dir={tmp_path / 'collect'}"]) == 0
    run_dir = tmp_path / "pretrain"
    code = main(["pretrain", "task=reach", "policy=flow", f"data={data}", "steps=20",
                 "eval_episodes=2", "videos=1", f"run_dir={run_dir}", *TINY])
    assert code == 0
    out = capsys.readouterr().out
    assert "success_rate" in out and "checkpoint" in out
    for name in ("config.yaml", "metrics.jsonl", "eval_info.json", "checkpoints/20", "checkpoints/last",
                 "videos/episode_0.mp4"):
        assert (run_dir / name).exists(), name
    info = json.loads((run_dir / "eval_info.json").read_text())
    assert info["overall"]["n_episodes"] == 2 and len(info["per_episode"]) == 2
    assert info["per_episode"][0]["video"] == "videos/episode_0.mp4"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/success_rate" in r for r in rows)


def test_pretrain_refuses_a_dataset_with_a_missing_chunk(tmp_path, capsys):
    data = tmp_path / "demos.zarr"
    assert main(["collect", "task=reach", "demos=2", "num_envs=2", f"out={data}",
                 f"run_dir={tmp_path / 'collect'}"]) == 0
    chunk = next((data / "data" / "action" / "c").rglob("*"))
    while chunk.is_dir():
        chunk = next(chunk.iterdir())
    chunk.unlink()  # zarr would read the missing chunk as zeros
    capsys.readouterr()
    run_dir = tmp_path / "pretrain"
    assert main(["pretrain", "task=reach", f"data={data}", "steps=2", "eval_episodes=0",
                 f"run_dir={run_dir}", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "data/action is missing 1 of its 1 chunk files" in err
    assert not run_dir.exists()


def test_a_stopped_pretrain_resumes_exactly(toy_data, tmp_path, capsys):
    from safetensors.torch import load_file

    def run(run_dir):
        return main(["pretrain", "task=reach", "policy=flow", f"data={toy_data}", "steps=12", "eval_every=4",
                     "eval_episodes=0", f"run_dir={run_dir}", *TINY])

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run(whole) == 0
    assert run(parts) == 0
    # stopped before step 12's checkpoint, with step 8's training state damaged: it resumes from step 4
    for name in ("12", "last"):
        shutil.rmtree(parts / "checkpoints" / name)
    (parts / "done.json").unlink()
    (parts / "checkpoints" / "8" / "training_state" / "optimizer.safetensors").write_bytes(b"damaged")
    capsys.readouterr()
    assert run(parts) == 0
    captured = capsys.readouterr()
    assert "cannot resume from checkpoint" in captured.err and "checkpoints/8'" in captured.err
    assert "resuming from step 4 of 12" in captured.out
    for name in ("model.safetensors", "training_state/model.safetensors"):
        a, b = (load_file(d / "checkpoints" / "last" / name) for d in (whole, parts))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    losses = [(r["step"], r["train/loss"]) for r in (json.loads(line) for line in
              (parts / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    assert [step for step, _ in losses] == [5, 10, 12]
