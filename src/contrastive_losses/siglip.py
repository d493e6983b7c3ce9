r"""SigLIP: the pairwise sigmoid loss (Zhai et al. 2023, "Sigmoid Loss for Language Image
Pre-Training").

Every audio-text pair of the batch is an independent binary problem, positive on the
diagonal (or where ``ids`` match). :func:`siglip` is the maths, :class:`SigLIPLoss` the
Module with a learnable logit scale :math:`c` (stored as :math:`\log c`) and bias :math:`b`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _checks, _compat, _guide, _hard_negatives
from ._common import (
    MIN_PLAUSIBLE_SCALE,
    MIN_TEMPERATURE,
    ContrastivePair,
    Terms,
    _agree_pair,
    _as_tensor,
    _batch,
    _check_logit_scale,
    _cpu_constant,
    _diagonal_mask,
    _finish,
    _gather,
    _gather_no_grad,
    _logit_range,
    _narrow,
    _pair_and_ids,
    _reduce,
    _tile_width,
    _value_dtype,
)
from ._docs import init_doc
from ._kernels import _TiledSigmoid, distinct_ids, widen
from ._param_watch import ParameterWatch
from ._settings import _LossSettings, _refuse_trainable, _scalar_repr
from ._warnings import warn_at_caller
from .distributed import counted_call, resolve_gather, validate_together

__all__ = ["SigLIPLoss", "siglip"]


def _check_scale(scale: float | Tensor, validate: bool = True) -> None:
    r"""SigLIP's logit scale :math:`c = 1/\tau`: the bound of :func:`_temperature` (a
    tensor's value with ``validate`` only); a float below 2 warns, as a temperature above
    1/2 does (:func:`_warn_low_scale`)."""
    value = _checks.check_positive(scale, "scale", validate=validate)
    if value is not None and value > 1 / MIN_TEMPERATURE:
        raise ValueError(
            f"scale: {value:.3g} exceeds {1 / MIN_TEMPERATURE:g}, the largest logit scale "
            f"(1/temperature) the losses accept"
        )
    if not isinstance(scale, Tensor):
        _warn_low_scale(float(scale), "scale")


def _warn_low_scale(value: float, name: str) -> None:
    """Warn, once per calling line, about a float scale below
    :data:`~contrastive_losses._common.MIN_PLAUSIBLE_SCALE` (a learnable scale that falls
    there in training is not warned about: a tensor is not read for this)."""
    if value >= MIN_PLAUSIBLE_SCALE or _compat.is_compiling():
        return
    warn_at_caller(
        "logit_scale below 2",
        f"{name}={value:.4g} is below {MIN_PLAUSIBLE_SCALE:g} (a temperature above 0.5), "
        f"where no SigLIP/CLIP recipe trains (SigLIP's scale starts at 10, CLIP's at 14.3): "
        f"the sigmoid logits stay within about {value:.3g} of the bias, with little "
        f"learning signal. Pass {name}=10.0, SigLIP's initial value"
        + (f" (a temperature? {name}={1 / value:.4g})" if value < 1 else ""),
    )


def _check_bias(bias: float | Tensor, validate: bool = True, name: str = "bias") -> None:
    """A finite real scalar (SigLIP's bias may be negative or zero) of moderate size (a
    tensor's value with ``validate`` only)."""
    value = _checks.check_scalar(bias, name, floating=True, validate=validate)
    if value is None:
        return
    if value != value or abs(value) == float("inf"):
        raise ValueError(f"{name}: must be finite, got {value}")
    if abs(value) > 1 / MIN_TEMPERATURE:  # a logit of its own: the same bound as the scale
        raise ValueError(f"{name}: |{value:.3g}| exceeds {1 / MIN_TEMPERATURE:g}")


def _model_scale_bias(
    scale: float | Tensor,
    bias: float | Tensor,
    logit_scale: Tensor | None,
    logit_bias: Tensor | None,
    ref: object,
    validate: bool,
) -> tuple[float | Tensor, float | Tensor]:
    """``(scale, bias)`` of a call: the model's ``logit_scale`` and ``logit_bias`` where
    given (0-d floating tensors on ``ref``'s device), each refused together with a
    non-default ``scale`` or ``bias``."""
    if logit_scale is not None:
        if isinstance(scale, Tensor) or scale != 10.0:
            raise ValueError(f"logit_scale: given together with scale={scale!r}; pass one of them")
        scale = _check_logit_scale(logit_scale, ref, validate)
    if logit_bias is not None:
        if isinstance(bias, Tensor) or bias != -10.0:
            raise ValueError(f"logit_bias: given together with bias={bias!r}; pass one of them")
        bias = _check_logit_scale(logit_bias, ref, False, "logit_bias", is_scale=False)
        _check_bias(bias, validate, "logit_bias")  # may be negative: its own bounds
    return scale, bias


@_compat.autocast_off
def siglip(
    audio: Tensor,
    text: Tensor,
    scale: float | Tensor = 10.0,
    bias: float | Tensor = -10.0,
    *,
    logit_scale: Tensor | None = None,
    logit_bias: Tensor | None = None,
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
    r"""Pairwise sigmoid loss (SigLIP, Zhai et al. 2023).

    .. math::

        \mathcal{L} = -\frac1B \sum_{i=1}^B \sum_{j=1}^B
            \log \sigma\big(z_{ij}\,(c\,\langle a_i, t_j\rangle + b)\big),
        \qquad z_{ij} = \begin{cases} 1 & i, j \text{ positive} \\ -1 & \text{else}\end{cases}

    with scale :math:`c` (SigLIP's :math:`t' = \log c` initialised at :math:`\log 10`)
    and bias :math:`b` (initialised at :math:`-10`). float16/bfloat16 inputs are computed
    in float32 and the loss is returned in their dtype: finite wherever the float64 loss
    fits it (the sum over the :math:`B^2` pairs no longer overflows float16).

    Args:
        audio: ``(B, D)``.
        text: ``(B, D)``.
        scale: :math:`c > 0`, float or 0-d tensor.
        bias: :math:`b`, float or 0-d tensor.
        logit_scale: the model's exp'd scale :math:`c` as a 0-d tensor (open_clip's
            ``logit_scale.exp()``), used instead of ``scale`` (leave that at its
            default), with gradient; at most :math:`10^4`, checked positive and finite
            with the value checks.
        logit_bias: the model's bias :math:`b` as a 0-d tensor (open_clip's
            ``logit_bias``), used instead of ``bias`` (leave that at its default).
        ids: optional ``(B,)``; equal ids are positives.
        normalize: L2-normalise the inputs first.
        reduction: ``"mean"`` (sum over pairs / B), ``"sum"``, or ``"none"`` (row sums ``(B,)``).
        gather: all-gather across ranks (this rank's audio rows against all texts).
        return_terms: also return ``{"scale", "bias"}``.
        chunk_size: ``None`` builds the ``(B, B)`` logits; an int tiles the columns in
            blocks of that many (memory ``O(B * chunk_size)``, the same value and gradients,
            those of ``scale`` and ``bias`` included).
        validate_args: value checks on, off (no host sync) or ``None`` (the global
            default), as in :func:`~contrastive_losses.functional.info_nce`.
        hard_negatives: optional hard-negative texts ``(B, H, D)``, normalised as the batch:
            every present one (of every row and, gathered, of every rank) adds the
            negative-label pair term
            :math:`\operatorname{softplus}(c\langle a_i, n\rangle + b)` to every audio
            anchor's row; counted like the in-batch pairs (``"mean"`` still divides by
            the global batch size ``B``). Never anchors themselves.
        hard_negatives_mask: optional bool ``(B, H)``, ``True`` where present.
        audio_hard_negatives: optional hard-negative audio ``(B, H', D)``: the pair term
            :math:`\operatorname{softplus}(c\langle m, t_i\rangle + b)` of every audio
            negative :math:`m` with every text :math:`t_i`, added to row :math:`i`.
        audio_hard_negatives_mask: optional bool ``(B, H')`` for ``audio_hard_negatives``.
        guide: guided false-negative filtering, a frozen model's ``(B, Dg)``
            embeddings or a pair ``(guide_audio, guide_text)``, as in
            :func:`~contrastive_losses.functional.info_nce`: a negative pair
            :math:`(i, j)` leaves the sum when the guide excludes it for either anchor,
            :math:`G_{ij} > \theta_i` or :math:`G_{ij} > \theta_j` with
            :math:`\theta_i = G_{ii} - m` (``"absolute"``) or :math:`G_{ii}(1 - m)`
            (``"relative"``). ``return_terms`` adds ``"guide_masked"``, the excluded
            share of the negative pairs.
        guide_margin: :math:`m \ge 0`.
        guide_strategy: ``"absolute"`` or ``"relative"``.

    Shape:
        audio ``(B, D)``, text ``(B, D)``, hard_negatives ``(B, H, D)``, hard_negatives_mask
        ``(B, H)``, guide ``(B, Dg)``; output scalar or ``(B,)``.

    Example:
        >>> import torch
        >>> from contrastive_losses.functional import siglip
        >>> siglip(torch.randn(8, 16), torch.randn(8, 16)).shape
        torch.Size([])
    """
    enabled = resolve_gather(gather)
    validate = _checks.resolve_validate(validate_args)
    with validate_together(enabled, audio, validate=validate, requested=validate_args) as v:
        _checks.check_reduction(reduction)
        if logit_scale is None:
            _check_scale(scale, validate)
        if logit_bias is None:
            _check_bias(bias, validate)
        scale, bias = _model_scale_bias(scale, bias, logit_scale, logit_bias, audio, validate)
        _checks.check_chunk_size(chunk_size)
        a, t, ids = _pair_and_ids(audio, text, ids, normalize, v.min_batch, validate)
        g = _guide.check_guide(guide, guide_margin, guide_strategy, widen(a), validate)
        _logit_range([(a, "audio", t, "text")], normalize, validate, scale=scale, shift=bias)
        v.batch = a.shape[0]
        if v.active:  # the ranks check together (else nothing is recorded)
            settings = {
                "logit_scale" if logit_scale is not None else "scale": scale,
                "logit_bias" if logit_bias is not None else "bias": bias,
                "scale dtype": _value_dtype(scale),
                "bias dtype": _value_dtype(bias),
            }
            _agree_pair(v, audio, text, ids, reduction, chunk_size, normalize, settings)
            _guide.record(v, g, guide_margin, guide_strategy)
        neg = _hard_negatives.check_negatives(
            v,
            (audio, a, t),
            (hard_negatives, hard_negatives_mask),
            (audio_hard_negatives, audio_hard_negatives_mask),
            (normalize, validate, "hard_negatives"),
            scale,
            bias,
        )
    dtype = audio.dtype  # of the loss; half inputs are computed in float32
    a, t = widen(a), widen(t)
    a, t, ids = v.ordered(a, t, ids)  # gathered only after the ranks' exchange
    gd = _guide.expand(g, v, enabled, validate)
    t_all, offset = _gather(t, enabled, validate)
    ids_all = None if ids is None else _gather_no_grad(ids, enabled, validate)
    chunk = _tile_width(chunk_size, t_all.shape[0])
    tiles = None if gd is None else gd.tiles()
    if chunk is None:  # reduced whole (one reduction) unless the rows are asked for
        pairs = _dense_pair_losses(a, t_all, scale, bias, offset, ids, ids_all)
        if tiles is not None:  # an excluded pair leaves the sum
            pairs = pairs.masked_fill(_excluded_pairs(tiles, offset, ids, ids_all), 0)
        per_row = pairs.sum(dim=1) if reduction == "none" else pairs
    else:
        s_t, b_t = (_as_tensor(v, a).to(a.dtype) for v in (scale, bias))
        col_ids = distinct_ids(ids, ids_all)
        per_row = _TiledSigmoid.apply(a, t_all, s_t, b_t, offset, ids, col_ids, chunk, tiles)
    if neg is not None:  # each row's pairs plus its hard negatives' pair terms
        neg = neg.ordered(v).gathered(enabled, validate)
        per_row = _hard_negatives.siglip_rows(per_row, a, t, scale, bias, neg, chunk_size)
    batch = _batch(offset, t_all.shape[0], enabled)
    loss = _reduce(per_row, reduction, batch.n_global, batch)
    if not return_terms:
        return _narrow(loss, dtype)
    terms = {"scale": _as_tensor(scale, a), "bias": _as_tensor(bias, a)}
    if tiles is not None:
        pair_ids = None if ids is None or ids_all is None else (ids, ids_all)
        terms["guide_masked"] = _guide.fraction(
            tiles, offset, pair_ids, (None, None), chunk, True, enabled
        )
    return _finish(loss, terms, return_terms, dtype)


def _excluded_pairs(
    tiles: _guide.Tiles, offset: int, ids: Tensor | None, ids_all: Tensor | None
) -> Tensor:
    """``(b, N)``: the negative pairs the guide excludes for either anchor."""
    b, n = tiles[0].shape[0], tiles[1].shape[0]
    if ids is None or ids_all is None:
        positives = _diagonal_mask(b, n, offset, tiles[0].device)
    else:
        positives = ids[:, None] == ids_all[None, :]
    row, col = _guide.tile_masks(tiles, 0, n, positives)
    return row if col is row else row | col


# Up to this many pairs the positives' sign flip is a product with a +-1 matrix: the
# in-place flip of the diagonal costs autograd a CopySlices node (a clone of the (b, N)
# gradient and five ops), 8% of a SigLIP call at B = 32 and 3% at 128 (thread CPU time);
# above it the sign matrix's extra passes and its (b, N) kept for backward cost more.
_SIGN_PRODUCT_MAX = 128 * 128


def _dense_pair_losses(
    a: Tensor,
    t_all: Tensor,
    scale: float | Tensor,
    bias: float | Tensor,
    offset: int,
    ids: Tensor | None,
    ids_all: Tensor | None,
) -> Tensor:
    """The pairs' losses ``(b, N)`` from the ``(b, N)`` logits, in one buffer: the scale
    multiplies the ``(b, D)`` side, the bias is added by the GEMM (``addmm``), the
    positives' sign flip is in place, and ``softplus(-z l)`` (= ``-logsigmoid(z l)``)
    needs no sign matrix above :data:`_SIGN_PRODUCT_MAX` pairs; up to it a product with
    a ``+-1`` matrix flips them (exact either way)."""
    b_t = _as_tensor(bias, a)  # a float stays symbolic under compile
    if b_t.dtype != a.dtype:
        b_t = b_t.to(a.dtype)
    logits = torch.addmm(b_t, a * scale, t_all.T)  # (b, N)
    if ids is None and logits.numel() <= _SIGN_PRODUCT_MAX:
        key = ("signs", *logits.shape, offset, logits.dtype)
        logits = logits.mul_(_cpu_constant(key, logits, lambda: _signs(logits, offset)))
    elif ids is None:
        logits.diagonal(offset=offset).neg_()
    else:
        logits = torch.where(ids[:, None] == ids_all[None, :], -logits, logits)  # type: ignore[index]
    return F.softplus(logits)


def _signs(logits: Tensor, offset: int) -> Tensor:
    """``+1`` in ``logits``' shape, dtype and device, ``-1`` on the positives' diagonal."""
    sign = torch.ones_like(logits)
    sign.diagonal(offset=offset).fill_(-1)
    return sign


# How the watch on parameters left out of the optimizer names log_scale and bias.
_WATCHED = ["scale", "bias"]


@init_doc
class SigLIPLoss(_LossSettings):
    r"""Pairwise sigmoid loss; see :func:`contrastive_losses.functional.siglip`.

    Args:
        scale_init: initial scale :math:`c` (SigLIP: 10, stored as :math:`\log c`).
        bias_init: initial bias :math:`b` (SigLIP: -10).
        learnable: learn scale and bias (default) or keep them fixed.
        normalize, reduction, gather, chunk_size, validate_args: as in :class:`InfoNCELoss`.
        guide_margin, guide_strategy: the guided filter's settings, as in
            :class:`InfoNCELoss`, used when ``forward`` gets a ``guide``.

    Shape:
        ``forward(audio (B, D), text (B, D), ids (B,) = None, guide=(B, Dg))`` -> scalar
        or ``(B,)``.

    Example:
        >>> import torch
        >>> from contrastive_losses import SigLIPLoss
        >>> SigLIPLoss()(torch.randn(8, 32), torch.randn(8, 32)).shape
        torch.Size([])
    """

    def __init__(
        self,
        scale_init: float = 10.0,
        bias_init: float = -10.0,
        *,
        learnable: bool = True,
        normalize: bool = True,
        reduction: str = "mean",
        gather: bool | None = None,
        chunk_size: int | None = None,
        validate_args: bool | None = None,
        guide_margin: float = 0.0,
        guide_strategy: str = "absolute",
    ) -> None:
        super().__init__()
        _refuse_trainable(scale_init, "scale_init", "learnable=True")
        self.guide_margin, self.guide_strategy = _guide.check_settings(guide_margin, guide_strategy)
        _refuse_trainable(bias_init, "bias_init", "learnable=True")
        _checks.check_positive(scale_init, "scale_init")
        _checks.resolve_validate(validate_args)  # the type
        if not torch.finfo(torch.float32).tiny <= scale_init <= 1.0 / MIN_TEMPERATURE:
            raise ValueError(
                f"scale_init: {scale_init:g} is outside [{torch.finfo(torch.float32).tiny:.3g}, "
                f"{1.0 / MIN_TEMPERATURE:g}] (the logit scale is 1/temperature)"
            )
        _warn_low_scale(float(scale_init), "scale_init")
        if isinstance(bias_init, bool) or not isinstance(bias_init, (int, float)):
            raise TypeError(f"bias_init: expected a float, got {type(bias_init).__name__}")
        if not abs(bias_init) <= 1.0 / MIN_TEMPERATURE:  # False for NaN too
            raise ValueError(
                f"bias_init: must be finite with |bias_init| <= {1.0 / MIN_TEMPERATURE:g}, "
                f"got {bias_init}"
            )
        self._init_settings(normalize, reduction, gather, chunk_size, validate_args)
        self.learnable = learnable
        log_scale = torch.tensor(math.log(scale_init))
        bias = torch.tensor(float(bias_init))
        self._watch = ParameterWatch(
            "SigLIPLoss: the learnable {what} ({names}) got gradients in {steps} optimizer "
            "steps that did not hold {them} and never changed from the initial values, so "
            "the loss trains with them fixed. Are all the loss's parameters in the "
            "optimizer? Pass them with the model's, e.g. torch.optim.AdamW("
            "[*model.parameters(), *loss_fn.parameters()]), or build it with learnable=False"
        )
        if learnable:
            self.log_scale = nn.Parameter(log_scale)
            self.bias = nn.Parameter(bias)
            self._watch.arm(self, [self.log_scale, self.bias], _WATCHED)
        else:
            self.register_buffer("log_scale", log_scale)
            self.register_buffer("bias", bias)

    #: Optimizer steps, each after a gradient in training mode, that do not hold the
    #: learnable scale or the bias, after which one that never changed is reported.
    stuck_after: int = 50

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy or an unpickled loss watches its own scale and bias."""
        super().__setstate__(state)
        if self.learnable:
            self._watch.arm(self, [self.log_scale, self.bias], _WATCHED)

    @property
    def scale(self) -> Tensor:
        r"""Current logit scale :math:`c` (``exp`` of the stored :math:`\log c`), a 0-d tensor."""
        return self.log_scale.exp()

    @property
    def temperature(self) -> Tensor:
        """:math:`1/c`, the temperature the sigmoid logits correspond to."""
        return 1.0 / self.scale

    def extra_repr(self) -> str:
        """The current scale and bias (learnable or fixed) and the settings."""
        return (
            f"scale={_scalar_repr(self.scale)}, bias={_scalar_repr(self.bias)}, "
            f"learnable={self.learnable}, {self._settings_repr()}"
        )

    @counted_call
    def forward(
        self,
        audio: Tensor,
        text: Tensor,
        ids: Tensor | None = None,
        *,
        logit_scale: Tensor | None = None,
        logit_bias: Tensor | None = None,
        return_terms: bool = False,
        hard_negatives: Tensor | None = None,
        hard_negatives_mask: Tensor | None = None,
        audio_hard_negatives: Tensor | None = None,
        audio_hard_negatives_mask: Tensor | None = None,
        guide: Tensor | tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """The loss of one batch.

        Args:
            audio: audio embeddings ``(B, D)``.
            text: text embeddings ``(B, D)``; ``text[i]`` is the positive of ``audio[i]``.
            ids: optional integer sample ids ``(B,)``; equal ids are positives.
            guide: a frozen guide's ``(B, Dg)`` embeddings, or a pair ``(guide_audio,
                guide_text)``: pairs it excludes leave the sum (see
                :func:`~contrastive_losses.functional.siglip`).
            logit_scale: the model's exp'd scale :math:`c`, a 0-d tensor (open_clip's
                ``logit_scale.exp()``), used instead of this Module's scale, with gradient.
            logit_bias: the model's bias :math:`b`, a 0-d tensor, used instead of this
                Module's bias. Both are refused when this Module learns its own
                (``learnable=True``, the default): build it with ``learnable=False``.
            return_terms: also return the detached terms ``{"scale", "bias"}``.
            hard_negatives, hard_negatives_mask, audio_hard_negatives, audio_hard_negatives_mask:
                hard negatives ``(B, H, D)`` and their bool masks ``(B, H)``, extra columns of
                every anchor's softmax (see :func:`~contrastive_losses.functional.siglip`).

        Returns:
            The loss, a scalar (``(B,)`` row sums with ``reduction="none"``), or
            ``(loss, terms)``.
        """
        if (logit_scale is not None or logit_bias is not None) and self.learnable:
            given = "logit_scale" if logit_scale is not None else "logit_bias"
            raise ValueError(
                f"{given}: SigLIPLoss(learnable=True) learns its own scale and bias; with "
                "the model's (logit_scale=..., logit_bias=...) build it with learnable=False"
            )
        if self.learnable:
            self._watch.rearm(self, [self.log_scale, self.bias], _WATCHED)
        scale: dict[str, Any] = (
            {"scale": self.scale} if logit_scale is None else {"logit_scale": logit_scale}
        )
        bias = {"bias": self.bias} if logit_bias is None else {"logit_bias": logit_bias}
        return siglip(
            audio,
            text,
            ids=ids,
            return_terms=return_terms,
            hard_negatives=hard_negatives,
            hard_negatives_mask=hard_negatives_mask,
            audio_hard_negatives=audio_hard_negatives,
            audio_hard_negatives_mask=audio_hard_negatives_mask,
            **scale,
            **bias,
            **self._settings(),
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
