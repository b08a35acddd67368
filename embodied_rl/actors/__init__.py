"""RL actors around a ChunkPolicy (the Actor contract: actors/base.py) and `load_agent`, which
turns any checkpoint (BC or fine-tuned) into an agent for evaluation."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

from embodied_rl.actors.base import Actor, ActorAgent, ActorOutput
from embodied_rl.errors import UserError

AGENT_FILE = "agent.json"
BASE_POLICY = "base_policy"
WEIGHTS = "actor.safetensors"

# kind -> "module:Class"
ACTORS: dict[str, str] = {
    "residual": "embodied_rl.actors.residual:ResidualActor",
    "residual_chunk": "embodied_rl.actors.residual:ResidualChunkActor",
    "latent_noise": "embodied_rl.actors.latent_ppo:LatentNoiseActor",
    "dppo": "embodied_rl.actors.dppo:DPPOActor",
    "flow_noise": "embodied_rl.actors.flow_noise:FlowNoiseActor",
    "flow_sde": "embodied_rl.actors.flow_sde:FlowSDEActor",
}


def _resolve(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def make_actor(kind: str, policy, num_envs: int, **kwargs: Any) -> Actor:
    if kind not in ACTORS:
        raise UserError(f"unknown actor '{kind}' (choose from: {', '.join(ACTORS)})")
    return _resolve(ACTORS[kind])(policy, num_envs=num_envs, **kwargs)


def save_actor(actor: Actor, directory: str | Path) -> None:
    """agent.json + base_policy/ + actor.safetensors (every tensor but the frozen base's)."""
    from safetensors.torch import save_file

    from embodied_rl.policies import save_policy

    directory = Path(directory)
    (directory / AGENT_FILE).write_text(json.dumps({
        "loader": "embodied_rl.actors:load_actor_agent", "kind": actor.kind, "config": actor.config(),
    }, indent=2) + "\n")
    save_policy(actor.policy, directory / BASE_POLICY)
    state = {k: v.detach().cpu().contiguous() for k, v in actor.state_dict().items()
             if not k.startswith("policy.")}
    save_file(state, str(directory / WEIGHTS))


def load_actor(path: str | Path, num_envs: int, device: str | torch.device = "cpu") -> Actor:
    """Rebuild the actor saved by `save_actor` (for resume and evaluation)."""
    from safetensors.torch import load_file

    from embodied_rl.policies import load_policy

    path = Path(path)
    spec = json.loads((path / AGENT_FILE).read_text())
    policy = load_policy(path / BASE_POLICY, device=device)
    actor = make_actor(spec["kind"], policy, num_envs, **spec.get("config", {}))
    try:
        state = load_file(str(path / WEIGHTS))
    except Exception as error:
        raise UserError(f"checkpoint '{path}': {WEIGHTS} is missing or corrupt ({error})") from None
    load_weights(actor, state, path)
    return actor.to(device)


def load_weights(actor: Actor, state: dict[str, torch.Tensor], path: Any = "") -> None:
    expected = {k for k in actor.state_dict() if not k.startswith("policy.")}
    if set(state) != expected:
        missing = sorted(expected - set(state))[:1] or sorted(set(state) - expected)[:1]
        raise UserError(f"checkpoint '{path}': actor weights do not match the actor (e.g. '{missing[0]}')")
    actor.load_state_dict(state, strict=False)


def load_actor_agent(path: str | Path, num_envs: int, device: str | torch.device = "cpu") -> ActorAgent:
    """The loader named in agent.json of on-policy checkpoints: the actor, deterministic."""
    return ActorAgent(load_actor(path, num_envs, device).eval(), num_envs, deterministic=True)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (then its checkpoints/last)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint '{path}' does not exist")
    last = path / "checkpoints" / "last"
    if not (path / AGENT_FILE).exists() and not (path / "config.json").exists() and last.is_dir():
        return last
    return path


def load_agent(path: str | Path, num_envs: int, device: str | torch.device = "cpu"):
    """An agent (`reset(mask)` / `act(obs)`) for any checkpoint.

    A BC checkpoint (config.json, model.safetensors) -> PolicyRunner(load_policy(path)).
    A fine-tuned checkpoint (agent.json) -> its `loader(path, num_envs, device)`, which acts
    deterministically. A run directory stands for its checkpoints/last.
    """
    path = resolve_checkpoint(path)
    agent_file = path / AGENT_FILE
    if not agent_file.exists():
        from embodied_rl.policies import PolicyRunner, load_policy

        return PolicyRunner(load_policy(path, device=device), num_envs)
    try:
        spec = json.loads(agent_file.read_text())
        loader = spec["loader"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"checkpoint '{path}': {AGENT_FILE} is not valid (needs a 'loader')") from None
    if not isinstance(loader, str) or not loader.startswith("embodied_rl.") or ":" not in loader:
        raise UserError(f"checkpoint '{path}': loader {loader!r} must be 'embodied_rl.<module>:<function>'")
    return _resolve(loader)(path, num_envs, device)


__all__ = [
    "ACTORS", "Actor", "ActorAgent", "ActorOutput", "load_actor", "load_actor_agent", "load_agent",
    "make_actor", "resolve_checkpoint", "save_actor",
]
