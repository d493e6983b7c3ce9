"""Machinery shared by the losses: input checks, the temperature floor, the local rows
against the (gathered) global batch and their reduction, the ``terms`` dict and the row
mask. The Modules' settings and temperature are in :mod:`contrastive_losses._settings`,
the InfoNCE rows in :mod:`contrastive_losses._nce_rows`, the radius checks in
:mod:`contrastive_losses._svr_radius`.

Private: each method's module (:mod:`~contrastive_losses.infonce`,
:mod:`~contrastive_losses.siglip`, :mod:`~contrastive_losses.kcl`,
:mod:`~contrastive_losses.cacl`, :mod:`~contrastive_losses.svr`) imports from here; the
public names (:class:`ContrastivePair`, ``MIN_TEMPERATURE``) are re-exported by
:mod:`contrastive_losses.losses` and :mod:`contrastive_losses.functional`.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from . import _checks, _compat, _guide
from ._gather import _gather_no_grad as _gather_no_grad  # the losses import it from here
from ._kernels import (
    _compute_dtype,
    l2_normalize,
)
from ._warnings import warn_at_caller
from .distributed import Validation, all_gather_with_grad

Terms = dict[str, Tensor]


# Below 1e-4 the logits (up to 1/temperature = 1e4) no longer fit float16's 65504 once
# multiplied by a similarity sum, and the softmax is already a hard argmax in every dtype.
MIN_TEMPERATURE = 1e-4


# Below this scale (above 1/2 as a temperature) no CLIP or CLAP recipe trains: CLIP starts
# at 14.3 and clamps at 100, SigLIP starts at 10. A scale of 1.07 (a parameter initialised
# with the temperature 0.07, then exp'd) trains to 3.55 where chance is 4.16.
MIN_PLAUSIBLE_SCALE = 2.0

# open_clip and Hugging Face keep log(scale) in model.logit_scale and clamp the scale at
# 100: their log-scale lies in [log 14.3, log 100] = [2.66, 4.61] in training. A scale
# between MIN_PLAUSIBLE_SCALE and this (a temperature between 0.2 and 0.5) is more likely
# that log passed without .exp() than a setting (CLIP/CLAP recipes train above 10).
MIN_LINEAR_SCALE = 5.0

# The kind of the temperature-habit warning (once per calling line; a Module that warned
# at construction keeps its calls quiet: _warnings.told).
TEMPERATURE_HABIT = "temperature habit"


def _temperature(temperature: float | Tensor, validate: bool = True) -> None:
    """A float or 0-d tensor temperature; the bounds of a tensor's value with ``validate``.

    A float above 1/:data:`MIN_PLAUSIBLE_SCALE` warns (:func:`_warn_logit_scale_habit`)."""
    value = _checks.check_positive(temperature, "temperature", validate=validate)
    if value is not None and value < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature: {value:.3g} is below the smallest supported {MIN_TEMPERATURE:g} "
            "(1/temperature scales the logits; beyond 1e4 they overflow float16 and the "
            "softmax is a hard argmax)"
        )
    if not isinstance(temperature, Tensor):
        _warn_logit_scale_habit(float(temperature))


def _warn_logit_scale_habit(temperature: float, name: str = "temperature") -> None:
    """Warn, once per calling line, when a float temperature is above 1/2: above 1 open_clip
    and Hugging Face users pass the logit scale 1/temperature (100, 14.3), which makes
    every loss about log B; between 1/2 and 1 the scale is below any CLIP/CLAP recipe's."""
    if temperature * MIN_PLAUSIBLE_SCALE <= 1 or _compat.is_compiling():
        return
    if temperature > 1:
        message = (
            f"{name}={temperature:g} looks like a logit scale (1/temperature, as open_clip "
            f"and Hugging Face store it); pass {name}={1 / temperature:.4g}, or the model's "
            "scale per call: loss_fn(audio, text, logit_scale=model.logit_scale.exp())"
        )
    else:
        message = (
            f"{name}={temperature:g} is above 0.5: a logit scale of {1 / temperature:.3g}, "
            f"below {MIN_PLAUSIBLE_SCALE:g} where no CLIP/CLAP recipe trains (CLIP starts at "
            f"0.07 and stops at 0.01), so every loss stays near log(batch size); pass "
            f"{name}=0.07, CLIP's initial value"
        )
    warn_at_caller(TEMPERATURE_HABIT, message)


def _check_logit_scale(
    logit_scale: object,
    ref: object,
    validate: bool = True,
    name: str = "logit_scale",
    *,
    is_scale: bool = True,
) -> Tensor:
    """The model's exp'd logit scale: a floating 0-d tensor on ``ref``'s device (when
    ``ref`` is a tensor); with ``validate`` positive, finite and at most
    ``1/MIN_TEMPERATURE`` (one host sync). Returns it.

    For the scale (``is_scale``; not for SigLIP's bias, which goes through here too) two
    habits warn, once per calling line (:func:`_warn_scale_habits`): a leaf
    ``nn.Parameter`` (open_clip's and Hugging Face's ``model.logit_scale`` holds the
    log of the scale), and with ``validate`` a value below 1 (a temperature)."""
    if not isinstance(logit_scale, Tensor):
        raise TypeError(
            f"{name}: expected a 0-d tensor (the model's exp'd scale, e.g. "
            f"model.logit_scale.exp()), got {type(logit_scale).__name__}; for a fixed value "
            "pass temperature=1/scale"
        )
    if logit_scale.dim() != 0:
        raise ValueError(
            f"{name}: expected a 0-d tensor, got shape {_checks.shape_of(logit_scale)}; "
            "one scale for the whole batch"
        )
    _checks.check_float(logit_scale, name)
    if isinstance(ref, Tensor) and logit_scale.device != ref.device:
        raise ValueError(
            f"{name}: on device {logit_scale.device} but the embeddings are on {ref.device}"
        )
    value = None
    if validate:
        _checks.check_materialised(logit_scale, name)
        value = float(logit_scale.item())  # item: no graph, no warning
        if not (0 < value <= 1 / MIN_TEMPERATURE):  # False for NaN
            raise ValueError(
                f"{name}: must be finite and in (0, {1 / MIN_TEMPERATURE:g}] (1/temperature, "
                f"with the temperature floor {MIN_TEMPERATURE:g}), got {value}"
            )
    if is_scale and not _compat.is_compiling():
        _warn_scale_habits(logit_scale, value, name)
    return logit_scale


def _warn_scale_habits(logit_scale: Tensor, value: float | None, name: str) -> None:
    """Warn, once per calling line, where the scale looks like one of these mistakes: the
    model's raw ``nn.Parameter`` (open_clip and Hugging Face keep ``log(1/tau)`` there,
    so ``logit_scale=model.logit_scale`` scales by about 2.66 instead of 14.3), unless
    its value is too large for a log (then it holds the scale itself), and a ``value``
    below :data:`MIN_PLAUSIBLE_SCALE` (a temperature passed as the scale, or the exp of a
    parameter initialised with the temperature: every loss then sits near ``log B``),
    and, for a tensor that is no ``nn.Parameter``, a ``value`` in
    [:data:`MIN_PLAUSIBLE_SCALE`, :data:`MIN_LINEAR_SCALE`) (the log-scale passed without
    ``.exp()``, e.g. ``model.logit_scale.detach()``). Reads no value of its own: with
    ``validate`` off (``value`` None) only the Parameter is seen."""
    if isinstance(logit_scale, nn.Parameter):
        _warn_raw_parameter(logit_scale, value, name)
    elif value is not None and MIN_PLAUSIBLE_SCALE <= value < MIN_LINEAR_SCALE:
        warn_at_caller("log-space logit_scale", _log_scale_message(value, name))
    if value is not None and value < MIN_PLAUSIBLE_SCALE:
        warn_at_caller("logit_scale below 2", _low_scale_message(value, name))


def _log_scale_message(value: float, name: str) -> str:
    """Why a scale in [:data:`MIN_PLAUSIBLE_SCALE`, :data:`MIN_LINEAR_SCALE`) looks like
    the log of the scale, and the fix."""
    return (
        f"{name}={value:.4g} is below {MIN_LINEAR_SCALE:g}: it looks like the log of the "
        f"scale, which open_clip and Hugging Face keep in model.logit_scale (log(1/0.07) = "
        f"2.66 at initialisation, at most log(100) = 4.61), so the logits are scaled by "
        f"{value:.3g} instead of {math.exp(value):.3g}. Pass {name}=model.logit_scale.exp() "
        f"(open_clip clamps it: .exp().clamp(max=100)). If {value:.4g} is the scale you "
        f"mean (a temperature of {1 / value:.3g}), pass it as a setting instead, "
        f"temperature={1 / value:.4g} (SigLIP: scale={value:.4g}), which does not warn"
    )


def _warn_raw_parameter(logit_scale: Tensor, value: float | None, name: str) -> None:
    """The scale passed as an ``nn.Parameter`` itself: open_clip's log-scale, unless
    ``value``'s exp would exceed the largest scale (then it is the scale itself)."""
    if value is not None and value > math.log(1 / MIN_TEMPERATURE):
        frozen = (
            ""
            if logit_scale.requires_grad
            else (
                f"; a fixed scale needs no Parameter: {name}=torch.tensor({value:.4g}), or "
                f"temperature={1 / value:.4g} instead of {name}"
            )
        )
        message = (
            f"{name}: got an nn.Parameter holding {value:.4g}, which is the scale itself, "
            f"not its log as in open_clip's and Hugging Face's model.logit_scale (its exp, "
            f"{math.exp(min(value, 700)):.3g}, exceeds every allowed scale, "
            f"{1 / MIN_TEMPERATURE:g}); it is used as it is. To say so and silence this, pass "
            f"{name}=param.clamp(max=100){frozen}"
        )
    else:
        message = (
            f"{name}: got an nn.Parameter itself; open_clip and Hugging Face keep the log of "
            f"the scale in model.logit_scale, so {name}=model.logit_scale scales the logits "
            f"by about 2.66 instead of 14.3. Pass {name}=model.logit_scale.exp() (open_clip "
            f"clamps it: model.logit_scale.exp().clamp(max=100)); if your parameter holds the "
            f"scale itself, not its log, pass {name}=param.clamp(max=100), which also "
            "silences this"
        )
    warn_at_caller("raw logit_scale", message)


def _low_scale_message(value: float, name: str) -> str:
    """Why a scale below :data:`MIN_PLAUSIBLE_SCALE` is a mistake, and the likely fix."""
    if value < 1:
        return (
            f"{name}={value:.4g} is below 1: it looks like a temperature ({name} is "
            f"1/temperature, the model's exp'd scale, about 14.3 at CLIP's initialisation), "
            f"which leaves every loss near log(batch size) with no learning signal. Pass "
            f"{name}={1 / value:.4g}, or temperature={value:.4g} instead of {name}"
        )
    tau = math.log(value)  # what a parameter holding the temperature, exp'd, gives
    return (
        f"{name}={value:.4g} is below {MIN_PLAUSIBLE_SCALE:g} (a temperature above 0.5), "
        f"where no CLIP/CLAP recipe trains (CLIP's scale starts at 14.3, up to 100): every "
        f"loss stays near log(batch size). If it is the exp of a scale parameter "
        f"initialised with the temperature (nn.Parameter(torch.tensor({tau:.3g}))"
        f".exp() = {value:.4g}), initialise the parameter with the log of the scale, "
        f"nn.Parameter(torch.tensor(math.log(1 / {tau:.3g}))), and pass "
        f"{name}=param.exp(); if a trained scale fell here, check its learning rate and "
        "weight decay (CLIP exempts the scale from weight decay)"
    )


def _resolve_scale(
    temperature: float | Tensor,
    logit_scale: Tensor | None,
    ref: object,
    validate: bool = True,
    default: float = 0.07,
) -> float | Tensor:
    """The logit scale of a call, the factor the logits are multiplied by (open_clip's
    ``logit_scale * x @ y.T``): the model's ``logit_scale`` itself (checked; then
    ``temperature`` must be left at its ``default``), else ``1 / temperature`` (checked):
    a Python float for a float (exact in every input dtype; under ``torch.compile`` a
    symbolic float, so a new value reuses the graph), and for a tensor its reciprocal
    in the wider of its and ``ref``'s dtypes (a float32 temperature with float64 input
    loses nothing)."""
    if logit_scale is not None:
        return _resolve_temperature(temperature, logit_scale, ref, validate, default, scale=True)
    _temperature(temperature, validate)
    if not isinstance(temperature, Tensor):
        return 1.0 / temperature
    if isinstance(ref, Tensor) and ref.is_floating_point():
        temperature = temperature.to(torch.promote_types(temperature.dtype, ref.dtype))
    return temperature.reciprocal()


def _resolve_temperature(
    temperature: float | Tensor,
    logit_scale: Tensor | None,
    ref: object,
    validate: bool = True,
    default: float = 0.07,
    *,
    scale: bool = False,
) -> float | Tensor:
    """The temperature of a call: ``temperature`` (checked), or ``1/logit_scale`` when the
    model's scale is given (then ``temperature`` must be left at its ``default``); with
    ``scale`` the checked ``logit_scale`` itself (:func:`_resolve_scale`)."""
    if logit_scale is None:
        _temperature(temperature, validate)
        return temperature
    if isinstance(temperature, Tensor) or temperature != default:
        raise ValueError(
            f"logit_scale: given together with temperature={temperature!r}; pass one of "
            "them (logit_scale is 1/temperature, the model's exp'd scale)"
        )
    checked = _check_logit_scale(logit_scale, ref, validate)
    return checked if scale else checked.reciprocal()


def _scale_setting(temperature: float | Tensor, logit_scale: Tensor | None) -> dict[str, object]:
    """The fingerprint entries of a call's scale (ranks must agree on it under gather):
    ``logit_scale`` when the model's scale is given, else ``temperature``, and its dtype
    (a float16 scale on one rank and a float32 one on another give different losses)."""
    if logit_scale is None:
        return {"temperature": temperature, "temperature dtype": _value_dtype(temperature)}
    return {"logit_scale": logit_scale, "logit_scale dtype": logit_scale.dtype}


def _value_dtype(value: float | Tensor) -> torch.dtype | str:
    """A scalar setting's dtype for the fingerprint: a tensor's, or ``"float"``."""
    return value.dtype if isinstance(value, Tensor) else "float"


def _embeddings(
    x: object,
    name: str,
    dims: str,
    normalize: bool,
    min_batch: int = 2,
    validate: bool = True,
    *,
    static: bool = True,
    wide: bool = False,
) -> Tensor:
    """Validate an embedding input and (optionally) normalise it; one pass over ``x``.
    The value checks (NaN/Inf, zero rows) with ``validate`` only; the static ones unless
    the caller has seen them pass (``static=False``). With ``wide`` float16/bfloat16 rows
    are normalised in float32 (the losses' arithmetic, :func:`widen`): float32 unit rows,
    whose gradient autograd casts back to ``x``'s dtype."""
    if static:
        x = _checks.check_embeddings(
            x, name, ndim=dims.count(",") + 1, dims=dims, min_batch=min_batch, check_values=False
        )
    x = typing.cast(Tensor, x)
    if not normalize and not validate:
        return x
    dtype = _compute_dtype(x) if wide and normalize else None
    norms = _checks.check_row_norms(x, name, nonzero=normalize, validate=validate, dtype=dtype)
    return l2_normalize(x, norms) if normalize else x


def _host_float(value: float | Tensor) -> float:
    """A number or a 0-d tensor's value as a float, read without its graph (a learnable
    scale requires grad; reading it must not warn or build anything)."""
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def _logit_range(
    pairs: list[tuple[Tensor, str, Tensor, str]],
    normalize: bool,
    validate: bool,
    *,
    temperature: float | Tensor = 1.0,
    scale: float | Tensor = 1.0,
    shift: float | Tensor = 0.0,
    radius: float = 0.0,
) -> None:
    """With ``normalize=False`` (and ``validate``) refuse embeddings whose logits could
    overflow: with ``scale`` for ``scale / temperature``,
    ``|<x_i, y_j>| * scale + |shift| <= ||x_i|| ||y_j|| * scale + |shift|``
    (Cauchy-Schwarz; ``radius`` lengthens ``x``'s rows, SVR's support vectors) must stay
    below a quarter of the dtype's max, where the log-sum-exp minus the positive, up to
    twice a logit, is still finite. Beyond it the dense and tiled paths gave different
    wrong values (float16 rows of 65504: NaN dense, 4096 and 3840 tiled; true log 4).
    The largest norms (:func:`_checks.peak_row_norm`) also refuse NaN/Inf entries, named
    as :func:`_checks.check_finite` names them: :func:`_pair_and_ids` leaves that check
    to this function with ``normalize=False``.

    Each pair is first judged at a glance (:func:`_bounded_at_a_glance`, a cheaper
    reduction that can only pass where the exact check passes); the exact check runs,
    raising its own error, where that does not settle it."""
    if normalize or not validate:
        return
    for x, x_name, y, y_name in pairs:
        if _bounded_at_a_glance(x, y, temperature, scale, shift, radius):
            continue
        hi = _checks.peak_row_norm(x, x_name) + abs(radius)
        hi *= _checks.peak_row_norm(y, y_name)
        hi *= _host_float(scale) / _host_float(temperature)
        hi += abs(_host_float(shift))
        limit = torch.finfo(x.dtype).max / 4
        if not hi <= limit:  # True for NaN too
            raise ValueError(
                f"{x_name}, {y_name}: with normalize=False their logits can reach {hi:.3g} "
                f"(max ||{x_name}|| * max ||{y_name}|| times the logit scale), beyond "
                f"{limit:.3g} (a quarter of {x.dtype}'s max) where the loss overflows; "
                "normalize the embeddings, scale them down or use a wider dtype"
            )


def _bounded_at_a_glance(
    x: Tensor,
    y: Tensor,
    temperature: float | Tensor,
    scale: float | Tensor,
    shift: float | Tensor,
    radius: float,
) -> bool:
    """True where :func:`_logit_range` surely passes ``(x, y)``: the bound taken with the
    norms of the whole tensors (:func:`_checks.total_norm`, at least every row's) stays
    below the limit with room for their rounding, ``(1.01 + 2.4e-7 n)^2`` for ``n``
    entries in all (float32 sums of ``n`` squares are off by at most ``n`` units of
    ``2^-24`` each way). A total norm is finite only where every entry is, so a NaN or
    Inf never passes here. False says nothing: the exact check decides (and names the
    tensor at fault). Two reductions and two host reads, where the exact check takes
    four reductions (a norm per row, then their max, for each tensor) and two reads."""
    if x.is_meta or y.is_meta:  # the exact check words it
        return False
    bound = (_checks.total_norm(x) + abs(radius)) * _checks.total_norm(y)
    bound = bound * (_host_float(scale) / _host_float(temperature)) + abs(_host_float(shift))
    room = (1.01 + 2.4e-7 * (x.numel() + y.numel())) ** 2
    limit = _QUARTER_MAX.get(x.dtype)
    if limit is None:
        limit = _QUARTER_MAX[x.dtype] = torch.finfo(x.dtype).max / 4
    return bound * room <= limit  # False for NaN


# A quarter of each floating dtype's max (the logits' limit), as each is first met.
_QUARTER_MAX: dict[torch.dtype, float] = {}


def _check_pair(a: Tensor, a_name: str, b: Tensor, b_name: str) -> None:
    _checks.check_same_size(a, a_name, b, b_name, 0, "batch size B")
    _checks.check_same_size(a, a_name, b, b_name, -1, "embedding dim D")
    _checks.check_same_device_dtype([(a, a_name), (b, b_name)])


def _plain_pair(a: object, t: object, min_batch: int) -> bool:
    """Whether ``a`` and ``t`` pass every static check of :func:`_pair_and_ids`: plain
    floating ``(B, D)`` tensors of one shape, dtype and device, ``B >= min_batch``,
    ``D > 0`` (a subclass or anything else: the checks decide, and word the error)."""
    return (
        type(a) is Tensor
        and type(t) is Tensor
        and a.dim() == 2
        and a.shape == t.shape
        and a.dtype == t.dtype
        and a.is_floating_point()
        and a.device == t.device
        and a.shape[0] >= min_batch
        and a.shape[1] > 0
    )


def _pair_and_ids(
    audio: object,
    text: object,
    ids: object | None,
    normalize: bool,
    min_batch: int,
    validate: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Validated (and normalised) ``(B, D)`` audio and text, and optional ``(B,)`` ids;
    normalised float16/bfloat16 rows come back in float32 (:func:`_embeddings`).

    With ``normalize=False`` only their static checks run here: the callers
    (:func:`info_nce`, :func:`siglip`) run :func:`_logit_range` on the pair next, whose
    one reduction per tensor refuses NaN/Inf as well as logits that overflow (the norms
    and the finiteness checked apart cost 4 reductions and 4 host reads)."""
    values = validate and normalize  # normalize=False: the values in _logit_range
    # the usual call passes every static check at a glance; else each runs, in turn
    static = not _plain_pair(audio, text, min_batch)
    a = _embeddings(
        audio, "audio", "(B, D)", normalize, min_batch, values, static=static, wide=True
    )
    t = _embeddings(text, "text", "(B, D)", normalize, min_batch, values, static=static, wide=True)
    if static:
        # the inputs' dtypes (half rows come back normalised in float32)
        _check_pair(typing.cast(Tensor, audio), "audio", typing.cast(Tensor, text), "text")
    if ids is not None:
        ids = _checks.check_ids(ids, "ids", a.shape[0], a)
    return a, t, ids


def _agree_pair(
    v: Validation,
    a: Tensor,
    t: Tensor,
    ids: Tensor | None,
    reduction: str,
    chunk_size: int | None,
    normalize: bool,
    scale_settings: Mapping[str, object],
) -> None:
    """What the ranks compare of a call on one ``(audio, text)`` pair (InfoNCE, SigLIP):
    the tensors they gather (as given: their dtypes, not the float32 of normalised half
    rows), the scale's settings (first) and the common ones."""
    v.agree(audio=a, text=t, **({} if ids is None else {"ids": ids}))
    v.settings(
        **scale_settings,
        reduction=reduction,
        chunk_size=chunk_size,
        normalize=normalize,
        ids_given=ids is not None,
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


def _gather(x: Tensor, enabled: bool, validate: bool = True) -> tuple[Tensor, int]:
    """``x`` gathered from every rank (``enabled``), and this rank's offset; without
    ``validate`` every rank is taken to hold as many rows (no size exchange, no sync)."""
    return all_gather_with_grad(x, equal_sizes=not validate) if enabled else (x, 0)


def _batch(offset: int, n_global: int, enabled: bool) -> _Batch:
    world = torch.distributed.get_world_size() if enabled else 1
    return _Batch(offset=offset, n_global=n_global, world=world)


def _reduce(per_sample: Tensor, reduction: str, count: Tensor | int, batch: _Batch) -> Tensor:
    """Reduce per-sample losses; ``count`` is the global number of samples for "mean"."""
    if reduction == "none":
        return per_sample
    total = per_sample.sum()
    if batch.world != 1:  # one process: no op (and no autograd node) for an exact * 1
        total = total * batch.world
    if reduction == "sum":
        return total
    return total / count


def _tile_width(chunk_size: int | None, columns: int) -> int | None:
    """The column tile of a call with ``chunk_size`` over ``columns`` columns, ``None``
    for the dense path: no ``chunk_size``, or one tile covers every column. The tiled
    Functions would then compute the dense path's statistics at the cost of their tile
    loop (2-3x the dense path at ``B = 32``); the values and gradients are the same to
    rounding."""
    return chunk_size if chunk_size is not None and chunk_size < columns else None


# Small constant tensors a dense one-process call rebuilds each time (the labels 0..B-1,
# SigLIP's +-1 signs): on the CPU, where building one costs about as much as a check,
# kept per key, a few at a time.
_CONSTANTS: dict[tuple[object, ...], Tensor] = {}
_MAX_CONSTANTS = 16


def _as_tensor(value: float | Tensor, ref: Tensor) -> Tensor:
    """A float as a 0-d tensor in ``ref``'s dtype and on its device (a tensor as it is),
    made by a multiplication: ``torch.compile`` keeps a float that changes between
    calls symbolic through it (one graph for every value), where ``torch.as_tensor``
    or ``torch.full`` bake each value into a graph of its own."""
    return value if isinstance(value, Tensor) else ref.new_ones(()) * value


def _cpu_constant(key: tuple[object, ...], ref: Tensor, make: Callable[[], Tensor]) -> Tensor:
    """``make()``, a tensor never written to or differentiated, kept under ``key`` (which
    must name all it depends on but the device) where that is safe: eager, ``ref`` a
    plain CPU tensor (not fake, meta, nor another subclass), ``make()`` a plain tensor
    too; made outside inference mode, so that autograd may save it in any later call.
    Else ``make()`` afresh."""
    if type(ref) is not Tensor or not ref.is_cpu or _compat.is_compiling():
        return make()
    value = _CONSTANTS.get(key)
    if value is None:
        with torch.inference_mode(False):
            value = make()
        if type(value) is not Tensor:  # made under a mode that wraps what it makes
            return value
        if len(_CONSTANTS) >= _MAX_CONSTANTS:
            _CONSTANTS.clear()
        _CONSTANTS[key] = value
    return value


def _finish(
    loss: Tensor, terms: Terms, return_terms: bool, dtype: torch.dtype | None = None
) -> Tensor | tuple[Tensor, Terms]:
    """The loss (and, with ``return_terms``, the detached terms) in ``dtype``, the inputs'
    dtype: float16/bfloat16 losses are computed in float32 (:func:`widen`) and cast back
    here, once, at the end (``None``: as they are)."""
    if dtype is not None:
        loss = _narrow(loss, dtype)
    if return_terms:
        return loss, {k: _narrow(v.detach(), dtype or v.dtype) for k, v in terms.items()}
    return loss


def _narrow(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype``: a loss computed in float32 back in its half-precision inputs'
    dtype (finite wherever its value fits it); no op where it is already."""
    return x if x.dtype == dtype else x.to(dtype)


class ContrastivePair(NamedTuple):
    """One pair of aligned batches a loss contrasts: ``audio[i]`` matches ``text[i]``.

    ``mask`` ``(B,)`` marks the rows present (``None``: all).
    """

    audio: Tensor
    text: Tensor
    mask: Tensor | None = None


def _check_row_mask(mask: object, b: int, ref: Tensor) -> Tensor:
    """Bool ``(B,)`` row mask on ``ref``'s device."""
    mask = _checks.check_tensor(mask, "mask")
    if mask.dim() != 1 or mask.shape[0] != b:
        raise ValueError(
            f"mask: expected shape ({b},) matching the batch, got {_checks.shape_of(mask)}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"mask: expected a bool tensor, got dtype {mask.dtype}")
    if mask.device != ref.device:
        raise ValueError(f"mask: on device {mask.device} but the embeddings are on {ref.device}")
    return mask


def _diagonal_mask(rows: int, cols: int, offset: int, device: torch.device) -> Tensor:
    """``(rows, cols)`` bool, True at ``(r, offset + r)``: each local row's positive among
    the (gathered) columns. Built by comparison: ``mask[r, r + offset] = True`` copies the
    Python scalar to a CUDA device, a host sync."""
    return _guide.tile_positives(rows, offset, None, 0, cols, device)
