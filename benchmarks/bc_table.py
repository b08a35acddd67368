"""Behaviour-cloning benchmark: success against demos, pretraining time, inference time per chunk.

    python benchmarks/bc_table.py                                  # every task x policy, the tasks' default demos
    python benchmarks/bc_table.py --tasks push_t --policies flow --demos 25 50 100
    python benchmarks/bc_table.py --demos 0.25x 0.5x 1x --no-train     # print what is stored
    python benchmarks/bc_table.py --quick                          # push_t, flow, 500 steps, 20 episodes

Per task it collects one demo dataset with the scripted expert (the task's default quality, as
many episodes as the largest --demos) and, per (policy, demos) cell, pretrains with
`embodied-rl pretrain ... max_demos=K` (the first K demos), then evaluates the EMA policy at a few
numbers of denoising steps (diffusion DDIM 1/5/10, flow 1/4/10, shortcut 1/2/4): success rate
with a Wilson 95% interval (return for tasks without success). Cells run in --jobs processes of
one thread each. A cell's result is stored in <workdir>/<cell>/result.json and reused by later
runs (--fresh retrains), so a grid can be filled in several runs and printed as one table.

Inference time: best-of-R ms per predict_chunk call for one observation (batch 1) and a batch
of 64, for each policy type and number of steps, on freshly initialised policies of the
configured size (time does not depend on the weights) with the first task's dimensions, timed
round-robin in this process after training, as a ratio to flow K=10 measured in the same run.
For tasks without success (hopper) the table shows the average return R with a 95% interval.
The last line printed is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import time
from pathlib import Path

SUCCESS_STEPS = {"diffusion": [1, 5, 10], "flow": [1, 4, 10], "shortcut": [1, 2, 4]}
TIMING_STEPS = {"diffusion": [1, 5, 10, 20, 100], "flow": [1, 4, 10], "shortcut": [1, 2, 4, 8]}
BASELINE = ("flow", 10)


def task_defaults(task: str) -> dict:
    import yaml

    from embodied_rl.paths import config_dir

    return yaml.safe_load((config_dir() / "task" / f"{task}.yaml").read_text())


def demo_count(value: str, task_default: int) -> int:
    """'25' -> 25; '0.5x' -> half the task's default number of demos (at least 1)."""
    if value.endswith("x"):
        return max(1, round(float(value[:-1]) * task_default))
    return int(value)


def one_thread() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def collect(task: str, demos: int, quality: float, seed: int, workdir: Path) -> Path:
    """The task's demo dataset with `demos` expert episodes (reused when it exists)."""
    from embodied_rl.commands import collect as collect_command
    from embodied_rl.config import compose

    run_dir = workdir / f"demos_{task}_q{quality:g}_n{demos}_s{seed}"
    data = run_dir / "demos.zarr"
    if not data.exists():
        cfg = compose("collect", [f"task={task}", f"demos={demos}", f"quality={quality}", f"seed={seed}",
                                  f"run_dir={run_dir}"])
        collect_command.main(cfg)
    return data


def evaluate_at_steps(checkpoint: Path, task: str, steps_list: list[int], episodes: int, seed: int) -> dict:
    from embodied_rl import envs
    from embodied_rl.eval.evaluate import evaluate
    from embodied_rl.policies import PolicyRunner, load_policy

    policy = load_policy(checkpoint)
    env = envs.make(task, num_envs=min(25, episodes), seed=seed)
    results = {}
    try:
        for steps in steps_list:
            policy.set_num_inference_steps(steps)
            overall = evaluate(env, PolicyRunner(policy, env.num_envs, seed=seed), episodes, seed=seed,
                               progress=False)["overall"]
            results[str(steps)] = {key: overall.get(key) for key in
                                   ("n_episodes", "success_rate", "success_ci95", "avg_sum_reward",
                                    "sum_reward_ci95", "avg_episode_length", "eval_s")}
    finally:
        env.close()
    return results


def run_cell(cell: dict) -> dict:
    """Pretrain one (task, policy, demos) cell and evaluate it; cached in <cell dir>/result.json."""
    one_thread()
    cell_dir = Path(cell["dir"])
    result_file = cell_dir / "result.json"
    if result_file.exists() and not cell["fresh"]:
        return json.loads(result_file.read_text())
    from embodied_rl.commands import pretrain
    from embodied_rl.config import compose
    from embodied_rl.runs import atomic_write_text

    run_dir = cell_dir / "pretrain"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    overrides = [f"task={cell['task']}", f"policy={cell['policy']}", f"data={cell['data']}",
                 f"max_demos={cell['demos']}", f"steps={cell['steps']}", "eval_episodes=0", "videos=0",
                 f"seed={cell['seed']}", f"run_dir={run_dir}"]
    started = time.perf_counter()
    headline, _ = pretrain.main(compose("pretrain", overrides))
    wall_s = time.perf_counter() - started
    evals = evaluate_at_steps(run_dir / "checkpoints" / "last", cell["task"], SUCCESS_STEPS[cell["policy"]],
                              cell["episodes"], cell["seed"])
    result = {key: cell[key] for key in ("task", "policy", "demos", "quality", "steps", "seed")}
    result.update(train_s=headline["train_s"], pretrain_wall_s=wall_s, final_loss=headline["final_loss"],
                  evals=evals, finished=time.strftime("%Y-%m-%d %H:%M:%S"))
    atomic_write_text(result_file, json.dumps(result, indent=2) + "\n")
    return result


def time_chunks(task: str, policies: list[str], repeats: int) -> dict:
    """Best-of-`repeats` ms per predict_chunk at batch 1 and 64 for each (policy, K). The cases are
    timed round-robin, so load from other processes hits them alike; the minimum is the least
    disturbed sample."""
    one_thread()
    import torch

    from embodied_rl.config import compose
    from embodied_rl.envs import make_task
    from embodied_rl.policies import make_policy

    spec = make_task(task)
    cases = {}
    for policy_type in sorted(set(policies) | {BASELINE[0]}):
        p = compose("pretrain", [f"policy={policy_type}"]).policy
        for steps in TIMING_STEPS[policy_type]:
            torch.manual_seed(0)
            policy = make_policy(policy_type, obs_dim=spec.obs_dim, action_dim=spec.action_dim,
                                 n_obs_steps=p.n_obs_steps, horizon=p.horizon, n_action_steps=p.n_action_steps,
                                 num_inference_steps=steps, backbone=p.backbone,
                                 backbone_kwargs=dict(p[p.backbone]), task=task).eval()
            for batch in (1, 64):
                cases[(f"{policy_type}/{steps}", batch)] = (policy, torch.randn(batch, p.n_obs_steps, spec.obs_dim))
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in cases}
    with torch.no_grad():
        for round_index in range(repeats + 2):  # the first two rounds warm up
            for key, (policy, obs) in cases.items():
                start = time.perf_counter()
                policy.predict_chunk(obs)
                if round_index >= 2:
                    samples[key].append(time.perf_counter() - start)
    timings: dict[str, dict[str, float]] = {}
    for (name, batch), times in samples.items():
        timings.setdefault(name, {})[f"b{batch}_ms"] = 1000 * min(times)
    base = timings[f"{BASELINE[0]}/{BASELINE[1]}"]
    for row in timings.values():
        for batch in (1, 64):
            row[f"b{batch}_ratio"] = row[f"b{batch}_ms"] / base[f"b{batch}_ms"]
    return timings


def pct(entry: dict) -> str:
    if entry.get("success_rate") is None:
        interval = entry.get("sum_reward_ci95")
        bounds = f" [{interval[0]:.0f}-{interval[1]:.0f}]" if interval else ""
        return f"R={entry['avg_sum_reward']:.0f}{bounds}"
    low, high = entry["success_ci95"]
    return f"{100 * entry['success_rate']:.0f}% [{100 * low:.0f}-{100 * high:.0f}]"


def print_tables(results: list[dict], timings: dict, timing_task: str) -> None:
    print("\nBC success (Wilson 95% CI; R = average return and its 95% CI for tasks without success) at "
          "each number of denoising steps K; * = the policy's default K")
    header = f"{'task':<11}{'policy':<10}{'demos':>6}{'q':>5}{'steps':>7}{'train s':>9}  success at K"
    print(header)
    print("-" * 100)
    from embodied_rl.config import compose

    default_k = {p: compose("pretrain", [f"policy={p}"]).policy.num_inference_steps for p in SUCCESS_STEPS}
    for r in results:
        cells = []
        for steps, entry in r["evals"].items():
            mark = "*" if int(steps) == default_k[r["policy"]] else ""
            cells.append(f"K={steps}{mark}: {pct(entry)}")
        episodes = next(iter(r["evals"].values()))["n_episodes"]
        print(f"{r['task']:<11}{r['policy']:<10}{r['demos']:>6}{r['quality']:>5g}{r['steps']:>7}"
              f"{r['train_s']:>9.0f}  " + "  ".join(cells) + f"  (n={episodes})")
    if timings:
        print(f"\nInference time per chunk (best of --timing-repeats, ms; {timing_task} dims, 1 thread), ratio to "
              f"{BASELINE[0]} K={BASELINE[1]}")
        print(f"{'policy':<10}{'K':>4}{'batch 1 ms':>12}{'ratio':>8}{'batch 64 ms':>13}{'ratio':>8}")
        for key, row in timings.items():
            policy_type, steps = key.split("/")
            print(f"{policy_type:<10}{steps:>4}{row['b1_ms']:>12.2f}{row['b1_ratio']:>8.2f}"
                  f"{row['b64_ms']:>13.2f}{row['b64_ratio']:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["push_t", "lift", "peg_insert"])
    parser.add_argument("--policies", nargs="+", default=["diffusion", "flow", "shortcut"],
                        choices=list(SUCCESS_STEPS))
    parser.add_argument("--demos", nargs="+", default=None,
                        help="demo counts (25) or multiples of each task's `demos` (0.5x); default: 1x")
    parser.add_argument("--quality", type=float, default=None, help="default: each task's `quality`")
    parser.add_argument("--steps", type=int, default=None, help="default: each task's `pretrain_steps`")
    parser.add_argument("--episodes", type=int, default=50, help="evaluation episodes per (cell, K)")
    parser.add_argument("--jobs", type=int, default=2, help="cells trained in parallel (1 thread each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-repeats", type=int, default=30, help="0 = no inference timing")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench/bc_table"))
    parser.add_argument("--fresh", action="store_true", help="retrain cells that have a stored result")
    parser.add_argument("--quick", action="store_true", help="push_t, flow, 500 steps, 20 episodes")
    parser.add_argument("--no-train", action="store_true",
                        help="only print the stored results; cells without one are listed as not run")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.policies, args.steps, args.episodes = ["push_t"], ["flow"], 500, 20
        args.workdir = args.workdir.with_name(args.workdir.name + "_quick")
    one_thread()
    load = os.getloadavg()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average at start "
          f"{load[0]:.2f} (1 min) {load[1]:.2f} (5 min); {args.jobs} job(s) of 1 thread", flush=True)

    cells = []
    for task in args.tasks:
        defaults = task_defaults(task)
        if not defaults.get("expert", True):
            print(f"skip {task}: no scripted expert, so no BC demos")
            continue
        demos_list = [demo_count(value, int(defaults["demos"])) for value in args.demos or ["1x"]]
        quality = args.quality if args.quality is not None else float(defaults["quality"])
        steps = args.steps or int(defaults["pretrain_steps"])
        data = "" if args.no_train else collect(task, max(demos_list), quality, args.seed, args.workdir)
        for policy_type in args.policies:
            for demos in demos_list:
                name = f"{task}_{policy_type}_n{demos}_q{quality:g}_st{steps}_s{args.seed}"
                cells.append(dict(task=task, policy=policy_type, demos=demos, quality=quality, steps=steps,
                                  seed=args.seed, data=str(data), episodes=args.episodes,
                                  dir=str(args.workdir / name), fresh=args.fresh))

    missing = [cell for cell in cells if not (Path(cell["dir"]) / "result.json").exists() or cell["fresh"]]
    if args.no_train:
        cells = [cell for cell in cells if cell not in missing]
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")  # fresh interpreters: one torch thread each
    with context.Pool(max(1, min(args.jobs, len(cells) or 1))) as pool:
        results = []
        for result in pool.imap(run_cell, cells):
            print(f"done {result['task']} {result['policy']} demos={result['demos']}: train {result['train_s']:.0f} s, "
                  + ", ".join(f"K={k} {pct(v)}" for k, v in result["evals"].items()), flush=True)
            results.append(result)
    timings = time_chunks(args.tasks[0], args.policies, args.timing_repeats) if args.timing_repeats else {}
    print_tables(results, timings, args.tasks[0])
    if args.no_train and missing:
        print("\nnot run: " + ", ".join(f"{c['task']}/{c['policy']}/demos={c['demos']}" for c in missing))
    load = os.getloadavg()
    print(f"\nwall time {time.perf_counter() - started:.0f} s; load average at end {load[0]:.2f} (1 min)")
    headline = {
        "success": {f"{r['task']}/{r['policy']}/n{r['demos']}/K{k}": round(v["success_rate"], 3)
                    for r in results for k, v in r["evals"].items() if v.get("success_rate") is not None},
        "return": {f"{r['task']}/{r['policy']}/n{r['demos']}/K{k}": round(v["avg_sum_reward"], 1)
                   for r in results for k, v in r["evals"].items() if v.get("success_rate") is None},
        "episodes": args.episodes,
        "train_s": {f"{r['task']}/{r['policy']}/n{r['demos']}": round(r["train_s"], 1) for r in results},
        "chunk_ms_b1": {k: round(v["b1_ms"], 3) for k, v in timings.items()},
        "ratio_to_flow_k10_b1": {k: round(v["b1_ratio"], 3) for k, v in timings.items()},
    }
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
