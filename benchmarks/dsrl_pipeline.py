"""What `algo.pipeline` buys a DSRL-NA run: training env steps/s with the envs stepped between the
learner's updates (serial, the default) and in a thread while it trains (pipelined), measured in
the same run.

    OMP_NUM_THREADS=1 python benchmarks/dsrl_pipeline.py --checkpoint runs/vla_libero/pretrain/checkpoints/last \
        --task libero/libero_spatial --num-envs 20 --env-steps 3200 --utd 20

Each variant is a short `embodied-rl finetune algo=dsrl_na` run in its own temporary run_dir with no
warm-up (the learner trains from the first chunk) and no evaluation until the end; its speed is the
env steps over the training wall time (`eval/train_wall_s` of the final evaluation: set-up and
evaluation excluded). The variants alternate `--repeats` times and each keeps its best (other jobs
only ever slow a measurement down). The gain needs a core for the simulator besides the learner's:
a step takes the longer of the two instead of their sum. Printed: per variant the env steps/s, then
the ratio; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

VARIANTS = ("serial", "pipelined")


def train_seconds(run_dir: Path) -> float:
    from embodied_rl.runs import read_metrics

    rows = [row for row in read_metrics(run_dir) if "eval/train_wall_s" in row]
    if not rows:
        raise SystemExit(f"{run_dir}: the run logged no evaluation, so no training time")
    return float(rows[-1]["eval/train_wall_s"])


def finetune_speed(args: argparse.Namespace, pipeline: bool, run_dir: Path) -> float:
    """Env steps/s of one short DSRL-NA run."""
    from embodied_rl.cli import main

    code = main(["finetune", "algo=dsrl_na", f"checkpoint={args.checkpoint}", f"task={args.task}",
                 f"num_envs={args.num_envs}", f"env_steps={args.env_steps}", "eval_every=0", "eval_episodes=1",
                 "videos=0", f"seed={args.seed}", f"run_dir={run_dir}", f"algo.pipeline={str(pipeline).lower()}",
                 f"algo.utd_ratio={args.utd}", f"algo.policy_delay={args.policy_delay}", "algo.warmup_env_steps=0",
                 "algo.critic_only_steps=0", f"algo.batch_size={args.batch_size}", *args.overrides])
    if code != 0:
        raise SystemExit(f"finetune exited with {code} (pipeline={pipeline})")
    return args.env_steps / train_seconds(run_dir)


def run(args: argparse.Namespace) -> dict:
    best = {variant: 0.0 for variant in VARIANTS}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for variant in VARIANTS:
                speed = finetune_speed(args, variant == "pipelined", Path(scratch) / f"{variant}_{repeat}")
                best[variant] = max(best[variant], speed)
                print(f"{variant} (repeat {repeat}): {speed:.2f} env steps/s", flush=True)
    ratio = best["pipelined"] / best["serial"]
    print(f"serial {best['serial']:.2f}, pipelined {best['pipelined']:.2f} env steps/s: {ratio:.2f}x")
    return {"task": args.task, "num_envs": args.num_envs, "utd_ratio": args.utd, "env_steps": args.env_steps,
            "env_steps_per_s": best, "ratio": ratio}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="the BC checkpoint DSRL-NA wraps")
    parser.add_argument("--task", required=True)
    parser.add_argument("--num-envs", type=int, default=20)
    parser.add_argument("--env-steps", type=int, default=3200, help="per run")
    parser.add_argument("--utd", type=float, default=20.0, help="algo.utd_ratio")
    parser.add_argument("--policy-delay", type=int, default=20, help="algo.policy_delay")
    parser.add_argument("--batch-size", type=int, default=256, help="algo.batch_size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="more finetune overrides (key=value)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(run(parse_args())))
