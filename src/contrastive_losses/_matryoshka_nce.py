r"""The Matryoshka sum of InfoNCE in one pass over the features: every prefix's logits
from one ``B x B x D`` product's worth of matmuls.

The cosine of the ``d``-prefixes of unit rows :math:`u = a/\lVert a\rVert`,
:math:`v = t/\lVert t\rVert` is

.. math::

   \cos_d(a_i, t_j) = \frac{P_d[i, j]}{\rho_d(u_i)\,\rho_d(v_j)}, \qquad
   P_d = \sum_{\text{blocks } k \le d} u_{:,k} v_{:,k}^\top, \quad
   \rho_d(u_i)^2 = \sum_{\text{blocks } k \le d} \lVert u_{i,k} \rVert^2,

so the nested prefixes' logits are running sums over the feature blocks between
consecutive dims (``[0, d_M)``, ``[d_M, d_{M-1})``, ...): the products cost one full
``(B, D) @ (D, B)`` instead of :math:`\sum_m d_m / D` of it (1.875 for four halvings), and
no prefix is cut, normalised or given a gradient buffer of its own. Autograd runs through
the sums (exact; the backward's matmuls are one full product's too).

Private: :class:`~contrastive_losses.MatryoshkaLoss` calls :func:`nested_info_nce` through
its base's ``_loss`` (temperature, ``logit_scale``, the parameter watch) when the base is
a plain one-process dense ``InfoNCELoss`` with ``"mean"``: see
:func:`MatryoshkaLoss.forward <contrastive_losses.MatryoshkaLoss.forward>`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _checks
from ._common import _narrow, _pair_and_ids, _resolve_scale
from ._kernels import widen
from ._nce_rows import _mean_cross_entropies


def _prefix_norms(u: Tensor, edges: list[int], name: str, validate: bool) -> list[Tensor]:
    r""":math:`\rho_d` of the unit rows ``u`` ``(B, D)`` for each ``d`` of ``edges``
    (ascending), by running sums of the blocks' squared norms: at most 1, no overflow. A
    prefix with no energy (zero, or below the dtype's smallest square) cannot be
    normalised: with ``validate`` one host read refuses it, naming ``name`` and ``d``."""
    sums, lo, out = None, 0, []
    for hi in edges:
        block = u[:, lo:hi]
        sq = (block * block).sum(-1)
        sums = sq if sums is None else sums + sq
        out.append(sums)
        lo = hi
    if validate:
        bad = torch.stack(out) == 0  # (M, B)
        if bool(bad.any()):
            m, row = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name}: row {row}'s first {edges[m]} features are zero (or too small "
                "beside the rest of the row to be normalised), so its prefix has no "
                "direction; every prefix of every row must be nonzero"
            )
    return [s.rsqrt() for s in out]


def nested_info_nce(
    audio: Tensor,
    text: Tensor,
    temperature: float | Tensor = 0.07,
    *,
    dims: tuple[int, ...],
    weights: tuple[float, ...],
    logit_scale: Tensor | None = None,
    validate_args: bool | None = None,
    **_settings: object,
) -> Tensor:
    r""":math:`\sum_m w_m \,\mathrm{InfoNCE}(\pi_{d_m}(a), \pi_{d_m}(t))`, the one-process
    mean of :func:`~contrastive_losses.functional.info_nce` on each re-normalised prefix
    ``(B, d_m)`` of ``audio`` and ``text`` ``(B, D)``, summed with ``weights``; ``dims``
    strictly decreasing (checked by the caller). ``_settings`` are the base's (``"mean"``,
    normalising, dense, not gathered: the caller's conditions)."""
    validate = _checks.resolve_validate(validate_args)
    scale = _resolve_scale(temperature, logit_scale, audio, validate)
    a, t, _ = _pair_and_ids(audio, text, None, True, 2, validate)  # unit rows, checked
    a, t = widen(a), widen(t)
    edges = sorted(dims)
    rho_a = _prefix_norms(a, edges, "audio", validate)
    rho_t = _prefix_norms(t, edges, "text", validate)
    weight = dict(zip(dims, weights, strict=True))
    total: Tensor | None = None
    products: Tensor | None = None
    lo = 0
    for m, hi in enumerate(edges):
        block = a[:, lo:hi] @ t[:, lo:hi].T  # (B, B)
        products = block if products is None else products + block
        lo = hi
        logits = products * (rho_a[m] * scale)[:, None] * rho_t[m][None, :]
        a2t, t2a = _mean_cross_entropies(logits)  # as info_nce's one-process mean
        term = (a2t + t2a) / 2 * weight[hi]
        total = term if total is None else total + term
    assert total is not None  # dims is not empty
    return _narrow(total, audio.dtype)
