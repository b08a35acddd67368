"""Per-dimension normalisation of observations and actions, stored with the policy.

Statistics are computed once from the demo dataset and kept as buffers of an nn.Module, so they
travel with the policy's weights. Each key (e.g. "obs", "action") maps x to `x * scale + offset`:

- "minmax" (default): each dimension's [min, max] onto [-1, 1];
- "meanstd": each dimension to zero mean and unit variance.

A constant dimension (range or std below 1e-6) is only shifted (scale 1), never divided by zero:
min-max maps it to 0, mean-std to 0. Asking for a key that has no statistics is a UserError that
names the key, never a silent pass-through.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from embodied_rl.errors import UserError

MODES = ("minmax", "meanstd")
_EPS = 1e-6


class Normalizer(nn.Module):
    def __init__(self, mode: str = "minmax"):
        super().__init__()
        if mode not in MODES:
            raise UserError(f"unknown normalizer mode '{mode}' (choose from: {', '.join(MODES)})")
        self.mode = mode
        self.keys: list[str] = []

    @classmethod
    def fit(cls, arrays: dict[str, np.ndarray | Tensor], mode: str = "minmax") -> Normalizer:
        """Statistics over the leading axis of each array ([T, D])."""
        normalizer = cls(mode)
        for key, array in arrays.items():
            data = torch.as_tensor(np.asarray(array), dtype=torch.float64).reshape(len(array), -1)
            if mode == "minmax":
                low, high = data.min(0).values, data.max(0).values
                span = high - low
                scale = torch.where(span > _EPS, 2.0 / span.clamp_min(_EPS), torch.ones_like(span))
                offset = torch.where(span > _EPS, -1.0 - low * scale, -low)
            else:
                mean, std = data.mean(0), data.std(0, correction=0)
                scale = torch.where(std > _EPS, 1.0 / std.clamp_min(_EPS), torch.ones_like(std))
                offset = -mean * scale
            normalizer.add_key(key, scale.float(), offset.float())
        return normalizer

    @classmethod
    def empty_like(cls, dims: dict[str, int], mode: str = "minmax") -> Normalizer:
        """Identity statistics of the given sizes: a shell for load_state_dict."""
        normalizer = cls(mode)
        for key, dim in dims.items():
            normalizer.add_key(key, torch.ones(dim), torch.zeros(dim))
        return normalizer

    def add_key(self, key: str, scale: Tensor, offset: Tensor) -> None:
        self.register_buffer(f"{key}_scale", scale.float().clone())
        self.register_buffer(f"{key}_offset", offset.float().clone())
        self.keys.append(key)

    def dims(self) -> dict[str, int]:
        return {key: int(getattr(self, f"{key}_scale").numel()) for key in self.keys}

    def _stats(self, key: str, x: Tensor) -> tuple[Tensor, Tensor]:
        if key not in self.keys:
            known = ", ".join(self.keys) or "none"
            raise UserError(f"normalizer has no statistics for key '{key}' (has: {known})")
        scale, offset = getattr(self, f"{key}_scale"), getattr(self, f"{key}_offset")
        if x.shape[-1] != scale.numel():
            raise ValueError(f"normalizer '{key}': last dim {x.shape[-1]} != {scale.numel()}")
        return scale.to(x.device), offset.to(x.device)

    def normalize(self, key: str, x: Tensor) -> Tensor:
        scale, offset = self._stats(key, x)
        return x * scale + offset

    def unnormalize(self, key: str, x: Tensor) -> Tensor:
        scale, offset = self._stats(key, x)
        return (x - offset) / scale

    def extra_repr(self) -> str:
        return f"mode={self.mode}, keys={self.keys}"
