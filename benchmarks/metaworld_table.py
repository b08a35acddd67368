"""Meta-World benchmark: expert, BC and fine-tuned success per task, on EnvPool.

    python benchmarks/metaworld_table.py --tasks MT10 --algos residual_offpolicy residual_ppo \
        --env-steps 100000 --out runs/metaworld_table

Per task (`MT10` expands to its ten tasks): Meta-World's scripted expert collects the task's
default demos (50, configs/task/metaworld/<task>.yaml) and its success rate is the expert row;
`pretrain` clones a flow policy from them, evaluated on --eval-episodes episodes (Wilson
interval); each --algos method fine-tunes that checkpoint (periodic evaluations give the env steps
and training wall time to the first evaluation at >= --target) and its last checkpoint is
evaluated on the same episodes. Finished runs are reused, so an interrupted table resumes. The last
line printed is one JSON object with every row.

    python benchmarks/metaworld_table.py --tasks MT50 --experts-only --expert-episodes 50

runs only Meta-World's scripted policies (quality 1) on every task and prints their success rates.

    python benchmarks/metaworld_table.py --tasks MT10 --algos residual_offpolicy residual_ppo \
        --out runs/metaworld_table --figure curves.png

trains nothing: it draws a panel per task from the fine-tuning runs already in --out (every seed
of every --algos method; a run still under way shows its curve so far), BC's start dashed, and
prints each run's curve and its dip (the deepest fall below the curve's first point).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from finetune_table import (  # noqa: E402
    DIP_TOLERANCE,
    bc_checkpoint,
    curve,
    dip,
    evaluate_once,
    finetune_run,
    panel_figure,
    refuse,
)


def suite_tasks(names: list[str]) -> list[str]:
    """Meta-World task names, with MT10 / MT50 expanded to their tasks."""
    from embodied_rl.envs.registry import task_class

    tasks = []
    for name in names:
        cls = task_class(f"metaworld/{name}")
        tasks += list(cls.suite_tasks)
    return tasks


def expert_rates(args) -> dict:
    """Success rate of each task's scripted expert over --expert-episodes episodes (quality 1)."""
    from embodied_rl import envs

    rates = {}
    for short in suite_tasks(args.tasks):
        task = f"metaworld/{short}"
        env = envs.make(task, num_envs=args.num_envs, seed=args.eval_seed)
        expert = envs.make_expert(task, env)
        obs, _ = env.reset()
        successes: list[bool] = []
        while len(successes) < args.expert_episodes:
            obs, _, _, _, info = env.step(expert.act(obs))
            finished = info["_episode"]
            successes += info["episode"]["success_once"][finished].tolist()
            expert.reset(finished)
        env.close()
        rates[short] = sum(successes[:args.expert_episodes]) / args.expert_episodes
        print(f"{short:<28} {rates[short]:.2f}", flush=True)
    at_90 = sum(rate >= 0.9 for rate in rates.values())
    print(f"{at_90} of {len(rates)} tasks at >= 90%; mean {sum(rates.values()) / len(rates):.3f}")
    return rates


def table(args) -> dict:
    root = Path(args.out)
    rows = {}
    for short in suite_tasks(args.tasks):
        task = f"metaworld/{short}"
        task_sets = [] if args.max_episode_steps is None else [f"task.max_episode_steps={args.max_episode_steps}"]
        collect = [f"demos={args.demos}"] if args.demos else []
        pretrain = [f"steps={args.pretrain_steps}", *args.pretrain_set] if args.pretrain_steps else list(args.pretrain_set)
        checkpoint = bc_checkpoint(task, {}, root, collect, pretrain)
        collect_info = json.loads((root / f"{task}_bc" / "collect" / "collect_info.json").read_text())
        bc = evaluate_once(root / f"{task}_bc_eval", [f"task={task}", f"checkpoint={checkpoint}",
                                                       f"episodes={args.eval_episodes}", "videos=0",
                                                       f"seed={args.eval_seed}", *task_sets])
        row = {"expert": collect_info["expert_success_rate"], "demos": collect_info["episodes_written"],
               "bc": bc["success_rate"], "bc_ci95": bc["success_ci95"]}
        for algo in args.algos:
            run = finetune_run(task, algo, args.seed, checkpoint, root / f"{task}_{algo}_{args.seed}", args)
            eval_info = json.loads((root / f"{task}_{algo}_{args.seed}" / "eval" / "eval_info.json").read_text())
            row[algo] = {**run, "ci95": eval_info["overall"]["success_ci95"]}
        rows[short] = row
        print_table(rows, args)  # after every task, so a long table shows its progress
    return rows


def figure(args) -> dict:
    """A panel per task: the periodic evaluations of every run in --out of each --algos method
    (`<task>_<algo>_<seed>/finetune`), and their dips."""
    from embodied_rl.runs import read_metrics

    root = Path(args.out)
    panels: dict[str, dict[str, list]] = {}
    rows = {}
    for short in suite_tasks(args.tasks):
        for algo in args.algos:
            for run_dir in sorted(root.glob(f"metaworld/{short}_{algo}_*/finetune")):
                seed = run_dir.parent.name.removeprefix(f"{short}_{algo}_")
                if not seed.isdigit() or not (run_dir / "metrics.jsonl").exists():  # another algo's (dsrl_na: dsrl)
                    continue
                points = curve(read_metrics(run_dir))
                if not points:
                    continue
                panels.setdefault(short, {}).setdefault(algo, []).append(points)
                rows[str(run_dir.parent)] = {"task": short, "algo": algo, "curve": points, "dip": dip(points)}
                print(f"{run_dir.parent.name:<44} dip {dip(points):.2f}  " + " ".join(f"{r:.2f}" for _, r in points))
    if not panels:
        refuse(f"--figure: no fine-tuning runs of {' '.join(args.algos)} under {root}")
    fell = [Path(run).name for run, row in rows.items() if row["dip"] > DIP_TOLERANCE + 1e-9]
    print(f"{len(rows) - len(fell)} of {len(rows)} runs never more than {DIP_TOLERANCE * 100:.0f} points below their "
          f"start" + (f"; below it: {' '.join(fell)}" if fell else ""))
    print(panel_figure(panels, f"Meta-World, {', '.join(args.algos)}", Path(args.figure)))
    return rows


def print_table(rows: dict, args) -> None:
    print(f"\nMeta-World v3 on EnvPool; {args.eval_episodes} evaluation episodes per success rate (Wilson 95% "
          f"interval); 'to {args.target:.0%}': env steps and training wall time to the first periodic evaluation "
          f"({args.curve_episodes} episodes every {args.eval_every} env steps) at or above it.")
    header = f"{'task':<22} {'expert':>6} {'BC':>17}"
    for algo in args.algos:
        header += f" {algo + ' success':>28} {'steps':>8} {'wall s':>7} {'to target':>16}"
    print(header)
    for task, row in rows.items():
        line = f"{task:<22} {row['expert']:>6.2f} {row['bc']:>5.2f} [{row['bc_ci95'][0]:.2f},{row['bc_ci95'][1]:.2f}]"
        for algo in args.algos:
            r = row[algo]
            if r["steps_to_target"] is None:
                target = "-"
            elif r["steps_to_target"] == 0:
                target = "at start"  # the starting policy's own curve evaluation is already there
            else:
                target = f"{r['steps_to_target']} / {r['wall_to_target'] or 0:.0f}s"  # older runs logged no wall time
            line += (f" {r['success']:>16.2f} [{r['ci95'][0]:.2f},{r['ci95'][1]:.2f}] {r['env_steps']:>8}"
                     f" {r['wall_s']:>7.0f} {target:>16}")
        print(line)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["MT10"], help="Meta-World tasks, or MT10 / MT50")
    parser.add_argument("--algos", nargs="*", default=["residual_offpolicy", "residual_ppo"],
                        help="fine-tuning methods; none (a bare --algos) gives the expert and BC rows only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--env-steps", type=int, default=100000)
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=20000)
    parser.add_argument("--curve-episodes", type=int, default=20)
    parser.add_argument("--eval-episodes", type=int, default=100)
    parser.add_argument("--eval-seed", type=int, default=1000)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--set", nargs="*", default=[],
                        help="finetune overrides: key=value for every algo, ALGO:key=value for one")
    parser.add_argument("--demos", type=int, default=None, help="demos to collect (default: the task's, 50)")
    parser.add_argument("--pretrain-steps", type=int, default=None, help="BC steps (default: the task's)")
    parser.add_argument("--pretrain-set", nargs="*", default=[], help="pretrain overrides (key=value)")
    parser.add_argument("--max-episode-steps", type=int, default=None,
                        help="task.max_episode_steps for evaluation and fine-tuning (default: 500)")
    parser.add_argument("--out", default="runs/metaworld_table")
    parser.add_argument("--experts-only", action="store_true", help="only the scripted experts' success rates")
    parser.add_argument("--expert-episodes", type=int, default=50)
    parser.add_argument("--figure", default=None, help="draw the runs in --out into this image; train nothing")
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    mode = expert_rates if arguments.experts_only else figure if arguments.figure else table
    print(json.dumps(mode(arguments)))
