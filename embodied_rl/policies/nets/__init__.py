"""Backbones: denoisers over an action chunk and an image encoder."""

from embodied_rl.policies.nets.mlp import ResidualMLP, TimeEmbedding, sinusoidal_embedding
from embodied_rl.policies.nets.unet1d import ConditionalUnet1D
from embodied_rl.policies.nets.vision import ImageEncoder

BACKBONES = {"mlp": ResidualMLP, "unet": ConditionalUnet1D}

__all__ = [
    "BACKBONES",
    "ConditionalUnet1D",
    "ImageEncoder",
    "ResidualMLP",
    "TimeEmbedding",
    "sinusoidal_embedding",
]
