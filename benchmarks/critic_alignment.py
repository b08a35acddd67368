"""Does a residual TD3 critic point toward the expert? Its action gradient, and the learned residual,
against the correction the task's scripted expert would make, on the frozen BC policy's own states.

A residual actor (algo=residual_offpolicy) climbs its critics' slope dQ/da at a = b + r. Where the
critics are right, that slope points the way a better policy would move the action; the scripted
expert is such a policy (residual_ceiling.py: moving each BC action toward the expert's by 0.2
lifts the BC). This script runs the BC policy of a residual_offpolicy checkpoint in its task (the
residual not executed: the states are the BC's, where the critics' data began), asks the expert
what it would do in each reached state, and reports over the residual's live action dims:

  slope_cosine      mean cosine between dQ/da (the critics' mean, at the BC action) and a_expert - b
  residual_cosine   mean cosine between the checkpoint's residual r(s, b) and a_expert - b
  sign agreement    per dim, the share of steps where dQ/da (and r) has the sign of a_expert - b,
                    among the steps where the expert differs from the BC by more than 0.05

Cosines near 0 mean the actor climbs a slope unrelated to what the expert would correct; below 0,
away from it. A reference, not a proof: the expert is not the best policy, and far from its
phase the expert's answer on a BC state can be odd.

    OMP_NUM_THREADS=1 MUJOCO_GL=egl python benchmarks/critic_alignment.py \\
        --checkpoint runs/vla_libero/td3_transgrip/checkpoints/last --task libero/libero_spatial --episodes 40 --num-envs 20

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from embodied_rl.actors.base import head_input
from embodied_rl.actors.checkpoint import with_prefix
from embodied_rl.algos.offpolicy import QEnsemble
from embodied_rl.errors import UserError

SIGNIFICANT = 0.05  # |a_expert - b| below this on a dim: the expert does not ask for a correction there


def load_critics(tensors: dict[str, torch.Tensor]) -> QEnsemble:
    """The Q ensemble of a residual_offpolicy checkpoint (critic.critics.<k>.*), its sizes read
    off the weights."""
    critic = with_prefix("critic.", tensors)
    count = 1 + max(int(key.split(".")[1]) for key in critic)
    linear = sorted({int(key.split(".")[2]) for key in critic if key.startswith("critics.0.") and
                     critic[key].dim() == 2})
    sizes = [critic[f"critics.0.{index}.weight"].shape[0] for index in linear]
    ensemble = QEnsemble(critic[f"critics.0.{linear[0]}.weight"].shape[1], sizes[:-1], count)
    ensemble.load_state_dict(critic)
    return ensemble.eval().requires_grad_(False)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-8)


def run(args) -> dict:
    from embodied_rl import envs
    from embodied_rl.actors import load_agent_tensors, read_agent_json, resolve_checkpoint
    from embodied_rl.actors.residual_offpolicy import make_residual_net
    from embodied_rl.envs.experts import make_expert
    from embodied_rl.policies import PolicyRunner, load_policy

    torch.set_num_threads(1)
    path = resolve_checkpoint(args.checkpoint)
    kind, config, _ = read_agent_json(path)
    if kind != "residual_offpolicy":
        raise UserError(f"checkpoint '{path}' is a {kind} agent, not residual_offpolicy")
    tensors = load_agent_tensors(path)
    policy = load_policy(path / "base_policy").eval()
    net = make_residual_net(config)
    net.load_state_dict(with_prefix("actor.", tensors))
    net.eval()
    critics = load_critics(tensors)
    live = net.dims.bool()
    normalize = bool(config.get("normalize_obs", False))

    env = envs.make(args.task, num_envs=args.num_envs, seed=0, **policy.env_options())
    slope_cos, residual_cos = [], []
    slope_agree, residual_agree, counted = (torch.zeros(int(live.sum())) for _ in range(3))
    episodes = 0
    try:
        expert = make_expert(args.task, env)
        runner = PolicyRunner(policy, env.num_envs, seed=args.seed)
        obs, _ = env.reset(seed=args.seed)
        while episodes < args.episodes:
            with torch.no_grad():
                base = runner.act(obs).float()
                target = expert.act(obs).float()
                features = head_input(policy, obs, normalize)
                residual = net(features, base)
            action = base.clone().requires_grad_(True)
            q = critics(features, base, action).mean(0)  # Q(s, b, a), as the actor's loss reads it
            (slope,) = torch.autograd.grad(q.sum(), action)
            wanted = (target - base)[:, live]
            slope, residual = slope[:, live], residual[:, live]
            asks = wanted.abs() > SIGNIFICANT
            moving = asks.any(-1)
            slope_cos.append(cosine(slope, wanted)[moving])
            residual_cos.append(cosine(residual, wanted)[moving])
            slope_agree += ((slope.sign() == wanted.sign()) & asks).sum(0)
            residual_agree += ((residual.sign() == wanted.sign()) & asks).sum(0)
            counted += asks.sum(0)
            obs, _, terminated, truncated, _ = env.step(base)
            done = terminated | truncated
            if done.any():
                runner.reset(done)
                expert.reset(done)
                episodes += int(done.sum())
    finally:
        env.close()
    dims = torch.nonzero(live).flatten().tolist()
    result = {
        "checkpoint": str(path), "task": args.task, "episodes": episodes, "dims": dims,
        "slope_cosine": float(torch.cat(slope_cos).mean()), "residual_cosine": float(torch.cat(residual_cos).mean()),
        "slope_sign_agreement": {d: float(a / max(n, 1)) for d, a, n in zip(dims, slope_agree, counted)},
        "residual_sign_agreement": {d: float(a / max(n, 1)) for d, a, n in zip(dims, residual_agree, counted)},
        "steps_asking": {d: int(n) for d, n in zip(dims, counted)},
    }
    print(f"slope cosine {result['slope_cosine']:.3f}, residual cosine {result['residual_cosine']:.3f}")
    for d in dims:
        print(f"dim {d}: slope agrees {result['slope_sign_agreement'][d]:.2f}, residual agrees "
              f"{result['residual_sign_agreement'][d]:.2f} over {result['steps_asking'][d]} steps")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a residual_offpolicy checkpoint (or its run directory)")
    parser.add_argument("--task", required=True, help="its task, with a scripted expert")
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--num-envs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1000)
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.num_envs < 1:
        parser.error("--episodes and --num-envs must be >= 1")
    return args


if __name__ == "__main__":
    try:
        print(json.dumps(run(parse_args())))
    except UserError as error:  # a checkpoint that is not a residual TD3/SAC one: one line, exit 2
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
