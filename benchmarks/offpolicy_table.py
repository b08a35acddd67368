"""Off-policy fine-tuning table: BC success -> fine-tuned success for DSRL / DSRL-NA / residual SAC,
plus Stable-Baselines3 SAC from scratch (no base policy) at the same env steps, in one run.

    PYTHONPATH=. python benchmarks/offpolicy_table.py --task push_t --env-steps 100000 \
        --algos dsrl,residual_sac --num-envs 32 --out runs/bench_offpolicy

Pipeline (all through the CLI, so it measures what users run): collect demos with the scripted
expert -> pretrain a diffusion policy -> finetune each algo (eval at start = BC success, and at
the end) -> SB3 SAC from scratch on the task's gymnasium registration (`embodied_rl/<Task>-v0`,
SubprocVecEnv-free DummyVecEnv), evaluated with the same `evaluate`. Prints a table and, as the
last line, one JSON object. `--checkpoint` skips collect + pretrain.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def cli(args: list[str]) -> None:
    from embodied_rl.cli import main

    code = main(args)
    if code != 0:
        raise SystemExit(f"command failed ({code}): embodied-rl {' '.join(args)}")


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finetune_row(algo: str, checkpoint: Path, out: Path, a: argparse.Namespace) -> dict:
    run_dir = out / f"finetune_{algo}"
    start = time.perf_counter()
    cli(["finetune", f"task={a.task}", f"algo={algo}", f"checkpoint={checkpoint}", f"run_dir={run_dir}",
         f"num_envs={a.num_envs}", f"env_steps={a.env_steps}", f"eval_every={a.eval_every}",
         f"eval_episodes={a.eval_episodes}", "videos=0", f"device={a.device}", f"seed={a.seed}", *a.override])
    wall = time.perf_counter() - start
    evals = [row for row in metrics(run_dir) if "eval/success_rate" in row]
    best_at = next((row["step"] for row in evals if row["eval/success_rate"] >= 0.9), None)
    first, last = evals[0], evals[-1]
    return {"method": algo, "bc_success": first["eval/success_rate"],
            "bc_ci": [first["eval/success_rate_low"], first["eval/success_rate_high"]],
            "success": last["eval/success_rate"], "ci": [last["eval/success_rate_low"], last["eval/success_rate_high"]],
            "env_steps": last["step"], "steps_to_90": best_at, "wall_s": wall}


class SB3Agent:
    def __init__(self, model):
        self.model = model

    def reset(self, mask) -> None:
        pass

    def act(self, obs):
        action, _ = self.model.predict(obs.cpu().numpy(), deterministic=True)
        return torch.as_tensor(action, dtype=torch.float32)


def sac_from_scratch_row(a: argparse.Namespace) -> dict:
    import gymnasium
    from stable_baselines3 import SAC
    from stable_baselines3.common.env_util import make_vec_env

    from embodied_rl import envs
    from embodied_rl.envs.registry import gym_id
    from embodied_rl.eval import evaluate

    start = time.perf_counter()
    vec_env = make_vec_env(lambda: gymnasium.make(gym_id(a.task)), n_envs=a.num_envs, seed=a.seed)
    model = SAC("MlpPolicy", vec_env, gradient_steps=max(1, a.num_envs // 2), learning_starts=1000, seed=a.seed,
                device=a.device, verbose=0)
    model.learn(total_timesteps=a.env_steps)
    wall = time.perf_counter() - start
    eval_env = envs.make(a.task, num_envs=min(a.eval_episodes, a.num_envs), seed=a.seed + 1)
    info = evaluate(eval_env, SB3Agent(model), episodes=a.eval_episodes, seed=a.seed + 12345, progress=False)
    return {"method": "sb3_sac_scratch", "bc_success": None, "bc_ci": None, "success": info["overall"]["success_rate"],
            "ci": list(info["overall"]["success_ci95"]),
            "env_steps": int(model.num_timesteps), "steps_to_90": None, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="push_t")
    parser.add_argument("--algos", default="dsrl,dsrl_na,residual_sac")
    parser.add_argument("--checkpoint", default=None, help="a BC checkpoint (skips collect + pretrain)")
    parser.add_argument("--demos", type=int, default=100)
    parser.add_argument("--pretrain-steps", type=int, default=None)
    parser.add_argument("--env-steps", type=int, default=100_000)
    parser.add_argument("--eval-every", type=int, default=20_000)
    parser.add_argument("--eval-episodes", type=int, default=50)
    parser.add_argument("--num-envs", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-scratch", action="store_true", help="skip SB3 SAC from scratch")
    parser.add_argument("--override", nargs="*", default=[], help="extra finetune overrides (algo.KEY=VALUE)")
    parser.add_argument("--out", default="runs/bench_offpolicy")
    a = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    checkpoint = Path(a.checkpoint) if a.checkpoint else None
    if checkpoint is None:
        cli(["collect", f"task={a.task}", f"demos={a.demos}", f"run_dir={out / 'collect'}", f"out={out / 'demos.zarr'}"])
        steps = [f"steps={a.pretrain_steps}"] if a.pretrain_steps else []
        cli(["pretrain", f"task={a.task}", f"data={out / 'demos.zarr'}", f"run_dir={out / 'pretrain'}",
             "videos=0", f"device={a.device}", *steps])
        checkpoint = out / "pretrain" / "checkpoints" / "last"

    rows = [finetune_row(algo, checkpoint, out, a) for algo in a.algos.split(",") if algo]
    if not a.no_scratch:
        rows.append(sac_from_scratch_row(a))

    print(f"\n{a.task}: off-policy fine-tuning ({a.env_steps} env steps, {a.num_envs} envs, {a.eval_episodes} eval episodes)")
    print(f"{'method':<18}{'BC success [95% CI]':>22}{'fine-tuned [95% CI]':>22}{'env steps':>11}"
          f"{'steps to 90%':>14}{'wall s':>9}")

    def cell(value, ci) -> str:
        return "-" if value is None else f"{value:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"

    for row in rows:
        to90 = "-" if row["steps_to_90"] is None else str(row["steps_to_90"])
        print(f"{row['method']:<18}{cell(row['bc_success'], row['bc_ci']):>22}{cell(row['success'], row['ci']):>22}"
              f"{row['env_steps']:>11}{to90:>14}{row['wall_s']:>9.0f}")
    headline = {"task": a.task, "rows": rows}
    scratch = next((r for r in rows if r["method"] == "sb3_sac_scratch"), None)
    best = max((r for r in rows if r["method"] != "sb3_sac_scratch"), key=lambda r: r["success"], default=None)
    if scratch and best:
        headline["best"] = best["method"]
        headline["success_over_scratch"] = float(best["success"] - scratch["success"])
    print(json.dumps(headline, default=lambda x: float(x) if isinstance(x, np.floating) else str(x)))


if __name__ == "__main__":
    main()
