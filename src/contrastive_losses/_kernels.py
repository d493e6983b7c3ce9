"""Custom autograd Functions behind the losses: forward and backward written out where
autograd's own path costs passes over the largest tensor.

The tiled Functions (``chunk_size`` on every loss) never hold more than one
``(Q, b, chunk)`` tile of logits: forward keeps per-row (and per-column) log-sum-exp
vectors, backward recomputes each tile once and produces both gradients from it.

Private: the losses call these; each docstring says which tensor it saves a pass over.
Every one is checked against autograd's path (values and gradients, ``gradcheck``) in the
tests. :func:`l2_normalize` is public through :mod:`contrastive_losses.functional`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from . import _checks, _compat, _guide


class _L2Normalize(torch.autograd.Function):
    """``x / ||x||`` with a two-pass backward, ``(g - y <g, y>) / ||x||``.

    Autograd through ``F.normalize`` spends more time in the norm's backward than the
    loss spends in its matmuls at small batch sizes (see benchmarks/bench_losses.py).
    """

    @staticmethod
    def forward(ctx, x: Tensor, inv_norm: Tensor) -> Tensor:
        y = x * inv_norm.unsqueeze(-1)
        ctx.save_for_backward(y, inv_norm)
        # y is this op's own out-of-place result (saving an output is fine), not an alias
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        y, inv_norm = ctx.saved_tensors
        wide = grad.dtype in (torch.float32, torch.float64)
        if wide or not _compat.matmul_supported(grad):  # no bmm: float16 on CPU, torch < 2.2
            # row-wise <g, y>: a fifth of the batched (1, D) @ (D, 1) matmul's time on CPU
            # from B = 32 to 1024
            radial = (grad * y).sum(-1, keepdim=True)
        else:  # half: bmm sums the exact products in float32
            radial = (grad.unsqueeze(-2) @ y.unsqueeze(-1)).squeeze(-1)
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
            raise ValueError(f"x: expected shape (..., D) with D > 0, got {_checks.shape_of(x)}")
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
        # out of place: an output mutated in place gets zero gradients under torch
        # 2.11's compile (pytorch#180642)
        scores = (x @ y.T) * inv_norm.unsqueeze(-1)  # (M, N)
        ctx.save_for_backward(x, inv_norm, y, scores)
        return scores

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, Tensor]:
        x, inv_norm, y, scores = ctx.saved_tensors
        # Under autocast the forward's matmul ran in half precision and autocast is off
        # here: one common dtype for the mixed inputs (half captions, float32 audio and
        # norms), at least the norms' (1/||x|| overflows float16 for norms below 1.5e-5);
        # autograd casts each gradient back to its input's dtype.
        dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), inv_norm.dtype)
        grad, x, y, scores = grad.to(dtype), x.to(dtype), y.to(dtype), scores.to(dtype)
        inv = inv_norm.unsqueeze(-1).to(dtype)
        # d/dx_i of <x_i, y_j>/||x_i||: (y_j - s_ij x_i/||x_i||) / ||x_i||, with
        # 1/||x_i|| applied once at the end: 1/||x_i||^2 overflows float32 for norms
        # below 1e-19, which are valid (and normalised exactly) input.
        radial = (grad * scores).sum(dim=-1, keepdim=True) * inv  # (M, 1)
        grad_x = torch.addcmul(grad @ y, x, radial, value=-1).mul_(inv)
        return grad_x, None, (grad * inv).T @ x


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
    materialises four ``(K, B, B)`` tensors. ``excluded`` (optional): ``(B, B)`` masks of
    the entries that leave the rows' and the columns' log-sum-exp (the guide's,
    :mod:`._guide`; one tensor when they agree).
    """

    @staticmethod
    def forward(
        ctx, scores: Tensor, excluded: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        rows, cols = _excluded_scores(scores, excluded)
        lse_rows = rows.logsumexp(dim=-1)  # (K, B)
        lse_cols = cols.logsumexp(dim=-2)  # (K, B)
        diag = scores.diagonal(dim1=1, dim2=2)  # (K, B)
        ctx.save_for_backward(scores, lse_rows, lse_cols, *(excluded or (None, None)))
        return lse_rows - diag, lse_cols - diag

    @staticmethod
    def backward(ctx, g_rows: Tensor, g_cols: Tensor) -> tuple[Tensor, None]:
        scores, lse_rows, lse_cols, ex_rows, ex_cols = ctx.saved_tensors
        excluded = None if ex_rows is None else (ex_rows, ex_cols)
        rows, cols = _excluded_scores(scores, excluded)
        grad = (rows - lse_rows.unsqueeze(-1)).exp_().mul_(g_rows.unsqueeze(-1))
        grad.add_((cols - lse_cols.unsqueeze(-2)).exp_().mul_(g_cols.unsqueeze(-2)))
        grad.diagonal(dim1=1, dim2=2).sub_(g_rows + g_cols)
        return grad, None


def _excluded_scores(
    scores: Tensor, excluded: tuple[Tensor, Tensor] | None, fill: float | None = None
) -> tuple[Tensor, Tensor]:
    """``scores`` for the rows' and the columns' log-sum-exp, ``fill`` at the excluded
    entries (one tensor when the two masks are one): by default the dtype's finite
    minimum, the dense paths' fill, NaN-free in backward."""
    if excluded is None:
        return scores, scores
    low = torch.finfo(scores.dtype).min if fill is None else fill
    rows = scores.masked_fill(excluded[0], low)
    return rows, rows if excluded[1] is excluded[0] else scores.masked_fill(excluded[1], low)


class _SymmetricMeanCE(torch.autograd.Function):
    r"""The mean row and column cross-entropies of the logits ``z = scale * a @ t.T``
    of one process's ``(B, D)`` pair, positives on the diagonal: InfoNCE's a->t and t->a
    means (``scale`` a Python float, a constant: a tensor scale is multiplied into ``a``
    first, so autograd gives its gradient),

    .. math:: \frac{1}{B}\sum_i \big(\operatorname{lse}_j z_{ij} - z_{ii}\big), \quad
              \frac{1}{B}\sum_j \big(\operatorname{lse}_i z_{ij} - z_{jj}\big).

    Forward takes the row softmax and the column exps with one exp pass each over the
    ``(B, B)`` logits, both log-sum-exps on the way, and keeps those two ``(B, B)``
    tensors (autograd keeps two log-softmaxes); backward adds them, weighted, into one
    buffer, less the diagonal, and hands it to two plain GEMMs whose outputs are
    contiguous. Through autograd (two cross-entropies, the t->a one down the columns)
    the step cost 3.5-3.9 ``B x B x D`` matmuls at ``B = D = 1024`` (floor 3): four exp
    passes, ``(B, D)`` copies for the scale, and ``t``'s gradient came back transposed.
    """

    @staticmethod
    def forward(ctx: Any, a: Tensor, t: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        # (B, B); under autocast the matmul runs in half precision, the rest in a's dtype
        logits = (a @ t.T).to(torch.promote_types(a.dtype, t.dtype))
        if scale != 1.0:  # in place over (B, B): a * scale cost a (B, D) copy each way
            logits.mul_(scale)
        # rows: the fused softmax kernel (cheaper than exp alone on CPU); its largest
        # entry is 1 / sum(exp(z - max)), exp(0) = 1 at the max, so no underflow there
        row_max = logits.amax(dim=1)
        p_rows = F.softmax(logits, dim=1)
        lse_rows = row_max - p_rows.amax(dim=1).log()
        diag = logits.diagonal().clone()
        # columns: strided for the softmax kernel (1.3x this), so by hand, in the logits'
        # own buffer, and the division by the sums left to backward's pass
        col_max = logits.amax(dim=0)
        exp_cols = logits.sub_(col_max).exp_()
        col_sum = exp_cols.sum(dim=0)
        lse_cols = col_max + col_sum.log()
        ctx.save_for_backward(a, t, p_rows, exp_cols, col_sum)
        ctx.scale = scale
        return (lse_rows - diag).mean(), (lse_cols - diag).mean()

    @staticmethod
    def backward(ctx: Any, g_rows: Tensor, g_cols: Tensor) -> tuple[Tensor | None, ...]:
        a, t, p_rows, exp_cols, col_sum = ctx.saved_tensors
        b = p_rows.shape[0]
        # d/dlogits, times the scale (d logits = scale * d(a @ t.T)), in the two factors
        g_rows, g_cols = g_rows * (ctx.scale / b), g_cols * (ctx.scale / b)
        grad = (p_rows * g_rows).addcmul_(exp_cols, g_cols / col_sum)
        grad.diagonal().sub_(g_rows + g_cols)
        grad_a = grad @ t if ctx.needs_input_grad[0] else None
        grad_t = grad.T @ a if ctx.needs_input_grad[1] else None  # BLAS reads grad.T as is
        return grad_a, grad_t, None


class _Gram(torch.autograd.Function):
    """``y @ y.mT`` with the symmetric backward ``(g + g.mT) @ y``: one matmul, not two."""

    @staticmethod
    def forward(ctx: Any, y: Tensor) -> Tensor:
        ctx.save_for_backward(y)
        return y @ y.mT

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        # Under autocast the forward ran in half precision (autocast is off here).
        dtype = torch.promote_types(grad.dtype, y.dtype)
        return (grad + grad.mT).to(dtype) @ y.to(dtype)


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


# --------------------------------------------------------------------------- tiled


def _tile_valid(
    row_valid: Tensor | None, col_valid: Tensor | None, c0: int, c1: int
) -> Tensor | None:
    """``(Q, b, c)`` validity of a tile, ``None`` when everything is valid."""
    if row_valid is None and col_valid is None:
        return None
    if row_valid is None:
        return col_valid[:, None, c0:c1]  # type: ignore[index]
    if col_valid is None:
        return row_valid[:, :, None]
    return row_valid[:, :, None] & col_valid[:, None, c0:c1]


def _where_valid(loss: Tensor, valid: Tensor | None) -> Tensor:
    """0 where ``valid`` is False (an absent row or column leaves the loss)."""
    return loss if valid is None else torch.where(valid, loss, torch.zeros_like(loss))


def _finite_or_zero(x: Tensor) -> Tensor:
    """Log-sum-exp of an empty set is -inf; 0 keeps ``exp(s - lse)`` at 0, not NaN."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _positives(row_ids: Tensor, col_ids: Tensor, c0: int, c1: int) -> Tensor:
    return row_ids[:, None] == col_ids[None, c0:c1]  # (b, c)


def _diagonal_strip(p: Tensor, shift: int) -> tuple[Tensor, int]:
    """The entries ``(i, i + shift)`` of the last two dims of ``p`` (a view) and the row of
    the first of them."""
    strip = p.diagonal(offset=shift, dim1=-2, dim2=-1)
    return strip, max(0, -shift)


def _tile_logits(xc: Tensor, yt: Tensor) -> Tensor:
    """``xc @ yt.mT`` ``(Q, b, c)`` for ``xc`` ``(b, D)`` shared by the ``Q`` problems or
    ``(Q, b, D)``. A shared ``xc`` takes one GEMM, ``(b, D) @ (D, Q*c)``, viewed as
    ``(Q, b, c)``: ``matmul``'s broadcasting computes the transposed product and copies
    it, a pass over the tile that cost as much as the GEMM itself."""
    if xc.dim() == 3 or _compat.is_compiling():
        # traced, the in-place ops on the tile cannot replay through the transposed view;
        # the compiler picks its own layout
        return xc @ yt.mT
    q, c, d = yt.shape
    return (xc @ yt.reshape(q * c, d).T).view(xc.shape[0], q, c).transpose(0, 1)


def _masked_tile(
    xc: Tensor, yc: Tensor, c0: int, c1: int, row_valid: Tensor | None, col_valid: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Logits ``(Q, b, c)`` of columns ``[c0, c1)``, ``-inf`` at invalid entries, and
    the tile's validity (``None``: all valid)."""
    s = _tile_logits(xc, yc[:, c0:c1])
    valid = _tile_valid(row_valid, col_valid, c0, c1)
    if valid is not None:
        s = s.masked_fill_(~valid, float("-inf"))
    return s, valid


def _guided(
    s: Tensor,
    guide: _guide.Tiles | None,
    offset: int,
    ids: tuple[Tensor, Tensor] | None,
    c0: int,
    c1: int,
) -> tuple[Tensor, Tensor]:
    """The tile's logits for its rows' and for its columns' log-sum-exp: ``-inf`` where
    the guide excludes the entry for that direction (one tensor when the two agree)."""
    if guide is None:
        return s, s
    pos = _guide.tile_positives(s.shape[-2], offset, ids, c0, c1, s.device)
    return _excluded_scores(s, _guide.tile_masks(guide, c0, c1, pos), float("-inf"))


def _tile_positives(
    row_ids: Tensor, col_ids: Tensor, valid: Tensor | None, c0: int, c1: int
) -> Tensor:
    """Valid positive entries of a tile, ``(b, c)`` or ``(Q, b, c)``."""
    pos = _positives(row_ids, col_ids, c0, c1)
    return pos if valid is None else pos & valid


def _forward_statistics(
    xc: Tensor,
    yc: Tensor,
    ids: tuple[Tensor, Tensor] | None,
    row_valid: Tensor | None,
    col_valid: Tensor | None,
    chunk: int,
    symmetric: bool,
    guide: tuple[_guide.Tiles, int] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One pass over the tiles: the rows' log-sum-exp ``(Q, b)`` (each tile's, folded
    into the running one with ``logaddexp``: two ops a tile where a running max and sum
    took a dozen, the tiled path's fixed cost at small ``B``), with ``ids`` the rows'
    positive logit sums and counts ``(2, Q, b)``, and for ``symmetric`` the columns'
    log-sum-exp over these rows (and with ``ids`` their positive sums and counts)
    ``(1 or 3, Q, N)``. ``guide`` (its tiles and the diagonal's offset) drops the
    entries it excludes from each direction's log-sum-exp."""
    q, n, b = yc.shape[0], yc.shape[1], xc.shape[-2]
    row_lse = xc.new_full((q, b), float("-inf"))  # logaddexp(-inf, x) is x exactly
    row_pos = None if ids is None else xc.new_zeros((2, q, b))
    cols = xc.new_zeros((1 if ids is None else 3, q, n)) if symmetric else None
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        s, valid = _masked_tile(xc, yc, c0, c1, row_valid, col_valid)
        s, s_col = _guided(s, *guide, ids, c0, c1) if guide is not None else (s, s)
        if ids is not None:
            pos = _tile_positives(*ids, valid, c0, c1)
            pos_s = torch.where(pos, s, s.new_zeros(()))
            row_pos[0] += pos_s.sum(-1)  # type: ignore[index]
            row_pos[1] += pos.sum(-1)  # type: ignore[index]
            if cols is not None:
                cols[1, :, c0:c1] = pos_s.sum(-2)
                cols[2, :, c0:c1] = pos.sum(-2)
        if cols is not None:
            cols[0, :, c0:c1] = s_col.logsumexp(-2)
        row_lse = torch.logaddexp(row_lse, s.logsumexp(-1))  # -inf, -inf: -inf
    return row_lse, row_pos, cols  # lse -inf where no valid column


def _combine_columns(cols: Tensor, gathered: bool) -> Tensor:
    """Column statistics over every rank's rows: one ``all_gather`` of the partial
    ``(1 or 3, Q, N)`` statistics, log-sum-exp'd (the lse) and summed (positives)."""
    if not gathered:
        return cols
    parts = [torch.empty_like(cols) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, cols.contiguous())
    every = torch.stack(parts)  # (world, 1 or 3, Q, N)
    return torch.cat([every[:, :1].logsumexp(0), every[:, 1:].sum(0)])


class _TiledCrossEntropy(torch.autograd.Function):
    r"""Row (and column) cross-entropies of ``S = x @ y.mT`` over column tiles.

    ``x`` ``(b, D)`` or ``(Q, b, D)`` (already scaled by ``1/temperature``), ``y``
    ``(Q, N, D)``. Positives: with ``row_ids``/``col_ids`` every equal pair (mean of
    ``-log softmax`` over them); without, row ``i`` against column ``offset + i``. Valid
    entries are ``row_valid[i] & col_valid[j]``; others leave every sum.

    Returns ``(row_loss (Q, b), col_loss (Q, stop - start))`` with ``columns = (start,
    stop)`` this rank's columns (``None``: rows only, ``col_loss`` empty). The columns'
    log-sum-exp runs over every rank's rows: one ``all_gather`` of ``(1 or 3, Q, N)``
    partial statistics in forward and one ``all_reduce`` of ``(Q, N)`` column gradients
    in backward when ``gathered``. Saves the inputs and ``O(Q (b + N))`` statistics;
    forward computes each tile once, backward recomputes it once for both gradients.

    ``guide`` (:data:`_guide.Tiles`, optional): the guided false-negative filter; each
    tile's guide scores ``(b, chunk)`` are recomputed from the guide embeddings and the
    excluded entries leave the rows' (resp. the columns') log-sum-exp.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        y: Tensor,
        offset: int,
        row_ids: Tensor | None,
        col_ids: Tensor | None,
        row_valid: Tensor | None,
        col_valid: Tensor | None,
        chunk: int,
        columns: tuple[int, int] | None,
        gathered: bool,
        guide: _guide.Tiles | None = None,
    ) -> tuple[Tensor, Tensor]:
        compute = _compute_dtype(x)
        xc, yc = x.to(compute), y.to(compute)
        b = xc.shape[-2]
        ids = None if row_ids is None or col_ids is None else (row_ids, col_ids)
        row_lse, row_pos, cols = _forward_statistics(
            xc,
            yc,
            ids,
            row_valid,
            col_valid,
            chunk,
            columns is not None,
            None if guide is None else (guide, offset),
        )
        if row_pos is None:  # the diagonal: one positive per row, <x_i, y_offset+i>
            row_cnt = None
            positive = (xc * yc[:, offset : offset + b]).sum(-1)  # (Q, b)
        else:
            row_cnt = row_pos[1]
            positive = row_pos[0] / row_cnt.clamp_min(1)
        row_loss = _where_valid(row_lse - positive, row_valid)
        col_loss, col_stats = row_loss.new_zeros((row_loss.shape[0], 0)), None
        if cols is not None and columns is not None:
            col_stats = _combine_columns(cols, gathered)
            start, stop = columns
            part = col_stats[:, :, start:stop]
            # the diagonal's positive of column offset + i is row i's
            col_positive = positive if ids is None else part[1] / part[2].clamp_min(1)
            v = None if col_valid is None else col_valid[:, start:stop]
            col_loss = _where_valid(part[0] - col_positive, v)
            col_stats[0] = _finite_or_zero(col_stats[0])
        ctx.save_for_backward(
            x,
            y,
            _finite_or_zero(row_lse),
            row_cnt,
            col_stats,
            row_ids,
            col_ids,
            row_valid,
            col_valid,
            *(guide or (None,) * 4),
        )
        ctx.meta = (offset, chunk, columns, gathered, compute)
        # a fresh tensor, not an intermediate or one mutated in place: torch 2.11's compile
        # routes such an output's gradient to the wrong slot (zeros; pytorch#180642)
        return row_loss.to(x.dtype, copy=True), col_loss.to(x.dtype, copy=True)

    @staticmethod
    def backward(ctx: Any, g_row: Tensor, g_col: Tensor) -> tuple[Any, ...]:
        (x, y, row_lse, row_cnt, col_stats, row_ids, col_ids, row_valid, col_valid) = (
            ctx.saved_tensors[:9]
        )
        guide = _saved_guide(ctx.saved_tensors[9:])
        offset, chunk, columns, gathered, compute = ctx.meta
        xc, yc = x.to(compute), y.to(compute)
        q, n = yc.shape[0], yc.shape[1]
        g_row = g_row.to(compute)
        if row_valid is not None:
            g_row = g_row * row_valid
        multi = row_ids is not None
        symmetric = columns is not None
        if symmetric:
            start, stop = columns
            g_all = g_row.new_zeros((q, n))
            g_all[:, start:stop] = g_col.to(compute)
            if gathered:  # every rank's column gradients, each nonzero on its own slice
                dist.all_reduce(g_all)
            if col_valid is not None:
                g_all = g_all * col_valid
        row_coef = g_row if not multi else g_row / row_cnt.clamp_min(1)  # positive weights
        if symmetric:
            col_lse = col_stats[0]
            col_coef = g_all if not multi else g_all / col_stats[2].clamp_min(1)
        grad_x = torch.zeros_like(xc) if ctx.needs_input_grad[0] else None
        grad_y = torch.empty_like(yc) if ctx.needs_input_grad[1] else None
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            yt = yc[:, c0:c1]
            s, valid = _masked_tile(xc, yc, c0, c1, row_valid, col_valid)  # (Q, b, c)
            ids = (row_ids, col_ids) if multi else None
            s, s_col = _guided(s, guide, offset, ids, c0, c1)
            p = (s - row_lse[..., None]).exp_().mul_(g_row[..., None])
            if symmetric:
                p.add_(s_col.sub_(col_lse[:, None, c0:c1]).exp_().mul_(g_all[:, None, c0:c1]))
            del s, s_col
            if multi:
                pos = _positives(row_ids, col_ids, c0, c1)
                pos = pos if valid is None else pos & valid
                w = row_coef[..., None].expand(-1, -1, c1 - c0)
                if symmetric:
                    w = w + col_coef[:, None, c0:c1]
                p.sub_(torch.where(pos, w, torch.zeros((), dtype=compute, device=p.device)))
            else:
                strip, i0 = _diagonal_strip(p, offset - c0)
                rows = slice(i0, i0 + strip.shape[-1])
                w = row_coef[:, rows]
                if symmetric:
                    w = w + col_coef[:, offset + i0 : offset + i0 + strip.shape[-1]]
                strip.sub_(w)
            if grad_x is not None and xc.dim() == 3:
                grad_x.baddbmm_(p, yt)  # (Q, b, D), accumulated in place
            elif grad_x is not None:  # shared rows: one GEMM sums over the Q problems
                q, c, d = yt.shape
                # p is laid out (b, Q, c) in eager (a view of one GEMM), so this is no copy;
                # .contiguous() spells it for tracers that lay p out (Q, b, c)
                p_rows = p.transpose(0, 1).contiguous().view(p.shape[1], q * c)
                grad_x.addmm_(p_rows, yt.reshape(q * c, d))
            if grad_y is not None:
                grad_y[:, c0:c1] = p.mT @ xc
        gx_out = None if grad_x is None else grad_x.to(x.dtype)
        gy_out = None if grad_y is None else grad_y.to(y.dtype)
        return gx_out, gy_out, None, None, None, None, None, None, None, None, None


def _saved_guide(saved: tuple[Tensor | None, ...]) -> _guide.Tiles | None:
    """The guide tiles a kernel saved (four slots, ``None`` without a guide)."""
    rows, cols, row_thr, col_thr = saved
    if rows is None or cols is None or row_thr is None:
        return None
    return rows, cols, row_thr, col_thr


class _TiledSigmoid(torch.autograd.Function):
    r"""Per-row SigLIP loss :math:`\sum_j \operatorname{softplus}(-z_{ij} l_{ij})` with
    :math:`l = c\,x y^\top + b` and :math:`z = \pm 1` (positive or not), over column tiles.

    ``x`` ``(b, D)``, ``y`` ``(N, D)``, ``scale`` and ``bias`` 0-d tensors. Positives as
    in :class:`_TiledCrossEntropy`. Returns ``(b,)``; saves only the inputs. ``guide``
    (:data:`_guide.Tiles`): a pair excluded for either of its anchors leaves the sum.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        y: Tensor,
        scale: Tensor,
        bias: Tensor,
        offset: int,
        row_ids: Tensor | None,
        col_ids: Tensor | None,
        chunk: int,
        guide: _guide.Tiles | None = None,
    ) -> Tensor:
        compute = _compute_dtype(x)
        xs, yc, bc = x.to(compute) * scale.to(compute), y.to(compute), bias.to(compute)
        out = xs.new_zeros(xs.shape[0])
        for c0 in range(0, yc.shape[0], chunk):
            c1 = min(yc.shape[0], c0 + chunk)
            logits = _signed_logits(xs, yc[c0:c1], bc, offset, row_ids, col_ids, c0, c1)
            loss = torch.nn.functional.softplus(logits)
            out += _pairs_kept(loss, guide, offset, row_ids, col_ids, c0, c1).sum(-1)
        ctx.save_for_backward(x, y, scale, bias, row_ids, col_ids, *(guide or (None,) * 4))
        ctx.meta = (offset, chunk, compute)
        # a fresh tensor, not an intermediate or one mutated in place: torch 2.11's compile
        # routes such an output's gradient to the wrong slot (zeros; pytorch#180642)
        return out.to(x.dtype, copy=True)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        x, y, scale, bias, row_ids, col_ids = ctx.saved_tensors[:6]
        guide = _saved_guide(ctx.saved_tensors[6:])
        offset, chunk, compute = ctx.meta
        xc, yc, sc, bc = x.to(compute), y.to(compute), scale.to(compute), bias.to(compute)
        xs, g = xc * sc, g.to(compute)
        grad_xs = torch.zeros_like(xc)
        grad_y = torch.empty_like(yc)
        grad_bias = xc.new_zeros(())
        for c0 in range(0, yc.shape[0], chunk):
            c1 = min(yc.shape[0], c0 + chunk)
            # d softplus(-z l)/dl = -z sigmoid(-z l): sigmoid of the signed logits, sign back
            d = _signed_logits(xs, yc[c0:c1], bc, offset, row_ids, col_ids, c0, c1)
            d = _flip_positives(d.sigmoid_(), offset, row_ids, col_ids, c0, c1)
            d = _pairs_kept(d, guide, offset, row_ids, col_ids, c0, c1).mul_(g[:, None])
            grad_bias += d.sum()
            grad_xs.addmm_(d, yc[c0:c1])
            grad_y[c0:c1] = d.T @ xs
        grad_scale = (grad_xs * xc).sum()  # sum_ij d_ij <x_i, y_j>
        return (
            (grad_xs * sc).to(x.dtype),
            grad_y.to(y.dtype),
            grad_scale.to(scale.dtype),
            grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def _pairs_kept(
    t: Tensor,
    guide: _guide.Tiles | None,
    offset: int,
    row_ids: Tensor | None,
    col_ids: Tensor | None,
    c0: int,
    c1: int,
) -> Tensor:
    """``t`` ``(b, c)`` with 0 at the pairs the guide excludes for either anchor."""
    if guide is None:
        return t
    ids = None if row_ids is None or col_ids is None else (row_ids, col_ids)
    pos = _guide.tile_positives(t.shape[0], offset, ids, c0, c1, t.device)
    row, col = _guide.tile_masks(guide, c0, c1, pos)
    return t.masked_fill(row if col is row else row | col, 0)


def distinct_ids(row_ids: Tensor | None, col_ids: Tensor | None) -> Tensor | None:
    """``col_ids``, copied when it is ``row_ids`` itself (ungathered): dynamo refuses one
    tensor passed as two inputs of an autograd.Function (fullgraph fails)."""
    return col_ids.clone() if col_ids is not None and col_ids is row_ids else col_ids


# The dtypes whose losses are computed in float32 (widen): a sum of per-row losses overflows
# them long before the float64 loss does (float16's max is 65504).
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """float16/bfloat16 tiles are computed in float32, as the dense paths do (:func:`widen`)."""
    return torch.float32 if x.dtype in HALF_DTYPES else x.dtype


def widen(x: Tensor) -> Tensor:
    """``x`` in the dtype the losses compute in: float16/bfloat16 as float32 (logits,
    log-sum-exps, sums and means; the loss is cast back to the input dtype only at the
    end), any other dtype as it is (no op, no copy)."""
    return x.float() if x.dtype in HALF_DTYPES else x


def _flip_positives(
    t: Tensor, offset: int, row_ids: Tensor | None, col_ids: Tensor | None, c0: int, c1: int
) -> Tensor:
    """Negate the positive entries of a ``(b, c)`` tile of columns ``[c0, c1)``."""
    if row_ids is None:
        t.diagonal(offset=offset - c0).neg_()
        return t
    return torch.where(_positives(row_ids, col_ids, c0, c1), -t, t)  # type: ignore[arg-type]


def _signed_logits(
    xs: Tensor,
    y: Tensor,
    bias: Tensor,
    offset: int,
    row_ids: Tensor | None,
    col_ids: Tensor | None,
    c0: int,
    c1: int,
) -> Tensor:
    """``-z * (xs @ y.T + bias)``: SigLIP's logits, positives negated, so that
    ``softplus`` of them is the loss without cancellation."""
    return _flip_positives((xs @ y.T).add_(bias), offset, row_ids, col_ids, c0, c1)


@torch.no_grad()
def _tiled_top_negatives(
    x: Tensor, y: Tensor, k: int, offset: int, col_valid: Tensor | None, chunk: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The positive, the ``k`` largest negatives (sorted descending, ``-inf`` where fewer
    exist) and the smallest present similarity of each row of ``x @ y.mT``, tile by tile.

    ``x`` ``(Q, b, D)``, ``y`` ``(Q, N, D)``, ``col_valid`` ``(Q, N)``; returns
    ``(Q, b)``, ``(Q, b, k)``, ``(Q, b)``. Never more than one ``(Q, b, chunk)`` tile.
    """
    q, n = y.shape[0], y.shape[1]
    b = x.shape[-2]
    pos = (x * y[:, offset : offset + b]).sum(-1)  # (Q, b)
    top = x.new_full((q, b, k), float("-inf"))
    low = pos.clone()
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        s = x @ y[:, c0:c1].mT  # (Q, b, c)
        invalid = torch.zeros(b, c1 - c0, dtype=torch.bool, device=x.device)
        invalid.diagonal(offset=offset - c0).fill_(True)  # the positive is not a negative
        invalid = invalid.expand(q, -1, -1)
        if col_valid is not None:
            invalid = invalid | ~col_valid[:, None, c0:c1]
        low = torch.minimum(low, s.masked_fill(invalid, float("inf")).amin(-1))
        both = torch.cat([top, s.masked_fill_(invalid, float("-inf"))], dim=-1)
        top = both.topk(k, dim=-1).values  # k of the k + c: the running top-k
    return pos, top, low


@torch.no_grad()
def _tiled_softmax_mean(
    x: Tensor, y: Tensor, lse: Tensor, col_valid: Tensor | None, chunk: int
) -> Tensor:
    """``softmax(x @ y.mT) @ y`` ``(Q, b, D)`` from the rows' log-sum-exp ``lse``
    ``(Q, b)``, one ``(Q, b, chunk)`` tile at a time."""
    out = torch.zeros_like(x)
    for c0 in range(0, y.shape[1], chunk):
        c1 = min(y.shape[1], c0 + chunk)
        p = (x @ y[:, c0:c1].mT).sub_(lse[..., None]).exp_()  # (Q, b, c)
        if col_valid is not None:
            p = p.mul_(col_valid[:, None, c0:c1])
        out += p @ y[:, c0:c1]
    return out
