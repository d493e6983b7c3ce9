r"""Support vector regularisation (SupCLAP, Luo, Yin et al.): the SVR term, the radius
predictor and the Module that wraps any loss of this library.

:func:`support_vector_term` is the maths of one direction (SupCLAP Eq. 5-6, App. D),
:class:`RadiusPredictor` the dynamic radius (Sec. 3.2), and
:class:`SupportVectorRegularizer` holds the learnable radius (a scalar or the predictor)
and the wiring: the wrapped loss tells which ``(audio, text)`` pairs it contrasts
(``contrastive_pairs``), and the regulariser adds the SVR term on each of them, in one or
both directions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _checks, _compat
from ._common import (
    _batch,
    _check_pair,
    _check_row_mask,
    _embeddings,
    _gather,
    _gather_no_grad,
    _logit_range,
    _reduce,
    _resolve_temperature,
    _scale_setting,
)
from ._kernels import _distance, _gram
from ._svr_radius import RadiusPredictor, _radius_tensor
from ._svr_regularizer import SupportVectorRegularizer
from ._svr_rows import _support_vector_rows, _tiled_support_vector_rows, _upcast_half
from .distributed import resolve_gather, validate_together

# The predictor is defined in _svr_radius, the regulariser in _svr_regularizer and the
# maths both share in _svr_rows; import them from here.
__all__ = ["RadiusPredictor", "SupportVectorRegularizer", "support_vector_term"]


@_compat.autocast_off
def support_vector_term(
    anchor: Tensor,
    candidates: Tensor,
    radius: float | Tensor,
    temperature: float | Tensor = 0.07,
    *,
    logit_scale: Tensor | None = None,
    normalize: bool = True,
    mask: Tensor | None = None,
    reduction: str = "mean",
    gather: bool | None = None,
    chunk_size: int | None = None,
    validate_args: bool | None = None,
) -> Tensor:
    r"""The support-vector regularisation term of SupCLAP (Eq. 5–6), one direction.

    Each anchor :math:`t_i` is shifted towards its positive :math:`a_i` by the semantic
    radius :math:`R_i` and contrasted, as the support vector, with every candidate:

    .. math::

        \hat u_i = \frac{a_i - t_i}{\lVert a_i - t_i\rVert}, \qquad
        t_i^{sup} = t_i + R_i\,\hat u_i, \qquad
        \ell_i = -\log \frac{e^{\langle t_i^{sup}, a_i\rangle/\tau}}
            {\sum_{j=1}^{B} e^{\langle t_i^{sup}, a_j\rangle/\tau}},

    on normalised :math:`t, a`; :math:`t^{sup}` is *not* re-normalised and the positive
    is in the denominator. With :math:`R` fixed the gradient with respect to
    :math:`t_i` keeps the component of every candidate's force parallel to
    :math:`\hat u_i` and scales the perpendicular one by
    :math:`1 - R_i/\lVert a_i - t_i\rVert` (SupCLAP App. D); :math:`R = 0` is the
    one-directional InfoNCE row. :math:`\lVert a_i - t_i\rVert` is clamped at the
    dtype's epsilon; a positive equal to its anchor gives the InfoNCE row (finite).
    float16 and bfloat16 inputs are computed in float32 (:math:`R/d` and its gradient,
    :math:`\propto R/d^2`, overflow float16 for nearly aligned pairs) and the result is
    returned in the input dtype.

    Args:
        anchor: anchors ``(B, D)`` (text for text-to-audio SVR).
        candidates: candidates ``(B, D)``; ``candidates[i]`` is the positive of ``anchor[i]``.
        radius: :math:`R`: a float, a 0-d tensor, or one radius per anchor ``(B,)``;
            :math:`|R| \le 10^4`.
        temperature: :math:`\tau \ge 10^{-4}`, a float or a 0-d tensor.
        logit_scale: the model's exp'd scale :math:`1/\tau` as a 0-d tensor, used
            instead of ``temperature`` (leave that at its default).
        normalize: L2-normalise the inputs first.
        mask: optional bool ``(B,)``: ``False`` drops the pair as an anchor and as a
            candidate (an absent caption).
        reduction: ``"mean"`` over present anchors, ``"sum"``, or ``"none"`` (``(B,)``,
            0 at absent anchors).
        gather: all-gather the candidates across ranks (this rank's anchors against the
            global batch; the loss is scaled as described in
            :mod:`contrastive_losses.distributed`).
        chunk_size: ``None`` builds the ``(B, B)`` logits; an int tiles the candidates
            in blocks of that many (memory ``O(B * chunk_size)``, the same value and
            gradients, the radius' included).
        validate_args: value checks (NaN/Inf, zero embeddings, the values of a tensor
            radius or temperature) on, off (no host sync) or ``None`` (the global
            default), as in :func:`~contrastive_losses.functional.info_nce`.

    Shape:
        anchor ``(B, D)``, candidates ``(B, D)``, radius ``()`` or ``(B,)``, mask ``(B,)``;
        output scalar or ``(B,)``.

    Example:
        >>> import torch
        >>> from contrastive_losses.functional import info_nce, support_vector_term
        >>> text, audio = torch.randn(8, 32), torch.randn(8, 32)
        >>> support_vector_term(text, audio, radius=0.2, temperature=0.07).shape
        torch.Size([])
        >>> # R = 0: the text-to-audio half of InfoNCE
        >>> _, terms = info_nce(audio, text, 0.07, return_terms=True)
        >>> bool(torch.isclose(support_vector_term(text, audio, 0.0), terms["loss_t2a"]))
        True
    """
    enabled = resolve_gather(gather)
    validate = _checks.resolve_validate(validate_args)
    with validate_together(
        enabled, anchor, name="anchor", validate=validate, requested=validate_args
    ) as v:
        _checks.check_reduction(reduction)
        temperature = _resolve_temperature(temperature, logit_scale, anchor, validate)
        _checks.check_chunk_size(chunk_size)
        raw = (anchor, candidates)
        dtype = getattr(anchor, "dtype", None)
        if dtype is not None and dtype == getattr(candidates, "dtype", None):
            anchor, candidates = _upcast_half(anchor), _upcast_half(candidates)
        x = _embeddings(anchor, "anchor", "(B, D)", normalize, v.min_batch, validate)
        y = _embeddings(candidates, "candidates", "(B, D)", normalize, v.min_batch, validate)
        _check_pair(x, "anchor", y, "candidates")
        if validate and normalize and dtype in (torch.float16, torch.bfloat16):
            # The norms the input dtype can normalise, as every other loss checks them:
            # the float32 inside would accept a float16 row of 6e-8, whose gradient
            # (over its norm) is then inf in float16.
            for t_raw, t_name in zip(raw, ("anchor", "candidates"), strict=True):
                _checks.check_row_norms(t_raw, t_name)
        b = x.shape[0]
        r = _radius_tensor(radius, b, x, validate)
        if mask is not None:
            mask = _check_row_mask(mask, b, x)
        # The radius' peak (a host sync) only where the overflow check reads it.
        read_peak = validate and not normalize
        r_max = float(r.detach().abs().amax()) if isinstance(r, Tensor) and read_peak else r
        _logit_range(
            [(x, "anchor", y, "candidates")],
            normalize,
            validate,
            temperature=temperature,
            radius=r_max if isinstance(r_max, float) else 0.0,
        )
        v.batch = b
        v.agree(anchor=x, candidates=y)
        v.settings(
            **_scale_setting(temperature, logit_scale),
            radius="per anchor" if isinstance(r, Tensor) and r.dim() == 1 else r,
            reduction=reduction,
            chunk_size=chunk_size,
            normalize=normalize,
            mask_given=mask is not None,
        )
    y, mask = v.ordered(y, mask)  # gathered only after the ranks' exchange
    y_all, offset = _gather(y, enabled, validate)
    m_all = None if mask is None else _gather_no_grad(mask, enabled, validate)
    r = r[None] if isinstance(r, Tensor) and r.dim() == 1 else r
    col_mask = None if m_all is None else m_all[None]
    if chunk_size is None:
        per_row = _support_vector_rows(
            (x @ y_all.T)[None],  # (1, b, N)
            _gram(y, y_all, enabled)[None],
            _distance(x, y)[None],
            r,
            temperature,
            offset,
            col_mask,
        )[0]  # (b,)
    else:
        per_row = _tiled_support_vector_rows(
            x[None],
            y_all[None],
            y[None],
            _distance(x, y)[None],
            r,
            temperature,
            offset,
            col_mask,
            chunk_size,
        )[0][0]
    batch = _batch(offset, y_all.shape[0], enabled)
    if mask is None:
        return _reduce(per_row, reduction, batch.n_global, batch).to(dtype)
    per_row = torch.where(mask, per_row, torch.zeros_like(per_row))
    count = m_all.sum().clamp_min(1) if m_all is not None else b  # all absent: loss 0
    return _reduce(per_row, reduction, count, batch).to(dtype)
