"""Behaviour-cloning chunk policies (diffusion, flow matching, shortcut, and the vision-language-action
policy vla), checkpoints, and the chunk executor that runs them (runner.py)."""

from __future__ import annotations

from typing import Any

from embodied_rl.policies.base import ChunkPolicy
from embodied_rl.policies.checkpoint import load_policy, read_config, save_policy
from embodied_rl.policies.diffusion import DiffusionPolicy
from embodied_rl.policies.flow import FlowPolicy
from embodied_rl.policies.runner import ChunkExecutor, ObsHistory, PolicyRunner, executed_actions
from embodied_rl.policies.shortcut import ShortcutPolicy
from embodied_rl.policies.vla import VLAPolicy

POLICIES: dict[str, type[ChunkPolicy]] = {
    "diffusion": DiffusionPolicy,
    "flow": FlowPolicy,
    "shortcut": ShortcutPolicy,
    "vla": VLAPolicy,
}


def make_policy(policy_type: str, **kwargs: Any) -> ChunkPolicy:
    """Construct a policy by name: make_policy("flow", obs_dim=..., action_dim=..., normalizer=...)."""
    if policy_type not in POLICIES:
        from embodied_rl.errors import UserError

        raise UserError(f"unknown policy '{policy_type}' (choose from: {', '.join(POLICIES)})")
    return POLICIES[policy_type](**kwargs)


__all__ = [
    "POLICIES",
    "ChunkExecutor",
    "ChunkPolicy",
    "DiffusionPolicy",
    "FlowPolicy",
    "ObsHistory",
    "PolicyRunner",
    "ShortcutPolicy",
    "VLAPolicy",
    "executed_actions",
    "load_policy",
    "make_policy",
    "read_config",
    "save_policy",
]
