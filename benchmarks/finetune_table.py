"""Fine-tuning benchmark (on- and off-policy).

    python benchmarks/finetune_table.py timing       # ReinFlow K=1/K=4 vs DPPO K=10 per iteration
    python benchmarks/finetune_table.py table --tasks push_t lift peg_insert \
        --algos dppo residual_ppo residual_offpolicy sac_scratch --seeds 0 1 2 --env-steps 500000

`timing` runs the same number of envs and chunks per iteration for each actor on push_t with a
freshly initialised policy of the default size (speed does not depend on the weights) and
reports the rollout+update wall time per iteration and the ratio to DPPO K=10, measured in the
same run. `table` fine-tunes each task's BC checkpoint per (algo, seed) in --out (finished runs
are reused, so an interrupted table resumes) and reports BC and fine-tuned success (mean over
seeds with a t-interval), per-seed values, env steps and wall time per run, the env steps
and wall time to first reach --target, and the deepest dip of a periodic evaluation below the
curve's start (the BC policy on the same episodes); `sac_scratch` rows are Stable-Baselines3 SAC
from scratch. `--figures DIR` draws each task's curves (every algo and seed) over BC's interval.
The last line printed is one JSON object with the headline numbers.

    python benchmarks/finetune_table.py curves --runs "ramp=RUN_A,RUN_B" "no ramp=RUN_C" \
        --title peg_insert --out curves.png

`curves` does the same for finetune run directories made elsewhere (`embodied-rl finetune ...
eval_every=N`): per run its start, lowest point, dip and first step at --target, and the figure;
`--by-instruction` per instruction of multi-task runs (a VLA on Meta-World MT10: each task's
periodic success, logged as eval/success_rate/<instruction>), a panel per instruction.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch


def time_iteration(policy_type: str, steps: int, algo: str, num_envs: int, chunks: int, repeats: int) -> float:

    from embodied_rl import envs
    from embodied_rl.algos.ppo import finetune
    from embodied_rl.config import compose
    from embodied_rl.policies import make_policy
    from embodied_rl.runs import Run

    env = envs.make("push_t", num_envs=num_envs, seed=0)
    torch.manual_seed(0)
    policy = make_policy(policy_type, obs_dim=env.task.obs_dim, action_dim=env.action_dim, num_inference_steps=steps,
                         backbone_kwargs=dict(hidden_dim=256, num_blocks=3, time_dim=64), task="push_t")
    steps_per_iter = num_envs * chunks * policy.n_action_steps
    overrides = ["task=push_t", f"algo={algo}", "checkpoint=unused", f"num_envs={num_envs}", "eval_every=0",
                 f"env_steps={steps_per_iter * (repeats + 1)}", f"algo.num_steps={chunks}", "checkpoint_every=0", "log_every=1",
                 "algo.critic_warmup_iters=0", "algo.target_kl=null",
                 # no evaluation: judged deployment would evaluate at the start and the end (minutes, untimed)
                 "algo.deploy=latest", "videos=0"]
    if algo == "dppo":
        overrides.append("algo.actor_kwargs.ft_denoising_steps=0")
    cfg = compose("finetune", overrides)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run = Run(Path(tmp) / "run")
        finetune(cfg, run, env, policy)
        rows = [r for r in run.read_metrics() if "train/iteration_s" in r]
    env.close()
    # the first iteration pays for lazy imports and allocator warm-up: it is run but not timed
    times = [r["train/iteration_s"] for r in rows[1:]]
    return sum(times) / len(times)


def timing(args) -> dict:
    """Rollout + update wall time per iteration: DPPO at K=10 against ReinFlow at K=1-4, in one
    process, one after the other. The networks are the same size, so a denoising step costs about
    the same in both; the speed-up is bounded by 10 / K (less the env's and the critic's share)."""
    if args.repeats < 1:
        refuse(f"--repeats {args.repeats}: at least one timed iteration is needed")
    torch.set_num_threads(1)
    cases = [("DPPO K=10 (diffusion)", "diffusion", 10, "dppo")]
    cases += [(f"ReinFlow K={k} (flow)", "flow", k, "reinflow") for k in (1, 2, 3, 4)]
    results = {}
    for label, policy_type, steps, algo in cases:
        results[label] = time_iteration(policy_type, steps, algo, args.num_envs, args.chunks, args.repeats)
    base = results["DPPO K=10 (diffusion)"]
    print(f"{'actor':<24} {'s / iteration':>14} {'speed-up vs DPPO K=10':>22}")
    for label, seconds in results.items():
        print(f"{label:<24} {seconds:>14.3f} {base / seconds:>21.2f}x")
    return {"iteration_s": results,
            **{f"speedup_reinflow_k{k}": base / results[f"ReinFlow K={k} (flow)"] for k in (1, 2, 3, 4)},
            "num_envs": args.num_envs, "chunks_per_iteration": args.chunks}


def _cli(args: list[str]) -> None:
    from embodied_rl.cli import main as cli

    if cli(args) != 0:
        raise SystemExit(f"failed: embodied-rl {' '.join(args)}")


def _overall(run_dir: Path) -> dict:
    return json.loads((run_dir / "eval_info.json").read_text())["overall"]


def evaluate_once(run_dir: Path, eval_args: list[str]) -> dict:
    """`embodied-rl eval ... run_dir=RUN_DIR` unless it finished before (its eval_info.json is
    there): the overall result. An evaluation interrupted before it finished left a run_dir that
    `eval` would refuse; it holds nothing a finished one needs, so it is removed and redone."""
    if not (run_dir / "eval_info.json").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        _cli(["eval", *eval_args, f"run_dir={run_dir}"])
    return _overall(run_dir)


def _finished(run_dir: Path, env_steps: int) -> bool:
    """A finetune run that reached `env_steps`: each finished run (or resumed part) logs
    train/wall_s at its last step; curve evaluations alone (eval_info.json) do not make it finished."""
    if not (run_dir / "metrics.jsonl").exists():
        return False
    return any("train/wall_s" in r and r["step"] >= env_steps for r in _metrics(run_dir))


def _metrics(run_dir: Path) -> list[dict]:
    from embodied_rl.runs import read_metrics

    return read_metrics(run_dir)


def refuse(message: str) -> None:
    """Bad input: one line, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def curve(metrics: list[dict]) -> list[tuple[int, float]]:
    """A finetune run's periodic evaluations (its metrics.jsonl rows): (env step, success rate),
    the first at step 0."""
    return sorted((r["step"], r["eval/success_rate"]) for r in metrics if "eval/success_rate" in r)


def instruction_curves(metrics: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """A multi-task run's periodic evaluations per instruction (its `eval/success_rate/<instruction>`
    rows): {instruction: [(env step, success rate), ...]}."""
    prefix = "eval/success_rate/"
    by_text: dict[str, list[tuple[int, float]]] = {}
    for row in metrics:
        for key, value in row.items():
            if key.startswith(prefix):
                by_text.setdefault(key[len(prefix):], []).append((row["step"], value))
    return {text: sorted(points) for text, points in by_text.items()}


DIP_TOLERANCE = 0.05  # do no harm: no periodic evaluation more than 5 points below the start


def dip(points: list[tuple[int, float]]) -> float:
    """How far the lowest later evaluation falls below the first (the base policy on the same
    episodes); 0 when none falls below it."""
    return max([0.0] + [points[0][1] - rate for _, rate in points[1:]])


def curve_figure(series: dict[str, list[list[tuple[int, float]]]], bc: tuple[float, float, float] | None,
                 title: str, path: Path) -> Path:
    """One line per run, a colour per label, and BC's success with its interval as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4), dpi=100)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (label, runs) in enumerate(series.items()):
        for number, points in enumerate(runs):
            steps, rates = zip(*points)
            axes.plot(steps, rates, color=colours[index % len(colours)], marker="o", markersize=2, linewidth=1,
                      label=label if number == 0 else None)
    if bc is not None:
        axes.axhspan(bc[1], bc[2], color="grey", alpha=0.2, label=f"BC {bc[0]:.2f} [{bc[1]:.2f}, {bc[2]:.2f}]")
    axes.set(xlabel="env steps", ylabel="success rate", ylim=(-0.02, 1.02), title=title)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def run_entries(args):
    """(entry, label, run_dir, metrics rows) for each run of `--runs LABEL=RUN_DIR[,RUN_DIR...]`."""
    for entry in args.runs:
        label, _, dirs = entry.partition("=")
        if not dirs:
            refuse(f"--runs {entry}: expected LABEL=RUN_DIR[,RUN_DIR...]")
        for run_dir in dirs.split(","):
            metrics = _metrics(Path(run_dir)) if (Path(run_dir) / "metrics.jsonl").exists() else []
            yield entry, label, run_dir, metrics


def curve_row(label: str, points: list[tuple[int, float]], target: float) -> dict:
    """One curve's start, lowest point, dip, first step at `target` and last point."""
    reached = next((step for step, rate in points if rate >= target), None)
    return {"label": label, "start": points[0][1], "lowest": min(rate for _, rate in points), "dip": dip(points),
            "steps_to_target": reached, "last": points[-1][1]}


def panel_figure(panels: dict[str, dict[str, list[list[tuple[int, float]]]]], title: str, path: Path) -> Path:
    """A panel per key (an instruction of a multi-task run, a task): each run's curve there (a
    colour per label) and its runs' mean start (the base policy) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    columns = min(5, len(panels))
    rows = -(-len(panels) // columns)
    figure, grid = plt.subplots(rows, columns, figsize=(2.6 * columns, 2.2 * rows), dpi=100, squeeze=False,
                                sharex=True, sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axes, (text, series) in zip(grid.flat, panels.items()):
        starts = []
        for index, (label, runs) in enumerate(series.items()):
            for number, points in enumerate(runs):
                steps, rates = zip(*points)
                starts.append(rates[0])
                axes.plot(steps, rates, color=colours[index % len(colours)], marker="o", markersize=1.5,
                          linewidth=0.8, label=label if number == 0 else None)
        start = sum(starts) / len(starts)
        axes.axhline(start, color="grey", linestyle="--", linewidth=0.8)
        # the do-no-harm tolerance: an evaluation below this band fell more than 5 points below the start
        axes.axhspan(start - DIP_TOLERANCE, start, color="grey", alpha=0.15, linewidth=0)
        axes.set_title(text if len(text) <= 32 else text[:30] + "..", fontsize=7)
        axes.set_ylim(-0.02, 1.02)
        axes.grid(alpha=0.3)
        axes.tick_params(labelsize=6)
        axes.xaxis.set_major_locator(MaxNLocator(4))
        axes.xaxis.set_major_formatter(FuncFormatter(lambda step, _: f"{step / 1000:g}k"))  # env steps
    for axes in list(grid.flat)[len(panels):]:
        axes.axis("off")
    grid.flat[0].legend(fontsize=6)
    # two lines: a figure of one or two panels is narrower than the whole title
    figure.suptitle(f"{title}\n(dashed: the base policy; shaded: {DIP_TOLERANCE * 100:.0f} points below it)", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def curves_by_instruction(args) -> dict:
    """`curves --by-instruction`: the same per instruction of multi-task runs (a panel each)."""
    panels: dict[str, dict[str, list]] = {}
    rows = {}
    for entry, label, run_dir, metrics in run_entries(args):
        by_text = instruction_curves(metrics)
        if not by_text:
            refuse(f"--runs {entry}: {run_dir} holds no per-instruction periodic evaluations "
                   "(eval/success_rate/<instruction> in metrics.jsonl: a multi-task run's)")
        for text, points in by_text.items():
            panels.setdefault(text, {}).setdefault(label, []).append(points)
            rows[f"{run_dir} | {text}"] = {**curve_row(label, points, args.target), "instruction": text}
    print(f"{'instruction':<40} {'label':<16} {'dip per run':>24}")
    for text in panels:
        for label in panels[text]:
            dips = " ".join(f"{row['dip']:.2f}" for row in rows.values()
                            if row["instruction"] == text and row["label"] == label)
            print(f"{text[:40]:<40} {label[:16]:<16} {dips:>24}")
    print(panel_figure(panels, args.title, Path(args.out)))
    return rows


def curves(args) -> dict:
    """Start, lowest point, dip and first step at --target of each given run, and their figure."""
    if args.by_instruction:
        return curves_by_instruction(args)
    series, rows, starts = {}, {}, []
    for entry, label, run_dir, metrics in run_entries(args):
        points = curve(metrics)
        if not points:
            refuse(f"--runs {entry}: {run_dir} holds no periodic evaluations (metrics.jsonl)")
        series.setdefault(label, []).append(points)
        starts.append(next(r for r in metrics if r.get("step") == points[0][0] and "eval/success_rate" in r))
        rows[run_dir] = {**curve_row(label, points, args.target), "env_steps": points[-1][0]}
    print(f"{'run':<48} {'label':<16} {'start':>6} {'lowest':>6} {'dip':>5} {'last':>5} {'to ' + format(args.target, '.0%'):>8}")
    for run_dir, row in rows.items():
        reached = "-" if row["steps_to_target"] is None else str(row["steps_to_target"])
        print(f"{run_dir[-48:]:<48} {row['label'][:16]:<16} {row['start']:>6.2f} {row['lowest']:>6.2f}"
              f" {row['dip']:>5.2f} {row['last']:>5.2f} {reached:>8}")
    # BC's band: the first evaluations (the base policy) of every run, their intervals' hull
    bc = (sum(r["eval/success_rate"] for r in starts) / len(starts),
          min(r.get("eval/success_rate_low", r["eval/success_rate"]) for r in starts),
          max(r.get("eval/success_rate_high", r["eval/success_rate"]) for r in starts))
    print(curve_figure(series, bc, args.title, Path(args.out)))
    return rows


def bc_checkpoint(task: str, given: dict[str, str], root: Path, collect: list[str] = (),
                  pretrain: list[str] = ()) -> Path:
    """The task's BC checkpoint: given with --checkpoints, else collect + pretrain with the task
    defaults (and the `collect` / `pretrain` overrides)."""
    if task in given:
        return Path(given[task])
    bc_dir = root / f"{task}_bc"
    if not (bc_dir / "pretrain" / "checkpoints" / "last").exists():
        if not (bc_dir / "demos.zarr").exists():
            # a collect stopped before it wrote the demos: its run directory holds nothing to reuse (and
            # `collect` refuses a run_dir that holds files)
            shutil.rmtree(bc_dir / "collect", ignore_errors=True)
            _cli(["collect", f"task={task}", f"out={bc_dir / 'demos.zarr'}", f"run_dir={bc_dir / 'collect'}",
                  *collect])
        _cli(["pretrain", f"task={task}", "policy=flow", f"data={bc_dir / 'demos.zarr'}", "videos=0",
              "eval_episodes=0", f"run_dir={bc_dir / 'pretrain'}", *pretrain])
    return bc_dir / "pretrain" / "checkpoints" / "last"


def overrides_for(algo: str, sets: list[str]) -> list[str]:
    """--set entries: `key=value` applies to every algo, `ALGO:key=value` to that algo only. Any
    other prefix (a task's name, say) is refused: one config serves every task of a run."""
    from embodied_rl.paths import config_dir

    algos = {path.stem for path in (config_dir() / "algo").glob("*.yaml")}
    chosen = []
    for entry in sets:
        prefix, _, rest = entry.partition(":")
        if rest and "=" not in prefix:
            if prefix not in algos:
                raise ValueError(f"--set {entry}: '{prefix}' is not an algorithm (configs/algo/); per-task "
                                 "overrides are not supported, one config serves every task")
            if prefix == algo:
                chosen.append(rest)
        else:
            chosen.append(entry)
    return chosen


def finetune_run(task: str, algo: str, seed: int, checkpoint: Path, run_dir: Path, args) -> dict:
    """`embodied-rl finetune`, then `embodied-rl eval` of its last checkpoint (finished runs are reused;
    an interrupted one resumes from its last checkpoint and is evaluated again)."""
    if not _finished(run_dir / "finetune", args.env_steps):
        if (run_dir / "eval").exists():  # the evaluation of an unfinished run's checkpoint: stale
            shutil.rmtree(run_dir / "eval")
        _cli(["finetune", f"task={task}", f"algo={algo}", f"checkpoint={checkpoint}", f"seed={seed}",
              f"env_steps={args.env_steps}", f"num_envs={args.num_envs}", f"eval_every={args.eval_every}",
              f"eval_episodes={args.curve_episodes}", "videos=0", f"run_dir={run_dir / 'finetune'}",
              *overrides_for(algo, args.set)])
    task_sets = [entry for entry in overrides_for(algo, args.set) if entry.startswith("task.")]  # hold here too
    evaluate_once(run_dir / "eval", [f"task={task}", f"checkpoint={run_dir / 'finetune' / 'checkpoints' / 'last'}",
                                     f"episodes={args.eval_episodes}", "videos=0", f"seed={args.eval_seed}", *task_sets])
    metrics = _metrics(run_dir / "finetune")
    evals = [r for r in metrics if "eval/success_rate" in r]
    reached = next((r for r in evals if r["eval/success_rate"] >= args.target), None)
    points = curve(metrics)
    return {"success": _overall(run_dir / "eval")["success_rate"], "curve": points, "dip": dip(points),
            "env_steps": max(r["step"] for r in metrics),
            "wall_s": [r["train/wall_s"] for r in metrics if "train/wall_s" in r][-1],  # over every resumed part
            "steps_to_target": None if reached is None else reached["step"],
            "wall_to_target": None if reached is None else reached.get("eval/train_wall_s")}


def sac_scratch_run(task: str, seed: int, run_dir: Path, args) -> dict:
    """Stable-Baselines3 SAC from scratch (no base policy, SB3 defaults, the task's dense reward) on
    the task's gymnasium registration, at the same env steps; evaluated like the others."""
    import gymnasium
    from stable_baselines3 import SAC
    from stable_baselines3.common.env_util import make_vec_env

    from embodied_rl import envs
    from embodied_rl.envs.registry import gym_id
    from embodied_rl.eval import evaluate

    result_file = run_dir / "result.json"
    if result_file.exists():
        return json.loads(result_file.read_text())

    class Agent:
        def reset(self, mask) -> None:
            pass

        def act(self, obs):
            action, _ = model.predict(obs.cpu().numpy(), deterministic=True)
            return torch.as_tensor(action, dtype=torch.float32)

    start = time.perf_counter()
    vec_env = make_vec_env(lambda: gymnasium.make(gym_id(task)), n_envs=args.num_envs, seed=seed)
    model = SAC("MlpPolicy", vec_env, gradient_steps=max(1, args.num_envs // 2), learning_starts=1000, seed=seed)
    model.learn(total_timesteps=args.env_steps)
    wall = time.perf_counter() - start
    eval_env = envs.make(task, num_envs=min(args.eval_episodes, 50), seed=args.eval_seed)
    info = evaluate(eval_env, Agent(), episodes=args.eval_episodes, seed=args.eval_seed, progress=False)
    eval_env.close()
    result = {"success": info["overall"]["success_rate"], "env_steps": int(model.num_timesteps), "wall_s": wall,
              "steps_to_target": None, "wall_to_target": None, "curve": [], "dip": None}
    run_dir.mkdir(parents=True, exist_ok=True)
    result_file.write_text(json.dumps(result))
    return result


def table(args) -> dict:
    """BC -> fine-tuned success per (task, algo), mean over seeds with a t-interval.

    Per task: one BC checkpoint (--checkpoints, or collect + pretrain flow with the task's
    defaults), evaluated once on --eval-episodes episodes (Wilson interval). Per (algo, seed):
    `embodied-rl finetune` from it with evaluations every --eval-every env steps (the curve that
    gives the env steps and training wall time to the first evaluation at >= --target), then
    `embodied-rl eval` of the last checkpoint on the same episodes as the BC evaluation. Algo
    `sac_scratch` is Stable-Baselines3 SAC without a base policy, the off-policy baseline.
    """
    from embodied_rl.eval.stats import mean_interval

    root = Path(args.out)
    given = dict(entry.split("=", 1) for entry in args.checkpoints)
    rows = {}
    figures = {}
    for task in args.tasks:
        checkpoint = bc_checkpoint(task, given, root)
        bc = evaluate_once(root / f"{task}_bc_eval", [f"task={task}", f"checkpoint={checkpoint}",
                                                       f"episodes={args.eval_episodes}", "videos=0",
                                                       f"seed={args.eval_seed}"])
        series = {}
        for algo in args.algos:
            runs = []
            for seed in args.seeds:
                run_dir = root / f"{task}_{algo}_{seed}"
                runs.append(sac_scratch_run(task, seed, run_dir, args) if algo == "sac_scratch"
                            else finetune_run(task, algo, seed, checkpoint, run_dir, args))
            reached = [r for r in runs if r["steps_to_target"] is not None]
            dips = [r["dip"] for r in runs if r.get("dip") is not None]
            series[algo] = [r["curve"] for r in runs if r.get("curve")]
            rows[f"{task}/{algo}"] = {
                "bc": {"mean": bc["success_rate"], "ci_low": bc["success_ci95"][0], "ci_high": bc["success_ci95"][1]},
                "finetuned": mean_interval([r["success"] for r in runs]),
                "finetuned_per_seed": [r["success"] for r in runs], "seeds": list(args.seeds),
                "env_steps": max(r["env_steps"] for r in runs),
                "wall_s": sum(r["wall_s"] for r in runs) / len(runs),
                "reached_target": f"{len(reached)}/{len(runs)}",
                "steps_to_target": (sum(r["steps_to_target"] for r in reached) / len(reached)) if reached else None,
                "wall_to_target": (sum(r["wall_to_target"] or 0.0 for r in reached) / len(reached)) if reached else None,
                "dip": max(dips) if dips else None,
            }
        if args.figures and any(series.values()):
            figures[task] = str(curve_figure({a: c for a, c in series.items() if c},
                                             (bc["success_rate"], *bc["success_ci95"]),
                                             f"{task}: {args.curve_episodes} episodes every {args.eval_every} env steps",
                                             Path(args.figures) / f"{task}.png"))

    def fmt(s: dict) -> str:
        ci = "" if s["ci_low"] is None else f" [{s['ci_low']:.2f},{s['ci_high']:.2f}]"
        return f"{s['mean']:.2f}{ci}"

    print(f"\n{args.eval_episodes} evaluation episodes per number; BC: Wilson 95% interval; fine-tuned: mean over "
          f"seeds with a t 95% interval. 'to {args.target:.0%}': seeds whose periodic evaluation "
          f"({args.curve_episodes} episodes every {args.eval_every} env steps) reached it, and their mean env "
          f"steps and training wall time to get there. wall s: training wall time per run. dip: the deepest fall of a "
          f"periodic evaluation below the curve's first (BC on the same episodes), over seeds.")
    print(f"{'task/algo':<26} {'BC success':>18} {'fine-tuned success':>20} {'per seed':>16} {'env steps':>10}"
          f" {'wall s':>7} {'to target':>9} {'steps':>9} {'wall s':>7} {'dip':>5}")
    for key, row in rows.items():
        seeds = " ".join(f"{v:.2f}" for v in row["finetuned_per_seed"])
        steps = "-" if row["steps_to_target"] is None else f"{row['steps_to_target']:.0f}"
        wall = "-" if row["wall_to_target"] is None else f"{row['wall_to_target']:.0f}"
        worst = "-" if row["dip"] is None else f"{row['dip']:.2f}"
        print(f"{key:<26} {fmt(row['bc']):>18} {fmt(row['finetuned']):>20} {seeds:>16} {row['env_steps']:>10}"
              f" {row['wall_s']:>7.0f} {row['reached_target']:>9} {steps:>9} {wall:>7} {worst:>5}")
    for path in figures.values():
        print(path)
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("timing")
    t.add_argument("--num-envs", type=int, default=16)
    t.add_argument("--chunks", type=int, default=8)
    t.add_argument("--repeats", type=int, default=3, help="timed iterations per actor, after one untimed warm-up")
    b = sub.add_parser("table")
    b.add_argument("--tasks", nargs="+", default=["push_t", "lift", "peg_insert"])
    b.add_argument("--algos", nargs="+", default=["dppo", "residual_ppo"],
                   help="finetune algos (on- or off-policy) and/or sac_scratch")
    b.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    b.add_argument("--env-steps", type=int, default=500000)
    b.add_argument("--checkpoints", nargs="*", default=[],
                   help="TASK=DIR BC checkpoints; a task without one gets collect + pretrain (flow) with its defaults")
    b.add_argument("--num-envs", type=int, default=64)
    b.add_argument("--eval-every", type=int, default=100000, help="env steps between curve evaluations; 0 = end only")
    b.add_argument("--curve-episodes", type=int, default=50, help="episodes per curve evaluation")
    b.add_argument("--eval-episodes", type=int, default=100, help="episodes of the BC and final evaluations")
    b.add_argument("--eval-seed", type=int, default=1000)
    b.add_argument("--target", type=float, default=0.9, help="success rate whose first crossing is timed")
    b.add_argument("--out", default="runs/bench", help="run directories; finished runs are reused")
    b.add_argument("--set", nargs="*", default=[],
                   help="finetune overrides: key=value for every algo, ALGO:key=value for one (dppo:algo.lr=3e-4)")
    b.add_argument("--figures", default=None, help="directory for one curve figure per task (TASK.png)")
    c = sub.add_parser("curves")
    c.add_argument("--runs", nargs="+", required=True, help="LABEL=RUN_DIR[,RUN_DIR...]: finetune run directories")
    c.add_argument("--target", type=float, default=0.9)
    c.add_argument("--title", default="")
    c.add_argument("--out", required=True, help="the figure (PNG)")
    c.add_argument("--by-instruction", action="store_true",
                   help="multi-task runs: each instruction's curve and dip, a panel per instruction")
    args = parser.parse_args()
    try:
        for algo in getattr(args, "algos", []):
            overrides_for(algo, args.set)
    except ValueError as error:
        b.error(str(error))
    return args


if __name__ == "__main__":
    arguments = parse_args()
    result = {"timing": timing, "table": table, "curves": curves}[arguments.mode](arguments)
    print(json.dumps(result))
