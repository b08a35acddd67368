"""What running envs in worker processes costs: env steps/s of the in-process gymnasium backend
vs the process backend on the same env, measured in the same run.

    PYTHONPATH=. .venv/bin/python benchmarks/process_overhead.py
    PYTHONPATH=. .venv/bin/python benchmarks/process_overhead.py --envs Hopper-v5 --ns 16 --seconds 2

For every env and N it steps each variant with uniform random actions for `--seconds`, three
times, and reports the best env steps/s and the least CPU time per env step (this process and its
workers together, from /proc):
- gymnasium: backend=gymnasium, N copies in gymnasium's SyncVectorEnv in this process: the
  baseline, the same env code and numbers as the process backend's (tests/envs/test_process_backend.py).
- process_1w: backend=process with one worker: the same work moved into one other process, so
  its ratio to the baseline is the backend's overhead (shared memory, a JSON line each way per
  step, the copies into tensors, and waking the other process twice per step).
- process: backend=process with its default workers (one per available core): what a user gets,
  overhead and parallelism together.
On a machine shared with other jobs the wall-clock ratio also holds the scheduler's delays in
waking a process that waited (none in-process); the CPU ratio does not. The workers run this
interpreter (`python` defaults to sys.executable), as another venv's would. The last line is one
JSON object with the ratios (process time over in-process time; 1.15 = 15% overhead).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import torch

REPEATS = 3  # best of: other jobs only ever slow a measurement down

VARIANTS = {"gymnasium": dict(backend="gymnasium"), "process_1w": dict(backend="process", workers=1),
            "process": dict(backend="process")}


def cpu_seconds(pids: list[int]) -> float:
    """CPU time of this process and of the processes `pids` (user + system, from /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for pid in pids:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def measure(env: Any, seconds: float) -> tuple[float, float]:
    """(best env steps/s, least CPU microseconds per env step) over REPEATS runs of `seconds`."""
    generator = torch.Generator().manual_seed(0)
    actions = torch.rand(8, env.num_envs, env.action_dim, generator=generator) * 2 - 1
    env.reset(seed=0)
    env.step(actions[0])  # warm-up
    pids = list(getattr(env, "worker_pids", []))
    best_rate, least_cpu = 0.0, float("inf")
    for _ in range(REPEATS):
        steps, cpu, start = 0, cpu_seconds(pids), time.perf_counter()
        while time.perf_counter() - start < seconds:
            env.step(actions[steps % 8])
            steps += 1
        wall, cpu = time.perf_counter() - start, cpu_seconds(pids) - cpu
        best_rate = max(best_rate, env.num_envs * steps / wall)
        least_cpu = min(least_cpu, 1e6 * cpu / (env.num_envs * steps))
    return best_rate, least_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", default="Hopper-v5,reach", help="gymnasium ids or this package's task names")
    parser.add_argument("--ns", default="1,16,64")
    parser.add_argument("--seconds", type=float, default=1.0, help="wall time per measurement (best of 3)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from embodied_rl.envs.registry import make

    load = os.getloadavg()
    print(f"machine: {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
          f"load average at start {load[0]:.2f} (1 min); best of {REPEATS} x {args.seconds:g} s per measurement")
    headline: dict[str, Any] = {}
    for name in args.envs.split(","):
        print(f"\n[{name}] env steps/s and CPU us per env step (ratios: process time / in-process time)")
        print(f"{'N':>5} " + " ".join(f"{variant:>30}" for variant in VARIANTS))
        for n in (int(n) for n in args.ns.split(",")):
            rates, cpus = {}, {}
            for variant, options in VARIANTS.items():
                with make(name, num_envs=n, seed=0, **options) as env:
                    rates[variant], cpus[variant] = measure(env, args.seconds)
            wall = {v: rates["gymnasium"] / rates[v] for v in VARIANTS}
            cpu = {v: cpus[v] / cpus["gymnasium"] for v in VARIANTS}
            print(f"{n:>5} " + " ".join(f"{rates[v]:>7,.0f} ({wall[v]:.2f}) {cpus[v]:>6.0f} us ({cpu[v]:.2f})"
                                        for v in VARIANTS), flush=True)
            headline[f"{name}/N={n}"] = {f"{v}_{kind}": round(ratio[v], 3) for v in VARIANTS if v != "gymnasium"
                                         for kind, ratio in (("wall", wall), ("cpu", cpu))}
    print(json.dumps({"ratio_to_gymnasium": headline}))


if __name__ == "__main__":
    main()
