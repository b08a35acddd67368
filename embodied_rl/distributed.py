"""Data-parallel training across processes and machines (torch.distributed).

    torchrun --nproc-per-node=K -m embodied_rl finetune task=... num_envs=N ...

Every rank runs the same command: it steps its own shard of the envs (N / K of them, its own
seeds), collects its own rollouts and computes its own gradients; the gradients are averaged
across ranks before every optimiser step (one all-reduce of the flattened gradients), so the
weights stay identical on every rank. Rank 0 evaluates, logs and writes checkpoints; the other
ranks' loop state (env states, RNGs, replay shards) travels to rank 0 with each checkpoint, so
every rank resumes exactly from checkpoints/last.

Without torchrun (no WORLD_SIZE > 1 in the environment) every function here is the
single-process identity: a plain run never touches torch.distributed.
Backends: gloo on the CPU, nccl on CUDA. docs/scaling.md has the launch recipes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from embodied_rl.errors import UserError

# Rank r draws its env seeds and its exploration noise from seed + RANK_SEED_STRIDE * r, far
# from the seed + env_steps offsets a run's resets use, so no two ranks share an episode.
RANK_SEED_STRIDE = 1_000_003
TIMEOUT = timedelta(minutes=30)  # a collective waiting longer than this fails the job


def init(device: str) -> None:
    """Join the process group torchrun describes (gloo on the CPU, nccl on CUDA); a no-op for a
    single process or when already joined. A CUDA rank uses GPU LOCAL_RANK."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    cuda = str(device).startswith("cuda")
    if cuda:
        if str(device) != "cuda":
            raise UserError(f"device={device} names one GPU; under torchrun use device=cuda "
                            "(each rank takes GPU LOCAL_RANK)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=TIMEOUT)


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def close(finished: bool = True) -> None:
    """Tear the process group down. After a run every rank finished, a barrier first: a rank that
    destroys the group while its peer's last collective is still in flight can abort the peer
    (gloo: "terminate called without an active exception"). After an error, no barrier: the peer
    may be gone."""
    if dist.is_available() and dist.is_initialized():
        if finished and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def rank_seed(seed: int) -> int:
    """This rank's seed: `seed` on rank 0 (a 1-rank run is the plain run), shifted on the others."""
    return int(seed) + RANK_SEED_STRIDE * rank()


def seed_rank(seed: int) -> None:
    """Reseed torch on ranks other than 0 (after the weights are made and broadcast), so the
    ranks draw different exploration noise; rank 0 keeps its stream."""
    if rank() > 0:
        torch.manual_seed(rank_seed(seed))


def shard(num_envs: int) -> int:
    """This rank's number of envs: num_envs split evenly across the ranks."""
    world = world_size()
    if num_envs % world:
        raise UserError(f"num_envs={num_envs} must be a multiple of the number of ranks ({world})")
    return num_envs // world


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def average_gradients(parameters: Any) -> None:
    """Average the gradients of `parameters` across ranks in one all-reduce. A parameter without
    a gradient counts as zero, so every rank ends with the same gradient for every parameter."""
    if not active():
        return
    params = [p for p in parameters if p.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size()
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def broadcast_modules(modules: list[torch.nn.Module]) -> None:
    """Copy rank 0's parameters and buffers into every rank's modules."""
    if not active():
        return
    for module in modules:
        for tensor in list(module.parameters()) + list(module.buffers()):
            with torch.no_grad():
                dist.broadcast(tensor.data, src=0)


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """The element-wise sum over ranks (a new tensor; the input is left as it is)."""
    if not active():
        return values.clone()
    out = values.detach().to(_collective_device()).clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(values.device)


def any_rank(flag: bool) -> bool:
    """True when `flag` is true on any rank."""
    if not active():
        return bool(flag)
    return bool(all_sum(torch.tensor([float(bool(flag))])).item() > 0)


def mean_over_ranks(value: float) -> float:
    if not active():
        return float(value)
    return float(all_sum(torch.tensor([float(value)], dtype=torch.float64)).item() / world_size())


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """core.masked_whiten with the mean and the unbiased variance over every rank's valid
    positions (the same affine map on every rank); core.masked_whiten itself on one rank."""
    from embodied_rl import core

    if not active():
        return core.masked_whiten(x, mask, eps)
    valid = mask.bool()
    values = x.double()[valid]
    stats = all_sum(torch.stack([values.sum(), (values * values).sum(),
                                 torch.tensor(float(values.numel()), dtype=torch.float64)]))
    total, total_sq, count = stats.tolist()
    mean = total / count
    var = (total_sq - count * mean * mean) / max(count - 1.0, 1.0)
    return ((x - mean) * torch.rsqrt(torch.tensor(var + eps, dtype=x.dtype, device=x.device))).to(x.dtype)


def gather_objects(obj: Any) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (a list indexed by rank), None on the other ranks."""
    if not active():
        return [obj]
    received = [None] * world_size() if is_main() else None
    dist.gather_object(obj, received, dst=0)
    return received


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` on every rank (a list indexed by rank)."""
    if not active():
        return [obj]
    received: list[Any] = [None] * world_size()
    dist.all_gather_object(received, obj)
    return received


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not active():
        return obj
    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_on_main(check: Callable[[], None]) -> None:
    """Run `check` on rank 0 alone and raise its UserError on every rank. For checks that read
    the run directory: rank 0 may already be writing into it while a slower rank still looks."""
    if not active():
        check()
        return
    message = None
    if is_main():
        try:
            check()
        except UserError as error:
            message = str(error)
    message = broadcast_object(message)
    if message is not None:
        raise UserError(message)


def barrier() -> None:
    if active():
        dist.barrier()


def fingerprint(modules: dict[str, torch.nn.Module]) -> list[float]:
    """Two float64 sums per module (of the weights and of their magnitudes): ranks whose
    weights differ anywhere almost surely differ here."""
    sums = []
    for module in modules.values():
        if not hasattr(module, "state_dict"):
            continue
        tensors = [t.detach().double() for t in module.state_dict().values()
                   if isinstance(t, torch.Tensor) and t.is_floating_point()]
        sums += [float(sum(t.sum() for t in tensors)), float(sum(t.abs().sum() for t in tensors))]
    return sums


def check_in_sync(modules: dict[str, torch.nn.Module]) -> None:
    """Stop the job when the ranks' weights differ (the gradient averaging was bypassed)."""
    if not active():
        return
    prints = all_gather_objects(fingerprint(modules))
    if any(p != prints[0] for p in prints[1:]):
        raise RuntimeError(f"the ranks' weights differ (rank {rank()}): gradients were not averaged "
                           "on every optimiser step")


def cuda_in_use() -> bool:
    """Whether this process has drawn on a CUDA device, whose generator is then part of its RNG state."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def check_device(device: Any) -> None:
    """cpu, cuda or cuda:N, and CUDA only where torch can use it."""
    device = str(device)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UserError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UserError(f"device={device} but torch cannot use CUDA here (no GPU or a CPU-only torch); "
                            "use device=cpu")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise UserError(f"device={device} but this machine has {torch.cuda.device_count()} CUDA device(s)")
