"""Native MuJoCo backend throughput vs raw single-thread mj_step, and mujoco.rollout.

    PYTHONPATH=. python benchmarks/mujoco_cpu_steps.py [--tasks reach push_t] [--num-envs 64]

Rates are control steps (env steps) per second; one env step = task.control_substeps mj_steps.
Baseline: one MjData stepped in a Python loop on one thread (mj_step(m, d, substeps)).
Every rate is the median of --repeats rounds; each round measures every variant once, so load
from other jobs on a shared machine falls on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch


def rate(fn, steps_per_call: int, seconds: float) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return calls * steps_per_call / (time.perf_counter() - start)


def main() -> None:
    import mujoco
    import mujoco.rollout

    from embodied_rl.envs import make

    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", nargs="+", default=["reach", "push_t"])
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = args.num_envs
    cores = len(os.sched_getaffinity(0))
    rows = []
    for name in args.tasks:
        env = make(name, num_envs=n, seed=0)
        task, model = env.task, env.model
        k = task.control_substeps
        env.reset(seed=0)
        data = mujoco.MjData(model)
        data.qpos[:] = env.datas[0].qpos
        zeros = torch.zeros(n, task.action_dim)
        ctrl = task.action_to_ctrl(zeros.double())
        env1 = make(name, num_envs=n, seed=0, threads=1)
        env1.reset(seed=0)

        # mujoco.rollout: full physics state in, k substeps, state out (persistent thread pool)
        spec = mujoco.mjtState.mjSTATE_FULLPHYSICS
        nstate = mujoco.mj_stateSize(model, spec)
        initial = np.zeros((n, nstate))
        for i, d in enumerate(env.datas):
            mujoco.mj_getState(model, d, initial[i], spec)
        datas = [mujoco.MjData(model) for _ in range(cores)]
        models = [model] * n
        control = np.zeros((n, k, model.nu))
        state_out = np.zeros((n, k, nstate))
        sensor_out = np.zeros((n, k, model.nsensordata))

        def roll():
            mujoco.rollout.rollout(models, datas, initial, control, skip_checks=True, nstep=k,  # noqa: B023
                                   state=state_out, sensordata=sensor_out, persistent_pool=True)  # noqa: B023
            initial[:] = state_out[:, -1]  # noqa: B023

        variants = {
            "raw_1thread": (lambda: mujoco.mj_step(model, data, k), 1),  # noqa: B023
            "env_step": (lambda: env.step(zeros), n),  # noqa: B023
            "env_step_1thread": (lambda: env1.step(zeros), n),  # noqa: B023
            "physics_threads": (lambda: env._step_physics(ctrl), n),  # noqa: B023
            "rollout": (roll, n),
        }
        rates: dict[str, list[float]] = {key: [] for key in variants}
        for _ in range(args.repeats):
            for key, (fn, per_call) in variants.items():
                rates[key].append(rate(fn, per_call, args.seconds))
        median = {key: statistics.median(values) for key, values in rates.items()}
        raw, env_rate, env1_rate = median["raw_1thread"], median["env_step"], median["env_step_1thread"]
        physics_rate, rollout_rate = median["physics_threads"], median["rollout"]
        env.close()
        env1.close()
        rows.append({
            "task": name, "substeps": k, "raw_1thread": raw, "env_step": env_rate,
            "env_step_1thread": env1_rate, "physics_threads": physics_rate, "rollout": rollout_rate,
            "env_step_over_raw": env_rate / raw, "threads": env.threads,
        })
    print(f"native MuJoCo, N={n}, {cores} cores, load {os.getloadavg()[0]:.1f}; env steps per second "
          f"(median of {args.repeats})")
    header = f"{'task':<8} {'raw 1-thr':>10} {'env.step':>10} {'ratio':>6} {'env 1-thr':>10} {'physics':>10} {'rollout':>10}"
    print(header)
    for r in rows:
        print(f"{r['task']:<8} {r['raw_1thread']:>10.0f} {r['env_step']:>10.0f} {r['env_step_over_raw']:>6.2f} "
              f"{r['env_step_1thread']:>10.0f} {r['physics_threads']:>10.0f} {r['rollout']:>10.0f}")
    print(json.dumps({"num_envs": n, "cores": cores, "rows": rows}))


if __name__ == "__main__":
    main()
