"""Data-parallel scaling on this machine: 1 rank against K ranks, and memory against size.

    PYTHONPATH=. .venv/bin/python benchmarks/scaling.py                      # ranks 1,2 and memory
    PYTHONPATH=. .venv/bin/python benchmarks/scaling.py --ranks 1,2 --task push_t --env-steps 40960
    PYTHONPATH=. .venv/bin/python benchmarks/scaling.py --skip-memory

Ranks: `embodied-rl finetune` (launched with `torchrun --nproc-per-node=K -m embodied_rl` for
K > 1; the same total num_envs, split over the ranks) on a flow policy of the task's sizes and
the default architecture (random weights: speed does not depend on what the policy learned),
eval_every=0. From metrics.jsonl it reports, per algorithm and K:
- env steps/s: the job's env steps per second of training (rollouts and updates), iterations
  after the first (warm-up) only;
- rollout env steps/s: the job's env steps per second of rollout time;
- updates/s: the job's optimiser steps per second of update time (PPO: minibatch steps, each
  averaging K ranks' minibatches; off-policy: gradient steps, each averaging K batches);
- the ratio of each to K = 1 (the same run order, the same machine, one after the other).
Memory: the peak resident memory (ru_maxrss of the process, via os.wait4) of a single-process
run as num_envs grows (residual PPO) and as the replay buffer grows (residual TD3), beside the
replay's own size (capacity x floats per transition x 4 bytes).
The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def make_checkpoint(task: str, out: Path) -> Path:
    """A flow policy of the task's sizes with the default architecture, random weights."""
    import torch

    from embodied_rl.envs import make
    from embodied_rl.policies import make_policy, save_policy

    env = make(task, num_envs=1)
    obs_dim, action_dim = env.single_observation_space.shape[0], env.single_action_space.shape[0]
    env.close()
    torch.manual_seed(0)
    policy = make_policy("flow", obs_dim=obs_dim, action_dim=action_dim, task=task)
    save_policy(policy, out)
    return out


def launch(ranks: int, args: list[str]) -> tuple[int, float, int]:
    """Run the command (under torchrun for ranks > 1); (exit code, seconds, peak RSS in MiB of
    the process itself: single-process runs only)."""
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}  # torchrun gives each rank 1 thread
    prefix = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--rdzv-backend=c10d",
               "--rdzv-endpoint=localhost:0"] if ranks > 1 else [sys.executable])
    start = time.perf_counter()
    process = subprocess.Popen([*prefix, "-m", "embodied_rl", *args], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        print(process.stderr.read()[-2000:], file=sys.stderr)
    return code, seconds, int(usage.ru_maxrss / 1024)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


ALGOS = {
    # name: (overrides, optimiser steps per iteration or per env step)
    "residual_ppo": ["algo=residual_ppo", "algo.num_steps=64", "algo.critic_warmup_iters=0", "algo.target_kl=null"],
    "residual_offpolicy": ["algo=residual_offpolicy", "algo.warmup_env_steps=0", "algo.critic_only_steps=0",
                           "algo.utd_ratio=0.25", "algo.buffer_size=100000"],
}


def measure_ranks(task: str, checkpoint: Path, algo: str, ranks: int, num_envs: int, env_steps: int,
                  work: Path) -> dict[str, float]:
    run_dir = work / f"{algo}_{ranks}"
    args = ["finetune", f"task={task}", f"checkpoint={checkpoint}", f"num_envs={num_envs}", f"env_steps={env_steps}",
            "eval_every=0", "checkpoint_every=0", "videos=0", f"log_every={1 if algo == 'residual_ppo' else 2000}",
            f"run_dir={run_dir}", *ALGOS[algo]]
    code, seconds, _ = launch(ranks, args)
    if code != 0:
        raise SystemExit(f"{algo} with {ranks} rank(s) failed (exit {code})")
    rows = metrics(run_dir)
    if algo == "residual_ppo":
        epochs, minibatches = 10, 4  # configs/algo/residual_ppo.yaml and _ppo.yaml
        rows = [r for r in rows if "train/iteration_s" in r][1:]  # the first iteration warms up
        rollout_s = sum(r["train/rollout_s"] for r in rows)
        iteration_s = sum(r["train/iteration_s"] for r in rows)
        steps_per_iteration = num_envs * 64  # algo.num_steps=64 per env
        return {"env_steps_per_s": len(rows) * steps_per_iteration / iteration_s,
                "rollout_env_steps_per_s": len(rows) * steps_per_iteration / rollout_s,
                "updates_per_s": len(rows) * epochs * minibatches / (iteration_s - rollout_s),
                "wall_s": seconds}
    # off-policy: the whole run's training wall time (train/wall_s, logged at the end); each rank
    # takes utd_ratio gradient steps per env step of its own, and each step averages K batches
    wall = [r["train/wall_s"] for r in rows if "train/wall_s" in r][-1]
    return {"env_steps_per_s": env_steps / wall, "updates_per_s": 0.25 * env_steps / ranks / wall, "wall_s": seconds}


def measure_memory(task: str, checkpoint: Path, work: Path, env_sizes: list[int], replay_sizes: list[int]) -> dict:
    from embodied_rl.envs import make

    env = make(task, num_envs=1)
    obs_dim, action_dim = env.single_observation_space.shape[0], env.single_action_space.shape[0]
    env.close()
    out: dict[str, Any] = {"num_envs": {}, "replay": {}}
    for n in env_sizes:
        run_dir = work / f"mem_envs_{n}"
        args = ["finetune", f"task={task}", f"checkpoint={checkpoint}", f"num_envs={n}", f"env_steps={n * 64 * 2}",
                "eval_every=0", "checkpoint_every=0", "videos=0", f"run_dir={run_dir}", *ALGOS["residual_ppo"]]
        code, _, rss = launch(1, args)
        out["num_envs"][n] = rss if code == 0 else None
        print(f"memory residual_ppo num_envs={n}: {rss} MiB", flush=True)
    feature_dim = None
    for capacity in replay_sizes:
        run_dir = work / f"mem_replay_{capacity}"
        overrides = [o for o in ALGOS["residual_offpolicy"] if not o.startswith("algo.buffer_size")]
        args = ["finetune", f"task={task}", f"checkpoint={checkpoint}", "num_envs=16", "env_steps=2048",
                "eval_every=0", "checkpoint_every=0", "videos=0", f"run_dir={run_dir}", *overrides,
                f"algo.buffer_size={capacity}"]
        code, _, rss = launch(1, args)
        if feature_dim is None:
            from embodied_rl.policies import load_policy

            feature_dim = load_policy(checkpoint).feature_dim
        floats = 2 * feature_dim + 3 * action_dim + 2  # obs, next_obs; base, action, next_base; reward, discount
        out["replay"][capacity] = {"rss_mib": rss if code == 0 else None,
                                   "buffer_mib": round(capacity * floats * 4 / 2**20, 1)}
        print(f"memory residual_offpolicy buffer_size={capacity}: {rss} MiB (buffer {out['replay'][capacity]['buffer_mib']} MiB)",
              flush=True)
    out["obs_dim"], out["action_dim"] = obs_dim, action_dim
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="push_t")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--algos", default="residual_ppo,residual_offpolicy")
    parser.add_argument("--num-envs", type=int, default=32)
    parser.add_argument("--env-steps", type=int, default=32 * 64 * 6)
    parser.add_argument("--memory-envs", default="16,64,256")
    parser.add_argument("--memory-replay", default="100000,1000000")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    ranks = [int(k) for k in args.ranks.split(",")]
    work = Path(tempfile.mkdtemp(prefix="scaling_"))
    checkpoint = make_checkpoint(args.task, work / "policy")
    results: dict[str, Any] = {"task": args.task, "num_envs": args.num_envs, "env_steps": args.env_steps,
                               "machine": f"{platform.machine()}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"),
                               "ranks": {}}
    for algo in args.algos.split(","):
        results["ranks"][algo] = {}
        for k in ranks:
            row = measure_ranks(args.task, checkpoint, algo, k, args.num_envs, args.env_steps, work)
            results["ranks"][algo][k] = row
            base = results["ranks"][algo][ranks[0]]
            ratios = {key: row[key] / base[key] for key in row if key != "wall_s"}
            row["ratio_to_1"] = ratios
            shown = ", ".join(f"{key} {value:.0f} ({ratios[key]:.2f}x)" for key, value in row.items()
                              if key not in ("wall_s", "ratio_to_1"))
            print(f"{algo} ranks={k}: {shown}", flush=True)
    if not args.skip_memory:
        results["memory"] = measure_memory(args.task, checkpoint, work,
                                           [int(n) for n in args.memory_envs.split(",")],
                                           [int(n) for n in args.memory_replay.split(",")])
    print(json.dumps(results))


if __name__ == "__main__":
    main()
