"""The tabletop suite: its instructions and splits, success exact for the instruction given,
the scripted expert on every instruction, pixels (the batched renderer draws what
mujoco.Renderer draws), collect through the CLI, gymnasium, and MuJoCo Warp parity."""

import json

import gymnasium
import mujoco
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from embodied_rl.envs import make, make_expert
from embodied_rl.envs.api import SimState
from embodied_rl.envs.render import BatchRenderer
from embodied_rl.envs.tasks.tabletop import CUBES, HELD_OUT, INSTRUCTIONS, PADS, TabletopTask
from embodied_rl.errors import UserError


def tabletop(num_envs=4, **options):
    return make("tabletop", num_envs=num_envs, seed=0, threads=1, **options)


def test_instructions_templates_and_splits():
    assert len(INSTRUCTIONS) == 15 and len(set(INSTRUCTIONS)) == 15
    assert INSTRUCTIONS[0] == "pick up the red cube"
    assert "put the blue cube on the yellow pad" in INSTRUCTIONS and INSTRUCTIONS[-1] == "touch the purple pad"
    generator = torch.Generator().manual_seed(0)
    held = {INSTRUCTIONS.index(text) for text in HELD_OUT}
    seen = set(TabletopTask().sample_instruction(2000, generator).tolist())
    assert seen == set(range(15)) - held  # the default split never draws a held-out combination
    assert set(TabletopTask(instruction_split="held_out").sample_instruction(300, generator).tolist()) == held
    assert len(set(TabletopTask(instruction_split="all").sample_instruction(3000, generator).tolist())) == 15
    picks = TabletopTask(templates=["pick"]).sample_instruction(300, generator)
    assert set(picks.tolist()) == {0, 1, 2}
    # the instruction list never changes with the options (checkpoints run on every split)
    assert TabletopTask(instruction_split="held_out", templates=["put"]).instructions == INSTRUCTIONS

    with pytest.raises(UserError, match="unknown instruction template 'fly'"):
        TabletopTask(templates=["pick", "fly"])
    with pytest.raises(UserError, match="unknown instruction 'stack the cubes' in task.held_out"):
        TabletopTask(held_out=["stack the cubes"])
    with pytest.raises(UserError, match="instruction_split must be one of"):
        TabletopTask(instruction_split="train")
    with pytest.raises(UserError, match="leaves no instruction to draw"):
        TabletopTask(templates=["pick"], instruction_split="held_out")


def scene(task, instruction, hand=(0.0, 0.0, 0.12), closure=0.0, cubes=None, pads=None):
    """A one-env SimState: cubes {colour: (x, y, z above resting)}, pads {colour: (x, y)}."""
    model = task.load_model()
    task.bind(model)
    data = mujoco.MjData(model)
    cubes = {"red": (-0.1, -0.1, 0.0), "green": (0.0, -0.1, 0.0), "blue": (0.1, -0.1, 0.0), **(cubes or {})}
    pads = {"yellow": (-0.1, 0.1), "white": (0.0, 0.1), "purple": (0.1, 0.1), **(pads or {})}
    for c, colour in enumerate(CUBES):
        for joint, value in zip(task.cube_joints[c], cubes[colour], strict=True):
            data.qpos[joint] = value
    for p, colour in enumerate(PADS):
        for joint, value in zip(task.pad_joints[p], pads[colour], strict=True):
            data.qpos[joint] = value
    for joint, value in zip(task.hand_joints, hand, strict=True):
        data.qpos[joint] = value
    data.qpos[task.fingers] = closure * 0.04
    mujoco.mj_forward(model, data)

    def row(array):
        return torch.from_numpy(array.copy())[None]

    return SimState(row(data.qpos), row(data.qvel), row(data.sensordata), row(data.ctrl),
                    instruction=torch.tensor([INSTRUCTIONS.index(instruction)]))


def outcome(task, state):
    _, success, failure = task.evaluate(state, torch.zeros(1, 4))
    return bool(success), bool(failure)


def test_success_is_exact_for_the_instruction_given():
    task = TabletopTask()
    lifted_red = {"red": (-0.1, -0.1, 0.06)}
    assert outcome(task, scene(task, "pick up the red cube", cubes=lifted_red)) == (True, False)
    assert outcome(task, scene(task, "pick up the red cube", cubes={"red": (-0.1, -0.1, 0.04)})) == (False, False)
    # lifting another cube than the one named fails, for every template
    assert outcome(task, scene(task, "pick up the green cube", cubes=lifted_red)) == (False, True)
    assert outcome(task, scene(task, "touch the white pad", cubes=lifted_red)) == (False, True)
    assert outcome(task, scene(task, "put the blue cube on the white pad", cubes=lifted_red)) == (False, True)

    on_white = {"green": (0.01, 0.09, 0.0)}  # the green cube on the white pad, let go
    assert outcome(task, scene(task, "put the green cube on the white pad", cubes=on_white)) == (True, False)
    assert outcome(task, scene(task, "put the green cube on the yellow pad", cubes=on_white)) == (False, False)
    assert outcome(task, scene(task, "put the red cube on the white pad", cubes=on_white)) == (False, False)
    held = scene(task, "put the green cube on the white pad", cubes=on_white, closure=0.6)
    assert outcome(task, held) == (False, False)  # still in the gripper
    raised = {"green": (0.01, 0.09, 0.03)}
    assert outcome(task, scene(task, "put the green cube on the white pad", cubes=raised)) == (False, False)

    on_purple = (0.11, 0.095, 0.027)
    assert outcome(task, scene(task, "touch the purple pad", hand=on_purple)) == (True, False)
    assert outcome(task, scene(task, "touch the yellow pad", hand=on_purple)) == (False, False)
    assert outcome(task, scene(task, "touch the purple pad", hand=(0.11, 0.095, 0.06))) == (False, False)


def test_expert_succeeds_on_every_instruction():
    env = tabletop(30, task_options={"instruction_split": "all"})
    expert = make_expert("tabletop", env, quality=1.0, generator=torch.Generator().manual_seed(0))
    obs, _ = env.reset(seed=0)
    expert.reset(torch.ones(30, dtype=torch.bool))
    outcomes = {i: [] for i in range(len(INSTRUCTIONS))}
    for _ in range(90):
        instruction = obs["instruction"].clone()
        obs, _, _, _, info = env.step(expert.act(obs))
        for i in torch.nonzero(info["_episode"]).flatten().tolist():
            outcomes[int(instruction[i])].append(bool(info["episode"]["success_once"][i]))
        expert.reset(info["_episode"])
    env.close()
    assert all(len(results) >= 3 for results in outcomes.values()), {i: len(r) for i, r in outcomes.items()}
    assert all(all(results) for results in outcomes.values()), outcomes


def test_pixels_and_the_batched_renderer():
    env = tabletop(3, obs_mode="pixels", image_size=64)
    obs, _ = env.reset(seed=0)
    assert set(obs) == {"state", "pixels", "instruction"}
    assert obs["pixels"].shape == (3, 64, 64, 3) and obs["pixels"].dtype == torch.uint8
    assert obs["state"].shape == (3, 4)  # proprioception: hand xyz, finger closure
    env.step(torch.zeros(3, 4))
    assert not torch.equal(obs["pixels"][0], obs["pixels"][1])  # different scenes
    env.close()

    # 20 frames at 256 px take two passes of the 1024 px framebuffer (16 tiles each)
    env = tabletop(20)
    env.reset(seed=1)
    renderer = BatchRenderer(env.model, "front")
    frames = renderer.render(env.datas, 20, 256)
    small = renderer.render(env.datas[:5], 5, 48)
    renderer.close()
    reference = mujoco.Renderer(env.model, 256, 256)
    reference.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = False
    reference.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = False
    for i in (0, 15, 16, 19):
        reference.update_scene(env.datas[i], camera="front")
        expected = reference.render().astype(int)
        assert np.abs(frames[i].astype(int) - expected).max() <= 1  # GL rounding, if any
        assert (frames[i] != expected).mean() < 1e-3
    reference.close()
    assert small.shape == (5, 48, 48, 3) and not np.array_equal(small[0], small[1])
    env.close()


@pytest.mark.e2e
def test_collect_records_pixels_proprioception_and_seen_instructions(tmp_path, capsys):
    from embodied_rl.cli import main
    from embodied_rl.data import DemoDataset

    run_dir = tmp_path / "collect"
    assert main(["collect", "task=tabletop", "demos=6", "num_envs=6", "quality=1.0", "pixels=true",
                 "image_size=32", f"run_dir={run_dir}"]) == 0, capsys.readouterr().err
    dataset = DemoDataset.load(run_dir / "demos.zarr")
    assert dataset.instructions == list(INSTRUCTIONS)
    assert dataset.pixels.shape[1:] == (32, 32, 3) and dataset.obs.shape[1] == 4
    held = [INSTRUCTIONS.index(text) for text in HELD_OUT]
    assert not np.isin(dataset.instruction, held).any()
    info = json.loads((run_dir / "collect_info.json").read_text())
    assert info["expert_success_rate"] == 1.0 and info["episodes_written"] == 6
    # a task option naming no known template stops the command before any work
    assert main(["collect", "task=tabletop", "demos=1", "task.templates=[pick,stack]",
                 f"run_dir={tmp_path / 'bad'}"]) == 2
    assert "unknown instruction template 'stack'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_gymnasium_registration():
    env = gymnasium.make("embodied_rl/Tabletop-v0")
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=0)
    assert obs["state"].shape == (4,) and isinstance(obs["instruction"], np.int64)
    assert env.unwrapped.instructions == list(INSTRUCTIONS)
    env.close()


@pytest.mark.slow
def test_mujoco_warp_matches_the_cpu_backend():
    pytest.importorskip("mujoco_warp")
    warp_env = make("tabletop", num_envs=3, backend="mujoco_warp", device="cpu", seed=0,
                    task_options={"instruction_split": "all"})
    cpu_env = tabletop(3, task_options={"instruction_split": "all"})
    obs_w, _ = warp_env.reset(seed=0)
    obs_c, _ = cpu_env.reset(seed=0)
    expert = make_expert("tabletop", cpu_env, generator=torch.Generator().manual_seed(0))
    for _ in range(25):  # grasps and lifts: contacts between the fingers and a cube
        action = expert.act(obs_c)
        obs_w, _, _, _, info_w = warp_env.step(action)
        obs_c, _, _, _, info_c = cpu_env.step(action)
        expert.reset(info_c["_episode"])
        assert torch.equal(obs_w["instruction"], obs_c["instruction"])
        torch.testing.assert_close(obs_w["state"], obs_c["state"], atol=2e-3, rtol=0)
        assert torch.equal(info_w["success"], info_c["success"])
    frames_w, frames_c = warp_env.render(torch.tensor([2])), cpu_env.render(torch.tensor([2]))
    assert (frames_w.int() - frames_c.int()).abs().float().mean() < 1.0
    warp_env.close()
    cpu_env.close()
