"""The SVR radius: its bounds and checks (shared with the diagnostics and re-exported by
:mod:`contrastive_losses.functional`), the dynamic radius' input rows and
:class:`RadiusPredictor`, re-exported by :mod:`contrastive_losses.svr` and the package.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import _checks
from ._common import _diagonal_mask
from ._docs import init_doc

# The radius is a distance in the embedding space, where normalised embeddings are at most
# 2 apart. Up to 1e4 the support vector's logits (about R/temperature <= 1e8 at the 1e-4
# temperature floor) stay finite in float32; 1e40 is inf in float32 and gave NaN.
MAX_RADIUS = 1e4


def check_radius(value: float, name: str = "radius") -> float:
    """A finite float radius with ``|value| <= MAX_RADIUS``; returns it."""
    if value != value or abs(value) > MAX_RADIUS:
        raise ValueError(
            f"{name}: must be finite with |{name}| <= {MAX_RADIUS:g} (a distance in the "
            f"embedding space; unit embeddings are at most 2 apart), got {value}"
        )
    return float(value)


def _radius_tensor(radius: object, b: int, ref: Tensor, validate: bool = True) -> Tensor | float:
    """A float radius (checked) or a 0-d or ``(b,)`` tensor on ``ref``'s device, cast to
    its dtype; the bound on a tensor's values with ``validate`` only."""
    if isinstance(radius, Tensor):
        if radius.dim() > 1 or (radius.dim() == 1 and radius.shape[0] != b):
            raise ValueError(
                f"radius: expected a float, a 0-d tensor or shape ({b},) matching the "
                f"anchors, got shape {_checks.shape_of(radius)}"
            )
        _checks.check_float(radius, "radius")
        _checks.check_materialised(radius, "radius")
        if radius.device != ref.device:
            raise ValueError(f"radius: on device {radius.device} but anchor is on {ref.device}")
        if validate:
            peak = radius.detach().abs().amax() if radius.numel() else radius.new_zeros(())
            if not bool(peak <= MAX_RADIUS):  # False for NaN: one sync for NaN, Inf, the bound
                _checks.check_finite(radius, "radius")
                check_radius(float(peak))
        return radius.to(ref.dtype)
    if isinstance(radius, bool) or not isinstance(radius, (int, float)):
        raise TypeError(f"radius: expected a float or a tensor, got {type(radius).__name__}")
    return check_radius(radius)


# The predictor reads cos/temperature, at most 1e4 in magnitude at the 1e-4 temperature
# floor; far larger rows are no similarities and overflow its first layer (float32 max
# gave NaN).
MAX_SIMILARITY = 1e6


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


def _checksum(predictor: RadiusPredictor) -> Tensor:
    """A cheap fingerprint of the predictor's weights: their sum, each weighted by its
    position (a swap of two weights changes it too), in float64 on their device; read
    once, with the other settings, where the ranks check together."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).double() for p in predictor.parameters()])
        weights = torch.arange(1, flat.numel() + 1, dtype=flat.dtype, device=flat.device)
        return (flat * weights).sum() / flat.numel()
