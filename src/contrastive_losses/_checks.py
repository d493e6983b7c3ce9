"""Input validation shared by every public function.

Each check raises ``ValueError`` or ``TypeError`` whose message names the argument and
shows what was received, so a user sees ``text: expected shape (B, K, D) ...`` instead of
a NaN three steps later. Checks never ``assert`` (asserts vanish under ``python -O``).

Two kinds of check. *Static* checks read only what is known without looking at a
tensor's values (types, shapes, dtypes, devices, Python arguments): they always run, cost
no device work, and under ``torch.compile`` run once at trace time. *Value* checks read
tensor values (NaN/Inf, zero rows, bounds on a tensor temperature or radius): each costs a
host-device sync (the CPU waits for the GPU) and cannot be traced, so they run only when
:func:`resolve_validate` says so: ``validate_args`` (``None``: the global default set
with :func:`set_default_validate_args`, the ``torch.distributions`` convention) and not
while ``torch.compile`` traces the call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from . import _compat

REDUCTIONS = ("mean", "sum", "none")

# The gradient through x / ||x|| is the upstream gradient divided by ||x||: norms below
# NORM_HEADROOM / max of the dtype are refused, so an upstream gradient up to 16 per
# entry stays finite (bfloat16 rows of norm 1e-38 gave inf). float16: 2.4e-4; bfloat16 and
# float32: 4.7e-38.
NORM_HEADROOM = 16.0

_default_validate_args = True


def set_default_validate_args(value: bool) -> None:
    """Turn the value checks of every loss on (default) or off where ``validate_args`` is
    ``None`` (the ``torch.distributions`` convention).

    Off, a forward and backward make no host-device sync: NaN/Inf, zero embeddings and
    out-of-range tensor values are no longer caught (bad input may then give NaN or
    garbage instead of an error), the SVR training warnings are off, and under
    ``gather`` the ranks no longer check together and must hold equal batch sizes (see
    "Performance switches" in the docs). Shape, dtype, device and argument checks stay.

    Example:
        >>> import contrastive_losses
        >>> contrastive_losses.set_default_validate_args(False)
        >>> contrastive_losses.set_default_validate_args(True)
    """
    global _default_validate_args
    if not isinstance(value, bool):
        raise TypeError(f"value: expected True or False, got {value!r}")
    _default_validate_args = value


def default_validate_args() -> bool:
    """The global default of ``validate_args`` (:func:`set_default_validate_args`)."""
    return _default_validate_args


def resolve_validate(validate_args: bool | None) -> bool:
    """Whether the value checks run: ``validate_args`` (``None``: the global default),
    and never while ``torch.compile`` traces (a value check there is a graph break or,
    with ``fullgraph=True``, an error)."""
    if validate_args is None:
        validate = _default_validate_args
    elif isinstance(validate_args, bool):
        validate = validate_args
    else:
        raise TypeError(f"validate_args: expected None, True or False, got {validate_args!r}")
    _compat.check_compile_supported()
    return validate and not _compat.is_compiling()


def shape_of(x: Tensor) -> str:
    """``x``'s shape as Python prints a tuple (``(4, 6)``, ``(6,)``), for error messages.
    Each size goes through an f-string, not ``str()`` or a tuple: torch.compile traces
    f-string formatting of a symbolic size (and prints its value), but not ``str()`` of
    one, and prints a tuple's as ``s94``; so a message survives the recompile for a new
    shape."""
    return "(" + ", ".join(f"{s}" for s in x.shape) + ("," if x.dim() == 1 else "") + ")"


def _shape(x: Tensor) -> str:
    """``x``'s shape as ``(4, 6)`` or ``(6)``; traceable as :func:`shape_of`."""
    return "(" + ", ".join(f"{s}" for s in x.shape) + ")"


def check_tensor(x: object, name: str) -> Tensor:
    """``x`` must be a tensor; returns it for chaining."""
    if not isinstance(x, Tensor):
        hint = ""
        if isinstance(x, (list, tuple)) and x and all(isinstance(v, Tensor) for v in x):
            hint = (
                f" of {len(x)} tensors; stack them into one first: torch.stack({name}) "
                "(a new leading dim; torch.cat to join along an existing one)"
            )
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}{hint}")
    return x


def check_materialised(x: Tensor, name: str) -> None:
    """Not on the meta device, which holds shapes but no values to check or compute with.

    Called by the value checks, after the device checks (which word a meta tensor next to
    a CPU one as a device mismatch).
    """
    if x.is_meta:
        raise ValueError(f"{name}: on device meta, which holds no values; materialise it first")


def check_float(x: Tensor, name: str) -> None:
    """``x`` must have a floating dtype (float16, bfloat16, float32, float64)."""
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")


def check_finite(x: Tensor, name: str) -> None:
    """No NaN or Inf. One host sync; cheap next to the matmuls of any loss."""
    check_materialised(x, name)
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name}: contains {bad} NaN/Inf value(s) (shape {_shape(x)})")


def _index(flags: Tensor) -> tuple[int, ...]:
    return tuple(torch.nonzero(flags)[0].tolist())


def stable_row_norms(x: Tensor) -> Tensor:
    """L2 norms of ``x``'s rows (last dim) with no overflow or underflow of the squares.

    Each row is divided by its largest magnitude before squaring (in float32 at least),
    so entries up to the dtype's max and down to its smallest subnormal give the exact
    norm. Detached; float32 (float64 for float64 ``x``).
    """
    xd = x.detach() if x.dtype == torch.float64 else x.detach().float()
    scaled, peak = peak_scaled_rows(xd)
    return torch.linalg.vector_norm(scaled, dim=-1) * peak.squeeze(-1)


def exact_row_norms(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """L2 norms of ``x``'s rows (last dim) in ``x``'s dtype, detached, without a host
    sync and without the under- or overflow of the squares that a plain
    ``vector_norm`` has (float32 rows of ``1e-30`` have norm 0 there): the squares are
    summed in float64 (float16, bfloat16 and float32 squares all fit it), float64 rows
    are divided by their largest magnitude first. So the checks on and off see the same
    norms, and turning them off never changes a valid input's value. ``dtype``: that of
    the result (``x``'s by default; float64 holds every norm)."""
    xd = x.detach()
    if x.dtype == torch.float64:
        scaled, peak = peak_scaled_rows(xd)
        return torch.linalg.vector_norm(scaled, dim=-1) * peak.squeeze(-1)
    norms = torch.linalg.vector_norm(xd, dim=-1, dtype=torch.float64)
    return norms.to(dtype or x.dtype)


# [sqrt(tiny), sqrt(max)] of the dtype a row norm is summed in: no square that matters
# under- or overflows there (float16/bfloat16 rows are summed in float32).
_EXACT_NORMS = {
    dtype: (torch.finfo(dtype).tiny ** 0.5, torch.finfo(dtype).max ** 0.5)
    for dtype in (torch.float32, torch.float64)
}


def peak_row_norm(x: Tensor, name: str) -> float:
    """The largest L2 norm of ``x``'s rows (last dim), read to the host, with the NaN/Inf
    check of :func:`check_finite` on the way (a NaN or Inf entry makes its row's norm NaN
    or Inf): one reduction and one host read where that norm lies in
    ``[sqrt(tiny), sqrt(max)]`` of the float32 (float64 for float64 ``x``) it is summed
    in, where no square that matters under- or overflows; outside it :func:`check_finite`
    and :func:`exact_row_norms`. 0 for an empty ``x``. ``torch.isfinite(x).all()`` alone
    cost 4x this at ``(32, 512)`` on CPU."""
    check_materialised(x, name)
    if x.numel() == 0:
        return 0.0
    if x.dtype in _EXACT_NORMS:
        lo, hi = _EXACT_NORMS[x.dtype]
        peak = float(torch.linalg.vector_norm(x.detach(), dim=-1).max().item())
    else:  # float16, bfloat16: the squares in float32
        lo, hi = _EXACT_NORMS[torch.float32]
        norms = torch.linalg.vector_norm(x.detach(), dim=-1, dtype=torch.float32)
        peak = float(norms.max().item())
    if lo <= peak <= hi:  # False for NaN
        return peak
    check_finite(x, name)
    return float(exact_row_norms(x, torch.float64).max().item())


def total_norm(x: Tensor) -> float:
    """The L2 norm of all of ``x`` (at least its largest row's), read to the host: one
    reduction in float32 (float64 for float64 ``x``). Finite only where every entry is
    (a NaN or Inf entry gives NaN or Inf; so may squares beyond the float32 range, of
    finite entries). 0 for an empty ``x``."""
    if x.dtype in _EXACT_NORMS:
        return float(torch.linalg.vector_norm(x.detach()).item())
    return float(torch.linalg.vector_norm(x.detach(), dtype=torch.float32).item())


def peak_scaled_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x``'s rows (last dim) divided by their largest magnitude, and that magnitude
    ``(..., 1)`` (1 for all-zero rows): entries in ``[-1, 1]`` whose squares and products
    neither overflow nor underflow."""
    peak = x.abs().amax(dim=-1, keepdim=True)
    peak = torch.where(peak > 0, peak, torch.ones_like(peak))
    return x / peak, peak


def check_row_norms(
    x: Tensor,
    name: str,
    *,
    nonzero: bool = True,
    mask: Tensor | None = None,
    validate: bool = True,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Return the L2 norms of ``x``'s rows (last dim); see :func:`row_norms`."""
    return row_norms(x, name, nonzero=nonzero, mask=mask, validate=validate, dtype=dtype)[0]


def row_norms(
    x: Tensor,
    name: str,
    *,
    nonzero: bool = True,
    mask: Tensor | None = None,
    validate: bool = True,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, bool]:
    """Return the L2 norms of ``x``'s rows (last dim), validating values on the way.

    One reduction and one host sync cover NaN/Inf, zero rows and norms whose squares
    overflow or underflow: a row with a NaN has a NaN norm, a row with an Inf an infinite
    one, and the fast norm is exact only in ``[sqrt(tiny), sqrt(max)]`` of the dtype.
    Only when something is off do we look closer: rows outside that range get a norm
    computed stably (:func:`stable_row_norms`), and with ``nonzero`` a norm whose
    reciprocal is not finite in the dtype (``norm < 1/max`` or ``norm > max``) raises, as
    normalising it would give NaN or a zero embedding.

    ``mask`` (bool, ``x.shape[:-1]``) marks present rows: absent rows may be all zeros
    (the usual padding of a missing caption) and get norm 1, so they normalise to zeros.
    They must still be finite: a NaN would reach the gradient of the present rows through
    the matmuls (0 * NaN), and zeroing absent rows costs a full copy of ``x``.

    The second value is True when every norm lies in ``[sqrt(tiny), sqrt(max)]``, where
    ``1/norm**2`` and ``x @ y.T`` for unit ``y`` are finite too (fused fast paths need it).

    The norms are :func:`exact_row_norms`, checks on or off. A norm below
    ``NORM_HEADROOM / max`` is refused as well: the gradient through the normalisation is
    the upstream gradient over the norm, and must fit the dtype (bfloat16 rows of norm
    ``1e-38`` gave an infinite gradient).

    Without ``validate`` nothing is read back (no host sync): the norms are returned
    as they are, not known to be moderate (False: a fused path that needs moderate
    norms is not taken, so turning the checks off never changes a value).

    ``dtype``: that of the returned norms (``x``'s by default); the losses ask for
    float32 norms of float16/bfloat16 rows, which they normalise in float32. The checks
    judge the norms in ``x``'s dtype either way.
    """
    check_materialised(x, name)
    norms = exact_row_norms(x, None if dtype is None else torch.float64)
    wide, norms = (norms, norms) if dtype is None else (norms.to(dtype), norms.to(x.dtype))
    if mask is not None and nonzero:  # absent rows (zeros) get norm 1
        wide = wide.masked_fill(wide == 0, 1)
    if not validate:
        return wide, False
    fi = torch.finfo(x.dtype)
    if _in_range(norms, fi, nonzero, mask):
        return wide, True
    if mask is not None:
        _check_absent_finite(x, name, mask)
    check_finite(x, name)
    if not nonzero:
        return wide, False
    norms = norms.float() if x.dtype != torch.float64 else norms  # inf in float16 is > max
    norms = torch.where(norms.isinf(), stable_row_norms(x), norms)
    zero = norms == 0
    if mask is not None:
        norms = torch.where(zero & ~mask, torch.ones_like(norms), norms)
        zero = zero & mask
    if bool(zero.any()):
        raise ValueError(
            f"{name}: embedding at index {_index(zero)} is all zeros; it has no direction "
            "to normalise (check the encoder output, or mark padded rows absent in mask)"
        )
    lo, hi = NORM_HEADROOM / fi.max, fi.max
    bad = (norms < lo) | (norms > hi)
    if bool(bad.any()):
        idx = _index(bad)
        raise ValueError(
            f"{name}: embedding at index {idx} has L2 norm {float(norms[idx]):.3g}, outside "
            f"[{lo:.3g}, {hi:.3g}] where {x.dtype} can normalise it (1/norm must be finite "
            "and non-zero); rescale the embeddings or use a wider dtype"
        )
    return norms.to(dtype or x.dtype), False


def _check_absent_finite(x: Tensor, name: str, mask: Tensor) -> None:
    """Rows marked absent in ``mask`` hold no data but must be finite: say so by name."""
    absent_bad = ~torch.isfinite(x).all(dim=-1) & ~mask
    if bool(absent_bad.any()):
        raise ValueError(
            f"{name}: NaN/Inf in the masked-out (absent) row at index {_index(absent_bad)}; "
            "rows the mask marks absent are ignored but must still be finite (a NaN reaches "
            "the present rows' gradients through 0 * NaN): fill them with zeros, e.g. "
            f"{name}.masked_fill(~mask[..., None], 0)"
        )


def _in_range(norms: Tensor, fi: torch.finfo, nonzero: bool, mask: Tensor | None) -> bool:
    """Whether every norm lies in ``[sqrt(tiny), sqrt(max)]`` of ``fi`` (``nonzero``; an
    absent row's 0 allowed under ``mask``) or is finite (not ``nonzero``): one host read.
    Without a mask the smallest and largest norm (one ``aminmax``, NaN propagated) say
    it: 3 small ops and 2 reads fewer than comparing every norm, half the cost of the
    checks at ``B = 32``."""
    if norms.numel() == 0:
        return True
    if mask is not None and nonzero:
        ok = (norms >= fi.tiny**0.5) & (norms <= fi.max**0.5)  # False for NaN too
        return bool((ok | ((norms == 0) & ~mask)).all())
    if norms.dtype in (torch.float16, torch.bfloat16) and norms.device.type == "cpu":
        norms = norms.float()  # exact; torch < 2.2 has no CPU aminmax for half types
    low, high = (v.item() for v in torch.aminmax(norms))
    if nonzero:
        return fi.tiny**0.5 <= low and high <= fi.max**0.5  # False for NaN
    return math.isfinite(low) and math.isfinite(high)


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

    ``dims`` is the human-readable layout for error messages, e.g. ``"(B, K, D)"``;
    ``check_values`` adds the value checks of :func:`check_row_norms` (a host sync).
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
        check_row_norms(x, name)
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


def check_scalar(
    value: float | Tensor, name: str, *, floating: bool = False, validate: bool = True
) -> float | None:
    """A real scalar, a Python int or float (not bool) or a one-element tensor (of a
    floating dtype with ``floating``); returns it as a float, or ``None`` for a tensor
    without ``validate`` (its value is not read: no host sync)."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: expected a scalar, got shape {_shape(value)}")
        if floating:
            check_float(value, name)
        if not validate:
            return None
        return float(value.item())  # item: no graph, no warning, cheaper than float()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{name}: expected a float or a 0-d tensor, got {type(value).__name__}")


def check_positive(value: float | Tensor, name: str, *, validate: bool = True) -> float | None:
    """A strictly positive finite scalar (temperature, epsilon, ...); returns it as a float
    (``None`` for a tensor without ``validate``, whose value is not read)."""
    v = check_scalar(value, name, validate=validate)
    if v is None:
        return None
    if not v > 0 or v != v or v == float("inf"):
        raise ValueError(f"{name}: must be a finite number > 0, got {v}")
    return v


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


def check_chunk_size(chunk_size: object) -> int | None:
    """``None`` (dense) or a positive ``int`` column-tile size; returns it."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            "chunk_size: expected None (dense logits) or a positive int (columns per tile), "
            f"got {chunk_size!r}"
        )
    return chunk_size


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
    if ids.dim() == 0 and name == "ids":  # a loss's third positional argument
        raise ValueError(
            f"{name}: expected shape ({batch},) {what}, got a 0-d tensor; if it is the "
            "model's scale, pass it by keyword: loss_fn(audio, text, "
            "logit_scale=model.logit_scale.exp()) (the third positional argument is ids)"
        )
    if ids.dim() != 1 or ids.shape[0] != batch:
        raise ValueError(f"{name}: expected shape ({batch},) {what}, got {_shape(ids)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got dtype {ids.dtype}")
    if ids.device != ref.device:
        raise ValueError(f"{name}: on device {ids.device} but {ref_name} is on {ref.device}")
    return ids


def check_mask(
    mask: object, name: str, shape: tuple[int, ...], ref: Tensor, *, validate: bool = True
) -> Tensor:
    """Boolean mask of ``shape`` on ``ref``'s device where every row has a True entry
    (that last part a value check, with ``validate`` only)."""
    mask = check_tensor(mask, name)
    if tuple(mask.shape) != tuple(shape):
        want = "(" + ", ".join(f"{s}" for s in shape) + ")"
        raise ValueError(f"{name}: expected shape {want}, got {_shape(mask)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name}: expected a bool tensor, got dtype {mask.dtype}")
    if mask.device != ref.device:
        raise ValueError(f"{name}: on device {mask.device} but the embeddings are on {ref.device}")
    if not validate:
        return mask
    check_materialised(mask, name)
    empty = ~mask.flatten(1).any(dim=1) if mask.dim() > 1 else ~mask
    if bool(empty.any()):
        rows = torch.nonzero(empty).flatten().tolist()[:10]
        raise ValueError(f"{name}: sample(s) {rows} have no present caption (an all-False row)")
    return mask
