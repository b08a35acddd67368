"""Behaviour cloning of a ChunkPolicy: AdamW, cosine LR with warm-up, EMA weights.

    result = train_bc(policy, windows, BCConfig(steps=2000, batch_size=256, lr=1e-3, ...), run=run,
                      evaluate_fn=lambda policy, step: {...}, checkpoint_fn=save_every_time)

The loop samples a batch of windows, takes one gradient step on `policy.bc_loss`, updates the EMA
copy (the weights used for evaluation and saved in checkpoints), logs loss and lr every
`log_every` steps, and calls `evaluate_fn` / `checkpoint_fn` with the EMA policy every
`eval_every` steps and once at the end (`checkpoint_fn(ema_policy, policy, optimizer, step)`;
`save_checkpoint` writes one). A non-finite loss, gradient norm or weight stops it with
`Diverged` (exit code 3); weights are checked before every checkpoint, so checkpoints/last stays
finite.

Data-parallel (torchrun, embodied_rl/distributed.py): every rank samples its own batches (its own
seed), the gradients are averaged across ranks before each step (a step of K ranks sees K
batches of `batch_size`), the logged loss is the mean over ranks, and rank 0 alone evaluates and
writes checkpoints.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from embodied_rl import distributed
from embodied_rl.algos.common import diverged, refuse_non_finite
from embodied_rl.data.windows import ChunkWindows
from embodied_rl.policies.base import ChunkPolicy
from embodied_rl.policies.checkpoint import write_policy_files
from embodied_rl.runs import Run, atomic_dir, progress


@dataclass
class BCConfig:
    """The BC optimiser's settings. No defaults for what configs/pretrain.yaml and the policy yaml
    set (steps, batch size, lr, weight decay, warm-up, EMA power: `embodied-rl pretrain` passes
    them): those files are their one home."""

    steps: int
    batch_size: int
    lr: float
    weight_decay: float
    warmup_steps: int
    ema_power: float
    log_every: int
    eval_every: int | None
    seed: int
    betas: tuple[float, float] = (0.95, 0.999)
    grad_clip: float = 1.0
    ema_max_decay: float = 0.9999


class EMA:
    """Exponential moving average of a model's weights with diffusion_policy's warm-up schedule:
    decay = 1 - (1 + step) ** -power, capped at max_decay (early steps follow the model closely)."""

    def __init__(self, model: nn.Module, power: float = 0.75, max_decay: float = 0.9999):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.power, self.max_decay = power, max_decay
        self.step = 0

    def decay(self) -> float:
        return min(self.max_decay, 1.0 - (1.0 + self.step) ** -self.power)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        decay = self.decay()
        for ema_param, param in zip(self.model.parameters(), model.parameters()):
            ema_param.lerp_(param.detach(), 1.0 - decay)
        for ema_buffer, buffer in zip(self.model.buffers(), model.buffers()):
            ema_buffer.copy_(buffer)
        self.step += 1


def cosine_with_warmup(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress_frac = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress_frac)))

    return factor


def write_training_state(
    directory: str | Path, policy: ChunkPolicy, optimizer: torch.optim.Optimizer, step: int,
    rng: dict[str, torch.Tensor] | None = None,
) -> None:
    """Raw (non-EMA) weights, AdamW moments, the step and (`rng`) every rank's RNG states:
    safetensors + JSON, no pickles."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    optimizer_state = optimizer.state_dict()
    tensors = {f"state.{index}.{name}": value.detach().cpu().contiguous()
               for index, entries in optimizer_state["state"].items()
               for name, value in entries.items() if torch.is_tensor(value)}
    save_file({k: v.detach().cpu().contiguous() for k, v in policy.state_dict().items()},
              str(directory / "model.safetensors"))
    save_file(tensors, str(directory / "optimizer.safetensors"))
    if rng is not None:
        save_file(rng, str(directory / "rng.safetensors"))
    (directory / "state.json").write_text(
        json.dumps({"step": step, "param_groups": optimizer_state["param_groups"]}, indent=2) + "\n"
    )


def save_checkpoint(
    path: str | Path,
    ema_policy: ChunkPolicy,
    policy: ChunkPolicy,
    optimizer: torch.optim.Optimizer,
    step: int,
    extra: dict[str, Any] | None = None,
    rng: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A checkpoint directory, written atomically: the EMA policy (load it with load_policy)
    plus training_state/ (raw weights, optimiser, step, RNGs)."""
    with atomic_dir(path) as tmp:
        write_policy_files(ema_policy, tmp, {"step": step, **(extra or {})})
        write_training_state(tmp / "training_state", policy, optimizer, step, rng)
    return Path(path)


def read_training_state(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds for `train_bc(resume=...)`: {"step", "ema" and "policy" (state
    dicts), "optimizer" (a state dict), "rng" (per-rank states)}. Raises what a damaged file
    raises (algos.common.UNREADABLE)."""
    from safetensors.torch import load_file

    from embodied_rl.policies import load_policy

    path = Path(path)
    directory = path / "training_state"
    meta = json.loads((directory / "state.json").read_text())
    optimizer_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(directory / "optimizer.safetensors")).items():
        _, index, name = key.split(".", 2)
        optimizer_state.setdefault(int(index), {})[name] = value
    return {"step": int(meta["step"]), "ema": load_policy(path).state_dict(),
            "policy": load_file(str(directory / "model.safetensors")),
            "optimizer": {"state": optimizer_state, "param_groups": meta["param_groups"]},
            "rng": load_file(str(directory / "rng.safetensors"))}


def train_bc(
    policy: ChunkPolicy,
    windows: ChunkWindows,
    config: BCConfig,
    run: Run | None = None,
    evaluate_fn: Callable[[ChunkPolicy, int], dict[str, Any]] | None = None,
    checkpoint_fn: Callable[..., None] | None = None,
    resume: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train `policy` in place; returns {"ema_policy", "final_loss", "losses", "evals", "train_s"}.
    `checkpoint_fn(ema_policy, policy, optimizer, step, rng)`: `rng` holds every rank's RNG
    states. `resume` (read_training_state of a checkpoint of the same run) continues after its
    step exactly as the run that never stopped."""
    distributed.broadcast_modules([policy])
    seed = distributed.rank_seed(config.seed)  # each rank its own batches and noise
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(config.warmup_steps, config.steps)
    )
    ema = EMA(policy, power=config.ema_power, max_decay=config.ema_max_decay)
    done = 0  # steps taken before this process (a resumed run)
    saved: str | None = None  # the step checkpoints/last holds, for the divergence message
    if resume is not None:
        done, saved = int(resume["step"]), f"step {resume['step']}"
        policy.load_state_dict(resume["policy"])
        ema.model.load_state_dict(resume["ema"])
        ema.step = done  # one EMA update per step
        optimizer.load_state_dict(resume["optimizer"])
        lr_schedule.last_epoch = done  # the optimiser state holds the learning rate of that step
        torch.set_rng_state(resume["rng"][f"torch.{distributed.rank()}"])
        generator.set_state(resume["rng"][f"generator.{distributed.rank()}"])
        if f"cuda.{distributed.rank()}" in resume["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(resume["rng"][f"cuda.{distributed.rank()}"])
    losses: list[tuple[int, float]] = []
    evals: list[tuple[int, dict[str, Any]]] = []
    running_loss, running_count = 0.0, 0
    start = time.perf_counter()

    def evaluate_and_save(step: int) -> None:
        nonlocal saved
        # the ranks' weights are equal, so every rank stops here alike
        refuse_non_finite(f"step {step}", saved, weights=ema.model.state_dict(), raw_weights=policy.state_dict(),
                          optimizer=optimizer.state_dict())
        own = [torch.get_rng_state(), generator.get_state()] + ([torch.cuda.get_rng_state()] if distributed.cuda_in_use() else [])
        ranks = distributed.gather_objects(own)
        if not distributed.is_main():
            return
        rng = {f"{name}.{rank}": state for rank, states in enumerate(ranks)
               for name, state in zip(("torch", "generator", "cuda"), states)}
        if evaluate_fn is not None:
            metrics = evaluate_fn(ema.model, step)
            evals.append((step, metrics))
            if run is not None and metrics:
                run.log(step, {f"eval/{k}": v for k, v in metrics.items()})
        if checkpoint_fn is not None:
            checkpoint_fn(ema.model, policy, optimizer, step, rng)
            saved = f"step {step}"

    policy.train()
    bar = progress(range(done + 1, config.steps + 1), total=config.steps, desc="pretrain", show=distributed.is_main(),
                   initial=done)
    for step in bar:
        batch = windows.sample(config.batch_size, generator)
        loss = policy.bc_loss(batch)
        if not torch.isfinite(loss):
            raise diverged(f"step {step}", "train/loss", saved)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        distributed.average_gradients(policy.parameters())
        grad_norm = nn.utils.clip_grad_norm_(policy.parameters(), config.grad_clip)
        if not torch.isfinite(grad_norm):
            raise diverged(f"step {step}", "train/grad_norm", saved)
        optimizer.step()
        lr_schedule.step()
        ema.update(policy)

        running_loss += loss.item()
        running_count += 1
        if step % config.log_every == 0 or step == config.steps:
            mean_loss = distributed.mean_over_ranks(running_loss / running_count)
            losses.append((step, mean_loss))
            running_loss, running_count = 0.0, 0
            if run is not None:
                run.log(step, {"train/loss": mean_loss, "train/lr": optimizer.param_groups[0]["lr"],
                               "train/ema_decay": ema.decay(),
                               "train/steps_per_s": (step - done) / (time.perf_counter() - start)})
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{mean_loss:.4f}")
        if config.eval_every and step % config.eval_every == 0 and step < config.steps:
            evaluate_and_save(step)
            policy.train()
    train_s = time.perf_counter() - start
    evaluate_and_save(config.steps)
    return {"ema_policy": ema.model, "final_loss": losses[-1][1] if losses else float("nan"),
            "losses": losses, "evals": evals, "train_s": train_s}
