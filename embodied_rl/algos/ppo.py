"""PPO and GRPO fine-tuning of a chunk policy through an Actor (CleanRL style: top to bottom).

One MDP step is one chunk for chain actors (DPPO, Flow-Noise/ReinFlow, Flow-SDE: the rewards of
the executed steps are summed, envs.step_chunk) and one env step for the residual actor.

Reward (algo.reward, auto): the task's success (1 on the step that succeeds) where it has one,
else the env reward; with the success reward the time limit counts as failure (no bootstrap,
algo.bootstrap_truncation) and per-step actors may add potential-based shaping (PotentialShaping).

PPO: GAE (core.gae) with truncation bootstrapped from info["final_obs"]; the actor's critic (on
the env observation; the residual actor's also sees the base policy's queued chunk) with value
clipping; clipped surrogate with dual clip (core.policy_loss), one clip range per likelihood
column (DPPO's schedule over denoising steps); entropy bonus; an
optional regulariser toward the base policy (actor.base_kl); early stop on approximate KL;
optional linear learning-rate decay to 0 over the run (algo.anneal_lr); critic warm-up
(value-only updates for the first iterations); advantage normalisation.

ReMix (Liang et al. 2025; algo.reuse_iterations, kl_convex, reincarnate_at; docs/finetuning.md):
each update also trains on the previous iterations' rollouts, kept with the log-probs and
advantages they were collected with, under the mix-policy clipped loss (core.policy_loss with
precedent_logp: the trust region of the weights before the update); the base regulariser can be
split with a KL to those weights (KL-convex); from algo.reincarnate_at env steps on the replay is
dropped and the regulariser's anchor becomes the actor of that moment (policy reincarnation).

GRPO (algo.group_size = G > 1): groups of G envs start from the same initial state
(env.reset(group_size=G)), each env runs one episode, and the episode return's group-relative
advantage (core.group_advantages) is given to every step of that episode; no critic. Groups
whose members all got the same return carry no signal and are masked out.

Data-parallel (torchrun, embodied_rl/distributed.py): each rank collects its own envs; the
advantage normalisation takes every rank's statistics, the gradients are averaged before each
optimiser step and the early stop uses the mean KL over ranks, so the weights stay equal; the
train/* loss metrics are rank 0's.

Hyperparameters: configs/algo/{residual_ppo,residual_remix,dppo,reinflow,flow_sde,grpo,dsrl_ppo}.yaml.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from embodied_rl import core, distributed
from embodied_rl.actors import make_actor
from embodied_rl.actors.base import ActorAgent, HistoryEnv, ObsHistory
from embodied_rl.algos.common import (
    AlgoConfig,
    EnvEvaluation,
    FinetuneLoop,
    PotentialShaping,
    env_snapshot,
    reward_settings,
    training_reward,
)
from embodied_rl.algos.gradient_noise import GradientNoiseScale
from embodied_rl.algos.wsrl import (
    CRITIC,
    FIRST_REACH,
    FULL,
    EarnedReach,
    deploy_check,
    judged_deployment,
    visible_success,
)
from embodied_rl.envs.api import step_chunk
from embodied_rl.errors import UserError
from embodied_rl.policies.base import Obs
from embodied_rl.policies.runner import first_tensor, index_obs, map_obs


def _stack(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows of per-step tensors (or dict observations) -> [T, N, ...]."""
    return {key: map_obs(lambda *steps: torch.stack(steps), *[item[key] for item in items]) for key in items[0]}


def _flat(x: Obs) -> Obs:
    """[T, N, ...] -> [T * N, ...] (each entry of a dict observation)."""
    return map_obs(lambda t: t.reshape(-1, *t.shape[2:]), x)


def _cat(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Flat batches one after another (each entry of a dict observation too)."""
    return {key: map_obs(lambda *rows: torch.cat(rows), *[part[key] for part in parts]) for key in parts[0]}


@dataclass(frozen=True)
class PPOConfig(AlgoConfig):
    """configs/algo/<preset>.yaml for the PPO family (every preset extends configs/algo/_ppo.yaml,
    which holds the defaults). `actor` and `actor_kwargs` construct the Actor
    (embodied_rl.actors.make_actor); with group_size > 1 the run is GRPO and the critic keys
    (gamma, gae_lambda, critic_lr, vf_coef, value_clip, critic_warmup_iters, num_steps) are unused."""

    name: str
    actor: str
    actor_kwargs: dict[str, Any]
    num_steps: int            # MDP steps per env per iteration (chunks for chunk actors)
    gamma: float
    gae_lambda: float
    reward: str
    reward_shaping: float
    bootstrap_truncation: Any
    lr: float
    critic_lr: float
    anneal_lr: bool
    adam_eps: float
    update_epochs: int
    num_minibatches: int
    clip: float
    dual_clip: float | None
    value_clip: float | None
    ent_coef: float
    vf_coef: float
    base_reg_coef: float
    base_reg_decay_steps: int | None  # the regulariser's weight falls linearly to 0 over these env steps; None = constant
    base_reg_window: int | None  # the anchor lets go only as training success earns it, judged every this many episodes
    high_start: float | None  # ... only where the first evaluation succeeds at least this often; None = everywhere
    deploy: str  # judged: evaluations and checkpoints act with the last weights that won a paired evaluation
                 # (JudgedWeights); latest: with the weights of the moment
    target_kl: float | None
    critic_warmup_iters: int
    norm_adv: bool
    max_grad_norm: float
    group_size: int
    reuse_iterations: int     # ReMix: each update also trains on the previous reuse_iterations - 1 rollouts
    kl_convex: float          # ReMix: the regulariser is kl_convex * base_kl + (1 - kl_convex) * KL to the precedent
    reincarnate_at: int | None  # ReMix: env steps after which it goes on-policy, re-anchored; None = never

    def checks(self) -> list[tuple[str, bool, str]]:
        grpo = self.group_size > 1
        return [
            ("num_steps", self.num_steps >= 1 or grpo, ">= 1"),
            ("gamma", 0.0 <= self.gamma <= 1.0, "in [0, 1]"),
            ("gae_lambda", 0.0 <= self.gae_lambda <= 1.0, "in [0, 1]"),
            ("reward_shaping", self.reward_shaping >= 0, ">= 0"),
            ("lr", self.lr > 0, "> 0"),
            ("critic_lr", self.critic_lr >= 0, ">= 0"),
            ("adam_eps", self.adam_eps > 0, "> 0"),
            ("update_epochs", self.update_epochs >= 1, ">= 1"),
            ("num_minibatches", self.num_minibatches >= 1, ">= 1"),
            ("clip", self.clip > 0, "> 0"),
            ("dual_clip", self.dual_clip is None or self.dual_clip > 1, "> 1 or null"),
            ("value_clip", self.value_clip is None or self.value_clip > 0, "> 0 or null"),
            ("ent_coef", self.ent_coef >= 0, ">= 0"),
            ("vf_coef", self.vf_coef >= 0, ">= 0"),
            ("base_reg_coef", self.base_reg_coef >= 0, ">= 0"),
            ("base_reg_decay_steps", self.base_reg_decay_steps is None or self.base_reg_decay_steps > 0,
             "> 0 env steps or null"),
            ("base_reg_decay_steps", self.base_reg_decay_steps is None or self.base_reg_coef > 0,
             "null unless algo.base_reg_coef > 0 (it schedules that regulariser)"),
            ("base_reg_window", self.base_reg_window is None or self.base_reg_window >= 1, ">= 1 episodes or null"),
            ("base_reg_window", self.base_reg_window is None or (self.base_reg_coef > 0 and not grpo),
             "null unless algo.base_reg_coef > 0 and PPO (it releases that regulariser by training success)"),
            ("high_start", self.high_start is None or 0.0 <= self.high_start <= 1.0, "in [0, 1] or null"),
            deploy_check(self.deploy),
            ("target_kl", self.target_kl is None or self.target_kl > 0, "> 0 or null"),
            ("critic_warmup_iters", self.critic_warmup_iters >= 0, ">= 0"),
            ("max_grad_norm", self.max_grad_norm > 0, "> 0"),
            ("group_size", self.group_size == 0 or self.group_size >= 2, "0 (PPO) or >= 2 (GRPO)"),
            ("reuse_iterations", self.reuse_iterations >= 1, ">= 1 (1: on-policy)"),
            ("kl_convex", 0.0 <= self.kl_convex <= 1.0, "in [0, 1]"),
            ("kl_convex", self.kl_convex == 1.0 or self.base_reg_coef > 0,
             "1 unless algo.base_reg_coef > 0 (it splits that regulariser between the base and the precedent)"),
            ("reincarnate_at", self.reincarnate_at is None or self.reincarnate_at >= 0, ">= 0 env steps or null"),
        ]


def validate_config(cfg: Any) -> None:
    """Called by `embodied-rl finetune` before any work."""
    config = PPOConfig.from_cfg(cfg.algo)
    reward_settings(cfg)
    if config.group_size > 1 and int(cfg.num_envs) % config.group_size:
        raise UserError(f"num_envs={cfg.num_envs} must be a multiple of algo.group_size={config.group_size}")


def make_ppo_actor(config: PPOConfig, policy, num_envs: int):
    return make_actor(config.actor, policy, num_envs, **config.actor_kwargs)


@torch.no_grad()
def mdp_step(env, henv, actor, obs):
    """One MDP step: a whole chunk for chain actors (rewards summed by step_chunk), one env step
    for per-step actors. Resets the actor's per-env state where an episode ended.
    Returns (actor input, actor output, next obs, reward, terminated, truncated, info)."""
    obs_in = henv.history.get() if actor.chunked else obs
    out = actor.act(obs_in)
    if actor.chunked:
        next_obs, reward, terminated, truncated, info = step_chunk(henv, out.actions)
    else:
        next_obs, reward, terminated, truncated, info = env.step(out.actions)
    actor.reset((terminated | truncated).cpu())
    return obs_in, out, next_obs, reward, terminated, truncated, info


def collect_ppo(env, henv, actor, obs, num_steps: int, loop: FinetuneLoop, sparse_reward: bool = False,
                shaping: PotentialShaping | None = None, bootstrap_truncation: bool = True, on_episodes=None):
    """`num_steps` MDP steps of every env. Returns (batch dict [T, N, ...], next obs).
    Finished episodes (the env's own return and success) go to `loop`, which also counts the env
    steps, and to `on_episodes(done, info)` where given (at every step, on every rank: it may sum over
    ranks); the batch holds the training reward.
    `bootstrap_truncation=False` gives a time-limited episode no value after its last step (the
    time limit is part of the task: success must come before it)."""
    rows = []
    steps_per_mdp = actor.n_action_steps if actor.chunked else 1
    for _ in range(num_steps):
        obs_in, out, next_obs, reward, terminated, truncated, info = mdp_step(env, henv, actor, obs)
        done = terminated | truncated
        # V of the observation that really followed: final_obs where the episode ended
        next_value = actor.next_value(next_obs)
        if bool(done.any()):
            next_value[done] = actor.get_value(index_obs(info["final_obs"], done))
            if not bootstrap_truncation:
                next_value[truncated] = 0.0
        loop.advance(env.num_envs * steps_per_mdp, info)
        if on_episodes is not None:
            on_episodes(done, info)
        train_reward = training_reward(reward, info, sparse_reward)
        if shaping is not None:
            train_reward = train_reward + shaping(reward, done)
        rows.append({"obs": obs_in, "logprob": out.logprob, "value": out.value, "reward": train_reward,
                     "terminated": terminated.float(), "truncated": truncated.float(),
                     "next_value": next_value, "stash": out.stash})
        obs = next_obs
    stash = _stack([r.pop("stash") for r in rows])
    batch = _stack(rows)
    batch["stash"] = stash
    return batch, obs


def explained_variance(prediction: torch.Tensor, target: torch.Tensor) -> float | None:
    """1 - Var(target - prediction) / Var(target): 1 for a perfect critic, 0 for one that predicts
    the mean, negative for worse; None when the targets do not vary."""
    variance = target.var()
    return None if variance == 0 else float(1 - (target - prediction).var() / variance)


@torch.no_grad()
def collect_grpo(env, henv, actor, group_size: int, max_mdp_steps: int, sparse_reward: bool = False):
    """One episode per env from G-fold shared initial states. Returns (batch, stats); the
    episodes' env steps are counted by the caller (every env runs until the last one ends)."""
    obs, _ = henv.reset(group_size=group_size)
    instruction = obs.get("instruction") if isinstance(obs, dict) else None  # each episode's, for its stats
    n = env.num_envs
    actor.reset(torch.ones(n, dtype=torch.bool))
    device = first_tensor(obs).device
    running = torch.ones(n, dtype=torch.bool, device=device)
    episode_return = torch.zeros(n, device=device)
    success = torch.zeros(n, dtype=torch.bool, device=device)
    learned_success = torch.zeros(n, dtype=torch.bool, device=device)  # reward=model:PATH: the model's
    rows = []
    for _ in range(max_mdp_steps):
        obs_in, out, obs, reward, terminated, truncated, info = mdp_step(env, henv, actor, obs)
        done = terminated | truncated
        rows.append({"obs": obs_in, "logprob": out.logprob, "valid": running.float(), "stash": out.stash})
        reward = training_reward(reward, info, sparse_reward)
        episode_return += torch.where(running, reward, torch.zeros_like(reward))
        ended = info["_episode"] & running
        success |= info["episode"]["success_once"] & ended
        learned = "learned_success_once" in info["episode"]  # a learned reward's env (rewards.LearnedRewardEnv)
        if learned:
            learned_success |= info["episode"]["learned_success_once"] & ended
        running &= ~done
        if not distributed.any_rank(bool(running.any())):  # every rank runs as many MDP steps
            break
    stash = _stack([r.pop("stash") for r in rows])
    batch = _stack(rows)
    batch["stash"] = stash
    group_ids = torch.arange(n, device=device) // group_size
    advantages = core.group_advantages(episode_return, group_ids)
    per_group = episode_return.view(-1, group_size)  # groups are consecutive envs
    spread = per_group.max(dim=1).values - per_group.min(dim=1).values
    informative = (spread > 1e-6)[group_ids]  # groups with one return for all teach nothing
    batch["valid"] = batch["valid"] * informative.float()[None]
    batch["advantage"] = advantages[None].expand_as(batch["valid"]) * batch["valid"]
    stats = {"episodes": n, "returns": episode_return.tolist(), "successes": success.float().tolist(),
             "learned_successes": learned_success.float().tolist() if learned else None,
             "instructions": instruction.tolist() if instruction is not None else None,
             "informative_groups": float(informative.float().mean())}
    return batch, stats


DATA_PARALLEL = True  # runs under torchrun (embodied_rl/distributed.py)


def finetune(cfg: Any, run, env, policy) -> dict[str, Any]:
    algo = PPOConfig.from_cfg(cfg.algo)
    device = torch.device(cfg.device)
    group_size = algo.group_size
    grpo = group_size > 1
    num_envs = env.num_envs
    torch.manual_seed(int(cfg.seed))
    rewards = reward_settings(cfg)
    # shaping adds to the sparse success reward; a dense env reward (hopper) is used as it is
    shaping = PotentialShaping(algo.reward_shaping, algo.gamma) if algo.reward_shaping and rewards.sparse else None

    # ---- actor, optimiser, run bookkeeping (resumed from the newest checkpoint when there is one) ----
    actor = make_ppo_actor(algo, policy, num_envs).to(device)
    distributed.broadcast_modules([actor])
    distributed.seed_rank(int(cfg.seed))  # the ranks explore with different noise
    if shaping is not None and (actor.chunked or grpo):
        raise UserError("algo.reward_shaping needs a per-step actor (residual) and PPO, not chunks or GRPO")
    param_groups = [{"params": actor.actor_parameters(), "lr": algo.lr}]
    if not grpo:
        param_groups.append({"params": actor.critic_parameters(), "lr": algo.critic_lr})
    optimizer = torch.optim.Adam(param_groups, eps=algo.adam_eps)
    initial_lrs = [group["lr"] for group in optimizer.param_groups]
    steps_per_mdp = actor.n_action_steps if actor.chunked else 1
    max_mdp_steps = math.ceil(env.max_episode_steps / steps_per_mdp) + 1
    # every rank's envs (num_envs is this rank's shard under torchrun)
    env_steps_per_iter = num_envs * distributed.world_size() * steps_per_mdp * (max_mdp_steps if grpo else algo.num_steps)
    iterations = max(1, math.ceil(int(cfg.env_steps) / env_steps_per_iter))

    # algo.deploy=judged: evaluations and checkpoints act with the last weights that won a paired evaluation,
    # the pretrained ones until then (algos/wsrl.py JudgedWeights); training goes on from the current ones
    evaluation, write_agent = judged_deployment(
        algo.deploy, EnvEvaluation(cfg, run, lambda n: ActorAgent(actor.for_eval(n), n, deterministic=True),
                                   policy.env_options()), actor, actor.save)
    loop = FinetuneLoop(cfg, run, evaluation)
    loop.counters["iteration"] = 0
    modules = {"actor": actor}
    # ReMix: the rollouts the next update replays
    replay: list[dict[str, Any]] = []
    anchor = None  # after the reincarnation, the regulariser's anchor: the actor as it was then
    if algo.reincarnate_at is not None and algo.base_reg_coef > 0:
        anchor = copy.deepcopy(actor).requires_grad_(False)
        modules["anchor"] = anchor
    saved = loop.resume(modules, {"optimizer": optimizer}, write_agent)
    # the earned anchor: after its schedule, the anchor keeps the weight coef * (1 - release); the
    # release starts near 0 and grows (or shrinks) with the success of the training episodes against
    # those of the critic warm-up, which the untouched actor ran (EarnedReach's verdicts)
    earned = EarnedReach(FIRST_REACH, algo.base_reg_window) if algo.base_reg_window else None
    episode_regime = torch.full((num_envs,), EarnedReach.IGNORED)
    if earned is not None and saved is not None and "earned_anchor" in saved:
        earned.load_state_dict(saved["earned_anchor"])
        episode_regime = saved["episode_regime"]

    def starting_tag(episodes: int) -> int:  # EarnedReach's tag of `episodes` episodes that start now
        return earned.start(CRITIC if loop.counters["iteration"] < algo.critic_warmup_iters else FULL, episodes)

    def record_episodes(done: torch.Tensor, info: dict[str, Any]) -> None:
        ended = done.cpu()
        earned.record(episode_regime[ended], visible_success(info)[ended])
        episode_regime[ended] = starting_tag(int(ended.sum()))

    # ---- the env; chunk actors see obs histories kept by HistoryEnv ----
    history = ObsHistory(actor.n_obs_steps)
    henv = HistoryEnv(env, history)
    if saved is None or saved["env"] is None:  # new episodes: a new run, or a backend without snapshots
        obs, _ = henv.reset(seed=distributed.rank_seed(int(cfg.seed) + loop.env_steps))
        actor.reset(torch.ones(num_envs, dtype=torch.bool))
        if earned is not None:
            if saved is not None:  # resumed: the episodes in progress are gone, and so are their cohorts
                earned.drop_under_way()
            episode_regime[:] = starting_tag(num_envs)
    else:  # continue exactly where the checkpoint stopped: same env states, histories, queues
        env.set_state(saved["env"])
        obs, history.buffer = map_obs(lambda o: o.to(device), saved["obs"]), saved["history"]
        actor.load_runtime_state(saved["actor"])
        if shaping is not None:
            shaping.load_state(saved["shaping"])
    # the batch size at which an update's direction is half signal, from each update's first epoch
    gradient_noise = GradientNoiseScale()
    if saved is not None and "gradient_noise" in saved:
        gradient_noise.load_state_dict(saved["gradient_noise"])
    if saved is not None:
        replay = saved.get("replay_rollouts", [])  # a checkpoint written before ReMix existed has none

    def loop_state() -> dict[str, Any]:
        state = {"env": env_snapshot(env), "obs": obs, "history": history.buffer, "actor": actor.runtime_state(),
                 "replay_rollouts": replay, "gradient_noise": gradient_noise.state_dict()}
        if shaping is not None:
            state["shaping"] = shaping.state()
        if earned is not None:
            state["earned_anchor"], state["episode_regime"] = earned.state_dict(), episode_regime
            state["anchor_earned"] = anchor_earned
        return state

    loop.start(f"finetune {algo.name}", evaluate_start=earned is not None and algo.high_start is not None,
               instructions=env.instructions)
    # the release is earned at a high start (the base policy's own first evaluation reaches algo.high_start):
    # there RL has little to add and its noise much to take (docs/finetuning.md, "Conservative start of residual PPO")
    if earned is None:
        anchor_earned = False
    elif saved is not None:  # as the first part chose (a checkpoint from before the rule: whether it had the anchor)
        anchor_earned = bool(saved.get("anchor_earned", "earned_anchor" in saved))
    else:
        anchor_earned = algo.high_start is None or loop.starts_high(algo.high_start)

    while loop.counters["iteration"] < iterations:
        iteration_start = time.perf_counter()
        steps_before = loop.env_steps
        # ---- rollout ----
        actor.eval()
        if grpo:
            batch, stats = collect_grpo(env, henv, actor, group_size, max_mdp_steps, rewards.sparse)
            loop.advance(batch["valid"].shape[0] * num_envs * steps_per_mdp)
            loop.record_episodes(stats["returns"], stats["successes"], learned_successes=stats["learned_successes"],
                                 instructions=stats["instructions"])
        else:
            batch, obs = collect_ppo(env, henv, actor, obs, algo.num_steps, loop, rewards.sparse, shaping,
                                     rewards.bootstrap_truncation, record_episodes if anchor_earned else None)
            advantages, returns = core.gae(batch["reward"], batch["value"], batch["next_value"],
                                           batch["terminated"], batch["truncated"], algo.gamma, algo.gae_lambda)
            batch["advantage"], batch["return"] = advantages, returns
            batch["valid"] = torch.ones_like(batch["reward"])
        rollout_s = time.perf_counter() - iteration_start
        env_steps = loop.env_steps - steps_before

        # ---- flatten [T, N] -> [B] ----
        flat = {k: _flat(v) for k, v in batch.items() if k != "stash"}
        flat_stash = {k: _flat(v) for k, v in batch["stash"].items()}
        if not grpo:  # how much of the returns' variance the rollout's values explain (SB3's, CleanRL's)
            value_fit = explained_variance(flat["value"], flat["return"])
        # ReMix: this rollout joins the replay; the update trains on it and the replayed ones. The
        # reincarnation comes with the first rollout that starts at or after reincarnate_at env steps
        reincarnated = algo.reincarnate_at is not None and steps_before >= algo.reincarnate_at
        if reincarnated and steps_before - env_steps < algo.reincarnate_at:  # the current actor becomes the anchor
            replay.clear()
            if anchor is not None:
                anchor.load_state_dict(actor.state_dict())
        reuse = 1 if reincarnated else algo.reuse_iterations
        replayed = replay[len(replay) - (reuse - 1):] if reuse > 1 else []
        replay.append({"flat": flat, "stash": flat_stash})
        del replay[:len(replay) - (reuse - 1)]
        fresh = flat["logprob"].shape[0]
        if replayed:
            flat = _cat([flat] + [part["flat"] for part in replayed])
            flat_stash = _cat([flat_stash] + [part["stash"] for part in replayed])
        valid = flat["valid"].bool()
        advantage = flat["advantage"]
        if algo.norm_adv and int(distributed.all_sum(valid.sum())) > 1:
            advantage = distributed.masked_whiten(advantage, valid) * valid  # over every rank's batch
        batch_size = flat["logprob"].shape[0]
        minibatch_size = max(1, batch_size // algo.num_minibatches)
        clips = actor.clip_coefs(algo.clip)
        adv_weights = actor.advantage_weights().to(device)
        critic_only = (not grpo) and loop.counters["iteration"] < algo.critic_warmup_iters
        base_reg = algo.base_reg_coef  # a decaying anchor holds the first updates near the base, then lets go
        if algo.base_reg_decay_steps is not None:
            base_reg *= max(0.0, 1.0 - steps_before / algo.base_reg_decay_steps)
        if anchor_earned:
            base_reg = max(base_reg, algo.base_reg_coef * (1.0 - earned.cap))
        if algo.anneal_lr:  # linear decay to 0 at the last iteration (CleanRL's anneal_lr); resumes exactly
            remaining = 1.0 - loop.counters["iteration"] / iterations
            for group, initial_lr in zip(optimizer.param_groups, initial_lrs):
                group["lr"] = initial_lr * remaining

        # ---- update ----
        actor.train()
        # the log-probs of the weights before this update (the precedent): the rollout's own for its rows
        precedent = flat["logprob"]
        if replayed:
            with torch.no_grad():
                older = torch.arange(fresh, batch_size, device=device)
                older_logprob, _ = actor.evaluate(index_obs(flat["obs"], older), {k: v[older] for k, v in flat_stash.items()})
            precedent = torch.cat([flat["logprob"][:fresh], older_logprob])
        metrics: dict[str, list[float]] = {}
        first_ratio_dev = None
        stop = False
        for epoch in range(algo.update_epochs):
            order = torch.randperm(batch_size, device=device)
            for begin in range(0, batch_size, minibatch_size):
                mb = order[begin:begin + minibatch_size]
                mb_valid = valid[mb]
                if not distributed.any_rank(bool(mb_valid.any())):
                    continue
                mb_obs = index_obs(flat["obs"], mb)
                mb_stash = {k: v[mb] for k, v in flat_stash.items()}
                losses: dict[str, torch.Tensor] = {}
                loss = torch.zeros((), device=device)
                if not critic_only:
                    logprob, entropy = actor.evaluate(mb_obs, mb_stash)
                    old_logprob, mb_precedent = flat["logprob"][mb], precedent[mb]
                    if first_ratio_dev is None:  # against the weights before the update: 1 on its first minibatch
                        first_ratio_dev = float((logprob.detach() - mb_precedent).exp().sub(1).abs().max())
                    mb_adv = advantage[mb][:, None] * adv_weights[None]
                    pg_losses, approx_kl, clipfrac = [], [], []
                    for col, clip in enumerate(clips):
                        pg, info = core.policy_loss(logprob[:, col], old_logprob[:, col], mb_adv[:, col],
                                                    mb_valid, clip_low=clip, clip_high=clip, dual_clip=algo.dual_clip,
                                                    precedent_logp=mb_precedent[:, col] if replayed else None)
                        pg_losses.append(pg)
                        approx_kl.append(info["approx_kl"])
                        clipfrac.append(info["clipfrac"])
                    losses["policy_loss"] = torch.stack(pg_losses).mean()
                    losses["approx_kl"] = torch.stack(approx_kl).mean().detach()
                    losses["clipfrac"] = torch.stack(clipfrac).mean().detach()
                    losses["entropy"] = core.agg_loss(entropy.mean(-1), mb_valid, "token-mean")
                    loss = losses["policy_loss"] - algo.ent_coef * losses["entropy"]
                    if base_reg > 0:
                        if reincarnated and anchor is not None:  # the KL to the reincarnated anchor, on the rows' actions
                            with torch.no_grad():
                                anchor_logprob, _ = anchor.evaluate(mb_obs, mb_stash)
                            base_kl = core.kl_penalty(logprob, anchor_logprob, "k3").mean(-1)
                        else:
                            base_kl = actor.base_kl(mb_obs, mb_stash)
                        losses["base_kl"] = core.agg_loss(base_kl, mb_valid, "token-mean")
                        regulariser = losses["base_kl"]
                        if algo.kl_convex < 1:  # ReMix's KL-convex constraint: the base and the precedent
                            losses["kl_precedent"] = core.agg_loss(
                                core.kl_penalty(logprob, mb_precedent, "k3").mean(-1), mb_valid, "token-mean")
                            regulariser = algo.kl_convex * regulariser + (1 - algo.kl_convex) * losses["kl_precedent"]
                        loss = loss + base_reg * regulariser
                if not grpo:
                    losses["value_loss"] = actor.value_loss(mb_obs, mb_stash, flat["value"][mb], flat["return"][mb],
                                                            mb_valid, algo.value_clip)
                    loss = loss + algo.vf_coef * losses["value_loss"]
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                distributed.average_gradients(actor.parameters())
                if epoch == 0 and not critic_only:
                    gradient_noise.add(actor.actor_parameters(), int(distributed.all_sum(mb_valid.sum())))
                grad_norm = torch.nn.utils.clip_grad_norm_(actor.parameters(), algo.max_grad_norm)
                for key, value in losses.items():
                    metrics.setdefault(key, []).append(float(value.detach()))
                # a non-finite loss or gradient stops the run before it reaches the weights
                loop.check_finite("train/loss", loss, {f"train/{k}": v[-1] for k, v in metrics.items()})
                loop.check_finite("train/grad_norm", grad_norm)
                optimizer.step()
            kl = metrics.get("approx_kl", [0.0])
            if algo.target_kl is not None and not critic_only and distributed.mean_over_ranks(kl[-1]) > algo.target_kl:
                stop = True
            if stop:
                break
        loop.counters["iteration"] += 1

        # ---- log, evaluate, checkpoint ----
        iteration_s = time.perf_counter() - iteration_start
        log = {f"train/{k}": sum(v) / len(v) for k, v in metrics.items()}
        log.update(gradient_noise.end_update())
        log.update({"train/iteration": loop.counters["iteration"], "train/rollout_s": rollout_s,
                    "train/lr": optimizer.param_groups[0]["lr"], "train/base_reg_coef": base_reg,
                    "train/iteration_s": iteration_s, "train/sps": env_steps / iteration_s,
                    "train/early_stop": float(stop), "train/critic_only": float(critic_only),
                    "train/replayed_rows": float(batch_size - fresh)})
        if first_ratio_dev is not None:
            log["train/first_minibatch_ratio_dev"] = first_ratio_dev
        if earned is not None:  # whether the release is earned (1) or the schedule's (0), and the release
            log["train/anchor_earned"] = float(anchor_earned)
            if anchor_earned:
                log["train/anchor_release"] = earned.cap
        if grpo:
            log["train/informative_groups"] = stats["informative_groups"]
        elif value_fit is not None:
            log["train/explained_variance"] = value_fit
        loop.log(log)
        loop.boundary(loop_state)

    return loop.finish(loop_state)
