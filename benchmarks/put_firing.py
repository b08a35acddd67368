"""How finely does a reward model see a tabletop put? Its firing against the true cube-to-pad distance.

A put succeeds when the named cube rests within 2 cm of its pad's centre (in x and y) and the gripper
has let go. A learner paid by a learned success is paid wherever the model fires, so a model that
cannot tell 1.5 cm from 2.5 cm pays near misses as successes. This script runs a checkpoint on the
put instructions with success not ending the episodes (as `collect +task.success_terminates=false`
records them), keeps the simulator's privileged cube-to-pad distance of every reached state, and
reports for each reward model: the share of states at or above the threshold among the released
states in bands of that distance and among the held ones, how well its success probability ranks
the successes among the cubes released within 3 cm (ROC-AUC), and per episode where it fires. The
frames are rendered at the largest model's size; the policy, and each smaller model, reads them
mean-pooled to its own size (a model whose size does not divide it is refused by the pooling). A
model trained on another camera's frames (collect camera=top) reads that camera's (one such camera
per call).

    OMP_NUM_THREADS=1 MUJOCO_GL=egl python benchmarks/put_firing.py \\
        --checkpoint runs/vla_table/pretrain/checkpoints/last --models RUN_A RUN_B --episodes 100

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

BANDS = (0.0, 0.02, 0.03, 0.05, float("inf"))  # cube-to-pad distance (m, the larger of x and y); success below 0.02
NEAR = 0.03  # the separation that matters: a put from a near miss among the cubes released within this distance


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def put_rollouts(checkpoint: str, episodes: int, num_envs: int, seed: int, image_size: int,
                 reward_camera: str = "") -> dict[str, np.ndarray]:
    """Reached states of complete put episodes: frames (at image_size, which the policy reads pooled
    to its own; with `reward_camera` also that camera's, reward_frames), state, instruction, success,
    distance, closure, episode and time, one row per step."""
    import torch

    from embodied_rl.commands import load_checkpoint_agent
    from embodied_rl.commands.collect import PooledFramesAgent
    from embodied_rl.envs import make
    from embodied_rl.envs.tasks.tabletop import RELEASED
    from embodied_rl.eval.evaluate import seed_agent

    _, policy, agent, _ = load_checkpoint_agent(checkpoint, num_envs, "cpu", "tabletop")
    seed_agent(agent, seed + 1)
    agent = PooledFramesAgent(agent, policy.env_options()["image_size"])
    env = make("tabletop", num_envs=num_envs, seed=seed, task_options={"success_terminates": False},
               **{**policy.env_options(), "image_size": image_size},
               **({"reward_camera": reward_camera} if reward_camera else {}))
    puts = [i for i, text in enumerate(env.instructions) if text.startswith("put")]
    obs, _ = env.reset(seed=seed)
    agent.reset(torch.ones(num_envs, dtype=torch.bool))
    keys = ("frames", "state", "success", "distance", "closure", "episode", "time")
    columns: dict[str, list] = {key: [] for key in keys + (("reward_frames",) if reward_camera else ())}
    episode, time = np.arange(num_envs), np.zeros(num_envs, dtype=np.int64)
    instruction_of = dict(enumerate(obs["instruction"].cpu().tolist()))  # episode -> its instruction
    complete, complete_puts = set(), 0
    next_episode = num_envs
    while complete_puts < episodes:
        obs, _, _, _, info = env.step(agent.act(obs))
        _, cube, pad = env.task.targets(env.state)
        done = info["_episode"].cpu().numpy()
        final = info["final_obs"]
        for key, obs_key in (("frames", "pixels"), ("reward_frames", "reward_pixels")):
            if key in columns:
                columns[key].append(np.where(done[:, None, None, None], final[obs_key].cpu().numpy(),
                                             obs[obs_key].cpu().numpy()))
        columns["state"].append(np.where(done[:, None], final["state"].cpu().numpy(), obs["state"].cpu().numpy()))
        columns["success"].append(info["success"].cpu().numpy())
        columns["distance"].append((cube[:, :2] - pad[:, :2]).abs().amax(dim=1).cpu().numpy())
        columns["closure"].append(env.task.poses(env.state)["closure"].cpu().numpy())
        columns["episode"].append(episode.copy())
        columns["time"].append(time.copy())
        time += 1
        for i in np.flatnonzero(done):  # a finished episode's env already holds its next one
            complete.add(int(episode[i]))
            complete_puts += instruction_of[int(episode[i])] in puts
            episode[i], time[i] = next_episode, 0
            instruction_of[next_episode] = int(obs["instruction"][i])
            next_episode += 1
        agent.reset(torch.as_tensor(done))
    env.close()
    rows = {key: np.concatenate(value) for key, value in columns.items()}
    chosen = sorted(e for e in complete if instruction_of[e] in puts)[:episodes]
    keep = np.isin(rows["episode"], chosen)
    rows = {key: value[keep] for key, value in rows.items()}
    rows["instruction"] = np.array([instruction_of[int(e)] for e in rows["episode"]], dtype=np.int64)
    rows["released"] = rows["closure"] < RELEASED
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a tabletop policy checkpoint (the BC whose rollouts)")
    parser.add_argument("--models", nargs="+", required=True, help="train-reward run directories or reward_model/")
    parser.add_argument("--episodes", type=int, default=100, help="complete put episodes")
    parser.add_argument("--num-envs", type=int, default=32)
    parser.add_argument("--threshold", type=float, default=0.95)
    parser.add_argument("--hold", type=int, default=3, help="learned_reward.hold_steps for the per-episode rates")
    parser.add_argument("--seed", type=int, default=77)
    args = parser.parse_args(argv)

    import torch

    from embodied_rl.envs.render import pool_frames
    from embodied_rl.envs.tasks.tabletop import TabletopTask
    from embodied_rl.rewards import load_reward_model
    from embodied_rl.rewards.data import RewardSamples
    from embodied_rl.rewards.metrics import roc_auc
    from embodied_rl.rewards.train import episode_firing, predict

    models = {path: load_reward_model(path).eval() for path in args.models}
    image_size = max(model.image_size for model in models.values())  # the others' sizes must divide it
    own = {model.camera for model in models.values()} - {"", TabletopTask.camera}
    if len(own) > 1:
        parser.error(f"the models read {len(own)} cameras besides the task's ({', '.join(sorted(own))}); pass one")
    reward_camera = own.pop() if own else ""
    rows = put_rollouts(args.checkpoint, args.episodes, args.num_envs, args.seed, image_size, reward_camera)
    order = np.lexsort((rows["time"], rows["episode"]))  # an episode's rows in step order (episode_firing)
    rows = {key: value[order] for key, value in rows.items()}

    def samples_at(size: int, camera: str = "") -> RewardSamples:
        key = "reward_frames" if camera and camera == reward_camera else "frames"
        frames = pool_frames(torch.from_numpy(rows[key]), size).numpy()
        return RewardSamples(frames, rows["state"].astype(np.float32), rows["instruction"],
                             rows["success"].astype(bool), np.full(len(order), np.nan, dtype=np.float32),
                             rows["episode"], rows["time"])

    samples = samples_at(image_size)
    successful = len(np.unique(samples.episode[samples.success]))
    result = {"checkpoint": args.checkpoint, "episodes": args.episodes, "successful": successful,
              "threshold": args.threshold, "hold_steps": args.hold, "models": {}}
    print(f"{args.episodes} put episodes, {successful} successful", flush=True)
    for path, reward_model in models.items():
        success_prob = predict(reward_model, samples_at(reward_model.image_size, reward_model.camera))[0]
        fired = success_prob >= args.threshold
        near = rows["released"] & (rows["distance"] < NEAR)  # successes and the near misses beside them
        bands = []
        for low, high in zip(BANDS[:-1], BANDS[1:]):
            states = rows["released"] & (rows["distance"] >= low) & (rows["distance"] < high)
            bands.append({"released_distance": [low, high], "states": int(states.sum()),
                          "fires": float(fired[states].mean()) if states.any() else None,
                          "true_success": float(samples.success[states].mean()) if states.any() else None})
        held = ~rows["released"]
        by_hold = episode_firing(fired.astype(np.float32), samples, 0.5, (args.hold,))
        model = {"bands": bands, "held": {"states": int(held.sum()), "fires": float(fired[held].mean())},
                 "near_roc_auc": roc_auc(success_prob[near], samples.success[near]),
                 "episodes_fired": {hold: {"successful": rates[0], "failed": rates[1]} for hold, rates in by_hold.items()}}
        result["models"][path] = model
        print(path, flush=True)
        for band in bands:
            low, high = band["released_distance"]
            where = f"{100 * low:.0f}-{100 * high:.0f} cm" if high < float("inf") else f">= {100 * low:.0f} cm"
            print(f"  released, cube {where} from the pad: {band['states']} states, fires in {_rate(band['fires'])}", flush=True)
        print(f"  held: {held.sum()} states, fires in {model['held']['fires']:.2f}", flush=True)
        print(f"  success vs not among released cubes within {100 * NEAR:.0f} cm: ROC-AUC "
              f"{_rate(model['near_roc_auc'])}", flush=True)
        for hold, rates in model["episodes_fired"].items():
            print(f"  hold {hold}: fires in {_rate(rates['successful'])} of the successful episodes, "
                  f"{_rate(rates['failed'])} of the failed", flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
