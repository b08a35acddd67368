"""Simulator backends. `embodied_rl.envs.registry.BACKENDS` maps a backend name to its module;
each module exposes `make_env(task, num_envs, device, seed, **options) -> BatchedEnv`."""
