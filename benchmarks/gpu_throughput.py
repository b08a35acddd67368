"""The GPU recipe's numbers: MuJoCo Warp envs and PPO training on one device, N up to 8192.

    PYTHONPATH=. .venv/bin/python benchmarks/gpu_throughput.py                       # CUDA, N = 1024..8192
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_throughput.py --device cpu --ns 4,8 # Warp's CPU device (a test)

For every N it reports
- env steps/s: `envs.make(task, N, backend="mujoco_warp", device=D)` stepped with uniform random
  actions drawn on the device (the first steps, which compile Warp's kernels and capture the CUDA
  graph, are not timed);
- training env steps/s, rollout env steps/s and updates/s: `embodied-rl finetune device=D
  backend=mujoco_warp num_envs=N algo=residual_ppo` on a flow policy of the task's sizes with the
  default architecture (random weights), eval_every=0, iterations after the first only; the
  policy, the actor, the critic and the envs all live on D.
The exact command of each training run is printed. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaling import launch, make_checkpoint  # noqa: E402

CUDA_NS = (1024, 2048, 4096, 8192)
CPU_NS = (4, 8)
# algo.base_reg_window=null: the anchor's schedule alone, what the defaults train at a low start (random weights),
# without evaluating the start first (eval_every=0 then evaluates nothing: throughput only)
# deploy=latest: judged deployment would evaluate at the start and the end (untimed, minutes on the CPU)
PPO = ["algo=residual_ppo", "algo.num_steps=16", "algo.critic_warmup_iters=0", "algo.target_kl=null",
       "algo.base_reg_window=null", "algo.deploy=latest"]
EPOCHS, MINIBATCHES = 10, 4  # configs/algo/residual_ppo.yaml and _ppo.yaml


def env_steps_per_s(task: str, n: int, device: str, seconds: float) -> float:
    from embodied_rl import envs

    env = envs.make(task, num_envs=n, backend="mujoco_warp", device=device, seed=0)
    env.reset(seed=0)
    action_dim = env.single_action_space.shape[0]

    def step() -> None:
        env.step(torch.rand(n, action_dim, device=device) * 2 - 1)

    for _ in range(3):  # compile and capture
        step()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        steps += 1
    sync()
    rate = steps * n / (time.perf_counter() - start)
    env.close()
    return rate


def training(task: str, checkpoint: Path, n: int, device: str, iterations: int, work: Path) -> dict[str, float]:
    run_dir = work / f"ppo_{n}"
    args = ["finetune", f"task={task}", f"checkpoint={checkpoint}", f"device={device}", "backend=mujoco_warp",
            f"num_envs={n}", f"env_steps={n * 16 * iterations}", "eval_every=0", "checkpoint_every=0", "videos=0",
            "log_every=1", f"run_dir={run_dir}", *PPO]
    print("  embodied-rl " + " ".join(args), flush=True)
    code, _, _ = launch(1, args)
    if code != 0:
        raise SystemExit(f"training at N={n} failed (exit {code})")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/iteration_s" in r][1:]  # the first iteration compiles and warms up
    iteration_s = sum(r["train/iteration_s"] for r in rows)
    rollout_s = sum(r["train/rollout_s"] for r in rows)
    steps = len(rows) * n * 16
    return {"train_env_steps_per_s": steps / iteration_s, "rollout_env_steps_per_s": steps / rollout_s,
            "updates_per_s": len(rows) * EPOCHS * MINIBATCHES / (iteration_s - rollout_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--task", default="reach")
    parser.add_argument("--ns", default=None, help="comma-separated N (default: 1024..8192 on CUDA, 4,8 on the CPU)")
    parser.add_argument("--env-seconds", type=float, default=3.0)
    parser.add_argument("--iterations", type=int, default=4)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: pass --device cpu to run on Warp's CPU device")
    ns = [int(n) for n in args.ns.split(",")] if args.ns else list(CUDA_NS if args.device.startswith("cuda") else CPU_NS)
    with tempfile.TemporaryDirectory(prefix="gpu_throughput_") as tmp:
        results = measure(args, ns, Path(tmp))
    print(json.dumps(results))


def measure(args: argparse.Namespace, ns: list[int], work: Path) -> dict[str, Any]:
    checkpoint = make_checkpoint(args.task, work / "policy")
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "Warp CPU device"
    results: dict[str, Any] = {"task": args.task, "device": args.device, "gpu": gpu, "machine": platform.machine(),
                               "date": time.strftime("%Y-%m-%d"), "rows": {}}
    for n in ns:
        row = {"env_steps_per_s": env_steps_per_s(args.task, n, args.device, args.env_seconds)}
        row.update(training(args.task, checkpoint, n, args.device, args.iterations, work))
        results["rows"][n] = row
        print(f"N={n}: " + ", ".join(f"{key} {value:.0f}" for key, value in row.items()), flush=True)
    return results


if __name__ == "__main__":
    main()
