"""What DSRL's action space can express: the success a frozen BC policy reaches when its latent
noise is chosen well, per task (instruction), as best-of-n over the noise box.

DSRL (SAC over the latent noise) can only steer the frozen policy to the chunks that noise in
[-noise_bound, noise_bound]^(H x A) maps to. This script runs the same evaluation episodes n
times, each time with the policy's noise drawn from N(0, I) clipped to the box with another
sampling stream (draw j), and counts an episode as solved if any draw solved it. A noise choice
that adapts to the state can do better than any of n open-loop draws, so best-of-n is a lower
bound on the expressible success; with n = 8 it already separates "the noise cannot fix this
task" (best-of-n at the BC rate) from "a good noise policy exists".

    OMP_NUM_THREADS=1 python benchmarks/dsrl_ceiling.py --checkpoint runs/vla_mt50/pretrain/checkpoints/last \
        --task metaworld/MT50 --max-episode-steps 100 --episodes 500 --num-envs 100 --draws 8

Printed: per instruction, the BC rate with zero noise (DSRL's actor at its initialisation) and with
sampled noise (mean over draws), and best-of-n; then the averages. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch

from embodied_rl.policies.runner import PolicyRunner, executed_actions, map_obs


class NoiseDrawRunner(PolicyRunner):
    """The BC policy as an evaluation agent whose latent noise per chunk comes from its own stream
    (`draw`): N(0, I) clipped to [-bound, bound], or all zeros with draw=None. evaluate() reseeds
    the runner's `generator` each round (unused here), so the draws differ while the env episodes
    stay the same."""

    def __init__(self, policy, num_envs: int, draw: int | None, bound: float):
        super().__init__(policy, num_envs, seed=0)
        self.bound = bound
        self.draws = None if draw is None else torch.Generator().manual_seed(1000 + draw)

    def plan(self, history, envs):
        subset = map_obs(lambda h: h[envs.to(h.device)], history)
        shape = (len(envs), *self.policy.noise_shape)
        noise = (torch.zeros(shape) if self.draws is None
                 else torch.randn(shape, generator=self.draws).clamp(-self.bound, self.bound))
        chunk = self.policy.predict_chunk(subset, noise=noise.to(self.policy.device))
        return executed_actions(self.policy, chunk).float()


def run(args) -> dict:
    from embodied_rl import envs
    from embodied_rl.eval.evaluate import evaluate
    from embodied_rl.policies import load_policy

    torch.set_num_threads(1)
    policy = load_policy(args.checkpoint).eval()
    task_options = {"max_episode_steps": args.max_episode_steps} if args.max_episode_steps else None
    env = envs.make(args.task, num_envs=args.num_envs, seed=0, task_options=task_options, **policy.env_options())
    outcomes: dict[str, list[list[bool]]] = {}  # label -> per draw, per episode
    texts: list[str] = []
    try:
        for label, draw in [("zero", None)] + [(f"draw{j}", j) for j in range(args.draws)]:
            agent = NoiseDrawRunner(policy, env.num_envs, draw, args.noise_bound)
            with torch.inference_mode():
                info = evaluate(env, agent, episodes=args.episodes, seed=args.eval_seed, progress=False)
            records = info["per_episode"]
            texts = [r.get("instruction", "") for r in records]
            outcomes[label] = [bool(r["success"]) for r in records]
            print(f"{label}: {sum(outcomes[label]) / len(records):.3f}", flush=True)
    finally:
        env.close()

    draws = [outcomes[f"draw{j}"] for j in range(args.draws)]
    best = [any(column) for column in zip(*draws)]
    sampled = [sum(column) / args.draws for column in zip(*draws)]

    def by_text(values: list[float]) -> dict[str, float]:
        groups: dict[str, list[float]] = {}
        for text, value in zip(texts, values):
            groups.setdefault(text, []).append(float(value))
        return {text: sum(v) / len(v) for text, v in groups.items()}

    rows = {"zero": by_text(outcomes["zero"]), "sampled": by_text(sampled), "best_of_n": by_text(best)}
    print(f"\n{'instruction':<60} {'zero noise':>10} {'sampled':>8} {f'best of {args.draws}':>10}")
    for text in rows["zero"]:
        print(f"{text[:60]:<60} {rows['zero'][text]:>10.2f} {rows['sampled'][text]:>8.2f} {rows['best_of_n'][text]:>10.2f}")
    averages = {name: sum(row.values()) / len(row) for name, row in rows.items()}
    print(f"{'average over instructions':<60} {averages['zero']:>10.3f} {averages['sampled']:>8.3f} "
          f"{averages['best_of_n']:>10.3f}")
    return {"task": args.task, "episodes": args.episodes, "draws": args.draws, "noise_bound": args.noise_bound,
            "average": averages, "by_instruction": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a BC policy checkpoint directory")
    parser.add_argument("--task", required=True)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--num-envs", type=int, default=100)
    parser.add_argument("--draws", type=int, default=8, help="n of best-of-n")
    parser.add_argument("--noise-bound", type=float, default=1.5, help="DSRL's noise box (configs/algo/dsrl.yaml)")
    parser.add_argument("--eval-seed", type=int, default=1000)
    parser.add_argument("--max-episode-steps", type=int, help="the task's time limit (default: the task's; "
                        "vla_table's MT50 protocol: 100)")
    args = parser.parse_args(argv)
    if args.draws < 1 or args.episodes < 1 or args.num_envs < 1 or args.noise_bound <= 0:
        parser.error("--draws, --episodes and --num-envs must be >= 1 and --noise-bound > 0")
    return args


if __name__ == "__main__":
    print(json.dumps(run(parse_args())))
