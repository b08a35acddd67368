"""Wall time of one residual SAC/TD3 gradient step (critic + delayed actor + targets) per Q-ensemble
size and critic width, as a ratio to the 2-critic, 256-wide baseline measured in the same run.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/residual_sac_update.py
    PYTHONPATH=. .venv/bin/python benchmarks/residual_sac_update.py --ensembles 2 10 --widths 256 --device cuda

Why it matters: on a CPU the update, not the simulator, sets residual SAC's wall time
(peg_insert, 64 envs, 10 critics, utd 0.5: ~95% of a run), and its cost grows linearly with the
ensemble, so `algo.ensemble` and `algo.utd_ratio` together decide how many env steps fit in a
budget. The batch is random data of peg_insert's sizes (obs 9, action 3); the configuration is
configs/algo/residual_offpolicy.yaml with the ensemble and critic width swapped. The last line is one
JSON object with the numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from embodied_rl.algos.residual_offpolicy import ResidualOffPolicyConfig, ResidualOffPolicyLearner

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "algo" / "residual_offpolicy.yaml"


def ms_per_update(ensemble: int, width: int, args: argparse.Namespace) -> float:
    algo = OmegaConf.merge(OmegaConf.load(CONFIG), {"ensemble": ensemble, "critic_hidden_sizes": [width, width]})
    device = torch.device(args.device)
    learner = ResidualOffPolicyLearner(ResidualOffPolicyConfig.from_cfg(algo), args.obs_dim, args.action_dim, device, seed=0)
    batch_size = int(algo.batch_size)
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator).to(device)

    batch = {"obs": rand(batch_size, args.obs_dim), "base": rand(batch_size, args.action_dim),
             "action": rand(batch_size, args.action_dim), "reward": rand(batch_size),
             "discount": torch.full((batch_size,), 0.97, device=device), "next_obs": rand(batch_size, args.obs_dim),
             "next_base": rand(batch_size, args.action_dim)}
    for _ in range(args.warmup):
        learner.update(batch, update_actor=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.updates):
        learner.update(batch, update_actor=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / args.updates * 1000


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ensembles", type=int, nargs="+", default=[2, 4, 10])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--updates", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--obs-dim", type=int, default=9)
    parser.add_argument("--action-dim", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    baseline = ms_per_update(2, 256, args)
    results = {"baseline_ms": round(baseline, 2), "rows": []}
    print(f"torch threads {torch.get_num_threads()}, device {args.device}, batch from {CONFIG.name}")
    print(f"{'ensemble':>8} {'width':>6} {'ms/update':>10} {'x baseline':>11}")
    for ensemble in args.ensembles:
        for width in args.widths:
            ms = baseline if (ensemble, width) == (2, 256) else ms_per_update(ensemble, width, args)
            results["rows"].append({"ensemble": ensemble, "width": width, "ms": round(ms, 2),
                                    "ratio": round(ms / baseline, 2)})
            print(f"{ensemble:>8} {width:>6} {ms:>10.1f} {ms / baseline:>11.2f}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
