"""Values every command shares are checked at start: one line, exit 2, no run directory; and a
checkpoint whose task is missing or wrong is refused the same way by eval and finetune."""

import json
import shutil

import pytest
import torch

from embodied_rl.cli import main

# the smallest arguments that get each command past its required keys (paths need not exist:
# the shared checks come first)
COMMANDS = {
    "collect": ["collect", "task=reach"],
    "pretrain": ["pretrain", "task=reach", "data=/no/such/demos.zarr"],
    "eval": ["eval", "task=reach", "checkpoint=/no/such/checkpoint"],
    "finetune": ["finetune", "task=reach", "checkpoint=/no/such/checkpoint"],
    "quickstart": ["quickstart", "task=reach"],
}

BAD = [
    ("seed=-5", "seed must be an integer >= 0, got -5"),
    ("device=tpu", "device must be cpu, cuda or cuda:N, got 'tpu'"),
    ("backend=bullet", "unknown backend 'bullet'"),
]
if not torch.cuda.is_available():
    BAD.append(("device=cuda", "device=cuda but torch cannot use CUDA here"))


def run_refused(tmp_path, capsys, args, message):
    run_dir = tmp_path / "run"
    assert main([*args, f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0, err
    assert not run_dir.exists()


@pytest.mark.parametrize("override,message", BAD)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_shared_values_are_checked_by_every_command(command, override, message, tmp_path, capsys):
    run_refused(tmp_path, capsys, [*COMMANDS[command], override], message)


@pytest.mark.parametrize("command,override,message", [
    ("collect", "num_envs=0", "num_envs must be an integer >= 1, got 0"),
    ("collect", "image_size=0", "image_size must be an integer >= 8, got 0"),
    ("eval", "episodes=0", "episodes must be an integer >= 1, got 0"),
    ("eval", "videos=3", "videos must be in [0, episodes=2], got 3"),
    ("eval", "video_size=0", "video_size must be an integer >= 16, got 0"),
    ("pretrain", "obs=depth", "obs must be one of state, pixels, got 'depth'"),
    ("pretrain", "eval_episodes=-1", "eval_episodes must be an integer >= 0, got -1"),
    ("finetune", "eval_episodes=0", "eval_episodes must be an integer >= 1, got 0"),
    ("finetune", "videos=-1", "videos must be an integer >= 0, got -1"),
    ("quickstart", "videos=200", "videos must be in [0, eval_episodes=100], got 200"),
])
def test_command_values_are_checked(command, override, message, tmp_path, capsys):
    args = [*COMMANDS[command], override]
    if command == "eval":
        args.append("episodes=2" if override != "episodes=0" else "videos=0")
    run_refused(tmp_path, capsys, args, message)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A reach checkpoint, one without its task, one with an unknown task and one whose sizes
    are not reach's."""
    from embodied_rl.policies import make_policy, save_policy

    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)

    def save(name, obs_dim=8, task="reach"):
        policy = make_policy("flow", obs_dim=obs_dim, action_dim=2, n_obs_steps=1, horizon=4, n_action_steps=4,
                             num_inference_steps=2, task=task)
        return save_policy(policy, root / name)

    save("reach")
    save("wrong_sizes", obs_dim=5)
    for name, task in (("no_task", None), ("unknown_task", "nope")):
        shutil.copytree(root / "reach", root / name)
        config = json.loads((root / name / "config.json").read_text())
        config["task"] = config["policy"]["task"] = task
        (root / name / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize("name,task,message", [
    ("no_task", "reach", "does not record the task it was trained on"),
    ("unknown_task", "reach", "was trained on task 'nope', which is not a known task"),
    ("reach", "push_t", "was trained on task 'reach' but task=push_t; pass task=reach"),
    ("wrong_sizes", "reach", "has observation and action sizes (5, 2), but task 'reach' has (8, 2)"),
])
@pytest.mark.parametrize("command", ["eval", "finetune"])
def test_a_checkpoint_with_a_missing_or_wrong_task_is_refused(command, name, task, message, checkpoints,
                                                              tmp_path, capsys):
    args = [command, f"task={task}", f"checkpoint={checkpoints / name}", "videos=0"]
    run_refused(tmp_path, capsys, args, message)


def test_eval_without_task_refuses_a_checkpoint_without_one(checkpoints, tmp_path, capsys):
    run_refused(tmp_path, capsys, ["eval", f"checkpoint={checkpoints / 'no_task'}"], "does not record the task")
