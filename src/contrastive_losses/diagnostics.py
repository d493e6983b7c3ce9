r"""Diagnostics: measurements of what a loss does to the embedding space during training.

Plain functions on tensors and loss callables; nothing here changes a model.

* SupCLAP (§2.1, Fig. 1): :func:`force_decomposition` and :func:`trajectory_drift`. The
  gradient of an anchor's InfoNCE row splits into the *pull* of its positive and the
  *push* of its negatives; the push has a component along the direction from the anchor
  to its positive and one perpendicular to it, the part support vector regularisation
  (:class:`~contrastive_losses.SupportVectorRegularizer`) scales.
* ASK (Guo et al., arXiv 2512.19703): :func:`out_of_batch_influence` (gradient locality,
  Eq. 2) and :func:`representation_drift_mismatch` (stale knowledge, Eq. 3-4).

Inputs are detached tensors (or loss callables); outputs are detached tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks
from ._checks import _shape, check_choice, check_embeddings, check_float, check_tensor
from ._common import _check_pair, _check_row_mask, _embeddings, _temperature
from ._svr_radius import _radius_tensor

__all__ = [
    "Forces",
    "force_decomposition",
    "out_of_batch_influence",
    "representation_drift_mismatch",
    "trajectory_drift",
]


def _unit_offsets(x: Tensor, y_pos: Tensor) -> tuple[Tensor, Tensor]:
    """Unit direction ``(y_pos - x)/||y_pos - x||`` (0 below epsilon) and the distance."""
    u = y_pos - x
    dist = torch.linalg.vector_norm(u, dim=-1)
    eps = torch.finfo(x.dtype).eps
    inv = torch.where(dist > eps, 1 / dist.clamp_min(eps), torch.zeros_like(dist))
    return u * inv[..., None], dist


class Forces(NamedTuple):
    r"""Per-anchor forces of one InfoNCE (or SVR) row, in the descent direction.

    .. math::

        -\nabla_{t_i}\ell_i = \underbrace{J_i\,\tfrac{1 - P_{ii}}{\tau}\,a_i}_{\text{pull}}
            \;\underbrace{-\;J_i \sum_{j \ne i} \tfrac{P_{ij}}{\tau}\,a_j}_{\text{push}},
        \qquad J_i = \hat u_i\hat u_i^\top + \Big(1 - \frac{R_i}{d_i}\Big)
            (I - \hat u_i \hat u_i^\top),

    :math:`\hat u_i = (a_i - t_i)/d_i`, :math:`d_i = \lVert a_i - t_i\rVert`,
    :math:`P` the softmax of the (support-vector) logits; :math:`J = I` without SVR.

    Shape:
        ``pull``, ``push``, ``direction`` ``(B, D)``; ``push_parallel``,
        ``push_perpendicular``, ``distance`` ``(B,)``; ``negative_parallel``,
        ``negative_perpendicular`` ``(B, B)`` (row ``i``: each candidate's force on anchor
        ``i``, 0 at the positive); ``radius`` ``(B,)`` or ``None``.

    Example:
        >>> import torch
        >>> from contrastive_losses.diagnostics import force_decomposition
        >>> forces = force_decomposition(torch.randn(4, 8), torch.randn(4, 8), 0.1)
        >>> forces.pull.shape, forces.push_perpendicular.shape
        (torch.Size([4, 8]), torch.Size([4]))
    """

    pull: Tensor
    push: Tensor
    direction: Tensor
    push_parallel: Tensor
    push_perpendicular: Tensor
    negative_parallel: Tensor
    negative_perpendicular: Tensor
    distance: Tensor
    radius: Tensor | None


@torch.no_grad()
def force_decomposition(
    anchor: Tensor,
    candidates: Tensor,
    temperature: float | Tensor,
    radius: float | Tensor | None = None,
    *,
    normalize: bool = True,
    mask: Tensor | None = None,
) -> Forces:
    r"""Pull and push forces on each anchor, the push split along and across the path to
    the positive (SupCLAP §2.1; with ``radius``, through the support vector, App. D).

    For the anchor :math:`t_i` (normalised) and its row loss
    :math:`\ell_i = -\log \mathrm{softmax}_j(\langle t_i^{sup}, a_j\rangle/\tau)_i` with
    :math:`t_i^{sup} = t_i + R_i\hat u_i` (:math:`R = 0`, i.e. plain InfoNCE, when
    ``radius`` is ``None``), the forces are the terms of :math:`-\nabla_{t_i}\ell_i`
    (descent direction, so the pull points towards the positive; SupCLAP writes the
    gradient, the opposite sign):

    .. math::

        F^{pull}_i = J_i\frac{1 - P_{ii}}{\tau}a_i, \qquad
        f_{ij} = -J_i\frac{P_{ij}}{\tau}a_j, \qquad
        F^{push}_i = \sum_{j\ne i} f_{ij},

    and each push is split along the unit vector to the positive,
    :math:`f^{\parallel}_{ij} = \langle f_{ij}, \hat u_i\rangle` and
    :math:`f^{\perp}_{ij} = \lVert f_{ij} - f^{\parallel}_{ij}\hat u_i\rVert`. SVR keeps
    every :math:`f^{\parallel}` (at its own probabilities :math:`P`) and scales every
    :math:`f^{\perp}` by :math:`|1 - R_i/d_i|`. The direction is
    :math:`\hat u_i = (a_i - t_i)/\lVert a_i - t_i\rVert`, the straight path from the
    anchor to its positive and the frame of SupCLAP Eq. 16 (the pull itself lies along
    :math:`a_i`, in the plane of :math:`t_i` and :math:`\hat u_i`).

    Args:
        anchor: ``(B, D)`` (text for the text-to-audio direction).
        candidates: ``(B, D)``; ``candidates[i]`` is the positive of ``anchor[i]``.
        temperature: :math:`\tau \ge 10^{-4}`.
        radius: ``None`` (plain InfoNCE), a float, a 0-d or ``(B,)`` tensor.
        normalize: L2-normalise the inputs first (forces act on the normalised anchor).
        mask: optional bool ``(B,)`` of present pairs; absent rows are 0 and absent
            candidates exert no force.

    Returns:
        :class:`Forces`, detached.

    Shape:
        anchor, candidates ``(B, D)``; see :class:`Forces` for the outputs.

    Example:
        >>> import torch
        >>> from contrastive_losses.diagnostics import force_decomposition
        >>> t, a = torch.randn(6, 16), torch.randn(6, 16)
        >>> plain = force_decomposition(t, a, 0.07)
        >>> svr = force_decomposition(t, a, 0.07, radius=0.3)
        >>> # the net push is the sum of the negatives' pushes, along the path and across it
        >>> torch.allclose(svr.push_parallel, svr.negative_parallel.sum(dim=1), atol=1e-5)
        True
    """
    _temperature(temperature)
    x = _embeddings(anchor, "anchor", "(B, D)", normalize)
    y = _embeddings(candidates, "candidates", "(B, D)", normalize)
    _check_pair(x, "anchor", y, "candidates")
    b = x.shape[0]
    r = None if radius is None else _radius_tensor(radius, b, x)
    if mask is not None:
        mask = _check_row_mask(mask, b, x)
    u_hat, dist = _unit_offsets(x, y)  # (B, D), (B,)
    r_rows = torch.zeros(b, dtype=x.dtype, device=x.device)
    if r is not None:
        r_rows = r_rows + r
    support = x + r_rows[:, None] * u_hat  # (B, D)
    logits = support @ y.T / temperature  # (B, B)
    if mask is not None:
        logits = logits.masked_fill(~mask[None, :], torch.finfo(logits.dtype).min)
    prob = logits.softmax(dim=-1)  # (B, B)
    eye = torch.eye(b, dtype=torch.bool, device=x.device)
    # Perpendicular scale of J: 1 - R/d, and 1 where the direction is undefined (û = 0).
    defined = u_hat.abs().amax(dim=-1) > 0
    scale = torch.where(defined, 1 - r_rows / dist, torch.ones_like(dist))  # (B,)

    def through_j(v: Tensor) -> Tensor:  # (B, D) -> (B, D)
        par = (v * u_hat).sum(-1, keepdim=True) * u_hat
        return par + scale[:, None] * (v - par)

    weights = torch.where(eye, 1 - prob, -prob) / temperature  # (B, B) signed coefficients
    pull = through_j(weights.diagonal()[:, None] * y)
    push = through_j(weights.masked_fill(eye, 0) @ y)
    push_par = (push * u_hat).sum(-1)
    push_perp = (push - push_par[:, None] * u_hat).norm(dim=-1)
    # Per candidate: f_ij = w_ij a_j (before J); parallel kept, perpendicular scaled.
    along = u_hat @ y.T  # (B, B): <û_i, a_j>
    sq_norm = (y * y).sum(-1)[None, :]  # (1, B)
    perp_len = (sq_norm - along**2).clamp_min(0).sqrt()
    neg_w = weights.masked_fill(eye, 0)
    neg_par = neg_w * along
    neg_perp = neg_w.abs() * perp_len * scale.abs()[:, None]
    if mask is not None:
        rows = mask.to(x.dtype)  # (B,)
        pair = (mask[:, None] & mask[None, :]).to(x.dtype)  # (B, B)
        pull, push, u_hat = pull * rows[:, None], push * rows[:, None], u_hat * rows[:, None]
        push_par, push_perp = push_par * rows, push_perp * rows
        neg_par, neg_perp = neg_par * pair, neg_perp * pair
    return Forces(
        pull=pull,
        push=push,
        direction=u_hat,
        push_parallel=push_par,
        push_perpendicular=push_perp,
        negative_parallel=neg_par,
        negative_perpendicular=neg_perp,
        distance=dist,
        radius=None if r is None else r_rows,
    )


def trajectory_drift(update: Tensor, pull: Tensor, *, eps: float = 1e-12) -> Tensor:
    r"""Cosine between each embedding's update and the pull on it (SupCLAP Fig. 1).

    .. math::

        \cos_i = \frac{\langle \Delta t_i, F^{pull}_i\rangle}
            {\max(\lVert\Delta t_i\rVert\,\lVert F^{pull}_i\rVert, \epsilon)},

    with :math:`\Delta t_i = t_i^{(s+1)} - t_i^{(s)}` the change of a (normalised)
    embedding over one optimiser step and :math:`F^{pull}_i` the pull at step
    :math:`s` (:func:`force_decomposition`). 1 means the embedding moved straight along
    its pull; lower values are drift caused by the pushes (and by the other samples'
    updates through shared encoder weights). A zero update or pull gives 0.

    Args:
        update: ``(..., D)`` embedding updates.
        pull: ``(..., D)`` pull forces, same shape.
        eps: floor of the norm product.

    Returns:
        ``(...)`` cosines in :math:`[-1, 1]`, detached.

    Shape:
        update, pull ``(B, D)`` (or any ``(..., D)``); output ``(B,)``.

    Example:
        >>> import torch
        >>> from contrastive_losses.diagnostics import trajectory_drift
        >>> pull = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
        >>> trajectory_drift(torch.tensor([[0.5, 0.5], [0.0, 0.1]]), pull)
        tensor([0.7071, 1.0000])
    """
    update = _checks.check_tensor(update, "update")
    pull = _checks.check_tensor(pull, "pull")
    _checks.check_positive(eps, "eps")
    _checks.check_float(update, "update")
    _checks.check_float(pull, "pull")
    if update.dim() < 1 or update.shape != pull.shape:
        raise ValueError(
            f"pull: shape {_checks.shape_of(pull)} does not match update's "
            f"{_checks.shape_of(update)}"
        )
    _checks.check_same_device_dtype([(update, "update"), (pull, "pull")])
    _checks.check_finite(update, "update")
    _checks.check_finite(pull, "pull")
    # Each row divided by its largest magnitude first: entries near the dtype's max or
    # min would overflow or underflow the dot product and the norms. The floor eps on
    # |u||p| becomes eps / (s_u s_p) on the scaled norms (float64 scale product).
    u, s_u = _checks.peak_scaled_rows(update.detach())
    p, s_p = _checks.peak_scaled_rows(pull.detach())
    dot = (u * p).sum(-1)
    floor = eps / (s_u.squeeze(-1).double() * s_p.squeeze(-1).double())
    norms = u.norm(dim=-1) * p.norm(dim=-1)
    return dot / torch.maximum(norms, floor.to(norms.dtype))


def out_of_batch_influence(
    loss_fn: Callable[..., Tensor],
    *args: Any,
    outside: Tensor | Sequence[Tensor],
    reduction: str = "none",
    **kwargs: Any,
) -> Tensor:
    r"""How strongly a batch loss pulls on embeddings that are *not* in the batch.

    ASK Eq. 2 (gradient locality bottleneck): for an in-batch loss such as InfoNCE the
    gradient with respect to any out-of-batch embedding :math:`z_n` is exactly zero; a loss
    that injects retrieved knowledge (ASK) makes it non-zero. Per out-of-batch row
    :math:`n` (all tensors of ``outside`` share the row index, e.g. a bank's audio and
    text):

    .. math::

        I_n = \Big\lVert \frac{\partial \mathcal{L}(\text{batch})}{\partial z_n} \Big\rVert_2 ,
        \qquad z_n = (\text{outside}[0]_n, \text{outside}[1]_n, \dots).

    ``loss_fn(*args, **kwargs)`` must read ``outside`` (directly or through an object that
    holds it, such as :class:`~contrastive_losses.bank.KnowledgeBank`) for the gradient
    to be non-zero. Leaf tensors that do not require grad are switched on for the call
    and switched back after; the parameters' ``.grad`` are left untouched.

    Args:
        loss_fn: any callable returning a scalar loss tensor.
        *args: positional arguments for ``loss_fn``.
        outside: one ``(N, ...)`` tensor or a sequence of them with the same ``N``.
        reduction: ``"none"`` (per row), ``"sum"`` or ``"mean"``.
        **kwargs: keyword arguments for ``loss_fn``.

    Returns:
        ``(N,)`` influences, or their sum / mean.

    Shape:
        - outside: ``(N, D)`` (or ``(N, ...)``), each
        - output: ``(N,)`` with ``reduction="none"``, else scalar

    Example:
        >>> import torch
        >>> from contrastive_losses.diagnostics import out_of_batch_influence
        >>> g = torch.Generator().manual_seed(0)
        >>> a, bank = torch.randn(4, 3, generator=g), torch.randn(10, 3, generator=g)
        >>> in_batch = lambda x: (x @ x.T).logsumexp(-1).mean()
        >>> float(out_of_batch_influence(in_batch, a, outside=bank, reduction="sum"))
        0.0
        >>> with_bank = lambda x: (x @ bank.T).logsumexp(-1).mean()
        >>> bool(out_of_batch_influence(with_bank, a, outside=bank, reduction="sum") > 0)
        True
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable, got {type(loss_fn).__name__}")
    check_choice(reduction, "reduction", ("none", "sum", "mean"))
    tensors = [outside] if isinstance(outside, Tensor) else list(outside)
    if not tensors:
        raise ValueError("outside: expected at least one tensor")
    for i, t in enumerate(tensors):
        check_tensor(t, f"outside[{i}]")
        check_float(t, f"outside[{i}]")
        if t.dim() < 1 or t.shape[0] != tensors[0].shape[0]:
            raise ValueError(
                f"outside[{i}]: expected {tensors[0].shape[0]} rows like outside[0], "
                f"got shape {_shape(t)}"
            )
    switched = [t for t in tensors if t.is_leaf and not t.requires_grad]
    for t in switched:
        t.requires_grad_(True)
    try:
        loss = loss_fn(*args, **kwargs)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ValueError(
                f"loss_fn: must return a scalar tensor, got "
                f"{_shape(loss) if isinstance(loss, Tensor) else type(loss).__name__}"
            )
        grads: Sequence[Tensor | None]
        if loss.requires_grad:
            grads = torch.autograd.grad(loss.reshape(()), tensors, allow_unused=True)
        else:
            grads = [None] * len(tensors)
    finally:
        for t in switched:
            t.requires_grad_(False)
    n = tensors[0].shape[0]
    sq = torch.zeros(n, dtype=torch.float64, device=tensors[0].device)
    for g in grads:
        if g is not None:
            sq += g.detach().double().reshape(n, -1).pow(2).sum(-1)
    influence = sq.sqrt()
    if reduction == "sum":
        return influence.sum()
    if reduction == "mean":
        return influence.mean()
    return influence


def representation_drift_mismatch(
    current: Tensor,
    stale: Tensor,
    *,
    metric: str = "cosine",
    reduction: str = "mean",
) -> Tensor:
    r"""Representation-drift mismatch between a stale knowledge bank and the current model.

    ASK Eq. 3-4: the bank stores :math:`f_{\theta_s}(x_n)`, computed by the encoder at its
    last refresh; training moves the encoder to :math:`\theta_t`, and the mismatch is the
    mean drift between what the bank holds and what the model now computes for the same
    items (both L2-normalised):

    .. math::

        \text{RDM} = \frac1N \sum_n d\big(\hat f_{\theta_t}(x_n), \hat f_{\theta_s}(x_n)\big),
        \\ d(p, q) = 1 - \langle p, q\rangle \;\; (\texttt{"cosine"})
        \;\text{ or }\; \lVert p - q\rVert_2 \;\; (\texttt{"l2"}).

    Zero right after :meth:`KnowledgeBank.refresh`; grows as the encoder drifts.

    Args:
        current: embeddings of the items by the current model, ``(N, D)``.
        stale: the bank's embeddings of the same items in the same order, ``(N, D)``
            (e.g. ``bank.audio``).
        metric: ``"cosine"`` or ``"l2"``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Shape:
        - current, stale: ``(N, D)``
        - output: scalar, or ``(N,)`` with ``reduction="none"``

    Example:
        >>> import torch
        >>> from contrastive_losses.diagnostics import representation_drift_mismatch
        >>> x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
        >>> abs(float(representation_drift_mismatch(x, 2 * x))) < 1e-6
        True
        >>> round(float(representation_drift_mismatch(x, -x)), 4)
        2.0
    """
    current = check_embeddings(current, "current", ndim=2, dims="(N, D)", min_batch=1)
    stale = check_embeddings(stale, "stale", ndim=2, dims="(N, D)", min_batch=1)
    if current.shape != stale.shape:
        raise ValueError(
            f"stale: shape {_shape(stale)} does not match current's {_shape(current)}; "
            "both must hold the same items in the same order"
        )
    check_choice(metric, "metric", ("cosine", "l2"))
    check_choice(reduction, "reduction", ("mean", "sum", "none"))
    dtype = torch.promote_types(torch.promote_types(current.dtype, stale.dtype), torch.float32)
    p = F.normalize(current.detach().to(dtype), dim=-1)
    q = F.normalize(stale.detach().to(device=current.device, dtype=dtype), dim=-1)
    if metric == "cosine":
        drift = 1.0 - (p * q).sum(-1)
    else:
        drift = torch.linalg.vector_norm(p - q, dim=-1)
    if reduction == "mean":
        return drift.mean()
    if reduction == "sum":
        return drift.sum()
    return drift
