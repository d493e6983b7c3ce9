r"""Loss Modules: hyperparameters, learnable parameters, and a ``forward`` that calls the
functional form in :mod:`contrastive_losses.functional`.

Each Module also tells which ``(anchor, candidates)`` pairs it contrasts
(:meth:`contrastive_pairs`), so wrappers such as the support-vector regulariser work on
any of them without an ``isinstance`` ladder.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from . import _checks
from . import functional as CF
from .distributed import resolve_gather, validate_together

__all__ = ["CACLLoss", "ContrastivePair", "InfoNCELoss", "KCLLoss", "SigLIPLoss"]


class ContrastivePair(NamedTuple):
    """One pair of aligned batches a loss contrasts: ``audio[i]`` matches ``text[i]``.

    ``mask`` ``(B,)`` marks the rows present (``None``: all).
    """

    audio: Tensor
    text: Tensor
    mask: Tensor | None = None


class _UpperClamp(torch.autograd.Function):
    """``min(x, bound)`` whose gradient at the bound still passes when descent moves
    ``x`` back inside (gradient > 0), and only the outward part is cut.

    A plain ``clamp`` zeroes the gradient at the bound, and ``log(1/0.01)`` rounds above
    ``log(100)`` in float32: a temperature initialised at the bound would never move.
    """

    @staticmethod
    def forward(ctx, x: Tensor, bound: float) -> Tensor:
        ctx.save_for_backward(x)
        ctx.bound = bound
        return x.clamp(max=bound)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (x,) = ctx.saved_tensors
        outward = (x >= ctx.bound) & (grad < 0)  # descent would push x further out
        return torch.where(outward, torch.zeros_like(grad), grad), None


class _TemperatureMixin(nn.Module):
    """Fixed or learnable temperature; learnable as a log logit scale clamped at
    ``max_logit_scale`` (CLIP's 100), so the temperature never falls below 1/100."""

    def _init_temperature(
        self, temperature: float, learnable: bool, max_logit_scale: float
    ) -> None:
        _checks.check_positive(temperature, "temperature")
        _checks.check_positive(max_logit_scale, "max_logit_scale")
        if max_logit_scale > 1.0 / CF.MIN_TEMPERATURE:
            raise ValueError(
                f"max_logit_scale: {max_logit_scale:g} exceeds 1/{CF.MIN_TEMPERATURE:g}, "
                "the smallest temperature the losses accept"
            )
        if temperature * max_logit_scale < 1 - 1e-6:  # the bound itself is fine
            raise ValueError(
                f"temperature: {temperature:g} is below 1/max_logit_scale = "
                f"{1.0 / max_logit_scale:g}, where it would be clamped; raise max_logit_scale"
            )
        self.learnable_temperature = learnable
        self.max_logit_scale = float(max_logit_scale)
        log_scale = torch.tensor(math.log(1.0 / temperature))
        if learnable:
            self.log_logit_scale = nn.Parameter(log_scale)
        else:
            self.register_buffer("log_logit_scale", log_scale)

    @property
    def temperature(self) -> Tensor:
        """Current temperature :math:`\\tau` as a 0-d tensor (differentiable if learnable)."""
        log_bound = math.log(self.max_logit_scale)
        return 1.0 / _UpperClamp.apply(self.log_logit_scale, log_bound).exp()


class InfoNCELoss(_TemperatureMixin):
    r"""Symmetric InfoNCE (CLIP/CLAP loss); see :func:`contrastive_losses.functional.info_nce`.

    Args:
        temperature: initial or fixed :math:`\tau` (default 0.07).
        learnable_temperature: learn :math:`\log(1/\tau)`, clamped at ``max_logit_scale``.
        max_logit_scale: upper bound of :math:`1/\tau` (CLIP: 100).
        normalize: L2-normalise inputs.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        gather: all-gather across ranks (``None``: when distributed).

    Shape:
        ``forward(audio (B, D), text (B, D), ids (B,) = None)`` -> scalar or ``(B,)``.

    Example:
        >>> import torch
        >>> from contrastive_losses import InfoNCELoss
        >>> loss_fn = InfoNCELoss(temperature=0.07, learnable_temperature=True)
        >>> loss, terms = loss_fn(torch.randn(8, 32), torch.randn(8, 32), return_terms=True)
        >>> sorted(terms)
        ['loss_a2t', 'loss_t2a', 'temperature']
    """

    def __init__(
        self,
        temperature: float = 0.07,
        *,
        learnable_temperature: bool = False,
        max_logit_scale: float = 100.0,
        normalize: bool = True,
        reduction: str = "mean",
        gather: bool | None = None,
    ) -> None:
        super().__init__()
        _checks.check_reduction(reduction)
        self._init_temperature(temperature, learnable_temperature, max_logit_scale)
        self.normalize = normalize
        self.reduction = reduction
        self.gather = gather

    def forward(
        self,
        audio: Tensor,
        text: Tensor,
        ids: Tensor | None = None,
        *,
        return_terms: bool = False,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        temperature = self.temperature
        out = CF.info_nce(
            audio,
            text,
            temperature,
            ids=ids,
            normalize=self.normalize,
            reduction=self.reduction,
            gather=self.gather,
            return_terms=return_terms,
        )
        return _with_terms(out, return_terms, temperature=temperature)

    def contrastive_pairs(
        self, audio: Tensor, text: Tensor, ids: Tensor | None = None
    ) -> list[ContrastivePair]:
        """The one ``(audio, text)`` pair this loss contrasts."""
        return [ContrastivePair(audio, text)]


class SigLIPLoss(nn.Module):
    r"""Pairwise sigmoid loss; see :func:`contrastive_losses.functional.siglip`.

    Args:
        scale_init: initial scale :math:`c` (SigLIP: 10, stored as :math:`\log c`).
        bias_init: initial bias :math:`b` (SigLIP: -10).
        learnable: learn scale and bias (default) or keep them fixed.
        normalize, reduction, gather: as in :class:`InfoNCELoss`.

    Shape:
        ``forward(audio (B, D), text (B, D), ids (B,) = None)`` -> scalar or ``(B,)``.

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
    ) -> None:
        super().__init__()
        _checks.check_positive(scale_init, "scale_init")
        if not torch.finfo(torch.float32).tiny <= scale_init <= 1.0 / CF.MIN_TEMPERATURE:
            raise ValueError(
                f"scale_init: {scale_init:g} is outside [{torch.finfo(torch.float32).tiny:.3g}, "
                f"{1.0 / CF.MIN_TEMPERATURE:g}] (the logit scale is 1/temperature)"
            )
        if isinstance(bias_init, bool) or not isinstance(bias_init, (int, float)):
            raise TypeError(f"bias_init: expected a float, got {type(bias_init).__name__}")
        if not abs(bias_init) <= 1.0 / CF.MIN_TEMPERATURE:  # False for NaN too
            raise ValueError(
                f"bias_init: must be finite with |bias_init| <= {1.0 / CF.MIN_TEMPERATURE:g}, "
                f"got {bias_init}"
            )
        _checks.check_reduction(reduction)
        log_scale = torch.tensor(math.log(scale_init))
        bias = torch.tensor(float(bias_init))
        if learnable:
            self.log_scale = nn.Parameter(log_scale)
            self.bias = nn.Parameter(bias)
        else:
            self.register_buffer("log_scale", log_scale)
            self.register_buffer("bias", bias)
        self.normalize = normalize
        self.reduction = reduction
        self.gather = gather

    @property
    def scale(self) -> Tensor:
        """Current logit scale :math:`c` (``exp`` of the stored :math:`\\log c`), a 0-d tensor."""
        return self.log_scale.exp()

    @property
    def temperature(self) -> Tensor:
        """:math:`1/c`, the temperature the sigmoid logits correspond to."""
        return 1.0 / self.scale

    def forward(
        self,
        audio: Tensor,
        text: Tensor,
        ids: Tensor | None = None,
        *,
        return_terms: bool = False,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        return CF.siglip(
            audio,
            text,
            self.scale,
            self.bias,
            ids=ids,
            normalize=self.normalize,
            reduction=self.reduction,
            gather=self.gather,
            return_terms=return_terms,
        )

    def contrastive_pairs(
        self, audio: Tensor, text: Tensor, ids: Tensor | None = None
    ) -> list[ContrastivePair]:
        """The one ``(audio, text)`` pair this loss contrasts."""
        return [ContrastivePair(audio, text)]


class KCLLoss(_TemperatureMixin):
    r"""1-to-K contrastive loss (ATRI); see :func:`contrastive_losses.functional.kcl`.

    Args:
        temperature, learnable_temperature, max_logit_scale: as in :class:`InfoNCELoss`.
        negatives: ``"per_language"`` (ATRI Eq. 9–11) or ``"all_languages"``.
        normalize, reduction, gather: as in :class:`InfoNCELoss`; ``"none"`` gives ``(B, K)``.

    Shape:
        ``forward(audio (B, D), text (B, K, D), mask (B, K) = None)`` -> scalar or ``(B, K)``.

    Example:
        >>> import torch
        >>> from contrastive_losses import KCLLoss
        >>> audio, text = torch.randn(4, 16), torch.randn(4, 8, 16)
        >>> KCLLoss(temperature=0.07)(audio, text).shape
        torch.Size([])
    """

    def __init__(
        self,
        temperature: float = 0.07,
        *,
        negatives: str = "per_language",
        learnable_temperature: bool = False,
        max_logit_scale: float = 100.0,
        normalize: bool = True,
        reduction: str = "mean",
        gather: bool | None = None,
    ) -> None:
        super().__init__()
        _checks.check_choice(negatives, "negatives", ("per_language", "all_languages"))
        _checks.check_reduction(reduction)
        self._init_temperature(temperature, learnable_temperature, max_logit_scale)
        self.negatives = negatives
        self.normalize = normalize
        self.reduction = reduction
        self.gather = gather

    def forward(
        self,
        audio: Tensor,
        text: Tensor,
        mask: Tensor | None = None,
        *,
        return_terms: bool = False,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        temperature = self.temperature
        out = CF.kcl(
            audio,
            text,
            temperature,
            mask=mask,
            negatives=self.negatives,
            normalize=self.normalize,
            reduction=self.reduction,
            gather=self.gather,
            return_terms=return_terms,
        )
        return _with_terms(out, return_terms, temperature=temperature)

    def contrastive_pairs(
        self, audio: Tensor, text: Tensor, mask: Tensor | None = None
    ) -> list[ContrastivePair]:
        """One ``(audio, captions of language k)`` pair per language, rows masked."""
        # Layout only: forward validated the batch (its size globally, under gather, where
        # a rank may hold one sample or none; a local minimum here would fail one rank alone).
        _checks.check_embeddings(
            text, "text", ndim=3, dims="(B, K, D)", min_batch=0, check_values=False
        )
        return [
            ContrastivePair(audio, text[:, k], None if mask is None else mask[:, k])
            for k in range(text.shape[1])
        ]


class CACLLoss(_TemperatureMixin):
    r"""Audio–English co-anchor loss (ATRI); see :func:`contrastive_losses.functional.cacl`.

    ``forward`` takes either the triplet ``(audio, english, other)`` of ``(B, D)``
    tensors, or ``(audio, text, other_index)`` with ``text`` ``(B, K, D)`` (English at
    ``english_index``) and ``other_index`` ``(B,)`` — or ``other_index=None`` to draw it
    with :func:`~contrastive_losses.functional.sample_languages` (uniform over the present
    non-English captions of ``mask``, reproducible with ``generator``).

    Args:
        temperature, learnable_temperature, max_logit_scale: as in :class:`InfoNCELoss`.
        english_index: column of English in ``text`` (default 0).
        normalize, reduction, gather: as in :class:`InfoNCELoss`.

    Shape:
        ``forward(audio (B, D), english (B, D), other (B, D))`` or
        ``forward(audio (B, D), text (B, K, D), other_index (B,) | None, mask=(B, K))``.

    Example:
        >>> import torch
        >>> from contrastive_losses import CACLLoss
        >>> audio, text = torch.randn(4, 16), torch.randn(4, 8, 16)
        >>> g = torch.Generator().manual_seed(0)
        >>> CACLLoss()(audio, text, generator=g).shape
        torch.Size([])
    """

    def __init__(
        self,
        temperature: float = 0.07,
        *,
        english_index: int = 0,
        learnable_temperature: bool = False,
        max_logit_scale: float = 100.0,
        normalize: bool = True,
        reduction: str = "mean",
        gather: bool | None = None,
    ) -> None:
        super().__init__()
        _checks.check_reduction(reduction)
        self._init_temperature(temperature, learnable_temperature, max_logit_scale)
        self.english_index = _checks.check_int(english_index, "english_index", 0)
        self.normalize = normalize
        self.reduction = reduction
        self.gather = gather

    def triplet(
        self,
        audio: Tensor,
        english_or_text: Tensor,
        other: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Resolve the two call forms to ``(audio, english, other)``, each ``(B, D)``."""
        text = _checks.check_tensor(english_or_text, "english_or_text")
        if text.dim() == 2:
            if other is None or not isinstance(other, Tensor) or other.dim() != 2:
                raise ValueError(
                    "other: with a (B, D) english tensor, pass the other-language "
                    "captions as a (B, D) tensor"
                )
            return audio, text, other
        # Under gather these checks run on every rank together (a rank's error is raised on
        # all), else one failing rank would leave the others waiting in cacl's gather; the
        # global batch size is cacl's to check.
        with validate_together(resolve_gather(self.gather), text, min_global=0) as v:
            text = _checks.check_embeddings(
                text,
                "english_or_text",
                ndim=3,
                dims="(B, K, D)",
                check_values=False,
                min_batch=v.min_batch,
            )
            b, k_langs = text.shape[:2]
            if self.english_index >= k_langs:
                raise ValueError(
                    f"english_index: {self.english_index} is outside the K = {k_langs} languages "
                    f"of english_or_text (shape {tuple(text.shape)})"
                )
            if mask is not None:
                mask = _checks.check_mask(mask, "mask", (b, k_langs), text)
            if other is None:
                other = CF.sample_languages(
                    mask if mask is not None else k_langs,
                    batch_size=b,
                    generator=generator,
                    english_index=self.english_index,
                )
            index = _checks.check_ids(other, "other", b, text)
            if bool(((index < 0) | (index >= k_langs)).any()):
                raise ValueError(f"other: language indices must lie in [0, {k_langs}), got {index}")
            if bool((index == self.english_index).any()):
                raise ValueError(
                    f"other: index {self.english_index} is English; CACL needs another"
                )
            if mask is not None and not bool(
                mask[torch.arange(b, device=text.device), index].all()
            ):
                raise ValueError("other: points at captions that the mask marks absent")
            rows = torch.arange(b, device=text.device)
            v.batch = b
        return audio, text[:, self.english_index], text[rows, index]

    def resolve_inputs(
        self,
        audio: Tensor,
        english_or_text: Tensor,
        other: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[tuple[Tensor, Tensor, Tensor], dict[str, object]]:
        """``forward`` arguments with the language draw made once: ``((a, e, o), {})``.

        Wrappers (:class:`~contrastive_losses.SupportVectorRegularizer`) call it so the
        loss and :meth:`contrastive_pairs` see the same triplet.
        """
        return self.triplet(audio, english_or_text, other, mask=mask, generator=generator), {}

    def forward(
        self,
        audio: Tensor,
        english_or_text: Tensor,
        other: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
        return_terms: bool = False,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        a, e, o = self.triplet(audio, english_or_text, other, mask=mask, generator=generator)
        temperature = self.temperature
        out = CF.cacl(
            a,
            e,
            o,
            temperature,
            normalize=self.normalize,
            reduction=self.reduction,
            gather=self.gather,
            return_terms=return_terms,
        )
        return _with_terms(out, return_terms, temperature=temperature)

    def contrastive_pairs(
        self,
        audio: Tensor,
        english_or_text: Tensor,
        other: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> list[ContrastivePair]:
        """The three pairs (audio, English), (audio, other), (English, other).

        With ``other=None`` the language is drawn here; pass the same ``generator`` state
        (or an explicit ``other``) to contrast the same triplet as ``forward``.
        """
        a, e, o = self.triplet(audio, english_or_text, other, mask=mask, generator=generator)
        return [ContrastivePair(a, e), ContrastivePair(a, o), ContrastivePair(e, o)]


def _with_terms(
    out: Tensor | tuple[Tensor, dict[str, Tensor]], return_terms: bool, **extra: Tensor
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """Add Module-level values (the current temperature) to the functional's terms."""
    if not return_terms:
        return out
    loss, terms = out
    terms.update({k: v.detach() for k, v in extra.items()})
    return loss, terms
