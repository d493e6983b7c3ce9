"""Diagnostics: measurements of what a loss does to the embedding space during training.

Plain functions on tensors and loss callables; nothing here changes a model.
ASK (Guo et al., arXiv 2512.19703): :func:`out_of_batch_influence` (gradient locality,
Eq. 2) and :func:`representation_drift_mismatch` (stale knowledge, Eq. 3-4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import _shape, check_choice, check_embeddings, check_float, check_tensor

__all__ = ["out_of_batch_influence", "representation_drift_mismatch"]


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
        \qquad d(p, q) = 1 - \langle p, q\rangle \;\; (\texttt{"cosine"})
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
