"""Evaluate an agent on a BatchedEnv: success rate with a Wilson interval, per-episode records,
optional videos.

Episode slots are assigned up front, so short episodes are not over-counted. Evaluation runs in
rounds of `num_envs` episodes: round r resets every env with `round_seed(seed, r)` and episode
k = r * num_envs + i is the *first* episode env i runs after that reset. Whatever an env runs
after its counted episode ends (it auto-resets and keeps stepping while slower envs finish) is
discarded. A round whose slots outnumber the remaining episodes counts only the first ones.

Success is `success_once`: an episode is a success if the task's success test held at any step
of it, never a threshold on the mean or max reward.

For an env with instructions (`env.instructions`, a language-conditioned task) each record holds
its episode's instruction text and `overall.success_by_instruction` breaks the success rate down
by instruction. The agent receives the env's observations unchanged (dicts with "instruction").

Each round also seeds the agent's sampling with the same number: the global torch RNG (inside
a fork, so the caller's RNG state is untouched) and the agent's own generator (`seed_agent`).

Replaying episode k (docs/evaluation.md): its record holds `seed` (its round's reset seed) and
`env_index`; `run_round(env, agent, seed)` on an env with the same task, backend and num_envs
(or `evaluate(..., episodes=num_envs, seed=seed)`) returns it again as record `env_index`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from embodied_rl import distributed
from embodied_rl.eval.stats import mean_interval, wilson_interval
from embodied_rl.eval.video import DEFAULT_FPS, EpisodeRecorder

# Round r of an evaluation with seed s resets the envs with s + ROUND_SEED_STRIDE * r. A large
# odd stride keeps the rounds of nearby eval seeds (0, 1, 2, ...) from sharing initial states.
ROUND_SEED_STRIDE = 1_000_003


class Agent(Protocol):
    """What `evaluate` drives (docs/architecture.md, "Executing a chunk policy")."""

    def reset(self, mask: torch.Tensor) -> None: ...

    def act(self, obs: Any) -> torch.Tensor: ...


def round_seed(seed: int, round_index: int) -> int:
    """The env reset seed of evaluation round `round_index`."""
    return int(seed) + ROUND_SEED_STRIDE * int(round_index)


def evaluate(
    env: Any,
    agent: Agent,
    episodes: int,
    seed: int = 0,
    videos: int = 0,
    video_dir: str | Path | None = None,
    video_size: int | None = 256,
    fps: int = DEFAULT_FPS,
    progress: bool = True,
) -> dict[str, Any]:
    """Run `episodes` episodes of `agent` on `env` (all of its `num_envs` copies in parallel).

    Returns {"overall": {...}, "per_episode": [...]} (fields in docs/evaluation.md). The first
    `videos` episodes are rendered to `video_dir/episode_<k>.mp4` with a text overlay; rendering
    never steps physics, so videos do not change the numbers. The caller's torch RNG state is
    left untouched: the agent's sampling runs under a fork seeded per round.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    if not 0 <= videos <= episodes:
        raise ValueError(f"videos must be in [0, episodes={episodes}], got {videos}")
    if videos and video_dir is None:
        raise ValueError("videos > 0 needs a video_dir")
    task = getattr(env, "task", None)
    has_success = bool(getattr(task, "has_success", True))
    num_envs = int(env.num_envs)

    from embodied_rl.runs import progress as progress_bar

    bar = progress_bar(total=episodes, desc="eval") if progress else None
    per_episode: list[dict[str, Any]] = []
    start = time.perf_counter()
    try:
        for round_index in range(math.ceil(episodes / num_envs)):
            first = round_index * num_envs
            records = run_round(
                env, agent, round_seed(seed, round_index), first_episode=first,
                slots=min(num_envs, episodes - first), videos=max(0, videos - first),
                video_dir=video_dir, video_size=video_size, fps=fps, bar=bar,
            )
            per_episode.extend(records)
            if bar is not None and has_success:
                rate = sum(bool(r["success"]) for r in per_episode) / len(per_episode)
                bar.set_postfix(success=f"{100 * rate:.0f}%")
    finally:
        if bar is not None:
            bar.close()
    overall = summarize(per_episode, has_success)
    overall.update(num_envs=num_envs, seed=int(seed), eval_s=time.perf_counter() - start)
    # the simulator's versions: an upgrade can change every number (LIBERO's mujoco and robosuite)
    return {"overall": overall, "simulator": dict(getattr(env, "simulator", {}) or {}), "per_episode": per_episode}


def run_round(
    env: Any,
    agent: Agent,
    reset_seed: int,
    first_episode: int = 0,
    slots: int | None = None,
    videos: int = 0,
    video_dir: str | Path | None = None,
    video_size: int | None = 256,
    fps: int = DEFAULT_FPS,
    bar: Any = None,
) -> list[dict[str, Any]]:
    """One evaluation round: reset every env with `reset_seed` and run until envs 0..slots-1
    have each finished one episode; return their records (episode first_episode + i for env i).
    Envs 0..videos-1 are recorded. The agent samples under a fork of the torch RNG seeded with
    `reset_seed`, so the caller's RNG state is untouched."""
    cuda = [torch.cuda.current_device()] if distributed.cuda_in_use() else []
    with torch.random.fork_rng(devices=cuda):
        return _run_round(env, agent, reset_seed, first_episode, slots, videos, video_dir, video_size, fps, bar)


def _run_round(env, agent, reset_seed, first_episode, slots, videos, video_dir, video_size, fps, bar):
    task = getattr(env, "task", None)
    has_success = bool(getattr(task, "has_success", True))
    max_steps = getattr(env, "max_episode_steps", None) or getattr(task, "max_episode_steps", None)
    instructions = list(getattr(env, "instructions", None) or [])
    num_envs = int(env.num_envs)
    slots = num_envs if slots is None else slots
    device = getattr(env, "device", "cpu")

    torch.manual_seed(reset_seed)
    seed_agent(agent, reset_seed)
    obs, _ = env.reset(seed=reset_seed)
    agent.reset(torch.ones(num_envs, dtype=torch.bool, device=device))

    running = torch.arange(num_envs) < slots  # counted episodes not finished yet
    episode_return = torch.zeros(num_envs, dtype=torch.float64)
    max_reward = torch.full((num_envs,), -math.inf, dtype=torch.float64)
    length = torch.zeros(num_envs, dtype=torch.int64)
    success = torch.zeros(num_envs, dtype=torch.bool)
    records: dict[int, dict[str, Any]] = {}
    # a language-conditioned env's videos show each episode's instruction on the frame
    captions = {i: instructions[int(obs["instruction"][i])] if instructions else None for i in range(num_envs)}
    recorders = {i: EpisodeRecorder(video_size, fps, captions[i]) for i in range(min(videos, slots))}
    if recorders:
        ids = sorted(recorders)
        for i, frame in zip(ids, _render(env, ids)):
            recorders[i].add(frame, 0, None, 0.0)

    round_steps = 0
    while running.any():
        action = agent.act(obs)
        obs, reward, terminated, truncated, info = env.step(action)
        round_steps += 1
        reward = reward.detach().to("cpu", torch.float64)
        done = (terminated | truncated).detach().cpu()
        episode_return += torch.where(running, reward, 0.0)
        max_reward = torch.where(running, torch.maximum(max_reward, reward), max_reward)
        length += running.long()
        if has_success:
            success |= _step_success(info, num_envs) & running
        ended = done & running

        # A done env already shows its next episode (same-step auto-reset), so only envs still
        # inside their counted episode are rendered.
        live = [i for i in recorders if running[i] and not ended[i]]
        if live:
            for i, frame in zip(live, _render(env, live)):
                recorders[i].add(frame, int(length[i]), float(reward[i]), float(episode_return[i]))

        for i in ended.nonzero().flatten().tolist():
            k = first_episode + i
            outcome = bool(success[i]) if has_success else None
            video = None
            if i in recorders:
                video = recorders.pop(i).finish(
                    Path(video_dir) / f"episode_{k}.mp4", int(length[i]), float(reward[i]),
                    float(episode_return[i]), outcome,
                )
            records[i] = {
                "episode": k,
                "seed": int(reset_seed),
                "env_index": i,
                "success": outcome,
                "return": float(episode_return[i]),
                "max_reward": float(max_reward[i]),
                "length": int(length[i]),
                "video": str(video) if video is not None else None,
            }
            if instructions:  # the finished episode's instruction, from its last observation
                records[i]["instruction"] = instructions[int(info["final_obs"]["instruction"][i])]
            if bar is not None:
                bar.update(1)
        running &= ~done
        if done.any():
            agent.reset(done.to(device))
        if max_steps is not None and round_steps > max_steps and running.any():
            raise RuntimeError(f"env did not end its episodes within max_episode_steps={max_steps}")
    return [records[i] for i in range(slots)]


def seed_agent(agent: Any, seed: int) -> None:
    """Reseed an agent's own sampling RNG, if it has one: `agent.seed(seed)` when defined, else
    an `agent.generator` torch.Generator (PolicyRunner keeps its noise generator there)."""
    if callable(getattr(agent, "seed", None)):
        agent.seed(seed)
    elif isinstance(getattr(agent, "generator", None), torch.Generator):
        agent.generator.manual_seed(seed)


def _render(env: Any, env_ids: list[int]):
    frames = env.render(env_ids)
    if isinstance(frames, torch.Tensor):
        frames = frames.detach().cpu().numpy()
    return frames


def _step_success(info: dict[str, Any], num_envs: int) -> torch.Tensor:
    """Success at this step: info["success"], or'ed with the finished episodes' success_once
    (robust to a backend whose info["success"] describes the auto-reset state)."""
    step = torch.zeros(num_envs, dtype=torch.bool)
    if "success" in info:
        step |= torch.as_tensor(info["success"]).detach().cpu().bool()
    episode = info.get("episode")
    if isinstance(episode, dict) and "success_once" in episode and "_episode" in info:
        step |= torch.as_tensor(episode["success_once"]).detach().cpu().bool() & torch.as_tensor(
            info["_episode"]
        ).detach().cpu().bool()
    return step


def summarize(per_episode: list[dict[str, Any]], has_success: bool = True) -> dict[str, Any]:
    """The `overall` block of eval_info from per-episode records."""
    n = len(per_episode)
    if n == 0:
        raise ValueError("summarize needs at least one episode")
    returns = [e["return"] for e in per_episode]
    return_stats = mean_interval(returns)
    overall: dict[str, Any] = {
        "n_episodes": n,
        "has_success": has_success,
        "n_success": None,
        "pc_success": None,
        "success_rate": None,
        "success_ci95": None,
    }
    if has_success:
        successes = sum(bool(e["success"]) for e in per_episode)
        low, high = wilson_interval(successes, n)
        overall.update(
            n_success=successes,
            pc_success=100.0 * successes / n,
            success_rate=successes / n,
            success_ci95=[low, high],
        )
        if any("instruction" in e for e in per_episode):
            overall["success_by_instruction"] = success_by_instruction(per_episode)
    overall.update(
        avg_sum_reward=return_stats["mean"],
        std_sum_reward=return_stats["std"],
        sum_reward_ci95=(
            None if return_stats["ci_low"] is None else [return_stats["ci_low"], return_stats["ci_high"]]
        ),
        avg_max_reward=sum(e["max_reward"] for e in per_episode) / n,
        avg_episode_length=sum(e["length"] for e in per_episode) / n,
    )
    return overall


def success_by_instruction(per_episode: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{instruction text: {"n_episodes", "n_success", "success_rate"}} over the records that
    hold an instruction, in order of first appearance."""
    groups: dict[str, list[bool]] = {}
    for e in per_episode:
        if "instruction" in e:
            groups.setdefault(e["instruction"], []).append(bool(e["success"]))
    return {text: {"n_episodes": len(outcomes), "n_success": sum(outcomes),
                   "success_rate": sum(outcomes) / len(outcomes)}
            for text, outcomes in groups.items()}


def success_text(overall: dict[str, Any]) -> str | None:
    """An `overall` block's success rate as headlines print it, '62.0% [48.2, 74.1]'; None for a
    task without a success signal."""
    from embodied_rl.eval.stats import rate_with_interval

    if overall.get("success_rate") is None:
        return None
    return rate_with_interval(overall["success_rate"], overall["success_ci95"])
