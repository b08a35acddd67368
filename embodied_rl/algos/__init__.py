"""Training algorithms: BC pretraining (bc.py) and RL fine-tuning. Each reads top to bottom;
import the module you need (e.g. `from embodied_rl.algos.bc import train_bc`)."""
