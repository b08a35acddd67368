"""Data-parallel training (embodied_rl/distributed.py): the collectives on two gloo processes,
and `torchrun -m embodied_rl finetune|pretrain` with two ranks on this machine: the weights
stay equal on every rank, a stopped job resumes exactly, a rank that dies stops the job with
one line and the relaunch resumes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from embodied_rl import core, distributed
from embodied_rl.algos.common import read_best
from embodied_rl.errors import UserError

pytestmark = pytest.mark.e2e

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0"]


# ---- one process: every function is the identity ----

def test_a_single_process_is_the_plain_run():
    assert not distributed.active() and distributed.rank() == 0 and distributed.world_size() == 1
    assert distributed.rank_seed(7) == 7 and distributed.shard(6) == 6
    x, mask = torch.randn(10), torch.rand(10) > 0.3
    assert torch.equal(distributed.masked_whiten(x, mask), core.masked_whiten(x, mask))
    assert distributed.gather_objects({"a": 1}) == [{"a": 1}] and distributed.broadcast_object(3) == 3
    assert distributed.any_rank(True) and not distributed.any_rank(False)


# ---- two gloo processes ----

def _two_ranks(rank: int, init_file: str, results: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 2)
        torch.manual_seed(100 + rank)  # each rank its own data
        x = torch.randn(8, 3)
        net(x).pow(2).sum().backward()
        local = {name: p.grad.clone() for name, p in net.named_parameters()}
        distributed.average_gradients(net.parameters())
        values = torch.randn(6) + rank * 3.0
        mask = torch.tensor([True, True, False, True, rank == 0, True])
        out = {
            "local": local, "averaged": {name: p.grad.clone() for name, p in net.named_parameters()},
            "values": values, "mask": mask, "whitened": distributed.masked_whiten(values, mask),
            "shard": distributed.shard(6), "any": distributed.any_rank(rank == 1),
            "gathered": distributed.gather_objects(rank * 10),
        }
        try:
            distributed.shard(5)
        except UserError as error:
            out["shard_error"] = str(error)
        checked = []

        def check_once() -> None:  # fails wherever it runs: only rank 0 may run it
            checked.append(rank)
            raise UserError("run_dir holds files")
        try:
            distributed.check_on_main(check_once)
        except UserError as error:
            out["check_error"], out["checked"] = str(error), checked
        distributed.check_in_sync({"net": net})
        with torch.no_grad():
            net.weight[0, 0] += rank  # rank 1's weights now differ
        try:
            distributed.check_in_sync({"net": net})
        except RuntimeError as error:
            out["sync_error"] = str(error)
        torch.save(out, f"{results}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_collectives_on_two_processes(tmp_path):
    results = str(tmp_path / "out")
    mp.start_processes(_two_ranks, args=(str(tmp_path / "init"), results), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(f"{results}.{r}", weights_only=False) for r in (0, 1))
    for name in r0["local"]:  # the same gradient on both ranks: the mean of the two local ones
        assert torch.equal(r0["averaged"][name], r1["averaged"][name])
        assert torch.allclose(r0["averaged"][name], (r0["local"][name] + r1["local"][name]) / 2)
    # whitening uses both ranks' valid positions: the same map as core.masked_whiten on the union
    union = core.masked_whiten(torch.cat([r0["values"], r1["values"]]), torch.cat([r0["mask"], r1["mask"]]))
    assert torch.allclose(torch.cat([r0["whitened"], r1["whitened"]]), union, atol=1e-5)
    assert r0["shard"] == r1["shard"] == 3 and r0["any"] and r1["any"]
    assert r0["gathered"] == [0, 10] and r1["gathered"] is None
    assert "num_envs=5 must be a multiple of the number of ranks (2)" in r0["shard_error"]
    # a check of the run directory runs on rank 0 only, and its error stops every rank
    assert r0["check_error"] == r1["check_error"] == "run_dir holds files"
    assert r0["checked"] == [0] and r1["checked"] == []
    assert "weights differ" in r0["sync_error"] and "weights differ" in r1["sync_error"]


# ---- torchrun ----

@pytest.fixture(scope="module")
def bc(tmp_path_factory):
    """A tiny flow policy for reach and the demos it records."""
    from embodied_rl.data.dataset import write_demos
    from embodied_rl.policies import make_policy, save_policy

    root = tmp_path_factory.mktemp("bc")
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    episodes = [{"obs": rng.standard_normal((10, 8)).astype(np.float32),
                 "action": rng.uniform(-1, 1, (10, 2)).astype(np.float32),
                 "reward": np.zeros(10, np.float32), "success": bool(e % 2)} for e in range(4)]
    data = write_demos(root / "demos", episodes, {"task": "reach", "obs_dim": 8, "action_dim": 2})
    policy = make_policy("flow", obs_dim=8, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                         num_inference_steps=2, task="reach", backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
    save_policy(policy, root / "flow", extra={"dataset": str(data)})
    return root


def torchrun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "MUJOCO_GL": "egl", "OMP_NUM_THREADS": "1"}
    return subprocess.run([*TORCHRUN, "-m", "embodied_rl", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def agent_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / "last" / "agent.safetensors"))


TINY = ["task=reach", "num_envs=8", "eval_episodes=4", "videos=0", "log_every=1", "eval_every=64"]


@pytest.mark.parametrize("algo,extra", [
    ("reinflow", ["algo.num_steps=4", "checkpoint_every=64"]),
    ("residual_offpolicy", ["algo.warmup_env_steps=32", "algo.critic_only_steps=32", "algo.batch_size=16",
                            "algo.utd_ratio=0.25", "checkpoint_every=64", "algo.demo_fraction=0.5"]),
])
def test_two_ranks_train_resume_exactly_and_keep_equal_weights(algo, extra, bc, tmp_path):
    common = [f"algo={algo}", f"checkpoint={bc / 'flow'}", *TINY, *extra]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    done = torchrun("finetune", *common, "env_steps=256", f"run_dir={straight}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "env_steps: 256" in done.stdout and done.stdout.count("run_dir:") == 1  # rank 0 prints
    state = straight / "checkpoints" / "last" / "training_state"
    assert (state / "rank_1.pt").exists()  # rank 1's RNGs and envs travel with every checkpoint
    counters = json.loads((state / "counters.json").read_text())
    assert counters["ranks"] == 2 and counters["env_steps"] == 256
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/success_rate" in r] == [0, 64, 128, 192, 256]
    # stopped half way and resumed: the same weights as the run that never stopped (every checkpoint
    # also checked that both ranks held the same weights)
    half = torchrun("finetune", *common, "env_steps=128", f"run_dir={stopped}")
    assert half.returncode == 0, half.stderr[-3000:]
    resumed = torchrun("finetune", *common, "env_steps=256", f"run_dir={stopped}")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    a, b = agent_weights(straight), agent_weights(stopped)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # rank 0 keeps checkpoints/best, and the resumed job still knows it
    assert "best: " in done.stdout and read_best(stopped / "checkpoints") == read_best(straight / "checkpoints") is not None
    # one rank cannot resume what two wrote
    from embodied_rl.cli import main

    assert main(["finetune", *common, "env_steps=512", f"run_dir={stopped}"]) == 2


def test_pretrain_on_two_ranks_logs_evaluates_and_resumes_exactly(tmp_path):
    import shutil

    from embodied_rl.cli import main

    assert main(["collect", "task=reach", "demos=4", f"run_dir={tmp_path / 'demos'}"]) == 0
    args = ["pretrain", "task=reach", f"data={tmp_path / 'demos' / 'demos.zarr'}", "policy=flow", "steps=20",
            "eval_every=10", "log_every=10", "eval_episodes=2", "num_envs=2", "videos=0", "batch_size=32",
            "policy.mlp.hidden_dim=32", "policy.mlp.num_blocks=1"]
    for name in ("whole", "parts"):
        done = torchrun(*args, f"run_dir={tmp_path / name}")
        assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [10, 20]  # rank 0 logs, once per step
    parts = tmp_path / "parts"
    for name in ("20", "last"):  # stopped before step 20's checkpoint: each rank's RNGs come back from step 10
        shutil.rmtree(parts / "checkpoints" / name)
    resumed = torchrun(*args, f"run_dir={parts}")
    assert resumed.returncode == 0 and resumed.stdout.count("resuming from step 10 of 20") == 1, resumed.stderr[-3000:]
    for name in ("model.safetensors", "training_state/model.safetensors"):
        a, b = (load_file(str(tmp_path / run / "checkpoints" / "last" / name)) for run in ("whole", "parts"))
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_commands_that_run_in_one_process_refuse_torchrun(bc, tmp_path, monkeypatch, capsys):
    from embodied_rl.cli import main

    with monkeypatch.context() as patch:  # what torchrun sets; the CLI refuses before joining a group
        patch.setenv("WORLD_SIZE", "2")
        patch.setenv("RANK", "1")
        assert main(["eval", "task=reach", f"checkpoint={bc / 'flow'}", "episodes=2", f"run_dir={tmp_path / 'e'}"]) == 2
    assert "error: rank 1: 'eval' runs in one process" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
    done = torchrun("finetune", "algo=recap", f"checkpoint={bc / 'flow'}", *TINY, f"run_dir={tmp_path / 'r'}")
    assert done.returncode != 0 and "algo=recap runs in one process" in done.stderr


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_a_rank_that_dies_stops_the_job_and_the_relaunch_resumes(bc, tmp_path):
    run_dir = tmp_path / "run"
    args = ["finetune", "algo=reinflow", f"checkpoint={bc / 'flow'}", *TINY, "eval_every=0", "algo.num_steps=4",
            "checkpoint_every=64", "env_steps=100000000", f"run_dir={run_dir}"]
    env = {**os.environ, "MUJOCO_GL": "egl", "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([*TORCHRUN, "-m", "embodied_rl", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=env)
    try:
        deadline = time.time() + 180  # generous: a loaded machine starts torchrun slowly
        while not (run_dir / "checkpoints" / "last").exists() and time.time() < deadline and job.poll() is None:
            time.sleep(0.5)
        assert (run_dir / "checkpoints" / "last").exists(), job.communicate()[1][-3000:] if job.poll() is not None else ""
        ranks = _children(job.pid)
        assert len(ranks) == 2
        os.kill(ranks[-1], signal.SIGKILL)  # rank 1 dies
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert "error: rank 0: stopped because another rank of the job failed" in err
    relaunch = torchrun(*args[:-2], "env_steps=" + str(_steps(run_dir) + 128), f"run_dir={run_dir}")
    assert relaunch.returncode == 0 and "resuming from" in relaunch.stdout, relaunch.stderr[-3000:]


def _alive(pid: int) -> bool:
    """Whether any thread of `pid` still runs. The process's own status is not enough: after
    os._exit its leader thread shows as a zombie while other threads are still being torn down,
    and those still hold its files (the run_dir's flock) until the last one is gone."""
    try:
        threads = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return False
    for thread in threads:
        try:
            state = (thread / "status").read_text().split("State:")[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state not in ("Z", "X"):
            return True
    return False


def test_ranks_stop_when_the_launcher_is_killed_and_free_the_run_dir(bc, tmp_path):
    from embodied_rl.runs import Run

    run_dir = tmp_path / "run"
    args = ["finetune", "algo=reinflow", f"checkpoint={bc / 'flow'}", *TINY, "eval_every=0", "algo.num_steps=4",
            "checkpoint_every=64", "env_steps=100000000", f"run_dir={run_dir}"]
    env = {**os.environ, "MUJOCO_GL": "egl", "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([*TORCHRUN, "-m", "embodied_rl", *args], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=env)
    ranks = []
    try:
        deadline = time.time() + 180
        while not (run_dir / "checkpoints" / "last").exists() and time.time() < deadline and job.poll() is None:
            time.sleep(0.5)
        ranks = _children(job.pid)
        assert len(ranks) == 2
        os.kill(job.pid, signal.SIGKILL)  # the launcher dies without a word to its ranks
        job.wait()
        deadline = time.time() + 10
        while any(_alive(pid) for pid in ranks) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks)
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    Run(run_dir, allow_existing=True).close()  # the lock is free for the relaunch


def _steps(run_dir: Path) -> int:
    return json.loads((run_dir / "checkpoints" / "last" / "training_state" / "counters.json").read_text())["env_steps"]


def test_two_ranks_of_half_the_envs_see_what_one_rank_of_all_sees(bc, tmp_path):
    """The same job split over two ranks: the same env steps and metrics rows, the episodes of
    both ranks in every row (each of the 16 envs ends an episode per 50-step row), and returns
    of the same distribution."""
    from embodied_rl.cli import main

    common = ["algo=reinflow", f"checkpoint={bc / 'flow'}", *TINY, "num_envs=16", "eval_every=0",
              "algo.num_steps=25", "env_steps=3200"]
    assert main(["finetune", *common, f"run_dir={tmp_path / 'one'}"]) == 0
    done = torchrun("finetune", *common, f"run_dir={tmp_path / 'two'}")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {name: [r for r in (json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                   if "rollout/episodes" in r] for name in ("one", "two")}
    assert [r["step"] for r in rows["one"]] == [r["step"] for r in rows["two"]] == [800, 1600, 2400, 3200]
    assert all(r["rollout/episodes"] >= 16 for r in rows["one"] + rows["two"])
    returns = {name: np.array([r["rollout/return"] for r in rows[name]]) for name in rows}
    spread = max(returns["one"].std(), returns["two"].std()) + 1.0
    assert abs(returns["one"].mean() - returns["two"].mean()) < 3 * spread
