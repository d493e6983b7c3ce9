r"""KCL: 1-to-K contrastive learning (ATRI, Yin et al., ACL 2025, Eq. 9-11).

One audio clip, K captions in K languages. Per language the negatives are that
language's captions in the batch (ATRI, default) or every caption of every language
(``negatives="all_languages"``, Nie et al. 2024). :func:`kcl` is the maths,
:class:`KCLLoss` the Module. CACL, ATRI's other loss, is :mod:`contrastive_losses.cacl`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks, _compat, _guide, _hard_negatives
from ._common import (
    ContrastivePair,
    Terms,
    _Batch,
    _batch,
    _check_pair,
    _diagonal_mask,
    _embeddings,
    _finish,
    _gather,
    _gather_no_grad,
    _logit_range,
    _reduce,
    _resolve_scale,
    _scale_setting,
)
from ._docs import init_doc
from ._kernels import (
    _compute_dtype,
    _NormalizedRowsMatmul,
    _per_language_ce,
    _SymmetricDiagonalCE,
    _TiledCrossEntropy,
    l2_normalize,
    widen,
)
from ._nce_rows import _multi_positive_ce
from ._settings import _TemperatureMixin
from .distributed import counted_call, resolve_gather, validate_together

__all__ = ["KCLLoss", "kcl"]


def _text_and_mask(
    audio: Tensor,
    text: object,
    mask: object | None,
    normalize: bool,
    min_batch: int = 2,
    validate: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """Validated raw ``text`` ``(B, K, D)``, its row norms ``(B, K)``, the mask, and
    whether the norms are moderate enough for the fused path (:func:`_checks.row_norms`)."""
    t = _checks.check_embeddings(
        text, "text", ndim=3, dims="(B, K, D)", min_batch=min_batch, check_values=False
    )
    if t.shape[1] == 0:
        raise ValueError(f"text: K = 0 languages (shape {_checks.shape_of(t)}); need at least one")
    _check_pair(audio, "audio", t, "text")
    if mask is not None:
        mask = _checks.check_mask(mask, "mask", tuple(t.shape[:2]), t, validate=validate)
    # Absent captions may be zero rows (padding); they stay zero after normalising.
    wide = _compute_dtype(t) if normalize else None  # half captions: float32 norms
    norms, moderate = _checks.row_norms(
        t, "text", nonzero=normalize, mask=mask, validate=validate, dtype=wide
    )
    return t, norms, mask, moderate


@_compat.autocast_off
def kcl(
    audio: Tensor,
    text: Tensor,
    temperature: float | Tensor = 0.07,
    *,
    logit_scale: Tensor | None = None,
    mask: Tensor | None = None,
    negatives: str = "per_language",
    normalize: bool = True,
    reduction: str = "mean",
    gather: bool | None = None,
    return_terms: bool = False,
    chunk_size: int | None = None,
    validate_args: bool | None = None,
    hard_negatives: Tensor | None = None,
    hard_negatives_mask: Tensor | None = None,
    audio_hard_negatives: Tensor | None = None,
    audio_hard_negatives_mask: Tensor | None = None,
    guide: Tensor | tuple[Tensor, Tensor] | None = None,
    guide_margin: float = 0.0,
    guide_strategy: str = "absolute",
) -> Tensor | tuple[Tensor, Terms]:
    r"""1-to-K contrastive loss (KCL, ATRI Eq. 9–11): one audio, K captions in K languages.

    ``negatives="per_language"`` (default, ATRI): for each language :math:`k` the
    negatives of audio :math:`a_i` are the captions of language :math:`k` in the batch,
    and vice versa,

    .. math::

        \mathcal{L}_{a2t} = -\sum_{k=1}^K \sum_{i=1}^N
            \log \frac{e^{s(a_i, t_{ik})}}{\sum_j e^{s(a_i, t_{jk})}}, \quad
        \mathcal{L}_{t2a} = -\sum_{k=1}^K \sum_{i=1}^N
            \log \frac{e^{s(t_{ik}, a_i)}}{\sum_j e^{s(t_{ik}, a_j)}}, \\
        \mathcal{L} = \frac{\mathcal{L}_{a2t} + \mathcal{L}_{t2a}}{2NK},

    i.e. the mean over languages of the symmetric InfoNCE. ``negatives="all_languages"``
    (Nie et al. 2024) contrasts each audio with all :math:`NK` captions, its own K all
    positive (mean of :math:`-\log\mathrm{softmax}` over them), and each caption with
    all :math:`N` audios.

    A ``mask`` marks present captions: an absent caption :math:`(j, k)` leaves every
    numerator and denominator (per language, the loss is InfoNCE on the present pairs)
    and the normaliser counts present pairs only. With ``K = 1`` this is
    :func:`info_nce`. float16/bfloat16 inputs are computed in float32 and the loss is
    returned in their dtype: finite wherever the float64 loss fits it.

    Args:
        audio: ``(B, D)``.
        text: ``(B, K, D)``; ``text[i, k]`` is the caption of clip ``i`` in language ``k``.
        temperature: :math:`\tau \ge 10^{-4}`.
        logit_scale: the model's exp'd logit scale :math:`1/\tau` as a 0-d tensor
            (open_clip's and Hugging Face's ``logit_scale.exp()``), used instead of
            ``temperature`` (leave that at its default); its gradient flows back to the
            model. At most :math:`10^4`; checked positive and finite with the value checks.
        mask: optional bool ``(B, K)``; ``True`` where the caption exists. Every clip
            needs at least one caption. Absent captions may be zero rows (padding) but
            must be finite (a NaN would reach the present rows' gradients).
        negatives: ``"per_language"`` or ``"all_languages"``.
        normalize: L2-normalise the inputs first.
        reduction: ``"mean"``, ``"sum"``, or ``"none"``: per pair ``(B, K)``, the mean of
            its a->t and t->a terms, 0 where absent.
        gather: all-gather across ranks.
        return_terms: also return ``{"loss_a2t", "loss_t2a", "loss_per_language"}``.
        chunk_size: ``None`` builds the ``(K, B, B)`` scores; an int tiles the columns in
            blocks of that many (memory ``O(K * B * chunk_size)``, the same value and
            gradients), in both ``negatives`` modes.
        validate_args: value checks on, off (no host sync) or ``None`` (the global
            default), as in :func:`~contrastive_losses.functional.info_nce`; off, a mask
            row with no present caption is not caught (its terms are then undefined).
        hard_negatives: optional hard-negative captions ``(B, H, D)`` (named so because
            ``negatives`` picks the in-batch columns), normalised as the captions: every
            present one (of every row and, gathered, of every rank) is an extra column of
            every a->t softmax, of each language's (``"per_language"``) or of the one
            over all captions (``"all_languages"``); never anchors. A present pair's
            a->t loss :math:`LSE - pos` becomes :math:`\log(e^{LSE} + e^{L_i}) - pos`,
            :math:`L_i` the log-sum-exp of audio :math:`i`'s logits over them, computed
            as ``old + softplus(L_i - old - pos)``; absent captions stay 0.
        hard_negatives_mask: optional bool ``(B, H)``, ``True`` where present.
        audio_hard_negatives: optional hard-negative audio ``(B, H', D)``: extra columns of
            every present caption's t->a softmax.
        audio_hard_negatives_mask: optional bool ``(B, H')`` for ``audio_hard_negatives``.
        guide: guided false-negative filtering, one guide embedding per clip ``(B, Dg)``
            or a pair ``(guide_audio, guide_text)`` of ``(B, Dg)``, as in
            :func:`~contrastive_losses.functional.info_nce`: the pair (audio :math:`i`,
            caption :math:`(j, k)`) has the guide score :math:`G_{ij}` in every language
            :math:`k`; it leaves the audio's softmax when :math:`G_{ij} > \theta_i` and
            the caption's when :math:`G_{ij} > \theta_j`, :math:`\theta_i = G_{ii} - m`
            (``"absolute"``) or :math:`G_{ii}(1 - m)` (``"relative"``); positives stay.
            ``return_terms`` adds ``"guide_masked"``, the excluded share of the present
            negative entries (both directions, every language).
        guide_margin: :math:`m \ge 0`.
        guide_strategy: ``"absolute"`` or ``"relative"``.

    Shape:
        audio ``(B, D)``, text ``(B, K, D)``, mask ``(B, K)``, hard_negatives ``(B, H, D)``,
        guide ``(B, Dg)``; output scalar or ``(B, K)``.

    Example:
        >>> import torch
        >>> from contrastive_losses.functional import kcl
        >>> audio, text = torch.randn(4, 16), torch.randn(4, 3, 16)
        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1], [1, 1, 1]]).bool()
        >>> kcl(audio, text, mask=mask).shape
        torch.Size([])
    """
    enabled = resolve_gather(gather)
    validate = _checks.resolve_validate(validate_args)
    with validate_together(enabled, audio, validate=validate, requested=validate_args) as v:
        _checks.check_reduction(reduction)
        _checks.check_choice(negatives, "negatives", ("per_language", "all_languages"))
        scale = _resolve_scale(temperature, logit_scale, audio, validate)
        _checks.check_chunk_size(chunk_size)
        a = _embeddings(audio, "audio", "(B, D)", normalize, v.min_batch, validate, wide=True)
        # The raw audio's dtype: under CUDA autocast the norms (hence ``a``) are float32.
        t_raw, text_norms, m, moderate = _text_and_mask(
            audio, text, mask, normalize, v.min_batch, validate
        )
        g = _guide.check_guide(guide, guide_margin, guide_strategy, widen(a), validate)
        _logit_range([(a, "audio", t_raw, "text")], normalize, validate, scale=scale)
        v.batch = a.shape[0]
        v.agree(audio=audio, text=t_raw)  # as given: normalised half rows are float32
        v.settings(
            **_scale_setting(temperature, logit_scale),
            negatives=negatives,
            reduction=reduction,
            chunk_size=chunk_size,
            normalize=normalize,
            mask_given=mask is not None,
        )
        _guide.record(v, g, guide_margin, guide_strategy)
        neg = _hard_negatives.check_negatives(
            v,
            (audio, a, t_raw.flatten(0, 1)),
            (hard_negatives, hard_negatives_mask),
            (audio_hard_negatives, audio_hard_negatives_mask),
            (normalize, validate, "hard_negatives"),
            scale,
        )
    a, t_raw, m = v.ordered(a, t_raw, m)  # gathered only after the ranks' exchange
    gd = _guide.expand(g, v, enabled, validate)
    # Single process, per-language negatives: normalise through the scores (fast path)
    # only where the checks read the norms and found them moderate: the unnormalised
    # scores t @ (a / tau).T overflow for a caption norm near the dtype's max (3.4e38
    # normalises fine). With the checks off nothing is read (no sync), so the captions
    # are normalised first, as every other loss does: the same value as checks on.
    fused = normalize and not enabled and negatives == "per_language" and moderate
    fused = fused and chunk_size is None and neg is None  # the negatives need unit captions
    # Half inputs are computed in float32 and the loss returned in their dtype (autograd
    # casts the gradients back): the sums over B*K pairs overflow float16 long before the
    # float64 loss, as do the fused path's unnormalised scores t @ a.T and its 1/||t||^2
    # in backward (||t|| < 0.004 or > ~200).
    out_dtype = audio.dtype
    k = t_raw.shape[1]
    a, t_raw, text_norms = widen(a), widen(t_raw), widen(text_norms)
    t = l2_normalize(t_raw, text_norms) if normalize and not fused else t_raw
    a = a * scale  # the (B, D) side, not the (K, B, B) scores; as in _info_nce_rows
    if neg is not None:  # gathered as the batch; extra columns of the rows computed below
        neg = neg.ordered(v).gathered(enabled, validate)
        hard = (negatives == "all_languages", scale, chunk_size)
    if chunk_size is not None:
        a2t, t2a, offset, n_global, m_all = _tiled_pairs(
            a, t, m, negatives, enabled, chunk_size, validate, gd
        )
        if neg is not None:
            a2t, t2a = _hard_negatives.kcl_pairs((a2t, t2a), a, t, m, hard, neg)
        batch = _batch(offset, n_global, enabled)
        masked = _guide_masked(gd, m, m_all, negatives, batch, chunk_size, return_terms, k)
        return _kcl_reduce(a2t, t2a, m_all, batch, reduction, return_terms, out_dtype, masked)
    a_all, offset = _gather(a, enabled, validate)
    t_all, _ = _gather(t, enabled, validate)
    m_all = None if m is None else _gather_no_grad(m, enabled, validate)
    batch = _batch(offset, a_all.shape[0], enabled)
    glob = _Global(a_all, t_all, m_all, offset)
    excluded = None
    if gd is not None:  # positives on the diagonal in both orientations
        own = _diagonal_mask(a.shape[0], a_all.shape[0], offset, a.device)
        excluded = _guide.dense_masks(gd, own)
    if negatives == "per_language" and enabled:
        a2t, t2a = _per_language_gathered(a, t, m, glob, excluded)
    elif negatives == "per_language":
        a2t, t2a = _per_language_local(a, t, m, text_norms if fused else None, excluded)
    else:
        a2t, t2a = _all_languages(a, t, m, glob, excluded)
    if neg is not None:
        a2t, t2a = _hard_negatives.kcl_pairs((a2t, t2a), a, t, m, hard, neg)
    masked = _guide_masked(gd, m, m_all, negatives, batch, chunk_size, return_terms, k)
    return _kcl_reduce(a2t, t2a, m_all, batch, reduction, return_terms, out_dtype, masked)


def _guide_masked(
    gd: _guide.Guide | None,
    m: Tensor | None,
    m_all: Tensor | None,
    negatives: str,
    batch: _Batch,
    chunk_size: int | None,
    wanted: bool,
    k_langs: int,
) -> Tensor | None:
    """``guide_masked`` of a KCL call (``None`` without a guide or unless ``wanted``):
    per language the present pairs, or all ``N * K`` captions for
    ``negatives="all_languages"``."""
    if gd is None or not wanted:
        return None
    b, n, offset = gd.audio.shape[0], gd.audio_all.shape[0], batch.offset
    gathered = batch.world > 1
    if negatives == "per_language":
        valid = (None if m is None else m.T, None if m_all is None else m_all.T)
        return _guide.fraction(gd.tiles(), offset, None, valid, chunk_size, False, gathered)
    rows = torch.arange(offset, offset + b, device=gd.audio.device)
    cols = torch.arange(n, device=gd.audio.device).repeat_interleave(k_langs)
    valid = (None, None if m_all is None else m_all.reshape(1, -1))
    return _guide.fraction(
        gd.tiles(k_langs), offset, (rows, cols), valid, chunk_size, False, gathered
    )


def _tiled_pairs(
    a: Tensor,
    t: Tensor,
    m: Tensor | None,
    negatives: str,
    enabled: bool,
    chunk_size: int,
    validate: bool,
    gd: _guide.Guide | None = None,
) -> tuple[Tensor, Tensor, int, int, Tensor | None]:
    """Per-pair a->t and t->a losses ``(b, K)`` over column tiles (no ``(K, b, N)``
    scores); also the offset, the global batch size and the gathered mask. ``gd``: the
    guide, one ``(b, chunk)`` tile shared by the K languages (or repeated over each
    clip's K captions)."""
    b, k_langs, _ = t.shape
    t_all, offset = _gather(t, enabled, validate)  # (N, K, D); the audio stays local
    n = t_all.shape[0]
    m_all = None if m is None else _gather_no_grad(m, enabled, validate)
    if negatives == "per_language":  # K problems: audio against language k's captions
        a2t_k, t2a_k = _TiledCrossEntropy.apply(
            a,
            t_all.transpose(0, 1),
            offset,
            None,
            None,
            None if m is None else m.T,
            None if m_all is None else m_all.T,
            chunk_size,
            (offset, offset + b),
            enabled,
            None if gd is None else gd.tiles(),
        )  # (K, b) each
        return a2t_k.T, t2a_k.T, offset, n, m_all
    # One problem: audio against all N*K captions, its own K (present) positive.
    row_ids = torch.arange(offset, offset + b, device=a.device)
    col_ids = torch.arange(n, device=a.device).repeat_interleave(k_langs)
    a2t_r, t2a_c = _TiledCrossEntropy.apply(
        a,
        t_all.reshape(1, n * k_langs, -1),
        offset,
        row_ids,
        col_ids,
        None,
        None if m_all is None else m_all.reshape(1, -1),
        chunk_size,
        (offset * k_langs, (offset + b) * k_langs),
        enabled,
        None if gd is None else gd.tiles(k_langs),
    )
    a2t = a2t_r[0][:, None].expand(-1, k_langs)
    t2a = t2a_c[0].reshape(b, k_langs)
    return (a2t, t2a, offset, n, m_all) if m is None else (a2t * m, t2a, offset, n, m_all)


def _kcl_reduce(
    a2t: Tensor,
    t2a: Tensor,
    m_all: Tensor | None,
    batch: _Batch,
    reduction: str,
    return_terms: bool,
    out_dtype: torch.dtype,
    guide_masked: Tensor | None = None,
) -> Tensor | tuple[Tensor, Terms]:
    """The loss and terms from the per-pair losses ``(b, K)`` of this rank's rows."""
    b, k_langs = a2t.shape
    offset = batch.offset
    count: Tensor | int = b * k_langs if m_all is None else m_all.sum()
    if batch.world > 1 and m_all is None:
        count = batch.n_global * k_langs
    per_pair = (a2t + t2a) / 2  # (b, K)
    loss = _reduce(per_pair, reduction, count, batch)
    present = torch.ones_like(per_pair) if m_all is None else m_all.to(per_pair.dtype)
    terms = {
        "loss_a2t": _reduce(a2t, "mean", count, batch),
        "loss_t2a": _reduce(t2a, "mean", count, batch),
        # Each language's symmetric loss over its present pairs (local rows under gather).
        "loss_per_language": per_pair.sum(0) / present[offset : offset + b].sum(0).clamp_min(1),
    }
    if guide_masked is not None:
        terms["guide_masked"] = guide_masked
    return _finish(loss, terms, return_terms, out_dtype)


class _Global(NamedTuple):
    """The global batch this rank's rows are contrasted with: audio ``(N, D)`` (divided
    by the temperature), captions ``(N, K, D)``, their mask ``(N, K)`` and this rank's
    first row."""

    a_all: Tensor
    t_all: Tensor
    m_all: Tensor | None
    offset: int


def _per_language_gathered(
    a: Tensor,
    t: Tensor,
    m: Tensor | None,
    glob: _Global,
    excluded: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Eq. 9-10 under gather: this rank's ``(b, K)`` a->t and t->a losses, each row
    against the global batch of its language; ``a`` is already divided by the
    temperature. ``excluded``: the guide's ``(b, N)`` a->t and t->a masks."""
    a_all, t_all, m_all, offset = glob
    b, k_langs, dim = t.shape
    row_mask = None if m is None else m.T  # (K, b)
    col_mask = None if m_all is None else m_all.T  # (K, N)
    # (K, b, N): this rank's captions against all audio, and its audio against
    # all captions of the same language.
    t2a_scores = t.transpose(0, 1) @ a_all.T
    a2t_scores = (a @ t_all.reshape(-1, dim).T).reshape(b, t_all.shape[0], k_langs)
    a2t_scores = a2t_scores.permute(2, 0, 1)
    if excluded is not None:  # the same clip pairs in every language
        a2t_scores = _guide.fill(a2t_scores, excluded[0])
        t2a_scores = _guide.fill(t2a_scores, excluded[1])
    a2t = _per_language_ce(a2t_scores, row_mask, col_mask, offset).T  # (b, K)
    t2a = _per_language_ce(t2a_scores, row_mask, col_mask, offset).T  # (b, K)
    return a2t, t2a


def _per_language_local(
    a: Tensor,
    t: Tensor,
    m: Tensor | None,
    text_norms: Tensor | None,
    excluded: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Eq. 9-10 on one process: the ``(B, K)`` a->t and t->a losses from one GEMM and
    one fused cross-entropy of both directions. With ``text_norms`` the captions ``t``
    are raw and normalised through the scores (the fast path). ``excluded``: the guide's
    ``(B, B)`` a->t and t->a masks."""
    b, k_langs, dim = t.shape
    row_mask = None if m is None else m.T  # (K, b)
    # One GEMM: (B*K, D) @ (D, B) -> (K, B_text, B_audio); a->t is its transpose.
    flat = t.reshape(-1, dim)
    if text_norms is not None:
        inv_norm = 1.0 / text_norms.reshape(-1)
        scores = _NormalizedRowsMatmul.apply(flat, inv_norm, a)  # (B*K, B)
    else:
        scores = flat @ a.T
    t2a_scores = scores.reshape(b, k_langs, b).transpose(0, 1)
    if row_mask is not None:  # absent captions leave rows and columns alike
        valid = row_mask[:, :, None] & row_mask[:, None, :]  # (K, B, B)
        t2a_scores = t2a_scores.masked_fill(~valid, torch.finfo(t2a_scores.dtype).min)
    if excluded is not None:  # the scores are t->a: its rows are the captions' anchors
        a2t_ex = excluded[0].T
        excluded = (a2t_ex, a2t_ex) if excluded[1] is excluded[0] else (excluded[1], a2t_ex)
    t2a_k, a2t_k = _SymmetricDiagonalCE.apply(t2a_scores, excluded)  # (K, B) each
    if row_mask is not None:
        t2a_k, a2t_k = t2a_k * row_mask, a2t_k * row_mask
    return a2t_k.T, t2a_k.T  # (B, K)


def _all_languages(
    a: Tensor,
    t: Tensor,
    m: Tensor | None,
    glob: _Global,
    excluded: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """``negatives="all_languages"`` (Nie et al. 2024): each audio against all ``N*K``
    captions, its own K positive; each caption against all ``N`` audios. ``(b, K)`` each,
    the a->t loss repeated over the clip's languages; 0 at absent captions. ``excluded``:
    the guide's ``(b, N)`` a->t and t->a masks, each clip's over its K captions."""
    a_all, t_all, m_all, offset = glob
    b, k_langs, dim = t.shape
    a2t_logits = a @ t_all.reshape(-1, dim).T  # (b, N*K)
    # A comparison, not ``own[rows, rows + offset] = True``: on CUDA that index_put copies
    # the Python scalar to the device, a host sync even with the checks off.
    own = _diagonal_mask(b, a_all.shape[0], offset, a.device)  # (b, N)
    positives = own[:, :, None].expand(-1, -1, k_langs)  # (b, N, K)
    if m_all is not None:
        a2t_logits = a2t_logits.masked_fill(
            ~m_all.reshape(1, -1), torch.finfo(a2t_logits.dtype).min
        )
        positives = positives & m_all[None]
    n_cols = a_all.shape[0] * k_langs
    t2a_logits = t.reshape(-1, dim) @ a_all.T  # (b*K, N)
    if excluded is not None:
        n = a_all.shape[0]
        a2t_mask = excluded[0][:, :, None].expand(-1, -1, k_langs).reshape(b, n_cols)
        a2t_logits = _guide.fill(a2t_logits, a2t_mask)
        t2a_mask = excluded[1][:, None, :].expand(-1, k_langs, -1).reshape(b * k_langs, n)
        t2a_logits = _guide.fill(t2a_logits, t2a_mask)
    a2t = _multi_positive_ce(a2t_logits, positives.reshape(b, n_cols))[:, None]  # (b, 1)
    target = (torch.arange(b, device=a.device) + offset).repeat_interleave(k_langs)
    t2a = F.cross_entropy(t2a_logits, target, reduction="none").reshape(b, k_langs)
    a2t = a2t.expand(-1, k_langs)
    if m is not None:
        a2t, t2a = a2t * m, t2a * m
    return a2t, t2a


@init_doc
class KCLLoss(_TemperatureMixin):
    r"""1-to-K contrastive loss (ATRI); see :func:`contrastive_losses.functional.kcl`.

    Args:
        temperature, learnable_temperature, max_logit_scale: as in :class:`InfoNCELoss`.
        negatives: ``"per_language"`` (ATRI Eq. 9–11) or ``"all_languages"``.
        normalize, reduction, gather, chunk_size, validate_args: as in
            :class:`InfoNCELoss`; ``"none"`` gives ``(B, K)``.
        guide_margin, guide_strategy: the guided filter's settings, as in
            :class:`InfoNCELoss`, used when ``forward`` gets a ``guide``.

    Shape:
        ``forward(audio (B, D), text (B, K, D), mask (B, K) = None, guide=(B, Dg))`` ->
        scalar or ``(B, K)``.

    Example:
        >>> import torch
        >>> from contrastive_losses import KCLLoss
        >>> audio, text = torch.randn(4, 16), torch.randn(4, 8, 16)
        >>> KCLLoss(temperature=0.07)(audio, text).shape
        torch.Size([])
    """

    def __init__(
        self,
        temperature: float = 0.07,
        *,
        negatives: str = "per_language",
        learnable_temperature: bool = False,
        max_logit_scale: float = 100.0,
        normalize: bool = True,
        reduction: str = "mean",
        gather: bool | None = None,
        chunk_size: int | None = None,
        validate_args: bool | None = None,
        guide_margin: float = 0.0,
        guide_strategy: str = "absolute",
    ) -> None:
        super().__init__()
        _checks.check_choice(negatives, "negatives", ("per_language", "all_languages"))
        self.guide_margin, self.guide_strategy = _guide.check_settings(guide_margin, guide_strategy)
        self._init_settings(normalize, reduction, gather, chunk_size, validate_args)
        self._init_temperature(temperature, learnable_temperature, max_logit_scale)
        self.negatives = negatives

    def _extra_settings(self) -> list[str]:
        return [f"negatives={self.negatives!r}"]

    @counted_call
    def forward(
        self,
        audio: Tensor,
        text: Tensor,
        mask: Tensor | None = None,
        *,
        logit_scale: Tensor | None = None,
        return_terms: bool = False,
        hard_negatives: Tensor | None = None,
        hard_negatives_mask: Tensor | None = None,
        audio_hard_negatives: Tensor | None = None,
        audio_hard_negatives_mask: Tensor | None = None,
        guide: Tensor | tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        r"""The loss of one batch.

        Args:
            audio: audio embeddings ``(B, D)``.
            text: captions ``(B, K, D)``, ``text[i, k]`` of clip ``i`` in language ``k``.
            mask: optional bool ``(B, K)``, ``True`` where the caption exists.
            guide: a frozen guide's ``(B, Dg)`` embeddings (one per clip), or a pair
                ``(guide_audio, guide_text)`` (see :func:`~contrastive_losses.functional.kcl`).
            logit_scale: the model's exp'd scale :math:`1/\tau`, a 0-d tensor, used
                instead of this Module's temperature, with gradient; refused when the
                temperature is learnable here.
            return_terms: also return the detached terms (``loss_a2t``, ``loss_t2a``,
                ``temperature``, ...; see :func:`~contrastive_losses.functional.kcl`).
            hard_negatives, hard_negatives_mask, audio_hard_negatives, audio_hard_negatives_mask:
                hard negatives ``(B, H, D)`` and their bool masks ``(B, H)``, extra columns of
                every anchor's softmax (see :func:`~contrastive_losses.functional.kcl`).

        Returns:
            The loss, a scalar (``(B, K)`` with ``reduction="none"``), or ``(loss, terms)``.
        """
        return self._loss(
            kcl,
            audio,
            text,
            mask=mask,
            negatives=self.negatives,
            logit_scale=logit_scale,
            return_terms=return_terms,
            hard_negatives=hard_negatives,
            hard_negatives_mask=hard_negatives_mask,
            audio_hard_negatives=audio_hard_negatives,
            audio_hard_negatives_mask=audio_hard_negatives_mask,
            **_guide.call_settings(self, guide),
        )

    def contrastive_pairs(
        self,
        audio: Tensor,
        text: Tensor,
        mask: Tensor | None = None,
        guide: object = None,
        **hard_negatives: object,
    ) -> list[ContrastivePair]:
        """One ``(audio, captions of language k)`` pair per language, rows masked (hard
        negatives are no pair)."""
        # Layout only: forward validated the batch (its size globally, under gather, where
        # a rank may hold one sample or none; a local minimum here would fail one rank alone).
        _checks.check_embeddings(
            text, "text", ndim=3, dims="(B, K, D)", min_batch=0, check_values=False
        )
        return [
            ContrastivePair(audio, text[:, k], None if mask is None else mask[:, k])
            for k in range(text.shape[1])
        ]
