"""Scripted pick-and-place experts for LIBERO-Spatial and LIBERO-Object (libero/libero_spatial/*,
libero/libero_object/*), through LIBERO's own OSC_POSE controller.

Every task of both suites is "pick up X and place it on / in Y" (the BDDL goal is one `On` or `In`
predicate), and the privileged state holds every movable object's pose (embodied_rl/envs/sims/
libero_env.py), so one planner does them all. Per env and episode it runs these phases, each
ending when the hand is near its target (or stalled just short of it, or after a time-out):

  APPROACH  above the grasp point, the fingers opened just wider than the object (neighbours
            stand close in LIBERO-Object: a fully open hand hits them)
  DESCEND   down to the grasp point
  CLOSE     close the fingers for a few steps
  LIFT      straight up, high enough for the object's bottom to clear the target
  CARRY     over the place point at that height
  LOWER     down until the object is just above the target's surface
  RELEASE   open the fingers (the object drops into the basket or onto the plate)
  RETREAT   up (the episode usually ended at RELEASE: LIBERO's success ends it)

A grasp that misses or loses the object (during LIFT and CARRY the object does not keep its
offset from the hand) sends the plan back to APPROACH: the fingers reopen on the way up to the
object's new position and it grasps again, at most MAX_GRASPS times. With `mistakes` > 0 that
share of episodes starts with a grasp point deliberately off target across the fingers (the
object outside the open fingers), so the demos show the miss and the regrasp.

The hand points down, turned about the vertical by the task's yaw, held by a proportional
rotation command; positions are proportional commands too (a full action moves the hand about
1.2 cm per step). Grasps depend on the object's category (`GRASPS`: sizes read off LIBERO's
meshes): boxes and bottles across their narrow side at their centre, shifted along their long
side away from neighbours; the black bowl by its rim. The bowl in the cabinet's open drawer
(LIBERO-Spatial task 4) is grasped by its rim farthest from the robot with the hand turned 90
degrees: the hand is longer than the drawer's opening, and on the robot's side a finger can
catch the cabinet (LIBERO places the cabinet anew at every reset, a centimetre either way).

Measured success (docs/tasks.md): at least 90% on every task of both suites. Quality < 1 adds
noise and hesitations (ScriptedExpert; a hesitating hand holds still: a zero gripper command
keeps the fingers where they are); it does not slow the hand.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from embodied_rl.envs.experts import ScriptedExpert
from embodied_rl.envs.tasks import libero
from embodied_rl.errors import UserError


class Grasp(NamedTuple):
    half_width: float  # the object's half size across the fingers (m)
    height: float  # grasp point above the object's origin
    bottom: float  # the object's lowest point relative to its origin
    side: float  # grasp point beside the origin, across the fingers (the bowl's rim)
    slack: float  # how far the grasp may move along the object's long side


GRASPS = {
    "akita_black_bowl": Grasp(0.008, 0.040, 0.002, 0.047, 0.0),
    "alphabet_soup": Grasp(0.035, 0.015, -0.038, 0.0, 0.0),
    "cream_cheese": Grasp(0.021, 0.002, -0.009, 0.0, 0.022),
    "salad_dressing": Grasp(0.027, 0.030, -0.073, 0.0, 0.0),
    "bbq_sauce": Grasp(0.023, 0.020, -0.055, 0.0, 0.0),
    "ketchup": Grasp(0.029, 0.030, -0.072, 0.0, 0.0),
    "tomato_sauce": Grasp(0.034, 0.015, -0.038, 0.0, 0.0),
    "butter": Grasp(0.020, 0.002, -0.009, 0.0, 0.020),
    "milk": Grasp(0.027, 0.020, -0.070, 0.0, 0.0),
    "chocolate_pudding": Grasp(0.023, 0.004, -0.013, 0.0, 0.022),
    "orange_juice": Grasp(0.027, 0.020, -0.070, 0.0, 0.0),
}
SURFACES = {"plate": 0.016, "basket": 0.146}  # the target's top above its origin
# (suite, task id) -> the hand's yaw and the grasp point's offset from the object's origin
SPECIAL = {("libero_spatial", 4): (math.pi / 2, (0.047, 0.0))}

APPROACH, DESCEND, CLOSE, LIFT, CARRY, LOWER, RELEASE, RETREAT = range(8)
FINGER_OPEN = 0.04  # a finger's position when open (closed: 0)
STEP = 0.05  # a full position action asks for this displacement (OSC_POSE's output_max)
TURN = 0.5  # a full rotation action asks for this many radians
GAIN, TURN_GAIN = 2.0, 1.0
HOVER, LIFT_MIN, CLEAR, DROP, MARGIN = 0.08, 0.1, 0.08, 0.03, 0.012
TOLERANCE, TOLERANCE_XY, CLOSE_STEPS, TIME_OUT = 0.008, 0.01, 10, 30
LOST, MAX_GRASPS = 0.05, 3  # the object moved this far from where the hand held it: grasp again
MISS = (0.005, 0.015)  # a deliberate miss puts the object this far outside the open fingers
HAND = np.array([0.03, 0.11])  # half size of the hand's footprint: its long side is across the fingers
ROBOT, POSE = libero.ROBOT_DIM, libero.OBJECT_DIM


def rotation_error(quat: np.ndarray, yaw: float) -> np.ndarray:
    """Axis-angle (world frame) from the hand's orientation (quaternion xyzw) to pointing down,
    turned by `yaw` about the vertical."""
    x, y, z, w = quat
    current = np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])
    c, s = math.cos(yaw), math.sin(yaw)
    wanted = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]]) @ np.diag([1.0, -1.0, -1.0])
    error = wanted @ current.T
    angle = math.acos(float(np.clip((np.trace(error) - 1) / 2, -1.0, 1.0)))
    if angle < 1e-6:
        return np.zeros(3)
    axis = np.array([error[2, 1] - error[1, 2], error[0, 2] - error[2, 0], error[1, 0] - error[0, 1]])
    return axis / (2 * math.sin(angle)) * angle


def category(name: str) -> str:
    """akita_black_bowl_1 -> akita_black_bowl; basket_1_contain_region -> basket."""
    return name.replace("_contain_region", "").rsplit("_", 1)[0]


class PickPlace:
    """One episode's plan: pick `objects[k]` and put it on or in the goal's target."""

    def __init__(self, objects: list[str], goal: list[list[str]], yaw: float = 0.0,
                 side: tuple[float, float] | None = None, miss: float = 0.0):
        _, picked, target = goal[0]
        self.picked = objects.index(picked)
        self.target = objects.index(target.replace("_contain_region", ""))
        self.grasp = GRASPS[category(picked)]
        self.surface = SURFACES[category(target)]
        self.yaw = yaw
        self.side = np.array(side if side is not None else (0.0, self.grasp.side))
        self.phase, self.count = APPROACH, 0
        self.shift: float | None = None
        self.previous: np.ndarray | None = None
        self.hold_xy = np.zeros(2)
        self.carry_z = 0.0
        # the first grasp's offset across the fingers (a deliberate miss), then the grasps made
        self.miss = miss * np.array([-math.sin(yaw), math.cos(yaw)])
        self.grasps = 0
        self.held: np.ndarray | None = None  # the object's offset from the hand when the lift began

    @staticmethod
    def position(state: np.ndarray, k: int) -> np.ndarray:
        return state[ROBOT + POSE * k: ROBOT + POSE * k + 3]

    def choose_shift(self, state: np.ndarray) -> float:
        """Where along its long side to grasp the object: the shift whose hand footprint keeps
        farthest from the other objects (the smallest shift among equals)."""
        if self.grasp.slack <= 0:
            return 0.0
        slots = (len(state) - ROBOT) // POSE
        others = [self.position(state, k)[:2] for k in range(slots)
                  if k != self.picked and np.any(self.position(state, k))]  # empty slots are zeros
        centre = self.position(state, self.picked)[:2] + self.side
        best, best_room = 0.0, -math.inf
        for shift in sorted(np.linspace(-self.grasp.slack, self.grasp.slack, 9), key=abs):
            middle = centre + [shift, 0.0]
            room = min(float(np.linalg.norm(np.maximum(np.abs(o - middle) - HAND, 0.0))) for o in others)
            if room > best_room + 1e-3:
                best, best_room = float(shift), room
        return best

    def act(self, state: np.ndarray) -> np.ndarray:
        """The 7-d action (delta position, delta rotation, gripper) for this step."""
        grasp, hand, finger = self.grasp, state[:3], float(state[7])
        target_pos, picked = self.position(state, self.target), self.position(state, self.picked)
        if self.phase in (LIFT, CARRY) and np.linalg.norm(picked - hand - self.held) > LOST \
                and self.grasps < MAX_GRASPS:
            self.phase, self.count, self.shift, self.previous = APPROACH, 0, None, None  # missed or dropped
        if self.shift is None:
            self.shift = self.choose_shift(state)
        grasp_point = picked + [self.shift + self.side[0], self.side[1], grasp.height]
        if self.grasps == 0:
            grasp_point[:2] += self.miss
        # the hand height at which the object's bottom is `above` over the target's surface
        over_target = target_pos[2] + self.surface + (grasp.height - grasp.bottom)
        place = np.array([target_pos[0] + self.side[0], target_pos[1] + self.side[1], over_target + DROP])
        pre_grasp = grasp.half_width + MARGIN
        goal, width = {
            APPROACH: (grasp_point + [0.0, 0.0, HOVER], pre_grasp),
            DESCEND: (grasp_point, pre_grasp),
            CLOSE: (grasp_point, 0.0),
            LIFT: (np.array([*self.hold_xy, self.carry_z]), 0.0),
            CARRY: (np.array([*place[:2], self.carry_z]), 0.0),
            LOWER: (place, 0.0),
            RELEASE: (place, FINGER_OPEN),
        }.get(self.phase, (place + [0.0, 0.0, 0.1], FINGER_OPEN))
        error = goal - hand
        self.advance(hand, picked, error, over_target)
        action = np.zeros(7)
        action[:3] = np.clip(error / STEP * GAIN, -1.0, 1.0)
        action[3:6] = np.clip(rotation_error(state[3:7], self.yaw) / TURN * TURN_GAIN, -1.0, 1.0)
        # The Panda gripper moves its fingers a step per sign of the command (+1 closes, -1 opens,
        # 0 holds), so a width in between is kept by closing while wider and opening while narrower.
        if width <= 0.0 or width >= FINGER_OPEN:
            action[6] = 1.0 if width <= 0.0 else -1.0
        else:
            action[6] = 1.0 if finger > width + 0.003 else (-1.0 if finger < width - 0.003 else 0.0)
        return action

    def advance(self, hand: np.ndarray, picked: np.ndarray, error: np.ndarray, over_target: float) -> None:
        """Move to the next phase when this one is done."""
        self.count += 1
        # stalled: the hand stopped just short of its target (a load, a contact); close enough
        stalled = (self.previous is not None and np.linalg.norm(hand - self.previous) < 0.001
                   and np.linalg.norm(error) < 0.03)
        self.previous = hand.copy()
        near_xy = np.linalg.norm(error[:2]) < TOLERANCE_XY or stalled
        done = {
            APPROACH: near_xy and abs(error[2]) < 0.02,
            DESCEND: np.linalg.norm(error) < TOLERANCE or self.count > TIME_OUT,
            CLOSE: self.count >= CLOSE_STEPS,
            LIFT: abs(error[2]) < 0.015 or stalled,
            CARRY: near_xy,
            LOWER: np.linalg.norm(error) < TOLERANCE or self.count > TIME_OUT,
            RELEASE: self.count >= CLOSE_STEPS,
        }.get(self.phase, False)
        if not done:
            return
        if self.phase == CLOSE:  # lift straight up, high enough to clear the target (and at least LIFT_MIN)
            self.hold_xy = hand[:2].copy()
            self.carry_z = max(over_target + CLEAR, hand[2] + LIFT_MIN)
            self.held = picked - hand
            self.grasps += 1
        self.phase, self.count = self.phase + 1, 0


class Expert(ScriptedExpert):
    noise_scale = 0.3
    slow_scale = 0.0  # slowing the gripper command would loosen the grasp
    makes_mistakes = True  # a first grasp off target, then a regrasp

    def __init__(self, env: Any, quality: float = 1.0, generator: torch.Generator | None = None,
                 mistakes: float = 0.0):
        super().__init__(env, quality=quality, generator=generator, mistakes=mistakes)
        suite = self.task.suite
        if suite not in libero.EXPERT_SUITES:
            raise UserError(f"task '{self.task.name}' has no scripted expert (LIBERO's experts cover "
                            f"{', '.join(libero.EXPERT_SUITES)})")
        self.suite = suite
        self.tasks = libero.suites()[suite]["tasks"]
        self.plans: list[PickPlace | None] = [None] * self.num_envs

    def reset(self, mask: Tensor | None = None) -> None:
        super().reset(mask)
        mask = torch.ones(self.num_envs, dtype=torch.bool) if mask is None else mask.cpu().bool()
        for i in torch.nonzero(mask).flatten().tolist():
            self.plans[i] = None  # a new episode: a new plan at its first observation

    def plan(self, obs: Any) -> Tensor:
        state = obs["state"].cpu().double().numpy()
        instruction = obs["instruction"].cpu().numpy()  # the env's task, as its index in suite_tasks
        actions = np.zeros((self.num_envs, 7))
        for i in range(self.num_envs):
            if self.plans[i] is None:
                task_id = self.task.suite_tasks[int(instruction[i])]
                yaw, side = SPECIAL.get((self.suite, task_id), (0.0, None))
                description = self.tasks[task_id]
                miss = 0.0
                if self.mistakes > 0 and float(torch.rand(1, generator=self.generator)) < self.mistakes:
                    picked = GRASPS[category(description["goal"][0][1])]
                    sign = 1.0 if float(torch.rand(1, generator=self.generator)) < 0.5 else -1.0
                    beyond = MISS[0] + (MISS[1] - MISS[0]) * float(torch.rand(1, generator=self.generator))
                    miss = sign * (2 * picked.half_width + MARGIN + beyond)
                self.plans[i] = PickPlace(description["objects"], description["goal"], yaw, side, miss)
            actions[i] = self.plans[i].act(state[i])
        return torch.from_numpy(actions).float()
