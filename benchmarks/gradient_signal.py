"""How much signal an on-policy method's policy gradient carries: the agreement between the
gradients of independent rollout batches, against the same batches with their advantages shuffled.

A PPO-family update steps along the gradient of sum_i A_i * log pi(a_i | s_i) over one rollout
batch. Two independent batches estimate the same expected gradient s with independent noise, so
their gradients g_1, g_2 agree in proportion to how much of each is signal:
E[g_1 . g_2] = |s|^2, E[|g|^2] = |s|^2 + noise. Shuffling the advantages across a batch keeps every
sample's score and the advantages' spread but cuts the link between action and outcome: its
pairwise agreement is what pure noise gives. When the real advantages agree no better than the
shuffled ones, an update's direction is noise at that batch size and a larger learning rate only
walks the policy away from where it started (docs/finetuning.md, "When an on-policy method does
not learn"). The share s of a batch of B samples gives the gradient noise scale B (1 - s) / s: the
batch size at which a gradient is half signal. Training runs log a cheaper in-run estimate of it
(train/gradient_noise_scale, from one batch's minibatches), which counts the noise an episode's
samples share as signal and so reads lower.

    # a fine-tuned run's checkpoint (trained critic) or the BC checkpoint (--agent none: an
    # untrained critic, so the advantages carry the returns' full spread)
    OMP_NUM_THREADS=1 python benchmarks/gradient_signal.py --checkpoint runs/vla_mt50/pretrain/checkpoints/last \
        --agent runs/vla_mt50/reinflow/finetune/checkpoints/last --algo reinflow \
        --task metaworld/MT50 --max-episode-steps 100 --num-envs 100 --batches 8 --num-steps 32

With `--algo grpo` a batch is one GRPO rollout (one episode per env from fresh group states) and
its samples' advantages are their groups' (uninformative groups give 0); the shuffled baseline
permutes the episodes' advantages among the informative episodes.

With --line-search-episodes E it also evaluates the deterministic policy on the same E episodes
after a step of size eta along the batches' mean gradient, along its negative and along the mean
shuffled-advantage gradient (eta in units of an Adam step at lr 2e-5 over every weight,
2e-5 * sqrt(#weights)). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

LINE_SEARCH_STEPS = (1.0, 3.0)  # eta in Adam-step units, each taken along +signal, -signal, +-noise


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="the BC checkpoint the actor wraps")
    parser.add_argument("--agent", default="none", help="a fine-tuned agent checkpoint dir (actor + critic), or none")
    parser.add_argument("--algo", default="reinflow", help="a PPO-family algo config (reinflow, flow_sde, dppo, ...)")
    parser.add_argument("--task", required=True)
    parser.add_argument("--max-episode-steps", type=int, default=None)
    parser.add_argument("--num-envs", type=int, default=100)
    parser.add_argument("--batches", type=int, default=8, help="independent rollout batches (>= 2)")
    parser.add_argument("--num-steps", type=int, default=32, help="MDP steps per env in one batch")
    parser.add_argument("--set", action="append", default=[], help="a finetune config override, e.g. algo.lr=1e-5")
    parser.add_argument("--line-search-episodes", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error("--batches must be >= 2: agreement needs two independent batches")
    return args


def cosine(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0))


def agreement(grads: list[torch.Tensor]) -> dict[str, float]:
    """Pairwise cosines of independent gradient estimates, their mean and standard error, and the
    signal's share of one estimate's squared norm (mean pairwise dot / mean squared norm)."""
    pairs = list(itertools.combinations(range(len(grads)), 2))
    cosines = [cosine(grads[i], grads[j]) for i, j in pairs]
    mean = sum(cosines) / len(cosines)
    spread = math.sqrt(sum((c - mean) ** 2 for c in cosines) / max(1, len(cosines) - 1) / len(cosines))
    dots = sum(float(grads[i] @ grads[j]) for i, j in pairs) / len(pairs)
    squared = sum(float(g @ g) for g in grads) / len(grads)
    return {"cosine_mean": mean, "cosine_se": spread, "signal_share": dots / squared if squared else float("nan")}


class _Counter:
    """The part of FinetuneLoop that collect_ppo uses: env-step counting and finished episodes."""

    def __init__(self):
        self.successes: list[float] = []

    def advance(self, steps: int, info=None) -> None:
        if info is not None and bool(info["_episode"].any()):
            self.successes += info["episode"]["success_once"][info["_episode"]].float().tolist()


def run(args) -> dict:
    from embodied_rl import core
    from embodied_rl import envs as env_registry
    from embodied_rl.actors.base import ActorAgent, HistoryEnv
    from embodied_rl.actors.checkpoint import load_agent_tensors
    from embodied_rl.algos.common import reward_settings
    from embodied_rl.algos.ppo import PPOConfig, collect_grpo, collect_ppo, make_ppo_actor
    from embodied_rl.commands.finetune import load_base_policy
    from embodied_rl.config import compose
    from embodied_rl.errors import UserError
    from embodied_rl.eval.evaluate import evaluate
    from embodied_rl.policies.runner import ObsHistory, map_obs

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    overrides = [f"task={args.task}", f"algo={args.algo}", f"checkpoint={args.checkpoint}", f"num_envs={args.num_envs}",
                 *([f"task.max_episode_steps={args.max_episode_steps}"] if args.max_episode_steps else []), *args.set]
    cfg = compose("finetune", overrides)
    algo = PPOConfig.from_cfg(cfg.algo)
    grpo = algo.group_size > 1
    if grpo and args.num_envs % algo.group_size:
        raise UserError(f"--num-envs {args.num_envs} must be a multiple of algo.group_size={algo.group_size}")
    policy = load_base_policy(Path(args.checkpoint), "cpu")

    def make_env(seed: int):
        return env_registry.make(cfg.task.name, num_envs=args.num_envs, backend=cfg.backend, device="cpu", seed=seed,
                                 task_options=env_registry.task_overrides(cfg.task), **policy.env_options())

    actor = make_ppo_actor(algo, policy, args.num_envs)
    if args.agent != "none":
        unexpected = actor.load_state_dict(load_agent_tensors(args.agent), strict=False).unexpected_keys
        if unexpected:
            raise UserError(f"--agent {args.agent} is not a {args.algo} agent (unexpected weights: {unexpected[:3]})")
    actor.eval()
    params = actor.actor_parameters()
    rewards = reward_settings(cfg)

    def gradient(batch, advantage: torch.Tensor) -> torch.Tensor:
        obs = map_obs(lambda o: o.flatten(0, 1), batch["obs"])
        stash = {k: v.flatten(0, 1) for k, v in batch["stash"].items()}
        logprob, _ = actor.evaluate(obs, stash)  # [B, L]: PPO's surrogate at ratio 1 has this gradient
        loss = -(advantage[:, None] * logprob).mean()
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])

    def grpo_advantages(batch) -> tuple[torch.Tensor, torch.Tensor]:
        """GRPO's advantage per sample (0 on masked steps and uninformative groups) and the same with
        the episodes' advantages shuffled among the informative episodes (a sample keeps its mask)."""
        episode = batch["advantage"].abs().amax(0) > 0  # [N] envs whose episode carries an advantage
        per_env = (batch["advantage"].sum(0) / batch["valid"].sum(0).clamp(min=1))  # the episode's advantage
        rows = torch.nonzero(episode).flatten()
        shuffled_env = per_env.clone()
        shuffled_env[rows] = per_env[rows[torch.randperm(len(rows))]]
        return batch["advantage"].flatten(), (shuffled_env[None] * batch["valid"]).flatten()

    env = make_env(args.seed)
    henv = HistoryEnv(env, ObsHistory(actor.n_obs_steps))
    obs, _ = henv.reset(seed=args.seed)
    actor.reset(torch.ones(args.num_envs, dtype=torch.bool))
    counter = _Counter()
    grads, shuffled, samples = [], [], 0
    max_mdp_steps = math.ceil(env.max_episode_steps / (actor.n_action_steps if actor.chunked else 1)) + 1  # as ppo.finetune
    for index in range(args.batches):
        start = time.perf_counter()
        if grpo:  # one episode per env from fresh group states; the episodes' returns are its samples' advantages
            batch, stats = collect_grpo(env, henv, actor, algo.group_size, max_mdp_steps, rewards.sparse)
            counter.successes += stats["successes"]
            advantage, shuffled_advantage = grpo_advantages(batch)
        else:
            batch, obs = collect_ppo(env, henv, actor, obs, args.num_steps, counter, rewards.sparse, None,
                                     rewards.bootstrap_truncation)
            advantage, _ = core.gae(batch["reward"], batch["value"], batch["next_value"], batch["terminated"],
                                    batch["truncated"], algo.gamma, algo.gae_lambda)
            advantage = advantage.flatten()
            advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
            shuffled_advantage = advantage[torch.randperm(len(advantage))]
        grads.append(gradient(batch, advantage))
        shuffled.append(gradient(batch, shuffled_advantage))
        samples = int((advantage != 0).sum())
        print(f"batch {index}: {samples} samples, |g| {grads[-1].norm():.3e}, |g shuffled| {shuffled[-1].norm():.3e}, "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    env.close()
    real, noise = agreement(grads), agreement(shuffled)
    rollout_success = sum(counter.successes) / len(counter.successes) if counter.successes else None
    print(f"{args.algo} on {args.task}: {args.batches} batches of {samples} samples; rollout success "
          f"{rollout_success if rollout_success is None else round(rollout_success, 3)}")
    print(f"  pairwise cosine, real advantages:     {real['cosine_mean']:+.4f} +- {real['cosine_se']:.4f} "
          f"(signal share {real['signal_share']:+.4f})")
    print(f"  pairwise cosine, shuffled advantages: {noise['cosine_mean']:+.4f} +- {noise['cosine_se']:.4f}")
    # McCandlish et al.'s B_noise: a batch of B samples holds the share B / (B + B_noise) of signal
    share = real["signal_share"]
    noise_scale = samples * (1 - share) / share if share > 0 else math.inf
    print(f"  gradient noise scale: {noise_scale:.3g} samples (a batch this large is half signal)")
    result = {"algo": args.algo, "task": args.task, "batches": args.batches, "samples_per_batch": samples,
              "rollout_success": rollout_success, "real": real, "shuffled": noise, "noise_scale": noise_scale}

    if args.line_search_episodes:
        unit = 2e-5 * math.sqrt(sum(p.numel() for p in params))
        signal = torch.stack(grads).mean(0)
        directions = {"signal": signal / signal.norm()}
        noise_direction = torch.stack(shuffled).mean(0)
        directions["noise"] = noise_direction / noise_direction.norm()
        start_weights = [p.detach().clone() for p in params]
        eval_env = make_env(args.seed + 1)

        def success_after(direction: torch.Tensor | None, eta: float) -> float:
            offset = 0
            with torch.no_grad():
                for p, p0 in zip(params, start_weights):
                    step = 0 if direction is None else direction[offset:offset + p.numel()].view_as(p)
                    p.copy_(p0 - eta * unit * step)  # minus: a descent step on the loss
                    offset += p.numel()
            agent = ActorAgent(actor.for_eval(args.num_envs), args.num_envs, deterministic=True)
            return evaluate(eval_env, agent, args.line_search_episodes, seed=args.seed + 2, progress=False)["overall"]["success_rate"]

        steps = {"start": success_after(None, 0.0)}
        for eta in LINE_SEARCH_STEPS:
            for name, sign in (("signal", 1), ("signal", -1), ("noise", 1), ("noise", -1)):
                steps[f"{name} {sign * eta:+g}"] = success_after(directions[name], sign * eta)
        eval_env.close()
        print(f"  deterministic success on the same {args.line_search_episodes} episodes after a step of eta "
              f"Adam steps (unit {unit:.3g}):")
        for key, value in steps.items():
            print(f"    {key:12s} {value:.3f}")
        result["line_search"] = {"episodes": args.line_search_episodes, "unit": unit, "success": steps}
    return result


def main() -> int:
    from embodied_rl.errors import UserError

    try:
        print(json.dumps(run(parse_args())))
    except UserError as error:  # bad input: one line, exit 2, as the CLI
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
