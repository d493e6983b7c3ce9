"""The SVR's maths on similarity rows, batched over ``Q`` anchor/candidate problems: the
support vectors' logits and per-row cross-entropies (dense and over column tiles), the
radius slope, and the pair problems :class:`~contrastive_losses.SupportVectorRegularizer`
builds from its base's ``contrastive_pairs`` (checked, normalised and gathered once each)
and reduces over the present anchors.

Private: :mod:`contrastive_losses.svr` (:func:`support_vector_term`) and
:mod:`contrastive_losses._svr_regularizer` import from here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _checks
from ._common import _Batch, _gather, _gather_no_grad, _reduce
from ._kernels import _distance, _gram, _tiled_softmax_mean, _TiledCrossEntropy, l2_normalize, widen
from .distributed import validate_together


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
