r"""CACL: audio-English co-anchor contrastive learning (ATRI, Yin et al., ACL 2025,
Eq. 12-13).

Three symmetric InfoNCE terms over (audio, English caption, caption in a language drawn
per sample). :func:`cacl` is the maths, :func:`sample_languages` the draw of ATRI's
:math:`q_i` (and of the ML-CLAP random-language baseline), :class:`CACLLoss` the Module.
KCL, ATRI's other loss, is :mod:`contrastive_losses.kcl`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _checks, _compat
from ._common import (
    ContrastivePair,
    Terms,
    _batch,
    _check_pair,
    _embeddings,
    _finish,
    _logit_range,
    _reduce,
    _resolve_scale,
    _scale_setting,
)
from ._docs import init_doc
from ._kernels import widen
from ._nce_rows import _info_nce_rows
from ._settings import _TemperatureMixin
from .distributed import counted_call, resolve_gather, validate_together

__all__ = ["CACLLoss", "cacl", "sample_languages"]


@_compat.autocast_off
def cacl(
    audio: Tensor,
    english: Tensor,
    other: Tensor,
    temperature: float | Tensor = 0.07,
    *,
    logit_scale: Tensor | None = None,
    normalize: bool = True,
    reduction: str = "mean",
    gather: bool | None = None,
    return_terms: bool = False,
    chunk_size: int | None = None,
    validate_args: bool | None = None,
) -> Tensor | tuple[Tensor, Terms]:
    r"""Audio–English co-anchor contrastive loss (CACL, ATRI Eq. 12–13).

    Three symmetric InfoNCE terms over the triplet (audio, English caption, caption in a
    randomly drawn other language :math:`q_i`):

    .. math::

        \mathcal{L} = \frac{\mathcal{L}_{ae} + \mathcal{L}_{at} + \mathcal{L}_{et}}{6N},

    where each :math:`\mathcal{L}_{xy}` is the sum over the batch of the two directional
    InfoNCE terms between modalities :math:`x` and :math:`y`. It equals the mean of the
    three symmetric :func:`info_nce` means. Draw :math:`q_i` with :func:`sample_languages`.
    float16/bfloat16 inputs are computed in float32, the loss returned in their dtype.

    Args:
        audio: ``(B, D)``.
        english: English captions ``(B, D)``.
        other: captions in the other language ``(B, D)``.
        temperature: :math:`\tau \ge 10^{-4}`.
        logit_scale: the model's exp'd logit scale :math:`1/\tau` as a 0-d tensor
            (open_clip's and Hugging Face's ``logit_scale.exp()``), used instead of
            ``temperature`` (leave that at its default); its gradient flows back to the
            model. At most :math:`10^4`; checked positive and finite with the value checks.
        normalize: L2-normalise the inputs first.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (``(B,)``, mean of the three terms).
        gather: all-gather across ranks.
        return_terms: also return ``{"loss_audio_english", "loss_audio_other",
            "loss_english_other"}`` (each a symmetric InfoNCE mean).
        chunk_size: ``None`` (dense) or the column tile of the memory-bounded path, as
            in :func:`~contrastive_losses.functional.info_nce`.
        validate_args: value checks on, off (no host sync) or ``None`` (the global
            default), as in :func:`~contrastive_losses.functional.info_nce`.

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
    validate = _checks.resolve_validate(validate_args)
    with validate_together(enabled, audio, validate=validate, requested=validate_args) as v:
        _checks.check_reduction(reduction)
        scale = _resolve_scale(temperature, logit_scale, audio, validate)
        _checks.check_chunk_size(chunk_size)
        a, e, o = (
            _embeddings(x, name, "(B, D)", normalize, v.min_batch, validate, wide=True)
            for x, name in ((audio, "audio"), (english, "english"), (other, "other"))
        )
        # the inputs as given: normalised half rows are float32
        _check_pair(audio, "audio", english, "english")
        _check_pair(audio, "audio", other, "other")
        pairs = [(a, "audio", e, "english"), (a, "audio", o, "other"), (e, "english", o, "other")]
        _logit_range(pairs, normalize, validate, scale=scale)
        v.batch = a.shape[0]
        v.agree(audio=audio, english=english, other=other)
        v.settings(
            **_scale_setting(temperature, logit_scale),
            reduction=reduction,
            chunk_size=chunk_size,
            normalize=normalize,
        )
    dtype = audio.dtype  # of the loss; half inputs are computed in float32
    a, e, o = widen(a), widen(e), widen(o)
    a, e, o = v.ordered(a, e, o)  # gathered only after the ranks' exchange
    per_sample: list[Tensor] = []
    terms: Terms = {}
    batch = _batch(0, a.shape[0], False)
    for name, (x, y) in {
        "loss_audio_english": (a, e),
        "loss_audio_other": (a, o),
        "loss_english_other": (e, o),
    }.items():
        x2y, y2x, batch = _info_nce_rows(x, y, scale, None, enabled, chunk_size, validate)
        per_sample.append((x2y + y2x) / 2)
        terms[name] = _reduce(per_sample[-1], "mean", batch.n_global, batch)
    loss = _reduce(torch.stack(per_sample).mean(0), reduction, batch.n_global, batch)
    return _finish(loss, terms, return_terms, dtype)


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
    return _sample_languages(
        mask_or_num_languages, batch_size, generator, english_index, include_english, True
    )


def _sample_languages(
    mask_or_num_languages: Tensor | int,
    batch_size: int | None,
    generator: torch.Generator | None,
    english_index: int,
    include_english: bool,
    validate: bool,
) -> Tensor:
    """:func:`sample_languages`; the check for samples with nothing to draw (a host sync)
    with ``validate`` only. Without it such a sample draws uniformly among the languages
    it may draw (all but English for CACL), as if every caption were present: a defined
    draw, where ``torch.multinomial`` would raise its own error (or, on CUDA, assert)."""
    if isinstance(mask_or_num_languages, Tensor):
        mask = _checks.check_tensor(mask_or_num_languages, "mask_or_num_languages")
        _checks.check_materialised(mask, "mask_or_num_languages")
        if mask.dim() != 2 or mask.dtype != torch.bool:
            raise ValueError(
                "mask_or_num_languages: expected a bool (B, K) mask, got "
                f"dtype {mask.dtype} shape {_checks.shape_of(mask)}"
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
    if not include_english and k_langs < 2:
        raise ValueError(
            f"mask_or_num_languages: K = {k_langs} language leaves no non-English caption to draw"
        )
    weights = mask.to(torch.float32)
    allowed = torch.ones_like(weights)
    if not include_english:
        weights[:, english_index] = 0
        allowed[:, english_index] = 0
    empty = weights.sum(dim=1) == 0
    if validate and bool(empty.any()):
        rows = torch.nonzero(empty).flatten().tolist()[:10]
        what = "caption" if include_english else "non-English caption"
        raise ValueError(f"mask_or_num_languages: sample(s) {rows} have no {what} to draw")
    weights = torch.where(empty[:, None], allowed, weights)  # no sync: see the docstring
    return torch.multinomial(weights, 1, generator=generator).squeeze(1)


def _check_other_index(
    index: Tensor, k_langs: int, english_index: int, mask: Tensor | None
) -> None:
    """The values of CACL's other-language indices ``(B,)``: in range, not English, at
    present captions (host syncs)."""
    if bool(((index < 0) | (index >= k_langs)).any()):
        raise ValueError(f"other: language indices must lie in [0, {k_langs}), got {index}")
    if bool((index == english_index).any()):
        raise ValueError(f"other: index {english_index} is English; CACL needs another")
    rows = torch.arange(index.shape[0], device=index.device)
    if mask is not None and not bool(mask[rows, index].all()):
        raise ValueError("other: points at captions that the mask marks absent")


@init_doc
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
        normalize, reduction, gather, chunk_size, validate_args: as in
            :class:`InfoNCELoss`; without value checks ``other_index`` is not checked
            against the languages and the mask (an index out of range fails in indexing),
            and a sample whose mask row has no non-English caption draws among all the
            non-English languages (with the checks on it is refused).

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
        chunk_size: int | None = None,
        validate_args: bool | None = None,
    ) -> None:
        super().__init__()
        self._init_settings(normalize, reduction, gather, chunk_size, validate_args)
        self._init_temperature(temperature, learnable_temperature, max_logit_scale)
        self.english_index = _checks.check_int(english_index, "english_index", 0)

    def _extra_settings(self) -> list[str]:
        return [f"english_index={self.english_index}"]

    def triplet(
        self,
        audio: Tensor,
        english_or_text: Tensor,
        other: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Resolve the two call forms to ``(audio, english, other)``, each ``(B, D)``.

        In the ``(B, K, D)`` form errors about the captions name ``text`` (the English and
        drawn columns are checked here, so :func:`cacl` never reports them as
        ``english``/``other``)."""
        if (
            isinstance(other, Tensor)
            and other.dim() == 2
            and not (isinstance(english_or_text, Tensor) and english_or_text.dim() == 3)
        ):
            # (B, D) other captions: the triplet form, whose checks (in cacl) name english
            # when it is not (B, D) either.
            return audio, english_or_text, other
        if isinstance(english_or_text, Tensor) and english_or_text.dim() == 2:
            if other is None or not isinstance(other, Tensor) or other.dim() != 2:
                raise ValueError(
                    "other: with a (B, D) english tensor, pass the other-language "
                    "captions as a (B, D) tensor"
                )
            return audio, english_or_text, other
        # Under gather these checks run on every rank together (a rank's error is raised on
        # all), else one failing rank would leave the others waiting in cacl's gather; the
        # global batch size is cacl's to check.
        validate = _checks.resolve_validate(self.validate_args)
        enabled = resolve_gather(self.gather)
        with validate_together(
            enabled, english_or_text, min_global=0, validate=validate, requested=self.validate_args
        ) as v:
            a = _checks.check_embeddings(
                audio, "audio", ndim=2, dims="(B, D)", min_batch=v.min_batch, check_values=False
            )
            text = _checks.check_embeddings(
                english_or_text,
                "text",
                ndim=3,
                dims="(B, K, D)",
                check_values=False,
                min_batch=v.min_batch,
            )
            _checks.check_same_size(a, "audio", text, "text", 0, "batch size B")
            _checks.check_same_size(a, "audio", text, "text", -1, "embedding dim D")
            _checks.check_same_device_dtype([(a, "audio"), (text, "text")])
            b, k_langs = text.shape[:2]
            if k_langs == 0:
                raise ValueError(f"text: K = 0 languages (shape {_checks.shape_of(text)})")
            if self.english_index >= k_langs:
                raise ValueError(
                    f"english_index: {self.english_index} is outside the K = {k_langs} languages "
                    f"of text (shape {_checks.shape_of(text)})"
                )
            if isinstance(mask, Tensor) and tuple(mask.shape) != (b, k_langs):
                raise ValueError(
                    f"text, mask: text has shape {_checks.shape_of(text)} (B, K, D) but mask "
                    f"{_checks.shape_of(mask)}; the mask must be (B, K)"
                )
            if mask is not None:
                mask = _checks.check_mask(mask, "mask", (b, k_langs), text, validate=validate)
            if other is None:
                other = _sample_languages(
                    mask if mask is not None else k_langs,
                    b,
                    generator,
                    self.english_index,
                    False,
                    validate,
                )
            index = _checks.check_ids(other, "other", b, text)
            if validate:
                _check_other_index(index, k_langs, self.english_index, mask)
            rows = torch.arange(b, device=text.device)
            english, chosen = text[:, self.english_index], text[rows, index]
            if validate:  # value checks: host syncs
                # The captions cacl uses, checked as cacl would (values, and norms when it
                # normalises) but named after text; unused captions are not looked at.
                _checks.check_row_norms(
                    english, f"text[:, {self.english_index}]", nonzero=self.normalize
                )
                _checks.check_row_norms(chosen, "text[i, other[i]]", nonzero=self.normalize)
            v.batch = b
            v.settings(english_index=self.english_index)
        return v.ordered(audio, english, chosen)  # passed on after the ranks' exchange

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

    @counted_call
    def forward(
        self,
        audio: Tensor,
        english_or_text: Tensor,
        other: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
        logit_scale: Tensor | None = None,
        return_terms: bool = False,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        r"""The loss of one batch, in either call form.

        Args:
            audio: audio embeddings ``(B, D)``.
            english_or_text: English captions ``(B, D)``, or every language's captions
                ``(B, K, D)`` with English at ``english_index``.
            other: with ``(B, D)`` English, the other-language captions ``(B, D)``; with
                ``(B, K, D)`` text, the language index per sample ``(B,)``, or ``None`` to
                draw it (:func:`~contrastive_losses.functional.sample_languages`).
            mask: bool ``(B, K)`` of present captions (the ``(B, K, D)`` form).
            generator: the random source of the language draw.
            logit_scale: the model's exp'd scale :math:`1/\tau`, a 0-d tensor, used
                instead of this Module's temperature, with gradient; refused when the
                temperature is learnable here.
            return_terms: also return the detached terms ``{"loss_audio_english",
                "loss_audio_other", "loss_english_other", "temperature"}``.

        Returns:
            The loss, a scalar (``(B,)`` with ``reduction="none"``), or ``(loss, terms)``.
        """
        a, e, o = self.triplet(audio, english_or_text, other, mask=mask, generator=generator)
        return self._loss(cacl, a, e, o, logit_scale=logit_scale, return_terms=return_terms)

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
