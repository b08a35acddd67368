"""Can a critic learn what DSRL's latent noise does, from DSRL's own amount of data?

DSRL trains Q(s, w) over the frozen policy's latent noise w and its actor ascends that critic. This
script asks the supervised version of the question, without any actor: roll the frozen BC policy
out with prior noise w ~ N(0, I) clipped to the box (DSRL's warm-up data), label every chunk with a
one-step TD target y = r + gamma * V(s') (no bootstrap past an episode's end; V fitted to the
Monte-Carlo discounted success-to-go on the training episodes), then fit three regressors of y on
the training episodes and score them on held-out episodes (R^2, the best over training):

    f(s)        the state alone (what the noise adds is measured against this)
    f(s, w)     the state and the noise (DSRL's critic input)
    f(s, a)     the state and the executed chunk the frozen policy makes of that noise (DSRL-NA's Q_A)

f(s, w) below f(s) means a critic on the noise overfits the noise dimensions at this amount of data:
its actor then climbs errors. f(s, a) above f(s) means the executed chunk carries information about
the outcome a critic can extract.

An actor follows only the part of the critic that changes with its input: the advantage. So the
script also fits the residual y - f(s) (f(s) fitted on the training rows) from (s, w) and from
(s, a) and reports its held-out R^2: the share of the target's action-dependent variance a critic
can find. Near zero (or below) the critic's slope in w or a is noise, whatever its R^2 on y.

    OMP_NUM_THREADS=1 python benchmarks/dsrl_learnability.py --checkpoint runs/bc/push_t/checkpoints/last \\
        --task push_t --transitions 20000

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def collect(args) -> dict[str, np.ndarray]:
    """Chunks of the frozen policy under prior noise: [T, N, ...] arrays of features, noise, executed
    chunk, success reward and done."""
    from embodied_rl import envs
    from embodied_rl.actors.latent_noise import LatentNoiseVecEnv
    from embodied_rl.policies import load_policy

    policy = load_policy(args.checkpoint).eval()
    task_options = {"max_episode_steps": args.max_episode_steps} if args.max_episode_steps else None
    env = envs.make(args.task, num_envs=args.num_envs, seed=args.seed, task_options=task_options,
                    **policy.env_options())
    vec_env = LatentNoiseVecEnv(env, policy, noise_bound=args.noise_bound, seed=args.seed, sparse_reward=True,
                                bootstrap_truncation=False)
    rng = np.random.default_rng(args.seed)
    rows: dict[str, list[np.ndarray]] = {"s": [], "w": [], "a": [], "r": [], "d": []}
    obs = vec_env.reset()
    try:
        while len(rows["s"]) * args.num_envs < args.transitions:
            noise = np.clip(rng.standard_normal((args.num_envs, vec_env.action_space.shape[0])),
                            -args.noise_bound, args.noise_bound).astype(np.float32)
            next_obs, reward, done, infos = vec_env.step(noise)
            rows["s"].append(obs)
            rows["w"].append(noise)
            rows["a"].append(np.stack([info["executed_chunk"] for info in infos]))
            rows["r"].append(reward)
            rows["d"].append(done)
            obs = next_obs
    finally:
        vec_env.close()
    return {key: np.stack(value) for key, value in rows.items()}


def labelled_rows(data: dict[str, np.ndarray], gamma: float) -> dict[str, np.ndarray]:
    """Flatten [T, N] to the rows whose episode ended inside the data, with the Monte-Carlo return G,
    the next state and an episode id (for the held-out split by episode)."""
    reward, done = data["r"], data["d"]
    steps, num_envs = reward.shape
    returns = np.zeros((steps, num_envs))
    episode = np.zeros((steps, num_envs), dtype=np.int64)
    complete = np.zeros((steps, num_envs), dtype=bool)
    running, ended = np.zeros(num_envs), np.zeros(num_envs, dtype=bool)
    episode_id = np.arange(num_envs, dtype=np.int64) * steps  # unique per (env, episode)
    for t in range(steps - 1, -1, -1):
        ended |= done[t]
        episode_id = np.where(done[t], episode_id + 1, episode_id)
        running = reward[t] + gamma * running * (1 - done[t])
        returns[t], episode[t], complete[t] = running, episode_id, ended
    next_state = np.concatenate([data["s"][1:], data["s"][-1:]])
    complete[-1] = False  # its next state is not in the data
    keep = complete
    return {"s": data["s"][keep], "w": data["w"][keep], "a": data["a"][keep], "r": reward[keep],
            "d": done[keep].astype(np.float64), "g": returns[keep], "s_next": next_state[keep],
            "episode": episode[keep]}


def fit(x: np.ndarray, y: np.ndarray, held_out: np.ndarray, args, seed: int) -> tuple[float, torch.nn.Module]:
    """An MLP (LayerNorm, ReLU) fitted to y on the training rows; returns the best held-out R^2 seen
    (every 250 steps) and the network."""
    torch.manual_seed(seed)
    x_train = torch.tensor(x[~held_out], dtype=torch.float32)
    y_train = torch.tensor(y[~held_out], dtype=torch.float32)
    x_test = torch.tensor(x[held_out], dtype=torch.float32)
    y_test = torch.tensor(y[held_out], dtype=torch.float32)
    layers: list[torch.nn.Module] = []
    width = x.shape[1]
    for _ in range(args.depth):
        layers += [torch.nn.Linear(width, args.hidden), torch.nn.LayerNorm(args.hidden), torch.nn.ReLU()]
        width = args.hidden
    net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-4)
    generator = torch.Generator().manual_seed(seed)
    variance = float(y_test.var())
    best = -float("inf")
    for step in range(1, args.fit_steps + 1):
        index = torch.randint(len(x_train), (256,), generator=generator)
        loss = ((net(x_train[index]).squeeze(-1) - y_train[index]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 250 == 0:
            with torch.no_grad():
                mse = float(((net(x_test).squeeze(-1) - y_test) ** 2).mean())
            best = max(best, 1.0 - mse / variance)
    return best, net


def run(args) -> dict:
    torch.set_num_threads(1)
    start = time.time()
    rows = labelled_rows(collect(args), args.gamma)
    collect_s = time.time() - start
    episodes = np.unique(rows["episode"])
    rng = np.random.default_rng(args.seed + 1)
    test_episodes = rng.choice(episodes, max(1, len(episodes) // 5), replace=False)
    held_out = np.isin(rows["episode"], test_episodes)
    value_r2, value_net = fit(rows["s"], rows["g"], held_out, args, seed=0)
    with torch.no_grad():
        next_value = value_net(torch.tensor(rows["s_next"], dtype=torch.float32)).squeeze(-1).numpy()
    target = rows["r"] + args.gamma * (1 - rows["d"]) * next_value
    state_noise = np.concatenate([rows["s"], rows["w"]], 1)
    state_chunk = np.concatenate([rows["s"], rows["a"]], 1)
    state_r2, state_net = fit(rows["s"], target, held_out, args, seed=1)
    r2 = {
        "state": state_r2,
        "state_noise": fit(state_noise, target, held_out, args, seed=1)[0],
        "state_chunk": fit(state_chunk, target, held_out, args, seed=1)[0],
    }
    with torch.no_grad():
        residual = target - state_net(torch.tensor(rows["s"], dtype=torch.float32)).squeeze(-1).numpy()
    residual_r2 = {
        "state_noise": fit(state_noise, residual, held_out, args, seed=2)[0],
        "state_chunk": fit(state_chunk, residual, held_out, args, seed=2)[0],
    }
    print(f"{len(target)} chunks ({len(episodes)} episodes, {len(test_episodes)} held out), collected in "
          f"{collect_s:.0f} s; success per episode {rows['r'].sum() / max(1, rows['d'].sum()):.3f}")
    print(f"V(s) on the Monte-Carlo return: held-out R^2 {value_r2:.3f}")
    print(f"TD target, held-out R^2: f(s) {r2['state']:.3f}  f(s, w) {r2['state_noise']:.3f}  "
          f"f(s, a) {r2['state_chunk']:.3f}")
    print(f"residual y - f(s), held-out R^2: f(s, w) {residual_r2['state_noise']:.3f}  "
          f"f(s, a) {residual_r2['state_chunk']:.3f}")
    return {"task": args.task, "transitions": int(len(target)), "episodes": int(len(episodes)),
            "hidden": args.hidden, "depth": args.depth, "value_r2": value_r2, "td_target_r2": r2,
            "residual_r2": residual_r2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a BC policy checkpoint directory")
    parser.add_argument("--task", required=True)
    parser.add_argument("--transitions", type=int, default=20000, help="chunks collected (DSRL's transitions)")
    parser.add_argument("--num-envs", type=int, default=32)
    parser.add_argument("--noise-bound", type=float, default=1.5, help="DSRL's noise box (configs/algo/dsrl.yaml)")
    parser.add_argument("--gamma", type=float, default=0.99, help="per chunk, as configs/algo/dsrl.yaml")
    parser.add_argument("--hidden", type=int, default=256, help="regressor width (DSRL's critic: 256)")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--fit-steps", type=int, default=6000, help="Adam steps of batch 256 per regressor")
    parser.add_argument("--max-episode-steps", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.transitions, args.num_envs, args.hidden, args.depth, args.fit_steps) < 1 or args.noise_bound <= 0:
        parser.error("--transitions, --num-envs, --hidden, --depth and --fit-steps must be >= 1, --noise-bound > 0")
    return args


if __name__ == "__main__":
    print(json.dumps(run(parse_args())))
