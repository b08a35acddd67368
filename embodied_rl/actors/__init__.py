"""RL actors around a ChunkPolicy (the Actor contract: actors/base.py), the registry of agent kinds,
and `load_agent`, which turns any checkpoint (BC or fine-tuned) into an agent for evaluation.
The checkpoint format: actors/checkpoint.py."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import torch

from embodied_rl.actors.base import Actor, ActorAgent, ActorOutput
from embodied_rl.actors.checkpoint import (
    AGENT_FILE,
    BASE_POLICY,
    AgentCheckpoint,
    first_line,
    load_agent_tensors,
    read_agent_json,
    resolve_checkpoint,
    save_agent,
)
from embodied_rl.errors import UserError

# on-policy actor kind -> "module:Class"
ACTORS: dict[str, str] = {
    "residual": "embodied_rl.actors.residual:ResidualActor",
    "residual_chunk": "embodied_rl.actors.residual:ResidualChunkActor",
    "latent_noise": "embodied_rl.actors.latent_ppo:LatentNoiseActor",
    "dppo": "embodied_rl.actors.dppo:DPPOActor",
    "flow_noise": "embodied_rl.actors.flow_noise:FlowNoiseActor",
    "flow_sde": "embodied_rl.actors.flow_sde:FlowSDEActor",
    "fpo": "embodied_rl.actors.fpo:FPOActor",
}

# agent kind (agent.json's "kind") -> "module:function" that builds its evaluation agent from an
# AgentCheckpoint and a number of envs
AGENTS: dict[str, str] = {
    **{kind: "embodied_rl.actors:build_actor_agent" for kind in ACTORS},
    "residual_offpolicy": "embodied_rl.actors.residual_offpolicy:build_residual_agent",
    "dsrl": "embodied_rl.actors.latent_noise:build_noise_agent",
    "recap": "embodied_rl.actors.recap:build_recap_agent",
    "qc_fql": "embodied_rl.actors.qc_fql:build_one_step_agent",
}


def _resolve(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def check_actor_kwargs(kind: str, kwargs: dict[str, Any]) -> None:
    """One line for an unknown actor or an argument its constructor does not take (a preset's
    actor_kwargs belong to the preset's actor: `algo=grpo algo.actor=flow_sde` keeps Flow-Noise's)."""
    if kind not in ACTORS:
        raise UserError(f"unknown actor '{kind}' (choose from: {', '.join(ACTORS)})")
    takes = [name for name in inspect.signature(_resolve(ACTORS[kind])).parameters if name not in ("policy", "num_envs")]
    unknown = sorted(set(kwargs) - set(takes))
    if unknown:
        raise UserError(f"actor '{kind}' takes no {', '.join(repr(k) for k in unknown)} in algo.actor_kwargs (it takes "
                        f"{', '.join(takes)}); to replace the preset's: '~algo.actor_kwargs' '+algo.actor_kwargs={{...}}'")


def make_actor(kind: str, policy, num_envs: int, **kwargs: Any) -> Actor:
    check_actor_kwargs(kind, kwargs)
    return _resolve(ACTORS[kind])(policy, num_envs=num_envs, **kwargs)


def load_weights(actor: Actor, state: dict[str, torch.Tensor], path: Any = "") -> None:
    """Load `Actor.weights()` tensors into `actor`; a missing or unexpected name is a UserError."""
    expected = set(actor.weights())
    if set(state) != expected:
        missing = sorted(expected - set(state))[:1] or sorted(set(state) - expected)[:1]
        raise UserError(f"checkpoint '{path}': actor weights do not match the actor (e.g. '{missing[0]}')")
    actor.load_state_dict(state, strict=False)


# what the constructors defaulted to before configs/algo/ became the one home of their defaults:
# a checkpoint written without one of these keys was built with this value
LEGACY_ACTOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "residual": {"learn_std": True, "chunk_critic": False},
    "dppo": {"eta": 1.0, "min_sampling_std": 0.1, "min_logprob_std": 0.1},
    "fpo": {"action_noise": 0.0, "ratio": "chunk"},
    "flow_noise": {"min_std": 0.05, "max_std": 0.2, "logprob_reduce": "mean"},
    "flow_sde": {"logprob_reduce": "mean"},
}


def build_actor_agent(checkpoint: AgentCheckpoint, num_envs: int) -> ActorAgent:
    """The evaluation agent of an on-policy actor: the actor, deterministic."""
    config = {**LEGACY_ACTOR_DEFAULTS.get(checkpoint.kind, {}), **checkpoint.config}
    actor = make_actor(checkpoint.kind, checkpoint.base_policy, num_envs, **config)
    load_weights(actor, checkpoint.tensors, checkpoint.path)
    actor = actor.to(checkpoint.base_policy.device).eval()
    return ActorAgent(actor, num_envs, deterministic=True)


def load_agent(path: str | Path, num_envs: int, device: str | torch.device = "cpu"):
    """An agent (`reset(mask)` / `act(obs)`) for any checkpoint, acting as its run's evaluations
    did (a residual's mean; DSRL's noise actor per `eval_noise`). A BC checkpoint (config.json,
    model.safetensors) -> PolicyRunner; a fine-tuned one (agent.json) -> the builder AGENTS names
    for its kind. A run directory stands for its checkpoints/last."""
    from embodied_rl.policies import PolicyRunner, load_policy

    path = resolve_checkpoint(path)
    if not (path / AGENT_FILE).exists():
        return PolicyRunner(load_policy(path, device=device), num_envs)
    kind, config, _ = read_agent_json(path)
    if kind not in AGENTS:
        raise UserError(f"checkpoint '{path}': unknown agent kind {kind!r} (known: {', '.join(AGENTS)})")
    tensors = load_agent_tensors(path)
    base_policy = load_policy(path / BASE_POLICY, device=device)
    checkpoint = AgentCheckpoint(path, kind, config, tensors, base_policy)
    try:
        return _resolve(AGENTS[kind])(checkpoint, num_envs)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:  # UserError is a ValueError
        raise UserError(f"checkpoint '{path}': its {kind} agent does not load ({first_line(error)})") from None


__all__ = [
    "ACTORS", "AGENTS", "AGENT_FILE", "Actor", "ActorAgent", "ActorOutput", "AgentCheckpoint", "BASE_POLICY",
    "build_actor_agent", "load_agent", "load_agent_tensors", "load_weights", "make_actor", "read_agent_json",
    "resolve_checkpoint", "save_agent",
]
