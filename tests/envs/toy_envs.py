"""Tiny gymnasium envs whose numbers are known exactly, for the gymnasium and process backends.

Only numpy and gymnasium: the process backend's workers import this module (as `toy_envs`, with
tests/envs on PYTHONPATH), in interpreters that may have nothing else.
"""

import json
import os
import signal
import time

import gymnasium as gym
import numpy as np


class CountEnv(gym.Env):
    """obs = [steps taken, last env-space action, a seed-dependent start value]; reward = 1 per
    step; success (`is_success`) from the second step on; terminated when the action exceeds
    3.5 (the top of its [-2, 4] action range); the time limit comes from max_episode_steps.
    """

    observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float64)
    action_space = gym.spaces.Box(-2.0, 4.0, (1,), np.float32)
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, render_mode=None):
        self.render_mode = render_mode

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.start = float(self.np_random.uniform())
        return np.array([0.0, 0.0, self.start]), {}

    def step(self, action):
        self.t += 1
        a = float(action[0])
        obs = np.array([self.t, a, self.start])
        return obs, 1.0, a > 3.5, False, {"is_success": self.t >= 2}

    def render(self):
        return np.full((4, 6, 3), self.t, dtype=np.uint8)


class DictObsEnv(CountEnv):
    observation_space = gym.spaces.Dict({"a": gym.spaces.Box(-1, 1, (2,)),
                                         "b": gym.spaces.Box(-1, 1, (1,))})

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, False, {}


gym.register("TestCount-v0", entry_point=CountEnv, max_episode_steps=4)
gym.register("TestDictObs-v0", entry_point=DictObsEnv, max_episode_steps=4)

_made = 0  # envs made in this process so far


def misbehaving(fault: str, at_step: int = 2):
    """A factory for the process backend: a CountEnv (max 4 steps) whose second copy made in
    each worker process does `fault` at its `at_step`-th step: "nan_reward", "bad_shape",
    "bad_flag", "raise", "hang", "die", or "print" (prints to stdout, which must do no harm)."""
    global _made
    _made += 1
    env = Misbehaving(fault if _made == 2 else None, at_step)
    return gym.wrappers.TimeLimit(env, max_episode_steps=4)


class Misbehaving(CountEnv):
    def __init__(self, fault, at_step):
        super().__init__()
        self.fault, self.at_step = fault, at_step

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.t != self.at_step or self.fault is None:
            return obs, reward, terminated, truncated, info
        if self.fault == "print":
            print("a simulator that talks on stdout")
        elif self.fault == "nan_reward":
            reward = float("nan")
        elif self.fault == "bad_shape":
            obs = obs[:2]
        elif self.fault == "bad_flag":
            terminated = float("nan")
        elif self.fault == "raise":
            raise RuntimeError("the simulator broke\nacross two lines")
        elif self.fault == "hang":
            time.sleep(3600)
        elif self.fault == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        return obs, reward, terminated, truncated, info


class SnapshotCountEnv(CountEnv):
    """A CountEnv with get_state/set_state: its step count, start value and random state."""

    def get_state(self):
        rng = json.dumps(self.np_random.bit_generator.state).encode()
        return {"t": np.array(self.t), "start": np.array(self.start), "rng": np.frombuffer(rng, np.uint8)}

    def set_state(self, state):
        self.t, self.start = int(state["t"]), float(state["start"])
        self.np_random.bit_generator.state = json.loads(state["rng"].tobytes())


gym.register("TestSnapshotCount-v0", entry_point=SnapshotCountEnv, max_episode_steps=4)


class LabelledCountEnv(CountEnv):
    """A CountEnv whose observation's last entry is its `label` (each env's own keyword argument,
    from the process backend's per_env) and that reports its simulator's versions."""

    versions = {"toy": "1.0"}

    def __init__(self, label=0.0):
        super().__init__()
        self.label = float(label)

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed)
        return np.array([0.0, 0.0, self.label]), info

    def step(self, action):
        obs, *rest = super().step(action)
        return np.array([obs[0], obs[1], self.label]), *rest


def labelled(label=0.0, needs=None):
    """A factory for the process backend by file path (toy_envs.py:labelled); `needs` names a
    module it imports first (a simulator this interpreter may lack)."""
    if needs:
        __import__(needs)
    return gym.wrappers.TimeLimit(LabelledCountEnv(label), max_episode_steps=4)
