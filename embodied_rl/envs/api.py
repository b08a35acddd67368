"""The contracts of the envs layer: Task (task logic in torch), SimState (batched simulator state),
BatchedEnv (N copies of a task stepped at once) and step_chunk (execute an action chunk).

Layers:
- A `Task` holds everything task-specific: the MJCF file, initial-state sampling, observation,
  reward, success and failure, written once in torch over a `SimState`. It never steps physics.
- `BatchedEnv` is the interface every backend implements (torch tensors with a leading N).
- `SimBatchedEnv` implements the whole BatchedEnv contract (auto-reset, final_obs, episode
  statistics, partial and grouped resets, instability handling, pixel observations) on top of four
  physics primitives; the MuJoCo backends (mujoco_cpu, mujoco_warp) subclass it and implement only
  `state`, `_write_state`, `_step_physics` and `_render_frames`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
from torch import Tensor

from embodied_rl.envs.render import camera_names
from embodied_rl.errors import UserError
from embodied_rl.paths import asset_dir

Obs = Tensor | dict[str, Tensor]


# --------------------------------------------------------------------------------------------
# Simulator state and the Task API
# --------------------------------------------------------------------------------------------


@dataclass
class SimState:
    """Torch views over a backend's batched buffers, leading dim N.

    Native MuJoCo keeps float64 (the views share memory with the simulator's buffers, no copies);
    MuJoCo Warp keeps float32. Tasks must not rely on the dtype and return float32 results.
    Writing into these views writes the simulator state; only backends and tests should do that.
    `instruction` is the env's per-env instruction id (int64, on the same device as the other
    tensors) for a task with `Task.instructions`, None otherwise; SimBatchedEnv owns that tensor
    and draws a new id at every reset of an env.
    """

    qpos: Tensor  # [N, nq]
    qvel: Tensor  # [N, nv]
    sensordata: Tensor  # [N, nsensordata]  tasks read body/site poses through MJCF sensors
    ctrl: Tensor  # [N, nu]
    instruction: Tensor | None = None  # [N] int64 index into Task.instructions


def _object_id(model: Any, kind: str, name: str) -> int:
    """The id of the model's `kind` (sensor, joint, actuator) called `name`; a ValueError naming
    it when the model has none."""
    import mujoco

    object_id = mujoco.mj_name2id(model, getattr(mujoco.mjtObj, f"mjOBJ_{kind.upper()}"), name)
    if object_id < 0:
        raise ValueError(f"the model has no {kind} named '{name}'")
    return int(object_id)


def sensor_slice(model: Any, name: str) -> slice:
    """Columns of `sensordata` holding the sensor called `name` (looked up by name, once)."""
    sensor_id = _object_id(model, "sensor", name)
    start = int(model.sensor_adr[sensor_id])
    return slice(start, start + int(model.sensor_dim[sensor_id]))


def joint_qpos_slice(model: Any, name: str) -> slice:
    """Columns of `qpos` of the joint called `name` (free: 7, ball: 4, slide/hinge: 1)."""
    joint_id = _object_id(model, "joint", name)
    width = {0: 7, 1: 4, 2: 1, 3: 1}[int(model.jnt_type[joint_id])]
    start = int(model.jnt_qposadr[joint_id])
    return slice(start, start + width)


def joint_qvel_slice(model: Any, name: str) -> slice:
    """Columns of `qvel` of the joint called `name` (free: 6, ball: 3, slide/hinge: 1)."""
    joint_id = _object_id(model, "joint", name)
    width = {0: 6, 1: 3, 2: 1, 3: 1}[int(model.jnt_type[joint_id])]
    start = int(model.jnt_dofadr[joint_id])
    return slice(start, start + width)


def actuator_index(model: Any, name: str) -> int:
    """Column of `ctrl` of the actuator called `name`."""
    return _object_id(model, "actuator", name)


def scale_action(action: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """Map an action in [-1, 1] linearly onto [low, high] (e.g. an actuator's ctrlrange)."""
    return low + (action.clamp(-1.0, 1.0) + 1.0) * 0.5 * (high - low)


class Task:
    """Task logic, written once in torch over batched simulator state.

    Subclasses set the class attributes and implement the five methods. Keyword arguments of the
    constructor override class attributes (e.g. `ReachTask(max_episode_steps=100)`); unknown
    names raise UserError. `terminated = success & success_terminates | failure`;
    `truncated = step count reached max_episode_steps and not terminated`.

    A language-conditioned task lists its instructions (`instructions`, non-empty): the env
    draws one per episode with `sample_instruction`, hands it to `observe`/`evaluate` as
    `SimState.instruction` and adds it to every observation (obs["instruction"]).
    """

    name: str = ""  # registry name, e.g. "reach"
    gym_id: str = ""  # gymnasium id, e.g. "embodied_rl/Reach-v0"
    xml: str = ""  # MJCF file name under assets/
    max_episode_steps: int = 100
    control_substeps: int = 1  # mj_step calls per env step
    control_rate_hz: float | None = None  # env steps per second; None: the model's timestep x control_substeps
    obs_dim: int = 0
    action_dim: int = 0
    camera: str = ""  # name of the fixed MJCF camera used for rendering
    has_success: bool = True  # False for tasks with no success notion (e.g. hopper)
    success_terminates: bool = True  # whether reaching success ends the episode
    success_criterion: str = ""  # one sentence, shown by `embodied-rl tasks`
    instructions: tuple[str, ...] = ()  # non-empty: language-conditioned (obs["instruction"] ids)
    fixed_instruction: int | None = None  # an id: every episode gets that instruction (eval env_instruction=)
    backends: tuple[str, ...] = ("mujoco", "mujoco_warp", "gymnasium", "process")  # the first is the default
    # where the end effector sits in the state observation: the indices of its position (metres)
    # and of the gripper's opening or closure in [0, 1] (None: no gripper). The progress
    # pseudo-labels of train-reward read them (gripper changes, end-effector pauses).
    effector_obs: tuple[int, ...] = ()
    gripper_obs: int | None = None
    # True where the state observation is the robot's proprioception only (the objects are seen in the
    # camera image): what a real robot also has, so a reward model may read it (train-reward use_state=auto)
    proprioceptive_state: bool = False

    def __init__(self, **overrides: Any):
        for key, value in overrides.items():
            if key.startswith("_") or not hasattr(type(self), key) or callable(getattr(type(self), key)):
                raise UserError(f"unknown option '{key}' for task '{self.name}'")
            setattr(self, key, value)
        fixed = self.fixed_instruction
        if fixed is not None and (not isinstance(fixed, int) or isinstance(fixed, bool)
                                  or not 0 <= fixed < len(self.instructions)):
            raise UserError(f"fixed_instruction must be an instruction id in [0, {len(self.instructions)}) "
                            f"of task '{self.name}', got {fixed!r}")

    def model_path(self) -> Path:
        return asset_dir() / self.xml

    def load_model(self) -> Any:
        """The task's mujoco.MjModel (backends call this, then `bind`)."""
        import mujoco

        return mujoco.MjModel.from_xml_path(str(self.model_path()))

    def bind(self, model: Any) -> None:
        """Look up every index the task needs by name, once."""
        raise NotImplementedError

    def sample_init(self, n: int, generator: torch.Generator, device: torch.device | str) -> tuple[Tensor, Tensor]:
        """Initial states: (qpos [n, nq], qvel [n, nv]) float32 on `device`.

        `generator` is a CPU generator: draw on the CPU with it, then move to `device`, so that
        a seed gives the same episodes on every device.
        """
        raise NotImplementedError

    def sample_instruction(self, n: int, generator: torch.Generator) -> Tensor:
        """Instruction ids of n new episodes, int64 [n] on the CPU, drawn with the env's CPU
        `generator` (default: uniform over `instructions`). Only called when `instructions` is
        non-empty."""
        if not self.instructions:
            raise ValueError(f"task '{self.name}' has no instructions")
        return torch.randint(len(self.instructions), (n,), generator=generator)

    def action_to_ctrl(self, action: Tensor) -> Tensor:
        """Map actions [N, A] in [-1, 1] to actuator controls [N, nu]."""
        raise NotImplementedError

    def observe(self, state: SimState) -> Tensor:
        """State observation [N, obs_dim], float32."""
        raise NotImplementedError

    def evaluate(self, state: SimState, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(reward f32[N], success bool[N], failure bool[N]) after a step taken with `action`."""
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# BatchedEnv: the interface every backend implements
# --------------------------------------------------------------------------------------------


class BatchedEnv:
    """N copies of an environment stepped at once; every value is a torch tensor with leading N.

    obs, info = env.reset(seed=None, env_ids=None, group_size=None)
    obs, reward, terminated, truncated, info = env.step(action)   # action [N, A] in [-1, 1]
    frames = env.render(env_ids=None)                             # uint8 [k, H, W, 3]

    `step` auto-resets finished envs in the same step. Its info always holds:
      "success" bool[N], "unstable" bool[N],
      "_final" bool[N] and "final_obs" (the true last observation where _final is set; the
      other rows are the returned obs),
      "_episode" bool[N] and "episode" {"return" f32[N], "length" i64[N], "success_once" bool[N]}
      (valid where _episode is set).

    `instructions` lists the task's instructions ([] for a task without them). When it is
    non-empty every observation is a dict holding "instruction" int64 [N] (an index into it)
    next to "state" (and "pixels"); final_obs holds the finished episode's instruction.
    """

    num_envs: int
    device: torch.device
    task: Task | None = None
    single_observation_space: gymnasium.Space
    single_action_space: gymnasium.spaces.Box
    unstable_resets: int = 0
    max_episode_steps: int | None = None
    can_snapshot: bool = False  # whether get_state/set_state work (exact resume of a run)

    def reset(
        self, seed: int | None = None, env_ids: Tensor | None = None, group_size: int | None = None
    ) -> tuple[Obs, dict[str, Any]]:
        raise NotImplementedError

    def step(self, action: Tensor) -> tuple[Obs, Tensor, Tensor, Tensor, dict[str, Any]]:
        raise NotImplementedError

    def render(self, env_ids: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def get_state(self) -> dict[str, Tensor]:
        """A snapshot of everything `step` continues from, as a flat dict of tensors (safe for
        torch.save and torch.load(weights_only=True)); `set_state` on an env made with the same
        arguments continues bit for bit as if never stopped."""
        raise UserError(f"the {type(self).__name__} backend cannot snapshot its envs (get_state); "
                        "exact resume needs a MuJoCo backend")

    def set_state(self, state: dict[str, Tensor]) -> None:
        """Restore a snapshot taken with `get_state`."""
        raise UserError(f"the {type(self).__name__} backend cannot snapshot its envs (set_state); "
                        "exact resume needs a MuJoCo backend")

    def close(self) -> None:
        pass

    @property
    def instructions(self) -> list[str]:
        """The task's instructions; obs["instruction"] indexes this list ([]: none)."""
        task = self.task
        return list(task.instructions) if task is not None else []

    @property
    def simulator(self) -> dict[str, str]:
        """The simulator's package versions, recorded in eval_info.json (a simulator upgrade can
        change every number): {"mujoco": "3.3.7", ...}; {} where a backend cannot tell."""
        return {}

    @property
    def action_dim(self) -> int:
        return int(self.single_action_space.shape[0])

    def check_action(self, action: Any) -> Tensor:
        """Validate an action batch; return it as float32 on self.device, clamped to [-1, 1].

        A wrong shape or a non-floating dtype raises ValueError naming the expected shape;
        NaN or inf raises ValueError naming the envs.
        """
        expected = (self.num_envs, self.action_dim)
        if isinstance(action, np.ndarray):
            action = torch.from_numpy(action)
        if not isinstance(action, Tensor):
            raise ValueError(f"action must be a torch.Tensor of shape {expected}, got {type(action).__name__}")
        if tuple(action.shape) != expected:
            raise ValueError(f"action must have shape {expected} (num_envs, action_dim), got {tuple(action.shape)}")
        if not action.is_floating_point():
            raise ValueError(f"action must be a floating-point tensor of shape {expected}, got dtype {action.dtype}")
        if not bool(torch.isfinite(action).all()):
            bad = torch.nonzero(~torch.isfinite(action).all(dim=1)).flatten().tolist()[:8]
            raise ValueError(f"action contains NaN or inf (envs {bad})")
        return action.to(device=self.device, dtype=torch.float32).clamp(-1.0, 1.0)

    def _env_ids(self, env_ids: Tensor | None) -> Tensor:
        if env_ids is None:
            return torch.arange(self.num_envs)
        env_ids = torch.as_tensor(env_ids).cpu()
        if env_ids.dtype == torch.bool:
            if env_ids.shape != (self.num_envs,):
                raise ValueError(f"a boolean env_ids mask must have shape ({self.num_envs},)")
            return torch.nonzero(env_ids).flatten()
        env_ids = env_ids.long().flatten()
        if len(env_ids) and (env_ids.min() < 0 or env_ids.max() >= self.num_envs):
            raise ValueError(f"env_ids must lie in [0, {self.num_envs})")
        return env_ids


class EpisodeStats:
    """Running return, length and success_once per env (shared by backends).

    Updates build new tensors instead of writing in place, so a snapshot can hand out the
    tensors themselves without copying them.
    """

    def __init__(self, num_envs: int, device: torch.device):
        self.returns = torch.zeros(num_envs, device=device)
        self.lengths = torch.zeros(num_envs, dtype=torch.long, device=device)
        self.success_once = torch.zeros(num_envs, dtype=torch.bool, device=device)

    def update(self, reward: Tensor, success: Tensor) -> None:
        self.returns = self.returns + reward
        self.lengths = self.lengths + 1
        self.success_once = self.success_once | success

    def snapshot(self) -> dict[str, Tensor]:
        return {"return": self.returns, "length": self.lengths, "success_once": self.success_once}

    def clear(self, env_ids: Tensor) -> None:
        self.returns = self.returns.index_fill(0, env_ids, 0.0)
        self.lengths = self.lengths.index_fill(0, env_ids, 0)
        self.success_once = self.success_once.index_fill(0, env_ids, False)


def _index_obs(obs: Obs, env_ids: Tensor) -> Obs:
    if isinstance(obs, dict):
        return {key: value[env_ids] for key, value in obs.items()}
    return obs[env_ids]


def _assign_obs(target: Obs, env_ids: Tensor, source: Obs) -> None:
    if isinstance(target, dict):
        for key in target:
            target[key][env_ids] = source[key]
    else:
        target[env_ids] = source


def clone_obs(obs: Obs) -> Obs:
    if isinstance(obs, dict):
        return {key: value.clone() for key, value in obs.items()}
    return obs.clone()


class SimBatchedEnv(BatchedEnv):
    """The BatchedEnv contract over a MuJoCo-like simulator, given four physics primitives.

    Subclasses load `task.load_model()`, allocate N copies of the state, call
    `SimBatchedEnv.__init__` with the model, and implement:
      state -> SimState                     views of the batched buffers (on self.sim_device)
      _write_state(env_ids, qpos, qvel)     set the state of those envs, zero ctrl and
                                            time, and recompute derived quantities (sensordata);
                                            return bool[k], True where the simulator refused the
                                            state and reset the env itself (or None)
      _step_physics(ctrl) -> bool[N]        write ctrl and advance every env by
                                            task.control_substeps; return envs with simulator
                                            warnings (e.g. mjWARN_BADQACC)
      _render_frames(env_ids, size, camera) -> uint8 [k, size, size, 3] of that MJCF camera
      _get_sim_state() -> dict[str, Tensor]  everything the next physics step reads, per env
      _set_sim_state(state)                  write it back (the envs continue bit for bit)
    and may override `_state_is_finite() -> bool[N]` (default: three torch checks over `state`)
    with one cheaper call over their own buffers.

    An env whose physics goes unstable (a simulator warning or non-finite qpos/qvel/sensordata)
    is reset in the same step and counted in `unstable_resets`; that step returns reward 0,
    terminated False, truncated True, info["unstable"] True, and as final_obs the last finite
    observation (the one before the step), so a bootstrap stays finite. The other envs go on.
    A state that is broken when it is written (a reset, an initial state the simulator refuses
    or that is not finite) is put back to the model's reference pose at rest, so the observation
    stays finite, and the env's next step counts as unstable in the same way.

    For a task with instructions, `_instruction` (int64 [N] on sim_device, None otherwise) holds
    each env's instruction id, drawn per episode with `task.sample_instruction` from the env's
    generator; backends build their SimState with `_sim_state`, which passes it on, and it is only
    ever updated in place.
    """

    sim_device: torch.device = torch.device("cpu")
    can_snapshot = True

    @property
    def simulator(self) -> dict[str, str]:
        import mujoco

        return {"mujoco": mujoco.__version__}

    def __init__(
        self,
        task: Task,
        model: Any,
        num_envs: int,
        device: str | torch.device = "cpu",
        seed: int = 0,
        obs_mode: str = "state",
        image_size: int = 96,
        render_size: int = 256,
        reward_camera: str = "",
    ):
        if num_envs < 1:
            raise UserError(f"num_envs must be >= 1, got {num_envs}")
        if obs_mode not in ("state", "pixels"):
            raise UserError(f"obs_mode must be 'state' or 'pixels', got {obs_mode!r}")
        if image_size < 8 or render_size < 8:
            raise UserError("image_size and render_size must be >= 8")
        if reward_camera:
            if obs_mode != "pixels":
                raise UserError("reward_camera renders frames beside the policy's: it needs obs_mode='pixels'")
            cameras = camera_names(model)
            if reward_camera not in cameras:
                raise UserError(f"task '{task.name}' has no camera named '{reward_camera}' "
                                f"(its cameras: {', '.join(cameras) or 'none'})")
        self.task = task
        self.model = model
        self.num_envs = int(num_envs)
        self.device = torch.device(device)
        self.obs_mode = obs_mode
        self.image_size = int(image_size)
        self.render_size = int(render_size)
        # a second camera's frames, obs["reward_pixels"], for a reward model with a view of its own
        # (tabletop's "top": from the front the gripper hides the pad under a put cube)
        self.reward_camera = str(reward_camera)
        self.max_episode_steps = int(task.max_episode_steps)
        task.bind(model)

        self.generator = torch.Generator()  # CPU: the same seed gives the same episodes anywhere
        self.generator.manual_seed(int(seed))
        self.unstable_resets = 0
        self.elapsed = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        # envs whose written state was broken: their next step is reported unstable
        self._unstable_pending = torch.zeros(num_envs, dtype=torch.bool, device=self.device)
        self.stats = EpisodeStats(self.num_envs, self.device)
        self._obs: Obs | None = None
        # per-env instruction ids (language-conditioned tasks): drawn at every reset
        self._instruction: Tensor | None = (
            torch.zeros(num_envs, dtype=torch.long, device=self.sim_device) if task.instructions else None)

        state_space = gymnasium.spaces.Box(-np.inf, np.inf, (task.obs_dim,), np.float32)
        spaces: dict[str, gymnasium.Space] = {"state": state_space}
        if obs_mode == "pixels":
            spaces["pixels"] = gymnasium.spaces.Box(0, 255, (self.image_size, self.image_size, 3), np.uint8)
        if self.reward_camera:
            spaces["reward_pixels"] = spaces["pixels"]
        if task.instructions:
            spaces["instruction"] = gymnasium.spaces.Discrete(len(task.instructions))
        self.single_observation_space = gymnasium.spaces.Dict(spaces) if len(spaces) > 1 else state_space
        self.single_action_space = gymnasium.spaces.Box(-1.0, 1.0, (task.action_dim,), np.float32)

    # ---- physics primitives (backends) ----
    @property
    def state(self) -> SimState:
        raise NotImplementedError

    def _sim_state(self, qpos: Tensor, qvel: Tensor, sensordata: Tensor, ctrl: Tensor) -> SimState:
        """The SimState over a backend's batched buffers, with this env's instruction ids."""
        return SimState(qpos, qvel, sensordata, ctrl, instruction=self._instruction)

    def _write_state(self, env_ids: Tensor, qpos: Tensor, qvel: Tensor) -> None:
        raise NotImplementedError

    def _step_physics(self, ctrl: Tensor) -> Tensor:
        raise NotImplementedError

    def _render_frames(self, env_ids: Tensor, size: int, camera: str) -> Tensor:
        raise NotImplementedError

    def _get_sim_state(self) -> dict[str, Tensor]:
        raise UserError(f"the {type(self).__name__} backend cannot snapshot its simulator state")

    def _set_sim_state(self, state: dict[str, Tensor]) -> None:
        raise UserError(f"the {type(self).__name__} backend cannot snapshot its simulator state")

    def _state_is_finite(self) -> Tensor:
        """bool[N] on sim_device: qpos, qvel and sensordata all finite (a backend may override
        this with one call over its own buffers)."""
        state = self.state
        finite = torch.isfinite(state.qpos).all(dim=1) & torch.isfinite(state.qvel).all(dim=1)
        return finite & torch.isfinite(state.sensordata).all(dim=1)

    # ---- the contract ----
    def _observe(self, env_ids: Tensor | None = None) -> Obs:
        state_obs = self.task.observe(self.state).to(device=self.device, dtype=torch.float32)
        if env_ids is not None:
            state_obs = state_obs[env_ids.to(state_obs.device)]
        if self.obs_mode == "state" and self._instruction is None:
            return state_obs
        obs = {"state": state_obs}
        if self.obs_mode == "pixels":
            ids = self._env_ids(env_ids)
            obs["pixels"] = self._render_frames(ids, self.image_size, self.task.camera).to(self.device)
            if self.reward_camera:
                obs["reward_pixels"] = self._render_frames(ids, self.image_size, self.reward_camera).to(self.device)
        if self._instruction is not None:
            instruction = self._instruction if env_ids is None else self._instruction[env_ids.to(self.sim_device)]
            obs["instruction"] = instruction.to(self.device, copy=True)
        return obs

    def _reset_envs(self, env_ids: Tensor, group_size: int | None = None) -> None:
        n = len(env_ids)
        if n == 0:
            return
        grouped = group_size is not None and group_size > 1
        if grouped:
            if n % group_size:
                raise ValueError(f"group_size {group_size} must divide the number of envs reset ({n})")
            qpos, qvel = self.task.sample_init(n // group_size, self.generator, self.sim_device)
            qpos = qpos.repeat_interleave(group_size, dim=0)
            qvel = qvel.repeat_interleave(group_size, dim=0)
        else:
            qpos, qvel = self.task.sample_init(n, self.generator, self.sim_device)
        sim_ids = env_ids.to(self.sim_device)
        if self._instruction is not None:  # drawn after the initial states, from the same generator
            count = n // group_size if grouped else n
            if self.task.fixed_instruction is not None:
                instruction = torch.full((count,), self.task.fixed_instruction, dtype=torch.long)
            else:
                instruction = self.task.sample_instruction(count, self.generator)
            if grouped:
                instruction = instruction.repeat_interleave(group_size)
            self._instruction[sim_ids] = instruction.to(self.sim_device, torch.long)
        refused = self._write_state(sim_ids, qpos, qvel)
        broken = torch.zeros(n, dtype=torch.bool) if refused is None else refused.cpu()
        not_finite = ~self._state_is_finite()[sim_ids].cpu()
        if bool(not_finite.any()):
            # what MuJoCo does with a state it refuses: the reference pose, at rest
            bad = sim_ids[not_finite.to(self.sim_device)]
            qpos0 = torch.as_tensor(self.model.qpos0, dtype=torch.float32, device=self.sim_device)
            qvel0 = torch.zeros(len(bad), self.model.nv, device=self.sim_device)
            self._write_state(bad, qpos0.expand(len(bad), -1), qvel0)
            broken |= not_finite
        ids = env_ids.to(self.device)
        self._unstable_pending[ids] = broken.to(self.device)
        self.elapsed[ids] = 0
        self.stats.clear(ids)

    def reset(
        self, seed: int | None = None, env_ids: Tensor | None = None, group_size: int | None = None
    ) -> tuple[Obs, dict[str, Any]]:
        """Reset all envs, or only `env_ids` (indices or a bool[N] mask); return obs of all N.

        A seed reseeds the env's generator first, so the same seed gives the same episodes.
        `group_size=G` gives consecutive groups of G reset envs the same initial state and the
        same instruction (GRPO).
        """
        if seed is not None:
            self.generator.manual_seed(int(seed))
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if self._obs is None and env_ids is not None:
            env_ids = None  # the first reset must set every env
        ids = self._env_ids(env_ids)
        self._reset_envs(ids, group_size)
        if self._obs is None or len(ids) == self.num_envs:
            self._obs = self._observe()
        elif len(ids):
            _assign_obs(self._obs, ids.to(self.device), self._observe(ids))
        return clone_obs(self._obs), {}

    def step(self, action: Tensor) -> tuple[Obs, Tensor, Tensor, Tensor, dict[str, Any]]:
        if self._obs is None:
            raise RuntimeError("call reset() before step()")
        action = self.check_action(action)
        sim_action = action.to(self.sim_device)
        # envs written broken since the last step count as unstable now (their resets below
        # may mark them again)
        pending = self._unstable_pending
        self._unstable_pending = torch.zeros_like(pending)
        unstable = self._step_physics(self.task.action_to_ctrl(sim_action))
        unstable = (unstable | ~self._state_is_finite()).to(self.device) | pending
        reward, success, failure = self.task.evaluate(self.state, sim_action)
        reward = reward.to(device=self.device, dtype=torch.float32)
        success, failure = success.to(self.device), failure.to(self.device)
        obs = self._observe()
        if bool(unstable.any()):
            reward = reward.masked_fill(unstable, 0.0)
            success, failure = success & ~unstable, failure & ~unstable
            # keep the last finite observation of the broken envs (what a bootstrap can use)
            bad = torch.nonzero(unstable).flatten()
            _assign_obs(obs, bad, _index_obs(self._obs, bad))
            self.unstable_resets += len(bad)

        self.elapsed += 1
        terminated = (failure | success) if self.task.success_terminates else failure
        truncated = ((self.elapsed >= self.max_episode_steps) | unstable) & ~terminated
        self.stats.update(reward, success)
        done = terminated | truncated
        info: dict[str, Any] = {
            "success": success,
            "unstable": unstable,
            "_final": done,
            "final_obs": obs,  # a fresh tensor every step; the returned obs is a copy
            "_episode": done.clone(),
            "episode": self.stats.snapshot(),
        }
        obs = clone_obs(obs)
        if bool(done.any()):
            done_ids = torch.nonzero(done).flatten()
            self._reset_envs(done_ids.cpu())
            _assign_obs(obs, done_ids, self._observe(done_ids))
        self._obs = obs
        return clone_obs(obs), reward, terminated, truncated, info

    def render(self, env_ids: Tensor | None = None) -> Tensor:
        """Frames of task.camera, uint8 [k, render_size, render_size, 3]."""
        return self._render_frames(self._env_ids(env_ids), self.render_size, self.task.camera).to(self.device)

    def get_state(self) -> dict[str, Tensor]:
        """Everything `step` continues from, as CPU tensors: the simulator's state per env
        ("sim/..."), the step counters, episode statistics, the generator, the unstable count,
        the pending unstable flags, the instruction ids ("instruction", for a task with
        instructions) and the last observation ("obs" or "obs/<key>")."""
        if self._obs is None:
            raise RuntimeError("call reset() before get_state()")
        state = {f"sim/{key}": value.detach().cpu().clone() for key, value in self._get_sim_state().items()}
        state.update({
            "elapsed": self.elapsed.cpu().clone(),
            "episode/return": self.stats.returns.cpu().clone(),
            "episode/length": self.stats.lengths.cpu().clone(),
            "episode/success_once": self.stats.success_once.cpu().clone(),
            "generator": self.generator.get_state(),
            "unstable_resets": torch.tensor(self.unstable_resets),
            "unstable_pending": self._unstable_pending.cpu().clone(),
        })
        if self._instruction is not None:
            state["instruction"] = self._instruction.cpu().clone()
        if isinstance(self._obs, dict):
            state.update({f"obs/{key}": value.cpu().clone() for key, value in self._obs.items()})
        else:
            state["obs"] = self._obs.cpu().clone()
        return state

    def set_state(self, state: dict[str, Tensor]) -> None:
        """Restore a `get_state` snapshot of an env made with the same task, num_envs and
        obs_mode (a mismatch is a UserError naming the part)."""
        dict_obs = isinstance(self.single_observation_space, gymnasium.spaces.Dict)
        obs_keys = [f"obs/{key}" for key in self.single_observation_space.spaces] if dict_obs else ["obs"]
        required = ["elapsed", "episode/return", "episode/length", "episode/success_once", "generator",
                    "unstable_resets", "unstable_pending", *obs_keys]
        if self._instruction is not None:
            required.append("instruction")
        missing = [key for key in required if key not in state]
        if missing:
            raise UserError(f"env state is missing '{missing[0]}'")
        if tuple(state["elapsed"].shape) != (self.num_envs,):
            raise UserError(f"env state holds {tuple(state['elapsed'].shape)[0]} envs, this env has {self.num_envs}")
        if self._instruction is None and "instruction" in state:
            raise UserError("env state holds instructions, this env's task has none (another task?)")
        if self._instruction is not None:
            instruction = state["instruction"]
            if tuple(instruction.shape) != (self.num_envs,) or instruction.dtype != torch.long or bool(
                    ((instruction < 0) | (instruction >= len(self.task.instructions))).any()):
                raise UserError(f"env state 'instruction' must hold int64 ids in [0, "
                                f"{len(self.task.instructions)}) (another task?)")
        self._set_sim_state({key[4:]: value for key, value in state.items() if key.startswith("sim/")})
        device = self.device
        self.elapsed = state["elapsed"].to(device, torch.long).clone()
        self.stats.returns = state["episode/return"].to(device).clone()
        self.stats.lengths = state["episode/length"].to(device).clone()
        self.stats.success_once = state["episode/success_once"].to(device).clone()
        self.generator.set_state(state["generator"].cpu())
        self.unstable_resets = int(state["unstable_resets"])
        self._unstable_pending = state["unstable_pending"].to(device).clone()
        if self._instruction is not None:
            self._instruction.copy_(state["instruction"])  # in place: the SimState holds this tensor
        if dict_obs:
            self._obs = {key[4:]: state[key].to(device).clone() for key in obs_keys}
        else:
            self._obs = state["obs"].to(device).clone()


# --------------------------------------------------------------------------------------------
# Action chunks
# --------------------------------------------------------------------------------------------


def step_chunk(env: BatchedEnv, actions: Tensor) -> tuple[Obs, Tensor, Tensor, Tensor, dict[str, Any]]:
    """Execute an action chunk [N, H, A]; return (obs, reward_sum, terminated, truncated, info).

    Semantics when an env finishes at chunk step h < H - 1 (terminated or truncated):
    - its reward is summed up to and including step h; terminated/truncated, info["final_obs"],
      info["_final"], info["episode"], info["_episode"], info["success"] come from step h;
    - the batch keeps stepping (it is stepped as one), so that env runs its remaining actions on
      its auto-reset episode, but those steps are thrown away: at the end of the chunk the env is
      reset again, so the returned obs is a fresh initial observation and the next chunk starts
      a whole new episode (no episode starts with leftover actions of the previous one);
    - if every env has finished, the chunk stops early (their obs are already fresh).
    info["steps"] (i64[N]) counts the steps that count for each env (h + 1 for a finished env,
    H otherwise): discount a bootstrap with gamma ** steps. info["unstable"] is True where a
    counted step was unstable. The envs' own generator draws the extra resets, so a seeded run
    stays deterministic.
    """
    if actions.ndim != 3 or actions.shape[0] != env.num_envs:
        raise ValueError(f"actions must have shape ({env.num_envs}, H, {env.action_dim}), got {tuple(actions.shape)}")
    n, horizon = actions.shape[0], actions.shape[1]
    if horizon < 1:
        raise ValueError("an action chunk needs at least one step")
    device = env.device
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    stale = torch.zeros(n, dtype=torch.bool, device=device)  # stepped past their end: reset again
    reward_sum = torch.zeros(n, device=device)
    terminated = torch.zeros(n, dtype=torch.bool, device=device)
    truncated = torch.zeros(n, dtype=torch.bool, device=device)
    steps = torch.zeros(n, dtype=torch.long, device=device)
    unstable = torch.zeros(n, dtype=torch.bool, device=device)
    info_out: dict[str, Any] | None = None
    obs: Obs | None = None
    for h in range(horizon):
        stale |= finished
        obs, reward, term, trunc, info = env.step(actions[:, h])
        live = ~finished
        reward_sum += torch.where(live, reward, torch.zeros_like(reward))
        steps += live.long()
        terminated |= term & live
        truncated |= trunc & live
        unstable |= info["unstable"] & live
        if info_out is None:
            info_out = {key: clone_obs(value) if key == "final_obs" else value for key, value in info.items()}
            info_out["episode"] = dict(info["episode"])
        else:
            # rows of envs still live take this step's info; finished rows keep theirs
            for key in ("success", "_final", "_episode"):
                info_out[key] = torch.where(live, info[key], info_out[key])
            for key, value in info["episode"].items():
                info_out["episode"][key] = torch.where(live, value, info_out["episode"][key])
            live_ids = torch.nonzero(live).flatten()
            _assign_obs(info_out["final_obs"], live_ids, _index_obs(info["final_obs"], live_ids))
        finished |= term | trunc
        if bool(finished.all()):
            break
    if bool(stale.any()):
        obs, _ = env.reset(env_ids=torch.nonzero(stale).flatten().cpu())
    info_out["steps"] = steps
    info_out["unstable"] = unstable
    return obs, reward_sum, terminated, truncated, info_out
