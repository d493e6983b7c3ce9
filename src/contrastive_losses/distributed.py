"""All-gather across ranks with gradients flowing back to the owning rank.

Every loss computes its *local* rows (this rank's samples) against the *global* batch
(all ranks' samples), the "local loss" form of open_clip. Batch sizes may differ across
ranks (the last batch of an epoch, a dataset that does not divide evenly): tensors are
padded to the largest local batch, gathered, and the padding is cut off again. Finding the
sizes is a small collective and a host sync; with the losses' value checks off
(``validate_args=False``, or under ``torch.compile``) it is skipped and every rank must
hold the same batch size.

The returned loss on each rank is scaled so that the *average over ranks* — what
``DistributedDataParallel`` does to gradients — equals the single-process loss on the
concatenated batch, and its gradient equals the single-process gradient.
"""

from __future__ import annotations

import typing
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_gather_no_grad",
    "all_gather_with_grad",
    "is_distributed",
    "resolve_gather",
    "validate_together",
]


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


# What validate_together exchanges about each tensor the ranks will gather: its dtype
# and the sizes after the batch dim, in a fixed-length slot so that every rank sends
# the same number of longs whether or not its checks passed (or registered anything).
_MAX_AGREE = 4  # tensors per block
_MAX_TRAILING = 4  # dims after the batch dim; (B, K, 2, D) knowledge has 3
_SLOT = 2 + _MAX_TRAILING  # [dtype code, ndim, *dims, zero padding]
_DTYPES = {
    zlib.crc32(str(d).encode()): d
    for d in (getattr(torch, n) for n in dir(torch))
    if isinstance(d, torch.dtype)
}


def _dtype_code(dtype: torch.dtype) -> int:
    """A code that is the same in every process (not ``hash``, which is salted)."""
    return zlib.crc32(str(dtype).encode())


@dataclass
class Validation:
    """What :func:`validate_together` hands to the checks: ``min_batch`` is the local
    minimum (0 under gather, the global one otherwise); set ``batch`` to the local batch
    size once the inputs are validated, and name the validated tensors that will be
    gathered with :meth:`agree` (in the same order on every rank)."""

    min_batch: int
    batch: int = 0
    tensors: list[tuple[str, Tensor]] = field(default_factory=list)

    def agree(self, **tensors: Tensor) -> None:
        """Tensors (``name=tensor``) whose dtype and trailing shape (every dim after the
        batch dim) must be the same on every rank: under gather, ranks that differ raise
        one ``ValueError`` naming the argument and both values instead of crashing in the
        collective."""
        self.tensors.extend(tensors.items())
        if len(self.tensors) > _MAX_AGREE:
            raise RuntimeError(f"validate_together: at most {_MAX_AGREE} tensors can agree")

    def _encoded(self) -> list[int]:
        out = [0] * (_SLOT * _MAX_AGREE)
        for i, (_, x) in enumerate(self.tensors):
            dims = list(x.shape[1:])
            if len(dims) > _MAX_TRAILING:
                raise RuntimeError(f"validate_together: over {_MAX_TRAILING} trailing dims")
            slot = [_dtype_code(x.dtype), len(dims), *dims]
            out[i * _SLOT : i * _SLOT + len(slot)] = slot
        return out


def _slot_values(row: list[int], i: int) -> tuple[str, str]:
    """The dtype and the trailing shape a rank sent in slot ``i``, as printed."""
    code, ndim, *dims = row[i * _SLOT : (i + 1) * _SLOT]
    dtype = _DTYPES.get(code)
    return (str(dtype) if dtype is not None else f"<dtype code {code}>"), str(tuple(dims[:ndim]))


def _disagreement(names: list[str], rows: list[list[int]]) -> str | None:
    """The first registered tensor on which the ranks differ, as a message; ``None`` when
    all agree. Ranks compare slot by slot, so the message is the same on every rank."""
    for i, name in enumerate(names):
        for r, row in enumerate(rows[1:], start=1):
            if row[i * _SLOT : (i + 1) * _SLOT] == rows[0][i * _SLOT : (i + 1) * _SLOT]:
                continue
            (dtype0, shape0), (dtype_r, shape_r) = _slot_values(rows[0], i), _slot_values(row, i)
            what, v0, vr = (
                ("dtype", dtype0, dtype_r)
                if dtype0 != dtype_r
                else ("shape after the batch dim", shape0, shape_r)
            )
            return (
                f"{name}: {what} {v0} on rank 0 but {vr} on rank {r}; every rank must pass "
                f"the same {'dtype' if what == 'dtype' else 'embedding sizes'} (only the "
                "batch size may differ) to gather them (every rank raises it)"
            )
    return None


@contextmanager
def validate_together(
    enabled: bool,
    ref: object,
    *,
    name: str = "audio",
    min_global: int = 2,
    validate: bool = True,
) -> Iterator[Validation]:
    """Run a loss's input checks so that all ranks raise together or none does.

    Without gathering this only passes ``min_batch = min_global`` to the checks. Under
    gather a check that fails on one rank only would leave the other ranks waiting in the
    first collective forever (a hang, not an error). So the checks run with no local
    minimum (a rank may even hold no sample), and on leaving the block every rank shares,
    in one small ``all_gather``, whether its checks failed, its batch size and the dtype
    and trailing shape of the tensors registered with :meth:`Validation.agree`: if any
    rank failed, every rank raises that rank's error (the lowest failing rank's, same type
    and message everywhere); if the ranks disagree on a registered tensor's dtype or its
    sizes after the batch dim (``D = 8`` on one rank, ``16`` on another: the gather would
    abort a rank) every rank raises a ``ValueError`` naming it and both values; if the
    *global* batch is below ``min_global`` every rank raises a ``ValueError`` naming
    ``name``. Splits 1 + 6 and 0 + 2 are legal, 1 + 0 is not.

    ``ref`` is the first input; its device carries the collective (CPU when it is not a
    tensor; the current CUDA device under NCCL).

    With ``validate`` False (``validate_args=False``, or under ``torch.compile``) there is
    no collective and no host sync: a check that fails on one rank raises there alone
    (its peers then wait in the next collective: a hang), and the global batch size is
    not checked.
    """
    v = Validation(min_batch=0 if enabled else min_global)
    if not enabled or not validate:
        yield v
        return
    error: Exception | None = None
    try:
        yield v
    except Exception as err:  # re-raised below, on every rank
        error = err
    if dist.get_backend() == "nccl":  # NCCL only moves CUDA tensors, whatever ref is
        device = torch.device("cuda", torch.cuda.current_device())
    elif isinstance(ref, Tensor) and ref.device.type != "meta":
        device = ref.device
    else:
        device = torch.device("cpu")
    shared = [int(error is not None), v.batch]
    if error is None:
        shared += v._encoded()
    else:  # the same length, nothing to compare: the error is raised first
        shared += [0] * (_SLOT * _MAX_AGREE)
    flags = torch.tensor(shared, device=device, dtype=torch.long)
    gathered = [torch.zeros_like(flags) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flags)
    failed = [r for r, f in enumerate(gathered) if int(f[0])]
    if failed:
        info = (type(error).__name__, str(error)) if error is not None else None
        infos: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(infos, info)
        kind, message = typing.cast(tuple[str, str], infos[failed[0]])
        cls = TypeError if kind == "TypeError" else ValueError
        raise cls(f"{message} (on rank {failed[0]}; every rank raises it)") from error
    rows = [f[2:].tolist() for f in gathered]
    mismatch = _disagreement([name for name, _ in v.tensors], rows)
    if mismatch is not None:
        raise ValueError(mismatch)
    total = sum(int(f[1]) for f in gathered)
    if total < min_global:
        raise ValueError(
            f"{name}: global batch size {total} over {len(gathered)} ranks is too small; a "
            f"contrastive loss needs at least {min_global} samples so that each has a negative"
        )


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
