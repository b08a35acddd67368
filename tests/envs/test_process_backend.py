"""Backend `process`: envs in worker processes under another interpreter, with the gymnasium
backend's numbers, and failures as one line, never a hang."""

import ast
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import embodied_rl.envs.backends.process as process
from embodied_rl.cli import main
from embodied_rl.envs.backends.gymnasium import GymnasiumEnv
from embodied_rl.envs.registry import make, task_overrides
from embodied_rl.errors import UserError
from tests.envs.test_env_state import rollout as step_all
from tests.envs.test_env_state import saved_and_loaded

HERE = Path(__file__).parent
slow = pytest.mark.slow  # each test starts fresh interpreters


@pytest.fixture
def toy_envs_importable(monkeypatch):
    """Workers import tests/envs/toy_envs.py as `toy_envs`."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))


def rollout(env, steps=9, seed=5):
    """Everything an env returns over resets (full, partial, grouped) and random steps."""
    generator = torch.Generator().manual_seed(0)
    out = [env.reset(seed=seed)[0]]
    for t in range(steps):
        obs, reward, terminated, truncated, info = env.step(torch.rand(env.num_envs, env.action_dim, generator=generator) * 2 - 1)
        out += [obs, reward, terminated, truncated, *(info[k] for k in ("success", "_final", "final_obs", "_episode")),
                *info["episode"].values()]
        if t == 4:
            out.append(env.reset(env_ids=torch.tensor([1, 2]))[0])
    out.append(env.reset(group_size=2)[0])
    return out


@slow
@pytest.mark.parametrize("env_id", ["Hopper-v5", "toy_envs:TestCount-v0"])
def test_same_numbers_as_the_gymnasium_backend(env_id, toy_envs_importable):
    """Bit for bit: seeds, same-step auto-reset, final_obs, success, episode statistics."""
    with GymnasiumEnv(env_id, num_envs=4, seed=3, max_episode_steps=4) as reference:
        expected = rollout(reference)
    with make(env_id, num_envs=4, backend="process", seed=3, workers=2, max_episode_steps=4) as env:
        assert len(env.worker_pids) == 2
        assert env.single_observation_space == reference.single_observation_space
        assert env.single_action_space == reference.single_action_space
        got = rollout(env)
        frames = env.render(torch.tensor([3, 0]))
        assert not env.can_snapshot
        with pytest.raises(UserError, match="cannot snapshot"):
            env.get_state()
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert frames.dtype == torch.uint8 and frames.shape[0] == 2 and frames.shape[-1] == 3


@slow
@pytest.mark.parametrize("name,options", [
    ("toy_envs:TestSnapshotCount-v0", {"workers": 2}),  # TimeLimit's count too
    ("reach", {"workers": 1, "task_options": {"max_episode_steps": 3}}),  # one worker: torch imports take seconds
])
def test_a_snapshot_continues_exactly_where_the_env_has_get_state(name, options, toy_envs_importable):
    def make_env(seed):
        return make(name, num_envs=4, backend="process", seed=seed, **options)

    generator = torch.Generator().manual_seed(0)
    actions = [torch.rand(4, 2 if name == "reach" else 1, generator=generator) * 2 - 1 for _ in range(12)]
    with make_env(0) as env_a, make_env(9) as env_b:
        assert env_a.can_snapshot
        env_a.reset()
        step_all(env_a, actions[:5])  # mid-episode for some envs, after auto-resets for others
        state = saved_and_loaded(env_a.get_state())
        expected = step_all(env_a, actions[5:])
        env_b.set_state(state)
        got = step_all(env_b, actions[5:])
        assert all(torch.equal(a, b) for a, b in zip(expected, got)) and len(got) == len(expected)
        with pytest.raises(UserError, match="missing 'sim/3/'"):
            env_b.set_state({k: v for k, v in state.items() if not k.startswith("sim/3/")})


def isolated_python(tmp_path):
    """A command running this interpreter without site-packages, seeing only numpy and
    gymnasium (and their own dependencies) and the toy envs: no torch, no embodied_rl."""
    import gymnasium
    import numpy

    site = Path(numpy.__file__).parent.parent
    visible = tmp_path / "site"
    visible.mkdir()
    for name in ("numpy", "numpy.libs", "gymnasium", "cloudpickle", "typing_extensions.py", "farama_notifications"):
        if (site / name).exists():
            (visible / name).symlink_to(site / name)
    assert Path(gymnasium.__file__).parent.parent == site
    return f"env PYTHONPATH={visible}{os.pathsep}{HERE} {sys.executable} -S"


@slow
def test_a_worker_needs_neither_torch_nor_this_package(tmp_path):
    python = isolated_python(tmp_path)
    for module in ("torch", "embodied_rl"):
        probe = subprocess.run([*python.split(), "-c", f"import {module}"], capture_output=True, cwd=tmp_path)
        assert probe.returncode != 0, f"the isolated interpreter can import {module}"
    with GymnasiumEnv("Pendulum-v1", num_envs=4, seed=1, max_episode_steps=3) as reference:
        expected = rollout(reference, steps=4)
    with make("Pendulum-v1", num_envs=4, backend="process", seed=1, python=python, max_episode_steps=3) as env:
        got = rollout(env, steps=4)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@slow
def test_a_package_task_with_instructions_and_pixels_in_a_worker():
    with make("reach_choice", num_envs=2, backend="process", seed=0, workers=1, obs_mode="pixels",
              image_size=16, task_options={"max_episode_steps": 2}) as env:
        assert env.instructions == list(make_task_instructions("reach_choice"))
        assert env.max_episode_steps == 2  # the task's own limit, which PPO sizes its buffers by
        obs, _ = env.reset()
        assert set(obs) == {"state", "pixels", "instruction"}
        assert obs["pixels"].shape == (2, 16, 16, 3) and obs["pixels"].dtype == torch.uint8
        assert obs["instruction"].dtype == torch.int64 and obs["state"].dtype == torch.float32
        for _ in range(2):
            obs, _, terminated, truncated, info = env.step(torch.zeros(2, env.action_dim))
        assert (terminated | truncated).all() and info["_final"].all()  # the task's own time limit
        assert set(info["final_obs"]) == set(obs) and info["final_obs"]["pixels"].shape == (2, 16, 16, 3)


def make_task_instructions(name):
    from embodied_rl.envs.registry import task_class

    return task_class(name).instructions


def test_an_interpreter_that_is_not_there_is_one_line():
    with pytest.raises(UserError, match=r"interpreter '/no/such/python' does not exist.*venv") as error:
        make("Pendulum-v1", backend="process", python="/no/such/python")
    assert "\n" not in str(error.value)


@slow
def test_an_interpreter_without_the_simulator_is_one_line():
    python = f"{sys.executable} -I -S"  # no site-packages: no numpy, no gymnasium
    with pytest.raises(UserError, match=r"envs 0-1 .*worker 0.* cannot import 'numpy'.*pip install numpy") as error:
        make("Pendulum-v1", num_envs=2, backend="process", python=python, workers=1)
    assert "\n" not in str(error.value) and sys.executable in str(error.value)


def test_the_cli_refuses_a_missing_interpreter_in_one_line_without_a_run_dir(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["collect", "task=reach", "backend=process", "task.process.python=/no/such/python",
                 f"run_dir={run_dir}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "'/no/such/python'" in err, err
    assert not run_dir.exists()


def test_options_that_cannot_be_honoured_are_refused():
    with pytest.raises(UserError, match="unknown option"):
        make("Pendulum-v1", backend="process", vector="async")
    with pytest.raises(UserError, match="workers must be an integer >= 1"):
        make("Pendulum-v1", backend="process", workers=0)
    with pytest.raises(UserError, match="timeout must be a number"):
        make("Pendulum-v1", backend="process", timeout=-1)
    with pytest.raises(UserError, match="apply to a gymnasium id, not to a factory"):
        make("toy", backend="process", factory="toy_envs:misbehaving", max_episode_steps=3)
    with pytest.raises(UserError, match="task.process.python applies to backend=process only"):
        make("reach", backend="mujoco", task_options={"process": {"python": sys.executable}})
    with pytest.raises(UserError, match="unknown key 'task.process.pyhton'"):
        task_overrides({"name": "reach", "process": {"pyhton": "x"}})
    assert task_overrides({"name": "reach", "process": {"python": None, "workers": 2}}) == {"process": {"workers": 2}}


def alive(pid):
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()  # a zombie is gone
    except FileNotFoundError:
        return False


def wait_gone(pids, seconds=5.0):
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(pid) for pid in pids)


def misbehaving_env(fault, timeout=20.0):
    return make("toy", num_envs=4, backend="process", workers=2, seed=0, timeout=timeout,
                factory="toy_envs:misbehaving", env_kwargs={"fault": fault})


@slow
@pytest.mark.parametrize("fault,message", [
    ("nan_reward", "returned the reward nan"),
    ("bad_shape", r"returned an observation of shape \(2,\), its space says \(3,\)"),
    ("bad_flag", "returned terminated=nan, truncated=False; both must be booleans"),
    ("raise", "RuntimeError: the simulator broke$"),
    ("die", "was killed by SIGKILL during 'step'"),
])
def test_a_worker_that_fails_is_one_line_naming_the_env_and_the_worker(fault, message, toy_envs_importable):
    env = misbehaving_env(fault)
    pids = env.worker_pids
    env.reset()
    env.step(torch.zeros(4, 1))
    rows = "envs 0-1" if fault == "die" else "env 1"  # the second env of worker 0 misbehaves
    with pytest.raises(UserError, match=rf"^process backend: {rows} of 'toy' \(worker 0, pid {pids[0]}, .*\) {message}"):
        env.step(torch.zeros(4, 1))
    assert wait_gone(pids)  # the env closed every worker
    with pytest.raises(RuntimeError, match="closed"):
        env.step(torch.zeros(4, 1))


@slow
def test_a_hanging_worker_times_out_and_one_that_prints_does_no_harm(toy_envs_importable):
    with misbehaving_env("print") as env:  # stdout is the protocol's channel: prints go to stderr
        env.reset()
        for t in range(1, 5):
            _, _, _, truncated, info = env.step(torch.zeros(4, 1))
            assert info["success"].tolist() == [t >= 2] * 4  # CountEnv's is_success
        assert truncated.all() and info["final_obs"][:, 0].tolist() == [4.0] * 4
    env = misbehaving_env("hang", timeout=1.0)
    pids = env.worker_pids
    env.reset()
    env.step(torch.zeros(4, 1))
    started = time.monotonic()
    with pytest.raises(UserError, match=r"worker 0, .* no answer to 'step' within 1 s"):
        env.step(torch.zeros(4, 1))
    assert time.monotonic() - started < 5 and wait_gone(pids)


@slow
def test_workers_end_when_their_parent_dies(tmp_path):
    script = textwrap.dedent("""
        import os, signal, sys
        from embodied_rl.envs.registry import make
        env = make("Pendulum-v1", num_envs=2, backend="process", workers=2)
        env.reset()
        print(*env.worker_pids, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    pids = [int(pid) for pid in result.stdout.split()]
    assert len(pids) == 2 and wait_gone(pids)


def imported_packages(path, feature_version=None):
    """The top-level packages a source file imports (anywhere in it)."""
    tree = ast.parse(Path(path).read_text(), feature_version=feature_version)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    return imported


def test_the_worker_imports_no_torch_and_nothing_of_this_package():
    """The worker runs in other venvs: the standard library and numpy only, Python 3.8 syntax."""
    imported = imported_packages(process.WORKER, feature_version=(3, 8))
    assert not imported - set(sys.stdlib_module_names) - {"numpy"}, imported


@slow
def test_shared_memory_leaves_nothing_behind():
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with make("Pendulum-v1", num_envs=1, backend="process", workers=1) as env:
        env.reset()
        assert np.isfinite(env.step(torch.zeros(1, 1))[1].numpy()).all()
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {name for name in after - before if name.startswith("embodied_rl_process_")}


@slow
def test_a_factory_file_makes_each_env_with_its_own_arguments():
    """A factory named by its file (no installed module: LIBERO's envs/sims/libero_env.py), env i
    made with per_env[i], the env's versions passed on, and a grouped reset kept within envs
    made alike."""
    spec = {"factory": f"{HERE / 'toy_envs.py'}:labelled", "per_env": [{"label": i // 2} for i in range(4)]}
    with process.ProcessEnv("labelled", spec, num_envs=4, workers=2) as env:
        obs, _ = env.reset(seed=0)
        assert obs[:, 2].tolist() == [0, 0, 1, 1]
        assert env.simulator == {"toy": "1.0"}
        env.reset(group_size=2)  # each group's envs were made alike
        with pytest.raises(UserError, match="group_size=4 puts envs 0-3 of 'labelled', which run different tasks"):
            env.reset(group_size=4)


@slow
def test_a_module_the_factory_lacks_is_one_line_saying_how_to_set_it_up():
    spec = {"factory": f"{HERE / 'toy_envs.py'}:labelled", "env_kwargs": {"needs": "no_such_simulator"},
            "setup": "run `make-the-simulator`"}
    with pytest.raises(UserError, match=r"envs 0-1 .* cannot import 'no_such_simulator': run `make-the-simulator`$"):
        process.ProcessEnv("labelled", spec, num_envs=2, workers=1)
    with pytest.raises(UserError, match=r"the factory file '/no/such/file.py' does not exist"):
        process.ProcessEnv("labelled", {"factory": "/no/such/file.py:make"}, num_envs=1, workers=1)
