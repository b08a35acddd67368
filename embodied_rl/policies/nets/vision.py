"""A small image encoder trained from scratch: conv stack with GroupNorm, spatial softmax.

Input is uint8 [B, h, w, 3]; it is scaled to [0, 1] floats here. While training, each image is
randomly cropped to `crop_frac` of its size (a cheap, strong augmentation for BC from pixels);
at evaluation the crop is centred, so train and test see the same image size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class SpatialSoftmax(nn.Module):
    """[B, C, h, w] -> [B, 2C]: the expected (x, y) image coordinate of each channel."""

    def forward(self, features: Tensor) -> Tensor:
        b, c, h, w = features.shape
        attention = features.flatten(2).softmax(dim=-1).view(b, c, h, w)
        ys = torch.linspace(-1, 1, h, device=features.device)
        xs = torch.linspace(-1, 1, w, device=features.device)
        expected_y = (attention.sum(dim=3) * ys).sum(dim=-1)
        expected_x = (attention.sum(dim=2) * xs).sum(dim=-1)
        return torch.cat([expected_x, expected_y], dim=-1)


class ImageEncoder(nn.Module):
    def __init__(
        self,
        image_shape: tuple[int, int] | list[int],
        feature_dim: int = 64,
        channels: tuple[int, ...] | list[int] = (32, 64, 64),
        crop_frac: float = 0.9,
        n_groups: int = 8,
    ):
        super().__init__()
        self.image_shape = (int(image_shape[0]), int(image_shape[1]))
        self.crop = tuple(max(8, round(s * crop_frac)) for s in self.image_shape)
        layers, in_ch = [], 3
        for i, out_ch in enumerate(channels):
            layers += [
                nn.Conv2d(in_ch, out_ch, 3, stride=2 if i < 2 else 1, padding=1),
                nn.GroupNorm(n_groups, out_ch),
                nn.ReLU(),
            ]
            in_ch = out_ch
        self.convs = nn.Sequential(*layers)
        self.keypoints = SpatialSoftmax()
        self.project = nn.Sequential(nn.Linear(2 * in_ch, feature_dim), nn.LayerNorm(feature_dim))
        self.feature_dim = feature_dim

    def crop_images(self, images: Tensor) -> Tensor:
        """[B, h, w, 3] -> [B, ch, cw, 3]: random crops while training, the centre otherwise."""
        b, h, w, _ = images.shape
        ch, cw = self.crop
        if self.training:
            top = torch.randint(0, h - ch + 1, (b,), device=images.device)
            left = torch.randint(0, w - cw + 1, (b,), device=images.device)
        else:
            top = torch.full((b,), (h - ch) // 2, device=images.device)
            left = torch.full((b,), (w - cw) // 2, device=images.device)
        rows = top[:, None] + torch.arange(ch, device=images.device)
        cols = left[:, None] + torch.arange(cw, device=images.device)
        batch = torch.arange(b, device=images.device)[:, None, None]
        return images[batch, rows[:, :, None], cols[:, None, :]]

    def forward(self, pixels: Tensor) -> Tensor:
        if tuple(pixels.shape[1:3]) != self.image_shape:
            raise ValueError(f"image encoder expects {self.image_shape} images, got {tuple(pixels.shape[1:3])}")
        images = self.crop_images(pixels).permute(0, 3, 1, 2).float() / 255.0
        return self.project(self.keypoints(self.convs(images)))
