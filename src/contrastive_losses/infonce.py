r"""InfoNCE, the symmetric contrastive loss of CLIP and CLAP.

van den Oord et al. 2018 (InfoNCE); Radford et al. 2021 (CLIP, the symmetric form);
Elizalde et al. 2023 (CLAP). :func:`info_nce` is the maths, :class:`InfoNCELoss` the
Module with a fixed or learnable temperature. With ``ids``, pairs that share an id are
all positives (the supervised-contrastive form, Khosla et al. 2020).
"""

from __future__ import annotations

from torch import Tensor

from . import _checks, _compat, _guide, _hard_negatives
from ._common import (
    ContrastivePair,
    Terms,
    _agree_pair,
    _finish,
    _gather_no_grad,
    _logit_range,
    _narrow,
    _pair_and_ids,
    _reduce,
    _resolve_scale,
    _scale_setting,
    _tile_width,
)
from ._docs import init_doc
from ._kernels import widen
from ._nce_rows import _info_nce_means, _info_nce_rows
from ._settings import _TemperatureMixin
from .distributed import counted_call, resolve_gather, validate_together

__all__ = ["InfoNCELoss", "info_nce"]


@_compat.autocast_off
def info_nce(
    audio: Tensor,
    text: Tensor,
    temperature: float | Tensor = 0.07,
    *,
    logit_scale: Tensor | None = None,
    ids: Tensor | None = None,
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
    r"""Symmetric InfoNCE (the CLIP / CLAP loss).

    .. math::

        \ell_i = \tfrac12\Big(
            -\log \frac{e^{s(a_i, t_i)}}{\sum_j e^{s(a_i, t_j)}}
            -\log \frac{e^{s(t_i, a_i)}}{\sum_j e^{s(t_i, a_j)}}\Big),
        \qquad \mathcal{L} = \frac1B \sum_i \ell_i .

    With ``ids``, every pair that shares an id is a positive (the same clip twice in a
    batch is no false negative) and a row's loss is the mean over its positives of
    :math:`-\log \mathrm{softmax}`, the supervised-contrastive form.

    float16/bfloat16 inputs are computed in float32 and the loss is returned in their
    dtype: finite wherever the float64 loss fits it (inside the logit bound).

    Args:
        audio: audio embeddings ``(B, D)``.
        text: text embeddings ``(B, D)``; ``text[i]`` is the positive of ``audio[i]``.
        temperature: :math:`\tau \ge 10^{-4}`, a float or a 0-d tensor (learnable).
        logit_scale: the model's exp'd logit scale :math:`1/\tau` as a 0-d tensor
            (open_clip's and Hugging Face's ``logit_scale.exp()``), used instead of
            ``temperature`` (leave that at its default); its gradient flows back to the
            model. At most :math:`10^4`; checked positive and finite with the value checks.
        ids: optional integer ``(B,)`` sample ids; equal ids are positives.
        normalize: L2-normalise the inputs first.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"`` (per-sample ``(B,)``).
        gather: all-gather across ranks; ``None`` gathers when distributed.
        return_terms: also return ``{"loss_a2t", "loss_t2a"}``.
        chunk_size: ``None`` builds the ``(B, B)`` logits; an int tiles the columns in
            blocks of that many and keeps only per-row and per-column log-sum-exp
            vectors (memory ``O(B * chunk_size)``, the same value and gradients; see
            "Large batches" in the docs).
        validate_args: run the value checks (NaN/Inf, zero embeddings, the value of a
            tensor temperature), each a host-device sync; ``None`` follows
            :func:`contrastive_losses.set_default_validate_args` (on by default). Off,
            or under ``torch.compile``, only the static checks (shapes, dtypes, devices,
            arguments) run and a forward and backward make no host sync; under gather
            every rank must then hold the same batch size (see "Performance switches").
        hard_negatives: optional hard-negative texts ``(B, H, D)`` (e.g. mined captions of
            other clips), normalised as the batch. Every present negative of every row
            (and, gathered, of every rank) is an extra column of *every* a->t softmax,
            as in sentence-transformers' MultipleNegativesRankingLoss; negatives are
            never anchors. With :math:`L_i` the log-sum-exp of row :math:`i`'s logits
            over them, its a->t loss becomes
            :math:`\log(e^{LSE_i} + e^{L_i}) - pos_i`, computed exactly as
            ``old_i + softplus(L_i - old_i - pos_i)`` (dense or tiled by ``chunk_size``).
        hard_negatives_mask: optional bool ``(B, H)``, ``True`` where ``hard_negatives[i, h]``
            is present (absent ones may be zero rows; a row may have none).
        audio_hard_negatives: optional hard-negative audio ``(B, H', D)``: extra columns of
            every t->a softmax.
        audio_hard_negatives_mask: optional bool ``(B, H')`` for ``audio_hard_negatives``.
        guide: guided false-negative filtering (GISTEmbed): a frozen model's embeddings,
            one tensor ``(B, Dg)`` per pair (:math:`G = \hat g \hat g^\top`) or a pair
            ``(guide_audio, guide_text)`` of ``(B, Dg)`` (:math:`G_{ij} = \langle \hat
            g^a_i, \hat g^t_j\rangle`); L2-normalised, detached, gathered like the
            batch. The negative :math:`j` of the a->t row :math:`i` leaves its softmax
            when :math:`G_{ij} > G_{ii} - m` (``"absolute"``) or :math:`G_{ij} > G_{ii}(1 -
            m)` (``"relative"``); the t->a row :math:`j` drops the audio :math:`i` when
            :math:`G_{ij}` exceeds :math:`G_{jj}`'s bound. Positives are never dropped.
            ``return_terms`` adds ``"guide_masked"``, the excluded share of the negative
            entries (both directions, global batch). See "False negatives" in the docs.
        guide_margin: :math:`m \ge 0` (default 0: drop what the guide scores above the
            positive).
        guide_strategy: ``"absolute"`` or ``"relative"``.

    Shape:
        audio ``(B, D)``, text ``(B, D)``, ids ``(B,)``, hard_negatives ``(B, H, D)``,
        hard_negatives_mask ``(B, H)``, guide ``(B, Dg)``; output scalar or ``(B,)``.

    Example:
        >>> import torch
        >>> from contrastive_losses.functional import info_nce
        >>> audio, text = torch.randn(8, 32), torch.randn(8, 32)
        >>> info_nce(audio, text, temperature=0.07).shape
        torch.Size([])
    """
    enabled = resolve_gather(gather)
    validate = _checks.resolve_validate(validate_args)
    with validate_together(enabled, audio, validate=validate, requested=validate_args) as v:
        _checks.check_reduction(reduction)
        scale = _resolve_scale(temperature, logit_scale, audio, validate)
        _checks.check_chunk_size(chunk_size)
        a, t, ids = _pair_and_ids(audio, text, ids, normalize, v.min_batch, validate)
        g = _guide.check_guide(guide, guide_margin, guide_strategy, widen(a), validate)
        _logit_range([(a, "audio", t, "text")], normalize, validate, scale=scale)
        v.batch = a.shape[0]
        if v.active:  # the ranks check together (else nothing is recorded)
            settings = _scale_setting(temperature, logit_scale)
            _agree_pair(v, audio, text, ids, reduction, chunk_size, normalize, settings)
            _guide.record(v, g, guide_margin, guide_strategy)
        neg = _hard_negatives.check_negatives(
            v,
            (audio, a, t),
            (hard_negatives, hard_negatives_mask),
            (audio_hard_negatives, audio_hard_negatives_mask),
            (normalize, validate, "hard_negatives"),
            scale,
        )
    dtype = audio.dtype  # of the loss; half inputs are computed in float32
    a, t = widen(a), widen(t)
    a, t, ids = v.ordered(a, t, ids)  # gathered only after the ranks' exchange
    gd = _guide.expand(g, v, enabled, validate)
    if reduction == "mean" and ids is None and not enabled and neg is None and gd is None:
        if _tile_width(chunk_size, a.shape[0]) is None:  # one process, dense: fused means
            mean_a2t, mean_t2a = _info_nce_means(a, t, scale)
            loss = (mean_a2t + mean_t2a) / 2
            if not return_terms:
                return _narrow(loss, dtype)
            return _finish(loss, {"loss_a2t": mean_a2t, "loss_t2a": mean_t2a}, True, dtype)
    a2t, t2a, batch = _info_nce_rows(a, t, scale, ids, enabled, chunk_size, validate, gd)
    if neg is not None:
        neg = neg.ordered(v).gathered(enabled, validate)
        rows = (a2t, t2a)
        a2t, t2a = _hard_negatives.info_nce_rows(
            rows, a, t, scale, ids, neg, (enabled, validate, batch.offset), chunk_size
        )
    loss = _reduce((a2t + t2a) / 2, reduction, batch.n_global, batch)
    if not return_terms:  # the terms' reductions cost as much as the loss's at small B
        return _narrow(loss, dtype)
    terms = {
        "loss_a2t": _reduce(a2t, "mean", batch.n_global, batch),
        "loss_t2a": _reduce(t2a, "mean", batch.n_global, batch),
    }
    if gd is not None:
        pair_ids = None if ids is None else (ids, _gather_no_grad(ids, enabled, validate))
        chunk = _tile_width(chunk_size, batch.n_global)
        terms["guide_masked"] = _guide.fraction(
            gd.tiles(), batch.offset, pair_ids, (None, None), chunk, False, enabled
        )
    return _finish(loss, terms, return_terms, dtype)


@init_doc
class InfoNCELoss(_TemperatureMixin):
    r"""Symmetric InfoNCE (CLIP/CLAP loss); see :func:`contrastive_losses.functional.info_nce`.

    Args:
        temperature: initial or fixed :math:`\tau` (default 0.07).
        learnable_temperature: learn :math:`\log(1/\tau)`, clamped at ``max_logit_scale``.
        max_logit_scale: upper bound of :math:`1/\tau` (CLIP: 100).
        normalize: L2-normalise inputs.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        gather: all-gather across ranks (``None``: when distributed).
        chunk_size: ``None`` (dense) or the column tile of the memory-bounded path.
        validate_args: value checks on (``True``), off (``False``, no host sync) or the
            global default (``None``); see :func:`~contrastive_losses.functional.info_nce`.
        guide_margin, guide_strategy: the guided filter's margin :math:`m \ge 0` and
            ``"absolute"`` | ``"relative"``, used when ``forward`` gets a ``guide``.

    Shape:
        ``forward(audio (B, D), text (B, D), ids (B,) = None, guide=(B, Dg))`` -> scalar
        or ``(B,)``.

    Example:
        >>> import torch
        >>> from contrastive_losses import InfoNCELoss
        >>> loss_fn = InfoNCELoss(temperature=0.07, learnable_temperature=True)
        >>> loss, terms = loss_fn(torch.randn(8, 32), torch.randn(8, 32), return_terms=True)
        >>> sorted(terms)
        ['loss_a2t', 'loss_t2a', 'temperature']
    """

    def __init__(
        self,
        temperature: float = 0.07,
        *,
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
        self._init_settings(normalize, reduction, gather, chunk_size, validate_args)
        self._init_temperature(temperature, learnable_temperature, max_logit_scale)
        self.guide_margin, self.guide_strategy = _guide.check_settings(guide_margin, guide_strategy)

    @counted_call
    def forward(
        self,
        audio: Tensor,
        text: Tensor,
        ids: Tensor | None = None,
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
            text: text embeddings ``(B, D)``; ``text[i]`` is the positive of ``audio[i]``.
            ids: optional integer sample ids ``(B,)``; equal ids are positives.
            guide: a frozen guide's ``(B, Dg)`` embeddings, or a pair ``(guide_audio,
                guide_text)``: negatives it scores too close to the positive leave the
                softmax (see :func:`~contrastive_losses.functional.info_nce`).
            logit_scale: the model's exp'd scale :math:`1/\tau`, a 0-d tensor (open_clip,
                Hugging Face), used instead of this Module's temperature, with gradient;
                refused when the temperature is learnable here.
            return_terms: also return the detached terms ``{"loss_a2t", "loss_t2a",
                "temperature"}``.
            hard_negatives, hard_negatives_mask, audio_hard_negatives, audio_hard_negatives_mask:
                hard negatives ``(B, H, D)`` and their bool masks ``(B, H)``, extra columns of
                every anchor's softmax (see :func:`~contrastive_losses.functional.info_nce`).

        Returns:
            The loss, a scalar (``(B,)`` with ``reduction="none"``), or ``(loss, terms)``.
        """
        return self._loss(
            info_nce,
            audio,
            text,
            ids=ids,
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
        ids: Tensor | None = None,
        guide: object = None,
        **hard_negatives: object,
    ) -> list[ContrastivePair]:
        """The one ``(audio, text)`` pair this loss contrasts (hard negatives are no pair)."""
        return [ContrastivePair(audio, text)]
