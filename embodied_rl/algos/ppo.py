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

GRPO (algo.group_size = G > 1): groups of G envs start from the same initial state
(env.reset(group_size=G)), each env runs one episode, and the episode return's group-relative
advantage (core.group_advantages) is given to every step of that episode; no critic. Groups
whose members all got the same return carry no signal and are masked out.

Hyperparameters: configs/algo/{residual_ppo,dppo,reinflow,flow_sde,grpo,dsrl_ppo}.yaml.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from omegaconf import OmegaConf

from embodied_rl import core
from embodied_rl.actors import load_weights, make_actor
from embodied_rl.actors.base import ActorAgent, HistoryEnv, ObsHistory
from embodied_rl.algos.common import (
    Evaluator,
    headline_from_eval,
    load_training_state,
    restore,
    save_checkpoint,
)
from embodied_rl.envs.api import step_chunk
from embodied_rl.errors import UserError
from embodied_rl.runs import progress


def _stack(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, *x.shape[2:])


def training_reward(reward: torch.Tensor, info: dict[str, Any], sparse: bool) -> torch.Tensor:
    """What RL maximises: the env reward, or (`sparse`) 1 on a step that ends in success.

    Why sparse by default on tasks with a success signal: push_t's dense reward (coverage, up to
    1 per step) keeps paying while the block sits near the target, and success ends the episode,
    so a dense-reward agent earns more by hovering just outside the success region than by
    finishing; the sparse reward (ResiP's choice) with gamma < 1 rewards finishing, and soon.
    """
    return info["success"].float() if sparse else reward


class PotentialShaping:
    """Potential-based shaping (Ng et al. 1999) with the env reward as the potential:
    r_t += coef * (gamma * phi_{t+1} - phi_t), where phi_{t+1} is the env reward of step t (for
    push_t: the coverage of the state reached). It leaves the optimal policy unchanged but pays
    progress at every step, and standing still costs (1 - gamma) * phi, so unlike the raw dense
    reward it never pays to hover near the goal. The first step of an episode gets no shaping
    (the potential of its initial state is unknown). Per-step actors only."""

    def __init__(self, coef: float, gamma: float):
        self.coef, self.gamma = coef, gamma
        self.previous: torch.Tensor | None = None  # phi of the current state, per env
        self.fresh: torch.Tensor | None = None  # envs at the first step of an episode

    def __call__(self, env_reward: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        if self.previous is None:
            self.previous, self.fresh = env_reward.clone(), torch.ones_like(done)
        shaping = self.coef * (self.gamma * env_reward - self.previous)
        shaping = torch.where(self.fresh, torch.zeros_like(shaping), shaping)
        self.previous, self.fresh = env_reward.clone(), done.clone()
        return shaping


def make_ppo_actor(cfg: Any, policy, num_envs: int):
    kwargs = OmegaConf.to_container(cfg.algo.actor_kwargs, resolve=True) if cfg.algo.get("actor_kwargs") else {}
    return make_actor(cfg.algo.actor, policy, num_envs, **kwargs)


@torch.no_grad()
def mdp_step(env, henv, actor, obs):
    """One MDP step: a whole chunk for chain actors (rewards summed by step_chunk), one env step
    for per-step actors. Resets the actor's per-env state where an episode ended.
    Returns (actor input, actor output, next obs, reward, terminated, truncated, info)."""
    obs_in = henv.history.buffer.clone() if actor.chunked else obs
    out = actor.act(obs_in)
    if actor.chunked:
        next_obs, reward, terminated, truncated, info = step_chunk(henv, out.actions)
    else:
        next_obs, reward, terminated, truncated, info = env.step(out.actions)
    actor.reset((terminated | truncated).cpu())
    return obs_in, out, next_obs, reward, terminated, truncated, info


def collect_ppo(env, henv, actor, obs, num_steps: int, sparse_reward: bool = False,
                shaping: PotentialShaping | None = None, bootstrap_truncation: bool = True):
    """`num_steps` MDP steps of every env. Returns (batch dict [T, N, ...], next obs, stats).
    Stats report the env's own episode return and success; the batch holds the training reward.
    `bootstrap_truncation=False` gives a time-limited episode no value after its last step (the
    time limit is part of the task: success must come before it)."""
    rows, returns, successes = [], [], []
    for _ in range(num_steps):
        obs_in, out, next_obs, reward, terminated, truncated, info = mdp_step(env, henv, actor, obs)
        done = terminated | truncated
        # V of the observation that really followed: final_obs where the episode ended
        next_value = actor.next_value(next_obs)
        if bool(done.any()):
            next_value[done] = actor.get_value(info["final_obs"][done])
            if not bootstrap_truncation:
                next_value[truncated] = 0.0
            ended = info["_episode"]
            returns += info["episode"]["return"][ended].tolist()
            successes += info["episode"]["success_once"][ended].float().tolist()
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
    return batch, obs, {"episodes": len(returns), "returns": returns, "successes": successes}


@torch.no_grad()
def collect_grpo(env, henv, actor, group_size: int, max_mdp_steps: int, sparse_reward: bool = False):
    """One episode per env from G-fold shared initial states. Returns (batch, stats)."""
    obs, _ = henv.reset(group_size=group_size)
    n = env.num_envs
    actor.reset(torch.ones(n, dtype=torch.bool))
    running = torch.ones(n, dtype=torch.bool, device=obs.device)
    episode_return = torch.zeros(n, device=obs.device)
    success = torch.zeros(n, dtype=torch.bool, device=obs.device)
    rows = []
    for _ in range(max_mdp_steps):
        obs_in, out, obs, reward, terminated, truncated, info = mdp_step(env, henv, actor, obs)
        done = terminated | truncated
        rows.append({"obs": obs_in, "logprob": out.logprob, "valid": running.float(), "stash": out.stash})
        reward = training_reward(reward, info, sparse_reward)
        episode_return += torch.where(running, reward, torch.zeros_like(reward))
        success |= info["episode"]["success_once"] & info["_episode"] & running
        running &= ~done
        if not bool(running.any()):
            break
    stash = _stack([r.pop("stash") for r in rows])
    batch = _stack(rows)
    batch["stash"] = stash
    group_ids = torch.arange(n, device=obs.device) // group_size
    advantages = core.group_advantages(episode_return, group_ids)
    per_group = episode_return.view(-1, group_size)  # groups are consecutive envs
    spread = per_group.max(dim=1).values - per_group.min(dim=1).values
    informative = (spread > 1e-6)[group_ids]  # groups with one return for all teach nothing
    batch["valid"] = batch["valid"] * informative.float()[None]
    batch["advantage"] = advantages[None].expand_as(batch["valid"]) * batch["valid"]
    stats = {"episodes": n, "returns": episode_return.tolist(), "successes": success.float().tolist(),
             "informative_groups": float(informative.float().mean())}
    return batch, stats


def finetune(cfg: Any, run, env, policy) -> dict[str, Any]:
    algo = cfg.algo
    device = torch.device(cfg.device)
    group_size = int(algo.get("group_size", 0) or 0)
    grpo = group_size > 1
    num_envs = env.num_envs
    if grpo and num_envs % group_size:
        raise UserError(f"num_envs={num_envs} must be a multiple of algo.group_size={group_size}")
    if len(getattr(env.single_observation_space, "shape", None) or ()) != 1:
        raise UserError("on-policy fine-tuning supports state observations only (obs_mode=state)")
    torch.manual_seed(int(cfg.seed))
    reward_mode = str(algo.get("reward", "env"))
    if reward_mode not in ("env", "success", "auto"):
        raise UserError(f"algo.reward must be env, success or auto, got '{reward_mode}'")
    has_success = bool(cfg.task.get("has_success", True))
    if reward_mode == "success" and not has_success:
        raise UserError(f"algo.reward=success needs a task with a success signal; {cfg.task.name} has none")
    sparse_reward = reward_mode == "success" or (reward_mode == "auto" and has_success)
    shaping_coef = float(algo.get("reward_shaping", 0.0) or 0.0)
    # shaping adds to the sparse success reward; a dense env reward (hopper) is used as it is
    shaping = PotentialShaping(shaping_coef, float(algo.gamma)) if shaping_coef and sparse_reward else None
    # With the success reward the goal is success *within* the time limit: running out of time is
    # a failure, not a cut we bootstrap across (else hovering next to the goal until the limit
    # is valued like finishing). auto: no bootstrap with the success reward, bootstrap otherwise.
    bootstrap = algo.get("bootstrap_truncation", "auto")
    bootstrap_truncation = (not sparse_reward) if bootstrap in ("auto", None) else bool(bootstrap)

    # ---- actor, optimiser, counters (resumed from checkpoints/last when it exists) ----
    actor = make_ppo_actor(cfg, policy, num_envs).to(device)
    if shaping is not None and (actor.chunked or grpo):
        raise UserError("algo.reward_shaping needs a per-step actor (residual) and PPO, not chunks or GRPO")
    param_groups = [{"params": actor.actor_parameters(), "lr": float(algo.lr)}]
    if not grpo:
        param_groups.append({"params": actor.critic_parameters(), "lr": float(algo.critic_lr)})
    optimizer = torch.optim.Adam(param_groups, eps=1e-5)
    initial_lrs = [group["lr"] for group in optimizer.param_groups]
    anneal_lr = bool(algo.get("anneal_lr", False))
    steps_per_mdp = actor.n_action_steps if actor.chunked else 1
    max_mdp_steps = math.ceil(env.max_episode_steps / steps_per_mdp) + 1
    env_steps_per_iter = num_envs * steps_per_mdp * (max_mdp_steps if grpo else int(algo.num_steps))
    iterations = max(1, math.ceil(int(cfg.env_steps) / env_steps_per_iter))

    counters = {"iteration": 0, "env_steps": 0, "episodes": 0}
    state = load_training_state(run)
    if state is not None:
        from safetensors.torch import load_file

        load_weights(actor, {k: v.to(device) for k, v in load_file(str(state["path"] / "actor.safetensors")).items()},
                     state["path"])
        counters.update(restore(state, {"optimizer": optimizer}))
    evaluator = Evaluator(cfg, run, counters=counters)

    def eval_agent(n: int) -> ActorAgent:
        return ActorAgent(actor.for_eval(n), n, deterministic=True)

    def checkpoint() -> None:
        save_checkpoint(run, counters["env_steps"], actor.save, {"optimizer": optimizer},
                        {**counters, **evaluator.clock()})

    if state is None and evaluator.every > 0:
        evaluator.maybe_evaluate(0, eval_agent, force=True)  # the base policy: step 0 of the curve

    # ---- the env; chunk actors see obs histories kept by HistoryEnv ----
    history = ObsHistory(actor.n_obs_steps)
    henv = HistoryEnv(env, history)
    obs, _ = henv.reset(seed=int(cfg.seed) + counters["iteration"])
    actor.reset(torch.ones(num_envs, dtype=torch.bool))
    bar = progress(total=int(cfg.env_steps), desc=f"finetune {algo.name}")
    bar.update(min(counters["env_steps"], int(cfg.env_steps)))

    while counters["iteration"] < iterations:
        iteration_start = time.perf_counter()
        # ---- rollout ----
        actor.eval()
        if grpo:
            batch, stats = collect_grpo(env, henv, actor, group_size, max_mdp_steps, sparse_reward)
            mdp_steps = batch["valid"].shape[0]
        else:
            batch, obs, stats = collect_ppo(env, henv, actor, obs, int(algo.num_steps), sparse_reward, shaping,
                                            bootstrap_truncation)
            mdp_steps = int(algo.num_steps)
            advantages, returns = core.gae(batch["reward"], batch["value"], batch["next_value"],
                                           batch["terminated"], batch["truncated"],
                                           float(algo.gamma), float(algo.gae_lambda))
            batch["advantage"], batch["return"] = advantages, returns
            batch["valid"] = torch.ones_like(batch["reward"])
        rollout_s = time.perf_counter() - iteration_start
        env_steps = mdp_steps * num_envs * steps_per_mdp
        counters["env_steps"] += env_steps
        counters["episodes"] += stats["episodes"]

        # ---- flatten [T, N] -> [B] ----
        flat = {k: _flat(v) for k, v in batch.items() if k != "stash"}
        flat_stash = {k: _flat(v) for k, v in batch["stash"].items()}
        valid = flat["valid"].bool()
        advantage = flat["advantage"]
        if bool(algo.norm_adv) and int(valid.sum()) > 1:
            advantage = core.masked_whiten(advantage, valid) * valid
        batch_size = flat["logprob"].shape[0]
        minibatch_size = max(1, batch_size // int(algo.num_minibatches))
        clips = actor.clip_coefs(float(algo.clip))
        adv_weights = actor.advantage_weights().to(device)
        dual_clip = None if algo.dual_clip is None else float(algo.dual_clip)
        value_clip = None if algo.value_clip is None else float(algo.value_clip)
        critic_only = (not grpo) and counters["iteration"] < int(algo.critic_warmup_iters)
        if anneal_lr:  # linear decay to 0 at the last iteration (CleanRL's anneal_lr); resumes exactly
            remaining = 1.0 - counters["iteration"] / iterations
            for group, initial_lr in zip(optimizer.param_groups, initial_lrs):
                group["lr"] = initial_lr * remaining

        # ---- update ----
        actor.train()
        metrics: dict[str, list[float]] = {}
        first_ratio_dev = None
        stop = False
        for _epoch in range(int(algo.update_epochs)):
            order = torch.randperm(batch_size, device=device)
            for begin in range(0, batch_size, minibatch_size):
                mb = order[begin:begin + minibatch_size]
                mb_valid = valid[mb]
                if not bool(mb_valid.any()):
                    continue
                mb_obs = flat["obs"][mb]
                mb_stash = {k: v[mb] for k, v in flat_stash.items()}
                losses: dict[str, torch.Tensor] = {}
                loss = torch.zeros((), device=device)
                if not critic_only:
                    logprob, entropy = actor.evaluate(mb_obs, mb_stash)
                    old_logprob = flat["logprob"][mb]
                    if first_ratio_dev is None:
                        first_ratio_dev = float((logprob.detach() - old_logprob).exp().sub(1).abs().max())
                    mb_adv = advantage[mb][:, None] * adv_weights[None]
                    pg_losses, approx_kl, clipfrac = [], [], []
                    for col, clip in enumerate(clips):
                        pg, info = core.policy_loss(logprob[:, col], old_logprob[:, col], mb_adv[:, col],
                                                    mb_valid, clip_low=clip, clip_high=clip, dual_clip=dual_clip)
                        pg_losses.append(pg)
                        approx_kl.append(info["approx_kl"])
                        clipfrac.append(info["clipfrac"])
                    losses["policy_loss"] = torch.stack(pg_losses).mean()
                    losses["approx_kl"] = torch.stack(approx_kl).mean().detach()
                    losses["clipfrac"] = torch.stack(clipfrac).mean().detach()
                    losses["entropy"] = core.agg_loss(entropy.mean(-1), mb_valid, "token-mean")
                    loss = losses["policy_loss"] - float(algo.ent_coef) * losses["entropy"]
                    if float(algo.base_reg_coef) > 0:
                        losses["base_kl"] = core.agg_loss(actor.base_kl(mb_obs, mb_stash), mb_valid, "token-mean")
                        loss = loss + float(algo.base_reg_coef) * losses["base_kl"]
                if not grpo:
                    losses["value_loss"] = actor.value_loss(mb_obs, mb_stash, flat["value"][mb], flat["return"][mb],
                                                            mb_valid, value_clip)
                    loss = loss + float(algo.vf_coef) * losses["value_loss"]
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(actor.parameters(), float(algo.max_grad_norm))
                optimizer.step()
                for key, value in losses.items():
                    metrics.setdefault(key, []).append(float(value.detach()))
            kl = metrics.get("approx_kl", [0.0])
            if algo.target_kl is not None and not critic_only and kl and kl[-1] > float(algo.target_kl):
                stop = True
            if stop:
                break
        counters["iteration"] += 1

        # ---- log, evaluate, checkpoint ----
        iteration_s = time.perf_counter() - iteration_start
        log = {f"train/{k}": sum(v) / len(v) for k, v in metrics.items()}
        log.update({"train/iteration": counters["iteration"], "train/rollout_s": rollout_s,
                    "train/lr": optimizer.param_groups[0]["lr"],
                    "train/iteration_s": iteration_s, "train/sps": env_steps / iteration_s,
                    "train/early_stop": float(stop), "train/critic_only": float(critic_only)})
        if first_ratio_dev is not None:
            log["train/first_minibatch_ratio_dev"] = first_ratio_dev
        if stats["returns"]:
            log["train/episode_return"] = sum(stats["returns"]) / len(stats["returns"])
            log["train/success_rate"] = sum(stats["successes"]) / len(stats["successes"])
        if grpo:
            log["train/informative_groups"] = stats["informative_groups"]
        run.log(counters["env_steps"], log)
        bar.update(env_steps)
        if int(algo.checkpoint_every) > 0 and counters["iteration"] % int(algo.checkpoint_every) == 0:
            checkpoint()
        evaluator.maybe_evaluate(counters["env_steps"], eval_agent)

    bar.close()
    checkpoint()
    info = evaluator.last_info
    if evaluator.every > 0 and evaluator.last_step != counters["env_steps"]:
        info = evaluator.maybe_evaluate(counters["env_steps"], eval_agent, force=True)
    evaluator.close()
    run.log(counters["env_steps"], {"train/wall_s": evaluator.clock()["wall_s"]})
    return headline_from_eval(info, counters["env_steps"], run)
