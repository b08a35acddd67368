"""Backend `envpool`: EnvPool's C++ engine behind the BatchedEnv contract.

EnvPool (https://github.com/sail-sg/envpool) steps a batch of envs in its own C++ thread pool
with one Python call. It ships gym MuJoCo (Hopper-v5 ...), a native port of Meta-World v3,
gymnasium-robotics ports, MuJoCo Playground and MyoSuite. This backend runs

- any EnvPool id (`make("Hopper-v5", backend="envpool")`), and
- the Meta-World tasks and suites of this package (`make("metaworld/pick-place")`,
  `make("metaworld/MT10")`): one EnvPool pool per task of the suite, the N envs split evenly
  across them in order, all pools stepped at once (send to every pool, then receive).

What EnvPool does differently from the contract, and how this module bridges it:

- Auto-reset: EnvPool resets a finished env on the *next* step (that step ignores its action).
  Here a finished env is reset explicitly in the same step, so `step` returns the first
  observation of its next episode, with the true last one in `info["final_obs"]`.
- Seeds: EnvPool seeds each env once, when the pool is made (`env_seed`), and each env then
  draws its episodes from its own stream: its k-th reset gives the same state whatever the env
  did in between. `reset(seed=s)` therefore remakes the pools with env i seeded s + i. A grouped
  reset (`group_size=G`) makes them once with one seed per group of G envs; later grouped resets
  keep the pools and reset each group's envs until all stand at the same next draw of their
  shared stream (an env that ended early and auto-reset mid-rollout is ahead; the others catch
  up), so the group starts from one state. Remaking costs ~30 ms per env (MuJoCo model
  compilation) and does not give all memory back: MT50's 400 envs held 6.3 GB and grew 0.3-1.2
  GB per remake, so GRPO remaking every iteration ran out of memory. A partial reset (`env_ids`)
  continues each env's own stream and takes no seed.
- Success: `info["success"]` is the env's own success key (Meta-World: `success`;
  gymnasium-robotics: `is_success`); False for an env without one (gym MuJoCo).
- No snapshots: EnvPool exposes no simulator state, so `get_state`/`set_state` raise and a
  resumed fine-tuning run restarts its episodes (`can_snapshot` is False).
- Rendering: EnvPool's renderer (`render_mode="rgb_array"`) took ~130 ms per frame here at any
  size, so `render(env_ids)` is for evaluation videos; pixel observations are refused.
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium
import numpy as np
import torch

from embodied_rl.envs.api import BatchedEnv, EpisodeStats, Task
from embodied_rl.errors import UserError

# Info keys that envs use for task success; the first one present wins.
SUCCESS_KEYS = ("success", "is_success")
OPTIONS = ("num_threads", "env_kwargs")


def import_envpool():
    # EnvPool's renderer needs mujoco's GL setup done first, so mujoco is imported before it.
    import mujoco  # noqa: F401

    try:
        import envpool
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] == "envpool":
            raise UserError("backend 'envpool' needs EnvPool: pip install 'embodied-rl[envpool]'") from None
        raise
    return envpool


class EnvPoolEnv(BatchedEnv):
    """N envs run by EnvPool: one pool per env id, the N envs split evenly across the ids.

    Args:
        env_ids: EnvPool ids, e.g. ["Hopper-v5"] or the ten MetaWorld/<Task>-v3 ids of MT10.
        num_envs: N, a multiple of len(env_ids).
        seed: env i's seed at the first reset is seed + i.
        device: torch device of the returned tensors (EnvPool runs on the CPU).
        task: the Task these envs run (a MetaWorldTask) or None for a bare EnvPool id. A task
            with instructions makes observations dicts {"state", "instruction"}, where env i's
            instruction is the index of its env id.
        max_episode_steps: the time limit (default: the task's, else EnvPool's own).
        success_terminates: end an episode at its first success (for tasks that do not).
        num_threads: EnvPool worker threads per pool (0: one per available core, at most the
            pool's envs).
        render_size: frame size of `render()`.
        env_kwargs: extra EnvPool config, passed to every pool (e.g. reset_noise_scale).
    """

    can_snapshot = False

    def __init__(
        self,
        env_ids: list[str],
        num_envs: int = 1,
        seed: int = 0,
        device: str | torch.device = "cpu",
        task: Task | None = None,
        max_episode_steps: int | None = None,
        success_terminates: bool = False,
        num_threads: int = 0,
        render_size: int = 256,
        env_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._envpool = import_envpool()
        if num_envs < 1:
            raise UserError(f"num_envs must be >= 1, got {num_envs}")
        if num_envs % len(env_ids):
            fitting = len(env_ids) * max(1, round(num_envs / len(env_ids)))
            raise UserError(f"num_envs={num_envs} must be a multiple of the {len(env_ids)} tasks it is split across "
                            f"(e.g. num_envs={fitting})")
        if not isinstance(num_threads, int) or num_threads < 0:
            raise UserError(f"num_threads must be an integer >= 0, got {num_threads!r}")
        known = set(self._envpool.list_all_envs())
        for env_id in env_ids:
            if env_id not in known:
                raise UserError(f"EnvPool has no env {env_id!r} (envpool.list_all_envs() lists them)")
        self.env_ids = list(env_ids)
        self.task = task
        self.num_envs = int(num_envs)
        self.device = torch.device(device)
        self.per_pool = self.num_envs // len(env_ids)
        self.success_terminates = bool(success_terminates)
        self.render_size = int(render_size)
        self._seed = int(seed)
        self._pools: list[Any] = []
        self._fresh = False  # pools made and reset, not stepped since
        self._seed_group_size = 1  # the pools were made with one seed per group of this many envs
        self._draws = np.zeros(self.num_envs, dtype=np.int64)  # resets each env took since its pool was made
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._num_threads = min(num_threads or cores, self.per_pool)
        self._config: dict[str, Any] = dict(env_kwargs or {})
        if max_episode_steps is not None:
            self._config["max_episode_steps"] = int(max_episode_steps)
        if any(env_id.startswith("MetaWorld/") for env_id in env_ids):
            self._config.setdefault("partially_observable", False)  # the goal is in the observation

        # Spaces from one small pool: a bad config key fails here with one line.
        probe = self._make_pool(self.env_ids[0], [self._seed])
        obs_space, act_space = probe.observation_space, probe.action_space
        self.max_episode_steps = int(probe.spec.config.max_episode_steps)
        probe.close()
        if not isinstance(obs_space, gymnasium.spaces.Box) or not isinstance(act_space, gymnasium.spaces.Box):
            raise UserError(f"{self.env_ids[0]!r} has {type(obs_space).__name__} observations and "
                            f"{type(act_space).__name__} actions; the envpool backend takes Box ones only")
        self.obs_dim = int(np.prod(obs_space.shape))
        self._act_low = act_space.low.astype(np.float64).reshape(-1)
        self._act_high = act_space.high.astype(np.float64).reshape(-1)
        if task is not None and (self.obs_dim, self._act_low.size) != (task.obs_dim, task.action_dim):
            raise UserError(f"{self.env_ids[0]!r} has observation and action sizes {(self.obs_dim, self._act_low.size)}, "
                            f"task '{task.name}' {(task.obs_dim, task.action_dim)}")

        state_space = gymnasium.spaces.Box(-np.inf, np.inf, (self.obs_dim,), np.float32)
        self._instruction: torch.Tensor | None = None
        if task is not None and task.instructions:
            self._instruction = torch.arange(self.num_envs) // self.per_pool  # env i's task index
            self.single_observation_space = gymnasium.spaces.Dict(
                {"state": state_space, "instruction": gymnasium.spaces.Discrete(len(task.instructions))})
        else:
            self.single_observation_space = state_space
        self.single_action_space = gymnasium.spaces.Box(-1.0, 1.0, (self._act_low.size,), np.float32)
        self.stats = EpisodeStats(self.num_envs, torch.device("cpu"))
        # Draws the seeds of grouped resets.
        self.generator = torch.Generator()
        self.generator.manual_seed(self._seed)
        self._obs = np.zeros((self.num_envs, self.obs_dim), dtype=np.float32)

    # ---------------------------------------------------------------- pools

    def _make_pool(self, env_id: str, env_seeds: list[int]):
        try:
            return self._envpool.make(
                env_id, env_type="gymnasium", num_envs=len(env_seeds), batch_size=len(env_seeds),
                num_threads=min(self._num_threads, len(env_seeds)),
                seed=int(env_seeds[0]), env_seed=[int(s) for s in env_seeds],
                render_mode="rgb_array", render_width=self.render_size, render_height=self.render_size,
                **self._config)
        except (TypeError, ValueError, KeyError) as error:
            raise UserError(f"EnvPool could not make {env_id!r} with {self._config}: {error}") from None

    def _remake(self, env_seeds: list[int], group_size: int = 1) -> None:
        """Close the pools and make new ones, env i seeded env_seeds[i] (one seed per group of
        `group_size` consecutive envs); reset every env."""
        self.close()
        self._pools = [self._make_pool(env_id, env_seeds[k * self.per_pool:(k + 1) * self.per_pool])
                       for k, env_id in enumerate(self.env_ids)]
        self._seed_group_size = group_size
        self._draws[:] = 0
        self._reset_rows(np.arange(self.num_envs))
        self._fresh = True

    def _rows(self, pool_index: int, local_ids: np.ndarray) -> np.ndarray:
        return pool_index * self.per_pool + np.asarray(local_ids, dtype=np.int64)

    def _flat(self, obs: np.ndarray) -> np.ndarray:
        return np.asarray(obs, dtype=np.float32).reshape(len(obs), self.obs_dim)

    def _reset_rows(self, rows: np.ndarray) -> None:
        """Reset the envs `rows` (global indices) in their pools; their new first obs go to _obs.

        Every pool's resets are queued before any is awaited, so the pools reset in parallel, as
        they step: a Meta-World reset costs ~50 env steps (it settles the arm), and awaiting each
        pool's in turn made the same-step auto-resets of MT50's 50 pools a serial bottleneck
        (`pool.reset(ids)` is EnvPool's `_reset(ids)` followed by `recv`, split here)."""
        pool_of = rows // self.per_pool
        pools = np.unique(pool_of)
        for k in pools:
            self._pools[k]._reset((rows[pool_of == k] - k * self.per_pool).astype(np.int32))
        for k in pools:
            obs, info = self._pools[k].recv(reset=True, return_info=True)
            self._obs[self._rows(k, info["env_id"])] = self._flat(obs)
        self._draws[rows] += 1

    def _align_groups(self, group_size: int) -> None:
        """Reset every env until each group's envs stand at the same next draw of their stream."""
        target = self._draws.reshape(-1, group_size).max(axis=1) + 1
        owed = np.repeat(target, group_size) - self._draws
        while owed.any():
            rows = np.flatnonzero(owed > 0)
            self._reset_rows(rows)
            owed[rows] -= 1
        self._fresh = True

    # ---------------------------------------------------------------- reset / step

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None,
              group_size: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Reset all envs, or only `env_ids` (indices or a bool[N] mask); return obs of all N.

        With a seed (all envs only), env i starts a new stream seeded seed + i. `group_size=G`
        (all envs only) gives each group of G consecutive envs one seed, drawn from this env's
        generator, so the group starts from the same state; a later grouped reset without a seed
        takes each group's next state from that same stream (the module docstring says how).
        """
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        everything = env_ids is None or not self._pools
        if not everything and (seed is not None or (group_size or 1) > 1):
            raise ValueError("the envpool backend seeds envs only when it resets all of them: "
                             "reset(seed=...) and reset(group_size=...) take no env_ids")
        if (group_size or 1) > 1:
            if self.per_pool % group_size:
                # a group must start from one state of one task: it may not straddle two tasks' envs
                raise UserError(f"group_size={group_size} must divide the envs per task: {self.num_envs} envs over "
                                f"{len(self.env_ids)} tasks give {self.per_pool} each (choose num_envs a multiple of "
                                f"{len(self.env_ids) * group_size})")
            if seed is None and self._pools and self._seed_group_size == group_size:
                self._align_groups(group_size)
            else:
                if seed is not None:
                    self.generator.manual_seed(int(seed))
                groups = torch.randint(0, 2**31 - 1, (self.num_envs // group_size,), generator=self.generator)
                self._remake(groups.repeat_interleave(group_size).tolist(), group_size)
            ids = np.arange(self.num_envs)
        elif everything:
            if seed is not None or not self._pools:
                base = self._seed if seed is None else int(seed)
                self._remake([base + i for i in range(self.num_envs)])
            elif not self._fresh:
                self._reset_rows(np.arange(self.num_envs))
            ids = np.arange(self.num_envs)
        else:
            ids = self._env_ids(env_ids).numpy().astype(np.int64)
            if len(ids):
                self._reset_rows(ids)
        self.stats.clear(torch.from_numpy(ids))
        return self._observation(self._obs, self.device), {}

    def step(self, action: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        if not self._pools:
            raise RuntimeError("call reset() before step()")
        self._fresh = False
        action = self.check_action(action).cpu().double().numpy()  # validated, in [-1, 1]
        env_action = self._act_low + (action + 1.0) / 2.0 * (self._act_high - self._act_low)

        # One batched call per pool, all pools in flight at once.
        for k, pool in enumerate(self._pools):
            rows = slice(k * self.per_pool, (k + 1) * self.per_pool)
            pool.send(env_action[rows], np.arange(self.per_pool, dtype=np.int32))
        reward = np.zeros(self.num_envs, dtype=np.float32)
        terminated = np.zeros(self.num_envs, dtype=bool)
        truncated = np.zeros(self.num_envs, dtype=bool)
        success = np.zeros(self.num_envs, dtype=bool)
        for k, pool in enumerate(self._pools):
            obs, rew, term, trunc, info = pool.recv()
            rows = self._rows(k, info["env_id"])
            self._obs[rows] = self._flat(obs)
            reward[rows], terminated[rows], truncated[rows] = rew, term, trunc
            key = next((key for key in SUCCESS_KEYS if key in info), None)
            if key is not None:
                success[rows] = np.asarray(info[key]) > 0
        if self.success_terminates:
            terminated |= success
        truncated &= ~terminated  # the contract: truncated = time limit and not terminated
        done = terminated | truncated

        success_t = torch.from_numpy(success)
        self.stats.update(torch.from_numpy(reward), success_t)
        final_obs = self._observation(self._obs, "cpu")
        done_rows = np.flatnonzero(done)
        if len(done_rows):
            self._reset_rows(done_rows)  # same-step auto-reset
        info_out: dict[str, Any] = {
            "success": success_t,
            "unstable": torch.zeros(self.num_envs, dtype=torch.bool),  # not detected here
            "_final": torch.from_numpy(done),
            "final_obs": final_obs,
            "_episode": torch.from_numpy(done),
            "episode": self.stats.snapshot(),
        }
        self.stats.clear(torch.from_numpy(done_rows))
        info_out = {key: ({k: v.to(self.device) for k, v in value.items()} if isinstance(value, dict)
                          else value.to(self.device)) for key, value in info_out.items()}
        return (self._observation(self._obs, self.device), torch.from_numpy(reward).to(self.device),
                torch.from_numpy(terminated).to(self.device), torch.from_numpy(truncated).to(self.device), info_out)

    # ---------------------------------------------------------------- render / misc

    @property
    def simulator(self) -> dict[str, str]:
        return {"envpool": str(getattr(self._envpool, "__version__", "unknown"))}  # its MuJoCo is built in

    def render(self, env_ids: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """uint8 Tensor[k, render_size, render_size, 3] of the envs `env_ids` (all when None)."""
        if not self._pools:
            raise RuntimeError("call reset() before render()")
        ids = self._env_ids(env_ids).numpy().astype(np.int64)
        frames = np.zeros((len(ids), self.render_size, self.render_size, 3), dtype=np.uint8)
        pool_of = ids // self.per_pool
        for k in np.unique(pool_of):
            where = np.flatnonzero(pool_of == k)
            local = (ids[where] - k * self.per_pool).astype(np.int32)
            frames[where] = np.asarray(self._pools[k].render(local))[..., :3]
        return torch.from_numpy(frames)

    def close(self) -> None:
        for pool in self._pools:
            pool.close()
        self._pools = []

    def _observation(self, obs: np.ndarray, device: torch.device | str) -> Any:
        state = torch.from_numpy(obs.copy()).to(device)
        if self._instruction is None:
            return state
        return {"state": state, "instruction": self._instruction.to(device)}


def make_env(task: Task | str, num_envs: int, device: str | torch.device = "cpu", seed: int = 0, *,
             obs_mode: str = "state", image_size: int = 96, render_size: int = 256,
             **options: Any) -> EnvPoolEnv:
    """The registry's entry point: `task` is a MetaWorldTask (or another Task with `envpool_ids`)
    or a bare EnvPool id. Options: num_threads, env_kwargs (EnvPool config for every pool), and for
    a bare id max_episode_steps. image_size does not apply (no pixel observations)."""
    if obs_mode != "state":
        raise UserError("the envpool backend supports obs_mode='state' only (EnvPool's renderer took ~130 ms "
                        "per frame here, too slow for pixel observations; videos still work)")
    allowed = set(OPTIONS) | ({"max_episode_steps"} if isinstance(task, str) else set())
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise UserError(f"unknown option(s) {unknown} for the envpool backend (choose from: {', '.join(sorted(allowed))})")
    if isinstance(task, str):
        return EnvPoolEnv([task], num_envs=num_envs, seed=seed, device=device, render_size=render_size, **options)
    if not hasattr(task, "envpool_ids"):
        raise UserError(f"task '{task.name}' does not run on EnvPool (its backends: {', '.join(task.backends)})")
    return EnvPoolEnv(task.envpool_ids, num_envs=num_envs, seed=seed, device=device, task=task,
                      max_episode_steps=task.max_episode_steps, success_terminates=task.success_terminates,
                      render_size=render_size, **options)
