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

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _checks, _compat
from ._common import (
    _Batch,
    _batch,
    _check_pair,
    _check_row_mask,
    _diagonal_mask,
    _embeddings,
    _gather,
    _gather_no_grad,
    _logit_range,
    _narrow,
    _radius_tensor,
    _reduce,
    _refuse_trainable,
    _resolve_temperature,
    _scalar_repr,
    _scale_setting,
    _stamp,
    _temperature,
    _written_value,
    check_radius,
)
from ._docs import init_doc
from ._kernels import (
    _distance,
    _gram,
    _tiled_softmax_mean,
    _tiled_top_negatives,
    _TiledCrossEntropy,
    l2_normalize,
    widen,
)
from ._svr_monitor import _RadiusMonitor
from .distributed import counted_call, resolve_gather, validate_together

__all__ = ["RadiusPredictor", "SupportVectorRegularizer", "support_vector_term"]

RADIUS_MODES = ("static", "dynamic")
DIRECTIONS = ("bi", "uni")
# alpha and beta weigh terms of order log(B) against the base loss; 1e4 already drowns
# the base, and 1e40 overflowed the loss to inf in float32.
MAX_WEIGHT = 1e4
# The predictor reads cos/temperature, at most 1e4 in magnitude at the 1e-4 temperature
# floor; far larger rows are no similarities and overflow its first layer (float32 max
# gave NaN).
MAX_SIMILARITY = 1e6


def _check_weight(value: float, name: str) -> None:
    _checks.check_non_negative(value, name)
    if value > MAX_WEIGHT:
        raise ValueError(f"{name}: must be <= {MAX_WEIGHT:g} (a loss weight), got {value}")


def _support_vector_logits(
    sims: Tensor,
    positive_sims: Tensor,
    dist: Tensor,
    radius: Tensor | float,
    temperature: float | Tensor,
    col_mask: Tensor | None,
) -> Tensor:
    r"""The support vectors' logits from similarities, batched over ``Q`` problems.

    With :math:`c_i = R_i/d_i` the support vector's logits are
    :math:`\langle t_i + c_i(a_i - t_i), a_j\rangle / \tau = ((1 - c_i) s_{ij} + c_i g_{ij})/\tau`,
    so they come from the anchor-candidate similarities ``sims`` :math:`s_{ij}` and the
    positive-candidate similarities ``positive_sims`` :math:`g_{ij} = \langle a_i, a_j\rangle`,
    both ``(Q, b, N)``, and no ``(b, D)`` support vector is built. ``dist`` ``(Q, b)`` is
    :math:`d_i`; below the dtype's epsilon the direction is undefined and :math:`c_i = 0`
    (the InfoNCE row). ``radius`` is a scalar or ``(Q, b)``; ``col_mask`` ``(Q, N)`` marks
    present candidates (absent ones get the dtype's lowest logit).
    """
    eps = torch.finfo(dist.dtype).eps
    coef = torch.where(dist > eps, radius / dist.clamp_min(eps), torch.zeros_like(dist))
    # One dtype for lerp: under autocast the similarities are half, the radius float32.
    dtype = torch.promote_types(torch.promote_types(sims.dtype, positive_sims.dtype), coef.dtype)
    coef = coef.to(dtype)[..., None]
    logits = torch.lerp(sims.to(dtype), positive_sims.to(dtype), coef) / temperature  # (Q, b, N)
    if col_mask is not None:
        logits = logits.masked_fill(~col_mask[:, None, :], torch.finfo(logits.dtype).min)
    return logits


def _logit_rows(logits: Tensor, offset: int) -> Tensor:
    """Per-row cross-entropy ``(Q, b)`` of ``(Q, b, N)`` logits, the positive of row ``r``
    at column ``offset + r``; rows are not masked here."""
    rows = torch.arange(logits.shape[1], device=logits.device)
    return logits.logsumexp(dim=-1) - logits[:, rows, rows + offset]


def _support_vector_rows(
    sims: Tensor,
    positive_sims: Tensor,
    dist: Tensor,
    radius: Tensor | float,
    temperature: float | Tensor,
    offset: int,
    col_mask: Tensor | None,
) -> Tensor:
    """Per-row SVR cross-entropy ``(Q, b)``: :func:`_support_vector_logits` reduced."""
    logits = _support_vector_logits(sims, positive_sims, dist, radius, temperature, col_mask)
    return _logit_rows(logits, offset)


def _tiled_support_vector_rows(
    x: Tensor,
    y: Tensor,
    y_pos: Tensor,
    dist: Tensor,
    radius: Tensor | float,
    temperature: float | Tensor,
    offset: int,
    col_mask: Tensor | None,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """Per-row SVR cross-entropy ``(Q, b)`` over column tiles, and the support vectors
    ``t_sup / tau`` ``(Q, b, D)``: anchors ``x`` and their positives ``y_pos``
    ``(Q, b, D)``, candidates ``y`` ``(Q, N, D)``. The ``(b, D)`` support vector is built
    here (it is smaller than a tile) and contrasted with :class:`_TiledCrossEntropy`;
    the same maths as :func:`_support_vector_logits`."""
    eps = torch.finfo(dist.dtype).eps
    coef = torch.where(dist > eps, radius / dist.clamp_min(eps), torch.zeros_like(dist))
    support = torch.lerp(x, y_pos, coef[..., None]) / temperature  # (Q, b, D)
    rows, _ = _TiledCrossEntropy.apply(
        support, y, offset, None, None, None, col_mask, chunk_size, None, False
    )
    return rows, support


@torch.no_grad()
def _tiled_radius_slope(
    support: Tensor,
    rows: Tensor,
    x: Tensor,
    y: Tensor,
    y_pos: Tensor,
    dist: Tensor,
    col_mask: Tensor | None,
    chunk_size: int,
) -> Tensor:
    r""":func:`_radius_slope` from the tiled rows: with :math:`E_i = \sum_j P_{ij} a_j`
    (one tiled pass) the slope is :math:`\langle a_i - t_i, E_i - a_i\rangle / d_i`."""
    lse = rows + (support * y_pos).sum(-1)  # the rows' log-sum-exp
    mean = _tiled_softmax_mean(support, y, lse, col_mask, chunk_size)  # (Q, b, D)
    slope = ((y_pos - x) * (mean - y_pos)).sum(-1)
    eps = torch.finfo(dist.dtype).eps
    return torch.where(dist > eps, slope / dist.clamp_min(eps), torch.zeros_like(slope))


@torch.no_grad()
def _radius_slope(
    logits: Tensor, sims: Tensor, positive_sims: Tensor, dist: Tensor, offset: int
) -> Tensor:
    r"""Per anchor :math:`\tau\,\partial\ell_i/\partial R_i =
    \sum_j P_{ij} \langle \hat u_i, a_j - a_i\rangle` ``(Q, b)``, from the inputs and
    output of :func:`_support_vector_logits`: :math:`P` is the softmax of the support
    vector's logits and :math:`\langle \hat u_i, a_j - a_i\rangle =
    (g_{ij} - s_{ij} - g_{ii} + s_{ii})/d_i`. Positive: the SVR term pulls :math:`R`
    down. 0 where :math:`d_i` is below epsilon (the radius has no effect there)."""
    rows = torch.arange(sims.shape[1], device=sims.device)
    offsets = positive_sims - sims  # <a_i - t_i, a_j> = d_i <u_i, a_j>
    along = offsets - offsets[:, rows, rows + offset][..., None]  # d_i <u_i, a_j - a_i>
    slope = (logits.softmax(dim=-1) * along).sum(dim=-1)
    eps = torch.finfo(dist.dtype).eps
    return torch.where(dist > eps, slope / dist.clamp_min(eps), torch.zeros_like(slope))


def _upcast_half(x: object) -> Any:
    """float16/bfloat16 tensors -> float32, anything else as is: the SVR coefficient R/d
    and its gradient, which runs as R/d^2, overflow float16 for nearly aligned pairs (d
    near the dtype's epsilon), and d itself is noise unless the rows are normalised in
    float32."""
    return widen(x) if isinstance(x, Tensor) else x


def _radius_features(
    similarities: Tensor, num_features: int, offset: int = 0, col_mask: Tensor | None = None
) -> Tensor:
    """``[s_pos, negatives sorted descending]`` truncated or padded to ``num_features``.

    ``similarities`` ``(..., b, N)`` with the positive of row ``r`` at column
    ``offset + r``; ``col_mask`` ``(..., N)`` marks present candidates. Absent
    candidates and padding take the row's minimum over present candidates (positive
    included). Detached; invariant to any permutation of the negatives.
    """
    s = similarities.detach()
    b, n = s.shape[-2], s.shape[-1]
    rows = torch.arange(b, device=s.device)
    invalid = _diagonal_mask(b, n, offset, s.device)  # the positive is not a negative
    if col_mask is not None:
        invalid = invalid | ~col_mask[..., None, :]  # (..., b, N)
    s_pos = s[..., rows, rows + offset]  # (..., b)
    neg = s.masked_fill(invalid, float("-inf"))  # (..., b, N)
    k = num_features - 1
    if n - 1 >= k:
        top = neg.topk(k, dim=-1).values  # sorted descending
    else:
        top = neg.sort(dim=-1, descending=True).values[..., : n - 1]
        pad = top.new_full((*top.shape[:-1], k - (n - 1)), float("-inf"))
        top = torch.cat([top, pad], dim=-1)
    row_min = torch.minimum(s.masked_fill(invalid, float("inf")).amin(dim=-1), s_pos)
    return _assemble_features(s_pos, top, row_min)


def _assemble_features(s_pos: Tensor, top: Tensor, row_min: Tensor) -> Tensor:
    """``[s_pos, top]`` ``(..., b, F)`` with the empty slots of ``top`` (``-inf``: absent
    candidates, fewer than ``F - 1`` negatives) set to the row minimum ``row_min``."""
    top = torch.where(torch.isinf(top), row_min[..., None], top)
    return torch.cat([s_pos[..., None], top], dim=-1)


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


def _check_similarity_peak(s: Tensor) -> None:
    """Finite similarities of magnitude at most ``MAX_SIMILARITY`` (one host sync)."""
    peak = float(s.detach().abs().amax()) if s.numel() else 0.0  # NaN if any is NaN
    if not peak <= MAX_SIMILARITY:  # one host sync for NaN, Inf and the bound
        _checks.check_finite(s, "similarities")
        raise ValueError(
            f"similarities: |value| up to {peak:.3g} exceeds {MAX_SIMILARITY:g}; the "
            "predictor reads cos/temperature, at most 1e4 at the temperature floor"
        )


@init_doc
class RadiusPredictor(nn.Module):
    r"""The dynamic semantic radius of SupCLAP: a 3-layer MLP from an anchor's similarity
    row to its radius :math:`R_i`.

    The row is made fixed-size and permutation-invariant before the MLP:

    .. math::

        f_i = \big[s_{ii},\ s_{i\pi(1)}, \dots, s_{i\pi(F-1)}\big], \qquad
        R_i = W_3\,\mathrm{ReLU}(W_2\,\mathrm{ReLU}(W_1 f_i + b_1) + b_2) + b_3,

    with :math:`s_{ij}` the anchor's similarity row as given — the regulariser passes
    SupCLAP's :math:`s_{ij} = \cos(x_i, y_j)/\tau` (Sec. 3.2) —
    :math:`s_{ii}` the positive and :math:`\pi` the negatives sorted in descending order,
    truncated to :math:`F - 1` or padded with the row's minimum similarity — so any batch
    size :math:`N \ge 2` works and the order of the negatives does not matter. The row is
    detached: the predictor learns only through the SVR and constraint terms, and the
    embeddings' gradient is the one of :func:`~contrastive_losses.functional.support_vector_term`
    at the predicted :math:`R`. The output is unconstrained (the regulariser's constraint
    term penalises :math:`R < 0`). The last layer starts at zero weight and bias
    ``radius_init``, so every anchor starts at the same radius. NaN or Inf similarities,
    or any above ``1e6`` in magnitude (cos/τ is at most ``1e4`` at the temperature floor),
    raise a ``ValueError``.

    Args:
        num_features: :math:`F \ge 2`, the positive plus :math:`F - 1` negatives.
        hidden: width of the two hidden layers.
        radius_init: the initial radius (bias of the last layer).
        validate_args: the value check of the similarities (NaN/Inf, the bound; a host
            sync) on, off or ``None`` (the global default,
            :func:`contrastive_losses.set_default_validate_args`).

    Shape:
        ``forward(similarities (..., B, N), offset=0, mask=(..., N))`` -> ``(..., B)``; the
        positive of row ``r`` is column ``offset + r``.

    Example:
        >>> import torch
        >>> from contrastive_losses import RadiusPredictor
        >>> predictor = RadiusPredictor(num_features=8, radius_init=0.1)
        >>> sims = torch.randn(5, 5).clamp(-1, 1)
        >>> predictor(sims)
        tensor([0.1000, 0.1000, 0.1000, 0.1000, 0.1000], grad_fn=<SqueezeBackward1>)
    """

    def __init__(
        self,
        num_features: int = 32,
        hidden: int = 64,
        radius_init: float = 0.1,
        *,
        validate_args: bool | None = None,
    ) -> None:
        super().__init__()
        self.num_features = _checks.check_int(num_features, "num_features", 2)
        _checks.resolve_validate(validate_args)  # the type
        self.validate_args = validate_args
        self.hidden = _checks.check_int(hidden, "hidden", 1)
        _checks.check_non_negative(radius_init, "radius_init")
        last = nn.Linear(hidden, 1)
        nn.init.zeros_(last.weight)
        nn.init.constant_(last.bias, float(radius_init))
        self.mlp = nn.Sequential(
            nn.Linear(num_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), last
        )

    def features(self, similarities: Tensor, offset: int = 0, mask: Tensor | None = None) -> Tensor:
        """The detached ``(..., B, num_features)`` input rows ``[s_pos, sorted negatives]``."""
        return self._features(
            similarities, offset, mask, _checks.resolve_validate(self.validate_args)
        )

    def _features(
        self, similarities: Tensor, offset: int, mask: Tensor | None, validate: bool
    ) -> Tensor:
        """:meth:`features`, the value check of the similarities with ``validate`` only."""
        s = _checks.check_tensor(similarities, "similarities")
        _checks.check_float(s, "similarities")
        _checks.check_materialised(s, "similarities")
        if s.dim() < 2:
            raise ValueError(
                f"similarities: expected shape (..., B, N), got shape {_checks.shape_of(s)}"
            )
        b, n = s.shape[-2], s.shape[-1]
        if n < 2:
            raise ValueError(f"similarities: need N >= 2 candidates (a negative), got N={n}")
        if validate:
            _check_similarity_peak(s)
        _checks.check_int(offset, "offset", 0)
        if offset == 0 and b > n:
            raise ValueError(
                f"similarities: shape {_checks.shape_of(s)} has B = {b} rows but N = {n} columns; "
                "the positive of row r is column offset + r, so each of the B anchors needs "
                "its row against N >= B candidates (its positive among them)"
            )
        if offset + b > n:
            raise ValueError(
                f"offset: rows {offset}..{offset + b - 1} exceed the {n} columns of "
                f"similarities (shape {_checks.shape_of(s)}); the positive of row r is column "
                "offset + r"
            )
        if mask is not None:
            mask = _checks.check_tensor(mask, "mask")
            if tuple(mask.shape) != (*s.shape[:-2], n):
                raise ValueError(
                    f"mask: expected shape {_checks.shape_of(s.sum(dim=-2))}, got "
                    f"{_checks.shape_of(mask)}"
                )
            if mask.dtype != torch.bool:
                raise TypeError(f"mask: expected a bool tensor, got dtype {mask.dtype}")
            if mask.device != s.device:
                raise ValueError(
                    f"mask: on device {mask.device} but similarities are on {s.device}"
                )
        return _radius_features(s, self.num_features, offset, mask)

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}, validate_args={self.validate_args}"

    def forward(self, similarities: Tensor, offset: int = 0, mask: Tensor | None = None) -> Tensor:
        r"""The radius of every row.

        Args:
            similarities: the anchors' similarity rows ``(..., B, N)``, ``N >= 2`` (the
                regulariser passes :math:`\cos/\tau`).
            offset: the column of row ``r``'s positive is ``offset + r`` (a rank's rows
                against the gathered batch).
            mask: optional bool ``(..., N)``, ``True`` at present candidates.

        Returns:
            The radii ``(..., B)``, unconstrained.
        """
        return self._from_features(self.features(similarities, offset, mask))

    def _from_features(self, f: Tensor) -> Tensor:
        """The radii ``(..., B)`` from feature rows ``(..., B, num_features)``."""
        dtype = next(self.parameters()).dtype
        return self.mlp(f.to(dtype)).squeeze(-1).to(f.dtype)


# Settings of the base losses, which the regulariser takes from its base: passed to the
# regulariser they are refused with a TypeError that shows where they go.
BASE_SETTINGS = (
    "chunk_size",
    "reduction",
    "normalize",
    "gather",
    "learnable_temperature",
    "max_logit_scale",
    "negatives",
    "english_index",
    "scale_init",
    "bias_init",
    "learnable",
)


def _refuse_base_settings(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``SupportVectorRegularizer.__init__``: a base loss' setting given to the
    regulariser raises a ``TypeError`` naming the base's call it belongs in (the signature
    shown by ``help`` and ``inspect`` stays the wrapped one)."""

    @functools.wraps(init)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        misplaced = [k for k in kwargs if k in BASE_SETTINGS]
        if misplaced:
            base = args[0] if args else kwargs.get("base")
            name = type(base).__name__ if isinstance(base, nn.Module) else "InfoNCELoss"
            given = ", ".join(f"{k}={kwargs[k]!r}" for k in misplaced)
            raise TypeError(
                f"{', '.join(misplaced)}: {'belongs' if len(misplaced) == 1 else 'belong'} "
                f"to the base loss, not the regulariser: SupportVectorRegularizer({name}"
                f"({given})); the regulariser follows its base's settings"
            )
        init(self, *args, **kwargs)

    return wrapper


def _check_regularizer_settings(
    base: object,
    direction: str,
    alpha: float,
    beta: float,
    constraint: object,
    radius_init: float,
    temperature: float | None,
    validate_args: bool | None,
) -> None:
    """The argument checks of :class:`SupportVectorRegularizer`'s ``__init__`` (its radius
    is checked where it is stored)."""
    _checks.resolve_validate(validate_args)  # the type
    if not isinstance(base, nn.Module) or not callable(getattr(base, "contrastive_pairs", None)):
        raise TypeError(
            "base: expected a loss Module exposing contrastive_pairs(...) (InfoNCELoss, "
            f"SigLIPLoss, KCLLoss, CACLLoss), got {type(base).__name__}"
        )
    if temperature is None and not hasattr(base, "temperature"):
        raise TypeError(
            f"base: {type(base).__name__} has no temperature property; pass temperature="
        )
    _refuse_trainable(temperature, "temperature", "learnable_temperature=True on the base")
    if temperature is not None:
        _temperature(temperature)
    _check_base_reduction(base)
    _checks.check_choice(direction, "direction", DIRECTIONS)
    _check_weight(alpha, "alpha")
    _check_weight(beta, "beta")
    _checks.check_non_negative(radius_init, "radius_init")
    check_radius(radius_init, "radius_init")
    if constraint is not None and not isinstance(constraint, bool):
        raise TypeError(f"constraint: expected None, True or False, got {constraint!r}")


@init_doc
class SupportVectorRegularizer(_RadiusMonitor, nn.Module):
    r"""SupCLAP's support vector regularisation around any loss of this library.

    .. math::

        \begin{aligned}
        \mathcal{L} &= \mathcal{L}_{base}
            + \alpha\,\mathcal{L}_{svr} + \beta\,\mathcal{L}_{con}, \qquad
        \mathcal{L}_{svr} = \tfrac12 \textstyle\sum_{d} \mathcal{L}_{svr}^{d}, \\
        \mathcal{L}_{con} &= \tfrac12 \textstyle\sum_{d} \operatorname{mean}_i\big(
            \mathrm{ReLU}(R_i - \lVert a_i - t_i\rVert) + \mathrm{ReLU}(-R_i)\big),
        \end{aligned}

    where :math:`d` runs over the directions used (text anchors for
    ``direction="uni"``; text and audio anchors for ``"bi"``) and
    :math:`\mathcal{L}_{svr}^{d}` is
    :func:`~contrastive_losses.functional.support_vector_term` on every
    ``(audio, text)`` pair the base contrasts (its ``contrastive_pairs``: one for
    InfoNCE and SigLIP, one per language for KCL with absent captions masked, three for
    CACL), the mean over all present anchors of all pairs (for KCL the same weighting
    as the base). SupCLAP's Eq. 5-6 *sum* the two InfoNCE directions and add
    :math:`\alpha` times each SVR direction; our bases are the *mean* of the two
    directions, so the :math:`\tfrac12` makes this loss exactly half the paper's for
    ``uni`` and ``bi`` alike: ``alpha`` and ``beta`` are the paper's :math:`\alpha`
    and :math:`\beta`. :math:`\lVert a_i - t_i\rVert` is detached in the
    constraint: it trains the radius and never pushes a positive pair apart.

    Radius: ``"static"`` — one learnable scalar shared by both directions;
    ``"dynamic"`` — a :class:`RadiusPredictor` per anchor (shared by both directions);
    a float — fixed. The predictor reads the anchor's row of :math:`\cos/\tau` (SupCLAP
    Sec. 3.2). The SVR logits use the base's ``temperature`` (SigLIP: ``1/scale``), or
    ``1/logit_scale`` when the model's scale is passed per call (``forward(...,
    logit_scale=s)``, which the base also gets), unless ``temperature`` is given,
    *detached*: a learnable temperature (or SigLIP's scale and bias, or the model's scale)
    learns from the base loss alone, as with the fixed :math:`\tau` of the papers.
    float16/bfloat16 embeddings run the SVR in float32 (its :math:`R/d` overflows float16
    for nearly aligned pairs). ``normalize`` and ``gather`` follow the
    base; under ``gather`` the anchors are this rank's rows against the global batch,
    scaled like the base so the mean over ranks is the single-process loss. A base whose
    forward draws randomness (CACL without ``other``) exposes ``resolve_inputs``; it is
    called once so the base loss and the SVR see the same draw.

    Where the radius goes: from :math:`t^{sup} = t + R\hat u`, one anchor's SVR row has

    .. math::

        \begin{aligned}
        \frac{\partial \ell}{\partial R}
        &= \frac{1}{\tau}\sum_j P_j \langle \hat u, a_j - a^+\rangle \\
        &= -\frac{1}{\tau d}\sum_{j \ne +} P_j \langle a^+ - t,\ a^+ - a_j\rangle,
        \qquad d = \lVert a^+ - t\rVert,
        \end{aligned}

    with :math:`P` the softmax at the support vector; the row is convex in :math:`R`.
    :math:`\langle a^+ - t, a^+ - a_j\rangle = (1 - \langle a^+, a_j\rangle) -
    (\langle t, a^+\rangle - \langle t, a_j\rangle)`: the SVR term pushes :math:`R`
    *down* when the text separates its clip from the hard negatives better than the
    audio does (typical when fine-tuning from pretrained weights, SupCLAP Fig. 3) and
    *up* otherwise (random weights, noisy embeddings, SupCLAP Fig. 6), up to where the
    constraint holds it. ``terms["svr_radius_slope"]`` logs the batch mean of
    :math:`\tau\,\partial\ell/\partial R = \sum_j P_j\langle \hat u, a_j - a^+\rangle`
    (positive: the SVR pulls the radius down). Watch ``radius_over_distance``: where
    :math:`R_i > \lVert a_i - t_i\rVert` the perpendicular pushes are reversed rather
    than damped. In ``benchmarks/studies/svr.py`` (random initialisation) the dynamic
    radius with ``beta=0.01`` (the paper's) ended above the distance for nearly every
    anchor; ``beta=1`` (the default here) kept it below for about 90%.

    Three warnings, once each, in training mode, at the user's line; "steps" are
    ``torch.optim`` optimizer steps (gradient accumulation counts one per
    ``optimizer.step()``): the radius got gradients before :attr:`stuck_after` optimizer
    steps that did not hold its parameters and never changed (checked from autograd's and
    the optimizer's side, so under ``torch.compile`` too); ``radius_over_distance``
    stayed above 0.5 for a streak of steps at least :attr:`over_distance_steps` long and
    at least :attr:`over_distance_share` of the steps so far (eager only); and
    a regulariser built while an earlier one of the same shape, whose radius got
    gradients but was in no optimizer, is alive (built inside the training loop).

    Args:
        base: a loss Module with ``contrastive_pairs`` (:class:`~contrastive_losses.InfoNCELoss`,
            :class:`~contrastive_losses.SigLIPLoss`, :class:`~contrastive_losses.KCLLoss`,
            :class:`~contrastive_losses.CACLLoss`) and ``reduction="mean"``.
        radius: ``"static"``, ``"dynamic"`` (default) or a fixed float in ``[0, 1e4]``.
        direction: ``"bi"`` (default) or ``"uni"`` (text anchors only).
        alpha: weight of the SVR term, the paper's :math:`\alpha` (default 1.0), in
            ``[0, 1e4]``.
        beta: weight of the constraint term, the paper's :math:`\beta`, in ``[0, 1e4]``.
            Default 1.0, not the paper's 0.01 (SupCLAP App. B, Eq. 9): with 0.01 the
            dynamic radius ended above :math:`\lVert a - t\rVert` for 81-100% of anchors
            in every study of this project, the failure the term is there to prevent;
            1.0 kept it to 5-25% at no cost in R@1 (the SVR page of the docs, "Why
            beta = 1"). Pass ``beta=0.01`` to reproduce the paper.
        constraint: add the constraint term; ``None`` means on for ``"dynamic"`` only.
        radius_init: initial radius, static or dynamic (default 0.1), in ``[0, 1e4]``.
        num_features: predictor input size (positive + negatives), ``>= 2``.
        hidden: predictor hidden width.
        temperature: fixed SVR temperature overriding the base's, :math:`\tau \ge 10^{-4}`.
        validate_args: the regulariser's value checks (NaN/Inf and zero embeddings, the
            predictor's similarities) and the two training warnings above (each a host
            sync) on, off or ``None`` (the global default,
            :func:`contrastive_losses.set_default_validate_args`). The base keeps its own
            ``validate_args``: turn both off, or use the global default, for a step
            with no host sync.

    Shape:
        ``forward(*base_args, return_terms=False, **base_kwargs)`` takes exactly the
        base's arguments (e.g. audio ``(B, D)``, text ``(B, K, D)``, mask ``(B, K)`` for
        KCL) and returns a scalar; ``return_terms`` adds the base's terms and ``base``,
        ``svr``, ``constraint``, ``radius_mean``/``std``/``min``/``max`` and
        ``radius_over_distance``, the share of anchors with :math:`R_i > \lVert a_i -
        t_i\rVert` (their perpendicular pushes are reversed, not damped), and
        ``svr_radius_slope``, the mean of :math:`\tau\,\partial\ell_i/\partial R_i`
        (above), all over this rank's present anchors of every direction.

    Example:
        >>> import torch
        >>> from contrastive_losses import KCLLoss, SupportVectorRegularizer
        >>> loss_fn = SupportVectorRegularizer(KCLLoss(temperature=0.07), radius="dynamic")
        >>> audio, text = torch.randn(8, 32), torch.randn(8, 3, 32)
        >>> loss, terms = loss_fn(audio, text, return_terms=True)
        >>> loss.backward()
        >>> round(terms["radius_mean"].item(), 4)
        0.1
    """

    @_refuse_base_settings
    def __init__(
        self,
        base: nn.Module,
        radius: str | float = "dynamic",
        direction: str = "bi",
        alpha: float = 1.0,
        beta: float = 1.0,
        constraint: bool | None = None,
        radius_init: float = 0.1,
        num_features: int = 32,
        hidden: int = 64,
        temperature: float | None = None,
        *,
        validate_args: bool | None = None,
    ) -> None:
        super().__init__()
        _check_regularizer_settings(
            base, direction, alpha, beta, constraint, radius_init, temperature, validate_args
        )
        self.base = base
        self.direction = direction
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.svr_temperature = None if temperature is None else float(temperature)
        self.radius_init = float(radius_init)
        self.predictor: RadiusPredictor | None = None
        if isinstance(radius, str):
            _checks.check_choice(radius, "radius", RADIUS_MODES)
            self.radius_mode = radius
            if radius == "static":
                self.radius = nn.Parameter(torch.tensor(float(radius_init)))
            else:
                self.predictor = RadiusPredictor(
                    num_features, hidden, radius_init, validate_args=validate_args
                )
        elif isinstance(radius, (int, float)) and not isinstance(radius, bool):
            _checks.check_non_negative(radius, "radius")
            check_radius(radius)
            self.radius_mode = "fixed"
            self.register_buffer("radius", torch.tensor(float(radius)))
            self._radius_value = float(radius)  # used, exact: see _scalar_radius
            self._radius_stamp = _stamp(self.radius)
        else:
            raise TypeError(
                f"radius: expected 'static', 'dynamic' or a float, got {type(radius).__name__}"
            )
        self.constraint = self.radius_mode == "dynamic" if constraint is None else constraint
        self.validate_args = validate_args
        self._reset_monitor()

    def extra_repr(self) -> str:
        """The radius (mode, and its value unless predicted), the direction, the weights,
        the SVR temperature override and ``validate_args``; the base and the predictor
        print as children."""
        radius = f"radius={self.radius_mode!r}"
        if self.predictor is None:
            radius += f" ({_scalar_repr(_scalar_radius(self, self.radius))})"
        temperature = "None (the base's)" if self.svr_temperature is None else self.svr_temperature
        return (
            f"{radius}, direction={self.direction!r}, alpha={self.alpha}, beta={self.beta}, "
            f"constraint={self.constraint}, temperature={temperature}, "
            f"validate_args={self.validate_args}"
        )

    @property
    def temperature(self) -> Tensor | float:
        """The SVR temperature, i.e. the override, else the base's current ``temperature``."""
        if self.svr_temperature is not None:
            return self.svr_temperature
        return cast(Tensor, self.base.temperature)

    @counted_call
    @_compat.autocast_off
    def forward(
        self,
        *args: Any,
        logit_scale: Tensor | None = None,
        logit_bias: Tensor | None = None,
        return_terms: bool = False,
        **kwargs: Any,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        r"""The base loss plus the SVR and constraint terms, on one batch.

        Args:
            *args: the base's positional arguments: audio ``(B, D)`` and text ``(B, D)``
                (InfoNCE, SigLIP; ``ids`` ``(B,)``), text ``(B, K, D)`` (KCL; ``mask``
                ``(B, K)``), or CACL's triplet or ``(audio, text, other_index)``.
            logit_scale: the model's exp'd scale :math:`1/\tau`, a 0-d tensor: passed to
                the base (which then refuses a learnable temperature of its own) and, detached,
                the SVR temperature and the predictor's :math:`\cos/\tau` (unless this
                regulariser has its own ``temperature``).
            logit_bias: the model's SigLIP bias, a 0-d tensor, passed to a SigLIP base.
            return_terms: also return the detached terms: the base's, and ``base``,
                ``svr``, ``constraint``, ``radius_mean``/``std``/``min``/``max``,
                ``radius_over_distance`` and ``svr_radius_slope`` (see the class).
            **kwargs: the base's keyword arguments (``ids``, ``mask``, ``generator``...).

        Returns:
            The scalar loss, or ``(loss, terms)``.
        """
        _check_base_reduction(self.base)
        resolve = getattr(self.base, "resolve_inputs", None)
        if callable(resolve):
            args, kwargs = resolve(*args, **kwargs)
        model_scale = {"logit_scale": logit_scale} if logit_scale is not None else {}
        if logit_bias is not None:
            model_scale["logit_bias"] = logit_bias
        terms: dict[str, Tensor] = {}
        if return_terms:
            base_loss, terms = self.base(*args, return_terms=True, **model_scale, **kwargs)
        else:
            base_loss = self.base(*args, **model_scale, **kwargs)
        pairs = cast(Callable[..., list[Any]], self.base.contrastive_pairs)(*args, **kwargs)
        validate = _checks.resolve_validate(self.validate_args)
        _compat.check_compile_supported(_compat.MIN_TORCH_COMPILE_SVR, "SupportVectorRegularizer")
        temperature = _detached_temperature(self, logit_scale)
        # in float32 as documented, also under torch.autocast (open_clip's trainer calls
        # its loss inside one), which would run the SVR's matmuls and predictor in float16
        with torch.autocast(base_loss.device.type, enabled=False):
            svr, constraint, radius_terms, over = self._regularise(
                pairs, temperature, return_terms, validate
            )
        # summed in float32 for a half-precision base (svr is float32): two finite halves
        # can overflow where their sum fits
        loss = widen(base_loss) + self.alpha * svr
        if self.constraint:
            loss = loss + self.beta * constraint
        loss = _narrow(loss, base_loss.dtype)
        self._rearm_watch()
        if validate and self.training and torch.is_grad_enabled():
            self._monitor(over)
        if not return_terms:
            return loss
        terms = dict(terms)
        terms.update(
            base=base_loss.detach(),
            svr=svr.detach(),
            constraint=constraint.detach(),
            **cast(dict[str, Tensor], radius_terms),
            radius_over_distance=over,
        )
        return loss, terms

    # ------------------------------------------------------------------ training checks
    # (the checks themselves: _svr_monitor._RadiusMonitor)

    #: Optimizer steps, each after a gradient in training mode, that do not hold the
    #: radius' parameters, after which a radius that never moved from its value at its
    #: first gradient is reported; eager and compiled alike.
    stuck_after: int = 50
    #: The shortest streak of consecutive optimizer steps, each with
    #: ``radius_over_distance > 0.5`` in every training batch, that is reported...
    over_distance_steps: int = 20
    #: ...when it also covers this share of the optimizer steps since training began (a
    #: threshold that grows with the run).
    over_distance_share: float = 0.25
    #: The streak is read (one device sync) once every this many optimizer steps.
    over_distance_check_every: int = 10

    # ------------------------------------------------------------------ internals

    def _regularise(
        self,
        pairs: list[Any],
        temperature: Tensor | float | None = None,
        with_terms: bool = False,
        validate: bool = True,
    ) -> tuple[Tensor, Tensor, dict[str, Tensor] | None, Tensor]:
        """SVR and constraint terms (per-direction means over every present anchor, summed
        over the directions and halved), with ``with_terms`` the radius terms (the radii's
        mean, std, min and max and the mean of ``tau * d(row)/dR`` over the present
        anchors), and the share of anchors whose radius exceeds ``||a - t||`` (their
        perpendicular pushes change sign). ``temperature``: the SVR's, detached (``None``:
        the override or the base's); ``validate``: the value checks (host syncs).

        Matmuls run per pair (and per distinct tensor for the positive-candidate Gram
        matrices, e.g. KCL's audio once for all languages); everything after them runs
        batched over the ``Q = P`` (uni) or ``2P`` (bi) anchor/candidate problems on
        ``(Q, b, N)`` similarity tensors.
        """
        if temperature is None:
            temperature = _detached_temperature(self)
        normalize = bool(getattr(self.base, "normalize", True))
        enabled = resolve_gather(getattr(self.base, "gather", None))
        chunk_size = getattr(self.base, "chunk_size", None)
        predictor = self.predictor
        settings = {  # must match across ranks (the base's are checked by the base)
            "radius": self.radius_mode,
            # A fixed radius' value (a buffer) and a static one's (a parameter that DDP
            # keeps equal); a dynamic radius' initial value and the predictor's sizes.
            "radius value": _scalar_radius(self, self.radius) if predictor is None else None,
            "radius_init": None if self.radius_mode == "fixed" else self.radius_init,
            "num_features": None if predictor is None else predictor.num_features,
            "hidden": None if predictor is None else predictor.hidden,
            # Outside DDP the ranks' predictors drift apart, as a temperature would
            "predictor checksum": (
                _checksum(predictor) if predictor is not None and enabled and validate else None
            ),
            "direction": self.direction,
            "alpha": self.alpha,
            "beta": self.beta,
            "constraint": self.constraint,
            "temperature": temperature,  # the model's 1/logit_scale when given
            "chunk_size": chunk_size,
            "normalize": normalize,
        }
        local, glob, keys, b, offset = _prepare_pairs(
            pairs, normalize, enabled, validate, settings, self.validate_args
        )
        if chunk_size is not None:
            return self._regularise_tiled(
                pairs,
                local,
                glob,
                keys,
                b,
                offset,
                enabled,
                temperature,
                with_terms,
                chunk_size,
                validate,
            )
        sims, pos_sims, dist = _pair_similarities(local, glob, keys, self.direction, enabled)
        row_mask, col_mask = _pair_masks(pairs, b, sims, enabled, validate)
        if self.predictor is None:
            radius = _scalar_radius(self, sims)  # ()
        else:  # SupCLAP's s = cos / tau, detached inside the predictor
            features = self.predictor._features(sims / temperature, offset, col_mask, validate)
            radius = self.predictor._from_features(features)  # (Q, b)
        logits = _support_vector_logits(sims, pos_sims, dist, radius, temperature, col_mask)
        rows = _logit_rows(logits, offset)  # (Q, b)
        slope = _radius_slope(logits, sims, pos_sims, dist, offset) if with_terms else None
        con = F.relu(radius - dist.detach()) + F.relu(-radius)  # (Q, b), or () if static
        batch = _batch(offset, sims.shape[-1], enabled)
        return _anchor_means(
            rows, con, radius, dist, slope, row_mask, col_mask, batch, self.direction
        )

    def _regularise_tiled(
        self,
        pairs: list[Any],
        local: dict[int, Tensor],
        glob: dict[int, Tensor],
        keys: list[tuple[int, int]],
        b: int,
        offset: int,
        enabled: bool,
        temperature: Tensor | float,
        with_terms: bool,
        chunk_size: int,
        validate: bool,
    ) -> tuple[Tensor, Tensor, dict[str, Tensor] | None, Tensor]:
        """:meth:`_regularise` over column tiles (the base's ``chunk_size``): no
        ``(Q, b, N)`` similarities; the predictor's top negatives come from a running
        top-k over the tiles."""
        x, y, y_pos = _pair_problems(local, glob, keys, self.direction)
        dist = _distance(x, y_pos)  # (Q, b)
        row_mask, col_mask = _pair_masks(pairs, b, x, enabled, validate)
        if self.predictor is None:
            radius = _scalar_radius(self, x)  # ()
        else:  # SupCLAP's s = cos / tau, from the running top-k of every tile
            k = self.predictor.num_features - 1
            parts = _tiled_top_negatives(x, y, k, offset, col_mask, chunk_size)
            features = _assemble_features(*(p / temperature for p in parts))
            if validate:
                _check_similarity_peak(features)
            radius = self.predictor._from_features(features)  # (Q, b)
        rows, support = _tiled_support_vector_rows(
            x, y, y_pos, dist, radius, temperature, offset, col_mask, chunk_size
        )
        slope = None
        if with_terms:
            slope = _tiled_radius_slope(support, rows, x, y, y_pos, dist, col_mask, chunk_size)
        con = F.relu(radius - dist.detach()) + F.relu(-radius)  # (Q, b), or () if static
        batch = _batch(offset, y.shape[1], enabled)
        return _anchor_means(
            rows, con, radius, dist, slope, row_mask, col_mask, batch, self.direction
        )


def _detached_temperature(
    svr: SupportVectorRegularizer, logit_scale: Tensor | None = None
) -> Tensor | float:
    """The SVR temperature: the override, else ``1/logit_scale`` (the model's), else the
    base's (a fixed one as the Python float it was given, exact in float64, as the base
    uses it); detached, so a learnable one learns from the base only."""
    if svr.svr_temperature is None and logit_scale is not None:
        return 1.0 / logit_scale.detach()
    fixed = getattr(svr.base, "_fixed_value", None)
    if svr.svr_temperature is None and callable(fixed) and not svr.base.learnable_temperature:
        return cast(float, fixed())
    temperature = svr.temperature
    return temperature.detach() if isinstance(temperature, Tensor) else temperature


def _scalar_radius(svr: SupportVectorRegularizer, like: Tensor) -> Tensor:
    """The static radius (a parameter) in ``like``'s dtype, or the fixed one exact: the
    Python float it was given (its float32 buffer holds 0.2 as 0.2000000030), unless
    another value was written into the buffer (``load_state_dict``, ``fill_``)."""
    buffer = cast(Tensor, svr.radius)
    if svr.radius_mode != "fixed":
        return buffer.to(like.dtype)
    kept = getattr(svr, "_radius_value", None)
    if kept is None:  # pickled before the float was kept
        kept = svr._radius_value = float(buffer)
        svr._radius_stamp = _stamp(buffer)
    elif not _compat.is_compiling() and _stamp(buffer) != svr._radius_stamp:
        written = _written_value(buffer, kept)
        svr._radius_value = kept = kept if written is None else written
        svr._radius_stamp = _stamp(buffer)
    return like.new_full((), kept)


def _checksum(predictor: RadiusPredictor) -> Tensor:
    """A cheap fingerprint of the predictor's weights: their sum, each weighted by its
    position (a swap of two weights changes it too), in float64 on their device; read
    once, with the other settings, where the ranks check together."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).double() for p in predictor.parameters()])
        weights = torch.arange(1, flat.numel() + 1, dtype=flat.dtype, device=flat.device)
        return (flat * weights).sum() / flat.numel()


def _prepare_pairs(
    pairs: list[Any],
    normalize: bool,
    enabled: bool,
    validate: bool = True,
    settings: dict[str, Any] | None = None,
    requested: bool | None = False,
) -> tuple[dict[int, Tensor], dict[int, Tensor], list[tuple[int, int]], int, int]:
    """The pairs' tensors checked, upcast from half precision and normalised once each
    (key of the raw tensor ``->`` local rows ``(b, D)``), gathered (``->`` global rows
    ``(N, D)``), the ``(audio, text)`` keys of every pair, ``b`` and this rank's offset.
    ``settings`` must match across ranks (checked with the inputs under gather; under
    ``torch.compile`` only when ``requested``, the caller's ``validate_args``)."""
    local: dict[int, Tensor] = {}  # key of the raw tensor -> normalised local rows
    glob: dict[int, Tensor] = {}  # key of the raw tensor -> gathered rows (N, D)
    raw: list[Tensor] = []  # the distinct raw tensors, in order of first use

    def prepare(x: Tensor, name: str, mask: Tensor | None = None) -> int:
        # The key is the position among the distinct tensors, found by identity (``is``):
        # not ``id(x)``, which torch.compile guards on the input object itself, so every
        # step's fresh embeddings would invalidate the compiled graph (a recompile a step).
        key = next((i for i, r in enumerate(raw) if r is x), len(raw))
        if key == len(raw):
            raw.append(x)
            if x.dim() != 2:
                raise ValueError(
                    "base: contrastive_pairs must give (B, D) tensors, got shape "
                    f"{_checks.shape_of(x)}"
                )
            x = _upcast_half(x)  # float32 inside, as support_vector_term
            if normalize:  # masked rows may be zero padding, as in the base (KCL)
                norms = _checks.check_row_norms(x, name, mask=mask, validate=validate)
                x = l2_normalize(x, norms)
            local[key] = x
        return key

    # Every check before the first collective, and together: a rank failing alone
    # raises on every rank instead of leaving the others in the gather.
    first = pairs[0].audio if pairs else None
    with validate_together(enabled, first, validate=validate, requested=requested) as v:
        if len(pairs) == 0:
            raise ValueError("base: contrastive_pairs returned no pairs")
        # The mask marks absent captions: text rows only (one audio serves every language).
        keys = [(prepare(p.audio, "audio"), prepare(p.text, "text", p.mask)) for p in pairs]
        shapes = {tuple(x.shape) for x in local.values()}
        if len(shapes) != 1:
            raise ValueError(
                f"base: contrastive_pairs gave tensors of shapes {sorted(shapes)}; every "
                "pair needs (B, D) audio and text of one shape"
            )
        b = next(iter(local.values())).shape[0]
        v.batch = b
        v.agree(audio=local[keys[0][0]], text=local[keys[0][1]])
        v.settings(**(settings or {}))
    local.update(zip(local, v.ordered(*local.values()), strict=True))  # after the exchange
    offset = 0
    for key, x in local.items():  # the same order on every rank
        glob[key], offset = _gather(x, enabled, validate)
    return local, glob, keys, b, offset


def _stack(xs: list[Tensor]) -> Tensor:
    return xs[0].unsqueeze(0) if len(xs) == 1 else torch.stack(xs)


def _pair_problems(
    local: dict[int, Tensor], glob: dict[int, Tensor], keys: list[tuple[int, int]], direction: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Anchors and their positives ``(Q, b, D)`` and candidates ``(Q, N, D)``: text
    anchors against the audio for every pair, then (``"bi"``) audio anchors against the
    text. A tensor shared by every problem (KCL's audio) is expanded, not copied."""
    triples = [(local[t], glob[a], local[a]) for a, t in keys]
    if direction == "bi":
        triples += [(local[a], glob[t], local[t]) for a, t in keys]

    def stack(xs: list[Tensor]) -> Tensor:
        if all(x is xs[0] for x in xs):
            return xs[0].expand(len(xs), *xs[0].shape)
        return torch.stack(xs)

    x, y, y_pos = zip(*triples, strict=True)
    return stack(list(x)), stack(list(y)), stack(list(y_pos))


def _pair_similarities(
    local: dict[int, Tensor],
    glob: dict[int, Tensor],
    keys: list[tuple[int, int]],
    direction: str,
    enabled: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Anchor-candidate similarities ``s`` and positive-candidate similarities ``g``
    ``(Q, b, N)``, and the anchor-positive distances ``(Q, b)``: text anchors against the
    audio for every pair, then (``"bi"``) audio anchors against the text."""
    grams: dict[int, Tensor] = {}  # key of the raw tensor -> local @ gathered.T (b, N)

    def gram(key: int) -> Tensor:
        if key not in grams:
            grams[key] = _gram(local[key], glob[key], enabled)
        return grams[key]

    # text anchors against the audio: s_ij = <t_i, a_j>, g_ij = <a_i, a_j>
    sims = _stack([local[t] @ glob[a].T for a, t in keys])  # (P, b, N)
    pos_sims = _stack([gram(a) for a, _ in keys])  # (P, b, N)
    dist = _stack([_distance(local[t], local[a]) for a, t in keys])  # (P, b)
    if direction == "bi":  # audio anchors against the text
        if enabled:
            mirror = _stack([local[a] @ glob[t].T for a, t in keys])
        else:
            mirror = sims.transpose(1, 2)  # <a_i, t_j> = <t_j, a_i>
        sims = torch.cat([sims, mirror])  # (2P, b, N)
        pos_sims = torch.cat([pos_sims, _stack([gram(t) for _, t in keys])])
        dist = torch.cat([dist, dist])
    return sims, pos_sims, dist


def _pair_masks(
    pairs: list[Any], b: int, like: Tensor, enabled: bool, validate: bool = True
) -> tuple[Tensor | None, Tensor | None]:
    """Present anchors ``(Q, b)`` and present candidates ``(Q, N)`` from the pairs'
    masks (absent captions), or ``(None, None)`` when no pair has a mask; ``like`` is
    any ``(Q, ...)`` tensor of the problems, on their device."""
    if not any(p.mask is not None for p in pairs):
        return None, None
    ones = torch.ones(b, dtype=torch.bool, device=like.device)
    mask = torch.stack([ones if p.mask is None else p.mask for p in pairs], dim=1)
    mask = mask.repeat(1, like.shape[0] // len(pairs))  # (b, Q)
    row_mask = mask.T  # (Q, b)
    col_mask = _gather_no_grad(mask, enabled, validate).T.contiguous()  # (Q, N)
    return row_mask, col_mask


def _anchor_means(
    rows: Tensor,
    con: Tensor,
    radius: Tensor,
    dist: Tensor,
    slope: Tensor | None,
    row_mask: Tensor | None,
    col_mask: Tensor | None,
    batch: _Batch,
    direction: str,
) -> tuple[Tensor, Tensor, dict[str, Tensor] | None, Tensor]:
    """SVR and constraint means over the present anchors of every direction (halved for
    ``"uni"``: SupCLAP's Eq. 5-6 sum the directions, the base is their mean), the radius
    terms (with ``slope``: the radii's mean, std, min and max and the mean radius slope)
    and the share of radii above the distance; all over the present anchors, with masks
    rather than boolean indexing (which would read the mask back: a host sync)."""
    over = (radius.detach() > dist.detach()).expand_as(rows)
    con = con.expand_as(rows)
    if row_mask is not None:
        rows = torch.where(row_mask, rows, torch.zeros_like(rows))
        con = torch.where(row_mask, con, torch.zeros_like(con))
    radius_terms = None
    if slope is not None:
        r = radius.detach().expand_as(rows)
        mean = _masked_mean(r, row_mask)
        radius_terms = {
            "radius_mean": mean,
            "radius_std": _masked_mean((r - mean).square(), row_mask).sqrt(),
            "radius_min": _masked_fill(r, row_mask, float("inf")).amin(),
            "radius_max": _masked_fill(r, row_mask, float("-inf")).amax(),
            "svr_radius_slope": _masked_mean(slope, row_mask),
        }
    count: Tensor | int = batch.n_global * rows.shape[0]
    if col_mask is not None:
        count = col_mask.sum().clamp_min(1)
    if direction == "uni":  # Eq. 5-6 sum the directions; the base is their mean
        count = count * 2
    svr = _reduce(rows, "mean", count, batch)
    constraint = _reduce(con, "mean", count, batch)
    return svr, constraint, radius_terms, _masked_mean(over.to(rows.dtype), row_mask)


def _masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` (same shape) is True (NaN if none)."""
    if mask is None:
        return x.mean()
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum()


def _masked_fill(x: Tensor, mask: Tensor | None, value: float) -> Tensor:
    """``x`` with ``value`` where ``mask`` is False."""
    return x if mask is None else x.masked_fill(~mask, value)


def _check_base_reduction(base: nn.Module) -> None:
    reduction = getattr(base, "reduction", "mean")
    if reduction != "mean":
        raise ValueError(
            f"base: SupportVectorRegularizer needs the base loss with reduction='mean' "
            f"(its SVR and constraint terms are batch means), got reduction={reduction!r}"
        )
