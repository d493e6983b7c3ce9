"""The Module of SupCLAP's support vector regularisation,
:class:`SupportVectorRegularizer` (re-exported by :mod:`contrastive_losses.svr` and the
package): its settings and their checks, the radius it holds (a scalar or a
:class:`~contrastive_losses.RadiusPredictor`) and the wiring around the base loss. The
maths is in :mod:`contrastive_losses._svr_rows`, the training checks in
:mod:`contrastive_losses._svr_monitor`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _checks, _compat
from ._common import _batch, _narrow, _temperature
from ._docs import init_doc
from ._kernels import _distance, _tiled_top_negatives, widen
from ._settings import _refuse_trainable, _scalar_repr, _stamp, _written_value
from ._svr_monitor import _RadiusMonitor
from ._svr_radius import (
    RadiusPredictor,
    _assemble_features,
    _check_similarity_peak,
    _checksum,
    check_radius,
)
from ._svr_rows import (
    _anchor_means,
    _logit_rows,
    _pair_masks,
    _pair_problems,
    _pair_similarities,
    _prepare_pairs,
    _radius_slope,
    _support_vector_logits,
    _tiled_radius_slope,
    _tiled_support_vector_rows,
)
from .distributed import counted_call, resolve_gather

RADIUS_MODES = ("static", "dynamic")
DIRECTIONS = ("bi", "uni")
# alpha and beta weigh terms of order log(B) against the base loss; 1e4 already drowns
# the base, and 1e40 overflowed the loss to inf in float32.
MAX_WEIGHT = 1e4


def _check_weight(value: float, name: str) -> None:
    _checks.check_non_negative(value, name)
    if value > MAX_WEIGHT:
        raise ValueError(f"{name}: must be <= {MAX_WEIGHT:g} (a loss weight), got {value}")


# Settings of the base losses, which the regulariser takes from its base: passed to the
# regulariser they are refused with a TypeError that shows where they go.
BASE_SETTINGS = (
    "chunk_size",
    "reduction",
    "normalize",
    "gather",
    "learnable_temperature",
    "max_logit_scale",
    "negatives",
    "english_index",
    "scale_init",
    "bias_init",
    "learnable",
)


def _refuse_base_settings(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``SupportVectorRegularizer.__init__``: a base loss' setting given to the
    regulariser raises a ``TypeError`` naming the base's call it belongs in (the signature
    shown by ``help`` and ``inspect`` stays the wrapped one)."""

    @functools.wraps(init)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        misplaced = [k for k in kwargs if k in BASE_SETTINGS]
        if misplaced:
            base = args[0] if args else kwargs.get("base")
            name = type(base).__name__ if isinstance(base, nn.Module) else "InfoNCELoss"
            given = ", ".join(f"{k}={kwargs[k]!r}" for k in misplaced)
            raise TypeError(
                f"{', '.join(misplaced)}: {'belongs' if len(misplaced) == 1 else 'belong'} "
                f"to the base loss, not the regulariser: SupportVectorRegularizer({name}"
                f"({given})); the regulariser follows its base's settings"
            )
        init(self, *args, **kwargs)

    return wrapper


def _check_regularizer_settings(
    base: object,
    direction: str,
    alpha: float,
    beta: float,
    constraint: object,
    radius_init: float,
    temperature: float | None,
    validate_args: bool | None,
) -> None:
    """The argument checks of :class:`SupportVectorRegularizer`'s ``__init__`` (its radius
    is checked where it is stored)."""
    _checks.resolve_validate(validate_args)  # the type
    if not isinstance(base, nn.Module) or not callable(getattr(base, "contrastive_pairs", None)):
        raise TypeError(
            "base: expected a loss Module exposing contrastive_pairs(...) (InfoNCELoss, "
            f"SigLIPLoss, KCLLoss, CACLLoss), got {type(base).__name__}"
        )
    if temperature is None and not hasattr(base, "temperature"):
        raise TypeError(
            f"base: {type(base).__name__} has no temperature property; pass temperature="
        )
    _refuse_trainable(temperature, "temperature", "learnable_temperature=True on the base")
    if temperature is not None:
        _temperature(temperature)
    _check_base_reduction(base)
    _checks.check_choice(direction, "direction", DIRECTIONS)
    _check_weight(alpha, "alpha")
    _check_weight(beta, "beta")
    _checks.check_non_negative(radius_init, "radius_init")
    check_radius(radius_init, "radius_init")
    if constraint is not None and not isinstance(constraint, bool):
        raise TypeError(f"constraint: expected None, True or False, got {constraint!r}")


def _build_radius(
    svr: SupportVectorRegularizer,
    radius: object,
    num_features: int,
    hidden: int,
    validate_args: bool | None,
) -> None:
    """Give ``svr`` its radius: a learned scalar (``"static"``), a
    :class:`RadiusPredictor` (``"dynamic"``) or a fixed float buffer."""
    if isinstance(radius, str):
        _checks.check_choice(radius, "radius", RADIUS_MODES)
        svr.radius_mode = radius
        if radius == "static":
            svr.radius = nn.Parameter(torch.tensor(svr.radius_init))
        else:
            svr.predictor = RadiusPredictor(
                num_features, hidden, svr.radius_init, validate_args=validate_args
            )
    elif isinstance(radius, (int, float)) and not isinstance(radius, bool):
        _checks.check_non_negative(radius, "radius")
        check_radius(radius)
        svr.radius_mode = "fixed"
        svr.register_buffer("radius", torch.tensor(float(radius)))
        svr._radius_value = float(radius)  # used, exact: see _scalar_radius
        svr._radius_stamp = _stamp(svr.radius)
    else:
        raise TypeError(
            f"radius: expected 'static', 'dynamic' or a float, got {type(radius).__name__}"
        )


@init_doc
class SupportVectorRegularizer(_RadiusMonitor, nn.Module):
    r"""SupCLAP's support vector regularisation around any loss of this library.

    .. math::

        \begin{aligned}
        \mathcal{L} &= \mathcal{L}_{base}
            + \alpha\,\mathcal{L}_{svr} + \beta\,\mathcal{L}_{con}, \qquad
        \mathcal{L}_{svr} = \tfrac12 \textstyle\sum_{d} \mathcal{L}_{svr}^{d}, \\
        \mathcal{L}_{con} &= \tfrac12 \textstyle\sum_{d} \operatorname{mean}_i\big(
            \mathrm{ReLU}(R_i - \lVert a_i - t_i\rVert) + \mathrm{ReLU}(-R_i)\big),
        \end{aligned}

    where :math:`d` runs over the directions used (text anchors for
    ``direction="uni"``; text and audio anchors for ``"bi"``) and
    :math:`\mathcal{L}_{svr}^{d}` is
    :func:`~contrastive_losses.functional.support_vector_term` on every
    ``(audio, text)`` pair the base contrasts (its ``contrastive_pairs``: one for
    InfoNCE and SigLIP, one per language for KCL with absent captions masked, three for
    CACL), the mean over all present anchors of all pairs (for KCL the same weighting
    as the base). SupCLAP's Eq. 5-6 *sum* the two InfoNCE directions and add
    :math:`\alpha` times each SVR direction; our bases are the *mean* of the two
    directions, so the :math:`\tfrac12` makes this loss exactly half the paper's for
    ``uni`` and ``bi`` alike: ``alpha`` and ``beta`` are the paper's :math:`\alpha`
    and :math:`\beta`. :math:`\lVert a_i - t_i\rVert` is detached in the
    constraint: it trains the radius and never pushes a positive pair apart.

    Radius: ``"static"`` — one learnable scalar shared by both directions;
    ``"dynamic"`` — a :class:`RadiusPredictor` per anchor (shared by both directions);
    a float — fixed. The predictor reads the anchor's row of :math:`\cos/\tau` (SupCLAP
    Sec. 3.2). The SVR logits use the base's ``temperature`` (SigLIP: ``1/scale``), or
    ``1/logit_scale`` when the model's scale is passed per call (``forward(...,
    logit_scale=s)``, which the base also gets), unless ``temperature`` is given,
    *detached*: a learnable temperature (or SigLIP's scale and bias, or the model's scale)
    learns from the base loss alone, as with the fixed :math:`\tau` of the papers.
    float16/bfloat16 embeddings run the SVR in float32 (its :math:`R/d` overflows float16
    for nearly aligned pairs). ``normalize`` and ``gather`` follow the
    base; under ``gather`` the anchors are this rank's rows against the global batch,
    scaled like the base so the mean over ranks is the single-process loss. A base whose
    forward draws randomness (CACL without ``other``) exposes ``resolve_inputs``; it is
    called once so the base loss and the SVR see the same draw.

    Where the radius goes: from :math:`t^{sup} = t + R\hat u`, one anchor's SVR row has

    .. math::

        \begin{aligned}
        \frac{\partial \ell}{\partial R}
        &= \frac{1}{\tau}\sum_j P_j \langle \hat u, a_j - a^+\rangle \\
        &= -\frac{1}{\tau d}\sum_{j \ne +} P_j \langle a^+ - t,\ a^+ - a_j\rangle,
        \qquad d = \lVert a^+ - t\rVert,
        \end{aligned}

    with :math:`P` the softmax at the support vector; the row is convex in :math:`R`.
    :math:`\langle a^+ - t, a^+ - a_j\rangle = (1 - \langle a^+, a_j\rangle) -
    (\langle t, a^+\rangle - \langle t, a_j\rangle)`: the SVR term pushes :math:`R`
    *down* when the text separates its clip from the hard negatives better than the
    audio does (typical when fine-tuning from pretrained weights, SupCLAP Fig. 3) and
    *up* otherwise (random weights, noisy embeddings, SupCLAP Fig. 6), up to where the
    constraint holds it. ``terms["svr_radius_slope"]`` logs the batch mean of
    :math:`\tau\,\partial\ell/\partial R = \sum_j P_j\langle \hat u, a_j - a^+\rangle`
    (positive: the SVR pulls the radius down). Watch ``radius_over_distance``: where
    :math:`R_i > \lVert a_i - t_i\rVert` the perpendicular pushes are reversed rather
    than damped. In ``benchmarks/studies/svr.py`` (random initialisation) the dynamic
    radius with ``beta=0.01`` (the paper's) ended above the distance for nearly every
    anchor; ``beta=1`` (the default here) kept it below for about 90%.

    Three warnings, once each, in training mode, at the user's line; "steps" are
    ``torch.optim`` optimizer steps (gradient accumulation counts one per
    ``optimizer.step()``): the radius got gradients before :attr:`stuck_after` optimizer
    steps that did not hold its parameters and never changed (checked from autograd's and
    the optimizer's side, so under ``torch.compile`` too); ``radius_over_distance``
    stayed above 0.5 for a streak of steps at least :attr:`over_distance_steps` long and
    at least :attr:`over_distance_share` of the steps so far (eager only); and
    a regulariser built while an earlier one of the same shape, whose radius got
    gradients but was in no optimizer, is alive (built inside the training loop).

    Args:
        base: a loss Module with ``contrastive_pairs`` (:class:`~contrastive_losses.InfoNCELoss`,
            :class:`~contrastive_losses.SigLIPLoss`, :class:`~contrastive_losses.KCLLoss`,
            :class:`~contrastive_losses.CACLLoss`) and ``reduction="mean"``.
        radius: ``"static"``, ``"dynamic"`` (default) or a fixed float in ``[0, 1e4]``.
        direction: ``"bi"`` (default) or ``"uni"`` (text anchors only).
        alpha: weight of the SVR term, the paper's :math:`\alpha` (default 1.0), in
            ``[0, 1e4]``.
        beta: weight of the constraint term, the paper's :math:`\beta`, in ``[0, 1e4]``.
            Default 1.0, not the paper's 0.01 (SupCLAP App. B, Eq. 9): with 0.01 the
            dynamic radius ended above :math:`\lVert a - t\rVert` for 81-100% of anchors
            in every study of this project, the failure the term is there to prevent;
            1.0 kept it to 5-25% at no cost in R@1 (the SVR page of the docs, "Why
            beta = 1"). Pass ``beta=0.01`` to reproduce the paper.
        constraint: add the constraint term; ``None`` means on for ``"dynamic"`` only.
        radius_init: initial radius, static or dynamic (default 0.1), in ``[0, 1e4]``.
        num_features: predictor input size (positive + negatives), ``>= 2``.
        hidden: predictor hidden width.
        temperature: fixed SVR temperature overriding the base's, :math:`\tau \ge 10^{-4}`.
        validate_args: the regulariser's value checks (NaN/Inf and zero embeddings, the
            predictor's similarities) and the two training warnings above (each a host
            sync) on, off or ``None`` (the global default,
            :func:`contrastive_losses.set_default_validate_args`). The base keeps its own
            ``validate_args``: turn both off, or use the global default, for a step
            with no host sync.

    Shape:
        ``forward(*base_args, return_terms=False, **base_kwargs)`` takes exactly the
        base's arguments (e.g. audio ``(B, D)``, text ``(B, K, D)``, mask ``(B, K)`` for
        KCL) and returns a scalar; ``return_terms`` adds the base's terms and ``base``,
        ``svr``, ``constraint``, ``radius_mean``/``std``/``min``/``max`` and
        ``radius_over_distance``, the share of anchors with :math:`R_i > \lVert a_i -
        t_i\rVert` (their perpendicular pushes are reversed, not damped), and
        ``svr_radius_slope``, the mean of :math:`\tau\,\partial\ell_i/\partial R_i`
        (above), all over this rank's present anchors of every direction.

    Example:
        >>> import torch
        >>> from contrastive_losses import KCLLoss, SupportVectorRegularizer
        >>> loss_fn = SupportVectorRegularizer(KCLLoss(temperature=0.07), radius="dynamic")
        >>> audio, text = torch.randn(8, 32), torch.randn(8, 3, 32)
        >>> loss, terms = loss_fn(audio, text, return_terms=True)
        >>> loss.backward()
        >>> round(terms["radius_mean"].item(), 4)
        0.1
    """

    # a fixed radius's value as last read and its buffer's stamp (see _scalar_radius)
    _radius_value: float
    _radius_stamp: tuple[int, int]

    @_refuse_base_settings
    def __init__(
        self,
        base: nn.Module,
        radius: str | float = "dynamic",
        direction: str = "bi",
        alpha: float = 1.0,
        beta: float = 1.0,
        constraint: bool | None = None,
        radius_init: float = 0.1,
        num_features: int = 32,
        hidden: int = 64,
        temperature: float | None = None,
        *,
        validate_args: bool | None = None,
    ) -> None:
        super().__init__()
        _check_regularizer_settings(
            base, direction, alpha, beta, constraint, radius_init, temperature, validate_args
        )
        self.base = base
        self.direction = direction
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.svr_temperature = None if temperature is None else float(temperature)
        self.radius_init = float(radius_init)
        self.predictor: RadiusPredictor | None = None
        _build_radius(self, radius, num_features, hidden, validate_args)
        self.constraint = self.radius_mode == "dynamic" if constraint is None else constraint
        self.validate_args = validate_args
        self._reset_monitor()

    def extra_repr(self) -> str:
        """The radius (mode, and its value unless predicted), the direction, the weights,
        the SVR temperature override and ``validate_args``; the base and the predictor
        print as children."""
        radius = f"radius={self.radius_mode!r}"
        if self.predictor is None:
            radius += f" ({_scalar_repr(_scalar_radius(self, self.radius))})"
        temperature = "None (the base's)" if self.svr_temperature is None else self.svr_temperature
        return (
            f"{radius}, direction={self.direction!r}, alpha={self.alpha}, beta={self.beta}, "
            f"constraint={self.constraint}, temperature={temperature}, "
            f"validate_args={self.validate_args}"
        )

    @property
    def temperature(self) -> Tensor | float:
        """The SVR temperature, i.e. the override, else the base's current ``temperature``."""
        if self.svr_temperature is not None:
            return self.svr_temperature
        return cast(Tensor, self.base.temperature)

    @counted_call
    @_compat.autocast_off
    def forward(
        self,
        *args: Any,
        logit_scale: Tensor | None = None,
        logit_bias: Tensor | None = None,
        return_terms: bool = False,
        **kwargs: Any,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        r"""The base loss plus the SVR and constraint terms, on one batch.

        Args:
            *args: the base's positional arguments: audio ``(B, D)`` and text ``(B, D)``
                (InfoNCE, SigLIP; ``ids`` ``(B,)``), text ``(B, K, D)`` (KCL; ``mask``
                ``(B, K)``), or CACL's triplet or ``(audio, text, other_index)``.
            logit_scale: the model's exp'd scale :math:`1/\tau`, a 0-d tensor: passed to
                the base (which then refuses a learnable temperature of its own) and, detached,
                the SVR temperature and the predictor's :math:`\cos/\tau` (unless this
                regulariser has its own ``temperature``).
            logit_bias: the model's SigLIP bias, a 0-d tensor, passed to a SigLIP base.
            return_terms: also return the detached terms: the base's, and ``base``,
                ``svr``, ``constraint``, ``radius_mean``/``std``/``min``/``max``,
                ``radius_over_distance`` and ``svr_radius_slope`` (see the class).
            **kwargs: the base's keyword arguments (``ids``, ``mask``, ``generator``...).

        Returns:
            The scalar loss, or ``(loss, terms)``.
        """
        _check_base_reduction(self.base)
        resolve = getattr(self.base, "resolve_inputs", None)
        if callable(resolve):
            args, kwargs = resolve(*args, **kwargs)
        model_scale = {"logit_scale": logit_scale} if logit_scale is not None else {}
        if logit_bias is not None:
            model_scale["logit_bias"] = logit_bias
        terms: dict[str, Tensor] = {}
        if return_terms:
            base_loss, terms = self.base(*args, return_terms=True, **model_scale, **kwargs)
        else:
            base_loss = self.base(*args, **model_scale, **kwargs)
        pairs = cast(Callable[..., list[Any]], self.base.contrastive_pairs)(*args, **kwargs)
        validate = _checks.resolve_validate(self.validate_args)
        _compat.check_compile_supported(_compat.MIN_TORCH_COMPILE_SVR, "SupportVectorRegularizer")
        temperature = _detached_temperature(self, logit_scale)
        # in float32 as documented, also under torch.autocast (open_clip's trainer calls
        # its loss inside one), which would run the SVR's matmuls and predictor in float16
        with torch.autocast(base_loss.device.type, enabled=False):
            svr, constraint, radius_terms, over = self._regularise(
                pairs, temperature, return_terms, validate
            )
        # summed in float32 for a half-precision base (svr is float32): two finite halves
        # can overflow where their sum fits
        loss = widen(base_loss) + self.alpha * svr
        if self.constraint:
            loss = loss + self.beta * constraint
        loss = _narrow(loss, base_loss.dtype)
        self._rearm_watch()
        if validate and self.training and torch.is_grad_enabled():
            self._monitor(over)
        if not return_terms:
            return loss
        terms = dict(terms)
        terms.update(
            base=base_loss.detach(),
            svr=svr.detach(),
            constraint=constraint.detach(),
            **cast(dict[str, Tensor], radius_terms),
            radius_over_distance=over,
        )
        return loss, terms

    # ------------------------------------------------------------------ training checks
    # (the checks themselves: _svr_monitor._RadiusMonitor)

    #: Optimizer steps, each after a gradient in training mode, that do not hold the
    #: radius' parameters, after which a radius that never moved from its value at its
    #: first gradient is reported; eager and compiled alike.
    stuck_after: int = 50
    #: The shortest streak of consecutive optimizer steps, each with
    #: ``radius_over_distance > 0.5`` in every training batch, that is reported...
    over_distance_steps: int = 20
    #: ...when it also covers this share of the optimizer steps since training began (a
    #: threshold that grows with the run).
    over_distance_share: float = 0.25
    #: The streak is read (one device sync) once every this many optimizer steps.
    over_distance_check_every: int = 10

    # ------------------------------------------------------------------ internals

    def _regularise(
        self,
        pairs: list[Any],
        temperature: Tensor | float | None = None,
        with_terms: bool = False,
        validate: bool = True,
    ) -> tuple[Tensor, Tensor, dict[str, Tensor] | None, Tensor]:
        """SVR and constraint terms (per-direction means over every present anchor, summed
        over the directions and halved), with ``with_terms`` the radius terms (the radii's
        mean, std, min and max and the mean of ``tau * d(row)/dR`` over the present
        anchors), and the share of anchors whose radius exceeds ``||a - t||`` (their
        perpendicular pushes change sign). ``temperature``: the SVR's, detached (``None``:
        the override or the base's); ``validate``: the value checks (host syncs).

        Matmuls run per pair (and per distinct tensor for the positive-candidate Gram
        matrices, e.g. KCL's audio once for all languages); everything after them runs
        batched over the ``Q = P`` (uni) or ``2P`` (bi) anchor/candidate problems on
        ``(Q, b, N)`` similarity tensors.
        """
        if temperature is None:
            temperature = _detached_temperature(self)
        normalize = bool(getattr(self.base, "normalize", True))
        enabled = resolve_gather(getattr(self.base, "gather", None))
        chunk_size = getattr(self.base, "chunk_size", None)
        predictor = self.predictor
        settings = {  # must match across ranks (the base's are checked by the base)
            "radius": self.radius_mode,
            # A fixed radius' value (a buffer) and a static one's (a parameter that DDP
            # keeps equal); a dynamic radius' initial value and the predictor's sizes.
            "radius value": _scalar_radius(self, self.radius) if predictor is None else None,
            "radius_init": None if self.radius_mode == "fixed" else self.radius_init,
            "num_features": None if predictor is None else predictor.num_features,
            "hidden": None if predictor is None else predictor.hidden,
            # Outside DDP the ranks' predictors drift apart, as a temperature would
            "predictor checksum": (
                _checksum(predictor) if predictor is not None and enabled and validate else None
            ),
            "direction": self.direction,
            "alpha": self.alpha,
            "beta": self.beta,
            "constraint": self.constraint,
            "temperature": temperature,  # the model's 1/logit_scale when given
            "chunk_size": chunk_size,
            "normalize": normalize,
        }
        local, glob, keys, b, offset = _prepare_pairs(
            pairs, normalize, enabled, validate, settings, self.validate_args
        )
        if chunk_size is not None:
            return self._regularise_tiled(
                pairs,
                local,
                glob,
                keys,
                b,
                offset,
                enabled,
                temperature,
                with_terms,
                chunk_size,
                validate,
            )
        sims, pos_sims, dist = _pair_similarities(local, glob, keys, self.direction, enabled)
        row_mask, col_mask = _pair_masks(pairs, b, sims, enabled, validate)
        if self.predictor is None:
            radius = _scalar_radius(self, sims)  # ()
        else:  # SupCLAP's s = cos / tau, detached inside the predictor
            features = self.predictor._features(sims / temperature, offset, col_mask, validate)
            radius = self.predictor._from_features(features)  # (Q, b)
        logits = _support_vector_logits(sims, pos_sims, dist, radius, temperature, col_mask)
        rows = _logit_rows(logits, offset)  # (Q, b)
        slope = _radius_slope(logits, sims, pos_sims, dist, offset) if with_terms else None
        con = F.relu(radius - dist.detach()) + F.relu(-radius)  # (Q, b), or () if static
        batch = _batch(offset, sims.shape[-1], enabled)
        return _anchor_means(
            rows, con, radius, dist, slope, row_mask, col_mask, batch, self.direction
        )

    def _regularise_tiled(
        self,
        pairs: list[Any],
        local: dict[int, Tensor],
        glob: dict[int, Tensor],
        keys: list[tuple[int, int]],
        b: int,
        offset: int,
        enabled: bool,
        temperature: Tensor | float,
        with_terms: bool,
        chunk_size: int,
        validate: bool,
    ) -> tuple[Tensor, Tensor, dict[str, Tensor] | None, Tensor]:
        """:meth:`_regularise` over column tiles (the base's ``chunk_size``): no
        ``(Q, b, N)`` similarities; the predictor's top negatives come from a running
        top-k over the tiles."""
        x, y, y_pos = _pair_problems(local, glob, keys, self.direction)
        dist = _distance(x, y_pos)  # (Q, b)
        row_mask, col_mask = _pair_masks(pairs, b, x, enabled, validate)
        if self.predictor is None:
            radius = _scalar_radius(self, x)  # ()
        else:  # SupCLAP's s = cos / tau, from the running top-k of every tile
            k = self.predictor.num_features - 1
            parts = _tiled_top_negatives(x, y, k, offset, col_mask, chunk_size)
            features = _assemble_features(*(p / temperature for p in parts))
            if validate:
                _check_similarity_peak(features)
            radius = self.predictor._from_features(features)  # (Q, b)
        rows, support = _tiled_support_vector_rows(
            x, y, y_pos, dist, radius, temperature, offset, col_mask, chunk_size
        )
        slope = None
        if with_terms:
            slope = _tiled_radius_slope(support, rows, x, y, y_pos, dist, col_mask, chunk_size)
        con = F.relu(radius - dist.detach()) + F.relu(-radius)  # (Q, b), or () if static
        batch = _batch(offset, y.shape[1], enabled)
        return _anchor_means(
            rows, con, radius, dist, slope, row_mask, col_mask, batch, self.direction
        )


def _detached_temperature(
    svr: SupportVectorRegularizer, logit_scale: Tensor | None = None
) -> Tensor | float:
    """The SVR temperature: the override, else ``1/logit_scale`` (the model's), else the
    base's (a fixed one as the Python float it was given, exact in float64, as the base
    uses it); detached, so a learnable one learns from the base only."""
    if svr.svr_temperature is None and logit_scale is not None:
        return 1.0 / logit_scale.detach()
    fixed = getattr(svr.base, "_fixed_value", None)
    if svr.svr_temperature is None and callable(fixed) and not svr.base.learnable_temperature:
        return cast(float, fixed())
    temperature = svr.temperature
    return temperature.detach() if isinstance(temperature, Tensor) else temperature


def _scalar_radius(svr: SupportVectorRegularizer, like: Tensor) -> Tensor:
    """The static radius (a parameter) in ``like``'s dtype, or the fixed one exact: the
    Python float it was given (its float32 buffer holds 0.2 as 0.2000000030), unless
    another value was written into the buffer (``load_state_dict``, ``fill_``)."""
    buffer = cast(Tensor, svr.radius)
    if svr.radius_mode != "fixed":
        return buffer.to(like.dtype)
    kept = getattr(svr, "_radius_value", None)
    if kept is None:  # pickled before the float was kept
        kept = svr._radius_value = float(buffer)
        svr._radius_stamp = _stamp(buffer)
    elif not _compat.is_compiling() and _stamp(buffer) != svr._radius_stamp:
        written = _written_value(buffer, kept)
        svr._radius_value = kept = kept if written is None else written
        svr._radius_stamp = _stamp(buffer)
    return like.new_full((), kept)


def _check_base_reduction(base: nn.Module) -> None:
    reduction = getattr(base, "reduction", "mean")
    if reduction != "mean":
        raise ValueError(
            f"base: SupportVectorRegularizer needs the base loss with reduction='mean' "
            f"(its SVR and constraint terms are batch means), got reduction={reduction!r}"
        )
