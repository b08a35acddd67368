"""embodied-rl collect: run a task's scripted expert in parallel envs and write a demo dataset.

Each env's episode is recorded step by step (state obs, action, reward, the simulator's success
at the state each step reached, optionally pixels, and for a task with instructions the step's
instruction id, with the texts in attrs["instructions"]), with the observation it ended in; a
finished episode is kept if it succeeded (or always, with only_success=false or for a task
without success, like hopper) and was not cut short by unstable physics. Collection stops once
`demos` episodes are kept, or after `max_episodes` attempts (default 20 * demos): then whatever
was kept is written.

`checkpoint=PATH` records a policy checkpoint's rollouts instead of the expert's (BC or
fine-tuned; a run directory stands for its checkpoints/last), successes and failures alike by
default: the data train-reward learns success and progress from (docs/rewards.md).
`action_noise=STD` adds Gaussian noise to the checkpoint's actions (clamped to [-1, 1]): the
exploring rollouts whose failures a reward model must also refuse to pay.

`camera=NAME` (with pixels=true) records that MJCF camera's frames instead of the task's, while a
pixel policy still reads the task's: a reward model's own view (tabletop's `top`, docs/rewards.md).
attrs["camera"] names the camera the frames are from.

`per_instruction=k` makes a few-shot multi-task set: at most k episodes are kept per instruction
(per task of a Meta-World suite). An instruction given 10 * k attempts is given up,
and collection also stops once every instruction of the task is full or given up.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from embodied_rl.envs.render import pool_frames
from embodied_rl.errors import UserError
from embodied_rl.runs import progress, start_run

DEFAULT_NUM_ENVS = 16


def default_num_envs(cfg: DictConfig) -> int:
    """DEFAULT_NUM_ENVS, rounded up to a multiple of a suite's task count: a suite splits its envs
    evenly across its tasks (metaworld/MT50: 50 envs)."""
    suite = len(cfg.task.get("suite_tasks") or []) or 1
    return -(-DEFAULT_NUM_ENVS // suite) * suite


def validate(cfg: DictConfig) -> dict[str, Any]:
    """Check the config before any work (a null num_envs becomes `default_num_envs`, a null
    only_success true for the expert and false for a checkpoint); return the task's options
    (envs.task_overrides)."""
    from omegaconf import open_dict

    from embodied_rl.commands import validate_common
    from embodied_rl.envs import task_overrides

    with open_dict(cfg):
        if cfg.num_envs is None:
            cfg.num_envs = default_num_envs(cfg)
        if cfg.only_success is None:
            cfg.only_success = cfg.checkpoint is None
    validate_common(cfg)
    task_options = task_overrides(cfg.task)
    if not isinstance(cfg.only_success, bool):
        raise UserError(f"only_success must be true, false or null, got {cfg.only_success!r}")
    if cfg.checkpoint is not None:
        if not Path(str(cfg.checkpoint)).expanduser().exists():
            raise UserError(f"checkpoint '{cfg.checkpoint}' does not exist")
        if cfg.quality != cfg.task.get("quality", cfg.quality):
            raise UserError("quality sets the scripted expert's quality; a checkpoint's rollouts have none "
                            "(leave quality out with checkpoint=)")
        if cfg.mistakes:
            raise UserError("mistakes sets how often the scripted expert errs and recovers; a checkpoint's rollouts "
                            "have none (leave mistakes out with checkpoint=)")
    elif cfg.action_noise:
        raise UserError("action_noise perturbs a checkpoint's actions; the scripted expert's noise is quality= "
                        "(set checkpoint=PATH, or leave action_noise out)")
    elif cfg.task.get("expert") is False:
        raise UserError(f"task '{cfg.task.name}' has no scripted expert, so collect cannot make demos for it "
                        "(checkpoint=PATH records a policy's rollouts instead)")
    # demos and quality default to the task's (configs/task/<task>.yaml)
    if not isinstance(cfg.demos, int) or isinstance(cfg.demos, bool):
        raise UserError(f"demos must be an integer >= 1, got {cfg.demos!r}")
    if not isinstance(cfg.quality, (int, float)) or isinstance(cfg.quality, bool):
        raise UserError(f"quality must be a number in [0, 1], got {cfg.quality!r}")
    if cfg.demos < 1:
        raise UserError(f"demos must be >= 1, got {cfg.demos}")
    if not 0.0 <= float(cfg.quality) <= 1.0:
        raise UserError(f"quality must be in [0, 1], got {cfg.quality}")
    mistakes = cfg.mistakes
    if not isinstance(mistakes, (int, float)) or isinstance(mistakes, bool) or not 0.0 <= float(mistakes) <= 1.0:
        raise UserError(f"mistakes must be a number in [0, 1] (a share of episodes), got {mistakes!r}")
    if mistakes and cfg.checkpoint is None and cfg.task.get("expert") is not False:
        from embodied_rl.envs.experts import no_mistakes
        from embodied_rl.envs.registry import expert_module, import_module

        expert = import_module(expert_module(cfg.task.name), f"task '{cfg.task.name}' has no scripted expert").Expert
        if not expert.makes_mistakes:  # refused before the run directory exists
            raise no_mistakes(cfg.task.name)
    if cfg.per_instruction is not None and (not isinstance(cfg.per_instruction, int)
                                            or isinstance(cfg.per_instruction, bool) or cfg.per_instruction < 1):
        raise UserError(f"per_instruction must be null or an integer >= 1, got {cfg.per_instruction!r}")
    noise = cfg.action_noise
    if not isinstance(noise, (int, float)) or isinstance(noise, bool) or not 0.0 <= float(noise) <= 2.0:
        raise UserError(f"action_noise must be a number in [0, 2] (a std in the [-1, 1] action units), got {noise!r}")
    if cfg.camera is not None and not cfg.pixels:
        raise UserError(f"camera={cfg.camera} chooses the camera whose frames are recorded: set pixels=true")
    if cfg.max_episodes is not None and cfg.max_episodes < cfg.demos:
        raise UserError(f"max_episodes ({cfg.max_episodes}) must be >= demos ({cfg.demos})")
    if cfg.out is not None and Path(cfg.out).exists():
        raise UserError(f"out '{cfg.out}' already exists; choose a new path (nothing was overwritten)")
    return task_options


def collect_episodes(env: Any, expert: Any, demos: int, max_episodes: int, only_success: bool,
                     frames_key: str | None, seed: int, per_instruction: int | None = None,
                     ) -> tuple[list[dict[str, np.ndarray]], int, int]:
    """Run the expert (or any agent: `reset(mask)`, `act(obs)`) until `demos` episodes are kept
    (or, with `per_instruction`, every instruction is full or given up); return (kept,
    attempted, successes). The observations' `frames_key` ("pixels" or "reward_pixels") is
    recorded as the episodes' pixels; None records no frames."""
    pixels = frames_key is not None
    n = env.num_envs
    num_instructions = len(env.instructions)
    kept_by = np.zeros(max(num_instructions, 1), dtype=np.int64)  # per instruction id
    attempted_by = np.zeros_like(kept_by)

    def settled() -> bool:
        """Every instruction full or given up (only with per_instruction on a task with instructions)."""
        if per_instruction is None or not num_instructions:
            return False
        return bool(np.all((kept_by >= per_instruction) | (attempted_by >= 10 * per_instruction)))

    obs, _ = env.reset(seed=seed)
    expert.reset(torch.ones(n, dtype=torch.bool))

    def empty() -> dict[str, list]:
        return {"obs": [], "action": [], "reward": [], "step_success": [], "pixels": [], "instruction": []}

    buffers = [empty() for _ in range(n)]
    kept: list[dict[str, np.ndarray]] = []
    attempted = successes = 0
    bar = progress(total=demos, desc="collect")
    while len(kept) < demos and attempted < max_episodes and not settled():
        action = expert.act(obs)
        state = (obs["state"] if isinstance(obs, dict) else obs).cpu().numpy()
        frames = obs[frames_key].cpu().numpy() if pixels else None
        instruction = obs["instruction"].cpu().numpy() if isinstance(obs, dict) and "instruction" in obs else None
        obs, reward, _, _, info = env.step(action)
        action_np, reward_np, success_np = action.cpu().numpy(), reward.cpu().numpy(), info["success"].cpu().numpy()
        for i in range(n):
            buffers[i]["obs"].append(state[i])
            buffers[i]["action"].append(action_np[i])
            buffers[i]["reward"].append(reward_np[i])
            buffers[i]["step_success"].append(success_np[i])
            if pixels:
                buffers[i]["pixels"].append(frames[i])
            if instruction is not None:
                buffers[i]["instruction"].append(instruction[i])
        done = info["_episode"].cpu()
        success_once = info["episode"]["success_once"].cpu()
        unstable = info["unstable"].cpu()
        final = info["final_obs"]  # the observation each finished episode ended in
        final_state = (final["state"] if isinstance(final, dict) else final).cpu().numpy()
        final_frames = final[frames_key].cpu().numpy() if pixels else None
        for i in torch.nonzero(done).flatten().tolist():
            attempted += 1
            success = bool(success_once[i]) and not bool(unstable[i])
            successes += int(success)
            instruction_id = int(buffers[i]["instruction"][0]) if buffers[i]["instruction"] else 0
            attempted_by[instruction_id] += 1
            room = per_instruction is None or kept_by[instruction_id] < per_instruction
            if (success or not only_success) and not bool(unstable[i]) and len(kept) < demos and room:
                kept_by[instruction_id] += 1
                episode = {key: np.stack(value) for key, value in buffers[i].items() if value}
                episode["success"] = success
                episode["final_obs"] = final_state[i]
                if pixels:
                    episode["final_pixels"] = final_frames[i]
                kept.append(episode)
                bar.set_postfix(success=f"{100 * successes / attempted:.0f}%")
                bar.update(1)
            buffers[i] = empty()
        expert.reset(done)
    bar.close()
    return kept, attempted, successes


def recorded_camera(cfg: DictConfig) -> str | None:
    """The camera whose frames collect records (None without pixels=true): `camera`, else the task's."""
    from embodied_rl.envs.registry import is_task, task_class

    if not cfg.pixels:
        return None
    if cfg.camera is not None:
        return str(cfg.camera)
    return task_class(cfg.task.name).camera if is_task(cfg.task.name) else ""


def env_options(cfg: DictConfig, policy: Any | None) -> dict[str, Any]:
    """The envs.make keywords of what is recorded (frames at image_size with pixels=true; of
    `camera` as obs["reward_pixels"] where it is not the task's) and, for a checkpoint, of what
    its policy reads: a state policy ignores the frames, a pixel policy reads the task camera's
    pooled to its size (PooledFramesAgent), so image_size must be its size or a multiple of it
    (finer frames for a reward model, docs/rewards.md)."""
    from embodied_rl.envs.registry import task_class

    options: dict[str, Any] = {"obs_mode": "pixels" if cfg.pixels else "state", "image_size": int(cfg.image_size)}
    if cfg.camera is not None and cfg.camera != task_class(cfg.task.name).camera:
        options["reward_camera"] = str(cfg.camera)
    if policy is not None and policy.obs_mode == "pixels":
        size = policy.env_options()["image_size"]
        if cfg.pixels and int(cfg.image_size) % size:
            raise UserError(f"checkpoint '{cfg.checkpoint}' reads {size}x{size} frames, so the recorded ones must be "
                            f"that size or a multiple of it: image_size={size}, {2 * size}, ...")
        options.update(obs_mode="pixels", image_size=int(cfg.image_size) if cfg.pixels else size)
    return options


class NoisyAgent:
    """An agent whose actions get Gaussian noise of std `std`, clamped to [-1, 1]."""

    def __init__(self, agent: Any, std: float, seed: int):
        self.agent, self.std = agent, std
        self.generator = torch.Generator().manual_seed(seed)

    def reset(self, mask: torch.Tensor | None = None) -> None:
        self.agent.reset(mask)

    def act(self, obs: Any) -> torch.Tensor:
        actions = self.agent.act(obs)
        noise = torch.randn(actions.shape, generator=self.generator).to(actions.device, actions.dtype)
        return (actions + self.std * noise).clamp(-1.0, 1.0)


class PooledFramesAgent:
    """A pixel policy's agent that reads the env's frames pooled to its own size."""

    def __init__(self, agent: Any, image_size: int):
        self.agent, self.image_size = agent, image_size

    def reset(self, mask: torch.Tensor | None = None) -> None:
        self.agent.reset(mask)

    def act(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.agent.act({**obs, "pixels": pool_frames(obs["pixels"], self.image_size)})


def main(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    from embodied_rl.data import write_demos
    from embodied_rl.envs import make, make_expert
    from embodied_rl.envs.registry import resolve_backend

    task_options = validate(cfg)
    started = time.perf_counter()
    policy = agent = None
    if cfg.checkpoint is not None:  # a policy's rollouts instead of the expert's
        from embodied_rl.commands import load_checkpoint_agent
        from embodied_rl.eval.evaluate import seed_agent

        checkpoint, policy, agent, _ = load_checkpoint_agent(cfg.checkpoint, cfg.num_envs, str(cfg.device),
                                                             cfg.task.name)
        seed_agent(agent, int(cfg.seed) + 1)
    # the env first: a task or backend it refuses leaves no run directory behind
    options = env_options(cfg, policy)
    env = make(cfg.task.name, num_envs=cfg.num_envs, backend=cfg.backend, device=cfg.device, seed=cfg.seed,
               task_options=task_options, **options)
    try:
        run = start_run(cfg, "collect")
        out = Path(cfg.out) if cfg.out is not None else run.file("demos.zarr")
        if policy is not None and policy.obs_mode == "pixels":
            agent = PooledFramesAgent(agent, policy.env_options()["image_size"])
        if agent is not None and cfg.action_noise:
            agent = NoisyAgent(agent, float(cfg.action_noise), int(cfg.seed) + 2)
        if agent is None:
            generator = torch.Generator().manual_seed(int(cfg.seed) + 1)
            agent = make_expert(cfg.task.name, env, quality=float(cfg.quality), generator=generator,
                                mistakes=float(cfg.mistakes))
        max_episodes = cfg.max_episodes if cfg.max_episodes is not None else 20 * cfg.demos
        # a task without success (reward-only, e.g. hopper) keeps every stable episode
        has_success = bool(env.task.has_success)
        kept, attempted, successes = collect_episodes(
            env, agent, cfg.demos, max_episodes, cfg.only_success and has_success,
            ("reward_pixels" if "reward_camera" in options else "pixels") if cfg.pixels else None, cfg.seed,
            cfg.per_instruction,
        )
        obs_dim, action_dim = env.task.obs_dim, env.task.action_dim
        instructions = list(env.instructions)
    finally:
        env.close()
    # a task without success reports no success rate; the demos' mean return stands in
    success_rate = successes / max(attempted, 1) if has_success else None
    demo_return = float(np.mean([episode["reward"].sum() for episode in kept])) if kept else None
    who = "expert" if cfg.checkpoint is None else "policy"  # whose success rate it is
    if not kept:
        raise UserError(
            f"the {who} kept no episode in {attempted} attempts (success rate {success_rate or 0:.2f}); "
            + ("raise quality or set only_success=false" if who == "expert" else "set only_success=false")
        )
    source = ({"quality": float(cfg.quality), "mistakes": float(cfg.mistakes)} if who == "expert"
              else {"checkpoint": str(checkpoint), "action_noise": float(cfg.action_noise)})
    attrs = {
        "task": cfg.task.name, "obs_dim": obs_dim, "action_dim": action_dim, **source, "seed": int(cfg.seed),
        "backend": resolve_backend(cfg.task.name, cfg.backend),
        "only_success": bool(cfg.only_success), f"{who}_success_rate": success_rate,
    }
    if instructions:
        attrs["instructions"] = instructions
    if cfg.pixels:
        attrs["camera"] = recorded_camera(cfg)
    write_demos(out, kept, attrs)
    info = {
        "task": cfg.task.name,
        "dataset": str(out),
        "episodes_written": len(kept),
        "episodes_attempted": attempted,
        f"{who}_success_rate": success_rate,
        "demo_return_mean": demo_return,
        **source,
        "per_instruction": cfg.per_instruction,
        "seed": int(cfg.seed),
        "pixels": bool(cfg.pixels),
        "wall_time_s": time.perf_counter() - started,
    }
    if who == "expert" and success_rate is not None and success_rate < 0.9:
        # An expert below 90% (e.g. some Meta-World scripted policies) makes noisy demos unless
        # its failures are dropped, which only_success=true (the default) does.
        kept_what = "only its successful episodes were kept" if cfg.only_success else \
            "its failed episodes were kept too (only_success=false)"
        info["note"] = f"the expert succeeded in {success_rate:.0%} of {attempted} episodes (< 90%); {kept_what}"
    run.write_json("collect_info.json", info)
    run.close()
    quality_key, quality_value = ((f"{who}_success_rate", success_rate) if has_success
                                  else ("demo_return_mean", demo_return))
    headline = {"dataset": str(out), quality_key: quality_value, "episodes_written": len(kept)}
    if "note" in info:
        headline["note"] = info["note"]
    if len(kept) < cfg.demos:
        headline["warning"] = f"only {len(kept)} of {cfg.demos} episodes kept after {attempted} attempts"
    return headline, run.path
