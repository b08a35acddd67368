"""Backend `process`: any simulator in worker processes, under this or another Python interpreter.

A simulator that cannot live in this process (LIBERO's robosuite 1.4 pins its own mujoco; a suite
that needs another Python) runs in workers started as `[python, process_worker.py]`, where
`python` is any interpreter with numpy and the simulator: a venv's `bin/python`, or a command
(`conda run -n libero python`). The worker (process_worker.py) imports neither torch nor this
package. N envs are split into contiguous rows over W workers, K = N / W each; the BatchedEnv
contract is the gymnasium backend's (same seeds, same-step auto-reset, final_obs, success), so
an env gives the same numbers here as in `backend=gymnasium`.

Arrays travel through one shared-memory file (under /dev/shm) that every worker maps: actions
[N, A] float64 in, and obs, reward, terminated, truncated, success, final and the final
observations out, each worker writing only its rows. Commands and short answers are JSON lines
on the workers' stdin and stdout. The file is unlinked once every worker has mapped it, so
nothing is left behind however the processes end.

Failures are one line naming the env rows and the worker (index, pid, interpreter), and the env
closes all its workers (the run stops with exit code 2; there is no restart): a worker that dies,
does not answer within `timeout` seconds (then it is killed), or answers what the contract does
not allow (an observation of another shape, a reward that is not a finite number, flags that
are not booleans, a line that is not JSON). Workers end with the env (`close`, garbage
collection, interpreter exit) and with this process, however it ends: each watches its stdin and
its parent pid.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch

from embodied_rl.envs.api import _assign_obs, _index_obs
from embodied_rl.envs.backends.gymnasium import HostVectorEnv, gym_box
from embodied_rl.envs.backends.process_worker import pack, unpack
from embodied_rl.errors import UserError

WORKER = Path(__file__).with_name("process_worker.py")
DEFAULT_TIMEOUT = 60.0
# Starting a worker (its imports, making its first env: a robosuite scene takes seconds) may
# take longer than a step: it gets at least this long, and `timeout` more for each further env.
START_TIMEOUT = 120.0
OPTIONS = ("python", "workers", "timeout", "factory", "env_kwargs", "max_episode_steps",
           "render_mode", "flatten_obs", "task_weights")
OBS_KEYS = ("state", "pixels", "instruction")  # the dict observation entries of the contract
SETUP = "python3 -m venv DIR && DIR/bin/pip install numpy gymnasium <your simulator>"


def interpreter(python: str | list[str] | None) -> list[str]:
    """The command that starts a worker's Python: this interpreter by default, a path to one, or
    a command (a string split as a shell would, or a list). One that is not there is a UserError
    saying how to make one."""
    if python is None:
        return [sys.executable]
    command = shlex.split(python) if isinstance(python, str) else [str(part) for part in python]
    if not command:
        raise UserError("the process backend's python (task.process.python) is empty")
    if shutil.which(command[0]) is None:
        raise UserError(f"the process backend's interpreter {command[0]!r} does not exist or is not "
                        f"executable; set task.process.python= (python=) to a Python that has the "
                        f"simulator, e.g. a venv: {SETUP}")
    return command


class WorkerFailure(Exception):
    def __init__(self, worker: Worker, message: str, env: int | None = None):
        super().__init__(message)
        self.worker, self.env = worker, env


class Worker:
    """One worker process: its rows of the N envs, and one JSON line each way per command."""

    def __init__(self, index: int, rows: range, command: list[str]):
        self.index, self.rows, self.command = index, rows, command
        environment = dict(os.environ)
        # W workers already share the cores: one math thread each unless the user says otherwise
        environment.setdefault("OMP_NUM_THREADS", "1")
        try:
            self.process = subprocess.Popen([*command, str(WORKER)], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, env=environment)
        except OSError as error:
            raise UserError(f"the process backend could not start {command[0]!r}: {error.strerror}; "
                            f"set task.process.python= (python=) to a working Python, e.g. {SETUP}"
                            ) from None
        self._buffer = b""

    def __str__(self) -> str:
        return f"worker {self.index}, pid {self.process.pid}, {' '.join(self.command)}"

    def send(self, message: dict[str, Any]) -> None:
        try:
            self.process.stdin.write(json.dumps(message).encode() + b"\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerFailure(self, self._exit_text()) from None

    def receive(self, what: str, deadline: float, timeout: float) -> dict[str, Any]:
        """The answer to the last command; a worker that ends or stays silent past `deadline`
        (the end of the request's `timeout`; it is then killed) or answers garbage raises
        WorkerFailure."""
        stdout = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([stdout], [], [], remaining)[0]:
                self.kill()
                raise WorkerFailure(self, f"no answer to {what!r} within {timeout:g} s (raise it with "
                                          "task.process.timeout=SECONDS); the worker was stopped")
            chunk = os.read(stdout, 1 << 20)
            if not chunk:
                raise WorkerFailure(self, self._exit_text(what))
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
            raise WorkerFailure(self, f"answered {line[:80]!r} to {what!r}, not the protocol's JSON")
        return answer

    def _exit_text(self, what: str | None = None) -> str:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.process.returncode
        during = f" during {what!r}" if what else ""
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}{during}"
        return f"exited with code {code}{during} (its stderr above says why)"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _stop(workers: list[Worker]) -> None:
    """End every worker: close their stdin (they close their envs and exit), kill the ones still
    there two seconds later. Runs at close(), garbage collection and interpreter exit."""
    for worker in workers:
        try:
            worker.process.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + 2.0
    for worker in workers:
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.kill()
        worker.process.stdout.close()


class ProcessEnv(HostVectorEnv):
    """N copies of an env run by W worker processes, as one batch of torch tensors.

    Args:
        name: the env's name in messages; the gymnasium id to make unless `factory` is given.
        spec: what each worker makes: {"env_id"} or {"factory": "module:attr"} (the module may be
            a file: "/path/file.py:attr"), plus env_kwargs and, for an env id, max_episode_steps,
            render_mode and flatten_obs. A factory's spec may add "per_env" (N dicts: env i's own
            keyword arguments; a grouped reset keeps a group within envs made alike) and "setup"
            (how to get a module the workers lack, for the message).
        num_envs, seed, device: as in the gymnasium backend (copy i is seeded seed + i).
        python: the workers' interpreter: None (this one), a path or a command.
        workers: W (default: one per available core, at most N).
        timeout: seconds to wait for any answer of a worker (making its envs included).
    """

    def __init__(self, name: str, spec: dict[str, Any], num_envs: int = 1, seed: int = 0,
                 device: str | torch.device = "cpu", python: str | list[str] | None = None,
                 workers: int | None = None, timeout: float | None = None) -> None:
        command = interpreter(python)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        count = min(int(workers or cores), num_envs)
        self.name = name
        self.timeout = float(timeout or DEFAULT_TIMEOUT)
        spec = dict(spec)
        self._setup_hint = spec.pop("setup", None)
        self._per_env = spec.pop("per_env", None)
        if self._per_env is not None and len(self._per_env) != num_envs:
            raise ValueError(f"spec['per_env'] has {len(self._per_env)} entries for {num_envs} envs")
        bounds = np.linspace(0, num_envs, count + 1).round().astype(int)
        self._workers: list[Worker] = []
        self._stopper = weakref.finalize(self, _stop, self._workers)
        try:
            for w in range(count):
                self._workers.append(Worker(w, range(bounds[w], bounds[w + 1]), command))
        except UserError:
            self.close()
            raise
        most = max(len(worker.rows) for worker in self._workers)
        describes = [answer["describe"] for answer in self._request(
            "make", [{"spec": self._worker_spec(spec, worker), "count": len(worker.rows)} for worker in self._workers],
            timeout=max(self.timeout, START_TIMEOUT) + self.timeout * (most - 1))]
        self._describe = describes[0]
        for worker, other in zip(self._workers, describes):
            if {k: other[k] for k in ("obs", "action")} != {k: self._describe[k] for k in ("obs", "action")}:
                self._fail(WorkerFailure(worker, "made envs with other spaces than worker 0's"))
        self._check_spaces()
        action = self._describe["action"]
        self._setup(num_envs, seed, device, np.reshape(action["low"], action["shape"]),
                    np.reshape(action["high"], action["shape"]), np.dtype(action["dtype"]))
        self.max_episode_steps = self._describe["max_episode_steps"]
        self._map_shared_memory()

    # ---------------------------------------------------------------- set-up

    def _worker_spec(self, spec: dict[str, Any], worker: Worker) -> dict[str, Any]:
        if self._per_env is None:
            return spec
        return {**spec, "per_env": self._per_env[worker.rows.start:worker.rows.stop]}

    def _check_spaces(self) -> None:
        describe, name = self._describe, self.name
        if describe["action"] is None:
            raise self._closed_with(f"{name!r} has a {describe['action_space']} action space; the process "
                                    "backend takes Box (continuous) actions only")
        if not (np.all(np.isfinite(describe["action"]["low"])) and np.all(np.isfinite(describe["action"]["high"]))):
            raise self._closed_with(f"{name!r} has unbounded actions; actions in [-1, 1] cannot be rescaled to them")
        fields = describe["obs"]
        self._dict_obs = describe["dict_obs"]
        if not self._dict_obs:
            self.obs_dim = int(np.prod(fields["obs"][0]))
            self.single_observation_space = gym_box(-np.inf, np.inf, self.obs_dim)
            return
        other = sorted(set(fields) - set(OBS_KEYS))
        if "state" not in fields or other:
            raise self._closed_with(
                f"{name!r} has the observation entries {sorted(fields)}; the process backend passes on "
                f"'state' (required), 'pixels' and 'instruction' (flatten_obs=True flattens a Dict into one Box)")
        self.obs_dim = int(np.prod(fields["state"][0]))
        spaces: dict[str, gymnasium.Space] = {"state": gym_box(-np.inf, np.inf, self.obs_dim)}
        if "pixels" in fields:
            shape, dtype = fields["pixels"]
            if len(shape) != 3 or shape[2] != 3 or np.dtype(dtype) != np.uint8:
                raise self._closed_with(f"{name!r} gives pixels {dtype} {shape}; the contract's are uint8 [H, W, 3]")
            spaces["pixels"] = gymnasium.spaces.Box(0, 255, tuple(shape), np.uint8)
        if "instruction" in fields:
            if fields["instruction"][0] or not describe["instructions"]:
                raise self._closed_with(f"{name!r} gives an 'instruction' entry but no `instructions` list "
                                        "(the texts its ids index) or not one id per env")
            spaces["instruction"] = gymnasium.spaces.Discrete(len(describe["instructions"]))
        self.single_observation_space = gymnasium.spaces.Dict(spaces)

    def _map_shared_memory(self) -> None:
        """Lay out the shared arrays, [N, ...] each, in one file that every worker maps."""
        n, describe = self.num_envs, self._describe
        fields = [("action", (n, self._act_low.size), "<f8"), ("reward", (n,), "<f8")]
        fields += [(flag, (n,), "|b1") for flag in ("terminated", "truncated", "success", "final")]
        for prefix in ("obs", "final"):
            fields += [(f"{prefix}/{key}", (n, *shape), dtype) for key, (shape, dtype) in describe["obs"].items()]
        layout, size = [], 0
        for name, shape, dtype in fields:
            layout.append([name, size, list(shape), dtype])
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            size += (nbytes + 63) // 64 * 64  # each array 64-byte aligned
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, not disk, on Linux
        handle, path = tempfile.mkstemp(prefix="embodied_rl_process_", dir=folder)
        try:
            os.ftruncate(handle, size)
            self._mapped = mmap.mmap(handle, size)
            self._request("attach", [{"path": path, "size": size, "rows": [worker.rows.start, worker.rows.stop],
                                      "fields": layout} for worker in self._workers])
        finally:
            os.close(handle)
            os.unlink(path)  # the mappings keep the memory alive; nothing is left behind
        self._views = {name: np.ndarray(shape, np.dtype(dtype), buffer=self._mapped, offset=offset)
                       for name, offset, shape, dtype in layout}

    # ---------------------------------------------------------------- talking to the workers

    def _request(self, command: str, payloads: list[dict[str, Any]] | None = None,
                 workers: list[Worker] | None = None, timeout: float | None = None) -> list[dict[str, Any]]:
        """Send a command to the workers (all at once, so they work in parallel), then collect
        their answers; any failure closes the env and raises one UserError line."""
        workers = self._workers if workers is None else workers
        if not self._workers:
            raise RuntimeError(f"the process env {self.name!r} is closed")
        payloads = payloads or [{}] * len(workers)
        try:
            for worker, payload in zip(workers, payloads):
                worker.send({"cmd": command, **payload})
            timeout = timeout or self.timeout
            deadline = time.monotonic() + timeout
            answers = []
            for worker in workers:
                answer = worker.receive(command, deadline, timeout)
                if not answer["ok"]:
                    raise WorkerFailure(worker, self._error_text(worker, answer), answer.get("env"))
                answers.append(answer)
        except WorkerFailure as failure:
            self._fail(failure)
        return answers

    def _error_text(self, worker: Worker, answer: dict[str, Any]) -> str:
        missing = answer.get("missing")
        if missing and self._setup_hint:
            return f"cannot import {missing!r}: {self._setup_hint}"
        if missing:
            return (f"cannot import {missing!r}: install it into that interpreter ({worker.command[0]} -m pip "
                    f"install {missing}) or set task.process.python= (python=) to one that has it, e.g. {SETUP}")
        return str(answer.get("error"))

    def _fail(self, failure: WorkerFailure) -> None:
        worker = failure.worker
        local = failure.env
        rows = [worker.rows[local]] if isinstance(local, int) and 0 <= local < len(worker.rows) else worker.rows
        envs = f"env {rows[0]}" if len(rows) == 1 else f"envs {rows[0]}-{rows[-1]}"
        raise self._closed_with(f"process backend: {envs} of {self.name!r} ({worker}) {failure}")

    def _closed_with(self, message: str) -> UserError:
        self.close()
        return UserError(message)

    # ---------------------------------------------------------------- reset / step

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None,
              group_size: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Reset all envs, or only `env_ids` (indices or a bool[N] mask); return obs of all N.
        Seeds as in the gymnasium backend: env i gets seed + i; later resets continue each
        env's stream; `group_size=G` gives groups of G reset envs one seed each."""
        ids, seeds = self._reset_seeds(seed, env_ids, group_size)
        if (group_size or 1) > 1 and self._per_env is not None:
            for start in range(0, len(ids), group_size):
                group = ids[start:start + group_size]
                if any(self._per_env[i] != self._per_env[group[0]] for i in group):
                    raise UserError(f"group_size={group_size} puts envs {group[0]}-{group[-1]} of {self.name!r}, which "
                                    "run different tasks, in one group: choose a group size that divides the envs per task")
        mask = np.zeros(self.num_envs, dtype=bool)
        mask[ids] = True
        busy = [worker for worker in self._workers if mask[worker.rows.start:worker.rows.stop].any()]
        self._request("reset", [{"seeds": [seeds[i] for i in worker.rows],
                                 "mask": mask[worker.rows.start:worker.rows.stop].tolist()} for worker in busy], busy)
        return self._observation("obs"), {}

    def step(self, action: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        self._views["action"][:] = self._env_action(action)
        self._request("step")
        views = self._views
        obs = self._observation("obs", "cpu")
        final_mask = views["final"].copy()
        final_obs = self._observation("obs", "cpu")  # the true last observation where final is set
        if final_mask.any():
            rows = torch.from_numpy(np.flatnonzero(final_mask))
            _assign_obs(final_obs, rows, _index_obs(self._observation("final", "cpu"), rows))
        return self._step_result(obs, views["reward"].copy(), views["terminated"].copy(),
                                 views["truncated"].copy(), views["success"].copy(), final_mask, final_obs)

    def _observation(self, prefix: str, device: torch.device | str | None = None) -> Any:
        """Copies of the shared observation rows: float32 [N, D] (or a dict of state f32 [N, D],
        pixels u8 [N, H, W, 3], instruction i64 [N])."""
        device = device or self.device
        n, views = self.num_envs, self._views
        if not self._dict_obs:
            return torch.from_numpy(np.array(views[f"{prefix}/obs"], dtype=np.float32).reshape(n, -1)).to(device)
        obs = {"state": torch.from_numpy(np.array(views[f"{prefix}/state"], dtype=np.float32).reshape(n, -1))}
        if f"{prefix}/pixels" in views:
            obs["pixels"] = torch.from_numpy(views[f"{prefix}/pixels"].copy())
        if f"{prefix}/instruction" in views:
            obs["instruction"] = torch.from_numpy(np.array(views[f"{prefix}/instruction"], dtype=np.int64))
        return {key: value.to(device) for key, value in obs.items()}

    # ---------------------------------------------------------------- render / misc

    @property
    def instructions(self) -> list[str]:
        return list(self._describe["instructions"])

    @property
    def simulator(self) -> dict[str, str]:
        """The versions the workers' env reports (its `versions` attribute; {} without one)."""
        return dict(self._describe.get("versions") or {})

    def render(self, env_ids: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """uint8 Tensor[k, H, W, 3] of the envs `env_ids` (all when None), drawn by the workers
        (render_mode='rgb_array'; frames have the env's own size)."""
        ids = self._env_ids(env_ids).tolist()
        busy = [worker for worker in self._workers if any(i in worker.rows for i in ids)]
        answers = self._request("render", [{"ids": [i - worker.rows.start for i in ids if i in worker.rows]}
                                           for worker in busy], busy)
        frames = {}
        for worker, answer in zip(busy, answers):
            local = [i for i in ids if i in worker.rows]
            frames.update({i: unpack(frame) for i, frame in zip(local, answer["frames"])})
        if not ids:
            return torch.zeros(0, 0, 0, 3, dtype=torch.uint8)
        return torch.from_numpy(np.stack([frames[i] for i in ids]))

    @property
    def can_snapshot(self) -> bool:
        """Whether the envs have get_state/set_state (process_worker.py's docstring)."""
        return bool(self._describe["can_snapshot"])

    def get_state(self) -> dict[str, torch.Tensor]:
        """Everything `step` continues from, as CPU tensors: each env's simulator state
        ("sim/<i>/<key>") and TimeLimit count ("time_limit", -1 without one), the episode
        statistics, the generator and the last observations as the workers wrote them."""
        if not self.can_snapshot:
            return super().get_state()  # the UserError: cannot snapshot
        if not self._seeded:
            raise RuntimeError("call reset() before get_state()")
        states = [state for answer in self._request("get_state") for state in answer["states"]]
        snapshot = {f"sim/{i}/{key}": torch.from_numpy(unpack(value))
                    for i, state in enumerate(states) for key, value in state["sim"].items()}
        snapshot["time_limit"] = torch.tensor([-1 if s["elapsed"] is None else s["elapsed"] for s in states])
        snapshot.update({"episode/return": self.stats.returns.clone(), "episode/length": self.stats.lengths.clone(),
                         "episode/success_once": self.stats.success_once.clone(), "generator": self.generator.get_state()})
        snapshot.update({name: torch.from_numpy(self._views[name].copy()) for name in self._views if name.startswith("obs/")})
        return snapshot

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a `get_state` snapshot of an env made with the same name, options and num_envs
        (a mismatch is a UserError naming the part)."""
        if not self.can_snapshot:
            return super().set_state(state)
        observations = [name for name in self._views if name.startswith("obs/")]
        required = ["time_limit", "episode/return", "episode/length", "episode/success_once", "generator",
                    *observations, *(f"sim/{i}/" for i in range(self.num_envs))]
        missing = [key for key in required if not any(name.startswith(key) for name in state)]
        if missing or any(f"sim/{self.num_envs}/" in name for name in state):
            raise UserError(f"env state is missing '{missing[0]}'" if missing else
                            f"env state holds more than this env's {self.num_envs} envs")
        for name in observations:
            if tuple(state[name].shape) != self._views[name].shape:
                raise UserError(f"env state '{name}' has shape {tuple(state[name].shape)}, this env "
                                f"{self._views[name].shape} (another env?)")
        limits = state["time_limit"].tolist()
        self._request("set_state", [{"states": [{
            "sim": {key.split("/", 2)[2]: pack(value.numpy()) for key, value in state.items() if key.startswith(f"sim/{i}/")},
            "elapsed": None if limits[i] < 0 else limits[i]} for i in worker.rows]} for worker in self._workers])
        for name in observations:
            self._views[name][:] = state[name].numpy()
        self.stats.returns = state["episode/return"].clone()
        self.stats.lengths = state["episode/length"].clone()
        self.stats.success_once = state["episode/success_once"].clone()
        self.generator.set_state(state["generator"])
        self._seeded = True

    @property
    def worker_pids(self) -> list[int]:
        return [worker.process.pid for worker in self._workers]

    def close(self) -> None:
        self._stopper()
        self._workers.clear()


def _check_options(options: dict[str, Any]) -> None:
    """Check the options' types: one UserError line naming the key."""
    python = options.get("python")
    if python is not None and not isinstance(python, (str, list, tuple)):
        raise UserError(f"task.process.python must be a path or a command, got {python!r}")
    workers = options.get("workers")
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise UserError(f"task.process.workers must be an integer >= 1, got {workers!r}")
    timeout = options.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout <= 0):
        raise UserError(f"task.process.timeout must be a number of seconds > 0, got {timeout!r}")
    factory = options.get("factory")
    if factory is not None and (not isinstance(factory, str) or ":" not in factory):
        raise UserError(f"factory must be 'module:attribute', got {factory!r}")
    try:
        json.dumps(options.get("env_kwargs") or {})
    except (TypeError, ValueError):
        raise UserError("env_kwargs must be JSON values (they travel to the workers as JSON)") from None


def make_env(task: str | Any, num_envs: int, device: str | torch.device = "cpu", seed: int = 0, *,
             obs_mode: str = "state", image_size: int = 96, render_size: int = 256,
             **options: Any) -> ProcessEnv:
    """The registry's entry point: `task` is a gymnasium id (its `module:id` form imports the
    module in the worker first), a task name of this package (made in each worker through its
    gymnasium registration, so that worker's interpreter needs embodied_rl), with
    `factory="module:attr"` a name for messages, or a Task that describes its workers
    (`process_spec(num_envs, obs_mode, image_size, render_size, task_weights)` and
    `worker_python(python)`: LIBERO's, envs/tasks/libero.py), which the env then carries as
    `env.task`.

    Options: python, workers, timeout; factory; env_kwargs (JSON values, to gymnasium.make or
    the factory); task_weights (how a LIBERO suite's envs split across its tasks); for an env id
    max_episode_steps, render_mode (default "rgb_array") and flatten_obs. obs_mode="pixels" (with
    image_size) and render_size apply to this package's tasks, whose workers render them; any env
    whose Dict observation has a "pixels" entry gives pixels anyway.
    """
    from embodied_rl.envs import registry

    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise UserError(f"unknown option(s) {unknown} for the process backend (choose from: {', '.join(OPTIONS)})")
    _check_options(options)
    process = {key: options.pop(key) for key in ("python", "workers", "timeout") if key in options}
    task_weights = options.pop("task_weights", None)
    if task_weights is not None and (isinstance(task, str) or len(getattr(task, "suite_tasks", ())) < 2):
        raise UserError(f"task_weights splits the envs of a multi-task LIBERO suite (task=libero/<suite>), "
                        f"not of '{getattr(task, 'name', task)}'")
    if not isinstance(task, str):
        if options:
            raise UserError(f"option(s) {sorted(options)} do not apply to task '{task.name}', which makes its own envs")
        process["python"] = task.worker_python(process.get("python"))
        spec = task.process_spec(num_envs, obs_mode, image_size, render_size, task_weights)
        env = ProcessEnv(task.name, spec, num_envs=num_envs, seed=seed, device=device, **process)
        env.task = task
        return env
    factory = options.pop("factory", None)
    env_kwargs = dict(options.pop("env_kwargs", None) or {})
    if factory is not None:
        if options:
            raise UserError(f"option(s) {sorted(options)} apply to a gymnasium id, not to a factory "
                            "(the factory makes its env as it needs)")
        spec = {"factory": factory, "env_kwargs": env_kwargs}
    else:
        spec = {"env_id": task, "env_kwargs": env_kwargs, "render_mode": options.get("render_mode", "rgb_array"),
                "max_episode_steps": options.get("max_episode_steps"), "flatten_obs": bool(options.get("flatten_obs"))}
        if task in registry.GYM_NAMES:  # the worker imports embodied_rl.envs, which registers it
            spec["env_id"] = "embodied_rl.envs:" + registry.gym_id(task)
            spec["env_kwargs"].update(obs_mode=obs_mode, image_size=image_size, render_size=render_size)
            obs_mode = "state"
    if obs_mode != "state":
        raise UserError("the process backend renders pixel observations only for this package's tasks; "
                        "another env gives them as a 'pixels' entry of its Dict observation")
    return ProcessEnv(task, spec, num_envs=num_envs, seed=seed, device=device, **process)
