"""Run directories: creation, atomic writes, metric logging, progress bars.

Every command writes everything into one run directory (see docs/architecture.md):
config.yaml, metrics.jsonl, tb/, checkpoints/, eval_info.json, videos/, report.md, plots/.
Writes are atomic (write a temporary file, then rename) so a run killed at any moment leaves
either the old file or the new one, never half of one.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from embodied_rl.errors import UserError


def default_run_dir(command: str, task: str | None) -> Path:
    now = _dt.datetime.now()
    name = f"{now:%H-%M-%S}_{command}" + (f"_{task.replace('/', '-')}" if task else "")
    return Path("runs") / f"{now:%Y-%m-%d}" / name


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=_json_default) + "\n")


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `path` in one rename.

    Used for checkpoints: a kill mid-save leaves the previous checkpoint intact.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


PROGRESS_EVERY_S = 30.0  # seconds between progress lines when stderr is not a terminal


def progress(iterable: Iterable | None = None, total: int | None = None, desc: str = "", show: bool = True,
             initial: int = 0, every_s: float = PROGRESS_EVERY_S):
    """Progress of a long loop on stderr: a tqdm bar when stderr is a terminal, else one line
    every `every_s` seconds and one at the end (ProgressLines), so a redirected run (nohup,
    CI, `make demo > log`) still shows that it moves. `initial`: what a resumed loop had done.
    `show=False` prints nothing (data-parallel ranks other than 0)."""
    if show and sys.stderr.isatty():
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, initial=initial, leave=False)
    return ProgressLines(iterable, total=total, desc=desc, show=show, initial=initial, every_s=every_s)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressLines:
    """The progress bar of a run whose stderr is not a terminal: the same calls as tqdm
    (iterate, `update(n)`, `set_postfix(**values)`, `close()`), printed as lines such as
    `[pretrain] 1200/3000 (40%) loss=0.0412 | 35.1 it/s | ETA 51s`."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "",
                 show: bool = True, initial: int = 0, every_s: float = PROGRESS_EVERY_S):
        import time

        self.iterable, self.total, self.desc, self.show, self.every_s = iterable, total, desc, show, every_s
        self.n = self.start_n = int(initial)  # the rate counts this process's work only
        self.postfix: dict[str, Any] = {}
        self._clock = time.perf_counter
        self.start = self.last_print = self._clock()
        self.closed = False

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.show and self._clock() - self.last_print >= self.every_s:
            self._print()

    def set_postfix(self, **values: Any) -> None:
        self.postfix.update(values)

    def line(self) -> str:
        elapsed = max(self._clock() - self.start, 1e-9)
        rate = (self.n - self.start_n) / elapsed
        done = f"{self.n}/{self.total} ({100 * self.n / self.total:.0f}%)" if self.total else f"{self.n}"
        parts = [f"[{self.desc}] {done}" + "".join(f" {k}={v}" for k, v in self.postfix.items()),
                 f"{rate:.3g} it/s"]
        if self.closed:
            parts.append(f"took {_duration(elapsed)}")
        elif self.total and rate > 0:
            parts.append(f"ETA {_duration((self.total - self.n) / rate)}")
        return " | ".join(parts)

    def _print(self) -> None:
        print(self.line(), file=sys.stderr, flush=True)
        self.last_print = self._clock()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.show and self.n > self.start_n:
            self._print()


LOCK_FILE = ".lock"


def _lock_run_dir(path: Path):
    """Hold an exclusive lock on `path` for the life of this process: one run per run_dir.

    flock locks die with their process, so the lock of a killed run is simply taken over."""
    import fcntl

    handle = open(path / LOCK_FILE, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise UserError(f"run_dir '{path}' is in use by {holder}; wait for it or choose a new run_dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"process {os.getpid()}\n")
    handle.flush()
    return handle


def _metric_value(value: Any) -> Any:
    """A scalar as metrics.jsonl stores it: numbers as numbers, non-finite ones as the strings
    "nan", "inf", "-inf" (JSON has no token for them), anything else None (not logged)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return value if math.isfinite(value) else str(float(value))
    return None


def _read_metric(value: Any) -> Any:
    return float(value) if value in ("nan", "inf", "-inf") else value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (non-finite values back as floats); a line cut short by
    a kill is skipped. Reading takes no lock."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows.append({key: _read_metric(value) for key, value in row.items()})
    return rows


LOSS_GROWTH = 1e4  # a logged loss this many times its first size (at least 1) gets a warning,
LOSS_LIMIT = 1e8  # and so does one this large (no loss of a healthy run here comes near it)
DONE_FILE = "done.json"  # written last by a command that ran to its end (commands.run_command)


def _row_step(line: str) -> int | None:
    """The step of a metrics.jsonl line; None for a line cut short by a kill."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def is_done(run_dir: str | Path) -> bool:
    """Whether a run directory holds a run that ran to its end (its done.json)."""
    return (Path(run_dir) / DONE_FILE).is_file()


class Run:
    """One run directory and its loggers.

    `Run(path)` creates the directory and locks it for this process (a second process on the
    same run_dir is refused). `log(step, metrics)` appends one JSON line to metrics.jsonl (a
    non-finite value as "nan", "inf" or "-inf") and mirrors every scalar to TensorBoard under tb/.
    `Run.follower(path)`: the run as a data-parallel rank other than 0 sees it (rank 0 writes
    the directory): it creates, locks and writes nothing.
    """

    writes = True
    # the run directories this process created, oldest first (commands.run_command removes one
    # that a refused command left holding nothing but its config)
    created: list[Path] = []

    def __init__(self, path: str | Path, command: str = "", allow_existing: bool = False):
        self.path = Path(path)
        self.command = command
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"run_dir '{self.path}' exists and is not a directory")
        if self.path.is_dir() and not allow_existing and any(p.name != LOCK_FILE for p in self.path.iterdir()):
            raise UserError(
                f"run_dir '{self.path}' already holds files; choose a new run_dir (nothing was overwritten)"
            )
        new = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock = _lock_run_dir(self.path)
        except OSError as error:  # a read-only or missing parent, a file on the way, /proc, a full disk
            raise UserError(f"cannot write run_dir '{self.path}': {error.strerror or error}") from None
        if new:
            Run.created.append(self.path)
        self._tb = None
        self._purge_step: int | None = None
        self._loss_baseline: dict[str, float] = {}
        self._warned_growth = False

    @classmethod
    def follower(cls, path: str | Path, command: str = "") -> Run:
        run = cls.__new__(cls)
        run.path, run.command, run._lock, run._tb, run.writes = Path(path), command, None, False, False
        return run

    def file(self, *parts: str) -> Path:
        return self.path.joinpath(*parts)

    def write_json(self, name: str, obj: Any) -> Path:
        target = self.file(name)
        if self.writes:
            atomic_write_json(target, obj)
        return target

    def write_text(self, name: str, text: str) -> Path:
        target = self.file(name)
        if self.writes:
            atomic_write_text(target, text)
        return target

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.writes:
            return
        scalars = {key: _metric_value(value) for key, value in metrics.items()}
        scalars = {key: value for key, value in scalars.items() if value is not None}
        with open(self.file("metrics.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": int(step), **scalars}) + "\n")
        writer = self._tensorboard()
        if writer is not None:
            for key, value in scalars.items():
                writer.add_scalar(key, float(value), int(step))
        self._watch_losses(int(step), scalars)

    def _watch_losses(self, step: int, scalars: dict[str, Any]) -> None:
        """Warn once per run when a loss grows by LOSS_GROWTH over its first logged size (at
        least 1) or passes LOSS_LIMIT: a learning rate far too high shows there long before
        anything turns non-finite, sometimes already in the first row."""
        for key, value in scalars.items():
            if not key.endswith("loss") or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            first = self._loss_baseline.setdefault(key, value)
            if self._warned_growth or abs(value) <= min(LOSS_GROWTH * max(abs(first), 1.0), LOSS_LIMIT):
                continue
            self._warned_growth = True
            print(f"warning: {key} is {value:.3g} at step {step} (first logged: {first:.3g}); training may be "
                  "diverging: a lower learning rate usually helps", file=sys.stderr, flush=True)

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def forget_metrics_after(self, step: int) -> None:
        """Drop the metrics rows after `step`: a run resumed from its checkpoint at `step` redoes
        them, and the redone rows replace the old ones (one curve, no duplicate points).
        TensorBoard purges its events after `step` the same way."""
        if not self.writes:
            return
        path = self.file("metrics.jsonl")
        if path.exists():
            kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and _row_step(line) is not None and _row_step(line) <= step]
            atomic_write_text(path, "".join(line + "\n" for line in kept))
        self._purge_step = int(step) + 1

    def _tensorboard(self):
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is a dependency, but logging must never kill a run
                self._tb = False
                return None
            self._tb = SummaryWriter(str(self.file("tb")), purge_step=self._purge_step)
        return self._tb or None

    def close(self) -> None:
        if self._tb:
            self._tb.close()
            self._tb = None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None


# ---------------------------------------------------------------------------------------------
# Starting a command's run
# ---------------------------------------------------------------------------------------------


def start_run(cfg: Any, command: str, allow_existing: bool = False) -> Run:
    """Create the run directory (run_dir=PATH or runs/<date>/<time>_<command>_<task>) and save
    the resolved config in it. Under torchrun rank 0 does that, and the other ranks get a
    follower Run of the same directory, which writes nothing."""
    from omegaconf import OmegaConf

    from embodied_rl import distributed

    if not distributed.is_main():
        return Run.follower(distributed.broadcast_object(None), command=command)
    task = OmegaConf.select(cfg, "task.name", default=None)
    path = Path(cfg.run_dir) if cfg.get("run_dir") else default_run_dir(command, task)
    run = Run(path, command=command, allow_existing=allow_existing)
    run.file(DONE_FILE).unlink(missing_ok=True)  # a finished run given more work is running again
    run.write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    distributed.broadcast_object(str(run.path))
    return run


def _flat_items(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    def walk(node: Any, prefix: str) -> dict[str, Any]:
        if isinstance(node, dict):
            out: dict[str, Any] = {}
            for key, value in node.items():
                out.update(walk(value, f"{prefix}{key}."))
            return out
        return {prefix[:-1]: node}

    return walk(OmegaConf.to_container(cfg, resolve=True), "")


def check_previous_run(cfg: Any, command: str, may_change: tuple[str, ...]) -> None:
    """A non-empty run_dir must hold an earlier `command` run with the same settings, except the
    keys in `may_change` (how long it runs and what it records, not what it trains), so the run
    resumes; its config.yaml is then rewritten, so it always tells what ran."""
    from omegaconf import OmegaConf

    if not cfg.get("run_dir"):
        return
    path = Path(str(cfg.run_dir))
    if not path.is_dir() or not any(p.name != LOCK_FILE for p in path.iterdir()):
        return
    previous = path / "config.yaml"
    if not previous.is_file():
        raise UserError(f"run_dir '{path}' holds files but no {command} run; choose a new run_dir (nothing was overwritten)")
    before, now = _flat_items(OmegaConf.load(previous)), _flat_items(cfg)
    # how the work is spread (threads, the process backend's workers and their timeout) changes
    # no number, so a run may resume with other values
    spread = ("threads", "task.process.workers", "task.process.timeout")
    # a key the earlier run's config lacks is a setting added to the toolkit since it was written:
    # the run resumes with that key's value, stated (its config.yaml records it from now on)
    added = sorted(key for key in now.keys() - before.keys() if key not in (*may_change, *spread, "run_dir"))
    changed = sorted(key for key in before.keys()
                     if before.get(key) != now.get(key) and key not in (*may_change, *spread, "run_dir"))
    if changed:
        shown = ", ".join(f"{key}={before.get(key)} -> {now.get(key)}" for key in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise UserError(f"run_dir '{path}' holds a run with other settings ({shown}{more}); resume it with "
                        f"the same settings (only {', '.join(may_change)} may change) or choose a new run_dir")
    if added:
        print(f"resuming a run written before these settings existed: {', '.join(f'{k}={now[k]}' for k in added)}",
              flush=True)
