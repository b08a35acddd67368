"""Expert for hopper: a PPO actor trained once with Stable-Baselines3 and shipped as weights.

`assets/experts/hopper.safetensors` holds the deterministic actor (an MLP obs -> action mean) and
the observation normalisation it was trained with (VecNormalize's running mean/var and clip);
`scripts/train_hopper_expert.py` made it and `assets/experts/hopper.json` records how. Collecting
runs the MLP in plain torch: no SB3 and no pickle at collect time.

At quality q < 1 the torques get Gaussian noise and occasional zero-torque hesitations
(ScriptedExpert's degradation); torques are not velocities, so nothing is slowed down.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from embodied_rl.envs.experts import ScriptedExpert
from embodied_rl.errors import UserError
from embodied_rl.paths import asset_dir

ACTOR_FILE = "experts/hopper.safetensors"
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


class HopperActor(nn.Module):
    """Normalise the observation as VecNormalize did, then the MLP of the PPO actor's mean."""

    def __init__(self, tensors: dict[str, Tensor], activation: str = "tanh"):
        super().__init__()
        self.register_buffer("obs_mean", tensors["obs_mean"].float())
        self.register_buffer("obs_std", (tensors["obs_var"].float() + float(tensors["obs_epsilon"])).sqrt())
        self.clip_obs = float(tensors["obs_clip"])
        weights = sorted((key for key in tensors if key.startswith("mlp.") and key.endswith(".weight")),
                         key=lambda key: int(key.split(".")[1]))
        layers: list[nn.Module] = []
        for key in weights:
            out_dim, in_dim = tensors[key].shape
            layers += [nn.Linear(in_dim, out_dim), ACTIVATIONS[activation]()]
        self.mlp = nn.Sequential(*layers[:-1])  # no activation after the action layer
        self.mlp.load_state_dict({key[len("mlp."):]: value.float() for key, value in tensors.items()
                                  if key.startswith("mlp.")})

    @torch.no_grad()
    def forward(self, obs: Tensor) -> Tensor:
        normalised = ((obs.float() - self.obs_mean) / self.obs_std).clamp(-self.clip_obs, self.clip_obs)
        return self.mlp(normalised).clamp(-1.0, 1.0)


def load_actor(path: str | Path | None = None) -> HopperActor:
    """The shipped hopper actor (or the one at `path`); UserError if it is missing or unreadable."""
    from safetensors import SafetensorError, safe_open

    path = Path(path) if path is not None else asset_dir() / ACTOR_FILE
    if not path.is_file():
        raise UserError(f"hopper expert weights not found at {path} (reinstall embodied-rl or run "
                        "scripts/train_hopper_expert.py)")
    try:
        with safe_open(str(path), framework="pt") as file:
            activation = (file.metadata() or {}).get("activation", "tanh")
            tensors = {key: file.get_tensor(key) for key in file.keys()}
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}")
        return HopperActor(tensors, activation)
    except (SafetensorError, KeyError, RuntimeError, ValueError, OSError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"hopper expert weights at {path} are unreadable: {reason}") from None


class Expert(ScriptedExpert):
    noise_scale = 0.3
    slow_scale = 0.0  # actions are torques: scaling them down does not mean "slower"
    hesitate_prob = 0.02
    hesitate_steps = 3
    weights_path: str | Path | None = None  # tests point this elsewhere

    def __init__(self, env: Any, quality: float = 1.0, generator: torch.Generator | None = None,
                 mistakes: float = 0.0):
        super().__init__(env, quality=quality, generator=generator, mistakes=mistakes)
        self.actor = load_actor(self.weights_path)

    def plan(self, obs: Any) -> Tensor:
        state = obs["state"] if isinstance(obs, dict) else obs  # pixel observations carry the state too
        return self.actor(state.to("cpu"))
