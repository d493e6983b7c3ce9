"""The settings every loss Module holds (:class:`_LossSettings`) and the temperature of
the Modules that have one (:class:`_TemperatureMixin`: fixed, or learnable as a clamped
log logit scale), with the helpers the other Modules share: a fixed value's buffer read
back when written to, a trainable tensor refused where a copy is kept, a scalar's repr.

Private: the loss Modules and :class:`~contrastive_losses.SupportVectorRegularizer`
import from here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from . import _checks, _compat
from ._common import (
    MIN_PLAUSIBLE_SCALE,
    MIN_TEMPERATURE,
    TEMPERATURE_HABIT,
    Terms,
    _warn_logit_scale_habit,
)
from ._kernels import _UpperClamp
from ._param_watch import ParameterWatch
from ._warnings import told


class _LossSettings(nn.Module):
    """The settings every loss Module holds and passes to its functional form."""

    def _init_settings(
        self,
        normalize: bool,
        reduction: str,
        gather: bool | None,
        chunk_size: int | None,
        validate_args: bool | None,
    ) -> None:
        """Check and keep the settings."""
        _checks.check_reduction(reduction)
        _checks.resolve_validate(validate_args)  # the type
        self.normalize = normalize
        self.reduction = reduction
        self.gather = gather
        self.chunk_size = _checks.check_chunk_size(chunk_size)
        self.validate_args = validate_args

    def _settings_repr(self) -> str:
        """The settings for :meth:`extra_repr`, as keyword arguments."""
        return ", ".join(f"{k}={v!r}" for k, v in self._settings().items())

    def _settings(self) -> dict[str, Any]:
        """The keyword arguments of the functional forms that these settings fill."""
        return {
            "normalize": self.normalize,
            "reduction": self.reduction,
            "gather": self.gather,
            "chunk_size": self.chunk_size,
            "validate_args": self.validate_args,
        }


class _TemperatureMixin(_LossSettings):
    """Fixed or learnable temperature; learnable as a log logit scale clamped at
    ``max_logit_scale`` (CLIP's 100), so the temperature never falls below 1/100."""

    def _init_temperature(
        self, temperature: float, learnable: bool, max_logit_scale: float
    ) -> None:
        _refuse_trainable(temperature, "temperature", "learnable_temperature=True")
        _checks.check_positive(temperature, "temperature")
        _warn_logit_scale_habit(float(temperature))
        _checks.check_positive(max_logit_scale, "max_logit_scale")
        if max_logit_scale > 1.0 / MIN_TEMPERATURE:
            raise ValueError(
                f"max_logit_scale: {max_logit_scale:g} exceeds 1/{MIN_TEMPERATURE:g}, "
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
        self._watch = ParameterWatch(
            f"{type(self).__name__}: the learnable {{what}} ({{names}}) got gradients in "
            "{steps} optimizer steps that did not hold it and never changed from its "
            "initial value, so the loss trains at a fixed temperature. Are the loss's "
            "parameters in the optimizer? Pass them with the model's, e.g. "
            "torch.optim.AdamW([*model.parameters(), *loss_fn.parameters()]), or build it "
            "with learnable_temperature=False"
        )
        if learnable:
            self.log_logit_scale = nn.Parameter(log_scale)
            self._watch.arm(self, [self.log_logit_scale], ["temperature"])
        else:
            # The value used is the Python float, exact in every input dtype; the buffer
            # (float32, as checkpoints hold it) follows it, and a new value written into
            # the buffer (load_state_dict, fill_) is adopted (_fixed_value).
            self.register_buffer("log_logit_scale", log_scale)
            self._fixed = float(temperature)
            self._fixed_stamp = _stamp(log_scale)

    #: Optimizer steps, each after a gradient in training mode, that do not hold a
    #: learnable temperature, after which one that never changed is reported.
    stuck_after: int = 50

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy or an unpickled loss watches its own temperature parameter."""
        super().__setstate__(state)
        if getattr(self, "learnable_temperature", False):
            self._watch.arm(self, [self.log_logit_scale], ["temperature"])

    def _fixed_value(self) -> float:
        """The fixed temperature as a Python float: the value given, unless the buffer
        has since been given another (then that one, within ``max_logit_scale``; one host
        read per change, noticed by the buffer's identity and version counter, in eager
        mode only)."""
        buffer = self.log_logit_scale
        if _compat.is_compiling() or _stamp(buffer) == self._fixed_stamp:
            return self._fixed
        log = _written_value(buffer, math.log(1.0 / self._fixed))
        if log is not None:
            self._fixed = 1.0 / math.exp(min(log, math.log(self.max_logit_scale)))
        self._fixed_stamp = _stamp(buffer)
        return self._fixed

    def _loss(
        self,
        fn: Callable[..., Any],
        *args: Any,
        return_terms: bool,
        logit_scale: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor | tuple[Tensor, Terms]:
        """``fn(*args, temperature, ...)`` with this Module's settings, or
        ``fn(*args, logit_scale=...)`` with the model's scale; ``terms`` also get the
        temperature used. A fixed temperature goes as the Python float (exact)."""
        settings = {**self._settings(), **kwargs, "return_terms": return_terms}
        if logit_scale is None:
            if self.learnable_temperature:
                self._watch.rearm(self, [self.log_logit_scale], ["temperature"])
                temperature: float | Tensor = self.temperature
            else:
                temperature = self._fixed_value()
            if _habit_told(temperature):  # warned when built: once, at the user's line
                with told(TEMPERATURE_HABIT):
                    out = fn(*args, temperature, **settings)
            else:
                out = fn(*args, temperature, **settings)
            if not return_terms:
                return out
            used = temperature if isinstance(temperature, Tensor) else self.temperature
            return _with_terms(out, return_terms, temperature=used)
        self._refuse_logit_scale()
        out = fn(*args, logit_scale=logit_scale, **settings)
        if not return_terms:
            return out
        return _with_terms(out, return_terms, temperature=1.0 / logit_scale.detach())

    def _refuse_logit_scale(self) -> None:
        """The model's scale and this Module's own learnable temperature exclude each other."""
        if self.learnable_temperature:
            raise ValueError(
                f"logit_scale: {type(self).__name__}(learnable_temperature=True) learns its "
                "own temperature; with the model's scale (logit_scale=...) build it with "
                "learnable_temperature=False"
            )

    def extra_repr(self) -> str:
        """The temperature (its current value; learnable or fixed) and the settings."""
        return ", ".join([self._temperature_repr(), *self._extra_settings(), self._settings_repr()])

    def _extra_settings(self) -> list[str]:
        """The Module's own settings for :meth:`extra_repr` (``negatives=...``)."""
        return []

    def _temperature_repr(self) -> str:
        """``temperature=0.07`` or ``temperature=0.07, learnable_temperature=True,
        max_logit_scale=100.0`` (the current value of a learnable one)."""
        value = f"temperature={_scalar_repr(self.temperature)}"
        if self.learnable_temperature:
            value += f", learnable_temperature=True, max_logit_scale={self.max_logit_scale!r}"
        return value

    @property
    def temperature(self) -> Tensor:
        r"""Current temperature :math:`\tau` as a 0-d tensor (differentiable if learnable;
        a fixed one in the buffer's dtype and on its device)."""
        if not self.learnable_temperature:
            buffer = self.log_logit_scale
            # A fill, not torch.tensor(value, device=...): no host-to-device copy (a sync).
            return buffer.new_full((), self._fixed_value())
        log_bound = math.log(self.max_logit_scale)
        return 1.0 / _UpperClamp.apply(self.log_logit_scale, log_bound).exp()


def _written_value(buffer: Tensor, kept: float) -> float | None:
    """The value of a float32 buffer that mirrors a Python float (``kept``, as the buffer
    stores it), when another value was written into it since; ``None`` when it holds
    ``kept`` once both are rounded to the buffer's dtype or to float32, the dtype it was
    made in (``.double()`` upcasts the rounded value: 0.05 reads back as 0.0500000007),
    or on the meta device. One host read."""
    if buffer.device.type == "meta":
        return None
    coarse = buffer.dtype
    if torch.finfo(coarse).eps < torch.finfo(torch.float32).eps:
        coarse = torch.float32
    value = float(buffer.detach())
    if torch.tensor(value, dtype=coarse) != torch.tensor(kept, dtype=coarse):
        return value
    return None


def _habit_told(temperature: float | Tensor) -> bool:
    """Whether a Module's fixed float ``temperature`` warned when the Module was built
    (:func:`_warn_logit_scale_habit`), so its calls must not warn again; never read
    while ``torch.compile`` traces (no guard on the value)."""
    if _compat.is_compiling() or isinstance(temperature, Tensor):
        return False
    return temperature * MIN_PLAUSIBLE_SCALE > 1


def _stamp(buffer: Tensor) -> tuple[int, int]:
    """A tensor's identity and version counter (bumped by every in-place write: ``fill_``,
    ``copy_`` in ``load_state_dict``); inference tensors have no counter (-1)."""
    return id(buffer), -1 if buffer.is_inference() else buffer._version


def _refuse_trainable(value: object, name: str, instead: str) -> None:
    """A tensor that requires grad, passed where the Module keeps a copy of its value, would
    be frozen silently: refuse it and say how to learn it (``instead``) or pass the model's
    scale per call."""
    if isinstance(value, Tensor) and value.requires_grad:
        raise TypeError(
            f"{name}: got a tensor that requires grad; the Module keeps a copy of its value, "
            f"so it would never be trained. To learn it in the loss pass a float and "
            f"{instead}; to keep it in your model pass it per call: "
            "loss_fn(audio, text, logit_scale=1 / temperature) (or model.logit_scale.exp())"
        )


def _scalar_repr(x: Tensor | float) -> str:
    """A 0-d tensor's value for a repr (4 significant digits), without reading a tensor
    that holds no value (meta device)."""
    if isinstance(x, Tensor):
        if x.device.type == "meta":
            return "<meta>"
        x = float(x.detach())
    return f"{x:.4g}"


def _with_terms(
    out: Tensor | tuple[Tensor, dict[str, Tensor]], return_terms: bool, **extra: Tensor
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """Add Module-level values (the current temperature) to the functional's terms."""
    if not return_terms:
        return out
    loss, terms = out
    terms.update({k: v.detach() for k, v in extra.items()})
    return loss, terms
