"""Policy checkpoints: a directory of JSON and safetensors, no pickles.

    <path>/config.json              {"format", "policy_type", "policy": constructor kwargs, "extra"}
    <path>/model.safetensors        the weights used for inference (the EMA weights when training)
    <path>/normalizer.safetensors   the normaliser's scale/offset per key ("obs", "action")

`save_policy` writes the directory atomically (a kill mid-save leaves the old one);
`load_policy` rebuilds the policy and checks every file, raising a one-line UserError for a
missing file, bad JSON, an unknown policy type, missing/unexpected tensors or a shape mismatch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from embodied_rl.data.normalizer import Normalizer
from embodied_rl.errors import UserError
from embodied_rl.policies.base import ChunkPolicy
from embodied_rl.runs import atomic_dir

FORMAT = "embodied_rl.policy/v1"
CONFIG, MODEL, NORMALIZER = "config.json", "model.safetensors", "normalizer.safetensors"


def _split_state(policy: ChunkPolicy) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model, normalizer = {}, {}
    for key, value in policy.state_dict().items():
        if key.startswith("normalizer."):
            normalizer[key.removeprefix("normalizer.")] = value.detach().cpu().contiguous()
        else:
            model[key] = value.detach().cpu().contiguous()
    return model, normalizer


def write_policy_files(policy: ChunkPolicy, directory: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Write config.json, model.safetensors and normalizer.safetensors into an existing directory
    (not atomic by itself: call it on a private temporary directory, as save_policy does)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    model, normalizer = _split_state(policy)
    config = {
        "format": FORMAT,
        "policy_type": policy.policy_type,
        "task": policy.task,
        "policy": policy.config,
        "extra": extra or {},
    }
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(model, str(directory / MODEL))
    save_file(normalizer, str(directory / NORMALIZER))


def save_policy(policy: ChunkPolicy, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write `policy` to the directory `path`, replacing it atomically."""
    path = Path(path)
    with atomic_dir(path) as tmp:
        write_policy_files(policy, tmp, extra)
    return path


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint, validated."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"checkpoint '{path}' is not a directory")
    return read_config_json(path, FORMAT, "policy", "checkpoint")


def read_config_json(path: Path, expected_format: str, section: str, what: str) -> dict[str, Any]:
    """`path`/config.json, refused in one line (naming `what`: "checkpoint", "reward model")
    when it is missing, not JSON, of another format or without its `section` dict."""
    file = path / CONFIG
    if not file.is_file():
        raise UserError(f"{what} '{path}' is incomplete: {CONFIG} is missing")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{what} '{path}': {CONFIG} is not valid JSON ({error})") from None
    if not isinstance(config, dict) or config.get("format") != expected_format:
        found = config.get("format") if isinstance(config, dict) else None
        raise UserError(f"{what} '{path}': {CONFIG} has format {found!r}, expected {expected_format!r}")
    if not isinstance(config.get(section), dict):
        raise UserError(f"{what} '{path}': {CONFIG} has no '{section}' section")
    return config


def load_tensors(file: Path, checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not file.is_file():
        raise UserError(f"checkpoint '{checkpoint}' is incomplete: {file.name} is missing")
    try:
        return load_file(str(file))
    except Exception as error:  # safetensors raises SafetensorError / OSError on bad files
        raise UserError(f"checkpoint '{checkpoint}': {file.name} is corrupt or truncated ({error})") from None


def check_tensors(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], what: str) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        raise UserError(f"{what}: missing tensor '{missing[0]}' ({len(missing)} missing)")
    if unexpected:
        raise UserError(f"{what}: unexpected tensor '{unexpected[0]}' ({len(unexpected)} unexpected)")
    for key, value in expected.items():
        if tuple(found[key].shape) != tuple(value.shape):
            raise UserError(
                f"{what}: tensor '{key}' has shape {list(found[key].shape)}, config expects {list(value.shape)}"
            )


def load_policy(path: str | Path, device: str | torch.device = "cpu") -> ChunkPolicy:
    """Rebuild a policy saved with save_policy; it predicts exactly what it did before saving."""
    from embodied_rl.policies import POLICIES

    path = Path(path)
    config = read_config(path)
    policy_type = config.get("policy_type")
    if policy_type not in POLICIES:
        raise UserError(f"checkpoint '{path}': unknown policy_type {policy_type!r} (known: {', '.join(POLICIES)})")
    kwargs = dict(config["policy"])
    if policy_type == "diffusion":  # written before prediction_type existed: the network predicted epsilon
        kwargs.setdefault("prediction_type", "epsilon")
    try:
        normalizer = Normalizer.empty_like(
            {"obs": int(kwargs["obs_dim"]), "action": int(kwargs["action_dim"])},
            kwargs.get("normalizer_mode", "minmax"),
        )
        policy = POLICIES[policy_type](normalizer=normalizer, **kwargs)
    except (KeyError, TypeError, ValueError) as error:
        raise UserError(f"checkpoint '{path}': {CONFIG} does not describe a valid {policy_type} policy ({error})") from None
    model = load_tensors(path / MODEL, path)
    normalizer_state = load_tensors(path / NORMALIZER, path)
    expected_model, expected_normalizer = _split_state(policy)
    check_tensors(expected_model, model, f"checkpoint '{path}' {MODEL}")
    check_tensors(expected_normalizer, normalizer_state, f"checkpoint '{path}' {NORMALIZER}")
    state = {**model, **{f"normalizer.{k}": v for k, v in normalizer_state.items()}}
    policy.load_state_dict(state, strict=True)
    return policy.to(device).eval()
