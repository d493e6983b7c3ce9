r"""open_clip's ``ClipLoss`` and ``SigLipLoss``, backed by this library's losses.

Swap the import and keep the rest of a training script that builds open_clip's loss
itself::

    # from open_clip.loss import ClipLoss, SigLipLoss
    from contrastive_losses.integrations.open_clip import ClipLoss, SigLipLoss

open_clip's own trainer (``open_clip_train.main``) builds its loss through
``open_clip.factory``: there, :func:`contrastive_losses.integrations.open_clip_train.install`
does it.

The classes take open_clip's constructor arguments and ``forward(image_features,
text_features, logit_scale[, logit_bias], output_dict=False)`` and return what open_clip's
return (a scalar, or ``{"contrastive_loss": loss}`` with ``output_dict``); the values and
gradients equal open_clip 3.x's (tested to 1e-6, one process and two; where open_clip's
``gather_with_grad=False`` gradient is not the exact one, ours stays exact: see
:class:`ClipLoss`). Nothing is imported from open_clip. What they add, as keyword-only arguments:

* ``chunk_size``: the exact tiled path, ``O(B * chunk_size)`` memory for the logits
  (see "Large batches");
* ``ids`` in ``forward``: pairs that share an id are all positives (a clip drawn twice in a
  batch is no false negative);
* ``svr``: SupCLAP's :class:`~contrastive_losses.SupportVectorRegularizer` around the loss,
  with these keyword arguments (``{}`` for its defaults);
* uneven batch sizes across ranks (open_clip's gather needs equal ones).

Like open_clip's, the losses take the features as given: open_clip's models L2-normalise
them in ``encode_image`` / ``encode_text``.
"""

from __future__ import annotations

import typing
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import _checks
from .._common import _check_logit_scale
from .._docs import init_doc
from .._settings import _LossSettings
from ..distributed import counted_call, is_distributed, outer_settings, validate_together
from ..infonce import InfoNCELoss, info_nce
from ..siglip import SigLIPLoss, siglip
from ..svr import SupportVectorRegularizer

__all__ = ["ClipLoss", "SigLipLoss"]

#: open_clip's ``SigLipLoss(dist_impl=...)`` choices: four ways to pass the text features
#: round the ranks, one loss; here one all-gather serves them all.
DIST_IMPLS = ("bidir", "shift", "reduce", "gather")


class _OpenClipSettings(nn.Module):
    """What both drop-ins share: open_clip's ``rank`` / ``world_size``, and ``loss``, our
    Module that computes it (wrapped in the regulariser with ``svr``)."""

    def _init_settings(
        self,
        cache_labels: bool,
        rank: int,
        world_size: int,
        svr: Mapping[str, Any] | None,
        validate_args: bool | None,
    ) -> None:
        self.world_size = _checks.check_int(world_size, "world_size", 1)
        self.rank = _checks.check_int(rank, "rank", 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank: {rank} is not below world_size={world_size}")
        if svr is not None and not isinstance(svr, Mapping):
            raise TypeError(
                "svr: expected None or a dict of SupportVectorRegularizer keyword arguments "
                f"(e.g. {{'radius': 'dynamic'}}), got {type(svr).__name__}"
            )
        self.cache_labels = cache_labels  # open_clip caches its label vector; none is built here
        self.svr = svr
        self.validate_args = validate_args

    def _set_loss(self, base: nn.Module) -> None:
        """``loss``: ``base``, or the regulariser around it with ``svr``. Without ``svr``
        ``forward`` calls ``base``'s functional form with ``base``'s settings, as
        ``base`` does, skipping two Modules' dispatch (5% of a call at ``B = 32``; ``base``
        holds no parameter, so no hook or optimizer sees the difference)."""
        self.loss: nn.Module = (
            base if self.svr is None else SupportVectorRegularizer(base, **self.svr)
        )

    def _rank_mean(self, loss: Tensor, rows: Tensor) -> Tensor:
        """open_clip's value on each rank, the mean over this rank's rows, with the exact
        gradient of the library's loss.

        Our ``loss`` is ``world * (this rank's row sum) / N`` (``N`` rows on all ranks):
        its mean over ranks is the global-batch loss and its gradient, averaged over ranks
        by DDP, the global-batch gradient. open_clip returns ``(row sum) / b`` on each
        rank (``b`` its rows); the two agree on even shards. On uneven ones (allowed here,
        with the value checks on) the value is rescaled to open_clip's, ``N / (world *
        b)`` (``N`` from one all-reduce of ``b``, on the device, no host sync) and the
        gradient stays the exact one: logs then show what each rank of open_clip shows,
        and training follows the global-batch loss. With the checks off every rank holds
        ``b = N / world`` rows (the library's rule), so nothing is exchanged."""
        if not _checks.resolve_validate(self.validate_args):
            return loss
        total = torch.full((1,), rows.shape[0], dtype=torch.int64, device=loss.device)
        dist.all_reduce(total)  # N, exact (a bfloat16 count is not)
        wide = torch.promote_types(loss.dtype, torch.float32)
        factor = total[0].to(wide) / (rows.shape[0] * self.world_size)  # 1 on even shards
        return loss + (loss.detach() * (factor - 1))

    def _base_settings(self) -> dict[str, Any]:
        """The keyword arguments ``loss`` (without ``svr``) passes its functional form."""
        # from _modules itself: nn.Module's __getattr__ is a Python-level lookup (~1 us)
        return typing.cast(_LossSettings, self._modules["loss"])._settings()

    @property
    def gather(self) -> bool:
        """Whether the loss gathers across ranks: open_clip's ``world_size > 1``."""
        return self.world_size > 1

    def _check_world(self, ref: Tensor) -> None:
        """``rank`` and ``world_size`` must be the process group's (with one exception: no
        process group, or one of a single rank, and ``world_size=1``). A mismatch under a
        process group of several ranks is raised through the ranks' exchange, so every
        rank that calls the loss raises it, none waits in a collective the other skipped:
        ``world_size=1`` there would compute a local loss on that rank, silently."""
        if not self.gather and not is_distributed():
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"world_size: {self.world_size} needs torch.distributed to be initialised "
                "(torch.distributed.init_process_group) before the loss is called"
            )
        if (dist.get_rank(), dist.get_world_size()) == (self.rank, self.world_size):
            return
        problem = ValueError(
            f"rank, world_size: given {self.rank}, {self.world_size} but torch.distributed "
            f"runs rank {dist.get_rank()} of {dist.get_world_size()}; pass "
            "rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size() "
            "(open_clip's args.rank, args.world_size)"
        )
        if not is_distributed():
            raise problem
        # every rank raises it (the lowest rank's), compiled too
        with validate_together(True, ref, requested=True):
            raise problem

    _repr = ""  # the subclass's own settings

    def extra_repr(self) -> str:
        return f"{self._repr}rank={self.rank}, world_size={self.world_size}"


@init_doc
class ClipLoss(_OpenClipSettings):
    r"""open_clip's ``ClipLoss``: symmetric InfoNCE on the model's logit scale.

    .. math::

        \mathcal{L} = \frac{1}{2B}\sum_{i=1}^{B}\Big(
            -\log \frac{e^{c\langle x_i, y_i\rangle}}{\sum_j e^{c\langle x_i, y_j\rangle}}
            -\log \frac{e^{c\langle y_i, x_i\rangle}}{\sum_j e^{c\langle y_i, x_j\rangle}}\Big)

    with image features :math:`x`, text features :math:`y` and the model's logit scale
    :math:`c` (``logit_scale``, already exp'd): :class:`~contrastive_losses.InfoNCELoss`
    with ``logit_scale=`` per call, features taken as given (``normalize=False``).

    Under ``world_size > 1`` every rank's features are all-gathered (uneven batch sizes
    allowed) and each rank computes its own rows against the global batch, as open_clip's
    ``local_loss=True``; the value is then open_clip's: this rank's mean with ``local_loss``
    (the mean over this rank's rows, as each rank of open_clip logs it), the global-batch
    loss without. On uneven shards that per-rank mean is kept (open_clip's convention, so
    logs read as open_clip's would), rescaled from the library's own per-rank value
    (``world`` times this rank's row sum over the global batch size, whose mean over ranks
    is the global-batch loss); the mean over ranks of the values is then the mean of the
    ranks' means (weight each by its rows for the global-batch loss). The gradient is
    always the exact one, open_clip's with
    ``gather_with_grad=True`` (the feature gradients flow back through the gather to their
    rank; the mean over ranks of the gradients, what DDP applies, is the gradient of the
    global-batch loss). open_clip's ``gather_with_grad=False`` differs from it: with
    ``local_loss`` it drops the gradient through the other ranks' copies of a rank's
    features, without it the feature gradients are ``1/world_size`` of the exact ones; the
    constructor warns about it. The scale's gradient is shared out over the ranks
    differently (each rank's rows are scaled before the gather here, after it in
    open_clip); its mean over ranks, what DDP applies, is the same.

    Args:
        local_loss: open_clip's flag: this rank's rows against the global batch (the value
            is this rank's mean); ``False``: the value is the global-batch loss. Under
            ``world_size > 1`` every rank must pass the same (it picks the collective
            after the loss): ranks that differ raise one ``ValueError`` naming it.
        gather_with_grad: open_clip's flag; the gradient here is the exact one either way
            (above), so ``False`` with ``world_size > 1`` warns.
        cache_labels: accepted for open_clip's signature; no label vector is built here.
        rank: this process's rank (open_clip's ``args.rank``).
        world_size: the number of ranks; above 1 the features are gathered, which needs
            ``torch.distributed`` initialised with that many ranks. It must be the process
            group's: ``world_size=1`` (the default) called under a group of several ranks
            raises on every rank that calls the loss, instead of computing a local loss.
        use_horovod: not supported (``True`` raises); launch with ``torchrun``.
        chunk_size: ``None`` (dense) or the column tile of the exact memory-bounded path.
        svr: ``None``, or keyword arguments of
            :class:`~contrastive_losses.SupportVectorRegularizer` (e.g.
            ``{"radius": "dynamic"}``) to add SupCLAP's regulariser; its parameters (the
            radius) are this Module's: hand ``loss.parameters()`` to the optimizer.
        validate_args: the value checks (host syncs) on, off or the global default.

    Shape:
        ``forward(image_features (B, D), text_features (B, D), logit_scale (), logit_bias
        () = None, output_dict=False, *, ids (B,) = None)`` -> scalar, or
        ``{"contrastive_loss": scalar}`` with ``output_dict``. ``logit_bias`` (a 0-d
        tensor; another shape is a ``ValueError`` naming it) shifts every logit alike, so it
        cancels in the softmax (value and gradient unchanged, as in open_clip); it gets a
        zero gradient, so DDP sees it used.

    The scale multiplies the image features in their dtype, as open_clip's
    ``logit_scale * image_features @ text_features.T``: a float16 or bfloat16 scale with
    float32 features is taken exactly, and the values and gradients equal open_clip's to
    its own precision in half precision too.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_losses.integrations.open_clip import ClipLoss
        >>> image = F.normalize(torch.randn(8, 32), dim=-1)  # what open_clip's model returns
        >>> text = F.normalize(torch.randn(8, 32), dim=-1)
        >>> logit_scale = torch.tensor(1 / 0.07)  # model.logit_scale.exp()
        >>> out = ClipLoss()(image, text, logit_scale, output_dict=True)
        >>> list(out), out["contrastive_loss"].shape
        (['contrastive_loss'], torch.Size([]))
    """

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
        *,
        chunk_size: int | None = None,
        svr: Mapping[str, Any] | None = None,
        validate_args: bool | None = None,
    ) -> None:
        super().__init__()
        if use_horovod:
            raise ValueError(
                "use_horovod: Horovod is not supported; launch with torchrun "
                "(torch.distributed), as open_clip does without --horovod"
            )
        self._init_settings(cache_labels, rank, world_size, svr, validate_args)
        base = InfoNCELoss(
            normalize=False, gather=self.gather, chunk_size=chunk_size, validate_args=validate_args
        )
        self._set_loss(base)
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.use_horovod = use_horovod
        self._repr = f"local_loss={local_loss}, gather_with_grad={gather_with_grad}, "
        if self.gather and not gather_with_grad:
            warnings.warn(
                "ClipLoss(gather_with_grad=False): open_clip's gradient then "
                + (
                    "drops the part through the other ranks' copies of each rank's features"
                    if local_loss
                    else "scales the feature gradients by 1/world_size"
                )
                + "; this drop-in computes the exact gradient, open_clip's with "
                "gather_with_grad=True (the values are open_clip's either way)",
                stacklevel=2,
            )

    @counted_call
    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor,
        logit_bias: Tensor | None = None,
        output_dict: bool = False,
        *,
        ids: Tensor | None = None,
    ) -> Tensor | dict[str, Tensor]:
        """The loss of this rank's batch.

        Args:
            image_features: ``(B, D)``, as the model returns them (normalised).
            text_features: ``(B, D)``; ``text_features[i]`` is the positive of
                ``image_features[i]``.
            logit_scale: the model's exp'd scale, a 0-d tensor (gradient flows back).
            logit_bias: optional 0-d tensor; cancels in the softmax (a zero gradient).
            output_dict: return ``{"contrastive_loss": loss}`` instead of ``loss``.
            ids: optional integer sample ids ``(B,)``; equal ids are positives.

        Returns:
            A scalar, or ``{"contrastive_loss": scalar}`` with ``output_dict``.
        """
        self._check_world(image_features)
        if logit_bias is not None:  # one bias for every logit, as the scale
            _check_logit_scale(logit_bias, image_features, False, "logit_bias", is_scale=False)
        if self.gather:
            # local_loss picks the collective after the loss (an int64 all-reduce or a
            # float one): compared in the loss's exchange, before either
            with outer_settings(local_loss=bool(self.local_loss)):
                loss = self._clip_loss(image_features, text_features, logit_scale, ids)
            loss = (
                self._rank_mean(loss, image_features) if self.local_loss else _mean_over_ranks(loss)
            )
        else:
            loss = self._clip_loss(image_features, text_features, logit_scale, ids)
        if logit_bias is not None:  # cancels in the softmax: a zero gradient, no new value
            loss = loss + 0.0 * logit_bias
        return {"contrastive_loss": loss} if output_dict else loss

    def _clip_loss(
        self, image: Tensor, text: Tensor, logit_scale: Tensor, ids: Tensor | None
    ) -> Tensor:
        """The library's loss of this rank's rows (before open_clip's per-rank value)."""
        if self.svr is None:  # the functional form, as self.loss calls it
            out = info_nce(image, text, ids=ids, logit_scale=logit_scale, **self._base_settings())
            return typing.cast(Tensor, out)
        return typing.cast(Tensor, self.loss(image, text, ids, logit_scale=logit_scale))


@init_doc
class SigLipLoss(_OpenClipSettings):
    r"""open_clip's ``SigLipLoss``: the pairwise sigmoid loss on the model's scale and bias.

    .. math::

        \mathcal{L} = -\frac1B \sum_{i=1}^{B} \sum_{j=1}^{N}
            \log \sigma\big(z_{ij}\,(c\,\langle x_i, y_j\rangle + b)\big),
        \qquad z_{ij} = \pm 1 \text{ (positive / negative pair)},

    :class:`~contrastive_losses.SigLIPLoss` with scale :math:`c` (``logit_scale=``) and
    bias :math:`b` (``logit_bias=``) per call, features taken as given. Under
    ``world_size > 1`` this rank's :math:`B` images meet the texts of every rank
    (:math:`N` in all, gathered once whatever ``dist_impl`` says; uneven batch sizes
    allowed); the value and the gradients are open_clip's for each ``dist_impl``. On
    uneven shards each rank's value is open_clip's convention, the mean over this rank's
    rows, and the gradients stay those of the global-batch loss (see :class:`ClipLoss`).

    Args:
        cache_labels: accepted for open_clip's signature; no label matrix is built here.
        rank: this process's rank.
        world_size: the number of ranks; above 1 the text features are gathered. It must
            be the process group's, as in :class:`ClipLoss`.
        dist_impl: open_clip's exchange, one of ``"bidir"`` (``None``), ``"shift"``,
            ``"reduce"``, ``"gather"``: checked and kept, the same loss for each.
        chunk_size: ``None`` (dense) or the column tile of the exact memory-bounded path.
        svr: ``None`` or keyword arguments of
            :class:`~contrastive_losses.SupportVectorRegularizer`, as in :class:`ClipLoss`.
        validate_args: the value checks (host syncs) on, off or the global default.

    Shape:
        ``forward(image_features (B, D), text_features (B, D), logit_scale (), logit_bias
        (), output_dict=False, *, ids (B,) = None)`` -> scalar, or
        ``{"contrastive_loss": scalar}``. ``logit_bias=None`` means no bias.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_losses.integrations.open_clip import SigLipLoss
        >>> image = F.normalize(torch.randn(8, 32), dim=-1)
        >>> text = F.normalize(torch.randn(8, 32), dim=-1)
        >>> loss = SigLipLoss()(image, text, torch.tensor(10.0), torch.tensor(-10.0))
        >>> loss.shape
        torch.Size([])
    """

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: str | None = None,
        *,
        chunk_size: int | None = None,
        svr: Mapping[str, Any] | None = None,
        validate_args: bool | None = None,
    ) -> None:
        super().__init__()
        self._init_settings(cache_labels, rank, world_size, svr, validate_args)
        self.dist_impl = dist_impl or "bidir"
        _checks.check_choice(self.dist_impl, "dist_impl", DIST_IMPLS)
        self._repr = f"dist_impl={self.dist_impl!r}, "
        base = SigLIPLoss(  # bias_init 0: open_clip adds no bias when logit_bias is None
            bias_init=0.0,
            learnable=False,
            normalize=False,
            gather=self.gather,
            chunk_size=chunk_size,
            validate_args=validate_args,
        )
        self._set_loss(base)

    @counted_call
    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor,
        logit_bias: Tensor | None,
        output_dict: bool = False,
        *,
        ids: Tensor | None = None,
    ) -> Tensor | dict[str, Tensor]:
        """The loss of this rank's images against every rank's texts.

        Args:
            image_features, text_features, output_dict, ids: as in :meth:`ClipLoss.forward`.
            logit_scale: the model's exp'd scale :math:`c`, a 0-d tensor.
            logit_bias: the model's bias :math:`b`, a 0-d tensor, or ``None`` (no bias).

        Returns:
            A scalar, or ``{"contrastive_loss": scalar}`` with ``output_dict``.
        """
        self._check_world(image_features)
        if self.svr is None:  # the functional form, as self.loss calls it
            settings = self._base_settings()
            bias = {"bias": self.loss.bias} if logit_bias is None else {"logit_bias": logit_bias}
            out = siglip(
                image_features, text_features, ids=ids, logit_scale=logit_scale, **bias, **settings
            )
            loss = typing.cast(Tensor, out)
        else:
            bias = {} if logit_bias is None else {"logit_bias": logit_bias}
            loss = self.loss(image_features, text_features, ids, logit_scale=logit_scale, **bias)
        if self.gather:
            loss = self._rank_mean(loss, image_features)
        return {"contrastive_loss": loss} if output_dict else loss


def _mean_over_ranks(loss: Tensor) -> Tensor:
    """The mean of ``loss`` over ranks as the value, ``loss``'s own gradient: each rank's
    loss here has the global-batch loss as its mean over ranks, which is open_clip's
    value without ``local_loss``, and the gradient is already the exact one."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return loss + (total / dist.get_world_size() - loss.detach())
