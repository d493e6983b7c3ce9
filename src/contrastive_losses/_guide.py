r"""Guided false-negative filtering (GISTEmbed, Solatorio 2024; sentence-transformers'
``GISTEmbedLoss`` and the margin strategies of its PR #3299) for InfoNCE, SigLIP and KCL.

A frozen guide model scores every (audio ``i``, text ``j``) pair of the batch,
:math:`G_{ij}`: one guide embedding per sample ``g`` ``(B, Dg)`` gives
:math:`G = \hat g \hat g^\top` (unit rows, so :math:`G_{ii} = 1`), a pair
``(guide_audio, guide_text)`` gives :math:`G_{ij} = \langle \hat g^a_i, \hat g^t_j\rangle`.
For the anchor ``i`` of either direction a negative candidate ``j`` is excluded when

.. math::

    G_{ij} > G_{ii} - m \quad (\text{absolute}), \qquad
    G_{ij} > G_{ii}\,(1 - m) \quad (\text{relative}),

(the text->audio row ``j`` compares :math:`G_{ij}` with :math:`G_{jj}`); positives are
never excluded. The dense paths build the ``(b, N)`` masks (:func:`dense_masks`), the
tiled kernels one ``(b, chunk)`` guide tile at a time (:func:`tile_masks`).

Private: :mod:`~contrastive_losses.infonce`, :mod:`~contrastive_losses.siglip`,
:mod:`~contrastive_losses.kcl` and :mod:`~contrastive_losses._kernels` import from here;
it imports no loss module (the kernels import it).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import _checks
from ._gather import _gather_no_grad, all_gather_no_grad

STRATEGIES = ("absolute", "relative")

#: ``(row guide (b, Dg), column guide (N, Dg), row thresholds (b,), column thresholds
#: (N,) or None)``: what a tiled kernel needs; ``None`` column thresholds mean the column
#: direction's mask is the rows' (one guide tensor).
Tiles = tuple[Tensor, Tensor, Tensor, "Tensor | None"]


class GuideInput(NamedTuple):
    """A call's checked guide: this rank's unit rows (detached), the settings, and whether
    one tensor was given (``audio is text``)."""

    audio: Tensor  # (b, Dg)
    text: Tensor  # (b, Dg)
    margin: float
    strategy: str

    @property
    def single(self) -> bool:
        return self.audio is self.text


class Guide(NamedTuple):
    """The guide over the global batch: this rank's rows, every rank's, thresholds."""

    audio: Tensor  # (b, Dg)
    text: Tensor  # (b, Dg)
    audio_all: Tensor  # (N, Dg)
    text_all: Tensor  # (N, Dg)
    thr: Tensor  # (b,) this rank's anchors' thresholds
    thr_all: Tensor  # (N,)
    single: bool

    def tiles(self, repeat: int = 1) -> Tiles:
        """This rank's audio rows against every text column (each repeated ``repeat``
        times: KCL's ``N * K`` captions of ``negatives="all_languages"``)."""
        cols, thr_all = self.text_all, self.thr_all
        if repeat > 1:
            cols, thr_all = cols.repeat_interleave(repeat, 0), thr_all.repeat_interleave(repeat)
        if cols is self.audio:  # dynamo refuses one tensor as two inputs of a kernel
            cols = cols.clone()
        return self.audio, cols, self.thr, None if self.single else thr_all


def check_settings(margin: object, strategy: object) -> tuple[float, str]:
    """``guide_margin`` a finite float ``>= 0``, ``guide_strategy`` one of :data:`STRATEGIES`."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise TypeError(f"guide_margin: expected a float, got {type(margin).__name__}")
    if not math.isfinite(margin) or margin < 0:
        raise ValueError(f"guide_margin: must be finite and >= 0, got {margin}")
    _checks.check_choice(strategy, "guide_strategy", STRATEGIES)
    return float(margin), str(strategy)


def _unit_rows(x: object, name: str, ref: Tensor, validate: bool) -> Tensor:
    """A ``(B, Dg)`` floating guide on ``ref``'s device, L2-normalised in ``ref``'s
    compute dtype and detached (NaN/Inf and zero rows refused with ``validate``)."""
    x = _checks.check_embeddings(x, name, ndim=2, dims="(B, Dg)", min_batch=0, check_values=False)
    _checks.check_same_size(ref, "audio", x, name, 0, "batch size B")
    if x.device != ref.device:
        raise ValueError(f"{name}: on device {x.device} but audio is on {ref.device}")
    half = ref.dtype in (torch.float16, torch.bfloat16)  # computed in float32, as the loss
    x = x.detach().to(torch.float32 if half else ref.dtype)
    norms = _checks.check_row_norms(x, name, nonzero=True, validate=validate)
    return x / norms[:, None]


def check_guide(
    guide: object, margin: object, strategy: object, ref: Tensor, validate: bool
) -> GuideInput | None:
    """The checked guide of a call (``None`` without one); ``ref`` the checked audio
    ``(B, D)`` in the loss's compute dtype. The settings are checked with or without it."""
    margin, strategy = check_settings(margin, strategy)
    if guide is None:
        return None
    if isinstance(guide, (tuple, list)):
        if len(guide) != 2:
            raise ValueError(
                f"guide: expected a tensor (B, Dg) or a pair (guide_audio, guide_text), "
                f"got a {type(guide).__name__} of {len(guide)}"
            )
        ga = _unit_rows(guide[0], "guide[0]", ref, validate)
        gt = _unit_rows(guide[1], "guide[1]", ref, validate)
        if ga.shape[1] != gt.shape[1]:
            raise ValueError(
                f"guide: the pair's dims differ: guide[0] has Dg = {ga.shape[1]}, "
                f"guide[1] {gt.shape[1]}"
            )
        return GuideInput(ga, gt, margin, strategy)
    g = _unit_rows(guide, "guide", ref, validate)
    return GuideInput(g, g, margin, strategy)


def record(v: Any, guide: GuideInput | None, margin: object, strategy: object) -> None:
    """What the ranks compare of the guide: its presence and form, the settings, and
    (gathered) its tensors' dtype and trailing shape."""
    v.settings(
        guide_given=guide is not None,
        guide_pair=guide is not None and not guide.single,
        guide_margin=margin,
        guide_strategy=strategy,
    )
    if guide is not None:
        v.agree(guide_audio=guide.audio, guide_text=guide.text)


def expand(guide: GuideInput | None, v: Any, gather: bool, validate: bool) -> Guide | None:
    """Every rank's guide rows (no gradient) and the anchors' thresholds. With one guide
    tensor :math:`G_{ii} = 1` exactly, so both directions share one mask."""
    if guide is None:
        return None
    ga, gt = v.ordered(guide.audio, guide.text)  # gathered only after the ranks' exchange
    if guide.single:
        gt = ga
    ga_all = _gather_no_grad(ga, gather, validate)
    gt_all = ga_all if guide.single else _gather_no_grad(gt, gather, validate)
    if guide.single:
        diag, diag_all = ga.new_ones(ga.shape[0]), ga.new_ones(ga_all.shape[0])
    else:
        diag, diag_all = (ga * gt).sum(-1), (ga_all * gt_all).sum(-1)
    m = guide.margin
    if guide.strategy == "absolute":
        thr, thr_all = diag - m, diag_all - m
    else:
        thr, thr_all = diag * (1 - m), diag_all * (1 - m)
    return Guide(ga, gt, ga_all, gt_all, thr, thr_all, guide.single)


def tile_positives(
    b: int, offset: int, ids: tuple[Tensor, Tensor] | None, c0: int, c1: int, device: Any
) -> Tensor:
    """``(b, c1 - c0)`` bool, the positives among columns ``[c0, c1)``: equal ids, or
    row ``r``'s column ``offset + r``."""
    if ids is not None:
        return ids[0][:, None] == ids[1][None, c0:c1]
    cols = torch.arange(c0, c1, device=device)
    return cols[None, :] == torch.arange(offset, offset + b, device=device)[:, None]


def tile_masks(tiles: Tiles, c0: int, c1: int, positives: Tensor) -> tuple[Tensor, Tensor]:
    r"""The excluded entries ``(b, c)`` of columns ``[c0, c1)``: for the rows' anchors
    (:math:`G_{ij} > \theta_i`) and for the columns' (:math:`G_{ij} > \theta_j`), the
    same tensor when the column thresholds are ``None``; never a positive."""
    rows, cols, row_thr, col_thr = tiles
    g = rows @ cols[c0:c1].T  # (b, c), the guide tile
    keep = ~positives
    row = (g > row_thr[:, None]) & keep
    if col_thr is None:
        return row, row
    return row, (g > col_thr[None, c0:c1]) & keep


def dense_masks(guide: Guide, positives: Tensor) -> tuple[Tensor, Tensor]:
    """The excluded entries of the dense a->t logits (this rank's audio against every
    text) and t->a logits (this rank's text against every audio), ``(b, N)`` each;
    ``positives`` ``(b, N)`` serves both orientations (equal ids or the diagonal)."""
    n = guide.text_all.shape[0]
    a2t, _ = tile_masks(guide.tiles(), 0, n, positives)
    if guide.single:
        return a2t, a2t
    t2a, _ = tile_masks((guide.text, guide.audio_all, guide.thr, None), 0, n, positives)
    return a2t, t2a


def fill(logits: Tensor, excluded: Tensor) -> Tensor:
    """``logits`` with the excluded entries at the dtype's finite minimum, as the dense
    paths' absent entries: out of every softmax, and NaN-free in backward."""
    return logits.masked_fill(excluded, torch.finfo(logits.dtype).min)


@torch.no_grad()
def fraction(
    tiles: Tiles,
    offset: int,
    ids: tuple[Tensor, Tensor] | None,
    valid: tuple[Tensor | None, Tensor | None],
    chunk: int | None,
    either: bool,
    gather: bool,
) -> Tensor:
    """``guide_masked``: the excluded share of the present negative entries of both
    directions (``either``: of the pairs, excluded for either anchor, SigLIP), over the
    global batch. ``valid`` are the kernels' ``(Q, b)`` row and ``(Q, N)`` column
    validities (KCL's captions); a tile at a time, ``chunk`` columns (``None``: one)."""
    rows, cols = tiles[0], tiles[1]
    b, n = rows.shape[0], cols.shape[0]
    row_valid, col_valid = valid
    counts = rows.new_zeros(3)  # excluded for the rows, for the columns; negatives
    for c0 in range(0, n, chunk or max(n, 1)):
        c1 = min(n, c0 + (chunk or n))
        pos = tile_positives(b, offset, ids, c0, c1, rows.device)
        row, col = tile_masks(tiles, c0, c1, pos)
        weight = _valid_count(row_valid, col_valid, b, c0, c1, rows.device).to(rows.dtype)  # (b, c)
        if either:
            row = col = row | col
        counts += torch.stack([(weight * row).sum(), (weight * col).sum(), (weight * ~pos).sum()])
    if gather:
        counts = all_gather_no_grad(counts[None], equal_sizes=True).sum(0)
    return (counts[0] + counts[1]) / (2 * counts[2]).clamp_min(1)


def _valid_count(
    row_valid: Tensor | None, col_valid: Tensor | None, b: int, c0: int, c1: int, device: Any
) -> Tensor:
    """In how many of the ``Q`` problems each entry of the tile is present, ``(b, c)``
    (``1`` without validities)."""
    if row_valid is None and col_valid is None:
        return torch.ones(b, c1 - c0, dtype=torch.long, device=device)
    if row_valid is None:
        assert col_valid is not None
        return col_valid[:, None, c0:c1].long().sum(0).expand(b, -1)
    if col_valid is None:
        return row_valid[:, :, None].long().sum(0).expand(-1, c1 - c0)
    return (row_valid[:, :, None] & col_valid[:, None, c0:c1]).long().sum(0)


def call_settings(module: Any, guide: object) -> dict[str, Any]:
    """A loss Module's guide keywords for its functional form (none without a guide, so
    a call without one is the call it was)."""
    if guide is None:
        return {}
    return {
        "guide": guide,
        "guide_margin": getattr(module, "guide_margin", 0.0),  # a pickle from before
        "guide_strategy": getattr(module, "guide_strategy", "absolute"),
    }
