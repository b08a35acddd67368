"""On-policy fine-tuning benchmark.

    python benchmarks/finetune_table.py timing            # ReinFlow K=1/K=4 vs DPPO K=10 per iteration
    python benchmarks/finetune_table.py table --tasks push_t --checkpoint BC_DIR --algos residual_ppo \
        --seeds 0 1 2 --env-steps 500000                  # BC -> fine-tuned success per task/method

`timing` runs the same number of envs and chunks per iteration for each actor on push_t with a
freshly initialised policy of the default size (speed does not depend on the weights) and
reports the rollout+update wall time per iteration and the ratio to DPPO K=10, measured in the
same run. `table` fine-tunes a given BC checkpoint (--checkpoint) per (algo, seed), or runs
`embodied-rl quickstart` per (task, algo, seed), in --out, and reports mean BC and fine-tuned
success over seeds with a t-interval, the per-seed values, env steps and wall time per run.
The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def time_iteration(policy_type: str, steps: int, algo: str, num_envs: int, chunks: int, repeats: int) -> float:

    from embodied_rl import envs
    from embodied_rl.algos.ppo import finetune
    from embodied_rl.cli import compose
    from embodied_rl.policies import make_policy
    from embodied_rl.runs import Run

    env = envs.make("push_t", num_envs=num_envs, seed=0)
    torch.manual_seed(0)
    policy = make_policy(policy_type, obs_dim=env.task.obs_dim, action_dim=env.action_dim, num_inference_steps=steps,
                         backbone_kwargs=dict(hidden_dim=256, num_blocks=3, time_dim=64), task="push_t")
    steps_per_iter = num_envs * chunks * policy.n_action_steps
    overrides = ["task=push_t", f"algo={algo}", "checkpoint=unused", f"num_envs={num_envs}", "eval_every=0",
                 f"env_steps={steps_per_iter * repeats}", f"algo.num_steps={chunks}", "algo.checkpoint_every=0",
                 "algo.critic_warmup_iters=0", "algo.target_kl=null"]
    if algo == "dppo":
        overrides.append("algo.actor_kwargs.ft_denoising_steps=0")
    cfg = compose("finetune", overrides)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run = Run(Path(tmp) / "run")
        finetune(cfg, run, env, policy)
        rows = [r for r in run.read_metrics() if "train/iteration_s" in r]
    env.close()
    times = [r["train/iteration_s"] for r in rows[1:]] or [r["train/iteration_s"] for r in rows]
    return sum(times) / len(times)


def timing(args) -> dict:
    torch.set_num_threads(1)
    cases = [("DPPO K=10 (diffusion)", "diffusion", 10, "dppo"),
             ("ReinFlow K=1 (flow)", "flow", 1, "reinflow"),
             ("ReinFlow K=4 (flow)", "flow", 4, "reinflow")]
    results = {}
    for label, policy_type, steps, algo in cases:
        results[label] = time_iteration(policy_type, steps, algo, args.num_envs, args.chunks, args.repeats)
    base = results["DPPO K=10 (diffusion)"]
    print(f"{'actor':<24} {'s / iteration':>14} {'speed-up vs DPPO K=10':>22}")
    for label, seconds in results.items():
        print(f"{label:<24} {seconds:>14.3f} {base / seconds:>21.2f}x")
    return {"iteration_s": results, "speedup_reinflow_k1": base / results["ReinFlow K=1 (flow)"],
            "speedup_reinflow_k4": base / results["ReinFlow K=4 (flow)"],
            "num_envs": args.num_envs, "chunks_per_iteration": args.chunks}


def _cli(args: list[str]) -> None:
    from embodied_rl.cli import main as cli

    if cli(args) != 0:
        raise SystemExit(f"failed: embodied-rl {' '.join(args)}")


def _success(run_dir: Path) -> float:
    return json.loads((run_dir / "eval_info.json").read_text())["overall"]["success_rate"]


def table(args) -> dict:
    """BC -> fine-tuned success per (task, algo) over seeds.

    With --checkpoint (one task): the BC checkpoint is evaluated once and each (algo, seed) runs
    `embodied-rl finetune` from it, then `embodied-rl eval` of its last checkpoint on the same
    episodes. Without: `embodied-rl quickstart` per (task, algo, seed) (collect, pretrain, ...).
    """
    from embodied_rl.eval.stats import mean_interval

    root = Path(args.out)
    rows = {}
    for task in args.tasks:
        bc_success = None
        if args.checkpoint:
            bc_dir = root / f"{task}_bc_eval"
            if not (bc_dir / "eval_info.json").exists():
                _cli(["eval", f"task={task}", f"checkpoint={args.checkpoint}", f"episodes={args.eval_episodes}",
                      "videos=0", f"run_dir={bc_dir}"])
            bc_success = _success(bc_dir)
            bc_low, bc_high = json.loads((bc_dir / "eval_info.json").read_text())["overall"]["success_ci95"]
        for algo in args.algos:
            before, after, walls = [], [], []
            for seed in args.seeds:
                run_dir = root / f"{task}_{algo}_{seed}"
                start = time.perf_counter()
                if args.checkpoint:
                    if not (run_dir / "finetune" / "eval_info.json").exists():
                        _cli(["finetune", f"task={task}", f"algo={algo}", f"checkpoint={args.checkpoint}",
                              f"seed={seed}", f"env_steps={args.env_steps}", f"num_envs={args.num_envs}",
                              f"eval_every={args.eval_every}", "eval_episodes=50", "videos=0",
                              f"run_dir={run_dir / 'finetune'}", *args.set])
                    if not (run_dir / "eval" / "eval_info.json").exists():
                        _cli(["eval", f"task={task}", f"checkpoint={run_dir / 'finetune' / 'checkpoints' / 'last'}",
                              f"episodes={args.eval_episodes}", "videos=0", f"run_dir={run_dir / 'eval'}"])
                    before.append(bc_success)
                    after.append(_success(run_dir / "eval"))
                    # fine-tuning wall time as the run logged it (also right for a reused run)
                    metrics = [json.loads(line) for line in (run_dir / "finetune" / "metrics.jsonl").open()]
                    walls.append(max(r["train/wall_s"] for r in metrics if "train/wall_s" in r))
                else:
                    _cli(["quickstart", f"task={task}", f"finetune_algo={algo}", f"seed={seed}", f"run_dir={run_dir}",
                          f"finetune_env_steps={args.env_steps}", "videos=0"])
                    info = json.loads((run_dir / "quickstart_info.json").read_text())
                    before.append(info["before"]["success_rate"])
                    after.append(info["after"]["success_rate"])
                    walls.append(time.perf_counter() - start)
            # one BC evaluation: its Wilson interval; over seeds: a t-interval of the mean
            bc = ({"mean": bc_success, "std": None, "ci_low": bc_low, "ci_high": bc_high} if args.checkpoint
                  else mean_interval(before))
            rows[f"{task}/{algo}"] = {"bc": bc, "finetuned": mean_interval(after),
                                      "finetuned_per_seed": after, "seeds": list(args.seeds),
                                      "env_steps": args.env_steps, "wall_s": sum(walls) / len(walls)}
    print(f"{'task/algo':<28} {'BC success':>22} {'fine-tuned success':>22} {'per seed':>20} {'env steps':>10} {'wall s':>8}")
    print("(wall s: per run; with --checkpoint the fine-tuning's own train/wall_s, else the whole quickstart)")
    for key, row in rows.items():
        def fmt(s):
            ci = "" if s["ci_low"] is None else f" [{s['ci_low']:.2f},{s['ci_high']:.2f}]"
            return f"{s['mean']:.2f}{ci}"
        seeds = " ".join(f"{v:.2f}" for v in row["finetuned_per_seed"])
        print(f"{key:<28} {fmt(row['bc']):>22} {fmt(row['finetuned']):>22} {seeds:>20} {row['env_steps']:>10}"
              f" {row['wall_s']:>8.0f}")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("timing")
    t.add_argument("--num-envs", type=int, default=16)
    t.add_argument("--chunks", type=int, default=8)
    t.add_argument("--repeats", type=int, default=3)
    b = sub.add_parser("table")
    b.add_argument("--tasks", nargs="+", default=["push_t", "lift", "peg_insert"])
    b.add_argument("--algos", nargs="+", default=["residual_ppo"])
    b.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    b.add_argument("--env-steps", type=int, default=200000)
    b.add_argument("--checkpoint", default=None, help="a BC checkpoint to fine-tune (skips collect and pretrain)")
    b.add_argument("--num-envs", type=int, default=64)
    b.add_argument("--eval-every", type=int, default=0, help="0 = evaluate at the start and the end only")
    b.add_argument("--eval-episodes", type=int, default=100, help="episodes of the before/after evaluations")
    b.add_argument("--out", default="runs/bench", help="run directories; finished runs are reused")
    b.add_argument("--set", nargs="*", default=[], help="extra finetune overrides, e.g. algo.lr=1e-4")
    arguments = parser.parse_args()
    result = timing(arguments) if arguments.mode == "timing" else table(arguments)
    print(json.dumps(result))
