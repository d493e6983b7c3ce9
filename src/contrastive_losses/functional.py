r"""The maths of every loss as pure functions.

Modules in :mod:`contrastive_losses.losses` hold hyperparameters and learnable
parameters and call these functions. Every function

* takes raw embeddings and L2-normalises them (``normalize=True``),
* validates its inputs (shapes, dtypes, devices, NaN/Inf, zero vectors) and raises a
  ``ValueError``/``TypeError`` naming the argument,
* returns a scalar for ``reduction="mean"``/``"sum"`` and per-sample losses for ``"none"``,
* returns ``(loss, terms)`` with ``return_terms=True``, ``terms`` a dict of detached
  tensors for logging,
* with ``gather`` on (default: when ``torch.distributed`` runs with world size > 1)
  computes this rank's rows against the batch of all ranks; see
  :mod:`contrastive_losses.distributed` for the scaling of the returned loss.

Notation: ``B`` batch, ``K`` languages (captions per clip), ``D`` embedding dim,
:math:`s(u, v) = \langle u, v\rangle / \tau` on normalised embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks
from .ask import ask  # ASK's maths lives beside its bank retrieval; re-exported here
from .distributed import (
    all_gather_no_grad,
    all_gather_with_grad,
    resolve_gather,
    validate_together,
)
from .ot import sinkhorn

__all__ = [
    "ask",
    "cacl",
    "info_nce",
    "kcl",
    "l2_normalize",
    "sample_languages",
    "siglip",
    "sinkhorn",
    "support_vector_term",
]

Terms = dict[str, Tensor]


# --------------------------------------------------------------------------- helpers


class _L2Normalize(torch.autograd.Function):
    """``x / ||x||`` with a two-pass backward, ``(g - y <g, y>) / ||x||``.

    Autograd through ``F.normalize`` spends more time in the norm's backward than the
    loss spends in its matmuls at small batch sizes (see benchmarks/bench_losses.py).
    """

    @staticmethod
    def forward(ctx, x: Tensor, inv_norm: Tensor) -> Tensor:
        y = x * inv_norm.unsqueeze(-1)
        ctx.save_for_backward(y, inv_norm)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        y, inv_norm = ctx.saved_tensors
        radial = (grad.unsqueeze(-2) @ y.unsqueeze(-1)).squeeze(-1)  # row-wise <g, y>
        out = torch.addcmul(grad, y, radial, value=-1)
        return out.mul_(inv_norm.unsqueeze(-1)), None


def l2_normalize(x: Tensor, norms: Tensor | None = None) -> Tensor:
    """Unit-norm rows (last dim); ``norms`` are ``x``'s row norms if already computed.

    Without ``norms`` they are computed and checked (:func:`_checks.check_row_norms`):
    NaN/Inf, zero rows and norms whose reciprocal overflows raise ``ValueError``.
    """
    if norms is None:
        x = _checks.check_tensor(x, "x")
        _checks.check_float(x, "x")
        if x.dim() == 0 or x.shape[-1] == 0:
            raise ValueError(f"x: expected shape (..., D) with D > 0, got {tuple(x.shape)}")
        norms = _checks.check_row_norms(x, "x")
    return _L2Normalize.apply(x, 1.0 / norms)


def _embeddings(x: object, name: str, dims: str, normalize: bool, min_batch: int = 2) -> Tensor:
    """Validate an embedding input and (optionally) normalise it; one pass over ``x``."""
    x = _checks.check_embeddings(
        x, name, ndim=dims.count(",") + 1, dims=dims, min_batch=min_batch, check_values=False
    )
    norms = _checks.check_row_norms(x, name, nonzero=normalize)
    return l2_normalize(x, norms) if normalize else x


# Below 1e-4 the logits (up to 1/temperature = 1e4) no longer fit float16's 65504 once
# multiplied by a similarity sum, and the softmax is already a hard argmax in every dtype.
MIN_TEMPERATURE = 1e-4


def _check_scale(scale: float | Tensor) -> None:
    """SigLIP's logit scale :math:`c = 1/\\tau`: the bound of :func:`_temperature`."""
    value = _checks.check_positive(scale, "scale")
    if value > 1 / MIN_TEMPERATURE:
        raise ValueError(
            f"scale: {value:.3g} exceeds {1 / MIN_TEMPERATURE:g}, the largest logit scale "
            f"(1/temperature) the losses accept"
        )


def _check_bias(bias: float | Tensor) -> None:
    """A finite real scalar (SigLIP's bias may be negative or zero) of moderate size."""
    value = _checks.check_scalar(bias, "bias", floating=True)
    if value != value or abs(value) == float("inf"):
        raise ValueError(f"bias: must be finite, got {value}")
    if abs(value) > 1 / MIN_TEMPERATURE:  # a logit of its own: the same bound as the scale
        raise ValueError(f"bias: |{value:.3g}| exceeds {1 / MIN_TEMPERATURE:g}")


def _temperature(temperature: float | Tensor) -> None:
    value = _checks.check_positive(temperature, "temperature")
    if value < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature: {value:.3g} is below the smallest supported {MIN_TEMPERATURE:g} "
            "(1/temperature scales the logits; beyond 1e4 they overflow float16 and the "
            "softmax is a hard argmax)"
        )


@dataclass
class _Batch:
    """This rank's rows and the global batch they are contrasted with.

    Without gathering ``local is glob`` and ``offset == 0``. ``world`` scales the
    reduced loss so that its mean over ranks is the single-process loss.
    """

    offset: int
    n_global: int
    world: int


def _gather(x: Tensor, enabled: bool) -> tuple[Tensor, int]:
    return all_gather_with_grad(x) if enabled else (x, 0)


def _batch(offset: int, n_global: int, enabled: bool) -> _Batch:
    world = torch.distributed.get_world_size() if enabled else 1
    return _Batch(offset=offset, n_global=n_global, world=world)


def _reduce(per_sample: Tensor, reduction: str, count: Tensor | int, batch: _Batch) -> Tensor:
    """Reduce per-sample losses; ``count`` is the global number of samples for "mean"."""
    if reduction == "none":
        return per_sample
    total = per_sample.sum() * batch.world
    if reduction == "sum":
        return total
    return total / count


def _multi_positive_ce(logits: Tensor, positives: Tensor) -> Tensor:
    r"""Per-row :math:`-\frac{1}{|P_i|}\sum_{p \in P_i} \log \mathrm{softmax}(z_i)_p`.

    The supervised-contrastive "average outside the log" form: with one positive per row
    it is plain cross-entropy.
    """
    log_prob = logits - logits.logsumexp(dim=1, keepdim=True)  # (b, N)
    pos = positives.to(log_prob.dtype)
    return -(log_prob * pos).sum(dim=1) / pos.sum(dim=1)


def _check_pair(a: Tensor, a_name: str, b: Tensor, b_name: str) -> None:
    _checks.check_same_size(a, a_name, b, b_name, 0, "batch size B")
    _checks.check_same_size(a, a_name, b, b_name, -1, "embedding dim D")
    _checks.check_same_device_dtype([(a, a_name), (b, b_name)])


def _pair_and_ids(
    audio: object, text: object, ids: object | None, normalize: bool, min_batch: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Validated (and normalised) ``(B, D)`` audio and text, and optional ``(B,)`` ids."""
    a = _embeddings(audio, "audio", "(B, D)", normalize, min_batch)
    t = _embeddings(text, "text", "(B, D)", normalize, min_batch)
    _check_pair(a, "audio", t, "text")
    if ids is not None:
        ids = _checks.check_ids(ids, "ids", a.shape[0], a)
    return a, t, ids


def _info_nce_rows(
    a: Tensor,
    t: Tensor,
    temperature: float | Tensor,
    ids: Tensor | None,
    gather: bool,
) -> tuple[Tensor, Tensor, _Batch]:
    """Per-sample a->t and t->a cross-entropies of this rank's rows, ``(b,)`` each."""
    b = a.shape[0]
    a = a / temperature  # scale the (b, D) side, not the (b, N) logits
    if not gather:
        logits = a @ t.T  # (B, B)
        if ids is None:
            target = torch.arange(b, device=a.device)
            a2t = F.cross_entropy(logits, target, reduction="none")
            t2a = F.cross_entropy(logits.T, target, reduction="none")
        else:
            same = ids[:, None] == ids[None, :]  # (B, B), symmetric
            a2t = _multi_positive_ce(logits, same)
            t2a = _multi_positive_ce(logits.T, same)
        return a2t, t2a, _batch(0, b, False)

    a_all, offset = all_gather_with_grad(a)  # (N, D)
    t_all, _ = all_gather_with_grad(t)
    logits_a2t = a @ t_all.T  # (b, N)
    logits_t2a = t @ a_all.T  # (b, N)
    if ids is None:
        target = torch.arange(offset, offset + b, device=a.device)
        a2t = F.cross_entropy(logits_a2t, target, reduction="none")
        t2a = F.cross_entropy(logits_t2a, target, reduction="none")
    else:
        same = ids[:, None] == all_gather_no_grad(ids)[None, :]  # (b, N)
        a2t = _multi_positive_ce(logits_a2t, same)
        t2a = _multi_positive_ce(logits_t2a, same)
    return a2t, t2a, _batch(offset, a_all.shape[0], True)


def _finish(loss: Tensor, terms: Terms, return_terms: bool) -> Tensor | tuple[Tensor, Terms]:
    if return_terms:
        return loss, {k: v.detach() for k, v in terms.items()}
    return loss


# --------------------------------------------------------------------------- InfoNCE


def info_nce(
    audio: Tensor,
    text: Tensor,
    temperature: float | Tensor = 0.07,
    *,
    ids: Tensor | None = None,
    normalize: bool = True,
    reduction: str = "mean",
    gather: bool | None = None,
    return_terms: bool = False,
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

    Args:
        audio: audio embeddings ``(B, D)``.
        text: text embeddings ``(B, D)``; ``text[i]`` is the positive of ``audio[i]``.
        temperature: :math:`\tau \ge 10^{-4}`, a float or a 0-d tensor (learnable).
        ids: optional integer ``(B,)`` sample ids; equal ids are positives.
        normalize: L2-normalise the inputs first.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"`` (per-sample ``(B,)``).
        gather: all-gather across ranks; ``None`` gathers when distributed.
        return_terms: also return ``{"loss_a2t", "loss_t2a"}``.

    Shape:
        audio ``(B, D)``, text ``(B, D)``, ids ``(B,)``; output scalar or ``(B,)``.

    Example:
        >>> import torch
        >>> from contrastive_losses.functional import info_nce
        >>> audio, text = torch.randn(8, 32), torch.randn(8, 32)
        >>> info_nce(audio, text, temperature=0.07).shape
        torch.Size([])
    """
    enabled = resolve_gather(gather)
    with validate_together(enabled, audio) as v:
        _checks.check_reduction(reduction)
        _temperature(temperature)
        a, t, ids = _pair_and_ids(audio, text, ids, normalize, v.min_batch)
        v.batch = a.shape[0]
    a2t, t2a, batch = _info_nce_rows(a, t, temperature, ids, enabled)
    loss = _reduce((a2t + t2a) / 2, reduction, batch.n_global, batch)
    terms = {
        "loss_a2t": _reduce(a2t, "mean", batch.n_global, batch),
        "loss_t2a": _reduce(t2a, "mean", batch.n_global, batch),
    }
    return _finish(loss, terms, return_terms)


# --------------------------------------------------------------------------- SigLIP


def siglip(
    audio: Tensor,
    text: Tensor,
    scale: float | Tensor = 10.0,
    bias: float | Tensor = -10.0,
    *,
    ids: Tensor | None = None,
    normalize: bool = True,
    reduction: str = "mean",
    gather: bool | None = None,
    return_terms: bool = False,
) -> Tensor | tuple[Tensor, Terms]:
    r"""Pairwise sigmoid loss (SigLIP, Zhai et al. 2023).

    .. math::

        \mathcal{L} = -\frac1B \sum_{i=1}^B \sum_{j=1}^B
            \log \sigma\big(z_{ij}\,(c\,\langle a_i, t_j\rangle + b)\big),
        \qquad z_{ij} = \begin{cases} 1 & i, j \text{ positive} \\ -1 & \text{else}\end{cases}

    with scale :math:`c` (SigLIP's :math:`t' = \log c` initialised at :math:`\log 10`)
    and bias :math:`b` (initialised at :math:`-10`).

    Args:
        audio: ``(B, D)``.
        text: ``(B, D)``.
        scale: :math:`c > 0`, float or 0-d tensor.
        bias: :math:`b`, float or 0-d tensor.
        ids: optional ``(B,)``; equal ids are positives.
        normalize: L2-normalise the inputs first.
        reduction: ``"mean"`` (sum over pairs / B), ``"sum"``, or ``"none"`` (row sums ``(B,)``).
        gather: all-gather across ranks (this rank's audio rows against all texts).
        return_terms: also return ``{"scale", "bias"}``.

    Shape:
        audio ``(B, D)``, text ``(B, D)``; output scalar or ``(B,)``.

    Example:
        >>> import torch
        >>> from contrastive_losses.functional import siglip
        >>> siglip(torch.randn(8, 16), torch.randn(8, 16)).shape
        torch.Size([])
    """
    enabled = resolve_gather(gather)
    with validate_together(enabled, audio) as v:
        _checks.check_reduction(reduction)
        _check_scale(scale)
        _check_bias(bias)
        a, t, ids = _pair_and_ids(audio, text, ids, normalize, v.min_batch)
        v.batch = a.shape[0]
    t_all, offset = _gather(t, enabled)
    logits = scale * (a @ t_all.T) + bias  # (b, N)
    if ids is None:
        rows = torch.arange(a.shape[0], device=a.device)
        positive = torch.zeros_like(logits, dtype=torch.bool)
        positive[rows, rows + offset] = True
    else:
        ids_all = all_gather_no_grad(ids) if enabled else ids
        positive = ids[:, None] == ids_all[None, :]
    signs = positive.to(logits.dtype) * 2 - 1
    per_row = -F.logsigmoid(signs * logits).sum(dim=1)  # (b,)
    batch = _batch(offset, t_all.shape[0], enabled)
    loss = _reduce(per_row, reduction, batch.n_global, batch)
    terms = {"scale": torch.as_tensor(scale), "bias": torch.as_tensor(bias)}
    return _finish(loss, terms, return_terms)


# --------------------------------------------------------------------------- KCL


def _text_and_mask(
    audio: Tensor, text: object, mask: object | None, normalize: bool, min_batch: int = 2
) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """Validated raw ``text`` ``(B, K, D)``, its row norms ``(B, K)``, the mask, and
    whether the norms are moderate enough for the fused path (:func:`_checks.row_norms`)."""
    t = _checks.check_embeddings(
        text, "text", ndim=3, dims="(B, K, D)", min_batch=min_batch, check_values=False
    )
    if t.shape[1] == 0:
        raise ValueError(f"text: K = 0 languages (shape {tuple(t.shape)}); need at least one")
    _check_pair(audio, "audio", t, "text")
    if mask is not None:
        mask = _checks.check_mask(mask, "mask", tuple(t.shape[:2]), t)
    # Absent captions may be zero rows (padding); they stay zero after normalising.
    norms, moderate = _checks.row_norms(t, "text", nonzero=normalize, mask=mask)
    return t, norms, mask, moderate


class _NormalizedRowsMatmul(torch.autograd.Function):
    """``l2_normalize(x) @ y.T`` as ``(x @ y.T) / ||x||`` row-wise.

    For KCL's ``(B*K, D) @ (D, B)`` the ``(B*K, B)`` scores are smaller than the
    ``(B*K, D)`` captions whenever ``B < D``: scaling the scores instead of normalising
    the captions saves several passes over the largest tensor, forward and backward.
    """

    @staticmethod
    def forward(ctx, x: Tensor, inv_norm: Tensor, y: Tensor) -> Tensor:
        scores = (x @ y.T).mul_(inv_norm.unsqueeze(-1))  # (M, N)
        ctx.save_for_backward(x, inv_norm, y, scores)
        return scores

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, Tensor]:
        x, inv_norm, y, scores = ctx.saved_tensors
        grad_scaled = grad * inv_norm.unsqueeze(-1)  # (M, N)
        # d/dx_i of <x_i, y_j>/||x_i||: y_j/||x_i|| - s_ij x_i/||x_i||^2
        radial = (grad * scores).sum(dim=-1) * inv_norm.square()  # (M,)
        grad_x = torch.addcmul(grad_scaled @ y, x, radial.unsqueeze(-1), value=-1)
        return grad_x, None, grad_scaled.T @ x


def _per_language_ce(
    scores: Tensor, row_mask: Tensor | None, col_mask: Tensor | None, offset: int
) -> Tensor:
    """Cross-entropy of each row against its language's candidates, positive at ``offset + r``.

    ``scores`` is ``(K, b, N)``: row ``r`` of this rank against all ``N`` candidates of
    language ``k``. Absent candidates leave the denominator; absent rows give 0.
    """
    if col_mask is not None:
        # A finite fill, not -inf: a fully masked row must stay NaN-free in backward.
        scores = scores.masked_fill(~col_mask[:, None, :], torch.finfo(scores.dtype).min)
    positive = scores.diagonal(offset=offset, dim1=1, dim2=2)  # (K, b)
    loss = scores.logsumexp(dim=-1) - positive  # (K, b)
    return loss if row_mask is None else loss * row_mask


class _SymmetricDiagonalCE(torch.autograd.Function):
    """Both cross-entropies of square ``(K, B, B)`` score blocks, positives on the diagonal.

    Returns ``(row_losses, column_losses)``, each ``(K, B)``: row ``j`` against its row,
    column ``i`` against its column. One backward pass writes the gradient of both into a
    single buffer; autograd's path (two ``logsumexp`` and two ``diagonal`` backwards)
    materialises four ``(K, B, B)`` tensors.
    """

    @staticmethod
    def forward(ctx, scores: Tensor) -> tuple[Tensor, Tensor]:
        lse_rows = scores.logsumexp(dim=-1)  # (K, B)
        lse_cols = scores.logsumexp(dim=-2)  # (K, B)
        diag = scores.diagonal(dim1=1, dim2=2)  # (K, B)
        ctx.save_for_backward(scores, lse_rows, lse_cols)
        return lse_rows - diag, lse_cols - diag

    @staticmethod
    def backward(ctx, g_rows: Tensor, g_cols: Tensor) -> Tensor:
        scores, lse_rows, lse_cols = ctx.saved_tensors
        grad = (scores - lse_rows.unsqueeze(-1)).exp_().mul_(g_rows.unsqueeze(-1))
        grad.add_((scores - lse_cols.unsqueeze(-2)).exp_().mul_(g_cols.unsqueeze(-2)))
        grad.diagonal(dim1=1, dim2=2).sub_(g_rows + g_cols)
        return grad


def kcl(
    audio: Tensor,
    text: Tensor,
    temperature: float | Tensor = 0.07,
    *,
    mask: Tensor | None = None,
    negatives: str = "per_language",
    normalize: bool = True,
    reduction: str = "mean",
    gather: bool | None = None,
    return_terms: bool = False,
) -> Tensor | tuple[Tensor, Terms]:
    r"""1-to-K contrastive loss (KCL, ATRI Eq. 9–11): one audio, K captions in K languages.

    ``negatives="per_language"`` (default, ATRI): for each language :math:`k` the
    negatives of audio :math:`a_i` are the captions of language :math:`k` in the batch,
    and vice versa,

    .. math::

        \mathcal{L}_{a2t} = -\sum_{k=1}^K \sum_{i=1}^N
            \log \frac{e^{s(a_i, t_{ik})}}{\sum_j e^{s(a_i, t_{jk})}}, \quad
        \mathcal{L}_{t2a} = -\sum_{k=1}^K \sum_{i=1}^N
            \log \frac{e^{s(t_{ik}, a_i)}}{\sum_j e^{s(t_{ik}, a_j)}}, \quad
        \mathcal{L} = \frac{\mathcal{L}_{a2t} + \mathcal{L}_{t2a}}{2NK},

    i.e. the mean over languages of the symmetric InfoNCE. ``negatives="all_languages"``
    (Nie et al. 2024) contrasts each audio with all :math:`NK` captions, its own K all
    positive (mean of :math:`-\log\mathrm{softmax}` over them), and each caption with
    all :math:`N` audios.

    A ``mask`` marks present captions: an absent caption :math:`(j, k)` leaves every
    numerator and denominator (per language, the loss is InfoNCE on the present pairs)
    and the normaliser counts present pairs only. With ``K = 1`` this is
    :func:`info_nce`.

    Args:
        audio: ``(B, D)``.
        text: ``(B, K, D)``; ``text[i, k]`` is the caption of clip ``i`` in language ``k``.
        temperature: :math:`\tau \ge 10^{-4}`.
        mask: optional bool ``(B, K)``; ``True`` where the caption exists. Every clip
            needs at least one caption. Absent captions may be zero rows (padding) but
            must be finite (a NaN would reach the present rows' gradients).
        negatives: ``"per_language"`` or ``"all_languages"``.
        normalize: L2-normalise the inputs first.
        reduction: ``"mean"``, ``"sum"``, or ``"none"``: per pair ``(B, K)``, the mean of
            its a->t and t->a terms, 0 where absent.
        gather: all-gather across ranks.
        return_terms: also return ``{"loss_a2t", "loss_t2a", "loss_per_language"}``.

    Shape:
        audio ``(B, D)``, text ``(B, K, D)``, mask ``(B, K)``; output scalar or ``(B, K)``.

    Example:
        >>> import torch
        >>> from contrastive_losses.functional import kcl
        >>> audio, text = torch.randn(4, 16), torch.randn(4, 3, 16)
        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1], [1, 1, 1]]).bool()
        >>> kcl(audio, text, mask=mask).shape
        torch.Size([])
    """
    enabled = resolve_gather(gather)
    with validate_together(enabled, audio) as v:
        _checks.check_reduction(reduction)
        _checks.check_choice(negatives, "negatives", ("per_language", "all_languages"))
        _temperature(temperature)
        a = _embeddings(audio, "audio", "(B, D)", normalize, v.min_batch)
        t_raw, text_norms, m, moderate = _text_and_mask(a, text, mask, normalize, v.min_batch)
        v.batch = a.shape[0]
    # Single process, per-language negatives: normalise through the scores (fast path),
    # unless 1/||t||^2 in its backward could overflow (norms below sqrt(tiny)).
    fused = normalize and not enabled and negatives == "per_language" and moderate
    out_dtype = a.dtype
    if fused and out_dtype in (torch.float16, torch.bfloat16):
        # The fused path's unnormalised scores t @ a.T and its 1/||t||^2 in backward
        # overflow float16 (||t|| < 0.004 or > ~200): compute in float32, return the
        # input dtype (autograd casts the gradients back).
        a, t_raw, text_norms = a.float(), t_raw.float(), text_norms.float()
    t = l2_normalize(t_raw, text_norms) if normalize and not fused else t_raw
    b, k_langs, dim = t.shape
    a = a / temperature  # scale the (B, D) side, not the (K, B, B) scores
    a_all, offset = _gather(a, enabled)
    t_all, _ = _gather(t, enabled)
    m_all = all_gather_no_grad(m) if (enabled and m is not None) else m
    batch = _batch(offset, a_all.shape[0], enabled)
    row_mask = None if m is None else m.T  # (K, b)
    col_mask = None if m_all is None else m_all.T  # (K, N)

    if negatives == "per_language":
        if enabled:
            # (K, b, N): this rank's captions against all audio, and its audio against
            # all captions of the same language.
            t2a_scores = t.transpose(0, 1) @ a_all.T
            a2t_scores = (a @ t_all.reshape(-1, dim).T).reshape(b, t_all.shape[0], k_langs)
            a2t_scores = a2t_scores.permute(2, 0, 1)
        else:
            # One GEMM: (B*K, D) @ (D, B) -> (K, B_text, B_audio); a->t is its transpose.
            flat = t.reshape(-1, dim)
            if fused:
                inv_norm = 1.0 / text_norms.reshape(-1)
                scores = _NormalizedRowsMatmul.apply(flat, inv_norm, a)  # (B*K, B)
            else:
                scores = flat @ a.T
            t2a_scores = scores.reshape(b, k_langs, b).transpose(0, 1)
        if enabled:
            a2t = _per_language_ce(a2t_scores, row_mask, col_mask, offset).T  # (b, K)
            t2a = _per_language_ce(t2a_scores, row_mask, col_mask, offset).T  # (b, K)
        else:
            if row_mask is not None:  # absent captions leave rows and columns alike
                valid = row_mask[:, :, None] & row_mask[:, None, :]  # (K, B, B)
                t2a_scores = t2a_scores.masked_fill(~valid, torch.finfo(t2a_scores.dtype).min)
            t2a_k, a2t_k = _SymmetricDiagonalCE.apply(t2a_scores)  # (K, B) each
            if row_mask is not None:
                t2a_k, a2t_k = t2a_k * row_mask, a2t_k * row_mask
            a2t, t2a = a2t_k.T, t2a_k.T  # (B, K)
    else:
        a2t_logits = a @ t_all.reshape(-1, dim).T  # (b, N*K)
        own = torch.zeros(b, a_all.shape[0], dtype=torch.bool, device=a.device)
        own[torch.arange(b, device=a.device), torch.arange(b, device=a.device) + offset] = True
        positives = own[:, :, None].expand(-1, -1, k_langs)  # (b, N, K)
        if m_all is not None:
            a2t_logits = a2t_logits.masked_fill(
                ~m_all.reshape(1, -1), torch.finfo(a2t_logits.dtype).min
            )
            positives = positives & m_all[None]
        n_cols = a_all.shape[0] * k_langs
        a2t = _multi_positive_ce(a2t_logits, positives.reshape(b, n_cols))[:, None]  # (b, 1)
        t2a_logits = t.reshape(-1, dim) @ a_all.T  # (b*K, N)
        target = (torch.arange(b, device=a.device) + offset).repeat_interleave(k_langs)
        t2a = F.cross_entropy(t2a_logits, target, reduction="none").reshape(b, k_langs)
        a2t = a2t.expand(-1, k_langs)
        if m is not None:
            a2t, t2a = a2t * m, t2a * m

    count: Tensor | int = b * k_langs if m_all is None else m_all.sum()
    if enabled and m_all is None:
        count = batch.n_global * k_langs
    per_pair = (a2t + t2a) / 2  # (b, K)
    loss = _reduce(per_pair, reduction, count, batch).to(out_dtype)
    present = torch.ones_like(per_pair) if m_all is None else m_all.to(per_pair.dtype)
    terms = {
        "loss_a2t": _reduce(a2t, "mean", count, batch),
        "loss_t2a": _reduce(t2a, "mean", count, batch),
        # Each language's symmetric loss over its present pairs (local rows under gather).
        "loss_per_language": per_pair.sum(0) / present[offset : offset + b].sum(0).clamp_min(1),
    }
    return _finish(loss, {k: v.to(out_dtype) for k, v in terms.items()}, return_terms)


# --------------------------------------------------------------------------- CACL


def _select_language(text: Tensor, index: Tensor) -> Tensor:
    return text[torch.arange(text.shape[0], device=text.device), index]


def cacl(
    audio: Tensor,
    english: Tensor,
    other: Tensor,
    temperature: float | Tensor = 0.07,
    *,
    normalize: bool = True,
    reduction: str = "mean",
    gather: bool | None = None,
    return_terms: bool = False,
) -> Tensor | tuple[Tensor, Terms]:
    r"""Audio–English co-anchor contrastive loss (CACL, ATRI Eq. 12–13).

    Three symmetric InfoNCE terms over the triplet (audio, English caption, caption in a
    randomly drawn other language :math:`q_i`):

    .. math::

        \mathcal{L} = \frac{\mathcal{L}_{ae} + \mathcal{L}_{at} + \mathcal{L}_{et}}{6N},

    where each :math:`\mathcal{L}_{xy}` is the sum over the batch of the two directional
    InfoNCE terms between modalities :math:`x` and :math:`y`. It equals the mean of the
    three symmetric :func:`info_nce` means. Draw :math:`q_i` with :func:`sample_languages`.

    Args:
        audio: ``(B, D)``.
        english: English captions ``(B, D)``.
        other: captions in the other language ``(B, D)``.
        temperature: :math:`\tau \ge 10^{-4}`.
        normalize: L2-normalise the inputs first.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (``(B,)``, mean of the three terms).
        gather: all-gather across ranks.
        return_terms: also return ``{"loss_audio_english", "loss_audio_other",
            "loss_english_other"}`` (each a symmetric InfoNCE mean).

    Shape:
        audio, english, other ``(B, D)``; output scalar or ``(B,)``.

    Example:
        >>> import torch
        >>> from contrastive_losses.functional import cacl
        >>> a, e, o = torch.randn(6, 16), torch.randn(6, 16), torch.randn(6, 16)
        >>> cacl(a, e, o).shape
        torch.Size([])
    """
    enabled = resolve_gather(gather)
    with validate_together(enabled, audio) as v:
        _checks.check_reduction(reduction)
        _temperature(temperature)
        a = _embeddings(audio, "audio", "(B, D)", normalize, v.min_batch)
        e = _embeddings(english, "english", "(B, D)", normalize, v.min_batch)
        o = _embeddings(other, "other", "(B, D)", normalize, v.min_batch)
        _check_pair(a, "audio", e, "english")
        _check_pair(a, "audio", o, "other")
        v.batch = a.shape[0]
    per_sample: list[Tensor] = []
    terms: Terms = {}
    batch = _batch(0, a.shape[0], False)
    for name, (x, y) in {
        "loss_audio_english": (a, e),
        "loss_audio_other": (a, o),
        "loss_english_other": (e, o),
    }.items():
        x2y, y2x, batch = _info_nce_rows(x, y, temperature, None, enabled)
        per_sample.append((x2y + y2x) / 2)
        terms[name] = _reduce(per_sample[-1], "mean", batch.n_global, batch)
    loss = _reduce(torch.stack(per_sample).mean(0), reduction, batch.n_global, batch)
    return _finish(loss, terms, return_terms)


def sample_languages(
    mask_or_num_languages: Tensor | int,
    batch_size: int | None = None,
    *,
    generator: torch.Generator | None = None,
    english_index: int = 0,
    include_english: bool = False,
) -> Tensor:
    r"""Draw one language index per sample, uniformly among its present captions.

    For CACL (:func:`cacl`) the draw excludes English (``include_english=False``): it is
    ATRI's :math:`q_i`. For the ML-CLAP random-language baseline draw with
    ``include_english=True`` and train :func:`info_nce` on the drawn captions::

        idx = sample_languages(mask, include_english=True)
        loss = info_nce(audio, text[torch.arange(len(idx)), idx])

    Args:
        mask_or_num_languages: a bool mask ``(B, K)`` of present captions, or ``K`` (all
            present, then ``batch_size`` is required).
        batch_size: ``B`` when passing ``K``.
        generator: a ``torch.Generator`` for reproducible draws (on the mask's device).
        english_index: the column of English.
        include_english: draw among all present languages instead.

    Returns:
        ``(B,)`` long tensor of language indices.

    Example:
        >>> import torch
        >>> from contrastive_losses.functional import sample_languages
        >>> g = torch.Generator().manual_seed(0)
        >>> idx = sample_languages(8, batch_size=4, generator=g)
        >>> bool((idx >= 1).all() and (idx < 8).all())
        True
    """
    if isinstance(mask_or_num_languages, Tensor):
        mask = _checks.check_tensor(mask_or_num_languages, "mask_or_num_languages")
        _checks.check_materialised(mask, "mask_or_num_languages")
        if mask.dim() != 2 or mask.dtype != torch.bool:
            raise ValueError(
                "mask_or_num_languages: expected a bool (B, K) mask, got "
                f"dtype {mask.dtype} shape {tuple(mask.shape)}"
            )
        if batch_size is not None and batch_size != mask.shape[0]:
            raise ValueError(f"batch_size: {batch_size} does not match the mask's {mask.shape[0]}")
    elif isinstance(mask_or_num_languages, int) and not isinstance(mask_or_num_languages, bool):
        if batch_size is None or batch_size < 1:
            raise ValueError(f"batch_size: a positive int is required with K, got {batch_size}")
        device = generator.device if generator is not None else None
        mask = torch.ones(batch_size, mask_or_num_languages, dtype=torch.bool, device=device)
    else:
        raise TypeError(
            "mask_or_num_languages: expected a bool (B, K) tensor or an int K, got "
            f"{type(mask_or_num_languages).__name__}"
        )
    k_langs = mask.shape[1]
    _checks.check_int(english_index, "english_index", 0)
    if not 0 <= english_index < k_langs:
        raise ValueError(f"english_index: {english_index} is outside [0, {k_langs})")
    weights = mask.to(torch.float32)
    if not include_english:
        weights[:, english_index] = 0
    empty = weights.sum(dim=1) == 0
    if bool(empty.any()):
        rows = torch.nonzero(empty).flatten().tolist()[:10]
        what = "caption" if include_english else "non-English caption"
        raise ValueError(f"mask_or_num_languages: sample(s) {rows} have no {what} to draw")
    return torch.multinomial(weights, 1, generator=generator).squeeze(1)


# --------------------------------------------------------------------------- SVR (SupCLAP)


class _Gram(torch.autograd.Function):
    """``y @ y.mT`` with the symmetric backward ``(g + g.mT) @ y``: one matmul, not two."""

    @staticmethod
    def forward(ctx: Any, y: Tensor) -> Tensor:
        ctx.save_for_backward(y)
        return y @ y.mT

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return (grad + grad.mT) @ y


class _Distance(torch.autograd.Function):
    """``||y - x||`` over the last dim; backward recomputes ``y - x`` instead of keeping a
    ``(B, D)`` tensor alive, and is 0 where the distance is 0."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor) -> Tensor:
        dist = torch.linalg.vector_norm(y - x, dim=-1)
        ctx.save_for_backward(x, y, dist)
        return dist

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, y, dist = ctx.saved_tensors
        scale = torch.where(dist > 0, grad / dist.clamp_min(torch.finfo(dist.dtype).tiny), 0)
        grad_y = (y - x) * scale[..., None]
        return -grad_y, grad_y


def _distance(x: Tensor, y: Tensor) -> Tensor:
    return _Distance.apply(x, y)


def _gram(y_local: Tensor, y_all: Tensor, gathered: bool) -> Tensor:
    """``y_local @ y_all.T``: the positives' rows against every candidate."""
    return y_local @ y_all.mT if gathered else _Gram.apply(y_local)


def _unit_offsets(x: Tensor, y_pos: Tensor) -> tuple[Tensor, Tensor]:
    """Unit direction ``(y_pos - x)/||y_pos - x||`` (0 below epsilon) and the distance."""
    u = y_pos - x
    dist = torch.linalg.vector_norm(u, dim=-1)
    eps = torch.finfo(x.dtype).eps
    inv = torch.where(dist > eps, 1 / dist.clamp_min(eps), torch.zeros_like(dist))
    return u * inv[..., None], dist


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
    logits = torch.lerp(sims, positive_sims, coef[..., None]) / temperature  # (Q, b, N)
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
    if isinstance(x, Tensor) and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


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
    invalid = torch.zeros(b, n, dtype=torch.bool, device=s.device)
    invalid[rows, rows + offset] = True  # the positive is not a negative
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
    if col_mask is not None or n - 1 < k:  # empty slots take the row minimum
        row_min = torch.minimum(s.masked_fill(invalid, float("inf")).amin(dim=-1), s_pos)
        top = torch.where(torch.isinf(top), row_min[..., None], top)
    return torch.cat([s_pos[..., None], top], dim=-1)  # (..., b, num_features)


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


def _radius_tensor(radius: object, b: int, ref: Tensor) -> Tensor | float:
    if isinstance(radius, Tensor):
        if radius.dim() > 1 or (radius.dim() == 1 and radius.shape[0] != b):
            raise ValueError(
                f"radius: expected a float, a 0-d tensor or shape ({b},) matching the "
                f"anchors, got shape {tuple(radius.shape)}"
            )
        _checks.check_float(radius, "radius")
        _checks.check_materialised(radius, "radius")
        if radius.device != ref.device:
            raise ValueError(f"radius: on device {radius.device} but anchor is on {ref.device}")
        peak = radius.detach().abs().amax() if radius.numel() else radius.new_zeros(())
        if not bool(peak <= MAX_RADIUS):  # False for NaN: one host sync for NaN, Inf, the bound
            _checks.check_finite(radius, "radius")
            check_radius(float(peak))
        return radius.to(ref.dtype)
    if isinstance(radius, bool) or not isinstance(radius, (int, float)):
        raise TypeError(f"radius: expected a float or a tensor, got {type(radius).__name__}")
    return check_radius(radius)


def support_vector_term(
    anchor: Tensor,
    candidates: Tensor,
    radius: float | Tensor,
    temperature: float | Tensor = 0.07,
    *,
    normalize: bool = True,
    mask: Tensor | None = None,
    reduction: str = "mean",
    gather: bool | None = None,
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
        normalize: L2-normalise the inputs first.
        mask: optional bool ``(B,)``: ``False`` drops the pair as an anchor and as a
            candidate (an absent caption).
        reduction: ``"mean"`` over present anchors, ``"sum"``, or ``"none"`` (``(B,)``,
            0 at absent anchors).
        gather: all-gather the candidates across ranks (this rank's anchors against the
            global batch; the loss is scaled as described in
            :mod:`contrastive_losses.distributed`).

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
    with validate_together(enabled, anchor, name="anchor") as v:
        _checks.check_reduction(reduction)
        _temperature(temperature)
        dtype = getattr(anchor, "dtype", None)
        if dtype is not None and dtype == getattr(candidates, "dtype", None):
            anchor, candidates = _upcast_half(anchor), _upcast_half(candidates)
        x = _embeddings(anchor, "anchor", "(B, D)", normalize, v.min_batch)
        y = _embeddings(candidates, "candidates", "(B, D)", normalize, v.min_batch)
        _check_pair(x, "anchor", y, "candidates")
        b = x.shape[0]
        r = _radius_tensor(radius, b, x)
        if mask is not None:
            mask = _check_row_mask(mask, b, x)
        v.batch = b
    y_all, offset = _gather(y, enabled)
    m_all = None if mask is None else (all_gather_no_grad(mask) if enabled else mask)
    per_row = _support_vector_rows(
        (x @ y_all.T)[None],  # (1, b, N)
        _gram(y, y_all, enabled)[None],
        _distance(x, y)[None],
        r[None] if isinstance(r, Tensor) and r.dim() == 1 else r,
        temperature,
        offset,
        None if m_all is None else m_all[None],
    )[0]  # (b,)
    batch = _batch(offset, y_all.shape[0], enabled)
    if mask is None:
        return _reduce(per_row, reduction, batch.n_global, batch).to(dtype)
    per_row = torch.where(mask, per_row, torch.zeros_like(per_row))
    count = m_all.sum().clamp_min(1) if m_all is not None else b  # all absent: loss 0
    return _reduce(per_row, reduction, count, batch).to(dtype)


def _check_row_mask(mask: object, b: int, ref: Tensor) -> Tensor:
    """Bool ``(B,)`` row mask on ``ref``'s device."""
    mask = _checks.check_tensor(mask, "mask")
    if mask.dim() != 1 or mask.shape[0] != b:
        raise ValueError(f"mask: expected shape ({b},) matching the batch, got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask: expected a bool tensor, got dtype {mask.dtype}")
    if mask.device != ref.device:
        raise ValueError(f"mask: on device {mask.device} but the embeddings are on {ref.device}")
    return mask
