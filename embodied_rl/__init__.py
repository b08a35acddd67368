"""embodied_rl: make pretrained robot policies better with reinforcement learning in simulation."""

__version__ = "0.1.0"
