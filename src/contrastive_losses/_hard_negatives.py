r"""Hard negatives for InfoNCE, SigLIP and KCL: extra columns for every anchor.

As in sentence-transformers' MultipleNegativesRankingLoss, every hard negative of every
row (and, gathered, of every rank) is an extra column of every anchor's softmax; hard
negatives are never anchors. Text negatives ``(B, H, D)`` extend the a->t direction,
audio negatives ``(B, H', D)`` the t->a one.

The existing kernels are left as they are. A row's loss there is
``old_i = LSE_i - pos_i`` (``pos_i`` its positive logit, with ``ids`` the mean of its
positives' logits); with :math:`L_i` the log-sum-exp of its logits over the present hard
negatives the row's loss over all its columns is

.. math::

    \log\big(e^{LSE_i} + e^{L_i}\big) - pos_i
        = old_i + \operatorname{softplus}(L_i - old_i - pos_i),

exact in value and gradient (autograd runs through ``old_i`` and ``pos_i``), dense, tiled
and gathered alike. :math:`L_i` is one more row reduction over the negatives' columns:
dense, or over column tiles by :class:`_TiledNegatives` (memory ``O(b * chunk)``).
SigLIP's negatives add the pair terms :math:`\operatorname{softplus}(c\langle x_i,
n\rangle + b)` to each row, by the same reduction.

Private: :mod:`~contrastive_losses.infonce`, :mod:`~contrastive_losses.siglip` and
:mod:`~contrastive_losses.kcl` call :func:`check_negatives` in their checks block, then
:meth:`HardNegatives.gathered` and the per-loss function.
"""

from __future__ import annotations

import typing
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks
from ._common import _as_tensor, _gather, _gather_no_grad, _logit_range, _tile_width
from ._kernels import _compute_dtype, l2_normalize, widen
from .distributed import Validation


class HardNegatives(NamedTuple):
    """A call's hard negatives: text ``(b, H, D)`` and audio ``(b, H', D)`` (validated,
    normalised, in the losses' compute dtype; ``None`` when not given) and their bool
    masks ``(b, H)``/``(b, H')``. After :meth:`gathered` the columns of every rank,
    flattened: ``(M, D)`` and ``(M,)``."""

    text: Tensor | None
    text_mask: Tensor | None
    audio: Tensor | None
    audio_mask: Tensor | None

    def ordered(self, v: Validation) -> HardNegatives:
        """The tensors made to depend on the ranks' exchange (:meth:`Validation.ordered`)."""
        return HardNegatives(*v.ordered(*self))

    def gathered(self, enabled: bool, validate: bool) -> HardNegatives:
        """Every rank's negatives (with gradient, as the batch) as flat columns."""
        out: list[Tensor | None] = []
        for x, m in ((self.text, self.text_mask), (self.audio, self.audio_mask)):
            if x is None:
                out += [None, None]
                continue
            x_all, _ = _gather(x, enabled, validate)
            m_all = None if m is None else _gather_no_grad(m, enabled, validate)
            out += [x_all.flatten(0, 1), None if m_all is None else m_all.flatten()]
        return HardNegatives(*out)


def _check_side(
    x: object,
    mask: object | None,
    names: tuple[str, str],
    ref: Tensor,
    normalize: bool,
    validate: bool,
) -> tuple[Tensor, Tensor | None]:
    """One side's negatives ``(B, H, D)`` against the batch's raw ``ref`` ``(B, D)``:
    shape, dtype, device, the mask's layout, NaN/Inf and (``normalize``) zero rows
    (absent ones may be zeros); normalised and widened."""
    name, mask_name = names
    n = _checks.check_embeddings(x, name, ndim=3, dims="(B, H, D)", min_batch=0, check_values=False)
    _checks.check_same_size(ref, "audio", n, name, 0, "batch size B")
    _checks.check_same_size(ref, "audio", n, name, -1, "embedding dim D")
    _checks.check_same_device_dtype([(ref, "audio"), (n, name)])
    m = None
    if mask is not None:  # a row may have no negative: no all-False check
        m = _checks.check_mask(mask, mask_name, tuple(n.shape[:2]), n, validate=False)
    wide = _compute_dtype(n) if normalize else None
    norms, _ = _checks.row_norms(n, name, nonzero=normalize, mask=m, validate=validate, dtype=wide)
    return widen(l2_normalize(n, norms) if normalize else n), m


def check_negatives(
    v: Validation,
    anchors: tuple[Tensor, Tensor, Tensor],
    text: tuple[object | None, object | None],
    audio: tuple[object | None, object | None],
    options: tuple[bool, bool, str],
    scale: float | Tensor = 1.0,
    shift: float | Tensor = 0.0,
) -> HardNegatives | None:
    """Validate a call's hard negatives ``text`` and ``audio`` (each ``(negatives,
    mask)``) against the ``anchors``: the raw audio ``(B, D)`` as given, then the
    validated audio and text; ``options`` = (normalize, validate, the text side's
    keyword, ``hard_negatives``). ``None`` when none is given.
    With ``normalize=False`` their logits' range is checked as the batch's
    (:func:`_logit_range`). Under gather the ranks compare their dtypes, ``(H, D)`` and
    ``requires_grad`` (:meth:`Validation.agree`) and which of them are given."""
    normalize, validate, text_key = options
    keys = (text_key, "audio_hard_negatives")
    for (x, m), key in zip((text, audio), keys, strict=True):
        if x is None and m is not None:
            raise ValueError(f"{key}_mask: given without {key}")
    given = (text[0] is not None, audio[0] is not None)
    masked = (text[1] is not None, audio[1] is not None)
    v.settings(
        **{
            "hard negatives given (text, audio)": str(given),
            "hard negatives' masks given (text, audio)": str(masked),
        }
    )
    if not any(given):
        return None
    sides: list[Tensor | None] = []
    for side, ((x, m), key) in enumerate(zip((text, audio), keys, strict=True)):
        if x is None:
            sides += [None, None]
            continue
        n, nm = _check_side(x, m, (key, f"{key}_mask"), anchors[0], normalize, validate)
        pair = (anchors[1 + side], ("audio", "text")[side], n.flatten(0, 1), key)
        _logit_range([pair], normalize, validate, scale=scale, shift=shift)
        if v.active:
            v.agree(**{key: typing.cast(Tensor, x)})
        sides += [n, nm]
    return HardNegatives(*sides)


# ---------------------------------------------------------------------------- the maths


class _TiledNegatives(torch.autograd.Function):
    r"""Per-row reduction over column tiles of the logits ``x @ y.T + bias`` of the
    present columns (``mask`` ``(M,)``): ``"lse"``, their log-sum-exp (a row with none
    present gives the dtype's min, finite: its softplus in :func:`extend_rows` is 0 and so
    is its gradient); ``"softplus"``, the sum of their softplus. ``x`` ``(b, D)``, ``y``
    ``(M, D)``, ``bias`` a 0-d tensor or ``None``. Backward recomputes each tile once:
    ``p = dF/ds * g``, ``grad_x += p @ y_c``, ``grad_y_c = p.T @ x``."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        y: Tensor,
        bias: Tensor | None,
        mask: Tensor | None,
        kind: str,
        chunk: int,
    ) -> Tensor:
        compute = _compute_dtype(x)
        xc, yc = x.to(compute), y.to(compute)
        floor = torch.finfo(compute).min
        out = xc.new_full((xc.shape[0],), floor if kind == "lse" else 0.0)
        for c0 in range(0, yc.shape[0], chunk):
            s = _tile(xc, yc, bias, mask, c0, min(yc.shape[0], c0 + chunk), kind)
            out = (
                torch.logaddexp(out, s.logsumexp(-1))
                if kind == "lse"
                else out + F.softplus(s).sum(-1)
            )
        ctx.save_for_backward(x, y, bias, mask, out)
        ctx.meta = (kind, chunk, compute)
        return out.to(x.dtype, copy=True)  # a fresh output (see _TiledSigmoid, pytorch#180642)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        x, y, bias, mask, out = ctx.saved_tensors
        kind, chunk, compute = ctx.meta
        xc, yc, g = x.to(compute), y.to(compute), g.to(compute)[:, None]
        grad_x = torch.zeros_like(xc)
        grad_y = torch.empty_like(yc)
        grad_bias = xc.new_zeros(())
        for c0 in range(0, yc.shape[0], chunk):
            c1 = min(yc.shape[0], c0 + chunk)
            s = _tile(xc, yc, bias, None, c0, c1, "")  # absent columns: zeroed below
            p = (s - out[:, None]).exp_() if kind == "lse" else s.sigmoid_()
            if mask is not None:
                p = p.masked_fill_(~mask[None, c0:c1], 0.0)
            p = p.mul_(g)
            grad_bias += p.sum()
            grad_x.addmm_(p, yc[c0:c1])
            grad_y[c0:c1] = p.T @ xc
        return (
            grad_x.to(x.dtype),
            grad_y.to(y.dtype),
            None if bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def _tile(
    x: Tensor, y: Tensor, bias: Tensor | None, mask: Tensor | None, c0: int, c1: int, kind: str
) -> Tensor:
    """The ``(b, c1 - c0)`` logits of columns ``[c0, c1)``; absent ones (``mask``) set to
    the dtype's min for ``"lse"`` (finite: no NaN in a row with none present), to
    ``-inf`` for ``"softplus"`` (whose value and slope there are 0)."""
    s = x @ y[c0:c1].T
    if bias is not None:
        s = s + bias.to(s.dtype)
    if mask is not None:
        fill = torch.finfo(s.dtype).min if kind == "lse" else float("-inf")
        s = s.masked_fill(~mask[None, c0:c1], fill)
    return s


def _reduce_columns(
    x: Tensor,
    y: Tensor,
    mask: Tensor | None,
    kind: str,
    chunk_size: int | None,
    bias: Tensor | None = None,
) -> Tensor:
    """:class:`_TiledNegatives`'s ``(b,)`` reduction, dense (autograd) when one tile
    covers the columns (:func:`_tile_width`)."""
    chunk = _tile_width(chunk_size, y.shape[0])
    if chunk is not None:
        return _TiledNegatives.apply(x, y, bias, mask, kind, chunk)
    s = _tile(x, y, bias, mask, 0, y.shape[0], kind)
    return s.logsumexp(-1) if kind == "lse" else F.softplus(s).sum(-1)


def extend_rows(
    old: Tensor, pos: Tensor, x: Tensor, cols: Tensor, mask: Tensor | None, chunk: int | None
) -> Tensor:
    """Rows' cross-entropies ``old = LSE - pos`` with the columns ``cols`` ``(M, D)``
    added to each row's softmax: ``old + softplus(L - old - pos)``, ``L`` the log-sum-exp
    of ``x @ cols.T`` over the present columns. ``old``, ``pos`` broadcast to ``x``'s
    rows' layout ``(b,)`` or ``(b, K)``, ``x`` ``(..., D)`` already scaled."""
    return old + _added(old, pos, x, cols, mask, chunk)


def _added(
    old: Tensor, pos: Tensor, x: Tensor, cols: Tensor, mask: Tensor | None, chunk: int | None
) -> Tensor:
    """What :func:`extend_rows` adds to ``old``: ``softplus(L - old - pos)``."""
    lse = _reduce_columns(x.reshape(-1, x.shape[-1]), cols, mask, "lse", chunk)
    return F.softplus(lse.reshape(x.shape[:-1]) - old - pos)


def _same_id_means(ids: Tensor, ids_all: Tensor, x_all: Tensor, offset: int) -> Tensor:
    """For each local row ``i``, the mean of ``x_all``'s rows whose id equals ``ids[i]``
    ``(b, D)``: groups from a sort (static shapes, no ``(b, N)`` matrix, no sync)."""
    ids_sorted, order = ids_all.sort(stable=True)
    first = ids_sorted.new_ones(1, dtype=torch.bool)
    starts = torch.cat([first, ids_sorted[1:] != ids_sorted[:-1]])  # a group's first row
    group = torch.empty_like(order).scatter_(0, order, starts.long().cumsum(0) - 1)
    sums = x_all.new_zeros(x_all.shape).index_add(0, group, x_all)
    counts = x_all.new_zeros(x_all.shape[0]).index_add(0, group, x_all.new_ones(x_all.shape[0]))
    mine = group[offset : offset + ids.shape[0]]
    return sums[mine] / counts[mine, None]


def info_nce_rows(
    rows: tuple[Tensor, Tensor],
    a: Tensor,
    t: Tensor,
    scale: float | Tensor,
    ids: Tensor | None,
    neg: HardNegatives,
    gather: tuple[bool, bool, int],
    chunk_size: int | None,
) -> tuple[Tensor, Tensor]:
    """InfoNCE's per-row ``(a2t, t2a)`` (``rows``, this rank's ``(b,)`` each) with the
    gathered hard negatives ``neg`` as extra columns: text negatives in every a->t
    softmax, audio negatives in every t->a one. ``a``, ``t`` this rank's unit rows;
    ``gather`` = (enabled, validate, this rank's first row in the gathered batch)."""
    a2t, t2a = rows
    a_s = a * scale
    ids_all = None if ids is None else _gather_no_grad(ids, gather[0], gather[1])
    if neg.text is not None:
        pos = _positive(a_s, t, ids, ids_all, gather)
        a2t = extend_rows(a2t, pos, a_s, neg.text, neg.text_mask, chunk_size)
    if neg.audio is not None:
        pos = _positive(t, a_s, ids, ids_all, gather)
        t2a = extend_rows(t2a, pos, t * scale, neg.audio, neg.audio_mask, chunk_size)
    return a2t, t2a


def _positive(
    x: Tensor, y: Tensor, ids: Tensor | None, ids_all: Tensor | None, gather: tuple[bool, bool, int]
) -> Tensor:
    """Each local row's positive logit ``<x_i, y_i>``; with ``ids`` the mean of its
    logits with every rank's ``y`` of its id (:func:`_same_id_means`)."""
    if ids is None or ids_all is None:
        return (x * y).sum(-1)
    enabled, validate, offset = gather
    y_all = _gather(y, enabled, validate)[0]
    return (x * _same_id_means(ids, ids_all, y_all, offset)).sum(-1)


def siglip_rows(
    per_row: Tensor,
    a: Tensor,
    t: Tensor,
    scale: float | Tensor,
    bias: float | Tensor,
    neg: HardNegatives,
    chunk_size: int | None,
) -> Tensor:
    r"""SigLIP's per-row sums ``(b,)`` (or, dense, the ``(b, N)`` pair losses, whose rows
    are summed here) plus each row's negative-label pair terms
    :math:`\sum_n \operatorname{softplus}(c\langle a_i, n\rangle + b)` over the text
    negatives and :math:`\sum_m \operatorname{softplus}(c\langle m, t_i\rangle + b)`
    over the audio negatives (this rank's text rows as anchors)."""
    out = per_row.sum(-1) if per_row.dim() == 2 else per_row
    b_t = _as_tensor(bias, a).to(a.dtype)  # a float stays symbolic under compile
    for x, cols, m in ((a, neg.text, neg.text_mask), (t, neg.audio, neg.audio_mask)):
        if cols is not None:
            out = out + _reduce_columns(x * scale, cols, m, "softplus", chunk_size, b_t)
    return out


def kcl_pairs(
    pairs: tuple[Tensor, Tensor],
    a: Tensor,
    t: Tensor,
    m: Tensor | None,
    options: tuple[bool, float | Tensor, int | None],
    neg: HardNegatives,
) -> tuple[Tensor, Tensor]:
    """KCL's per-pair ``(a2t, t2a)`` ``(b, K)`` (0 at absent captions) with the hard
    negatives: text negatives extra columns of every language's a->t softmax (of the one
    a->t softmax over all captions with ``all_languages``), audio negatives of every
    caption's t->a softmax. ``a`` ``(b, D)`` already scaled, ``t`` ``(b, K, D)`` unit;
    ``options`` = (all_languages, the scale, chunk_size)."""
    a2t, t2a = pairs
    all_languages, scale, chunk_size = options
    pos = (a[:, None] * t).sum(-1)  # (b, K)
    present = None if m is None else m.to(pos.dtype)
    if neg.text is not None:
        pos_a2t = pos
        if all_languages:  # one softmax per clip: the mean of its present positives
            w = torch.ones_like(pos) if present is None else present
            pos_a2t = ((pos * w).sum(1) / w.sum(1))[:, None]
        extra = _added(a2t, pos_a2t, a[:, None], neg.text, neg.text_mask, chunk_size)
        a2t = a2t + (extra if present is None else extra * present)
    if neg.audio is not None:
        extra = _added(t2a, pos, t * scale, neg.audio, neg.audio_mask, chunk_size)
        t2a = t2a + (extra if present is None else extra * present)
    return a2t, t2a
