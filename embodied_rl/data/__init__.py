"""On-disk demonstrations, training windows and normalisation."""

from embodied_rl.data.dataset import DemoDataset, write_demos

__all__ = ["DemoDataset", "write_demos"]
