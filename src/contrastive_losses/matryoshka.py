r"""Matryoshka representation learning: one loss over nested prefixes of the embeddings.

Kusupati et al. 2022, *Matryoshka Representation Learning* (NeurIPS); the wrapper form of
sentence-transformers' ``MatryoshkaLoss``. :class:`MatryoshkaLoss` trains the first ``d``
features of every embedding to work on their own, for each ``d`` of ``dims``, so that an
index may keep only a prefix of each vector (a quarter, an eighth of the storage) and
still retrieve. Any loss Module of this library is the base: InfoNCE, SigLIP, KCL, CACL
and the support-vector regulariser around any of them.
"""

from __future__ import annotations

import functools
import itertools
import numbers
import typing
from collections.abc import Sequence
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from ._docs import init_doc
from ._gather import resolve_gather
from ._matryoshka_nce import nested_info_nce
from .ask import ASKLoss
from .losses import CACLLoss, InfoNCELoss, KCLLoss, SigLIPLoss
from .svr import SupportVectorRegularizer

__all__ = ["MatryoshkaLoss"]

_BASES = (InfoNCELoss, SigLIPLoss, KCLLoss, CACLLoss, SupportVectorRegularizer)
# Keyword arguments that hold embeddings (the hard negatives ``(B, H, D)``): cut to the
# prefix like the positional ones. Any other keyword goes to the base unchanged.
_EMBEDDING_KWARGS = ("hard_negatives", "audio_hard_negatives")


def _check_base(base: object) -> nn.Module:
    if isinstance(base, MatryoshkaLoss):
        raise TypeError("base: a MatryoshkaLoss inside a MatryoshkaLoss; give all dims to one")
    if isinstance(base, ASKLoss):
        raise TypeError(
            "base: ASKLoss retrieves its knowledge from a KnowledgeBank of full-width "
            "(D-dim) embeddings, which a d-dim prefix cannot query; use InfoNCELoss, "
            "SigLIPLoss, KCLLoss, CACLLoss or a SupportVectorRegularizer around one"
        )
    if not isinstance(base, _BASES):
        raise TypeError(
            "base: expected a loss Module of contrastive_losses (InfoNCELoss, SigLIPLoss, "
            f"KCLLoss, CACLLoss, SupportVectorRegularizer), got {type(base).__name__}"
        )
    return base


def _check_dims(dims: object) -> tuple[int, ...]:
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence):
        raise TypeError(f"dims: expected a sequence of ints, got {type(dims).__name__}")
    if len(dims) == 0:
        raise ValueError("dims: expected at least one dimension, got an empty sequence")
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):
            raise TypeError(f"dims: expected ints, got {type(d).__name__} {d!r} in {dims!r}")
        if d < 1:
            raise ValueError(f"dims: every dim must be >= 1, got {d} in {list(dims)}")
    out = tuple(int(d) for d in dims)
    if any(a <= b for a, b in itertools.pairwise(out)):
        raise ValueError(f"dims: must be strictly decreasing (largest first), got {list(out)}")
    return out


def _check_weights(weights: object, n: int) -> tuple[float, ...]:
    if weights is None:
        return (1.0,) * n
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise TypeError(f"weights: expected None or a sequence of floats, got {weights!r}")
    if len(weights) != n:
        raise ValueError(f"weights: expected one per dim ({n}), got {len(weights)}: {weights!r}")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, numbers.Real):
            raise TypeError(f"weights: expected floats, got {type(w).__name__} {w!r}")
        if not 0 < float(w) < float("inf"):
            raise ValueError(f"weights: each must be positive and finite, got {list(weights)}")
    return tuple(float(w) for w in weights)


def _normalizes(base: nn.Module) -> bool:
    """Whether ``base`` L2-normalises its inputs (a regulariser: its base's setting)."""
    inner = base.base if isinstance(base, SupportVectorRegularizer) else base
    return bool(getattr(inner, "normalize", True))


def _is_embedding(x: object) -> bool:
    """A floating ``(B, ..., D)`` input: the embeddings (ids, masks and 0-d scales are not)."""
    return isinstance(x, Tensor) and x.is_floating_point() and x.dim() >= 2


@init_doc
class MatryoshkaLoss(nn.Module):
    r"""A loss summed over nested prefixes of the embeddings (Matryoshka representations).

    For the strictly decreasing ``dims`` :math:`d_1 > \dots > d_M` and weights :math:`w_m`,

    .. math::

        \mathcal{L} = \sum_{m=1}^{M} w_m \,
            \mathcal{L}_\text{base}\big(\pi_{d_m}(a), \pi_{d_m}(t), \dots\big),
        \qquad \pi_d(x) = \frac{x_{1:d}}{\lVert x_{1:d} \rVert},

    the base loss on the first :math:`d` features of every embedding, each prefix
    re-normalised: a prefix of a unit vector is not one, and retrieval at :math:`d`
    scores cosines of prefixes. A base with ``normalize=True`` normalises the prefixes
    itself (the cut is all that is added); with ``normalize=False`` (inputs already unit)
    this wrapper normalises each prefix, so the base sees unit rows at every ``d`` (a
    zero prefix stays zero, as an absent KCL caption).

    What is cut: every floating-point positional input of two or more dims (audio ``(B,
    D)``, text ``(B, D)`` or KCL's ``(B, K, D)``, CACL's three) and the hard negatives
    ``hard_negatives=``/``audio_hard_negatives=``. Everything else (``ids``, KCL's
    ``mask``, the hard negatives' masks, a ``guide`` (its own space), ``logit_scale``,
    ...) goes to the base unchanged, as do the base's own settings (``chunk_size``,
    ``gather``, ``reduction``, ``validate_args``). Every embedding input must have the
    same last dim ``D``, at least ``dims[0]``: a ``ValueError`` names ``dims`` (or the
    input) otherwise, before any cut hides a mismatch. ``dims[0] == D`` trains the full
    embedding too.

    Across ranks each prefix's base call gathers its own prefixes (``len(dims)``
    gathers of ``sum(dims) / D`` the full volume in all), so every rank's loss and
    gradients are those of the base on each prefix: the DDP contract of the base holds
    term by term.

    Cost: one base call per dim. The prefixes' matmuls are :math:`\sum_m d_m / D` of the
    full one's (1.875 for ``(D, D/2, D/4, D/8)``), and each call pays the base's
    ``(B, B)`` softmaxes: 2.1x the base alone at ``B = 256``, ``D = 1024`` (one CPU
    thread). A plain one-process dense ``InfoNCELoss`` base called with ``(audio, text)``
    (and at most ``logit_scale``) without ``return_terms`` takes one pass instead: every
    prefix's logits as running sums of block products over the unit rows
    (``_matryoshka_nce``), one full product's matmuls, 1.5x the base alone; the same
    values and gradients to rounding.

    Args:
        base: the loss on each prefix: :class:`~contrastive_losses.InfoNCELoss`,
            :class:`~contrastive_losses.SigLIPLoss`, :class:`~contrastive_losses.KCLLoss`,
            :class:`~contrastive_losses.CACLLoss` or a
            :class:`~contrastive_losses.SupportVectorRegularizer` around one.
            :class:`~contrastive_losses.ASKLoss` is refused (its knowledge bank holds
            full-width embeddings that a prefix cannot query).
        dims: strictly decreasing prefix sizes, each ``>= 1`` and ``<= D`` (checked
            against the embeddings at each call), e.g. ``(768, 384, 192, 96)``.
        weights: one positive weight per dim; ``None``: all 1.

    Shape:
        ``forward(*inputs, return_terms=False, **kwargs)`` takes the base's inputs
        (audio ``(B, D)``, text ``(B, D)`` or ``(B, K, D)``, ...) and returns what the
        base returns: a scalar, or ``(B,)`` with the base's ``reduction="none"``.

    Example:
        >>> import torch
        >>> from contrastive_losses import InfoNCELoss, MatryoshkaLoss
        >>> loss_fn = MatryoshkaLoss(InfoNCELoss(), dims=(64, 32, 16, 8))
        >>> audio, text = torch.randn(8, 64), torch.randn(8, 64)
        >>> loss, terms = loss_fn(audio, text, return_terms=True)
        >>> [k for k in terms if k.startswith("loss@")]
        ['loss@64', 'loss@32', 'loss@16', 'loss@8']
        >>> total = sum(InfoNCELoss()(audio[:, :d], text[:, :d]) for d in (64, 32, 16, 8))
        >>> torch.allclose(loss, total)
        True
    """

    def __init__(
        self, base: nn.Module, dims: Sequence[int], weights: Sequence[float] | None = None
    ) -> None:
        super().__init__()
        self.base = _check_base(base)
        self.dims = _check_dims(dims)
        self.weights = _check_weights(weights, len(self.dims))
        self._normalize_prefix = not _normalizes(base)

    def extra_repr(self) -> str:
        return f"dims={self.dims}, weights={self.weights}"

    def forward(
        self, *inputs: Any, return_terms: bool = False, **kwargs: Any
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        r"""The weighted sum of the base's loss on each prefix.

        Args:
            *inputs: the base's positional inputs; the floating ones of two or more dims
                are cut to each prefix.
            return_terms: also return the detached terms: ``"loss@d"``, the base's
                (unweighted) loss at each ``d``, and the base's own terms at ``dims[0]``.
            **kwargs: the base's keyword inputs (``ids=``, ``mask=``, ``logit_scale=``,
                the hard negatives, ...).

        Returns:
            The loss, or ``(loss, terms)``.
        """
        self._check_widths(inputs, kwargs)
        if not return_terms and self._fused(inputs, kwargs):
            nested = functools.partial(nested_info_nce, dims=self.dims, weights=self.weights)
            base = typing.cast(InfoNCELoss, self.base)  # _fused checked its type
            return typing.cast(Tensor, base._loss(nested, *inputs, return_terms=False, **kwargs))
        cut = [self._prefixes(x) if _is_embedding(x) else None for x in inputs]
        cut_kw = {
            k: self._prefixes(v)
            for k, v in kwargs.items()
            if k in _EMBEDDING_KWARGS and _is_embedding(v)
        }
        total: Tensor | None = None
        terms: dict[str, Tensor] = {}
        for m, (d, w) in enumerate(zip(self.dims, self.weights, strict=True)):
            args = [x if c is None else c[m] for x, c in zip(inputs, cut, strict=True)]
            kw = {k: cut_kw[k][m] if k in cut_kw else v for k, v in kwargs.items()}
            if return_terms and m == 0:  # the base's terms of the widest prefix
                loss, base_terms = self.base(*args, return_terms=True, **kw)
                terms.update(base_terms)
            else:
                loss = self.base(*args, **kw)
            if return_terms:
                terms[f"loss@{d}"] = loss.detach()
            term = loss if w == 1.0 else loss * w  # 1.0: no op, the base's loss exactly
            total = term if total is None else total + term
        assert total is not None  # dims is not empty (checked when built)
        return (total, terms) if return_terms else total

    def _fused(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the call takes :func:`nested_info_nce`: every prefix's logits from one
        pass over the features (1.875 full products' matmuls become one for four
        halvings). The base must be a plain ``InfoNCELoss`` (not a subclass, whose forward
        may differ) computing the one-process dense mean of normalised rows, called with
        ``(audio, text)`` and at most a ``logit_scale``; anything else (ids, hard
        negatives, a guide, ``chunk_size``, gathering, terms) takes the per-prefix calls."""
        base = self.base
        return (
            type(base) is InfoNCELoss
            and len(inputs) == 2
            and set(kwargs) <= {"logit_scale"}
            and base.reduction == "mean"
            and base.normalize
            and base.chunk_size is None
            and not resolve_gather(base.gather)
        )

    def _prefixes(self, x: Tensor) -> tuple[Tensor, ...]:
        """The first ``d`` features of ``x`` for each ``d`` of ``dims``, unit rows where the
        base does not normalise (``F.normalize``: a zero row, an absent caption, stays
        zero)."""
        # The whole row uncut (a slice's backward fills a (..., D) tensor of zeros); the
        # rest plain slices: one autograd node adding their gradients in place measured
        # 10% slower at B = 256, D = 1024.
        cut = tuple(x if d == x.shape[-1] else x[..., :d] for d in self.dims)
        return tuple(F.normalize(p, dim=-1) for p in cut) if self._normalize_prefix else cut

    def _check_widths(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Every embedding input has one last dim ``D >= dims[0]`` (static: no sync)."""
        named = [(f"inputs[{i}]", x) for i, x in enumerate(inputs) if _is_embedding(x)]
        named += [(k, kwargs[k]) for k in _EMBEDDING_KWARGS if _is_embedding(kwargs.get(k))]
        if not named:
            return  # the base words what is missing or wrong
        first, x0 = named[0]
        width = x0.shape[-1]
        for name, x in named[1:]:
            if x.shape[-1] != width:
                raise ValueError(
                    f"{name}: last dim {x.shape[-1]} differs from {first}'s {width}; every "
                    "embedding must have the same D before it is cut to the dims' prefixes"
                )
        if self.dims[0] > width:
            raise ValueError(
                f"dims: {self.dims[0]} exceeds the embeddings' dim D = {width} "
                f"({first} has shape {tuple(x0.shape)}); every dim must be <= D"
            )
