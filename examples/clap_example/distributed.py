"""torch.distributed helpers of the trainer (process group, gradient all-reduce, broadcasts)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


def init_distributed(device_arg: str) -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)``; initialises the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device_arg in ("auto", "cuda")
    if device_arg not in ("auto", "cuda"):
        device = torch.device(device_arg)
    elif use_cuda:
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        # Rank 0 evaluates alone while the others wait: allow a long evaluation.
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=2)
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return rank, world, device


def allreduce_gradients(
    params: Sequence[nn.Parameter], world: int, bucket_mb: float = 25.0
) -> None:
    """Average gradients across ranks in flat buckets (used with GradCache instead of DDP hooks)."""
    if world == 1:
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    limit = int(bucket_mb * 2**20)
    bucket: list[Tensor] = []
    size = 0

    def flush() -> None:
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket.clear()

    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= limit:
            flush()
            size = 0
    flush()


def average_buffers(module: nn.Module, world: int) -> None:
    """Average every floating-point buffer (BatchNorm running statistics) over the ranks."""
    if world <= 1:
        return
    with torch.no_grad():
        for buf in module.buffers():
            if buf.is_floating_point():
                dist.all_reduce(buf)
                buf /= world


def broadcast_module(module: nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank (what DDP's constructor does)."""
    if not dist.is_initialized():
        return
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)


def from_main(value: Any, world: int) -> Any:
    """Rank 0's ``value`` on every rank (so every rank raises the same error)."""
    if world == 1:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def ranks_in_sync(params: Sequence[nn.Parameter], world: int) -> bool:
    """Every rank holds bit-identical parameters (a DDP sanity check; True alone)."""
    if world == 1:
        return True
    with torch.no_grad():
        checksum = torch.stack([p.detach().double().sum() for p in params])
    gathered = [torch.zeros_like(checksum) for _ in range(world)]
    dist.all_gather(gathered, checksum)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])
