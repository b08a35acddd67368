"""On-disk demonstrations, training windows and normalisation."""

from embodied_rl.data.dataset import DemoDataset, write_demos
from embodied_rl.data.normalizer import Normalizer
from embodied_rl.data.windows import ChunkWindows, fit_normalizer, window_indices

__all__ = ["ChunkWindows", "DemoDataset", "Normalizer", "fit_normalizer", "window_indices", "write_demos"]
