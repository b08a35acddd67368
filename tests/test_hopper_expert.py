"""The shipped hopper expert (assets/experts/hopper.safetensors) and BC on hopper through the CLI."""

import json
import os

import pytest
import torch

from embodied_rl.cli import main
from embodied_rl.envs import make, make_expert
from embodied_rl.envs.experts import hopper as hopper_expert
from embodied_rl.errors import UserError

os.environ.setdefault("MUJOCO_GL", "egl")

TINY = ["policy.mlp.hidden_dim=32", "policy.mlp.num_blocks=1", "policy.mlp.time_dim=16",
        "batch_size=32", "log_every=5"]


def rollout_return(act, steps: int = 400, num_envs: int = 16, seed: int = 0) -> float:
    """Mean over envs of the return of each env's first episode, cut at `steps` steps."""
    env = make("hopper", num_envs=num_envs)
    obs, _ = env.reset(seed=seed)
    total = torch.zeros(num_envs)
    alive = torch.ones(num_envs, dtype=torch.bool)
    for _ in range(steps):
        obs, reward, _, _, info = env.step(act(env, obs))
        total += reward * alive
        alive &= ~info["_final"]
    env.close()
    return float(total.mean())


def expert_policy(quality: float):
    expert = None

    def act(env, obs):
        nonlocal expert
        if expert is None:
            expert = make_expert("hopper", env, quality=quality, generator=torch.Generator().manual_seed(0))
        return expert.act(obs)

    return act


@pytest.mark.e2e
def test_shipped_expert_beats_zero_and_random_policies():
    generator = torch.Generator().manual_seed(0)
    expert = rollout_return(expert_policy(1.0))
    zero = rollout_return(lambda env, obs: torch.zeros(env.num_envs, 3))
    random = rollout_return(lambda env, obs: torch.rand(env.num_envs, 3, generator=generator) * 2 - 1)
    # 400 steps: the expert hops forward (~3 per step); zero/random torques fall within ~150 steps
    assert expert > 3 * max(zero, random) and expert > 600, (expert, zero, random)


@pytest.mark.e2e
def test_lower_quality_lowers_return():
    best = rollout_return(expert_policy(1.0))
    middle = rollout_return(expert_policy(0.5))
    worst = rollout_return(expert_policy(0.0))
    assert worst < 0.9 * middle and middle < 0.9 * best, (best, middle, worst)


def test_missing_expert_weights_is_a_user_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(hopper_expert.Expert, "weights_path", tmp_path / "nope.safetensors")
    code = main(["collect", "task=hopper", "demos=1", f"run_dir={tmp_path / 'run'}"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "hopper expert weights not found" in err and len(err.splitlines()) == 1


def test_corrupt_expert_weights_is_a_user_error(tmp_path):
    corrupt = tmp_path / "hopper.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(UserError, match="unreadable") as error:
        hopper_expert.load_actor(corrupt)
    assert len(str(error.value).splitlines()) == 1


@pytest.fixture(scope="module")
def hopper_demos(tmp_path_factory):
    root = tmp_path_factory.mktemp("hopper")
    data = root / "demos.zarr"
    code = main(["collect", "task=hopper", "demos=2", "num_envs=2", f"out={data}", f"run_dir={root / 'collect'}"])
    assert code == 0
    info = json.loads((root / "collect" / "collect_info.json").read_text())
    # hopper has no success: every stable episode is kept, and the return stands in
    assert info["episodes_written"] == 2 and info["expert_success_rate"] is None
    assert info["demo_return_mean"] > 1000
    return data


@pytest.mark.parametrize("policy", ["diffusion", "flow", "shortcut"])
@pytest.mark.e2e
def test_collect_pretrain_eval_on_hopper(hopper_demos, tmp_path, policy):
    run_dir = tmp_path / "pretrain"
    code = main(["pretrain", "task=hopper", f"policy={policy}", f"data={hopper_demos}", "steps=4",
                 "eval_episodes=0", f"run_dir={run_dir}", *TINY])
    assert code == 0
    eval_dir = tmp_path / "eval"
    code = main(["eval", f"checkpoint={run_dir / 'checkpoints' / 'last'}", "episodes=2", "videos=0",
                 f"run_dir={eval_dir}"])
    assert code == 0
    info = json.loads((eval_dir / "eval_info.json").read_text())
    overall = info["overall"]
    assert info["task"] == "hopper" and overall["has_success"] is False and overall["n_episodes"] == 2
    assert overall["avg_sum_reward"] > 0 and len(overall["sum_reward_ci95"]) == 2
