"""Train the hopper expert once with Stable-Baselines3 PPO and export it without pickle.

    PYTHONPATH=. python scripts/train_hopper_expert.py --minutes 16 --max-steps 3000000

PPO with VecNormalize (observations and rewards) and the classic MuJoCo PPO settings (SB3's
defaults, as in the PPO paper and CleanRL: 2048 samples per update, 10 epochs of minibatches of 64,
lr 3e-4 annealed to 0, gamma 0.99, gae_lambda 0.95, clip 0.2, tanh MLP [64, 64]), on 8 envs of our
batched MuJoCo hopper (256 steps each per update). The small network keeps it fast on one core.
RL-Zoo's tuned Hopper settings (gamma 0.999, lr 9.8e-5, ReLU [256, 256], log_std_init -2, 512
samples per update) were tried first in this 8-env form: they stayed at a return of ~1000 (standing
still) for 900k steps, so they are not used.

Writes assets/experts/hopper.safetensors (actor MLP + observation mean/var/clip, a few hundred KB)
and assets/experts/hopper.json (command, steps, measured return, date). Runs on one core.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
from safetensors.torch import save_file
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecEnv, VecNormalize
from torch import nn

from embodied_rl.envs.experts.hopper import load_actor
from embodied_rl.envs.registry import make

OUT_DIR = Path(__file__).resolve().parent.parent / "assets" / "experts"


class BatchedVecEnv(VecEnv):
    """A Stable-Baselines3 VecEnv view of a BatchedEnv (numpy in and out, SB3's terminal infos)."""

    def __init__(self, env: Any, seed: int):
        self.env = env
        self.seed_value = seed
        super().__init__(env.num_envs, env.single_observation_space, env.single_action_space)

    def reset(self) -> np.ndarray:
        obs, _ = self.env.reset(seed=self.seed_value)
        return obs.cpu().numpy()

    def step_async(self, actions: np.ndarray) -> None:
        self.actions = torch.as_tensor(actions, dtype=torch.float32)

    def step_wait(self):
        obs, reward, terminated, truncated, info = self.env.step(self.actions.clamp(-1, 1))
        done = (terminated | truncated).cpu().numpy()
        infos: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        for i in np.flatnonzero(done):
            infos[i]["terminal_observation"] = info["final_obs"][i].cpu().numpy()
            infos[i]["TimeLimit.truncated"] = bool(truncated[i]) and not bool(terminated[i])
            infos[i]["episode"] = {"r": float(info["episode"]["return"][i]),
                                   "l": int(info["episode"]["length"][i])}
        return obs.cpu().numpy(), reward.float().cpu().numpy(), done, infos

    def close(self) -> None:
        self.env.close()

    def get_attr(self, attr_name: str, indices=None) -> list[Any]:
        return [getattr(self, attr_name)] * self.num_envs

    def set_attr(self, attr_name: str, value: Any, indices=None) -> None:
        setattr(self, attr_name, value)

    def env_method(self, method_name: str, *method_args, indices=None, **method_kwargs) -> list[Any]:
        return [None] * self.num_envs

    def env_is_wrapped(self, wrapper_class, indices=None) -> list[bool]:
        return [False] * self.num_envs


def export(model: PPO, vec_normalize: VecNormalize, path: Path) -> None:
    """The deterministic actor (mean of the Gaussian) and VecNormalize's observation statistics."""
    policy_net = model.policy.mlp_extractor.policy_net  # Linear, Tanh, Linear, Tanh
    linears = [layer for layer in policy_net if isinstance(layer, nn.Linear)] + [model.policy.action_net]
    tensors = {}
    for index, layer in enumerate(linears):
        tensors[f"mlp.{2 * index}.weight"] = layer.weight.detach().float().contiguous()
        tensors[f"mlp.{2 * index}.bias"] = layer.bias.detach().float().contiguous()
    stats = vec_normalize.obs_rms
    tensors["obs_mean"] = torch.as_tensor(stats.mean, dtype=torch.float32)
    tensors["obs_var"] = torch.as_tensor(stats.var, dtype=torch.float32)
    tensors["obs_clip"] = torch.tensor(float(vec_normalize.clip_obs))
    tensors["obs_epsilon"] = torch.tensor(float(vec_normalize.epsilon))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"activation": "tanh", "format": "embodied_rl hopper actor v1"})
    path.chmod(0o644)  # safetensors writes 0600; the shipped file must be world-readable


def evaluate_actor(path: Path, episodes: int, seed: int) -> list[float]:
    """Returns of the exported actor (plain torch, deterministic), with the project's evaluator."""
    from embodied_rl.eval import evaluate

    actor = load_actor(path)

    class Agent:
        def reset(self, mask) -> None:
            pass

        def act(self, obs):
            return actor(obs)

    env = make("hopper", num_envs=episodes)
    try:
        info = evaluate(env, Agent(), episodes=episodes, seed=seed, progress=False)
    finally:
        env.close()
    return [record["return"] for record in info["per_episode"]]


class StopAfter(BaseCallback):
    """Stop at a wall-clock budget; print the recent training return now and then."""

    def __init__(self, seconds: float):
        super().__init__()
        self.deadline = time.time() + seconds
        self.start = time.time()
        self.last_print = 0

    def _on_step(self) -> bool:
        if self.num_timesteps - self.last_print >= 50_000:
            self.last_print = self.num_timesteps
            recent = [info["r"] for info in self.model.ep_info_buffer]
            mean = np.mean(recent) if recent else float("nan")
            print(f"{self.num_timesteps:>9d} steps  {time.time() - self.start:6.0f} s  "
                  f"train return {mean:7.1f}", flush=True)
        return time.time() < self.deadline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=16.0, help="wall-clock training budget")
    parser.add_argument("--max-steps", type=int, default=3_000_000)
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT_DIR / "hopper.safetensors")
    args = parser.parse_args()
    torch.set_num_threads(1)

    env = BatchedVecEnv(make("hopper", num_envs=args.num_envs), seed=args.seed)
    vec_env = VecNormalize(env, norm_obs=True, norm_reward=True, gamma=0.99)
    model = PPO(
        "MlpPolicy", vec_env, n_steps=2048 // args.num_envs, batch_size=64, n_epochs=10,
        learning_rate=lambda progress: 3e-4 * progress, gamma=0.99, gae_lambda=0.95, clip_range=0.2,
        ent_coef=0.0, vf_coef=0.5, max_grad_norm=0.5, seed=args.seed, device="cpu", verbose=0,
        policy_kwargs=dict(activation_fn=nn.Tanh, net_arch=dict(pi=[64, 64], vf=[64, 64])),
    )
    started = time.time()
    model.learn(total_timesteps=args.max_steps, callback=StopAfter(60 * args.minutes))
    minutes = (time.time() - started) / 60

    export(model, vec_env, args.out)
    returns = evaluate_actor(args.out, episodes=10, seed=12345)
    print(f"exported {args.out} after {model.num_timesteps} steps ({minutes:.1f} min); "
          f"return {np.mean(returns):.1f} +- {np.std(returns):.1f} over {len(returns)} episodes", flush=True)
    metadata = {
        "command": "PYTHONPATH=. python " + " ".join(["scripts/train_hopper_expert.py", *sys.argv[1:]]),
        "algorithm": "stable_baselines3 PPO + VecNormalize(obs, reward), SB3/CleanRL MuJoCo defaults",
        "actor": "obs -> clip((obs - mean) / sqrt(var + eps), +-clip) -> Linear-Tanh-Linear-Tanh-Linear",
        "env": f"embodied_rl hopper, {args.num_envs} batched envs (gymnasium Hopper-v5 dynamics)",
        "env_steps": int(model.num_timesteps),
        "train_minutes_one_core": round(minutes, 1),
        "eval_return_mean": round(float(np.mean(returns)), 1),
        "eval_return_std": round(float(np.std(returns)), 1),
        "eval_episodes": len(returns),
        "eval_seed": 12345,
        "sb3_version": __import__("stable_baselines3").__version__,
        "gymnasium_version": gymnasium.__version__,
        "date": datetime.date.today().isoformat(),
    }
    args.out.with_suffix(".json").write_text(json.dumps(metadata, indent=2) + "\n")


if __name__ == "__main__":
    main()
