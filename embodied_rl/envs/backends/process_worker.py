"""A worker of the process backend (embodied_rl/envs/backends/process.py): K envs of one
simulator, stepped on the parent's command.

The parent starts it as `[python, process_worker.py]` with any Python >= 3.8, typically the
interpreter of another venv where a simulator lives with its own pinned packages (LIBERO's, with
robosuite and its own mujoco). So this file imports only the standard library, numpy and what the
env spec names (gymnasium for an env id, the module of a factory): never torch or embodied_rl,
and nothing newer than Python 3.8.

Arrays go through shared memory: a file in /dev/shm that the parent creates and lays out, and
that both processes map. Commands and their short answers are one JSON object per line, on the
worker's stdin and stdout:

  {"cmd": "make", "spec": {...}, "count": K}      -> {"ok": true, "describe": {spaces, ...}}
      spec: {"env_id", ...} or {"factory": "module:attr" or "/path/file.py:attr", "env_kwargs",
      "per_env": K dicts, env k's own keyword arguments (optional)}
  {"cmd": "attach", "path": P, "size": S, "rows": [start, stop],
   "fields": [[name, offset, shape, dtype], ...]} -> {"ok": true}
  {"cmd": "reset", "seeds": [int or null] * K, "mask": [bool] * K}    obs -> shared memory
  {"cmd": "step"}     actions from shared memory; obs, reward, flags, final obs back into it
  {"cmd": "render", "ids": [local ids]}           -> {"ok": true, "frames": [packed array]}
  {"cmd": "get_state"}                            -> {"ok": true, "states": [per env]}
  {"cmd": "set_state", "states": [per env]}
Every other answer is {"ok": true}; a closed stdin closes the envs and ends the worker. Arrays
in answers are packed as {"shape", "dtype", "data": base64 of the bytes} (`pack`, `unpack`).

Snapshots work where the simulator allows: an env whose unwrapped env has `get_state() ->
dict[str, numpy array]` (everything its future depends on: physics, random state, counters) and
`set_state(state)` (applied after one reset). An env's state here is {"sim": its arrays, packed,
"elapsed": the step count of gymnasium's TimeLimit wrapper, or null without one}.

A finished env is reset in the same step (gymnasium's SAME_STEP autoreset): its last
observation goes to the final_* arrays, the first of its next episode to obs. A failure answers
{"ok": false, "error": one line, "env": local index or null}, or {"ok": false, "missing": name}
for a module this interpreter cannot import. The worker ends when its stdin closes or its parent
process goes away, whatever it is doing at the time.
"""

from __future__ import annotations

import base64
import importlib
import importlib.util
import json
import math
import mmap
import os
import re
import signal
import sys
import threading
import time

# Run as a script, this file's folder is sys.path[0]; its gymnasium.py (the parent's backend
# module) would shadow the gymnasium package.
_here = os.path.dirname(os.path.realpath(__file__))
if sys.path and os.path.realpath(sys.path[0] or os.curdir) == _here:
    del sys.path[0]

try:
    import numpy as np
except ModuleNotFoundError:  # the first command answers {"missing": "numpy"}
    np = None

# Info keys that envs use for task success: gymnasium-robotics says `is_success`, Meta-World says
# `success`. The first one present wins (as in the gymnasium backend).
SUCCESS_KEYS = ("is_success", "success")


def pack(array):
    array = np.asarray(array)  # tobytes() is C order whatever the layout; 0-d arrays stay 0-d
    return {"shape": list(array.shape), "dtype": array.dtype.str, "data": base64.b64encode(array.tobytes()).decode()}


def unpack(packed):
    data = base64.b64decode(packed["data"])
    return np.frombuffer(data, dtype=np.dtype(packed["dtype"])).reshape(packed["shape"]).copy()


def time_limits(env):
    """The TimeLimit wrappers around env (their step counts are part of a snapshot)."""
    while env is not None:
        if hasattr(env, "_elapsed_steps"):
            yield env
        env = getattr(env, "env", None)


def success_of(info):
    """The first success key present in a step's info, False without one."""
    for key in SUCCESS_KEYS:
        if key in (info or {}):
            return bool(info[key])
    return False


class EnvError(Exception):
    """A failure of one env (an exception in it, or a result that is not what it declared)."""

    def __init__(self, env, message):
        super().__init__(message)
        self.env = env


class Missing(Exception):
    """A module this interpreter cannot import."""

    @classmethod
    def of(cls, error):
        # gymnasium re-raises a failed "module:id" import without the module's name
        found = re.search(r"No module named '([^']+)'", str(error))
        return cls(error.name or (found.group(1) if found else one_line(error)))


def one_line(error):
    """An exception as one line: the parent prints it as the failure's single line."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _import(name):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        raise Missing.of(error) from None


def _field(space, what):
    """[shape, dtype] of a Box or Discrete space (duck-typed: gym and gymnasium spaces alike)."""
    if hasattr(space, "low") and hasattr(space, "high"):
        return [list(space.shape), np.dtype(space.dtype).str]
    if hasattr(space, "n"):
        return [[], np.dtype(np.int64).str]
    raise ValueError(f"{what} is a {type(space).__name__} space; only Box and Discrete ones "
                     "(and a Dict of them) cross to the parent")


def describe(env, spec):
    """The spaces and facts the parent lays out shared memory and checks the contract with."""
    obs_space, act_space = env.observation_space, env.action_space
    subspaces = getattr(obs_space, "spaces", None)
    if isinstance(subspaces, dict):
        fields = {key: _field(sub, f"observation entry {key!r}") for key, sub in subspaces.items()}
    else:
        fields = {"obs": _field(obs_space, "the observation")}
    action = None
    if hasattr(act_space, "low") and hasattr(act_space, "high"):
        action = {"shape": list(act_space.shape), "dtype": np.dtype(act_space.dtype).str,
                  "low": np.asarray(act_space.low, dtype=np.float64).ravel().tolist(),
                  "high": np.asarray(act_space.high, dtype=np.float64).ravel().tolist()}
    env_spec = getattr(env, "spec", None)
    unwrapped = getattr(env, "unwrapped", env)
    # the time limit: gymnasium's TimeLimit, else the env's own (this package's tasks say it)
    limit = (getattr(env_spec, "max_episode_steps", None) or spec.get("max_episode_steps")
             or getattr(unwrapped, "max_episode_steps", None))
    instructions = getattr(unwrapped, "instructions", None) or []
    versions = getattr(unwrapped, "versions", None) or {}  # the simulator's packages, where it says them
    return {"obs": fields, "dict_obs": isinstance(subspaces, dict), "action": action,
            "can_snapshot": hasattr(unwrapped, "get_state") and hasattr(unwrapped, "set_state"),
            "action_space": type(act_space).__name__, "max_episode_steps": limit,
            "instructions": [str(text) for text in instructions],
            "versions": {str(key): str(value) for key, value in dict(versions).items()}}


def import_factory(factory):
    """The function "module:attr" names; the module may be a file ("/path/to/file.py:attr"),
    for a factory that is no installed module (embodied_rl/envs/sims/*.py, which this
    interpreter cannot import as part of embodied_rl)."""
    module_name, _, attr = factory.partition(":")
    if not module_name.endswith(".py"):
        return getattr(_import(module_name), attr)
    name = os.path.splitext(os.path.basename(module_name))[0]
    spec = importlib.util.spec_from_file_location(name, module_name)
    if spec is None or not os.path.isfile(module_name):
        raise ValueError(f"the factory file {module_name!r} does not exist")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as error:
        raise Missing.of(error) from None
    return getattr(module, attr)


def make_envs(spec, count):
    """K envs from the spec: a factory "module:attr" called with env_kwargs (and env k's own
    entry of per_env, this worker's rows of it), or a gymnasium id made as the gymnasium backend
    makes it."""
    kwargs = dict(spec.get("env_kwargs") or {})
    if spec.get("factory"):
        factory = import_factory(spec["factory"])
        per_env = spec.get("per_env") or [{}] * count
        try:
            return [factory(**kwargs, **per_env[k]) for k in range(count)]
        except ModuleNotFoundError as error:  # the simulator itself, imported by the factory
            raise Missing.of(error) from None
    gym = _import("gymnasium")

    def make_one():
        env = gym.make(spec["env_id"], render_mode=spec.get("render_mode"),
                       max_episode_steps=spec.get("max_episode_steps"), **kwargs)
        return gym.wrappers.FlattenObservation(env) if spec.get("flatten_obs") else env

    try:
        return [make_one() for _ in range(count)]
    except ModuleNotFoundError as error:
        raise Missing.of(error) from None
    except gym.error.Error as error:
        raise ValueError(f"gymnasium could not make {spec['env_id']!r}: {one_line(error)}") from None


class Worker:
    def __init__(self):
        self.envs = []
        self.views = {}
        self.targets = {}
        self.mapped = None

    # ------------------------------------------------------------------ commands

    def make(self, spec, count):
        if np is None:
            raise Missing("numpy")
        self.envs = make_envs(spec, count)
        info = describe(self.envs[0], spec)
        self.dict_obs = info["dict_obs"]
        if info["action"] is not None:
            self.act_shape = tuple(info["action"]["shape"])
            self.act_dtype = info["action"]["dtype"]
        return {"describe": info}

    def attach(self, path, size, rows, fields):
        with open(path, "r+b") as handle:
            self.mapped = mmap.mmap(handle.fileno(), size)
        start, stop = rows
        for name, offset, shape, dtype in fields:
            whole = np.ndarray(tuple(shape), dtype=np.dtype(dtype), buffer=self.mapped, offset=offset)
            self.views[name] = whole[start:stop]
        keys = [name[4:] for name, *_ in fields if name.startswith("obs/")]
        # where each observation entry goes: the rows of "obs/<key>" or "final/<key>"
        self.targets = {prefix: [(key, self.views[prefix + "/" + key]) for key in keys] for prefix in ("obs", "final")}
        return {}

    def reset(self, seeds, mask):
        for i, env in enumerate(self.envs):
            if mask[i]:
                obs, _ = self._call(i, 2, env.reset, seed=seeds[i])
                self._write_obs("obs", i, obs)
        return {}

    def step(self):
        shared = self.views
        actions = shared["action"].astype(self.act_dtype).reshape((len(self.envs),) + self.act_shape)
        for i, env in enumerate(self.envs):
            obs, reward, terminated, truncated, info = self._call(i, 5, env.step, actions[i])
            if terminated not in (True, False) or truncated not in (True, False):
                raise EnvError(i, f"returned terminated={terminated!r}, truncated={truncated!r}; both must be booleans")
            shared["reward"][i] = self._number(i, reward)
            shared["terminated"][i], shared["truncated"][i] = terminated, truncated
            shared["success"][i] = success_of(info)
            shared["final"][i] = done = bool(terminated or truncated)
            if done:  # same-step auto-reset, continuing the env's own random stream
                self._write_obs("final", i, obs)
                obs, _ = self._call(i, 2, env.reset)
            self._write_obs("obs", i, obs)
        return {}

    def render(self, ids):
        frames = []
        for i in ids:
            frame = self._call(i, None, self.envs[i].render)
            if frame is None:
                raise EnvError(i, "returned no frame: make the env with render_mode='rgb_array'")
            frames.append(pack(np.asarray(frame, dtype=np.uint8)[..., :3]))
        return {"frames": frames}

    def get_state(self):
        states = []
        for i, env in enumerate(self.envs):
            arrays = self._call(i, None, env.unwrapped.get_state)
            elapsed = [wrapper._elapsed_steps for wrapper in time_limits(env)]
            states.append({"sim": {key: pack(np.asarray(value)) for key, value in arrays.items()},
                           "elapsed": elapsed[0] if elapsed else None})
        return {"states": states}

    def set_state(self, states):
        for i, (env, state) in enumerate(zip(self.envs, states)):
            self._call(i, 2, env.reset)  # the wrappers (OrderEnforcing, TimeLimit) want one first
            self._call(i, None, env.unwrapped.set_state, {key: unpack(value) for key, value in state["sim"].items()})
            for wrapper in time_limits(env):
                wrapper._elapsed_steps = state["elapsed"]
        return {}

    def close(self):
        for env in self.envs:
            try:
                env.close()
            except Exception:  # closing is best effort: the process ends next
                pass
        self.envs = []
        return {}

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _call(i, size, method, *args, **kwargs):
        """env i's `method(...)`; a failure, or a result that is not a tuple of `size` (gymnasium's
        API: reset -> (obs, info), step -> 5 values), is an EnvError naming env i."""
        try:
            result = method(*args, **kwargs)
        except Exception as error:
            raise EnvError(i, one_line(error)) from error
        if size is not None and not (isinstance(result, tuple) and len(result) == size):
            raise EnvError(i, f"{method.__name__}() returned {type(result).__name__} "
                              f"{str(result)[:40]!r}, not the {size} values of gymnasium's API")
        return result

    @staticmethod
    def _number(i, value):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise EnvError(i, f"returned the reward {value!r}, not a number") from None
        if not math.isfinite(value):
            raise EnvError(i, f"returned the reward {value!r}")
        return value

    def _write_obs(self, prefix, i, obs):
        """Observation `obs` of env i into the shared rows `prefix/<key>`, checked against the
        shape its space declared."""
        if self.dict_obs and not isinstance(obs, dict):
            raise EnvError(i, f"returned a {type(obs).__name__} observation; its space is a Dict")
        for key, rows in self.targets[prefix]:
            if self.dict_obs and key not in obs:
                raise EnvError(i, f"returned an observation without the entry {key!r}")
            value = np.asarray(obs[key] if self.dict_obs else obs)
            if value.shape != rows.shape[1:]:
                what = f"the observation entry {key!r}" if self.dict_obs else "an observation"
                raise EnvError(i, f"returned {what} of shape {value.shape}, its space says {rows.shape[1:]}")
            rows[i] = value


def watch_parent(parent):
    """End this process when its parent goes away, even in the middle of a simulator call."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def main():
    # Ctrl-C reaches the whole process group; the parent decides, and its exit ends this worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the simulator prints goes to stderr, never into the answers
    threading.Thread(target=watch_parent, args=(os.getppid(),), daemon=True).start()
    worker = Worker()
    for line in sys.stdin:
        try:
            message = json.loads(line)
            answer = {"ok": True, **getattr(worker, message.pop("cmd"))(**message)}
        except Missing as error:
            answer = {"ok": False, "missing": str(error)}
        except EnvError as error:
            answer = {"ok": False, "env": error.env, "error": str(error)}
        except Exception as error:
            answer = {"ok": False, "env": None, "error": one_line(error)}
        try:
            answers.write(json.dumps(answer) + "\n")
            answers.flush()
        except BrokenPipeError:  # the parent went away mid-call: nobody to answer, nothing to report
            os._exit(0)
    worker.close()  # stdin closed: the parent closed the env or went away


if __name__ == "__main__":
    main()
