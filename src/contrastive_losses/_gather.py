"""The gather across ranks behind :mod:`contrastive_losses.distributed`: whether to
gather, every rank's batch size (padding to the largest and cutting it off again), the
autograd-aware all-gather whose backward sums into the owning rank, and the object
collective that words the ranks' errors.

Private: import the public names from :mod:`contrastive_losses.distributed`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


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


def _device(ref: object) -> torch.device:
    """The device that carries a collective: the current CUDA device under NCCL (it moves
    CUDA tensors only), else ``ref``'s (CPU when it is not a tensor)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(ref, Tensor) and ref.device.type != "meta":
        return ref.device
    return torch.device("cpu")


@torch.compiler.disable
def _gather_objects(mine: object, world: int) -> list[object]:
    """Every rank's ``mine``: an object collective, never traced (dynamo fails inside
    one; after a graph break, ``torch.compile`` without ``fullgraph`` would try)."""
    out: list[object] = [None] * world
    dist.all_gather_object(out, mine)
    return out


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


def _sizes(n: int, device: torch.device, equal_sizes: bool) -> list[int]:
    """Every rank's batch size: exchanged (one small ``all_gather`` and a host sync), or
    with ``equal_sizes`` taken to be this rank's ``n`` on every rank (no sync)."""
    if equal_sizes:
        return [n] * dist.get_world_size()
    return _local_sizes(n, device)


def all_gather_with_grad(x: Tensor, *, equal_sizes: bool = False) -> tuple[Tensor, int]:
    """Concatenate ``x`` from every rank along dim 0, keeping the autograd graph.

    Args:
        x: this rank's tensor ``(b_r, ...)``; ``b_r`` may differ across ranks.
        equal_sizes: promise that every rank passes the same ``b_r``: the sizes are not
            exchanged (no extra collective, no host sync). Unequal sizes then fail in the
            collective or gather garbage. The losses pass it with ``validate_args=False``.

    Returns:
        ``(gathered, offset)``: ``gathered`` is ``(sum_r b_r, ...)`` in rank order and
        ``gathered[offset:offset + b_r]`` are this rank's rows. Gradients that any rank
        sends into ``gathered`` are summed into the owner's ``x``.
    """
    sizes = _sizes(x.shape[0], x.device, equal_sizes)
    max_rows = max(sizes)
    gathered = _autograd_all_gather(_pad_rows(x, max_rows))
    offset = sum(sizes[: dist.get_rank()])
    return _unpad(gathered, sizes, max_rows), offset


def all_gather_no_grad(x: Tensor, *, equal_sizes: bool = False) -> Tensor:
    """Concatenate ``x`` (ids, masks, ...) from every rank along dim 0; no autograd.
    ``equal_sizes`` as in :func:`all_gather_with_grad`."""
    is_bool = x.dtype == torch.bool
    if is_bool:  # gloo cannot all_gather bool tensors
        x = x.to(torch.uint8)
    sizes = _sizes(x.shape[0], x.device, equal_sizes)
    max_rows = max(sizes)
    padded = _pad_rows(x, max_rows).contiguous()
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    gathered = _unpad(torch.cat(out, dim=0), sizes, max_rows)
    return gathered.bool() if is_bool else gathered


def _gather_no_grad(x: Tensor, enabled: bool, validate: bool = True) -> Tensor:
    """:func:`all_gather_no_grad` when ``enabled`` (sizes as in ``_common._gather``), else ``x``."""
    return all_gather_no_grad(x, equal_sizes=not validate) if enabled else x
