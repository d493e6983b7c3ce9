"""Input validation shared by every public function.

Each check raises ``ValueError`` or ``TypeError`` whose message names the argument and
shows what was received, so a user sees ``text: expected shape (B, K, D) ...`` instead of
a NaN three steps later. Checks never ``assert`` (asserts vanish under ``python -O``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

REDUCTIONS = ("mean", "sum", "none")


def _shape(x: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in x.shape) + ")"


def check_tensor(x: object, name: str) -> Tensor:
    """``x`` must be a tensor; returns it for chaining."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def check_float(x: Tensor, name: str) -> None:
    """``x`` must have a floating dtype (float16, bfloat16, float32, float64)."""
    if not torch.is_floating_point(x):
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")


def check_finite(x: Tensor, name: str) -> None:
    """No NaN or Inf. One host sync; cheap next to the matmuls of any loss."""
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name}: contains {bad} NaN/Inf value(s) (shape {_shape(x)})")


def check_nonzero_rows(x: Tensor, name: str) -> None:
    """Every embedding (last dim) must have a non-zero norm, else normalising divides by 0."""
    norms = x.detach().abs().amax(dim=-1)
    if not bool((norms > 0).all()):
        idx = torch.nonzero(norms == 0)[0].tolist()
        raise ValueError(
            f"{name}: embedding at index {tuple(idx)} is all zeros; it has no direction "
            "to normalise (check the encoder output or the padding)"
        )


def check_row_norms(x: Tensor, name: str, *, nonzero: bool = True) -> Tensor:
    """Return the L2 norms of ``x``'s rows (last dim), validating values on the way.

    One reduction and one host sync cover both NaN/Inf and zero rows: a row with a NaN
    has a NaN norm, a row with an Inf an infinite one. Only when something is off do we
    look at ``x`` element-wise to say exactly what.
    """
    norms = torch.linalg.vector_norm(x.detach(), dim=-1)
    ok = torch.isfinite(norms)
    if nonzero:
        ok &= norms > 0
    if not bool(ok.all()):
        check_finite(x, name)
        if nonzero:
            check_nonzero_rows(x, name)
        # Finite values whose squares overflow (float16 > ~256): normalise in float32.
        norms = torch.linalg.vector_norm(x.detach().float(), dim=-1).to(x.dtype)
    return norms


def check_embeddings(
    x: object,
    name: str,
    *,
    ndim: int,
    dims: str,
    min_batch: int = 2,
    check_values: bool = True,
) -> Tensor:
    """Validate an embedding tensor of ``ndim`` dims whose layout is described by ``dims``.

    ``dims`` is the human-readable layout for error messages, e.g. ``"(B, K, D)"``.
    """
    x = check_tensor(x, name)
    if x.dim() != ndim:
        raise ValueError(
            f"{name}: expected shape {dims}, got {x.dim()}-d tensor of shape {_shape(x)}"
        )
    check_float(x, name)
    if x.shape[0] < min_batch:
        raise ValueError(
            f"{name}: batch size {x.shape[0]} is too small; a contrastive loss needs at least "
            f"{min_batch} samples so that each has a negative"
        )
    if x.shape[-1] == 0:
        raise ValueError(f"{name}: embedding dimension D is 0 (shape {_shape(x)})")
    if check_values:
        check_finite(x, name)
        check_nonzero_rows(x, name)
    return x


def check_same_size(a: Tensor, a_name: str, b: Tensor, b_name: str, dim: int, what: str) -> None:
    """``a.shape[dim] == b.shape[dim]``; ``what`` names the dimension (``"batch size B"``)."""
    if a.shape[dim] != b.shape[dim]:
        raise ValueError(
            f"{b_name}: {what} {b.shape[dim]} does not match {a_name}'s {a.shape[dim]} "
            f"({a_name} shape {_shape(a)}, {b_name} shape {_shape(b)})"
        )


def check_same_device_dtype(tensors: Sequence[tuple[Tensor, str]]) -> None:
    """All tensors on one device with one dtype (mixed inputs silently upcast otherwise)."""
    first, first_name = tensors[0]
    for t, name in tensors[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name}: on device {t.device} but {first_name} is on {first.device}; "
                "move both to the same device"
            )
        if t.dtype != first.dtype:
            raise TypeError(
                f"{name}: dtype {t.dtype} differs from {first_name}'s {first.dtype}; "
                "cast both to the same dtype"
            )


def check_positive(value: float | Tensor, name: str) -> None:
    """A strictly positive scalar (temperature, epsilon, ...)."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: expected a scalar, got shape {_shape(value)}")
        v = float(value.detach())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        v = float(value)
    else:
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    if not v > 0 or v != v or v == float("inf"):
        raise ValueError(f"{name}: must be a finite number > 0, got {v}")


def check_non_negative(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name}: must be a finite number >= 0, got {value}")


def check_int(value: object, name: str, minimum: int) -> int:
    """An ``int`` (not a bool) that is at least ``minimum``; returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


def check_choice(value: object, name: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


def check_reduction(reduction: str) -> None:
    check_choice(reduction, "reduction", REDUCTIONS)


def check_ids(
    ids: object,
    name: str,
    batch: int,
    ref: Tensor,
    *,
    what: str = "matching the batch",
    ref_name: str = "the embeddings",
) -> Tensor:
    """Integer ``(batch,)`` ids on ``ref``'s device; ``what`` and ``ref_name`` word the errors."""
    ids = check_tensor(ids, name)
    if ids.dim() != 1 or ids.shape[0] != batch:
        raise ValueError(f"{name}: expected shape ({batch},) {what}, got {_shape(ids)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got dtype {ids.dtype}")
    if ids.device != ref.device:
        raise ValueError(f"{name}: on device {ids.device} but {ref_name} is on {ref.device}")
    return ids


def check_mask(mask: object, name: str, shape: tuple[int, ...], ref: Tensor) -> Tensor:
    """Boolean mask of ``shape`` on ``ref``'s device where every row has a True entry."""
    mask = check_tensor(mask, name)
    if tuple(mask.shape) != tuple(shape):
        want = "(" + ", ".join(str(s) for s in shape) + ")"
        raise ValueError(f"{name}: expected shape {want}, got {_shape(mask)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name}: expected a bool tensor, got dtype {mask.dtype}")
    if mask.device != ref.device:
        raise ValueError(f"{name}: on device {mask.device} but the embeddings are on {ref.device}")
    empty = ~mask.reshape(mask.shape[0], -1).any(dim=1)
    if bool(empty.any()):
        rows = torch.nonzero(empty).flatten().tolist()[:10]
        raise ValueError(f"{name}: sample(s) {rows} have no present caption (an all-False row)")
    return mask
