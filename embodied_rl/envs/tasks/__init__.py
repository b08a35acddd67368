"""Task logic, one module per task (see embodied_rl.envs.registry.TASKS and api.Task)."""
