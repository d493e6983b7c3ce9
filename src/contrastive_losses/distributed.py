"""All-gather across ranks with gradients flowing back to the owning rank.

Every loss computes its *local* rows (this rank's samples) against the *global* batch
(all ranks' samples), the "local loss" form of open_clip. Batch sizes may differ across
ranks (the last batch of an epoch, a dataset that does not divide evenly): tensors are
padded to the largest local batch, gathered, and the padding is cut off again.

The returned loss on each rank is scaled so that the *average over ranks* — what
``DistributedDataParallel`` does to gradients — equals the single-process loss on the
concatenated batch, and its gradient equals the single-process gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_no_grad", "all_gather_with_grad", "is_distributed", "resolve_gather"]


def is_distributed() -> bool:
    """True when ``torch.distributed`` is initialised with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def resolve_gather(gather: bool | None) -> bool:
    """``None`` means "gather when running distributed"; ``True`` requires it."""
    if gather is None:
        return is_distributed()
    if not isinstance(gather, bool):
        raise TypeError(f"gather: expected None, True or False, got {gather!r}")
    if gather and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "gather: True needs torch.distributed to be initialised "
            "(torch.distributed.init_process_group); pass gather=None to gather only when it is"
        )
    return gather


def _local_sizes(n: int, device: torch.device) -> list[int]:
    size = torch.tensor([n], device=device, dtype=torch.long)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    return [int(s) for s in sizes]


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad], dim=0)


def _unpad(gathered: Tensor, sizes: list[int], max_rows: int) -> Tensor:
    if all(s == max_rows for s in sizes):
        return gathered
    chunks = gathered.split(max_rows, dim=0)
    return torch.cat([c[:s] for c, s in zip(chunks, sizes, strict=False)], dim=0)


def _autograd_all_gather(x: Tensor) -> Tensor:
    """Gather along dim 0 with a backward that reduce-scatters (sums) into the owner."""
    from torch.distributed import _functional_collectives as fc

    group = dist.group.WORLD
    # torch >= 2.13 names it all_gather_single_autograd; 2.3–2.12 all_gather_tensor_autograd.
    fn = getattr(fc, "all_gather_single_autograd", None) or getattr(
        fc, "all_gather_tensor_autograd", None
    )
    if fn is not None:
        return fn(x.contiguous(), gather_dim=0, group=group)
    # torch 2.1–2.2: the older autograd-aware collective (backward is all_reduce + slice).
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(x.contiguous(), group=group), dim=0)


def all_gather_with_grad(x: Tensor) -> tuple[Tensor, int]:
    """Concatenate ``x`` from every rank along dim 0, keeping the autograd graph.

    Args:
        x: this rank's tensor ``(b_r, ...)``; ``b_r`` may differ across ranks.

    Returns:
        ``(gathered, offset)``: ``gathered`` is ``(sum_r b_r, ...)`` in rank order and
        ``gathered[offset:offset + b_r]`` are this rank's rows. Gradients that any rank
        sends into ``gathered`` are summed into the owner's ``x``.
    """
    sizes = _local_sizes(x.shape[0], x.device)
    max_rows = max(sizes)
    gathered = _autograd_all_gather(_pad_rows(x, max_rows))
    offset = sum(sizes[: dist.get_rank()])
    return _unpad(gathered, sizes, max_rows), offset


def all_gather_no_grad(x: Tensor) -> Tensor:
    """Concatenate ``x`` (ids, masks, ...) from every rank along dim 0; no autograd."""
    is_bool = x.dtype == torch.bool
    if is_bool:  # gloo cannot all_gather bool tensors
        x = x.to(torch.uint8)
    sizes = _local_sizes(x.shape[0], x.device)
    max_rows = max(sizes)
    padded = _pad_rows(x, max_rows).contiguous()
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    gathered = _unpad(torch.cat(out, dim=0), sizes, max_rows)
    return gathered.bool() if is_bool else gathered
