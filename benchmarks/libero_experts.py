"""LIBERO through backend=process: the scripted experts' success per task, and env steps/s with
and without cameras. Needs LIBERO's venv (`embodied-rl setup-sim libero`).

    PYTHONPATH=. .venv/bin/python benchmarks/libero_experts.py --suites libero_spatial --episodes 5
    PYTHONPATH=. .venv/bin/python benchmarks/libero_experts.py --suites none --speed 10
    PYTHONPATH=. .venv/bin/python benchmarks/libero_experts.py --suites libero_spatial --mistakes 0.5

Success: for each suite, the suite's env (`libero/<suite>`, one env per task, or --envs-per-task)
runs the expert at quality 1 until every env has finished --episodes episodes (seeded, so each
draws its own initial states from the task's 50); a table of the success rate per task, the
grasps per episode (a missed or dropped object is grasped again) and the episode length. With
--mistakes M that share of episodes starts with a deliberate miss (collect's mistakes=).
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


def expert_success(suite: str, episodes: int, envs_per_task: int, workers: int | None, seed: int,
                   mistakes: float = 0.0) -> dict[str, Any]:
    """{"per_task": [success rate of task k], "grasps": [mean grasps per episode of task k],
    "length": [mean episode length of task k], "episodes": per task, "steps_per_s"}."""
    name = f"libero/{suite}"
    env = make(name, num_envs=10 * envs_per_task, workers=workers, seed=seed)
    try:
        expert = make_expert(name, env, quality=1.0, generator=torch.Generator().manual_seed(seed), mistakes=mistakes)
        obs, _ = env.reset(seed=seed)
        expert.reset(torch.ones(env.num_envs, dtype=torch.bool))
        results: list[list[bool]] = [[] for _ in range(env.num_envs)]
        grasps: list[list[int]] = [[] for _ in range(env.num_envs)]
        lengths: list[list[int]] = [[] for _ in range(env.num_envs)]
        steps, start = 0, time.perf_counter()
        while min(len(r) for r in results) < episodes:
            obs, _, _, _, info = env.step(expert.act(obs))
            steps += env.num_envs
            done = info["_episode"].cpu()
            for i in torch.nonzero(done).flatten().tolist():
                if len(results[i]) < episodes:
                    results[i].append(bool(info["episode"]["success_once"][i]))
                    grasps[i].append(expert.plans[i].grasps)
                    lengths[i].append(int(info["episode"]["length"][i]))
            expert.reset(done)
        elapsed = time.perf_counter() - start
    finally:
        env.close()
    def task_mean(values: list[list[Any]], k: int) -> float:
        rows = values[k * envs_per_task:(k + 1) * envs_per_task]
        return sum(sum(row[:episodes]) for row in rows) / (episodes * envs_per_task)

    return {"per_task": [task_mean(results, k) for k in range(10)], "grasps": [task_mean(grasps, k) for k in range(10)],
            "length": [task_mean(lengths, k) for k in range(10)], "episodes": episodes * envs_per_task,
            "steps_per_s": steps / elapsed}


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
    parser.add_argument("--mistakes", type=float, default=0.0, help="share of episodes with a deliberate miss")
    parser.add_argument("--speed", type=float, default=0.0, help="seconds per speed measurement (0: none)")
    parser.add_argument("--speed-envs", type=int, default=2)
    args = parser.parse_args()
    report: dict[str, Any] = {}
    for suite in [s for s in args.suites.split(",") if s and s != "none"]:
        result = expert_success(suite, args.episodes, args.envs_per_task, args.workers, args.seed, args.mistakes)
        report[suite] = result
        print(f"{suite}: expert success per task ({result['episodes']} episodes each), "
              f"{result['steps_per_s']:.1f} env steps/s")
        print("  task  " + "  ".join(f"{k:>4d}" for k in range(10)))
        print("  rate  " + "  ".join(f"{rate:4.0%}" for rate in result["per_task"]))
        print("  grasp " + "  ".join(f"{n:4.2f}" for n in result["grasps"]))
        print("  steps " + "  ".join(f"{n:4.0f}" for n in result["length"]))
    if args.speed > 0:
        for obs_mode in ("state", "pixels"):
            rate = speed(args.speed, args.speed_envs, args.workers, obs_mode)
            report[f"steps_per_s_{obs_mode}"] = rate
            print(f"speed, obs={obs_mode}, {args.speed_envs} envs: {rate:.1f} env steps/s")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
