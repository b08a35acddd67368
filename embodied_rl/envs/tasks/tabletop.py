"""tabletop: the language-conditioned table suite. One scene, fifteen instructions; the instruction,
not the scene, decides what success is.

Scene (assets/tabletop.xml): a gantry gripper (hand on x/y/z slides, two box fingers), three 4 cm
cubes (red, green, blue) and three flat 6 cm pads (yellow, white, purple) at random places on a
table. The cubes slide on x/y/z joints without rotating; the table is the z joint's lower limit.
Control at 10 Hz (10 x 10 ms physics).

Instructions, three templates over the same scene (`INSTRUCTIONS`, in this order):
  "pick up the {cube} cube"              (3)  success: that cube's bottom >= 5 cm above the table
  "put the {cube} cube on the {pad} pad" (9)  success: that cube's centre within 2 cm of the pad's
                                              centre (x and y), resting on it, the gripper open
  "touch the {pad} pad"                  (3)  success: the point between the fingertips over the
                                              pad (within 3 cm in x and y), the hand within 8 mm
                                              of its lowest position (fingertips on the pad)
Success ends the episode. Failure (also ends it): lifting a cube the instruction does not name
(>= 2 cm; cubes rise only when grasped), so picking the wrong object never passes.

Each env draws its instruction per episode (`sample_instruction`) from the templates in
`templates` and the split in `instruction_split`: "seen" (the default: every instruction but the
`held_out` ones, what collect records and training uses), "held_out" (only those: generalisation
to unseen cube/pad combinations) or "all". The instruction list itself never changes with these
options, so a checkpoint runs on any split.

Action (4): absolute hand target x, y (+-18 cm), z (2.7-20 cm: the fingertips 2 mm above the table
at the bottom), and the gripper (-1 open ... +1 closed), each in [-1, 1].
Observation (4, proprioception only: the objects are seen in the camera image, obs_mode=pixels):
hand xyz (the point between the fingertips), finger closure (0 open .. 1 fully closed).
Reward (dense, in [0, 1], for `algo.reward=dense`): reach the named cube and lift it (pick), reach
it and bring it to the pad (put), bring the fingertips to the pad (touch).
Initial state: cubes and pads uniform in +-15 cm, cubes and pads >= 9 cm apart (the open fingers
fit between cubes; pads never overlap), pads >= 8 cm from every cube (no cube starts on a pad);
the open hand 10-16 cm above the table at a random xy in +-10 cm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embodied_rl.envs.api import (
    SimState,
    Task,
    actuator_index,
    joint_qpos_slice,
    scale_action,
    sensor_slice,
)
from embodied_rl.errors import UserError

CUBES = ("red", "green", "blue")
PADS = ("yellow", "white", "purple")
TEMPLATES = {  # template name -> text; the instruction list is every filling, in this order
    "pick": "pick up the {cube} cube",
    "put": "put the {cube} cube on the {pad} pad",
    "touch": "touch the {pad} pad",
}


def _fillings() -> list[tuple[str, str, int, int]]:
    """(text, template, cube index or -1, pad index or -1) of every instruction."""
    rows = [(TEMPLATES["pick"].format(cube=cube), "pick", c, -1) for c, cube in enumerate(CUBES)]
    rows += [(TEMPLATES["put"].format(cube=cube, pad=pad), "put", c, p)
             for c, cube in enumerate(CUBES) for p, pad in enumerate(PADS)]
    rows += [(TEMPLATES["touch"].format(pad=pad), "touch", -1, p) for p, pad in enumerate(PADS)]
    return rows


FILLINGS = _fillings()
INSTRUCTIONS = tuple(row[0] for row in FILLINGS)
KINDS = tuple(row[1] for row in FILLINGS)
# one cube and one pad never paired in the demos, for each cube and each pad (a Latin square)
HELD_OUT = ("put the red cube on the purple pad", "put the green cube on the yellow pad",
            "put the blue cube on the white pad")
SPLITS = ("seen", "held_out", "all")

CUBE_HALF = 0.02
PAD_HALF = 0.03
FINGER_TRAVEL = 0.04  # finger joint range: 0 open .. 0.04 fully closed (past a cube)
HAND_LOW_Z = 0.027  # the lowest hand target: fingertips 2 mm above the table
LIFT_HEIGHT = 0.05  # pick: the cube's bottom this high above the table
WRONG_LIFT = 0.02  # a cube the instruction does not name, lifted this high: failure
PLACE_TOLERANCE = 0.02  # put: cube centre within this of the pad centre (x and y)
RESTING = 0.005  # put: the cube's bottom at most this above the table
RELEASED = 0.3  # put: finger closure below this (the gripper let go)
TOUCH_HEIGHT = HAND_LOW_Z + 0.008  # touch: the hand at most this high
# least distances between object centres in an initial scene (metres)
GAPS = {("cube", "cube"): 0.09,  # the open fingers (outer faces 5 cm from the centre) fit between cubes
        ("pad", "pad"): 0.09,  # 6 cm pads never overlap
        ("pad", "cube"): 0.08}  # no cube starts on a pad; fingers on a pad's centre miss the cubes


class TabletopTask(Task):
    name = "tabletop"
    gym_id = "embodied_rl/Tabletop-v0"
    xml = "tabletop.xml"
    max_episode_steps = 60
    control_substeps = 10
    obs_dim = 4
    action_dim = 4
    camera = "front"
    effector_obs, gripper_obs = (0, 1, 2), 3  # hand xyz, finger closure
    proprioceptive_state = True
    has_success = True
    success_criterion = ("per instruction: the named cube lifted 5 cm (pick), on the named pad and let go "
                         "(put), the fingertips on the named pad (touch); lifting another cube fails")
    instructions = INSTRUCTIONS
    # which instructions the env draws (the list above never changes)
    instruction_split = "seen"  # seen | held_out | all
    held_out = list(HELD_OUT)  # instructions never drawn under "seen" (lists: as a config gives them)
    templates = list(TEMPLATES)  # the templates drawn from: pick, put, touch
    object_range = 0.15
    hand_range = 0.1

    def __init__(self, **overrides: Any):
        super().__init__(**overrides)
        self.templates = tuple(self.templates)
        self.held_out = tuple(self.held_out)
        for template in self.templates:
            if template not in TEMPLATES:
                raise UserError(f"unknown instruction template '{template}' in task.templates "
                                f"(choose from: {', '.join(TEMPLATES)})")
        for text in self.held_out:
            if text not in INSTRUCTIONS:
                raise UserError(f"unknown instruction '{text}' in task.held_out (the instructions: "
                                f"{', '.join(repr(t) for t in INSTRUCTIONS)})")
        if self.instruction_split not in SPLITS:
            raise UserError(f"task.instruction_split must be one of {', '.join(SPLITS)}, "
                            f"got {self.instruction_split!r}")
        self.drawn = torch.tensor([i for i in range(len(INSTRUCTIONS)) if self._drawn(i)], dtype=torch.long)
        if len(self.drawn) == 0:
            raise UserError(f"task.templates={list(self.templates)} with task.instruction_split="
                            f"{self.instruction_split} leaves no instruction to draw")
        # per instruction id: template (0 pick, 1 put, 2 touch), cube and pad index (-1: none)
        self.kind = torch.tensor([list(TEMPLATES).index(kind) for kind in KINDS])
        self.cube = torch.tensor([row[2] for row in FILLINGS])
        self.pad = torch.tensor([row[3] for row in FILLINGS])

    def _drawn(self, index: int) -> bool:
        text, template = INSTRUCTIONS[index], KINDS[index]
        held = text in self.held_out
        split_ok = {"seen": not held, "held_out": held, "all": True}[self.instruction_split]
        return template in self.templates and split_ok

    def sample_instruction(self, n: int, generator: torch.Generator) -> Tensor:
        """Uniform over the instructions of `templates` in `instruction_split`."""
        return self.drawn[torch.randint(len(self.drawn), (n,), generator=generator)]

    def bind(self, model: Any) -> None:
        self.nq, self.nv, self.nu = model.nq, model.nv, model.nu
        self.hand_joints = [joint_qpos_slice(model, f"hand_{axis}").start for axis in "xyz"]
        self.fingers = [joint_qpos_slice(model, f"finger_{side}").start for side in ("left", "right")]
        self.cube_joints = [[joint_qpos_slice(model, f"{cube}_cube_{axis}").start for axis in "xyz"]
                            for cube in CUBES]
        self.pad_joints = [[joint_qpos_slice(model, f"{pad}_pad_{axis}").start for axis in "xy"] for pad in PADS]
        self.hand_actuators = [actuator_index(model, f"hand_{axis}") for axis in "xyz"]
        self.finger_actuators = [actuator_index(model, f"finger_{side}") for side in ("left", "right")]
        self.grip_pos = sensor_slice(model, "grip_pos")
        self.cube_sensors = [sensor_slice(model, f"{cube}_cube_pos").start for cube in CUBES]
        self.pad_sensors = [sensor_slice(model, f"{pad}_pad_pos").start for pad in PADS]
        self.low = torch.tensor([-0.18, -0.18, HAND_LOW_Z])
        self.high = torch.tensor([0.18, 0.18, 0.2])

    # ---- helpers shared with the expert ----
    def poses(self, state: SimState) -> dict[str, Tensor]:
        """hand xyz [N, 3], closure [N], cubes xyz [N, 3, 3], pads xyz [N, 3, 3] (float32)."""
        sensors = state.sensordata.float()
        qpos = state.qpos.float()
        cubes = torch.stack([sensors[:, s : s + 3] for s in self.cube_sensors], dim=1)
        pads = torch.stack([sensors[:, s : s + 3] for s in self.pad_sensors], dim=1)
        return {"hand": sensors[:, self.grip_pos], "closure": qpos[:, self.fingers].mean(dim=1) / FINGER_TRAVEL,
                "cubes": cubes, "pads": pads}

    def targets(self, state: SimState) -> tuple[Tensor, Tensor, Tensor]:
        """(template id [N], named cube xyz [N, 3], named pad xyz [N, 3]) of each env's instruction
        (a template without a cube or pad gives cube or pad 0 there: unused)."""
        if state.instruction is None:
            raise ValueError("tabletop needs SimState.instruction (the env's instruction ids)")
        p = self.poses(state)
        instruction = state.instruction.to(p["hand"].device)
        kind, cube, pad = (table.to(instruction.device)[instruction] for table in (self.kind, self.cube, self.pad))
        rows = torch.arange(len(instruction), device=instruction.device)
        return kind, p["cubes"][rows, cube.clamp(min=0)], p["pads"][rows, pad.clamp(min=0)]

    def target_to_action(self, target: Tensor, grip: Tensor) -> Tensor:
        """Hand target [N, 3] (x, y, z) and grip [N] in [-1, 1] -> action [N, 4]."""
        low, high = self.low.to(target.device), self.high.to(target.device)
        scaled = (target - low) / (high - low) * 2 - 1
        return torch.cat((scaled, grip[:, None]), dim=1).clamp(-1.0, 1.0)

    # ---- Task API ----
    def _layout(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Cube and pad xy ([n, 3, 2] each), uniform in +-object_range and placed one at a time: each
        new object is redrawn (up to 100 times, for the envs where it breaks a rule) until it is
        far enough from those already placed (GAPS). The rules leave room to spare: the 100 draws
        almost never run out (then the last draw stands)."""
        def draw(k: int) -> Tensor:
            return (torch.rand(k, 2, generator=generator) * 2 - 1) * self.object_range

        kinds = ["cube"] * len(CUBES) + ["pad"] * len(PADS)
        placed = torch.zeros(n, 0, 2)
        for k, kind in enumerate(kinds):
            minimum = torch.tensor([GAPS[kind, other] for other in kinds[:k]])
            point = draw(n)
            for _ in range(100):
                bad = ((point[:, None] - placed).norm(dim=2) < minimum).any(dim=1)
                if not bool(bad.any()):
                    break
                point[bad] = draw(int(bad.sum()))
            placed = torch.cat((placed, point[:, None]), dim=1)
        return placed[:, : len(CUBES)], placed[:, len(CUBES) :]

    def sample_init(self, n: int, generator: torch.Generator, device: torch.device | str) -> tuple[Tensor, Tensor]:
        cubes, pads = self._layout(n, generator)
        qpos = torch.zeros(n, self.nq)
        for c, (x, y, _) in enumerate(self.cube_joints):
            qpos[:, x], qpos[:, y] = cubes[:, c, 0], cubes[:, c, 1]
        for p, (x, y) in enumerate(self.pad_joints):
            qpos[:, x], qpos[:, y] = pads[:, p, 0], pads[:, p, 1]
        hand_xy = (torch.rand(n, 2, generator=generator) * 2 - 1) * self.hand_range
        qpos[:, self.hand_joints[0]], qpos[:, self.hand_joints[1]] = hand_xy[:, 0], hand_xy[:, 1]
        qpos[:, self.hand_joints[2]] = 0.10 + torch.rand(n, generator=generator) * 0.06
        return qpos.to(device), torch.zeros(n, self.nv, device=device)

    def action_to_ctrl(self, action: Tensor) -> Tensor:
        ctrl = torch.zeros(action.shape[0], self.nu, device=action.device)
        ctrl[:, self.hand_actuators] = scale_action(action[:, :3], self.low.to(action.device),
                                                    self.high.to(action.device))
        ctrl[:, self.finger_actuators] = scale_action(action[:, 3:4], 0.0, FINGER_TRAVEL).expand(-1, 2)
        return ctrl

    def observe(self, state: SimState) -> Tensor:
        p = self.poses(state)
        return torch.cat((p["hand"], p["closure"][:, None]), dim=1)

    def evaluate(self, state: SimState, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        p = self.poses(state)
        kind, cube, pad = self.targets(state)
        hand = p["hand"]
        pick, put, touch = kind == 0, kind == 1, kind == 2
        rise = cube[:, 2] - CUBE_HALF
        reach_cube = 1 - torch.tanh(10 * (cube - hand).norm(dim=1))
        placed = (cube[:, :2] - pad[:, :2]).abs().amax(dim=1)
        over_pad = (hand[:, :2] - pad[:, :2]).abs().amax(dim=1)
        touch_distance = (hand[:, :2] - pad[:, :2]).norm(dim=1) + (hand[:, 2] - HAND_LOW_Z).clamp(min=0)

        success = torch.where(pick, rise >= LIFT_HEIGHT, torch.zeros_like(pick))
        success |= put & (placed < PLACE_TOLERANCE) & (rise < RESTING) & (p["closure"] < RELEASED)
        success |= touch & (over_pad < PAD_HALF) & (hand[:, 2] < TOUCH_HEIGHT)
        reward = torch.where(
            pick, 0.5 * reach_cube + 0.5 * (rise / LIFT_HEIGHT).clamp(0.0, 1.0),
            torch.where(put, 0.5 * reach_cube + 0.5 * (1 - torch.tanh(10 * placed)),
                        1 - torch.tanh(10 * touch_distance)))

        # failure: a cube the instruction does not name was lifted (only a grasp lifts a cube)
        named = self.cube.to(kind.device)[state.instruction.to(kind.device)]
        others = torch.arange(len(CUBES), device=kind.device)[None, :] != named[:, None]  # touch: all
        lifted = (p["cubes"][:, :, 2] - CUBE_HALF) >= WRONG_LIFT
        failure = (lifted & others).any(dim=1)
        return reward, success & ~failure, failure
