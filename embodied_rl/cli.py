"""The `embodied-rl` command line.

    embodied-rl <command> [key=value ...]

Each command composes its Hydra config (configs/<command>.yaml plus the groups task/, policy/
and algo/), validates it before doing any work, runs in one run directory, and prints the
headline numbers and the run directory at the end (`tasks` only prints its table). Bad input
exits with code 2 and one line; a training run that diverges exits with code 3 and one line.
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

from embodied_rl.config import compose
from embodied_rl.errors import Diverged, UserError

# OSErrors that are the machine's state, not a bug: one line and exit code 2
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)

# command -> (one-line help, module with `main(cfg) -> (headline, run_dir)`)
# Commands that run data-parallel under torchrun (embodied_rl/distributed.py).
DATA_PARALLEL = ("finetune", "pretrain")

COMMANDS: dict[str, tuple[str, str]] = {
    "collect": ("run a scripted expert and write a demo dataset", "embodied_rl.commands.collect"),
    "pretrain": ("behaviour-clone a policy from demos", "embodied_rl.commands.pretrain"),
    "eval": ("success rate, intervals and videos of a checkpoint", "embodied_rl.commands.evaluate"),
    "finetune": ("RL fine-tuning of a pretrained policy", "embodied_rl.commands.finetune"),
    "train-reward": ("train a reward model (success, progress) on collected episodes", "embodied_rl.commands.train_reward"),
    "quickstart": ("collect, pretrain, eval, finetune, eval on the default task", "embodied_rl.commands.quickstart"),
    "tasks": ("list every task: backends, observation modes, success criterion, expert", "embodied_rl.commands.tasks"),
    "import-demos": ("read a LeRobotDataset v3 directory into a demo dataset", "embodied_rl.commands.import_demos"),
    "export-demos": ("write a demo dataset as a LeRobotDataset v3 directory", "embodied_rl.commands.export_demos"),
    "setup-sim": ("make a simulator's own venv: setup-sim libero", "embodied_rl.commands.setup_sim"),
}
# Commands whose first argument may be a bare value: `embodied-rl setup-sim libero` is sim=libero.
POSITIONAL = {"setup-sim": "sim"}

USAGE = """usage: embodied-rl <command> [key=value ...]

Make pretrained robot policies better with reinforcement learning in simulation.

commands:
{commands}

Every command takes Hydra overrides (key=value); those that write a run directory take run_dir=PATH.
`embodied-rl <command> --help` prints the command's full config.
"""


def usage() -> str:
    lines = [f"  {name:<12} {text}" for name, (text, _) in COMMANDS.items()]
    return USAGE.format(commands="\n".join(lines))


def print_headline(command: str, headline: dict[str, Any], run_dir: Path | None) -> None:
    for key, value in headline.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        print(f"{key}: {value}")
    if run_dir is not None:  # None: a command that writes no run directory (tasks)
        print(f"run_dir: {run_dir}")


def set_threads(cfg: Any) -> int:
    """Set torch's intra-op threads: `threads=N`, else OMP_NUM_THREADS when the user set it,
    else one. Why one by default: the policies and language models here are small, so a second
    thread gains little on an idle machine, and on a busy one torch's threads wait for each
    other: 100 BC steps took 180 s with torch's default 2 threads and 11 s with one thread on a
    2-core box with one other busy process. Returns the thread count."""
    import torch

    threads = cfg.get("threads")
    if threads is not None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise UserError(f"threads must be an integer >= 1 or null, got {threads!r}")
    elif os.environ.get("OMP_NUM_THREADS", "").strip().isdigit() and int(os.environ["OMP_NUM_THREADS"]) >= 1:
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        threads = 1
    torch.set_num_threads(threads)
    return threads


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from embodied_rl import __version__

        print(f"embodied-rl {__version__}")
        return 0
    command, overrides = argv[0], argv[1:]
    if command in POSITIONAL and overrides and "=" not in overrides[0] and not overrides[0].startswith("-"):
        overrides[0] = f"{POSITIONAL[command]}={overrides[0]}"
    os.environ.setdefault("MUJOCO_GL", "egl")  # offscreen rendering; read when mujoco is imported
    if command not in COMMANDS:
        print(f"error: unknown command '{command}' (choose from: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    finished = False  # every rank ran its command to the end (the process group closes behind a barrier)
    try:
        cfg = compose(command, [o for o in overrides if o not in ("-h", "--help")])
        if "-h" in overrides or "--help" in overrides:
            from omegaconf import OmegaConf

            print(f"embodied-rl {command}: {COMMANDS[command][0]}\n\nconfig (override with key=value):\n")
            print(OmegaConf.to_yaml(cfg))
            return 0
        set_threads(cfg)
        if _world_size() > 1:
            if command not in DATA_PARALLEL:
                raise UserError(f"'{command}' runs in one process; under torchrun run {' or '.join(DATA_PARALLEL)}")
            from embodied_rl import distributed

            _stop_with_the_launcher()
            distributed.init(str(cfg.device))
            signal.signal(signal.SIGTERM, _stopped_by_torchrun)
        from embodied_rl.commands import run_command

        headline, run_dir = run_command(importlib.import_module(COMMANDS[command][1]), cfg)
        finished = True
    except UserError as error:
        print(f"error: {_rank_prefix()}{error}", file=sys.stderr)
        return 2
    except Diverged as error:
        print(f"error: {_rank_prefix()}{error}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as error:
        if error.errno not in DISK_ERRORS:
            raise
        # a full disk or a file system gone read-only: every write is atomic, so the files already
        # there (checkpoints/last included) are whole
        where = f" writing '{error.filename}'" if error.filename else ""
        print(f"error: {_rank_prefix()}{error.strerror or error}{where}; free space (or fix the file system) and "
              "run the same command again: what was saved is kept", file=sys.stderr)
        return 2
    except Exception as error:
        if _world_size() > 1 and _lost_peer(error):
            _stopped_by_torchrun(0, None)
        raise
    finally:
        if _world_size() > 1:
            from embodied_rl import distributed

            distributed.close(finished)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 prints the headline
        print_headline(command, headline, run_dir)
    return 0


def _world_size() -> int:
    """The number of processes torchrun launched (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _stopped_by_torchrun(signum: int, frame: Any) -> None:
    """torchrun stops the other ranks when one fails: say so in one line (torchrun's report,
    which names the failed rank, follows)."""
    print(f"error: {_rank_prefix()}stopped because another rank of the job failed; relaunch the same "
          "command to resume from checkpoints/last", file=sys.stderr, flush=True)
    os._exit(1)


def _stop_with_the_launcher() -> None:
    """torchrun's ranks are its child processes, and a launcher killed with SIGKILL cannot stop
    them: without this they train on as orphans and hold the run_dir's lock. A thread notices
    the parent process change (within a second) and stops this rank in one line."""
    import threading
    import time

    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(1.0)
        print(f"error: {_rank_prefix()}the torchrun launcher went away; relaunch the same command to resume "
              "from checkpoints/last", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _lost_peer(error: Exception) -> bool:
    """A collective failed because another rank went away (gloo: the connection closed)."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or "Connection closed by peer" in text or "Connection reset" in text


def _rank_prefix() -> str:
    """"rank R: " under torchrun, so the line says which process stopped the job."""
    return f"rank {os.environ.get('RANK', '0')}: " if _world_size() > 1 else ""


if __name__ == "__main__":
    sys.exit(main())
