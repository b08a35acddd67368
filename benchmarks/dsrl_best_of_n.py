"""What a DSRL-NA run's action critic adds at deployment: value-guided best-of-N.

At each decision the agent draws N candidate noises, turns each into a chunk with the frozen base
policy, and executes the chunk its action critics value most (the Q_A ensemble's value, its
`critic_reduction`, as every target and the actor read it). This is how Q-chunking (QC, Li et al. 2025) and V-GPS
(Nakamoto et al. 2024) extract a policy from a critic without training an actor on it; here the
critic is the one a DSRL-NA run trained (RUN/checkpoints/<step>/training_state), so any DSRL-NA
checkpoint can be measured; a run with `algo.eval_candidates=N` deploys it (actors/latent_noise.py
NoiseActorAgent). With N = 1 and the actor as the source it is the run's own evaluation agent (the
noise actor, sampled).

Candidates come from the noise actor (`actor`: its sampled noises) or from the base policy's prior
(`prior`: N(0, I) clipped to the noise box, i.e. best-of-N over BC's own chunks). Every N runs the
same evaluation episodes (same eval seed and envs).

    OMP_NUM_THREADS=1 python benchmarks/dsrl_best_of_n.py --checkpoint runs/vla_libero/dsrl_na_b1/checkpoints/last \
        --task libero/libero_spatial --episodes 100 --num-envs 20 --candidates 1 8 --source actor prior

Printed: per (source, N) the success rate and its Wilson interval, then per instruction; the last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from embodied_rl.actors import latent_noise, load_agent, read_agent_json, resolve_checkpoint
from embodied_rl.actors.latent_noise import NoiseActorAgent
from embodied_rl.eval.stats import wilson_interval


def load_action_critic(checkpoint: Path, obs_dim: int, executed_dim: int, config: dict) -> latent_noise.ActionCritics:
    state = torch.load(checkpoint / "training_state" / "state.pt", map_location="cpu", weights_only=False)
    learner = state["modules"]["learner"]
    if "action_critic" not in learner:
        raise SystemExit(f"{checkpoint}: not a DSRL-NA checkpoint (its training state holds no action critic)")
    return latent_noise.load_action_critic(learner["action_critic"], {**config, "obs_dim": obs_dim}, executed_dim)


def run(args) -> dict:
    from embodied_rl import envs
    from embodied_rl.eval.evaluate import evaluate

    torch.set_num_threads(1)
    checkpoint = resolve_checkpoint(args.checkpoint)
    _, config, _ = read_agent_json(checkpoint)
    agent = load_agent(checkpoint, args.num_envs)
    if not isinstance(agent, NoiseActorAgent):
        raise SystemExit(f"{checkpoint}: not a DSRL checkpoint")
    policy = agent.policy
    critic = load_action_critic(checkpoint, config["obs_dim"], policy.n_action_steps * policy.action_dim, config)
    env = envs.make(args.task, num_envs=args.num_envs, seed=0, **policy.env_options())
    results: dict[str, dict] = {}
    try:
        for source in args.source:
            for k in args.candidates:
                label = f"{source}, N={k}"
                torch.manual_seed(args.eval_seed)
                with torch.inference_mode():
                    best_of_n = NoiseActorAgent(agent.actor, policy, args.num_envs, agent.noise_bound, deterministic=False,
                                                obs_features=agent.obs_features, action_critic=critic, candidates=k,
                                                source=source)
                    info = evaluate(env, best_of_n, episodes=args.episodes, seed=args.eval_seed, progress=False)
                records = info["per_episode"]
                wins = sum(bool(r["success"]) for r in records)
                by_text: dict[str, list[float]] = {}
                for r in records:
                    by_text.setdefault(r.get("instruction", ""), []).append(float(r["success"]))
                low, high = wilson_interval(wins, len(records))
                results[label] = {"success": wins / len(records), "interval": [low, high],
                                  "by_instruction": {t: sum(v) / len(v) for t, v in by_text.items()}}
                print(f"{label}: {wins / len(records):.3f} [{low:.3f}, {high:.3f}]", flush=True)
    finally:
        env.close()
    texts = list(next(iter(results.values()))["by_instruction"])
    print(f"\n{'instruction':<60} " + " ".join(f"{label:>14}" for label in results))
    for text in texts:
        print(f"{text[:60]:<60} " + " ".join(f"{row['by_instruction'][text]:>14.2f}" for row in results.values()))
    return {"checkpoint": str(checkpoint), "task": args.task, "episodes": args.episodes, "results": results}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a DSRL-NA run's checkpoint (or its run directory)")
    parser.add_argument("--task", required=True)
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--num-envs", type=int, default=20)
    parser.add_argument("--candidates", type=int, nargs="+", default=[1, 8], help="the N of best-of-N, one run each")
    parser.add_argument("--source", nargs="+", choices=("actor", "prior"), default=["actor"],
                        help="where the candidate noises come from")
    parser.add_argument("--eval-seed", type=int, default=1000)
    args = parser.parse_args(argv)
    if min(args.candidates) < 1 or args.episodes < 1 or args.num_envs < 1:
        parser.error("--candidates, --episodes and --num-envs must be >= 1")
    return args


if __name__ == "__main__":
    print(json.dumps(run(parse_args())))
