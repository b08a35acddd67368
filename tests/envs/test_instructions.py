"""Per-env instructions (a task with `Task.instructions`) through the envs layer, on reach_choice.

Dict observations and spaces, determinism by seed, grouped and automatic resets, snapshots,
success judged on the instructed target only, the scripted expert per instruction, the
gymnasium registration and parity of the MuJoCo Warp backend.
"""

import gymnasium
import mujoco
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from embodied_rl.envs import make, make_expert
from embodied_rl.envs.api import SimState
from embodied_rl.envs.tasks.reach_choice import BLUE, RED
from embodied_rl.errors import UserError
from tests.envs.test_env_state import check_continues_exactly, saved_and_loaded

INSTRUCTIONS = ["reach the red target", "reach the blue target"]


def reach_choice(num_envs=4, seed=0, **options):
    return make("reach_choice", num_envs=num_envs, seed=seed, threads=1, **options)


def test_dict_observations_and_spaces():
    env = reach_choice(3)
    assert env.instructions == INSTRUCTIONS
    space = env.single_observation_space
    assert isinstance(space, gymnasium.spaces.Dict) and set(space.spaces) == {"state", "instruction"}
    assert space["instruction"] == gymnasium.spaces.Discrete(2) and space["state"].shape == (8,)
    obs, _ = env.reset(seed=0)
    assert set(obs) == {"state", "instruction"}
    assert obs["state"].shape == (3, 8) and obs["state"].dtype == torch.float32
    assert obs["instruction"].shape == (3,) and obs["instruction"].dtype == torch.int64
    assert torch.equal(env.state.instruction, obs["instruction"])  # what the task reads
    obs, _, _, _, info = env.step(torch.zeros(3, 2))
    assert set(obs) == set(info["final_obs"]) == {"state", "instruction"}
    env.close()

    pixels = reach_choice(2, obs_mode="pixels", image_size=16)
    assert set(pixels.single_observation_space.spaces) == {"state", "pixels", "instruction"}
    obs, _ = pixels.reset(seed=0)
    assert obs["pixels"].shape == (2, 16, 16, 3) and obs["instruction"].shape == (2,)
    pixels.close()

    plain = make("reach", num_envs=2, threads=1)  # a task without instructions is unchanged
    assert plain.instructions == [] and plain.state.instruction is None
    assert isinstance(plain.reset(seed=0)[0], torch.Tensor)
    assert isinstance(plain.single_observation_space, gymnasium.spaces.Box)
    wrapped = make("InvertedPendulum-v5", num_envs=1, backend="gymnasium")
    assert wrapped.instructions == []
    wrapped.close()


def instruction_trace(seed, steps=12, num_envs=6):
    """Instructions of every observation and final_obs over a run with 3-step episodes."""
    env = reach_choice(num_envs, seed=seed, task_options={"max_episode_steps": 3})
    obs, _ = env.reset(seed=seed)
    trace = [obs["instruction"]]
    for _ in range(steps):
        obs, _, _, _, info = env.step(torch.zeros(num_envs, 2))
        trace += [obs["instruction"], info["final_obs"]["instruction"]]
    env.close()
    return torch.stack(trace)


def test_same_seed_same_instructions():
    first = instruction_trace(seed=3)
    assert torch.equal(first, instruction_trace(seed=3))
    assert not torch.equal(first, instruction_trace(seed=4))
    assert set(first.flatten().tolist()) == {RED, BLUE}


def test_grouped_reset_shares_the_instruction():
    env = reach_choice(8)
    seen = set()
    for seed in range(4):
        obs, _ = env.reset(seed=seed, group_size=2)
        instruction, state = obs["instruction"].view(4, 2), obs["state"].view(4, 2, 8)
        assert torch.equal(instruction[:, 0], instruction[:, 1])
        assert torch.equal(state[:, 0], state[:, 1])
        seen.update(instruction[:, 0].tolist())
    assert seen == {RED, BLUE}  # groups draw their own instruction
    env.close()


def test_resets_draw_new_instructions_and_final_obs_keeps_the_old_one():
    env = reach_choice(8, task_options={"max_episode_steps": 2})
    obs, _ = env.reset(seed=0)
    changed = torch.zeros(8, dtype=torch.bool)
    for _ in range(20):
        before = obs["instruction"]
        obs, _, _, truncated, info = env.step(torch.zeros(8, 2))
        # the finished episode's instruction in final_obs; every other env keeps its own
        assert torch.equal(info["final_obs"]["instruction"], before)
        assert torch.equal(obs["instruction"][~truncated], before[~truncated])
        assert torch.equal(env.state.instruction, obs["instruction"])
        changed |= obs["instruction"] != before
    assert changed.all()  # every env's auto-resets drew instructions anew

    # a partial reset redraws the reset envs only
    kept = obs["instruction"].clone()
    redrawn = torch.zeros(8, dtype=torch.bool)
    for _ in range(10):
        obs, _ = env.reset(env_ids=torch.tensor([1, 5]))
        assert torch.equal(obs["instruction"][[0, 2, 3, 4, 6, 7]], kept[[0, 2, 3, 4, 6, 7]])
        redrawn[[1, 5]] |= obs["instruction"][[1, 5]] != kept[[1, 5]]
    assert redrawn[[1, 5]].all()
    env.close()


@pytest.mark.parametrize("obs_mode", ["state", "pixels"])
def test_snapshot_continues_bit_for_bit_with_instructions(obs_mode):
    # 5-step episodes: the continuation auto-resets envs, drawing instructions from the generator
    check_continues_exactly(lambda: reach_choice(3, obs_mode=obs_mode, image_size=16,
                                                 task_options={"max_episode_steps": 5}), k=7)


def test_snapshot_holds_the_instructions_and_set_state_checks_them():
    env = reach_choice(4)
    env.reset(seed=1)
    state = saved_and_loaded(env.get_state())
    assert torch.equal(state["instruction"], env.state.instruction)
    assert torch.equal(state["obs/instruction"], state["instruction"])
    other = reach_choice(4)
    other.set_state(state)
    assert torch.equal(other.state.instruction, env.state.instruction)
    with pytest.raises(UserError, match="missing 'instruction'"):
        other.set_state({key: value for key, value in state.items() if key != "instruction"})
    with pytest.raises(UserError, match="ids in \\[0, 2\\)"):
        other.set_state({**state, "instruction": torch.full((4,), 2)})
    plain = make("reach", num_envs=4, threads=1)
    plain.reset(seed=0)
    with pytest.raises(UserError, match="holds instructions"):
        plain.set_state({**plain.get_state(), "instruction": state["instruction"]})


def sim_state(task, finger, red, blue, instruction):
    """SimState of one env of reach_choice at rest with the given positions (mj_forward)."""
    model = task.load_model()
    task.bind(model)
    data = mujoco.MjData(model)
    data.qpos[task.finger_qpos] = finger
    data.qpos[task.red_qpos] = red
    data.qpos[task.blue_qpos] = blue
    mujoco.mj_forward(model, data)

    def row(array):
        return torch.from_numpy(array.copy())[None]

    return SimState(row(data.qpos), row(data.qvel), row(data.sensordata), row(data.ctrl),
                    instruction=torch.tensor([instruction]))


def test_success_only_at_the_instructed_target():
    from embodied_rl.envs.registry import make_task

    task = make_task("reach_choice")
    red, blue = [0.1, 0.1], [-0.1, -0.05]
    for finger, instruction, expected in (
        (red, RED, True), (red, BLUE, False), (blue, BLUE, True), (blue, RED, False),
    ):
        reward, success, failure = task.evaluate(sim_state(task, finger, red, blue, instruction), torch.zeros(1, 2))
        assert bool(success) == expected and not failure.any()
        if expected:
            assert reward.item() == pytest.approx(1.0, abs=1e-6)
        else:  # -10 x the distance to the instructed target
            assert reward.item() == pytest.approx(-10 * float(np.hypot(0.2, 0.15)), abs=1e-5)
    state = sim_state(task, red, red, blue, RED)
    with pytest.raises(ValueError, match="SimState.instruction"):  # a SimState without instructions
        task.evaluate(SimState(state.qpos, state.qvel, state.sensordata, state.ctrl), torch.zeros(1, 2))


def test_env_step_on_the_other_target_is_no_success():
    # write the state so that every fingertip sits on its non-instructed target, at rest, and hold it
    env = reach_choice(4)
    obs, _ = env.reset(seed=0)
    task = env.task
    qpos, qvel = task.sample_init(4, torch.Generator().manual_seed(0), "cpu")
    instruction = env.state.instruction
    other = torch.where((instruction == RED)[:, None], qpos[:, task.blue_qpos], qpos[:, task.red_qpos])
    qpos[:, task.finger_qpos] = other
    env._write_state(torch.arange(4), qpos, qvel)
    hold = other / task.ctrl_high  # position actuators in [-0.2, 0.2]: command where it is
    _, reward, terminated, _, info = env.step(hold)
    assert not info["success"].any() and not terminated.any()
    assert (reward < -0.4).all()  # targets start >= 5 cm apart

    # on the instructed target instead: success, and the episode ends
    env.reset(seed=0)
    qpos, qvel = task.sample_init(4, torch.Generator().manual_seed(0), "cpu")
    instruction = env.state.instruction
    mine = torch.where((instruction == RED)[:, None], qpos[:, task.red_qpos], qpos[:, task.blue_qpos])
    qpos[:, task.finger_qpos] = mine
    env._write_state(torch.arange(4), qpos, qvel)
    _, reward, terminated, _, info = env.step(mine / task.ctrl_high)
    assert info["success"].all() and terminated.all()
    env.close()


def test_expert_succeeds_on_both_instructions():
    env = reach_choice(64)
    expert = make_expert("reach_choice", env, quality=1.0, generator=torch.Generator().manual_seed(0))
    obs, _ = env.reset(seed=0)
    outcomes = {RED: [], BLUE: []}
    while min(len(v) for v in outcomes.values()) < 60:
        obs, _, _, _, info = env.step(expert.act(obs))
        expert.reset(info["_final"])
        for i in torch.nonzero(info["_episode"]).flatten().tolist():
            outcomes[int(info["final_obs"]["instruction"][i])].append(bool(info["episode"]["success_once"][i]))
    env.close()
    for instruction, results in outcomes.items():
        assert np.mean(results) >= 0.95, (instruction, np.mean(results))


def test_gymnasium_registration_gives_dict_observations():
    env = gymnasium.make("embodied_rl/ReachChoice-v0")
    check_env(env.unwrapped, skip_render_check=True)
    assert env.unwrapped.instructions == INSTRUCTIONS
    obs, _ = env.reset(seed=0)
    assert set(obs) == {"state", "instruction"}
    assert obs["state"].shape == (8,) and obs["state"].dtype == np.float32
    assert isinstance(obs["instruction"], np.integer) and obs["instruction"] in (RED, BLUE)
    assert env.observation_space.contains(obs)
    obs, _, _, _, _ = env.step(np.zeros(2, dtype=np.float32))
    assert env.observation_space.contains(obs)
    env.close()


@pytest.mark.slow
def test_mujoco_warp_matches_the_cpu_backend():
    pytest.importorskip("mujoco_warp")
    warp = make("reach_choice", num_envs=3, backend="mujoco_warp", device="cpu", seed=0,
                task_options={"max_episode_steps": 4})
    cpu = reach_choice(3, task_options={"max_episode_steps": 4})
    obs_w, _ = warp.reset(seed=0)
    obs_c, _ = cpu.reset(seed=0)
    assert torch.equal(obs_w["instruction"], obs_c["instruction"])
    assert torch.equal(warp.state.instruction, obs_w["instruction"])
    torch.testing.assert_close(obs_w["state"], obs_c["state"], atol=0, rtol=0)
    generator = torch.Generator().manual_seed(1)
    for _ in range(6):  # crosses an auto-reset
        action = torch.rand(3, 2, generator=generator) * 2 - 1
        obs_w, reward_w, term_w, trunc_w, info_w = warp.step(action)
        obs_c, reward_c, term_c, trunc_c, info_c = cpu.step(action)
        assert torch.equal(obs_w["instruction"], obs_c["instruction"])
        assert torch.equal(info_w["final_obs"]["instruction"], info_c["final_obs"]["instruction"])
        torch.testing.assert_close(obs_w["state"], obs_c["state"], atol=1e-5, rtol=0)
        torch.testing.assert_close(reward_w, reward_c, atol=1e-4, rtol=0)
        assert torch.equal(term_w, term_c) and torch.equal(trunc_w, trunc_c)
    warp.close()
    cpu.close()
