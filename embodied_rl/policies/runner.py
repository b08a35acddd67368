"""PolicyRunner: executes a ChunkPolicy one action per env step (the agent protocol).

    runner = PolicyRunner(policy, num_envs)
    runner.reset()                       # all envs (or reset(mask) for some)
    action = runner.act(obs)             # obs: Tensor[N, D] or {"state": [N, D], "pixels": [N, h, w, 3]}

Per env it keeps the last n_obs_steps observations (filled with the first observation after a
reset) and a queue of n_action_steps actions taken from the predicted chunk starting at index
n_obs_steps - 1 (the chunk's step for the current observation, as in diffusion_policy). An env
replans only when its queue is empty; after partial resets envs drift out of sync, so the policy
is called on the subset that needs a plan. `reset(mask)` clears those envs' history and queue,
so a queue never leaks into the next episode.
"""

from __future__ import annotations

import torch
from torch import Tensor

from embodied_rl.policies.base import ChunkPolicy


class PolicyRunner:
    def __init__(self, policy: ChunkPolicy, num_envs: int, seed: int | None = None):
        self.policy = policy
        self.num_envs = num_envs
        self.generator = torch.Generator(device=policy.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        self.history: dict[str, Tensor] | None = None
        self.fresh = torch.ones(num_envs, dtype=torch.bool)      # history must be refilled
        self.queue = torch.zeros(num_envs, policy.n_action_steps, policy.action_dim)
        self.next_index = torch.full((num_envs,), policy.n_action_steps, dtype=torch.long)
        self.num_replans = 0  # envs planned for, summed over calls (tests and diagnostics)

    def reset(self, mask: Tensor | None = None) -> None:
        """Forget the obs history and the action queue of the envs where `mask` is set."""
        if mask is None:
            mask = torch.ones(self.num_envs, dtype=torch.bool)
        mask = torch.as_tensor(mask, dtype=torch.bool).cpu().reshape(self.num_envs)
        self.fresh |= mask
        self.next_index[mask] = self.policy.n_action_steps

    def _update_history(self, obs: dict[str, Tensor]) -> None:
        steps = self.policy.n_obs_steps
        fresh = self.fresh.to(next(iter(obs.values())).device)
        if self.history is None:
            self.history = {k: v[:, None].repeat(1, steps, *([1] * (v.ndim - 1))) for k, v in obs.items()}
        else:
            for key, value in obs.items():
                rolled = torch.cat([self.history[key][:, 1:], value[:, None]], dim=1)
                filled = value[:, None].expand_as(rolled)
                where = fresh.view(-1, *([1] * (rolled.ndim - 1)))
                self.history[key] = torch.where(where, filled, rolled)
        self.fresh[:] = False

    def act(self, obs: Tensor | dict[str, Tensor]) -> Tensor:
        """One action per env, [N, A], on the device of `obs`."""
        is_dict = isinstance(obs, dict)
        obs_dict = dict(obs) if is_dict else {"state": obs}
        first = next(iter(obs_dict.values()))
        if len(first) != self.num_envs:
            raise ValueError(f"PolicyRunner was built for {self.num_envs} envs, got obs for {len(first)}")
        self._update_history(obs_dict)

        replan = self.next_index >= self.policy.n_action_steps
        if replan.any():
            envs = replan.nonzero().squeeze(1)
            device = self.policy.device
            subset = {k: v[envs.to(v.device)].to(device) for k, v in self.history.items()}
            with torch.no_grad():
                chunk = self.policy.predict_chunk(
                    subset if is_dict else subset["state"], generator=self.generator
                )
            start = self.policy.n_obs_steps - 1
            self.queue[envs] = chunk[:, start : start + self.policy.n_action_steps].float().cpu()
            self.next_index[envs] = 0
            self.num_replans += len(envs)

        action = self.queue[torch.arange(self.num_envs), self.next_index]
        self.next_index += 1
        return action.to(first.device)
