"""Executing action chunks one action per env step (the agent protocol: `reset(mask)`, `act(obs)`).

    ObsHistory      the last n_obs_steps observations per env
    ChunkExecutor   an ObsHistory and a queue of planned actions per env; replans the envs whose
                    queue is empty with `plan(history, envs)`, which a subclass provides
    PolicyRunner    a ChunkExecutor that plans with a ChunkPolicy (the BC agent)

    runner = PolicyRunner(policy, num_envs, seed=0)
    runner.reset()                       # all envs (or reset(mask) for some)
    action = runner.act(obs)             # obs: Tensor[N, D] or {"state": [N, D], "pixels": [N, h, w, 3]}

Per env the executor keeps the last n_obs_steps observations (filled with the first observation
after a reset) and a queue of n_action_steps actions taken from the planned chunk starting at
index n_obs_steps - 1 (the chunk's step for the current observation, as in diffusion_policy). An
env replans only when its queue is empty; after partial resets envs drift out of sync, so a plan
covers the subset that needs one. `reset(mask)` clears those envs' history and queue, so a queue
never leaks into the next episode. `state_dict()` / `load_state_dict()` carry all of it (and the
sampling generator) across a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from embodied_rl.errors import UserError
from embodied_rl.policies.base import ChunkPolicy, Obs


def map_obs(fn: Callable[..., Tensor], obs: Obs, *others: Obs) -> Obs:
    """`fn` applied to a tensor observation, or to each entry of a dict observation (with the same
    entry of `others`)."""
    if isinstance(obs, dict):
        return {key: fn(value, *(other[key] for other in others)) for key, value in obs.items()}
    return fn(obs, *others)


def index_obs(obs: Obs, index: Tensor | slice) -> Obs:
    """The rows `index` of a tensor or dict observation."""
    return map_obs(lambda o: o[index], obs)


def where_obs(mask: Tensor, obs: Obs, other: Obs) -> Obs:
    """Per env (mask [N]): the rows of `obs` where mask is set, else those of `other`."""
    return map_obs(lambda a, b: torch.where(mask.to(a.device).view(-1, *([1] * (a.ndim - 1))), a, b), obs, other)


def first_tensor(obs: Obs) -> Tensor:
    return next(iter(obs.values())) if isinstance(obs, dict) else obs


def executed_actions(policy: Any, chunk: Tensor) -> Tensor:
    """The part of a chunk [N, H, A] that is executed: n_action_steps actions from index
    n_obs_steps - 1 (the chunk starts at the oldest observation of the history)."""
    start = int(policy.n_obs_steps) - 1
    return chunk[:, start : start + int(policy.n_action_steps)]


class ObsHistory:
    """The last `n_obs_steps` observations per env: [N, n_obs_steps, ...] (a tensor, or a dict of
    them for observations with several entries). An env whose episode starts has its first
    observation repeated, what a policy trained on episode windows saw at t=0."""

    def __init__(self, n_obs_steps: int):
        self.n_obs_steps = int(n_obs_steps)
        self.buffer: Obs | None = None

    def reset(self, obs: Obs, mask: Tensor | None = None) -> Obs:
        """Refill the rows in `mask` (every row when None) with `obs` repeated."""
        def repeated(o: Tensor) -> Tensor:
            return o[:, None].expand(-1, self.n_obs_steps, *o.shape[1:]).clone()

        def refill(h: Tensor, o: Tensor) -> Tensor:
            where = mask.to(h.device).view(-1, *([1] * (h.ndim - 1)))
            return torch.where(where, repeated(o), h)

        if self.buffer is None or mask is None:
            self.buffer = map_obs(repeated, obs)
        else:
            self.buffer = map_obs(refill, self.buffer, obs)
        return self.buffer

    def push(self, obs: Obs, new_episode: Tensor | None = None) -> Obs:
        """Append `obs`, dropping the oldest; rows in `new_episode` restart with `obs` repeated."""
        if self.buffer is None:
            return self.reset(obs)
        self.buffer = map_obs(lambda h, o: torch.cat([h[:, 1:], o[:, None]], dim=1), self.buffer, obs)
        if new_episode is not None:
            self.reset(obs, new_episode)
        return self.buffer

    def get(self) -> Obs:
        """A copy of the history."""
        return map_obs(torch.clone, self.buffer)

    def to(self, device: torch.device) -> None:
        if self.buffer is not None:
            self.buffer = map_obs(lambda h: h.to(device), self.buffer)

    def state_dict(self) -> dict[str, Tensor]:
        """{"obs": [N, To, ...]} or {"obs.<key>": ...} per entry of a dict observation; {} before
        the first observation."""
        if self.buffer is None:
            return {}
        if isinstance(self.buffer, dict):
            return {f"obs.{key}": value for key, value in self.buffer.items()}
        return {"obs": self.buffer}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if "obs" in state:
            self.buffer = state["obs"]
        else:
            entries = {key.removeprefix("obs."): value for key, value in state.items() if key.startswith("obs.")}
            self.buffer = entries or None


class ChunkExecutor:
    """Executes chunks one action per env step; see the module docstring. A subclass implements
    `plan(history, envs) -> Tensor[len(envs), n_action_steps, A]`: the actions to queue for the
    envs `envs` (indices into N), given every env's history."""

    def __init__(self, num_envs: int, n_obs_steps: int, n_action_steps: int, action_dim: int,
                 generator: torch.Generator | None = None):
        self.num_envs = int(num_envs)
        self.n_action_steps = int(n_action_steps)
        self.history = ObsHistory(n_obs_steps)
        self.queue = torch.zeros(self.num_envs, self.n_action_steps, int(action_dim))
        # index of each env's next queued action; n_action_steps: the queue is empty
        self.next_index = torch.full((self.num_envs,), self.n_action_steps, dtype=torch.long)
        self.fresh = torch.ones(self.num_envs, dtype=torch.bool)  # a new episode: refill the history
        self.generator = generator  # the planner's sampling noise, when it has its own
        self.num_replans = 0  # envs planned for, summed over calls (tests and diagnostics)

    def plan(self, history: Obs, envs: Tensor) -> Tensor:
        raise NotImplementedError

    def reset(self, mask: Tensor | None = None) -> None:
        """Forget the obs history and the action queue of the envs where `mask` is set (all: None)."""
        if mask is None:
            mask = torch.ones(self.num_envs, dtype=torch.bool)
        mask = torch.as_tensor(mask, dtype=torch.bool).reshape(self.num_envs).to(self.fresh.device)
        self.fresh |= mask
        self.next_index[mask] = self.n_action_steps

    @torch.no_grad()
    def act(self, obs: Obs) -> Tensor:
        """One action per env, [N, A], on the device of `obs`."""
        first = first_tensor(obs)
        if len(first) != self.num_envs:
            raise ValueError(f"{type(self).__name__} was built for {self.num_envs} envs, got obs for {len(first)}")
        self._to(first.device)
        history = self.history.push(obs, self.fresh)
        self.fresh[:] = False
        envs = (self.next_index >= self.n_action_steps).nonzero().squeeze(1)
        if len(envs) > 0:
            self.queue[envs] = self.plan(history, envs).to(self.queue)
            self.next_index[envs] = 0
            self.num_replans += len(envs)
        action = self.queue[torch.arange(self.num_envs, device=first.device), self.next_index]
        self.next_index += 1
        return action

    @torch.no_grad()
    def peek(self, obs: Obs, mask: Tensor) -> Tensor:
        """The action each env in `mask` would take next if `obs` were its next observation (e.g. a
        truncated episode's final observation, to bootstrap from); zero outside the mask. Nothing
        changes but the generator, which an env with an empty queue plans with."""
        first = first_tensor(obs)
        self._to(first.device)
        out = torch.zeros(self.num_envs, self.queue.shape[-1], device=first.device)
        mask = mask.to(first.device)
        queued = self.next_index < self.n_action_steps
        take = (mask & queued).nonzero().squeeze(1)
        out[take] = self.queue[take, self.next_index[take]]
        envs = (mask & ~queued).nonzero().squeeze(1)
        if len(envs) > 0:
            history = map_obs(lambda h, o: torch.cat([h[:, 1:], o[:, None]], dim=1), self.history.buffer, obs)
            out[envs] = self.plan(history, envs)[:, 0].to(out)
        return out

    def _to(self, device: torch.device) -> None:
        """Keep every per-env tensor on the device of the observations."""
        if self.queue.device != device:
            self.queue, self.next_index, self.fresh = (t.to(device) for t in (self.queue, self.next_index, self.fresh))
            self.history.to(device)

    def state_dict(self) -> dict[str, Tensor]:
        """Copies, on the CPU, of the per-env state (history, queue, next_index, fresh) and of the
        generator's state."""
        state = {"queue": self.queue, "next_index": self.next_index, "fresh": self.fresh}
        state.update({f"history.{key}": value for key, value in self.history.state_dict().items()})
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return {key: value.detach().to("cpu", copy=True) for key, value in state.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore what `state_dict` returned (the executor continues exactly where it was)."""
        missing = [key for key in ("queue", "next_index", "fresh") if key not in state]
        if self.generator is not None and "generator" not in state:
            missing.append("generator")
        if missing:
            raise UserError(f"executor state lacks '{missing[0]}'")
        if tuple(state["queue"].shape) != tuple(self.queue.shape):
            raise UserError(f"executor state has a queue of shape {list(state['queue'].shape)}, "
                            f"expected {list(self.queue.shape)}")
        device = self.queue.device
        self.queue = state["queue"].to(device, torch.float32, copy=True)
        self.next_index = state["next_index"].to(device, torch.long, copy=True)
        self.fresh = state["fresh"].to(device, torch.bool, copy=True)
        self.history.load_state_dict({key.removeprefix("history."): value.to(device, copy=True)
                                      for key, value in state.items() if key.startswith("history.")})
        if self.generator is not None:
            self.generator.set_state(state["generator"].cpu())


class PolicyRunner(ChunkExecutor):
    """A ChunkPolicy as an agent: plans with `policy.predict_chunk` and the runner's own noise
    generator (seeded with `seed`; evaluate() reseeds `generator` every round)."""

    def __init__(self, policy: ChunkPolicy, num_envs: int, seed: int | None = None):
        generator = torch.Generator(device=policy.device)
        if seed is not None:
            generator.manual_seed(seed)
        super().__init__(num_envs, policy.n_obs_steps, policy.n_action_steps, policy.action_dim, generator)
        self.policy = policy

    def plan(self, history: Obs, envs: Tensor) -> Tensor:
        device = self.policy.device
        subset = map_obs(lambda h: h[envs.to(h.device)].to(device), history)
        chunk = self.policy.predict_chunk(subset, generator=self.generator)
        return executed_actions(self.policy, chunk).float()
