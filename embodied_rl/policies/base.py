"""ChunkPolicy: a BC policy that maps an observation history to a chunk of H actions.

Every policy is a chain of K steps over a latent chunk x of shape [N, H, A] in the normalised
action space (actions in [-1, 1]):

    cond = policy.encode_obs(obs)                 # obs history -> conditioning vector [N, C]
    x = noise                                     # [N, H, A] ~ N(0, I)   (policy.noise_shape)
    for i in range(policy.num_inference_steps):   # one shared grid: policy.timesteps()
        x = policy.denoise_step(x, i, cond)       # deterministic step (DDIM eta=0 / Euler)
    chunk = policy.unnormalize_action(x)          # clip to [-1, 1], then to env units

`predict_chunk` is exactly that loop. `step_mean_std(x, i, cond, noise_level)` gives the mean and
std of a stochastic version of step i (DDIM with eta for diffusion, a marginal-preserving SDE step
for flow models); with noise_level=0 its mean equals `denoise_step`. RL actors build likelihoods
from these two methods, so sampling and likelihood always share one time grid. See docs/policies.md.

Capabilities a fine-tuning method may need are class attributes, never probed with hasattr:
`is_flow` says the chain integrates a learned velocity field from t = 0 (noise) to 1: the
policy has `velocity(x, t, cond)` and `sample_train_times(n, device)` (flow, shortcut, vla).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from embodied_rl.data.normalizer import Normalizer
from embodied_rl.policies.nets import BACKBONES, ImageEncoder
from embodied_rl.policies.text import check_text_encoder, embed_instructions

Obs = Tensor | dict[str, Tensor]


class ChunkPolicy(nn.Module):
    """Base class: observation encoding, normalisation, the sampling loop. Subclasses define the
    network call (`predict_noise` or `velocity`), `timesteps`, `denoise_step`, `step_mean_std`
    and `bc_loss`."""

    policy_type: ClassVar[str] = ""
    num_times: ClassVar[int] = 1  # scalars the backbone is conditioned on (t, or t and step size)
    is_flow: ClassVar[bool] = False  # velocity() and sample_train_times() (the module docstring)

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        normalizer: Normalizer | None = None,
        n_obs_steps: int = 2,
        horizon: int = 16,
        n_action_steps: int = 8,
        num_inference_steps: int = 10,
        backbone: str = "mlp",
        backbone_kwargs: dict[str, Any] | None = None,
        obs_mode: str = "state",
        image_shape: list[int] | None = None,
        vision_kwargs: dict[str, Any] | None = None,
        normalizer_mode: str = "minmax",
        task: str | None = None,
        instructions: list[str] | None = None,
        text_encoder: str = "hash",
    ):
        super().__init__()
        if not 1 <= n_obs_steps <= horizon:
            raise ValueError(f"need 1 <= n_obs_steps <= horizon, got {n_obs_steps}, {horizon}")
        if not 1 <= n_action_steps <= horizon - n_obs_steps + 1:
            raise ValueError(
                f"n_action_steps={n_action_steps} must be in [1, horizon - n_obs_steps + 1 = "
                f"{horizon - n_obs_steps + 1}] (executed actions start at index n_obs_steps-1)"
            )
        if backbone not in BACKBONES:
            raise ValueError(f"unknown backbone '{backbone}' (choose from: {', '.join(BACKBONES)})")
        if obs_mode not in ("state", "pixels"):
            raise ValueError(f"unknown obs_mode '{obs_mode}' (choose from: state, pixels)")
        if obs_mode == "pixels" and not image_shape:
            raise ValueError("obs_mode=pixels needs image_shape [h, w]")
        self.obs_dim, self.action_dim = int(obs_dim), int(action_dim)
        self.n_obs_steps, self.horizon, self.n_action_steps = n_obs_steps, horizon, n_action_steps
        self.num_inference_steps = num_inference_steps
        self.obs_mode = obs_mode
        self.task = task
        # Everything needed to rebuild this policy; subclasses add their own keys.
        self.config: dict[str, Any] = {
            "obs_dim": self.obs_dim, "action_dim": self.action_dim, "n_obs_steps": n_obs_steps,
            "horizon": horizon, "n_action_steps": n_action_steps,
            "num_inference_steps": num_inference_steps, "backbone": backbone,
            "backbone_kwargs": dict(backbone_kwargs or {}), "obs_mode": obs_mode,
            "image_shape": list(image_shape) if image_shape else None,
            "vision_kwargs": dict(vision_kwargs or {}), "normalizer_mode": normalizer_mode,
            "task": task, "instructions": list(instructions) if instructions else None,
            "text_encoder": check_text_encoder(text_encoder),
        }
        if normalizer is None:
            normalizer = Normalizer.empty_like({"obs": self.obs_dim, "action": self.action_dim}, normalizer_mode)
        self.normalizer = normalizer
        # per-step features: normalised state, image features, instruction embedding
        self.feature_dim = self.obs_dim
        self.image_encoder = None
        if obs_mode == "pixels":
            self.image_encoder = ImageEncoder(image_shape, **(vision_kwargs or {}))
            self.feature_dim += self.image_encoder.feature_dim
        self.instructions = list(instructions or [])
        text_dim = 0
        if self.instructions:  # the table travels with the weights: loading needs no text encoder
            self.register_buffer("instruction_embeddings", embed_instructions(self.instructions, text_encoder))
            text_dim = self.instruction_embeddings.shape[1]
            self.feature_dim += text_dim
        # the conditioning: every step's state and image features, the instruction once
        self.cond_dim = n_obs_steps * (self.feature_dim - text_dim) + text_dim
        self.net = BACKBONES[backbone](
            action_dim=self.action_dim, horizon=horizon, cond_dim=self.cond_dim,
            num_times=self.num_times, **(backbone_kwargs or {}),
        )

    # ------------------------------------------------------------------ observations and actions
    @property
    def noise_shape(self) -> tuple[int, int]:
        return (self.horizon, self.action_dim)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def encode_obs(self, obs: Obs) -> Tensor:
        """Raw obs history -> conditioning [N, cond_dim]. `obs` is a Tensor [N, To, D] or a dict
        {"state": [N, To, D], "pixels": u8 [N, To, h, w, 3], "instruction": int64 [N, To]} with
        the entries this policy reads. Normalises the state; the image encoder scales pixels to
        [0, 1]; the instruction of the latest step picks its embedding."""
        state = obs["state"] if isinstance(obs, dict) else obs
        if state.ndim != 3 or state.shape[1:] != (self.n_obs_steps, self.obs_dim):
            raise ValueError(
                f"obs must be [N, {self.n_obs_steps}, {self.obs_dim}], got {list(state.shape)}"
            )
        parts = [self.normalizer.normalize("obs", state.float()).flatten(1)]
        if self.image_encoder is not None:
            features = self.image_encoder(self._entry(obs, "pixels").flatten(0, 1))
            parts.append(features.view(len(state), -1))
        if self.instructions:
            parts.append(self._instruction_embedding(self._entry(obs, "instruction")[:, -1]))
        return torch.cat(parts, dim=-1)

    def obs_features(self, obs: Obs) -> Tensor:
        """One observation per env (Tensor [N, D], or a dict of [N, ...] entries) -> the policy's
        features of it [N, feature_dim]: normalised state, image features, instruction
        embedding. Critics and RL heads read these, so they work for every policy and obs type."""
        state = obs["state"] if isinstance(obs, dict) else obs
        if state.ndim != 2 or state.shape[1] != self.obs_dim:
            raise ValueError(f"obs must be [N, {self.obs_dim}], got {list(state.shape)}")
        parts = [self.normalizer.normalize("obs", state.float())]
        if self.image_encoder is not None:
            parts.append(self.image_encoder(self._entry(obs, "pixels")))
        if self.instructions:
            parts.append(self._instruction_embedding(self._entry(obs, "instruction")))
        return torch.cat(parts, dim=-1)

    def _entry(self, obs: Obs, key: str) -> Tensor:
        if not isinstance(obs, dict) or key not in obs:
            raise ValueError(f"this policy reads '{key}': pass obs as a dict with 'state' and '{key}'")
        return obs[key]

    def _instruction_embedding(self, ids: Tensor) -> Tensor:
        ids = ids.long()
        if bool(((ids < 0) | (ids >= len(self.instructions))).any()):
            raise ValueError(f"instruction ids must be in [0, {len(self.instructions)}), got {ids.tolist()}")
        return self.instruction_embeddings[ids.to(self.instruction_embeddings.device)]

    def env_options(self) -> dict[str, Any]:
        """The `envs.make` keywords of the observations this policy reads (obs_mode, image_size)."""
        options: dict[str, Any] = {"obs_mode": self.obs_mode}
        if self.obs_mode == "pixels":
            options["image_size"] = int(self.config["image_shape"][0])
        return options

    def normalize_action(self, action: Tensor) -> Tensor:
        return self.normalizer.normalize("action", action)

    def unnormalize_action(self, x: Tensor) -> Tensor:
        """Normalised chunk -> env units; clipped to [-1, 1] first (the normalised action range)."""
        return self.normalizer.unnormalize("action", x.clamp(-1.0, 1.0))

    @staticmethod
    def batch_obs(batch: dict[str, Tensor]) -> Obs:
        """The obs part of a training batch (see data.ChunkWindows) in predict_chunk's format."""
        extra = {key: batch[key] for key in ("pixels", "instruction") if key in batch}
        return {"state": batch["obs"], **extra} if extra else batch["obs"]

    def encode_batch(self, batch: dict[str, Tensor]) -> Tensor:
        """The conditioning of a training batch: `encode_obs` of its obs, plus the batch's
        "cond_offset" [B, cond_dim] where it has one (an additive shift of the conditioning,
        which advantage-conditioned training (RECAP) uses to add its indicator embedding)."""
        cond = self.encode_obs(self.batch_obs(batch))
        return cond + batch["cond_offset"] if "cond_offset" in batch else cond

    # ------------------------------------------------------------------ sampling
    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        device = generator.device if generator is not None else self.device
        return torch.randn((n, *self.noise_shape), generator=generator, device=device).to(self.device)

    def sample(self, cond: Tensor, noise: Tensor) -> Tensor:
        """Run the deterministic chain from `noise`; returns the normalised chunk (not clipped)."""
        x = noise
        for i in range(self.num_inference_steps):
            x = self.denoise_step(x, i, cond)
        return x

    def predict_chunk(
        self, obs: Obs, noise: Tensor | None = None, generator: torch.Generator | None = None
    ) -> Tensor:
        """Obs history -> action chunk [N, H, A] in env units. Deterministic given `noise`."""
        cond = self.encode_obs(obs)
        n = len(cond)
        if noise is None:
            noise = self.initial_noise(n, generator)
        elif tuple(noise.shape) != (n, *self.noise_shape):
            raise ValueError(f"noise must be [{n}, {self.horizon}, {self.action_dim}], got {list(noise.shape)}")
        return self.unnormalize_action(self.sample(cond, noise.to(cond)))

    def set_num_inference_steps(self, steps: int) -> None:
        """Change K; sampling and every step method follow the new grid."""
        self.num_inference_steps = int(steps)
        self.config["num_inference_steps"] = int(steps)

    # ------------------------------------------------------------------ per policy
    def timesteps(self) -> Tensor:
        """The K times (network inputs) at which steps 0..K-1 start."""
        raise NotImplementedError

    def denoise_step(self, x: Tensor, i: int, cond: Tensor) -> Tensor:
        raise NotImplementedError

    def step_mean_std(
        self, x: Tensor, i: int, cond: Tensor, noise_level: float | Tensor
    ) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def sde_noise_level(self, i: int, scale: float) -> float:
        """The noise_level that `step_mean_std` takes at step i for a sampler of noise scale
        `scale` (Flow-SDE's a): the scale itself where the step already schedules its noise over
        the grid (diffusion's DDIM eta); flow policies override it with their schedule."""
        return scale

    def bc_loss(self, batch: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError

    @staticmethod
    def _expand_time(t: Tensor | float | int, n: int, device: torch.device) -> Tensor:
        t = torch.as_tensor(t, dtype=torch.float32, device=device)
        return t.expand(n) if t.ndim == 0 else t.reshape(n)
