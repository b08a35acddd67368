"""Where does a trained reward model fire on rollouts it never saw, and at which operating point?

A learner paid by the learned success is paid wherever it fires: in a failed episode that is a
reward for failing. This script scores a `train-reward` model on another `collect` of rollouts
(pixels=true, +task.success_terminates=false, as train-reward's data) at several thresholds and
`learned_reward.hold_steps` values: per episode, the share of successful ones in which it fires and
of failed ones, overall and per instruction (rewards/train.py: episode_firing).

    OMP_NUM_THREADS=1 python benchmarks/reward_firing.py --model runs/i36/tt_reward_0 \\
        --data runs/i36/tt_rollouts_probe/demos.zarr --thresholds 0.9 0.95 0.99 --holds 1 2 3 5

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a train-reward run directory or its reward_model/")
    parser.add_argument("--data", required=True, help="a collect run's demos.zarr (pixels=true)")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.95])
    parser.add_argument("--holds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args(argv)

    from embodied_rl.data import DemoDataset
    from embodied_rl.envs.registry import task_class
    from embodied_rl.rewards import load_reward_model
    from embodied_rl.rewards.data import reward_samples
    from embodied_rl.rewards.train import episode_firing, predict

    model = load_reward_model(args.model).eval()
    dataset = DemoDataset.load(args.data)
    task = task_class(model.task)
    samples = reward_samples(dataset, "none", task.effector_obs, task.gripper_obs)
    success_prob, _ = predict(model, samples)  # once: every operating point reads the same probabilities
    result = {"model": args.model, "data": args.data, "episodes": int(len(np.unique(samples.episode))), "rows": []}
    for threshold in args.thresholds:
        for hold, (successful, failed) in episode_firing(success_prob, samples, threshold, tuple(args.holds)).items():
            result["rows"].append({"threshold": threshold, "hold_steps": int(hold),
                                   "fires_in_successful": successful, "fires_in_failed": failed})
            print(f"threshold {threshold:.2f} hold {hold}: fires in {_rate(successful)} of the successful episodes, "
                  f"{_rate(failed)} of the failed", flush=True)
    if samples.instruction is not None and dataset.instructions:
        threshold, hold = args.thresholds[0], max(args.holds)
        result["per_instruction"] = {}
        for index in np.unique(samples.instruction):
            rows = np.isin(samples.episode, np.unique(samples.episode[samples.instruction == index]))
            rates = episode_firing(success_prob[rows], samples.subset(rows), threshold, (hold,))
            name = dataset.instructions[int(index)]
            result["per_instruction"][name] = rates
            shown = "; ".join(f"hold {h}: successful {_rate(r[0])}, failed {_rate(r[1])}" for h, r in rates.items())
            print(f"{name:40s} at {threshold:.2f}, {shown}", flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
