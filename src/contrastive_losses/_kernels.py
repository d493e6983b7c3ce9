"""Custom autograd Functions behind the losses: forward and backward written out where
autograd's own path costs passes over the largest tensor.

Private: the losses call these; each docstring says which tensor it saves a pass over.
Every one is checked against autograd's path (values and gradients, ``gradcheck``) in the
tests. :func:`l2_normalize` is public through :mod:`contrastive_losses.functional`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _checks


class _L2Normalize(torch.autograd.Function):
    """``x / ||x||`` with a two-pass backward, ``(g - y <g, y>) / ||x||``.

    Autograd through ``F.normalize`` spends more time in the norm's backward than the
    loss spends in its matmuls at small batch sizes (see benchmarks/bench_losses.py).
    """

    @staticmethod
    def forward(ctx, x: Tensor, inv_norm: Tensor) -> Tensor:
        y = x * inv_norm.unsqueeze(-1)
        ctx.save_for_backward(y, inv_norm)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        y, inv_norm = ctx.saved_tensors
        radial = (grad.unsqueeze(-2) @ y.unsqueeze(-1)).squeeze(-1)  # row-wise <g, y>
        out = torch.addcmul(grad, y, radial, value=-1)
        return out.mul_(inv_norm.unsqueeze(-1)), None


def l2_normalize(x: Tensor, norms: Tensor | None = None) -> Tensor:
    """Unit-norm rows (last dim); ``norms`` are ``x``'s row norms if already computed.

    Without ``norms`` they are computed and checked (:func:`_checks.check_row_norms`):
    NaN/Inf, zero rows and norms whose reciprocal overflows raise ``ValueError``.
    """
    if norms is None:
        x = _checks.check_tensor(x, "x")
        _checks.check_float(x, "x")
        if x.dim() == 0 or x.shape[-1] == 0:
            raise ValueError(f"x: expected shape (..., D) with D > 0, got {tuple(x.shape)}")
        norms = _checks.check_row_norms(x, "x")
    return _L2Normalize.apply(x, 1.0 / norms)


class _NormalizedRowsMatmul(torch.autograd.Function):
    """``l2_normalize(x) @ y.T`` as ``(x @ y.T) / ||x||`` row-wise.

    For KCL's ``(B*K, D) @ (D, B)`` the ``(B*K, B)`` scores are smaller than the
    ``(B*K, D)`` captions whenever ``B < D``: scaling the scores instead of normalising
    the captions saves several passes over the largest tensor, forward and backward.
    """

    @staticmethod
    def forward(ctx, x: Tensor, inv_norm: Tensor, y: Tensor) -> Tensor:
        scores = (x @ y.T).mul_(inv_norm.unsqueeze(-1))  # (M, N)
        ctx.save_for_backward(x, inv_norm, y, scores)
        return scores

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, Tensor]:
        x, inv_norm, y, scores = ctx.saved_tensors
        grad_scaled = grad * inv_norm.unsqueeze(-1)  # (M, N)
        # d/dx_i of <x_i, y_j>/||x_i||: y_j/||x_i|| - s_ij x_i/||x_i||^2
        radial = (grad * scores).sum(dim=-1) * inv_norm.square()  # (M,)
        grad_x = torch.addcmul(grad_scaled @ y, x, radial.unsqueeze(-1), value=-1)
        return grad_x, None, grad_scaled.T @ x


def _per_language_ce(
    scores: Tensor, row_mask: Tensor | None, col_mask: Tensor | None, offset: int
) -> Tensor:
    """Cross-entropy of each row against its language's candidates, positive at ``offset + r``.

    ``scores`` is ``(K, b, N)``: row ``r`` of this rank against all ``N`` candidates of
    language ``k``. Absent candidates leave the denominator; absent rows give 0.
    """
    if col_mask is not None:
        # A finite fill, not -inf: a fully masked row must stay NaN-free in backward.
        scores = scores.masked_fill(~col_mask[:, None, :], torch.finfo(scores.dtype).min)
    positive = scores.diagonal(offset=offset, dim1=1, dim2=2)  # (K, b)
    loss = scores.logsumexp(dim=-1) - positive  # (K, b)
    return loss if row_mask is None else loss * row_mask


class _SymmetricDiagonalCE(torch.autograd.Function):
    """Both cross-entropies of square ``(K, B, B)`` score blocks, positives on the diagonal.

    Returns ``(row_losses, column_losses)``, each ``(K, B)``: row ``j`` against its row,
    column ``i`` against its column. One backward pass writes the gradient of both into a
    single buffer; autograd's path (two ``logsumexp`` and two ``diagonal`` backwards)
    materialises four ``(K, B, B)`` tensors.
    """

    @staticmethod
    def forward(ctx, scores: Tensor) -> tuple[Tensor, Tensor]:
        lse_rows = scores.logsumexp(dim=-1)  # (K, B)
        lse_cols = scores.logsumexp(dim=-2)  # (K, B)
        diag = scores.diagonal(dim1=1, dim2=2)  # (K, B)
        ctx.save_for_backward(scores, lse_rows, lse_cols)
        return lse_rows - diag, lse_cols - diag

    @staticmethod
    def backward(ctx, g_rows: Tensor, g_cols: Tensor) -> Tensor:
        scores, lse_rows, lse_cols = ctx.saved_tensors
        grad = (scores - lse_rows.unsqueeze(-1)).exp_().mul_(g_rows.unsqueeze(-1))
        grad.add_((scores - lse_cols.unsqueeze(-2)).exp_().mul_(g_cols.unsqueeze(-2)))
        grad.diagonal(dim1=1, dim2=2).sub_(g_rows + g_cols)
        return grad


class _Gram(torch.autograd.Function):
    """``y @ y.mT`` with the symmetric backward ``(g + g.mT) @ y``: one matmul, not two."""

    @staticmethod
    def forward(ctx: Any, y: Tensor) -> Tensor:
        ctx.save_for_backward(y)
        return y @ y.mT

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return (grad + grad.mT) @ y


class _Distance(torch.autograd.Function):
    """``||y - x||`` over the last dim; backward recomputes ``y - x`` instead of keeping a
    ``(B, D)`` tensor alive, and is 0 where the distance is 0."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor) -> Tensor:
        dist = torch.linalg.vector_norm(y - x, dim=-1)
        ctx.save_for_backward(x, y, dist)
        return dist

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, y, dist = ctx.saved_tensors
        scale = torch.where(dist > 0, grad / dist.clamp_min(torch.finfo(dist.dtype).tiny), 0)
        grad_y = (y - x) * scale[..., None]
        return -grad_y, grad_y


def _distance(x: Tensor, y: Tensor) -> Tensor:
    return _Distance.apply(x, y)


def _gram(y_local: Tensor, y_all: Tensor, gathered: bool) -> Tensor:
    """``y_local @ y_all.T``: the positives' rows against every candidate."""
    return y_local @ y_all.mT if gathered else _Gram.apply(y_local)


class _UpperClamp(torch.autograd.Function):
    """``min(x, bound)`` whose gradient at the bound still passes when descent moves
    ``x`` back inside (gradient > 0), and only the outward part is cut.

    A plain ``clamp`` zeroes the gradient at the bound, and ``log(1/0.01)`` rounds above
    ``log(100)`` in float32: a temperature initialised at the bound would never move.
    """

    @staticmethod
    def forward(ctx, x: Tensor, bound: float) -> Tensor:
        ctx.save_for_backward(x)
        ctx.bound = bound
        return x.clamp(max=bound)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (x,) = ctx.saved_tensors
        outward = (x >= ctx.bound) & (grad < 0)  # descent would push x further out
        return torch.where(outward, torch.zeros_like(grad), grad), None
