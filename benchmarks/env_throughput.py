"""Env steps per second of each backend, beside two baselines measured in the same run.

    PYTHONPATH=. .venv/bin/python benchmarks/env_throughput.py
    PYTHONPATH=. .venv/bin/python benchmarks/env_throughput.py --tasks push_t --ns 64 --seconds 3
    PYTHONPATH=. .venv/bin/python benchmarks/env_throughput.py --device cuda   # Warp up to N=8192
    MUJOCO_GL=egl PYTHONPATH=. .venv/bin/python benchmarks/env_throughput.py --tasks tabletop,lift \
        --pixels 64 --ns 16,64 --backends mujoco                                 # with 64x64 camera obs

For every task and N it steps each backend with uniform random actions for `--seconds` of wall
time and reports env steps/s (N x batched steps / s). Baselines:
- raw: the physical limit here, a plain single-thread loop of mujoco.mj_step on the task's model
  replaying the states and controls of a recorded random-action rollout: env steps/s =
  mj_steps/s / control_substeps. The mujoco backend steps from one thread per core, so on more
  than one core it can beat this number; that counts in its favour. `mujoco_1thread` (the mujoco
  backend with threads=1) shows the backend's own overhead against the same single thread.
- sync_vector_env: gymnasium's SyncVectorEnv over N copies of the registered single env
  (gymnasium.make("embodied_rl/PushT-v0")), what a plain gymnasium user would run.
- envpool_direct (hopper only): EnvPool's C++ engine called directly on the same model
  (`envpool.make("Hopper-v5", env_type="gymnasium")`, numpy actions, its own next-step
  auto-reset), beside `envpool`, the same engine through this package's backend (torch tensors,
  same-step auto-reset): their ratio is the backend's cost. Both count transitions: EnvPool's
  direct steps whose env slot was a reset (its next-step auto-reset ignores that action) are not
  counted.
mujoco_warp on Warp's CPU device is slow and is measured at N <= 16 only; with --device cuda it
runs on the GPU at N up to 8192. `--pixels S` makes every step also render each env's S x S camera
observation (obs_mode="pixels", the batched renderer of envs/render.py); the baselines step
state only, so they are skipped then. The last line is one JSON object with the headline numbers.

`--breakdown` (hopper, the model EnvPool's Hopper-v5 uses) answers where a step's time goes, on
one thread each so that nothing overlaps: microseconds per env step of the physics alone (the raw
loop above), of the mujoco backend's physics call (`_step_physics`: the physics plus the per-env
Python of the thread loop: ctrl in, qpos/qvel/sensordata out, clocks), of the backend's whole
`step` (plus the task's torch code, resets and episode statistics, once per batch), and of EnvPool
called directly with one worker thread (the same physics driven from C++).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import numpy as np
import torch

DEFAULT_NS = (1, 16, 64, 256)
CUDA_WARP_NS = (1, 16, 64, 256, 1024, 4096, 8192)
WARP_CPU_MAX_N = 16
BACKENDS = ("mujoco", "mujoco_1thread", "gymnasium", "mujoco_warp", "envpool", "envpool_direct")
# EnvPool ids of the same model as a task here (envpool rows are measured for these tasks only)
ENVPOOL_IDS = {"hopper": "Hopper-v5"}


def available_task(name: str) -> tuple[str, str]:
    """(task to measure, note): a task that is not there yet falls back to reach."""
    from embodied_rl.envs.registry import task_class
    from embodied_rl.errors import UserError

    try:
        task_class(name)
        return name, ""
    except (UserError, ImportError, AttributeError):
        return "reach", f"task '{name}' is not available yet: measured reach instead"


REPEATS = 3  # best of: the machine is shared, and other jobs only ever slow a measurement down


def timed_loop(step, seconds: float, min_iters: int = 3) -> tuple[float, float]:
    """Call step() for `seconds` (at least min_iters times), REPEATS times; return the
    (batches, elapsed) of the fastest repeat. A step() that returns a number counts as that
    fraction of a batch (EnvPool's direct steps, some of whose env slots are resets)."""
    best = (0.0, float("inf"))
    for _ in range(REPEATS):
        iters, batches, start = 0, 0.0, time.perf_counter()
        while True:
            done = step()
            iters += 1
            batches += 1.0 if done is None else done
            elapsed = time.perf_counter() - start
            if elapsed >= seconds and iters >= min_iters:
                break
        if batches / elapsed > best[0] / best[1]:
            best = (batches, elapsed)
    return best


def raw_mj_step_rate(task_name: str, seconds: float, record_steps: int = 300) -> tuple[float, int]:
    """(mj_steps per second of a single-thread mj_step loop, control_substeps).

    The loop replays the states and controls of a recorded env rollout (random actions, with the
    env's own resets), so that it simulates what the envs simulate: a fallen hopper or a block
    pushed against a wall costs more contacts than a healthy episode. Each control step sets
    qpos/qvel/ctrl from the recording and calls mj_step control_substeps times.
    """
    import mujoco

    from embodied_rl.envs.registry import make

    env = make(task_name, num_envs=1, backend="mujoco", seed=0, threads=1)
    generator = torch.Generator().manual_seed(0)
    env.reset(seed=0)
    qpos, qvel, ctrl = [], [], []
    for _ in range(record_steps):
        qpos.append(env.state.qpos[0].clone().numpy())
        qvel.append(env.state.qvel[0].clone().numpy())
        env.step(torch.rand(1, env.action_dim, generator=generator) * 2 - 1)
        ctrl.append(env.state.ctrl[0].clone().numpy())
    model, substeps = env.model, int(env.task.control_substeps)
    env.close()
    data = mujoco.MjData(model)
    counter = {"k": 0}

    def control_step() -> None:  # one env step worth of physics
        k = counter["k"] % record_steps
        data.qpos[:] = qpos[k]
        data.qvel[:] = qvel[k]
        data.ctrl[:] = ctrl[k]
        for _ in range(substeps):
            mujoco.mj_step(model, data)
        counter["k"] += 1

    iters, elapsed = timed_loop(control_step, seconds)
    return iters * substeps / elapsed, substeps


def batched_rate(env: Any, seconds: float, action_dim: int) -> float:
    """Env steps per second of a BatchedEnv stepped with random actions."""
    generator = torch.Generator().manual_seed(0)
    actions = (torch.rand(8, env.num_envs, action_dim, generator=generator) * 2 - 1).to(env.device)
    env.reset(seed=0)
    for k in range(2):  # warm-up (first-call allocations, Warp module loads)
        env.step(actions[k])
    counter = {"k": 0}

    def step() -> None:
        env.step(actions[counter["k"] % 8])
        counter["k"] += 1

    iters, elapsed = timed_loop(step, seconds)
    return env.num_envs * iters / elapsed


def vector_rate(vec: Any, n: int, action_shape: tuple[int, ...], seconds: float,
                transition_share: Any = None) -> float:
    """Env steps per second of a reset numpy vector env (gymnasium's or EnvPool's), random actions.
    `transition_share(info)`, when given, is the share of a step's N env slots that were
    transitions (EnvPool's reset slots are not); the rate counts those only."""
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, size=(8, *action_shape)).astype(np.float32)
    counter = {"k": 0}

    def step() -> float | None:
        info = vec.step(actions[counter["k"] % 8])[-1]
        counter["k"] += 1
        return None if transition_share is None else transition_share(info)

    batches, elapsed = timed_loop(step, seconds)
    vec.close()
    return n * batches / elapsed


def sync_vector_env_rate(task_name: str, n: int, seconds: float) -> float:
    """Env steps per second of gymnasium.vector.SyncVectorEnv over the registered single env."""
    import gymnasium as gym

    import embodied_rl.envs  # noqa: F401  (registers embodied_rl/<Name>-v0)
    from embodied_rl.envs.registry import gym_id

    vec = gym.vector.SyncVectorEnv([lambda: gym.make(gym_id(task_name))] * n)
    vec.reset(seed=0)
    return vector_rate(vec, n, vec.action_space.shape, seconds)


def envpool_direct_rate(env_id: str, n: int, seconds: float, threads: int | None = None) -> float:
    """Transitions per second of EnvPool called directly (numpy in, numpy out); `threads` worker
    threads (default one per core).

    EnvPool resets a finished env on its next step and ignores that step's action, so a batch of
    N returns fewer than N transitions whenever an env was resetting; those env slots (the ones
    whose `elapsed_step` comes back 0) are not counted. Every step of this package's backends is
    a transition (they reset in the same step), so both rows count the same thing."""
    from embodied_rl.envs.backends.envpool import import_envpool

    envpool = import_envpool()  # mujoco first, as EnvPool's renderer needs
    pool = envpool.make(env_id, env_type="gymnasium", num_envs=n, batch_size=n, seed=0,
                        num_threads=threads or min(n, len(os.sched_getaffinity(0))))
    pool.reset()
    # the slots whose elapsed_step came back 0 were resets, not transitions
    return vector_rate(pool, n, (n, *pool.action_space.shape), seconds,
                       transition_share=lambda info: np.count_nonzero(info["elapsed_step"]) / n)


def rate_of(rows: list[dict[str, Any]], task: str, backend: str, n: int) -> float | None:
    match = [r["sps"] for r in rows if r["task"] == task and r["backend"] == backend and r["n"] == n]
    return match[0] if match else None


def breakdown(task_name: str, ns: list[int], seconds: float) -> dict[str, Any]:
    """Microseconds per env step, one thread each, of the layers of a step (module docstring)."""
    raw, substeps = raw_mj_step_rate(task_name, seconds)
    physics_us = 1e6 * substeps / raw
    print(f"\n[{task_name}] microseconds per env step, one thread each (raw physics: {physics_us:.1f})")
    print(f"{'N':>6} {'raw physics':>12} {'backend physics call':>21} {'backend step':>13}"
          f" {'EnvPool direct':>15} {'Python per env':>15} {'task+torch per env':>19}")
    result: dict[str, Any] = {"raw_physics_us": round(physics_us, 1), "n": {}}
    for n in ns:
        env = make_env(task_name, "mujoco_1thread", n, "cpu")
        in_physics = {"s": 0.0}
        step_physics = env._step_physics

        def timed_physics(ctrl, step_physics=step_physics, in_physics=in_physics):
            start = time.perf_counter()
            unstable = step_physics(ctrl)
            in_physics["s"] += time.perf_counter() - start
            return unstable

        env._step_physics = timed_physics
        generator = torch.Generator().manual_seed(0)
        actions = torch.rand(8, n, env.action_dim, generator=generator) * 2 - 1
        env.reset(seed=0)
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds * REPEATS or steps < 3:
            env.step(actions[steps % 8])
            steps += 1
        step_us = 1e6 * (time.perf_counter() - start) / (steps * n)
        call_us = 1e6 * in_physics["s"] / (steps * n)
        env.close()
        envpool_us = None
        if task_name in ENVPOOL_IDS:
            envpool_us = 1e6 / envpool_direct_rate(ENVPOOL_IDS[task_name], n, seconds, threads=1)
        row = {"backend_physics_call_us": round(call_us, 1), "backend_step_us": round(step_us, 1),
               "envpool_direct_us": None if envpool_us is None else round(envpool_us, 1),
               "python_per_env_us": round(call_us - physics_us, 1), "task_torch_per_env_us": round(step_us - call_us, 1)}
        result["n"][n] = row
        envpool_cell = "-" if envpool_us is None else f"{envpool_us:.1f}"
        print(f"{n:>6} {physics_us:>12.1f} {call_us:>21.1f} {step_us:>13.1f} {envpool_cell:>15}"
              f" {call_us - physics_us:>15.1f} {step_us - call_us:>19.1f}", flush=True)
    return result


def make_env(task_name: str, backend: str, n: int, device: str, pixels: int = 0):
    from embodied_rl.envs.registry import make

    if pixels:
        options = {"obs_mode": "pixels", "image_size": pixels}
        if backend == "mujoco_1thread":
            return make(task_name, num_envs=n, backend="mujoco", seed=0, threads=1, **options)
        sim_device = device if backend == "mujoco_warp" else "cpu"
        return make(task_name, num_envs=n, backend=backend, device=sim_device, seed=0, **options)
    if backend == "mujoco_1thread":
        return make(task_name, num_envs=n, backend="mujoco", seed=0, threads=1)
    if backend == "envpool":
        return make(ENVPOOL_IDS[task_name], num_envs=n, backend="envpool", seed=0)
    sim_device = device if backend == "mujoco_warp" else "cpu"
    return make(task_name, num_envs=n, backend=backend, device=sim_device, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="push_t,hopper")
    parser.add_argument("--ns", default=",".join(map(str, DEFAULT_NS)))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="wall time per measurement (the best of 3 is reported)")
    parser.add_argument("--device", default="cpu", help="Warp device for mujoco_warp: cpu|cuda")
    parser.add_argument("--no-baselines", action="store_true", help="skip raw and SyncVectorEnv")
    parser.add_argument("--pixels", type=int, default=0,
                        help="render S x S camera observations every step (0: state only)")
    parser.add_argument("--breakdown", action="store_true",
                        help="microseconds per env step of each layer, one thread each (module docstring)")
    args = parser.parse_args()
    if args.breakdown:
        torch.set_num_threads(1)
        print(json.dumps({task: breakdown(task, [int(n) for n in args.ns.split(",")], args.seconds)
                          for task in args.tasks.split(",")}))
        return
    if args.pixels:  # the baselines and EnvPool step state only
        args.no_baselines = True

    torch.set_num_threads(1)
    ns = [int(n) for n in args.ns.split(",")]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    load_start = os.getloadavg()
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"{len(os.sched_getaffinity(0))} cores, load average at start {load_start[0]:.2f} "
          f"(1 min) {load_start[1]:.2f} (5 min); best of {REPEATS} x {args.seconds:g} s per measurement"
          + (f"; {args.pixels}x{args.pixels} pixel observations" if args.pixels else ""))

    rows: list[dict[str, Any]] = []
    headline: dict[str, Any] = {}
    measured: set[str] = set()
    for requested in args.tasks.split(","):
        task_name, note = available_task(requested.strip())
        if note:
            print(f"note: {note}")
        if task_name in measured:
            continue
        measured.add(task_name)

        raw = substeps = None
        if not args.no_baselines:
            raw, substeps = raw_mj_step_rate(task_name, args.seconds)
            print(f"\n[{task_name}] raw mj_step: {raw:,.0f} mj_steps/s single thread, "
                  f"control_substeps={substeps} -> {raw / substeps:,.0f} env steps/s")
        warp_ns = CUDA_WARP_NS if args.device.startswith("cuda") else [
            n for n in ns if n <= WARP_CPU_MAX_N]
        for backend in backends:
            if backend.startswith("envpool") and (task_name not in ENVPOOL_IDS or args.pixels):
                continue
            for n in (warp_ns if backend == "mujoco_warp" else ns):
                if backend == "envpool_direct":
                    rate = envpool_direct_rate(ENVPOOL_IDS[task_name], n, args.seconds)
                else:
                    env = make_env(task_name, backend, n, args.device, args.pixels)
                    rate = batched_rate(env, args.seconds, env.action_dim)
                    env.close()
                rows.append(dict(task=task_name, backend=backend, n=n, sps=rate))
                print(f"  {backend:<16} N={n:<5} {rate:>12,.0f} env steps/s", flush=True)
        if not args.no_baselines:
            for n in ns:
                rate = sync_vector_env_rate(task_name, n, args.seconds)
                rows.append(dict(task=task_name, backend="sync_vector_env", n=n, sps=rate))
                print(f"  {'sync_vector_env':<16} N={n:<5} {rate:>12,.0f} env steps/s", flush=True)

        # readable table for the task: backends x N, with the ratios to the baselines
        table_ns = sorted({r["n"] for r in rows if r["task"] == task_name})
        print(f"\n{task_name}: env steps/s (ratio to raw mj_step / control_substeps)")
        print(f"{'backend':<16}" + "".join(f"{'N=' + str(n):>20}" for n in table_ns))
        raw_env = raw / substeps if raw else None
        for backend in [*backends, "sync_vector_env"]:
            cells = []
            for n in table_ns:
                rate = rate_of(rows, task_name, backend, n)
                if rate is None:
                    cells.append(f"{'-':>20}")
                elif raw_env:
                    cells.append(f"{rate:>12,.0f} ({rate / raw_env:4.2f})")
                else:
                    cells.append(f"{rate:>20,.0f}")
            print(f"{backend:<16}" + "".join(cells))

        mujoco64 = rate_of(rows, task_name, "mujoco", 64)
        sync64 = rate_of(rows, task_name, "sync_vector_env", 64)
        entry: dict[str, Any] = {"measured_task": task_name}
        if args.pixels:
            entry["pixels"] = args.pixels
        if mujoco64:
            entry["mujoco_n64_sps"] = round(mujoco64)
        if raw_env:
            entry["raw_mj_step_env_sps"] = round(raw_env)
            if mujoco64:
                entry["mujoco_n64_over_raw"] = round(mujoco64 / raw_env, 3)
        if mujoco64 and sync64:
            entry["mujoco_n64_over_sync_vector_env"] = round(mujoco64 / sync64, 2)
        for n in ns:
            direct = rate_of(rows, task_name, "envpool_direct", n)
            if direct:
                ours, wrapped = rate_of(rows, task_name, "mujoco", n), rate_of(rows, task_name, "envpool", n)
                if wrapped:
                    entry[f"envpool_backend_over_direct_n{n}"] = round(wrapped / direct, 3)
                if ours:
                    entry[f"mujoco_over_envpool_direct_n{n}"] = round(ours / direct, 3)
        warp_rates = [(r["n"], r["sps"]) for r in rows
                      if r["task"] == task_name and r["backend"] == "mujoco_warp"]
        if warp_rates:
            entry["mujoco_warp_best"] = {"n": max(warp_rates, key=lambda x: x[1])[0],
                                         "sps": round(max(x[1] for x in warp_rates)),
                                         "device": args.device}
        headline[requested.strip()] = entry

    load_end = os.getloadavg()
    print(f"\nload average at end {load_end[0]:.2f} (1 min)")
    headline["load_avg_1min"] = [round(load_start[0], 2), round(load_end[0], 2)]
    headline["cores"] = len(os.sched_getaffinity(0))
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
