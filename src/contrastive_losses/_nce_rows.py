"""The InfoNCE family's per-row cross-entropies: this rank's audio rows against the
(gathered) text and back, with one positive per row or every row of the same id
(:func:`_multi_positive_ce`), dense or over column tiles, and the one-process mean in two
fused calls (:func:`_info_nce_means`).

Private: :mod:`~contrastive_losses.infonce`, :mod:`~contrastive_losses.kcl` and
:mod:`~contrastive_losses.cacl` import from here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _guide
from ._common import (
    _Batch,
    _batch,
    _cpu_constant,
    _diagonal_mask,
    _gather,
    _gather_no_grad,
    _tile_width,
)
from ._kernels import _SymmetricMeanCE, _TiledCrossEntropy, distinct_ids


def _multi_positive_ce(logits: Tensor, positives: Tensor) -> Tensor:
    r"""Per-row :math:`-\frac{1}{|P_i|}\sum_{p \in P_i} \log \mathrm{softmax}(z_i)_p`.

    The supervised-contrastive "average outside the log" form: with one positive per row
    it is plain cross-entropy.
    """
    log_prob = logits - logits.logsumexp(dim=1, keepdim=True)  # (b, N)
    pos = positives.to(log_prob.dtype)
    return -(log_prob * pos).sum(dim=1) / pos.sum(dim=1)


# From this batch size on, info_nce's one-process mean takes the t->a term from a
# log-softmax down the logits' columns: the cross-entropy of the transposed logits (a
# strided view) cost 1.28x open_clip's two-matmul maths at B = 1024, D = 64 (its gradient
# reached the logits transposed, whose strided sum took a third of the step); 0.93x this
# way. Below it the transposed view's one fused call is cheaper (0.84x against 0.95x at
# B = 32; the maths alone, forward and backward, one CPU thread).
_COLUMN_SOFTMAX_MIN = 128
# From this one on, both means come from :class:`_SymmetricMeanCE` (the logits' matmul,
# both means, one (B, B) gradient buffer, two plain GEMMs): against the two
# cross-entropies 0.81x at B = 512 and 0.51x at 1024 with D = 64, 0.96x and 0.86x with
# D = 512; below 512 the Function's fixed cost does not pay (1.23-1.34x at B = 32, about
# 1.0x at 256). Through the cross-entropies the step at B = D = 1024 cost 3.5-3.9
# B x B x D matmuls (floor 3), their passes over (B, B) most of the rest.
_FUSED_MEANS_MIN = 512


def _info_nce_means(a: Tensor, t: Tensor, scale: float | Tensor) -> tuple[Tensor, Tensor]:
    """The mean a->t and t->a cross-entropies of one process's ``(B, D)`` batch without
    ids, dense: :func:`_info_nce_rows` reduced by ``"mean"``, without per-sample losses
    and five reductions (at ``B = 32`` those cost a quarter of the loss's forward and
    backward): two fused ``F.cross_entropy`` calls (open_clip's ops), the t->a one down
    the columns from :data:`_COLUMN_SOFTMAX_MIN` rows, and :class:`_SymmetricMeanCE` from
    :data:`_FUSED_MEANS_MIN` on; the same values and gradients to rounding."""
    b = a.shape[0]
    if b >= _FUSED_MEANS_MIN:
        if isinstance(scale, Tensor):  # its gradient from autograd
            return _SymmetricMeanCE.apply(a * scale, t, 1.0)
        return _SymmetricMeanCE.apply(a, t, scale)
    a = a * scale  # the (B, D) side, not the (B, B) logits; as in _info_nce_rows
    return _mean_cross_entropies(a @ t.T)


def _mean_cross_entropies(logits: Tensor) -> tuple[Tensor, Tensor]:
    """The mean a->t and t->a cross-entropies of square ``(B, B)`` logits, positives on
    the diagonal: two fused ``F.cross_entropy`` calls, the t->a one down the columns from
    :data:`_COLUMN_SOFTMAX_MIN` rows."""
    b = logits.shape[0]
    target = _cpu_constant(("labels", b), logits, lambda: torch.arange(b, device=logits.device))
    if b < _COLUMN_SOFTMAX_MIN:
        return F.cross_entropy(logits, target), F.cross_entropy(logits.T, target)
    return F.cross_entropy(logits, target), -F.log_softmax(logits, dim=0).diagonal().mean()


def _info_nce_rows(
    a: Tensor,
    t: Tensor,
    scale: float | Tensor,
    ids: Tensor | None,
    gather: bool,
    chunk_size: int | None = None,
    validate: bool = True,
    guide: _guide.Guide | None = None,
) -> tuple[Tensor, Tensor, _Batch]:
    """Per-sample a->t and t->a cross-entropies of this rank's rows, ``(b,)`` each, of
    the logits ``scale * a @ t.T`` (:func:`_resolve_scale`); tiled when ``chunk_size`` is
    below the global batch (:func:`_tile_width`). ``guide`` leaves the negatives it
    excludes out of each row's softmax (:mod:`._guide`)."""
    b = a.shape[0]
    # Scale the (b, D) side, not the (b, N) logits, by a multiplication in a's dtype, as
    # open_clip's logit_scale * x @ y.T: a half-precision scale with float32 features
    # is taken exactly, and its gradient is a sum of products (a reciprocal's gradient,
    # -g/s**2, overflowed for tiny scales and for float16 features of norm 30).
    a = a * scale
    t_all, offset = _gather(t, gather, validate)  # (N, D)
    chunk = _tile_width(chunk_size, t_all.shape[0])
    if chunk is not None:
        return _tiled_info_nce_rows(a, t_all, offset, ids, gather, chunk, validate, guide)
    if not gather:
        logits_a2t = a @ t.T  # (B, B)
        logits_t2a = logits_a2t.T
    else:
        a_all, _ = _gather(a, True, validate)  # (N, D)
        logits_a2t = a @ t_all.T  # (b, N)
        logits_t2a = t @ a_all.T  # (b, N)
    n = t_all.shape[0]
    same = None if ids is None else ids[:, None] == _gather_no_grad(ids, gather, validate)[None, :]
    if guide is not None:
        positives = _diagonal_mask(b, n, offset, a.device) if same is None else same
        excluded_a2t, excluded_t2a = _guide.dense_masks(guide, positives)
        logits_a2t = _guide.fill(logits_a2t, excluded_a2t)
        logits_t2a = _guide.fill(logits_t2a, excluded_t2a)
    if same is None:
        target = torch.arange(offset, offset + b, device=a.device)
        a2t = F.cross_entropy(logits_a2t, target, reduction="none")
        t2a = F.cross_entropy(logits_t2a, target, reduction="none")
    else:  # (b, N), symmetric without gathering
        a2t = _multi_positive_ce(logits_a2t, same)
        t2a = _multi_positive_ce(logits_t2a, same)
    return a2t, t2a, _batch(offset, n, gather)


def _tiled_info_nce_rows(
    a: Tensor,
    t_all: Tensor,
    offset: int,
    ids: Tensor | None,
    gather: bool,
    chunk_size: int,
    validate: bool,
    guide: _guide.Guide | None = None,
) -> tuple[Tensor, Tensor, _Batch]:
    """:func:`_info_nce_rows` over column tiles: this rank's audio rows against every
    rank's text ``t_all`` (gathered, this rank's from ``offset``), the text columns'
    log-sum-exp completed across ranks in the kernel, so only the text is gathered and no
    ``(b, N)`` logits exist."""
    b = a.shape[0]
    col_ids = None if ids is None else distinct_ids(ids, _gather_no_grad(ids, gather, validate))
    a2t, t2a = _TiledCrossEntropy.apply(
        a,
        t_all[None],
        offset,
        ids,
        col_ids,
        None,
        None,
        chunk_size,
        (offset, offset + b),
        gather,
        None if guide is None else guide.tiles(),
    )
    return a2t[0], t2a[0], _batch(offset, t_all.shape[0], gather)
