"""LIBERO through backend=process: the scripted experts' success per task, and env steps/s with
and without cameras. Needs LIBERO's venv (`embodied-rl setup-sim libero`).

    PYTHONPATH=. .venv/bin/python benchmarks/libero_experts.py --suites libero_spatial --episodes 5
    PYTHONPATH=. .venv/bin/python benchmarks/libero_experts.py --suites none --speed 10

Success: for each suite, the suite's env (`libero/<suite>`, one env per task, or --envs-per-task)
runs the expert at quality 1 until every env has finished --episodes episodes (seeded, so each
draws its own initial states from the task's 50); a table of the success rate per task.
Speed (--speed S): libero/libero_spatial/0 with --speed-envs envs stepped by its expert for S
seconds, state only and with obs=pixels (the agentview and wrist cameras, 128 x 128 each); env
steps/s of the whole batch, making the envs and the first reset not counted.
The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from embodied_rl.envs import make, make_expert


def expert_success(suite: str, episodes: int, envs_per_task: int, workers: int | None, seed: int) -> dict[str, Any]:
    """{"per_task": [success rate of task k], "episodes": per task, "steps_per_s"}."""
    name = f"libero/{suite}"
    env = make(name, num_envs=10 * envs_per_task, workers=workers, seed=seed)
    try:
        expert = make_expert(name, env, quality=1.0, generator=torch.Generator().manual_seed(seed))
        obs, _ = env.reset(seed=seed)
        expert.reset(torch.ones(env.num_envs, dtype=torch.bool))
        results: list[list[bool]] = [[] for _ in range(env.num_envs)]
        steps, start = 0, time.perf_counter()
        while min(len(r) for r in results) < episodes:
            obs, _, _, _, info = env.step(expert.act(obs))
            steps += env.num_envs
            done = info["_episode"].cpu()
            for i in torch.nonzero(done).flatten().tolist():
                if len(results[i]) < episodes:
                    results[i].append(bool(info["episode"]["success_once"][i]))
            expert.reset(done)
        elapsed = time.perf_counter() - start
    finally:
        env.close()
    per_task = [sum(sum(results[k * envs_per_task + j]) for j in range(envs_per_task)) / (episodes * envs_per_task)
                for k in range(10)]
    return {"per_task": per_task, "episodes": episodes * envs_per_task, "steps_per_s": steps / elapsed}


def speed(seconds: float, num_envs: int, workers: int | None, obs_mode: str) -> float:
    """Env steps/s of libero/libero_spatial/0 stepped by its expert."""
    name = "libero/libero_spatial/0"
    env = make(name, num_envs=num_envs, workers=workers, obs_mode=obs_mode, image_size=128)
    try:
        expert = make_expert(name, env)
        obs, _ = env.reset(seed=0)
        expert.reset(torch.ones(env.num_envs, dtype=torch.bool))
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            obs, _, _, _, info = env.step(expert.act(obs))
            expert.reset(info["_episode"].cpu())
            steps += env.num_envs
        return steps / (time.perf_counter() - start)
    finally:
        env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", default="libero_spatial,libero_object", help="comma-separated, or none")
    parser.add_argument("--episodes", type=int, default=5, help="episodes per env")
    parser.add_argument("--envs-per-task", type=int, default=1)
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: one per core)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speed", type=float, default=0.0, help="seconds per speed measurement (0: none)")
    parser.add_argument("--speed-envs", type=int, default=2)
    args = parser.parse_args()
    report: dict[str, Any] = {}
    for suite in [s for s in args.suites.split(",") if s and s != "none"]:
        result = expert_success(suite, args.episodes, args.envs_per_task, args.workers, args.seed)
        report[suite] = result
        print(f"{suite}: expert success per task ({result['episodes']} episodes each), "
              f"{result['steps_per_s']:.1f} env steps/s")
        print("  task  " + "  ".join(f"{k:>4d}" for k in range(10)))
        print("  rate  " + "  ".join(f"{rate:4.0%}" for rate in result["per_task"]))
    if args.speed > 0:
        for obs_mode in ("state", "pixels"):
            rate = speed(args.speed, args.speed_envs, args.workers, obs_mode)
            report[f"steps_per_s_{obs_mode}"] = rate
            print(f"speed, obs={obs_mode}, {args.speed_envs} envs: {rate:.1f} env steps/s")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
