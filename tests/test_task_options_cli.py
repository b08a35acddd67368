"""Task config keys reach the env: task.max_episode_steps=7 runs 7-step episodes on collect,
pretrain, eval and finetune, and a key that contradicts the task is refused with exit 2."""

import json

import numpy as np
import pytest

import embodied_rl.envs as envs
from embodied_rl.cli import main
from embodied_rl.data import DemoDataset

SHORT = ["task=reach", "task.max_episode_steps=7"]
TINY_POLICY = ["policy=flow", "policy.mlp.hidden_dim=16", "policy.mlp.num_blocks=1",
               "policy.mlp.time_dim=8", "batch_size=16", "log_every=1"]


def episode_lengths(run_dir):
    return [e["length"] for e in json.loads((run_dir / "eval_info.json").read_text())["per_episode"]]


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    """collect then pretrain reach with 7-step episodes."""
    root = tmp_path_factory.mktemp("short")
    assert main(["collect", *SHORT, "demos=4", "only_success=false", "num_envs=2",
                 f"run_dir={root / 'collect'}"]) == 0
    assert main(["pretrain", *SHORT, *TINY_POLICY, f"data={root / 'collect' / 'demos.zarr'}", "steps=2",
                 "eval_episodes=3", "num_envs=3", "videos=0", f"run_dir={root / 'pretrain'}"]) == 0
    return root


@pytest.mark.e2e
def test_collect_and_pretrain_run_the_overridden_length(short_runs):
    dataset = DemoDataset.load(short_runs / "collect" / "demos.zarr")
    lengths = np.diff(dataset.episode_ends, prepend=0)
    assert lengths.max() == 7 and lengths.min() >= 1
    lengths = episode_lengths(short_runs / "pretrain")
    assert max(lengths) == 7 and len(lengths) == 3


def test_eval_runs_the_overridden_length(short_runs, tmp_path):
    checkpoint = short_runs / "pretrain" / "checkpoints" / "last"
    assert main(["eval", *SHORT, f"checkpoint={checkpoint}", "episodes=3", "num_envs=3", "videos=0",
                 f"run_dir={tmp_path / 'eval'}"]) == 0
    assert max(episode_lengths(tmp_path / "eval")) == 7


@pytest.mark.e2e
def test_finetune_makes_every_env_with_the_overrides(short_runs, tmp_path, monkeypatch):
    made = []
    make = envs.make

    def recording_make(*args, **kwargs):
        made.append(kwargs.get("task_options"))
        return make(*args, **kwargs)

    monkeypatch.setattr(envs, "make", recording_make)
    run_dir = tmp_path / "ft"
    assert main(["finetune", *SHORT, "algo=residual_ppo", f"checkpoint={short_runs / 'pretrain'}",
                 "env_steps=28", "num_envs=2", "eval_episodes=2", "videos=0",
                 "algo.num_steps=7", "algo.actor_kwargs.hidden=16", f"run_dir={run_dir}"]) == 0
    assert made == [{"max_episode_steps": 7}] * 2  # the training env and the evaluation env
    assert max(episode_lengths(run_dir)) == 7


@pytest.mark.parametrize("override,message", [
    ("task.has_success=false", "task.has_success=False contradicts task 'reach'"),
    ("task.expert=false", "task.expert=False contradicts task 'reach'"),
    ("task.max_episode_steps=0", "task.max_episode_steps must be >= 1"),
])
def test_a_contradicting_task_key_is_one_line_and_leaves_no_run_dir(override, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["collect", "task=reach", override, "demos=1", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0
    assert not run_dir.exists()


@pytest.mark.e2e
def test_quickstart_hands_the_task_keys_to_its_stages(monkeypatch, tmp_path):
    from embodied_rl.commands import quickstart

    class Stop(Exception):
        pass

    def first_stage(command, module, overrides, run_dir, resumable=False):
        raise Stop(overrides)

    monkeypatch.setattr(quickstart, "run_stage", first_stage)
    with pytest.raises(Stop) as stopped:
        main(["quickstart", *SHORT, "task.process.workers=2", f"run_dir={tmp_path / 'qs'}"])
    assert "task.max_episode_steps=7" in stopped.value.args[0]
    assert "task.process.workers=2" in stopped.value.args[0]  # a mapping's keys one by one
