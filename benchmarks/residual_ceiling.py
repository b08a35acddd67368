"""What a residual head's action space can express: the success of the frozen BC policy when each
action is corrected toward the task's scripted expert by at most the residual's bound, per task
(instruction).

A residual actor (algo=residual_offpolicy, residual PPO) executes a = clip(a_BC + r, -1, 1) with
|r| <= residual_scale per action entry. This script plays the residual an oracle would pick
without learning anything: r = clamp(a_expert - a_BC, -scale, scale), the step toward the expert
the bound allows. Scale 0 is the BC policy itself; scale 2 covers any difference of two actions in
[-1, 1], so it is the expert alone. A learned residual may beat the oracle (the expert is not the
best policy, and the oracle does not plan around its bound), so the column is a reference point,
not a proof; where even the expert fails (Meta-World's 100-step episodes), no residual that copies
it succeeds.

    OMP_NUM_THREADS=1 python benchmarks/residual_ceiling.py --checkpoint runs/vla_mt50/pretrain/checkpoints/last \
        --task metaworld/MT50 --max-episode-steps 100 --episodes 1000 --scales 0.2 0.5 1.0

`--dims 0 1 2 6` corrects only those action dims (the others stay the BC's): what a residual on them
alone can express (LIBERO: translation and gripper, no rotation).

Printed: per instruction, the success at scale 0 (BC), each --scales value and 2 (the expert);
then the averages over instructions. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import Tensor

from embodied_rl.policies.runner import PolicyRunner

EXPERT_SCALE = 2.0  # |a_expert - a_BC| <= 2 for actions in [-1, 1]: the clamp is a no-op


class OracleResidual:
    """The BC policy plus the residual toward the expert that a bound of `scale` allows."""

    def __init__(self, policy, expert, num_envs: int, scale: float, dims: list[int] | None = None):
        self.base = PolicyRunner(policy, num_envs, seed=0)
        self.expert = expert
        self.scale = scale
        self.mask = None if dims is None else torch.zeros(policy.action_dim).index_fill_(0, torch.tensor(dims), 1.0)

    def reset(self, mask: Tensor | None = None) -> None:
        self.base.reset(mask)
        self.expert.reset(mask)

    def act(self, obs) -> Tensor:
        base = self.base.act(obs).float().cpu()
        target = self.expert.act(obs).float().cpu()
        residual = (target - base).clamp(-self.scale, self.scale)
        if self.mask is not None:
            residual = residual * self.mask
        return (base + residual).clamp(-1.0, 1.0)

    @property
    def generator(self) -> torch.Generator:  # evaluate() reseeds the agent's sampling per round
        return self.base.generator


def run(args) -> dict:
    from embodied_rl import envs
    from embodied_rl.envs.experts import make_expert
    from embodied_rl.eval.evaluate import evaluate
    from embodied_rl.policies import load_policy

    torch.set_num_threads(1)
    policy = load_policy(args.checkpoint).eval()
    task_options = {"max_episode_steps": args.max_episode_steps} if args.max_episode_steps else None
    env = envs.make(args.task, num_envs=args.num_envs, seed=0, task_options=task_options, **policy.env_options())
    scales = [0.0, *args.scales, EXPERT_SCALE]
    rows: dict[str, dict[str, float]] = {}  # scale -> instruction -> success
    try:
        expert = make_expert(args.task, env)
        for scale in scales:
            agent = OracleResidual(policy, expert, env.num_envs, scale, args.dims)
            with torch.inference_mode():
                info = evaluate(env, agent, episodes=args.episodes, seed=args.eval_seed, progress=False)
            by_text = info["overall"].get("success_by_instruction") or {
                args.task: {"success_rate": info["overall"]["success_rate"]}}
            rows[str(scale)] = {text: row["success_rate"] for text, row in by_text.items()}
            print(f"scale {scale}: {info['overall']['success_rate']:.3f}", flush=True)
    finally:
        env.close()

    names = {str(scale): f"{scale:g}" for scale in scales} | {"0.0": "BC", str(EXPERT_SCALE): "expert"}
    print(f"\n{'instruction':<60} " + " ".join(f"{names[key]:>7}" for key in rows))
    for text in rows["0.0"]:
        print(f"{text[:60]:<60} " + " ".join(f"{rows[key][text]:>7.2f}" for key in rows))
    averages = {key: sum(row.values()) / len(row) for key, row in rows.items()}
    print(f"{'average over instructions':<60} " + " ".join(f"{averages[key]:>7.3f}" for key in rows))
    return {"task": args.task, "episodes": args.episodes, "max_episode_steps": args.max_episode_steps, "dims": args.dims,
            "average": averages, "by_instruction": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a BC policy checkpoint directory")
    parser.add_argument("--task", required=True, help="a task or suite with a scripted expert")
    parser.add_argument("--scales", type=float, nargs="+", default=[0.2, 0.5, 1.0],
                        help="residual bounds in action units (BC at 0 and the expert at 2 are always run)")
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--num-envs", type=int, default=100)
    parser.add_argument("--eval-seed", type=int, default=1000)
    parser.add_argument("--max-episode-steps", type=int, help="the task's time limit (default: the task's; "
                        "vla_table's MT50 protocol: 100)")
    parser.add_argument("--dims", type=int, nargs="+", help="correct only these action dims (default: all)")
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.num_envs < 1 or any(not 0 < s < EXPERT_SCALE for s in args.scales):
        parser.error(f"--episodes and --num-envs must be >= 1 and every --scales value in (0, {EXPERT_SCALE:g})")
    return args


if __name__ == "__main__":
    print(json.dumps(run(parse_args())))
