"""Which of its own rollouts does a BC policy learn from? The question under RECAP.

    python benchmarks/recap_rollout_data.py --task peg_insert --checkpoint runs/.../checkpoints/last

Rolls out the BC policy (`--rollout-steps` steps on `--num-envs` envs), cuts the rollouts into
successful and failed episodes, and reports the BC loss of each kind of training window and the
share of their action entries at the normalised range's bounds (clipped). Then, from the BC
weights each time, it runs `--updates` BC updates with half of each batch from the demos and half
from one kind of rollout window, and evaluates the result on the same episodes as the BC policy:

    demos       the demos alone (the control: more BC)
    all         demos + every rollout window
    successful  demos + windows of successful episodes (filtered BC)
    failed      demos + windows of failed episodes
    conditioned what RECAP trains: demos and successful windows with the positive indicator,
                failed ones with the negative indicator (dropped with probability 0.3), acting
                with the positive indicator and guidance `--guidance`

The last line printed is one JSON object with the numbers.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

VARIANTS = ("demos", "all", "successful", "failed", "conditioned")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True)
    p.add_argument("--checkpoint", required=True, help="a flow/diffusion BC checkpoint")
    p.add_argument("--data", default=None, help="its demo dataset (default: the one its pretrain run recorded)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--rollout-steps", type=int, default=400)
    p.add_argument("--num-envs", type=int, default=32)
    p.add_argument("--updates", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--indicator-lr", type=float, default=1e-3)
    p.add_argument("--guidance", type=float, default=1.0)
    p.add_argument("--eval-episodes", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def roll_out(env, policy, steps: int, seed: int) -> list[dict]:
    """Finished episodes of the BC policy (the RECAP agent before any update), success rewards."""
    from embodied_rl.actors.recap import IndicatorEmbedding, RecapAgent
    from embodied_rl.algos.recap import RolloutEpisodes, policy_obs

    agent = RecapAgent(policy, IndicatorEmbedding(policy.cond_dim), env.num_envs, 1.0, seed=seed)
    recorder = RolloutEpisodes(env.num_envs)
    obs, _ = env.reset(seed=seed)
    agent.reset()
    for _ in range(steps):
        action = agent.act(obs)
        next_obs, _, terminated, truncated, info = env.step(action)
        done = terminated | truncated
        recorder.add(policy_obs(policy, obs), action, info["success"].float(), done, truncated,
                     policy_obs(policy, info["final_obs"] if bool(done.any()) else next_obs))
        agent.reset(done.cpu())
        obs = next_obs
    return recorder.take_finished()


def run(args: argparse.Namespace) -> dict:
    from embodied_rl import envs
    from embodied_rl.actors.recap import IndicatorEmbedding, RecapAgent
    from embodied_rl.algos.recap import concat_episodes
    from embodied_rl.data.dataset import DemoDataset
    from embodied_rl.data.windows import ChunkWindows
    from embodied_rl.eval.evaluate import evaluate
    from embodied_rl.policies import load_policy, read_config

    torch.manual_seed(args.seed)
    policy = load_policy(args.checkpoint).eval()
    extra = read_config(args.checkpoint).get("extra", {}) or {}
    data = args.data or extra.get("dataset") or extra.get("data")
    if not data or not Path(data).exists():
        raise SystemExit(f"no demo dataset: pass --data (the checkpoint records {data!r})")
    demos = DemoDataset.load(data)
    env = envs.make(args.task, num_envs=args.num_envs, seed=args.seed, **policy.env_options())
    started = time.perf_counter()
    episodes = roll_out(env, policy, args.rollout_steps, args.seed)
    successful = [e for e in episodes if float(e["reward"].sum()) > 0]
    failed = [e for e in episodes if float(e["reward"].sum()) == 0]
    if not successful or not failed:
        raise SystemExit(f"the rollouts need both outcomes: {len(successful)} successful, {len(failed)} failed episodes")

    def windows(dataset):
        return ChunkWindows(dataset, policy.n_obs_steps, policy.horizon, policy.obs_mode)

    sources = {"demos": windows(demos), "all": windows(concat_episodes(episodes, demos.instructions)),
               "successful": windows(concat_episodes(successful, demos.instructions)),
               "failed": windows(concat_episodes(failed, demos.instructions))}
    keys = ["obs", "action"] + (["pixels"] if policy.obs_mode == "pixels" else []) + (
        ["instruction"] if policy.instructions else [])
    report: dict = {"task": args.task, "episodes": len(episodes), "successful": len(successful),
                    "successful_steps": sum(len(e["action"]) for e in successful),
                    "failed_steps": sum(len(e["action"]) for e in failed), "windows": {}}
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, source in sources.items():
            batch = source.batch(torch.randint(len(source), (min(len(source), 1024),), generator=generator))
            at_bound = (policy.normalize_action(batch["action"]).abs() >= 0.999).float().mean()
            report["windows"][name] = {"bc_loss": float(policy.bc_loss({k: batch[k] for k in keys})),
                                       "at_bound": float(at_bound)}
    print(f"{args.task}: {len(episodes)} rollout episodes, {len(successful)} successful "
          f"({report['successful_steps']} steps; failed: {report['failed_steps']})")
    for name, row in report["windows"].items():
        print(f"  windows of {name:<10} BC loss {row['bc_loss']:.4f}, action entries at a bound {row['at_bound']:.1%}")

    eval_env = envs.make(args.task, num_envs=min(args.eval_episodes, 50), seed=args.seed + 1, **policy.env_options())

    def success(agent_policy, indicator, guidance) -> float:
        agent = RecapAgent(agent_policy, indicator, eval_env.num_envs, guidance, seed=args.seed)
        info = evaluate(eval_env, agent, args.eval_episodes, seed=1000 + args.seed, progress=False)
        return float(info["overall"]["success_rate"])

    zero = IndicatorEmbedding(policy.cond_dim)
    report["success"] = {"bc": success(policy, zero, 1.0)}
    print(f"  BC policy: {report['success']['bc']:.2f} on {args.eval_episodes} episodes")
    half = args.batch_size // 2
    for variant in args.variants:
        trained = copy.deepcopy(policy).train()
        indicator = IndicatorEmbedding(policy.cond_dim)
        optimizer = torch.optim.AdamW([{"params": trained.parameters(), "lr": args.lr},
                                       {"params": indicator.parameters(), "lr": args.indicator_lr}], weight_decay=0.0)
        if variant == "demos":
            mix = [("demos", args.batch_size, True)]
        elif variant == "conditioned":  # rollout halves in the proportion of the two kinds' windows
            share = len(sources["successful"]) / (len(sources["successful"]) + len(sources["failed"]))
            n_successful = int(round(half * share))
            mix = [("demos", half, True), ("successful", n_successful, True), ("failed", half - n_successful, False)]
        else:
            mix = [("demos", half, True), (variant, args.batch_size - half, True)]
        for _ in range(args.updates):
            parts, labels = [], []
            for name, count, label in mix:
                if count:
                    parts.append(sources[name].batch(torch.randint(len(sources[name]), (count,), generator=generator)))
                    labels.append(torch.full((count,), label))
            batch = {key: torch.cat([part[key] for part in parts]) for key in keys}
            if variant == "conditioned":
                keep = torch.rand(args.batch_size, generator=generator) >= 0.3
                batch["cond_offset"] = indicator(torch.cat(labels)) * keep[:, None]
            loss = trained.bc_loss(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([*trained.parameters(), *indicator.parameters()], 1.0)
            optimizer.step()
        trained.eval()
        guided = variant == "conditioned"
        report["success"][variant] = success(trained, indicator if guided else zero, args.guidance if guided else 1.0)
        print(f"  {args.updates} updates on {variant:<11} -> {report['success'][variant]:.2f}")
        if guided:  # how far the indicator moves the conditioning, beside the conditioning's own size
            demo = sources["demos"].batch(torch.arange(min(len(sources["demos"]), 1024)))
            extra = {key: demo[key] for key in ("pixels", "instruction") if key in demo}
            with torch.no_grad():
                cond = trained.encode_obs({"state": demo["obs"], **extra} if extra else demo["obs"])
                report["indicator_norm"] = {"positive": float(indicator.table[1].norm()),
                                            "negative": float(indicator.table[0].norm()),
                                            "conditioning": float(cond.norm(dim=-1).mean())}
            print("    indicator embedding norms: positive {positive:.3f}, negative {negative:.3f}; "
                  "conditioning {conditioning:.3f}".format(**report["indicator_norm"]))
    report["wall_s"] = time.perf_counter() - started
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    run(parse_args())
