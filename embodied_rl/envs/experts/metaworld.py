"""Meta-World's own scripted policies as the expert of every metaworld/<task> and suite.

The `metaworld` package ships a hand-written policy per task (`metaworld.policies`, numpy only:
they read the fully observed 39-d observation and return a 4-d action). Only that module is used;
Meta-World's Python envs are not (EnvPool runs the tasks). In a suite each env runs the policy of
its own task. At quality q < 1 the actions get noise and hesitations (ScriptedExpert); they are
not slowed, as slowing the gripper command would loosen the grasp.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor

from embodied_rl.envs.experts import ScriptedExpert
from embodied_rl.errors import UserError


def policy_map() -> dict[str, Any]:
    """Meta-World's task name (pick-place-v3) -> scripted policy class."""
    try:
        from metaworld.policies import ENV_POLICY_MAP
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] == "metaworld":
            raise UserError("the Meta-World experts need the metaworld package: "
                            "pip install 'embodied-rl[envpool]'") from None
        raise
    return ENV_POLICY_MAP


class Expert(ScriptedExpert):
    noise_scale = 0.3
    slow_scale = 0.0

    def __init__(self, env: Any, quality: float = 1.0, generator: torch.Generator | None = None,
                 mistakes: float = 0.0):
        super().__init__(env, quality=quality, generator=generator, mistakes=mistakes)
        policies = policy_map()
        suite_tasks = env.task.suite_tasks
        per_task = self.num_envs // len(suite_tasks)
        # The policies keep no state between steps, so one instance per task serves its envs.
        instances = {task: policies[f"{task}-v3"]() for task in suite_tasks}
        self.env_policies = [instances[suite_tasks[i // per_task]] for i in range(self.num_envs)]

    def plan(self, obs: Any) -> Tensor:
        state = (obs["state"] if isinstance(obs, dict) else obs).cpu().double().numpy()
        with warnings.catch_warnings():  # "Constant(s) may be too high": the env clips, as do we
            warnings.simplefilter("ignore", UserWarning)
            actions = np.stack([policy.get_action(row) for policy, row in zip(self.env_policies, state)])
        return torch.from_numpy(actions).float().clamp(-1.0, 1.0)
