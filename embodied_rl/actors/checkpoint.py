"""Agent checkpoints: one format for every fine-tuned agent.

    <dir>/agent.json           {"format": "embodied_rl.agent/v1", "kind": <a key of actors.AGENTS>,
                                "config": {...}}
    <dir>/agent.safetensors    the agent's tensors
    <dir>/base_policy/         the frozen BC policy (policies/checkpoint.py)

    kind                             config                          tensors
    residual, residual_chunk,        the actor's constructor         the actor's state_dict without
    latent_noise, dppo, flow_noise,  arguments (Actor.config())      the base policy ("policy.*")
    flow_sde, fpo (on-policy actors)
    residual_offpolicy               ResidualPolicyNet's sizes,      actor.* (the residual network),
                                     learner, normalize_obs          critic.* (the Q ensemble)
    dsrl                             noise bound and shape, SB3      the SB3 SAC policy's state_dict
                                     network sizes, variant          (noise actor and critics)
    recap                            the guidance weight             indicator.table; its base_policy/
                                                                     is the fine-tuned policy
    qc_fql                           one_step (flow | mlp), and the  actor.* (the one-step policy's
                                     MLP's sizes                     trained weights), critic.*

`save_agent` writes a checkpoint, `read_agent_json` and `load_agent_tensors` read its parts, and
`embodied_rl.actors.load_agent` builds the agent of any checkpoint. Checkpoints written before
this format (agent.json naming a Python "loader", tensors in actor.safetensors) are read through
LEGACY_LOADERS, which maps each loader to its kind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from embodied_rl.errors import UserError

FORMAT = "embodied_rl.agent/v1"
AGENT_FILE = "agent.json"
TENSORS = "agent.safetensors"
BASE_POLICY = "base_policy"

# the old agent.json "loader" -> the kind it loads (None: the kind is agent.json's own "kind")
LEGACY_LOADERS: dict[str, str | None] = {
    "embodied_rl.actors:load_actor_agent": None,
    "embodied_rl.actors.residual_offpolicy:load_agent": "residual_offpolicy",
    "embodied_rl.actors.latent_noise:load_agent": "dsrl",
}
LEGACY_TENSORS = "actor.safetensors"


@dataclass
class AgentCheckpoint:
    """A fine-tuned checkpoint read from disk: what a builder in actors.AGENTS turns into an agent."""

    path: Path
    kind: str
    config: dict[str, Any]
    tensors: dict[str, Tensor]  # on the CPU
    base_policy: Any  # the ChunkPolicy, on the device the agent runs on


def save_agent(directory: str | Path, kind: str, config: dict[str, Any], tensors: dict[str, Tensor],
               base_policy: Any) -> None:
    """Write agent.json, agent.safetensors and base_policy/ into `directory` (created if needed).
    Not atomic by itself: checkpoints are written into a temporary directory that is renamed."""
    from safetensors.torch import save_file

    from embodied_rl.policies import save_policy

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({key: value.detach().cpu().contiguous() for key, value in tensors.items()}, str(directory / TENSORS))
    save_policy(base_policy, directory / BASE_POLICY)
    spec = {"format": FORMAT, "kind": kind, "config": config}
    (directory / AGENT_FILE).write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")


def read_agent_json(path: str | Path) -> tuple[str, dict[str, Any], str]:
    """(kind, config, name of the tensors file) of the checkpoint at `path`, in either layout."""
    path = Path(path)
    try:
        spec = json.loads((path / AGENT_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"checkpoint '{path}': cannot read {AGENT_FILE} ({first_line(error)})") from None
    if not isinstance(spec, dict):
        raise UserError(f"checkpoint '{path}': {AGENT_FILE} is not a JSON object")
    if "loader" in spec:
        return _legacy(path, spec)
    if spec.get("format") != FORMAT:
        raise UserError(f"checkpoint '{path}': {AGENT_FILE} has format {spec.get('format')!r}, expected {FORMAT!r}")
    kind, config = spec.get("kind"), spec.get("config")
    if not isinstance(kind, str) or not isinstance(config, dict):
        raise UserError(f"checkpoint '{path}': {AGENT_FILE} needs a 'kind' (a string) and a 'config' (an object)")
    return kind, config, TENSORS


def _legacy(path: Path, spec: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    loader = spec["loader"]
    if loader not in LEGACY_LOADERS:
        raise UserError(f"checkpoint '{path}': {AGENT_FILE} names an unknown loader {loader!r}")
    kind = LEGACY_LOADERS[loader]
    if kind is None:  # on-policy actors: {"loader", "kind", "config"}
        kind, config = spec.get("kind"), spec.get("config", {})
    else:  # off-policy agents kept their config next to "loader" and "kind"
        config = {key: value for key, value in spec.items() if key not in ("loader", "kind")}
    if not isinstance(kind, str) or not isinstance(config, dict):
        raise UserError(f"checkpoint '{path}': {AGENT_FILE} needs a 'kind' and a 'config'")
    return kind, config, LEGACY_TENSORS


def load_agent_tensors(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint at `path` (CPU), in either layout."""
    from safetensors.torch import load_file

    path = Path(path)
    _, _, name = read_agent_json(path)
    if not (path / name).is_file():
        raise UserError(f"checkpoint '{path}' is incomplete: {name} is missing")
    try:
        return load_file(str(path / name))
    except Exception as error:  # safetensors raises SafetensorError / OSError on bad files
        raise UserError(f"checkpoint '{path}': {name} is corrupt or truncated ({first_line(error)})") from None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (then its checkpoints/last)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint '{path}' does not exist")
    last = path / "checkpoints" / "last"
    if not (path / AGENT_FILE).exists() and not (path / "config.json").exists() and last.is_dir():
        return last
    return path


def with_prefix(prefix: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The tensors whose name starts with `prefix`, without it."""
    return {key.removeprefix(prefix): value for key, value in tensors.items() if key.startswith(prefix)}


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
