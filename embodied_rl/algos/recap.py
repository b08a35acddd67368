"""RECAP (pi*0.6, Physical Intelligence 2025): RL by advantage-conditioned behaviour cloning.
No likelihood of the sampler and no critic in the policy update: the policy learns to imitate
its own data, told which actions were better than usual.

One iteration:
  1. roll out `rollout_steps` env steps per env with the policy conditioned on the positive
     indicator (guidance weight `guidance`; actors/recap.py);
  2. fit a value function V(s) (an MLP on the BC policy's features, frozen at the start of the
     run) to the discounted Monte-Carlo returns of the demos and the kept rollout episodes;
  3. label each rollout step with the indicator I_t = [A_t > threshold], A_t the n-step
     advantage sum_{k<n} gamma^k r_{t+k} + gamma^n V(s_{t+n}) - V(s_t) (Monte-Carlo to the
     episode's end when `advantage_steps` is 0 or the episode ends first), V clamped to the
     range of the returns it was fit to. The threshold is the (1 - positive_fraction) quantile of
     this iteration's advantages (pi*0.6 sets it per task so that about 30% of the data is
     positive), and never below 0: a step is positive only where it did better than V expected.
     Without that floor, when successful episodes hold fewer than 30% of the steps (they end
     early), steps of failed episodes fill the quota, and imitating those is what pulls the
     policy down (benchmarks/recap_rollout_data.py: on peg_insert, BC updates on the demos plus
     failed rollouts halve the BC policy's success; plus successful ones keep it). Demonstrations
     are labelled positive (expert data, like pi*0.6's corrections);
  4. fine-tune every weight of the policy and the indicator embedding with the policy's own BC
     loss on windows of demos and rollouts (`demo_fraction` of each batch from the demos; a
     negative rollout window drawn `negative_weight` times as often as a positive one),
     conditioned on their indicators, dropping the indicator with probability
     `condition_dropout` so the unconditioned policy that guidance needs is learned too.

The reward is the task's success (algo.reward=auto) as in the other methods; with it a time
limit is a failure (no bootstrap), with a dense reward V(final obs) bootstraps a truncation.
Rollout episodes are kept for `keep_iterations` iterations; an episode still running at the end
of an iteration is completed in the next one. Hyperparameters: configs/algo/recap.yaml.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from embodied_rl.actors import save_agent
from embodied_rl.actors.base import Critic
from embodied_rl.actors.recap import AGENT_KIND, IndicatorEmbedding, RecapAgent
from embodied_rl.algos.common import (
    AlgoConfig,
    EnvEvaluation,
    FinetuneLoop,
    env_snapshot,
    reward_settings,
    training_reward,
)
from embodied_rl.algos.offpolicy import dataset_obs, find_demo_path
from embodied_rl.algos.wsrl import deploy_check, judged_deployment
from embodied_rl.errors import UserError
from embodied_rl.policies.runner import index_obs, map_obs


@dataclass(frozen=True)
class RecapConfig(AlgoConfig):
    """configs/algo/recap.yaml (the one home of its defaults)."""

    name: str
    rollout_steps: int
    gamma: float
    reward: str
    bootstrap_truncation: Any
    advantage_steps: int
    positive_fraction: float
    demo_fraction: float
    negative_weight: float
    keep_iterations: int
    condition_dropout: float
    guidance: float
    policy_updates: int
    batch_size: int
    lr: float
    indicator_lr: float
    grad_clip: float
    value_updates: int
    value_lr: float
    value_hidden: int
    data: str | None
    deploy: str

    def checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("rollout_steps", self.rollout_steps >= 1, ">= 1"),
            ("gamma", 0.0 <= self.gamma <= 1.0, "in [0, 1]"),
            ("advantage_steps", self.advantage_steps >= 0, ">= 0 (0 = Monte-Carlo)"),
            ("positive_fraction", 0.0 < self.positive_fraction < 1.0, "in (0, 1)"),
            ("demo_fraction", 0.0 <= self.demo_fraction <= 1.0, "in [0, 1]"),
            ("negative_weight", 0.0 <= self.negative_weight <= 1.0, "in [0, 1]"),
            ("keep_iterations", self.keep_iterations >= 1, ">= 1"),
            ("condition_dropout", 0.0 <= self.condition_dropout < 1.0, "in [0, 1)"),
            ("guidance", self.guidance >= 0.0, ">= 0"),
            ("policy_updates", self.policy_updates >= 1, ">= 1"),
            ("batch_size", self.batch_size >= 2, ">= 2"),
            ("lr", self.lr > 0, "> 0"),
            deploy_check(self.deploy),
            ("indicator_lr", self.indicator_lr > 0, "> 0"),
            ("grad_clip", self.grad_clip > 0, "> 0"),
            ("value_updates", self.value_updates >= 1, ">= 1"),
            ("value_lr", self.value_lr > 0, "> 0"),
            ("value_hidden", self.value_hidden >= 1, ">= 1"),
        ]


def validate_config(cfg: Any) -> None:
    """Called by `embodied-rl finetune` before any work."""
    RecapConfig.from_cfg(cfg.algo)
    reward_settings(cfg)
    if find_demo_path(cfg) is None:
        raise UserError("algo=recap trains on the demonstrations too: set algo.data=PATH (a demo dataset) or "
                        "pass a checkpoint whose pretrain run recorded its data")


# ---------------------------------------------------------------------------------------------
# Episodes, returns and advantages
# ---------------------------------------------------------------------------------------------


def discounted_returns(reward: Tensor, gamma: float, tail: float = 0.0) -> Tensor:
    """G_t = r_t + gamma G_{t+1} over one episode [T], with G_T = `tail`."""
    returns = torch.empty_like(reward)
    running = float(tail)
    for t in range(len(reward) - 1, -1, -1):
        running = float(reward[t]) + gamma * running
        returns[t] = running
    return returns


def nstep_advantages(reward: Tensor, value: Tensor, gamma: float, steps: int, tail: float = 0.0) -> Tensor:
    """A_t = sum_{k<m} gamma^k r_{t+k} + gamma^m V_{t+m} - V_t over one episode [T], with
    m = min(steps, T - t) and V_T = `tail`; steps = 0 means m = T - t (Monte-Carlo)."""
    length = len(reward)
    m = length if steps <= 0 else steps
    values = torch.cat([value, torch.tensor([float(tail)], dtype=value.dtype)])
    discounts = gamma ** torch.arange(length, dtype=reward.dtype)
    # prefix sums of gamma^k r_k make each window's discounted sum one subtraction
    prefix = torch.cat([torch.zeros(1, dtype=reward.dtype), torch.cumsum(discounts * reward, 0)])
    t = torch.arange(length)
    end = torch.clamp(t + m, max=length)
    window = (prefix[end] - prefix[t]) / discounts
    return window + gamma ** (end - t).to(reward.dtype) * values[end] - value


def positive_indicator(advantages: Tensor, positive_fraction: float) -> tuple[Tensor, float]:
    """I_t = [A_t > threshold], the threshold the (1 - positive_fraction) quantile of the
    advantages floored at 0: at most `positive_fraction` of the steps, and only those that did
    better than V expected. Returns (I [T] bool, threshold)."""
    threshold = max(float(torch.quantile(advantages, 1.0 - positive_fraction)), 0.0)
    return advantages > threshold, threshold


def draw_windows(positive: Tensor, count: int, negative_weight: float, generator: torch.Generator) -> Tensor:
    """`count` window indices, a negative window drawn `negative_weight` times as often as a
    positive one (uniform when it is 1)."""
    if negative_weight == 1.0:
        return torch.randint(len(positive), (count,), generator=generator)
    weight = torch.where(positive, 1.0, negative_weight)
    return torch.multinomial(weight, count, replacement=True, generator=generator)


def policy_obs(policy: Any, obs: Any) -> Any:
    """The entries of an env observation that `policy` reads, in the layout `dataset_obs` gives
    demos (the state tensor alone, or a dict with pixels and/or instruction ids)."""
    if not isinstance(obs, dict):
        return obs
    entries = {key: obs[key] for key in ("pixels", "instruction")
               if (key == "pixels" and policy.obs_mode == "pixels") or (key == "instruction" and policy.instructions)}
    return {"state": obs["state"], **entries} if entries else obs["state"]


class RolloutEpisodes:
    """Rollout steps per env, cut into episodes as they finish.

    `rows` holds every step (batched over envs) since the oldest episode still running began;
    `start[i]` is the row where env i's running episode began. A finished episode is its column
    of rows[start[i]:], with the observation that followed its last step ("final", for a
    truncated episode's bootstrap)."""

    def __init__(self, num_envs: int):
        self.rows: list[dict[str, Any]] = []
        self.first_row = 0  # the global index of rows[0]
        self.start = [0] * num_envs
        self.finished: list[dict[str, Any]] = []  # episodes finished in the current iteration

    def add(self, obs: Any, action: Tensor, reward: Tensor, done: Tensor, truncated: Tensor, final_obs: Any) -> None:
        self.rows.append({"obs": map_obs(lambda o: o.cpu(), obs), "action": action.cpu(), "reward": reward.cpu()})
        end = self.first_row + len(self.rows)
        for i in done.nonzero().squeeze(1).tolist():
            rows = self.rows[self.start[i] - self.first_row:]
            self.finished.append({
                "obs": map_obs(lambda *steps, i=i: torch.stack([s[i] for s in steps]), *[r["obs"] for r in rows]),
                "action": torch.stack([r["action"][i] for r in rows]),
                "reward": torch.stack([r["reward"][i] for r in rows]),
                "truncated": bool(truncated[i]),
                "final": map_obs(lambda o, i=i: o[i].cpu(), final_obs),
            })
            self.start[i] = end
        drop = min(self.start) - self.first_row  # rows no running episode needs
        if drop > 0:
            del self.rows[:drop]
            self.first_row += drop

    def take_finished(self) -> list[dict[str, Any]]:
        finished, self.finished = self.finished, []
        return finished

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "first_row": self.first_row, "start": list(self.start), "finished": self.finished}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows, self.first_row = list(state["rows"]), int(state["first_row"])
        self.start, self.finished = [int(s) for s in state["start"]], list(state["finished"])


def demo_episodes(dataset: Any, policy: Any, sparse: bool, success_terminates: bool) -> list[dict[str, Any]]:
    """A demo dataset's episodes in RolloutEpisodes' layout, with the training reward: with the
    sparse reward 1 on the last step of a successful episode (if success ends the task's
    episodes), else the dataset's reward."""
    obs_all = dataset_obs(dataset, policy)
    episodes = []
    for e in range(dataset.num_episodes):
        start, end = dataset.episode_bounds(e)
        reward = torch.as_tensor(np.asarray(dataset.reward[start:end]), dtype=torch.float32)
        success = bool(dataset.episode_success[e])
        if sparse:
            reward = torch.zeros(end - start)
            reward[-1] = float(success)
        episodes.append({"obs": index_obs(obs_all, slice(start, end)),
                         "action": torch.as_tensor(np.asarray(dataset.action[start:end]), dtype=torch.float32),
                         "reward": reward, "truncated": not (success and success_terminates), "final": None})
    return episodes


def concat_episodes(episodes: list[dict[str, Any]], instructions: list[str]):
    """Episodes -> a DemoDataset in memory (what ChunkWindows serves windows from)."""
    from embodied_rl.data.dataset import DemoDataset

    obs = map_obs(lambda *parts: torch.cat(parts), *[e["obs"] for e in episodes])
    state = obs["state"] if isinstance(obs, dict) else obs
    ends = np.cumsum([len(e["action"]) for e in episodes]).astype(np.int64)
    return DemoDataset(
        Path("<rollouts>"), state.numpy(), torch.cat([e["action"] for e in episodes]).numpy(),
        torch.cat([e["reward"] for e in episodes]).numpy(), ends, np.zeros(len(episodes), dtype=bool),
        obs["pixels"].numpy() if isinstance(obs, dict) and "pixels" in obs else None, {},
        obs["instruction"].numpy() if isinstance(obs, dict) and "instruction" in obs else None, list(instructions),
    )


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def finetune(cfg: Any, run: Any, env: Any, policy: Any) -> dict[str, Any]:
    from embodied_rl.data.dataset import DemoDataset
    from embodied_rl.data.windows import ChunkWindows

    algo = RecapConfig.from_cfg(cfg.algo)
    seed = int(cfg.seed)
    torch.manual_seed(seed)
    device = torch.device(str(cfg.device))
    num_envs = int(env.num_envs)
    rewards = reward_settings(cfg)
    success_terminates = bool(getattr(getattr(env, "task", None), "success_terminates", True))

    # the value function reads the BC policy's features, frozen before any update (or resume)
    features_policy = copy.deepcopy(policy).eval().requires_grad_(False)
    value = Critic(features_policy, algo.value_hidden).to(device)
    indicator = IndicatorEmbedding(policy.cond_dim).to(device)
    policy.requires_grad_(True)
    policy_optimizer = torch.optim.AdamW([{"params": policy.parameters(), "lr": algo.lr},
                                          {"params": indicator.parameters(), "lr": algo.indicator_lr}],
                                         weight_decay=0.0)
    value_optimizer = torch.optim.Adam(value.parameters(), lr=algo.value_lr)

    dataset = DemoDataset.load(find_demo_path(cfg))
    demos = demo_episodes(dataset, policy, rewards.demo_sparse, success_terminates)
    demo_windows = ChunkWindows(dataset, policy.n_obs_steps, policy.horizon, policy.obs_mode, device)
    agent = RecapAgent(policy, indicator, num_envs, algo.guidance, seed=seed)
    sampler = torch.Generator().manual_seed(seed + 1)  # batches and indicator dropout

    def write_agent(path: Path) -> None:
        save_agent(path, AGENT_KIND, {"guidance": algo.guidance}, {"indicator.table": indicator.table}, policy)

    def make_eval_agent(n: int) -> RecapAgent:
        return RecapAgent(policy, indicator, n, algo.guidance)

    evaluation, write_agent = judged_deployment(algo.deploy, EnvEvaluation(cfg, run, make_eval_agent, policy.env_options()),
                                                torch.nn.ModuleList([policy, indicator]), write_agent)
    loop = FinetuneLoop(cfg, run, evaluation)
    loop.counters["iteration"] = 0
    saved = loop.resume({"policy": policy, "indicator": indicator, "value": value},
                        {"policy": policy_optimizer, "value": value_optimizer}, write_agent)
    recorder = RolloutEpisodes(num_envs)
    kept: list[dict[str, Any]] = []  # rollout episodes of the last keep_iterations iterations
    if saved is None or saved["env"] is None:  # new episodes: a new run, or a backend without snapshots
        obs, _ = env.reset(seed=seed + loop.env_steps)
        agent.reset()
    else:  # continue exactly where the checkpoint stopped
        env.set_state(saved["env"])
        obs = saved["obs"]
        agent.load_state_dict(saved["agent"])
        recorder.load_state_dict(saved["recorder"])
    if saved is not None:
        sampler.set_state(saved["sampler"])
        kept = list(saved.get("replay", {}).get("episodes", []))

    def loop_state() -> dict[str, Any]:
        return {"env": env_snapshot(env), "obs": obs, "agent": agent.state_dict(), "recorder": recorder.state_dict(),
                "sampler": sampler.get_state(), "replay": {"episodes": kept}}

    def values_of(observations: Any) -> Tensor:
        with torch.no_grad():
            return value(map_obs(lambda o: o.to(device), observations)).cpu()

    def tail_value(episode: dict[str, Any]) -> float:
        if episode["final"] is None or not episode["truncated"] or not rewards.bootstrap_truncation:
            return 0.0
        return float(values_of(map_obs(lambda o: o[None], episode["final"]))[0])

    loop.start(f"finetune {algo.name}", instructions=env.instructions)
    while loop.env_steps < loop.total_env_steps:
        iteration_start = time.perf_counter()
        # ---- 1. roll out with the positive indicator ----
        policy.eval()
        for _ in range(algo.rollout_steps):
            action = agent.act(obs)
            next_obs, reward, terminated, truncated, info = env.step(action)
            done = terminated | truncated
            recorder.add(policy_obs(policy, obs), action, training_reward(reward, info, rewards.sparse), done, truncated,
                         policy_obs(policy, info["final_obs"] if bool(done.any()) else next_obs))
            agent.reset(done.cpu())
            obs = next_obs
            loop.advance(num_envs, info)
        iteration = loop.counters["iteration"]
        kept = [e for e in kept if e["iteration"] > iteration - algo.keep_iterations]
        kept += [{**e, "iteration": iteration} for e in recorder.take_finished()]
        rollout_s = time.perf_counter() - iteration_start
        metrics: dict[str, float] = {}

        # ---- 2. the value function on Monte-Carlo returns of demos and rollouts ----
        episodes = demos + kept
        all_obs = map_obs(lambda *parts: torch.cat(parts), *[e["obs"] for e in episodes])
        returns = torch.cat([discounted_returns(e["reward"], algo.gamma, tail_value(e)) for e in episodes])
        value.train()
        for _ in range(algo.value_updates):
            rows = torch.randint(len(returns), (algo.batch_size,), generator=sampler)
            loss = (value(map_obs(lambda o, rows=rows: o[rows].to(device), all_obs))
                    - returns[rows].to(device)).pow(2).mean()
            value_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            loop.check_finite("train/value_loss", loss)
            value_optimizer.step()
        metrics["train/value_loss"] = float(loss.detach())
        value.eval()

        # ---- 3. advantages and indicators of the rollout steps ----
        positive = None
        if kept:
            # V within the range of the returns it was fit to: with the success reward a failed
            # episode's steps (return 0) then never score above V
            low, high = float(returns.min()), float(returns.max())
            advantages = torch.cat([
                nstep_advantages(e["reward"], values_of(e["obs"]).clamp(low, high), algo.gamma, algo.advantage_steps,
                                 min(max(tail_value(e), low), high))
                for e in kept])
            positive, threshold = positive_indicator(advantages, algo.positive_fraction)
            metrics.update({"train/advantage_mean": float(advantages.mean()), "train/threshold": threshold,
                            "train/positive_fraction": float(positive.float().mean())})

        # ---- 4. advantage-conditioned BC on demos (positive) and rollouts ----
        sources = [(demo_windows, None)]
        if positive is not None and (algo.negative_weight > 0 or bool(positive.any())):
            sources.append((ChunkWindows(concat_episodes(kept, dataset.instructions), policy.n_obs_steps,
                                         policy.horizon, policy.obs_mode, device), positive))
        demo_count = algo.batch_size if len(sources) == 1 else int(round(algo.batch_size * algo.demo_fraction))
        counts = [demo_count, algo.batch_size - demo_count]
        batch_keys = ["obs", "action"] + (["pixels"] if policy.obs_mode == "pixels" else []) + (
            ["instruction"] if policy.instructions else [])
        policy.train()
        bc_losses = []
        for _ in range(algo.policy_updates):
            parts, labels = [], []
            for (windows, label), count in zip(sources, counts):
                if count == 0:
                    continue
                if label is None:
                    index = torch.randint(len(windows), (count,), generator=sampler)
                else:
                    index = draw_windows(label, count, algo.negative_weight, sampler)
                parts.append(windows.batch(index))
                labels.append(torch.ones(count, dtype=torch.bool) if label is None else label[index])
            batch = {key: torch.cat([part[key] for part in parts]) for key in batch_keys}
            keep = torch.rand(algo.batch_size, generator=sampler) >= algo.condition_dropout
            batch["cond_offset"] = indicator(torch.cat(labels)) * keep[:, None].to(device)
            loss = policy.bc_loss(batch)
            policy_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_([*policy.parameters(), *indicator.parameters()],
                                                       algo.grad_clip)
            loop.check_finite("train/bc_loss", loss)
            loop.check_finite("train/grad_norm", grad_norm)
            policy_optimizer.step()
            bc_losses.append(float(loss.detach()))
        policy.eval()
        loop.counters["iteration"] += 1

        metrics.update({"train/bc_loss": sum(bc_losses) / len(bc_losses), "train/iteration": loop.counters["iteration"],
                        "train/rollout_episodes": float(len(kept)), "train/rollout_s": rollout_s,
                        "train/iteration_s": time.perf_counter() - iteration_start})
        loop.log(metrics)
        loop.boundary(loop_state)
    return loop.finish(loop_state)
